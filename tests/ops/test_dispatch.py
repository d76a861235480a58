"""The kernel table (``ops.choose_implementation``), checked on any backend: it reads shapes and
dtypes only, so what a GPU or TPU would run is decided here without one."""

import functools

import jax
import jax.numpy as jnp
import pytest

from transformer_jax import ops
from transformer_jax.ops import dispatch, linear


def qkv(b=4, t=1024, s=None, n=12, k=None, h=64, dtype=jnp.bfloat16):
  s = t if s is None else s
  q = jax.ShapeDtypeStruct((b, t, n, h), dtype)
  kv = jax.ShapeDtypeStruct((b, s, n if k is None else k, h), dtype)
  return q, kv, kv


@pytest.mark.parametrize("heads", [(12, 12), (12, 4), (12, 1)])   # MHA, GQA, MQA
@pytest.mark.parametrize("causal", [True, False])
@pytest.mark.parametrize("dtype", [jnp.bfloat16, jnp.float16])
def test_gpu_half_precision_attention_is_cudnn(heads, causal, dtype):
  n, k = heads
  q, kk, v = qkv(n=n, k=k, dtype=dtype)
  choose = functools.partial(ops.choose_implementation, q, kk, v, platform="gpu", causal=causal)
  assert choose() == "cudnn"
  assert choose(segment_ids=True) == "cudnn"       # packed documents, as a mask
  assert choose(kv_valid=True) == "cudnn"          # padding
  if causal:
    assert choose(window=256) == "cudnn"           # cuDNN's look-back window
  else:
    assert choose(window=256) != "cudnn"           # a two-sided window it does not have


def test_gpu_falls_back_past_what_cudnn_takes():
  q, kk, v = qkv()
  choose = functools.partial(ops.choose_implementation, platform="gpu", causal=True)
  f32 = qkv(dtype=jnp.float32)
  assert choose(*f32) == "xla"                     # 805 MB of scores: dense
  assert choose(*qkv(b=16, t=4096, dtype=jnp.float32)) == "chunked"   # 12.9 GB: blocks
  assert choose(q, kk, v, dropout=True) == "xla"
  assert choose(q, kk, v, bias=True) == "xla"      # ALiBi, T5's buckets
  assert choose(*qkv(h=256)) == "xla"              # head dim past cuDNN's
  assert choose(*qkv(t=1, s=1024)) == "xla"        # decoding: T != S
  assert choose(q, kk, v, q_positions=True) == "xla"
  assert choose(q, kk, v, return_weights=True) == "xla"


@pytest.mark.parametrize("heads", [(12, 12), (12, 4), (12, 1)])
@pytest.mark.parametrize("window", [None, 256])
def test_tpu_attention_is_splash(heads, window):
  n, k = heads
  choose = functools.partial(ops.choose_implementation, *qkv(n=n, k=k), platform="tpu",
                             window=window)
  assert choose(causal=True) == "splash"
  assert choose(causal=True, segment_ids=True) == "splash"
  assert choose(causal=False) == "splash"
  assert choose(causal=True, bias=True) != "splash"
  assert choose(causal=True, dropout=True) != "splash"


def test_tpu_short_sequences_and_decoding_are_dense():
  choose = functools.partial(ops.choose_implementation, platform="tpu", causal=True)
  assert choose(*qkv(t=256)) == "xla"              # below SPLASH_MIN_TS
  assert choose(*qkv(t=1000)) == "xla"             # not a multiple of splash's blocks
  assert choose(*qkv(t=1, s=2048)) == "xla"        # one decoded token against the cache
  q, kk, v = qkv(t=2048)
  assert choose(q, kk, v, q_positions=True) == "xla"


def test_cpu_row_is_the_size_rule(monkeypatch):
  monkeypatch.setattr(linear, "matmul_pays", lambda dtype: False)
  choose = functools.partial(ops.choose_implementation, platform="cpu", causal=True)
  assert choose(*qkv(t=512, dtype=jnp.float32)) == "xla"
  assert choose(*qkv(t=768, dtype=jnp.float32)) == "chunked"     # AUTO_CHUNKED_MIN_TS
  assert choose(*qkv(t=1024)) == "chunked"
  monkeypatch.setattr(linear, "matmul_pays", lambda dtype: jnp.dtype(dtype) == jnp.bfloat16)
  assert choose(*qkv(b=1, t=1024)) == "xla"        # bf16 units: 24 MiB of bf16 weights, dense
  assert choose(*qkv(b=8, t=1024)) == "chunked"    # 192 MiB: past AUTO_DENSE_BF16_MAX_BYTES
  assert choose(*qkv(b=1, t=1024), dropout=True) == "chunked"


def test_sequence_sharded_self_attention_is_ring_on_every_backend():
  for platform in dispatch.PLATFORMS:
    choose = functools.partial(ops.choose_implementation, *qkv(), platform=platform, causal=True)
    assert choose(sequence_shards=4) == "ring"
    assert choose(sequence_shards=4, segment_ids=True, kv_valid=True) == "ring"
    assert choose(sequence_shards=4, bias=True) != "ring"
    assert choose(sequence_shards=4, window=128) != "ring"
    assert choose(sequence_shards=1) != "ring"


def test_unknown_platform_is_named():
  with pytest.raises(ValueError, match="platform='cuda'"):
    ops.choose_implementation(*qkv(), platform="cuda")


def test_implementation_none_follows_the_table_here():
  # On this backend, implementation=None gives the same numbers as the table's kernel.
  key = jax.random.split(jax.random.key(0), 3)
  q, kk, v = (jax.random.normal(k_, (2, 32, 4, 16), jnp.float32) for k_ in key)
  choice = ops.choose_implementation(q, kk, v, platform=jax.default_backend(), causal=True)
  auto = ops.dot_product_attention(q, kk, v, causal=True)
  chosen = ops.dot_product_attention(q, kk, v, causal=True, implementation=choice)
  assert jnp.array_equal(auto, chosen)
