"""The model families (GPT, BERT, Seq2Seq, Mamba), their configs and presets, and pure-function
forms."""

from transformer_jax.models.bert import BERT, BERTOutput
from transformer_jax.models.common import checked
from transformer_jax.models.config import (
  BERTConfig,
  GPTConfig,
  MambaConfig,
  ModelConfig,
  ReformerConfig,
  Seq2SeqConfig,
  config_from_dict,
  config_to_dict,
  unrolls_layers,
)
from transformer_jax.models.counting import (
  ParamCount,
  count_params,
  param_count,
  train_flops_per_token,
  train_memory_bytes,
)
from transformer_jax.models.functional import (
  abstract,
  apply,
  create,
  graphdef,
  init,
  init_abstract,
  model_class,
)
from transformer_jax.models.gpt import GPT
from transformer_jax.models.mamba import Mamba
from transformer_jax.models.presets import PRESETS, get_config, list_presets
from transformer_jax.models.reformer import Reformer
from transformer_jax.models.seq2seq import Seq2Seq

__all__ = [
  "BERT",
  "BERTConfig",
  "BERTOutput",
  "GPT",
  "GPTConfig",
  "Mamba",
  "MambaConfig",
  "ModelConfig",
  "PRESETS",
  "ParamCount",
  "Seq2Seq",
  "Seq2SeqConfig",
  "abstract",
  "apply",
  "checked",
  "config_from_dict",
  "config_to_dict",
  "count_params",
  "create",
  "get_config",
  "graphdef",
  "init",
  "init_abstract",
  "list_presets",
  "model_class",
  "param_count",
  "Reformer",
  "ReformerConfig",
  "train_flops_per_token",
  "train_memory_bytes",
  "unrolls_layers",
]
