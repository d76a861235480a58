"""``tj.hf.load``/``save`` of transformers' ReformerModelWithLMHead: logits within 1e-4 in eval
mode (LSH rotations drawn as transformers draws them from ``hash_seed``), a round trip, and
the refusals."""

import jax.numpy as jnp
import numpy as np
import pytest
import torch
from transformers import ReformerConfig, ReformerModelWithLMHead

import transformer_jax as tj
from transformer_jax.hf.errors import UnsupportedError
from tests.hf.tiny_configs import TINY_REFORMER


def hf_model(**kw):
  base = dict(
    TINY_REFORMER,
    attn_layers=["local", "lsh", "local", "lsh"],
    hidden_dropout_prob=0.0,
    lsh_attention_probs_dropout_prob=0.0,
    local_attention_probs_dropout_prob=0.0,
  )
  torch.manual_seed(0)
  model = ReformerModelWithLMHead(ReformerConfig(**{**base, **kw})).eval()
  with torch.no_grad():  # transformers initialises the LM head's bias and norms trivially
    for p in model.parameters():
      p.add_(0.1 * torch.randn_like(p))
  return model


def logits_of(model, ids, mask=None):
  with torch.no_grad():
    return model(
      torch.from_numpy(ids),
      attention_mask=None if mask is None else torch.from_numpy(mask.astype(np.int64)),
    ).logits.numpy()


@pytest.mark.parametrize(
  "kw",
  [
    {},
    dict(
      num_buckets=[2, 4], axial_pos_embds=False, chunk_size_feed_forward=8, attn_layers=["lsh"] * 2
    ),
  ],
  ids=["local+lsh", "lsh-factored-buckets"],
)
def test_logits_match_transformers(kw):
  theirs = hf_model(**kw)
  config, ours = tj.hf.load(theirs)
  ids = np.random.default_rng(0).integers(0, 61, (2, 64))
  mask = np.arange(64)[None] < np.array([[64], [50]])
  for m in (None, mask):
    want = logits_of(theirs, ids, m)
    got = np.asarray(ours(jnp.asarray(ids), None if m is None else jnp.asarray(m)))
    rows = np.ones_like(mask) if m is None else mask
    np.testing.assert_allclose(got[rows], want[rows], atol=1e-4, rtol=1e-4)
  # A length that is not a whole number of chunks: both pad it (transformers in eval mode).
  ids = ids[:, :37]
  np.testing.assert_allclose(
    np.asarray(ours(jnp.asarray(ids))), logits_of(theirs, ids), atol=1e-4, rtol=1e-4
  )


def test_save_then_transformers_loads_the_same_model(tmp_path):
  theirs = hf_model()
  config, ours = tj.hf.load(theirs)
  assert tj.hf.save(ours, config, tmp_path / "r") == "ReformerModelWithLMHead"
  back = ReformerModelWithLMHead.from_pretrained(tmp_path / "r").eval()
  ids = np.random.default_rng(1).integers(0, 61, (1, 64))
  np.testing.assert_allclose(logits_of(back, ids), logits_of(theirs, ids), atol=1e-5)
  config2, ours2 = tj.hf.load(tmp_path / "r")
  assert config2 == config


def test_unsupported_configs_are_named():
  with pytest.raises(UnsupportedError, match="num_buckets=None"):
    tj.hf.load(hf_model(num_buckets=None))
