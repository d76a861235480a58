"""``prepare(..., engine="ray")``: the preparation as a Ray Data job on a local Ray instance writes
the same dataset, byte for byte, as the one-machine path."""

import gzip
import importlib
import json

import pytest

from transformer_jax.data import prepare

ray = pytest.importorskip("ray")
prepare_module = importlib.import_module("transformer_jax.data.prepare")  # not the function


def _corpus(root):
  import pyarrow as pa
  import pyarrow.parquet as pq

  root.mkdir()
  words = "alpha beta gamma delta return import class def self value".split()
  docs = [f"doc {i}: " + " ".join(words[(i * j) % 10] for j in range(40)) for i in range(120)]
  lines = [json.dumps({"text": d}) for d in docs[:40]]
  (root / "a.jsonl").write_text("\n".join(lines[:20] + ["{not json"] + lines[20:]) + "\n")
  table = pa.table({"text": docs[40:80]})
  pq.write_table(table, root / "b.parquet", row_group_size=16)
  (root / "c.txt").write_text("\n".join(docs[80:100]))
  spoilt = gzip.compress("".join(json.dumps({"text": d}) + "\n" for d in docs[100:]).encode())
  (root / "d.jsonl.gz").write_bytes(spoilt[: len(spoilt) // 2])  # a corrupt gzip stream
  return root


@pytest.mark.long
@pytest.mark.slow  # ~15 s: starts a local Ray instance and its workers
def test_the_ray_job_writes_the_same_dataset_byte_for_byte(tmp_path, capsys, monkeypatch):
  corpus = _corpus(tmp_path / "c")
  kw = dict(val_fraction=0.2, seed=3, progress=False, skip_bad=True, workers=2, shard_bytes=2048)
  one = prepare([str(corpus)], str(tmp_path / "threads"), **kw)
  capsys.readouterr()

  def no_threads(*args, **kwargs):
    raise AssertionError("engine='ray' ran the thread pool's stream")

  monkeypatch.setattr(prepare_module, "stream_corpus", no_threads)
  job = prepare([str(corpus)], str(tmp_path / "ray"), engine="ray", **kw)
  assert "skipped: " in capsys.readouterr().err
  assert job == one and one["skipped"] == {"records": 1, "files": 1, "empty_documents": 0}
  names = sorted(p.name for p in (tmp_path / "threads").iterdir())
  assert names == sorted(p.name for p in (tmp_path / "ray").iterdir())
  assert len([n for n in names if n.startswith("train_0")]) > 1
  for name in names:
    assert (tmp_path / "threads" / name).read_bytes() == (tmp_path / "ray" / name).read_bytes()


def test_the_ray_engine_refuses_synthetic_inputs_by_name(tmp_path):
  with pytest.raises(ValueError, match="engine='ray' reads files"):
    prepare(["synthetic:reverse:10"], str(tmp_path / "o"), task="seq2seq", engine="ray")
