"""The "cudnn" attention kernel (``backends.cudnn``: cuDNN's fused attention through
``jax.nn.dot_product_attention``) against the float64 NumPy reference of
``tests/ops/test_chunked_attention.py``, and whole models with ``attention_impl="cudnn"`` against
``"xla"``.

The numbers need an NVIDIA GPU: elsewhere the kernel does not exist, and
``test_off_a_gpu_the_kernel_is_refused_by_name`` checks the error that says so. What this file
checks is the translation of our mask parts (causal, window, key lengths, segment ids, position
biases) into cuDNN's arguments, forward and backward, and the kernel table's packed segments.
"""

from __future__ import annotations

import dataclasses
import functools

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from flax import nnx

from transformer_jax import models, ops
from transformer_jax.backends import cudnn
from tests.backends import only_on
from tests.models.conftest import VOCAB, forward, params_for, tiny
from tests.ops.test_chunked_attention import assert_close, inputs, reference, valid_mask

on_gpu = only_on("gpu", "cuDNN's fused attention")

# bfloat16 inputs and output, bfloat16 probabilities inside cuDNN's second product: max |error| /
# max |reference| per array, against float64 on the same (rounded) inputs.
TOL = 3e-2
B, T, N, H = 2, 64, 4, 32


def _grads(q, k, v, do, bias=None, **kw):
  """``out`` and the gradients of ``sum(out * do)`` wrt q, k, v (and the dense bias)."""

  def loss(q, k, v, bias):
    out = cudnn.attention(q, k, v, bias=bias, **kw)
    return jnp.sum(out.astype(jnp.float32) * do.astype(jnp.float32)), out

  argnums = (0, 1, 2) if bias is None else (0, 1, 2, 3)
  grads, out = jax.grad(loss, argnums=argnums, has_aux=True)(q, k, v, bias)
  return out, grads


CASES = {
  "causal": dict(causal=True),
  "full": dict(),
  "causal-window": dict(causal=True, window=16),
  "window": dict(window=16),
  "key-lengths": dict(kv_valid=np.arange(T)[None] < np.array([[T], [40]])),
  "segments": dict(q_seg=np.repeat(np.array([[0, 1], [0, 0]]), T // 2, axis=1)),
}


def test_off_a_gpu_the_kernel_is_refused_by_name():
  if jax.default_backend() == "gpu":
    pytest.skip("the kernel exists here")
  q, k, v, _ = inputs(16, t=9, s=9)
  with pytest.raises(ValueError, match=f"needs an NVIDIA GPU.*{jax.default_backend()}"):
    cudnn.attention(q, k, v)


def test_packed_segments_only_where_the_table_asks():
  q = kk = jax.ShapeDtypeStruct((4, 1024, 12, 64), jnp.bfloat16)
  packed = functools.partial(
    cudnn.packed_segments,
    window=None,
    bias=False,
    mask=False,
    kv_valid=False,
    q_positions=False,
    kv_segment_ids=False,
  )
  assert packed(q, kk, table_segments=0) == 0  # off by default: the mask
  assert packed(q, kk, table_segments=16) == 16
  # Another mask part, separate key segment ids, cross-attention or GQA: the mask.
  for part in ("bias", "mask", "kv_valid", "q_positions", "kv_segment_ids"):
    assert packed(q, kk, table_segments=16, **{part: True}) == 0, part
  assert packed(q, kk, table_segments=16, window=256) == 0
  assert packed(q, jax.ShapeDtypeStruct((4, 512, 12, 64), jnp.bfloat16), table_segments=16) == 0
  assert packed(q, jax.ShapeDtypeStruct((4, 1024, 4, 64), jnp.bfloat16), table_segments=16) == 0
  assert packed(q, kk, table_segments=1) == 0  # one run per row is no packing


@on_gpu
@pytest.mark.parametrize("kh", [4, 2], ids=["mha", "gqa"])
@pytest.mark.parametrize("case", list(CASES))
def test_matches_float64_reference(case, kh):
  parts = CASES[case]
  q, k, v, do = inputs(0, b=B, t=T, s=T, n=N, kh=kh, h=H, dtype=jnp.bfloat16)
  kw = {
    key: value
    for key, value in dict(
      causal=parts.get("causal", False),
      window=parts.get("window"),
      kv_valid=parts.get("kv_valid"),
      q_segment_ids=parts.get("q_seg"),
    ).items()
    if value is not None
  }
  out, (dq, dk, dv) = _grads(q, k, v, do, **kw)
  assert out.dtype == jnp.bfloat16
  valid = valid_mask(
    B,
    T,
    T,
    causal=parts.get("causal", False),
    window=parts.get("window"),
    kv_valid=parts.get("kv_valid"),
    q_seg=parts.get("q_seg"),
    kv_seg=parts.get("q_seg"),
  )
  ref = reference(q, k, v, do, valid=valid)
  for name, a, e in zip(("out", "dq", "dk", "dv"), (out, dq, dk, dv), ref):
    assert_close(a, e, TOL, f"{case} {name}")


@on_gpu
def test_traced_key_padding_goes_in_as_a_mask():
  # Under jit the padding is a tracer, not known to be a prefix: it becomes a dense mask.
  q, k, v, do = inputs(1, b=B, t=T, s=T, n=N, kh=N, h=H, dtype=jnp.bfloat16)
  kv_valid = np.ones((B, T), bool)
  kv_valid[1, ::3] = False  # not a prefix
  out = jax.jit(lambda q, k, v, m: cudnn.attention(q, k, v, kv_valid=m))(q, k, v, kv_valid)
  ref = reference(q, k, v, do, valid=valid_mask(B, T, T, kv_valid=kv_valid))
  assert_close(out, ref[0], TOL, "out")


@on_gpu
def test_dense_bias_and_its_gradient():
  q, k, v, do = inputs(2, b=B, t=T, s=T, n=N, kh=N, h=H, dtype=jnp.bfloat16)
  bias = jnp.asarray(np.random.default_rng(3).standard_normal((1, N, T, T)), jnp.bfloat16)
  out, (dq, dk, dv, dbias) = _grads(q, k, v, do, bias=bias, causal=True)
  ref = reference(q, k, v, do, valid=valid_mask(B, T, T, causal=True), bias=bias)
  for name, a, e in zip(("out", "dq", "dk", "dv"), (out, dq, dk, dv), ref):
    assert_close(a, e, TOL, name)
  assert_close(dbias, ref[4].sum(0, keepdims=True), TOL, "dbias")


@on_gpu
def test_float32_inputs_get_a_clear_error():
  q, k, v, _ = inputs(4, b=B, t=T, s=T, n=N, kh=N, h=H, dtype=jnp.float32)
  with pytest.raises(ValueError, match="implementation='cudnn'.*q.dtype=float32.*bfloat16"):
    cudnn.attention(q, k, v)


# Packed documents, B=2 rows of T=64: runs that fit in 4 packed sequences per row (with a padding
# tail of id 0), rows of 6 runs (more than 4), and an id that comes back after its run ended.
PACKED = {
  "fits": np.array([[1] * 20 + [2] * 30 + [0] * 14, [1] * 7 + [2] * 9 + [3] * 48]),
  "more-runs": np.array([[1, 2, 3, 4, 5] * 4 + [6] * 44, [1] * 64]),
  "id-comes-back": np.array([[1] * 16 + [2] * 16 + [1] * 32, [1] * 64]),
}


@on_gpu
@pytest.mark.parametrize("causal", [True, False], ids=["causal", "bidirectional"])
@pytest.mark.parametrize("case", list(PACKED))
def test_packed_segments_match_float64_reference(case, causal):
  # With the table's cudnn_packed_segments the runs that fit go in as packed sequences, the
  # others as the mask: both give segment-masked attention.
  ids = PACKED[case].astype(np.int32)
  q, k, v, do = inputs(5, b=B, t=T, s=T, n=N, kh=N, h=H, dtype=jnp.bfloat16)
  out, grads = jax.jit(
    lambda q, k, v, do, ids: _grads(q, k, v, do, causal=causal, q_segment_ids=ids, table_segments=4)
  )(q, k, v, do, ids)
  ref = reference(q, k, v, do, valid=valid_mask(B, T, T, causal=causal, q_seg=ids, kv_seg=ids))
  for name, a, e in zip(("out", "dq", "dk", "dv"), (out, *grads), ref):
    assert_close(a, e, TOL, f"{case} {name}")


@on_gpu
@pytest.mark.skipif(
  jax.default_backend() == "gpu" and not cudnn.ragged_layout(),
  reason="cuDNN's packed-sequence layout needs a Hopper or later GPU",
)
@pytest.mark.parametrize("causal", [True, False], ids=["causal", "bidirectional"])
def test_packed_kernel_itself_matches_float64_reference(causal):
  # The packed call alone (not behind the choice on the device), so that a broken packed kernel
  # cannot pass through the mask's branch.
  ids = PACKED["fits"].astype(np.int32)
  lengths, starts, fits = ops.segment_runs(jnp.asarray(ids), 4)
  assert bool(fits)
  q, k, v, do = inputs(6, b=B, t=T, s=T, n=N, kh=N, h=H, dtype=jnp.bfloat16)

  def loss(q, k, v):
    out = cudnn.packed_attention(
      q, k, v, lengths_BM=lengths, starts_BM1=starts, causal=causal, scale=H**-0.5
    )
    return jnp.sum(out.astype(jnp.float32) * do.astype(jnp.float32)), out

  grads, out = jax.jit(jax.grad(loss, argnums=(0, 1, 2), has_aux=True))(q, k, v)
  ref = reference(q, k, v, do, valid=valid_mask(B, T, T, causal=causal, q_seg=ids, kv_seg=ids))
  for name, a, e in zip(("out", "dq", "dk", "dv"), (out, *grads), ref):
    assert_close(a, e, TOL, name)


def _loss_and_grads(name, impl, dtype):
  # Scanned layers: one cuDNN attention per stack. (With XLA_FLAGS=--xla_gpu_deterministic_ops=
  # true, which tests/conftest.py sets, XLA 0.11.2 fails with "IndexError: raw_hash_map<>::at" to
  # run the backward of a program holding two cuDNN attentions of identical shapes and mask types,
  # as unrolled layers do, and as an encoder's and the cross-attention's are for equal lengths.)
  config = dataclasses.replace(tiny(name), dtype=dtype, attention_impl=impl, scan_layers=True)
  graphdef = models.graphdef(config)
  tokens = jax.random.randint(jax.random.key(7), (2, 12), 0, VOCAB)

  def loss_fn(params, tokens):
    model = nnx.merge(graphdef, params)
    if isinstance(config, models.Seq2SeqConfig):
      # Target shorter than the source (see above).
      logits = model(tokens, tokens[:, :8][:, ::-1])
    else:
      logits = forward(model, config, tokens)
    return jnp.mean(jax.nn.log_softmax(logits.astype(jnp.float32))[..., 1])

  return jax.jit(jax.value_and_grad(loss_fn))(params_for(tiny(name)), tokens)


@on_gpu
@pytest.mark.parametrize(
  "name", ["gpt2-tiny", "llama-tiny", "gpt-alibi-tiny", "bert-tiny", "transformer-tiny", "t5-tiny"]
)
def test_models_with_cudnn_train_as_accurately_as_with_xla(name):
  # A bfloat16 model with attention_impl="cudnn" and the same model with "xla", each against the
  # float32 model: loss and every gradient (T5's learned relative bias included, through cuDNN's
  # bias gradient) within twice the error of "xla" in bfloat16. (T5 computes unscaled logits:
  # its bfloat16 gradients are ~9% from float32's with either kernel.)
  loss_f32, grads_f32 = _loss_and_grads(name, "xla", "float32")
  loss_xla, grads_xla = _loss_and_grads(name, "xla", "bfloat16")
  loss, grads = _loss_and_grads(name, "cudnn", "bfloat16")
  assert abs(float(loss) - float(loss_f32)) <= 2 * abs(float(loss_xla) - float(loss_f32)) + 1e-3

  def as64(g):
    return np.asarray(g, np.float64)

  top = max(float(np.linalg.norm(as64(g))) for g in jax.tree.leaves(grads_f32))
  for (path, g32), g_xla, g in zip(
    jax.tree_util.tree_leaves_with_path(grads_f32),
    jax.tree.leaves(grads_xla),
    jax.tree.leaves(grads),
  ):
    scale = float(np.linalg.norm(as64(g32)))
    # The key projection's bias has a zero gradient up to rounding (softmax ignores a constant
    # added to a row's logits): no relative error to speak of.
    if scale < 1e-5 * top:
      assert float(np.linalg.norm(as64(g))) < 1e-4 * top, jax.tree_util.keystr(path)
      continue
    err_xla = float(np.linalg.norm(as64(g_xla) - as64(g32))) / scale
    err = float(np.linalg.norm(as64(g) - as64(g32))) / scale
    assert err <= 2 * err_xla + 1e-2, (jax.tree_util.keystr(path), err, err_xla)
