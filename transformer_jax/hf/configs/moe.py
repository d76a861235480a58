"""Mixtral and Qwen3-MoE ``config.json`` <-> ``GPTConfig`` with experts.

Both are LLaMA's decoder (``decoders.llama_from``) whose every MLP is a mixture of gated experts:
Mixtral's ``num_local_experts`` of ``intermediate_size`` with the top ``num_experts_per_tok``
renormalised; Qwen3-MoE's ``num_experts`` of ``moe_intermediate_size``, renormalised only under
``norm_topk_prob``, with ``qk_norm`` and an explicit ``head_dim``. Qwen3-MoE's layers that stay
dense (``mlp_only_layers``, and every layer but each ``decoder_sparse_step``-th) are the config's
``dense_layers``, written back as ``mlp_only_layers`` with a step of 1.
"""

from __future__ import annotations

import dataclasses

from transformer_jax.hf.configs import common, decoders
from transformer_jax.hf.errors import UnsupportedError
from transformer_jax.models import GPTConfig
from transformer_jax.models.config import moe as moe_fields


def _llama_fields(c: GPTConfig) -> dict:
  dense = dataclasses.replace(c, num_experts=0, dense_layers=(), d_ff=moe_fields.expert_width(c))
  hf = decoders.llama_to(dense)
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
    dense_layers=_qwen3_dense_layers(f, base.num_layers),
  )


def _qwen3_dense_layers(f: common.Fields, num_layers: int) -> tuple[int, ...]:
  """The layers transformers' ``Qwen3MoeDecoderLayer`` gives a plain MLP: those of
  ``mlp_only_layers`` and those whose ``index + 1`` is not a multiple of ``decoder_sparse_step``.

  Raises:
    UnsupportedError: a step below 1, or an index of ``mlp_only_layers`` that is no layer.
  """
  step = f.int("decoder_sparse_step", 1)
  if step < 1:
    raise UnsupportedError(f"decoder_sparse_step={step} must be >= 1")
  only = f.ints("mlp_only_layers", ()) or ()
  outside = [i for i in only if not 0 <= i < num_layers]
  if outside:
    raise UnsupportedError(
      f"mlp_only_layers={list(only)}: {outside} outside the {num_layers} layers"
    )
  return tuple(i for i in range(num_layers) if i in only or (i + 1) % step)


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
    "mlp_only_layers": list(c.dense_layers),
    "num_experts": c.num_experts,
    "num_experts_per_tok": c.experts_per_token,
    "moe_intermediate_size": moe_fields.expert_width(c),
    "norm_topk_prob": c.router_norm_topk,
    "router_aux_loss_coef": c.router_aux_coef,
  }
