"""Test-session options and datasets shared by every test directory.

``TJAX_ATTENTION_IMPL=chunked python -m pytest tests/...`` runs the tests with that attention
kernel:
every model config built in this test process (presets, ``get_config``, configs read from Hugging
Face or a run directory) that leaves ``attention_impl`` at its default None gets it, and tests that
build layers directly pass ``FORCED_IMPL``. This is a test-session patch of the config classes,
applied here; the library itself has no such switch (the kernel is always the config's
``attention_impl``). Commands run in subprocesses are not affected.
"""

import gc
import os
import random
import shutil
import tempfile

from tests.xla_flags import harness_flags

# The XLA:CPU flags that make the suite's compilations cheaper (``harness_flags`` says each one's
# reason), set before JAX starts its backend; commands run in subprocesses inherit them.
os.environ["XLA_FLAGS"] = " ".join(
  [os.environ.get("XLA_FLAGS", ""), *harness_flags(os.environ.get("XLA_FLAGS", ""))]
).strip()

# One persistent compilation cache for the test session, in a temporary folder the session removes
# at its end, shared by the xdist workers and the commands they start: a program compiled again (a
# resumed run's steps, a tiny model another test built, a CLI run in a subprocess) is loaded
# instead. Programs that compile in under 0.1 s (JAX's op-by-op dispatches) are not written. The
# library's own cache folder (``runtime.enable_compilation_cache``) stays off below.
if "JAX_COMPILATION_CACHE_DIR" not in os.environ:
  os.environ["JAX_COMPILATION_CACHE_DIR"] = tempfile.mkdtemp(prefix="tjax-tests-xla-")
  os.environ["TJAX_TESTS_CACHE_OWNER"] = str(os.getpid())
  os.environ.setdefault("JAX_PERSISTENT_CACHE_MIN_COMPILE_TIME_SECS", "0.1")

# On a GPU, XLA may pick kernels that differ in the last bits between runs and processes (atomic
# scatter-adds, autotuned gemms): tests that expect a resumed run to equal an uninterrupted one to
# the last bit ask for deterministic ones. No effect on CPU.
if "xla_gpu_deterministic_ops" not in os.environ["XLA_FLAGS"]:
  os.environ["XLA_FLAGS"] += " --xla_gpu_deterministic_ops=true"

import jax
import pytest

from transformer_jax.backends.cpu import onednn
from transformer_jax.models import config as config_lib

# Tests compare float32 results with float64 NumPy and with PyTorch. Left to JAX, NVIDIA GPUs
# compute float32 dots in TensorFloat-32 and TPUs in one bfloat16 pass, so ops and layers called
# directly run at float32 precision here. Models set it from config.matmul_precision themselves
# (tests/models/test_families.py checks every dot of their gradients under JAX's own default).
jax.config.update("jax_default_matmul_precision", "float32")

FORCED_IMPL = os.environ.get("TJAX_ATTENTION_IMPL") or None

# What the environment of a process that checks a compilation cache of its own leaves out.
SESSION_CACHE_ENV = (
  "JAX_COMPILATION_CACHE_DIR",
  "JAX_PERSISTENT_CACHE_MIN_COMPILE_TIME_SECS",
  "TJAX_TESTS_CACHE_OWNER",
)

# Tests compile afresh and leave no files in the user's cache folder (tests/test_runtime.py checks
# the persistent compilation cache itself, tests/test_hardware.py the matmul limits, in temporary
# folders).
os.environ.setdefault("TJAX_COMPILATION_CACHE", "0")
os.environ.setdefault("TJAX_MATMUL_LIMIT_CACHE", "0")  # matmul limits: tests/test_hardware.py

# On CPU the train and eval steps hand their products to oneDNN (``backends.cpu.onednn``): a run
# of the step is faster, its compilation slower, and the suite compiles far more steps than it
# runs. The tests' steps leave their products to XLA; the ``onednn_steps`` fixture turns oneDNN
# back on for the tests of oneDNN and of the CPU's defaults (tests/backends/cpu/test_onednn.py,
# tests/backends/test_compile_options.py, tests/test_harness.py, tests/test_runtime.py) and for one
# end-to-end run (tests/train/test_trainer.py, marked long: ``make test-long`` runs it).
# ``TJAX_ONEDNN=1 make test`` runs the whole suite's steps with oneDNN.
os.environ.setdefault("TJAX_ONEDNN", "0")


def pytest_report_header(config):
  return f"attention implementation: {FORCED_IMPL or 'the configs own (default None = auto)'}"


def pytest_collection_finish(session):
  """Moves what collection built (modules, torch, transformers, the test items: a few hundred
  thousand objects that live as long as the process) out of the garbage collector's sight, so
  that its full collections in each worker walk only what the tests make; and collects less
  often (every 20,000 net allocations instead of 700: tracing allocates in bursts). The A/B:
  experiments/results/suite_settings_ab_xeon.json, ``ab_5cfdcd7_release_and_collection``."""
  gc.collect()
  gc.freeze()
  gc.set_threshold(20_000, 20, 20)


def pytest_configure(config):
  """Patches the config classes before collection, so configs built at import time are covered."""
  if FORCED_IMPL is None:
    return
  if FORCED_IMPL not in config_lib._ATTENTION_IMPLS:
    raise pytest.UsageError(
      f"TJAX_ATTENTION_IMPL={FORCED_IMPL!r} must be one of "
      f"{', '.join(map(repr, config_lib._ATTENTION_IMPLS[1:]))}"
    )
  patch = pytest.MonkeyPatch()
  for cls in (config_lib.GPTConfig, config_lib.BERTConfig, config_lib.Seq2SeqConfig):
    patch.setattr(cls, "__post_init__", _forcing(cls.__post_init__))
  config.add_cleanup(patch.undo)


def _forcing(post_init):
  def wrapped(self):
    if self.attention_impl is None:
      object.__setattr__(self, "attention_impl", FORCED_IMPL)  # frozen dataclass
    post_init(self)

  return wrapped


@pytest.fixture(scope="session")
def text_dataset(tmp_path_factory):
  """A small prepared GPT/BERT dataset: 40 documents of pseudo-English lines."""
  from transformer_jax import data

  root = tmp_path_factory.mktemp("corpus")
  rng = random.Random(0)
  words = [
    "alpha",
    "beta",
    "gamma",
    "delta",
    "value",
    "return",
    "self",
    "def",
    "class",
    "for",
    "in",
    "range",
    "print",
    "if",
    "else",
    "x",
    "y",
    "z",
    "the",
    "of",
  ]
  for d in range(40):
    lines = [" ".join(rng.choice(words) for _ in range(rng.randint(3, 12))) for _ in range(30)]
    (root / f"doc{d:02d}.txt").write_text("\n".join(lines) + "\n")
  out = str(tmp_path_factory.mktemp("ds") / "text")
  data.prepare([str(root)], out, compact_vocab=True, progress=False, val_fraction=4)
  return out


@pytest.fixture(scope="session")
def reverse_dataset(tmp_path_factory):
  """The synthetic string-reversal Seq2Seq dataset, prepared."""
  from transformer_jax import data

  out = str(tmp_path_factory.mktemp("ds") / "reverse")
  data.prepare(["synthetic:reverse"], out, task="seq2seq", progress=False)
  return out


@pytest.fixture
def onednn_steps(monkeypatch):
  """The CPU backend's default: train and eval steps with oneDNN products, in this test and the
  processes it starts (the suite's steps otherwise leave them to XLA)."""
  monkeypatch.delenv("TJAX_ONEDNN", raising=False)


def release_boundary(item, nextitem) -> bool:
  """Whether the compiled programs are released after ``item``: the last test of its module in
  this process (``nextitem`` is in another file, or there is none).

  A module's tests share their compiled functions; the modules of a folder share some too
  (tests/models/conftest.py ``jit_forward``, tests/conformance/harness.py), but keeping those to
  the end of the folder cost more than compiling them again: tracing, lowering and compiling all
  slow down as JAX's caches grow, and the workers' memory with them (the A/B:
  experiments/results/suite_settings_ab_xeon.json, ``ab_5cfdcd7_release_and_collection``).
  """
  return nextitem is None or nextitem.path != item.path


def release_compiled_programs() -> None:
  """Drops JAX's in-memory caches of traced and compiled programs (``jax.clear_caches``).

  Why: an xdist worker runs half the suite in one process, and JAX keeps every program it compiled
  (its compilation cache holds up to 2048 executables, the jit fast path 8192 call signatures, the
  op-by-op cache one per primitive and shape): a module of small tests leaves hundreds of MB
  behind (tests/ops/test_chunked_attention.py alone about 200 MB), and over the whole suite both
  workers grow by GiBs. First ``onednn.settle()``: a program with oneDNN products destroyed
  just after a call aborts the process (``backends.cpu.onednn.hold``), and clearing destroys the
  executables behind held ``jax.jit`` steps too (a held ``Compiled`` keeps its own).
  """
  onednn.settle()
  jax.clear_caches()


@pytest.hookimpl(trylast=True)
def pytest_runtest_teardown(item, nextitem):
  """After the module fixtures of ``item`` are torn down: at a module's end, the programs go."""
  if release_boundary(item, nextitem):
    release_compiled_programs()


def pytest_unconfigure(config):
  """The process that made the session's compilation cache removes it."""
  if os.environ.get("TJAX_TESTS_CACHE_OWNER") == str(os.getpid()):
    shutil.rmtree(os.environ["JAX_COMPILATION_CACHE_DIR"], ignore_errors=True)


def own_cache_env() -> dict:
  """This process's environment for a process that checks a compilation cache of its own: without
  the session's cache, and with the library's own (``TJAX_COMPILATION_CACHE``) left to it."""
  env = {k: v for k, v in os.environ.items() if k not in SESSION_CACHE_ENV}
  return {**env, "TJAX_COMPILATION_CACHE": ""}


def pytest_terminal_summary(terminalreporter):
  """Names the machine at the very end: CI shows only the tail of the output, and a failure that
  only one machine sees (a crash in a compute library) is the CPU's as often as the code's."""
  from transformer_jax.bench import machine

  terminalreporter.write_line(
    f"machine: {machine.cpu_name()} ({machine.cpu_family()}), {os.cpu_count()} CPUs, "
    f"flags: {' '.join(machine.cpu_flags())}; jax {jax.__version__}"
  )
