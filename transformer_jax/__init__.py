"""transformer_jax: a JAX/Flax NNX model zoo for BERT, GPT (GPT-2, LLaMA) and encoder-decoder
transformers (the Transformer, T5)."""

from transformer_jax import backends, models, ops, parallel

# The one place the version is written: pyproject.toml reads it (dynamic version); CHANGELOG.md
# has a section per version.
__version__ = "0.1.0"
__all__ = ["backends", "load_model", "load_run", "models", "ops", "parallel", "__version__"]


def __getattr__(name: str):
  """``load_run`` and ``load_model`` (``transformer_jax.runs``) and ``train`` (``tj.train.
  make_step``), imported on first use: the checkpoint library loads only for a program that
  reads runs or trains."""
  if name == "train":
    import importlib  # noqa: PLC0415 - lazy attribute

    return importlib.import_module("transformer_jax.train")
  if name in ("load_run", "load_model"):
    from transformer_jax import runs  # noqa: PLC0415 - lazy attribute

    return getattr(runs, name)
  raise AttributeError(f"module 'transformer_jax' has no attribute {name!r}")
