"""``BERTConfig``: the BERT-family encoder's config (``models.BERT``).

BERT itself (post-LayerNorm blocks, MLM, NSP and an optional classification head) and its
efficient-attention variants on the same weights: Linformer (keys and values projected along the
sequence) and BigBird's block-sparse attention. ``approx_kind`` maps ``attention_kind`` to the
``layers.approx`` kind the blocks run; ``block_config`` gives the encoder block's options.
"""

from __future__ import annotations

import dataclasses
from typing import Literal

from transformer_jax import ops
from transformer_jax.layers import BlockConfig, Remat
from transformer_jax.layers.approx import ApproxKind, LinformerKind, SparseKind
from transformer_jax.models.config import checks


@dataclasses.dataclass(frozen=True, slots=True)
class BERTConfig(checks.Heads):
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
    checks.positive(self, "num_layers", "type_vocab_size", "linformer_rows")
    checks.scan_layers(self)
    checks.choice(self, "activation", checks.ACTIVATIONS)
    checks.num_labels(self)
    checks.choice(self, "attention_kind", ("softmax", "linformer", "sparse"))
    checks.sparse_pattern(self, causal=False)
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
