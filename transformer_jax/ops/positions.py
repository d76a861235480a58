"""Position encodings: sinusoidal, rotary (RoPE), ALiBi and T5 relative-position buckets."""

from __future__ import annotations

import dataclasses
import math
from typing import Literal

import jax
import jax.numpy as jnp
import numpy as np


def sinusoidal_positions(num_positions: int, dim: int) -> jax.Array:
  """The fixed encoding of "Attention Is All You Need" (section 3.5), interleaved.

  ``PE[p, 2i] = sin(p / 10000^(2i/dim))`` and ``PE[p, 2i+1] = cos(p / 10000^(2i/dim))``.

  Returns:
    float32 ``[num_positions, dim]``.
  """
  if dim % 2:
    raise ValueError(f"dim={dim} must be even for sinusoidal positions")
  pos = np.arange(num_positions, dtype=np.float64)[:, None]
  inv_freq = 1.0 / (10000.0 ** (np.arange(0, dim, 2, dtype=np.float64) / dim))
  angles = pos * inv_freq[None, :]
  pe = np.empty((num_positions, dim), dtype=np.float64)
  pe[:, 0::2] = np.sin(angles)
  pe[:, 1::2] = np.cos(angles)
  return jnp.asarray(pe, dtype=jnp.float32)


# --------------------------------------------------------------------------------------------------
# Rotary position embedding.


@dataclasses.dataclass(frozen=True, slots=True)
class RopeScaling:
  """How to stretch RoPE beyond the trained context.

  kind: ``linear`` (position interpolation: positions / factor), ``ntk`` (NTK-aware: the base is
    raised to ``theta * factor ** (dim / (dim - 2))``) or ``llama3`` (frequency-dependent, as in
    LLaMA 3.1: long wavelengths divided by ``factor``, short ones kept, a smooth blend between).
  factor: the stretch factor (> 0).
  low_freq_factor, high_freq_factor, original_max_len: the LLaMA 3 parameters.
  """

  kind: Literal["linear", "ntk", "llama3"] = "linear"
  factor: float = 1.0
  low_freq_factor: float = 1.0
  high_freq_factor: float = 4.0
  original_max_len: int = 8192

  def __post_init__(self):
    if self.kind not in ("linear", "ntk", "llama3"):
      raise ValueError(f"RopeScaling.kind={self.kind!r} must be 'linear', 'ntk' or 'llama3'")
    if not self.factor > 0:
      raise ValueError(f"RopeScaling.factor={self.factor} must be > 0")
    if self.kind == "llama3" and not self.high_freq_factor > self.low_freq_factor:
      raise ValueError(
        f"RopeScaling.high_freq_factor={self.high_freq_factor} must exceed "
        f"low_freq_factor={self.low_freq_factor}"
      )


def rope_frequencies(
  dim: int, *, theta: float = 10000.0, scaling: RopeScaling | None = None
) -> np.ndarray:
  """Inverse frequencies ``[dim // 2]`` (float64 NumPy; constant-folded under jit)."""
  if dim % 2:
    raise ValueError(f"rotary dim={dim} must be even")
  exponents = np.arange(0, dim, 2, dtype=np.float64) / dim
  if scaling is not None and scaling.kind == "ntk":
    theta = theta * scaling.factor ** (dim / (dim - 2))
  inv_freq = 1.0 / theta**exponents
  if scaling is None:
    return inv_freq
  match scaling.kind:
    case "linear":
      return inv_freq / scaling.factor
    case "ntk":
      return inv_freq
    case "llama3":
      low_wavelen = scaling.original_max_len / scaling.low_freq_factor
      high_wavelen = scaling.original_max_len / scaling.high_freq_factor
      wavelen = 2 * math.pi / inv_freq
      scaled = np.where(wavelen > low_wavelen, inv_freq / scaling.factor, inv_freq)
      smooth = (scaling.original_max_len / wavelen - scaling.low_freq_factor) / (
        scaling.high_freq_factor - scaling.low_freq_factor
      )
      blended = (1 - smooth) * scaled / scaling.factor + smooth * scaled
      medium = (wavelen >= high_wavelen) & (wavelen <= low_wavelen)
      return np.where(medium, blended, scaled)
    case _:
      raise ValueError(f"unknown RoPE scaling kind {scaling.kind!r}")


def apply_rope(
  x: jax.Array,
  positions: jax.Array,
  *,
  theta: float = 10000.0,
  interleaved: bool = False,
  scaling: RopeScaling | None = None,
) -> jax.Array:
  """Rotates feature pairs of ``x`` by position-dependent angles (Su et al., RoFormer).

  Args:
    x: ``[B, T, N, H]`` queries or keys (H even).
    positions: ``[B, T]`` or ``[T]`` integer positions.
    theta: the frequency base.
    interleaved: pair features ``(2i, 2i+1)`` as GPT-J and the RoFormer paper do. The default pairs
      ``(i, i + H/2)`` ("rotate half"), the convention of GPT-NeoX, LLaMA and Hugging Face.
    scaling: optional context-extension scaling.

  Returns:
    ``x`` rotated, same shape and dtype. Rotation is computed in float32.
  """
  h = x.shape[-1]
  inv_freq = jnp.asarray(rope_frequencies(h, theta=theta, scaling=scaling), jnp.float32)
  positions = jnp.asarray(positions)
  if positions.ndim == 1:
    positions = positions[None, :]
  angles_BTF = positions.astype(jnp.float32)[..., None] * inv_freq[None, None, :]  # F = H // 2
  sin = jnp.sin(angles_BTF)[:, :, None, :]  # [B, T, 1, H/2]
  cos = jnp.cos(angles_BTF)[:, :, None, :]
  xf = x.astype(jnp.float32)
  if interleaved:
    x1, x2 = xf[..., 0::2], xf[..., 1::2]
    out = jnp.stack([x1 * cos - x2 * sin, x2 * cos + x1 * sin], axis=-1).reshape(xf.shape)
  else:
    x1, x2 = xf[..., : h // 2], xf[..., h // 2 :]
    out = jnp.concatenate([x1 * cos - x2 * sin, x2 * cos + x1 * sin], axis=-1)
  return out.astype(x.dtype)


# --------------------------------------------------------------------------------------------------
# ALiBi (Press et al., "Train Short, Test Long").


def alibi_slopes(num_heads: int) -> np.ndarray:
  """Per-head slopes ``[N]`` exactly as the ALiBi paper and its reference code define them.

  For a power of two ``n`` the slopes are the geometric sequence starting at ``2^(-8/n)`` with that
  ratio. Otherwise the slopes of the closest smaller power of two ``c`` are followed by every other
  slope of ``2c`` heads, to make ``n`` in all.
  """
  if num_heads < 1:
    raise ValueError(f"num_heads={num_heads} must be >= 1")

  def power_of_two(n: int) -> list[float]:
    start = 2.0 ** (-(2.0 ** -(math.log2(n) - 3)))
    return [start * start**i for i in range(n)]

  if math.log2(num_heads).is_integer():
    slopes = power_of_two(num_heads)
  else:
    closest = 2 ** math.floor(math.log2(num_heads))
    slopes = power_of_two(closest) + power_of_two(2 * closest)[0::2][: num_heads - closest]
  return np.asarray(slopes, dtype=np.float64)


def alibi_bias(num_heads: int, q_len: int, k_len: int | None = None) -> jax.Array:
  """``[1, N, T, S]`` float32 bias ``-slope_n * |i - j|`` (queries aligned to the end of the keys).

  Under a causal mask this is the paper's ``m * [-(i-1), ..., -1, 0]``; without one it is the
  symmetric variant used for bidirectional encoders.
  """
  k_len = q_len if k_len is None else k_len
  q_pos = np.arange(q_len)[:, None] + (k_len - q_len)
  k_pos = np.arange(k_len)[None, :]
  dist = np.abs(q_pos - k_pos).astype(np.float64)
  bias = -alibi_slopes(num_heads)[:, None, None] * dist[None]
  return jnp.asarray(bias[None], dtype=jnp.float32)


# --------------------------------------------------------------------------------------------------
# T5 relative positions (Raffel et al.; bucketing as in Mesh TensorFlow).


def relative_position_bucket(
  relative_position: jax.Array,
  *,
  bidirectional: bool = True,
  num_buckets: int = 32,
  max_distance: int = 128,
) -> jax.Array:
  """Maps ``key_pos - query_pos`` to a bucket in ``[0, num_buckets)``.

  Half the buckets (per direction, when bidirectional) hold exact small distances; the rest cover
  distances up to ``max_distance`` logarithmically, and everything farther shares the last bucket.
  A causal (unidirectional) model maps every future position to bucket 0.
  """
  relative_position = jnp.asarray(relative_position)
  ret = jnp.zeros_like(relative_position)
  n = -relative_position
  if bidirectional:
    num_buckets //= 2
    ret = ret + (n < 0).astype(relative_position.dtype) * num_buckets
    n = jnp.abs(n)
  else:
    n = jnp.maximum(n, 0)
  max_exact = num_buckets // 2
  is_small = n < max_exact
  # Guard log(0): the large branch is only used where n >= max_exact >= 1.
  n_f = jnp.maximum(n, 1).astype(jnp.float32)
  val_if_large = max_exact + (
    jnp.log(n_f / max_exact) / math.log(max_distance / max_exact) * (num_buckets - max_exact)
  ).astype(relative_position.dtype)
  val_if_large = jnp.minimum(val_if_large, num_buckets - 1)
  return ret + jnp.where(is_small, n, val_if_large)


def relative_positions(q_len: int, k_len: int | None = None) -> jax.Array:
  """``[T, S]`` integer ``key_pos - query_pos`` with queries aligned to the end of the keys."""
  k_len = q_len if k_len is None else k_len
  q_pos = jnp.arange(q_len)[:, None] + (k_len - q_len)
  return jnp.arange(k_len)[None, :] - q_pos


# --------------------------------------------------------------------------------------------------
# Additive position biases as functions of positions, for attention kernels that build the bias
# block by block (``dot_product_attention(bias_fn=..., bias_params=...)``) instead of taking a dense
# ``[B, N, T, S]`` array. Frozen dataclasses: hashable, so they can be static arguments of a kernel.


@dataclasses.dataclass(frozen=True, slots=True)
class AlibiBias:
  """ALiBi as a ``bias_fn``: ``params`` are the slopes ``[N]`` (``alibi_slopes``); the bias of query
  position ``i`` and key position ``j`` is ``-slope_n * |i - j|``, as ``alibi_bias``."""

  def __call__(self, slopes_N: jax.Array, q_pos_BT: jax.Array, k_pos_S: jax.Array) -> jax.Array:
    """``[B, N, T, S]`` float32."""
    dist_BTS = jnp.abs(q_pos_BT[:, :, None] - k_pos_S[None, None, :]).astype(jnp.float32)
    return -slopes_N.astype(jnp.float32)[None, :, None, None] * dist_BTS[:, None]


@dataclasses.dataclass(frozen=True, slots=True)
class RelativeBias:
  """T5's learned relative-position bias as a ``bias_fn``: ``params`` is the table ``[U, N]`` of
  ``U = num_buckets`` rows; the bias of query position ``i`` and key position ``j`` is
  ``table[relative_position_bucket(j - i), n]``."""

  num_buckets: int
  max_distance: int
  bidirectional: bool

  def __call__(self, table_UN: jax.Array, q_pos_BT: jax.Array, k_pos_S: jax.Array) -> jax.Array:
    """``[B, N, T, S]`` float32."""
    rel_BTS = k_pos_S[None, None, :] - q_pos_BT[:, :, None]
    buckets_BTS = relative_position_bucket(
      rel_BTS,
      bidirectional=self.bidirectional,
      num_buckets=self.num_buckets,
      max_distance=self.max_distance,
    )
    bias_BTSN = jnp.take(table_UN, buckets_BTS, axis=0)
    return jnp.transpose(bias_BTSN, (0, 3, 1, 2)).astype(jnp.float32)
