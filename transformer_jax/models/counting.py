"""Analytic parameter counts, training FLOPs per token and a memory estimate for any config."""

from __future__ import annotations

import dataclasses

from transformer_jax.models.config import (
  BERTConfig,
  GPTConfig,
  MambaConfig,
  ModelConfig,
  Seq2SeqConfig,
)
from transformer_jax.models.config import moe as moe_fields


def _attention(c, use_bias: bool, out_bias: bool | None = None, qk_norm: int = 0) -> int:
  """Projections with biases on query/key/value (``use_bias``) and output (``out_bias``, None:
  ``use_bias``), plus ``qk_norm`` parameters per head_dim entry of each of the two norms."""
  d, n, k, h = c.d_model, c.num_heads, c.kv_heads, c.head_size
  weights = d * n * h + 2 * d * k * h + n * h * d
  out_bias = use_bias if out_bias is None else out_bias
  qkv = (n * h + 2 * k * h) if use_bias else 0
  return weights + qkv + (d if out_bias else 0) + 2 * qk_norm * h


def _mlp(c, gated: bool, use_bias: bool) -> int:
  ins = 2 if gated else 1
  return (
    ins * c.d_model * c.d_ff + c.d_ff * c.d_model + ((ins * c.d_ff + c.d_model) if use_bias else 0)
  )


def _experts(c) -> tuple[int, int]:
  """A mixture-of-experts layer's (parameters, parameters a token uses): gated experts, the
  router, the shared experts."""
  f = moe_fields.expert_width(c)
  per_expert = 3 * c.d_model * f
  shared_ff = c.num_shared_experts * (f if c.shared_expert_d_ff is None else c.shared_expert_d_ff)
  always = c.d_model * c.num_experts + 3 * c.d_model * shared_ff
  return c.num_experts * per_expert + always, c.experts_per_token * per_expert + always


def _norm(d: int, kind: str) -> int:
  return 2 * d if kind == "layernorm" else d


def _mamba_mixer(c: MambaConfig) -> int:
  d, e, s, w = c.d_model, c.d_inner, c.d_state, c.d_conv
  if c.mixer == "mamba1":
    r = c.time_step_rank
    channels = e
    inner = e * (r + 2 * s) + (r * e + e) + e * s + e  # x_proj, dt_proj, A_log, D
    proj = 2 * e
  else:
    n, gs = c.ssm_heads, c.ssm_groups * s
    channels = e + 2 * gs
    inner = 3 * n + e  # dt_bias, A_log, D, gated norm
    proj = 2 * e + 2 * gs + n
  in_out = d * proj + e * d + ((proj + d) if c.use_bias else 0)
  return in_out + w * channels + (channels if c.conv_bias else 0) + inner


@dataclasses.dataclass(frozen=True)
class ParamCount:
  total: int
  embedding: int  # lookup tables: tokens, positions, token types, relative-position buckets
  inactive: int = 0  # a mixture of experts' weights a token does not use (unchosen experts)

  @property
  def non_embedding(self) -> int:
    return self.total - self.embedding

  @property
  def active(self) -> int:
    """The parameters one token uses (all of them but a mixture's unchosen experts)."""
    return self.total - self.inactive


def param_count(config: ModelConfig) -> ParamCount:
  """Exact parameter count of the model the config builds, split into embedding and the rest."""
  c = config
  match c:
    case GPTConfig():
      qkv, out, mlp = (c.use_bias if b is None else b for b in (c.qkv_bias, c.out_bias, c.mlp_bias))
      attn = _attention(c, qkv, out, _norm(1, c.norm) if c.qk_norm else 0)
      dense_ffn = _mlp(c, c.gated, mlp)
      ffn, used = _experts(c) if c.num_experts else (dense_ffn,) * 2
      moe_layers = moe_fields.expert_layers(c)  # the layers of dense_layers keep the plain MLP
      block = attn + (4 if c.post_norms else 2) * _norm(c.d_model, c.norm)
      layers = c.num_layers * block + moe_layers * ffn + (c.num_layers - moe_layers) * dense_ffn
      tables = c.vocab_size * c.d_model + (c.max_len * c.d_model if c.position == "learned" else 0)
      head = 0 if c.tie_embeddings else c.d_model * c.vocab_size
      head += c.d_model * c.num_labels + c.num_labels
      total = tables + layers + _norm(c.d_model, c.norm) + head
      return ParamCount(total, tables, moe_layers * (ffn - used))
    case BERTConfig():
      block = _attention(c, True) + _mlp(c, False, True) + 2 * _norm(c.d_model, "layernorm")
      d = c.d_model
      tables = (c.vocab_size + c.max_len + c.type_vocab_size) * d
      heads = (d * d + d) + (d * d + d + 2 * d + c.vocab_size) + (2 * d + 2)  # pooler, MLM, NSP
      heads += d * c.num_labels + c.num_labels
      return ParamCount(tables + 2 * d + c.num_layers * block + heads, tables)
    case Seq2SeqConfig():
      attn, norm = _attention(c, c.use_bias), _norm(c.d_model, c.norm)
      mlp = _mlp(c, c.gated, c.use_bias)
      enc = c.num_encoder_layers * (attn + mlp + 2 * norm)
      dec = c.num_decoder_layers * (2 * attn + mlp + 3 * norm)
      tables = c.vocab_size * c.d_model
      rel = 2 * c.relative_num_buckets * c.num_heads if c.position == "relative" else 0
      final = 2 * norm if c.pre_norm else 0
      head = 0 if c.tie_embeddings else c.d_model * c.vocab_size
      head += c.d_model * c.num_labels + c.num_labels
      return ParamCount(tables + rel + enc + dec + final + head, tables + rel)
    case MambaConfig():
      d = c.d_model
      attn = d * c.num_heads * c.head_size * 2 + 2 * d * c.kv_heads * c.head_size
      mlp = (3 * d * c.d_ff + d) if c.d_ff else 0
      blocks = sum(
        d + mlp + (_mamba_mixer(c) if kind == "mamba" else attn) for kind in c.layer_kinds
      )
      tables = c.vocab_size * d
      head = 0 if c.tie_embeddings else d * c.vocab_size
      return ParamCount(tables + blocks + d + head, tables)
    case _:
      raise TypeError(f"not a model config: {type(config).__name__}")


def count_params(config: ModelConfig) -> int:
  """Total number of parameters of the model built from ``config`` (computed, not instantiated)."""
  return param_count(config).total


def _layers(c: ModelConfig) -> tuple[int, int]:
  """(self-attention layers over the sequence, number of attention modules incl. cross)."""
  if isinstance(c, Seq2SeqConfig):
    return (
      c.num_encoder_layers + c.num_decoder_layers,
      c.num_encoder_layers + 2 * c.num_decoder_layers,
    )
  if isinstance(c, MambaConfig):  # a hybrid's attention layers only
    n = c.layer_kinds.count("attention")
    return n, n
  return c.num_layers, c.num_layers


def train_flops_per_token(config: ModelConfig, seq_len: int) -> float:
  """Training FLOPs per token: ``6 N + 12 L T N_h H`` (Kaplan et al.; PaLM's attention term).

  ``N`` counts the parameters used in matrix multiplies: the non-embedding parameters a token uses
  (a mixture of experts' chosen ones only) plus the output projection onto the vocabulary (tied or
  not). The attention term counts ``q k^T`` and
  ``weights v`` over ``T`` keys (not halved for causal masking, as PaLM does). For an
  encoder-decoder, a "token" is one source plus one target token with ``S = T = seq_len``. A Mamba
  model counts its projections; the scans' elementwise work (O(E S) per token and layer) is left
  out, and attention only for a hybrid's attention layers.
  """
  pc = param_count(config)
  matmul = (
    pc.non_embedding
    - pc.inactive
    + (config.d_model * config.vocab_size if getattr(config, "tie_embeddings", True) else 0)
  )
  _, attn_modules = _layers(config)
  attn = 12 * attn_modules * seq_len * config.num_heads * config.head_size
  return 6.0 * matmul + attn


def train_memory_bytes(config: ModelConfig, batch_size: int, seq_len: int) -> dict[str, float]:
  """Rough training memory for AdamW with float32 master weights.

  State: 4 bytes of parameters + 4 of gradients + 8 of Adam moments per parameter. Activations
  follow Korthikanti et al. (2022), ``s b h (34 + 5 a s / h)`` bytes per layer at 16-bit, scaled by
  the compute dtype's size / 2, plus float32 logits and their gradient. Remat "full" keeps only each
  layer's input. An estimate for planning, not a measurement.
  """
  n = count_params(config)
  elem = 4 if config.dtype == "float32" else 2
  b, t, d = batch_size, seq_len, config.d_model
  layers, _ = _layers(config)
  per_layer = b * t * d * (34 + 5 * config.num_heads * t / d) * elem / 2
  if config.remat == "full":
    acts = layers * b * t * d * elem + per_layer
  else:
    acts = layers * per_layer
  logits = 2 * b * t * config.vocab_size * 4
  return {
    "params": 4.0 * n,
    "grads": 4.0 * n,
    "optimizer": 8.0 * n,
    "activations": acts + logits,
    "total": 16.0 * n + acts + logits,
  }
