"""``MambaConfig``: the state-space language model's config (``models.Mamba``).

Mamba-1's selective scan or Mamba-2's SSD mixer, and hybrid stacks whose ``layer_types`` put
attention layers among the Mamba ones (as Jamba), with an optional gated MLP in every block.
Numbers read from YAML as strings (``1e-3``) are taken as floats; ``mamba_kind`` and
``block_config`` give the options of ``layers.ssm``'s mixer and block.
"""

from __future__ import annotations

import dataclasses
import math
from typing import Literal

from transformer_jax import ops
from transformer_jax.layers import Remat
from transformer_jax.layers.ssm import MambaKind, MixerBlockConfig
from transformer_jax.models.config import checks

_LAYER_TYPES = ("mamba", "attention")


@dataclasses.dataclass(frozen=True, slots=True)
class MambaConfig(checks.Heads):
  """A decoder-only language model of Mamba blocks (Gu and Dao 2023; Mamba-2: Dao and Gu 2024),
  or a hybrid stack whose ``layer_types`` mix Mamba and attention blocks (as Jamba).

  A Mamba block is ``x + mixer(rmsnorm x)``; an attention block ``x + attention(rmsnorm x)``;
  ``d_ff > 0`` adds ``x + mlp(rmsnorm x)`` to every block. The attention fields (``num_heads``,
  ``num_kv_heads``, ``head_dim``, ``position``) only matter for the attention layers.
  """

  vocab_size: int = 50280
  d_model: int = 768
  num_layers: int = 24
  mixer: Literal["mamba1", "mamba2"] = "mamba1"
  d_state: int = 16  # S, the state size per channel
  d_conv: int = 4  # W, the causal convolution's width
  expand: int = 2  # d_inner = expand * d_model
  dt_rank: int | None = None  # Mamba-1: the time step's rank; None: ceil(d_model / 16)
  ssm_head_dim: int = 64  # Mamba-2: H per head; heads = d_inner / ssm_head_dim
  ssm_groups: int = 1  # Mamba-2: G groups of B and C (and of the gated norm)
  ssm_chunk: int = 64  # positions per chunk of the training scan (no effect on
  # the function)
  # Mamba-1's scan inside a chunk: "associative" (log depth), "sequential" (less work), or
  # "auto": sequential on CPUs, associative on GPUs and TPUs (ops.ssm.choose_scan_method).
  ssm_scan: Literal["auto", "associative", "sequential"] = "auto"
  # Mamba-2's chunked scan: "xla" (ops.ssd), "pallas" (the TPU kernel of ops.ssm_pallas; Pallas'
  # interpreter elsewhere), or "auto" (ops.ssm_pallas.choose_ssd_implementation: "xla" for now).
  ssm_impl: Literal["auto", "xla", "pallas"] = "auto"
  # Mamba-2: dt clamped to [low, high]. Mamba-1 does not clamp.
  time_step_limit: tuple[float, float] = dataclasses.field(
    default=(0.0, math.inf), metadata={"infinite": True}
  )
  time_step_min: float = 1e-3  # initial dt drawn log-uniformly in [min, max], >= floor
  time_step_max: float = 0.1
  time_step_floor: float = 1e-4
  conv_bias: bool = True
  use_bias: bool = False  # biases on the mixers' in and out projections
  norm_eps: float = 1e-5
  residual_in_fp32: bool = True  # the residual stream in float32 whatever the dtype
  tie_embeddings: bool = True
  # The longest sequence accepted. Nothing is sized by it but a hybrid's key/value cache.
  max_len: int = 1 << 20
  # Per layer "mamba" or "attention" (a hybrid stack); None: every layer "mamba".
  layer_types: tuple[str, ...] | None = None
  num_heads: int = 8  # attention layers
  num_kv_heads: int | None = None
  head_dim: int | None = None
  position: Literal["none", "rope"] = "none"  # the attention layers' positions (Jamba: none)
  rope_theta: float = 10000.0
  d_ff: int = 0  # > 0: a gated MLP in every block (Jamba); 0: none
  activation: ops.Activation = "silu"
  dropout_rate: float = 0.0  # residual dropout
  init_std: float = 0.02
  dtype: str = "float32"
  param_dtype: str = "float32"
  matmul_precision: str = "float32"  # as GPTConfig's
  remat: Remat = "none"
  scan_layers: bool | Literal["auto"] = "auto"
  attention_impl: ops.Implementation | None = None  # the attention layers' kernel

  def __post_init__(self):
    checks.positive(
      self,
      "vocab_size",
      "d_model",
      "num_layers",
      "d_state",
      "d_conv",
      "expand",
      "ssm_head_dim",
      "ssm_groups",
      "ssm_chunk",
      "max_len",
      "num_heads",
    )
    checks.choice(self, "mixer", ("mamba1", "mamba2"))
    checks.choice(self, "ssm_scan", ("auto", "associative", "sequential"))
    checks.choice(self, "ssm_impl", ("auto", "xla", "pallas"))
    checks.floats(
      self,
      "time_step_min",
      "time_step_max",
      "time_step_floor",
      "norm_eps",
      "rope_theta",
      "init_std",
      "dropout_rate",
    )
    if self.dt_rank is not None:
      checks.positive(self, "dt_rank")
    limit = self.time_step_limit
    if isinstance(limit, str) or not hasattr(limit, "__len__") or len(limit) != 2:
      raise ValueError(f"time_step_limit={limit!r} must be [low, high]")
    try:
      limit = tuple(float(v) for v in limit)
    except (TypeError, ValueError):
      raise ValueError(f"time_step_limit={self.time_step_limit!r} must be two numbers") from None
    if not 0.0 <= limit[0] <= limit[1]:
      raise ValueError(f"time_step_limit={self.time_step_limit!r} must have 0 <= low <= high")
    object.__setattr__(self, "time_step_limit", limit)
    if not 0.0 < self.time_step_min <= self.time_step_max:
      raise ValueError(
        f"time_step_min={self.time_step_min!r} and time_step_max="
        f"{self.time_step_max!r} must have 0 < min <= max"
      )
    if not self.norm_eps > 0:
      raise ValueError(f"norm_eps={self.norm_eps!r} must be > 0")
    if self.mixer == "mamba2":
      if self.d_inner % self.ssm_head_dim:
        raise ValueError(
          f"ssm_head_dim={self.ssm_head_dim} does not divide d_inner = expand * "
          f"d_model = {self.d_inner}"
        )
      if self.ssm_heads % self.ssm_groups:
        raise ValueError(
          f"ssm_groups={self.ssm_groups} does not divide the {self.ssm_heads} Mamba-2 heads"
        )
    if self.layer_types is not None:
      types = self.layer_types
      if isinstance(types, str) or not hasattr(types, "__len__"):
        raise ValueError(f"layer_types={types!r} must be a list of 'mamba'/'attention'")
      types = tuple(types)
      if len(types) != self.num_layers:
        raise ValueError(f"layer_types has {len(types)} entries for num_layers={self.num_layers}")
      bad = [t for t in types if t not in _LAYER_TYPES]
      if bad:
        raise ValueError(f"layer_types: {bad[0]!r} must be 'mamba' or 'attention'")
      object.__setattr__(self, "layer_types", types)
    if not isinstance(self.d_ff, int) or isinstance(self.d_ff, bool) or self.d_ff < 0:
      raise ValueError(f"d_ff={self.d_ff!r} must be an integer >= 0")
    if self.head_dim is None:
      if self.d_model % self.num_heads:
        raise ValueError(f"num_heads={self.num_heads} does not divide d_model={self.d_model}")
    else:
      checks.positive(self, "head_dim")
    if self.num_kv_heads is not None:
      checks.positive(self, "num_kv_heads")
      if self.num_heads % self.num_kv_heads:
        raise ValueError(
          f"num_kv_heads={self.num_kv_heads} does not divide num_heads={self.num_heads}"
        )
    checks.choice(self, "position", ("none", "rope"))
    if self.position == "rope" and self.head_size % 2:
      raise ValueError(f"head_dim={self.head_size} must be even for rotary positions")
    checks.choice(self, "activation", checks.ACTIVATIONS)
    checks.rate(self, "dropout_rate")
    checks.dtype(self, "dtype", "param_dtype")
    checks.choice(self, "matmul_precision", ops.precision.PRECISIONS)
    checks.choice(self, "remat", checks.REMATS)
    checks.scan_layers(self)
    checks.choice(self, "attention_impl", checks.ATTENTION_IMPLS)

  @property
  def d_inner(self) -> int:
    """E = expand * d_model, the mixers' width."""
    return self.expand * self.d_model

  @property
  def time_step_rank(self) -> int:
    """Mamba-1's R (``dt_rank``, or ceil(d_model / 16) when unset)."""
    return math.ceil(self.d_model / 16) if self.dt_rank is None else self.dt_rank

  @property
  def ssm_heads(self) -> int:
    """Mamba-2's heads N = d_inner / ssm_head_dim."""
    return self.d_inner // self.ssm_head_dim

  @property
  def rope_scaling(self) -> None:
    """The attention layers' RoPE is never rescaled (as GPTConfig's ``rope_scaling=None``)."""
    return None

  @property
  def layer_kinds(self) -> tuple[str, ...]:
    """Every layer's type, ``layer_types`` or all ``"mamba"``."""
    return ("mamba",) * self.num_layers if self.layer_types is None else self.layer_types

  def mamba_kind(self) -> MambaKind:
    return MambaKind(
      version=1 if self.mixer == "mamba1" else 2,
      d_model=self.d_model,
      d_inner=self.d_inner,
      d_state=self.d_state,
      d_conv=self.d_conv,
      dt_rank=self.time_step_rank,
      head_dim=self.ssm_head_dim,
      groups=self.ssm_groups,
      chunk_size=self.ssm_chunk,
      scan_method=self.ssm_scan,
      ssd_impl=self.ssm_impl,
      time_step_limit=self.time_step_limit,
      time_step_min=self.time_step_min,
      time_step_max=self.time_step_max,
      time_step_floor=self.time_step_floor,
      conv_bias=self.conv_bias,
      use_bias=self.use_bias,
      norm_eps=self.norm_eps,
      init_std=self.init_std,
      # One residual branch per layer: GPT-2's 1/sqrt(N) scaling of the output projections.
      out_init_std=self.init_std / self.num_layers**0.5,
      dtype=self.dtype,
      param_dtype=self.param_dtype,
    )

  def block_config(self) -> MixerBlockConfig:
    return MixerBlockConfig(
      d_model=self.d_model,
      norm_eps=self.norm_eps,
      mamba=self.mamba_kind(),
      residual_in_fp32=self.residual_in_fp32,
      num_heads=self.num_heads,
      num_kv_heads=self.kv_heads,
      head_dim=self.head_size,
      rope_theta=self.rope_theta if self.position == "rope" else None,
      attention_impl=self.attention_impl,
      d_ff=self.d_ff,
      activation=self.activation,
      gated=True,
      dropout_rate=self.dropout_rate,
      init_std=self.init_std,
      out_init_std=self.init_std / self.num_layers**0.5,
      dtype=self.dtype,
      param_dtype=self.param_dtype,
    )
