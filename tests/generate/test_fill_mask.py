"""``fill_mask``: top-k ids and probabilities at every [MASK] equal a full forward pass followed by
a float64 NumPy softmax; padding, several masks per row, and clear errors."""

import functools

import jax
import numpy as np
import pytest
from flax import nnx

from transformer_jax import generate, models
from tests.generate.conftest import VOCAB

MASK = 3


@functools.lru_cache(maxsize=None)
def bert():
  """BERT-Tiny with N(0, 0.3^2) weights drawn by NumPy (no compiled initialisation to wait for)."""
  config = models.get_config("bert-tiny", vocab_size=VOCAB, max_len=32)
  rng = np.random.default_rng(0)
  params = jax.tree.map(
    lambda s: jax.numpy.asarray(rng.normal(0.0, 0.3, s.shape), s.dtype),
    models.init_abstract(config),
  )
  return nnx.merge(models.graphdef(config), params)


def reference(model, tokens, valid, top_k):
  """Per mask position: (row, col, ids, probs) from the full model's MLM logits, float64 softmax."""
  graphdef, params = nnx.split(model)
  full = jax.jit(
    lambda params, tokens, valid: nnx.merge(graphdef, params)(tokens, None, valid).mlm_logits
  )
  logits = np.asarray(full(params, tokens, valid), np.float64)
  out = []
  for row, col in zip(*np.nonzero((tokens == MASK) & valid)):
    x = logits[row, col] - logits[row, col].max()
    p = np.exp(x) / np.exp(x).sum()
    ids = np.argsort(-p, kind="stable")[:top_k]
    out.append((row, col, ids, p[ids]))
  return out


def test_top_k_matches_full_forward_float64_softmax():
  model = bert()
  rng = np.random.RandomState(0)
  tokens = rng.randint(5, VOCAB, size=(3, 12)).astype(np.int32)
  valid = np.ones((3, 12), bool)
  valid[1, 9:] = False  # padding; a mask under it is ignored
  tokens[0, [2, 7]] = MASK  # two masks in one row
  tokens[1, 4] = MASK
  tokens[1, 10] = MASK
  tokens[2, 0] = MASK
  got = generate.fill_mask(model, tokens, top_k=4, mask_id=MASK, attention_mask=valid)
  want = reference(model, tokens, valid, 4)
  assert (
    got.positions.tolist() == [[r, c] for r, c, _, _ in want] == [[0, 2], [0, 7], [1, 4], [2, 0]]
  )
  assert got.token_ids.shape == got.probs.shape == (4, 4) and got.token_ids.dtype == np.int32
  for m, (_, _, ids, probs) in enumerate(want):
    np.testing.assert_array_equal(got.token_ids[m], ids)
    np.testing.assert_allclose(got.probs[m], probs, rtol=1e-5, atol=1e-7)
  assert (np.diff(got.probs, axis=1) <= 0).all()


def test_one_row_and_config_params_pair():
  model = bert()
  _, params = nnx.split(model)
  tokens = np.array([1, 9, MASK, 17, 2], np.int32)
  a = generate.fill_mask(model, tokens, mask_id=MASK)
  b = generate.fill_mask((model.config, params), tokens[None], mask_id=MASK)
  assert a.positions.tolist() == [[0, 2]] and a.token_ids.shape == (1, 5)
  np.testing.assert_array_equal(a.token_ids, b.token_ids)
  np.testing.assert_allclose(a.probs, b.probs)
  ((_, _, ids, probs),) = reference(model, tokens[None], np.ones((1, 5), bool), 5)
  np.testing.assert_array_equal(a.token_ids[0], ids)
  np.testing.assert_allclose(a.probs[0], probs, rtol=1e-5, atol=1e-7)


@pytest.mark.parametrize(
  "kwargs, match",
  [
    (dict(tokens=[[1, 2, 4]]), "no mask token"),
    (dict(tokens=[[1, MASK, 2]], attention_mask=[[1, 0, 1]]), "no mask token"),
    (dict(top_k=0), "top_k=0"),
    (dict(top_k=VOCAB + 1), f"top_k={VOCAB + 1}"),
    (dict(mask_id=VOCAB), f"mask_id={VOCAB}"),
    (dict(tokens=[[1, MASK, VOCAB]]), "outside the vocabulary"),
    (dict(tokens=np.full((1, 33), MASK)), "max_len=32"),
  ],
)
def test_bad_input_raises_value_error(kwargs, match):
  kwargs = {"tokens": [[1, MASK, 2]], "mask_id": MASK, **kwargs}
  with pytest.raises(ValueError, match=match):
    generate.fill_mask(bert(), **kwargs)


def test_gpt_model_is_rejected():
  config = models.get_config("gpt2-tiny", vocab_size=VOCAB)
  with pytest.raises(TypeError, match="GPTConfig"):
    generate.fill_mask((config, None), [[1, MASK]], mask_id=MASK)
