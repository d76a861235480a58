"""Mamba-2's chunked scan (``ops.ssd``) as a Pallas TPU kernel, and the table that picks it.

The kernel's grid is ``(B, N, Z)``: one program per batch row, head and chunk, the chunk axis
innermost and sequential ("arbitrary"), so the head's state ``[H, S]`` stays in a VMEM scratch
from chunk to chunk and never goes back to HBM until the last one. Each program computes the SSD
four-term form of ``ops.ssd`` for its chunk with matrix products only (the within-chunk cumulative
sum of the decays is a product with a lower-triangular matrix): the intra-chunk quadratic, the
carried state's contribution, the chunk's own state and the carried state's decay. The head reads
its group's B and C through the block index (no repeat in HBM).

Forward only: the gradient is that of ``ops.ssd`` (``jax.custom_vjp`` recomputes the pure form in
the backward pass), so training with the kernel is exact and costs one extra forward. Tested in
interpret mode on CPU (``interpret=True``: Pallas' TPU interpreter) against ``ops.ssd``; not yet
measured on a TPU, so ``choose_ssd_implementation`` keeps ``"xla"`` on every platform and the
kernel runs where a config asks for it (``MambaConfig.ssm_impl``).
"""

from __future__ import annotations

import jax
import jax.numpy as jnp
from jax.experimental import pallas as pl
from jax.experimental.pallas import tpu as pltpu

from transformer_jax.ops import ssm as ssm_ops

SSD_IMPLEMENTATIONS = ("xla", "pallas")


def choose_ssd_implementation(platform: str) -> str:
  """The SSD kernel for ``platform``: ``"xla"`` everywhere until the Pallas kernel is measured on a
  TPU (``MambaConfig.ssm_impl: pallas`` asks for it; on CPU it runs in interpret mode)."""
  del platform
  return "xla"


def _kernel(
  x_ref, dt_ref, b_ref, c_ref, seg_ref, seg_in_ref, h0_ref, a_ref, y_ref, h_ref, state_ref
):
  """One (row, head, chunk): refs hold ``x [Q, H]``, ``dt [Q, 1]``, ``B``/``C`` ``[Q, S]``, the
  segment indices ``[Q, 1]`` and ``[1, 1]`` of the position before the chunk, ``h0 [H, S]``,
  ``A [1, 1]``; writes ``y [Q, H]`` and, after the last chunk, ``h [H, S]``."""
  z = pl.program_id(2)

  @pl.when(z == 0)
  def _():
    state_ref[...] = h0_ref[0, 0]

  x = x_ref[0, 0, 0]  # [Q, H]
  dt = dt_ref[0, 0, 0]  # [Q, 1]
  b, c = b_ref[0, 0, 0], c_ref[0, 0, 0]  # [Q, S]
  seg = seg_ref[0, 0]  # [Q, 1] int32
  seg_in = seg_in_ref[0, 0]  # [1, 1]
  q = x.shape[0]
  rows = jax.lax.broadcasted_iota(jnp.int32, (q, q), 0)
  cols = jax.lax.broadcasted_iota(jnp.int32, (q, q), 1)
  lower = (rows >= cols).astype(jnp.float32)
  cum = jnp.dot(lower, dt * a_ref[0, 0], preferred_element_type=jnp.float32)  # [Q, 1], <= 0
  # 1. intra-chunk: decay from position m to l within one segment, causal.
  same = (seg == seg.reshape(1, q)) & (rows >= cols)
  diff = jnp.where(same, cum - cum.reshape(1, q), -jnp.inf)
  scores = jax.lax.dot_general(
    c, b, (((1,), (1,)), ((), ())), preferred_element_type=jnp.float32
  ) * jnp.exp(diff)
  u = x * dt
  y = jnp.dot(scores, u, preferred_element_type=jnp.float32)
  # 4. the carried state, decayed to each position of its own segment.
  h = state_ref[...]
  into = jnp.where(seg == seg_in, jnp.exp(cum), 0.0)  # [Q, 1]
  y = y + into * jax.lax.dot_general(
    c, h, (((1,), (1,)), ((), ())), preferred_element_type=jnp.float32
  )
  y_ref[0, 0, 0] = y.astype(y_ref.dtype)
  # 2. + 3. the chunk's own state (its last segment's inputs) and the carried one's decay.
  last = cum[q - 1 : q]  # [1, 1]
  out_of = jnp.where(seg == seg[q - 1 : q], jnp.exp(last - cum), 0.0)  # [Q, 1]
  own = jax.lax.dot_general(
    u * out_of, b, (((0,), (0,)), ((), ())), preferred_element_type=jnp.float32
  )  # [H, S]
  across = jnp.where(seg[q - 1 : q] == seg_in, jnp.exp(last), 0.0)  # [1, 1]
  state_ref[...] = h * across + own

  @pl.when(z == pl.num_programs(2) - 1)
  def _():
    h_ref[0, 0] = state_ref[...]


def _forward(x, dt32, A, B, C, h0, seg_BT, q, interpret):
  """The kernel on prepared inputs: ``dt32`` clamped and masked, ``h0 [B, N, H, S]``; returns
  ``(y [B, T, N, H] float32 before the skip term, h_end)``."""
  b, t, n, hd = x.shape
  g, s = B.shape[2], B.shape[3]
  rep = n // g
  pad = (-t) % q
  z = (t + pad) // q

  # Head-major chunks: [B, N|G, Z, Q, ...]; padding has dt = 0 (keeps the state).
  def heads(a):
    return jnp.moveaxis(jnp.pad(a, [(0, 0), (0, pad)] + [(0, 0)] * (a.ndim - 2)), 2, 1)

  x_c = heads(x.astype(jnp.float32)).reshape(b, n, z, q, hd)
  dt_c = heads(dt32[..., None]).reshape(b, n, z, q, 1)
  b_c = heads(B.astype(jnp.float32)).reshape(b, g, z, q, s)
  c_c = heads(C.astype(jnp.float32)).reshape(b, g, z, q, s)
  seg = jnp.pad(seg_BT, ((0, 0), (0, pad)), mode="edge").reshape(b, z, q, 1)
  seg_in = jnp.concatenate([jnp.zeros((b, 1), jnp.int32), seg[:, :-1, -1, 0]], axis=1)
  seg_in = seg_in.reshape(b, z, 1, 1)
  a_n11 = A.astype(jnp.float32).reshape(n, 1, 1)
  per_head = lambda *blk: pl.BlockSpec((1, 1, 1, *blk), lambda i, j, k: (i, j, k, 0, 0))  # noqa

  def per_group(*blk):
    return pl.BlockSpec((1, 1, 1, *blk), lambda i, j, k: (i, j // rep, k, 0, 0))

  y, h_end = pl.pallas_call(
    _kernel,
    out_shape=(
      jax.ShapeDtypeStruct((b, n, z, q, hd), jnp.float32),
      jax.ShapeDtypeStruct((b, n, hd, s), jnp.float32),
    ),
    grid=(b, n, z),
    in_specs=[
      per_head(q, hd),
      per_head(q, 1),
      per_group(q, s),
      per_group(q, s),
      pl.BlockSpec((1, 1, q, 1), lambda i, j, k: (i, k, 0, 0)),
      pl.BlockSpec((1, 1, 1, 1), lambda i, j, k: (i, k, 0, 0)),
      pl.BlockSpec((1, 1, hd, s), lambda i, j, k: (i, j, 0, 0)),
      pl.BlockSpec((1, 1, 1), lambda i, j, k: (j, 0, 0)),
    ],
    out_specs=(per_head(q, hd), pl.BlockSpec((1, 1, hd, s), lambda i, j, k: (i, j, 0, 0))),
    scratch_shapes=[pltpu.VMEM((hd, s), jnp.float32)],
    compiler_params=pltpu.CompilerParams(dimension_semantics=("parallel", "parallel", "arbitrary")),
    interpret=pltpu.InterpretParams() if interpret else False,
    name="ssd_chunked_scan",
  )(x_c, dt_c, b_c, c_c, seg, seg_in, h0, a_n11)
  y = jnp.moveaxis(y.reshape(b, n, z * q, hd), 1, 2)[:, :t]
  return y, h_end


def ssd(
  x: jax.Array,
  dt: jax.Array,
  A: jax.Array,
  B: jax.Array,
  C: jax.Array,
  D: jax.Array | None = None,
  *,
  chunk_size: int = 256,
  time_step_limit: tuple[float, float] = (0.0, float("inf")),
  initial_state: jax.Array | None = None,
  return_state: bool = False,
  valid: jax.Array | None = None,
  segment_ids: jax.Array | None = None,
  interpret: bool = False,
):
  """``ops.ssd`` with the forward pass in the Pallas kernel (arguments and results as there).

  Args:
    interpret: run the kernel in Pallas' TPU interpreter (any platform; for tests).
  """
  b, t, n, hd = x.shape
  s = B.shape[3]
  if (
    dt.shape != (b, t, n)
    or A.shape != (n,)
    or B.shape[:2] != (b, t)
    or C.shape != B.shape
    or n % B.shape[2]
  ):
    raise ValueError(
      f"ssd shapes: x {x.shape} [B, T, N, H], dt {dt.shape} [B, T, N], A "
      f"{A.shape} [N], B {B.shape} and C {C.shape} [B, T, G, S] with N % G == 0"
    )
  # The same checks and time-step rules as the reference scan in ops/ssm.py.
  ssm_ops._check_chunk(chunk_size)  # noqa: SLF001
  ssm_ops._check_mask("valid", valid, b, t)  # noqa: SLF001
  ssm_ops._check_mask("segment_ids", segment_ids, b, t)  # noqa: SLF001
  h0 = (
    jnp.zeros((b, n, hd, s), jnp.float32)
    if initial_state is None
    else initial_state.astype(jnp.float32)
  )
  seg_BT = ssm_ops.segment_index(segment_ids, b, t)
  q = min(chunk_size, t)
  limit = tuple(float(v) for v in time_step_limit)

  def pure(x, dt, A, B, C, D, h0, valid, segment_ids):
    return ssm_ops.ssd(
      x,
      dt,
      A,
      B,
      C,
      D,
      chunk_size=chunk_size,
      time_step_limit=limit,
      initial_state=h0,
      return_state=True,
      valid=valid,
      segment_ids=segment_ids,
    )

  # The masks are arguments, not closed over: a custom_vjp closing over traced arrays leaves them
  # as constants of its jaxpr, which no lowering takes once it sits in a scan (layers scanned,
  # ``jax.lax.scan``): "No constant handler for type: DynamicJaxprTracer".
  @jax.custom_vjp
  def run(x, dt, A, B, C, D, h0, valid, segment_ids, seg_BT):
    dt32 = ssm_ops._masked_dt(ssm_ops._clamped_dt(dt, limit), valid, b, t)  # noqa: SLF001
    y, h_end = _forward(x, dt32, A, B, C, h0, seg_BT, q, interpret)
    if D is not None:
      y = y + x.astype(jnp.float32) * D.astype(jnp.float32)[:, None]
    return y, h_end

  def fwd(*args):
    return run(*args), args

  def bwd(args, cotangents):  # the gradient of the pure form, recomputed; none for the masks
    *diff, valid, segment_ids, _ = args
    grads = jax.vjp(lambda *d: pure(*d, valid, segment_ids), *diff)[1](cotangents)
    return (*grads, None, None, None)

  run.defvjp(fwd, bwd)
  y, h_end = run(x, dt, A, B, C, D, h0, valid, segment_ids, seg_BT)
  return (y, h_end) if return_state else y
