"""The pod recipes' train steps exported for NVIDIA GPUs from this CPU: ``tjax train CONFIG
--export-for cuda``, in this process, on the 8 simulated devices (the recipes' widths and mesh
axes, their sizes cut to 8 devices). jax partitions a cuDNN call against devices while lowering,
so the CUDA export needs them; the TPU export runs on an abstract 64-device mesh
(tests/train/test_export.py)."""

import json
import os
import re

import pytest

from transformer_jax import cli

REPO = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))


@pytest.mark.parametrize(
  "name, mesh",
  [("gpt2_xl_pod", ["mesh.data=2", "mesh.fsdp=4"]), ("llama3_8b_fsdp", ["mesh.fsdp=8"])],
)
def test_cuda_step_holds_cudnn_the_planned_shardings_and_no_host_transfer(
  tmp_path, capsys, name, mesh
):
  config = os.path.join(REPO, "experiments", f"{name}.yaml")
  assert (
    cli.main(["train", config, "--export-for", "cuda", "--export-dir", str(tmp_path), *mesh]) == 0
  )
  out = capsys.readouterr().out
  assert "host transfers: none" in out and "shardings: as planned" in out
  report = json.loads((tmp_path / f"{name}.cuda.json").read_text())
  assert report["devices"] == 8 and not report["abstract_mesh"]
  # cuDNN's flash attention, forward (twice: remat recomputes it) and backward, nothing else.
  assert report["custom_calls"] == {
    "__cudnn$fmhaScaleBiasSoftmax": 2,
    "__cudnn$fmhaScaleBiasSoftmaxBackward": 1,
  }
  assert report["host_transfers"] == [] and report["sharding_mismatches"] == []
  text = (tmp_path / f"{name}.cuda.mlir").read_text()
  assert not re.search(r"callback|CustomSPMDPartitioning|outfeed|infeed", text)
  # Each call sees one device's rows: the global batch over data x fsdp = 8 devices.
  batch = {"gpt2_xl_pod": 512, "llama3_8b_fsdp": 256}[name] // 8
  rows = {
    int(re.search(r"\} : \(tensor<(\d+)x", line).group(1))
    for line in text.splitlines()
    if "custom_call @__cudnn$fmha" in line
  }
  assert rows == {batch}
  main = next(line for line in text.splitlines() if "func.func public @main(" in line)
  rows_over = r'\{"data", "fsdp"\}'  # a dense model's mesh has no expert axis
  tokens = r"sdy\.sharding<@mesh, \[" + rows_over + r""", \{\}\]>\} loc\("batch\['tokens'\]"\)"""
  assert re.search(tokens, main)
