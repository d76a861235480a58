"""``tjax``'s own guards: what a command would write over is checked before it runs."""

import json
import os
import subprocess
import sys

import pytest

from tests.train.conftest import REPO, run_cli
from transformer_jax.cli import bench as bench_cli


def test_bench_json_never_writes_over_a_file_it_did_not_write(tmp_path, monkeypatch):
  ran = []
  monkeypatch.setattr("transformer_jax.bench.run", lambda *a: ran.append(a) or {})
  mine = tmp_path / "notes.json"
  mine.write_text('{"mine": true}\n')
  code, _, err = run_cli("bench", "attention", "--json", str(mine))
  assert code == 2 and err.count("\n") == 1 and ran == []
  assert f"--json {mine} exists and is not a tjax bench result" in err
  assert mine.read_text() == '{"mine": true}\n'
  earlier = tmp_path / "bench.json"  # an earlier result of the same command: written again
  earlier.write_text(json.dumps({"command": "tjax bench attention", "rows": []}))
  code, _, err = run_cli("bench", "attention", "--json", str(earlier))
  assert code == 0 and len(ran) == 1, err


@pytest.mark.parametrize("content", [b"\xff\xfe", b"[1, 2]", b"{\"command\": 3}"])
def test_bench_json_refuses_damaged_or_foreign_files(tmp_path, content):
  path = tmp_path / "x.json"
  path.write_bytes(content)
  with pytest.raises(ValueError, match="is not a tjax bench result"):
    bench_cli._check_bench_out(str(path))


@pytest.mark.parametrize("flag", ["--seq-len", "--batch-size", "--vocab-size"])
def test_info_refuses_sizes_below_one(flag):
  code, _, err = run_cli("info", "gpt2-tiny", flag, "0")
  assert code == 2 and err == f"tjax info: error: {flag} 0: expected an integer >= 1\n"


def test_info_describes_a_prepared_dataset(text_dataset, tmp_path):
  from transformer_jax.data import GPTLoader, load_dataset
  from transformer_jax.data.layout import read_metadata

  args = ("--steps", "30", "--batch-size", "4", "--seq-len", "32")
  code, out, err = run_cli("info", text_dataset, *args)
  assert code == 0, err
  meta, lines = read_metadata(text_dataset), out.splitlines()
  assert lines[0] == f"{text_dataset}: gpt dataset, tokenizer {meta['tokenizer']}"
  for name, line in zip(("train", "val"), lines[1:3]):
    split = meta["splits"][name]
    assert line.split()[0] == name, out
    assert f"{split['tokens']:,} tokens in {split['documents']:,} documents" in line, out
  # The windows the loader itself draws an epoch from.
  windows = GPTLoader(load_dataset(text_dataset), batch_size=4, seq_len=32).num_windows
  assert lines[3] == f"  30 steps of 4 x 32: {30 * 4 / windows:.3g} epoch(s) of train", out
  assert run_cli("info", text_dataset, "--steps", "3")[2].endswith("need --seq-len\n")
  code, _, err = run_cli("info", str(tmp_path))
  assert code == 2 and "is not a prepared dataset (no metadata.json)" in err, err


def test_the_presets_table_keeps_its_columns_apart():
  from transformer_jax import models

  code, out, _ = run_cli("info")
  rows = out.splitlines()
  assert code == 0 and rows[0].split() == ["preset", "family", "parameters"]
  assert [row.split() for row in rows[1:]] == [
    [
      name,
      type(models.get_config(name)).__name__,
      f"{models.count_params(models.get_config(name)):,}",
    ]
    for name in models.list_presets()
  ]
  start = rows[0].index("family")  # every family starts under its heading, after a space
  assert all(row[start - 1] == " " and row[start:].split()[0] != "" for row in rows[1:])


def test_generate_checks_its_options_before_loading_the_run_or_its_libraries(tmp_path):
  """A refused option is answered before the checkpoint library (orbax) or the training stack
  load, let alone the model: in a fresh interpreter, as the command starts."""
  script = (
    "import sys\n"
    "from transformer_jax import cli\n"
    "code = cli.main(['generate', sys.argv[1], '--prompt', 'x', '--top-p', '1.5'])\n"
    "heavy = ('orbax.checkpoint', 'transformer_jax.runs', 'transformer_jax.train')\n"
    "print(code, [m for m in heavy if m in sys.modules])\n"
  )
  done = subprocess.run(
    [sys.executable, "-c", script, str(tmp_path / "no-run")],
    capture_output=True,
    text=True,
    timeout=300,
    env={**os.environ, "PYTHONPATH": REPO},
  )
  assert done.stdout == "2 []\n", done.stderr
  assert done.stderr == "tjax generate: error: --top-p 1.5 must be in (0, 1]\n"


def test_prepare_runs_without_starting_itself_again_over_mimalloc(monkeypatch, capsys):
  """Only commands that compute on JAX's allocations restart over mimalloc: `prepare` tokenizes."""
  from transformer_jax import cli
  from transformer_jax.backends.cpu import allocator

  execs = []

  def execve(path, argv, env):
    execs.append(argv)
    raise OSError("not started again in a test")  # launch then runs on in this process

  monkeypatch.setattr(allocator, "allocator_env", lambda: {"LD_PRELOAD": "libmimalloc.so"})
  monkeypatch.setattr(os, "execve", execve)
  for command in ("prepare", "info"):
    monkeypatch.setattr(sys, "argv", ["tjax", command, "--help"])
    with pytest.raises(SystemExit):
      cli.launch()
  capsys.readouterr()
  assert [argv[3] for argv in execs] == ["info"]
