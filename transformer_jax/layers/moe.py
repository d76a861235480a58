"""A mixture-of-experts feed-forward layer: a router, E gated experts (SwiGLU by default) whose
weights are stacked along a leading ``expert`` axis, and optional always-on shared experts.

Dropless by default: every token's k copies are sorted by expert and go through the backend's
grouped product (``Backend.grouped_matmul``: ``jax.lax.ragged_dot``, Megablox on TPU). With a
``capacity_factor`` each expert takes at most ``ceil(factor * N * k / E)`` copies in a dense
``[E, C, D]`` buffer; the rest are dropped (their weight lost, the residual carries the token)
and counted.
"""

from __future__ import annotations

import dataclasses
from typing import Literal

import jax
import jax.numpy as jnp
from flax import nnx
from jax.sharding import Mesh

from transformer_jax import backends, ops
from transformer_jax.layers.common import normal, param
from transformer_jax.layers.dense import Projection
from transformer_jax.layers.mlp import MLP
from transformer_jax.ops import moe as moe_ops
from transformer_jax.parallel import axes as ax
from transformer_jax.parallel import experts as expert_parallel


@dataclasses.dataclass(frozen=True, slots=True)
class MoEKind:
  """A block's mixture of experts (``BlockConfig.moe``)."""

  num_experts: int
  top_k: int  # experts per token
  d_ff: int  # each expert's hidden width
  num_shared: int = 0  # shared experts, run on every token (one MLP of num_shared * shared_d_ff)
  shared_d_ff: int = 0
  scoring: moe_ops.Scoring = "softmax"
  normalize: bool = True  # the k weights renormalised to sum to 1
  num_groups: int = 1  # group-limited routing (sigmoid scoring)
  topk_groups: int = 1
  routed_scale: float = 1.0  # multiplies the routed experts' weights
  capacity_factor: float | None = None  # None: dropless
  impl: Literal["grouped", "dense"] = "grouped"  # dense: every expert on every token (reference)


class MoE(nnx.Module):
  """``y = sum_j w_j * expert_{e_j}(x) (+ shared(x))`` over each token's k chosen experts."""

  def __init__(
    self,
    d_model: int,
    kind: MoEKind,
    *,
    activation: ops.Activation,
    init_std: float,
    out_init_std: float,
    dtype: jnp.dtype,
    param_dtype: jnp.dtype,
    rngs: nnx.Rngs,
    backend: backends.Backend | None = None,
    mesh: Mesh | None = None,
  ):
    """``mesh``: where the layer runs; with an ``expert`` axis the experts are split over it and
    the tokens exchanged by all-to-all (``parallel.experts``)."""
    ops.get_activation(activation)
    self.kind = kind
    self.mesh = mesh
    self.activation = activation
    self.dtype = dtype
    self.backend = backend = backend or backends.current()
    e, f = kind.num_experts, kind.d_ff
    # The router's logits: Mixtral's ``gate`` (no bias); its columns are experts, not split.
    self.router = Projection(
      "BTD,DE->BTE",
      (d_model, e),
      (ax.EMBED, None),
      init_std=init_std,
      dtype=dtype,
      param_dtype=param_dtype,
      rngs=rngs,
      backend=backend,
    )
    expert_in = (ax.EXPERT, ax.EMBED, ax.MLP)
    self.gate = param(rngs, normal(init_std), (e, d_model, f), expert_in, param_dtype)
    self.up = param(rngs, normal(init_std), (e, d_model, f), expert_in, param_dtype)
    self.down = param(
      rngs, normal(out_init_std), (e, f, d_model), (ax.EXPERT, ax.MLP, ax.EMBED), param_dtype
    )
    self.shared = (
      MLP(
        d_model,
        kind.num_shared * kind.shared_d_ff,
        activation=activation,
        gated=True,
        use_bias=False,
        init_std=init_std,
        out_init_std=out_init_std,
        dtype=dtype,
        param_dtype=param_dtype,
        rngs=rngs,
        backend=backend,
      )
      if kind.num_shared
      else None
    )
    # LoRA adapters of the expert weights by name ("gate", "up", "down"): lora.ExpertAdapter.
    self.adapters = nnx.data({})

  def weights(self) -> tuple[jax.Array, jax.Array, jax.Array]:
    """The experts' (gate, up, down) weights, each with its LoRA update where it has one."""
    out = []
    for name in ("gate", "up", "down"):
      w = getattr(self, name)[...]
      adapter = self.adapters.get(name)
      out.append(w if adapter is None else w + adapter.delta().astype(w.dtype))
    return tuple(out)

  def __call__(self, x_BTD: jax.Array) -> tuple[jax.Array, dict[str, jax.Array]]:
    """The layer on ``x`` ``[B, T, D]``.

    Returns:
      ``(y [B, T, D], stats)``: ``stats`` holds float32 ``load_balancing`` and ``z`` losses
      (``ops.moe``), ``tokens_per_expert`` ``[E]`` and ``dropped`` (copies over capacity).
    """
    k = self.kind
    b, t, d = x_BTD.shape
    x_ND = x_BTD.reshape(b * t, d)
    logits_NE = self.router(x_BTD).reshape(b * t, k.num_experts)
    r = moe_ops.route(
      logits_NE,
      top_k=k.top_k,
      scoring=k.scoring,
      normalize=k.normalize,
      num_groups=k.num_groups,
      topk_groups=k.topk_groups,
      scale=k.routed_scale,
    )
    dropped = jnp.zeros((), jnp.float32)
    if k.impl == "dense":
      y_ND = self._dense(x_ND, r)
    elif k.capacity_factor is None:
      y_ND = self._dropless(x_ND, r)
    else:
      y_ND, dropped = self._capacity(x_ND, r)
    y_BTD = y_ND.reshape(b, t, d).astype(self.dtype)
    if self.shared is not None:
      y_BTD = y_BTD + self.shared(x_BTD)
    stats = {
      "load_balancing": moe_ops.load_balancing_loss(r.probs_NE, r.experts_Nk),
      "z": moe_ops.router_z_loss(logits_NE),
      "tokens_per_expert": moe_ops.tokens_per_expert(r.experts_Nk, k.num_experts),
      "dropped": dropped,
    }
    return y_BTD, stats

  def _experts(self, x_MD, group_sizes_E, weights=None) -> jax.Array:
    """The SwiGLU experts on rows sorted by expert: ``[M, D]`` (``weights``: (gate, up, down),
    default this layer's)."""
    gate, up, down = weights or self.weights()
    gmm = self.backend.grouped_matmul
    g_MF = gmm(x_MD, gate, group_sizes_E, dtype=self.dtype)
    u_MF = gmm(x_MD, up, group_sizes_E, dtype=self.dtype)
    h_MF = self.backend.activate(self.activation, g_MF, u_MF, dtype=self.dtype)
    return gmm(h_MF, down, group_sizes_E, dtype=self.dtype)

  def _dropless(self, x_ND, r: moe_ops.Routing) -> jax.Array:
    if expert_parallel.expert_shards(self.mesh) > 1:
      return expert_parallel.expert_parallel_ffn(
        x_ND, r.experts_Nk, r.weights_Nk, self.weights(), mesh=self.mesh, experts_fn=self._experts
      )
    srt = moe_ops.sort_by_expert(r.experts_Nk, self.kind.num_experts)
    y_MD = self._experts(moe_ops.permute(x_ND, srt, self.kind.top_k), srt.group_sizes_E)
    return moe_ops.unsort(y_MD, srt, r.weights_Nk)

  def _expert_products(self, x_ECD) -> jax.Array:
    """Every expert on its own rows: ``[E, C, D]`` -> ``[E, C, D]``."""
    dt = self.dtype
    w = dict(zip(("gate", "up", "down"), (x.astype(dt) for x in self.weights())))
    x_ECD = x_ECD.astype(dt)
    g_ECF = jnp.einsum("ECD,EDF->ECF", x_ECD, w["gate"])
    u_ECF = jnp.einsum("ECD,EDF->ECF", x_ECD, w["up"])
    h_ECF = self.backend.activate(self.activation, g_ECF, u_ECF, dtype=dt)
    return jnp.einsum("ECF,EFD->ECD", h_ECF, w["down"])

  def _dense(self, x_ND, r: moe_ops.Routing) -> jax.Array:
    """Every expert on every token, the unchosen weighted 0 (a reference; E times the work)."""
    e = self.kind.num_experts
    y_END = self._expert_products(jnp.broadcast_to(x_ND, (e, *x_ND.shape)))
    w_NE = jnp.einsum("Nk,NkE->NE", r.weights_Nk, jax.nn.one_hot(r.experts_Nk, e))
    return jnp.einsum("END,NE->ND", y_END, w_NE.astype(y_END.dtype))

  def _capacity(self, x_ND, r: moe_ops.Routing) -> tuple[jax.Array, jax.Array]:
    """Copies into per-expert buffers of the capacity (overflow dropped); ``(y, dropped)``."""
    n, d = x_ND.shape
    e, top_k = self.kind.num_experts, self.kind.top_k
    cap = moe_ops.capacity(n, top_k, e, self.kind.capacity_factor)
    slot_Nk, kept_Nk = moe_ops.capacity_slots(r.experts_Nk, e, cap)
    x_NkD = jnp.broadcast_to(x_ND[:, None, :], (n, top_k, d))
    # One spare row per expert takes the dropped copies; it is sliced off.
    buf_ECD = jnp.zeros((e, cap + 1, d), x_ND.dtype).at[r.experts_Nk, slot_Nk].set(x_NkD)
    y_ECD = self._expert_products(buf_ECD[:, :cap])
    y_ECD = jnp.pad(y_ECD, ((0, 0), (0, 1), (0, 0)))
    y_NkD = y_ECD[r.experts_Nk, slot_Nk]
    w_Nk = (r.weights_Nk * kept_Nk).astype(y_NkD.dtype)
    dropped = jnp.sum(~kept_Nk).astype(jnp.float32)
    return jnp.einsum("NkD,Nk->ND", y_NkD, w_Nk), dropped
