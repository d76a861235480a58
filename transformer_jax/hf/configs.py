"""Config translation: a Hugging Face ``config.json`` dict <-> GPTConfig / BERTConfig /
Seq2SeqConfig / MambaConfig.

Each family has a reader (``hf dict -> our config``) and a writer (``our config -> hf dict``).
Options we do not implement are refused by name (``UnsupportedError``), never approximated. A writer
refuses a config the target architecture cannot express by translating back and naming the fields
that differ.
"""

from __future__ import annotations

import dataclasses
import math

from transformer_jax import ops
from transformer_jax.hf.errors import CheckpointError, UnsupportedError
from transformer_jax.models import BERTConfig, GPTConfig, MambaConfig, ModelConfig, Seq2SeqConfig

# Architecture name -> (family, model_type). The family picks the config reader/writer and params
# table.
ARCHITECTURES = {
  "GPT2LMHeadModel": ("gpt2", "gpt2"),
  "BertForPreTraining": ("bert", "bert"),
  "BertForMaskedLM": ("bert", "bert"),
  "BertForSequenceClassification": ("bert", "bert"),
  "BertModel": ("bert", "bert"),
  "T5ForConditionalGeneration": ("t5", "t5"),
  "LlamaForCausalLM": ("llama", "llama"),
  "MistralForCausalLM": ("mistral", "mistral"),
  "MarianMTModel": ("marian", "marian"),
  "BigBirdModel": ("bigbird", "big_bird"),
  "BigBirdForMaskedLM": ("bigbird", "big_bird"),
  "BigBirdForPreTraining": ("bigbird", "big_bird"),
  "MambaForCausalLM": ("mamba", "mamba"),
  "Mamba2ForCausalLM": ("mamba2", "mamba2"),
}

# Hugging Face activation names (ACT2FN) -> ours.
_ACTIVATIONS = {
  "gelu": "gelu",
  "gelu_new": "gelu_tanh",
  "gelu_pytorch_tanh": "gelu_tanh",
  "relu": "relu",
  "silu": "silu",
  "swish": "silu",
}
_ACTIVATIONS_BACK = {"gelu": "gelu", "gelu_tanh": "gelu_new", "relu": "relu", "silu": "silu"}

# Fields that do not change the function a model computes; ignored when checking a round trip.
_NON_ARCHITECTURAL = {
  "dropout_rate",
  "attention_dropout_rate",
  "ffn_dropout_rate",
  "init_std",
  "embed_init_std",
  "dtype",
  "param_dtype",
  "remat",
  "scan_layers",
  "attention_impl",
}


def architecture_of(hf: dict) -> str:
  """The single supported architecture named in ``hf["architectures"]`` (refused by name
  otherwise)."""
  archs = hf.get("architectures") or []
  if not isinstance(archs, list) or not all(isinstance(a, str) for a in archs):
    raise CheckpointError(f"architectures={archs!r}: expected a list of one name")
  model_type = _Fields(hf).str("model_type")
  if model_type not in {mt for _, mt in ARCHITECTURES.values()}:
    raise UnsupportedError(
      f"model_type={model_type!r} is not supported; supported: "
      f"{', '.join(sorted({mt for _, mt in ARCHITECTURES.values()}))}"
    )
  if len(archs) != 1:
    raise UnsupportedError(
      f"config.json must name exactly one architecture (got architectures={archs!r}); "
      f"supported: {', '.join(ARCHITECTURES)}"
    )
  arch = archs[0]
  if arch not in ARCHITECTURES:
    raise UnsupportedError(
      f"architecture {arch!r} is not supported; supported: {', '.join(ARCHITECTURES)}"
    )
  if ARCHITECTURES[arch][1] != model_type:
    raise UnsupportedError(f"architecture {arch!r} does not go with model_type={model_type!r}")
  return arch


def _activation(name, field: str) -> ops.Activation:
  if name not in _ACTIVATIONS:
    raise UnsupportedError(f"{field}={name!r} is not supported; supported: {sorted(_ACTIVATIONS)}")
  return _ACTIVATIONS[name]


def _require(hf: dict, field: str, expected, default=None) -> None:
  value = hf.get(field, default)
  if value != expected or type(value) is not type(expected):
    raise UnsupportedError(f"{field}={value!r} is not supported (only {expected!r})")


class _Fields:
  """Typed reads of a ``config.json`` mapping: each value is checked against the type the field
  has in transformers, never coerced (``sliding_window: 4.7`` is refused, not read as 4). A key
  that is absent gives the default; ``null`` is taken only where ``null=True``.

  Raises (every method):
    CheckpointError: ``field=value: expected ...``, naming the field (``prefix.field`` inside a
      nested object).
  """

  def __init__(self, hf: dict, prefix: str = ""):
    self.hf, self.prefix = hf, prefix

  def _get(self, field: str, default, null: bool, kind: str, ok) -> object:
    value = self.hf.get(field, default)
    if value is None and (null or default is None and field not in self.hf):
      return None
    if not ok(value):
      raise CheckpointError(f"{self.prefix}{field}={value!r}: expected {kind}")
    return value

  def int(self, field: str, default=None, *, null: bool = False) -> int | None:
    value = self._get(
      field,
      default,
      null,
      "an integer",
      lambda v: (
        not isinstance(v, bool) and (isinstance(v, int) or isinstance(v, float) and v.is_integer())
      ),
    )
    return None if value is None else int(value)  # 4096.0 is 4096; 4.7 was refused

  def number(self, field: str) -> int | float:
    """A required number that may be infinite (``float()`` refuses that)."""
    return self._get(
      field,
      None,
      False,
      "a number",
      lambda v: isinstance(v, (int, float)) and not isinstance(v, bool),
    )

  def float(self, field: str, default=None, *, null: bool = False) -> float | None:
    value = self._get(
      field,
      default,
      null,
      "a number",
      lambda v: isinstance(v, (int, float)) and not isinstance(v, bool),
    )
    if value is not None and not math.isfinite(value):
      raise CheckpointError(f"{self.prefix}{field}={value!r}: expected a finite number")
    return None if value is None else float(value)

  def bool(self, field: str, default=None, *, null: bool = False) -> bool | None:
    return self._get(field, default, null, "true or false", lambda v: isinstance(v, bool))

  def str(self, field: str, default=None, *, null: bool = False) -> str | None:
    return self._get(field, default, null, "a string", lambda v: isinstance(v, str))

  def object(self, field: str, *, null: bool = True) -> dict:
    """A nested object (absent or null: empty)."""
    return self._get(field, None, null, "an object", lambda v: isinstance(v, dict)) or {}


# --- GPT-2 ----------------------------------------------------------------------------------------


def _gpt2_from(hf: dict) -> GPTConfig:
  _require(hf, "scale_attn_weights", True, True)
  _require(hf, "scale_attn_by_inverse_layer_idx", False, False)
  _require(hf, "add_cross_attention", False, False)
  f = _Fields(hf)
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
    activation=_activation(f.str("activation_function", "gelu_new"), "activation_function"),
    gated=False,
    use_bias=True,
    tie_embeddings=f.bool("tie_word_embeddings", True),
    dropout_rate=f.float("resid_pdrop", 0.1),
    attention_dropout_rate=f.float("attn_pdrop", 0.1),
    init_std=f.float("initializer_range", 0.02),
  )


def _gpt2_to(c: GPTConfig) -> dict:
  return dict(
    model_type="gpt2",
    vocab_size=c.vocab_size,
    n_embd=c.d_model,
    n_layer=c.num_layers,
    n_head=c.num_heads,
    n_inner=c.d_ff,
    n_positions=c.max_len,
    layer_norm_epsilon=c.norm_eps,
    activation_function=_ACTIVATIONS_BACK[c.activation],
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
  f = _Fields(hf)
  params = dict(f.object("rope_scaling"))
  params.update(f.object("rope_parameters"))
  where = "rope_parameters." if "rope_parameters" in hf else "rope_scaling."
  p = _Fields(params, where)
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


def _llama_from(hf: dict) -> GPTConfig:
  f = _Fields(hf)
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
    activation=_activation(f.str("hidden_act", "silu"), "hidden_act"),
    gated=True,
    use_bias=attn_bias,
    tie_embeddings=f.bool("tie_word_embeddings", False),
    rope_theta=theta,
    rope_scaling=scaling,
    dropout_rate=0.0,
    attention_dropout_rate=f.float("attention_dropout", 0.0),
    init_std=f.float("initializer_range", 0.02),
  )


def _llama_to(c: GPTConfig) -> dict:
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
    hidden_act=_ACTIVATIONS_BACK[c.activation],
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


def _mistral_from(hf: dict) -> GPTConfig:
  """Mistral: LLaMA's layers, attention over the last ``sliding_window`` tokens (null: none)."""
  window = _Fields(hf).int("sliding_window", null=True)
  return dataclasses.replace(_llama_from(hf), sliding_window=window)


def _mistral_to(c: GPTConfig) -> dict:
  return {**_llama_to(c), "model_type": "mistral", "sliding_window": c.sliding_window}


# --- BERT -----------------------------------------------------------------------------------------


def _bert_from(hf: dict, arch: str) -> BERTConfig:
  _require(hf, "position_embedding_type", "absolute", "absolute")
  _require(hf, "is_decoder", False, False)
  _require(hf, "add_cross_attention", False, False)
  f = _Fields(hf)
  num_labels = 0
  if arch == "BertForSequenceClassification":
    id2label = f.object("id2label")
    num_labels = len(id2label) if id2label else f.int("num_labels", 2)
  return BERTConfig(
    vocab_size=f.int("vocab_size", 30522),
    d_model=f.int("hidden_size", 768),
    num_layers=f.int("num_hidden_layers", 12),
    num_heads=f.int("num_attention_heads", 12),
    d_ff=f.int("intermediate_size", 3072),
    max_len=f.int("max_position_embeddings", 512),
    type_vocab_size=f.int("type_vocab_size", 2),
    norm_eps=f.float("layer_norm_eps", 1e-12),
    activation=_activation(f.str("hidden_act", "gelu"), "hidden_act"),
    num_labels=num_labels,
    dropout_rate=f.float("hidden_dropout_prob", 0.1),
    attention_dropout_rate=f.float("attention_probs_dropout_prob", 0.1),
    init_std=f.float("initializer_range", 0.02),
  )


def _bert_to(c: BERTConfig) -> dict:
  out = dict(
    model_type="bert",
    vocab_size=c.vocab_size,
    hidden_size=c.d_model,
    num_hidden_layers=c.num_layers,
    num_attention_heads=c.num_heads,
    intermediate_size=c.d_ff,
    max_position_embeddings=c.max_len,
    type_vocab_size=c.type_vocab_size,
    layer_norm_eps=c.norm_eps,
    hidden_act=_ACTIVATIONS_BACK[c.activation],
    hidden_dropout_prob=c.dropout_rate,
    attention_probs_dropout_prob=c.attention_dropout_rate,
    initializer_range=c.init_std,
    position_embedding_type="absolute",
  )
  if c.num_labels:
    out["id2label"] = {str(i): f"LABEL_{i}" for i in range(c.num_labels)}
    out["label2id"] = {f"LABEL_{i}": i for i in range(c.num_labels)}
  return out


# --- BigBird --------------------------------------------------------------------------------------
# BERT's layers and names with block-sparse attention. transformers' BigBird in eval mode (what
# its logits are compared with) takes every random block to be block 0 and attends densely up to
# (5 + 2 * num_random_blocks) * block_size tokens: SparsePattern.bigbird(eval_mode=True). In
# training it draws new random blocks at every call, which a fixed pattern cannot follow.


def _bigbird_from(hf: dict, arch: str) -> BERTConfig:
  _require(hf, "rescale_embeddings", False, False)
  _require(hf, "use_bias", True, True)
  base = _bert_from({"hidden_act": "gelu_new", "max_position_embeddings": 4096, **hf}, "BertModel")
  attention = hf.get("attention_type", "block_sparse")
  match attention:
    case "original_full":
      return base
    case "block_sparse":
      pattern = ops.SparsePattern.bigbird(
        hf.get("block_size", 64), hf.get("num_random_blocks", 3), eval_mode=True
      )
      return dataclasses.replace(
        base, attention_kind="sparse", sparse_pattern=pattern, attention_dropout_rate=0.0
      )
    case _:
      raise UnsupportedError(
        f"attention_type={attention!r} is not supported ('block_sparse' or 'original_full')"
      )


def _bigbird_shape(p: ops.SparsePattern | None):
  """What transformers' BigBird config holds of a pattern (not its seed or eval-mode parts)."""
  if p is None:
    return None
  return (p.block, p.local_blocks, p.global_blocks, p.random_blocks, p.summary, p.strided)


def _bigbird_to(c: BERTConfig) -> dict:
  out = {**_bert_to(c), "model_type": "big_bird", "rescale_embeddings": False, "use_bias": True}
  if c.attention_kind == "softmax":
    return {**out, "attention_type": "original_full"}
  p = c.sparse_pattern or ops.SparsePattern.bigbird()
  if c.attention_kind != "sparse" or _bigbird_shape(p) != _bigbird_shape(
    ops.SparsePattern.bigbird(p.block, p.random_blocks)
  ):
    raise KeyError(f"attention_kind={c.attention_kind!r} with sparse_pattern={p!r}")
  return {
    **out,
    "attention_type": "block_sparse",
    "block_size": p.block,
    "num_random_blocks": p.random_blocks,
  }


# --- T5 -------------------------------------------------------------------------------------------


def _t5_from(hf: dict) -> Seq2SeqConfig:
  f = _Fields(hf)
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
    activation=_activation(act, "feed_forward_proj"),
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


def _t5_to(c: Seq2SeqConfig) -> dict:
  if not c.tie_embeddings and c.logits_rescale:
    raise UnsupportedError("logits_rescale=True with tie_embeddings=False has no T5 equivalent")
  act = _ACTIVATIONS_BACK[c.activation]
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
    # transformers reads tie_word_embeddings as "scale the decoder output" (see _t5_from).
    tie_word_embeddings=c.logits_rescale,
    scale_decoder_outputs=c.logits_rescale,
    decoder_start_token_id=0,
    pad_token_id=0,
    eos_token_id=1,
  )


# --- Marian (the Transformer of Vaswani et al.) ---------------------------------------------------


def _marian_from(hf: dict) -> Seq2SeqConfig:
  f = _Fields(hf)
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
    activation=_activation(f.str("activation_function", "gelu"), "activation_function"),
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


def _marian_to(c: Seq2SeqConfig) -> dict:
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
    activation_function=_ACTIVATIONS_BACK[c.activation],
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


# --- Mamba, Mamba-2 ------------------------------------------------------------------------------


def _mamba_common(f: _Fields) -> dict:
  """The fields Mamba and Mamba-2 share (transformers' names -> ours), each read by its type."""
  act = f.str("hidden_act", "silu")
  if act not in ("silu", "swish"):
    raise UnsupportedError(f"hidden_act={act!r} is not supported (only 'silu')")
  return dict(
    vocab_size=f.int("vocab_size", 50280),
    d_model=f.int("hidden_size", 768),
    num_layers=f.int("num_hidden_layers", 32),
    d_state=f.int("state_size", 16),
    d_conv=f.int("conv_kernel", 4),
    expand=f.int("expand", 2),
    use_bias=f.bool("use_bias", False),
    conv_bias=f.bool("use_conv_bias", True),
    norm_eps=f.float("layer_norm_epsilon", 1e-5),
    residual_in_fp32=f.bool("residual_in_fp32", True),
    time_step_min=f.float("time_step_min", 1e-3),
    time_step_max=f.float("time_step_max", 0.1),
    time_step_floor=f.float("time_step_floor", 1e-4),
    init_std=f.float("initializer_range", 0.1),
  )


def _mamba_from(hf: dict) -> MambaConfig:
  f = _Fields(hf)
  common = _mamba_common(f)
  rank = hf.get("time_step_rank", "auto")
  if rank != "auto":
    rank = f.int("time_step_rank")
    if rank < 1:
      raise CheckpointError(f"time_step_rank={rank!r}: expected 'auto' or a positive integer")
  auto = math.ceil(common["d_model"] / 16)
  return MambaConfig(
    **common,
    mixer="mamba1",
    dt_rank=None if rank in ("auto", auto) else rank,
    tie_embeddings=f.bool("tie_word_embeddings", True),
  )


def _mamba_common_to(c: MambaConfig) -> dict:
  return dict(
    vocab_size=c.vocab_size,
    hidden_size=c.d_model,
    num_hidden_layers=c.num_layers,
    state_size=c.d_state,
    conv_kernel=c.d_conv,
    expand=c.expand,
    use_bias=c.use_bias,
    use_conv_bias=c.conv_bias,
    layer_norm_epsilon=c.norm_eps,
    residual_in_fp32=c.residual_in_fp32,
    hidden_act="silu",
    time_step_min=c.time_step_min,
    time_step_max=c.time_step_max,
    time_step_floor=c.time_step_floor,
    initializer_range=c.init_std,
    tie_word_embeddings=c.tie_embeddings,
  )


def _mamba_to(c: MambaConfig) -> dict:
  return {**_mamba_common_to(c), "model_type": "mamba", "time_step_rank": c.time_step_rank}


def _mamba2_from(hf: dict) -> MambaConfig:
  f = _Fields(hf)
  common = _mamba_common(f)
  heads, head_dim = f.int("num_heads", 128), f.int("head_dim", 64)
  if common["expand"] * common["d_model"] != heads * head_dim:
    raise UnsupportedError(
      f"num_heads={heads} x head_dim={head_dim} must equal expand x "
      f"hidden_size = {common['expand'] * common['d_model']}"
    )
  # transformers 5 writes a non-finite float as {"__float__": "Infinity"}.
  raw = hf.get("time_step_limit", (0.0, math.inf))
  if not isinstance(raw, (list, tuple)) or len(raw) != 2:
    raise CheckpointError(f"time_step_limit={raw!r}: expected a pair of numbers")
  limit = _Fields({"time_step_limit[0]": _unboxed(raw[0]), "time_step_limit[1]": _unboxed(raw[1])})
  lo, hi = (limit.number(k) for k in limit.hf)
  return MambaConfig(
    **common,
    mixer="mamba2",
    ssm_head_dim=head_dim,
    ssm_groups=f.int("n_groups", 8),
    ssm_chunk=f.int("chunk_size", 256),
    time_step_limit=(float(lo), float(hi)),
    tie_embeddings=f.bool("tie_word_embeddings", False),
  )


def _unboxed(v):
  """A number as transformers writes it: plain, or ``{"__float__": "Infinity"}``."""
  if isinstance(v, dict) and isinstance(v.get("__float__"), str):
    try:
      return float(v["__float__"])
    except ValueError:
      return v
  return v


def _mamba2_to(c: MambaConfig) -> dict:
  return {
    **_mamba_common_to(c),
    "model_type": "mamba2",
    "num_heads": c.ssm_heads,
    "head_dim": c.ssm_head_dim,
    "n_groups": c.ssm_groups,
    "chunk_size": c.ssm_chunk,
    "time_step_limit": list(c.time_step_limit),
  }


# --- Dispatch -------------------------------------------------------------------------------------


def from_hf(hf: dict, arch: str) -> ModelConfig:
  """Our config for the Hugging Face config dict ``hf`` of architecture ``arch``."""
  match ARCHITECTURES[arch][0]:
    case "bigbird":
      return _bigbird_from(hf, arch)
    case "gpt2":
      return _gpt2_from(hf)
    case "llama":
      return _llama_from(hf)
    case "mistral":
      return _mistral_from(hf)
    case "bert":
      return _bert_from(hf, arch)
    case "t5":
      return _t5_from(hf)
    case "marian":
      return _marian_from(hf)
    case "mamba":
      return _mamba_from(hf)
    case "mamba2":
      return _mamba2_from(hf)
    case family:
      raise UnsupportedError(f"no config reader for family {family!r}")


def default_architecture(config: ModelConfig) -> str:
  """The architecture ``save`` writes when none is given."""
  match config:
    case GPTConfig(position="rope", sliding_window=None):
      return "LlamaForCausalLM"
    case GPTConfig(position="rope"):
      return "MistralForCausalLM"
    case GPTConfig():
      return "GPT2LMHeadModel"
    case BERTConfig(attention_kind="sparse"):
      return "BigBirdForMaskedLM"
    case BERTConfig(num_labels=0):
      return "BertForPreTraining"
    case BERTConfig():
      return "BertForSequenceClassification"
    case Seq2SeqConfig(position="relative"):
      return "T5ForConditionalGeneration"
    case Seq2SeqConfig():
      return "MarianMTModel"
    case MambaConfig(mixer="mamba1"):
      return "MambaForCausalLM"
    case MambaConfig():
      return "Mamba2ForCausalLM"
    case _:
      raise TypeError(f"not a model config: {type(config).__name__}")


def token_ids(arch: str, tokenizer=None) -> dict:
  """The special-token fields of ``arch``'s ``config.json`` for a model trained with ``tokenizer``.

  A GPT (GPT-2 or LLaMA) separates documents with ``<|endoftext|>`` (``tokenizer.eot_id``): it is
  both ``bos_token_id`` and ``eos_token_id``, as in GPT-2. BERT gets ``pad_token_id``. A Seq2Seq
  model starts decoding at ``<bos>`` and ends at ``<eos>``, with ``[PAD]`` as padding. Without a
  tokenizer the ids are unknown: a GPT's are written as ``null`` (transformers would otherwise put
  its own defaults, GPT-2's 50256 or LLaMA's 1 and 2, which may lie outside the vocabulary); the
  other families keep their writer's conventional ids.

  Args:
    arch: a supported architecture (``ARCHITECTURES``).
    tokenizer: an object with ``eot_id``, ``bos_id``, ``eos_id`` and ``pad_id`` (a
      ``transformer_jax.data.Tokenizer``), or None.
  """
  family = ARCHITECTURES[arch][0]
  if family in ("gpt2", "llama", "mistral", "mamba", "mamba2"):
    eot = None if tokenizer is None else int(tokenizer.eot_id)
    return {"bos_token_id": eot, "eos_token_id": eot}
  if tokenizer is None:
    return {}
  if family in ("bert", "bigbird"):
    return {"pad_token_id": int(tokenizer.pad_id)}
  return {
    "pad_token_id": int(tokenizer.pad_id),
    "eos_token_id": int(tokenizer.eos_id),
    "decoder_start_token_id": int(tokenizer.bos_id),
  }


def to_hf(config: ModelConfig, arch: str, tokenizer=None) -> dict:
  """The Hugging Face config dict for ``config`` as ``arch``.

  ``tokenizer`` (optional) gives the special-token ids (``token_ids``).

  Raises:
    UnsupportedError: ``arch`` cannot express ``config`` (the differing fields are named).
  """
  if arch not in ARCHITECTURES:
    raise UnsupportedError(
      f"architecture {arch!r} is not supported; supported: {', '.join(ARCHITECTURES)}"
    )
  family = ARCHITECTURES[arch][0]
  writers = {
    "gpt2": (GPTConfig, _gpt2_to),
    "llama": (GPTConfig, _llama_to),
    "mistral": (GPTConfig, _mistral_to),
    "bert": (BERTConfig, _bert_to),
    "t5": (Seq2SeqConfig, _t5_to),
    "bigbird": (BERTConfig, _bigbird_to),
    "marian": (Seq2SeqConfig, _marian_to),
    "mamba": (MambaConfig, _mamba_to),
    "mamba2": (MambaConfig, _mamba2_to),
  }
  cls, writer = writers[family]
  if not isinstance(config, cls):
    raise UnsupportedError(f"{arch} needs a {cls.__name__}, not a {type(config).__name__}")
  try:
    hf = writer(config)
  except KeyError as e:
    raise UnsupportedError(f"{arch} has no equivalent for {e.args[0]!r}") from None
  hf["architectures"] = [arch]
  hf["dtype"] = str(config.param_dtype)
  ids = token_ids(arch, tokenizer)
  outside = {k: v for k, v in ids.items() if v is not None and not 0 <= v < config.vocab_size}
  if outside:
    raise ValueError(
      f"the tokenizer's {', '.join(f'{k}={v}' for k, v in outside.items())} lie "
      f"outside the model's vocabulary [0, {config.vocab_size})"
    )
  hf.update(ids)
  back = from_hf(hf, arch)
  if isinstance(config, BERTConfig) and arch != "BertForSequenceClassification":
    back = dataclasses.replace(back, num_labels=config.num_labels)  # the head is just not written
  if family == "t5":
    # A tied T5 without the v1.0 rescale is written with its lm_head.weight (see params.py).
    back = dataclasses.replace(back, tie_embeddings=config.tie_embeddings)
  if family in ("mamba", "mamba2"):
    # None changes the function of a Mamba model (chunk, scan method and kernel are how the scan
    # is computed, max_len sizes nothing), and Mamba-1's config.json has no field for them.
    back = dataclasses.replace(
      back,
      ssm_chunk=config.ssm_chunk,
      ssm_scan=config.ssm_scan,
      ssm_impl=config.ssm_impl,
      max_len=config.max_len,
    )

  def value(c, name):  # head counts compare by their effective values (None = the default)
    return {
      "head_dim": lambda: c.head_size,
      "num_kv_heads": lambda: c.kv_heads,
      "sparse_pattern": lambda: _bigbird_shape(c.sparse_pattern),
    }.get(name, lambda: getattr(c, name))()

  differ = [
    f.name
    for f in dataclasses.fields(config)
    if f.name not in _NON_ARCHITECTURAL and value(config, f.name) != value(back, f.name)
  ]
  if differ:
    raise UnsupportedError(
      f"{arch} cannot express this {type(config).__name__}: "
      + ", ".join(f"{n}={getattr(config, n)!r}" for n in differ)
    )
  return hf
