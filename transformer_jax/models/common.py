"""Input checks and small pieces shared by the model families."""

from __future__ import annotations

import contextlib
import contextvars
import functools
import inspect

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


def output_heads(
  config, *, dtype, param_dtype, rngs: nnx.Rngs, backend=None
) -> tuple[Projection | None, Projection | None]:
  """A family's ``(lm_head, classifier)``: the untied vocabulary projection ``[D, V]`` (None when
  the embedding is tied) and the classification head ``[D, C]`` with a bias (None without
  ``num_labels``); their products are ``backend``'s."""
  lm_head = (
    None
    if config.tie_embeddings
    else Projection(
      "BTD,DV->BTV",
      (config.d_model, config.vocab_size),
      (ax.EMBED, ax.VOCAB),
      init_std=config.init_std,
      dtype=dtype,
      param_dtype=param_dtype,
      rngs=rngs,
      backend=backend,
    )
  )
  classifier = (
    Projection(
      "BD,DC->BC",
      (config.d_model, config.num_labels),
      (ax.EMBED, ax.CLASSES),
      bias_shape=(config.num_labels,),
      bias_axes=(ax.CLASSES,),
      init_std=config.init_std,
      dtype=dtype,
      param_dtype=param_dtype,
      rngs=rngs,
      backend=backend,
    )
    if config.num_labels
    else None
  )
  return lm_head, classifier


def hidden_lm_loss(
  model,
  x_BTD: jax.Array,
  labels: jax.Array,
  weights: jax.Array,
  *,
  label_smoothing: float,
  z_loss: float,
) -> tuple[jax.Array, jax.Array]:
  """The next-token loss of a decoder's final hidden states ``[B, T, D]`` through its output head
  (``model.lm_head``, or the tied ``model.embed``) without the ``[B, T, V]`` logits: the model
  backend's ``linear_cross_entropy``. ``(loss_sum, correct_sum)``, float32 scalars."""
  b, t, d = x_BTD.shape
  if model.lm_head is None:
    w, layout = model.embed.embedding[...], "VD"
  else:
    w, layout = model.lm_head.kernel[...], "DV"
  return model.backend.linear_cross_entropy(
    x_BTD.reshape(b * t, d),
    w,
    labels.reshape(-1),
    weights.reshape(-1).astype(jnp.float32),
    w_layout=layout,
    label_smoothing=label_smoothing,
    z_loss=z_loss,
    dtype=jnp.dtype(model.config.dtype),
  )


def with_matmul_precision(method):
  """A model method whose dots, forward and backward, take the precision of the model's
  ``config.matmul_precision`` (``ops.precision.scope``) when it computes in float32 (the setting is
  about float32 products). bfloat16 or float16 compute keeps JAX's own setting, so that nothing
  asks an accelerator for more than the half-precision products that dtype means. Nested calls
  set it again."""

  @functools.wraps(method)
  def wrapped(self, *args, **kwargs):
    c = self.config
    scope = (
      precision.scope(c.matmul_precision)
      if jnp.dtype(c.dtype) == jnp.float32
      else contextlib.nullcontext()
    )
    with scope:
      return method(self, *args, **kwargs)

  return wrapped


def is_concrete(x) -> bool:
  return not isinstance(x, jax.core.Tracer)


def _device_check(name: str, values, hi: int, message: str) -> None:
  """Under ``checked``: a device check that ``values`` lie in ``[0, hi)``, compared in a dtype
  that holds ``hi`` (int8 ids against a vocabulary of 50257 are compared in int32)."""
  values = jnp.asarray(values)
  if jnp.iinfo(values.dtype).bits < 32:
    values = values.astype(jnp.int32)
  ok = values < hi
  if jnp.issubdtype(values.dtype, jnp.signedinteger):
    ok = ok & (values >= 0)
  checkify.check(
    jnp.all(ok),
    f"{name} holds {message}: min {{lo}}, max {{hi}}",
    lo=jnp.min(values),
    hi=jnp.max(values),
  )


def _first_outside(name: str, values, hi: int, what: str) -> None:
  """Raises naming the first entry of concrete ``values`` outside ``[0, hi)``."""
  arr = np.asarray(values)
  if not np.issubdtype(arr.dtype, np.integer):
    raise ValueError(f"{name} must be integers; got dtype {arr.dtype}")
  bad = (arr < 0) | (arr >= hi)
  if bad.any():
    idx = tuple(int(i) for i in np.argwhere(bad)[0])
    at = f"[{', '.join(map(str, idx))}]" if idx else ""
    raise ValueError(f"{name}{at} = {int(arr[idx])} is outside {what}")


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
      _device_check(name, ids, vocab_size, f"ids outside the vocabulary [0, {vocab_size})")
    return
  arr = np.asarray(ids)
  if arr.ndim != 2:
    raise ValueError(f"{name} must be [batch, length] integers; got shape {arr.shape}")
  _first_outside(name, arr, vocab_size, f"the vocabulary [0, {vocab_size})")


def check_positions(name: str, positions, max_len: int) -> None:
  """Raises ``ValueError`` naming the first position outside a position table of ``max_len``
  rows (learned or sinusoidal), which the lookup would otherwise clamp silently. Traced
  positions are checked on the device under ``checked`` (as ``check_tokens``)."""
  if positions is None:
    return
  if not is_concrete(positions):
    if _CHECKING_IDS.get():
      _device_check(name, positions, max_len, f"positions outside the table [0, max_len={max_len})")
    return
  _first_outside(name, positions, max_len, f"the position table [0, max_len={max_len})")


def check_length(name: str, length: int, max_len: int) -> None:
  if length > max_len:
    raise ValueError(f"{name} has length {length}, more than max_len={max_len} positions")


def check_same_shape(name: str, x, ref_name: str, ref) -> None:
  if x is not None and tuple(x.shape) != tuple(ref.shape):
    raise ValueError(
      f"{name}.shape={tuple(x.shape)} must equal {ref_name}.shape={tuple(ref.shape)}"
    )


def _refuse_wrapping_ints(fn, args, kwargs) -> None:
  """Raises for a concrete 64-bit integer argument holding a value outside int32: without
  ``jax_enable_x64`` JAX converts it to int32 at the call, wrapping 2**32 + 3 to 3 (a valid id
  or position) before any check could see it. Named by ``fn``'s parameter, where it binds."""
  if jax.config.jax_enable_x64:
    return
  try:
    named = inspect.signature(fn).bind(*args, **kwargs).arguments
  except (TypeError, ValueError):
    named = {**{f"argument {i}": a for i, a in enumerate(args)}, **kwargs}
  lo, hi = np.iinfo(np.int32).min, np.iinfo(np.int32).max
  for name, value in named.items():
    for path, leaf in jax.tree_util.tree_leaves_with_path(value):
      if not isinstance(leaf, (np.ndarray, np.generic)):
        continue
      arr = np.asarray(leaf)
      if arr.dtype.kind not in "iu" or arr.dtype.itemsize < 8 or arr.size == 0:
        continue
      bad = (arr < lo) | (arr > hi)
      if bad.any():
        idx = tuple(int(i) for i in np.argwhere(bad)[0])
        at = f"[{', '.join(map(str, idx))}]" if idx else ""
        raise ValueError(
          f"{name}{jax.tree_util.keystr(path)}{at} = {int(arr[idx])} does not fit "
          f"in int32 ({arr.dtype} without jax_enable_x64 would wrap it silently); "
          "no vocabulary or position table is that large"
        )


def checked(fn):
  """``jax.jit(fn)`` with the models' token-id and position checks kept inside the compiled
  function.

  Under a plain ``jax.jit`` the models cannot see their ids' values: the embedding lookup clamps
  an id outside ``[0, vocab_size)``, and a learned or sinusoidal position table a position
  outside ``[0, max_len)``. A function made by ``checked`` checks every model input's ids and
  explicit positions on the device (``jax.experimental.checkify``) and raises ``ValueError``
  naming the input and the values' range after the call. Before the call it refuses 64-bit
  integer arguments that int32 cannot hold (JAX would wrap them; see ``_refuse_wrapping_ints``).
  Pass the undecorated ``fn`` (a function already jitted elsewhere may reuse a trace made
  without the checks).

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
    _refuse_wrapping_ints(fn, args, kwargs)
    err, out = run(*args, **kwargs)
    message = err.get()
    if message is not None:
      raise ValueError(message.split(" (`check` failed)")[0])
    return out

  return call
