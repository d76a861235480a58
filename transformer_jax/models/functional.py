"""Models as pure functions: ``init(config, key) -> params`` and ``apply(config, params, *inputs)``.

Built on ``nnx.split``/``nnx.merge``: the graph definition is derived once per config (configs are
hashable) and the parameters are a plain pytree, so ``jax.grad``, ``jax.vmap`` and ``jax.jit`` treat
a model like any function.
"""

from __future__ import annotations

import functools

import jax
from flax import nnx
from jax.sharding import Mesh

from transformer_jax.backends import Backend
from transformer_jax.models.bert import BERT
from transformer_jax.models.config import (
  BERTConfig,
  GPTConfig,
  MambaConfig,
  ModelConfig,
  ReformerConfig,
  Seq2SeqConfig,
)
from transformer_jax.models.gpt import GPT
from transformer_jax.models.mamba import Mamba
from transformer_jax.models.reformer import Reformer
from transformer_jax.models.seq2seq import Seq2Seq


def model_class(config: ModelConfig) -> type[nnx.Module]:
  match config:
    case GPTConfig():
      return GPT
    case BERTConfig():
      return BERT
    case Seq2SeqConfig():
      return Seq2Seq
    case MambaConfig():
      return Mamba
    case ReformerConfig():
      return Reformer
    case _:
      raise TypeError(f"not a model config: {type(config).__name__}")


def create(
  config: ModelConfig,
  *,
  rngs: nnx.Rngs | None = None,
  mesh: Mesh | None = None,
  backend: Backend | None = None,
) -> nnx.Module:
  """The NNX module for ``config`` (GPT, BERT or Seq2Seq), built for ``mesh`` and ``backend``
  (see ``GPT``).

  Without ``rngs`` the parameters come from ``init(config, jax.random.key(0))``: one compiled
  initialisation instead of hundreds of eagerly dispatched ops.
  """
  if rngs is None:
    return nnx.merge(graphdef(config, mesh, backend), init(config, jax.random.key(0)))
  return model_class(config)(config, rngs=rngs, mesh=mesh, backend=backend)


def abstract(
  config: ModelConfig, mesh: Mesh | None = None, backend: Backend | None = None
) -> nnx.Module:
  """The module with ``ShapeDtypeStruct`` parameters: no memory, any size (``nnx.eval_shape``)."""
  return nnx.eval_shape(
    lambda: model_class(config)(config, rngs=nnx.Rngs(0), mesh=mesh, backend=backend)
  )


@functools.lru_cache(maxsize=64)
def graphdef(
  config: ModelConfig, mesh: Mesh | None = None, backend: Backend | None = None
) -> nnx.GraphDef:
  """The model's graph definition; ``mesh``: the mesh its layers run on (ring attention and
  activation shardings; see ``GPT``); ``backend``: the kernels they call (default
  ``backends.current()``, the default kernel table). Parameters depend on neither."""
  return nnx.split(abstract(config, mesh, backend))[0]


@functools.lru_cache(maxsize=64)
def _jitted_init(config: ModelConfig):
  return jax.jit(lambda key: nnx.state(create(config, rngs=nnx.Rngs(params=key)), nnx.Param))


def init_abstract(config: ModelConfig) -> nnx.State:
  """Parameter shapes and dtypes (``ShapeDtypeStruct`` leaves) without allocating anything."""
  return nnx.state(abstract(config), nnx.Param)


def init(config: ModelConfig, key: jax.Array) -> nnx.State:
  """Freshly initialised parameters (an ``nnx.State`` pytree) for ``config``; jit- and vmap-safe."""
  if isinstance(key, jax.core.Tracer):  # already inside a transformation: trace through
    return nnx.state(create(config, rngs=nnx.Rngs(params=key)), nnx.Param)
  return _jitted_init(config)(key)


def apply(config: ModelConfig, params: nnx.State, *inputs, method: str | None = None, **kwargs):
  """Runs the model for ``config`` with ``params``: ``apply(cfg, params, tokens)``.

  ``method`` picks another entry point (``"encode"``, ``"decode"``, ``"classify"``...).
  """
  model = nnx.merge(graphdef(config), params)
  fn = model if method is None else getattr(model, method)
  return fn(*inputs, **kwargs)
