"""Mamba and Mamba-2 ``config.json`` <-> ``MambaConfig``.

The two share most fields (``_mamba_common`` reads them, ``_mamba_common_to`` writes them);
Mamba-1 adds the time step's rank (``"auto"``: ceil(d_model / 16)), Mamba-2 its heads, groups,
chunk size and the time step's clamp, whose infinite bound transformers 5 writes boxed
(``{"__float__": "Infinity"}``).
"""

from __future__ import annotations

import math

from transformer_jax.hf.configs.common import Fields
from transformer_jax.hf.errors import CheckpointError, UnsupportedError
from transformer_jax.models import MambaConfig

# --- Mamba, Mamba-2 ------------------------------------------------------------------------------


def _mamba_common(f: Fields) -> dict:
  """The fields Mamba and Mamba-2 share (transformers' names -> ours), each read by its type."""
  act = f.str("hidden_act", "silu")
  if act not in ("silu", "swish"):
    raise UnsupportedError(f"hidden_act={act!r} is not supported (only 'silu')")
  return dict(
    vocab_size=f.int("vocab_size", 50280),
    d_model=f.int("hidden_size", 768),
    num_layers=f.int("num_hidden_layers", 32),
    d_state=f.int("state_size", 16),
    d_conv=f.int("conv_kernel", 4),
    expand=f.int("expand", 2),
    use_bias=f.bool("use_bias", False),
    conv_bias=f.bool("use_conv_bias", True),
    norm_eps=f.float("layer_norm_epsilon", 1e-5),
    residual_in_fp32=f.bool("residual_in_fp32", True),
    time_step_min=f.float("time_step_min", 1e-3),
    time_step_max=f.float("time_step_max", 0.1),
    time_step_floor=f.float("time_step_floor", 1e-4),
    init_std=f.float("initializer_range", 0.1),
  )


def mamba_from(hf: dict) -> MambaConfig:
  """``MambaConfig`` (``mixer='mamba1'``) from a Mamba ``config.json`` dict."""
  f = Fields(hf)
  common = _mamba_common(f)
  rank = hf.get("time_step_rank", "auto")
  if rank != "auto":
    rank = f.int("time_step_rank")
    if rank < 1:
      raise CheckpointError(f"time_step_rank={rank!r}: expected 'auto' or a positive integer")
  auto = math.ceil(common["d_model"] / 16)
  return MambaConfig(
    **common,
    mixer="mamba1",
    dt_rank=None if rank in ("auto", auto) else rank,
    tie_embeddings=f.bool("tie_word_embeddings", True),
  )


def _mamba_common_to(c: MambaConfig) -> dict:
  return dict(
    vocab_size=c.vocab_size,
    hidden_size=c.d_model,
    num_hidden_layers=c.num_layers,
    state_size=c.d_state,
    conv_kernel=c.d_conv,
    expand=c.expand,
    use_bias=c.use_bias,
    use_conv_bias=c.conv_bias,
    layer_norm_epsilon=c.norm_eps,
    residual_in_fp32=c.residual_in_fp32,
    hidden_act="silu",
    time_step_min=c.time_step_min,
    time_step_max=c.time_step_max,
    time_step_floor=c.time_step_floor,
    initializer_range=c.init_std,
    tie_word_embeddings=c.tie_embeddings,
  )


def mamba_to(c: MambaConfig) -> dict:
  """Mamba's ``config.json`` fields for ``c``."""
  return {**_mamba_common_to(c), "model_type": "mamba", "time_step_rank": c.time_step_rank}


def mamba2_from(hf: dict) -> MambaConfig:
  """``MambaConfig`` (``mixer='mamba2'``) from a Mamba2 ``config.json`` dict."""
  f = Fields(hf)
  common = _mamba_common(f)
  heads, head_dim = f.int("num_heads", 128), f.int("head_dim", 64)
  if common["expand"] * common["d_model"] != heads * head_dim:
    raise UnsupportedError(
      f"num_heads={heads} x head_dim={head_dim} must equal expand x "
      f"hidden_size = {common['expand'] * common['d_model']}"
    )
  # transformers 5 writes a non-finite float as {"__float__": "Infinity"}.
  raw = hf.get("time_step_limit", (0.0, math.inf))
  if not isinstance(raw, (list, tuple)) or len(raw) != 2:
    raise CheckpointError(f"time_step_limit={raw!r}: expected a pair of numbers")
  limit = Fields({"time_step_limit[0]": _unboxed(raw[0]), "time_step_limit[1]": _unboxed(raw[1])})
  lo, hi = (limit.number(k) for k in limit.hf)
  return MambaConfig(
    **common,
    mixer="mamba2",
    ssm_head_dim=head_dim,
    ssm_groups=f.int("n_groups", 8),
    ssm_chunk=f.int("chunk_size", 256),
    time_step_limit=(float(lo), float(hi)),
    tie_embeddings=f.bool("tie_word_embeddings", False),
  )


def _unboxed(v):
  """A number as transformers writes it: plain, or ``{"__float__": "Infinity"}``."""
  if isinstance(v, dict) and isinstance(v.get("__float__"), str):
    try:
      return float(v["__float__"])
    except ValueError:
      return v
  return v


def mamba2_to(c: MambaConfig) -> dict:
  """Mamba2's ``config.json`` fields for ``c``."""
  return {
    **_mamba_common_to(c),
    "model_type": "mamba2",
    "num_heads": c.ssm_heads,
    "head_dim": c.ssm_head_dim,
    "n_groups": c.ssm_groups,
    "chunk_size": c.ssm_chunk,
    "time_step_limit": list(c.time_step_limit),
  }
