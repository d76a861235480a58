"""``tjax bench``: the same work on both sides, numbers that agree with each other, JSON written."""

import json
import math
import os
import statistics

import pytest

from transformer_jax import bench, cli


def _bench(tmp_path, *argv):
  out = tmp_path / "bench.json"
  assert cli.main(["bench", *argv, "--json", str(out)]) == 0
  return json.loads(out.read_text())


@pytest.mark.long
def test_train_against_torch_does_the_same_work(tmp_path, capsys):
  pytest.importorskip("torch")
  r = _bench(
    tmp_path,
    "train",
    "--preset",
    "gpt2-tiny",
    "--batch-size",
    "2",
    "--seq-len",
    "16",
    "--steps",
    "2",
    "--warmup",
    "0",
  )
  # Same weights, tokens and loss: the first step's losses agree to float32 rounding, and AdamW
  # with the same settings keeps them together.
  assert r["first_loss_diff_vs_torch"] < 1e-4
  assert r["ours"]["losses"] == pytest.approx(r["torch"]["losses"], abs=1e-3)
  med = {s: r[s]["step_s"]["median"] for s in ("ours", "torch")}
  assert r["speedup_vs_torch"] == pytest.approx(med["torch"] / med["ours"], rel=1e-9)
  limit = r["limit"]["matmul"]["float32"]["flops_per_sec"]
  assert r["ours"]["mfu"] == pytest.approx(
    r["model_flops_per_step"] / med["ours"] / limit, rel=1e-9
  )
  assert r["limit"]["step_floor_s"] == pytest.approx(r["model_flops_per_step"] / limit, rel=1e-9)
  assert r["command"].startswith("tjax bench train --preset gpt2-tiny")
  assert r["machine"]["cpu"] and "cpu_flags" in r["machine"]
  # The compiled step's scratch block, and what each side cost the kernel per step.
  assert r["ours"]["temp_bytes"] > 0
  for side in ("ours", "torch"):
    assert r[side]["minor_faults_per_step"] >= 0 and r[side]["sys_s_per_step"] >= 0
    assert len(r[side]["minor_faults_all"]) == len(r[side]["sys_s_all"]) == 2
  assert "ours" in capsys.readouterr().out
  # On CPU: PyTorch in float32 on the CPU, its plain AdamW; no datasheet peak for a CPU.
  assert (r["platform"], r["device_kind"]) == ("cpu", "cpu")
  assert (r["torch"]["device"], r["torch"]["autocast"], r["torch"]["fused_adamw"]) == (
    "cpu",
    None,
    False,
  )
  assert "mfu_vs_peak" not in r["ours"] and "peak_flops" not in r["limit"]
  assert "ratio_vs_torch_compile" not in r and "left_out" not in r
  assert r["model_overrides"] == {}


@pytest.mark.long
def test_train_against_torch_llama_is_transformers_llama(tmp_path):
  # ~10 s. A LLaMA-style preset's rival is transformers' LlamaForCausalLM on the same weights (RoPE,
  # GQA, SwiGLU, RMSNorm, untied head): the same first loss, and AdamW keeps them together.
  pytest.importorskip("torch")
  r = _bench(
    tmp_path,
    "train",
    "--preset",
    "llama-tiny",
    "--batch-size",
    "2",
    "--seq-len",
    "16",
    "--steps",
    "2",
    "--warmup",
    "0",
  )
  assert r["torch"]["architecture"] == "LlamaForCausalLM"
  assert r["first_loss_diff_vs_torch"] < 1e-4
  assert r["ours"]["losses"] == pytest.approx(r["torch"]["losses"], abs=1e-3)


@pytest.mark.long
@pytest.mark.parametrize("preset", ["bert-tiny", "t5-tiny"])
def test_train_runs_every_family_alone(tmp_path, preset):
  r = _bench(
    tmp_path,
    "train",
    "--preset",
    preset,
    "--batch-size",
    "2",
    "--seq-len",
    "16",
    "--steps",
    "1",
    "--warmup",
    "0",
    "--against",
    "none",
  )
  assert math.isfinite(r["ours"]["losses"][-1]) and r["ours"]["mfu"] > 0
  assert "torch" not in r


@pytest.mark.long
def test_bf16_loss_curve_against_float32_from_the_same_start(tmp_path, capsys):
  r = _bench(
    tmp_path,
    "train",
    "--preset",
    "gpt2-tiny",
    "--dtype",
    "bfloat16",
    "--batch-size",
    "2",
    "--seq-len",
    "16",
    "--steps",
    "1",
    "--warmup",
    "0",
    "--against",
    "none",
    "--curve-steps",
    "12",
    "--curve-data",
    str(tmp_path / "data"),
  )
  c = r["loss_curves"]
  f32, b16 = c["losses"]["float32"], c["losses"]["bfloat16"]
  assert len(f32) == len(b16) == 12 and all(math.isfinite(x) for x in f32 + b16)
  assert 0 < c["ids_used"] <= 512  # the corpus' ids renumbered into the preset's vocab
  # Same weights, same first batch: the first losses differ by bfloat16 rounding only.
  assert abs(b16[0] - f32[0]) < 0.02 * f32[0]
  assert f32[-1] < f32[0]  # real text: the loss falls
  # The gap is recomputed here from the two curves' 10-step trailing means.
  mean = lambda xs, i: statistics.fmean(xs[max(0, i - 9) : i + 1])  # noqa: E731
  gaps = [abs(mean(b16, i) - mean(f32, i)) / mean(f32, i) for i in range(12)]
  assert c["relative_gap_10_step_mean"] == pytest.approx(gaps, rel=1e-9)
  assert c["max_relative_gap"] == pytest.approx(max(gaps), rel=1e-9)
  assert "loss curves over 12 steps" in capsys.readouterr().out


def test_model_overrides_are_read_as_yaml():
  from transformer_jax.bench.train import parse_model_overrides

  got = parse_model_overrides(
    [
      "scan_layers=false",
      "attention_impl=cudnn",
      "num_layers=3",
      "norm_eps=1e-5",
      "init_std=0.5",
      "max_len=null",
      "name=a=b",
    ]
  )
  assert got == {
    "scan_layers": False,
    "attention_impl": "cudnn",
    "num_layers": 3,
    "norm_eps": 1e-5,
    "init_std": 0.5,
    "max_len": None,
    "name": "a=b",
  }
  assert isinstance(got["norm_eps"], float)
  for bad, match in (
    ("scan_layers", "expected KEY=VALUE"),
    ("=3", "expected KEY=VALUE"),
    ("dtype=bfloat16", "--dtype"),
    ("dropout_rate=0.1", "no dropout"),
  ):
    with pytest.raises(ValueError, match=match):
      parse_model_overrides([bad])
  with pytest.raises(ValueError, match="num_layers is given twice"):
    parse_model_overrides(["num_layers=1", "num_layers=2"])


def test_model_override_reaches_the_step(tmp_path, capsys):
  # float32 on CPU scans the layers by default ("auto"); the override unrolls them.
  r = _bench(
    tmp_path,
    "train",
    "--preset",
    "gpt2-tiny",
    "--batch-size",
    "1",
    "--seq-len",
    "8",
    "--steps",
    "1",
    "--warmup",
    "0",
    "--against",
    "none",
    "--model",
    "scan_layers=false",
  )
  assert r["model_overrides"] == {"scan_layers": False} and r["layers"] == "unrolled"
  assert "model overrides: scan_layers=False" in capsys.readouterr().out
  assert (
    cli.main(
      [
        "bench",
        "train",
        "--preset",
        "gpt2-tiny",
        "--against",
        "none",
        "--model",
        "no_such_field=1",
        "--json",
        str(tmp_path / "x"),
      ]
    )
    == 2
  )
  assert "no_such_field" in capsys.readouterr().err


def test_table_entries_are_checked():
  from transformer_jax.backends import KernelTable
  from transformer_jax.bench.train import parse_table

  assert parse_table(["pad_cols=128", "CUDNN_PACKED_SEGMENTS=16"]) == KernelTable(
    pad_cols=128, cudnn_packed_segments=16
  )
  assert parse_table(["PAD_COLS=1.28e2"]) == KernelTable(pad_cols=128)  # exponent form
  assert parse_table([]) is None
  for bad, match in (
    ("PAD_COLS", "expected NAME=N"),
    ("NO_SUCH=1", "NO_SUCH is not one of"),
    ("PAD_COLS=-8", "pad_cols=-8 must be 0 .off. or an integer from 2 to"),
    ("PAD_COLS=x", "pad_cols='x': expected an integer"),
    ("PAD_COLS=12.5", "pad_cols='12.5': expected an integer"),
    ("PAD_COLS=1e999", "pad_cols='1e999': expected an integer"),
    ("PAD_COLS=0", "pad_cols=0 is the default"),
  ):
    with pytest.raises(ValueError, match=match):
      parse_table([bad])
  with pytest.raises(ValueError, match="pad_cols is given twice"):
    parse_table(["PAD_COLS=8", "pad_cols=16"])
  with pytest.raises(
    ValueError, match="cudnn_packed_segments has no effect on cpu .it applies on gpu."
  ):
    parse_table(["CUDNN_PACKED_SEGMENTS=4"], "cpu")
  assert parse_table(["CUDNN_PACKED_SEGMENTS=4"], "gpu") == KernelTable(cudnn_packed_segments=4)


@pytest.mark.parametrize(
  "item,words",
  [
    (
      "PAD_COLS=99999999999999999999",
      "pad_cols=99999999999999999999 must be 0 (off) or an integer from 2 to 65536",
    ),
    ("CUDNN_PACKED_SEGMENTS=4", "cudnn_packed_segments has no effect on cpu"),
  ],
)
def test_table_entries_are_refused_in_one_line_before_anything_compiles(
  tmp_path, capsys, monkeypatch, item, words
):
  from transformer_jax.bench import machine
  from transformer_jax.bench import train as bench_train

  if "CUDNN" in item and jax_platform() != "cpu":
    pytest.skip("the entry applies off CPU")

  def compiles(*args, **kwargs):
    raise AssertionError("compiled a program before the table was checked")

  monkeypatch.setattr(machine, "run_matmul_limit", compiles)
  monkeypatch.setattr(bench_train, "Ours", compiles)
  assert (
    cli.main(
      [
        "bench",
        "train",
        "--preset",
        "gpt2-tiny",
        "--batch-size",
        "2",
        "--seq-len",
        "16",
        "--against",
        "none",
        "--table",
        item,
        "--json",
        str(tmp_path / "x.json"),
      ]
    )
    == 2
  )
  err = capsys.readouterr().err.strip()
  assert words in err and len(err.splitlines()) == 1, err
  assert not (tmp_path / "x.json").exists()


def jax_platform() -> str:
  import jax

  return jax.default_backend()


def test_table_side_runs_the_lever_from_the_same_weights(tmp_path, capsys):
  # pad_cols pads the tied vocabulary product (gpt2-tiny: 512 rows, padded to 640): the same
  # losses from the same weights, a program with other shapes; the default table is untouched.
  from transformer_jax import backends

  r = _bench(
    tmp_path,
    "train",
    "--preset",
    "gpt2-tiny",
    "--batch-size",
    "2",
    "--seq-len",
    "16",
    "--steps",
    "2",
    "--warmup",
    "0",
    "--against",
    "none",
    "--table",
    "PAD_COLS=640",
  )
  assert backends.current().table == backends.KernelTable()
  assert r["table"] == {"pad_cols": 640}
  assert r["ours+table"]["losses"] == pytest.approx(r["ours"]["losses"], rel=1e-5)
  assert r["first_loss_diff_of_table"] < 1e-5
  assert r["ours+table"]["temp_bytes"] != r["ours"]["temp_bytes"]
  assert r["speedup_of_table"] == pytest.approx(
    r["ours"]["step_s"]["median"] / r["ours+table"]["step_s"]["median"], rel=1e-9
  )
  out = capsys.readouterr().out
  assert "ours+table: pad_cols=640" in out and "x ours" in out
  assert (
    cli.main(
      [
        "bench",
        "train",
        "--preset",
        "gpt2-tiny",
        "--against",
        "none",
        "--table",
        "NO_SUCH=1",
        "--json",
        str(tmp_path / "x"),
      ]
    )
    == 2
  )
  assert "NO_SUCH is not one of" in capsys.readouterr().err


@pytest.mark.slow  # about 20 s: the matmul limit and two compiled steps
def test_library_side_is_the_readme_step_on_the_same_weights(tmp_path, capsys):
  # train.make_step with Step.init(key(seed)): the weights ours draws from the same seed, the same
  # optimizer and batch, so the same losses; its step time is set against ours.
  r = _bench(
    tmp_path,
    "train",
    "--preset",
    "gpt2-tiny",
    "--batch-size",
    "2",
    "--seq-len",
    "16",
    "--steps",
    "2",
    "--warmup",
    "0",
    "--against",
    "none",
    "--library",
  )
  assert r["library"]["losses"] == pytest.approx(r["ours"]["losses"], rel=1e-5)
  assert r["library"]["microbatches"] == r["microbatches"]
  assert r["library_vs_ours"] == pytest.approx(
    r["library"]["step_s"]["median"] / r["ours"]["step_s"]["median"], rel=1e-9
  )
  assert "library:" in capsys.readouterr().out


def test_train_table_on_an_accelerator():
  from transformer_jax.bench.train import table

  side = {"step_s": {"median": 0.0123}, "tokens_per_sec": 83000.0, "mfu": 0.41, "mfu_vs_peak": 0.35}
  result = {
    "preset": "gpt2-small",
    "batch_size": 8,
    "seq_len": 1024,
    "dtype": "bfloat16",
    "layers": "unrolled",
    "platform": "gpu",
    "device_kind": "NVIDIA H100 80GB HBM3",
    "model_overrides": {"attention_impl": "cudnn"},
    "limit": {
      "step_floor_s": 0.005,
      "matmul": {"float32": {"flops_per_sec": 5e13}, "bfloat16": {"flops_per_sec": 8e14}},
    },
    "ours": side,
    "torch.compile": {
      **side,
      "step_s": {"median": 0.0150},
      "device": "cuda",
      "autocast": "bfloat16",
      "fused_adamw": True,
    },
    "speedup_vs_torch.compile": 0.0150 / 0.0123,
    "ratio_vs_torch_compile": 0.0150 / 0.0123,
    "left_out": {"torch": "could not run (RuntimeError: x)"},
  }
  text = table(result)
  assert "on NVIDIA H100 80GB HBM3" in text and "800000 GFLOP/s" in text
  assert "0.0123 s/step" in text and "35.0% of peak" in text
  assert "[cuda, autocast bfloat16]" in text and "ratio vs torch.compile: 1.22x" in text
  assert "attention_impl=cudnn" in text and "torch: left out" in text


def test_rivals_run_on_jax_device_or_are_left_out(monkeypatch):
  torch = pytest.importorskip("torch")
  from transformer_jax import backends
  from transformer_jax.bench import generate, machine

  assert machine.torch_device() == ("cpu", "") and generate.hf_device() == "cpu"
  monkeypatch.setattr(backends, "platform", lambda: "tpu")
  device, why = machine.torch_device()
  assert device is None and "no PyTorch rival on tpu" in why
  with pytest.raises(ValueError, match="on tpu"):
    generate.hf_device()
  # A GPU run whose torch has no CUDA: no rival on another device either.
  monkeypatch.setattr(backends, "platform", lambda: "gpu")
  monkeypatch.setattr(torch.cuda, "is_available", lambda: False)
  device, why = machine.torch_device()
  assert device is None and "has no CUDA device" in why
  with pytest.raises(ValueError, match="no CUDA device"):
    generate.hf_device()


def test_torch_rival_needs_a_gpt_preset(tmp_path, capsys):
  assert cli.main(["bench", "train", "--preset", "bert-tiny", "--json", str(tmp_path / "x")]) == 2
  assert "GPT presets" in capsys.readouterr().err


def test_attention_rows_per_implementation(tmp_path):
  r = _bench(
    tmp_path,
    "attention",
    "--lengths",
    "32,64",
    "--heads",
    "2",
    "--head-dim",
    "8",
    "--reps",
    "1",
    "--inner",
    "2",
  )
  assert [(row["T"], row["implementation"]) for row in r["rows"]] == [
    (32, "xla"),
    (32, "chunked"),
    (64, "xla"),
    (64, "chunked"),
  ]
  for row in r["rows"]:
    assert row["fraction_of_matmul_limit"] == pytest.approx(
      row["useful_flops_per_sec"] / r["limit"]["matmul"]["flops_per_sec"], rel=1e-9
    )
    assert row["best_s"] <= row["median_s"] and row["first_call_s"] > 0
  # On CPU: no torch rival unless asked, one batch size, no peak.
  assert r["batch_size"] == 1 and r["batch_sizes"] == [1, 1] and r["platform"] == "cpu"
  assert r["inner"] == 2
  assert "torch_device" not in r and "peak_flops" not in r["limit"]


def test_attention_inner_calls_are_issued_back_to_back_and_divided(monkeypatch):
  from transformer_jax.bench import attention

  log = []
  clock = iter(range(0, 1000, 8))  # each perf_counter() reading is 8 s after the last
  monkeypatch.setattr(attention.time, "perf_counter", lambda: next(clock))
  first, times = attention._times(
    lambda: log.append("call"), lambda: log.append("sync"), reps=2, inner=4
  )
  assert first == 8 and times == [2.0, 2.0]  # 8 s over 4 calls
  one_rep = ["sync"] + ["call"] * 4 + ["sync"]
  assert log == ["sync", "call", "sync"] + one_rep + one_rep


def test_train_profile_below_zero_is_refused(tmp_path, capsys):
  assert (
    cli.main(
      [
        "bench",
        "train",
        "--preset",
        "gpt2-tiny",
        "--profile",
        "-1",
        "--against",
        "none",
        "--json",
        str(tmp_path / "x.json"),
      ]
    )
    == 2
  )
  assert "--profile -1: must be 0 (off) or a number of steps" in capsys.readouterr().err


def test_attention_inner_below_one_is_refused(tmp_path, capsys):
  assert (
    cli.main(
      [
        "bench",
        "attention",
        "--lengths",
        "16",
        "--heads",
        "1",
        "--head-dim",
        "8",
        "--inner",
        "0",
        "--json",
        str(tmp_path / "x.json"),
      ]
    )
    == 2
  )
  assert "--inner 0: must be at least 1" in capsys.readouterr().err


def test_attention_cells_that_fail_are_recorded_and_the_rest_run(tmp_path, capsys):
  r = _bench(
    tmp_path,
    "attention",
    "--lengths",
    "16,32",
    "--batch-sizes",
    "2,1",
    "--heads",
    "2",
    "--head-dim",
    "8",
    "--reps",
    "2",
    "--implementations",
    "xla,bogus,auto",
  )
  assert [(row["T"], row["batch_size"], row["implementation"]) for row in r["rows"]] == [
    (16, 2, "xla"),
    (16, 2, "bogus"),
    (16, 2, "auto"),
    (32, 1, "xla"),
    (32, 1, "bogus"),
    (32, 1, "auto"),
  ]
  for row in r["rows"]:
    if row["implementation"] == "bogus":
      assert set(row) == {"T", "batch_size", "implementation", "error"}
      assert "bogus" in row["error"]
    else:
      assert "error" not in row and row["best_s"] > 0
  assert r["batch_size"] is None and r["batch_sizes"] == [2, 1]
  out = capsys.readouterr().out
  assert "B=2" in out and "failed" in out


def test_without_json_a_bench_writes_under_runs_and_says_where(tmp_path, monkeypatch, capsys):
  # Never over the results kept in experiments/results/: runs/ is ignored by git.
  assert bench.default_json("train") == os.path.join("runs", "bench", "bench_train.json")
  monkeypatch.chdir(tmp_path)
  assert (
    cli.main(
      [
        "bench",
        "attention",
        "--lengths",
        "16",
        "--heads",
        "1",
        "--head-dim",
        "8",
        "--reps",
        "1",
        "--implementations",
        "xla",
      ]
    )
    == 0
  )
  written = tmp_path / "runs" / "bench" / "bench_attention.json"
  assert json.loads(written.read_text())["rows"][0]["implementation"] == "xla"
  assert "wrote runs/bench/bench_attention.json" in capsys.readouterr().err
  # --json '': the table only.
  written.unlink()
  assert (
    cli.main(
      [
        "bench",
        "attention",
        "--lengths",
        "16",
        "--heads",
        "1",
        "--head-dim",
        "8",
        "--reps",
        "1",
        "--implementations",
        "xla",
        "--json",
        "",
      ]
    )
    == 0
  )
  assert not written.exists() and "wrote" not in capsys.readouterr().err


def test_attention_batch_sizes_align_with_lengths(tmp_path, capsys):
  from transformer_jax.bench.attention import batch_sizes

  assert batch_sizes([1024, 4096, 16384], 3, None) == [3, 3, 3]
  assert batch_sizes([1024, 4096, 16384], 3, "4,4,1") == [4, 4, 1]
  with pytest.raises(ValueError, match=r"--batch-sizes '4,4': 2 sizes for 3 --lengths"):
    batch_sizes([1024, 4096, 16384], 1, "4,4")
  with pytest.raises(ValueError, match="--batch-sizes '4,x'"):
    batch_sizes([1, 2], 1, "4,x")
  with pytest.raises(ValueError, match="--batch-size 0"):
    batch_sizes([1, 2], 0, None)
  assert (
    cli.main(
      [
        "bench",
        "attention",
        "--lengths",
        "16,32",
        "--batch-sizes",
        "1",
        "--json",
        str(tmp_path / "x"),
      ]
    )
    == 2
  )
  assert "1 sizes for 2 --lengths" in capsys.readouterr().err


def test_attention_against_torch_sdpa_on_cpu(tmp_path):
  pytest.importorskip("torch")
  r = _bench(
    tmp_path,
    "attention",
    "--lengths",
    "16",
    "--heads",
    "2",
    "--head-dim",
    "8",
    "--reps",
    "1",
    "--implementations",
    "xla",
    "--against",
    "torch",
  )
  assert [row["implementation"] for row in r["rows"]] == ["xla", "torch_sdpa"]
  assert r["torch_device"] == "cpu" and r["rows"][1]["best_s"] > 0


@pytest.mark.long
def test_generate_against_transformers_same_tokens_and_floor_from_the_same_moments(
  tmp_path, monkeypatch
):
  pytest.importorskip("transformers")
  from transformer_jax.bench import machine
  from transformer_jax.backends.cpu import poll
  from tests.backends.cpu.test_poll import _fds_on

  # With --cpu-poll the whole run holds the polling request (a stand-in file here): every
  # bandwidth reading is taken under it, like both sides' calls.
  device = tmp_path / "cpu_dma_latency"
  device.write_bytes(b"")
  monkeypatch.setattr(poll, "CPU_DMA_LATENCY", str(device))
  monkeypatch.delenv(poll.POLL_ENV, raising=False)
  held, reading = [], machine.weight_bandwidth

  def weight_bandwidth(*a, **kw):
    held.append(_fds_on(device))
    return reading(*a, **kw)

  monkeypatch.setattr(machine, "weight_bandwidth", weight_bandwidth)
  r = _bench(
    tmp_path,
    "generate",
    "--preset",
    "gpt2-tiny",
    "--batch-sizes",
    "1,2",
    "--prompt-len",
    "5",
    "--new-tokens",
    "6",
    "--dtypes",
    "float32",
    "--reps",
    "2",
    "--ttft-reps",
    "1",
    "--torch-threads-alt",
    "0",
    "--cpu-poll",
  )
  assert r["cpu_poll"] == {"held": True, "reason": "", "requested": True}
  assert (r["platform"], r["hf_device"]) == ("cpu", "cpu")
  assert r["machine"]["torch_threads"] >= 1
  assert held == [1] * 5 and _fds_on(device) == 0  # the start's reading and 2 per case
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
      floor_ms / s["ours_ms_per_step"], rel=1e-9
    )
    sustained_ms = 1e3 * r["weight_bytes"]["float32"] / s["sustained_bandwidth_bytes_per_sec"]
    assert s["ours_fraction_of_sustained_floor"] == pytest.approx(
      sustained_ms / s["ours_ms_per_step"], rel=1e-9
    )
    assert s["ours_fraction_of_sustained_floor"] >= s["ours_fraction_of_bandwidth_floor"]
    # The fastest reading's floor: the strictest of the three.
    best_ms = 1e3 * r["weight_bytes"]["float32"] / max(readings)
    assert s["best_bandwidth_bytes_per_sec"] == max(readings)
    assert s["ours_fraction_of_best_floor"] == pytest.approx(
      best_ms / s["ours_ms_per_step"], rel=1e-9
    )
    assert s["ours_fraction_of_best_floor"] <= s["ours_fraction_of_bandwidth_floor"]
    # Repetition by repetition: each step against the reading taken right before its calls.
    n = r["new_tokens"] - 1
    if min(diffs) > 0:
      by_rep = [
        1e3 * r["weight_bytes"]["float32"] / bw / (1e3 * d / n) for bw, d in zip(readings, diffs)
      ]
      assert ours["fraction_of_paired_floor"]["all"] == pytest.approx(by_rep, rel=1e-9)
      assert s["ours_fraction_of_paired_floor"] == pytest.approx(
        statistics.median(by_rep), rel=1e-9
      )
    else:
      assert s["ours_fraction_of_paired_floor"] is None
    assert s["ratio"] == pytest.approx(s["ours_tokens_per_sec"] / s["theirs_tokens_per_sec"])


def test_generate_bench_polls_cpus_only_when_asked(tmp_path, monkeypatch):
  from transformer_jax.bench import generate as bench_generate
  from transformer_jax.backends.cpu import poll
  from tests.backends.cpu.test_poll import _fds_on

  device = tmp_path / "cpu_dma_latency"
  device.write_bytes(b"")
  monkeypatch.setattr(poll, "CPU_DMA_LATENCY", str(device))
  monkeypatch.delenv(poll.POLL_ENV, raising=False)
  monkeypatch.setattr("jax.default_backend", lambda: "cpu")
  seen = []
  monkeypatch.setattr(
    bench_generate, "_run", lambda args, command: seen.append(_fds_on(device)) or {}
  )
  args = bench_generate.parse_args(["--reps", "1"])
  assert args.cpu_poll is None
  r = bench_generate.run(args)
  assert seen == [0] and r["cpu_poll"]["requested"] is False and not r["cpu_poll"]["held"]
  assert "--cpu-poll" in r["cpu_poll"]["reason"]
  monkeypatch.setenv(poll.POLL_ENV, "1")
  assert bench_generate.run(args)["cpu_poll"] == {"held": True, "reason": "", "requested": True}
  assert seen == [0, 1] and _fds_on(device) == 0
  args = bench_generate.parse_args(["--no-cpu-poll"])
  assert not bench_generate.run(args)["cpu_poll"]["requested"] and seen == [0, 1, 0]
  monkeypatch.setenv(poll.POLL_ENV, "maybe")
  with pytest.raises(ValueError, match="TJAX_CPU_POLL='maybe'"):
    bench_generate.run(bench_generate.parse_args([]))


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
  assert paired_fraction(100, [100.0, 100.0], [1.5, -0.1], 4) is None  # a step lost in jitter
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
  if head.returncode == 0:  # this checkout is a git repository (CI's fresh clone is)
    here = machine.source_revision()
    assert here["commit"] == head.stdout.strip() and isinstance(here["modified"], bool)
  # The same module installed outside any git checkout, or in a virtual environment inside
  # another repository's tree: no commit to name.
  other = str(tmp_path / "other")
  subprocess.run(["git", "init", "-q", other], check=True)
  subprocess.run(
    [
      "git",
      "-C",
      other,
      "-c",
      "user.name=t",
      "-c",
      "user.email=t@t",
      "commit",
      "-q",
      "--allow-empty",
      "-m",
      "other",
    ],
    check=True,
  )
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


@pytest.mark.parametrize(
  "preset, overrides, seq_len, want",
  [
    ("gpt2-tiny", {}, None, 128),  # a 128-position table: the default shrinks to it
    ("gpt2-small", {}, None, 256),  # the documented default
    ("llama-tiny", {}, None, 128),  # RoPE: the default still keeps to the context ...
    ("llama-tiny", {}, 300, 300),  # ... but a longer one is the model's to allow
    ("gpt2-tiny", {}, 128, 128),
  ],
)
def test_train_default_sequence_fits_the_preset(preset, overrides, seq_len, want):
  import argparse
  import dataclasses
  from transformer_jax import models
  from transformer_jax.bench import train

  config = dataclasses.replace(models.get_config(preset), **overrides)
  args = argparse.Namespace(preset=preset, seq_len=seq_len)
  assert train.resolve_seq_len(args, config) == want


@pytest.mark.parametrize(
  "argv, message",
  [
    (
      ["--preset", "gpt2-tiny", "--seq-len", "129"],
      "--seq-len 129: longer than gpt2-tiny's max_len=128",
    ),
    (
      ["--preset", "gpt2-small", "--model", "max_len=64", "--seq-len", "65"],
      "--seq-len 65: longer than gpt2-small's max_len=64",
    ),
    (["--preset", "gpt2-tiny", "--seq-len", "0"], "--seq-len 0: must be at least 1"),
  ],
)
def test_train_sequence_past_the_preset_is_one_line_before_anything_runs(
  tmp_path, monkeypatch, capsys, argv, message
):
  from transformer_jax.bench import machine

  def measured(*a, **kw):
    raise AssertionError("the matmul limit was measured before the length was checked")

  monkeypatch.setattr(machine, "run_matmul_limit", measured)
  assert (
    cli.main(["bench", "train", *argv, "--against", "none", "--json", str(tmp_path / "x.json")])
    == 2
  )
  err = capsys.readouterr().err.strip()
  assert err == f"tjax bench: error: {message}" and not (tmp_path / "x.json").exists()


@pytest.mark.parametrize(
  "preset, argv, lengths",
  [
    ("gpt2-small", [], (32, 128)),  # the documented defaults
    ("gpt2-tiny", [], (32, 96)),  # 128 positions: the new tokens shrink
    ("gpt2-tiny", ["--prompt-len", "100"], (100, 28)),
    ("gpt2-tiny", ["--new-tokens", "120"], (8, 120)),  # the prompt shrinks to fit
    ("gpt2-tiny", ["--prompt-len", "28", "--new-tokens", "100"], (28, 100)),
  ],
)
def test_generate_default_lengths_fit_the_preset(preset, argv, lengths):
  from transformer_jax.bench import generate

  args = generate.parse_args(["--preset", preset, *argv])
  assert (args.prompt_len, args.new_tokens) == lengths


@pytest.mark.parametrize(
  "argv, message",
  [
    (
      ["--prompt-len", "100", "--new-tokens", "29"],
      "--prompt-len 100 + --new-tokens 29 = 129: longer than gpt2-tiny's max_len=128",
    ),
    (
      ["--prompt-len", "128"],
      "--prompt-len 128: leaves no room for a new token in gpt2-tiny's max_len=128",
    ),
    (
      ["--new-tokens", "128"],
      "--new-tokens 128: leaves no room for a prompt in gpt2-tiny's max_len=128",
    ),
  ],
)
def test_generate_lengths_past_the_preset_are_one_line_before_anything_runs(
  tmp_path, monkeypatch, capsys, argv, message
):
  from transformer_jax.bench import generate

  def ran(*a, **kw):
    raise AssertionError("the benchmark ran before the lengths were checked")

  monkeypatch.setattr(generate, "_run", ran)
  assert (
    cli.main(
      ["bench", "generate", "--preset", "gpt2-tiny", *argv, "--json", str(tmp_path / "x.json")]
    )
    == 2
  )
  assert capsys.readouterr().err.strip() == f"tjax bench: error: {message}"
