"""Model configs: frozen, hashable dataclasses validated at construction.

Field names follow the papers and are shared by the families (``vocab_size``, ``d_model``, ``d_ff``,
``num_heads``, ``num_kv_heads``, ``head_dim``, ``max_len``, ``dropout_rate``, ``dtype``...). A bad
value raises ``ValueError`` naming the field and the value. Configs are hashable, so they can be
static arguments of ``jax.jit``.
"""

from __future__ import annotations

import dataclasses
import math
from typing import Literal

import jax.numpy as jnp

from transformer_jax import backends, ops
from transformer_jax.layers import BlockConfig, LinearKind, Remat
from transformer_jax.layers.approx import ApproxKind, LinformerKind, SparseKind
from transformer_jax.layers.ssm import MambaKind, MixerBlockConfig

Norm = Literal["layernorm", "rmsnorm"]
_ACTIVATIONS = ("relu", "gelu", "gelu_tanh", "silu")
_REMATS = ("none", "full", "dots")
_ATTENTION_IMPLS = (None, "xla", "chunked", "cudnn", "splash")


def _positive(cfg, *names):
  for name in names:
    value = getattr(cfg, name)
    if not isinstance(value, int) or isinstance(value, bool) or value < 1:
      raise ValueError(f"{name}={value!r} must be a positive integer")


def _num_labels(cfg):
  if isinstance(cfg.num_labels, bool) or not isinstance(cfg.num_labels, int) or cfg.num_labels < 0:
    raise ValueError(f"num_labels={cfg.num_labels!r} must be an integer >= 0")


def _choice(cfg, name, choices):
  value = getattr(cfg, name)
  if value not in choices:
    raise ValueError(f"{name}={value!r} must be one of {', '.join(map(repr, choices))}")


def _scan_layers(cfg):
  if not (isinstance(cfg.scan_layers, bool) or cfg.scan_layers == "auto"):
    raise ValueError(f"scan_layers={cfg.scan_layers!r} must be true, false or 'auto'")


def _rate(cfg, *names):
  for name in names:
    value = getattr(cfg, name)
    if not 0.0 <= value < 1.0:
      raise ValueError(f"{name}={value!r} must be in [0, 1)")


def _dtype(cfg, *names):
  for name in names:
    value = getattr(cfg, name)
    try:
      dt = jnp.dtype(value)
    except TypeError:
      raise ValueError(f"{name}={value!r} is not a dtype name") from None
    if not jnp.issubdtype(dt, jnp.floating):
      raise ValueError(f"{name}={value!r} must be a floating dtype")


def _sparse_pattern(cfg, *, causal: bool):
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


class _Heads:
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
    _positive(self, "d_model", "num_heads", "d_ff", "vocab_size", "max_len")
    if self.head_dim is None:
      if self.d_model % self.num_heads:
        raise ValueError(f"num_heads={self.num_heads} does not divide d_model={self.d_model}")
    else:
      _positive(self, "head_dim")
    if self.num_kv_heads is not None:
      _positive(self, "num_kv_heads")
      if self.num_heads % self.num_kv_heads:
        raise ValueError(
          f"num_kv_heads={self.num_kv_heads} does not divide num_heads={self.num_heads}"
        )
    _rate(self, "dropout_rate", "attention_dropout_rate")
    _dtype(self, "dtype", "param_dtype")
    _choice(self, "matmul_precision", ops.precision.PRECISIONS)
    _choice(self, "remat", _REMATS)
    _choice(self, "attention_impl", _ATTENTION_IMPLS)
    if self.attention_impl == "cudnn" and jnp.dtype(self.dtype) not in (jnp.bfloat16, jnp.float16):
      raise ValueError(
        f"attention_impl='cudnn' computes in bfloat16 or float16; dtype="
        f"{self.dtype!r}: set dtype='bfloat16' or attention_impl 'xla'/'chunked'"
      )
    if not self.norm_eps > 0:
      raise ValueError(f"norm_eps={self.norm_eps!r} must be > 0")


@dataclasses.dataclass(frozen=True, slots=True)
class GPTConfig(_Heads):
  """A decoder-only language model: GPT-2 by default, LLaMA with rope/rmsnorm/silu+gated/GQA."""

  vocab_size: int = 50257
  d_model: int = 768
  num_layers: int = 12
  num_heads: int = 12
  num_kv_heads: int | None = None  # None: as many as num_heads (MHA); 1: MQA
  head_dim: int | None = None  # None: d_model // num_heads
  d_ff: int = 3072
  max_len: int = 1024  # context; size of the learned/sinusoidal position table
  position: Literal["learned", "sinusoidal", "rope", "alibi", "none"] = "learned"
  norm: Norm = "layernorm"
  norm_eps: float = 1e-5
  activation: ops.Activation = "gelu_tanh"
  gated: bool = False  # SwiGLU/GeGLU feed-forward (LLaMA)
  use_bias: bool = True  # biases on projections (GPT-2 yes, LLaMA no)
  tie_embeddings: bool = True  # output projection = token embedding^T (GPT-2)
  num_labels: int = 0  # > 0 adds a classification head on the last real token
  rope_theta: float = 10000.0
  rope_interleaved: bool = False  # GPT-J pairing; default is LLaMA's rotate-half
  rope_scaling: ops.RopeScaling | None = None
  sliding_window: int | None = None  # local attention over the last `sliding_window` tokens
  # "softmax" attention, "linear" (Katharopoulos et al.: elu+1 features, O(1) decoding state),
  # or "sparse" (block-sparse softmax under sparse_pattern: ops.sparse).
  attention_kind: Literal["softmax", "linear", "sparse"] = "softmax"
  # attention_kind="sparse": an ops.SparsePattern (or its fields as a mapping); None: Child et
  # al.'s fixed pattern, SparsePattern.fixed() (blocks of 128, 8 summary positions).
  sparse_pattern: ops.SparsePattern | None = None
  # Linear attention's decay per position (RetNet's gamma): None, one float for every head, a
  # tuple of one per head, or "retnet" (head h decays by 1 - 2^(-5 - h), RetNet's schedule).
  linear_decay: float | tuple[float, ...] | Literal["retnet"] | None = None
  linear_chunk: int = 64  # positions per chunk of linear attention's parallel form
  dropout_rate: float = 0.0  # embedding and residual dropout (GPT-2 used 0.1)
  attention_dropout_rate: float = 0.0
  init_std: float = 0.02
  dtype: str = "float32"  # compute dtype
  param_dtype: str = "float32"
  # Float32 products: "float32" (as PyTorch/NumPy; GPUs and TPUs then run them at their full-
  # precision rate), "tensorfloat32", "bfloat16", "default" (JAX's setting). ops/precision.py.
  matmul_precision: str = "float32"
  remat: Remat = "none"
  # True: one lax.scan over the stacked layers; False: an unrolled Python loop over the same
  # parameters; "auto": see unrolls_layers.
  scan_layers: bool | Literal["auto"] = "auto"
  # Reversible residual layers (layers.reversible, the Reformer's): activations recomputed in
  # the backward pass, so training memory does not grow with num_layers (needs remat "none").
  reversible: bool = False
  # Kernel of ops.dot_product_attention: "xla", "chunked", "cudnn", "splash"; None: the
  # backend's choice (Backend.attention).
  attention_impl: ops.Implementation | None = None

  def __post_init__(self):
    self._validate_heads()
    _positive(self, "num_layers")
    _scan_layers(self)
    _num_labels(self)
    _choice(self, "position", ("learned", "sinusoidal", "rope", "alibi", "none"))
    _choice(self, "norm", ("layernorm", "rmsnorm"))
    _choice(self, "activation", _ACTIVATIONS)
    if self.sliding_window is not None:
      _positive(self, "sliding_window")
    _choice(self, "attention_kind", ("softmax", "linear", "sparse"))
    _positive(self, "linear_chunk")
    _sparse_pattern(self, causal=True)
    if self.attention_kind == "sparse" and (
      self.sliding_window is not None or self.position == "alibi"
    ):
      raise ValueError(
        f"attention_kind='sparse' takes no sliding_window or ALiBi bias "
        f"(sliding_window={self.sliding_window!r}, position={self.position!r})"
      )
    if self.attention_kind == "linear":
      if self.sliding_window is not None or self.position == "alibi":
        raise ValueError(
          f"attention_kind='linear' takes no sliding_window or ALiBi bias "
          f"(sliding_window={self.sliding_window!r}, position={self.position!r})"
        )
      d = self.linear_decay
      if isinstance(d, list):  # a YAML sequence: stored as a tuple, so the config hashes
        d = tuple(d)
        object.__setattr__(self, "linear_decay", d)
      gammas = d if isinstance(d, tuple) else (d,)
      if (
        d is not None
        and d != "retnet"
        and (
          isinstance(d, tuple)
          and len(d) != self.num_heads
          or not gammas
          or any(
            isinstance(g, bool) or not isinstance(g, (int, float)) or not 0.0 < g <= 1.0
            for g in gammas
          )
        )
      ):
        raise ValueError(
          f"linear_decay={d!r} must be None, 'retnet', a number in (0, 1] or "
          f"one such number per head (num_heads={self.num_heads})"
        )
    elif self.linear_decay is not None:
      raise ValueError(f"linear_decay={self.linear_decay!r} needs attention_kind='linear'")
    if self.position == "rope" and self.head_size % 2:
      raise ValueError(f"head_dim={self.head_size} must be even for rotary positions")
    if self.position == "sinusoidal" and self.d_model % 2:
      raise ValueError(f"d_model={self.d_model} must be even for sinusoidal positions")
    if not isinstance(self.reversible, bool):
      raise ValueError(f"reversible={self.reversible!r} must be true or false")
    if self.reversible and self.remat != "none":
      raise ValueError(
        f"reversible=True recomputes activations already: remat={self.remat!r} must be 'none'"
      )

  def block_config(self) -> BlockConfig:
    return BlockConfig(
      d_model=self.d_model,
      num_heads=self.num_heads,
      num_kv_heads=self.kv_heads,
      head_dim=self.head_size,
      d_ff=self.d_ff,
      activation=self.activation,
      gated=self.gated,
      norm=self.norm,
      norm_eps=self.norm_eps,
      pre_norm=True,
      use_bias=self.use_bias,
      rope_theta=self.rope_theta if self.position == "rope" else None,
      rope_interleaved=self.rope_interleaved,
      rope_scaling=self.rope_scaling,
      dropout_rate=self.dropout_rate,
      attention_dropout_rate=self.attention_dropout_rate,
      init_std=self.init_std,
      # GPT-2: "scale the weights of residual layers at initialization by 1/sqrt(N)".
      out_init_std=self.init_std / (2 * self.num_layers) ** 0.5,
      dtype=self.dtype,
      param_dtype=self.param_dtype,
      attention_impl=self.attention_impl,
      linear=self.linear_kind(),
      approx=self.approx_kind(),
    )

  def approx_kind(self) -> ApproxKind | None:
    """The block-sparse kind (``layers.approx.SparseKind``), or None."""
    if self.attention_kind != "sparse":
      return None
    return SparseKind(self.sparse_pattern or ops.SparsePattern.fixed())

  def linear_kind(self) -> LinearKind | None:
    """Linear attention's options (``layers.LinearKind``), or None for softmax attention."""
    if self.attention_kind != "linear":
      return None
    decay = self.linear_decay
    if decay == "retnet":
      decay = tuple(1.0 - 2.0 ** (-5.0 - h) for h in range(self.num_heads))
    elif isinstance(decay, tuple):
      decay = tuple(float(g) for g in decay)
    elif decay is not None:
      decay = (float(decay),) * self.num_heads
    return LinearKind(chunk_size=self.linear_chunk, decay=decay)


@dataclasses.dataclass(frozen=True, slots=True)
class BERTConfig(_Heads):
  """BERT (Devlin et al.): post-LayerNorm encoder with MLM, NSP and optional classification
  heads."""

  vocab_size: int = 30522
  d_model: int = 768
  num_layers: int = 12
  num_heads: int = 12
  num_kv_heads: int | None = None
  head_dim: int | None = None
  d_ff: int = 3072
  max_len: int = 512
  type_vocab_size: int = 2  # segment A / segment B
  norm_eps: float = 1e-12
  activation: ops.Activation = "gelu"
  num_labels: int = 0  # > 0 adds a sequence-classification head
  dropout_rate: float = 0.1
  attention_dropout_rate: float = 0.1
  init_std: float = 0.02
  dtype: str = "float32"
  param_dtype: str = "float32"
  # Float32 products: "float32" (as PyTorch/NumPy; GPUs and TPUs then run them at their full-
  # precision rate), "tensorfloat32", "bfloat16", "default" (JAX's setting). ops/precision.py.
  matmul_precision: str = "float32"
  remat: Remat = "none"
  scan_layers: bool | Literal["auto"] = "auto"  # see unrolls_layers
  # Kernel of ops.dot_product_attention: "xla", "chunked", "cudnn", "splash"; None: the
  # backend's choice (Backend.attention).
  attention_impl: ops.Implementation | None = None
  # "softmax"; "linformer" (keys and values projected along the sequence to linformer_rows
  # rows, Wang et al. 2020: ops.linformer); "sparse" (block-sparse softmax: ops.sparse).
  attention_kind: Literal["softmax", "linformer", "sparse"] = "softmax"
  linformer_rows: int = 128  # Linformer's k: projected keys/values per layer
  linformer_share_kv: bool = False  # one projection for keys and values (per layer)
  # attention_kind="sparse": an ops.SparsePattern (or its fields as a mapping); None: BigBird's,
  # SparsePattern.bigbird() (blocks of 64, windows of 3 blocks, 2 global and 3 random blocks).
  sparse_pattern: ops.SparsePattern | None = None

  def __post_init__(self):
    self._validate_heads()
    _positive(self, "num_layers", "type_vocab_size", "linformer_rows")
    _scan_layers(self)
    _choice(self, "activation", _ACTIVATIONS)
    _num_labels(self)
    _choice(self, "attention_kind", ("softmax", "linformer", "sparse"))
    _sparse_pattern(self, causal=False)
    if self.attention_kind != "softmax" and self.attention_dropout_rate > 0.0:
      raise ValueError(
        f"attention_kind={self.attention_kind!r} has no attention dropout: "
        f"attention_dropout_rate={self.attention_dropout_rate} must be 0"
      )

  def approx_kind(self) -> ApproxKind | None:
    """Linformer's or the block-sparse kind (``layers.approx``), or None for softmax."""
    match self.attention_kind:
      case "softmax":
        return None
      case "linformer":
        return LinformerKind(
          rows=self.linformer_rows, max_len=self.max_len, share_kv=self.linformer_share_kv
        )
      case "sparse":
        return SparseKind(self.sparse_pattern or ops.SparsePattern.bigbird())
      case _:
        raise ValueError(f"attention_kind={self.attention_kind!r}")

  def block_config(self) -> BlockConfig:
    return BlockConfig(
      d_model=self.d_model,
      num_heads=self.num_heads,
      num_kv_heads=self.kv_heads,
      head_dim=self.head_size,
      d_ff=self.d_ff,
      activation=self.activation,
      gated=False,
      norm="layernorm",
      norm_eps=self.norm_eps,
      pre_norm=False,
      use_bias=True,
      dropout_rate=self.dropout_rate,
      attention_dropout_rate=self.attention_dropout_rate,
      init_std=self.init_std,
      out_init_std=self.init_std,
      dtype=self.dtype,
      param_dtype=self.param_dtype,
      attention_impl=self.attention_impl,
      approx=self.approx_kind(),
    )


@dataclasses.dataclass(frozen=True, slots=True)
class Seq2SeqConfig(_Heads):
  """Encoder-decoder: the Transformer of Vaswani et al. by default; T5 with
  relative/rmsnorm/pre-norm."""

  vocab_size: int = 37000  # one vocabulary shared by source and target
  d_model: int = 512
  num_encoder_layers: int = 6
  num_decoder_layers: int = 6
  num_heads: int = 8
  num_kv_heads: int | None = None
  head_dim: int | None = None
  d_ff: int = 2048
  max_len: int = 512  # size of the sinusoidal table (unused by relative)
  position: Literal["sinusoidal", "relative"] = "sinusoidal"
  relative_num_buckets: int = 32  # T5 relative attention buckets
  relative_max_distance: int = 128
  norm: Norm = "layernorm"
  norm_eps: float = 1e-6
  pre_norm: bool = False  # Vaswani: post-norm; T5: pre-norm plus a final norm
  activation: ops.Activation = "relu"
  gated: bool = False  # T5 v1.1: gated GELU
  use_bias: bool = True
  tie_embeddings: bool = True  # output projection = shared embedding^T
  embed_scale: bool = True  # multiply embeddings by sqrt(d_model) (Vaswani 3.4)
  logits_rescale: bool = False  # T5 (tied): decoder output * d_model^-0.5 before projecting
  num_labels: int = 0  # > 0 adds a classification head on the mean encoder state
  scale_attention: bool = True  # T5 folds 1/sqrt(H) into its initialisation: False
  dropout_rate: float = 0.1
  attention_dropout_rate: float = 0.0
  ffn_dropout_rate: float = 0.0  # after the feed-forward activation (T5 uses dropout_rate)
  init_std: float = 0.02
  embed_init_std: float | None = None  # None: d_model^-0.5 (embeddings are scaled by sqrt(d))
  dtype: str = "float32"
  param_dtype: str = "float32"
  # Float32 products: "float32" (as PyTorch/NumPy; GPUs and TPUs then run them at their full-
  # precision rate), "tensorfloat32", "bfloat16", "default" (JAX's setting). ops/precision.py.
  matmul_precision: str = "float32"
  remat: Remat = "none"
  scan_layers: bool | Literal["auto"] = "auto"  # see unrolls_layers
  # Kernel of ops.dot_product_attention: "xla", "chunked", "cudnn", "splash"; None: the
  # backend's choice (Backend.attention).
  attention_impl: ops.Implementation | None = None

  def __post_init__(self):
    self._validate_heads()
    _positive(
      self,
      "num_encoder_layers",
      "num_decoder_layers",
      "relative_num_buckets",
      "relative_max_distance",
    )
    _scan_layers(self)
    _num_labels(self)
    _choice(self, "position", ("sinusoidal", "relative"))
    _rate(self, "ffn_dropout_rate")
    _choice(self, "norm", ("layernorm", "rmsnorm"))
    _choice(self, "activation", _ACTIVATIONS)
    if self.position == "sinusoidal" and self.d_model % 2:
      raise ValueError(f"d_model={self.d_model} must be even for sinusoidal positions")
    if self.position == "relative" and self.relative_num_buckets < 4:
      raise ValueError(f"relative_num_buckets={self.relative_num_buckets} must be >= 4")

  @property
  def embedding_init_std(self) -> float:
    return self.d_model**-0.5 if self.embed_init_std is None else self.embed_init_std

  def block_config(self, *, decoder: bool) -> BlockConfig:
    return BlockConfig(
      d_model=self.d_model,
      num_heads=self.num_heads,
      num_kv_heads=self.kv_heads,
      head_dim=self.head_size,
      d_ff=self.d_ff,
      activation=self.activation,
      gated=self.gated,
      norm=self.norm,
      norm_eps=self.norm_eps,
      pre_norm=self.pre_norm,
      use_bias=self.use_bias,
      cross_attention=decoder,
      attention_scale=None if self.scale_attention else 1.0,
      dropout_rate=self.dropout_rate,
      attention_dropout_rate=self.attention_dropout_rate,
      ffn_dropout_rate=self.ffn_dropout_rate,
      init_std=self.init_std,
      out_init_std=self.init_std,
      dtype=self.dtype,
      param_dtype=self.param_dtype,
      attention_impl=self.attention_impl,
    )


def _floats(cfg, *names):
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


_LAYER_TYPES = ("mamba", "attention")


@dataclasses.dataclass(frozen=True, slots=True)
class MambaConfig(_Heads):
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
    _positive(
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
    _choice(self, "mixer", ("mamba1", "mamba2"))
    _choice(self, "ssm_scan", ("auto", "associative", "sequential"))
    _choice(self, "ssm_impl", ("auto", "xla", "pallas"))
    _floats(
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
      _positive(self, "dt_rank")
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
      _positive(self, "head_dim")
    if self.num_kv_heads is not None:
      _positive(self, "num_kv_heads")
      if self.num_heads % self.num_kv_heads:
        raise ValueError(
          f"num_kv_heads={self.num_kv_heads} does not divide num_heads={self.num_heads}"
        )
    _choice(self, "position", ("none", "rope"))
    if self.position == "rope" and self.head_size % 2:
      raise ValueError(f"head_dim={self.head_size} must be even for rotary positions")
    _choice(self, "activation", _ACTIVATIONS)
    _rate(self, "dropout_rate")
    _dtype(self, "dtype", "param_dtype")
    _choice(self, "matmul_precision", ops.precision.PRECISIONS)
    _choice(self, "remat", _REMATS)
    _scan_layers(self)
    _choice(self, "attention_impl", _ATTENTION_IMPLS)

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


_REFORMER_KINDS = ("lsh", "local")


@dataclasses.dataclass(frozen=True, slots=True)
class ReformerConfig:
  """The Reformer (Kitaev et al. 2020) as a causal LM (``models.Reformer``): reversible layers of
  LSH or local attention, chunked feed-forward, axial positions. Field names follow the other
  families; the defaults are transformers' ``ReformerConfig``'s."""

  vocab_size: int = 320
  d_model: int = 256
  num_heads: int = 12
  head_dim: int = 64
  d_ff: int = 512
  attn_layers: tuple[str, ...] = ("local", "lsh", "local", "lsh", "local", "lsh")  # "lsh"/"local"
  max_len: int = 4096
  # Axial positions: position p gets [A0[p // w], A1[p % w]] for axial_pos_shape (h, w), widths
  # axial_pos_dims (summing to d_model), h * w >= max_len; None: a learned [max_len, D] table.
  axial_pos_shape: tuple[int, int] | None = (64, 64)
  axial_pos_dims: tuple[int, int] = (64, 192)
  axial_init_std: float = 1.0
  causal: bool = True  # a decoder (transformers' is_decoder)
  lsh_chunk_length: int = 64
  lsh_chunks_before: int = 1
  lsh_chunks_after: int = 0
  n_hashes: int = 1
  n_buckets: int | tuple[int, ...] = 64  # even; or even factors whose product is the buckets
  hash_seed: int = 0  # the random rotations' seed (ops.lsh.random_rotations)
  local_chunk_length: int = 64
  local_chunks_before: int = 1
  local_chunks_after: int = 0
  ff_chunk: int = 0  # chunked feed-forward: positions per chunk; 0: at once
  activation: ops.Activation = "relu"
  norm_eps: float = 1e-12
  dropout_rate: float = 0.0  # embeddings, residual branches and the final norm
  init_std: float = 0.02
  dtype: str = "float32"
  param_dtype: str = "float32"
  matmul_precision: str = "float32"

  def __post_init__(self):
    for name in ("attn_layers", "axial_pos_shape", "axial_pos_dims", "n_buckets"):
      if isinstance(getattr(self, name), list):  # from YAML / JSON
        object.__setattr__(self, name, tuple(getattr(self, name)))
    _positive(
      self,
      "vocab_size",
      "d_model",
      "num_heads",
      "head_dim",
      "d_ff",
      "max_len",
      "lsh_chunk_length",
      "local_chunk_length",
      "n_hashes",
    )
    for name in (
      "lsh_chunks_before",
      "lsh_chunks_after",
      "local_chunks_before",
      "local_chunks_after",
      "ff_chunk",
      "hash_seed",
    ):
      if not isinstance(getattr(self, name), int) or getattr(self, name) < 0:
        raise ValueError(f"{name}={getattr(self, name)!r} must be an integer >= 0")
    if (
      not isinstance(self.attn_layers, tuple)
      or not self.attn_layers
      or any(k not in _REFORMER_KINDS for k in self.attn_layers)
    ):
      raise ValueError(
        f"attn_layers={self.attn_layers!r} must be a non-empty list of 'lsh' and 'local'"
      )
    factors = (self.n_buckets,) if isinstance(self.n_buckets, int) else self.n_buckets
    if not factors or any(
      isinstance(f, bool) or not isinstance(f, int) or f < 2 or f % 2 for f in factors
    ):
      raise ValueError(
        f"n_buckets={self.n_buckets!r} must be an even integer >= 2 or a list of them"
      )
    if self.axial_pos_shape is not None:
      shape, dims = self.axial_pos_shape, self.axial_pos_dims
      if len(shape) != 2 or any(not isinstance(x, int) or x < 1 for x in shape):
        raise ValueError(f"axial_pos_shape={shape!r} must be two positive integers")
      if len(dims) != 2 or sum(dims) != self.d_model:
        raise ValueError(
          f"axial_pos_dims={dims!r} must be two widths summing to d_model={self.d_model}"
        )
      if shape[0] * shape[1] < self.max_len:
        raise ValueError(
          f"axial_pos_shape={shape!r} covers {shape[0] * shape[1]} positions, "
          f"fewer than max_len={self.max_len}"
        )
    _choice(self, "activation", _ACTIVATIONS)
    _rate(self, "dropout_rate")
    _dtype(self, "dtype", "param_dtype")
    _choice(self, "matmul_precision", ops.precision.PRECISIONS)
    if not self.norm_eps > 0:
      raise ValueError(f"norm_eps={self.norm_eps!r} must be > 0")

  @property
  def num_layers(self) -> int:
    return len(self.attn_layers)


ModelConfig = GPTConfig | BERTConfig | Seq2SeqConfig | MambaConfig | ReformerConfig

# "auto" unrolls at most this many layers in all (encoder and decoder together): the unrolled
# program's compile time grows with every layer (experiments/PERFORMANCE.md, "Unrolled layers").
UNROLL_MAX_LAYERS = 12


def unrolls_layers(config: ModelConfig, backend: backends.Backend | None = None) -> bool:
  """Whether ``config``'s layer stacks run as an unrolled loop instead of one ``lax.scan``.

  ``scan_layers`` true or false says so. ``"auto"`` (the default) unrolls a model of at most
  ``UNROLL_MAX_LAYERS`` layers where the backend asks for it (``Backend.unrolls_layers``: on a
  GPU, and on a CPU whose bfloat16 products run on its bf16 units); anything else, and
  everything on a TPU, is scanned. Unrolled, the step skips the scan's
  stacking of each layer's saved residuals and gradients, at the price of compiling every layer
  (experiments/PERFORMANCE.md, "Unrolled layers"). The parameters are stacked either way, so
  checkpoints do not depend on it.

  Args:
    config: a model config.
    backend: the backend the model runs on; default ``backends.current()``.
  """
  if config.scan_layers != "auto":
    return not config.scan_layers
  layers = (
    config.num_encoder_layers + config.num_decoder_layers
    if isinstance(config, Seq2SeqConfig)
    else config.num_layers
  )
  if layers > UNROLL_MAX_LAYERS:
    return False
  return (backend or backends.current()).unrolls_layers(config.dtype)


_FAMILIES = {
  "gpt": GPTConfig,
  "bert": BERTConfig,
  "seq2seq": Seq2SeqConfig,
  "mamba": MambaConfig,
  "reformer": ReformerConfig,
}


def config_to_dict(config: ModelConfig) -> dict:
  """``{"family": "gpt", **fields}``, YAML-able (RoPE scaling becomes a nested mapping)."""
  family = next(k for k, v in _FAMILIES.items() if isinstance(config, v))
  fields = {f.name: getattr(config, f.name) for f in dataclasses.fields(config)}
  if fields.get("rope_scaling") is not None:
    fields["rope_scaling"] = dataclasses.asdict(fields["rope_scaling"])
  # Tuples (per-head linear_decay, Mamba's layer_types, time_step_limit) as lists: YAML has no
  # tuple.
  fields = {k: list(v) if isinstance(v, tuple) else v for k, v in fields.items()}
  if fields.get("sparse_pattern") is not None:
    fields["sparse_pattern"] = dataclasses.asdict(fields["sparse_pattern"])
    fields["sparse_pattern"]["global_blocks"] = list(fields["sparse_pattern"]["global_blocks"])
  return {"family": family, **fields}


def config_from_dict(spec: dict) -> ModelConfig:
  """Inverse of ``config_to_dict``; unknown fields raise ``ValueError`` naming them."""
  spec = dict(spec)
  family = spec.pop("family", None)
  if family not in _FAMILIES:
    raise ValueError(f"family={family!r} must be one of {', '.join(_FAMILIES)}")
  cls = _FAMILIES[family]
  known = {f.name for f in dataclasses.fields(cls)}
  unknown = sorted(set(spec) - known)
  if unknown:
    raise ValueError(f"{cls.__name__} has no field(s) {', '.join(unknown)}")
  if isinstance(spec.get("rope_scaling"), dict):
    spec["rope_scaling"] = ops.RopeScaling(**spec["rope_scaling"])
  return cls(**spec)
