"""Task objectives: the BERT masked-position gather equals the full MLM computation."""

import jax
import jax.numpy as jnp
import numpy as np
from flax import nnx

from transformer_jax import models
from transformer_jax.train import tasks


def test_bert_gathered_mlm_equals_full_mlm():
  config = models.get_config("bert-tiny", vocab_size=101, d_model=32, num_heads=2, d_ff=64)
  model = nnx.merge(models.graphdef(config), models.init(config, jax.random.key(0)))
  rng = np.random.default_rng(0)
  b, t = 3, 20
  mask = np.zeros((b, t), bool)
  for i, n in enumerate((1, 3, 4)):
    mask[i, rng.choice(np.arange(1, t), n, replace=False)] = True
  batch = {
    "tokens": jnp.asarray(rng.integers(0, 101, (b, t))),
    "token_types": jnp.zeros((b, t), jnp.int32),
    "attention_mask": jnp.ones((b, t), bool),
    "mlm_labels": jnp.asarray(np.where(mask, rng.integers(0, 101, (b, t)), 0)),
    "mlm_mask": jnp.asarray(mask),
    "nsp_labels": jnp.asarray([0, 1, 0]),
  }
  full_loss, full_metrics = tasks.get_task("bert").sums(model, batch, None)
  gathered_loss, gathered_metrics = tasks.get_task("bert", max_predictions=4).sums(
    model, batch, None
  )
  for key in full_loss:
    np.testing.assert_allclose(gathered_loss[key], full_loss[key], rtol=1e-5)
  for key in full_metrics:
    np.testing.assert_allclose(gathered_metrics[key], full_metrics[key])
  # Independent check of the MLM sum: cross-entropy of the full logits at the masked positions.
  logits = np.asarray(
    model(batch["tokens"], batch["token_types"], batch["attention_mask"]).mlm_logits, np.float64
  )
  logp = (
    logits
    - np.log(np.exp(logits - logits.max(-1, keepdims=True)).sum(-1, keepdims=True))
    - logits.max(-1, keepdims=True)
  )
  labels = np.asarray(batch["mlm_labels"])
  expected = -sum(logp[i, j, labels[i, j]] for i, j in zip(*np.nonzero(mask)))
  np.testing.assert_allclose(float(full_loss["mlm"]), expected, rtol=1e-5)


def test_correct_counts_rows_whose_label_holds_the_top_logit():
  rng = np.random.default_rng(1)
  logits = rng.standard_normal((3, 7, 11)).astype(np.float32)
  labels = rng.integers(0, 11, (3, 7))
  labels[0, :4] = logits[0, :4].argmax(-1)  # some rows right for sure
  mask = rng.random((3, 7)) < 0.7
  expected = np.sum((logits.astype(np.float64).argmax(-1) == labels) & mask)
  got = tasks._correct(jnp.asarray(logits), jnp.asarray(labels), jnp.asarray(mask))
  assert float(got) == expected and expected > 0
  # A tie for the top counts for every tied label; a row holding a NaN counts as wrong.
  tied = jnp.asarray([[1.0, 3.0, 3.0], [1.0, 3.0, 3.0], [np.nan, 3.0, 1.0]])
  hits = [
    float(tasks._correct(tied[i : i + 1], jnp.asarray([y]), jnp.ones(1, bool)))
    for i, y in enumerate((1, 2, 1))
  ]
  assert hits == [1.0, 1.0, 0.0]


def test_gpt_task_lm_correct_matches_numpy_argmax():
  config = models.get_config("gpt2-tiny")
  model = nnx.merge(models.graphdef(config), models.init(config, jax.random.key(0)))
  rng = np.random.default_rng(0)
  b, t = 2, 16
  tokens = rng.integers(0, config.vocab_size, (b, t))
  logits = np.asarray(
    model(jnp.asarray(tokens), jnp.tile(jnp.arange(t), (b, 1)), jnp.ones((b, t), jnp.int32)),
    np.float64,
  )
  labels = logits.argmax(-1)
  labels[:, ::2] = rng.integers(0, config.vocab_size, (b, t // 2))  # half of them likely wrong
  loss_mask = np.ones((b, t), bool)
  loss_mask[1, -3:] = False
  batch = {
    "tokens": jnp.asarray(tokens),
    "labels": jnp.asarray(labels),
    "positions": jnp.tile(jnp.arange(t), (b, 1)),
    "segment_ids": jnp.ones((b, t), jnp.int32),
    "loss_mask": jnp.asarray(loss_mask),
  }
  _, metrics = tasks.get_task("gpt").sums(model, batch, None)
  assert float(metrics["lm_correct"]) == np.sum((logits.argmax(-1) == labels) & loss_mask)


def test_gpt_fused_loss_head_equals_the_logits_head():
  # Same loss sum, correct count and gradients as the [B, T, V] logits and cross-entropy, with a
  # tied (GPT-2) and an untied (LLaMA-style) head, label smoothing and z-loss on.
  rng = np.random.default_rng(2)
  b, t = 2, 12
  for tie in (True, False):
    config = models.get_config("gpt2-tiny", tie_embeddings=tie)
    params = models.init(config, jax.random.key(1))
    graphdef = models.graphdef(config)
    tokens = rng.integers(0, config.vocab_size, (b, t))
    loss_mask = rng.random((b, t)) < 0.8
    batch = {
      "tokens": jnp.asarray(tokens),
      "labels": jnp.asarray(rng.integers(0, config.vocab_size, (b, t))),
      "positions": jnp.tile(jnp.arange(t), (b, 1)),
      "segment_ids": jnp.asarray(np.repeat([[1] * 7 + [2] * 5], b, 0)),
      "loss_mask": jnp.asarray(loss_mask),
    }

    def loss(params, head):
      task = tasks.get_task("gpt", loss_head=head)
      sums, metrics = task.sums(
        nnx.merge(graphdef, params), batch, None, label_smoothing=0.1, z_loss=1e-3
      )
      return sums["lm"], metrics["lm_correct"]

    grads = jax.jit(jax.value_and_grad(loss, has_aux=True), static_argnums=1)
    (dense, dense_correct), dense_grads = grads(params, "logits")
    (fused, fused_correct), fused_grads = grads(params, "fused")
    np.testing.assert_allclose(float(fused), float(dense), rtol=1e-5)
    assert float(fused_correct) == float(dense_correct)
    # One scale for every gradient: some are rounding noise around 0 (a key bias's, softmax
    # being blind to a constant added to a row's logits).
    scale = max(float(jnp.max(jnp.abs(g))) for g in jax.tree.leaves(dense_grads))
    for (path, g), f in zip(jax.tree.leaves_with_path(dense_grads), jax.tree.leaves(fused_grads)):
      np.testing.assert_allclose(
        np.asarray(f), np.asarray(g), atol=2e-6 * scale, err_msg=jax.tree_util.keystr(path)
      )
