"""Hugging Face interop: load ``transformers`` checkpoints into transformer_jax models and save
back.

    config, model = transformer_jax.hf.load("path/to/checkpoint_dir")  # or a transformers model
    transformer_jax.hf.save(model, config, "out_dir")                  # config.json + safetensors
    transformer_jax.hf.save(model, config, "out_dir", tokenizer=tok)   # with its special ids

Supported architectures (``ARCHITECTURES``, plus the Reformer):

- GPT2LMHeadModel -> ``models.GPT``
- LlamaForCausalLM, MistralForCausalLM (sliding window), Qwen2ForCausalLM (query/key/value
  biases), Qwen3ForCausalLM (per-head query/key norms) -> ``models.GPT``
- Gemma2ForCausalLM, Gemma3ForCausalLM (text: (1 + w) norms, soft-caps, local and global layers)
  -> ``models.GPT``
- MixtralForCausalLM, Qwen3MoeForCausalLM (stacked or per-expert weights) -> ``models.GPT`` with
  mixture-of-experts feed-forwards
- BertForPreTraining, BertForMaskedLM, BertForSequenceClassification, BertModel -> ``models.BERT``
- BigBirdForPreTraining, BigBirdForMaskedLM, BigBirdModel -> ``models.BERT`` with block-sparse
  attention (``attention_kind="sparse"``); like any BERT its call returns a ``BERTOutput``
- T5ForConditionalGeneration (v1.0 and v1.1), MarianMTModel -> ``models.Seq2Seq``
- MambaForCausalLM, Mamba2ForCausalLM -> ``models.Mamba``
- ReformerModelWithLMHead -> ``models.Reformer``

Every reader takes its tensors through ``checked.read`` (names, exact shapes, floating dtypes,
finite values) and its config fields by type (``configs.common.Fields``). Nothing here imports
torch or transformers at import time; only ``pytorch_model.bin`` files, in-memory models and the
Reformer's LSH rotations need torch.
"""

from transformer_jax.hf.api import load, save
from transformer_jax.hf.configs import ARCHITECTURES
from transformer_jax.hf.errors import CheckpointError, UnsupportedError

__all__ = ["ARCHITECTURES", "CheckpointError", "UnsupportedError", "load", "save"]
