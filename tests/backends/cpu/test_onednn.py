"""oneDNN for the steps' products on XLA:CPU (``backends.cpu.onednn``): the CPU backend's step
options, the persistent cache that cannot keep them, and the executables held alive."""

import collections
import gc
import os
import subprocess
import sys
import textwrap
import time
import warnings
import weakref

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from transformer_jax import backends, ops
from transformer_jax.backends import compile as compile_lib
from transformer_jax.backends.cpu import onednn
from tests import conftest
from tests.backends import only_on
from tests.ops.test_attention import attention_ref

CPU = backends.for_platform("cpu")

# The suite's steps leave their products to XLA (tests/conftest.py): here they take oneDNN.
pytestmark = pytest.mark.usefixtures("onednn_steps")


@pytest.mark.slow
@only_on("cpu", "XLA:CPU's oneDNN products")
def test_steps_with_onednn_products_are_compiled_each_run_without_a_warning(tmp_path):
  """This jaxlib cannot serialize oneDNN products, so the cache cannot keep such a step: every
  run compiles it again (a jaxlib that can would fail this test, and the docs in
  ``backends.cpu.onednn`` and experiments/PERFORMANCE.md would want updating). JAX's warning about
  the failed write is silenced where such a step compiles (a held step's calls with new shapes, a
  compile in ``quiet_uncacheable``), and only there: asking for the options leaves the process's
  warning filters as they were, and the same program compiled outside those scopes still warns.
  Other programs are still cached."""
  script = textwrap.dedent("""
      import jax, jax.numpy as jnp, sys, warnings
      from transformer_jax import backends, runtime
      from transformer_jax.backends.cpu import onednn
      runtime.enable_compilation_cache(sys.argv[1])
      jax.config.update("jax_persistent_cache_min_compile_time_secs", 0.0)
      filters = list(warnings.filters)
      options = backends.for_platform("cpu").step_compiler_options()

      def onednn_product(x):
        return x @ x

      def compiled_ahead(x):
        return x @ x + 1

      def unheld(x):
        return x @ x - 1

      def plain(x):
        return jnp.tanh(x).sum()

      x = jnp.ones((8, 32, 32))
      with warnings.catch_warnings(record=True) as caught:   # JAX's UserWarning shows by default
        warnings.simplefilter("always")
        held = onednn.hold(jax.jit(onednn_product, compiler_options=options), options)
        held(x)
        held(jnp.ones((4, 16, 16)))  # another shape compiles again (a Seq2Seq bucket)
        with onednn.quiet_uncacheable():
          jax.jit(compiled_ahead).lower(x).compile(compiler_options=options)(x)
        jax.jit(plain)(x).block_until_ready()
        quiet = len([w for w in caught if "cache" in str(w.message)])
        jax.jit(unheld, compiler_options=options)(x).block_until_ready()
        loud = [str(w.message) for w in caught if "cache" in str(w.message)][quiet:]
      print(bool(options), quiet, len(loud), "jit_unheld" in "".join(loud),
            warnings.filters == filters)
  """)
  env = conftest.own_cache_env()
  for _ in range(2):
    out = subprocess.run(
      [sys.executable, "-c", script, str(tmp_path / "xla")],
      env=env,
      check=True,
      capture_output=True,
      text=True,
    ).stdout.split()
    if out[0] == "False":
      pytest.skip("this jaxlib does not take the oneDNN options")
    assert out == ["True", "0", "1", "True", "True"]
  files = os.listdir(tmp_path / "xla")
  assert any(f.startswith("jit_plain-") for f in files), files
  assert not any(f.startswith(("jit_onednn_product-", "jit_compiled_ahead-")) for f in files), files


def test_asking_for_the_step_options_leaves_the_warning_filters_alone():
  before = list(warnings.filters)
  for platform in ("cpu", "gpu", "tpu"):
    backends.for_platform(platform).step_compiler_options()
  assert warnings.filters == before
  with onednn.quiet_uncacheable():
    assert warnings.filters != before
  assert warnings.filters == before


@pytest.mark.slow
@pytest.mark.skipif(jax.default_backend() != "cpu", reason="XLA:CPU's oneDNN products")
def test_bfloat16_step_on_bf16_units_has_no_onednn_product_and_serializes(monkeypatch):
  """With bf16 units, every product of a bfloat16 train step (projections, the head, attention's
  row-major core) is a bfloat16 product for YNNPACK, which oneDNN does not take: the step
  serializes, which is what the persistent cache writes, with the oneDNN options on. (With 64
  tokens or fewer per step, XLA upcasts this tiny model's vocabulary products and oneDNN takes
  them: 128 tokens here.)"""
  from jax.experimental import serialize_executable

  from transformer_jax import hardware, models
  from transformer_jax.bench import train as bench_train
  from transformer_jax.backends.cpu import matmul as cpu_matmul

  if not CPU.step_compiler_options():
    pytest.skip("this jaxlib does not take the oneDNN options")
  monkeypatch.setattr(
    cpu_matmul, "bf16_products_native", lambda dtype: jnp.dtype(dtype) == jnp.bfloat16
  )
  monkeypatch.setattr(hardware, "has_bf16_units", lambda: True)  # the CPU backend's bf16 units
  config = models.get_config("gpt2-tiny", dtype="bfloat16")
  batch, task = bench_train.random_batch(config, 2, 64, 0)
  step = bench_train.Ours(config, batch, task, 1e-4, 0).step_fn
  assert "__onednn_fusion" not in step.as_text()
  payload, _, _ = serialize_executable.serialize(step)
  assert len(payload) > 0


def test_steps_give_their_products_to_onednn_on_cpu_only(monkeypatch):
  options = {p: backends.for_platform(p).step_compiler_options() for p in ("cpu", "gpu", "tpu")}
  assert options == {
    "cpu": onednn.ONEDNN_DOTS,
    "gpu": dict(compile_lib.GPU_STEP_OPTIONS),
    "tpu": {},
  }
  assert onednn.step_options("gpu") == onednn.step_options("tpu") == {}
  # A copy: a caller's change does not reach the next caller.
  CPU.step_compiler_options()["xla_cpu_use_onednn"] = False
  assert CPU.step_compiler_options() == onednn.ONEDNN_DOTS
  # The table's options go over the backend's own.
  table = backends.KernelTable(step_options={"xla_cpu_use_onednn": False, "xla_cpu_x": 1})
  assert backends.for_platform("cpu", table).step_compiler_options() == {
    **onednn.ONEDNN_DOTS,
    "xla_cpu_use_onednn": False,
    "xla_cpu_x": 1,
  }
  monkeypatch.setenv("TJAX_ONEDNN", "0")
  assert CPU.step_compiler_options() == {}


@only_on("cpu", "XLA:CPU's oneDNN products")
def test_onednn_attention_and_its_gradients_match_float64_numpy():
  """The attention core compiled with the steps' options, against the float64 NumPy reference:
  the value, and the gradients by central differences. Its backward sums two products into one
  gradient, the pattern XLA's merged oneDNN mode could not compile (the process died)."""
  rng = np.random.default_rng(0)
  q, k, v = (rng.standard_normal((2, 16, 4, 8)).astype(np.float32) for _ in range(3))
  w = rng.standard_normal((2, 16, 4, 8))

  def loss(q, k, v):
    out = ops.dot_product_attention(q, k, v, causal=True, implementation="xla")
    return jnp.sum(out * jnp.asarray(w, jnp.float32))

  compiled = (
    jax.jit(jax.value_and_grad(loss, argnums=(0, 1, 2)))
    .lower(q, k, v)
    .compile(compiler_options=CPU.step_compiler_options())
  )
  CPU.hold(compiled, CPU.step_compiler_options())
  assert "__onednn_fusion" in compiled.as_text()  # the products did go to oneDNN
  value, grads = compiled(q, k, v)

  def ref(q, k, v):
    return float(np.sum(attention_ref(q, k, v, causal=True)[0] * w))

  args = [np.asarray(a, np.float64) for a in (q, k, v)]
  np.testing.assert_allclose(float(value), ref(*args), rtol=1e-5)
  eps = 1e-6
  for i, grad in enumerate(grads):
    for flat in rng.choice(args[i].size, 12, replace=False):
      idx = np.unravel_index(flat, args[i].shape)
      up, down = [a.copy() for a in args], [a.copy() for a in args]
      up[i][idx] += eps
      down[i][idx] -= eps
      expected = (ref(*up) - ref(*down)) / (2 * eps)
      np.testing.assert_allclose(float(grad[idx]), expected, rtol=1e-4, atol=1e-5)


@pytest.mark.slow
@only_on("cpu", "XLA:CPU's oneDNN products")
def test_steps_with_onednn_products_outlive_their_callers(monkeypatch):
  """This jaxlib aborts the process when an executable with oneDNN products dies just after a
  call (``backends.cpu.onednn.hold``): a step compiled with the options stays alive after its
  caller drops it, until 16 more have been held; without the options nothing is held."""
  from transformer_jax.parallel.mesh import make_mesh
  from transformer_jax.train import step as step_lib

  def eval_step(params, batch):
    return batch["x"] @ batch["x"].T

  mesh = make_mesh()
  batch = {"x": jnp.ones((4, 8))}
  step = step_lib.jit_eval_step(eval_step, mesh, {})
  np.testing.assert_allclose(step({}, batch), np.full((4, 4), 8.0))
  alive = weakref.ref(step)
  del step
  gc.collect()
  assert alive() is not None
  assert onednn._HELD.maxlen == onednn.HELD_LIMIT == 16
  settled = []
  monkeypatch.setattr(onednn, "settle", lambda: settled.append(alive() is not None))
  for _ in range(onednn.HELD_LIMIT):
    onednn.hold(object(), onednn.ONEDNN_DOTS)
  gc.collect()
  assert alive() is None
  assert settled and settled[0]  # the step had settled before it was let go
  monkeypatch.undo()

  monkeypatch.setenv("TJAX_ONEDNN", "0")
  step = step_lib.jit_eval_step(eval_step, mesh, {})
  step({}, batch)
  alive = weakref.ref(step)
  del step
  gc.collect()
  assert alive() is None


def test_held_steps_get_a_moment_at_exit_before_they_are_destroyed(monkeypatch):
  registered, settled = [], []
  monkeypatch.setattr(onednn, "_HELD", collections.deque(maxlen=2))
  monkeypatch.setattr(onednn.atexit, "register", lambda *args: registered.append(args))
  monkeypatch.setattr(onednn, "settle", lambda: settled.append(list(onednn._HELD)))
  for obj in ("a", "b", "c"):
    assert onednn.hold(obj, onednn.ONEDNN_DOTS) == obj
  assert onednn.hold("d", None) == "d"  # built without the options: not held
  assert list(onednn._HELD) == ["b", "c"]
  assert settled == [["a", "b"]]  # once, before "a" was let go
  assert registered == [(time.sleep, onednn.EXIT_WAIT_S)]  # once


def test_a_held_jit_function_is_the_function_with_quiet_compiles(monkeypatch):
  monkeypatch.setattr(onednn, "_HELD", collections.deque(maxlen=2))
  fn = jax.jit(lambda x: x * 2)
  held = onednn.hold(fn, onednn.ONEDNN_DOTS)
  assert isinstance(held, onednn.QuietCompiles) and held.fn is fn and list(onednn._HELD) == [held]
  assert onednn.hold(held, onednn.ONEDNN_DOTS) is held  # not wrapped twice
  assert held.lower(1.0).compile()(3.0) == 6.0 and held(2.0) == 4.0 and held(5.0) == 10.0
  assert onednn.hold(fn, None) is fn and onednn.hold(fn, compile_lib.GPU_STEP_OPTIONS) is fn
