"""Mixtral and Qwen3-MoE ``config.json`` <-> ``GPTConfig`` with experts.

Both are LLaMA's decoder (``decoders.llama_from``) whose every MLP is a mixture of gated experts:
Mixtral's ``num_local_experts`` of ``intermediate_size`` with the top ``num_experts_per_tok``
renormalised; Qwen3-MoE's ``num_experts`` of ``moe_intermediate_size``, renormalised only under
``norm_topk_prob``, with ``qk_norm`` and an explicit ``head_dim``. Layers that stay dense
(Qwen3-MoE's ``mlp_only_layers``, ``decoder_sparse_step`` > 1) are refused by name.
"""

from __future__ import annotations

import dataclasses

from transformer_jax.hf.configs import common, decoders
from transformer_jax.hf.errors import UnsupportedError
from transformer_jax.models import GPTConfig
from transformer_jax.models.config import moe as moe_fields


def _llama_fields(c: GPTConfig) -> dict:
  hf = decoders.llama_to(dataclasses.replace(c, num_experts=0, d_ff=moe_fields.expert_width(c)))
  for key in ("model_type", "mlp_bias"):
    hf.pop(key)
  return hf


def mixtral_from(hf: dict) -> GPTConfig:
  """Mixtral: LLaMA's attention (with Mistral's optional window), every MLP a mixture."""
  f = common.Fields(hf)
  common.require(hf, "router_jitter_noise", 0.0, 0.0)
  base = decoders.llama_from({**hf, "mlp_bias": False})
  return dataclasses.replace(
    base,
    sliding_window=f.int("sliding_window", null=True),
    num_experts=f.int("num_local_experts", 8),
    experts_per_token=f.int("num_experts_per_tok", 2),
    router_norm_topk=True,
    router_aux_coef=f.float("router_aux_loss_coef", 0.001),
  )


def mixtral_to(c: GPTConfig) -> dict:
  """Mixtral's ``config.json`` fields for ``c``."""
  return {
    **_llama_fields(c),
    "model_type": "mixtral",
    "sliding_window": c.sliding_window,
    "num_local_experts": c.num_experts,
    "num_experts_per_tok": c.experts_per_token,
    "router_aux_loss_coef": c.router_aux_coef,
    "router_jitter_noise": 0.0,
  }


def qwen3_moe_from(hf: dict) -> GPTConfig:
  """Qwen3-MoE: LLaMA's attention with q/k RMSNorm per head, every MLP a mixture."""
  f = common.Fields(hf)
  if f.int("decoder_sparse_step", 1) != 1 or (hf.get("mlp_only_layers") or []):
    raise UnsupportedError(
      f"decoder_sparse_step={hf.get('decoder_sparse_step')!r} / mlp_only_layers="
      f"{hf.get('mlp_only_layers')!r}: dense layers among the experts are not supported"
    )
  window = f.int("sliding_window", null=True) if f.bool("use_sliding_window", False) else None
  base = decoders.llama_from({**hf, "mlp_bias": hf.get("attention_bias", False)})
  return dataclasses.replace(
    base,
    mlp_bias=False if base.use_bias else None,  # attention biases only: the experts have none
    qk_norm=True,
    sliding_window=window,
    d_ff=f.int("intermediate_size", 6144),
    # transformers 5 writes num_local_experts (its attribute map); Qwen's own files num_experts.
    num_experts=f.int("num_local_experts", null=True) or f.int("num_experts", 128),
    experts_per_token=f.int("num_experts_per_tok", 8),
    expert_d_ff=f.int("moe_intermediate_size", 768),
    router_norm_topk=f.bool("norm_topk_prob", False),
    router_aux_coef=f.float("router_aux_loss_coef", 0.001),
  )


def qwen3_moe_to(c: GPTConfig) -> dict:
  """Qwen3-MoE's ``config.json`` fields for ``c``."""
  hf = _llama_fields(c)
  return {
    **hf,
    "model_type": "qwen3_moe",
    "intermediate_size": c.d_ff,
    "attention_bias": c.use_bias,
    "use_sliding_window": c.sliding_window is not None,
    "sliding_window": c.sliding_window,
    "decoder_sparse_step": 1,
    "mlp_only_layers": [],
    "num_experts": c.num_experts,
    "num_experts_per_tok": c.experts_per_token,
    "moe_intermediate_size": moe_fields.expert_width(c),
    "norm_topk_prob": c.router_norm_topk,
    "router_aux_loss_coef": c.router_aux_coef,
  }
