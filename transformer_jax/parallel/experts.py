"""Expert parallelism: a mixture of experts' weights split over the ``expert`` mesh axis, the
tokens' routed copies exchanged by all-to-all.

Each device routes its own tokens (the batch is split over ``expert`` as over the data axes),
sorts their ``n * k`` copies by expert, and sends device j the copies for j's ``E / ep`` experts;
each device runs its experts on what it received (one grouped product per weight) and sends the
results back, where they are weighed and summed per token. The exchange is dropless: a device's
send buffer holds ``ep`` chunks of ``n * k`` rows (the most one device can receive from it), so
no routing can overflow it; ``jax.lax.all_to_all`` needs equal chunks, and the unused rows travel
as padding (``ragged_all_to_all`` would send only the used ones, on the platforms that have it).
"""

from __future__ import annotations

from collections.abc import Callable

import jax
import jax.numpy as jnp
from jax.sharding import Mesh, PartitionSpec as P

from transformer_jax.ops import moe as moe_ops

EXPERT = "expert"
TOKEN_AXES = ("data", "fsdp", EXPERT)  # the mesh axes a batch's tokens are split over


def expert_shards(mesh: Mesh | None) -> int:
  """How many devices ``mesh`` splits the experts over (1: no mesh or no ``expert`` axis)."""
  return 1 if mesh is None else mesh.shape.get(EXPERT, 1)


def _device_ffn(x_nD, experts_nk, weights_nk, weights, *, experts_fn, num_experts, ep):
  """One device's part (inside ``shard_map``): its tokens in, their expert outputs out."""
  n, k = experts_nk.shape
  m = n * k
  local = num_experts // ep
  srt = moe_ops.sort_by_expert(experts_nk, num_experts)
  x_mD = moe_ops.permute(x_nD, srt, k)  # copies in expert order: destination devices in order
  sizes_JL = srt.group_sizes_E.reshape(ep, local)  # copies for device j's l-th expert
  count_J = jnp.sum(sizes_JL, axis=1)
  start_J = jnp.cumsum(count_J) - count_J
  r_m = jnp.arange(m)
  idx_Jm = jnp.minimum(start_J[:, None] + r_m[None, :], m - 1)
  valid_Jm = r_m[None, :] < count_J[:, None]
  send_JmD = jnp.where(valid_Jm[..., None], x_mD[idx_Jm], 0).astype(x_nD.dtype)
  # Chunk j goes to device j; chunk i of the result came from device i.
  recv_ImD = jax.lax.all_to_all(send_JmD, EXPERT, 0, 0, tiled=True)
  recv_sizes_IL = jax.lax.all_to_all(sizes_JL, EXPERT, 0, 0, tiled=True)
  # Each received chunk is sorted by this device's experts; rows past its count are padding.
  ends_IL = jnp.cumsum(recv_sizes_IL, axis=1)
  expert_Im = jax.vmap(lambda e: jnp.searchsorted(e, r_m, side="right"))(ends_IL)
  flat = expert_Im.reshape(-1)  # == local for padding: sorted after every real row
  order = jnp.argsort(flat, stable=True)
  group_sizes_L = jnp.sum(recv_sizes_IL, axis=0).astype(jnp.int32)
  y_sorted = experts_fn(recv_ImD.reshape(ep * m, -1)[order], group_sizes_L, weights)
  y_ImD = jnp.zeros_like(y_sorted).at[order].set(y_sorted).reshape(ep, m, -1)
  back_JmD = jax.lax.all_to_all(y_ImD, EXPERT, 0, 0, tiled=True)
  # Copy p (expert order) went to device e // local as row p - start there.
  dest_m = jnp.repeat(jnp.arange(ep), count_J, total_repeat_length=m)
  y_mD = back_JmD[dest_m, r_m - start_J[dest_m]]
  return moe_ops.unsort(y_mD, srt, weights_nk)


def expert_parallel_ffn(
  x_ND: jax.Array,
  experts_Nk: jax.Array,
  weights_Nk: jax.Array,
  weights: tuple[jax.Array, ...],
  *,
  mesh: Mesh,
  experts_fn: Callable,
) -> jax.Array:
  """The routed experts' output ``[N, D]`` with the experts split over ``mesh``'s ``expert`` axis.

  Args:
    x_ND: the tokens ``[N, D]``.
    experts_Nk, weights_Nk: their routing (``ops.moe.route``).
    weights: the experts' stacked weights, each ``[E, ...]`` (split over ``expert`` along E).
    mesh: a mesh with an ``expert`` axis that divides E; N must divide over the token axes.
    experts_fn: ``experts_fn(x_MD, group_sizes_L, local_weights) -> y_MD``: a device's experts on
      rows sorted by (local) expert.

  Raises:
    ValueError: E or N not divisible by the mesh's axes (the numbers named).
  """
  ep = expert_shards(mesh)
  e = weights[0].shape[0]
  if e % ep:
    raise ValueError(f"num_experts={e} is not divisible by mesh.expert={ep}")
  axes = tuple(a for a in TOKEN_AXES if mesh.shape.get(a, 1) > 1)
  shards = 1
  for a in axes:
    shards *= mesh.shape[a]
  if x_ND.shape[0] % shards:
    raise ValueError(
      f"{x_ND.shape[0]} tokens do not divide over the {shards} devices of mesh axes {axes}"
    )
  tok = P(axes or None)
  w_specs = tuple(P(EXPERT) for _ in weights)

  def device(x, ex, w, ws):
    return _device_ffn(x, ex, w, ws, experts_fn=experts_fn, num_experts=e, ep=ep)

  return jax.shard_map(
    device, mesh=mesh, in_specs=(tok, tok, tok, w_specs), out_specs=tok, check_vma=False
  )(x_ND, experts_Nk, weights_Nk, tuple(weights))


def exchange_report(config, mesh_shape: dict[str, int], batch_size: int, seq_len: int) -> dict:
  """What a train step's mixture-of-experts layers hold and send per device (the dry run's
  ``experts`` entry); ``{}`` for a model without experts.

  ``tokens``: a device's tokens per layer; ``send_rows``: the rows of its all-to-all send buffer
  ``[ep, n * k, D]`` (1 device: no exchange); ``exchange_bytes``: that buffer, sent and received
  once forward and once back per layer (and again in the backward pass).
  """
  e = getattr(config, "num_experts", 0)
  if not e:
    return {}
  ep = mesh_shape.get(EXPERT, 1)
  token_shards = 1
  for a in TOKEN_AXES:
    token_shards *= mesh_shape.get(a, 1)
  n = batch_size * seq_len // max(token_shards, 1)
  rows = ep * n * config.experts_per_token if ep > 1 else 0
  width = jax.numpy.dtype(config.dtype).itemsize * config.d_model
  return {
    "experts": e,
    "per_device": e // ep,
    "expert_shards": ep,
    "top_k": config.experts_per_token,
    "tokens": n,
    "send_rows": rows,
    "exchange_bytes": rows * width,
  }
