"""Block-sparse attention (``ops.sparse``) against float64 dense attention under the same mask.

The mask is checked first against the definitions of Child et al. (2019) and BigBird written out
position by position; then the kernel's output and gradients against the float64 reference of
``test_chunked_attention`` under that mask, causal and bidirectional, with padding and segments.
"""

from __future__ import annotations

import functools

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from transformer_jax.ops.sparse import SparsePattern, sparse_attention
from tests.ops.test_chunked_attention import assert_close, inputs, reference

TOL = 1e-5


def test_fixed_mask_is_child_et_al_definition():
  # A(1) = {j : floor(j / l) == floor(i / l)}, A(2) = {j : j mod l in {l - c, ..., l - 1}}.
  l, c, t = 4, 1, 14
  got = SparsePattern.fixed(block=l, summary=c).mask(t, causal=True)
  want = np.array(
    [[(j // l == i // l or j % l >= l - c) and j <= i for j in range(t)] for i in range(t)]
  )
  np.testing.assert_array_equal(got, want)


def test_strided_mask_is_child_et_al_definition():
  # A(1) = {j : i - j < l} (here whole blocks: the own and the previous one), A(2) = {j : (i - j)
  # mod l == 0}; bidirectional: the same on both sides.
  l, t = 4, 13
  got = SparsePattern.strided_pattern(block=l).mask(t, causal=False)
  want = np.array(
    [[abs(i // l - j // l) < 2 or (i - j) % l == 0 for j in range(t)] for i in range(t)]
  )
  np.testing.assert_array_equal(got, want)


def test_bigbird_layout_globals_window_and_random_blocks():
  pat = SparsePattern.bigbird(block=2, random_blocks=2, seed=3)
  lay = pat.layout(8, causal=False)
  assert lay[0].all() and lay[-1].all() and lay[:, 0].all() and lay[:, -1].all()
  for a in range(1, 7):
    assert lay[a, a - 1] and lay[a, a] and lay[a, a + 1]
  # Rows 2..5 have 5 fixed blocks (first, last, window of 3) and draw 2 of the remaining 3.
  np.testing.assert_array_equal(lay[2:6].sum(1), 7)
  np.testing.assert_array_equal(lay, pat.layout(8, causal=False))  # the seed fixes them
  assert not np.array_equal(lay, SparsePattern.bigbird(2, 2, seed=4).layout(8, causal=False))
  causal = pat.layout(8, causal=True)
  assert not np.triu(causal, 1).any()


@functools.partial(jax.jit, static_argnames=("pattern", "causal", "implementation"))
def value_and_grads(q, k, v, do, kv_valid, seg, *, pattern, causal, implementation="chunked"):
  def loss(q, k, v):
    out = sparse_attention(
      q,
      k,
      v,
      pattern,
      causal=causal,
      kv_valid=kv_valid,
      segment_ids=seg,
      implementation=implementation,
    )
    return jnp.sum(out * do), out

  grads, out = jax.grad(loss, argnums=(0, 1, 2), has_aux=True)(q, k, v)
  return out, grads


def check(pattern, *, causal, t=37, kh=2, kv_valid=None, seg=None, seed=0):
  q, k, v, do = inputs(seed, t=t, s=t, kh=kh)
  out, (dq, dk, dv) = value_and_grads(q, k, v, do, kv_valid, seg, pattern=pattern, causal=causal)
  valid = pattern.mask(t, causal=causal)[None, None]
  if kv_valid is not None:
    valid = valid & np.asarray(kv_valid)[:, None, None, :]
  if seg is not None:
    seg = np.asarray(seg)
    valid = valid & (seg[:, None, :, None] == seg[:, None, None, :])
  bias = pattern.bias(t, causal=causal)
  ref = reference(q, k, v, do, valid=valid, bias=None if bias is None else bias[None, None])
  for name, a, e in zip(("out", "dq", "dk", "dv"), (out, dq, dk, dv), ref):
    assert_close(a, e, TOL, name)
  return out


PATTERNS = {
  "fixed": SparsePattern.fixed(block=8, summary=3),
  "strided": SparsePattern.strided_pattern(block=6),
  "bigbird": SparsePattern.bigbird(block=5, random_blocks=2, seed=1),
  # transformers' BigBird in eval mode: the random blocks are block 0, counted again each.
  "bigbird-eval": SparsePattern(
    block=5, local_blocks=2, global_blocks=(0, -1), random_blocks=2, random_first=True
  ),
  "everything": SparsePattern(
    block=7, local_blocks=1, summary=2, strided=True, global_blocks=(1,), random_blocks=1, seed=2
  ),
}


@pytest.mark.parametrize("causal", [True, False], ids=["causal", "bidirectional"])
@pytest.mark.parametrize("name", list(PATTERNS))
def test_matches_float64_dense_under_the_same_mask(name, causal):
  # T = 37 is not a whole number of blocks: the last block is padded.
  check(PATTERNS[name], causal=causal)


@pytest.mark.parametrize("causal", [True, False], ids=["causal", "bidirectional"])
def test_segments_padding_and_heads(causal):
  r = np.random.default_rng(9)
  seg = jnp.asarray(np.sort(r.integers(0, 3, (2, 37)), axis=1))
  kv_valid = jnp.asarray(np.arange(37)[None] < np.array([[30], [37]]))
  # MQA (one key/value head for four query heads); the other tests have GQA (two).
  check(PATTERNS["everything"], causal=causal, kh=1, seg=seg, kv_valid=kv_valid, seed=5)


def test_query_without_keys_gives_zeros_and_xla_path_agrees():
  pat = SparsePattern(block=8, local_blocks=0, summary=2)  # summary positions alone
  q, k, v, do = inputs(11, t=21, s=21)
  kv_valid = jnp.asarray(np.arange(21)[None] < np.array([[21], [0]]))  # row 1: no key at all
  out, grads = value_and_grads(q, k, v, do, kv_valid, None, pattern=pat, causal=True)
  np.testing.assert_array_equal(np.asarray(out[1]), 0.0)
  out_x, grads_x = value_and_grads(
    q, k, v, do, kv_valid, None, pattern=pat, causal=True, implementation="xla"
  )
  for a, e in zip((out, *grads), (out_x, *grads_x)):
    np.testing.assert_allclose(np.asarray(a), np.asarray(e), atol=2e-5, rtol=1e-4)


def test_random_first_counts_block_zero_again_and_dense_up_to():
  pat = SparsePattern.bigbird(block=4, random_blocks=3, eval_mode=True)
  np.testing.assert_array_equal(pat.first_block_count(12, causal=False), [1] + [4] * 10 + [1])
  bias = pat.bias(48, causal=False)
  np.testing.assert_allclose(bias[4:44, :4], np.log(4.0))
  assert np.all(bias[:4] == 0) and np.all(bias[44:] == 0) and np.all(bias[:, 4:] == 0)
  # Up to (5 + 2 * 3) * 4 = 44 positions the attention is dense.
  assert pat.mask(44, causal=False).all() and pat.bias(44, causal=False) is None
  assert not pat.mask(48, causal=False).all()


def test_work_follows_the_pattern():
  # Child et al.'s fixed pattern at T = 16k: one layout block per query block and 8 chunks of
  # summary keys in all, against 128 blocks per query block for full attention.
  from transformer_jax.ops.sparse import _tables

  _, _, cnt, _, _, ns, s_hi = _tables(SparsePattern.fixed(block=128, summary=8), 16384, True)
  np.testing.assert_array_equal(cnt, 1)
  assert ns == 8 and s_hi.max() == 8 and s_hi.min() == 1


def test_bad_inputs_are_named():
  q, k, v, _ = inputs(0, t=16, s=16)
  with pytest.raises(ValueError, match="summary=9 must be <= block=8"):
    SparsePattern(block=8, summary=9)
  with pytest.raises(ValueError, match="holds no keys"):
    SparsePattern(local_blocks=0)
  with pytest.raises(ValueError, match="block=0"):
    SparsePattern(block=0)
  with pytest.raises(ValueError, match="self-attention"):
    sparse_attention(q, k[:, :8], v[:, :8], PATTERNS["fixed"])
  with pytest.raises(ValueError, match="implementation='splash'"):
    sparse_attention(q, k, v, PATTERNS["fixed"], implementation="splash")
  with pytest.raises(ValueError, match="segment_ids must be"):
    sparse_attention(q, k, v, PATTERNS["fixed"], segment_ids=jnp.zeros((2, 3), jnp.int32))
