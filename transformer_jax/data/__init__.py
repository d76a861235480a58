"""Data layer: tiktoken tokenizer, corpus preparation, memory-mapped datasets, deterministic numpy
loaders.

No Flax here; ``jax`` only answers the loaders' default process index and count.
"""

from transformer_jax.data.classify import ClassifyLoader, classify_eval_batches
from transformer_jax.data.dataset import Dataset, Stream, load_dataset
from transformer_jax.data.estimate import dataset_facts, estimate_corpus
from transformer_jax.data.loaders import (
  BertLoader,
  GPTLoader,
  Seq2SeqLoader,
  bert_eval_batches,
  gpt_eval_batches,
  make_loader,
  seq2seq_eval_batches,
  unigram_cross_entropy,
)
from transformer_jax.data.layout import METADATA_FILE, read_metadata
from transformer_jax.data.mixture import MixtureLoader, load_mixture, row_documents

# ``prepare`` here is the function; the module is ``transformer_jax.data.prepare`` imported by its
# full name (``from transformer_jax.data import prepare`` gives the function).
from transformer_jax.data.prepare import prepare
from transformer_jax.data.sources import synthetic_examples
from transformer_jax.data.tokenizer import SPECIAL_TOKENS, CompactVocab, Tokenizer

__all__ = [
  "SPECIAL_TOKENS",
  "BertLoader",
  "ClassifyLoader",
  "classify_eval_batches",
  "dataset_facts",
  "estimate_corpus",
  "CompactVocab",
  "Dataset",
  "GPTLoader",
  "Seq2SeqLoader",
  "Stream",
  "Tokenizer",
  "bert_eval_batches",
  "gpt_eval_batches",
  "load_dataset",
  "load_mixture",
  "make_loader",
  "MixtureLoader",
  "METADATA_FILE",
  "prepare",
  "read_metadata",
  "row_documents",
  "seq2seq_eval_batches",
  "synthetic_examples",
  "unigram_cross_entropy",
]
