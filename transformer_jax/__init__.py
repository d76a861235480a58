"""transformer_jax: a JAX/Flax NNX model zoo for BERT, GPT (GPT-2, LLaMA) and encoder-decoder
transformers (the Transformer, T5)."""

from transformer_jax import backends, models, ops, parallel

__version__ = "0.1.0"
__all__ = ["backends", "models", "ops", "parallel", "__version__"]
