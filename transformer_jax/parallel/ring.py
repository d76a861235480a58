"""Ring attention: exact self-attention with the sequence axis sharded over a mesh axis.

Sequence (context) parallelism for long inputs. The length axis of ``q``, ``k`` and ``v`` is
split into ``n`` equal blocks over the mesh axis ``seq_axis``; device ``i`` keeps query block ``i``
for the whole computation and sees every key/value block in turn. At each of the ``n`` steps it
attends its queries to the key/value block it currently holds, folds the result into a streaming
(flash-style) float32 softmax (running max, running denominator, running numerator), and passes
the block on to the next device of the ring with ``jax.lax.ppermute``. After ``n`` steps every
query has met every key, and the result equals ``ops.dot_product_attention`` on the unsharded
arrays up to float rounding.

Each step is the block step of the chunked kernel (``ops.chunked``: block scores with the mask
evaluated from global positions and ids, online softmax update), so the two share one copy of the
softmax and mask code. The gradient is a ``jax.custom_vjp`` over the whole ring, as in the chunked
kernel: the forward saves only the output and the per-row log-sum-exp, and the backward sends the
key/value blocks around the ring again together with their gradients ``dk, dv``, to which every
device adds its share before passing them on; after ``n`` hops they are home.

Memory: the logits a device holds at any step are ``[B, N, T/n, T/n]`` instead of the
``[B, N, T, T]`` of full attention, i.e. O((T/n)^2) rather than O(T^2) per device, and the
key/value blocks it holds are O(T/n). Between the passes it keeps its own q, k, v, output and
log-sum-exp: O(T/n), with no quadratic term.

Causal masking uses global positions: with ``T == S`` the block that device ``i`` holds at step
``s`` started on device ``(i - s) mod n``, so it lies entirely in the past (``0 < s <= i``: no
mask), on the diagonal (step 0: a lower-triangular mask) or entirely in the future (``s > i``:
skipped with ``lax.cond``). Devices late in the ring therefore do more work than early ones; a
striped or zig-zag token layout would balance that, at the price of a permuted sequence layout.

Letters as in ``ops/attention.py``: B batch, T query length, S key length (== T here), N query
heads, K key/value heads, G = N // K, H head dim.
"""

from __future__ import annotations

import dataclasses
import functools
from collections.abc import Sequence

import jax
import jax.numpy as jnp
from jax.sharding import PartitionSpec as P

from transformer_jax.ops import chunked, precision
from transformer_jax.ops.attention import check_qkv

__all__ = ["ring_attention"]


def _check_inputs(
  q_BTNH: jax.Array,
  k_BSKH: jax.Array,
  v_BSKH: jax.Array,
  kv_mask_BS: jax.Array | None,
  segment_ids_BT: jax.Array | None,
) -> None:
  check_qkv(q_BTNH, k_BSKH, v_BSKH)
  (b, t), s = q_BTNH.shape[:2], k_BSKH.shape[1]
  if t != s:
    raise ValueError(
      f"ring attention is self-attention: query length T={t} must equal key length S={s}"
    )
  if kv_mask_BS is not None and kv_mask_BS.shape != (b, s):
    raise ValueError(f"kv_mask_BS.shape={kv_mask_BS.shape} must be [B, S] = {(b, s)}")
  if segment_ids_BT is not None and segment_ids_BT.shape != (b, t):
    raise ValueError(f"segment_ids_BT.shape={segment_ids_BT.shape} must be [B, T] = {(b, t)}")


def _varying_like(tree, ref: jax.Array):
  """Marks fresh constants (loop carries' initial values) as varying over the mesh axes ``ref``
  varies over, as ``shard_map`` requires of a carry that the loop makes varying."""
  aval = jax.typeof(ref)
  axes = getattr(aval, "vma", None)  # older JAX; newer ones keep it in the manual axis type
  axes = tuple(sorted(aval.mat.varying if axes is None else axes))
  if not axes:
    return tree
  return jax.tree.map(lambda x: jax.lax.pcast(x, axes, to="varying"), tree)


@dataclasses.dataclass(frozen=True)
class _Ring:
  """The ring's static parts: the mesh axis it runs over, its size, and the attention's
  (``chunked.Static``)."""

  seq_axis: str
  axis_size: int
  st: chunked.Static

  def perm(self) -> list[tuple[int, int]]:
    """Send to the next device: at step s a device holds the block of device (i - s) mod n."""
    return [(j, (j + 1) % self.axis_size) for j in range(self.axis_size)]

  def block(self, s, t: int, q_seg, kv_mask, kv_seg) -> chunked.Block:
    """The positions and ids of the key/value block a device holds at step ``s``."""
    my_block = jax.lax.axis_index(self.seq_axis)
    src = (my_block - s) % self.axis_size  # where the block held at step s started
    return chunked.Block(
      q_pos=(my_block * t + jnp.arange(t, dtype=jnp.int32))[None],
      k_pos=src * t + jnp.arange(t, dtype=jnp.int32),
      kv_valid=kv_mask,
      q_seg=q_seg,
      kv_seg=kv_seg,
    )

  def visit(self, s, step_fn, skip_fn, *args):
    """Runs a block step, or under ``causal`` skips a block that lies entirely in the future (it
    started on a later device): devices late in the ring do more work than early ones."""
    if not self.st.causal:
      return step_fn(*args)
    my_block = jax.lax.axis_index(self.seq_axis)
    return jax.lax.cond((my_block - s) % self.axis_size <= my_block, step_fn, skip_fn, *args)


def _ring_body(
  q_BTNH: jax.Array,
  k_BSKH: jax.Array,
  v_BSKH: jax.Array,
  kv_mask_BS: jax.Array | None,
  seg_BT: jax.Array | None,
  *,
  seq_axis: str,
  axis_size: int,
  causal: bool,
  scale: float,
) -> jax.Array:
  """Per-device program (inside ``shard_map``): local blocks in, local output block out.

  The forward and backward block steps are the chunked kernel's (``ops.chunked``); only the
  schedule differs: the key/value blocks come from the ring instead of a loop over slices."""
  ring = _Ring(seq_axis, axis_size, chunked.Static(scale=scale, causal=causal))
  # The backward is traced after the forward's precision scope has closed (ops/precision.py).
  return _ring(ring, precision.current(), q_BTNH, k_BSKH, v_BSKH, kv_mask_BS, seg_BT)


def _forward(ring: _Ring, q_BTNH, k_BSKH, v_BSKH, kv_mask_BS, seg_BT):
  """Output ``[B, T, N, H]`` and log-sum-exp ``[B, K, G, T]`` of the local query block."""
  b, t, n, h = q_BTNH.shape
  kh = k_BSKH.shape[2]
  g = n // kh
  q_BTKGH = q_BTNH.reshape(b, t, kh, g, h)

  def attend(s, state, blocks):
    k_blk, v_blk, kvm_blk, seg_blk = blocks
    blk = ring.block(s, t, seg_BT, kvm_blk, seg_blk)
    return ring.visit(
      s,
      lambda st_: chunked.online_update(st_, q_BTKGH, k_blk, v_blk, blk, ring.st),
      lambda st_: st_,
      state,
    )

  def step(carry, s):
    state, blocks = carry
    # Pass the block on before attending to it, so that communication can overlap compute.
    next_blocks = jax.lax.ppermute(blocks, ring.seq_axis, ring.perm())
    return (attend(s, state, blocks), next_blocks), None

  blocks = (k_BSKH, v_BSKH, kv_mask_BS, seg_BT)
  state = _varying_like(chunked.initial_state(b, kh, g, t, h), q_BTNH)
  (state, blocks), _ = jax.lax.scan(step, (state, blocks), jnp.arange(ring.axis_size - 1))
  state = attend(ring.axis_size - 1, state, blocks)  # the last block is not sent on again
  out_BKGTH, lse_BKGT = chunked.finish(state)
  out_BTNH = out_BKGTH.transpose(0, 3, 1, 2, 4).reshape(b, t, n, h).astype(q_BTNH.dtype)
  return out_BTNH, lse_BKGT


# (The custom_vjp's functions look the device index up themselves: they must not close over
# values traced outside them.)
@functools.partial(jax.custom_vjp, nondiff_argnums=(0, 1))
def _ring(ring: _Ring, matmul_precision: str | None, q_BTNH, k_BSKH, v_BSKH, kv_mask_BS, seg_BT):
  return _forward(ring, q_BTNH, k_BSKH, v_BSKH, kv_mask_BS, seg_BT)[0]


def _ring_fwd(ring, matmul_precision, q_BTNH, k_BSKH, v_BSKH, kv_mask_BS, seg_BT):
  out_BTNH, lse_BKGT = _forward(ring, q_BTNH, k_BSKH, v_BSKH, kv_mask_BS, seg_BT)
  return out_BTNH, (q_BTNH, k_BSKH, v_BSKH, kv_mask_BS, seg_BT, out_BTNH, lse_BKGT)


def _ring_bwd(ring, matmul_precision, res, do_BTNH):
  with jax.default_matmul_precision(matmul_precision):  # the forward's (ops/precision.py)
    return _ring_grads(ring, res, do_BTNH)


def _ring_grads(ring: _Ring, res, do_BTNH):
  """The key/value blocks go around the ring once more, now with their gradients ``dk, dv``,
  which every device adds to; after ``n`` hops they are back on the device that owns them."""
  q_BTNH, k_BSKH, v_BSKH, kv_mask_BS, seg_BT, out_BTNH, lse_BKGT = res
  b, t, n, h = q_BTNH.shape
  kh = k_BSKH.shape[2]
  g = n // kh
  q_BTKGH = q_BTNH.reshape(b, t, kh, g, h)
  do_BTKGH = do_BTNH.reshape(b, t, kh, g, h)
  delta_BTKG = chunked.output_delta(do_BTKGH, out_BTNH.reshape(b, t, kh, g, h))
  delta_BKGT = delta_BTKG.transpose(0, 2, 3, 1)

  def step(carry, s):
    dq, blocks, grads = carry
    k_blk, v_blk, kvm_blk, seg_blk = blocks
    blk = ring.block(s, t, seg_BT, kvm_blk, seg_blk)

    def grad_step(dq, grads):
      dq_i, dk_i, dv_i, _ = chunked.block_grads(
        q_BTKGH, k_blk, v_blk, do_BTKGH, lse_BKGT, delta_BKGT, blk, ring.st
      )
      return dq + dq_i, (grads[0] + dk_i, grads[1] + dv_i)

    dq, grads = ring.visit(s, grad_step, lambda dq, grads: (dq, grads), dq, grads)
    blocks, grads = jax.lax.ppermute((blocks, grads), ring.seq_axis, ring.perm())
    return (dq, blocks, grads), None

  zeros = _varying_like(jnp.zeros(k_BSKH.shape, jnp.float32), k_BSKH)
  init = (
    _varying_like(jnp.zeros(q_BTKGH.shape, jnp.float32), q_BTNH),
    (k_BSKH, v_BSKH, kv_mask_BS, seg_BT),
    (zeros, zeros),
  )
  (dq, _, (dk, dv)), _ = jax.lax.scan(step, init, jnp.arange(ring.axis_size))
  return (
    dq.reshape(b, t, n, h).astype(q_BTNH.dtype),
    dk.astype(k_BSKH.dtype),
    dv.astype(v_BSKH.dtype),
    None,
    None,
  )


_ring.defvjp(_ring_fwd, _ring_bwd)


def _axis_sizes(mesh: jax.sharding.Mesh | jax.sharding.AbstractMesh) -> dict[str, int]:
  return dict(zip(mesh.axis_names, mesh.axis_sizes))


def ring_attention(
  q_BTNH: jax.Array,
  k_BSKH: jax.Array,
  v_BSKH: jax.Array,
  *,
  mesh: jax.sharding.Mesh | jax.sharding.AbstractMesh | None = None,
  seq_axis: str = "sequence",
  causal: bool = False,
  kv_mask_BS: jax.Array | None = None,
  segment_ids_BT: jax.Array | None = None,
  scale: float | None = None,
  batch_axes: Sequence[str] | None = ("data", "fsdp"),
  head_axis: str | None = "tensor",
) -> jax.Array:
  """Self-attention ``softmax(scale * q k^T, masked) v`` with the length axis sharded over a ring.

  Computes what ``ops.dot_product_attention(q, k, v, mask=..., causal=causal, scale=scale)``
  computes (multi-, multi-query and grouped-query heads; float32 softmax; a query with no valid key
  gives zeros), but with ``T`` split into equal blocks over the mesh axis ``seq_axis`` and the
  key/value blocks passed around the ring (see the module docstring). Gradients work through it.

  It wraps a ``jax.shard_map`` and is meant to be called on global arrays, eagerly or inside
  ``jit`` under GSPMD: on a mesh of ``Auto`` axes (``jax.sharding.Mesh``'s default, which the
  package's meshes use) arrays sharded otherwise are resharded to ``[batch_axes, seq_axis,
  head_axis, -]`` on the way in and the output comes back sharded that way; on a mesh with
  ``Explicit`` axes (``jax.make_mesh``'s default) the inputs are resharded explicitly and the output
  is returned sharded like ``q``. Sharding the activations' length over ``seq_axis`` upstream
  (logical axis ``length`` -> ``sequence``) makes both reshardings no-ops. An attention layer
  (``layers.Attention``) calls it instead of ``ops.dot_product_attention`` for self-attention
  without a key/value cache, a bias function or attention dropout, when the mesh it was built with
  has a ``sequence`` axis, after RoPE (positions must be the global ones, which ``jnp.arange(T)``
  on the global array already is). Dense ``[B, N, T, S]`` masks and additive biases (ALiBi, T5
  buckets) are not supported: express padding as ``kv_mask_BS`` and packing as ``segment_ids_BT``.

  Args:
    q_BTNH: queries ``[B, T, N, H]``.
    k_BSKH: keys ``[B, S, K, H]`` with ``S == T`` and ``N % K == 0``.
    v_BSKH: values ``[B, S, K, H]``.
    mesh: the device mesh; default the one set by ``jax.set_mesh``.
    seq_axis: mesh axis the length is split over; ``T`` must be a multiple of its size.
    causal: query ``i`` attends only to keys ``j <= i`` (global positions).
    kv_mask_BS: optional ``[B, S]`` bool (or 0/1), True for real keys; padded keys get no weight.
    segment_ids_BT: optional ``[B, T]`` int ids of packed sequences; tokens attend only within
      their own segment (``ops.segment_mask``).
    scale: logits scale; default ``1 / sqrt(H)``.
    batch_axes: mesh axes (or one axis) the batch is sharded over. Names the mesh lacks are left
      out; ``B`` must be a multiple of the product of the sizes of the others.
    head_axis: mesh axis the heads are sharded over, if the mesh has it. It is used only when
      ``K`` is a multiple of its size (``N`` then is too); otherwise (e.g. MQA under tensor
      parallelism) heads are replicated over it and each device computes all of them.

  Returns:
    ``[B, T, N, H]`` in q's dtype, sharded ``[batch_axes, seq_axis, head_axis, -]`` (like ``q`` on
    an ``Explicit`` mesh).

  Raises:
    ValueError: on inconsistent shapes, a missing ``seq_axis``, a ``seq_axis`` also named in
      ``batch_axes``/``head_axis``, or a length or batch not divisible by its mesh axes.
  """
  _check_inputs(q_BTNH, k_BSKH, v_BSKH, kv_mask_BS, segment_ids_BT)
  if mesh is None:
    mesh = jax.sharding.get_abstract_mesh()
    if mesh.empty:
      raise ValueError("ring_attention needs a mesh: pass mesh= or call it under jax.set_mesh")
  sizes = _axis_sizes(mesh)
  if seq_axis not in sizes:
    raise ValueError(f"seq_axis={seq_axis!r} is not an axis of the mesh {tuple(sizes)}")
  if isinstance(batch_axes, str):
    batch_axes = (batch_axes,)
  batch_axes = tuple(a for a in (batch_axes or ()) if a in sizes)
  if seq_axis in batch_axes or seq_axis == head_axis:
    raise ValueError(
      f"seq_axis={seq_axis!r} cannot also be a batch axis {batch_axes} or the head axis "
      f"{head_axis!r}"
    )

  b, t, n, h = q_BTNH.shape
  kh = k_BSKH.shape[2]
  axis_size = sizes[seq_axis]
  if t % axis_size:
    raise ValueError(
      f"sequence length T={t} is not divisible by the size {axis_size} of mesh axis {seq_axis!r}"
    )
  batch_size = 1
  for a in batch_axes:
    batch_size *= sizes[a]
  if b % batch_size:
    raise ValueError(
      f"batch B={b} is not divisible by {batch_size}, the size of mesh axes {batch_axes}"
    )
  head = head_axis if head_axis in sizes and kh % sizes[head_axis] == 0 else None

  batch = batch_axes if batch_axes else None
  x_spec = P(batch, seq_axis, head, None)
  bt_spec = P(batch, seq_axis)
  if kv_mask_BS is not None:
    kv_mask_BS = kv_mask_BS.astype(bool)
  body = functools.partial(
    _ring_body,
    seq_axis=seq_axis,
    axis_size=axis_size,
    causal=causal,
    scale=h**-0.5 if scale is None else scale,
  )
  mapped = jax.shard_map(
    body, mesh=mesh, in_specs=(x_spec, x_spec, x_spec, bt_spec, bt_spec), out_specs=x_spec
  )
  args = (q_BTNH, k_BSKH, v_BSKH, kv_mask_BS, segment_ids_BT)
  if jax.sharding.AxisType.Explicit not in mesh.axis_types:
    return mapped(*args)  # Auto axes: GSPMD reshards the inputs to the specs.
  # Explicit axes: shard_map takes arguments already sharded as in_specs; hand the output back
  # sharded like q, as a drop-in for ops.dot_product_attention.
  q_spec = jax.typeof(q_BTNH).sharding.spec
  args = [
    None if a is None else jax.sharding.reshard(a, jax.sharding.NamedSharding(mesh, spec))
    for a, spec in zip(args, (x_spec, x_spec, x_spec, bt_spec, bt_spec))
  ]
  out_BTNH = mapped(*args)
  return jax.sharding.reshard(out_BTNH, jax.sharding.NamedSharding(mesh, q_spec))
