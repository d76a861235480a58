"""T5 and Marian ``config.json`` <-> ``Seq2SeqConfig``.

T5 (v1.0 and v1.1): relative position buckets, RMSNorm, pre-norm, unscaled attention, a gated or
plain feed-forward named by ``feed_forward_proj``, and the decoder-output rescale of tied v1.0
models. Marian is the Transformer of Vaswani et al.: sinusoidal positions, post-LayerNorm, one
vocabulary shared by encoder, decoder and output; settings it would need to untie are refused.
"""

from __future__ import annotations

from transformer_jax.hf.configs import common
from transformer_jax.hf.errors import UnsupportedError
from transformer_jax.models import Seq2SeqConfig

# --- T5 -------------------------------------------------------------------------------------------


def t5_from(hf: dict) -> Seq2SeqConfig:
  """``Seq2SeqConfig`` from a T5 (v1.0 or v1.1) ``config.json`` dict."""
  f = common.Fields(hf)
  proj = f.str("feed_forward_proj", "relu")
  parts = proj.split("-")
  if len(parts) > 2 or (len(parts) == 2 and parts[0] != "gated"):
    raise UnsupportedError(f"feed_forward_proj={proj!r} is not supported")
  act = "gelu_new" if proj == "gated-gelu" else parts[-1]  # transformers' own legacy rule
  # T5 v1.0 scales the decoder output by d_model^-0.5 before the tied projection; v1.1 does not.
  # transformers 5 records this as scale_decoder_outputs; 4.x inferred it from tie_word_embeddings.
  tied = f.bool("tie_word_embeddings", True, null=True) is not False
  rescale = bool(f.bool("scale_decoder_outputs", tied, null=True))
  d = f.int("d_model", 512)
  rate = f.float("dropout_rate", 0.1)
  return Seq2SeqConfig(
    vocab_size=f.int("vocab_size", 32128),
    d_model=d,
    num_encoder_layers=f.int("num_layers", 6),
    num_decoder_layers=f.int("num_decoder_layers", null=True) or f.int("num_layers", 6),
    num_heads=f.int("num_heads", 8),
    head_dim=f.int("d_kv", 64),
    d_ff=f.int("d_ff", 2048),
    max_len=f.int("n_positions", 512),
    position="relative",
    relative_num_buckets=f.int("relative_attention_num_buckets", 32),
    relative_max_distance=f.int("relative_attention_max_distance", 128),
    norm="rmsnorm",
    norm_eps=f.float("layer_norm_epsilon", 1e-6),
    pre_norm=True,
    activation=common.activation(act, "feed_forward_proj"),
    gated=parts[0] == "gated",
    use_bias=False,
    # Tied unless the weights say otherwise: the loader unties when lm_head.weight differs.
    tie_embeddings=tied or rescale,
    embed_scale=False,
    logits_rescale=rescale,
    scale_attention=False,
    dropout_rate=rate,
    attention_dropout_rate=rate,
    ffn_dropout_rate=rate,
    init_std=d**-0.5 if d > 0 else 1.0,
    embed_init_std=1.0,
  )


def t5_to(c: Seq2SeqConfig) -> dict:
  """T5's ``config.json`` fields for ``c``; a feed-forward T5 cannot name is refused."""
  if not c.tie_embeddings and c.logits_rescale:
    raise UnsupportedError("logits_rescale=True with tie_embeddings=False has no T5 equivalent")
  act = common.ACTIVATIONS_BACK[c.activation]
  if c.gated:
    proj = "gated-gelu" if c.activation == "gelu_tanh" else f"gated-{act}"
    if c.activation == "gelu":
      raise UnsupportedError("gated exact GELU has no T5 feed_forward_proj ('gated-gelu' is tanh)")
  else:
    if c.activation == "gelu_tanh":
      raise UnsupportedError("ungated tanh-GELU has no T5 feed_forward_proj")
    proj = act
  return dict(
    model_type="t5",
    vocab_size=c.vocab_size,
    d_model=c.d_model,
    d_kv=c.head_size,
    d_ff=c.d_ff,
    num_layers=c.num_encoder_layers,
    num_decoder_layers=c.num_decoder_layers,
    num_heads=c.num_heads,
    relative_attention_num_buckets=c.relative_num_buckets,
    relative_attention_max_distance=c.relative_max_distance,
    layer_norm_epsilon=c.norm_eps,
    feed_forward_proj=proj,
    dropout_rate=c.dropout_rate,
    is_encoder_decoder=True,
    # transformers reads tie_word_embeddings as "scale the decoder output" (see t5_from).
    tie_word_embeddings=c.logits_rescale,
    scale_decoder_outputs=c.logits_rescale,
    decoder_start_token_id=0,
    pad_token_id=0,
    eos_token_id=1,
  )


# --- Marian (the Transformer of Vaswani et al.) ---------------------------------------------------


def marian_from(hf: dict) -> Seq2SeqConfig:
  """``Seq2SeqConfig`` from a Marian ``config.json`` dict; unshared embeddings are refused."""
  f = common.Fields(hf)
  for a, b, default in (
    ("encoder_attention_heads", "decoder_attention_heads", 16),
    ("encoder_ffn_dim", "decoder_ffn_dim", 4096),
  ):
    if f.int(a, default) != f.int(b, default):
      raise UnsupportedError(f"{a}={hf.get(a)} != {b}={hf.get(b)}: encoder and decoder must match")
  if f.bool("share_encoder_decoder_embeddings", True, null=True) is not True:
    raise UnsupportedError("share_encoder_decoder_embeddings=False is not supported")
  vocab = f.int("vocab_size", 58101)
  if f.int("decoder_vocab_size", null=True) not in (None, vocab):
    raise UnsupportedError("a decoder_vocab_size different from vocab_size is not supported")
  if f.bool("normalize_before", False) or f.bool("normalize_embedding", False):
    raise UnsupportedError("normalize_before/normalize_embedding are not supported")
  if f.bool("tie_word_embeddings", True, null=True) is False:
    raise UnsupportedError("tie_word_embeddings=False is not supported for Marian")
  return Seq2SeqConfig(
    vocab_size=vocab,
    d_model=f.int("d_model", 1024),
    num_encoder_layers=f.int("encoder_layers", 12),
    num_decoder_layers=f.int("decoder_layers", 12),
    num_heads=f.int("encoder_attention_heads", 16),
    d_ff=f.int("encoder_ffn_dim", 4096),
    max_len=f.int("max_position_embeddings", 1024),
    position="sinusoidal",
    norm="layernorm",
    norm_eps=1e-5,
    pre_norm=False,
    activation=common.activation(f.str("activation_function", "gelu"), "activation_function"),
    gated=False,
    use_bias=True,
    tie_embeddings=True,
    embed_scale=f.bool("scale_embedding", False),
    logits_rescale=False,
    scale_attention=True,
    dropout_rate=f.float("dropout", 0.1),
    attention_dropout_rate=f.float("attention_dropout", 0.0),
    ffn_dropout_rate=f.float("activation_dropout", 0.0),
    init_std=f.float("init_std", 0.02),
  )


def marian_to(c: Seq2SeqConfig) -> dict:
  """Marian's ``config.json`` fields for ``c``."""
  return dict(
    model_type="marian",
    vocab_size=c.vocab_size,
    decoder_vocab_size=c.vocab_size,
    d_model=c.d_model,
    encoder_layers=c.num_encoder_layers,
    decoder_layers=c.num_decoder_layers,
    encoder_attention_heads=c.num_heads,
    decoder_attention_heads=c.num_heads,
    encoder_ffn_dim=c.d_ff,
    decoder_ffn_dim=c.d_ff,
    max_position_embeddings=c.max_len,
    activation_function=common.ACTIVATIONS_BACK[c.activation],
    scale_embedding=c.embed_scale,
    dropout=c.dropout_rate,
    attention_dropout=c.attention_dropout_rate,
    activation_dropout=c.ffn_dropout_rate,
    init_std=c.init_std,
    is_encoder_decoder=True,
    share_encoder_decoder_embeddings=True,
    tie_word_embeddings=True,
    pad_token_id=c.vocab_size - 1,
    decoder_start_token_id=c.vocab_size - 1,
    eos_token_id=0,
  )
