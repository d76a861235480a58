"""Process settings: the persistent compilation cache, the allocator launcher, the bf16 notice, the
idle-CPU polling request."""

import collections
import gc
import glob
import os
import struct
import subprocess
import sys
import textwrap
import time
import weakref

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from tests.ops.test_attention import attention_ref
from transformer_jax import hardware, ops, runtime
from transformer_jax.bench import machine
from tests.backends import only_on


def test_allocator_env_preloads_mimalloc_once(monkeypatch):
  lib = "/x/cmeel.prefix/lib/libmimalloc.so"
  monkeypatch.setattr(runtime, "mimalloc_path", lambda: lib)
  env = runtime.allocator_env({"PATH": "/bin"})
  assert env["LD_PRELOAD"] == lib and env["MIMALLOC_PURGE_DELAY"] == "-1"
  # Already preloaded (the re-executed process), or turned off: nothing to do.
  assert runtime.allocator_env(env) is None
  assert runtime.allocator_env({"TJAX_MALLOC": "0"}) is None
  assert runtime.allocator_env({"TJAX_MALLOC": "system"}) is None
  # A user's own preload is kept after ours.
  assert runtime.allocator_env({"LD_PRELOAD": "/x/libfoo.so"})["LD_PRELOAD"] == f"{lib} /x/libfoo.so"


def test_second_process_loads_the_compiled_step_from_the_cache(tmp_path):
  """A second process compiling the same function finds it in the folder and does not compile."""
  script = textwrap.dedent("""
      import jax, jax.numpy as jnp, sys
      from transformer_jax import runtime
      print(runtime.enable_compilation_cache(sys.argv[1]))
      jax.config.update("jax_persistent_cache_min_compile_time_secs", 0.0)
      hits = []
      jax.monitoring.register_event_listener(
          lambda name, **kw: hits.append(name) if name.endswith("/cache_hits") else None)
      f = jax.jit(lambda x: jnp.tanh(x @ x.T).sum())
      f(jnp.ones((64, 64))).block_until_ready()
      print(len(hits))
  """)
  env = {**os.environ, "TJAX_COMPILATION_CACHE": ""}
  cache = tmp_path / "xla"
  seen = []
  for _ in range(2):
    out = subprocess.run([sys.executable, "-c", script, str(cache)], env=env, check=True,
                         capture_output=True, text=True).stdout
    folder, hits = out.split()
    assert folder == str(cache)
    seen.append((int(hits), sorted(p for p in os.listdir(cache) if p.endswith("-cache"))))
  (hits0, files0), (hits1, files1) = seen
  assert hits0 == 0 and any(p.startswith("jit__lambda-") for p in files0), files0
  assert hits1 >= 1 and files1 == files0   # loaded from the folder, nothing compiled anew


@only_on("cpu", "XLA:CPU's oneDNN products")
def test_steps_with_onednn_products_are_compiled_each_run_without_a_warning(tmp_path):
  """This jaxlib cannot serialize oneDNN products, so the cache cannot keep such a step: every
  run compiles it again (a jaxlib that can would fail this test, and the docs in
  ``step_compiler_options`` and experiments/PERFORMANCE.md would want updating). JAX's warning
  about the failed write is silenced; other programs are still cached."""
  script = textwrap.dedent("""
      import jax, jax.numpy as jnp, sys, warnings
      from transformer_jax import runtime
      runtime.enable_compilation_cache(sys.argv[1])
      jax.config.update("jax_persistent_cache_min_compile_time_secs", 0.0)
      options = runtime.step_compiler_options("cpu")

      def onednn_product(x):
        return x @ x

      def plain(x):
        return jnp.tanh(x).sum()

      x = jnp.ones((8, 32, 32))
      with warnings.catch_warnings(record=True) as caught:   # JAX's UserWarning shows by default
        runtime.hold(jax.jit(onednn_product, compiler_options=options), options)(x)
        jax.jit(plain)(x).block_until_ready()
      print(bool(options), len([w for w in caught if "cache" in str(w.message)]))
  """)
  env = {**os.environ, "TJAX_COMPILATION_CACHE": ""}
  for _ in range(2):
    out = subprocess.run([sys.executable, "-c", script, str(tmp_path / "xla")], env=env,
                         check=True, capture_output=True, text=True).stdout.split()
    if out[0] == "False":
      pytest.skip("this jaxlib does not take the oneDNN options")
    assert out == ["True", "0"]   # no warning
  files = os.listdir(tmp_path / "xla")
  assert any(f.startswith("jit_plain-") for f in files), files
  assert not any(f.startswith("jit_onednn_product-") for f in files), files


@pytest.mark.skipif(jax.default_backend() != "cpu", reason="XLA:CPU's oneDNN products")
def test_bfloat16_step_on_bf16_units_has_no_onednn_product_and_serializes(monkeypatch):
  """With bf16 units, every product of a bfloat16 train step (projections, the head, attention's
  row-major core) is a bfloat16 product for YNNPACK, which oneDNN does not take: the step
  serializes, which is what the persistent cache writes, with the oneDNN options on. (With 64
  tokens or fewer per step, XLA upcasts this tiny model's vocabulary products and oneDNN takes
  them: 128 tokens here.)"""
  from jax.experimental import serialize_executable

  from transformer_jax import models
  from transformer_jax.bench import train as bench_train
  from transformer_jax.ops import linear

  if not runtime.step_compiler_options("cpu"):
    pytest.skip("this jaxlib does not take the oneDNN options")
  monkeypatch.setattr(linear, "matmul_pays", lambda dtype: jnp.dtype(dtype) == jnp.bfloat16)
  config = models.get_config("gpt2-tiny", dtype="bfloat16")
  batch, task = bench_train.random_batch(config, 2, 64, 0)
  step = bench_train.Ours(config, batch, task, 1e-4, 0).step_fn
  assert "__onednn_fusion" not in step.as_text()
  payload, _, _ = serialize_executable.serialize(step)
  assert len(payload) > 0


def test_cache_can_be_turned_off(monkeypatch):
  monkeypatch.setenv("TJAX_COMPILATION_CACHE", "0")
  assert runtime.enable_compilation_cache() is None


def test_bf16_notice_only_without_bf16_hardware(monkeypatch):
  assert runtime.bf16_notice("float32") is None
  monkeypatch.setattr(jax, "default_backend", lambda: "gpu")   # accelerators: never a notice
  monkeypatch.setattr(hardware, "has_bf16_units", lambda: False)
  assert runtime.bf16_notice("bfloat16") is None
  monkeypatch.setattr(jax, "default_backend", lambda: "cpu")
  monkeypatch.setattr(runtime, "_warned_bf16", False)
  with pytest.warns(UserWarning, match="slower than dtype=float32"):
    text = runtime.bf16_notice("bfloat16")
  assert "avx512_bf16" in text
  monkeypatch.setattr(hardware, "has_bf16_units", lambda: True)
  assert runtime.bf16_notice("bfloat16") is None


def test_machine_description_names_cpu_and_flags():
  d = machine.describe()
  assert d["cpu"] and isinstance(d["cpu_flags"], list)
  assert d["bf16_hardware"] == any(f in d["cpu_flags"] for f in machine.BF16_FLAGS)
  # How idle CPUs wait, as /sys says (nothing where it says nothing).
  for key, path in (("driver", "/sys/devices/system/cpu/cpuidle/current_driver"),
                    ("guest_halt_poll_ns", "/sys/module/haltpoll/parameters/guest_halt_poll_ns")):
    if os.path.exists(path):
      with open(path) as f:
        assert str(d["cpu_idle"][key]) == f.read().strip()
    else:
      assert key not in d["cpu_idle"]


@only_on("cpu", "XLA:CPU's product libraries")
def test_matmul_limit_counts_flops_of_each_layout_and_library():
  r = machine.matmul_limit([(64, 32, 48)], reps=1)
  rates = r["per_shape"]["64x32x48"]
  assert set(rates) == {"x@W", "dy@W^T", "x^T@dy"}
  # The limit is the best of every library the step may use: oneDNN's rates are measured too.
  assert set(r["per_library"]) == {"onednn"}
  dnn = r["per_library"]["onednn"]["64x32x48"]
  assert set(dnn) == {"x@W", "dy@W^T", "x^T@dy"}
  assert r["flops_per_sec"] == max(*rates.values(), *dnn.values()) > 0


def test_steps_give_their_products_to_onednn_on_cpu_only(monkeypatch):
  assert runtime.step_compiler_options("cpu") == runtime.ONEDNN_DOTS
  assert runtime.step_compiler_options("gpu") == runtime.GPU_STEP_OPTIONS
  assert runtime.step_compiler_options("tpu") == {}
  monkeypatch.setenv("TJAX_ONEDNN", "0")
  assert runtime.step_compiler_options("cpu") == {}


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

  compiled = jax.jit(jax.value_and_grad(loss, argnums=(0, 1, 2))).lower(q, k, v).compile(
      compiler_options=runtime.step_compiler_options("cpu"))
  runtime.hold(compiled, runtime.step_compiler_options("cpu"))
  assert "__onednn_fusion" in compiled.as_text()   # the products did go to oneDNN
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


@only_on("cpu", "XLA:CPU's oneDNN products")
def test_steps_with_onednn_products_outlive_their_callers(monkeypatch):
  """This jaxlib aborts the process when an executable with oneDNN products dies just after a
  call (``runtime.hold``): a step compiled with the options stays alive after its caller drops
  it, until 16 more have been held; without the options nothing is held."""
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
  for _ in range(runtime._HELD.maxlen):   # noqa: SLF001
    runtime.hold(object(), runtime.ONEDNN_DOTS)
  gc.collect()
  assert alive() is None

  monkeypatch.setenv("TJAX_ONEDNN", "0")
  step = step_lib.jit_eval_step(eval_step, mesh, {})
  step({}, batch)
  alive = weakref.ref(step)
  del step
  gc.collect()
  assert alive() is None


def test_held_steps_get_a_moment_at_exit_before_they_are_destroyed(monkeypatch):
  registered = []
  monkeypatch.setattr(runtime, "_HELD", collections.deque(maxlen=2))
  monkeypatch.setattr(runtime.atexit, "register", lambda *args: registered.append(args))
  for obj in ("a", "b", "c"):
    assert runtime.hold(obj, runtime.ONEDNN_DOTS) == obj
  assert runtime.hold("d", None) == "d"   # built without the options: not held
  assert list(runtime._HELD) == ["b", "c"]   # noqa: SLF001 - bounded
  assert registered == [(time.sleep, 0.02)]   # once


def test_scratch_notice_only_for_cpu_steps_past_mimallocs_reuse_limit():
  limit = runtime.MIMALLOC_REUSE_LIMIT
  assert runtime.scratch_notice(limit, platform="cpu", malloc="mimalloc") is None
  assert runtime.scratch_notice(None, platform="cpu", malloc="mimalloc") is None
  assert runtime.scratch_notice(3 << 30, platform="gpu", malloc="mimalloc") is None
  assert runtime.scratch_notice(3 << 30, platform="cpu", malloc="glibc") is None
  msg = runtime.scratch_notice(3 << 30, platform="cpu", malloc="mimalloc")
  assert "3.00 GiB" in msg and "microbatches" in msg


def test_allocator_names_the_preloaded_malloc(monkeypatch):
  monkeypatch.setenv("LD_PRELOAD", "/x/libmimalloc.so")
  assert runtime.allocator() == "mimalloc" and machine.describe()["allocator"] == "mimalloc"
  monkeypatch.delenv("LD_PRELOAD")
  assert runtime.allocator() == "glibc"


def _fds_on(path) -> int:
  """How many of this process's file descriptors are open on ``path``."""
  n = 0
  for fd in os.listdir("/proc/self/fd"):
    try:
      n += os.readlink(f"/proc/self/fd/{fd}") == str(path)
    except OSError:
      pass
  return n


def test_cpu_poll_holds_a_zero_request_only_while_the_block_runs(tmp_path, monkeypatch):
  device = tmp_path / "cpu_dma_latency"
  device.write_bytes(b"")
  monkeypatch.setattr(runtime, "CPU_DMA_LATENCY", str(device))
  monkeypatch.delenv(runtime.POLL_ENV, raising=False)
  monkeypatch.setattr(jax, "default_backend", lambda: "cpu")
  with runtime.cpu_poll() as req:
    assert req.held and req.reason == ""
    # The kernel reads one signed 32-bit latency in microseconds; the request lasts while the
    # file stays open.
    assert device.read_bytes() == struct.pack("i", 0)
    assert _fds_on(device) == 1
  assert _fds_on(device) == 0
  # Released when the block fails too, and the error is the caller's.
  with pytest.raises(KeyError):
    with runtime.cpu_poll() as req:
      assert req.held and _fds_on(device) == 1
      raise KeyError("x")
  assert _fds_on(device) == 0


def test_cpu_poll_does_nothing_when_turned_off_or_not_allowed(tmp_path, monkeypatch):
  device = tmp_path / "cpu_dma_latency"
  device.write_bytes(b"")
  monkeypatch.setattr(runtime, "CPU_DMA_LATENCY", str(device))
  monkeypatch.setenv(runtime.POLL_ENV, "0")
  with runtime.cpu_poll() as req:
    assert not req.held and runtime.POLL_ENV in req.reason and _fds_on(device) == 0
  assert device.read_bytes() == b""
  monkeypatch.delenv(runtime.POLL_ENV)
  monkeypatch.setattr(jax, "default_backend", lambda: "cpu")
  for missing in (tmp_path / "absent", tmp_path):   # no such file; a directory (cannot write)
    monkeypatch.setattr(runtime, "CPU_DMA_LATENCY", str(missing))
    with runtime.cpu_poll() as req:
      assert not req.held and str(missing) in req.reason
  monkeypatch.setattr(runtime, "CPU_DMA_LATENCY", str(device))
  monkeypatch.setattr(jax, "default_backend", lambda: "gpu")
  with runtime.cpu_poll() as req:
    assert not req.held and "not on CPU" in req.reason and _fds_on(device) == 0


def _poll_entries() -> int:
  """Times the machine's CPUs entered cpuidle's POLL state (``state0``) so far."""
  total = 0
  for state in glob.glob("/sys/devices/system/cpu/cpu*/cpuidle/state0"):
    with open(f"{state}/name") as f:
      if f.read().strip() != "POLL":
        continue
    with open(f"{state}/usage") as f:
      total += int(f.read())
  return total


@pytest.mark.skipif(not (os.access(runtime.CPU_DMA_LATENCY, os.W_OK)
                         and glob.glob("/sys/devices/system/cpu/cpu*/cpuidle/state0")),
                    reason="needs a writable /dev/cpu_dma_latency (root on Linux) and cpuidle")
def test_cpu_poll_makes_idle_cpus_poll(monkeypatch):
  """On the real kernel: while the request is held, CPUs that go idle (this process sleeping) poll
  instead of entering their halting state."""
  monkeypatch.delenv(runtime.POLL_ENV, raising=False)
  with runtime.cpu_poll() as req:
    assert req.held
    before = _poll_entries()
    for _ in range(20):
      time.sleep(0.01)
    assert _poll_entries() > before
