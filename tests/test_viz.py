"""The pictures draw exactly the data they are given (read back from the figures, not pixels)."""

import math

import numpy as np
import pytest
from matplotlib.figure import Figure

import transformer_jax as tj
from transformer_jax import ops, viz


def _image(ax) -> np.ma.MaskedArray:
  return np.ma.asarray(ax.images[0].get_array())


def test_attention_maps_draws_the_ops_weights_with_the_mask_visible():
  rng = np.random.default_rng(0)
  q = rng.normal(size=(1, 5, 4, 8)).astype(np.float32)
  k = v = rng.normal(size=(1, 5, 2, 8)).astype(np.float32)
  _, weights_BNTS = ops.dot_product_attention(q, k, v, causal=True, return_weights=True)
  weights = np.asarray(weights_BNTS[0])
  # Independent reference: a float64 softmax of the masked scores.
  s = np.einsum("tkgh,skh->kgts", q[0].reshape(5, 2, 2, 8), k[0]).reshape(4, 5, 5) / math.sqrt(8)
  s = np.where(np.tril(np.ones((5, 5), bool)), s, -np.inf)
  ref = np.exp(s - s.max(-1, keepdims=True))
  np.testing.assert_allclose(weights, ref / ref.sum(-1, keepdims=True), rtol=1e-5, atol=1e-6)

  tokens = ["def", " add", "(a", ",", " b"]
  mask = np.tril(np.ones((5, 5), bool))
  fig = viz.attention_maps(weights, query_tokens=tokens, mask=mask, heads=[0, 3])
  axes = [ax for ax in fig.axes if ax.images]
  assert len(axes) == 2
  for ax, head in zip(axes, [0, 3]):
    drawn = _image(ax)
    np.testing.assert_array_equal(drawn.mask, ~mask)  # future keys greyed out
    np.testing.assert_allclose(drawn.filled(0.0), weights[head] * mask)
    assert [t.get_text() for t in ax.get_xticklabels()] == tokens
    assert ax.get_title() == f"layer 0, head {head}"


def test_attention_maps_rejects_bad_shapes_and_labels():
  with pytest.raises(ValueError, match=r"\[L, N, T, S\]"):
    viz.attention_maps(np.zeros((4, 4)))
  with pytest.raises(ValueError, match="query_tokens has 2 labels for 3 positions"):
    viz.attention_maps(np.zeros((1, 3, 3)), query_tokens=["a", "b"])
  with pytest.raises(ValueError, match="head 5 is out of range"):
    viz.attention_maps(np.zeros((2, 3, 3)), heads=[5])


def test_positional_encoding_draws_the_sinusoidal_table():
  table = np.asarray(ops.sinusoidal_positions(32, 16))
  p, i = np.arange(32)[:, None], np.arange(8)[None, :]
  np.testing.assert_allclose(table[:, 0::2], np.sin(p / 10000 ** (2 * i / 16)), atol=1e-6)
  drawn = _image(viz.positional_encoding(table).axes[0])
  np.testing.assert_array_equal(drawn, table)


def test_rope_angles_are_position_times_frequency_mod_two_pi():
  fig = viz.rope_angles(8, 20, theta=100.0)
  drawn = np.asarray(_image(fig.axes[0]))
  inv_freq = 100.0 ** (-np.arange(0, 8, 2) / 8)
  np.testing.assert_allclose(drawn, np.mod(np.arange(20)[:, None] * inv_freq, 2 * np.pi), atol=1e-6)


def test_alibi_biases_per_head_with_the_causal_mask():
  fig = viz.alibi_biases(6, 7)
  axes = [ax for ax in fig.axes if ax.images]
  assert len(axes) == 6
  slopes = ops.alibi_slopes(6)
  dist = np.abs(np.arange(7)[:, None] - np.arange(7)[None, :])
  for n, ax in enumerate(axes):
    drawn = _image(ax)
    np.testing.assert_array_equal(drawn.mask, np.triu(np.ones((7, 7), bool), 1))
    np.testing.assert_allclose(drawn.filled(0.0), np.tril(-slopes[n] * dist), rtol=1e-6)


def test_loss_curves_plot_every_run_train_and_val():
  runs = {
    "a": [{"step": 1, "loss": 5.0}, {"step": 2, "loss": 4.0}, {"step": 2, "val_loss": 4.5}],
    "b": [{"step": 1, "loss": 6.0}, {"step": 3, "loss": 3.0}],
  }
  fig = viz.loss_curves(runs, perplexity=True)
  lines = {line.get_label(): line for line in fig.axes[0].lines}
  assert set(lines) == {"a train", "a val", "b train"}
  np.testing.assert_allclose(lines["a train"].get_ydata(), np.exp([5.0, 4.0]))
  np.testing.assert_array_equal(lines["b train"].get_xdata(), [1, 3])
  assert fig.axes[0].get_yscale() == "log"


def test_lr_schedule_draws_the_schedule():
  fig = viz.lr_schedule(lambda s: 0.1 * min(1.0, s / 4), 10)
  line = fig.axes[0].lines[0]
  np.testing.assert_allclose(line.get_ydata(), [0.1 * min(1.0, s / 4) for s in range(11)])


def test_parameter_breakdown_sums_to_the_models_count():
  config = tj.models.get_config("gpt2-tiny")
  params = tj.models.init_abstract(config)
  counts = viz.parameter_counts(params, depth=1)
  assert sum(counts.values()) == tj.models.count_params(config)
  fig = viz.parameter_breakdown(params, depth=1)
  assert isinstance(fig, Figure)
  widths = sorted(bar.get_width() for bar in fig.axes[0].patches)
  assert widths == sorted(counts.values())
