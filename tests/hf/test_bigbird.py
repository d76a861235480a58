"""``tj.hf.load``/``save`` of transformers' BigBird (``BigBirdModel``, ``BigBirdForMaskedLM``):
logits within 1e-4 in eval mode at lengths where transformers runs ``block_sparse`` attention
(and below them, where it attends densely), padding included; a save that transformers loads."""

import jax.numpy as jnp
import numpy as np
import pytest
import torch
from transformers import BigBirdConfig, BigBirdForMaskedLM, BigBirdModel

import transformer_jax as tj
import transformer_jax.hf


def hf_model(cls=BigBirdForMaskedLM, **kw):
  base = dict(
    vocab_size=50,
    hidden_size=16,
    num_attention_heads=2,
    intermediate_size=32,
    num_hidden_layers=2,
    max_position_embeddings=1024,
    block_size=64,
    num_random_blocks=3,
    sep_token_id=3,
    pad_token_id=0,
    bos_token_id=1,
    eos_token_id=2,
    hidden_dropout_prob=0.0,
    attention_probs_dropout_prob=0.0,
  )
  torch.manual_seed(0)
  model = cls(BigBirdConfig(**{**base, **kw})).eval()
  with torch.no_grad():
    for p in model.parameters():
      p.add_(0.05 * torch.randn_like(p))
  return model


def run_hf(model, ids, mask):
  with torch.no_grad():
    out = model(torch.from_numpy(ids), attention_mask=torch.from_numpy(mask.astype(np.int64)))
  return out.logits.numpy() if hasattr(out, "logits") else out.last_hidden_state.numpy()


@pytest.fixture(scope="module")
def mlm():
  theirs = hf_model()
  config, ours = tj.hf.load(theirs)
  return theirs, config, ours


@pytest.mark.parametrize("t", [1024, 1000, 200])
def test_masked_lm_logits_match_transformers(mlm, t):
  # 1024 = 16 blocks of 64 (block_sparse); 1000 is padded to 1024 by both; 200 <= (5 + 2 * 3)
  # * 64 = 704 tokens: transformers attends densely.
  theirs, config, ours = mlm
  assert config.attention_kind == "sparse" and config.sparse_pattern.block == 64
  ids = np.random.default_rng(t).integers(4, 50, (2, t))
  mask = np.arange(t)[None] < np.array([[t], [t - 150]])
  want = run_hf(theirs, ids, mask)
  got = np.asarray(ours.mlm_logits(ours.encode(jnp.asarray(ids), None, jnp.asarray(mask))[0]))
  np.testing.assert_allclose(got[mask], want[mask], atol=1e-4, rtol=1e-4)


def test_base_model_and_save_round_trip(tmp_path):
  theirs = hf_model(BigBirdModel, num_random_blocks=2, block_size=32, max_position_embeddings=512)
  config, ours = tj.hf.load(theirs)
  ids = np.random.default_rng(0).integers(4, 50, (1, 512))
  mask = np.ones((1, 512), bool)
  hidden = np.asarray(ours.encode(jnp.asarray(ids))[0])
  np.testing.assert_allclose(hidden, run_hf(theirs, ids, mask), atol=1e-4, rtol=1e-4)
  assert tj.hf.save(ours, config, tmp_path / "bb", architecture="BigBirdModel") == "BigBirdModel"
  back = BigBirdModel.from_pretrained(tmp_path / "bb").eval()
  np.testing.assert_allclose(run_hf(back, ids, mask), run_hf(theirs, ids, mask), atol=1e-5)


def test_linformer_bert_is_refused_by_bert_architectures(tmp_path):
  config = tj.models.BERTConfig(
    vocab_size=50,
    d_model=16,
    num_heads=2,
    d_ff=32,
    num_layers=1,
    attention_kind="linformer",
    attention_dropout_rate=0.0,
  )
  model = tj.models.create(config)
  with pytest.raises(tj.hf.UnsupportedError, match="attention_kind='linformer'"):
    tj.hf.save(model, config, tmp_path / "x")
