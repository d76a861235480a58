"""Process-level settings for speed: the persistent compilation cache, the memory allocator, idle
CPUs that poll instead of sleeping while decoding, the compile options of the train and eval steps
(oneDNN products on CPU), and notices when bfloat16 would be slower than float32 on this CPU or
when a step's temporaries are too large for the allocator to reuse.

``tjax`` applies them (the trainer gives the notices); a library user calls
``enable_compilation_cache()`` once (the trainer does it too), may start Python through
``python -m transformer_jax.launch`` to get the allocator, and may wrap decoding in
``with cpu_poll():``.
"""

from __future__ import annotations

import atexit
import collections
import contextlib
import dataclasses
import functools
import os
import struct
import sys
import time
import warnings

CACHE_ENV = "TJAX_COMPILATION_CACHE"   # a folder, or "0" to turn the cache off
MALLOC_ENV = "TJAX_MALLOC"             # "0"/"system": keep the C library's malloc
POLL_ENV = "TJAX_CPU_POLL"             # "0": let idle CPUs sleep while ``tjax`` decodes
ONEDNN_ENV = "TJAX_ONEDNN"             # "0": leave the steps' products where XLA:CPU puts them
CPU_DMA_LATENCY = "/dev/cpu_dma_latency"


def default_cache_dir() -> str:
  """``$TJAX_COMPILATION_CACHE``, else ``$XDG_CACHE_HOME/transformer_jax/xla`` (``~/.cache/...``)."""
  env = os.environ.get(CACHE_ENV)
  if env and env != "0":
    return os.path.abspath(os.path.expanduser(env))
  base = os.environ.get("XDG_CACHE_HOME") or os.path.join(os.path.expanduser("~"), ".cache")
  return os.path.join(base, "transformer_jax", "xla")


def enable_compilation_cache(path: str | None = None) -> str | None:
  """Turns on JAX's persistent compilation cache in ``path`` (default ``default_cache_dir()``), so a
  second run of the same program loads its compiled steps instead of compiling them again.

  Returns the folder, or None when ``$TJAX_COMPILATION_CACHE=0``, the user already chose a folder
  (``jax_compilation_cache_dir``), or the folder cannot be created (then nothing changes: a cache
  is an optimisation, never a reason to fail).
  """
  import jax

  if os.environ.get(CACHE_ENV) == "0":
    return None
  if jax.config.jax_compilation_cache_dir:
    return jax.config.jax_compilation_cache_dir
  path = path or default_cache_dir()
  try:
    os.makedirs(path, exist_ok=True)
  except OSError:
    return None
  jax.config.update("jax_compilation_cache_dir", path)
  # Cache every step that took over a second to compile (JAX's default skips nothing larger).
  jax.config.update("jax_persistent_cache_min_compile_time_secs", 1.0)
  return path


# XLA:CPU compile options that give each matrix product of a program, one at a time, to oneDNN.
ONEDNN_DOTS = {"xla_cpu_use_onednn": True,
               "xla_cpu_experimental_onednn_fusion_type": "LIBRARY_FUSION_TYPE_INDIVIDUAL_DOT"}


def step_compiler_options(platform: str) -> dict:
  """Compile options for the train and eval steps on ``platform`` (a device's ``.platform``): on
  CPU, ``ONEDNN_DOTS``; elsewhere, or with ``$TJAX_ONEDNN=0``, or with a jaxlib that lacks them,
  none. Pass them as ``jax.jit(..., compiler_options=...)``; they are part of the persistent
  cache's key. Pass what you compile with them to ``hold`` (the train and eval steps are held).

  Why: XLA:CPU gives most float32 products to YNNPACK, which runs the large ones near the CPU's best
  rate but the attention's batched ``[B*N] x [T, H] x [H, S]`` products at a third of it, and leaves
  the ones with a transposed operand to Eigen. Measured on a 2-core Zen 4 EPYC
  (experiments/PERFORMANCE.md, "oneDNN"): ``q k^T`` 79 -> 178 GFLOP/s, ``p v`` 82 -> 202, the
  backward's ``p^T dO`` and ``dS^T q`` 56-87 -> 136; the large projections are level; the GPT-2
  small float32 train step 0.92x the time (paired, faster in 7 of 8), bfloat16 0.97x. XLA takes
  only products whose operands and result share a dtype (float32; bfloat16 only with AVX-512
  BF16), so a bfloat16 model's float32-accumulating products stay where they were.

  One product per oneDNN call ("individual"): XLA's other oneDNN mode merges neighbouring products
  and their sum into one oneDNN graph, which this jaxlib's oneDNN failed to compile for the
  attention backward, killing the process. Decoding does not use these options: a matrix-vector
  product is XLA's own kernel, three times faster than oneDNN's at GPT-2 small's sizes.

  The cost: this jaxlib cannot serialize a program with oneDNN products ("ToProto is not
  implemented for thunk kind: onednn-fusion"), so the persistent compilation cache cannot keep a
  float32 step, and every run compiles it again (GPT-2 small: 1.6-2.2 s). JAX's warning about the
  failed cache write is silenced here, for that case only. ``$TJAX_ONEDNN=0`` gives the cached
  steps back, at the products' speed. A bfloat16 step on a CPU with bf16 units has no oneDNN
  product left (``ops.attention``'s row-major core keeps attention's products in YNNPACK too), so
  it is cached with these options on; XLA still upcasts a tiny model's vocabulary products when a
  step has 64 tokens or fewer, and oneDNN takes those.
  """
  if platform == "gpu":
    return dict(GPU_STEP_OPTIONS)
  if platform != "cpu" or os.environ.get(ONEDNN_ENV, "").lower() in ("0", "off", "false", "no"):
    return {}
  if not _onednn_compiles():
    return {}
  warnings.filterwarnings("ignore", category=UserWarning, message=UNCACHEABLE_WARNING)
  return dict(ONEDNN_DOTS)


# XLA:GPU compile options of the train and eval steps (``step_compiler_options("gpu")``) and of the
# decoding loop (``decode_compiler_options``): experiments/PERFORMANCE.md, "XLA:GPU options".
GPU_STEP_OPTIONS: dict = {"xla_gpu_enable_triton_gemm": False}
GPU_DECODE_OPTIONS: dict = {}


def decode_compiler_options(platform: str) -> dict:
  """Compile options for ``generate``'s decoding loop on ``platform``: ``GPU_DECODE_OPTIONS`` on
  GPUs, none elsewhere."""
  return dict(GPU_DECODE_OPTIONS) if platform == "gpu" else {}


# JAX's warning when the persistent cache cannot write a program with oneDNN products.
UNCACHEABLE_WARNING = (r"Error writing persistent compilation cache entry .*"
                       r"ToProto is not implemented for thunk kind: onednn-fusion")


@functools.cache
def _onednn_compiles() -> bool:
  """Whether this jaxlib's CPU compiler takes ``ONEDNN_DOTS`` (an older or newer one may not know
  them: then the steps compile without, instead of failing)."""
  import jax
  import jax.numpy as jnp

  x = jax.ShapeDtypeStruct((2, 16, 16), jnp.float32, sharding=jax.sharding.SingleDeviceSharding(
      jax.local_devices(backend="cpu")[0]))
  try:
    jax.jit(jnp.matmul).lower(x, x).compile(compiler_options=ONEDNN_DOTS)
  except Exception:   # noqa: BLE001 - XlaRuntimeError (unknown option) or anything else: not used
    return False
  return True


# Executables built with ONEDNN_DOTS, kept alive: see ``hold``.
_HELD: collections.deque = collections.deque(maxlen=16)


def hold(compiled, options: dict | None):
  """Returns ``compiled`` (a ``jax.jit`` function or a ``Compiled``), kept alive until 16 more
  have been held when ``options``, the compile options it was built with, are not empty (from
  ``step_compiler_options``: the oneDNN ones). Without options nothing is held.

  Why: this jaxlib's oneDNN thunk (XLA's ``OneDnnFusionThunk``) hands its borrowed oneDNN runtime
  back to the executable's pool in a callback that may run after the program's results are
  ready. An executable destroyed in that window (a jitted function dropped, or replaced, just
  after its last call) aborts the whole process: ``Check failed: available_.size() == num_created_
  (0 vs. 1)`` in ``ObjectPool``'s destructor. Seen in a test worker that evaluated a run twice,
  and here in 2 of 3 processes that ran ``evaluate_run`` 60 times each (2-core Zen 4); none of 8
  such processes aborted once the steps were held.

  Every step and benchmark that compiles with these options is held here. Sixteen: the bench's
  matmul limit compiles a dozen products in a burst, and each held executable keeps its code and
  oneDNN's compiled products in memory (a sweep in one notebook keeps at most 16 steps). At exit,
  before Python destroys what is held, the process waits 20 ms, so that a call just made
  (``tjax eval`` exits right after its last one) has handed its runtimes back.
  """
  if not (options or {}).get("xla_cpu_use_onednn"):
    return compiled
  if not _HELD:
    atexit.register(time.sleep, 0.02)   # runs before JAX's own exit hooks (registered earlier)
  _HELD.append(compiled)
  return compiled


_warned_bf16 = False


def bf16_notice(dtype: str) -> str | None:
  """When ``dtype`` is bfloat16 and the computation runs on a CPU without bfloat16 matrix units
  (AVX-512 BF16 or AMX), warns once that it will be slower than float32, and why. Returns the text
  (None when there is nothing to say)."""
  global _warned_bf16
  import jax

  from transformer_jax import hardware

  if str(dtype) != "bfloat16" or jax.default_backend() != "cpu" or hardware.has_bf16_units():
    return None
  text = (f"dtype=bfloat16 on {hardware.cpu_name() or 'this CPU'}, which has no bfloat16 matrix "
          "instructions (avx512_bf16/amx_bf16): XLA converts every bfloat16 dot to float32 and "
          "back, so this runs slower than dtype=float32 (about 0.6x the matmul rate here); use "
          "float32 on this machine, bfloat16 on CPUs with AVX-512 BF16 or AMX, or on "
          "accelerators.")
  if not _warned_bf16:
    _warned_bf16 = True
    warnings.warn(text, stacklevel=2)
  return text


def mimalloc_path() -> str | None:
  """The ``libmimalloc.so`` shipped by the ``cmeel-mimalloc`` wheel, if installed."""
  for entry in sys.path:
    lib = os.path.join(entry, "cmeel.prefix", "lib", "libmimalloc.so")
    if os.path.exists(lib):
      return lib
  return None


def allocator_env(environ: dict[str, str] | None = None) -> dict[str, str] | None:
  """The environment that runs this program again over mimalloc, or None when it already does,
  the user said ``TJAX_MALLOC=0`` (or ``system``), or mimalloc is not installed.

  Why: XLA's CPU runtime allocates every step's temporaries (activations, gradients, logits: GBs
  for GPT-2 small) afresh; glibc returns such large blocks to the kernel at once, so every step
  pays for re-mapping and zeroing the same pages (~850k page faults per GPT-2-small step). mimalloc
  told to keep freed memory (``MIMALLOC_PURGE_DELAY=-1``) reuses it: 18% faster steps measured on a
  2-core AMD EPYC. A process cannot change its allocator once started, hence the re-execution.

  mimalloc 3.4 keeps freed blocks up to about 2 GiB (measured: 2000 MiB reused, 2047 MiB mapped
  afresh each time). XLA:CPU takes a step's temporaries as one block, so a step whose
  temporaries pass that size still pays for fresh pages: ``compiled.memory_analysis()
  .temp_size_in_bytes`` tells. The activations' derivative rules (``ops.activations``) keep
  GPT-2 small's 4 x 256 step under it.
  """
  env = dict(os.environ if environ is None else environ)
  if env.get(MALLOC_ENV, "").lower() in ("0", "system", "glibc"):
    return None
  if "malloc" in env.get("LD_PRELOAD", "") or sys.platform != "linux":
    return None
  lib = mimalloc_path()
  if lib is None:
    return None
  env["LD_PRELOAD"] = f"{lib} {env['LD_PRELOAD']}".strip() if env.get("LD_PRELOAD") else lib
  env.setdefault("MIMALLOC_PURGE_DELAY", "-1")
  env[MALLOC_ENV] = "mimalloc"
  return env


# mimalloc reuses freed blocks up to about this size (mimalloc 3.4, measured: 2000 MiB reused,
# 2047 MiB mapped afresh at every call).
MIMALLOC_REUSE_LIMIT = 2000 << 20


def allocator() -> str:
  """The malloc preloaded into this process (``LD_PRELOAD``), or ``"glibc"``."""
  pre = os.environ.get("LD_PRELOAD", "")
  for name in ("jemalloc", "tcmalloc", "mimalloc"):
    if name in pre:
      return name
  return "glibc"


def scratch_notice(temp_bytes: int | None, *, platform: str, malloc: str) -> str | None:
  """A one-line notice when one compiled step's temporaries (``memory_analysis()
  .temp_size_in_bytes``) are larger than what mimalloc keeps for reuse on CPU, else None.

  XLA:CPU takes a step's temporaries as one block per call. Above ``MIMALLOC_REUSE_LIMIT`` every
  step maps and zeroes that block afresh: measured on a bfloat16 GPT-2 small step whose
  temporaries went from 1883 to 2085 MiB, 3.4 s of kernel time per step, 1.76 s -> 3.5 s.
  """
  if temp_bytes is None or platform != "cpu" or malloc != "mimalloc":
    return None
  if temp_bytes <= MIMALLOC_REUSE_LIMIT:
    return None
  return (f"notice: one training step needs {temp_bytes / 2**30:.2f} GiB of temporaries, more "
          f"than the {MIMALLOC_REUSE_LIMIT / 2**30:.2f} GiB that mimalloc reuses between steps on "
          "CPU, so every step maps fresh memory (it can double the step's time); "
          "train.microbatches or a smaller train.batch_size brings it under")


@dataclasses.dataclass
class PollRequest:
  """What ``cpu_poll`` got: ``held`` is True while this process asks the kernel to keep idle CPUs
  polling; ``reason`` says why not when it is False."""
  held: bool
  reason: str = ""


@contextlib.contextmanager
def cpu_poll():
  """While the block runs on CPU, asks Linux to keep idle CPUs polling instead of halting (a PM QoS
  request of 0 µs through ``/dev/cpu_dma_latency``, released when the block ends). Yields a
  ``PollRequest``; never fails: without the right (the file is root's), on another OS, off CPU or
  with ``$TJAX_CPU_POLL=0`` nothing changes and ``reason`` says why.

  Why: XLA:CPU cuts a decoding step's products into blocks for its thread pool. Between two
  products the pool's other thread spins briefly and then sleeps, and the next product waits for it
  to wake. On a virtual machine whose idle CPUs halt at once (``haltpoll.guest_halt_poll_ns=0``),
  that wake-up goes through the hypervisor: measured on a 2-core Zen 5 EPYC, each pool thread
  slept ~15 times per GPT-2-small token, and batch-1 decoding ran at 0.91 of the weight-streaming
  floor; holding this request, 0.95-0.98 (7.6% faster in the fast memory state, 4.7% in the
  slow; batch 8 5.5%). PyTorch's OpenMP threads and llama.cpp's ``--poll`` busy-wait for the same
  reason.

  The request covers every CPU of the machine while it is held (idle CPUs burn power instead of
  sleeping), so hold it around decoding, not around a whole program: ``tjax generate`` and
  ``tjax bench generate`` do.
  """
  setting = os.environ.get(POLL_ENV, "")
  if setting.lower() in ("0", "off", "false", "no"):
    yield PollRequest(False, f"{POLL_ENV}={setting}")
    return
  if sys.platform != "linux":
    yield PollRequest(False, f"a Linux request ({CPU_DMA_LATENCY}); this is {sys.platform}")
    return
  import jax

  if jax.default_backend() != "cpu":
    yield PollRequest(False, f"not on CPU (backend {jax.default_backend()})")
    return
  try:
    fd = os.open(CPU_DMA_LATENCY, os.O_WRONLY)
  except OSError as e:
    why = ("only root may write it" if isinstance(e, PermissionError)
           else e.strerror or type(e).__name__)
    yield PollRequest(False, f"cannot open {CPU_DMA_LATENCY}: {why}")
    return
  try:
    os.write(fd, struct.pack("i", 0))
  except OSError as e:
    os.close(fd)
    yield PollRequest(False, f"cannot write {CPU_DMA_LATENCY}: {e.strerror or type(e).__name__}")
    return
  try:
    yield PollRequest(True)
  finally:
    os.close(fd)
