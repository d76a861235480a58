"""``GPTConfig``: the decoder-only language model's config (``models.GPT``).

One class covers GPT-2 (learned positions, LayerNorm, GELU, tied embeddings), LLaMA and Mistral
(RoPE, RMSNorm, gated SiLU, grouped-query heads, a sliding window), ALiBi and sinusoidal
positions, linear attention (with RetNet's decays) and block-sparse attention. ``__post_init__``
refuses the combinations the model cannot run; ``block_config``, ``linear_kind`` and
``approx_kind`` turn the fields into the options ``layers`` takes.
"""

from __future__ import annotations

import dataclasses
from typing import Literal

from transformer_jax import ops
from transformer_jax.layers import BlockConfig, LinearKind, Remat
from transformer_jax.layers.approx import ApproxKind, SparseKind
from transformer_jax.models.config import checks
from transformer_jax.models.config import moe as moe_fields

LAYER_TYPES = ("full_attention", "sliding_attention")  # transformers' names for the layer kinds


@dataclasses.dataclass(frozen=True, slots=True)
class GPTConfig(checks.Heads):
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
  norm: checks.Norm = "layernorm"
  norm_eps: float = 1e-5
  activation: ops.Activation = "gelu_tanh"
  gated: bool = False  # SwiGLU/GeGLU feed-forward (LLaMA)
  use_bias: bool = True  # biases on projections (GPT-2 yes, LLaMA no)
  # Biases per projection group; None follows use_bias (Qwen2: qkv_bias=True, use_bias=False).
  qkv_bias: bool | None = None  # on the query, key and value projections
  out_bias: bool | None = None  # on the attention's output projection
  mlp_bias: bool | None = None  # on the feed-forward projections
  # The model's norm (kind, norm_eps) over head_dim on each query and key head, before RoPE
  # (Qwen3's q_norm/k_norm; one [head_dim] scale each, shared by the heads).
  qk_norm: bool = False
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
  # Gemma 2 / 3 (every default leaves the other families' programs as they were):
  # RMSNorm's scale is (norm_offset + w), in float32, w initialised to 0 when the offset is not.
  norm_offset: float = 0.0
  post_norms: bool = False  # a norm on each sub-layer's output before its residual add
  embed_scale: bool = False  # token embeddings times sqrt(d_model), in the compute dtype
  attn_softcap: float | None = None  # attention logits -> c * tanh(logits / c) (Gemma 2: 50)
  final_softcap: float | None = None  # output logits -> c * tanh(logits / c) (Gemma 2: 30)
  query_pre_attn_scalar: float | None = None  # attention scale 1/sqrt(it); None: 1/sqrt(head_dim)
  # Per layer "sliding_attention" (over the last sliding_window tokens) or "full_attention", as
  # transformers' layer_types; None: every layer as sliding_window says.
  layer_types: tuple[str, ...] | None = None
  # The sliding layers' RoPE base, without rope_scaling (Gemma 3's rope_local_base_freq); None:
  # every layer uses rope_theta and rope_scaling.
  rope_local_theta: float | None = None
  # Mixture of experts (layers.moe, models/config/moe.py): every block's MLP becomes num_experts
  # gated experts of expert_d_ff (None: d_ff), experts_per_token of them per token; 0: dense.
  num_experts: int = 0
  experts_per_token: int = 2
  expert_d_ff: int | None = None
  num_shared_experts: int = 0  # always-on experts (Qwen2-MoE, DeepSeek), one MLP of their sum
  shared_expert_d_ff: int | None = None  # None: expert_d_ff
  router_scoring: Literal["softmax", "sigmoid"] = "softmax"  # sigmoid: DeepSeek-V3
  router_norm_topk: bool = True  # the k weights renormalised (Mixtral; Qwen3's norm_topk_prob)
  router_groups: int = 1  # group-limited routing (sigmoid): experts in this many groups ...
  router_topk_groups: int = 1  # ... of which a token's best this many stay eligible
  routed_scale: float = 1.0  # multiplies the routed weights (DeepSeek's routed_scaling_factor)
  capacity_factor: float | None = None  # None: dropless; else copies over capacity are dropped
  router_aux_coef: float = 0.01  # load-balancing loss coefficient in the training loss
  router_z_coef: float = 0.0  # router z-loss coefficient
  # With experts: the indices of the layers whose feed-forward stays the plain gated MLP of d_ff
  # (Qwen3-MoE's mlp_only_layers and decoder_sparse_step, DeepSeek's first dense layers).
  dense_layers: tuple[int, ...] = ()

  def __post_init__(self):
    self._validate_heads()
    checks.positive(self, "num_layers")
    checks.scan_layers(self)
    checks.num_labels(self)
    checks.choice(self, "position", ("learned", "sinusoidal", "rope", "alibi", "none"))
    checks.choice(self, "norm", ("layernorm", "rmsnorm"))
    checks.choice(self, "activation", checks.ACTIVATIONS)
    for name in ("qkv_bias", "out_bias", "mlp_bias"):
      value = getattr(self, name)
      if not (value is None or isinstance(value, bool)):
        raise ValueError(f"{name}={value!r} must be true, false or null (follow use_bias)")
    if not isinstance(self.qk_norm, bool):
      raise ValueError(f"qk_norm={self.qk_norm!r} must be true or false")
    if self.sliding_window is not None:
      checks.positive(self, "sliding_window")
    checks.choice(self, "attention_kind", ("softmax", "linear", "sparse"))
    checks.positive(self, "linear_chunk")
    checks.sparse_pattern(self, causal=True)
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
    self._validate_gemma()
    moe_fields.validate(self)
    if not isinstance(self.reversible, bool):
      raise ValueError(f"reversible={self.reversible!r} must be true or false")
    if self.reversible and self.remat != "none":
      raise ValueError(
        f"reversible=True recomputes activations already: remat={self.remat!r} must be 'none'"
      )

  def _validate_gemma(self):
    """The Gemma fields: each refused by name when out of range or meaningless here."""
    for name in ("post_norms", "embed_scale"):
      if not isinstance(getattr(self, name), bool):
        raise ValueError(f"{name}={getattr(self, name)!r} must be true or false")
    off = self.norm_offset
    if isinstance(off, bool) or not isinstance(off, (int, float)):
      raise ValueError(f"norm_offset={off!r} must be a number (Gemma: 1.0)")
    if off and self.norm != "rmsnorm":
      raise ValueError(f"norm_offset={off!r} needs norm='rmsnorm' (norm={self.norm!r})")
    for name in ("attn_softcap", "final_softcap", "query_pre_attn_scalar", "rope_local_theta"):
      v = getattr(self, name)
      if v is not None and (isinstance(v, bool) or not isinstance(v, (int, float)) or v <= 0):
        raise ValueError(f"{name}={v!r} must be a positive number or None")
    if self.attn_softcap is not None and self.attention_kind != "softmax":
      raise ValueError(
        f"attn_softcap={self.attn_softcap!r} needs attention_kind='softmax' "
        f"(attention_kind={self.attention_kind!r})"
      )
    types = self.layer_types
    if types is None:
      if self.rope_local_theta is not None:
        raise ValueError(f"rope_local_theta={self.rope_local_theta!r} needs layer_types")
      return
    if isinstance(types, (list, str)):  # a YAML sequence: stored as a tuple, so the config hashes
      types = tuple(types) if isinstance(types, list) else (types,)
      object.__setattr__(self, "layer_types", types)
    if len(types) != self.num_layers:
      raise ValueError(
        f"layer_types has {len(types)} entries: it needs one per layer (num_layers="
        f"{self.num_layers})"
      )
    for i, kind in enumerate(types):
      if kind not in LAYER_TYPES:
        raise ValueError(
          f"layer_types[{i}]={kind!r} must be one of {', '.join(map(repr, LAYER_TYPES))}"
        )
    if "sliding_attention" in types and self.sliding_window is None:
      raise ValueError("layer_types has 'sliding_attention' layers: set sliding_window")
    if self.attention_kind != "softmax" or self.reversible:
      raise ValueError(
        f"layer_types needs softmax attention in plain layers (attention_kind="
        f"{self.attention_kind!r}, reversible={self.reversible!r})"
      )
    if self.rope_local_theta is not None and self.position != "rope":
      raise ValueError(f"rope_local_theta needs position='rope' (position={self.position!r})")

  def layer_windows(self) -> tuple[int | None, ...]:
    """Each layer's attention window (None: every earlier token)."""
    if self.layer_types is None:
      return (self.sliding_window,) * self.num_layers
    return tuple(
      self.sliding_window if kind == "sliding_attention" else None for kind in self.layer_types
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
      qkv_bias=self.qkv_bias,
      out_bias=self.out_bias,
      mlp_bias=self.mlp_bias,
      qk_norm=self.qk_norm,
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
      **self._gemma_block_fields(),
      moe=moe_fields.kind(self),
    )

  def _gemma_block_fields(self) -> dict:
    """The Gemma ``BlockConfig`` fields that differ from their defaults (none for the others)."""
    fields = dict(
      norm_offset=float(self.norm_offset) if self.norm_offset else None,
      post_norms=self.post_norms or None,
      attn_softcap=self.attn_softcap,
      rope_local_theta=self.rope_local_theta if self.position == "rope" else None,
    )
    if self.query_pre_attn_scalar is not None:
      fields["attention_scale"] = float(self.query_pre_attn_scalar) ** -0.5
    return {k: v for k, v in fields.items() if v is not None}

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
