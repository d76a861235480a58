"""Input checks and small pieces shared by the model families."""

from __future__ import annotations

import contextlib
import contextvars
import functools

import jax
import jax.numpy as jnp
import numpy as np
from flax import nnx
from jax.experimental import checkify

from transformer_jax.layers import Projection
from transformer_jax.ops import precision
from transformer_jax.parallel import axes as ax

# Set while ``checked`` traces its function: traced token ids are then checked on the device.
_CHECKING_IDS = contextvars.ContextVar("checking_ids", default=False)


def output_heads(config, *, dtype, param_dtype, rngs: nnx.Rngs, backend=None
                 ) -> tuple[Projection | None, Projection | None]:
  """A family's ``(lm_head, classifier)``: the untied vocabulary projection ``[D, V]`` (None when
  the embedding is tied) and the classification head ``[D, C]`` with a bias (None without
  ``num_labels``); their products are ``backend``'s."""
  lm_head = (None if config.tie_embeddings else Projection(
      "BTD,DV->BTV", (config.d_model, config.vocab_size), (ax.EMBED, ax.VOCAB),
      init_std=config.init_std, dtype=dtype, param_dtype=param_dtype, rngs=rngs,
      backend=backend))
  classifier = (Projection(
      "BD,DC->BC", (config.d_model, config.num_labels), (ax.EMBED, ax.CLASSES),
      bias_shape=(config.num_labels,), bias_axes=(ax.CLASSES,), init_std=config.init_std,
      dtype=dtype, param_dtype=param_dtype, rngs=rngs, backend=backend)
                if config.num_labels else None)
  return lm_head, classifier


def with_matmul_precision(method):
  """A model method whose dots, forward and backward, take the precision of the model's
  ``config.matmul_precision`` (``ops.precision.scope``) when it computes in float32 (the setting is
  about float32 products). bfloat16 or float16 compute keeps JAX's own setting, so that nothing
  asks an accelerator for more than the half-precision products that dtype means. Nested calls
  set it again."""
  @functools.wraps(method)
  def wrapped(self, *args, **kwargs):
    c = self.config
    scope = (precision.scope(c.matmul_precision) if jnp.dtype(c.dtype) == jnp.float32
             else contextlib.nullcontext())
    with scope:
      return method(self, *args, **kwargs)
  return wrapped


def is_concrete(x) -> bool:
  return not isinstance(x, jax.core.Tracer)


def check_tokens(name: str, ids, vocab_size: int) -> None:
  """Raises ``ValueError`` naming the first out-of-range id and where it is.

  Concrete arrays are checked here. Under ``jit`` the values are unknown: the embedding lookup
  then clamps an id outside the vocabulary to its nearest end, silently, unless the function was
  wrapped by ``checked``, which checks them on the device. The data loaders check ids when a
  dataset is loaded, so training is covered there.
  """
  if ids is None:
    return
  if not is_concrete(ids):
    if _CHECKING_IDS.get():
      ids = jnp.asarray(ids)
      checkify.check(jnp.all((ids >= 0) & (ids < vocab_size)),
                     f"{name} holds ids outside the vocabulary [0, {vocab_size}): min {{lo}}, "
                     "max {hi}", lo=jnp.min(ids), hi=jnp.max(ids))
    return
  arr = np.asarray(ids)
  if arr.ndim != 2:
    raise ValueError(f"{name} must be [batch, length] integers; got shape {arr.shape}")
  if not np.issubdtype(arr.dtype, np.integer):
    raise ValueError(f"{name} must be integers; got dtype {arr.dtype}")
  bad = (arr < 0) | (arr >= vocab_size)
  if bad.any():
    idx = tuple(int(i) for i in np.argwhere(bad)[0])
    raise ValueError(
        f"{name}[{idx[0]}, {idx[1]}] = {int(arr[idx])} is outside the vocabulary [0, {vocab_size})")


def check_length(name: str, length: int, max_len: int) -> None:
  if length > max_len:
    raise ValueError(f"{name} has length {length}, more than max_len={max_len} positions")


def check_same_shape(name: str, x, ref_name: str, ref) -> None:
  if x is not None and tuple(x.shape) != tuple(ref.shape):
    raise ValueError(f"{name}.shape={tuple(x.shape)} must equal {ref_name}.shape={tuple(ref.shape)}")


def checked(fn):
  """``jax.jit(fn)`` with the models' token-id checks kept inside the compiled function.

  Under a plain ``jax.jit`` the models cannot see their ids' values and the embedding lookup
  clamps an id outside ``[0, vocab_size)``. A function made by ``checked`` checks every model
  input's ids on the device (``jax.experimental.checkify``) and raises ``ValueError`` naming the
  input and the ids' range after the call. Pass the undecorated ``fn`` (a function already
  jitted elsewhere may reuse a trace made without the checks).

  Example: ``logits = tj.models.checked(lambda params, t: apply(config, params, t))(params, ids)``.
  """
  def traced(*args, **kwargs):
    token = _CHECKING_IDS.set(True)
    try:
      return fn(*args, **kwargs)
    finally:
      _CHECKING_IDS.reset(token)

  run = jax.jit(checkify.checkify(traced, errors=checkify.user_checks))

  @functools.wraps(fn)
  def call(*args, **kwargs):
    err, out = run(*args, **kwargs)
    message = err.get()
    if message is not None:
      raise ValueError(message.split(" (`check` failed)")[0])
    return out

  return call
