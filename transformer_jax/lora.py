"""LoRA (Hu et al., 2021) on the einsum projections of any family, with Flax NNX's own pieces.

``add_adapters(model, rank=, alpha=, targets=)`` gives every targeted ``Projection`` an
``Adapter``: an ``nnx.LoRA`` (``nnx.LoRAParam`` A ``[in, r]``, He-uniform, and B ``[r, out]``,
zeros) over the projection's flattened input and output dims, so a ``[D, N, H]`` query kernel keeps
its shape and the adapter sees it as ``[D, N*H]``. The projection then computes
``x W + (alpha / r) (x A) B``; with B zero the adapted model equals the base model exactly.
Stacked blocks (``layers.Stack``) get stacked adapters (a leading ``layers`` axis), scanned with
the blocks.

Only ``nnx.LoRAParam`` (and a classification head) are trained: :data:`TRAINABLE` is the filter,
``split(model)`` returns ``(graphdef, trainable, frozen)``. ``merge(model)`` folds the adapters into
the kernels and removes them: the base architecture again, for export or fast decoding.

Targets: ``query``, ``key``, ``value``, ``out`` (attention, self and cross), ``mlp_in`` (the MLP's
up and gate projections) and ``mlp_out`` (its down projection); Mamba mixers: ``ssm_in``
(``in_proj``), ``ssm_x`` (Mamba-1's ``x_proj``), ``ssm_dt`` (its ``dt_proj``) and ``ssm_out``
(``out_proj``); mixtures of experts: ``router``, ``experts_in`` (every expert's gate and up
weights) and ``experts_out`` (their down weights), one adapter per expert (``ExpertAdapter``).
"""

from __future__ import annotations

import dataclasses
import math
from typing import Any, Sequence

import jax
import jax.numpy as jnp
import numpy as np
from flax import nnx

from transformer_jax import models
from transformer_jax.layers.dense import Projection, einsum_dims
from transformer_jax.layers.moe import MoE
from transformer_jax.parallel import axes as ax

TARGETS = (
  "query",
  "key",
  "value",
  "out",
  "mlp_in",
  "mlp_out",
  "ssm_in",
  "ssm_x",
  "ssm_dt",
  "ssm_out",
  "router",
  "experts_in",
  "experts_out",
)
# Attribute name of a projection in its parent -> target name.
_ATTR_TARGET = {
  ("attn", "query"): "query",
  ("attn", "key"): "key",
  ("attn", "value"): "value",
  ("attn", "out"): "out",
  ("cross_attn", "query"): "query",
  ("cross_attn", "key"): "key",
  ("cross_attn", "value"): "value",
  ("cross_attn", "out"): "out",
  ("mlp", "up"): "mlp_in",
  ("mlp", "gate"): "mlp_in",
  ("mlp", "down"): "mlp_out",
  ("mixer", "in_proj"): "ssm_in",
  ("mixer", "x_proj"): "ssm_x",
  ("mixer", "dt_proj"): "ssm_dt",
  ("mixer", "out_proj"): "ssm_out",
  ("mlp", "router"): "router",
}
# A mixture of experts' stacked weights -> target name.
_EXPERT_TARGET = {"gate": "experts_in", "up": "experts_in", "down": "experts_out"}
# What a LoRA run trains: the adapters and a classification head (new for the task).
TRAINABLE = nnx.Any(nnx.LoRAParam, nnx.PathContains("classifier"))


@dataclasses.dataclass(frozen=True)
class LoRAConfig:
  """``rank`` r, ``alpha`` (the update is scaled by alpha / r) and the projections to adapt."""

  rank: int = 8
  alpha: float = 16.0
  targets: tuple[str, ...] = ("query", "value")

  def __post_init__(self):
    if isinstance(self.rank, bool) or not isinstance(self.rank, int) or self.rank < 1:
      raise ValueError(f"lora.rank={self.rank!r} must be an integer >= 1")
    if not math.isfinite(self.alpha) or self.alpha <= 0:
      raise ValueError(f"lora.alpha={self.alpha!r} must be a positive number")
    if not self.targets:
      raise ValueError("lora.targets is empty; name some of " + ", ".join(TARGETS))
    for t in self.targets:
      if t not in TARGETS:
        raise ValueError(f"lora.targets: {t!r} is not one of {', '.join(TARGETS)}")


class Adapter(nnx.Module):
  """The low-rank update of one ``Projection``: ``(alpha / r) * x A B`` reshaped to its output.

  Holds an ``nnx.LoRA`` (no base module: the projection computes its own part).
  """

  def __init__(self, proj: Projection, rank: int, alpha: float, *, rngs: nnx.Rngs):
    _, k_letters, _ = einsum_dims(proj.einsum)
    n_in = proj.contracted_dims()
    kernel = proj.kernel
    lead = kernel.ndim - len(k_letters)  # stacked layers in front
    shape = tuple(kernel.shape)
    axes = tuple(nnx.get_partition_spec(nnx.state(proj))["kernel"])
    in_dims, out_dims = shape[lead : lead + n_in], shape[lead + n_in :]
    self.in_shape, self.out_shape = in_dims, out_dims
    self.scale = alpha / rank
    d_in, d_out = math.prod(in_dims), math.prod(out_dims)
    self.lora = nnx.LoRA(d_in, rank, d_out, dtype=proj.dtype, param_dtype=kernel.dtype, rngs=rngs)
    # The flattened dims keep the name of their leading (major) axis: a split of it over the mesh
    # is the same split as the kernel's.
    lead_axes = axes[:lead]
    a_axes = (*lead_axes, axes[lead], ax.LORA_RANK)
    b_axes = (*lead_axes, ax.LORA_RANK, axes[lead + n_in])
    if lead:
      init_a = nnx.initializers.he_uniform()
      keys = jax.random.split(rngs.params(), math.prod(shape[:lead]))
      a = jax.vmap(lambda k: init_a(k, (d_in, rank), kernel.dtype))(keys)
      a = a.reshape(*shape[:lead], d_in, rank)
      b = jnp.zeros((*shape[:lead], rank, d_out), kernel.dtype)
    else:
      a, b = self.lora.lora_a[...], self.lora.lora_b[...]
    self.lora.lora_a = nnx.LoRAParam(a, out_sharding=a_axes, eager_sharding=False)
    self.lora.lora_b = nnx.LoRAParam(b, out_sharding=b_axes, eager_sharding=False)

  def __call__(self, x: jax.Array) -> jax.Array:
    n = len(self.in_shape)
    x_flat = x.reshape(*x.shape[: x.ndim - n], -1)
    y = self.lora(x_flat) * jnp.asarray(self.scale, x_flat.dtype)
    return y.reshape(*y.shape[:-1], *self.out_shape)

  def delta(self) -> jax.Array:
    """``(alpha / r) A B`` in the kernel's layout (stacked layers in front)."""
    a, b = self.lora.lora_a[...], self.lora.lora_b[...]
    # A weight, not an activation: full float32 products on every backend (ops/precision.py).
    d = jnp.matmul(a, b, precision=jax.lax.Precision.HIGHEST) * self.scale
    return d.reshape(*d.shape[:-2], *self.in_shape, *self.out_shape)


class ExpertAdapter(nnx.Module):
  """Low-rank updates of a mixture's stacked expert weights ``[..., E, I, O]``: one ``A [I, r]``,
  ``B [r, O]`` per expert (and layer); the layer adds ``(alpha / r) A B`` to each expert's weight
  before its grouped product (``MoE.weights``)."""

  def __init__(self, weight: nnx.Param, rank: int, alpha: float, *, rngs: nnx.Rngs):
    shape, axes = tuple(weight.shape), tuple(weight.get_metadata()["out_sharding"])
    lead, (d_in, d_out) = shape[:-2], shape[-2:]
    self.scale = alpha / rank
    init_a = nnx.initializers.he_uniform()
    keys = jax.random.split(rngs.params(), math.prod(lead))
    a = jax.vmap(lambda k: init_a(k, (d_in, rank), weight.dtype))(keys).reshape(*lead, d_in, rank)
    b = jnp.zeros((*lead, rank, d_out), weight.dtype)
    a_axes = (*axes[:-1], ax.LORA_RANK)
    b_axes = (*axes[:-2], ax.LORA_RANK, axes[-1])
    self.lora_a = nnx.LoRAParam(a, out_sharding=a_axes, eager_sharding=False)
    self.lora_b = nnx.LoRAParam(b, out_sharding=b_axes, eager_sharding=False)

  def delta(self) -> jax.Array:
    """``(alpha / r) A B`` in the weight's layout."""
    d = jnp.matmul(self.lora_a[...], self.lora_b[...], precision=jax.lax.Precision.HIGHEST)
    return d * self.scale


def _targeted(model: nnx.Module, targets: Sequence[str]):
  """``(path, projection)`` of every projection a target names."""
  out = []
  for path, module in nnx.iter_modules(model):
    if isinstance(module, Projection) and len(path) >= 2:
      name = _ATTR_TARGET.get((path[-2], path[-1]))
      if name is not None and name in targets:
        out.append((path, module))
  return out


def add_adapters(model: nnx.Module, config: LoRAConfig, *, rngs: nnx.Rngs) -> nnx.Module:
  """Gives the targeted projections of ``model`` adapters (in place); returns ``model``.

  Raises:
    ValueError: no projection matches the targets, or the model already has adapters.
  """
  found = _targeted(model, config.targets)
  moes = [m for _, m in nnx.iter_modules(model) if isinstance(m, MoE)]
  experts = [n for n, t in _EXPERT_TARGET.items() if t in config.targets]
  if not found and not (moes and experts):
    raise ValueError(
      f"lora.targets={list(config.targets)}: no such projection in this {type(model).__name__}"
    )
  for path, proj in found:
    if proj.lora is not None:
      raise ValueError(f"{'/'.join(map(str, path))} already has a LoRA adapter")
    proj.lora = nnx.data(Adapter(proj, config.rank, config.alpha, rngs=rngs))
  for moe in moes:
    for name in experts:
      if moe.adapters.get(name) is not None:
        raise ValueError(f"the experts' {name} weights already have a LoRA adapter")
    moe.adapters = nnx.data(
      {n: ExpertAdapter(getattr(moe, n), config.rank, config.alpha, rngs=rngs) for n in experts}
    )
  return model


def has_adapters(model: nnx.Module) -> bool:
  return any(isinstance(m, (Adapter, ExpertAdapter)) for _, m in nnx.iter_modules(model))


def merge(model: nnx.Module) -> nnx.Module:
  """Folds every adapter into its projection's kernel (``W + (alpha / r) A B``) and removes it, in
  place; returns ``model``, now the base architecture (same parameter paths and shapes)."""
  for _, proj in list(nnx.iter_modules(model)):
    if isinstance(proj, Projection) and proj.lora is not None:
      kernel = proj.kernel[...]
      proj.kernel[...] = (
        kernel.astype(jnp.float32) + proj.lora.delta().astype(jnp.float32)
      ).astype(kernel.dtype)
      proj.lora = None
  for _, moe in list(nnx.iter_modules(model)):
    if isinstance(moe, MoE) and moe.adapters:
      for name, adapter in moe.adapters.items():
        w = getattr(moe, name)
        w[...] = (w[...].astype(jnp.float32) + adapter.delta().astype(jnp.float32)).astype(w.dtype)
      moe.adapters = nnx.data({})
  return model


def merged_params(graphdef: nnx.GraphDef, trainable, frozen) -> nnx.State:
  """The base model's parameters (adapters folded in) of an adapted model's states."""
  model = merge(nnx.merge(graphdef, trainable, frozen))
  return nnx.state(model, nnx.Param)


def split(model: nnx.Module):
  """``(graphdef, trainable, frozen)``: adapters and head, then every other parameter."""
  return nnx.split(model, TRAINABLE, nnx.Param)


# -------------------------------------------------------------------------------------------------
# Pure-function forms for the trainer (configs in, states out).


def create(model_config, config: LoRAConfig, key: jax.Array, mesh=None, backend=None) -> nnx.Module:
  """The model of ``model_config`` with adapters, built for ``mesh`` and ``backend`` (see
  ``models.create``); the base parameters come from ``key`` exactly as
  ``models.init(model_config, key)`` makes them, the adapters from a key folded from it."""
  model = models.model_class(model_config)(
    model_config, rngs=nnx.Rngs(params=key), mesh=mesh, backend=backend
  )
  return add_adapters(model, config, rngs=nnx.Rngs(params=jax.random.fold_in(key, 0x10A)))


def abstract(model_config, config: LoRAConfig, mesh=None, backend=None) -> nnx.Module:
  return nnx.eval_shape(lambda: create(model_config, config, jax.random.key(0), mesh, backend))


def count(trainable, frozen) -> dict[str, Any]:
  """Parameter counts: trainable, total and the trainable fraction."""
  n_t = sum(int(np.prod(x.shape)) for x in jax.tree.leaves(trainable))
  n_f = sum(int(np.prod(x.shape)) for x in jax.tree.leaves(frozen))
  return {"trainable": n_t, "total": n_t + n_f, "fraction": n_t / max(n_t + n_f, 1)}
