"""Hugging Face interop: load ``transformers`` checkpoints into transformer_jax models and save
back.

    config, model = transformer_jax.hf.load("path/to/checkpoint_dir")  # or a transformers model
    transformer_jax.hf.save(model, config, "out_dir")                  # config.json + safetensors
    transformer_jax.hf.save(model, config, "out_dir", tokenizer=tok)   # with its special ids

Supported architectures: GPT2LMHeadModel; BertForPreTraining, BertForMaskedLM,
BertForSequenceClassification, BertModel; T5ForConditionalGeneration (v1.0 and v1.1);
LlamaForCausalLM; MarianMTModel (our Vaswani-style Seq2Seq). Nothing here imports torch or
transformers at import time; only ``pytorch_model.bin`` files and in-memory models need torch.
"""

from transformer_jax.hf.api import load, save
from transformer_jax.hf.configs import ARCHITECTURES
from transformer_jax.hf.errors import CheckpointError, UnsupportedError

__all__ = ["ARCHITECTURES", "CheckpointError", "UnsupportedError", "load", "save"]
