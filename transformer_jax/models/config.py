"""Model configs: frozen, hashable dataclasses validated at construction.

Field names follow the papers and are shared by the families (``vocab_size``, ``d_model``, ``d_ff``,
``num_heads``, ``num_kv_heads``, ``head_dim``, ``max_len``, ``dropout_rate``, ``dtype``...). A bad value
raises ``ValueError`` naming the field and the value. Configs are hashable, so they can be static
arguments of ``jax.jit``.
"""

from __future__ import annotations

import dataclasses
from typing import Literal

import jax.numpy as jnp

from transformer_jax import backends, ops
from transformer_jax.layers import BlockConfig, LinearKind, Remat

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
            f"num_kv_heads={self.num_kv_heads} does not divide num_heads={self.num_heads}")
    _rate(self, "dropout_rate", "attention_dropout_rate")
    _dtype(self, "dtype", "param_dtype")
    _choice(self, "matmul_precision", ops.precision.PRECISIONS)
    _choice(self, "remat", _REMATS)
    _choice(self, "attention_impl", _ATTENTION_IMPLS)
    if self.attention_impl == "cudnn" and jnp.dtype(self.dtype) not in (jnp.bfloat16, jnp.float16):
      raise ValueError(f"attention_impl='cudnn' computes in bfloat16 or float16; dtype="
                       f"{self.dtype!r}: set dtype='bfloat16' or attention_impl 'xla'/'chunked'")
    if not self.norm_eps > 0:
      raise ValueError(f"norm_eps={self.norm_eps!r} must be > 0")


@dataclasses.dataclass(frozen=True, slots=True)
class GPTConfig(_Heads):
  """A decoder-only language model: GPT-2 by default, LLaMA with rope/rmsnorm/silu+gated/GQA."""

  vocab_size: int = 50257
  d_model: int = 768
  num_layers: int = 12
  num_heads: int = 12
  num_kv_heads: int | None = None      # None: as many as num_heads (MHA); 1: MQA
  head_dim: int | None = None          # None: d_model // num_heads
  d_ff: int = 3072
  max_len: int = 1024                  # context; size of the learned/sinusoidal position table
  position: Literal["learned", "sinusoidal", "rope", "alibi", "none"] = "learned"
  norm: Norm = "layernorm"
  norm_eps: float = 1e-5
  activation: ops.Activation = "gelu_tanh"
  gated: bool = False                  # SwiGLU/GeGLU feed-forward (LLaMA)
  use_bias: bool = True                # biases on projections (GPT-2 yes, LLaMA no)
  tie_embeddings: bool = True          # output projection = token embedding^T (GPT-2)
  num_labels: int = 0                  # > 0 adds a classification head on the last real token
  rope_theta: float = 10000.0
  rope_interleaved: bool = False       # GPT-J pairing; default is LLaMA's rotate-half
  rope_scaling: ops.RopeScaling | None = None
  sliding_window: int | None = None    # local attention over the last `sliding_window` tokens
  # "softmax" attention, or "linear" (Katharopoulos et al.: elu+1 features, O(1) decoding state).
  attention_kind: Literal["softmax", "linear"] = "softmax"
  # Linear attention's decay per position (RetNet's gamma): None, one float for every head, or
  # "retnet" (head h decays by 1 - 2^(-5 - h), RetNet's schedule over the heads).
  linear_decay: float | Literal["retnet"] | None = None
  linear_chunk: int = 64               # positions per chunk of linear attention's parallel form
  dropout_rate: float = 0.0            # embedding and residual dropout (GPT-2 used 0.1)
  attention_dropout_rate: float = 0.0
  init_std: float = 0.02
  dtype: str = "float32"               # compute dtype
  param_dtype: str = "float32"
  # Float32 products: "float32" (as PyTorch/NumPy; GPUs and TPUs then run them at their full-
  # precision rate), "tensorfloat32", "bfloat16", "default" (JAX's setting). ops/precision.py.
  matmul_precision: str = "float32"
  remat: Remat = "none"
  # True: one lax.scan over the stacked layers; False: an unrolled Python loop over the same
  # parameters; "auto": see unrolls_layers.
  scan_layers: bool | Literal["auto"] = "auto"
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
    _choice(self, "attention_kind", ("softmax", "linear"))
    _positive(self, "linear_chunk")
    if self.attention_kind == "linear":
      if self.sliding_window is not None or self.position == "alibi":
        raise ValueError(f"attention_kind='linear' takes no sliding_window or ALiBi bias "
                         f"(sliding_window={self.sliding_window!r}, position={self.position!r})")
      d = self.linear_decay
      if d is not None and d != "retnet" and (isinstance(d, bool) or not isinstance(
          d, (int, float)) or not 0.0 < d <= 1.0):
        raise ValueError(f"linear_decay={d!r} must be None, 'retnet' or a number in (0, 1]")
    elif self.linear_decay is not None:
      raise ValueError(f"linear_decay={self.linear_decay!r} needs attention_kind='linear'")
    if self.position == "rope" and self.head_size % 2:
      raise ValueError(f"head_dim={self.head_size} must be even for rotary positions")
    if self.position == "sinusoidal" and self.d_model % 2:
      raise ValueError(f"d_model={self.d_model} must be even for sinusoidal positions")

  def block_config(self) -> BlockConfig:
    return BlockConfig(
        d_model=self.d_model, num_heads=self.num_heads, num_kv_heads=self.kv_heads,
        head_dim=self.head_size, d_ff=self.d_ff, activation=self.activation, gated=self.gated,
        norm=self.norm, norm_eps=self.norm_eps, pre_norm=True, use_bias=self.use_bias,
        rope_theta=self.rope_theta if self.position == "rope" else None,
        rope_interleaved=self.rope_interleaved, rope_scaling=self.rope_scaling,
        dropout_rate=self.dropout_rate, attention_dropout_rate=self.attention_dropout_rate,
        init_std=self.init_std,
        # GPT-2: "scale the weights of residual layers at initialization by 1/sqrt(N)".
        out_init_std=self.init_std / (2 * self.num_layers) ** 0.5,
        dtype=self.dtype, param_dtype=self.param_dtype, attention_impl=self.attention_impl,
        linear=self.linear_kind())

  def linear_kind(self) -> LinearKind | None:
    """Linear attention's options (``layers.LinearKind``), or None for softmax attention."""
    if self.attention_kind != "linear":
      return None
    decay = self.linear_decay
    if decay == "retnet":
      decay = tuple(1.0 - 2.0 ** (-5.0 - h) for h in range(self.num_heads))
    elif decay is not None:
      decay = (float(decay),) * self.num_heads
    return LinearKind(chunk_size=self.linear_chunk, decay=decay)


@dataclasses.dataclass(frozen=True, slots=True)
class BERTConfig(_Heads):
  """BERT (Devlin et al.): post-LayerNorm encoder with MLM, NSP and optional classification heads."""

  vocab_size: int = 30522
  d_model: int = 768
  num_layers: int = 12
  num_heads: int = 12
  num_kv_heads: int | None = None
  head_dim: int | None = None
  d_ff: int = 3072
  max_len: int = 512
  type_vocab_size: int = 2             # segment A / segment B
  norm_eps: float = 1e-12
  activation: ops.Activation = "gelu"
  num_labels: int = 0                  # > 0 adds a sequence-classification head
  dropout_rate: float = 0.1
  attention_dropout_rate: float = 0.1
  init_std: float = 0.02
  dtype: str = "float32"
  param_dtype: str = "float32"
  # Float32 products: "float32" (as PyTorch/NumPy; GPUs and TPUs then run them at their full-
  # precision rate), "tensorfloat32", "bfloat16", "default" (JAX's setting). ops/precision.py.
  matmul_precision: str = "float32"
  remat: Remat = "none"
  scan_layers: bool | Literal["auto"] = "auto"   # see unrolls_layers
  # Kernel of ops.dot_product_attention: "xla", "chunked", "cudnn", "splash"; None: the
  # backend's choice (Backend.attention).
  attention_impl: ops.Implementation | None = None

  def __post_init__(self):
    self._validate_heads()
    _positive(self, "num_layers", "type_vocab_size")
    _scan_layers(self)
    _choice(self, "activation", _ACTIVATIONS)
    _num_labels(self)

  def block_config(self) -> BlockConfig:
    return BlockConfig(
        d_model=self.d_model, num_heads=self.num_heads, num_kv_heads=self.kv_heads,
        head_dim=self.head_size, d_ff=self.d_ff, activation=self.activation, gated=False,
        norm="layernorm", norm_eps=self.norm_eps, pre_norm=False, use_bias=True,
        dropout_rate=self.dropout_rate, attention_dropout_rate=self.attention_dropout_rate,
        init_std=self.init_std, out_init_std=self.init_std, dtype=self.dtype,
        param_dtype=self.param_dtype, attention_impl=self.attention_impl)


@dataclasses.dataclass(frozen=True, slots=True)
class Seq2SeqConfig(_Heads):
  """Encoder-decoder: the Transformer of Vaswani et al. by default; T5 with relative/rmsnorm/pre-norm."""

  vocab_size: int = 37000              # one vocabulary shared by source and target
  d_model: int = 512
  num_encoder_layers: int = 6
  num_decoder_layers: int = 6
  num_heads: int = 8
  num_kv_heads: int | None = None
  head_dim: int | None = None
  d_ff: int = 2048
  max_len: int = 512                   # size of the sinusoidal table (unused by relative)
  position: Literal["sinusoidal", "relative"] = "sinusoidal"
  relative_num_buckets: int = 32       # T5 relative attention buckets
  relative_max_distance: int = 128
  norm: Norm = "layernorm"
  norm_eps: float = 1e-6
  pre_norm: bool = False               # Vaswani: post-norm; T5: pre-norm plus a final norm
  activation: ops.Activation = "relu"
  gated: bool = False                  # T5 v1.1: gated GELU
  use_bias: bool = True
  tie_embeddings: bool = True          # output projection = shared embedding^T
  embed_scale: bool = True             # multiply embeddings by sqrt(d_model) (Vaswani 3.4)
  logits_rescale: bool = False         # T5 (tied): decoder output * d_model^-0.5 before projecting
  num_labels: int = 0                  # > 0 adds a classification head on the mean encoder state
  scale_attention: bool = True         # T5 folds 1/sqrt(H) into its initialisation: False
  dropout_rate: float = 0.1
  attention_dropout_rate: float = 0.0
  ffn_dropout_rate: float = 0.0        # after the feed-forward activation (T5 uses dropout_rate)
  init_std: float = 0.02
  embed_init_std: float | None = None  # None: d_model^-0.5 (embeddings are scaled by sqrt(d))
  dtype: str = "float32"
  param_dtype: str = "float32"
  # Float32 products: "float32" (as PyTorch/NumPy; GPUs and TPUs then run them at their full-
  # precision rate), "tensorfloat32", "bfloat16", "default" (JAX's setting). ops/precision.py.
  matmul_precision: str = "float32"
  remat: Remat = "none"
  scan_layers: bool | Literal["auto"] = "auto"   # see unrolls_layers
  # Kernel of ops.dot_product_attention: "xla", "chunked", "cudnn", "splash"; None: the
  # backend's choice (Backend.attention).
  attention_impl: ops.Implementation | None = None

  def __post_init__(self):
    self._validate_heads()
    _positive(self, "num_encoder_layers", "num_decoder_layers", "relative_num_buckets",
              "relative_max_distance")
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
        d_model=self.d_model, num_heads=self.num_heads, num_kv_heads=self.kv_heads,
        head_dim=self.head_size, d_ff=self.d_ff, activation=self.activation, gated=self.gated,
        norm=self.norm, norm_eps=self.norm_eps, pre_norm=self.pre_norm, use_bias=self.use_bias,
        cross_attention=decoder, attention_scale=None if self.scale_attention else 1.0,
        dropout_rate=self.dropout_rate, attention_dropout_rate=self.attention_dropout_rate,
        ffn_dropout_rate=self.ffn_dropout_rate,
        init_std=self.init_std, out_init_std=self.init_std, dtype=self.dtype,
        param_dtype=self.param_dtype, attention_impl=self.attention_impl)


ModelConfig = GPTConfig | BERTConfig | Seq2SeqConfig

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
  layers = (config.num_encoder_layers + config.num_decoder_layers
            if isinstance(config, Seq2SeqConfig) else config.num_layers)
  if layers > UNROLL_MAX_LAYERS:
    return False
  return (backend or backends.current()).unrolls_layers(config.dtype)


_FAMILIES = {"gpt": GPTConfig, "bert": BERTConfig, "seq2seq": Seq2SeqConfig}


def config_to_dict(config: ModelConfig) -> dict:
  """``{"family": "gpt", **fields}``, YAML-able (RoPE scaling becomes a nested mapping)."""
  family = next(k for k, v in _FAMILIES.items() if isinstance(config, v))
  fields = {f.name: getattr(config, f.name) for f in dataclasses.fields(config)}
  if fields.get("rope_scaling") is not None:
    fields["rope_scaling"] = dataclasses.asdict(fields["rope_scaling"])
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
