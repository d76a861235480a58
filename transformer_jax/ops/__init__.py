"""Pure JAX functions that the models are built from. No Flax here: every function works under
``jit``, ``grad``, ``vmap`` and ``shard_map`` on plain arrays."""

from transformer_jax.ops.activations import (
  Activation,
  dropout,
  gated,
  gelu,
  gelu_tanh,
  geglu,
  get_activation,
  packed_activation,
  relu,
  silu,
  swiglu,
)
from transformer_jax.ops.attention import dot_product_attention
from transformer_jax.ops.dispatch import Implementation, choose_implementation
from transformer_jax.ops.fused_loss import linear_cross_entropy
from transformer_jax.ops.linear_attn import LinearState, linear_attention, linear_attention_step
from transformer_jax.ops.linformer import linformer_attention
from transformer_jax.ops.losses import cross_entropy
from transformer_jax.ops.lsh import local_attention, lsh_attention
from transformer_jax.ops.masks import (
  and_masks,
  causal_mask,
  padding_mask,
  segment_mask,
  segment_runs,
  sliding_window_mask,
)
from transformer_jax.ops.norms import layer_norm, rms_norm
from transformer_jax.ops.positions import (
  AlibiBias,
  RelativeBias,
  RopeScaling,
  alibi_bias,
  alibi_slopes,
  apply_rope,
  relative_position_bucket,
  relative_positions,
  rope_frequencies,
  sinusoidal_positions,
)
from transformer_jax.ops.reductions import argmax
from transformer_jax.ops.sparse import sparse_attention
from transformer_jax.ops.sparse_pattern import SparsePattern
from transformer_jax.ops.ssm import (
  SSMState,
  causal_conv1d,
  causal_conv1d_step,
  gated_rms_norm,
  selective_scan,
  selective_scan_step,
  ssd,
  ssd_step,
)

__all__ = [
  "Activation",
  "alibi_bias",
  "alibi_slopes",
  "AlibiBias",
  "and_masks",
  "apply_rope",
  "argmax",
  "causal_mask",
  "choose_implementation",
  "cross_entropy",
  "dot_product_attention",
  "dropout",
  "gated",
  "geglu",
  "gelu",
  "gelu_tanh",
  "get_activation",
  "Implementation",
  "layer_norm",
  "linear_attention",
  "linear_attention_step",
  "linear_cross_entropy",
  "LinearState",
  "linformer_attention",
  "local_attention",
  "lsh_attention",
  "packed_activation",
  "padding_mask",
  "relative_position_bucket",
  "relative_positions",
  "RelativeBias",
  "relu",
  "rms_norm",
  "rope_frequencies",
  "RopeScaling",
  "segment_mask",
  "segment_runs",
  "silu",
  "sinusoidal_positions",
  "sliding_window_mask",
  "SparsePattern",
  "sparse_attention",
  "swiglu",
  # State-space scans (Mamba-1, Mamba-2) and their convolution.
  "SSMState",
  "causal_conv1d",
  "causal_conv1d_step",
  "gated_rms_norm",
  "selective_scan",
  "selective_scan_step",
  "ssd",
  "ssd_step",
]
