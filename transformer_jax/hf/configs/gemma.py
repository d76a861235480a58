"""Gemma 2 and Gemma 3 (text) ``config.json`` <-> ``GPTConfig``.

Both are LLaMA's layers with Gemma's fields: the (1 + w) RMSNorm (``norm_offset=1``), norms on
each sub-layer's output (``post_norms``), embeddings times sqrt(d_model), a query scale of
``query_pre_attn_scalar ** -0.5``, the gated tanh-GELU MLP and ``layer_types`` of sliding and full
layers. Gemma 2 soft-caps the attention (50) and output (30) logits; Gemma 3 normalises queries
and keys per head (``qk_norm``) and gives its sliding layers their own RoPE base
(``rope_parameters.sliding_attention``, transformers 4's ``rope_local_base_freq``) while the full
layers take ``rope_theta`` and the scaling.
"""

from __future__ import annotations

from transformer_jax.hf.configs import common, decoders
from transformer_jax.hf.errors import UnsupportedError
from transformer_jax.models import GPTConfig

# Transformers' default layer_types: every `pattern`-th layer is full, the others sliding.
_PATTERN = {"gemma2": 2, "gemma3_text": 6}


def _layer_types(hf: dict, family: str, num_layers: int) -> tuple[str, ...]:
  f = common.Fields(hf)
  types = f.strs("layer_types")
  if types is None:
    pattern = f.int("sliding_window_pattern", _PATTERN[family])
    return tuple(
      "sliding_attention" if (i + 1) % pattern else "full_attention" for i in range(num_layers)
    )
  return types


def _rope(hf: dict, family: str) -> dict:
  """``rope_theta``, ``rope_scaling`` and (Gemma 3) ``rope_local_theta`` of ``hf``."""
  params = hf.get("rope_parameters")
  if family == "gemma2" or not isinstance(params, dict) or "full_attention" not in params:
    theta, scaling = decoders.rope_of(hf)
    if family == "gemma2":
      return dict(rope_theta=theta, rope_scaling=scaling)
    local = common.Fields(hf).float("rope_local_base_freq", 10000.0)
    return dict(rope_theta=theta, rope_scaling=scaling, rope_local_theta=local)
  theta, scaling = decoders.rope_of({"rope_parameters": params["full_attention"]})
  sliding = params.get("sliding_attention") or {"rope_type": "default", "rope_theta": 10000.0}
  local, local_scaling = decoders.rope_of({"rope_parameters": sliding})
  if local_scaling is not None:
    raise UnsupportedError("rope scaling on the sliding layers is not supported")
  return dict(rope_theta=theta, rope_scaling=scaling, rope_local_theta=local)


def gemma_from(hf: dict, family: str) -> GPTConfig:
  """``GPTConfig`` from a Gemma 2 (``family`` "gemma2") or Gemma 3 text ("gemma3_text")
  ``config.json`` dict."""
  f = common.Fields(hf)
  if f.bool("use_bidirectional_attention", null=True):
    raise UnsupportedError("use_bidirectional_attention=True is not supported (only causal)")
  act = f.str("hidden_activation", null=True) or f.str("hidden_act", "gelu_pytorch_tanh")
  d, n = f.int("hidden_size", 2304), f.int("num_attention_heads", 8)
  layers = f.int("num_hidden_layers", 26)
  gemma2 = family == "gemma2"
  if not gemma2 and f.float("attn_logit_softcapping", null=True) is not None:
    # Gemma3Attention keeps the field but passes no soft-cap to its attention (transformers 5).
    raise UnsupportedError(
      f"attn_logit_softcapping={hf['attn_logit_softcapping']!r} in a Gemma 3 config is not "
      "supported: transformers' Gemma 3 does not apply it (only null)"
    )
  bias = f.bool("attention_bias", False)
  return GPTConfig(
    vocab_size=f.int("vocab_size", 256000 if gemma2 else 262208),
    d_model=d,
    num_layers=layers,
    num_heads=n,
    num_kv_heads=f.int("num_key_value_heads", 4),
    head_dim=f.int("head_dim", 256),
    d_ff=f.int("intermediate_size", 9216),
    max_len=f.int("max_position_embeddings", 8192 if gemma2 else 131072),
    position="rope",
    norm="rmsnorm",
    norm_eps=f.float("rms_norm_eps", 1e-6),
    activation=common.activation(act, "hidden_activation"),
    gated=True,
    use_bias=False,
    qkv_bias=bias or None,
    out_bias=bias or None,
    qk_norm=not gemma2,
    tie_embeddings=f.bool("tie_word_embeddings", True),
    sliding_window=f.int("sliding_window", 4096, null=True),
    layer_types=_layer_types(hf, family, layers),
    norm_offset=1.0,
    post_norms=True,
    embed_scale=True,
    attn_softcap=f.float("attn_logit_softcapping", 50.0, null=True) if gemma2 else None,
    final_softcap=f.float("final_logit_softcapping", 30.0 if gemma2 else None, null=True),
    query_pre_attn_scalar=f.float("query_pre_attn_scalar", 256.0),
    attention_dropout_rate=f.float("attention_dropout", 0.0),
    init_std=f.float("initializer_range", 0.02),
    **_rope(hf, family),
  )


def _number(x: float | None):
  """An integral float as an int (transformers' configs type these fields ``int``)."""
  return int(x) if x is not None and float(x).is_integer() else x


def gemma_to(c: GPTConfig, family: str) -> dict:
  """Gemma 2's (``family`` "gemma2") or Gemma 3 text's ("gemma3_text") ``config.json`` fields."""
  if c.qk_norm != (family == "gemma3_text"):
    raise UnsupportedError(f"qk_norm={c.qk_norm!r}: Gemma 3 has it and Gemma 2 has not")
  llama = decoders.llama_to(c)
  rope = llama["rope_parameters"]
  hf = dict(
    model_type=family,
    vocab_size=c.vocab_size,
    hidden_size=c.d_model,
    num_hidden_layers=c.num_layers,
    num_attention_heads=c.num_heads,
    num_key_value_heads=c.kv_heads,
    head_dim=c.head_size,
    intermediate_size=c.d_ff,
    max_position_embeddings=c.max_len,
    rms_norm_eps=c.norm_eps,
    hidden_activation={"gelu_tanh": "gelu_pytorch_tanh"}.get(c.activation, c.activation),
    attention_bias=bool(c.qkv_bias),
    tie_word_embeddings=c.tie_embeddings,
    sliding_window=c.sliding_window,
    layer_types=list(c.layer_types or ("full_attention",) * c.num_layers),
    attn_logit_softcapping=c.attn_softcap,
    final_logit_softcapping=c.final_softcap,
    query_pre_attn_scalar=_number(c.query_pre_attn_scalar or c.head_size),
    attention_dropout=c.attention_dropout_rate,
    initializer_range=c.init_std,
    use_bidirectional_attention=False,
  )
  if family == "gemma2":
    hf["rope_parameters"] = rope
  else:
    local = 10000.0 if c.rope_local_theta is None else c.rope_local_theta
    hf["rope_parameters"] = {
      "full_attention": rope,
      "sliding_attention": {"rope_type": "default", "rope_theta": local},
    }
  return hf
