"""A stack of identical blocks with stacked parameters (leading ``layers`` axis), run by
``lax.scan``.

Scanning compiles one block instead of L and is what FSDP-per-layer gathering and remat policies
hang on. ``unroll=True`` runs a Python loop over the same stacked parameters; both give the same
numbers, and ``models.unrolls_layers`` decides per backend (``Backend.unrolls_layers``;
experiments/PERFORMANCE.md, "Unrolled layers").
"""

from __future__ import annotations

import dataclasses
from typing import Literal

import jax
import jax.numpy as jnp
from flax import nnx
from jax.sharding import Mesh

from transformer_jax import backends
from transformer_jax.layers.cache import KVCache
from transformer_jax.layers.block import Block, BlockConfig
from transformer_jax.layers import reversible as reversible_lib
from transformer_jax.layers.dense import to_decode_layout
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
  """``num_layers`` blocks sharing one config; parameters are stacked along axis 0. With
  ``dense_layers`` a mixture-of-experts stack keeps plain MLP blocks at those indices, stacked
  apart; each run of consecutive layers of one kind is scanned (a lone layer called)."""

  def __init__(
    self,
    cfg: BlockConfig,
    num_layers: int,
    *,
    remat: Remat = "none",
    unroll: bool = False,
    rngs: nnx.Rngs,
    mesh: Mesh | None = None,
    reversible: bool = False,
    backend: backends.Backend | None = None,
    local_layers: tuple[bool, ...] | None = None,
    dense_layers: tuple[int, ...] = (),
  ):
    """``mesh``: where the model runs (activations are pinned to it at block boundaries and
    self-attention may run as ring attention); None on one device. ``reversible``: the blocks
    run as reversible residual layers (``layers.reversible``: activations recomputed in the
    backward pass; pre-norm blocks without cross-attention, no remat). ``backend``: the blocks'
    kernels (default ``backends.current()``). ``local_layers``: per layer, True for a local
    (sliding) layer, which attends within the ``window`` of the call, False for a global one,
    which attends to every earlier key (Gemma's ``layer_types``); None: every layer alike.
    ``dense_layers``: with a mixture-of-experts ``cfg``, the indices of the layers whose
    feed-forward is the plain MLP (``cfg`` without ``moe``); their parameters are stacked apart
    (``self.dense_layers``, the expert layers' in ``self.layers``)."""
    backend = backend or backends.current()
    if remat != "none" and remat not in _REMAT_POLICIES:
      raise ValueError(
        f"remat={remat!r} must be one of 'none', {', '.join(map(repr, _REMAT_POLICIES))}"
      )
    if reversible:
      reversible_lib.check_blocks(cfg)
      if remat != "none":
        raise ValueError(
          f"reversible layers recompute their activations already: remat={remat!r} must be 'none'"
        )
    self.reversible = reversible
    self.num_layers = num_layers
    self.remat = remat
    self.unroll = unroll
    self.mesh = mesh
    self.backend = backend
    if local_layers is not None:
      if reversible or len(local_layers) != num_layers:
        raise ValueError(
          f"local_layers needs one flag per layer ({len(local_layers)} for num_layers="
          f"{num_layers}) and plain (not reversible) layers"
        )
      local_layers = tuple(bool(f) for f in local_layers)
    self.local_layers = local_layers
    dense_ids = tuple(sorted(dense_layers))
    if dense_ids and (
      cfg.moe is None
      or reversible
      or len(set(dense_ids)) != len(dense_ids)
      or not all(0 <= i < num_layers for i in dense_ids)
      or len(dense_ids) == num_layers
    ):
      raise ValueError(
        f"dense_layers={list(dense_layers)} must be distinct indices in [0, {num_layers}), not "
        f"all of them, of plain (not reversible) layers of a mixture-of-experts block config"
      )
    self.dense_ids = dense_ids

    def stacked(block_cfg, count):
      @nnx.split_rngs(splits=count)
      @nnx.vmap(in_axes=(0,), out_axes=0, transform_metadata={nnx.PARTITION_NAME: ax.LAYERS})
      def make(rngs):
        return Block(block_cfg, rngs=rngs, mesh=mesh, backend=backend)

      return make(rngs)

    self.layers = stacked(cfg, num_layers - len(dense_ids))
    if dense_ids:
      self.dense_layers = stacked(dataclasses.replace(cfg, moe=None), len(dense_ids))

  def __call__(
    self,
    x_BTD: jax.Array,
    *,
    dropout_rng: jax.Array | None = None,
    cache: KVCache | None = None,
    layer_params: tuple[nnx.State, ...] | None = None,
    moe_stats: list | None = None,
    **block_kwargs,
  ) -> tuple[jax.Array, KVCache | None]:
    """Runs every block on ``x``; ``block_kwargs`` (mask parts, bias, positions, encoder output)
    are shared by all layers.

    Args:
      x_BTD: ``[B, T, D]``.
      dropout_rng: a key turns dropout on (one key per layer is split from it).
      cache: a ``KVCache`` of every layer (decoding): layer ``i`` reads and writes
      ``cache.layer(i)``
        and the T new tokens advance ``lengths``. The layers then run one after another (their
        caches are separate arrays); without a cache they run under ``lax.scan``.
      layer_params: this stack's parameters split per layer (``split_layers``), for a decoding
        loop: split once outside the loop, each step reads every layer's weights where they are
        instead of slicing (copying) them out of the stacked arrays.
      moe_stats: a list that mixture-of-experts layers' router statistics are appended to, as one
        dict of arrays with a leading ``[L]`` axis (training and eval; not with a cache).

    Returns:
      ``(x [B, T, D], cache)``: the updated cache, or None without one.
    """
    if self.reversible:
      return self._reversible(x_BTD, dropout_rng, cache, layer_params, block_kwargs)
    if cache is not None:
      if layer_params is None:
        layer_params = self.split_layers()
      graphdefs = {kind: nnx.split(getattr(self, kind))[0] for kind in self._kinds()}
      layers = []
      for i, ((kind, _), p) in enumerate(zip(self._order(), layer_params)):
        kw = self._layer_kwargs(block_kwargs, i)
        x_BTD, new = nnx.merge(graphdefs[kind], p)(x_BTD, cache=cache.layer(i), **kw)
        layers.append(new)
      return x_BTD, cache.joined(layers, x_BTD.shape[1])

    keys = None if dropout_rng is None else jax.random.split(dropout_rng, self.num_layers)
    per_segment = []
    for kind, j, i, n in self._segments():
      graphdef, params = nnx.split(getattr(self, kind))
      if n != jax.tree.leaves(params)[0].shape[0]:
        params = jax.tree.map(lambda a: a[j : j + n], params)
      seg_keys = None if keys is None else keys[i : i + n]
      x_BTD, stats = self._run(graphdef, params, seg_keys, x_BTD, block_kwargs, i, n)
      if stats is not None:
        per_segment.append(stats)
    if moe_stats is not None and per_segment:
      moe_stats.append(jax.tree.map(lambda *a: jnp.concatenate(a), *per_segment))
    return constrain(x_BTD, ACTIVATION_BTD, self.mesh), None

  def _run(self, graphdef, params, keys, x_BTD, block_kwargs, first: int, count: int):
    """Layers ``first .. first + count - 1``, all of one kind (``params`` stacked): under one
    ``lax.scan`` or unrolled. Returns ``(x, stats)``: the router statistics ``[count, ...]`` of
    mixture-of-experts layers, None for plain ones."""

    def layer_fn(kwargs):
      def run(x, layer_params, key):
        # Block boundary: under a mesh, activations split over batch (and length), width whole.
        x = constrain(x, ACTIVATION_BTD, self.mesh)
        stats = []  # a mixture of experts' router statistics, the scan's per-layer output
        x = nnx.merge(graphdef, layer_params)(x, dropout_rng=key, moe_stats=stats, **kwargs)[0]
        return x, (stats[0] if stats else None)

      if self.remat != "none":
        return jax.checkpoint(run, policy=_REMAT_POLICIES[self.remat], prevent_cse=False)
      return run

    local = None if self.local_layers is None else self.local_layers[first : first + count]
    if self.unroll or count == 1 and self.dense_ids:  # a lone layer between the other kind
      per_layer = []
      for i in range(count):
        layer = jax.tree.map(lambda a: a[i], (params, keys))
        x_BTD, stats = layer_fn(self._layer_kwargs(block_kwargs, first + i))(x_BTD, *layer)
        per_layer.append(stats)
      stats = None if per_layer[0] is None else jax.tree.map(lambda *a: jnp.stack(a), *per_layer)
    elif local is not None and len(set(local)) == 2:  # local and global: a branch each
      local_fn = layer_fn(self._layer_kwargs(block_kwargs, local=True))
      global_fn = layer_fn(self._layer_kwargs(block_kwargs, local=False))

      def mixed_body(x, layer):
        layer_params, key, is_local = layer
        return jax.lax.cond(is_local, local_fn, global_fn, x, layer_params, key)

      x_BTD, stats = jax.lax.scan(mixed_body, x_BTD, (params, keys, jnp.asarray(local)))
    else:
      fn = layer_fn(self._layer_kwargs(block_kwargs, first))
      x_BTD, stats = jax.lax.scan(lambda x, layer: fn(x, *layer), x_BTD, (params, keys))
    return x_BTD, stats

  def _kinds(self) -> tuple[str, ...]:
    """The attributes holding stacked blocks: ``layers`` and, with plain MLP layers among
    mixture-of-experts ones, ``dense_layers``."""
    return ("layers", "dense_layers") if self.dense_ids else ("layers",)

  def _order(self) -> list[tuple[str, int]]:
    """``(attribute, index within its stack)`` of every layer, in order."""
    seen = {"layers": 0, "dense_layers": 0}
    out = []
    for i in range(self.num_layers):
      kind = "dense_layers" if i in self.dense_ids else "layers"
      out.append((kind, seen[kind]))
      seen[kind] += 1
    return out

  def _segments(self) -> list[tuple[str, int, int, int]]:
    """Runs of consecutive layers of one kind: ``(attribute, first index within its stack,
    first layer, count)``; one run of every layer without ``dense_layers``."""
    out = []
    for i, (kind, j) in enumerate(self._order()):
      if out and out[-1][0] == kind:
        out[-1][3] += 1
      else:
        out.append([kind, j, i, 1])
    return [tuple(seg) for seg in out]

  def _mixed(self) -> bool:
    """Whether the stack has both local and global layers."""
    return self.local_layers is not None and len(set(self.local_layers)) == 2

  def _layer_kwargs(self, block_kwargs: dict, i: int = 0, *, local: bool | None = None) -> dict:
    """The block arguments of layer ``i`` (or of a layer that is ``local`` or not): a global
    layer of a stack with ``local_layers`` attends without the window."""
    if self.local_layers is None:
      return block_kwargs
    local = self.local_layers[i] if local is None else local
    if local:
      return {**block_kwargs, "local": True}
    return {**block_kwargs, "window": None}

  def _reversible(self, x_BTD, dropout_rng, cache, layer_params, block_kwargs):
    """``__call__`` of a reversible stack (``layers.reversible``)."""
    if cache is None:
      return reversible_lib.run_blocks(
        self.layers, x_BTD, dropout_rng=dropout_rng, num_layers=self.num_layers, **block_kwargs
      ), None
    graphdef, _ = nnx.split(self.layers)
    blocks = [nnx.merge(graphdef, p) for p in (layer_params or self.split_layers())]
    x_BTD, layers = reversible_lib.run_blocks_cached(
      blocks, x_BTD, [cache.layer(i) for i in range(self.num_layers)], **block_kwargs
    )
    return x_BTD, cache.joined(layers, x_BTD.shape[1])

  def attention_weights(self, x_BTD: jax.Array, **block_kwargs) -> tuple[jax.Array, jax.Array]:
    """Every layer's self-attention weights on the way through the stack (no dropout, no cache).

    Args:
      x_BTD: the stack's input ``[B, T, D]``.
      block_kwargs: as in ``__call__``; the self-attention mask and bias parts reach the weights.

    Returns:
      ``(x [B, T, D], weights [L, B, N, T, S])``: the stack's output and each layer's weights.
    """
    graphdef, params = nnx.split(self.layers)
    names = ("positions", "causal", "kv_valid", "segment_ids", "window", "bias_fn", "bias_params")

    def run(x, layer_params, kwargs, kind_graphdef=graphdef):
      block = nnx.merge(kind_graphdef, layer_params)
      parts = {k: v for k, v in kwargs.items() if k in (*names, "local")}
      return block(x, **kwargs)[0], block.attention_weights(x, **parts)

    def body(x, layer):
      layer_params, local = layer
      if self._mixed():
        return jax.lax.cond(
          local,
          lambda: run(x, layer_params, self._layer_kwargs(block_kwargs, local=True)),
          lambda: run(x, layer_params, self._layer_kwargs(block_kwargs, local=False)),
        )
      return run(x, layer_params, self._layer_kwargs(block_kwargs, 0))

    if self.dense_ids:  # blocks of two kinds: one after another
      weights = []
      for i, (kind, j) in enumerate(self._order()):
        kind_graphdef, kind_params = nnx.split(getattr(self, kind))
        p = jax.tree.map(lambda a: a[j], kind_params)
        x_BTD, w = run(x_BTD, p, self._layer_kwargs(block_kwargs, i), kind_graphdef)
        weights.append(w)
      return x_BTD, jnp.stack(weights)
    flags = None if not self._mixed() else jax.numpy.asarray(self.local_layers)
    return jax.lax.scan(body, x_BTD, (params, flags))

  def split_layers(self) -> tuple[nnx.State, ...]:
    """This stack's parameters as one state per layer, for decoding: each array sliced out of the
    stacked one, every projection kernel in the backend's decoding layout
    (``Backend.decode_layout``; on CPU, XLA:CPU's matrix-vector products)."""
    kinds = {kind: nnx.split(getattr(self, kind)) for kind in self._kinds()}
    out = []
    for kind, j in self._order():
      graphdef, params = kinds[kind]
      block = nnx.merge(graphdef, jax.tree.map(lambda a: a[j], params))
      to_decode_layout(block, self.backend)
      out.append(nnx.state(block))
    return tuple(out)

  def map_layers(self, fn):
    """``fn(block)`` for every layer, outputs stacked along a leading ``[L]`` axis (e.g. the
    cross-attention keys/values of each decoder layer, computed once per source)."""
    if self.dense_ids:
      raise ValueError("map_layers needs blocks of one kind (this stack has dense_layers)")
    graphdef, params = nnx.split(self.layers)
    return jax.vmap(lambda p: fn(nnx.merge(graphdef, p)))(params)
