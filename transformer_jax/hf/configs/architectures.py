"""The supported Hugging Face architectures, and config translation dispatched on them.

``ARCHITECTURES`` names each architecture's family and ``model_type``; ``architecture_of`` picks
the one a ``config.json`` names (refusing anything else), ``from_hf`` and ``to_hf`` call that
family's reader or writer, ``default_architecture`` is what ``save`` writes a config as, and
``token_ids`` the special-token fields. ``to_hf`` reads what it wrote back and refuses a config
the architecture cannot express, naming the fields that would change.
"""

from __future__ import annotations

import dataclasses

from transformer_jax.hf.configs import common, decoders, encoders, gemma, moe, seq2seq, ssm
from transformer_jax.hf.errors import CheckpointError, UnsupportedError
from transformer_jax.models import BERTConfig, GPTConfig, MambaConfig, ModelConfig, Seq2SeqConfig
from transformer_jax.models.config import moe as moe_fields

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
  "Gemma2ForCausalLM": ("gemma2", "gemma2"),
  "Gemma3ForCausalLM": ("gemma3", "gemma3_text"),
  "Qwen2ForCausalLM": ("qwen2", "qwen2"),
  "Qwen3ForCausalLM": ("qwen3", "qwen3"),
  "MarianMTModel": ("marian", "marian"),
  "BigBirdModel": ("bigbird", "big_bird"),
  "BigBirdForMaskedLM": ("bigbird", "big_bird"),
  "BigBirdForPreTraining": ("bigbird", "big_bird"),
  "MambaForCausalLM": ("mamba", "mamba"),
  "Mamba2ForCausalLM": ("mamba2", "mamba2"),
  "MixtralForCausalLM": ("mixtral", "mixtral"),
  "Qwen3MoeForCausalLM": ("qwen3_moe", "qwen3_moe"),
}

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
  "router_z_coef",  # training losses of a mixture of experts
  "router_aux_coef",
}


def architecture_of(hf: dict) -> str:
  """The single supported architecture named in ``hf["architectures"]`` (refused by name
  otherwise)."""
  archs = hf.get("architectures") or []
  if not isinstance(archs, list) or not all(isinstance(a, str) for a in archs):
    raise CheckpointError(f"architectures={archs!r}: expected a list of one name")
  model_type = common.Fields(hf).str("model_type")
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


# --- Dispatch -------------------------------------------------------------------------------------


def from_hf(hf: dict, arch: str) -> ModelConfig:
  """Our config for the Hugging Face config dict ``hf`` of architecture ``arch``."""
  match ARCHITECTURES[arch][0]:
    case "bigbird":
      return encoders.bigbird_from(hf, arch)
    case "gpt2":
      return decoders.gpt2_from(hf)
    case "llama":
      return decoders.llama_from(hf)
    case "mistral":
      return decoders.mistral_from(hf)
    case "gemma2" | "gemma3":
      return gemma.gemma_from(hf, ARCHITECTURES[arch][1])
    case "qwen2":
      return decoders.qwen2_from(hf)
    case "qwen3":
      return decoders.qwen3_from(hf)
    case "bert":
      return encoders.bert_from(hf, arch)
    case "t5":
      return seq2seq.t5_from(hf)
    case "marian":
      return seq2seq.marian_from(hf)
    case "mamba":
      return ssm.mamba_from(hf)
    case "mamba2":
      return ssm.mamba2_from(hf)
    case "mixtral":
      return moe.mixtral_from(hf)
    case "qwen3_moe":
      return moe.qwen3_moe_from(hf)
    case family:
      raise UnsupportedError(f"no config reader for family {family!r}")


def default_architecture(config: ModelConfig) -> str:
  """The architecture ``save`` writes when none is given."""
  match config:
    case GPTConfig(num_experts=n, qk_norm=qk) if n:
      return "Qwen3MoeForCausalLM" if qk else "MixtralForCausalLM"
    case GPTConfig(norm_offset=offset, qk_norm=qk_norm) if offset:
      return "Gemma3ForCausalLM" if qk_norm else "Gemma2ForCausalLM"
    case GPTConfig(position="rope", qk_norm=True):
      return "Qwen3ForCausalLM"
    case GPTConfig(position="rope", use_bias=False, qkv_bias=True, out_bias=None | False):
      return "Qwen2ForCausalLM"
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
  if family in (
    "gpt2",
    "llama",
    "mistral",
    "qwen2",
    "qwen3",
    "gemma2",
    "gemma3",
    "mamba",
    "mamba2",
    "mixtral",
    "qwen3_moe",
  ):
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


# The special-token fields of a config.json that a round trip keeps (``special_ids``).
SPECIAL_IDS = ("bos_token_id", "eos_token_id", "pad_token_id", "decoder_start_token_id")


def special_ids(hf: dict) -> dict:
  """The special-token ids ``hf`` holds, of those in ``SPECIAL_IDS`` it names: each an integer,
  ``null``, or a list of integers (LLaMA 3's several ``eos_token_id``), read by type.

  Raises:
    CheckpointError: a field of another type (``eos_token_id='2'``), named with its value.
  """
  f = common.Fields(hf)
  return {
    key: f.ints(key) if isinstance(hf[key], list) else f.int(key, null=True)
    for key in SPECIAL_IDS
    if key in hf
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
    "gpt2": (GPTConfig, decoders.gpt2_to),
    "llama": (GPTConfig, decoders.llama_to),
    "mistral": (GPTConfig, decoders.mistral_to),
    "gemma2": (GPTConfig, lambda c: gemma.gemma_to(c, "gemma2")),
    "gemma3": (GPTConfig, lambda c: gemma.gemma_to(c, "gemma3_text")),
    "qwen2": (GPTConfig, decoders.qwen2_to),
    "qwen3": (GPTConfig, decoders.qwen3_to),
    "bert": (BERTConfig, encoders.bert_to),
    "t5": (Seq2SeqConfig, seq2seq.t5_to),
    "bigbird": (BERTConfig, encoders.bigbird_to),
    "marian": (Seq2SeqConfig, seq2seq.marian_to),
    "mamba": (MambaConfig, ssm.mamba_to),
    "mamba2": (MambaConfig, ssm.mamba2_to),
    "mixtral": (GPTConfig, moe.mixtral_to),
    "qwen3_moe": (GPTConfig, moe.qwen3_moe_to),
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

  def value(c, name):  # head counts and biases compare by their effective values (None = default)
    return {
      "head_dim": lambda: c.head_size,
      "num_kv_heads": lambda: c.kv_heads,
      "qkv_bias": lambda: c.use_bias if c.qkv_bias is None else c.qkv_bias,
      "out_bias": lambda: c.use_bias if c.out_bias is None else c.out_bias,
      "mlp_bias": lambda: c.use_bias if c.mlp_bias is None else c.mlp_bias,
      "sparse_pattern": lambda: encoders.bigbird_shape(c.sparse_pattern),
      # With experts, d_ff sizes only dense_layers; expert_d_ff is the experts' effective width.
      "d_ff": lambda: (
        None if getattr(c, "num_experts", 0) and not getattr(c, "dense_layers", ()) else c.d_ff
      ),
      "expert_d_ff": lambda: moe_fields.expert_width(c) if c.num_experts else c.expert_d_ff,
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
