"""Where a step's device time goes: the kernels of a few steps, traced and summed by kind.

``jax_kernels`` traces a JAX callable with ``jax.profiler`` (its ``*.trace.json.gz``), and
``torch_kernels`` a PyTorch callable with ``torch.profiler`` (its Chrome trace); both return
``summarize``'s dict: device milliseconds per step in all and by kind (``KINDS``), the span
from the first kernel to the last, the busiest kernels, and the trace's threads. ``tjax bench
train --profile N`` records one per side.

Only GPU kernels are counted: on a CPU or TPU the summary has no kernels (its ``threads`` still
list what the trace held).
"""

from __future__ import annotations

import collections
import glob
import gzip
import json
import os
import re
import shutil
import tempfile

import jax

# (kind, pattern on the lower-cased kernel name), first match wins.
KINDS = (
  ("attention", re.compile(r"fmha|flash|sdpa|attention|cudnn_generated|fprop_kernel|bprop")),
  (
    "matmul",
    re.compile(
      r"gemm|cutlass|xmma|nvjet|cublas|matmul|sm\d+_.*(mma|wgmma)|tem_fused_mm"
      r"|triton_mm|triton_tem"
    ),
  ),
  ("optimizer", re.compile(r"adam|multi_tensor")),
  # Fused kernels (torch.compile's Triton, XLA's fusions) even where a cast ("_to_copy") is fused.
  ("other", re.compile(r"^triton_(poi|per|red)_|fusion")),
  ("copy", re.compile(r"memcpy|memset|copy")),
)


def kind_of(name: str) -> str:
  """The kind (``KINDS``) of a kernel named ``name``; "other" (element-wise and reductions)."""
  low = name.lower()
  for kind, pattern in KINDS:
    if pattern.search(low):
      return kind
  return "other"


def summarize(
  kernels: list[tuple[str, float, float]], steps: int, threads: dict | None = None, top: int = 30
) -> dict:
  """``kernels``: (name, start, duration), in microseconds, of every device kernel in ``steps``
  steps.

  Returns ``{"steps", "kernels_per_step", "device_ms_per_step", "span_ms_per_step",
  "by_kind_ms_per_step", "top": [{"name", "kind", "calls_per_step", "ms_per_step"}, ...],
  "threads"}``; ``span_ms_per_step`` is first kernel start to last kernel end over ``steps``, so
  that ``span - device`` is the time the device waited (between kernels and between steps).
  """
  total = collections.Counter()
  calls = collections.Counter()
  for name, _, us in kernels:
    total[name] += us
    calls[name] += 1
  by_kind = collections.Counter()
  for name, us in total.items():
    by_kind[kind_of(name)] += us
  n = max(steps, 1)
  per = lambda us: us / 1e3 / n  # noqa: E731
  span = max(ts + us for _, ts, us in kernels) - min(ts for _, ts, _ in kernels) if kernels else 0.0
  return {
    "steps": steps,
    "kernels_per_step": len(kernels) / n,
    "device_ms_per_step": per(sum(total.values())),
    "span_ms_per_step": per(span),
    "by_kind_ms_per_step": {k: per(v) for k, v in by_kind.most_common()},
    "top": [
      {
        "name": name[:200],
        "kind": kind_of(name),
        "calls_per_step": calls[name] / n,
        "ms_per_step": per(us),
      }
      for name, us in total.most_common(top)
    ],
    "threads": threads or {},
  }


def _gpu_events(trace: dict) -> tuple[list[tuple[str, float, float]], dict]:
  """Kernels (name, start, duration) on a JAX trace's GPU streams, and every thread's event count
  and microseconds."""
  events = trace.get("traceEvents", [])
  process = {
    e["pid"]: e["args"]["name"]
    for e in events
    if e.get("ph") == "M" and e.get("name") == "process_name"
  }
  thread = {
    (e["pid"], e["tid"]): e["args"]["name"]
    for e in events
    if e.get("ph") == "M" and e.get("name") == "thread_name"
  }
  name_of = lambda e: str(thread.get((e["pid"], e.get("tid")), e.get("tid")))  # noqa: E731
  threads = collections.defaultdict(lambda: [0, 0.0])
  spans = [e for e in events if e.get("ph") == "X"]
  for e in spans:
    key = f"{process.get(e['pid'], e['pid'])} | {name_of(e)}"
    threads[key][0] += 1
    threads[key][1] += float(e.get("dur", 0.0))
  on_gpu = [e for e in spans if str(process.get(e["pid"], "")).startswith("/device:GPU")]
  streams = [e for e in on_gpu if name_of(e).startswith("Stream")]
  chosen = streams or [
    e for e in on_gpu if not name_of(e).startswith(("XLA", "TensorFlow", "Steps", "Framework"))
  ]
  return (
    [(e["name"], float(e["ts"]), float(e.get("dur", 0.0))) for e in chosen],
    {k: {"events": n, "us": us} for k, (n, us) in threads.items()},
  )


def jax_kernels(fn, steps: int, keep: str | None = None) -> dict:
  """Runs ``fn()`` (which must block until its device work is done) ``steps`` times under
  ``jax.profiler`` and summarizes the GPU kernels; with ``keep`` the trace (Chrome format,
  gzipped) is copied to that path."""

  with tempfile.TemporaryDirectory() as tmp:
    with jax.profiler.trace(tmp):
      for _ in range(steps):
        fn()
    found = glob.glob(os.path.join(tmp, "plugins", "profile", "*", "*.trace.json.gz"))
    if not found:
      return {"error": "jax.profiler wrote no *.trace.json.gz"}
    if keep:
      shutil.copyfile(found[0], keep)
    with gzip.open(found[0], "rt") as f:
      kernels, threads = _gpu_events(json.load(f))
  return summarize(kernels, steps, threads)


def torch_kernels(fn, steps: int, keep: str | None = None) -> dict:
  """Runs ``fn()`` ``steps`` times under ``torch.profiler`` (CPU and CUDA activity) and summarizes
  the CUDA kernels, memcpys and memsets; with ``keep`` the Chrome trace is written gzipped to
  that path."""
  import torch  # noqa: PLC0415 - torch is optional (the hf extra)
  from torch.profiler import ProfilerActivity, profile  # noqa: PLC0415 - torch is optional (the hf extra)

  activities = [ProfilerActivity.CPU]
  if torch.cuda.is_available():
    activities.append(ProfilerActivity.CUDA)
  with tempfile.TemporaryDirectory() as tmp:
    path = os.path.join(tmp, "trace.json")
    with profile(activities=activities) as prof:
      for _ in range(steps):
        fn()
    prof.export_chrome_trace(path)
    with open(path) as f:
      trace = json.load(f)
  if keep:
    with gzip.open(keep, "wt") as f:
      json.dump(trace, f)
  events = trace.get("traceEvents", [])
  kinds = collections.Counter(e.get("cat") for e in events if e.get("ph") == "X")
  kernels = [
    (e["name"], float(e["ts"]), float(e.get("dur", 0.0)))
    for e in events
    if e.get("ph") == "X" and e.get("cat") in ("kernel", "gpu_memcpy", "gpu_memset")
  ]
  return summarize(kernels, steps, {f"cat {k}": {"events": n} for k, n in kinds.items()})
