"""The kernel table's rules (``ops.choose_implementation``), checked on any backend: they read
shapes and dtypes only, so what a GPU or TPU would run is decided here without one."""

import functools

import jax
import jax.numpy as jnp
import pytest

from transformer_jax import ops
from transformer_jax.ops import dispatch


def qkv(b=4, t=1024, s=None, n=12, k=None, h=64, dtype=jnp.bfloat16):
  s = t if s is None else s
  q = jax.ShapeDtypeStruct((b, t, n, h), dtype)
  kv = jax.ShapeDtypeStruct((b, s, n if k is None else k, h), dtype)
  return q, kv, kv


@pytest.mark.parametrize("heads", [(12, 12), (12, 4), (12, 1)])  # MHA, GQA, MQA
@pytest.mark.parametrize("causal", [True, False])
@pytest.mark.parametrize("dtype", [jnp.bfloat16, jnp.float16])
def test_gpu_half_precision_attention_is_cudnn(heads, causal, dtype):
  n, k = heads
  q, kk, v = qkv(n=n, k=k, dtype=dtype)
  choose = functools.partial(ops.choose_implementation, q, kk, v, platform="gpu", causal=causal)
  assert choose() == "cudnn"
  assert choose(segment_ids=True) == "cudnn"  # packed documents, as a mask
  assert choose(kv_valid=True) == "cudnn"  # padding
  if causal:
    assert choose(window=256) == "cudnn"  # cuDNN's look-back window
  else:
    assert choose(window=256) != "cudnn"  # a two-sided window it does not have


def test_gpu_falls_back_past_what_cudnn_takes():
  q, kk, v = qkv()
  choose = functools.partial(ops.choose_implementation, platform="gpu", causal=True)
  f32 = qkv(dtype=jnp.float32)
  assert choose(*f32) == "xla"  # 805 MB of scores: dense
  assert choose(*qkv(b=16, t=4096, dtype=jnp.float32)) == "chunked"  # 12.9 GB: blocks
  assert choose(q, kk, v, dropout=True) == "xla"
  assert choose(q, kk, v, bias=True) == "xla"  # ALiBi, T5's buckets
  assert choose(*qkv(h=256)) == "xla"  # head dim past cuDNN's
  assert choose(*qkv(t=1, s=1024)) == "xla"  # decoding: T != S
  assert choose(q, kk, v, q_positions=True) == "xla"
  assert choose(q, kk, v, return_weights=True) == "xla"


@pytest.mark.parametrize("heads", [(12, 12), (12, 4), (12, 1)])
@pytest.mark.parametrize("window", [None, 256])
def test_tpu_attention_is_splash(heads, window):
  n, k = heads
  choose = functools.partial(
    ops.choose_implementation, *qkv(n=n, k=k), platform="tpu", window=window
  )
  assert choose(causal=True) == "splash"
  assert choose(causal=True, segment_ids=True) == "splash"
  assert choose(causal=False) == "splash"
  assert choose(causal=True, bias=True) != "splash"
  assert choose(causal=True, dropout=True) != "splash"


def test_tpu_short_sequences_and_decoding_are_dense():
  choose = functools.partial(ops.choose_implementation, platform="tpu", causal=True)
  assert choose(*qkv(t=256)) == "xla"  # below SPLASH_MIN_TS
  assert choose(*qkv(t=1000)) == "xla"  # not a multiple of splash's blocks
  assert choose(*qkv(t=1, s=2048)) == "xla"  # one decoded token against the cache
  q, kk, v = qkv(t=2048)
  assert choose(q, kk, v, q_positions=True) == "xla"


def test_cpu_row_is_the_size_rule():
  choose = functools.partial(ops.choose_implementation, platform="cpu", causal=True)
  assert choose(*qkv(t=512, dtype=jnp.float32)) == "xla"
  assert choose(*qkv(t=768, dtype=jnp.float32)) == "chunked"  # AUTO_CHUNKED_MIN_TS
  assert choose(*qkv(t=1024)) == "chunked"
  # Where the CPU's row-major core takes the inputs (bfloat16 on bf16 units):
  rowmajor = functools.partial(choose, rowmajor_core=True)
  assert rowmajor(*qkv(b=1, t=1024)) == "xla"  # 24 MiB of bf16 weights, dense
  assert rowmajor(*qkv(b=8, t=1024)) == "chunked"  # 192 MiB: past AUTO_DENSE_BF16_MAX_BYTES
  assert rowmajor(*qkv(b=1, t=1024), dropout=True) == "chunked"
  # The fact is the CPU's alone: GPUs and TPUs ignore it.
  assert choose(*qkv(b=1, t=1024), platform="gpu", rowmajor_core=True) == "cudnn"


def test_splash_takes_multiples_of_its_lanes_that_leave_every_query_a_key():
  assert dispatch.splash_supports(1024, 1024, 128, jnp.bfloat16)
  assert dispatch.splash_supports(256, 512, 64, jnp.float32, causal=True, window=8)
  assert not dispatch.splash_supports(1000, 1024, 128, jnp.float32)
  assert not dispatch.splash_supports(1024, 1000, 128, jnp.float32)
  assert not dispatch.splash_supports(1024, 1024, 128, jnp.float16)
  assert not dispatch.splash_supports(1024, 1024, 128, jnp.int32)
  assert not dispatch.splash_supports(512, 256, 128, jnp.float32, causal=True)
  assert dispatch.splash_supports(512, 256, 128, jnp.float32)
  assert not dispatch.splash_supports(512, 256, 128, jnp.float32, window=256)
  assert dispatch.splash_supports(512, 256, 128, jnp.float32, window=257)


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


def test_implementation_none_is_dense_while_the_scores_fit(monkeypatch):
  # ops' own choice knows no platform: "xla" while the float32 scores fit DENSE_MAX_BYTES, else
  # "chunked" (the platform's table is its backend's: tests/backends).
  key = jax.random.split(jax.random.key(0), 3)
  q, kk, v = (jax.random.normal(k_, (2, 32, 4, 16), jnp.float32) for k_ in key)
  auto = ops.dot_product_attention(q, kk, v, causal=True)
  assert jnp.array_equal(
    auto, ops.dot_product_attention(q, kk, v, causal=True, implementation="xla")
  )
  monkeypatch.setattr(dispatch, "DENSE_MAX_BYTES", 2 * 4 * 32 * 32 * 4 - 1)
  assert dispatch.dense_or_chunked(q, kk) == "chunked"
  chunked = ops.dot_product_attention(q, kk, v, causal=True, implementation="chunked")
  assert jnp.array_equal(ops.dot_product_attention(q, kk, v, causal=True), chunked)


@pytest.mark.parametrize("name", ["cudnn", "splash"])
def test_platform_kernels_are_the_backends(name):
  q = jnp.zeros((1, 8, 2, 8))
  with pytest.raises(
    ValueError, match=f"implementation='{name}' is a platform's kernel: call it through its backend"
  ):
    ops.dot_product_attention(q, q, q, implementation=name)
