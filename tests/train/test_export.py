"""The pod recipes' train steps exported for TPUs and NVIDIA GPUs from this CPU (``train.export``).

The TPU steps lower on a ``jax.sharding.AbstractMesh`` of the recipes' real 64-device layout, in
this process (about 7 s each; layers are scanned on a TPU, so the full models trace once). The
CUDA steps need devices behind the mesh: tests/parallel/test_export_cuda.py exports them on 8
simulated devices.
"""

import functools
import os
import re

import pytest
from jax.sharding import PartitionSpec as P

from transformer_jax.train import export, load_experiment

REPO = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
XL = os.path.join(REPO, "experiments", "gpt2_xl_pod.yaml")
LLAMA = os.path.join(REPO, "experiments", "llama3_8b_fsdp.yaml")
SPLASH = {
  "splash_mha_fwd_segmented_residuals",
  "splash_mha_dq_segmented_no_residuals",
  "splash_mha_dkv_segmented_no_residuals",
}


def _args(text: str) -> dict[str, str]:
  """Argument name -> its sharding as the module's main function declares it (read here
  independently of ``export.signature``)."""
  main = next(line for line in text.splitlines() if "func.func public @main(" in line)
  out = {}
  for attrs, name in re.findall(r"%arg\d+: tensor<[^>]*>(.*?)loc\(\"([^\"]*)\"\)", main):
    found = re.search(r"#sdy\.sharding<@mesh, (\[.*?\])>", attrs)
    out[name] = found.group(1) if found else None
  return out


@pytest.fixture(scope="module", params=["gpt2_xl", "llama3_8b"])
def tpu_step(request):
  path = {"gpt2_xl": XL, "llama3_8b": LLAMA}[request.param]
  return request.param, export.export_train_step(load_experiment(path, []), "tpu")


def test_tpu_step_holds_splash_the_planned_shardings_and_no_host_transfer(tpu_step):
  name, step = tpu_step
  report = export.inspect(step)
  assert step.exported.platforms == ("tpu",) and step.exported.nr_devices == 64
  assert step.abstract_mesh
  # Attention is Pallas splash, forward (twice: remat recomputes it) and both backward kernels;
  # nothing else leaves XLA.
  assert report["custom_calls"] == {"tpu_custom_call": 4}
  assert set(report["kernels"]) == SPLASH
  assert report["host_transfers"] == [] and report["sharding_mismatches"] == []
  assert not re.search(r"callback|outfeed|infeed|stablehlo\.(send|recv)", step.text)
  # FSDP as the rules table plans it: parameter rows or columns split over fsdp, AdamW's moments
  # like their parameters, the batch's rows over data x fsdp (no expert axis: a dense model).
  args = _args(step.text)
  tokens = args["batch['tokens']"]
  assert tokens == '[{"data", "fsdp"}, {}]'
  embed = "state.params['embed']['embedding'].value"
  assert args[embed] == '[{}, {"fsdp"}]'  # [V, D]: D split
  moment = "state.opt_state[1][0].mu['embed']['embedding'].value"
  assert args[moment] == args[embed]
  kernel = {"gpt2_xl": "attn']['query']['kernel']", "llama3_8b": "attn']['query']['kernel']"}[name]
  query = next(v for k, v in args.items() if k.startswith("state.params") and kernel in k)
  assert query == '[{}, {"fsdp"}, {}, {}]'  # [L, D, N, H]: D split


def test_a_step_that_leaves_the_plan_is_reported(tpu_step):
  # The report can fail: a plan that asks for another sharding, and a module holding a callback.
  _, step = tpu_step
  wrong = tuple((n, P("tensor") if "embedding" in n else s) for n, s in step.planned)
  bad = export.inspect(
    export.ExportedStep(step.exported, "tpu", step.mesh, True, wrong, step.planned_outputs)
  )
  assert bad["sharding_mismatches"] and not export.holds(bad)
  assert all("embedding" in m for m in bad["sharding_mismatches"])

  class WithCallback:
    nr_devices = 1
    mlir_module = staticmethod(
      lambda: step.text.replace("@tpu_custom_call", "@xla_ffi_python_cpu_callback", 1)
    )

  host = export.inspect(
    export.ExportedStep(WithCallback(), "tpu", step.mesh, True, step.planned, step.planned_outputs)
  )
  assert host["host_transfers"] == ["xla_ffi_python_cpu_callback"] and not export.holds(host)


def test_cuda_needs_the_mesh_devices(monkeypatch):
  with pytest.raises(ValueError, match=r"--export-for cuda needs the mesh's 64 devices"):
    export.export_train_step(load_experiment(XL, []), "cuda")
  with pytest.raises(ValueError, match=r"--export-for 'rocm': must be one of tpu, cuda"):
    export.export_train_step(load_experiment(XL, []), "rocm")


MAMBA = os.path.join(REPO, "experiments", "mamba_tiny.yaml")
HYBRID = os.path.join(REPO, "experiments", "hybrid_tiny.yaml")


@functools.cache
def _exported(path: str, platform: str):
  """The experiment's step exported once per test process (about 3 s each)."""
  return export.export_train_step(load_experiment(path, []), platform)


@pytest.mark.parametrize("platform", ["tpu", "cuda"])
@pytest.mark.parametrize("path", [MAMBA, HYBRID], ids=["mamba_tiny", "hybrid_tiny"])
def test_mamba_experiments_export_without_the_positions_they_do_not_read(path, platform):
  # A Mamba model reads no positions: jax.jit leaves that batch input out of the module, and the
  # plan the report checks against leaves it out too.
  step = _exported(path, platform)
  report = export.inspect(step)
  assert report["sharding_mismatches"] == [] and report["host_transfers"] == []
  assert export.holds(report)
  assert step.unused_inputs == ("batch['positions']",)
  args = _args(step.text)
  assert "batch['positions']" not in args and "batch['tokens']" in args
  assert report["inputs"] == len(step.planned) == len(step.exported.in_avals) - 1


def test_mamba2_with_the_pallas_scan_exports_its_kernel_for_tpu_and_is_refused_for_cuda():
  from jax._src.pallas.mosaic import tpu_info

  pallas = ["model.mixer=mamba2", "model.ssm_impl=pallas"]
  exp = load_experiment(MAMBA, [*pallas, "mesh.data=1"])
  step = export.export_train_step(exp, "tpu")
  report = export.inspect(step)
  # The layers are scanned on a TPU: the kernel's forward once in the loop body (its gradient is
  # the pure form's).
  assert report["custom_calls"] == {"tpu_custom_call": 1}
  assert report["kernels"] == {"ssd_chunked_scan": 1}
  assert export.holds(report)
  assert "cpu" not in tpu_info.registry  # the stand-in chip is gone after the export
  with pytest.raises(ValueError, match=r"--export-for cuda: model\.ssm_impl: pallas .* set "):
    export.export_train_step(exp, "cuda")
  # XLA cannot partition a Mosaic kernel: over a mesh, the export says so before tracing.
  wide = load_experiment(MAMBA, [*pallas, "mesh.data=8"])
  with pytest.raises(ValueError, match=r"pallas on a mesh of 8 devices: .* set model\.ssm_impl"):
    export.export_train_step(wide, "tpu")


def test_the_serialized_module_is_written_and_reads_back(tmp_path):
  import jax

  step = _exported(MAMBA, "tpu")
  report = export.write(step, str(tmp_path), "mamba_tiny")
  path = tmp_path / "mamba_tiny.tpu.jax_exported"
  assert "serialized" not in report and str(path) in report["files"]
  back = jax.export.deserialize(path.read_bytes())
  assert back.platforms == ("tpu",) and back.mlir_module() == step.text
  for got, want in (
    (back.in_avals, step.exported.in_avals),
    (back.out_avals, step.exported.out_avals),
  ):
    assert [(a.shape, a.dtype) for a in got] == [(a.shape, a.dtype) for a in want]
  assert back.module_kept_var_idx == step.exported.module_kept_var_idx
  assert back.in_tree.num_leaves == len(step.exported.in_avals)
