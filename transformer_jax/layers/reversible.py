"""Reversible residual layers (Gomez et al. 2017; the Reformer): activations recomputed in the
backward pass, so a step's memory does not grow with the depth.

The width is carried as two streams. A layer with branches ``f`` and ``g`` maps ``(x1, x2)`` to

    y1 = x1 + f(x2)        y2 = x2 + g(y1)

and its inputs follow from its outputs: ``x2 = y2 - g(y1)``, ``x1 = y1 - f(x2)``.
``reversible_layers`` runs L such layers (stacked parameters, ``lax.scan``) under a
``jax.custom_vjp`` that saves only the last layer's outputs; its backward walks the layers in
reverse, rebuilding each layer's inputs and taking its vector-Jacobian products, so only one
layer's activations exist at a time.

The streams are float32 (or wider) whatever the branches compute in, each carried as a pair
``(hi, lo)`` whose ``lo`` keeps the adds' rounding error (Knuth's two-sum): the backward's
subtraction then returns each layer's inputs to about ``2**-44`` of the activations, so the
branches see the float32 inputs they saw in the forward (``hi``; ``lo`` never reaches them).
Plain float32 adds would lose ``2**-24`` of the activations per layer, and bfloat16 adds
``2**-8``, which the inversion amplifies layer by layer into wrong gradients. What is left
differs from ordinary autodiff only where XLA compiles a branch's recomputation differently
from its forward: less than the branches' own rounding puts in the gradient
(``tests/layers/test_reversible.py``; docs/approximations.md).

``Stack(reversible=True)`` runs its blocks this way: ``f`` is a pre-norm block's attention branch
and ``g`` its feed-forward branch; the stack's input feeds both streams and its output is their
mean (``models/reformer.py`` keeps both streams instead, as the Reformer does).
"""

from __future__ import annotations

import functools
from collections.abc import Callable
from typing import Any

import jax
import jax.numpy as jnp
from flax import nnx

from transformer_jax import ops
from transformer_jax.layers.block import Block
from transformer_jax.layers.common import split_key
from transformer_jax.ops import precision

# branch(layer_params, x [B, T, D], shared, per_layer) -> [B, T, D]
Branch = Callable[[Any, jax.Array, Any, Any], jax.Array]


def stream_dtype(dtype) -> jnp.dtype:
  """The residual streams' dtype for inputs of ``dtype``: float32 at least."""
  return jnp.promote_types(dtype, jnp.float32)


def _tree_add(a, b):
  return jax.tree.map(jnp.add, a, b)


def _slice(a, j):
  return None if a is None else jax.tree.map(lambda x: x[j], a)


def _add(x, a):
  """``x + a`` for a stream ``x = (hi, lo)`` (the value ``hi + lo``, ``|lo|`` at most half an ulp
  of ``hi``) and a branch output ``a``: Knuth's two-sum keeps the add's rounding error in ``lo``,
  so ``_add(_add(x, a), -a)`` gives ``x`` back to about ``2**-44`` of the values (float32)."""
  hi, lo = x
  a = a.astype(hi.dtype)
  s = hi + a
  bb = s - hi
  e = (hi - (s - bb)) + (a - bb) + lo  # the add's rounding error, exactly, plus the old lo
  hi = s + e
  return hi, e - (hi - s)


def _stream(x):
  return x, jnp.zeros_like(x)


@functools.partial(jax.custom_vjp, nondiff_argnums=(0, 1, 2))
def _run(
  fs: tuple[Branch, ...],
  gs: tuple[Branch, ...],
  matmul_precision,
  params,
  x1,
  x2,
  shared,
  per_layer,
):
  y1, y2 = _run_streams(fs, gs, params, x1, x2, shared, per_layer)
  return y1[0], y2[0]


def _run_streams(fs, gs, params, x1, x2, shared, per_layer):
  def body(carry, step):
    x1, x2 = carry
    ps, a = step
    for j, (f, g) in enumerate(zip(fs, gs)):
      x1 = _add(x1, f(ps[j], x2[0], shared, _slice(a, j)))
      x2 = _add(x2, g(ps[j], x1[0], shared, _slice(a, j)))
    return (x1, x2), None

  return jax.lax.scan(body, (_stream(x1), _stream(x2)), (params, per_layer))[0]


def _run_fwd(fs, gs, matmul_precision, params, x1, x2, shared, per_layer):
  y1, y2 = _run_streams(fs, gs, params, x1, x2, shared, per_layer)
  return (y1[0], y2[0]), (params, y1, y2, shared, per_layer)


def _run_bwd(fs, gs, matmul_precision, res, cotangents):
  params, y1, y2, shared, per_layer = res
  dy1, dy2 = cotangents

  def body(carry, step):
    y1, y2, dy1, dy2 = carry
    ps, a = step
    dps = [None] * len(fs)
    for j in reversed(range(len(fs))):
      f, g, p, aj = fs[j], gs[j], ps[j], _slice(a, j)
      gy1, g_vjp = jax.vjp(lambda p, y: g(p, y, shared, aj), p, y1[0])
      x2 = _add(y2, -gy1)
      dp_g, dy1_g = g_vjp(dy2.astype(gy1.dtype))
      dy1 = dy1 + dy1_g
      fx2, f_vjp = jax.vjp(lambda p, x: f(p, x, shared, aj), p, x2[0])
      dp_f, dx2_f = f_vjp(dy1.astype(fx2.dtype))
      y1, y2, dy2 = _add(y1, -fx2), x2, dy2 + dx2_f
      dps[j] = _tree_add(dp_f, dp_g)
    return (y1, y2, dy1, dy2), tuple(dps)

  with jax.default_matmul_precision(matmul_precision):  # the forward's (ops/precision.py)
    (_, _, dx1, dx2), dparams = jax.lax.scan(
      body, (y1, y2, dy1, dy2), (params, per_layer), reverse=True
    )
  return dparams, dx1, dx2, None, None


_run.defvjp(_run_fwd, _run_bwd)


def reversible_layers(
  f: Branch | tuple[Branch, ...],
  g: Branch | tuple[Branch, ...],
  params: Any,
  x1: jax.Array,
  x2: jax.Array,
  *,
  shared: Any = None,
  per_layer: Any = None,
  recompute: bool = True,
) -> tuple[jax.Array, jax.Array]:
  """L reversible layers ``y1 = x1 + f(x2)``, ``y2 = x2 + g(y1)`` with recomputing gradients.

  Args:
    f, g: the branches, ``branch(layer_params, x, shared, per_layer_slice) -> x``'s shape;
      hashable (module-level functions or ``functools.partial`` of them: they are static). Or
      tuples of P branches for layers of P kinds in turn (the Reformer's local and LSH layers):
      the scan's step then runs P layers, kind j with ``f[j]``, ``g[j]``, ``params[j]``.
    params: the layers' parameters, every leaf with a leading ``[L]`` axis (differentiated); a
      tuple of P such trees with ``[L / P]`` when the branches are tuples.
    x1, x2: the two input streams ``[B, T, D]``.
    shared: arrays every layer reads (masks, positions); not differentiated.
    per_layer: arrays with a leading ``[L]`` axis (``[L / P, P]`` with tuples), one slice per
      layer (dropout keys); not differentiated.
    recompute: True: the recomputing backward; False: the same layers under ordinary autodiff
      (every layer's activations saved), for comparisons.

  Returns:
    ``(y1, y2)`` after the last layer, in ``stream_dtype(x1.dtype)`` (float32 at least). Its
    gradients wrt ``params``, ``x1`` and ``x2`` equal those of the same layers under ordinary
    autodiff up to the branches' rounding (see the module docstring), from one layer's
    activations at a time.
  """
  if not isinstance(f, tuple):
    f, g, params = (f,), (g,), (params,)
    per_layer = None if per_layer is None else jax.tree.map(lambda a: a[:, None], per_layer)
  stream = stream_dtype(x1.dtype)
  run = _run if recompute else _run.fun
  return run(
    f, g, precision.current(), params, x1.astype(stream), x2.astype(stream), shared, per_layer
  )


def _block_kwargs(kw: dict) -> dict:
  """The self-attention mask parts a block takes (``Block.__call__``)."""
  unknown = set(kw) - {
    "positions",
    "causal",
    "kv_valid",
    "segment_ids",
    "window",
    "bias_fn",
    "bias_params",
  }
  if unknown:
    raise ValueError(
      f"reversible blocks take no {', '.join(sorted(unknown))} (self-attention "
      "blocks without cross-attention)"
    )
  return kw


def _attention_branch(graphdef, p, x, shared, key, *, static):
  block: Block = nnx.merge(graphdef, p)
  r_attn, r_attn_w = split_key(key, 2)
  kw = {**static, **shared}
  out, _ = block.attn(
    block.attn_norm(x).astype(block.cfg.dtype),
    dropout_rate=block.cfg.attention_dropout_rate,
    dropout_rng=r_attn_w,
    **kw,
  )
  return ops.dropout(out, block.cfg.dropout_rate, r_attn)


def _mlp_branch(graphdef, p, x, shared, key, *, static):
  del shared, static
  block: Block = nnx.merge(graphdef, p)
  r_mlp, r_mlp_in = split_key(None if key is None else jax.random.fold_in(key, 1), 2)
  out = block.mlp(
    block.mlp_norm(x).astype(block.cfg.dtype),
    dropout_rate=block.cfg.ffn_dropout_rate,
    dropout_rng=r_mlp_in,
  )
  return ops.dropout(out, block.cfg.dropout_rate, r_mlp)


class _Static(dict):
  """Hashable options of a branch (bools, ints, callables); arrays go in ``shared``."""

  def __hash__(self):
    return hash(tuple(sorted(self.items(), key=lambda kv: kv[0])))


def check_blocks(cfg) -> None:
  """Raises ``ValueError`` unless blocks of ``cfg`` (a ``BlockConfig``) can run reversibly:
  pre-norm, no cross-attention."""
  if not cfg.pre_norm or cfg.cross_attention:
    raise ValueError(
      "reversible layers need pre-norm blocks without cross-attention "
      f"(pre_norm={cfg.pre_norm}, cross_attention={cfg.cross_attention})"
    )


def run_blocks(
  layers: Block,
  x_BTD: jax.Array,
  *,
  dropout_rng: jax.Array | None,
  num_layers: int,
  recompute: bool = True,
  **block_kwargs,
) -> jax.Array:
  """The stacked ``layers`` (an ``nnx.vmap``-ed ``Block``) on ``x`` as reversible layers; the
  output is the mean of the two streams (``recompute`` as in ``reversible_layers``)."""
  check_blocks(layers.cfg)
  graphdef, params = nnx.split(layers)
  kw = _block_kwargs(block_kwargs)
  shared = {k: v for k, v in kw.items() if isinstance(v, jax.Array) or hasattr(v, "shape")}
  static = _Static({k: v for k, v in kw.items() if k not in shared})
  keys = None if dropout_rng is None else jax.random.split(dropout_rng, num_layers)
  f = functools.partial(_attention_branch, graphdef, static=static)
  g = functools.partial(_mlp_branch, graphdef, static=static)
  y1, y2 = reversible_layers(
    f, g, params, x_BTD, x_BTD, shared=shared, per_layer=keys, recompute=recompute
  )
  return ((y1 + y2) * 0.5).astype(x_BTD.dtype)


def run_blocks_cached(blocks: list[Block], x_BTD: jax.Array, caches: list, **block_kwargs):
  """Decoding (no gradients): the blocks one after another on the two streams, each reading and
  writing its cache. Returns ``(mean of the streams, new caches)``."""
  kw = _block_kwargs(block_kwargs)
  x1 = x2 = _stream(x_BTD.astype(stream_dtype(x_BTD.dtype)))
  new = []
  for block, cache in zip(blocks, caches):
    out, cache = block.attn(block.attn_norm(x2[0]).astype(block.cfg.dtype), cache=cache, **kw)
    x1 = _add(x1, out)
    x2 = _add(x2, block.mlp(block.mlp_norm(x1[0]).astype(block.cfg.dtype)))
    new.append(cache)
  return ((x1[0] + x2[0]) * 0.5).astype(x_BTD.dtype), new
