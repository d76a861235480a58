"""The Mamba mixer: Mamba-1's selective scan (Gu and Dao 2023) and Mamba-2's SSD with its gated
group norm (Dao and Gu 2024), one layer holding both by ``MambaKind.version``; its options
(``MambaKind``) and its parameters' initialisers. The blocks and stacks around it, and the
decoding cache of a stack, are ``layers.ssm``.
"""

from __future__ import annotations

import dataclasses
import math
from typing import Literal

import jax
import jax.numpy as jnp
from flax import nnx

from transformer_jax import backends, ops
from transformer_jax.layers.common import ones, param, zeros
from transformer_jax.layers.dense import Projection
from transformer_jax.ops import ssm as ssm_ops
from transformer_jax.ops import ssm_pallas
from transformer_jax.parallel import axes as ax


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
