"""The kernel table (``ops.choose_implementation``), checked on any backend: it reads shapes and
dtypes only, so what a GPU or TPU would run is decided here without one."""

import functools
import subprocess
import sys

import jax
import jax.numpy as jnp
import pytest

from transformer_jax import hardware, ops
from transformer_jax.cpu import matmul
from transformer_jax.ops import dispatch


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
  monkeypatch.setattr(matmul, "bf16_products_native", lambda dtype: False)
  choose = functools.partial(ops.choose_implementation, platform="cpu", causal=True)
  assert choose(*qkv(t=512, dtype=jnp.float32)) == "xla"
  assert choose(*qkv(t=768, dtype=jnp.float32)) == "chunked"     # AUTO_CHUNKED_MIN_TS
  assert choose(*qkv(t=1024)) == "chunked"
  monkeypatch.setattr(matmul, "bf16_products_native",
                      lambda dtype: jnp.dtype(dtype) == jnp.bfloat16)
  assert choose(*qkv(b=1, t=1024)) == "xla"        # bf16 units: 24 MiB of bf16 weights, dense
  assert choose(*qkv(b=8, t=1024)) == "chunked"    # 192 MiB: past AUTO_DENSE_BF16_MAX_BYTES
  assert choose(*qkv(b=1, t=1024), dropout=True) == "chunked"


def test_cpu_pieces_are_chosen_on_cpu_only(monkeypatch):
  # Even where bfloat16 products would run natively, GPUs and TPUs keep the dense core and the
  # einsum, and the table does not read the CPU's flags to say so.
  monkeypatch.setattr(matmul, "bf16_products_native",
                      lambda dtype: jnp.dtype(dtype) == jnp.bfloat16)
  q, kk, v = qkv(t=8)
  for platform in ("gpu", "tpu"):
    assert dispatch.choose_dense_core(q, kk, v, platform=platform) == "heads_major"
    assert dispatch.choose_product(jnp.bfloat16, rows=1, platform=platform) == "einsum"
    assert dispatch.choose_product(jnp.bfloat16, platform=platform) == "einsum"
  assert dispatch.choose_dense_core(q, kk, v, platform="cpu") == "rowmajor"
  assert dispatch.choose_product(jnp.bfloat16, platform="cpu") == "cpu_bf16"
  assert dispatch.choose_product(jnp.float32, platform="cpu") == "einsum"
  # A few rows of a weight stored [out, in]: weight-first on CPU, any dtype.
  from transformer_jax.cpu import decode
  for dtype in (jnp.float32, jnp.bfloat16):
    assert dispatch.choose_product(dtype, rows=decode.SKINNY_ROWS, platform="cpu") == "weight_first"
  assert dispatch.choose_product(jnp.bfloat16, rows=decode.SKINNY_ROWS + 1,
                                 platform="cpu") == "cpu_bf16"


def test_padded_product_only_where_pad_cols_asks(monkeypatch):
  assert dispatch.PAD_COLS == {}   # off by default everywhere
  assert dispatch.choose_product(jnp.bfloat16, rows=4096, cols=50257, platform="gpu") == "einsum"
  monkeypatch.setitem(dispatch.PAD_COLS, "gpu", 128)
  assert dispatch.choose_product(jnp.bfloat16, rows=4096, cols=50257, platform="gpu") == "padded"
  # Already aligned, no product shape given, or another platform: unchanged.
  assert dispatch.choose_product(jnp.bfloat16, rows=4096, cols=50304, platform="gpu") == "einsum"
  assert dispatch.choose_product(jnp.bfloat16, platform="gpu") == "einsum"
  assert dispatch.choose_product(jnp.bfloat16, rows=4096, cols=50257, platform="tpu") == "einsum"
  assert dispatch.choose_product(jnp.float32, rows=4096, cols=50257, platform="cpu") == "einsum"


def test_packed_segments_only_where_the_table_asks(monkeypatch):
  q, kk, v = qkv()
  packed = functools.partial(dispatch.cudnn_packed_segments, window=None, bias=False, mask=False,
                             kv_valid=False, q_positions=False, kv_segment_ids=False)
  assert dispatch.CUDNN_PACKED_SEGMENTS == 0   # off until measured: the mask
  assert packed(q, kk) == 0
  monkeypatch.setattr(dispatch, "CUDNN_PACKED_SEGMENTS", 16)
  assert packed(q, kk) == 16
  # Another mask part, separate key segment ids, cross-attention or GQA: the mask.
  for part in ("bias", "mask", "kv_valid", "q_positions", "kv_segment_ids"):
    assert packed(q, kk, **{part: True}) == 0, part
  assert packed(q, kk, window=256) == 0
  assert packed(*qkv(t=512, s=1024)[:2]) == 0
  assert packed(*qkv(n=12, k=4)[:2]) == 0
  monkeypatch.setattr(dispatch, "CUDNN_PACKED_SEGMENTS", 1)   # one run per row is no packing
  assert packed(q, kk) == 0


def test_bf16_products_native_is_false_off_cpu_without_reading_cpuinfo(monkeypatch):
  def cpuinfo():
    raise AssertionError("read /proc/cpuinfo off CPU")
  monkeypatch.setattr(hardware, "has_bf16_units", cpuinfo)
  monkeypatch.setattr(jax, "default_backend", lambda: "gpu")
  assert not matmul.bf16_products_native(jnp.bfloat16)
  assert dispatch.choose_product(jnp.bfloat16) == "einsum"


def test_the_core_imports_no_cpu_module():
  # The CPU profile is imported lazily, where the table picks one of its pieces on CPU.
  code = ("import sys, transformer_jax.models, transformer_jax.layers, transformer_jax.ops, "
          "transformer_jax.parallel.ring; "
          "print(sorted(m for m in sys.modules if m.startswith('transformer_jax.cpu.')))")
  out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True)
  assert out.stdout.strip() == "[]", out.stdout


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
