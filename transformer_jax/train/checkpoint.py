"""Checkpoints of a run: the format belongs to :mod:`transformer_jax.runs`; these names are kept
for code that imports them from here."""

from transformer_jax.runs import (
    Checkpoints, abstract_target, default_sharding, load_model, model_spec, restore_params,
    save_model)

__all__ = ["Checkpoints", "abstract_target", "default_sharding", "load_model", "model_spec",
           "restore_params", "save_model"]
