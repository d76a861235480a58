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

from transformer_jax.layers.attention import LayerCaches, StackedKV
from transformer_jax.layers.block import Block, BlockConfig
from transformer_jax.parallel import axes as ax
from transformer_jax.parallel.rules import ACTIVATION_BTD, constrain

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
      # Block boundary: under a mesh, activations split over batch (and length), width whole.
      x = constrain(x, ACTIVATION_BTD)
      return nnx.merge(graphdef, layer_params)(x, dropout_rng=key, **block_kwargs), None

    if self.remat != "none":
      body = jax.checkpoint(body, policy=_REMAT_POLICIES[self.remat], prevent_cse=False)
    if self.unroll:
      for i in range(self.num_layers):
        x_BTD, _ = body(x_BTD, jax.tree.map(lambda a: a[i], (params, keys)))
      return constrain(x_BTD, ACTIVATION_BTD)
    x_BTD, _ = jax.lax.scan(body, x_BTD, (params, keys))
    return constrain(x_BTD, ACTIVATION_BTD)

  def _cached(self, x_BTD, kv_cache, **block_kwargs):
    """The layers at inference (no dropout, no remat) against the caches of every layer.

    ``kv_cache["self"]`` (and ``["cross"]``) hold ``[L, B, S, K, H]`` arrays or ``LayerCaches``. Each
    layer writes its new keys/values into them in place (``StackedKV``) and hands them to the next:
    nothing is sliced out and stacked back. ``kv_cache`` may also hold ``"layers"``: this stack's
    parameters already split per layer (``split_layers``). A decoding loop splits them once, outside
    the loop, and the layers run unrolled on them; otherwise stacked caches are scanned over, each
    layer's weights sliced out of the stacked ones (a copy: fine once, for a prefill).
    """
    graphdef, params = nnx.split(self.layers)
    layers = kv_cache.get("layers")
    k, v = kv_cache["self"]
    cross = kv_cache.get("cross")

    def body(x, k, v, layer_params, i):
      caches = {"self": StackedKV(k, v, i)}
      if cross is not None:
        caches["cross"] = StackedKV(cross[0], cross[1], i)
      x, new = nnx.merge(graphdef, layer_params)(x, kv_cache=caches, **block_kwargs)
      return x, new["self"].k, new["self"].v

    if layers is None and (self.unroll or isinstance(k, LayerCaches)):
      layers = self.split_layers()
    if layers is not None:
      for i, layer_params in enumerate(layers):
        x_BTD, k, v = body(x_BTD, k, v, layer_params, i)
    else:
      def scan_body(carry, layer):
        return body(*carry, *layer), None
      (x_BTD, k, v), _ = jax.lax.scan(scan_body, (x_BTD, k, v),
                                      (params, jnp.arange(self.num_layers)))
    new_cache = {"self": (k, v)}
    if cross is not None:
      new_cache["cross"] = cross
    return x_BTD, new_cache

  def split_layers(self) -> tuple[nnx.State, ...]:
    """This stack's parameters as one state per layer (each array sliced out of the stacked one)."""
    _, params = nnx.split(self.layers)
    return tuple(jax.tree.map(lambda a: a[i], params) for i in range(self.num_layers))

  def map_layers(self, fn):
    """``fn(block)`` for every layer, outputs stacked along a leading ``[L]`` axis (e.g. the
    cross-attention keys/values of each decoder layer, computed once per source)."""
    graphdef, params = nnx.split(self.layers)
    return jax.vmap(lambda p: fn(nnx.merge(graphdef, p)))(params)
