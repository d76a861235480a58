"""``tjax``'s own guards: what a command would write over is checked before it runs."""

import json

import pytest

from tests.train.conftest import run_cli
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
