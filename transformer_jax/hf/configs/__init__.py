"""Config translation: a Hugging Face ``config.json`` dict <-> GPTConfig / BERTConfig /
Seq2SeqConfig / MambaConfig.

Each family has a reader (``hf dict -> our config``) and a writer (``our config -> hf dict``).
Options we do not implement are refused by name (``UnsupportedError``), never approximated. A writer
refuses a config the target architecture cannot express by translating back and naming the fields
that differ. The readers and writers live by family (``decoders``: GPT-2, LLaMA, Mistral, Qwen2,
Qwen3; ``encoders``: BERT, BigBird; ``seq2seq``: T5, Marian; ``ssm``: Mamba, Mamba-2) over the
typed reads of ``common``; ``architectures`` holds the table and the entry points this package
re-exports.
"""

from transformer_jax.hf.configs.architectures import (
  ARCHITECTURES,
  architecture_of,
  default_architecture,
  from_hf,
  special_ids,
  to_hf,
  token_ids,
)

__all__ = [
  "ARCHITECTURES",
  "architecture_of",
  "default_architecture",
  "from_hf",
  "special_ids",
  "to_hf",
  "token_ids",
]
