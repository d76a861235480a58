"""BERT and BigBird ``config.json`` <-> ``BERTConfig``.

BERT's encoder, with its sequence-classification head sized from ``id2label``, and BigBird: BERT's
layers with block-sparse attention, read as the eval-mode ``SparsePattern.bigbird`` whose logits
transformers' model computes. ``bigbird_shape`` is the part of a pattern BigBird's config can
hold, which ``architectures.to_hf`` compares after a round trip.
"""

from __future__ import annotations

import dataclasses

from transformer_jax import ops
from transformer_jax.hf.configs import common
from transformer_jax.hf.errors import UnsupportedError
from transformer_jax.models import BERTConfig

# --- BERT -----------------------------------------------------------------------------------------


def bert_from(hf: dict, arch: str) -> BERTConfig:
  """``BERTConfig`` from a BERT ``config.json`` dict; ``arch`` says whether it has a classifier."""
  common.require(hf, "position_embedding_type", "absolute", "absolute")
  common.require(hf, "is_decoder", False, False)
  common.require(hf, "add_cross_attention", False, False)
  f = common.Fields(hf)
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
    activation=common.activation(f.str("hidden_act", "gelu"), "hidden_act"),
    num_labels=num_labels,
    dropout_rate=f.float("hidden_dropout_prob", 0.1),
    attention_dropout_rate=f.float("attention_probs_dropout_prob", 0.1),
    init_std=f.float("initializer_range", 0.02),
  )


def bert_to(c: BERTConfig) -> dict:
  """BERT's ``config.json`` fields for ``c`` (``id2label`` too when it has a classifier)."""
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
    hidden_act=common.ACTIVATIONS_BACK[c.activation],
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


def bigbird_from(hf: dict, arch: str) -> BERTConfig:
  """``BERTConfig`` from a BigBird ``config.json`` dict: dense, or the eval-mode pattern."""
  common.require(hf, "rescale_embeddings", False, False)
  common.require(hf, "use_bias", True, True)
  base = bert_from({"hidden_act": "gelu_new", "max_position_embeddings": 4096, **hf}, "BertModel")
  f = common.Fields(hf)
  attention = f.str("attention_type", "block_sparse")
  match attention:
    case "original_full":
      return base
    case "block_sparse":
      pattern = ops.SparsePattern.bigbird(
        f.int("block_size", 64), f.int("num_random_blocks", 3), eval_mode=True
      )
      return dataclasses.replace(
        base, attention_kind="sparse", sparse_pattern=pattern, attention_dropout_rate=0.0
      )
    case _:
      raise UnsupportedError(
        f"attention_type={attention!r} is not supported ('block_sparse' or 'original_full')"
      )


def bigbird_shape(p: ops.SparsePattern | None):
  """What transformers' BigBird config holds of a pattern (not its seed or eval-mode parts)."""
  if p is None:
    return None
  return (p.block, p.local_blocks, p.global_blocks, p.random_blocks, p.summary, p.strided)


def bigbird_to(c: BERTConfig) -> dict:
  """BigBird's ``config.json`` fields for ``c``; a pattern it cannot hold raises ``KeyError``."""
  out = {**bert_to(c), "model_type": "big_bird", "rescale_embeddings": False, "use_bias": True}
  if c.attention_kind == "softmax":
    return {**out, "attention_type": "original_full"}
  p = c.sparse_pattern or ops.SparsePattern.bigbird()
  if c.attention_kind != "sparse" or bigbird_shape(p) != bigbird_shape(
    ops.SparsePattern.bigbird(p.block, p.random_blocks)
  ):
    raise KeyError(f"attention_kind={c.attention_kind!r} with sparse_pattern={p!r}")
  return {
    **out,
    "attention_type": "block_sparse",
    "block_size": p.block,
    "num_random_blocks": p.random_blocks,
  }
