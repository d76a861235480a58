"""The run-directory model format used by ``tjax convert``: ``save_model`` / ``load_model``."""

from transformer_jax.train.checkpoint import load_model, save_model

__all__ = ["load_model", "save_model"]
