"""Damaged corpus inputs: each is one error naming the file and its line, row group or record
batch; with ``skip_bad`` the bad record (or the spoilt file, whole) is skipped and counted."""

import gzip
import json
import re

import pytest

from tests.train.conftest import run_cli
from transformer_jax.data import load_dataset, prepare

GOOD = [f"good document {i} with a few words\n" for i in range(20)]


def _jsonl(docs) -> bytes:
  return "".join(json.dumps({"text": d}) + "\n" for d in docs).encode()


def _docs(out):
  ds = load_dataset(out)
  return sorted(
    ds.tokenizer.decode(ds.stream(s).doc(d))
    for s in ("train", "val")
    for d in range(ds.stream(s).num_docs)
  )


def _check(tmp_path, inputs, named, *, records=0, files=0, kept=GOOD):
  """``prepare`` stops naming ``named``; with ``skip_bad`` it keeps ``kept`` and counts the rest.
  The CLI says the same in one line, exit 2."""
  with pytest.raises(ValueError, match=named):
    prepare(inputs, str(tmp_path / "stop"), progress=False)
  code, _, err = run_cli("prepare", *inputs, "--out", str(tmp_path / "cli"), "--no-progress")
  assert code == 2 and err.count("\n") == 1 and re.search(named, err), err
  assert "--skip-bad" in err
  meta = prepare(inputs, str(tmp_path / "skip"), progress=False, skip_bad=True)
  assert meta["skipped"]["records"] == records and meta["skipped"]["files"] == files
  assert _docs(tmp_path / "skip") == sorted(kept)


@pytest.mark.parametrize(
  "line, problem",
  [
    ('{"body": "no text field"}', "expected an object with a string field 'text'"),
    ('{"text": 7}', "field 'text' is int, expected a string"),
    ('{"text": ""}', r"empty document \(field 'text' is ''\)"),
    ('{"text": "cut', "invalid JSON"),
  ],
)
def test_bad_json_lines_are_named_by_line(tmp_path, line, problem):
  path = tmp_path / "c.jsonl"
  path.write_bytes(_jsonl(GOOD[:5]) + line.encode() + b"\n" + _jsonl(GOOD[5:]))
  _check(tmp_path, [str(path)], rf"{path}:6: {problem}", records=1)


def test_undecodable_json_lines_spoil_their_file(tmp_path):
  bad = tmp_path / "bad.jsonl"
  bad.write_bytes(b'{"text": "\xff\xfe\xfd latin-1 words \xe9\xe8"}\n' * 10)
  (tmp_path / "good.jsonl").write_bytes(_jsonl(GOOD))
  inputs = [str(bad), str(tmp_path / "good.jsonl")]
  _check(tmp_path, inputs, rf"{bad}: 50 undecodable byte sequences in \d+ bytes", files=1)


def test_corrupt_gzip_stream_spoils_its_file(tmp_path):
  whole = gzip.compress(_jsonl([f"lost document {i}\n" for i in range(500)]))
  bad = tmp_path / "a.jsonl.gz"
  bad.write_bytes(whole[: len(whole) // 2])  # truncated: an EOFError in the middle of a line
  (tmp_path / "b.jsonl.gz").write_bytes(gzip.compress(_jsonl(GOOD)))
  inputs = [str(tmp_path / "*.jsonl.gz")]
  _check(tmp_path, inputs, rf"{bad}:\d+: corrupt gzip stream", files=1)


def test_corrupt_zstd_stream_spoils_its_file(tmp_path):
  zstandard = pytest.importorskip("zstandard", reason="the 'data' extra (zstandard) is missing")
  whole = bytearray(
    zstandard.ZstdCompressor().compress(_jsonl([f"lost {i}\n" for i in range(500)]))
  )
  whole[len(whole) // 2 : len(whole) // 2 + 64] = bytes(64)
  bad = tmp_path / "a.jsonl.zst"
  bad.write_bytes(bytes(whole))
  (tmp_path / "b.jsonl").write_bytes(_jsonl(GOOD))
  _check(
    tmp_path, [str(bad), str(tmp_path / "b.jsonl")], rf"{bad}:\d+: corrupt zstd stream", files=1
  )


def test_truncated_zstd_stream_spoils_its_file(tmp_path):
  """A zstd frame cut short decodes to nothing without an error of zstd's own: the reader checks
  that the frame ended."""
  zstandard = pytest.importorskip("zstandard", reason="the 'data' extra (zstandard) is missing")
  whole = zstandard.ZstdCompressor().compress(_jsonl([f"lost {i}\n" for i in range(500)]))
  bad = tmp_path / "a.jsonl.zst"
  bad.write_bytes(whole[: len(whole) // 2])
  (tmp_path / "b.jsonl").write_bytes(_jsonl(GOOD))
  _check(
    tmp_path, [str(bad), str(tmp_path / "b.jsonl")], rf"{bad}:\d+: corrupt zstd stream", files=1
  )


def test_corrupt_parquet_row_group_spoils_its_file(tmp_path):
  pa = pytest.importorskip("pyarrow", reason="the 'data' extra (pyarrow) is missing")
  import pyarrow.parquet as pq

  bad = tmp_path / "a.parquet"
  pq.write_table(
    pa.table({"text": [f"doc {i} " * 20 for i in range(200)]}), bad, row_group_size=100
  )
  column = pq.ParquetFile(bad).metadata.row_group(1).column(0)
  data = bytearray(bad.read_bytes())
  start, size = column.dictionary_page_offset, column.total_compressed_size
  data[start + 8 : start + size - 8] = bytes(size - 16)  # the second row group's pages, zeroed
  bad.write_bytes(bytes(data))
  pq.write_table(pa.table({"text": GOOD}), tmp_path / "b.parquet")
  _check(tmp_path, [str(tmp_path / "*.parquet")], rf"{bad}: row group 1: unreadable", files=1)


def test_parquet_without_the_text_column_and_null_rows(tmp_path):
  pa = pytest.importorskip("pyarrow", reason="the 'data' extra (pyarrow) is missing")
  import pyarrow.parquet as pq

  other = tmp_path / "a.parquet"
  pq.write_table(pa.table({"body": GOOD}), other)
  with pytest.raises(ValueError, match=rf"{other}: no column 'text' \(it has body\); give --text"):
    prepare([str(other)], str(tmp_path / "o"), progress=False)
  nulls = tmp_path / "n.parquet"
  pq.write_table(pa.table({"text": GOOD[:3] + [None] + GOOD[3:]}), nulls, row_group_size=8)
  _check(tmp_path, [str(nulls)], rf"{nulls}: row group 0, row 3: 'text' is null", records=1)


def test_datasets_folder_with_a_cut_shard_is_named(tmp_path):
  datasets = pytest.importorskip("datasets", reason="the 'data' extra (datasets) is missing")
  datasets.disable_progress_bars()
  folder = tmp_path / "hf"
  datasets.Dataset.from_dict({"text": GOOD}).save_to_disk(str(folder), num_shards=2)
  shard = sorted(folder.glob("*.arrow"))[1]
  shard.write_bytes(shard.read_bytes()[:-40])  # cut inside its record batch
  with pytest.raises(ValueError, match=rf"{shard}: record batch 0: unreadable"):
    prepare([str(folder)], str(tmp_path / "o"), progress=False)
