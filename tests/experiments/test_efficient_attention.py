"""experiments/efficient_attention.py: the LSH and masked-LM rows at matched sizes, and a run of
the new rows at a tiny size whose JSON the picture and ``tjax report`` read."""

import dataclasses
import json
import math
import os
import sys
import types

import pytest

from transformer_jax import report, viz

REPO = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
sys.path.insert(0, os.path.join(REPO, "experiments"))

import efficient_attention as ea  # noqa: E402
import efficient_attention_rows as rows  # noqa: E402

DEFAULTS = types.SimpleNamespace(  # the script's defaults for the sizes
  d_model=128, layers=3, heads=4, lsh_chunk=64, lsh_buckets=8, bigbird_block=64, linformer_rows=128
)


def test_the_lsh_row_has_the_gpts_size_and_the_encoders_share_their_weights():
  vocab = 4104
  gpt = rows.num_params(rows.config_for(DEFAULTS, vocab))
  lsh = rows.lsh_config(DEFAULTS, vocab)
  assert lsh.attn_layers == ("lsh",) * 3 and lsh.d_ff % 8 == 0
  assert abs(rows.num_params(lsh) / gpt - 1) < 0.02
  for other in (lsh.d_ff - 8, lsh.d_ff + 8):  # the nearest width
    assert abs(rows.num_params(dataclasses.replace(lsh, d_ff=other)) - gpt) > abs(
      rows.num_params(lsh) - gpt
    )
  enc = rows.encoder_configs(DEFAULTS, vocab, max_len=1024)
  full, bigbird, linformer = (
    rows.num_params(enc[k]) for k in ("mlm-full", "mlm-bigbird", "mlm-linformer")
  )
  assert full == bigbird
  assert linformer == full + 128 * 1024 * 3  # one [rows, max_len] projection per layer
  assert {rows.task_of(c) for c in enc.values()} == {"masked"}
  assert rows.task_of(lsh) == "causal"


def test_speedups_are_against_each_tasks_baseline_at_the_same_length():
  result = {
    "learning": {
      "softmax": {},
      "lsh": {"task": "causal"},
      "mlm-full": {"task": "masked"},
      "mlm-bigbird": {"task": "masked"},
    },
    "train_step": {
      "softmax": {"512": {"step_s": 2.0}},
      "lsh": {"512": {"step_s": 1.0}, "1024": {"step_s": 3.0}},
      "mlm-full": {"512": {"step_s": 3.0}},
      "mlm-bigbird": {"512": {"step_s": 1.5}},
    },
  }
  got = viz.attention_speedups(result, "train_step", "step_s")
  assert got == {
    "softmax": {"512": 1.0},
    "lsh": {"512": 2.0},  # no softmax at 1024: left out
    "mlm-full": {"512": 1.0},
    "mlm-bigbird": {"512": 2.0},
  }


TINY = [
  "--steps=2",
  "--train-len=64",
  "--batch-size=2",
  "--d-model=32",
  "--layers=1",
  "--heads=2",
  "--lsh-chunk=16",
  "--lsh-buckets=4",
  "--mlm-train-len=128",
  "--mlm-batch-size=2",
  "--bigbird-block=16",
  "--linformer-rows=16",
  "--eval-batches=1",
  "--mlm-eval-batches=2",
  "--kernel-lengths=64",
  "--kernel-window=16",
  "--lengths=128,256",
  "--mlm-lengths=128,256",
  "--decode-lengths=32,64",
  "--reps=1",
  "--rows=lsh,mlm-bigbird,mlm-linformer",
]


@pytest.mark.slow
@pytest.mark.long
def test_a_tiny_run_of_the_new_rows_gives_every_number_the_page_draws(tmp_path, text_dataset):
  path = tmp_path / "ea.json"
  ea.main([*TINY, f"--data={text_dataset}", f"--json={path}"])
  result = report.read_attention_result(str(path))
  assert json.loads(path.read_text()) == result
  learning = result["learning"]
  assert set(learning) == {"softmax", "lsh", "mlm-full", "mlm-bigbird", "mlm-linformer"}
  assert {k: r["task"] for k, r in learning.items() if r["task"] == "masked"}.keys() == {
    "mlm-full",
    "mlm-bigbird",
    "mlm-linformer",
  }
  assert all(math.isfinite(r["val_loss"]) and r["val_tokens"] > 0 for r in learning.values())
  steps = result["train_step"]
  assert set(steps["lsh"]) == {"128", "256"} and set(steps["mlm-bigbird"]) == {"128", "256"}
  for kind, by_length in steps.items():
    for t, row in by_length.items():
      assert row["step_s"] > 0 and row["temp_bytes"] > 0
      base = steps[ea.BASELINES[learning[kind]["task"]]][t]["step_s"]
      assert row["speedup"] == pytest.approx(base / row["step_s"])
  assert steps["softmax"]["256"]["speedup"] == 1.0 == steps["mlm-full"]["256"]["speedup"]
  assert set(result["decode"]) == {"softmax"}  # the Reformer does not decode here
  machine = result["machine"]
  assert machine["cores"] == os.cpu_count() and {"start", "end"} <= set(machine["load_average"])
  assert "load average" in result["conditions"]
  assert result["setup"]["lsh_d_ff"] % 8 == 0
  assert (tmp_path / "ea.png").stat().st_size > 1000


def test_an_unknown_row_is_refused(tmp_path, text_dataset):
  with pytest.raises(SystemExit):
    ea.main(["--rows=lsh,nope", f"--data={text_dataset}", f"--json={tmp_path / 'x.json'}"])
  assert not (tmp_path / "x.json").exists()


def test_the_report_gives_each_kind_its_ratios_memory_and_task(tmp_path):
  from transformer_jax import cli

  result = {
    "machine": {"cpu": "Some CPU", "cores": 2, "device": "cpu"},
    "conditions": "shared with others",
    "setup": {"steps": 3, "train_len": 64, "mlm_train_len": 128},
    "learning": {
      "softmax": {"task": "causal", "val_loss": 5.0, "params": 10},
      "lsh": {"task": "causal", "val_loss": 5.5, "params": 11},
      "mlm-full": {"task": "masked", "val_loss": 6.0, "params": 8},
      "mlm-bigbird": {"task": "masked", "val_loss": 6.25, "params": 8},
    },
    "train_step": {
      "softmax": {"512": {"step_s": 0.9, "temp_bytes": 2**21}},
      "lsh": {"512": {"step_s": 0.3, "temp_bytes": 2**20}},
      "mlm-full": {"512": {"step_s": 1.0, "temp_bytes": 3 * 2**20}},
      "mlm-bigbird": {"512": {"step_s": 0.4, "temp_bytes": 2**20}},
    },
    "decode": {"softmax": {"1024": {"step_ms": 2.0, "cache_bytes": 2**20}}},
  }
  path = tmp_path / "ea.json"
  path.write_text(json.dumps(result))
  assert cli.main(["report", "--experiment", str(path), "--out", str(tmp_path / "r")]) == 0
  page = (tmp_path / "r" / "index.html").read_text()
  assert "Some CPU, 2, cpu; shared with others" in page
  assert "<th>train step x full, 512</th>" in page and "<th>temp MiB, 512</th>" in page
  # lsh: 3x softmax's speed and 1 MiB; mlm-bigbird: 2.5x mlm-full's (not softmax's)
  assert "<td>lsh</td><td>causal</td><td>5.5</td><td>11</td><td>3</td><td>1</td>" in page
  assert "<td>mlm-bigbird</td><td>masked</td><td>6.25</td><td>8</td><td>2.5</td><td>1</td>" in page


@pytest.mark.long
@pytest.mark.slow
def test_a_run_may_leave_out_every_timing(tmp_path, text_dataset):
  path = tmp_path / "ea.json"
  blank = ["--kernel-lengths=", "--lengths=", "--mlm-lengths=", "--decode-lengths="]
  args = [a for a in TINY if a.split("=")[0] not in {b[:-1] for b in blank} | {"--rows"}]
  ea.main([*args, *blank, "--rows=mlm-bigbird", f"--data={text_dataset}", f"--json={path}"])
  result = report.read_attention_result(str(path))
  assert set(result["learning"]) == {"mlm-full", "mlm-bigbird"}
  assert result["train_step"] == {"mlm-full": {}, "mlm-bigbird": {}} and result["decode"] == {}
  assert result["attention_kernel"] == []
