"""A stack of identical blocks with stacked parameters (leading ``layers`` axis), run by ``lax.scan``.

Scanning compiles one block instead of L (GPT-2 small: ~3 s instead of ~16 s here) and is what
FSDP-per-layer gathering and remat policies hang on. ``unroll=True`` runs a Python loop over the same
stacked parameters, for debugging; both give the same numbers.
"""

from __future__ import annotations

from typing import Literal

import jax
import jax.numpy as jnp
from flax import nnx

from transformer_jax.layers.block import Block, BlockConfig
from transformer_jax.parallel import axes as ax

Remat = Literal["none", "full", "dots"]

_REMAT_POLICIES = {
    # Recompute everything in the backward pass: least memory.
    "full": jax.checkpoint_policies.nothing_saveable,
    # Keep matmul outputs, recompute the cheap elementwise work.
    "dots": jax.checkpoint_policies.dots_with_no_batch_dims_saveable,
}


class Stack(nnx.Module):
  """``num_layers`` blocks sharing one config; parameters are stacked along axis 0."""

  def __init__(self, cfg: BlockConfig, num_layers: int, *, remat: Remat = "none",
               unroll: bool = False, rngs: nnx.Rngs):
    if remat != "none" and remat not in _REMAT_POLICIES:
      raise ValueError(f"remat={remat!r} must be one of 'none', {', '.join(map(repr, _REMAT_POLICIES))}")
    self.num_layers = num_layers
    self.remat = remat
    self.unroll = unroll

    @nnx.split_rngs(splits=num_layers)
    @nnx.vmap(in_axes=(0,), out_axes=0, transform_metadata={nnx.PARTITION_NAME: ax.LAYERS})
    def make(rngs):
      return Block(cfg, rngs=rngs)

    self.layers = make(rngs)

  def __call__(self, x_BTD: jax.Array, *, dropout_rng: jax.Array | None = None,
               kv_cache=None, **block_kwargs) -> jax.Array | tuple[jax.Array, object]:
    """Runs every block on ``x``; ``block_kwargs`` (masks, biases, positions, encoder output) are
    shared by all layers.

    ``kv_cache`` (decoding): the blocks' caches stacked along a leading ``[L]`` axis (see
    ``Block``); each layer gets its slice and the stack returns ``(x, new_kv_cache)``.
    """
    if kv_cache is not None:
      return self._cached(x_BTD, kv_cache, **block_kwargs)
    graphdef, params = nnx.split(self.layers)
    keys = None if dropout_rng is None else jax.random.split(dropout_rng, self.num_layers)

    def body(x, layer):
      layer_params, key = layer
      return nnx.merge(graphdef, layer_params)(x, dropout_rng=key, **block_kwargs), None

    if self.remat != "none":
      body = jax.checkpoint(body, policy=_REMAT_POLICIES[self.remat], prevent_cse=False)
    if self.unroll:
      for i in range(self.num_layers):
        x_BTD, _ = body(x_BTD, jax.tree.map(lambda a: a[i], (params, keys)))
      return x_BTD
    x_BTD, _ = jax.lax.scan(body, x_BTD, (params, keys))
    return x_BTD

  def _cached(self, x_BTD, kv_cache, **block_kwargs):
    """Scans over the layers and their cache slices together (inference: no dropout, no remat)."""
    graphdef, params = nnx.split(self.layers)

    def body(x, layer):
      layer_params, layer_cache = layer
      return nnx.merge(graphdef, layer_params)(x, kv_cache=layer_cache, **block_kwargs)

    if self.unroll:
      outs = []
      for i in range(self.num_layers):
        x_BTD, c = body(x_BTD, jax.tree.map(lambda a: a[i], (params, kv_cache)))
        outs.append(c)
      return x_BTD, jax.tree.map(lambda *a: jnp.stack(a), *outs)
    return jax.lax.scan(body, x_BTD, (params, kv_cache))

  def map_layers(self, fn):
    """``fn(block)`` for every layer, outputs stacked along a leading ``[L]`` axis (e.g. the
    cross-attention keys/values of each decoder layer, computed once per source)."""
    graphdef, params = nnx.split(self.layers)
    return jax.vmap(lambda p: fn(nnx.merge(graphdef, p)))(params)
