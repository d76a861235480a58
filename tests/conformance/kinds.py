"""The registry of model kinds: every property of the conformance suite runs on every kind here.

To register a kind, append one ``Kind`` to ``KINDS``: a name (the test id), a function that returns
a tiny config of it (a few layers of width 16, so that each property compiles in about a second),
and the capabilities that say which properties apply. Nothing else in the suite changes: each test
module is parametrized over ``KINDS`` and skips, with the capability as the reason, what a kind does
not claim. A kind that claims a capability must pass every property that comes with it; one that
does not claim ``MASK`` must refuse an ``attention_mask`` with an error naming it. Every kind also
runs with ``dtype`` and ``param_dtype`` bfloat16 and its layers scanned (``test_bfloat16``).

Capabilities (which calling convention the suite uses, and what the kind promises):

- ``DECODER``: a causal language model called as GPT is:
  ``model(tokens [B, T], positions=, segment_ids=, attention_mask=) -> logits [B, T, V]``, with
  ``init_cache``/``extend``. Changing a later token never changes earlier logits.
- ``ENCODER``: a bidirectional encoder called as BERT is:
  ``model(tokens, token_types, attention_mask).mlm_logits``.
- ``SEQ2SEQ``: an encoder-decoder called as Seq2Seq is: ``model(src, tgt_in, src_mask, tgt_mask)``,
  decoding with ``generate.with_encoder``; the suite feeds the same ids to both sides.
- ``DECODES``: has a decoding cache: cached prefill, token-by-token steps, ``generate`` (greedy
  and sampling) and ``beam_search`` give what the full forward pass gives, row by row.
- ``MASK``: honours ``attention_mask``: padding (right, and left where ``LEFT_PADDING``) gives the
  unpadded result at the real positions.
- ``LEFT_PADDING``: left padding with the mask (and, for a ``DECODER``, positions counting the
  real tokens) gives the unpadded result. Kinds with absolute positions that cannot be given
  (BERT, the sinusoidal Transformer) leave it out.
- ``PACKING``: ``segment_ids`` with positions restarted per document give each document what it
  gives alone (packed training batches).
- ``TABLE_POSITIONS``: positions index a table of ``max_len`` rows (learned or sinusoidal):
  explicit positions outside it are refused, never clamped.

Other fields:

- ``hf_class``: the transformers class the kind saves as and loads from (``tj.hf``), or None.
- ``extremes``: config overrides at the edge of what the config accepts (tiny decays, a window of
  one token, chunks of one or of 64 positions); each must still give finite logits and caches at
  lengths 1 .. 4 chunks and a position (``max_len`` raised where 4 chunks do not fit).
"""

from __future__ import annotations

import dataclasses
from collections.abc import Callable

from transformer_jax import models, ops

DECODER, ENCODER, SEQ2SEQ = "decoder", "encoder", "seq2seq"
DECODES = "decodes"
MASK = "attention_mask"
LEFT_PADDING = "left_padding"
PACKING = "packing"
TABLE_POSITIONS = "table_positions"

VOCAB = 61  # a prime: no accidental alignment with widths or chunk sizes
WINDOW = 3  # sliding windows: shorter than every prompt the suite decodes
CHUNK = 4  # linear attention: prompts and decoding cross several chunk boundaries
SMALL = dict(vocab_size=VOCAB, d_model=16, num_heads=2, d_ff=32, max_len=64)


@dataclasses.dataclass(frozen=True, eq=False)  # hashed by identity: a cache key
class Kind:
  """One registered model kind (see the module docstring)."""

  name: str
  make_config: Callable[[], models.ModelConfig]
  capabilities: frozenset[str]
  hf_class: str | None = None
  extremes: tuple[dict, ...] = ()

  def has(self, capability: str) -> bool:
    return capability in self.capabilities

  def config(self, **overrides) -> models.ModelConfig:
    """The kind's config, with ``overrides`` (validated by the config itself)."""
    return dataclasses.replace(self.make_config(), **overrides)


def _gpt(preset, **kw):
  return lambda: models.get_config(preset, **SMALL, num_layers=2, **kw)


_DECODER = frozenset({DECODER, DECODES, MASK, LEFT_PADDING, PACKING})
_LINEAR = dict(attention_kind="linear", linear_chunk=CHUNK)
LONG = dict(linear_chunk=64, max_len=320)  # 4 chunks of 64 and a position fit
_LINEAR_EXTREMES = ({"linear_decay": 1e-3}, {"linear_decay": 0.2, **LONG})

KINDS: list[Kind] = [
  Kind(
    "gpt-softmax",
    _gpt("gpt2-tiny"),
    _DECODER | {TABLE_POSITIONS},
    "GPT2LMHeadModel",
    extremes=({"init_std": 1.0, "norm_eps": 1e-12},),
  ),
  Kind("gpt-window", _gpt("gpt2-tiny", sliding_window=WINDOW), _DECODER | {TABLE_POSITIONS}),
  Kind("gpt-alibi", _gpt("gpt-alibi-tiny"), _DECODER),
  Kind(
    "gpt-linear",
    _gpt("gpt2-tiny", **_LINEAR),
    _DECODER | {TABLE_POSITIONS},
    extremes=({"linear_chunk": 1},),
  ),
  Kind(
    "gpt-linear-decay",
    _gpt("gpt2-tiny", **_LINEAR, linear_decay=0.5),
    _DECODER | {TABLE_POSITIONS},
    extremes=_LINEAR_EXTREMES,
  ),
  Kind(
    "gpt-linear-decay-per-head",
    _gpt("llama-tiny", **_LINEAR, linear_decay=(0.95, 0.2)),
    _DECODER,
    extremes=({"linear_decay": (1e-3, 1.0)},),
  ),
  Kind("gpt-linear-retnet", _gpt("llama-tiny", **_LINEAR, linear_decay="retnet"), _DECODER),
  Kind("llama", _gpt("llama-tiny"), _DECODER, "LlamaForCausalLM"),
  Kind(
    "mistral",
    _gpt("mistral-tiny", sliding_window=WINDOW),
    _DECODER,
    "MistralForCausalLM",
    extremes=({"sliding_window": 1, "rope_theta": 1e6, "norm_eps": 1e-12},),
  ),
  # Qwen2: biases on the query/key/value projections only, here over a sliding window; Qwen3:
  # per-head query/key norms before RoPE, head_dim (12) apart from d_model / num_heads (8).
  Kind(
    "qwen2",
    _gpt("qwen2-tiny", num_kv_heads=1, sliding_window=WINDOW),
    _DECODER,
    "Qwen2ForCausalLM",
  ),
  Kind(
    "qwen3",
    _gpt("qwen3-tiny", num_kv_heads=1, head_dim=12),
    _DECODER,
    "Qwen3ForCausalLM",
    extremes=({"norm_eps": 1e-12, "sliding_window": 1, "qkv_bias": True, "out_bias": True},),
  ),
  Kind(
    "bert",
    lambda: models.get_config(
      "bert-tiny", **SMALL, num_layers=2, dropout_rate=0.0, attention_dropout_rate=0.0
    ),
    frozenset({ENCODER, MASK}),
    "BertForPreTraining",
  ),
  Kind(
    "seq2seq",
    lambda: models.get_config(
      "transformer-tiny",
      **SMALL,
      num_encoder_layers=1,
      num_decoder_layers=2,
      dropout_rate=0.0,
      norm_eps=1e-5,
    ),
    frozenset({SEQ2SEQ, DECODES, MASK}),
    "MarianMTModel",
  ),
  # T5's max_len stays its preset's: relative positions need no table, and T5's HF config
  # has no field for it.
  Kind(
    "t5",
    lambda: models.get_config(
      "t5-tiny",
      **{**SMALL, "max_len": 512},
      num_encoder_layers=1,
      num_decoder_layers=2,
      dropout_rate=0.0,
    ),
    frozenset({SEQ2SEQ, DECODES, MASK, LEFT_PADDING}),
    "T5ForConditionalGeneration",
  ),
]

# State-space models (Mamba-1, Mamba-2) and a hybrid stack of Mamba and attention layers: the scan
# chunk is CHUNK, so prompts and decoding cross chunk boundaries as linear attention's do.
_SSM = dict(vocab_size=VOCAB, d_model=16, num_layers=2, d_state=4, ssm_chunk=CHUNK, max_len=64)
KINDS += [
  Kind("mamba1", lambda: models.get_config("mamba-tiny", **_SSM), _DECODER, "MambaForCausalLM"),
  Kind(
    "mamba2",
    lambda: models.get_config("mamba2-tiny", **_SSM, ssm_head_dim=8, ssm_groups=2),
    _DECODER,
    "Mamba2ForCausalLM",
  ),
  Kind(
    "hybrid",
    lambda: models.get_config(
      "hybrid-tiny", **{**_SSM, "num_layers": 3}, num_heads=2, num_kv_heads=1, d_ff=32
    ),
    _DECODER,
  ),
]

# Approximations of softmax attention (docs/approximations.md). A block-sparse pattern is laid out
# over array positions, so left padding and packed documents, which move a row's tokens within
# the array, are not claimed; blocks of 4 and 3 put the suite's rows across several blocks.
# BigBird and the Reformer are not registered: a row's result depends on the length it is padded
# to (BigBird's last block is global, LSH chunks span the padded rounds), as in transformers, so
# they neither honour attention_mask in this suite's sense nor refuse it; tests/hf/test_bigbird.py,
# tests/hf/test_reformer.py and tests/models/test_approx_properties.py cover them.
_SPARSE = frozenset({DECODER, DECODES, MASK, TABLE_POSITIONS})
_BERT = dict(**SMALL, num_layers=2, dropout_rate=0.0, attention_dropout_rate=0.0)
KINDS += [
  Kind(
    "gpt-sparse-fixed",
    _gpt(
      "gpt2-tiny",
      attention_kind="sparse",
      sparse_pattern=ops.SparsePattern.fixed(block=4, summary=1),
    ),
    _SPARSE,
    extremes=({"sparse_pattern": ops.SparsePattern(block=1)},),
  ),
  Kind(
    "gpt-sparse-strided",
    _gpt(
      "gpt2-tiny",
      attention_kind="sparse",
      sparse_pattern=ops.SparsePattern.strided_pattern(block=3),
    ),
    _SPARSE,
  ),
  Kind("gpt-reversible", _gpt("llama-tiny", reversible=True), _DECODER),
  Kind(
    "bert-linformer",
    lambda: models.get_config("bert-tiny", **_BERT, attention_kind="linformer", linformer_rows=8),
    frozenset({ENCODER, MASK}),
  ),
  Kind(
    "bert-sparse-fixed",
    lambda: models.get_config(
      "bert-tiny",
      **_BERT,
      attention_kind="sparse",
      sparse_pattern=ops.SparsePattern.fixed(block=4, summary=1),
    ),
    frozenset({ENCODER, MASK}),
  ),
]

# Gemma 2 and 3: the (1 + w) norm, sandwich norms, scaled embeddings and layer_types mixing
# sliding (WINDOW) and full layers in one scanned stack; Gemma 2 soft-caps both logits, Gemma 3
# normalises queries and keys and gives the sliding layers their own RoPE base.
_GEMMA = dict(**SMALL, sliding_window=WINDOW, query_pre_attn_scalar=8.0, head_dim=8)
_LOCAL, _GLOBAL = "sliding_attention", "full_attention"
KINDS += [
  Kind(
    "gemma2",
    lambda: models.get_config(
      "gemma2-tiny", **_GEMMA, num_layers=2, layer_types=(_LOCAL, _GLOBAL), num_kv_heads=1
    ),
    _DECODER,
    "Gemma2ForCausalLM",
    extremes=({"attn_softcap": 1e-3, "final_softcap": 1e-3, "sliding_window": 1},),
  ),
  Kind(
    "gemma3",
    lambda: models.get_config(
      "gemma3-tiny", **_GEMMA, num_layers=3, layer_types=(_LOCAL, _GLOBAL, _LOCAL), num_kv_heads=2
    ),
    _DECODER,
    "Gemma3ForCausalLM",
    extremes=(
      {"sliding_window": 1, "rope_theta": 1e6, "rope_local_theta": 1.5, "norm_eps": 1e-12},
    ),
  ),
]

# Mixtures of experts (layers.moe): dropless routing is per token, so every decoder property
# holds as for a dense MLP. 4 experts of 24, top 2 renormalised (Mixtral), or top 3 of raw
# probabilities with q/k norms and a plain MLP in layer 0 (Qwen3-MoE's mlp_only_layers).
_MOE = dict(num_experts=4, expert_d_ff=24)
_QWEN3_MOE = dict(experts_per_token=3, router_norm_topk=False, qk_norm=True, head_dim=8)
KINDS += [
  Kind("moe", _gpt("moe-tiny", **_MOE), _DECODER, "MixtralForCausalLM"),
  Kind(
    "qwen3-moe",
    _gpt("moe-tiny", **_MOE, **_QWEN3_MOE, dense_layers=(0,)),
    _DECODER,
    "Qwen3MoeForCausalLM",
  ),
]

BY_NAME = {k.name: k for k in KINDS}


def having(*capabilities: str) -> list[Kind]:
  """The registered kinds that claim every one of ``capabilities``."""
  return [k for k in KINDS if all(k.has(c) for c in capabilities)]
