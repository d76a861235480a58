"""Named configurations: the papers' sizes plus ``*-tiny`` sizes for tests and CPU demos.

``get_config("gpt2-small", vocab_size=8192)`` returns a preset with fields replaced (and
re-validated). Parameter counts at the papers' vocabularies are in the README and checked by tests.
"""

from __future__ import annotations

import dataclasses
import difflib

from transformer_jax import ops
from transformer_jax.models.config import (
  BERTConfig,
  GPTConfig,
  MambaConfig,
  ModelConfig,
  Seq2SeqConfig,
)


def _gpt2(d_model: int, num_layers: int, num_heads: int) -> GPTConfig:
  # Radford et al. 2019: vocabulary 50257, context 1024, d_ff = 4 d_model, tied embeddings.
  return GPTConfig(
    vocab_size=50257,
    d_model=d_model,
    num_layers=num_layers,
    num_heads=num_heads,
    d_ff=4 * d_model,
    max_len=1024,
  )


_LLAMA = dict(
  position="rope",
  norm="rmsnorm",
  activation="silu",
  gated=True,
  use_bias=False,
  tie_embeddings=False,
)


def _llama(**kw) -> GPTConfig:
  return GPTConfig(**{**_LLAMA, **kw})


def _gemma(gen: int, num_layers: int, **kw) -> GPTConfig:
  """Gemma ``gen`` 2 or 3: LLaMA's layers with the (1 + w) norm, sandwich norms, scaled
  embeddings, tied heads, tanh-GELU gates and head_dim 256; every second layer (Gemma 2) or
  five of six (Gemma 3) sliding."""
  pattern = 2 if gen == 2 else 6
  types = tuple(
    "sliding_attention" if (i + 1) % pattern else "full_attention" for i in range(num_layers)
  )
  base = dict(
    position="rope",
    norm="rmsnorm",
    norm_eps=1e-6,
    activation="gelu_tanh",
    gated=True,
    use_bias=False,
    tie_embeddings=True,
    head_dim=256,
    query_pre_attn_scalar=256.0,
    norm_offset=1.0,
    post_norms=True,
    embed_scale=True,
    layer_types=types,
  )
  if gen == 2:
    base.update(attn_softcap=50.0, final_softcap=30.0, max_len=8192, sliding_window=4096)
  else:
    base.update(qk_norm=True, rope_theta=1_000_000.0, rope_local_theta=10_000.0)
  return GPTConfig(num_layers=num_layers, **{**base, **kw})


def _qwen(**kw) -> GPTConfig:
  # Qwen2/2.5 and Qwen3 (Yang et al. 2024, 2025): rope_theta 1e6, RMSNorm eps 1e-6.
  return _llama(**{"rope_theta": 1000000.0, "norm_eps": 1e-6, **kw})


def _bert(d_model: int, num_layers: int) -> BERTConfig:
  # Devlin et al. and Turc et al. ("Well-Read Students Learn Better"): 64-dim heads, d_ff = 4 d.
  return BERTConfig(
    d_model=d_model, num_layers=num_layers, num_heads=d_model // 64, d_ff=4 * d_model
  )


def _transformer(d_model: int, num_heads: int, d_ff: int, dropout: float) -> Seq2SeqConfig:
  # Vaswani et al. 2017, Table 3: shared source/target BPE vocabulary of about 37000 tokens.
  return Seq2SeqConfig(
    vocab_size=37000, d_model=d_model, num_heads=num_heads, d_ff=d_ff, dropout_rate=dropout
  )


_T5 = dict(
  position="relative",
  norm="rmsnorm",
  norm_eps=1e-6,
  pre_norm=True,
  activation="relu",
  use_bias=False,
  tie_embeddings=True,
  embed_scale=False,
  logits_rescale=True,
  scale_attention=False,
  dropout_rate=0.1,
  ffn_dropout_rate=0.1,
  embed_init_std=1.0,
)


def _t5(**kw) -> Seq2SeqConfig:
  # Raffel et al. 2020: SentencePiece vocabulary of 32000 padded to 32128; 64-dim heads.
  kw = {"vocab_size": 32128, "head_dim": 64, "init_std": kw["d_model"] ** -0.5, **_T5, **kw}
  return Seq2SeqConfig(**kw)


PRESETS: dict[str, ModelConfig] = {
  # --- GPT-2 (decoder-only, learned positions, pre-LayerNorm, GELU-tanh, tied).
  "gpt2-small": _gpt2(768, 12, 12),
  "gpt2-medium": _gpt2(1024, 24, 16),
  "gpt2-large": _gpt2(1280, 36, 20),
  "gpt2-xl": _gpt2(1600, 48, 25),
  "gpt2-tiny": GPTConfig(
    vocab_size=512, d_model=64, num_layers=2, num_heads=4, d_ff=256, max_len=128
  ),
  # --- GPT with ALiBi (Press et al.) instead of learned positions.
  "gpt-alibi-tiny": GPTConfig(
    vocab_size=512, d_model=64, num_layers=2, num_heads=4, d_ff=256, max_len=128, position="alibi"
  ),
  # --- LLaMA flavour (RoPE, RMSNorm, SwiGLU, GQA, no biases, untied).
  "llama2-7b": _llama(
    vocab_size=32000,
    d_model=4096,
    num_layers=32,
    num_heads=32,
    d_ff=11008,
    max_len=4096,
    norm_eps=1e-5,
  ),
  "llama3-8b": _llama(
    vocab_size=128256,
    d_model=4096,
    num_layers=32,
    num_heads=32,
    num_kv_heads=8,
    d_ff=14336,
    max_len=8192,
    norm_eps=1e-5,
    rope_theta=500000.0,
  ),
  "llama3.2-1b": _llama(
    vocab_size=128256,
    d_model=2048,
    num_layers=16,
    num_heads=32,
    num_kv_heads=8,
    d_ff=8192,
    max_len=131072,
    norm_eps=1e-5,
    rope_theta=500000.0,
    tie_embeddings=True,
    rope_scaling=ops.RopeScaling(
      "llama3", factor=32.0, low_freq_factor=1.0, high_freq_factor=4.0, original_max_len=8192
    ),
  ),
  # TinyLlama-1.1B's shape (Zhang et al. 2024): a LLaMA-style 1B for one GPU, context 2048.
  "tinyllama-1.1b": _llama(
    vocab_size=32000,
    d_model=2048,
    num_layers=22,
    num_heads=32,
    num_kv_heads=4,
    d_ff=5632,
    max_len=2048,
    norm_eps=1e-5,
  ),
  "llama-tiny": _llama(
    vocab_size=512,
    d_model=64,
    num_layers=2,
    num_heads=4,
    num_kv_heads=2,
    d_ff=176,
    max_len=128,
    norm_eps=1e-5,
  ),
  # --- Mistral flavour: LLaMA's with grouped-query attention over a sliding window (Jiang et
  # al. 2023: window 4096, context 32k).
  "mistral-7b": _llama(
    vocab_size=32000,
    d_model=4096,
    num_layers=32,
    num_heads=32,
    num_kv_heads=8,
    d_ff=14336,
    max_len=32768,
    norm_eps=1e-5,
    sliding_window=4096,
  ),
  "mistral-tiny": _llama(
    vocab_size=512,
    d_model=64,
    num_layers=2,
    num_heads=4,
    num_kv_heads=2,
    d_ff=176,
    max_len=256,
    norm_eps=1e-5,
    sliding_window=16,
  ),
  # --- Gemma 2 (Gemma Team 2024; google/gemma-2-2b, gemma-2-9b config.json) and Gemma 3 text
  # (2025; google/gemma-3-1b-pt, the text half of gemma-3-4b-pt).
  "gemma2-2b": _gemma(
    2, 26, vocab_size=256000, d_model=2304, num_heads=8, num_kv_heads=4, d_ff=9216
  ),
  "gemma2-9b": _gemma(
    2, 42, vocab_size=256000, d_model=3584, num_heads=16, num_kv_heads=8, d_ff=14336
  ),
  "gemma3-1b": _gemma(
    3,
    26,
    vocab_size=262144,
    d_model=1152,
    num_heads=4,
    num_kv_heads=1,
    d_ff=6912,
    max_len=32768,
    sliding_window=512,
  ),
  "gemma3-4b": _gemma(
    3,
    34,
    vocab_size=262208,
    d_model=2560,
    num_heads=8,
    num_kv_heads=4,
    d_ff=10240,
    max_len=131072,
    sliding_window=1024,
    rope_scaling=ops.RopeScaling("linear", factor=8.0),
  ),
  "gemma2-tiny": _gemma(
    2,
    4,
    vocab_size=512,
    d_model=64,
    num_heads=4,
    num_kv_heads=2,
    head_dim=16,
    query_pre_attn_scalar=16.0,
    d_ff=176,
    max_len=256,
    sliding_window=16,
  ),
  "gemma3-tiny": _gemma(
    3,
    6,
    vocab_size=512,
    d_model=64,
    num_heads=4,
    num_kv_heads=2,
    head_dim=16,
    query_pre_attn_scalar=16.0,
    d_ff=176,
    max_len=256,
    sliding_window=16,
  ),
  # --- Qwen2.5 (Qwen2ForCausalLM): LLaMA's layers with biases on the query/key/value
  # projections only, rope_theta 1e6; the published config.json values.
  "qwen2.5-0.5b": _qwen(
    vocab_size=151936,
    d_model=896,
    num_layers=24,
    num_heads=14,
    num_kv_heads=2,
    d_ff=4864,
    max_len=32768,
    tie_embeddings=True,
    qkv_bias=True,
  ),
  "qwen2.5-7b": _qwen(
    vocab_size=152064,
    d_model=3584,
    num_layers=28,
    num_heads=28,
    num_kv_heads=4,
    d_ff=18944,
    max_len=131072,
    qkv_bias=True,
  ),
  "qwen2-tiny": _qwen(
    vocab_size=512,
    d_model=64,
    num_layers=2,
    num_heads=4,
    num_kv_heads=2,
    d_ff=176,
    max_len=256,
    qkv_bias=True,
  ),
  # --- Qwen3 (Qwen3ForCausalLM): RMSNorm over head_dim on queries and keys before RoPE, no
  # biases, head_dim 128 whatever d_model.
  "qwen3-0.6b": _qwen(
    vocab_size=151936,
    d_model=1024,
    num_layers=28,
    num_heads=16,
    num_kv_heads=8,
    head_dim=128,
    d_ff=3072,
    max_len=40960,
    tie_embeddings=True,
    qk_norm=True,
  ),
  "qwen3-8b": _qwen(
    vocab_size=151936,
    d_model=4096,
    num_layers=36,
    num_heads=32,
    num_kv_heads=8,
    head_dim=128,
    d_ff=12288,
    max_len=40960,
    qk_norm=True,
  ),
  "qwen3-tiny": _qwen(
    vocab_size=512,
    d_model=64,
    num_layers=2,
    num_heads=4,
    num_kv_heads=2,
    head_dim=32,
    d_ff=176,
    max_len=256,
    tie_embeddings=True,
    qk_norm=True,
  ),
  # --- Mixtures of experts: every MLP a set of gated experts (layers.moe).
  # Mixtral 8x7B (Jiang et al. 2024): Mistral 7B's attention without the window, 8 experts of
  # 14336, top 2.
  "mixtral-8x7b": _llama(
    vocab_size=32000,
    d_model=4096,
    num_layers=32,
    num_heads=32,
    num_kv_heads=8,
    d_ff=14336,
    max_len=32768,
    norm_eps=1e-5,
    rope_theta=1e6,
    num_experts=8,
    experts_per_token=2,
    router_aux_coef=0.02,
  ),
  # Qwen3-30B-A3B: 128 experts of 768, top 8 (renormalised), q/k norms, head_dim 128.
  "qwen3-30b-a3b": _llama(
    vocab_size=151936,
    d_model=2048,
    num_layers=48,
    num_heads=32,
    num_kv_heads=4,
    head_dim=128,
    qk_norm=True,
    d_ff=6144,
    max_len=40960,
    norm_eps=1e-6,
    rope_theta=1e6,
    num_experts=128,
    experts_per_token=8,
    expert_d_ff=768,
    router_aux_coef=0.001,
  ),
  "moe-tiny": _llama(
    vocab_size=512,
    d_model=64,
    num_layers=2,
    num_heads=4,
    num_kv_heads=2,
    d_ff=176,
    max_len=256,
    norm_eps=1e-5,
    num_experts=8,
    experts_per_token=2,
    expert_d_ff=64,
  ),
  # --- BERT (post-LayerNorm encoder, MLM + NSP heads).
  "bert-base": _bert(768, 12),
  "bert-large": BERTConfig(d_model=1024, num_layers=24, num_heads=16, d_ff=4096),
  "bert-tiny": _bert(128, 2),  # Turc et al. BERT-Tiny  (L=2, H=128)
  "bert-mini": _bert(256, 4),  # Turc et al. BERT-Mini  (L=4, H=256)
  "bert-small": _bert(512, 4),  # Turc et al. BERT-Small (L=4, H=512)
  "bert-medium": _bert(512, 8),  # Turc et al. BERT-Medium (L=8, H=512)
  # --- The Transformer (Vaswani et al.): sinusoidal, post-LayerNorm, ReLU, shared embeddings.
  "transformer-base": _transformer(512, 8, 2048, 0.1),
  "transformer-big": Seq2SeqConfig(
    vocab_size=37000, d_model=1024, num_heads=16, d_ff=4096, dropout_rate=0.3
  ),
  "transformer-tiny": Seq2SeqConfig(
    vocab_size=512,
    d_model=64,
    num_encoder_layers=2,
    num_decoder_layers=2,
    num_heads=4,
    d_ff=256,
    max_len=128,
  ),
  # --- T5 (relative bias, pre-RMSNorm, no biases). v1.0: ReLU, tied; v1.1: gated GELU, untied.
  "t5-small": _t5(d_model=512, num_encoder_layers=6, num_decoder_layers=6, num_heads=8, d_ff=2048),
  "t5-base": _t5(
    d_model=768, num_encoder_layers=12, num_decoder_layers=12, num_heads=12, d_ff=3072
  ),
  "t5-v1.1-small": _t5(
    d_model=512,
    num_encoder_layers=8,
    num_decoder_layers=8,
    num_heads=6,
    d_ff=1024,
    activation="gelu_tanh",
    gated=True,
    tie_embeddings=False,
    logits_rescale=False,
    dropout_rate=0.0,
    ffn_dropout_rate=0.0,
  ),
  "t5-tiny": _t5(
    vocab_size=512,
    d_model=64,
    num_encoder_layers=2,
    num_decoder_layers=2,
    num_heads=4,
    head_dim=16,
    d_ff=128,
    relative_num_buckets=16,
    relative_max_distance=32,
  ),
  # --- Mamba (Gu and Dao 2023): selective-scan blocks, no attention, tied; GPT-NeoX vocabulary
  # padded to 50280. Mamba-2 (Dao and Gu 2024): SSD blocks with grouped B/C and a gated norm.
  "mamba-130m": MambaConfig(vocab_size=50280, d_model=768, num_layers=24),
  "mamba-2.8b": MambaConfig(vocab_size=50280, d_model=2560, num_layers=64),
  "mamba-codestral-7b": MambaConfig(
    vocab_size=32768,
    d_model=4096,
    num_layers=64,
    mixer="mamba2",
    d_state=128,
    ssm_head_dim=64,
    ssm_groups=8,
    ssm_chunk=256,
    tie_embeddings=False,
  ),
  "mamba-tiny": MambaConfig(vocab_size=512, d_model=64, num_layers=2, d_state=8, ssm_chunk=16),
  "mamba2-tiny": MambaConfig(
    vocab_size=512,
    d_model=64,
    num_layers=2,
    mixer="mamba2",
    d_state=16,
    ssm_head_dim=16,
    ssm_groups=2,
    ssm_chunk=16,
    tie_embeddings=False,
  ),
  # --- A hybrid stack (Jamba's pattern at toy size): Mamba and attention layers, each with a
  # gated MLP; attention without positions (the Mamba layers carry the order).
  "hybrid-tiny": MambaConfig(
    vocab_size=512,
    d_model=64,
    num_layers=3,
    d_state=8,
    ssm_chunk=16,
    layer_types=("mamba", "attention", "mamba"),
    num_heads=4,
    num_kv_heads=2,
    d_ff=128,
  ),
}


def list_presets() -> list[str]:
  """Names of every preset, in definition order."""
  return list(PRESETS)


def get_config(name: str, **overrides) -> ModelConfig:
  """The preset ``name`` with ``overrides`` applied (validated like any config).

  A preset whose layers differ by kind (``layer_types``: Gemma's sliding and full attention, a
  hybrid's Mamba and attention mixers) keeps its pattern at another depth: ``num_layers``
  without ``layer_types`` repeats the preset's shortest period of layer kinds over the new count
  (``get_config("gemma3-1b", num_layers=6)``: five sliding layers, then one full, as
  transformers' ``Gemma3Config(num_hidden_layers=6)``).

  Raises:
    ValueError: for an unknown preset (suggesting close names) or an unknown field.
  """
  if name not in PRESETS:
    close = difflib.get_close_matches(name, PRESETS, n=3)
    hint = f"; did you mean {', '.join(close)}?" if close else ""
    raise ValueError(f"unknown preset {name!r}{hint} (see list_presets())")
  config = PRESETS[name]
  fields = {f.name for f in dataclasses.fields(config)}
  unknown = sorted(set(overrides) - fields)
  if unknown:
    raise ValueError(
      f"{type(config).__name__} has no field(s) {', '.join(unknown)} (preset {name!r})"
    )
  n = overrides.get("num_layers")
  types = getattr(config, "layer_types", None)
  if types and "layer_types" not in overrides and isinstance(n, int) and n > 0:
    overrides["layer_types"] = _repeated(types, n)
  return dataclasses.replace(config, **overrides)


def _repeated(types: tuple[str, ...], n: int) -> tuple[str, ...]:
  """``types`` cut to its shortest period and repeated to ``n`` entries."""
  period = next(
    p for p in range(1, len(types) + 1) if all(t == types[i % p] for i, t in enumerate(types))
  )
  return tuple(types[i % period] for i in range(n))
