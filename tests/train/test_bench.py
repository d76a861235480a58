"""experiments/bench_train.py: runs for each family and reports positive, self-consistent numbers."""

import json
import math
import os
import subprocess
import sys

import pytest

REPO = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
SCRIPT = os.path.join(REPO, "experiments", "bench_train.py")

CASES = {  # preset: (extra args, family, tokens per row)
    "gpt2-tiny": ((), "GPTConfig", 16),
    "t5-tiny": ((), "Seq2SeqConfig", 32),                    # source + target tokens
    "bert-tiny": (("--vocab-size", "512"), "BERTConfig", 16),
}


@pytest.fixture(scope="module")
def reports(tmp_path_factory):
  """Runs the three benchmarks side by side (separate interpreters) and collects their JSON."""
  root = tmp_path_factory.mktemp("bench")
  procs = {}
  for preset, (extra, _, _) in CASES.items():
    out = root / f"{preset}.json"
    cmd = [sys.executable, SCRIPT, "--preset", preset, "--batch-size", "2", "--seq-len", "16",
           "--steps", "2", "--warmup", "1", "--matmul-size", "256", "--matmul-reps", "2",
           "--out", str(out), *extra]
    procs[preset] = (subprocess.Popen(cmd, cwd=REPO, stdout=subprocess.PIPE,
                                      stderr=subprocess.PIPE, text=True), out)
  results = {}
  for preset, (proc, out) in procs.items():
    stdout, stderr = proc.communicate(timeout=180)
    results[preset] = (proc.returncode, stdout, stderr, out)
  return results


@pytest.mark.parametrize("preset", list(CASES))
def test_bench_train_reports(reports, preset):
  extra, family, tokens_per_row = CASES[preset]
  rc, stdout, stderr, out = reports[preset]
  assert rc == 0, stderr[-3000:]
  r = json.loads(stdout)
  assert json.loads(out.read_text()) == r
  assert r["preset"] == preset and r["family"] == family
  assert r["batch_size"] == 2 and r["seq_len"] == 16 and r["dtype"] == "float32"
  assert r["devices"]["count"] >= 1 and r["devices"]["platform"]
  assert r["versions"]["jax"]
  assert r["config"]["params"] > r["config"]["non_embedding_params"] > 0
  if extra:
    assert r["config"]["vocab_size"] == 512
  for key in ("compile_s", "first_step_s", "median_step_s", "tokens_per_sec", "flops_per_token",
              "model_flops_per_sec", "mfu"):
    assert r[key] > 0 and math.isfinite(r[key]), key
  for dt in ("float32", "bfloat16"):
    assert r["matmul_flops_per_sec"][dt] > 0
  steps = r["step_s"]
  assert len(steps["all"]) == 2
  assert steps["min"] <= steps["median"] <= steps["max"]
  assert steps["median"] == r["median_step_s"]
  assert r["tokens_per_step"] == 2 * tokens_per_row
  assert r["tokens_per_sec"] == pytest.approx(r["tokens_per_step"] / r["median_step_s"], rel=1e-9)
  assert r["model_flops_per_sec"] == pytest.approx(r["flops_per_token"] * r["tokens_per_sec"],
                                                   rel=1e-9)
  assert r["mfu"] == pytest.approx(r["model_flops_per_sec"] / r["matmul_flops_per_sec"]["float32"],
                                   rel=1e-9)
  assert math.isfinite(r["final_loss"])
