"""``tjax train CONFIG --dry-run``: plan a pod run on a laptop.

Lowers and compiles the real train step for the configured mesh on simulated host devices, against
``ShapeDtypeStruct`` parameters, optimizer state and batch (nothing is allocated, no data is read),
and reports per-device memory from the sharding of the state and from the compiled executable.
The CLI sets the number of simulated CPU devices before JAX starts (``simulate_devices``).
"""

from __future__ import annotations

import os
import time
from typing import Any

import jax

from transformer_jax import backends, models, parallel, runs
from transformer_jax.train import step as step_lib
from transformer_jax.train.config import Experiment


def simulate_devices(exp: Experiment, num_devices: int | None) -> int:
  """Makes JAX's CPU backend present ``num_devices`` devices (default: the product of the mesh
  sizes). Must run before anything touches a JAX backend.

  Raises:
    ValueError: the mesh has a -1 axis and no device count was given.
  """
  sizes = [exp.mesh.data, exp.mesh.fsdp, exp.mesh.tensor, exp.mesh.sequence]
  if num_devices is None:
    if -1 in sizes:
      raise ValueError(f"mesh {dict(zip(parallel.AXES, sizes))} has a -1 axis: give the device "
                       "count to simulate with --devices N")
    num_devices = 1
    for s in sizes:
      num_devices *= s
  jax.config.update("jax_platforms", "cpu")
  jax.config.update("jax_num_cpu_devices", int(num_devices))
  return int(num_devices)


def _model_config(exp: Experiment) -> tuple[models.ModelConfig, str]:
  """The model a real run would build: an existing run's own ``model.yaml``; else the experiment's
  model with the prepared dataset's vocabulary when there is one (else the preset's)."""
  rd = runs.RunDir(exp.run_dir)
  if rd.checkpoint_steps() and rd.read_model() is not None:
    config = rd.read_model()
    return config, f"vocabulary {config.vocab_size} from {rd.file(runs.MODEL)}"
  path = exp.data.path
  meta = None if path is None else os.path.join(path, "metadata.json")
  if meta and os.path.exists(meta):
    from transformer_jax.data import prepare
    vocab = prepare.read_metadata(path)["vocab_size"]
    return exp.model_config(vocab_size=vocab), f"vocabulary {vocab} from {path}"
  config = exp.model_config()
  return config, f"vocabulary {config.vocab_size} from the model config (no prepared dataset)"


def dry_run(exp: Experiment) -> dict[str, Any]:
  """Compiles one train step of ``exp`` on the available devices; returns the memory report.

  Task, mesh, optimizer and step are built by the trainer's own functions (``trainer.plan`` and
  ``trainer.make_step``); only the dataset is replaced by batch shapes.
  """
  from transformer_jax.train import trainer
  config, vocab_note = _model_config(exp)
  task, mesh, optimizer = trainer.plan(exp, config)
  t = exp.train
  state = step_lib.abstract_state(config, optimizer, mesh)
  batch_sharding = parallel.batch_sharding(mesh)
  batch = {k: jax.ShapeDtypeStruct(v.shape, v.dtype, sharding=batch_sharding)
           for k, v in task.batch_shapes(t.batch_size, t.seq_len).items()}
  start = time.perf_counter()
  backend = backends.for_platform(mesh.devices.flat[0].platform, exp.kernels)
  _, compiled, microbatches = trainer.compiled_step(exp, models.graphdef(config, mesh, backend),
                                                    task, optimizer, mesh, state, batch, backend)
  compile_s = time.perf_counter() - start

  def per_device(tree):
    return parallel.bytes_per_device(tree, jax.tree.map(lambda a: a.sharding, tree))

  mem = compiled.memory_analysis()
  report = {
      "model": type(config).__name__, "parameters": models.count_params(config),
      "vocab": vocab_note, "devices": jax.device_count(), "mesh": dict(mesh.shape),
      "batch_size": t.batch_size, "seq_len": t.seq_len, "microbatches": microbatches,
      "dtype": config.dtype, "compile_seconds": round(compile_s, 1),
      "per_device_bytes": {
          "parameters": per_device(state.params),
          "optimizer_state": per_device(state.opt_state),
          "arguments": int(mem.argument_size_in_bytes),
          "outputs": int(mem.output_size_in_bytes),
          "aliased": int(mem.alias_size_in_bytes),
          "temporaries": int(mem.temp_size_in_bytes),
      },
  }
  b = report["per_device_bytes"]
  b["peak_estimate"] = b["arguments"] + b["outputs"] - b["aliased"] + b["temporaries"]
  report["attention"] = attention_kernels(config, dict(mesh.shape), t.batch_size, t.seq_len,
                                          task.name, exp.kernels)
  return report


def attention_kernels(config, mesh: dict[str, int], batch_size: int, seq_len: int,
                      task_name: str, kernels=None) -> list[dict[str, Any]]:
  """The kernel each backend (with the kernel table ``kernels``) chooses for each attention of a
  training step (``Backend.choose_attention``), for one device's share: ``[{"attention", "shape"
  [B, T, N, H], "dtype", "kernels": {platform: kernel}}]``. The mask parts are the ones the task
  and model pass (GPT: causal, the packed documents' segment ids, the sliding window; BERT: key
  padding; Seq2Seq: padding, causal decoder self-attention, cross-attention)."""
  rows_per_device = max(1, batch_size // (mesh.get("data", 1) * mesh.get("fsdp", 1)))
  heads = max(1, config.num_heads // mesh.get("tensor", 1))
  kv_heads = max(1, config.kv_heads // mesh.get("tensor", 1))
  dtype = jax.numpy.dtype(config.dtype)

  def shapes(t, s):
    q = jax.ShapeDtypeStruct((rows_per_device, t, heads, config.head_size), dtype)
    k = jax.ShapeDtypeStruct((rows_per_device, s, kv_heads, config.head_size), dtype)
    return q, k

  bias = getattr(config, "position", None) in ("alibi", "relative")
  calls = []
  match type(config).__name__:
    case "GPTConfig":
      calls.append(("self-attention", seq_len, seq_len, dict(
          causal=True, window=config.sliding_window, segment_ids=task_name == "gpt",
          bias=bias)))
    case "BERTConfig":
      calls.append(("self-attention", seq_len, seq_len, dict(kv_valid=True)))
    case _:
      calls.append(("encoder self-attention", seq_len, seq_len, dict(kv_valid=True, bias=bias)))
      calls.append(("decoder self-attention", seq_len, seq_len, dict(causal=True, bias=bias)))
      calls.append(("cross-attention", seq_len, seq_len, dict(kv_valid=True)))
  out = []
  for name, t, s, parts in calls:
    q, k = shapes(t, s)
    chosen = {p: backends.for_platform(p, kernels).choose_attention(
                  q, k, k, sequence_shards=mesh.get("sequence", 1), **parts)
              for p in ("tpu", "gpu", "cpu")}
    out.append({"attention": name, "shape": list(q.shape), "dtype": str(dtype),
                "kernels": chosen})
  return out


def format_report(report: dict[str, Any]) -> str:
  gib = lambda n: f"{n / 2**30:10.3f} GiB"
  mesh = " x ".join(f"{k}={v}" for k, v in report["mesh"].items())
  b = report["per_device_bytes"]
  lines = [
      f"dry run: {report['model']} with {report['parameters']:,} parameters, {report['vocab']}",
      f"  mesh {mesh} on {report['devices']} simulated devices",
      f"  global batch {report['batch_size']} x {report['seq_len']} tokens, "
      f"{report['microbatches']} microbatch(es), compute dtype {report['dtype']}",
      f"  train step compiled in {report['compile_seconds']} s",
      "  per device:",
      f"    parameters (fp32)       {gib(b['parameters'])}",
      f"    optimizer state         {gib(b['optimizer_state'])}",
      f"    activations + scratch   {gib(b['temporaries'])}   (XLA temporaries of the step)",
      f"    step inputs / outputs   {gib(b['arguments'])} / {gib(b['outputs']).strip()} "
      f"({gib(b['aliased']).strip()} donated)",
      f"    peak estimate           {gib(b['peak_estimate'])}",
  ]
  if report.get("attention"):
    lines.append("  attention kernel per backend (ops.choose_implementation), one device's share:")
    for a in report["attention"]:
      kernels = ", ".join(f"{p} {k}" for p, k in a["kernels"].items())
      lines.append(f"    {a['attention']:<24s}[{', '.join(map(str, a['shape']))}] {a['dtype']}: "
                   f"{kernels}")
  return "\n".join(lines)
