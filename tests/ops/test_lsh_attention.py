"""Reformer's LSH and local attention (``ops.lsh``) against the ``transformers`` PyTorch modules
(``LSHSelfAttention``, ``LocalSelfAttention``) fed the same projections and rotations."""

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from transformer_jax.ops import lsh

torch = pytest.importorskip("torch")
reformer = pytest.importorskip("transformers.models.reformer.modeling_reformer")
from transformers import ReformerConfig  # noqa: E402

B, T, D, N, H = 2, 32, 24, 2, 8

# The kernels as compiled programs (one per shape and options), not each operation on its own.
LSH = jax.jit(
  lsh.lsh_attention,
  static_argnames=("n_buckets", "n_hashes", "chunk_length", "chunks_before", "chunks_after",
                   "causal", "seed"),
)  # fmt: skip
LOCAL = jax.jit(
  lsh.local_attention, static_argnames=("chunk_length", "chunks_before", "chunks_after", "causal")
)


def hf_config(**kw):
  base = dict(
    hidden_size=D,
    num_attention_heads=N,
    attention_head_size=H,
    num_hashes=2,
    num_buckets=4,
    lsh_attn_chunk_length=8,
    local_attn_chunk_length=8,
    hash_seed=7,
    attn_layers=["lsh"],
    lsh_attention_probs_dropout_prob=0.0,
    local_attention_probs_dropout_prob=0.0,
  )
  return ReformerConfig(**{**base, **kw})


def hf_rotations(config):
  torch.manual_seed(config.hash_seed)
  r = lsh.rotation_size(
    config.num_buckets if isinstance(config.num_buckets, int) else tuple(config.num_buckets)
  )
  return torch.randn((N, H, config.num_hashes, r // 2)).numpy()


def heads(x, w):
  """``x [B, T, D] @ w.T`` as ``[B, T, N, H]`` (torch's Linear weight ``[N*H, D]``)."""
  return jnp.asarray((x @ w.T).reshape(x.shape[0], x.shape[1], N, H))


def mask(b, t, lengths):
  return np.arange(t)[None] < np.asarray(lengths)[:, None]


@pytest.mark.slow
@pytest.mark.parametrize("causal", [False, True], ids=["encoder", "decoder"])
@pytest.mark.parametrize("buckets", [4, (2, 4)], ids=["4", "2x4"])
@pytest.mark.parametrize("padded", [False, True])
def test_lsh_matches_transformers(causal, buckets, padded):
  config = hf_config(
    is_decoder=causal, num_buckets=list(buckets) if isinstance(buckets, tuple) else buckets
  )
  torch.manual_seed(0)
  layer = reformer.LSHSelfAttention(config, layer_idx=0).eval()
  x = np.random.default_rng(1).standard_normal((B, T, D)).astype(np.float32)
  valid = mask(B, T, [T, 21]) if padded else None
  with torch.no_grad():
    want = layer(
      torch.from_numpy(x),
      attention_mask=None if valid is None else torch.from_numpy(valid.astype(np.int64)),
    ).hidden_states.numpy()
  qk, v = (
    heads(x, layer.query_key.weight.detach().numpy()),
    heads(x, layer.value.weight.detach().numpy()),
  )
  got = LSH(
    qk,
    v,
    n_buckets=buckets,
    n_hashes=2,
    chunk_length=8,
    causal=causal,
    kv_valid=None if valid is None else jnp.asarray(valid),
    rotations=jnp.asarray(hf_rotations(config)),
  )
  got = np.asarray(got).reshape(B, T, N * H)
  rows = slice(None) if valid is None else valid  # padded queries: any value
  np.testing.assert_allclose(got[rows], want[rows], atol=1e-5, rtol=1e-4)


@pytest.mark.parametrize("causal", [False, True], ids=["encoder", "decoder"])
@pytest.mark.parametrize("t", [8, 32])
def test_local_matches_transformers(causal, t):
  config = hf_config(is_decoder=causal, attn_layers=["local"])
  torch.manual_seed(2)
  layer = reformer.LocalSelfAttention(config, layer_idx=0).eval()
  x = np.random.default_rng(3).standard_normal((B, t, D)).astype(np.float32)
  valid = mask(B, t, [t, t - 3])
  with torch.no_grad():
    want = layer(
      torch.from_numpy(x), attention_mask=torch.from_numpy(valid.astype(np.int64))
    ).hidden_states.numpy()
  q, k, v = (
    heads(x, getattr(layer, name).weight.detach().numpy()) for name in ("query", "key", "value")
  )
  got = LOCAL(q, k, v, chunk_length=8, causal=causal, kv_valid=jnp.asarray(valid))
  got = np.asarray(got).reshape(B, t, N * H)
  np.testing.assert_allclose(got[valid], want[valid], atol=1e-5, rtol=1e-4)


@pytest.mark.slow
def test_lsh_short_sequence_and_causality_by_gradients():
  r = np.random.default_rng(4)
  qk, v = (jnp.asarray(r.standard_normal((1, T, N, H)), jnp.float32) for _ in range(2))
  # Position 20's output does not depend on later values, and not on its own value while it
  # sees any other key.
  grad = jax.jit(
    jax.grad(
      lambda v: lsh.lsh_attention(qk, v, n_buckets=4, n_hashes=3, chunk_length=8, causal=True)[
        0, 20
      ].sum()
    )
  )(v)
  assert np.all(np.asarray(grad[0, 21:]) == 0.0)
  assert np.abs(np.asarray(grad[0, 20])).max() < 1e-30 + np.abs(np.asarray(grad[0, :20])).max()
  # One chunk (T <= chunk_length): plain attention, self masked unless alone.
  out = lsh.lsh_attention(qk[:, :4], v[:, :4], n_buckets=4, chunk_length=8, causal=True)
  np.testing.assert_allclose(np.asarray(out[0, 0]), np.asarray(v[0, 0]), rtol=1e-6)


def test_bad_options_are_named():
  x = jnp.zeros((1, 12, N, H))
  with pytest.raises(ValueError, match="n_buckets=3 must be even"):
    lsh.lsh_attention(x, x, n_buckets=3, chunk_length=4)
  with pytest.raises(ValueError, match="multiple of chunk_length=5"):
    lsh.lsh_attention(x, x, n_buckets=4, chunk_length=5)
  with pytest.raises(ValueError, match="rotations must be"):
    lsh.lsh_attention(x, x, n_buckets=4, chunk_length=4, rotations=jnp.zeros((N, H, 1, 3)))


def test_sort_order_matches_an_int64_reference_past_int32():
  # 12 rounds of (64, 128) buckets over T = 24,576: n_hashes * (buckets + 1) * T passes 2**31,
  # where a packed int32 (round, bucket, position) key overflowed. The reference packs the same
  # key in int64; the order is a permutation of integers, so it must match exactly.
  n_hashes, t, nb = 12, 24_576, 64 * 128
  assert n_hashes * (nb + 1) * t > 2**31
  buckets = np.random.default_rng(5).integers(0, nb + 1, (1, 2, n_hashes, t))
  got = lsh.sort_order(jnp.asarray(buckets, jnp.int32), nb)
  rounds = np.arange(n_hashes, dtype=np.int64)[:, None]
  key = ((rounds * (nb + 1) + buckets.astype(np.int64)) * t + np.arange(t)).reshape(1, 2, -1)
  np.testing.assert_array_equal(np.asarray(got), np.argsort(key, axis=-1, kind="stable"))


def test_lsh_matches_transformers_where_int32_keys_overflowed():
  # 2**22 buckets (22 factors of 2) over T = 1024: (buckets + 1) * T passes 2**31, so half the
  # positions' packed int32 sort keys overflowed. transformers sorts int64 keys.
  t, factors = 1024, [2] * 22
  assert (2**22 + 1) * t > 2**31
  config = hf_config(num_hashes=1, num_buckets=factors, lsh_attn_chunk_length=64, is_decoder=True)
  torch.manual_seed(6)
  layer = reformer.LSHSelfAttention(config, layer_idx=0).eval()
  x = np.random.default_rng(7).standard_normal((1, t, D)).astype(np.float32)
  with torch.no_grad():
    want = layer(torch.from_numpy(x)).hidden_states.numpy()
  qk, v = (heads(x, getattr(layer, k).weight.detach().numpy()) for k in ("query_key", "value"))
  got = LSH(
    qk,
    v,
    n_buckets=tuple(factors),
    n_hashes=1,
    chunk_length=64,
    causal=True,
    rotations=jnp.asarray(hf_rotations(config)),
  )
  # The tolerance of test_lsh_matches_transformers: float32 attention over the same chunks.
  np.testing.assert_allclose(np.asarray(got).reshape(1, t, N * H), want, atol=1e-5, rtol=1e-4)


def test_sizes_past_int32_are_named():
  with pytest.raises(ValueError, match=r"n_hashes \* T = 2 \* 1073741824"):
    lsh.check_sizes(2**30, 2, 4)
  with pytest.raises(ValueError, match=r"n_hashes \* \(buckets \+ 1\)"):
    lsh.check_sizes(64, 2, (2,) * 31)
  lsh.check_sizes(2**30, 1, (2,) * 30)  # 2**30 entries, 2**30 + 1 keys: fits
  # The Reformer's config refuses them at construction, for its max_len.
  from transformer_jax.models import ReformerConfig as Config

  with pytest.raises(ValueError, match=r"n_hashes \* T = 4 \* 1073741824"):
    Config(max_len=2**30, n_hashes=4, axial_pos_shape=(2**15, 2**15))
