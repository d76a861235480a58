"""``tjax bench``: the same work on both sides, numbers that agree with each other, JSON written."""

import json
import math

import pytest

from transformer_jax import cli


def _bench(tmp_path, *argv):
  out = tmp_path / "bench.json"
  assert cli.main(["bench", *argv, "--json", str(out)]) == 0
  return json.loads(out.read_text())


def test_train_against_torch_does_the_same_work(tmp_path, capsys):
  pytest.importorskip("torch")
  r = _bench(tmp_path, "train", "--preset", "gpt2-tiny", "--batch-size", "2", "--seq-len", "16",
             "--steps", "2", "--warmup", "0")
  # Same weights, tokens and loss: the first step's losses agree to float32 rounding, and AdamW
  # with the same settings keeps them together.
  assert r["first_loss_diff_vs_torch"] < 1e-4
  assert r["ours"]["losses"] == pytest.approx(r["torch"]["losses"], abs=1e-3)
  med = {s: r[s]["step_s"]["median"] for s in ("ours", "torch")}
  assert r["speedup_vs_torch"] == pytest.approx(med["torch"] / med["ours"], rel=1e-9)
  limit = r["limit"]["matmul"]["float32"]["flops_per_sec"]
  assert r["ours"]["mfu"] == pytest.approx(r["model_flops_per_step"] / med["ours"] / limit,
                                           rel=1e-9)
  assert r["limit"]["step_floor_s"] == pytest.approx(r["model_flops_per_step"] / limit, rel=1e-9)
  assert r["command"].startswith("tjax bench train --preset gpt2-tiny")
  assert r["machine"]["cpu"] and "cpu_flags" in r["machine"]
  assert "ours" in capsys.readouterr().out


@pytest.mark.parametrize("preset", ["bert-tiny", "t5-tiny"])
def test_train_runs_every_family_alone(tmp_path, preset):
  r = _bench(tmp_path, "train", "--preset", preset, "--batch-size", "2", "--seq-len", "16",
             "--steps", "1", "--warmup", "0", "--against", "none")
  assert math.isfinite(r["ours"]["losses"][-1]) and r["ours"]["mfu"] > 0
  assert "torch" not in r


def test_torch_rival_needs_a_gpt_preset(tmp_path, capsys):
  assert cli.main(["bench", "train", "--preset", "bert-tiny", "--json", str(tmp_path / "x")]) == 2
  assert "GPT presets" in capsys.readouterr().err


def test_attention_rows_per_implementation(tmp_path):
  r = _bench(tmp_path, "attention", "--lengths", "32,64", "--heads", "2", "--head-dim", "8",
             "--reps", "1")
  assert [(row["T"], row["implementation"]) for row in r["rows"]] == [
      (32, "xla"), (32, "chunked"), (64, "xla"), (64, "chunked")]
  for row in r["rows"]:
    assert row["fraction_of_matmul_limit"] == pytest.approx(
        row["useful_flops_per_sec"] / r["limit"]["matmul"]["flops_per_sec"], rel=1e-9)
