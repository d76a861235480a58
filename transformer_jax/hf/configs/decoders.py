"""GPT-2, LLaMA, Mistral, Qwen2 and Qwen3 ``config.json`` <-> ``GPTConfig``.

GPT-2 is the learned-position, LayerNorm, GELU decoder; LLaMA the RoPE, RMSNorm, gated-SiLU one
with grouped-query heads, whose RoPE settings are read in both transformers 4's (``rope_theta``,
``rope_scaling``) and 5's (``rope_parameters``) spellings and written in both; Mistral is LLaMA
with a sliding window; Qwen2 is LLaMA with query/key/value biases and Qwen3 LLaMA with per-head
query/key norms (``qk_norm``), both with a sliding window on every layer or none. Each ``*_from``
reads a dict into our config and each ``*_to`` writes one; ``architectures.to_hf`` checks the
written dict by reading it back.
"""

from __future__ import annotations

import dataclasses

from transformer_jax import ops
from transformer_jax.hf.configs import common
from transformer_jax.hf.errors import CheckpointError, UnsupportedError
from transformer_jax.models import GPTConfig

# --- GPT-2 ----------------------------------------------------------------------------------------


def gpt2_from(hf: dict) -> GPTConfig:
  """``GPTConfig`` from a GPT-2 ``config.json`` dict."""
  common.require(hf, "scale_attn_weights", True, True)
  common.require(hf, "scale_attn_by_inverse_layer_idx", False, False)
  common.require(hf, "add_cross_attention", False, False)
  f = common.Fields(hf)
  d = f.int("n_embd", 768)
  return GPTConfig(
    vocab_size=f.int("vocab_size", 50257),
    d_model=d,
    num_layers=f.int("n_layer", 12),
    num_heads=f.int("n_head", 12),
    d_ff=f.int("n_inner", null=True) or 4 * d,
    max_len=f.int("n_positions", 1024),
    position="learned",
    norm="layernorm",
    norm_eps=f.float("layer_norm_epsilon", 1e-5),
    activation=common.activation(f.str("activation_function", "gelu_new"), "activation_function"),
    gated=False,
    use_bias=True,
    tie_embeddings=f.bool("tie_word_embeddings", True),
    dropout_rate=f.float("resid_pdrop", 0.1),
    attention_dropout_rate=f.float("attn_pdrop", 0.1),
    init_std=f.float("initializer_range", 0.02),
  )


def gpt2_to(c: GPTConfig) -> dict:
  """GPT-2's ``config.json`` fields for ``c``."""
  return dict(
    model_type="gpt2",
    vocab_size=c.vocab_size,
    n_embd=c.d_model,
    n_layer=c.num_layers,
    n_head=c.num_heads,
    n_inner=c.d_ff,
    n_positions=c.max_len,
    layer_norm_epsilon=c.norm_eps,
    activation_function=common.ACTIVATIONS_BACK[c.activation],
    tie_word_embeddings=c.tie_embeddings,
    resid_pdrop=c.dropout_rate,
    embd_pdrop=c.dropout_rate,
    attn_pdrop=c.attention_dropout_rate,
    initializer_range=c.init_std,
    scale_attn_weights=True,
  )


# --- LLaMA ----------------------------------------------------------------------------------------


def _llama_rope(hf: dict) -> tuple[float, ops.RopeScaling | None]:
  # transformers 5 writes rope_parameters {rope_type, rope_theta, ...}; 4.x wrote rope_theta plus
  # rope_scaling {type|rope_type, factor, ...}. Both are read.
  f = common.Fields(hf)
  params = dict(f.object("rope_scaling"))
  params.update(f.object("rope_parameters"))
  where = "rope_parameters." if "rope_parameters" in hf else "rope_scaling."
  p = common.Fields(params, where)
  theta = p.float("rope_theta", f.float("rope_theta", 10000.0))
  kind = p.str("rope_type", p.str("type", "default"))
  partial = p.float("partial_rotary_factor", f.float("partial_rotary_factor", 1.0))
  if partial != 1.0:
    raise UnsupportedError("partial_rotary_factor != 1 (partial rotary embedding) is not supported")
  if p.float("attention_factor", null=True) not in (None, 1.0):
    raise UnsupportedError(f"rope attention_factor={params['attention_factor']!r} is not supported")
  match kind:
    case "default":
      return theta, None
    case "linear":
      return theta, ops.RopeScaling("linear", factor=p.float("factor", 1.0))
    case "llama3":
      for key in (
        "factor",
        "low_freq_factor",
        "high_freq_factor",
        "original_max_position_embeddings",
      ):
        if key not in params:
          raise CheckpointError(f"{where}{key}: missing (rope_type 'llama3' needs it)")
      return theta, ops.RopeScaling(
        "llama3",
        factor=p.float("factor"),
        low_freq_factor=p.float("low_freq_factor"),
        high_freq_factor=p.float("high_freq_factor"),
        original_max_len=p.int("original_max_position_embeddings"),
      )
    case _:
      raise UnsupportedError(
        f"rope scaling type {kind!r} is not supported (supported: default, linear, llama3)"
      )


def llama_from(hf: dict) -> GPTConfig:
  """``GPTConfig`` from a LLaMA ``config.json`` dict (RoPE settings in either spelling)."""
  f = common.Fields(hf)
  attn_bias, mlp_bias = f.bool("attention_bias", False), f.bool("mlp_bias", False)
  if attn_bias != mlp_bias:
    raise UnsupportedError(
      f"attention_bias={attn_bias} with mlp_bias={mlp_bias} is not supported: biases are on both "
      "the attention and MLP projections or on neither"
    )
  theta, scaling = _llama_rope(hf)
  d, n = f.int("hidden_size", 4096), f.int("num_attention_heads", 32)
  return GPTConfig(
    vocab_size=f.int("vocab_size", 32000),
    d_model=d,
    num_layers=f.int("num_hidden_layers", 32),
    num_heads=n,
    num_kv_heads=f.int("num_key_value_heads", null=True) or n,
    head_dim=f.int("head_dim", null=True) or (d // n if n else None),
    d_ff=f.int("intermediate_size", 11008),
    max_len=f.int("max_position_embeddings", 2048),
    position="rope",
    norm="rmsnorm",
    norm_eps=f.float("rms_norm_eps", 1e-6),
    activation=common.activation(f.str("hidden_act", "silu"), "hidden_act"),
    gated=True,
    use_bias=attn_bias,
    tie_embeddings=f.bool("tie_word_embeddings", False),
    rope_theta=theta,
    rope_scaling=scaling,
    dropout_rate=0.0,
    attention_dropout_rate=f.float("attention_dropout", 0.0),
    init_std=f.float("initializer_range", 0.02),
  )


def llama_to(c: GPTConfig) -> dict:
  """LLaMA's ``config.json`` fields for ``c`` (RoPE in transformers 4's and 5's spellings)."""
  rope = {"rope_type": "default", "rope_theta": c.rope_theta}
  s = c.rope_scaling
  if s is not None and s.kind == "linear":
    rope.update(rope_type="linear", factor=s.factor)
  elif s is not None and s.kind == "llama3":
    rope.update(
      rope_type="llama3",
      factor=s.factor,
      low_freq_factor=s.low_freq_factor,
      high_freq_factor=s.high_freq_factor,
      original_max_position_embeddings=s.original_max_len,
    )
  elif s is not None:
    raise UnsupportedError(f"RopeScaling kind {s.kind!r} has no LLaMA equivalent in transformers")
  return dict(
    model_type="llama",
    vocab_size=c.vocab_size,
    hidden_size=c.d_model,
    num_hidden_layers=c.num_layers,
    num_attention_heads=c.num_heads,
    num_key_value_heads=c.kv_heads,
    head_dim=c.head_size,
    intermediate_size=c.d_ff,
    max_position_embeddings=c.max_len,
    rms_norm_eps=c.norm_eps,
    hidden_act=common.ACTIVATIONS_BACK[c.activation],
    attention_bias=c.use_bias,
    mlp_bias=c.use_bias,
    tie_word_embeddings=c.tie_embeddings,
    rope_parameters=rope,
    # transformers 4.x reads these two instead of rope_parameters.
    rope_theta=c.rope_theta,
    rope_scaling=None if rope["rope_type"] == "default" else rope,
    attention_dropout=c.attention_dropout_rate,
    initializer_range=c.init_std,
  )


def mistral_from(hf: dict) -> GPTConfig:
  """Mistral: LLaMA's layers, attention over the last ``sliding_window`` tokens (null: none)."""
  window = common.Fields(hf).int("sliding_window", null=True)
  return dataclasses.replace(llama_from(hf), sliding_window=window)


def mistral_to(c: GPTConfig) -> dict:
  """Mistral's ``config.json`` fields for ``c``: LLaMA's plus ``sliding_window``."""
  return {**llama_to(c), "model_type": "mistral", "sliding_window": c.sliding_window}


# --- Qwen2, Qwen3 ---------------------------------------------------------------------------------

_LAYER_TYPES = ("full_attention", "sliding_attention")
# Where transformers' Qwen2Config and Qwen3Config defaults differ from LlamaConfig's.
_QWEN_DEFAULTS = dict(vocab_size=151936, intermediate_size=22016, max_position_embeddings=32768)


def _qwen_window(hf: dict, num_layers: int) -> int | None:
  """The sliding window every layer has, or None for full attention everywhere.

  transformers gives layer ``i`` a window of ``sliding_window`` when ``use_sliding_window`` is
  true and ``layer_types[i]`` (default: sliding from layer ``max_window_layers`` on) is
  ``sliding_attention``. A window on some layers only is refused by name.
  """
  f = common.Fields(hf)
  use = f.bool("use_sliding_window", False)
  window = f.int("sliding_window", null=True) if use else None
  if use and window is None:
    raise CheckpointError("use_sliding_window=true needs an integer sliding_window (got null)")
  max_window = f.int("max_window_layers", 28)
  types = f.strs("layer_types")
  if types is None:
    types = tuple(
      "sliding_attention" if use and i >= max_window else "full_attention"
      for i in range(num_layers)
    )
  if len(types) != num_layers or not set(types) <= set(_LAYER_TYPES):
    raise CheckpointError(
      f"layer_types={list(types)!r}: expected {num_layers} entries (num_hidden_layers), each "
      f"one of {', '.join(_LAYER_TYPES)}"
    )
  sliding = [i for i, t in enumerate(types) if t == "sliding_attention"] if use else []
  if not sliding:
    return None
  if len(sliding) == num_layers:
    return window
  raise UnsupportedError(
    f"use_sliding_window=true with sliding_window={window} on layers {sliding} only "
    f"(max_window_layers={max_window}, layer_types) is not supported: the window is on every "
    "layer or on none"
  )


def _qwen_window_fields(c: GPTConfig) -> dict:
  sliding = c.sliding_window is not None
  kind = "sliding_attention" if sliding else "full_attention"
  return dict(
    use_sliding_window=sliding,
    sliding_window=c.sliding_window,
    max_window_layers=0 if sliding else c.num_layers,
    layer_types=[kind] * c.num_layers,
  )


def _without_llama_biases(c: GPTConfig) -> dict:
  hf = llama_to(c)
  del hf["attention_bias"], hf["mlp_bias"]
  return hf


def qwen2_from(hf: dict) -> GPTConfig:
  """Qwen2 (and 2.5): LLaMA with biases on the query, key and value projections only, and a
  sliding window on every layer or none (``_qwen_window``)."""
  # Qwen2's biases are fixed by the architecture, not config fields.
  hf = {**_QWEN_DEFAULTS, **hf, "attention_bias": False, "mlp_bias": False}
  c = llama_from(hf)
  return dataclasses.replace(c, qkv_bias=True, sliding_window=_qwen_window(hf, c.num_layers))


def qwen2_to(c: GPTConfig) -> dict:
  """Qwen2's ``config.json`` fields for ``c`` (whose biases ``to_hf`` checks by reading back)."""
  return {**_without_llama_biases(c), "model_type": "qwen2", **_qwen_window_fields(c)}


def qwen3_from(hf: dict) -> GPTConfig:
  """Qwen3: LLaMA with RMSNorm over head_dim on queries and keys before RoPE (``qk_norm``),
  ``attention_bias`` on the query/key/value and output projections (none on the MLP), and a
  sliding window on every layer or none."""
  hf = {**_QWEN_DEFAULTS, **hf}
  f = common.Fields(hf)
  bias = f.bool("attention_bias", False)
  c = llama_from({**hf, "attention_bias": False, "mlp_bias": False})
  return dataclasses.replace(
    c,
    qkv_bias=bias or None,
    out_bias=bias or None,
    qk_norm=True,
    head_dim=f.int("head_dim", 128),
    sliding_window=_qwen_window(hf, c.num_layers),
  )


def qwen3_to(c: GPTConfig) -> dict:
  """Qwen3's ``config.json`` fields for ``c``: ``attention_bias`` is the query/key/value one."""
  qkv_bias = c.use_bias if c.qkv_bias is None else c.qkv_bias
  return {
    **_without_llama_biases(c),
    "model_type": "qwen3",
    "attention_bias": qkv_bias,
    **_qwen_window_fields(c),
  }
