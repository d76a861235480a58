"""oneDNN for the train and eval steps' matrix products on XLA:CPU, and what that costs.

``step_options(platform)`` gives the compile options (``ONEDNN_DOTS``) that hand each matrix
product of a program, one at a time, to oneDNN; the CPU backend's ``step_compiler_options`` takes
them. Two jaxlib limits come with them:

* a program with oneDNN products cannot be serialized, so the persistent compilation cache cannot
  keep it and JAX warns at each failed write
  (https://github.com/openxla/xla/blob/main/xla/backends/cpu/runtime/thunk_proto_serdes.cc has no
  case for the "onednn-fusion" thunk): ``quiet_uncacheable`` silences that warning, in scope;
* an executable with oneDNN products destroyed just after a call aborts the process (the oneDNN
  fusion thunk returns its runtime to the executable's object pool in a callback that may run
  later,
  https://github.com/openxla/xla/blob/main/xla/backends/cpu/runtime/onednn/onednn_fusion_thunk.cc):
  ``hold`` keeps such executables alive.
"""

from __future__ import annotations

import atexit
import collections
import contextlib
import functools
import os
import time
import warnings

import jax
import jax.numpy as jnp

ONEDNN_ENV = "TJAX_ONEDNN"  # "0"/"off"/"false"/"no": leave the steps' products where XLA puts them
_OFF = ("0", "off", "false", "no")

# XLA:CPU compile options that give each matrix product of a program, one at a time, to oneDNN.
# One product per oneDNN call ("individual"): XLA's merging mode failed to compile the attention
# backward with this jaxlib's oneDNN.
ONEDNN_DOTS = {
  "xla_cpu_use_onednn": True,
  "xla_cpu_experimental_onednn_fusion_type": "LIBRARY_FUSION_TYPE_INDIVIDUAL_DOT",
}

# JAX's warning when the persistent cache cannot write a program with oneDNN products.
UNCACHEABLE_WARNING = (
  r"Error writing persistent compilation cache entry .*"
  r"ToProto is not implemented for thunk kind: onednn-fusion"
)

# How many executables built with ONEDNN_DOTS ``hold`` keeps alive: a benchmark's matmul limit
# compiles a dozen products in a burst.
HELD_LIMIT = 16
# What the process waits at exit, before Python destroys what is held, so that a call just made
# has handed its oneDNN runtimes back.
EXIT_WAIT_S = 0.02
# What ``settle`` waits once every live array is computed: a program's oneDNN runtimes go back to
# its pool in a callback after its outputs are ready. On a loaded 2-core machine, destroying
# the executable 0 s after its outputs were ready aborted, 0.1 s after did not (20 tries).
SETTLE_S = 0.25


def step_options(platform: str) -> dict:
  """The compile options of the train and eval steps' products on ``platform``.

  Why: XLA:CPU's own libraries run attention's batched products, and products with a transposed
  operand, well below the CPU's matmul rate, and oneDNN runs them near it (experiments/
  PERFORMANCE.md, "oneDNN for the steps' products"). Decoding does not take them: for a
  matrix-vector product XLA's own kernel is the faster one.

  Returns:
    A copy of ``ONEDNN_DOTS`` on "cpu"; ``{}`` on any other platform, with ``$TJAX_ONEDNN=0``, or
    with a jaxlib whose CPU compiler does not take them. They are part of the persistent cache's
    key. Compile with them inside ``quiet_uncacheable()`` and pass the result to ``hold``.
  """
  if platform != "cpu" or os.environ.get(ONEDNN_ENV, "").lower() in _OFF:
    return {}
  if not _onednn_compiles():
    return {}
  return dict(ONEDNN_DOTS)


def uses_onednn(options: dict | None) -> bool:
  """Whether compile ``options`` give products to oneDNN (``ONEDNN_DOTS`` or the like)."""
  return bool((options or {}).get("xla_cpu_use_onednn"))


@functools.cache
def _onednn_compiles() -> bool:
  """Whether this jaxlib's CPU compiler takes ``ONEDNN_DOTS`` (an older or newer one may not know
  them: then the steps compile without, instead of failing)."""

  x = jax.ShapeDtypeStruct(
    (2, 16, 16),
    jnp.float32,
    sharding=jax.sharding.SingleDeviceSharding(jax.local_devices(backend="cpu")[0]),
  )
  try:
    with quiet_uncacheable():
      jax.jit(jnp.matmul).lower(x, x).compile(compiler_options=ONEDNN_DOTS)
  except Exception:  # noqa: BLE001 - XlaRuntimeError (unknown option) or anything else: not used
    return False
  return True


@contextlib.contextmanager
def quiet_uncacheable():
  """While the block runs, JAX's warning that the persistent cache cannot write a program with
  oneDNN products (``UNCACHEABLE_WARNING``) is not shown; every other warning is. Wrap the calls
  that compile such programs (a first call of a ``jax.jit`` function, ``Lowered.compile``).

  The filter lasts for the block only (``warnings.catch_warnings``), so asking for the options
  changes nothing in the process.
  """
  with warnings.catch_warnings():
    warnings.filterwarnings("ignore", category=UserWarning, message=UNCACHEABLE_WARNING)
    yield


def _signature(args, kwargs) -> tuple:
  """What decides whether a ``jax.jit`` call compiles: the arguments' tree and each leaf's shape
  and dtype (a Python scalar: its type)."""
  leaves, tree = jax.tree.flatten((args, kwargs))
  return tree, tuple(
    (x.shape, str(x.dtype)) if hasattr(x, "shape") and hasattr(x, "dtype") else type(x)
    for x in leaves
  )


class QuietCompiles:
  """A ``jax.jit`` function compiled with oneDNN products, whose calls with arguments of a shape
  not seen before (the ones that compile it: the first, and each new bucket of a Seq2Seq batch)
  run inside ``quiet_uncacheable()``; every attribute (``lower``, ``trace``, ...) is the
  function's. The filter is not entered on the other calls: each entry resets Python's record of
  the warnings already shown.

  Attributes:
    fn: the jitted function.
  """

  def __init__(self, fn):
    self.fn = fn
    self._seen: set = set()

  def __call__(self, *args, **kwargs):
    signature = _signature(args, kwargs)
    if signature in self._seen:
      return self.fn(*args, **kwargs)
    with quiet_uncacheable():
      out = self.fn(*args, **kwargs)
    self._seen.add(signature)
    return out

  def __getattr__(self, name):
    if name in ("fn", "_seen"):  # not set yet (a copy being built)
      raise AttributeError(name)
    return getattr(self.fn, name)


def settle() -> None:
  """Returns once every program with oneDNN products may be destroyed without aborting: every
  live array is computed (JAX dispatches calls asynchronously), then ``SETTLE_S`` passes. Call it
  before dropping executables in bulk (``jax.clear_caches`` destroys those behind held ``jax.jit``
  steps too; see ``hold``)."""
  import jax  # noqa: PLC0415 - loads before jax

  for array in jax.live_arrays():
    if not array.is_deleted():
      array.block_until_ready()
  time.sleep(SETTLE_S)


# Executables built with ONEDNN_DOTS, kept alive: see ``hold``.
_HELD: collections.deque = collections.deque(maxlen=HELD_LIMIT)


def hold(compiled, options: dict | None):
  """Keeps an executable built with oneDNN products alive until ``HELD_LIMIT`` more are held:
  when the limit is reached, ``settle`` and the older half are let go (one wait per half).

  Why: this jaxlib aborts the process when such an executable is destroyed just after a call
  (``Check failed: available_.size() == num_created_`` in XLA's ``ObjectPool``; see the module's
  docstring). Every step and benchmark that compiles with ``step_options`` passes its result here.
  At exit the process waits ``EXIT_WAIT_S`` before Python destroys what is held.

  Args:
    compiled: a ``jax.jit`` function or a ``Compiled``.
    options: the compile options it was built with (``step_options``).

  Returns:
    ``compiled`` itself when ``options`` do not use oneDNN (nothing is held) or it is already
    compiled; a ``jax.jit`` function comes back as a ``QuietCompiles`` around it, so that the
    calls that compile it do not warn about the cache. What is returned is what is held.
  """
  if not uses_onednn(options):
    return compiled
  if callable(compiled) and hasattr(compiled, "lower") and not isinstance(compiled, QuietCompiles):
    compiled = QuietCompiles(compiled)
  if not _HELD:
    atexit.register(time.sleep, EXIT_WAIT_S)  # runs before JAX's exit hooks (registered earlier)
  if len(_HELD) == _HELD.maxlen:
    settle()  # the oldest may have been called just now; one wait lets the older half go
    for _ in range(max(1, _HELD.maxlen // 2)):
      _HELD.popleft()
  _HELD.append(compiled)
  return compiled
