"""transformer_jax: a JAX/Flax NNX model zoo for BERT, GPT (GPT-2, LLaMA) and encoder-decoder
transformers (the Transformer, T5)."""

import importlib

# The one place the version is written: pyproject.toml reads it (dynamic version); CHANGELOG.md
# has a section per version.
__version__ = "0.1.0"
__all__ = ["backends", "load_model", "load_run", "models", "ops", "parallel", "__version__"]


# Subpackages imported on first use (``tj.models``, ``tj.ops``, ...): a program that only
# prepares data (``tjax prepare``) never loads JAX, and one that never reads runs never loads orbax.
_LAZY = ("backends", "data", "generate", "hf", "models", "ops", "parallel", "train")


def __getattr__(name: str):
  """The subpackages of ``_LAZY``, and ``load_run``/``load_model`` (``transformer_jax.runs``),
  imported on first use."""
  if name in _LAZY:
    return importlib.import_module(f"transformer_jax.{name}")
  if name in ("load_run", "load_model"):
    from transformer_jax import runs  # noqa: PLC0415 - lazy attribute

    return getattr(runs, name)
  raise AttributeError(f"module 'transformer_jax' has no attribute {name!r}")
