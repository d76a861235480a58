"""Process settings and the CPU profile: the persistent compilation cache, the allocator launcher
and its decision, the oneDNN options and what holds them, the bf16 notice, the idle-CPU polling
request (always against a stand-in for /dev/cpu_dma_latency), the table of measured CPUs."""

import collections
import gc
import os
import struct
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

from tests.ops.test_attention import attention_ref
from transformer_jax import cli, hardware, ops, runtime
from transformer_jax.bench import machine
from transformer_jax.cpu import allocator, measured, microbatches, onednn, poll
from tests.backends import only_on
from tests.train.conftest import CompiledStandIn

MIMALLOC = "/x/cmeel.prefix/lib/libmimalloc.so"


def _plugins(*names):
  """A ``find_spec`` stand-in under which only ``names`` can be imported."""
  return lambda name: object() if name in names else None


NO_PLUGIN = _plugins()


@pytest.mark.skipif(sys.platform != "linux", reason="LD_PRELOAD is the Linux launcher's")
def test_allocator_env_preloads_mimalloc_once(monkeypatch):
  monkeypatch.setattr(allocator, "mimalloc_path", lambda: MIMALLOC)
  env = allocator.allocator_env({"PATH": "/bin"}, find_spec=NO_PLUGIN)
  assert env["LD_PRELOAD"] == MIMALLOC and env["MIMALLOC_PURGE_DELAY"] == "-1"
  # Already preloaded (the re-executed process), or turned off: nothing to do.
  assert allocator.allocator_env(env, find_spec=NO_PLUGIN) is None
  for off in ("0", "system", "glibc"):
    assert allocator.allocator_env({"TJAX_MALLOC": off}, find_spec=NO_PLUGIN) is None
  # A user's own preload is kept after ours.
  env = allocator.allocator_env({"LD_PRELOAD": "/x/libfoo.so"}, find_spec=NO_PLUGIN)
  assert env["LD_PRELOAD"] == f"{MIMALLOC} /x/libfoo.so"
  # Not installed: nothing to preload.
  monkeypatch.setattr(allocator, "mimalloc_path", lambda: None)
  assert allocator.allocator_env({}, find_spec=NO_PLUGIN) is None


@pytest.mark.parametrize("environ, plugins, on_cpu", [
    ({}, (), True),                                          # nothing but jaxlib: CPU
    ({}, ("jax_cuda12_plugin",), False),
    ({}, ("jax_cuda13_plugin",), False),
    ({}, ("libtpu",), False),
    ({}, ("jax_plugins",), False),                           # any PJRT plugin
    ({"JAX_PLATFORMS": "cpu"}, ("jax_cuda12_plugin",), True),  # JAX_PLATFORMS decides
    ({"JAX_PLATFORMS": " CPU "}, ("libtpu",), True),
    ({"JAX_PLATFORMS": "cuda"}, (), False),
    ({"JAX_PLATFORMS": "cuda,cpu"}, (), False),              # the first listed computes
    ({"JAX_PLATFORMS": "tpu"}, (), False),
    ({"JAX_PLATFORMS": ""}, ("jax_cuda12_plugin",), False),  # empty: as unset
])
def test_launcher_decides_cpu_from_jax_platforms_then_plugins(environ, plugins, on_cpu):
  assert allocator.computes_on_cpu(environ, find_spec=_plugins(*plugins)) is on_cpu


@pytest.mark.skipif(sys.platform != "linux", reason="LD_PRELOAD is the Linux launcher's")
def test_allocator_env_only_for_processes_that_compute_on_cpu(monkeypatch):
  monkeypatch.setattr(allocator, "mimalloc_path", lambda: MIMALLOC)
  gpu = _plugins("jax_cuda12_plugin")
  assert allocator.allocator_env({}, find_spec=gpu) is None
  assert allocator.allocator_env({"JAX_PLATFORMS": "tpu"}, find_spec=NO_PLUGIN) is None
  assert allocator.allocator_env({"JAX_PLATFORMS": "cpu"}, find_spec=gpu)["LD_PRELOAD"] == MIMALLOC
  # TJAX_MALLOC=mimalloc asks for it wherever the process computes.
  assert allocator.allocator_env({"TJAX_MALLOC": "mimalloc"}, find_spec=gpu) is not None


@pytest.mark.skipif(sys.platform != "linux", reason="LD_PRELOAD is the Linux launcher's")
def test_system_allocator_notice_only_when_mimalloc_would_run_but_is_missing(monkeypatch):
  monkeypatch.setattr(allocator, "mimalloc_path", lambda: None)
  text = allocator.system_allocator_notice({}, find_spec=NO_PLUGIN)
  assert "system allocator" in text and "transformer-jax[cpu]" in text and "\n" not in text
  assert allocator.system_allocator_notice({"TJAX_MALLOC": "system"}, find_spec=NO_PLUGIN) is None
  assert allocator.system_allocator_notice({}, find_spec=_plugins("libtpu")) is None
  assert allocator.system_allocator_notice({"LD_PRELOAD": "/x/libjemalloc.so"},
                                           find_spec=NO_PLUGIN) is None
  monkeypatch.setattr(allocator, "mimalloc_path", lambda: MIMALLOC)
  assert allocator.system_allocator_notice({}, find_spec=NO_PLUGIN) is None


def _launch(monkeypatch, capsys):
  """Runs ``cli.launch`` with ``main`` and ``os.execve`` stubbed: ``(exec calls, stderr)``."""
  calls = []
  monkeypatch.setattr(cli, "main", lambda: 0)
  monkeypatch.setattr(os, "execve", lambda *args: calls.append(args))
  with pytest.raises(SystemExit) as done:
    cli.launch()
  assert done.value.code == 0
  return calls, capsys.readouterr().err


@pytest.mark.skipif(sys.platform != "linux", reason="LD_PRELOAD is the Linux launcher's")
def test_launcher_runs_itself_over_mimalloc_only_on_cpu(monkeypatch, capsys):
  for name in ("LD_PRELOAD", "TJAX_MALLOC"):
    monkeypatch.delenv(name, raising=False)
  monkeypatch.setattr(allocator, "mimalloc_path", lambda: MIMALLOC)
  monkeypatch.setenv("JAX_PLATFORMS", "cpu")
  calls, err = _launch(monkeypatch, capsys)
  assert len(calls) == 1 and calls[0][2]["LD_PRELOAD"] == MIMALLOC and err == ""
  assert calls[0][1][1:3] == ["-m", "transformer_jax.cli"]
  monkeypatch.setenv("JAX_PLATFORMS", "cuda")
  calls, err = _launch(monkeypatch, capsys)
  assert calls == [] and err == ""


@pytest.mark.skipif(sys.platform != "linux", reason="LD_PRELOAD is the Linux launcher's")
def test_launcher_without_mimalloc_says_so_once_and_runs(monkeypatch, capsys):
  for name in ("LD_PRELOAD", "TJAX_MALLOC"):
    monkeypatch.delenv(name, raising=False)
  monkeypatch.setenv("JAX_PLATFORMS", "cpu")
  monkeypatch.setattr(allocator, "mimalloc_path", lambda: None)
  calls, err = _launch(monkeypatch, capsys)
  assert calls == [] and err.count("\n") == 1 and "system allocator" in err


def test_the_core_never_imports_the_bench():
  """runtime and the CPU profile load without any of transformer_jax.bench."""
  script = ("import sys; from transformer_jax import runtime; "
            "from transformer_jax.cpu import allocator, measured, microbatches, onednn, poll; "
            "print(sorted(m for m in sys.modules if m.startswith('transformer_jax.bench')))")
  out = subprocess.run([sys.executable, "-c", script], check=True, capture_output=True,
                       text=True).stdout
  assert out.strip() == "[]"


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
  ``cpu.onednn`` and experiments/PERFORMANCE.md would want updating). JAX's warning about the
  failed write is silenced where such a step compiles (a held step's first call, a compile in
  ``quiet_uncacheable``), and only there: asking for the options leaves the process's warning
  filters as they were, and the same program compiled outside those scopes still warns. Other
  programs are still cached."""
  script = textwrap.dedent("""
      import jax, jax.numpy as jnp, sys, warnings
      from transformer_jax import runtime
      from transformer_jax.cpu import onednn
      runtime.enable_compilation_cache(sys.argv[1])
      jax.config.update("jax_persistent_cache_min_compile_time_secs", 0.0)
      filters = list(warnings.filters)
      options = runtime.step_compiler_options("cpu")

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
        onednn.hold(jax.jit(onednn_product, compiler_options=options), options)(x)
        with onednn.quiet_uncacheable():
          jax.jit(compiled_ahead).lower(x).compile(compiler_options=options)(x)
        jax.jit(plain)(x).block_until_ready()
        quiet = len([w for w in caught if "cache" in str(w.message)])
        jax.jit(unheld, compiler_options=options)(x).block_until_ready()
        loud = [str(w.message) for w in caught if "cache" in str(w.message)][quiet:]
      print(bool(options), quiet, len(loud), "jit_unheld" in "".join(loud),
            warnings.filters == filters)
  """)
  env = {**os.environ, "TJAX_COMPILATION_CACHE": ""}
  for _ in range(2):
    out = subprocess.run([sys.executable, "-c", script, str(tmp_path / "xla")], env=env,
                         check=True, capture_output=True, text=True).stdout.split()
    if out[0] == "False":
      pytest.skip("this jaxlib does not take the oneDNN options")
    assert out == ["True", "0", "1", "True", "True"]
  files = os.listdir(tmp_path / "xla")
  assert any(f.startswith("jit_plain-") for f in files), files
  assert not any(f.startswith(("jit_onednn_product-", "jit_compiled_ahead-")) for f in files), files


def test_asking_for_the_step_options_leaves_the_warning_filters_alone():
  before = list(warnings.filters)
  for platform in ("cpu", "gpu", "tpu"):
    runtime.step_compiler_options(platform)
  assert warnings.filters == before
  with onednn.quiet_uncacheable():
    assert warnings.filters != before
  assert warnings.filters == before


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
  from transformer_jax.cpu import matmul as cpu_matmul

  if not runtime.step_compiler_options("cpu"):
    pytest.skip("this jaxlib does not take the oneDNN options")
  monkeypatch.setattr(cpu_matmul, "bf16_products_native",
                      lambda dtype: jnp.dtype(dtype) == jnp.bfloat16)
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
  assert runtime.step_compiler_options("cpu") == onednn.ONEDNN_DOTS
  assert runtime.step_compiler_options("gpu") == runtime.GPU_STEP_OPTIONS
  assert runtime.step_compiler_options("tpu") == {}
  assert onednn.step_options("gpu") == onednn.step_options("tpu") == {}
  # A copy: a caller's change does not reach the next caller.
  runtime.step_compiler_options("cpu")["xla_cpu_use_onednn"] = False
  assert runtime.step_compiler_options("cpu") == onednn.ONEDNN_DOTS
  monkeypatch.setenv("TJAX_ONEDNN", "0")
  assert runtime.step_compiler_options("cpu") == {}


def test_packed_segments_put_conditionals_in_the_gpu_command_buffers(monkeypatch):
  # Packed segments choose their cuDNN call in a lax.cond per attention: on GPUs the step keeps
  # those conditionals inside its CUDA graphs; nothing changes while the lever is off, or off GPUs.
  from transformer_jax.ops import dispatch

  assert "xla_gpu_enable_command_buffer" not in runtime.step_compiler_options("gpu")
  monkeypatch.setattr(dispatch, "CUDNN_PACKED_SEGMENTS", 16)
  gpu = runtime.step_compiler_options("gpu")
  assert gpu == {**runtime.GPU_STEP_OPTIONS,
                 "xla_gpu_enable_command_buffer": runtime.GPU_COMMAND_BUFFERS_WITH_CONDITIONALS}
  assert "CONDITIONAL" in gpu["xla_gpu_enable_command_buffer"].split(",")
  assert runtime.step_compiler_options("cpu") == onednn.ONEDNN_DOTS
  # XLA takes the list as a compile option (its flag's "+CONDITIONAL" form it does not).
  jax.jit(lambda x: x + 1).lower(jnp.ones(2)).compile(
      compiler_options={"xla_gpu_enable_command_buffer": gpu["xla_gpu_enable_command_buffer"]})


def test_decoding_compiles_without_triton_gemms_on_gpus_only():
  # The GPU decoding loop's first call: 33.9 s with Triton GEMMs autotuned, 6.2 s without
  # (experiments/PERFORMANCE.md, "XLA:GPU options").
  assert runtime.decode_compiler_options("gpu") == {"xla_gpu_enable_triton_gemm": False}
  assert runtime.decode_compiler_options("cpu") == runtime.decode_compiler_options("tpu") == {}
  runtime.decode_compiler_options("gpu").clear()   # a copy
  assert runtime.decode_compiler_options("gpu") == runtime.GPU_DECODE_OPTIONS != {}


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
  onednn.hold(compiled, runtime.step_compiler_options("cpu"))
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
  call (``cpu.onednn.hold``): a step compiled with the options stays alive after its caller drops
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
  assert onednn._HELD.maxlen == onednn.HELD_LIMIT == 16   # noqa: SLF001
  for _ in range(onednn.HELD_LIMIT):
    onednn.hold(object(), onednn.ONEDNN_DOTS)
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
  monkeypatch.setattr(onednn, "_HELD", collections.deque(maxlen=2))
  monkeypatch.setattr(onednn.atexit, "register", lambda *args: registered.append(args))
  for obj in ("a", "b", "c"):
    assert onednn.hold(obj, onednn.ONEDNN_DOTS) == obj
  assert onednn.hold("d", None) == "d"   # built without the options: not held
  assert list(onednn._HELD) == ["b", "c"]   # noqa: SLF001 - bounded
  assert registered == [(time.sleep, onednn.EXIT_WAIT_S)]   # once


def test_a_held_jit_function_is_the_function_with_a_quiet_first_call(monkeypatch):
  monkeypatch.setattr(onednn, "_HELD", collections.deque(maxlen=2))
  fn = jax.jit(lambda x: x * 2)
  held = onednn.hold(fn, onednn.ONEDNN_DOTS)
  assert isinstance(held, onednn.QuietFirstCall) and held.fn is fn and list(onednn._HELD) == [held]
  assert onednn.hold(held, onednn.ONEDNN_DOTS) is held   # not wrapped twice
  assert held.lower(1.0).compile()(3.0) == 6.0 and held(2.0) == 4.0 and held(5.0) == 10.0
  assert onednn.hold(fn, None) is fn and onednn.hold(fn, runtime.GPU_STEP_OPTIONS) is fn


def test_scratch_notice_only_for_cpu_steps_past_mimallocs_reuse_limit(monkeypatch):
  limit = allocator.MIMALLOC_REUSE_LIMIT
  assert allocator.scratch_notice(limit, platform="cpu", malloc="mimalloc") is None
  assert allocator.scratch_notice(None, platform="cpu", malloc="mimalloc") is None
  assert allocator.scratch_notice(3 << 30, platform="gpu", malloc="mimalloc") is None
  assert allocator.scratch_notice(3 << 30, platform="cpu", malloc="glibc") is None
  msg = allocator.scratch_notice(3 << 30, platform="cpu", malloc="mimalloc")
  assert "3.00 GiB" in msg and "microbatches" in msg
  # The module's limit is the one its notice uses (the trainer's tests lower it there).
  monkeypatch.setattr(allocator, "MIMALLOC_REUSE_LIMIT", 0)
  assert allocator.scratch_notice(1, platform="cpu", malloc="mimalloc") is not None


def test_allocator_names_the_preloaded_malloc(monkeypatch):
  monkeypatch.setenv("LD_PRELOAD", "/x/libmimalloc.so")
  assert allocator.allocator() == "mimalloc" and machine.describe()["allocator"] == "mimalloc"
  monkeypatch.delenv("LD_PRELOAD")
  assert allocator.allocator() == "glibc"


@pytest.mark.parametrize("platform, malloc, want, compiled", [
    ("cpu", "mimalloc", 4, [1, 4]),
    ("cpu", "glibc", 1, [1]),      # the limit is mimalloc's
    ("gpu", "mimalloc", 1, [1]),   # and the CPU's
])
def test_auto_microbatches_only_on_cpu_over_mimalloc(platform, malloc, want, compiled):
  calls = []

  def compile_step(m):
    calls.append(m)
    return CompiledStandIn({1: 5000, 4: 1900}[m])

  m, step = microbatches.resolve_auto(compile_step, 8, platform=platform, malloc=malloc,
                                      limit=2000)
  assert (m, calls) == (want, compiled) and step.temp == {1: 5000, 4: 1900}[m]


def _fds_on(path) -> int:
  """How many of this process's file descriptors are open on ``path``."""
  n = 0
  for fd in os.listdir("/proc/self/fd"):
    try:
      n += os.readlink(f"/proc/self/fd/{fd}") == str(path)
    except OSError:
      pass
  return n


def _stand_in(tmp_path, monkeypatch):
  """A file in place of /dev/cpu_dma_latency (tests never write the real one)."""
  device = tmp_path / "cpu_dma_latency"
  device.write_bytes(b"")
  monkeypatch.setattr(poll, "CPU_DMA_LATENCY", str(device))
  return device


def test_cpu_poll_holds_a_zero_request_only_while_the_block_runs(tmp_path, monkeypatch):
  device = _stand_in(tmp_path, monkeypatch)
  monkeypatch.setattr(jax, "default_backend", lambda: "cpu")
  with poll.cpu_poll() as req:
    assert req.held and req.requested and req.reason == ""
    # The kernel reads one signed 32-bit latency in microseconds; the request lasts while the
    # file stays open.
    assert device.read_bytes() == struct.pack("i", 0)
    assert _fds_on(device) == 1
  assert _fds_on(device) == 0
  # Released when the block fails too, and the error is the caller's.
  with pytest.raises(KeyError):
    with poll.cpu_poll() as req:
      assert req.held and _fds_on(device) == 1
      raise KeyError("x")
  assert _fds_on(device) == 0


def test_cpu_poll_does_nothing_when_not_requested_or_not_allowed(tmp_path, monkeypatch):
  device = _stand_in(tmp_path, monkeypatch)
  monkeypatch.setattr(jax, "default_backend", lambda: "cpu")
  with poll.cpu_poll_if(False) as req:
    assert (req.held, req.requested) == (False, False) and "--cpu-poll" in req.reason
    assert _fds_on(device) == 0
  assert device.read_bytes() == b""
  for missing in (tmp_path / "absent", tmp_path):   # no such file; a directory (cannot write)
    monkeypatch.setattr(poll, "CPU_DMA_LATENCY", str(missing))
    with poll.cpu_poll_if(True) as req:
      assert req.requested and not req.held and str(missing) in req.reason
  monkeypatch.setattr(poll, "CPU_DMA_LATENCY", str(device))
  monkeypatch.setattr(jax, "default_backend", lambda: "gpu")
  with poll.cpu_poll() as req:
    assert not req.held and "not on CPU" in req.reason and _fds_on(device) == 0


@pytest.mark.parametrize("flag, env, want", [
    (None, {}, False),                      # off unless asked for
    (None, {"TJAX_CPU_POLL": "1"}, True),
    (None, {"TJAX_CPU_POLL": "yes"}, True),
    (None, {"TJAX_CPU_POLL": "0"}, False),
    (True, {}, True),                       # --cpu-poll
    (False, {"TJAX_CPU_POLL": "1"}, False),  # --no-cpu-poll over the environment
])
def test_cpu_poll_is_requested_by_the_flag_else_the_environment(flag, env, want):
  assert poll.requested(flag, env) is want


def test_cpu_poll_environment_must_say_yes_or_no():
  with pytest.raises(ValueError, match=r"TJAX_CPU_POLL='maybe' must be 1 or 0"):
    poll.requested(None, {"TJAX_CPU_POLL": "maybe"})


def test_every_cpu_rule_names_the_cpus_it_was_measured_on():
  assert set(measured.MEASURED_ON) == {"onednn_step_products", "mimalloc", "cpu_poll",
                                       "auto_microbatches"}
  for rule, kinds in measured.MEASURED_ON.items():
    assert kinds and all(isinstance(k, measured.CpuKind) for k in kinds), rule
    assert isinstance(measured.this_cpu_measured(rule), bool)
  assert measured.measured_on("onednn_step_products") == (measured.EPYC_ZEN4,)
  with pytest.raises(ValueError, match="rule 'nope' is not one of"):
    measured.measured_on("nope")


def test_cpu_kinds_match_by_name_family_model_and_flags():
  zen4_flags = ["avx", "avx2", "fma", "avx512f", "avx512_bf16"]
  assert measured.parse_family("cpu family 25, model 17") == (25, 17)
  assert measured.parse_family("") == (None, None)
  assert measured.EPYC_ZEN4.matches("AMD EPYC 9B14", 25, 17, zen4_flags)
  assert not measured.EPYC_ZEN4.matches("AMD EPYC 9B14", 25, 1, zen4_flags)
  assert measured.EPYC_ZEN5.matches("AMD EPYC 9B45", 26, 2, zen4_flags)
  assert measured.EPYC_AVX2.matches("AMD EPYC 7B12", 23, 49, ["avx", "avx2", "fma"])
  assert not measured.EPYC_AVX2.matches("AMD EPYC 9B14", 25, 17, zen4_flags)   # has AVX-512
  xeon = ["avx", "avx2", "fma", "avx512f", "avx512_bf16", "amx_bf16"]
  assert not any(k.matches("Intel(R) Xeon(R) Processor", 6, 143, xeon)
                 for k in (measured.EPYC_AVX2, measured.EPYC_ZEN4, measured.EPYC_ZEN5))


@pytest.mark.parametrize("value", ["maybe", "1", "yes", "jemalloc"])
def test_an_unknown_tjax_malloc_is_one_line_naming_it(monkeypatch, capsys, value):
  monkeypatch.setenv("TJAX_MALLOC", value)
  with pytest.raises(ValueError, match=rf"TJAX_MALLOC={value!r} must be one of"):
    allocator.allocator_env()
  calls = []
  monkeypatch.setattr(os, "execve", lambda *args: calls.append(args))
  monkeypatch.setattr(cli, "main", lambda: calls.append("main") or 0)
  with pytest.raises(SystemExit) as done:
    cli.launch()
  err = capsys.readouterr().err
  assert done.value.code == 2 and calls == [] and err.count("\n") == 1
  assert f"TJAX_MALLOC={value!r} must be one of '0', 'system', 'glibc', 'mimalloc'" in err
  for valid in ("0", "System", "mimalloc", ""):   # any case; empty is unset
    monkeypatch.setenv("TJAX_MALLOC", valid)
    allocator.allocator_env()
