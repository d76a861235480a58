"""Model configs: frozen, hashable dataclasses validated at construction.

Field names follow the papers and are shared by the families (``vocab_size``, ``d_model``, ``d_ff``,
``num_heads``, ``num_kv_heads``, ``head_dim``, ``max_len``, ``dropout_rate``, ``dtype``...). A bad
value raises ``ValueError`` naming the field and the value. Configs are hashable, so they can be
static arguments of ``jax.jit``. One module per family (``gpt``, ``bert``, ``seq2seq``, ``mamba``,
``reformer``), the field checks they share (``checks``) and what spans the families
(``families``: ``ModelConfig``, ``unrolls_layers``, ``config_to_dict``/``config_from_dict``); this
package re-exports their public names.
"""

from transformer_jax.models.config.bert import BERTConfig
from transformer_jax.models.config.checks import ATTENTION_IMPLS, Norm
from transformer_jax.models.config.families import (
  UNROLL_MAX_LAYERS,
  ModelConfig,
  config_from_dict,
  config_to_dict,
  unrolls_layers,
)
from transformer_jax.models.config.gpt import GPTConfig
from transformer_jax.models.config.mamba import MambaConfig
from transformer_jax.models.config.reformer import ReformerConfig
from transformer_jax.models.config.seq2seq import Seq2SeqConfig

# The accepted ``attention_impl`` values under the name tests/conftest.py reads.
_ATTENTION_IMPLS = ATTENTION_IMPLS

__all__ = [
  "ATTENTION_IMPLS",
  "BERTConfig",
  "GPTConfig",
  "MambaConfig",
  "ModelConfig",
  "Norm",
  "ReformerConfig",
  "Seq2SeqConfig",
  "UNROLL_MAX_LAYERS",
  "config_from_dict",
  "config_to_dict",
  "unrolls_layers",
]
