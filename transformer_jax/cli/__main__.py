"""``python -m transformer_jax.cli``: the ``tjax`` program (``launch``)."""

from transformer_jax.cli import launch

launch()
