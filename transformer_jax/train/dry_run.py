"""``tjax train CONFIG --dry-run``: plan a pod run on a laptop.

Plans the run as a real run does (``plan.make_plan``: the same checks, the same model, task, mesh,
method and step, ``train.microbatches`` resolved), compiling the step for the configured mesh on
simulated host devices against ``ShapeDtypeStruct`` parameters, optimizer state and batch (nothing
is allocated), and reports per-device memory from the sharding of the state and from the compiled
executable. Of the data it reads only the few batches that time the loader (``loader_report``).
The CLI sets the number of simulated CPU devices before JAX starts (``simulate_devices``).
"""

from __future__ import annotations

import time
from typing import Any

import jax

from transformer_jax import backends, models, parallel
from transformer_jax.data import estimate
from transformer_jax.parallel import experts as experts_lib
from transformer_jax.ops import ssm as ssm_ops
from transformer_jax.ops import ssm_pallas
from transformer_jax.train import checks
from transformer_jax.train.config import Experiment
from transformer_jax.train.metrics import batch_tokens
from transformer_jax.train.plan import make_plan

# XLA:CPU compiles a program for at most 2048 devices in one process ("Multiprocess computations
# aren't implemented on the CPU backend" past it); each simulated device also costs about 1 MiB
# of host memory while the step compiles.
MAX_SIMULATED_DEVICES = 2048
LOADER_STEPS = 4  # batches the dry run times the loader on (after a first one)


def simulate_devices(exp: Experiment, num_devices: int | None) -> int:
  """Makes JAX's CPU backend present ``num_devices`` devices (default: the product of the mesh
  sizes). Must run before anything touches a JAX backend; checks the count before setting it.

  Raises:
    ValueError: the mesh has a -1 axis and no device count was given, or the count lies outside
      ``[1, MAX_SIMULATED_DEVICES]``.
  """
  sizes = [exp.mesh.data, exp.mesh.fsdp, exp.mesh.tensor, exp.mesh.sequence, exp.mesh.expert]
  if num_devices is None:
    if -1 in sizes:
      raise ValueError(
        f"mesh {dict(zip(parallel.AXES, sizes))} has a -1 axis: give the device "
        "count to simulate with --devices N"
      )
    num_devices = 1
    for s in sizes:
      num_devices *= s
    if num_devices > MAX_SIMULATED_DEVICES:
      mesh = " x ".join(f"{a}={s}" for a, s in zip(parallel.AXES, sizes))
      raise ValueError(
        f"mesh {mesh} needs {num_devices} devices; a dry run simulates at most "
        f"{MAX_SIMULATED_DEVICES} (XLA:CPU's limit for one process)"
      )
  elif isinstance(num_devices, bool) or not 1 <= num_devices <= MAX_SIMULATED_DEVICES:
    raise ValueError(
      f"--devices {num_devices}: a dry run simulates 1 to {MAX_SIMULATED_DEVICES} "
      "devices (XLA:CPU's limit for one process)"
    )
  jax.config.update("jax_platforms", "cpu")
  jax.config.update("jax_num_cpu_devices", int(num_devices))
  return int(num_devices)


def dry_run(exp: Experiment) -> dict[str, Any]:
  """Plans ``exp`` on the available devices (``make_plan(exp, purpose="dry_run")``: the train
  step compiled against shapes); returns the memory report."""
  plan = make_plan(exp, purpose="dry_run")
  config, mesh, task, t = plan.model_config, plan.mesh, plan.task, plan.exp.train
  state = plan.method.abstract_state(plan.optimizer, mesh)

  def per_device(tree):
    return parallel.bytes_per_device(tree, jax.tree.map(lambda a: a.sharding, tree))

  mem = plan.compiled.memory_analysis()
  report = {
    "model": type(config).__name__,
    "parameters": models.count_params(config),
    "vocab": plan.vocab_note,
    "devices": jax.device_count(),
    "mesh": dict(mesh.shape),
    "batch_size": t.batch_size,
    "seq_len": t.seq_len,
    "microbatches": t.microbatches,
    "dtype": config.dtype,
    "compile_seconds": round(plan.compile_seconds, 1),
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
  report["attention"] = attention_kernels(
    config, dict(mesh.shape), t.batch_size, t.seq_len, packed=task.packed, kernels=exp.kernels
  )
  report["mixers"] = mixer_kernels(config, t.seq_len)
  report["experts"] = experts_lib.exchange_report(config, dict(mesh.shape), t.batch_size, t.seq_len)
  report["dataset"] = dataset_report(exp)
  report["loader"] = loader_report(plan.exp, task)
  return report


def loader_report(exp: Experiment, task, steps: int = LOADER_STEPS) -> dict[str, Any]:
  """The tokens per second this host's loader must deliver and the rate it does.

  ``need``: the tokens of this host's rows of a batch (``jax.process_count()`` hosts; one in a
  dry run, which reads the whole global batch) over ``train.target_step_time`` (None without
  one). ``measured``: ``task.loader(...).batch_at`` timed on ``steps`` batches of the prepared
  ``data.path`` after a first one (which opens the shards), on this machine; ``missing`` instead
  when the dataset is not prepared.
  """
  out: dict[str, Any] = {
    "hosts": jax.process_count(),
    "target_step_time": exp.train.target_step_time,
  }
  try:
    loader = task.loader(checks.ensure_dataset(exp, prepare=False), exp)
  except (FileNotFoundError, ValueError) as e:
    return {**out, "missing": str(e)}
  tokens = batch_tokens(loader.batch_at(0))
  t0 = time.perf_counter()
  read = sum(batch_tokens(loader.batch_at(s)) for s in range(1, steps + 1))
  seconds = time.perf_counter() - t0
  target = exp.train.target_step_time
  return {
    **out,
    "tokens_per_step": tokens,
    "need": None if target is None else tokens / target,
    "measured": read / seconds,
    "steps_timed": steps,
  }


def dataset_report(exp: Experiment) -> dict[str, Any]:
  """The prepared dataset's size and the epochs the configured steps read
  (``data.dataset_facts``); ``{}`` without ``data.path``; ``{"path": ..., "missing": reason}``
  when it is not prepared yet."""
  path, t = exp.data.path, exp.train
  if not path:
    return {}
  try:
    facts = estimate.dataset_facts(path, steps=t.steps, batch_size=t.batch_size, seq_len=t.seq_len)
  except (FileNotFoundError, ValueError) as e:
    return {"path": path, "missing": str(e)}
  return {"path": path, **facts}


def mixer_kernels(config, seq_len: int) -> list[dict[str, Any]]:
  """What each state-space layer of a ``MambaConfig`` runs (empty for other models): ``[{"layers":
  [indices], "mixer", "op", "detail", "conv"}]``: pure ``ops`` in XLA, or Mamba-2's Pallas kernel
  where the config asks for it."""
  if not isinstance(config, models.MambaConfig):
    return []
  layers = [i for i, kind in enumerate(config.layer_kinds) if kind == "mamba"]
  if not layers:
    return []
  q = min(config.ssm_chunk, seq_len)
  if config.mixer == "mamba1":
    op = "ops.selective_scan"
    methods = ", ".join(
      f"{p} {ssm_ops.choose_scan_method(p) if config.ssm_scan == 'auto' else config.ssm_scan}"
      for p in ("tpu", "gpu", "cpu")
    )
    detail = (
      f"chunks of {q} over [B, {q}, E={config.d_inner}, S={config.d_state}] ({methods}), "
      f"state carried across {-(-seq_len // q)} chunks"
    )
  else:
    impls = {
      p: (ssm_pallas.choose_ssd_implementation(p) if config.ssm_impl == "auto" else config.ssm_impl)
      for p in ("tpu", "gpu", "cpu")
    }
    op = ", ".join(
      f"{p} " + ("ops.ssd" if impl == "xla" else "ops.ssm_pallas.ssd (Pallas)")
      for p, impl in impls.items()
    )
    detail = (
      f"SSD four-term form in chunks of {q}, {config.ssm_heads} heads x "
      f"{config.ssm_head_dim}, {config.ssm_groups} groups, S={config.d_state}"
    )
  return [
    {
      "layers": layers,
      "mixer": config.mixer,
      "op": op,
      "detail": detail,
      "conv": f"ops.causal_conv1d, width {config.d_conv}",
    }
  ]


def attention_kernels(
  config, mesh: dict[str, int], batch_size: int, seq_len: int, *, packed: bool, kernels=None
) -> list[dict[str, Any]]:
  """The kernel each attention of a training step runs on each backend (linear attention's chunked
  form, the config's ``attention_impl``, else what the backend with the kernel table ``kernels``
  chooses, ``Backend.choose_attention``), for one device's share: ``[{"attention", "shape"
  [B, T, N, H], "dtype", "kernels": {platform: kernel}}]``. The mask parts are the ones the task
  and model pass (GPT: causal, the sliding window, and the segment ids of a task that packs
  documents (``packed``); BERT: key padding; Seq2Seq: padding, causal decoder self-attention,
  cross-attention)."""
  rows_per_device = max(1, batch_size // parallel.batch_shards(mesh))
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
    case "MambaConfig":  # a hybrid's attention layers (causal, packed documents)
      if "attention" in config.layer_kinds:
        calls.append(
          ("self-attention", seq_len, seq_len, dict(causal=True, segment_ids=packed, bias=False))
        )
    case "GPTConfig":
      # Each distinct layer window (layer_types: sliding and full layers) is its own call.
      cap = dict(softcap=True) if config.attn_softcap is not None else {}
      windows = sorted(set(config.layer_windows()), key=lambda w: -1 if w is None else w)
      for w in windows:
        name = "self-attention" if len(windows) == 1 else f"self-attention (window {w})"
        calls.append(
          (
            name,
            seq_len,
            seq_len,
            dict(causal=True, window=w, segment_ids=packed, bias=bias, **cap),
          )
        )
    case "BERTConfig":
      calls.append(("self-attention", seq_len, seq_len, dict(kv_valid=True)))
    case _:
      calls.append(("encoder self-attention", seq_len, seq_len, dict(kv_valid=True, bias=bias)))
      calls.append(("decoder self-attention", seq_len, seq_len, dict(causal=True, bias=bias)))
      calls.append(("cross-attention", seq_len, seq_len, dict(kv_valid=True)))
  dropout = getattr(config, "attention_dropout_rate", 0.0) > 0.0
  out = []
  for name, t, s, parts in calls:
    q, k = shapes(t, s)
    chosen = {
      p: _kernel(
        config,
        q,
        k,
        backends.for_platform(p, kernels),
        mesh.get("sequence", 1),
        dict(parts, dropout=dropout),
      )
      for p in ("tpu", "gpu", "cpu")
    }
    out.append({"attention": name, "shape": list(q.shape), "dtype": str(dtype), "kernels": chosen})
  return out


def _kernel(config, q, k, backend: backends.Backend, sequence_shards: int, parts: dict) -> str:
  """What one attention of ``config`` runs on ``backend``, as ``layers.Attention`` decides: linear
  attention's chunked form, ring attention over a sequence axis, the kernel the config forces
  (``attention_impl``), else the backend's choice."""
  linear = config.linear_kind() if hasattr(config, "linear_kind") else None
  if linear is not None:
    decay = getattr(config, "linear_decay", None)
    return (
      f"linear (chunks of {linear.chunk_size}" + ("" if decay is None else f", decay {decay}") + ")"
    )
  choice = backend.choose_attention(q, k, k, sequence_shards=sequence_shards, **parts)
  return choice if choice == "ring" else (config.attention_impl or choice)


def format_report(report: dict[str, Any]) -> str:
  def gib(n):
    return f"{n / 2**30:10.3f} GiB"

  # The expert axis is named when it splits something (older reports have no such axis).
  mesh = " x ".join(f"{k}={v}" for k, v in report["mesh"].items() if k != "expert" or v > 1)
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
  ds = report.get("dataset")
  if ds:
    what = ds["missing"] if "missing" in ds else estimate.describe_facts(ds)
    lines.append(f"  dataset {ds['path']}: {what}")
  ld = report.get("loader")
  if ld:
    lines.append(_loader_line(ld))
  for m in report.get("mixers") or ():
    lines.append(
      f"  layers {', '.join(map(str, m['layers']))}: {m['mixer']} mixer, {m['op']}: "
      f"{m['detail']}; {m['conv']}"
    )
  x = report.get("experts")
  if x:
    exchange = (
      f"all-to-all of [{x['expert_shards']}, {x['send_rows'] // x['expert_shards']}, D] rows "
      f"({gib(x['exchange_bytes']).strip()} each way per layer)"
      if x["send_rows"]
      else "no exchange (one expert shard)"
    )
    lines.append(
      f"  experts: {x['experts']} ({x['per_device']} per device), top-{x['top_k']} of "
      f"{x['tokens']} tokens per device; {exchange}"
    )
  if report.get("attention"):
    lines.append("  attention kernel per backend (Backend.choose_attention), one device's share:")
    for a in report["attention"]:
      kernels = ", ".join(f"{p} {k}" for p, k in a["kernels"].items())
      lines.append(
        f"    {a['attention']:<24s}[{', '.join(map(str, a['shape']))}] {a['dtype']}: {kernels}"
      )
  return "\n".join(lines)


def _loader_line(ld: dict[str, Any]) -> str:
  if "missing" in ld:
    return f"  loader: not timed ({ld['missing']})"
  per = f"{ld['tokens_per_step']:,} tokens a step per host ({ld['hosts']} here)"
  got = f"measured {ld['measured']:,.0f} tokens/s (batch_at, {ld['steps_timed']} steps)"
  if ld["need"] is None:
    fastest = ld["tokens_per_step"] / ld["measured"]
    return f"  loader: {per}; {got}: feeds steps of {fastest:.3g} s or more"
  ratio = ld["measured"] / ld["need"]
  verdict = "enough" if ratio >= 1 else f"{1 / ratio:.3g}x too slow"
  return (
    f"  loader: {per}; needs {ld['need']:,.0f} tokens/s at train.target_step_time="
    f"{ld['target_step_time']} s; {got}: {verdict}"
  )
