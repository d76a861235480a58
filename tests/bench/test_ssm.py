"""``tjax bench train`` and ``bench generate`` on Mamba presets: the same work as transformers'
PyTorch Mamba, in one run."""

import json

import pytest

from transformer_jax import cli


def _bench(tmp_path, *argv):
  out = tmp_path / "bench.json"
  assert cli.main(["bench", *argv, "--json", str(out)]) == 0
  return json.loads(out.read_text())


@pytest.mark.long
def test_train_against_transformers_mamba_does_the_same_work(tmp_path):
  pytest.importorskip("torch")
  r = _bench(
    tmp_path,
    "train",
    "--preset",
    "mamba-tiny",
    "--batch-size",
    "2",
    "--seq-len",
    "24",
    "--steps",
    "2",
    "--warmup",
    "0",
  )
  # Same weights (hf.save), tokens and loss: the first losses agree to float32 rounding.
  assert r["first_loss_diff_vs_torch"] < 1e-4
  assert r["ours"]["losses"] == pytest.approx(r["torch"]["losses"], abs=1e-3)
  med = {s: r[s]["step_s"]["median"] for s in ("ours", "torch")}
  assert r["speedup_vs_torch"] == pytest.approx(med["torch"] / med["ours"], rel=1e-9)
  assert 0 < r["ours"]["mfu"] and 0 < r["torch"]["mfu"]


@pytest.mark.long
def test_generate_against_transformers_mamba_gives_the_same_tokens(tmp_path):
  pytest.importorskip("transformers")
  r = _bench(
    tmp_path,
    "generate",
    "--preset",
    "mamba2-tiny",
    "--batch-sizes",
    "2",
    "--prompt-len",
    "5",
    "--new-tokens",
    "6",
    "--dtypes",
    "float32",
    "--reps",
    "1",
    "--ttft-reps",
    "1",
    "--torch-threads-alt",
    "0",
  )
  assert r["weights_max_abs_logit_diff_float32"] < 1e-4
  s = r["summary"]["float32_batch2"]
  assert s["tokens_equal"] and s["ours_tokens_per_sec"] > 0 and s["theirs_tokens_per_sec"] > 0
