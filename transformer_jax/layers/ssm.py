"""Mamba mixers (Mamba-1's selective scan; Mamba-2's SSD with its gated group norm), the blocks
around them, hybrid stacks that mix them with attention layers by a per-layer list (as Jamba), and
the decoding cache of such a stack (``SSMCache``).

A Mamba block is ``x + mixer(rmsnorm(x))`` (no MLP, as in the papers); an attention block of a
hybrid is ``x + attention(rmsnorm(x))``; with ``d_ff > 0`` every block adds
``x + mlp(rmsnorm(x))`` (Jamba's layers). Parameters are stacked per kind of layer (a leading
``layers`` axis over the Mamba layers, another over the attention layers).
"""

from __future__ import annotations

import dataclasses
import functools
import math
from typing import Literal

import flax.struct
import jax
import jax.numpy as jnp
from flax import nnx
from jax.sharding import Mesh

from transformer_jax import backends, ops
from transformer_jax.layers.attention import Attention
from transformer_jax.ops import ssm as ssm_ops
from transformer_jax.ops import ssm_pallas
from transformer_jax.layers.cache import KVCache
from transformer_jax.layers.common import ones, param, split_key, zeros
from transformer_jax.layers.dense import Norm, Projection, to_decode_layout
from transformer_jax.layers.mlp import MLP
from transformer_jax.parallel import axes as ax
from transformer_jax.parallel.rules import ACTIVATION_BTD, constrain

LayerType = Literal["mamba", "attention"]

_REMAT_POLICIES = {
  "full": jax.checkpoint_policies.nothing_saveable,
  "dots": jax.checkpoint_policies.dots_with_no_batch_dims_saveable,
}


@dataclasses.dataclass(frozen=True, slots=True)
class MambaKind:
  """A Mamba mixer's options; each model builds one from its config."""

  version: Literal[1, 2]
  d_model: int  # D
  d_inner: int  # E = expand * D
  d_state: int  # S
  d_conv: int  # W
  dt_rank: int = 1  # Mamba-1: R, the time step's low-rank projection
  head_dim: int = 64  # Mamba-2: H; heads N = E // H
  groups: int = 1  # Mamba-2: G groups of B and C (and of the gated norm)
  chunk_size: int = 64  # positions per chunk of the training scan
  # Mamba-1's scan inside a chunk: "associative", "sequential", or "auto" (the platform's choice,
  # ops.ssm.choose_scan_method).
  scan_method: str = "auto"
  # Mamba-2's chunked scan: "xla" (ops.ssd), "pallas" (ops.ssm_pallas; interpret mode off a TPU),
  # or "auto" (ops.ssm_pallas.choose_ssd_implementation).
  ssd_impl: str = "auto"
  time_step_limit: tuple[float, float] = (0.0, math.inf)  # Mamba-2: dt clamped to it
  time_step_min: float = 1e-3  # initial dt drawn log-uniformly in [min, max], >= floor
  time_step_max: float = 0.1
  time_step_floor: float = 1e-4
  conv_bias: bool = True
  use_bias: bool = False  # biases on in_proj and out_proj
  norm_eps: float = 1e-5  # Mamba-2's gated norm
  init_std: float = 0.02
  out_init_std: float = 0.02
  dtype: str = "float32"
  param_dtype: str = "float32"

  @property
  def num_heads(self) -> int:
    """Mamba-2's N."""
    return self.d_inner // self.head_dim

  @property
  def conv_channels(self) -> int:
    """C: the convolved channels (Mamba-2 convolves x, B and C together)."""
    return self.d_inner if self.version == 1 else self.d_inner + 2 * self.groups * self.d_state

  def state_shapes(self, batch: int) -> tuple[tuple[int, ...], tuple[int, ...]]:
    """The decoding state's shapes: ``(conv [B, W - 1, C], ssm [B, E, S] or [B, N, H, S])``."""
    ssm = (
      (batch, self.d_inner, self.d_state)
      if self.version == 1
      else (batch, self.num_heads, self.head_dim, self.d_state)
    )
    return (batch, self.d_conv - 1, self.conv_channels), ssm


# --- initialisers (Gu and Dao, "S4D real" A and the dt range of the Mamba code) -------------------


def _uniform(bound: float):
  return lambda key, shape, dtype: jax.random.uniform(key, shape, dtype, -bound, bound)


def _dt_bias(kind: MambaKind):
  """Softplus^-1 of time steps drawn log-uniformly in ``[time_step_min, time_step_max]``."""

  def init(key, shape, dtype):
    lo, hi = math.log(kind.time_step_min), math.log(kind.time_step_max)
    dt = jnp.exp(jax.random.uniform(key, shape, jnp.float32) * (hi - lo) + lo)
    dt = jnp.maximum(dt, kind.time_step_floor)
    return (dt + jnp.log(-jnp.expm1(-dt))).astype(dtype)

  return init


def _a_log(key, shape, dtype):
  """``log(1 .. S)`` along the last axis (``A = -exp(A_log)``: S4D-real's ``-(n + 1)``)."""
  del key
  return jnp.broadcast_to(jnp.log(jnp.arange(1, shape[-1] + 1, dtype=jnp.float32)), shape).astype(
    dtype
  )


class GatedRMSNorm(nnx.Module):
  """Mamba-2's ``rmsnorm(y * silu(z))`` over groups of channels (``ops.gated_rms_norm``)."""

  def __init__(
    self, features: int, *, groups: int, eps: float, param_dtype: jnp.dtype, rngs: nnx.Rngs
  ):
    self.groups = groups
    self.eps = eps
    self.scale = param(rngs, ones, (features,), (ax.SSM_INNER,), param_dtype)

  def __call__(self, y: jax.Array, z: jax.Array) -> jax.Array:
    return ops.gated_rms_norm(y, z, self.scale[...], groups=self.groups, eps=self.eps)


class MambaMixer(nnx.Module):
  """A Mamba mixer: in-projection, causal depthwise conv, SiLU, selective scan, gate,
  out-projection.

  Mamba-1 (``version=1``): ``x, z = in_proj(u)``; ``x = silu(conv(x))``; ``dt, B, C = x_proj(x)``
  with ``dt = softplus(dt_proj(dt))``; ``y = scan(x) * silu(z)``. Mamba-2: ``z, xBC, dt =
  in_proj(u)``; ``x, B, C = silu(conv(xBC))``; ``dt = softplus(dt + dt_bias)``; ``y =
  gated_norm(ssd(x), z)``. Parameter names follow the reference code (``A_log``, ``D``,
  ``dt_bias``, ``in_proj``, ``x_proj``, ``dt_proj``, ``out_proj``).
  """

  def __init__(self, kind: MambaKind, *, rngs: nnx.Rngs, backend: backends.Backend | None = None):
    """``backend``: the kernels its projections call and the scan it picks (default
    ``backends.current()``)."""
    self.kind = k = kind
    self.backend = backend = backend or backends.current()
    dtype, param_dtype = jnp.dtype(k.dtype), jnp.dtype(k.param_dtype)
    common = dict(dtype=dtype, param_dtype=param_dtype, rngs=rngs, backend=backend)
    d, e, s, w = k.d_model, k.d_inner, k.d_state, k.d_conv
    c = k.conv_channels
    if k.version == 1:
      self.in_proj = Projection(
        "BTD,DZE->BTZE",
        (d, 2, e),
        (ax.EMBED, ax.SSM_PROJ, ax.SSM_INNER),
        bias_shape=(2, e) if k.use_bias else None,
        bias_axes=(ax.SSM_PROJ, ax.SSM_INNER),
        init_std=k.init_std,
        **common,
      )
      conv_axis = ax.SSM_INNER
    else:
      n, g = k.num_heads, k.groups
      self.in_proj = Projection(
        "BTD,DP->BTP",
        (d, 2 * e + 2 * g * s + n),
        (ax.EMBED, ax.SSM_PROJ),
        bias_shape=(2 * e + 2 * g * s + n,) if k.use_bias else None,
        bias_axes=(ax.SSM_PROJ,),
        init_std=k.init_std,
        **common,
      )
      conv_axis = ax.SSM_PROJ
    self.conv_kernel = param(rngs, _uniform(w**-0.5), (w, c), (ax.CONV, conv_axis), param_dtype)
    self.conv_bias = param(rngs, zeros, (c,), (conv_axis,), param_dtype) if k.conv_bias else None
    if k.version == 1:
      r = k.dt_rank
      self.x_proj = Projection(
        "BTE,EP->BTP", (e, r + 2 * s), (ax.SSM_INNER, ax.SSM_PROJ), init_std=k.init_std, **common
      )
      self.dt_proj = Projection(
        "BTR,RE->BTE",
        (r, e),
        (ax.SSM_RANK, ax.SSM_INNER),
        bias_shape=(e,),
        bias_axes=(ax.SSM_INNER,),
        init_std=k.init_std,
        **common,
      )
      # The time step's projection starts at +-R^-0.5 and its bias at softplus^-1(dt).
      self.dt_proj.kernel = param(
        rngs, _uniform(r**-0.5), (r, e), (ax.SSM_RANK, ax.SSM_INNER), param_dtype
      )
      self.dt_proj.bias = param(rngs, _dt_bias(k), (e,), (ax.SSM_INNER,), param_dtype)
      self.A_log = param(rngs, _a_log, (e, s), (ax.SSM_INNER, ax.SSM_STATE), param_dtype)
      self.D = param(rngs, ones, (e,), (ax.SSM_INNER,), param_dtype)
      self.dt_bias = self.norm = None
    else:
      n = k.num_heads
      self.x_proj = self.dt_proj = None
      self.dt_bias = param(rngs, _dt_bias(k), (n,), (ax.SSM_HEADS,), param_dtype)
      self.A_log = param(rngs, _a_log, (n,), (ax.SSM_HEADS,), param_dtype)
      self.D = param(rngs, ones, (n,), (ax.SSM_HEADS,), param_dtype)
      self.norm = GatedRMSNorm(
        e, groups=k.groups, eps=k.norm_eps, param_dtype=param_dtype, rngs=rngs
      )
    self.out_proj = Projection(
      "BTE,ED->BTD",
      (e, d),
      (ax.SSM_INNER, ax.EMBED),
      bias_shape=(d,) if k.use_bias else None,
      bias_axes=(ax.EMBED,),
      init_std=k.out_init_std,
      **common,
    )

  def __call__(
    self,
    u_BTD: jax.Array,
    *,
    valid: jax.Array | None = None,
    segment_ids: jax.Array | None = None,
    state: ops.SSMState | None = None,
  ) -> tuple[jax.Array, ops.SSMState | None]:
    """The mixer on ``u [B, T, D]``.

    Args:
      u_BTD: the normed block input.
      valid: ``[B, T]`` bool, False for padding: it leaves the state as it was (left or right
        padding; the outputs at padding positions mean nothing).
      segment_ids: ``[B, T]`` ints; the state restarts where the id changes (packed documents).
      state: the decoding state before these positions (``ops.SSMState``); then the state after
        them is returned. One position without padding runs the one-step recurrence.

    Returns:
      ``(y [B, T, D], state)``: the new state, or None without one.
    """
    k = self.kind
    step = state is not None and u_BTD.shape[1] == 1 and valid is None and segment_ids is None
    w = self.conv_kernel[...]
    bias = None if self.conv_bias is None else self.conv_bias[...]
    proj = self.in_proj(u_BTD)
    if k.version == 1:
      x_BTE, z_BTE = proj[:, :, 0], proj[:, :, 1]
    else:
      e, c = k.d_inner, k.conv_channels
      z_BTE, xbc_BTC, dt_BTN = proj[..., :e], proj[..., e : e + c], proj[..., e + c :]
      x_BTE = xbc_BTC

    if step:
      xc, conv_state = ops.causal_conv1d_step(state.conv, x_BTE[:, 0], w, bias)
      xc = xc[:, None]
    elif state is not None:
      xc, conv_state = ops.causal_conv1d(
        x_BTE,
        w,
        bias,
        state_BWC=state.conv,
        valid=valid,
        segment_ids=segment_ids,
        return_state=True,
      )
    else:
      xc, conv_state = ops.causal_conv1d(x_BTE, w, bias, valid=valid, segment_ids=segment_ids), None
    xc = jax.nn.silu(xc.astype(jnp.float32)).astype(xc.dtype)
    A = -jnp.exp(self.A_log[...].astype(jnp.float32))
    D = self.D[...]
    scan_kw = dict(
      chunk_size=k.chunk_size,
      initial_state=None if state is None else state.ssm,
      return_state=state is not None,
      valid=valid,
      segment_ids=segment_ids,
    )

    if k.version == 1:
      r, s = k.dt_rank, k.d_state
      dbc = self.x_proj(xc)
      dt_BTE = jax.nn.softplus(self.dt_proj(dbc[..., :r]).astype(jnp.float32))
      B_BTS, C_BTS = dbc[..., r : r + s], dbc[..., r + s :]
      if step:
        y, h = ops.selective_scan_step(
          state.ssm, xc[:, 0], dt_BTE[:, 0], A, B_BTS[:, 0], C_BTS[:, 0], D
        )
        out = (y[:, None], h)
      else:
        method = (
          ssm_ops.choose_scan_method(self.backend.platform)
          if k.scan_method == "auto"
          else k.scan_method
        )
        out = ops.selective_scan(xc, dt_BTE, A, B_BTS, C_BTS, D, method=method, **scan_kw)
      y_BTE, h = out if state is not None else (out, None)
      y_BTE = y_BTE * jax.nn.silu(z_BTE.astype(jnp.float32))
    else:
      b, t = u_BTD.shape[:2]
      e, g, s, n, hd = k.d_inner, k.groups, k.d_state, k.num_heads, k.head_dim
      x_BTNH = xc[..., :e].reshape(b, t, n, hd)
      B_BTGS = xc[..., e : e + g * s].reshape(b, t, g, s)
      C_BTGS = xc[..., e + g * s :].reshape(b, t, g, s)
      dt_BTN = jax.nn.softplus(dt_BTN.astype(jnp.float32) + self.dt_bias[...].astype(jnp.float32))
      if step:
        y, h = ops.ssd_step(
          state.ssm,
          x_BTNH[:, 0],
          dt_BTN[:, 0],
          A,
          B_BTGS[:, 0],
          C_BTGS[:, 0],
          D,
          time_step_limit=k.time_step_limit,
        )
        out = (y[:, None], h)
      else:
        platform = self.backend.platform
        impl = (
          ssm_pallas.choose_ssd_implementation(platform) if k.ssd_impl == "auto" else k.ssd_impl
        )
        match impl:
          case "xla":
            out = ops.ssd(
              x_BTNH, dt_BTN, A, B_BTGS, C_BTGS, D, time_step_limit=k.time_step_limit, **scan_kw
            )
          case "pallas":
            out = ssm_pallas.ssd(
              x_BTNH,
              dt_BTN,
              A,
              B_BTGS,
              C_BTGS,
              D,
              time_step_limit=k.time_step_limit,
              interpret=platform != "tpu",
              **scan_kw,
            )
          case _:
            raise ValueError(f"ssd implementation {impl!r} must be 'xla' or 'pallas'")
      y, h = out if state is not None else (out, None)
      y_BTE = self.norm(y.reshape(b, t, e), z_BTE)
    y_BTD = self.out_proj(y_BTE.astype(jnp.dtype(k.dtype)))
    return y_BTD, (None if state is None else ops.SSMState(conv_state, h))


# --- blocks and stacks ----------------------------------------------------------------------------


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
