"""An experiment's train step exported for TPUs or NVIDIA GPUs from any host (``jax.export``).

``tjax train CONFIG --export-for tpu|cuda`` (or :func:`export_train_step`) lowers the step a run of
``CONFIG`` would compile on its target, for the configured mesh, on a machine without that
accelerator: the kernels the table picks there (Pallas splash attention on a TPU, cuDNN attention
on a GPU), the parameter and optimizer-state shardings of the rules table, and nothing that goes
back to the host. :func:`inspect` reads those three properties off the exported module, so the
first time the program is lowered for a TPU pod is not the pod's first compile.

How the target is stood in for while tracing:

* ``jax.default_backend()`` answers the target's name (``"tpu"``, ``"gpu"``): the kernel table,
  ``scan_layers: auto`` and the layers read it when they trace. Not thread-safe: nothing else
  should trace in this process meanwhile.
* For ``cuda``, jax's cuDNN wrapper is told it runs on a Hopper GPU (compute capability 9.0) with
  cuDNN 9.10, where it asks the local GPU otherwise. jax gives cuDNN's attention calls no
  compatibility guarantee across jax versions, so they are exported with that check disabled by
  name: load the module with the jax version that wrote it.
* For ``tpu``, on a host without a TPU, Pallas' Mosaic lowering (``model.ssm_impl: pallas``) reads
  the chip from a TPU v5e (``TPU_TARGET``): the generation and the 8 x 128 vector registers, the
  same on every TPU since v4.
* The mesh: the process's own devices when it has as many as the mesh (``tjax train`` simulates
  them on CPU, as ``--dry-run`` does), else a ``jax.sharding.AbstractMesh`` of the same axes. The
  TPU step lowers on either; the CUDA step needs devices (jax partitions a cuDNN call against
  them while lowering).

The module holds the inputs the step reads: ``jax.jit`` drops the others (a Mamba model reads no
``positions``), and the report names them (``unused_inputs``); ``Exported.call`` takes them all.
The serialized module (``STEM.PLATFORM.jax_exported``, :func:`serialize`) needs the
``flatbuffers`` package, a dependency of this one; it takes and returns its arrays flat, in the
module's order.
"""

from __future__ import annotations

import contextlib
import dataclasses
import json
import os
import re
from collections import Counter
from typing import Any

import jax
from jax.sharding import AbstractMesh, PartitionSpec

from transformer_jax import parallel
from transformer_jax.train import step as step_lib
from transformer_jax.train.config import Experiment
from transformer_jax.train.plan import make_plan

# jax.export's platform names -> the kernel table's (ops.dispatch.PLATFORMS).
PLATFORMS = {"tpu": "tpu", "cuda": "gpu"}

# Custom-call targets and ops that move data between the device and the host while a step runs.
HOST_TARGETS = re.compile(r"callback|host|infeed|outfeed|MoveTo(Host|Device)", re.IGNORECASE)
HOST_OPS = ("stablehlo.send", "stablehlo.recv", "stablehlo.infeed", "stablehlo.outfeed")

# The compute capability and cuDNN version the CUDA export assumes (Hopper, cuDNN 9.10).
CUDA_TARGET = {"compute_capability": "9.0", "cudnn": 91000}

# The chip Pallas' Mosaic lowering reads when the TPU export runs on a host without one.
TPU_TARGET = {"chip": "TPU_V5E", "cores": 1}


@dataclasses.dataclass(frozen=True)
class ExportedStep:
  """A train step exported for ``platform``.

  Attributes:
    exported: the ``jax.export.Exported`` module.
    platform: ``"tpu"`` or ``"cuda"``.
    mesh: mesh axis -> size.
    abstract_mesh: True when no devices stood behind the mesh (``AbstractMesh``).
    planned: ``(name, PartitionSpec)`` per input, in the module's order: the state's shardings
      from the rules table, then the batch split over ``data`` and ``fsdp``.
    planned_outputs: the same per output: the new state's, then the metrics replicated.
    unused_inputs: the inputs the step does not read, which the module leaves out.
  """

  exported: Any
  platform: str
  mesh: dict[str, int]
  abstract_mesh: bool
  planned: tuple[tuple[str, PartitionSpec], ...]
  planned_outputs: tuple[tuple[str, PartitionSpec], ...]
  unused_inputs: tuple[str, ...] = ()

  @property
  def text(self) -> str:
    """The StableHLO module as text."""
    return self.exported.mlir_module()


@contextlib.contextmanager
def target(platform: str):
  """While tracing inside, the process answers as ``platform``'s accelerator (module docstring)."""
  if platform not in PLATFORMS:
    raise ValueError(f"--export-for {platform!r}: must be one of {', '.join(PLATFORMS)}")
  saved = [(jax, "default_backend", jax.default_backend)]
  jax.default_backend = lambda: PLATFORMS[platform]
  try:
    if platform == "cuda":
      from jax._src.cudnn import fused_attention_stablehlo as cudnn  # noqa: PLC0415 - exporting only

      from transformer_jax.backends import cudnn as cudnn_lib  # noqa: PLC0415 - exporting only

      want = tuple(int(p) for p in CUDA_TARGET["compute_capability"].split("."))
      for obj, name, value in (
        (cudnn, "check_cudnn_version", lambda: CUDA_TARGET["cudnn"]),
        (
          cudnn,
          "check_compute_capability",
          lambda capability: tuple(map(int, str(capability).split("."))) <= want,
        ),
        (
          cudnn,
          "is_cuda_compute_capability_equal",
          lambda capability: tuple(map(int, str(capability).split("."))) == want,
        ),
        (cudnn_lib, "ragged_layout", lambda: True),
      ):  # Hopper and later
        saved.append((obj, name, getattr(obj, name)))
        setattr(obj, name, value)
    with _tpu_chip() if platform == "tpu" else contextlib.nullcontext():
      yield
  finally:
    for obj, name, value in reversed(saved):
      setattr(obj, name, value)


@contextlib.contextmanager
def _tpu_chip():
  """Inside, Pallas' Mosaic lowering reads a ``TPU_TARGET`` chip where this host has no TPU (it
  looks the local device's kind up in its table of chips, then in ``tpu_info.registry``)."""
  from jax._src.pallas.mosaic import tpu_info  # noqa: PLC0415 - exporting only

  kind = jax.local_devices()[0].device_kind
  if tpu_info.chip_version_from_device_kind(kind) is not None or kind in tpu_info.registry:
    yield
    return
  chip = tpu_info.ChipVersion[TPU_TARGET["chip"]]
  tpu_info.registry[kind] = lambda: tpu_info.get_tpu_info_for_chip(chip, TPU_TARGET["cores"])
  tpu_info.get_tpu_info.cache_clear()
  try:
    yield
  finally:
    del tpu_info.registry[kind]
    tpu_info.get_tpu_info.cache_clear()


def _cudnn_targets() -> list[str]:
  """The custom-call targets of jax's cuDNN attention: the only ones in these steps without
  jax's compatibility guarantee (module docstring)."""
  from jax._src.cudnn import fused_attention_stablehlo as cudnn  # noqa: PLC0415 - exporting only

  return sorted(set(cudnn._custom_name_maps.values()))  # noqa: SLF001 - jax's own table


def _mesh(exp: Experiment):
  """The experiment's mesh on this process's devices, or an ``AbstractMesh`` where it has fewer.

  Raises:
    ValueError: the mesh has a -1 axis and too few devices to resolve it.
  """
  m = exp.mesh
  shape = {
    "data": m.data,
    "fsdp": m.fsdp,
    "tensor": m.tensor,
    "sequence": m.sequence,
    "expert": m.expert,
  }
  if -1 not in shape.values():
    wanted = 1
    for size in shape.values():
      wanted *= size
    if jax.device_count() < wanted:
      names = parallel.mesh_axes_of(shape)
      return AbstractMesh(tuple(shape[a] for a in names), names)
  return parallel.make_mesh(shape)


def _named(tree, prefix: str = "") -> list[tuple[str, Any]]:
  """``(name, leaf)`` per leaf of ``tree``, named as jax names a jitted function's arguments
  (``state.params['embed']['embedding'].value``) after ``prefix``."""
  return [
    (prefix + jax.tree_util.keystr(path), leaf)
    for path, leaf in jax.tree_util.tree_flatten_with_path(tree)[0]
  ]


def check_kernels(model_config, platform: str, devices: int) -> None:
  """Refuses, before anything is traced, a model asking for a kernel ``platform`` cannot run:
  Mamba-2's Pallas scan (``model.ssm_impl: pallas``) is a TPU kernel, which elsewhere runs in
  Pallas' TPU interpreter, on the host; and XLA cannot partition it over a mesh of ``devices`` > 1
  (the layer calls it outside ``shard_map``).

  Raises:
    ValueError: naming the setting to change.
  """
  if getattr(model_config, "ssm_impl", None) == "pallas" and model_config.mixer == "mamba2":
    if platform == "tpu" and devices > 1:
      raise ValueError(
        f"--export-for tpu: model.ssm_impl: pallas on a mesh of {devices} devices: XLA cannot "
        f"partition the Pallas kernel (Mosaic) and the layer calls it outside shard_map; set "
        f"model.ssm_impl: xla (or auto), or a 1-device mesh"
      )
    if platform != "tpu":
      raise ValueError(
        f"--export-for {platform}: model.ssm_impl: pallas is a Pallas TPU kernel (Mamba-2's "
        f"chunked scan, ops.ssm_pallas), which off a TPU runs in Pallas' interpreter on the "
        f"host: set model.ssm_impl: xla (or auto) to export for {platform}"
      )


def export_train_step(exp: Experiment, platform: str) -> ExportedStep:
  """``exp``'s train step exported for ``platform`` (``"tpu"``, ``"cuda"``) on its mesh.

  The step is the one the run's plan makes (``make_plan(exp, purpose="export")``: the same
  checks, model, task, method and step; ``train.microbatches: auto`` as 1), jitted with the
  state's and the batch's shardings and the state donated, as ``step.jit_train_step`` does;
  parameters, optimizer state and batch are shapes only.

  Raises:
    ValueError: an unknown platform, a model or batch that does not fit the mesh (named by
      ``parallel.check_config``), or a CUDA export without the mesh's devices.
  """
  with target(platform):
    mesh = _mesh(exp)
    abstract = isinstance(mesh, AbstractMesh)
    if abstract and platform == "cuda":
      raise ValueError(
        f"--export-for cuda needs the mesh's {mesh.size} devices (jax partitions cuDNN "
        f"attention against devices while lowering) and this process has "
        f"{jax.device_count()}: `tjax train CONFIG --export-for cuda` simulates them"
      )
    plan = make_plan(exp, purpose="export", mesh=mesh)
    check_kernels(plan.model_config, platform, mesh.size)
    t = plan.exp.train
    state = plan.method.abstract_state(plan.optimizer, mesh)
    shardings = step_lib.state_shardings(state, mesh)
    batch_sharding = parallel.batch_sharding(mesh)
    batch = {
      k: jax.ShapeDtypeStruct(v.shape, v.dtype, sharding=batch_sharding)
      for k, v in plan.task.batch_shapes(t.batch_size, t.seq_len).items()
    }
    step = plan.train_step()
    jitted = jax.jit(
      step,
      in_shardings=(shardings, batch_sharding),
      out_shardings=(shardings, parallel.replicated(mesh)),
      donate_argnums=(0,),
    )
    checks = [
      jax.export.DisabledSafetyCheck.custom_call(name)
      for name in (_cudnn_targets() if platform == "cuda" else ())
    ]
    exported = jax.export.export(jitted, platforms=(platform,), disabled_checks=checks)(
      state, batch
    )
  inputs = _named(shardings, "state") + _named({k: batch_sharding for k in batch}, "batch")
  if len(inputs) != len(exported.in_avals):
    raise AssertionError(f"{len(exported.in_avals)} inputs exported, {len(inputs)} named")
  kept = set(exported.module_kept_var_idx)
  state_out = _named(shardings, "state")
  metrics = len(exported.out_avals) - len(state_out)
  outputs = state_out + [(f"metrics[{i}]", parallel.replicated(mesh)) for i in range(metrics)]
  return ExportedStep(
    exported=exported,
    platform=platform,
    mesh=dict(mesh.shape),
    abstract_mesh=abstract,
    planned=tuple((n, s.spec) for i, (n, s) in enumerate(inputs) if i in kept),
    planned_outputs=tuple((n, s.spec) for n, s in outputs),
    unused_inputs=tuple(n for i, (n, _) in enumerate(inputs) if i not in kept),
  )


def sdy_spec(spec: PartitionSpec, rank: int) -> str:
  """``spec`` as Shardy prints a closed sharding of a rank-``rank`` array: ``[{}, {"fsdp"}]``."""
  dims = list(spec) + [None] * (rank - len(spec))
  out = []
  for d in dims:
    axes = [] if d is None else [d] if isinstance(d, str) else list(d)
    out.append("{" + ", ".join(f'"{a}"' for a in axes) + "}")
  return "[" + ", ".join(out) + "]"


_ARG = re.compile(r"%arg\d+: tensor<([^>]*)>(.*?)loc\(\"([^\"]*)\"\)")
_RESULT = re.compile(r"tensor<([^>]*)> \{([^{}]*(?:\{[^{}]*\}[^{}]*)*)\}")
_SDY = re.compile(r"sdy\.sharding = #sdy\.sharding<@\w+, (\[.*?\])>")


def _rank(tensor_type: str) -> int:
  return tensor_type.count("x")  # "48x1600xf32": two dimensions; "i32": none


def signature(text: str) -> tuple[list[tuple[str, int, str]], list[tuple[str, int, str]]]:
  """The public ``main``'s ``(name, rank, sharding)`` per argument and per result, the sharding as
  Shardy prints it (``[{}, {"fsdp"}]``; ``""`` where none is given).

  Raises:
    ValueError: the module has no public ``main``.
  """
  main = next((line for line in text.splitlines() if "func.func public @main(" in line), None)
  if main is None:
    raise ValueError("the exported module has no public main function")
  head, _, tail = main.partition(") -> (")
  args = []
  for shape, attrs, name in _ARG.findall(head):
    found = _SDY.search(attrs)
    args.append((name, _rank(shape), found.group(1) if found else ""))
  results = []
  for shape, attrs in _RESULT.findall(tail):
    found = _SDY.search(attrs)
    info = re.search(r'jax\.result_info = "([^"]*)"', attrs)
    results.append((info.group(1) if info else "", _rank(shape), found.group(1) if found else ""))
  return args, results


def inspect(step: ExportedStep) -> dict[str, Any]:
  """What the exported module holds: ``custom_calls`` (target -> count), ``kernels`` (a TPU
  custom call's ``kernel_name`` -> count), ``host_transfers`` (host callbacks, send/recv,
  in/outfeed, host offloading; should be empty) and ``sharding_mismatches`` (every input or
  output whose sharding differs from the plan, or that has none; should be empty)."""
  text = step.text
  calls = Counter(re.findall(r"custom_call @([\w$.]+)", text))
  kernels = Counter(re.findall(r'kernel_name = "(\w+)"', text))
  host = sorted(
    {t for t in calls if HOST_TARGETS.search(t)} | {op for op in HOST_OPS if op in text}
  )
  args, results = signature(text)
  mismatches = []
  for kind, got, want in (("input", args, step.planned), ("output", results, step.planned_outputs)):
    if len(got) != len(want):
      mismatches.append(f"{len(got)} {kind}s in the module, {len(want)} planned")
      continue
    for (_, rank, sharding), (name, spec) in zip(got, want):
      planned = sdy_spec(spec, rank)
      if sharding != planned:
        mismatches.append(f"{kind} {name}: {sharding or 'no sharding'}, planned {planned}")
  return {
    "platform": step.platform,
    "mesh": step.mesh,
    "abstract_mesh": step.abstract_mesh,
    "devices": step.exported.nr_devices,
    "custom_calls": dict(calls),
    "kernels": dict(kernels),
    "host_transfers": host,
    "inputs": len(args),
    "unused_inputs": list(step.unused_inputs),
    "outputs": len(results),
    "sharding_mismatches": mismatches,
  }


def serialize(step: ExportedStep) -> bytes:
  """The exported step as ``jax.export.serialize`` writes it, taking and returning flat tuples of
  arrays: jax serializes only the pytree types registered with it, and the state's flax variables
  and optax states are not. ``jax.export.deserialize`` reads it back; ``call(*inputs)`` takes the
  state's leaves, then the batch's (``jax.tree.leaves((state, batch))``), and returns the new
  state's leaves, then the metrics'.

  Raises:
    ImportError: the ``flatbuffers`` package is missing.
  """
  exported = step.exported
  flat = dataclasses.replace(
    exported,
    in_tree=jax.tree.structure((tuple(range(len(exported.in_avals))), {})),
    out_tree=jax.tree.structure(tuple(range(len(exported.out_avals)))),
  )
  return flat.serialize()


def write(step: ExportedStep, out_dir: str, stem: str) -> dict[str, Any]:
  """Writes ``STEM.PLATFORM.mlir`` (the StableHLO text), ``STEM.PLATFORM.json`` (:func:`inspect`
  with ``files``) and ``STEM.PLATFORM.jax_exported`` (:func:`serialize`; where ``flatbuffers`` is
  missing, the report says why it is not written); returns the report."""
  os.makedirs(out_dir, exist_ok=True)
  base = os.path.join(out_dir, f"{stem}.{step.platform}")
  with open(base + ".mlir", "w") as f:
    f.write(step.text)
  report = inspect(step)
  report["files"] = [base + ".mlir", base + ".json"]
  try:
    blob = serialize(step)
  except ImportError as e:  # jax serializes with flatbuffers (a dependency of transformer-jax)
    report["serialized"] = f"not written: {e}"
  else:
    with open(base + ".jax_exported", "wb") as f:
      f.write(blob)
    report["files"].append(base + ".jax_exported")
  with open(base + ".json", "w") as f:
    f.write(json.dumps(report, indent=2) + "\n")
  return report


def holds(report: dict[str, Any]) -> bool:
  """The exported step keeps the plan: no host transfers, every sharding as planned."""
  return not report["host_transfers"] and not report["sharding_mismatches"]


def format_report(report: dict[str, Any]) -> str:
  mesh = " x ".join(f"{k}={v}" for k, v in report["mesh"].items() if k != "expert" or v > 1)
  kind = "abstract mesh" if report["abstract_mesh"] else "simulated devices"
  calls = ", ".join(f"{k} x{v}" for k, v in sorted(report["custom_calls"].items())) or "none"
  lines = [
    f"train step exported for {report['platform']}: mesh {mesh} ({report['devices']} "
    f"devices, {kind}), {report['inputs']} inputs, {report['outputs']} outputs",
    f"  custom calls: {calls}",
  ]
  if report["kernels"]:
    lines.append(
      "  kernels: " + ", ".join(f"{k} x{v}" for k, v in sorted(report["kernels"].items()))
    )
  if report.get("unused_inputs"):
    lines.append(
      "  inputs the step does not read (not in the module): " + ", ".join(report["unused_inputs"])
    )
  lines.append("  host transfers: " + (", ".join(report["host_transfers"]) or "none"))
  bad = report["sharding_mismatches"]
  lines.append(
    "  shardings: "
    + ("as planned" if not bad else f"{len(bad)} differ from the plan: " + "; ".join(bad[:3]))
  )
  lines += [f"  wrote {p}" for p in report.get("files", [])]
  if "serialized" in report:
    lines.append(f"  serialized module {report['serialized']}")
  return "\n".join(lines)


def run(exp: Experiment, platform: str, out_dir: str, stem: str) -> int:
  """``tjax train CONFIG --export-for PLATFORM``: exports, writes, prints the report; 0 when the
  step keeps the plan (:func:`holds`), else 1."""
  report = write(export_train_step(exp, platform), out_dir, stem)
  print(format_report(report))
  return 0 if holds(report) else 1
