"""``tjax bench``: the same work on both sides, numbers that agree with each other, JSON written."""

import json
import math
import statistics

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
  # The compiled step's scratch block, and what each side cost the kernel per step.
  assert r["ours"]["temp_bytes"] > 0
  for side in ("ours", "torch"):
    assert r[side]["minor_faults_per_step"] >= 0 and r[side]["sys_s_per_step"] >= 0
    assert len(r[side]["minor_faults_all"]) == len(r[side]["sys_s_all"]) == 2
  assert "ours" in capsys.readouterr().out


@pytest.mark.parametrize("preset", ["bert-tiny", "t5-tiny"])
def test_train_runs_every_family_alone(tmp_path, preset):
  r = _bench(tmp_path, "train", "--preset", preset, "--batch-size", "2", "--seq-len", "16",
             "--steps", "1", "--warmup", "0", "--against", "none")
  assert math.isfinite(r["ours"]["losses"][-1]) and r["ours"]["mfu"] > 0
  assert "torch" not in r


def test_bf16_loss_curve_against_float32_from_the_same_start(tmp_path, capsys):
  r = _bench(tmp_path, "train", "--preset", "gpt2-tiny", "--dtype", "bfloat16", "--batch-size", "2",
             "--seq-len", "16", "--steps", "1", "--warmup", "0", "--against", "none",
             "--curve-steps", "12", "--curve-data", str(tmp_path / "data"))
  c = r["loss_curves"]
  f32, b16 = c["losses"]["float32"], c["losses"]["bfloat16"]
  assert len(f32) == len(b16) == 12 and all(math.isfinite(x) for x in f32 + b16)
  assert 0 < c["ids_used"] <= 512            # the corpus' ids renumbered into the preset's vocab
  # Same weights, same first batch: the first losses differ by bfloat16 rounding only.
  assert abs(b16[0] - f32[0]) < 0.02 * f32[0]
  assert f32[-1] < f32[0]                    # real text: the loss falls
  # The gap is recomputed here from the two curves' 10-step trailing means.
  mean = lambda xs, i: statistics.fmean(xs[max(0, i - 9):i + 1])  # noqa: E731
  gaps = [abs(mean(b16, i) - mean(f32, i)) / mean(f32, i) for i in range(12)]
  assert c["relative_gap_10_step_mean"] == pytest.approx(gaps, rel=1e-9)
  assert c["max_relative_gap"] == pytest.approx(max(gaps), rel=1e-9)
  assert "loss curves over 12 steps" in capsys.readouterr().out


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


def test_generate_against_transformers_same_tokens_and_floor_from_the_same_moments(
    tmp_path, monkeypatch):
  pytest.importorskip("transformers")
  from transformer_jax import runtime
  from transformer_jax.bench import machine
  from tests.test_runtime import _fds_on

  # The whole run holds runtime.cpu_poll's request (a stand-in file here): every bandwidth reading
  # is taken under it, like both sides' calls.
  device = tmp_path / "cpu_dma_latency"
  device.write_bytes(b"")
  monkeypatch.setattr(runtime, "CPU_DMA_LATENCY", str(device))
  monkeypatch.delenv(runtime.POLL_ENV, raising=False)
  held, reading = [], machine.weight_bandwidth

  def weight_bandwidth(*a, **kw):
    held.append(_fds_on(device))
    return reading(*a, **kw)
  monkeypatch.setattr(machine, "weight_bandwidth", weight_bandwidth)
  r = _bench(tmp_path, "generate", "--preset", "gpt2-tiny", "--batch-sizes", "1,2",
             "--prompt-len", "5", "--new-tokens", "6", "--dtypes", "float32", "--reps", "2",
             "--ttft-reps", "1", "--torch-threads-alt", "0")
  assert r["cpu_poll"] == {"held": True, "reason": ""}
  assert held == [1] * 5 and _fds_on(device) == 0   # the start's reading and 2 per case
  assert r["weights_max_abs_logit_diff_float32"] < 1e-4
  assert set(r["summary"]) == {"float32_batch1", "float32_batch2"}
  for case in r["cases"]:
    s = r["summary"][f"float32_batch{case['batch']}"]
    assert s["tokens_equal"], case["divergence"]
    # The floor comes from the bandwidth read between this case's timed calls.
    readings = case["bandwidth_bytes_per_sec"]["all"]
    assert len(readings) == 2 and all(b > 0 for b in readings)
    floor_ms = 1e3 * r["weight_bytes"]["float32"] / case["bandwidth_bytes_per_sec"]["median"]
    assert s["step_floor_ms"] == pytest.approx(floor_ms, rel=1e-9)
    # The sustained floor: the same readings' mean rate, never above their best.
    sustained = case["sustained_bandwidth_bytes_per_sec"]["all"]
    assert len(sustained) == 2 and all(0 < m <= b for m, b in zip(sustained, readings))
    # The step: each full call minus its one-token partner from the same repetition.
    ours = case["ours"]
    diffs = [f - o for f, o in zip(ours["generate_s"]["all"], ours["paired_one_token_s"])]
    assert ours["decode_s"]["all"] == pytest.approx(diffs, rel=1e-12)
    if s["ours_ms_per_step"] is None:
      # gpt2-tiny's 5 steps can drown in the calls' jitter: then no time and no fraction at all.
      assert statistics.median(diffs) <= 0 and "jitter" in s["ours_step_unresolved"]
      assert s["ours_fraction_of_bandwidth_floor"] is None
      assert s["ours_fraction_of_sustained_floor"] is None
      assert s["ours_fraction_of_best_floor"] is None
      assert s["ours_fraction_of_paired_floor"] is None
      continue
    assert s["ours_ms_per_step"] > 0 and s["ours_step_unresolved"] is None
    assert s["ours_fraction_of_bandwidth_floor"] == pytest.approx(
        floor_ms / s["ours_ms_per_step"], rel=1e-9)
    sustained_ms = 1e3 * r["weight_bytes"]["float32"] / s["sustained_bandwidth_bytes_per_sec"]
    assert s["ours_fraction_of_sustained_floor"] == pytest.approx(
        sustained_ms / s["ours_ms_per_step"], rel=1e-9)
    assert s["ours_fraction_of_sustained_floor"] >= s["ours_fraction_of_bandwidth_floor"]
    # The fastest reading's floor: the strictest of the three.
    best_ms = 1e3 * r["weight_bytes"]["float32"] / max(readings)
    assert s["best_bandwidth_bytes_per_sec"] == max(readings)
    assert s["ours_fraction_of_best_floor"] == pytest.approx(best_ms / s["ours_ms_per_step"],
                                                             rel=1e-9)
    assert s["ours_fraction_of_best_floor"] <= s["ours_fraction_of_bandwidth_floor"]
    # Repetition by repetition: each step against the reading taken right before its calls.
    n = r["new_tokens"] - 1
    if min(diffs) > 0:
      by_rep = [1e3 * r["weight_bytes"]["float32"] / bw / (1e3 * d / n)
                for bw, d in zip(readings, diffs)]
      assert ours["fraction_of_paired_floor"]["all"] == pytest.approx(by_rep, rel=1e-9)
      assert s["ours_fraction_of_paired_floor"] == pytest.approx(statistics.median(by_rep),
                                                                 rel=1e-9)
    else:
      assert s["ours_fraction_of_paired_floor"] is None
    assert s["ratio"] == pytest.approx(s["ours_tokens_per_sec"] / s["theirs_tokens_per_sec"])


def test_step_time_from_paired_calls_never_negative():
  from transformer_jax.bench.generate import step_time

  # Three pairs, differences 0.9, 1.1 and 3.0 s over 10 steps: the median 1.1 s, 110 ms a step.
  ok = step_time([1.0, 1.3, 3.5], [0.1, 0.2, 0.5], 11)
  assert ok["ms_per_step"] == pytest.approx(110.0) and ok["step_unresolved"] is None
  assert ok["decode_s"]["all"] == pytest.approx([0.9, 1.1, 3.0])
  # The steps drowned in jitter: the median difference is negative; no time, a reason naming it.
  lost = step_time([0.010, 0.012, 0.011], [0.011, 0.010, 0.0115], 6)
  assert lost["ms_per_step"] is None
  assert "-0.500 ms" in lost["step_unresolved"] and "--new-tokens" in lost["step_unresolved"]
  assert step_time([0.2], [0.1], 1)["ms_per_step"] is None
  with pytest.raises(ValueError, match="2 full calls and 1 one-token"):
    step_time([0.2, 0.3], [0.1], 5)


def test_paired_floor_follows_each_repetitions_reading():
  from transformer_jax.bench.generate import paired_fraction

  # 100 bytes of weights, 3 steps per call: a 1.5 s difference is 0.5 s a step. At 100 B/s the
  # floor is 1 s a step (2.0 of it), at 400 B/s 0.25 s (0.5); the median of 2.0, 0.5 and 1.0.
  got = paired_fraction(100, [100.0, 400.0, 200.0], [1.5, 1.5, 1.5], 4)
  assert got["all"] == pytest.approx([2.0, 0.5, 1.0]) and got["median"] == pytest.approx(1.0)
  assert paired_fraction(100, [100.0, 100.0], [1.5, -0.1], 4) is None   # a step lost in jitter
  assert paired_fraction(100, [100.0], [1.5], 1) is None
  with pytest.raises(ValueError, match="2 readings for 1 repetitions"):
    paired_fraction(100, [100.0, 100.0], [1.5], 4)


def test_results_name_the_commit_they_ran_and_none_outside_a_checkout(tmp_path):
  import importlib.util
  import shutil
  import subprocess

  from transformer_jax.bench import machine
  root = machine.__file__.rsplit("/transformer_jax/", 1)[0]
  head = subprocess.run(["git", "-C", root, "rev-parse", "HEAD"], capture_output=True, text=True)
  if head.returncode == 0:   # this checkout is a git repository (CI's fresh clone is)
    here = machine.source_revision()
    assert here["commit"] == head.stdout.strip() and isinstance(here["modified"], bool)
  # The same module installed outside any git checkout, or in a virtual environment inside
  # another repository's tree: no commit to name.
  other = str(tmp_path / "other")
  subprocess.run(["git", "init", "-q", other], check=True)
  subprocess.run(["git", "-C", other, "-c", "user.name=t", "-c", "user.email=t@t", "commit", "-q",
                  "--allow-empty", "-m", "other"], check=True)
  for site in (tmp_path / "site", tmp_path / "other" / ".venv" / "site-packages"):
    pkg = site / "transformer_jax" / "bench"
    pkg.mkdir(parents=True)
    shutil.copy(machine.__file__, pkg / "machine.py")
    spec = importlib.util.spec_from_file_location("machine_copy", pkg / "machine.py")
    copy = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(copy)
    assert copy.source_revision() is None, site


def test_cpu_family_names_the_first_processor_of_proc_cpuinfo():
  from transformer_jax.bench import machine

  try:
    lines = open("/proc/cpuinfo").read().split("\n\n")[0].splitlines()
  except OSError:
    pytest.skip("no /proc/cpuinfo")
  first = dict((k.strip(), v.strip()) for k, _, v in (line.partition(":") for line in lines))
  want = [f"{key} {first[key]}" for key in ("cpu family", "model") if key in first]
  assert machine.cpu_family() == ", ".join(want)
