"""Field checks shared by the model config families, and the option vocabularies they check.

Each check takes a config under construction (``self`` in its ``__post_init__``) and the names of
the fields to check, and raises ``ValueError`` naming the field and the offending value. A few
normalise as they go (``floats``, ``sparse_pattern``), writing the canonical value back with
``object.__setattr__`` because the configs are frozen. ``Heads`` is the mixin for the families with
attention heads: the effective K and H, and the checks of the attention fields.
"""

from __future__ import annotations

import math
from typing import Literal

import jax.numpy as jnp

from transformer_jax import ops

Norm = Literal["layernorm", "rmsnorm"]
ACTIVATIONS = ("relu", "gelu", "gelu_tanh", "silu")
REMATS = ("none", "full", "dots")
ATTENTION_IMPLS = (None, "xla", "chunked", "cudnn", "splash")  # None: the backend's choice


def positive(cfg, *names):
  """Each of ``names`` is an int >= 1 (a bool is refused)."""
  for name in names:
    value = getattr(cfg, name)
    if not isinstance(value, int) or isinstance(value, bool) or value < 1:
      raise ValueError(f"{name}={value!r} must be a positive integer")


def num_labels(cfg):
  """``num_labels`` (the classification head's classes) is an int >= 0; 0: no head."""
  if isinstance(cfg.num_labels, bool) or not isinstance(cfg.num_labels, int) or cfg.num_labels < 0:
    raise ValueError(f"num_labels={cfg.num_labels!r} must be an integer >= 0")


def choice(cfg, name, choices):
  """Field ``name`` is one of ``choices``."""
  value = getattr(cfg, name)
  if value not in choices:
    raise ValueError(f"{name}={value!r} must be one of {', '.join(map(repr, choices))}")


def scan_layers(cfg):
  """``scan_layers`` is true, false or ``"auto"`` (``unrolls_layers`` reads it)."""
  if not (isinstance(cfg.scan_layers, bool) or cfg.scan_layers == "auto"):
    raise ValueError(f"scan_layers={cfg.scan_layers!r} must be true, false or 'auto'")


def rate(cfg, *names):
  """Each of ``names`` is a dropout rate in [0, 1)."""
  for name in names:
    value = getattr(cfg, name)
    if not 0.0 <= value < 1.0:
      raise ValueError(f"{name}={value!r} must be in [0, 1)")


def dtype(cfg, *names):
  """Each of ``names`` names a floating dtype (``"float32"``, ``"bfloat16"``...)."""
  for name in names:
    value = getattr(cfg, name)
    try:
      dt = jnp.dtype(value)
    except TypeError:
      raise ValueError(f"{name}={value!r} is not a dtype name") from None
    if not jnp.issubdtype(dt, jnp.floating):
      raise ValueError(f"{name}={value!r} must be a floating dtype")


def sparse_pattern(cfg, *, causal: bool):
  """``sparse_pattern`` as an ``ops.SparsePattern`` (a mapping from YAML is converted; None is
  left for the model's default), checked for ``attention_kind``."""
  value = cfg.sparse_pattern
  if isinstance(value, dict):
    spec = dict(value)
    if "global_blocks" in spec:
      spec["global_blocks"] = tuple(spec["global_blocks"])
    try:
      value = ops.SparsePattern(**spec)
    except TypeError as e:
      raise ValueError(f"sparse_pattern={cfg.sparse_pattern!r}: {e}") from None
    object.__setattr__(cfg, "sparse_pattern", value)
  if value is not None and not isinstance(value, ops.SparsePattern):
    raise ValueError(f"sparse_pattern={value!r} must be an ops.SparsePattern or a mapping")
  if value is not None and cfg.attention_kind != "sparse":
    raise ValueError(
      f"sparse_pattern needs attention_kind='sparse' (attention_kind={cfg.attention_kind!r})"
    )
  if causal and value is not None and any(g < 0 for g in value.global_blocks):
    raise ValueError(
      f"sparse_pattern.global_blocks={value.global_blocks} of a decoder must "
      "count from the start (>= 0): a causal pattern may not depend on the length"
    )
  if causal and value is not None and (value.random_first or value.dense_up_to):
    raise ValueError(
      "sparse_pattern.random_first and dense_up_to (transformers' BigBird) are "
      "for encoders; a decoder's cache reads the pattern row by row"
    )


def floats(cfg, *names):
  """Numbers as floats; a numeric string too (YAML 1.1 reads ``1e-3``, without a dot, as one)."""
  for name in names:
    value = getattr(cfg, name)
    if isinstance(value, str):
      try:
        value = float(value)
      except ValueError:
        raise ValueError(f"{name}={value!r} must be a number") from None
    if isinstance(value, bool) or not isinstance(value, (int, float)) or math.isnan(value):
      raise ValueError(f"{name}={value!r} must be a number")
    object.__setattr__(cfg, name, float(value))


class Heads:
  """Shared head arithmetic and validation for the attention fields."""

  __slots__ = ()

  @property
  def kv_heads(self) -> int:
    """Key/value heads K (``num_kv_heads`` or, when unset, ``num_heads``)."""
    return self.num_heads if self.num_kv_heads is None else self.num_kv_heads

  @property
  def head_size(self) -> int:
    """Head dim H (``head_dim`` or, when unset, ``d_model // num_heads``)."""
    return self.d_model // self.num_heads if self.head_dim is None else self.head_dim

  def _validate_heads(self):
    positive(self, "d_model", "num_heads", "d_ff", "vocab_size", "max_len")
    if self.head_dim is None:
      if self.d_model % self.num_heads:
        raise ValueError(f"num_heads={self.num_heads} does not divide d_model={self.d_model}")
    else:
      positive(self, "head_dim")
    if self.num_kv_heads is not None:
      positive(self, "num_kv_heads")
      if self.num_heads % self.num_kv_heads:
        raise ValueError(
          f"num_kv_heads={self.num_kv_heads} does not divide num_heads={self.num_heads}"
        )
    rate(self, "dropout_rate", "attention_dropout_rate")
    dtype(self, "dtype", "param_dtype")
    choice(self, "matmul_precision", ops.precision.PRECISIONS)
    choice(self, "remat", REMATS)
    choice(self, "attention_impl", ATTENTION_IMPLS)
    if self.attention_impl == "cudnn" and jnp.dtype(self.dtype) not in (jnp.bfloat16, jnp.float16):
      raise ValueError(
        f"attention_impl='cudnn' computes in bfloat16 or float16; dtype="
        f"{self.dtype!r}: set dtype='bfloat16' or attention_impl 'xla'/'chunked'"
      )
    if not self.norm_eps > 0:
      raise ValueError(f"norm_eps={self.norm_eps!r} must be > 0")
