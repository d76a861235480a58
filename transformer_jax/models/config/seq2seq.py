"""``Seq2SeqConfig``: the encoder-decoder's config (``models.Seq2Seq``).

The Transformer of Vaswani et al. by default (sinusoidal positions, post-LayerNorm, scaled
embeddings); T5 with relative position buckets, RMSNorm, pre-norm, unscaled attention and the
tied-logits rescale. ``block_config(decoder=...)`` gives the encoder's and the decoder's (with
cross-attention) block options.
"""

from __future__ import annotations

import dataclasses
from typing import Literal

from transformer_jax import ops
from transformer_jax.layers import BlockConfig, Remat
from transformer_jax.models.config import checks


@dataclasses.dataclass(frozen=True, slots=True)
class Seq2SeqConfig(checks.Heads):
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
  norm: checks.Norm = "layernorm"
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
    checks.positive(
      self,
      "num_encoder_layers",
      "num_decoder_layers",
      "relative_num_buckets",
      "relative_max_distance",
    )
    checks.scan_layers(self)
    checks.num_labels(self)
    checks.choice(self, "position", ("sinusoidal", "relative"))
    checks.rate(self, "ffn_dropout_rate")
    checks.choice(self, "norm", ("layernorm", "rmsnorm"))
    checks.choice(self, "activation", checks.ACTIVATIONS)
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
