"""The blocks around the Mamba mixers (``layers.mamba``: Mamba-1's selective scan, Mamba-2's SSD),
hybrid stacks that mix them with attention layers by a per-layer list (as Jamba), and the decoding
cache of such a stack (``SSMCache``).

A Mamba block is ``x + mixer(rmsnorm(x))`` (no MLP, as in the papers); an attention block of a
hybrid is ``x + attention(rmsnorm(x))``; with ``d_ff > 0`` every block adds
``x + mlp(rmsnorm(x))`` (Jamba's layers). Parameters are stacked per kind of layer (a leading
``layers`` axis over the Mamba layers, another over the attention layers).
"""

from __future__ import annotations

import dataclasses
import functools
from typing import Literal

import flax.struct
import jax
import jax.numpy as jnp
from flax import nnx
from jax.sharding import Mesh

from transformer_jax import backends, ops
from transformer_jax.layers.attention import Attention
from transformer_jax.layers.cache import KVCache
from transformer_jax.layers.common import split_key
from transformer_jax.layers.dense import Norm, to_decode_layout
from transformer_jax.layers.mamba import MambaKind, MambaMixer
from transformer_jax.layers.mlp import MLP
from transformer_jax.parallel import axes as ax
from transformer_jax.parallel.rules import ACTIVATION_BTD, constrain

# The mixer and its options are exported here too (the blocks' configs name them).
__all__ = [
  "LayerType",
  "MambaKind",
  "MambaMixer",
  "MixerBlock",
  "MixerBlockConfig",
  "MixerStack",
  "SSMCache",
]

LayerType = Literal["mamba", "attention"]

_REMAT_POLICIES = {
  "full": jax.checkpoint_policies.nothing_saveable,
  "dots": jax.checkpoint_policies.dots_with_no_batch_dims_saveable,
}


@dataclasses.dataclass(frozen=True, slots=True)
class MixerBlockConfig:
  """Everything a hybrid stack's blocks need; each model builds one from its own config."""

  d_model: int
  norm_eps: float
  mamba: MambaKind
  residual_in_fp32: bool = True  # the residual stream in float32 whatever the compute dtype
  # Attention layers of a hybrid.
  num_heads: int = 1
  num_kv_heads: int = 1
  head_dim: int = 1
  rope_theta: float | None = None  # None: no positions (Jamba: the Mamba layers carry order)
  attention_impl: ops.Implementation | None = None
  # Every block's MLP when d_ff > 0.
  d_ff: int = 0
  activation: ops.Activation = "silu"
  gated: bool = True
  dropout_rate: float = 0.0  # on each residual branch
  init_std: float = 0.02
  out_init_std: float = 0.02
  dtype: str = "float32"
  param_dtype: str = "float32"


class MixerBlock(nnx.Module):
  """``x + mixer(rmsnorm x)`` (a Mamba mixer or self-attention), then ``x + mlp(rmsnorm x)`` when
  the config has ``d_ff > 0``."""

  def __init__(
    self,
    cfg: MixerBlockConfig,
    layer_type: LayerType,
    *,
    rngs: nnx.Rngs,
    mesh: Mesh | None = None,
    backend: backends.Backend | None = None,
  ):
    """``mesh``: where the block runs; ``backend``: its kernels (default ``backends.current()``)."""
    self.cfg = cfg
    self.layer_type = layer_type
    backend = backend or backends.current()
    dtype, param_dtype = jnp.dtype(cfg.dtype), jnp.dtype(cfg.param_dtype)
    norm = dict(kind="rmsnorm", eps=cfg.norm_eps, param_dtype=param_dtype, rngs=rngs)
    self.norm = Norm(cfg.d_model, **norm)
    match layer_type:
      case "mamba":
        self.mixer = MambaMixer(cfg.mamba, rngs=rngs, backend=backend)
      case "attention":
        self.mixer = Attention(
          cfg.d_model,
          cfg.num_heads,
          cfg.num_kv_heads,
          cfg.head_dim,
          use_bias=False,
          init_std=cfg.init_std,
          out_init_std=cfg.out_init_std,
          dtype=dtype,
          param_dtype=param_dtype,
          rngs=rngs,
          rope_theta=cfg.rope_theta,
          implementation=cfg.attention_impl,
          mesh=mesh,
          backend=backend,
        )
      case _:
        raise ValueError(f"layer type {layer_type!r} must be 'mamba' or 'attention'")
    if cfg.d_ff:
      self.mlp_norm = Norm(cfg.d_model, **norm)
      self.mlp = MLP(
        cfg.d_model,
        cfg.d_ff,
        activation=cfg.activation,
        gated=cfg.gated,
        use_bias=False,
        init_std=cfg.init_std,
        out_init_std=cfg.out_init_std,
        dtype=dtype,
        param_dtype=param_dtype,
        rngs=rngs,
        backend=backend,
      )
    else:
      self.mlp_norm = self.mlp = None

  def __call__(
    self,
    x_BTD: jax.Array,
    *,
    valid: jax.Array | None = None,
    segment_ids: jax.Array | None = None,
    positions: jax.Array | None = None,
    dropout_rng: jax.Array | None = None,
    cache=None,
  ):
    """The block on ``x [B, T, D]``.

    Args:
      valid: ``[B, T]`` bool, False for padding (Mamba: keeps the state; attention: masked keys).
      segment_ids: ``[B, T]`` packed documents: no token sees another document.
      positions: ``[B, T]`` positions (rotary attention; default ``0..T-1``).
      dropout_rng: a key turns residual dropout on.
      cache: decoding: an ``ops.SSMState`` (Mamba) or one layer of a ``KVCache`` (attention).

    Returns:
      ``(x [B, T, D], cache)``, the cache after these positions (None without one).
    """
    cfg = self.cfg
    r_mix, r_mlp = split_key(dropout_rng, 2)
    if cfg.residual_in_fp32:
      x_BTD = x_BTD.astype(jnp.float32)
    h = self.norm(x_BTD)
    if self.layer_type == "mamba":
      out, cache = self.mixer(h, valid=valid, segment_ids=segment_ids, state=cache)
    else:
      out, cache = self.mixer(
        h,
        positions=positions,
        causal=True,
        kv_valid=None if cache is not None else valid,
        segment_ids=segment_ids,
        cache=cache,
      )
    x_BTD = x_BTD + ops.dropout(out, cfg.dropout_rate, r_mix).astype(x_BTD.dtype)
    if self.mlp is not None:
      x_BTD = x_BTD + ops.dropout(self.mlp(self.mlp_norm(x_BTD)), cfg.dropout_rate, r_mlp).astype(
        x_BTD.dtype
      )
    return x_BTD, cache


@flax.struct.dataclass
class SSMCache:
  """The decoding state of a stack of Mamba (and attention) layers: per Mamba layer the last
  ``W - 1`` convolution inputs and the scan's state, the same size for any length; a hybrid's
  attention layers keep a ``KVCache``. The same interface as ``KVCache`` where decoding uses it
  (``lengths``, ``new_valid``, ``positions``, ``take_rows``)."""

  conv: tuple[jax.Array, ...]  # per Mamba layer [B, W - 1, C] float32
  ssm: tuple[jax.Array, ...]  # per Mamba layer [B, E, S] or [B, N, H, S] float32
  lengths: jax.Array  # [B] int32 tokens seen per row
  kv: KVCache | None = None  # the attention layers of a hybrid (its lengths unused)
  # [B] how many of the tokens being written are real (right padding after them).
  new_valid: jax.Array | None = None
  cross = None  # no encoder side

  @classmethod
  def zeros(
    cls, kind: MambaKind, num_mamba: int, batch_size: int, kv: KVCache | None = None
  ) -> SSMCache:
    """An empty state for ``num_mamba`` Mamba layers of ``kind`` (and a hybrid's ``kv``)."""
    conv, ssm = kind.state_shapes(batch_size)
    return cls(
      tuple(jnp.zeros(conv, jnp.float32) for _ in range(num_mamba)),
      tuple(jnp.zeros(ssm, jnp.float32) for _ in range(num_mamba)),
      jnp.zeros((batch_size,), jnp.int32),
      kv,
    )

  def positions(self, t: int) -> jax.Array:
    """``[B, T]`` positions of T new tokens per row."""
    return self.lengths[:, None].astype(jnp.int32) + jnp.arange(t, dtype=jnp.int32)[None, :]

  def take_rows(self, rows_R: jax.Array) -> SSMCache:
    """The state of batch rows ``rows`` (repeated or reordered beams)."""
    pick = lambda x: jnp.take(x, rows_R, axis=0)  # noqa: E731
    return self.replace(
      conv=tuple(map(pick, self.conv)),
      ssm=tuple(map(pick, self.ssm)),
      lengths=pick(self.lengths),
      kv=None if self.kv is None else self.kv.take_rows(rows_R),
      new_valid=None if self.new_valid is None else pick(self.new_valid),
    )


class MixerStack(nnx.Module):
  """Blocks of two kinds in the order of ``layer_types`` (``"mamba"``, ``"attention"``), each
  kind's parameters stacked along a leading ``layers`` axis (``self.mamba``, ``self.attention``).

  A stack of one kind runs under one ``lax.scan`` (or an unrolled loop with ``unroll``); a hybrid
  runs its layers one after another (each reads its slice of its kind's stacked parameters).
  """

  def __init__(
    self,
    cfg: MixerBlockConfig,
    layer_types: tuple[LayerType, ...],
    *,
    remat: str = "none",
    unroll: bool = False,
    rngs: nnx.Rngs,
    mesh: Mesh | None = None,
    backend: backends.Backend | None = None,
  ):
    if remat != "none" and remat not in _REMAT_POLICIES:
      raise ValueError(
        f"remat={remat!r} must be one of 'none', {', '.join(map(repr, _REMAT_POLICIES))}"
      )
    self.layer_types = tuple(layer_types)
    # Every block returns its residual stream in float32 then (MixerBlock): the scan over the
    # layers carries it in float32 from the first layer on, whatever the embedding's dtype.
    self.residual_in_fp32 = cfg.residual_in_fp32
    self.remat = remat
    self.unroll = unroll
    self.mesh = mesh
    self.backend = backend = backend or backends.current()

    def stacked(layer_type, count):
      if not count:
        return None

      @nnx.split_rngs(splits=count)
      @nnx.vmap(in_axes=(0,), out_axes=0, transform_metadata={nnx.PARTITION_NAME: ax.LAYERS})
      def make(rngs):
        return MixerBlock(cfg, layer_type, rngs=rngs, mesh=mesh, backend=backend)

      return make(rngs)

    self.mamba = stacked("mamba", self.layer_types.count("mamba"))
    self.attention = stacked("attention", self.layer_types.count("attention"))

  def _order(self) -> list[tuple[LayerType, int]]:
    """``(kind, index within its kind)`` of every layer, in order."""
    seen = {"mamba": 0, "attention": 0}
    out = []
    for kind in self.layer_types:
      out.append((kind, seen[kind]))
      seen[kind] += 1
    return out

  def __call__(
    self,
    x_BTD: jax.Array,
    *,
    valid: jax.Array | None = None,
    segment_ids: jax.Array | None = None,
    positions: jax.Array | None = None,
    dropout_rng: jax.Array | None = None,
    cache: SSMCache | None = None,
    layer_params: tuple[nnx.State, ...] | None = None,
  ) -> tuple[jax.Array, SSMCache | None]:
    """Every block on ``x [B, T, D]`` (arguments as ``MixerBlock``'s).

    With a ``cache`` (decoding) the layers read and write their states and the T new tokens
    advance ``lengths``; ``layer_params`` (``split_layers``) then gives each layer's weights.

    Returns:
      ``(x [B, T, D], cache)``: the updated cache, or None without one.
    """
    kinds = {
      kind: nnx.split(getattr(self, kind))
      for kind in ("mamba", "attention")
      if getattr(self, kind) is not None
    }
    block_kw = dict(segment_ids=segment_ids, positions=positions)
    if cache is not None:
      return self._decode(x_BTD, cache, layer_params, kinds)

    keys = None if dropout_rng is None else jax.random.split(dropout_rng, len(self.layer_types))

    def body_for(kind):
      graphdef = kinds[kind][0]

      def body(x, layer):
        p, key = layer
        x = constrain(x, ACTIVATION_BTD, self.mesh)
        return nnx.merge(graphdef, p)(x, valid=valid, dropout_rng=key, **block_kw)[0], None

      if self.remat != "none":
        body = jax.checkpoint(body, policy=_REMAT_POLICIES[self.remat], prevent_cse=False)
      return body

    if self.residual_in_fp32:  # the carry's dtype is the blocks' output dtype
      x_BTD = x_BTD.astype(jnp.float32)
    if len(kinds) == 1 and not self.unroll:
      ((kind, (_, params)),) = kinds.items()
      x_BTD, _ = jax.lax.scan(body_for(kind), x_BTD, (params, keys))
    else:
      bodies = {kind: body_for(kind) for kind in kinds}
      for i, (kind, j) in enumerate(self._order()):
        p = jax.tree.map(lambda a: a[j], kinds[kind][1])
        x_BTD, _ = bodies[kind](x_BTD, (p, None if keys is None else keys[i]))
    return constrain(x_BTD, ACTIVATION_BTD, self.mesh), None

  def _decode(self, x_BTD, cache: SSMCache, layer_params, kinds):
    t = x_BTD.shape[1]
    if layer_params is None:
      layer_params = self.split_layers()
    valid = None
    if cache.new_valid is not None:
      valid = jnp.arange(t)[None, :] < jnp.asarray(cache.new_valid, jnp.int32)[:, None]
    kv = None
    if cache.kv is not None:  # the attention layers write at the stack's lengths
      kv = cache.kv.replace(lengths=cache.lengths, new_valid=cache.new_valid)
    conv, ssm, kv_layers = list(cache.conv), list(cache.ssm), []
    for (kind, j), p in zip(self._order(), layer_params):
      block = nnx.merge(kinds[kind][0], p)
      if kind == "mamba":
        x_BTD, state = block(x_BTD, valid=valid, cache=ops.SSMState(conv[j], ssm[j]))
        conv[j], ssm[j] = state
      else:
        x_BTD, layer = block(x_BTD, cache=kv.layer(j))
        kv_layers.append(layer)
    if kv is not None:
      kv = kv.joined(kv_layers, t).replace(new_valid=None)
    return x_BTD, cache.replace(conv=tuple(conv), ssm=tuple(ssm), kv=kv, lengths=cache.lengths + t)

  def split_layers(self) -> tuple[nnx.State, ...]:
    """Every layer's parameters as a state of its own, in layer order (each sliced out of its
    kind's stacked arrays; every projection kernel in the backend's decoding layout,
    ``Backend.decode_layout``): ``layer_params``."""
    kinds = {
      kind: nnx.split(getattr(self, kind))
      for kind in ("mamba", "attention")
      if getattr(self, kind) is not None
    }
    out = []
    for kind, j in self._order():
      graphdef, params = kinds[kind]
      block = nnx.merge(graphdef, jax.tree.map(functools.partial(lambda i, a: a[i], j), params))
      to_decode_layout(block, self.backend)
      out.append(nnx.state(block))
    return tuple(out)
