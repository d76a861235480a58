"""The same documents in every corpus format ``prepare`` reads give the same prepared dataset;
damaged inputs are named (file, line, row group) or, with ``skip_bad``, skipped and counted."""

import contextlib
import functools
import gzip
import http.server
import io
import json
import os
import random
import threading
import uuid

import pytest

from transformer_jax.data import load_dataset, prepare

WORDS = "alpha beta gamma delta return import class über naïve 日本 café None 42 {} [] \t".split(
  " "
)


def _docs(n=300, seed=0):
  rng = random.Random(seed)
  docs = []
  for i in range(n):
    lines = [" ".join(rng.choice(WORDS) for _ in range(rng.randint(1, 12))) for _ in range(3)]
    docs.append(f"doc {i}\n" + "\n".join(lines[: rng.randint(1, 3)]))
  return docs


DOCS = _docs()


def _jsonl(docs, field="text") -> bytes:
  return "".join(json.dumps({field: d, "id": i}) + "\n" for i, d in enumerate(docs)).encode()


def _write_formats(root):
  """The corpus in each format: {name: the input names given to prepare}."""
  inputs = {}
  txt = root / "txt"
  txt.mkdir()
  for i, d in enumerate(DOCS):
    (txt / f"d{i:03d}.txt").write_text(d, encoding="utf-8")
  inputs["txt folder"] = [str(txt)]
  (root / "c.jsonl").write_bytes(_jsonl(DOCS))
  inputs["jsonl"] = [str(root / "c.jsonl")]
  (root / "c.json.gz").write_bytes(gzip.compress(_jsonl(DOCS)))
  inputs["json.gz"] = [str(root / "c.json.gz")]
  parts = root / "parts"
  parts.mkdir()
  for k in range(3):  # a glob over shards, each gzip-compressed
    (parts / f"part-{k}.jsonl.gz").write_bytes(gzip.compress(_jsonl(DOCS[k * 100 : k * 100 + 100])))
  inputs["jsonl.gz glob"] = [str(parts / "part-*.jsonl.gz")]
  try:
    import zstandard

    (root / "c.jsonl.zst").write_bytes(zstandard.ZstdCompressor().compress(_jsonl(DOCS)))
    inputs["jsonl.zst"] = [str(root / "c.jsonl.zst")]
    frames = [
      zstandard.ZstdCompressor().compress(_jsonl(DOCS[k * 100 : k * 100 + 100])) for k in range(3)
    ]
    (root / "f.jsonl.zst").write_bytes(b"".join(frames))  # several frames, as zstd -T writes
    inputs["jsonl.zst, 3 frames"] = [str(root / "f.jsonl.zst")]
  except ImportError:
    pass
  try:
    import pyarrow as pa
    import pyarrow.parquet as pq

    pq.write_table(pa.table({"text": DOCS}), root / "c.parquet", row_group_size=64)
    inputs["parquet"] = [str(root / "c.parquet")]
    inputs["file:// parquet"] = [(root / "c.parquet").as_uri()]
  except ImportError:
    pass
  try:
    import datasets

    datasets.disable_progress_bars()
    folder = root / "hf"
    datasets.Dataset.from_dict({"text": DOCS}).save_to_disk(str(folder), num_shards=2)
    inputs["datasets folder"] = [str(folder)]
    inputs["arrow files"] = [str(p) for p in sorted(folder.glob("*.arrow"))]
  except ImportError:
    pass
  try:
    import fsspec

    memory = fsspec.filesystem("memory")
    base = f"/tjax-{uuid.uuid4().hex}"
    for k in range(3):
      memory.pipe(f"{base}/part-{k}.jsonl", _jsonl(DOCS[k * 100 : k * 100 + 100]))
    inputs["memory:// glob"] = [f"memory://{base}/part-*.jsonl"]
  except ImportError:
    pass
  return inputs


def _dataset_files(out):
  return {p.name: p.read_bytes() for p in sorted(out.iterdir()) if p.name != "metadata.json"}


def test_every_format_gives_the_same_dataset(tmp_path, capsys):
  inputs = _write_formats(tmp_path)
  reference = None
  for name, given in inputs.items():
    out = tmp_path / ("out-" + "".join(c if c.isalnum() else "_" for c in name))
    meta = prepare(given, str(out), val_fraction=0.1, compact_vocab=True, progress=False)
    files = _dataset_files(out)
    if reference is None:
      reference, ref_meta = files, meta
      ds = load_dataset(out)
      tok = ds.tokenizer
      got = sorted(
        tok.decode(ds.stream(s).doc(d))
        for s in ("train", "val")
        for d in range(ds.stream(s).num_docs)
      )
      assert got == sorted(DOCS)
      assert 0 < meta["splits"]["val"]["documents"] < len(DOCS)
      continue
    assert meta["splits"] == ref_meta["splits"], name
    assert files.keys() == reference.keys(), name
    for f in files:
      assert files[f] == reference[f], f"{name}: {f} differs"
  assert len(inputs) >= 4  # txt, jsonl, json.gz, glob: the core formats at least
  for name in ("jsonl.gz glob", "memory:// glob"):  # a second prepare is a no-op
    if name in inputs:
      capsys.readouterr()
      out = tmp_path / ("out-" + "".join(c if c.isalnum() else "_" for c in name))
      prepare(inputs[name], str(out), val_fraction=0.1, compact_vocab=True, progress=False)
      assert "up to date" in capsys.readouterr().out, name


class _RangeHandler(http.server.SimpleHTTPRequestHandler):
  """A file server that answers range requests, as object stores and the Hub do (Python's own
  answers every request with the whole file)."""

  def send_head(self):
    path = self.translate_path(self.path)
    if os.path.isdir(path) or "Range" not in self.headers:
      return super().send_head()
    with open(path, "rb") as f:
      data = f.read()
    first, last = self.headers["Range"].split("=", 1)[1].split("-")
    body = data[int(first) : (int(last) + 1 if last else len(data))]
    self.send_response(206)
    self.send_header("Content-Range", f"bytes {first}-{int(first) + len(body) - 1}/{len(data)}")
    self.send_header("Content-Length", str(len(body)))
    self.end_headers()
    return io.BytesIO(body)

  def log_message(self, *args):
    pass


class _PlainHandler(http.server.SimpleHTTPRequestHandler):
  def log_message(self, *args):
    pass


@contextlib.contextmanager
def _serving(root, handler):
  server = http.server.ThreadingHTTPServer(
    ("127.0.0.1", 0), functools.partial(handler, directory=str(root))
  )
  thread = threading.Thread(target=server.serve_forever, args=(0.05,), daemon=True)
  thread.start()
  try:
    yield f"http://127.0.0.1:{server.server_address[1]}"
  finally:
    server.shutdown()
    server.server_close()


def test_http_urls_give_the_same_dataset_from_any_server(tmp_path, monkeypatch):
  """JSON lines stream in one response from a server that answers no range requests; Parquet
  seeks, which a server answering them allows. fsspec's blocks are cut to 4 KiB here, so the
  files span several."""
  fsspec = pytest.importorskip("fsspec", reason="the 'data' extra (fsspec) is missing")
  pytest.importorskip("aiohttp", reason="the 'data' extra (fsspec[http]) is missing")
  pa = pytest.importorskip("pyarrow", reason="the 'data' extra (pyarrow) is missing")
  import pyarrow.parquet as pq

  monkeypatch.setitem(fsspec.config.conf, "http", {"block_size": 4096})
  root = tmp_path / "served"
  (root / "parts").mkdir(parents=True)
  (root / "c.jsonl.gz").write_bytes(gzip.compress(_jsonl(DOCS)))
  for k in range(3):
    (root / "parts" / f"part-{k}.jsonl").write_bytes(_jsonl(DOCS[k * 100 : k * 100 + 100]))
  pq.write_table(pa.table({"text": DOCS}), root / "c.parquet", row_group_size=64)
  kw = dict(val_fraction=0.1, compact_vocab=True, progress=False)
  prepare([str(root / "c.jsonl.gz")], str(tmp_path / "local"), **kw)
  want = _dataset_files(tmp_path / "local")
  with _serving(root, _PlainHandler) as url:
    for name in ("c.jsonl.gz", "parts/part-*.jsonl"):
      out = tmp_path / ("plain-" + name.replace("/", "_").replace("*", "_"))
      prepare([f"{url}/{name}"], str(out), **kw)
      assert _dataset_files(out) == want, name
  with _serving(root, _RangeHandler) as url:
    prepare([f"{url}/c.parquet"], str(tmp_path / "ranges"), **kw)
    assert _dataset_files(tmp_path / "ranges") == want


def test_split_follows_content_not_order_or_file(tmp_path):
  (tmp_path / "a.jsonl").write_bytes(_jsonl(DOCS[:50]))
  (tmp_path / "b.jsonl").write_bytes(_jsonl(DOCS[50:100][::-1]))
  (tmp_path / "c.jsonl").write_bytes(_jsonl(DOCS[:100][::-1]))

  def val_docs(inputs, out):
    prepare(inputs, str(tmp_path / out), val_fraction=0.2, progress=False)
    ds = load_dataset(tmp_path / out)
    s = ds.stream("val")
    return {ds.tokenizer.decode(s.doc(d)) for d in range(s.num_docs)}

  two = val_docs([str(tmp_path / "a.jsonl"), str(tmp_path / "b.jsonl")], "two")
  assert two == val_docs([str(tmp_path / "c.jsonl")], "one") and 0 < len(two) < 100


def test_chunked_copy_matches_one_chunk(tmp_path, monkeypatch):
  from transformer_jax.data import shards

  (tmp_path / "c.jsonl").write_bytes(_jsonl(DOCS))
  prepare([str(tmp_path / "c.jsonl")], str(tmp_path / "big"), compact_vocab=50, progress=False)
  monkeypatch.setattr(shards, "CHUNK_TOKENS", 7)  # many chunks, documents longer than one
  prepare([str(tmp_path / "c.jsonl")], str(tmp_path / "small"), compact_vocab=50, progress=False)
  assert _dataset_files(tmp_path / "big") == _dataset_files(tmp_path / "small")


def test_parquet_is_read_by_row_groups(tmp_path, monkeypatch):
  pa = pytest.importorskip("pyarrow", reason="the 'data' extra (pyarrow) is missing")
  import pyarrow.parquet as pq

  pq.write_table(pa.table({"text": DOCS[:100]}), tmp_path / "c.parquet", row_group_size=16)

  def whole_file(*args, **kwargs):
    raise AssertionError("read the whole file")

  monkeypatch.setattr(pq.ParquetFile, "read", whole_file)
  monkeypatch.setattr(pq, "read_table", whole_file)
  meta = prepare([str(tmp_path / "c.parquet")], str(tmp_path / "o"), val_fraction=0, progress=False)
  assert meta["splits"]["train"]["documents"] == 100


def test_a_row_group_is_decoded_a_batch_of_rows_at_a_time(tmp_path):
  """A row group may hold gigabytes of text: the reader holds a batch of its rows, and names a
  bad row by its place in the group."""
  import tracemalloc

  pa = pytest.importorskip("pyarrow", reason="the 'data' extra (pyarrow) is missing")
  import pyarrow.parquet as pq

  from transformer_jax.data.readers import Problem, read_records
  from transformer_jax.data.sources import resolve_inputs

  rows = ["x" * 500 + str(i) for i in range(8192)]  # one row group, 4 MB of text
  rows[2000] = None
  pq.write_table(pa.table({"text": rows}), tmp_path / "c.parquet", row_group_size=len(rows))
  (source,), _ = resolve_inputs([str(tmp_path / "c.parquet")], "gpt")
  tracemalloc.start()
  try:
    items = problems = 0
    for item in read_records(source, "text", allow_undecodable=False):
      items += 1
      if isinstance(item, Problem):
        problems += 1
        assert str(item).endswith("c.parquet: row group 0, row 2000: 'text' is null"), item
    peak = tracemalloc.get_traced_memory()[1]
  finally:
    tracemalloc.stop()
  assert items == len(rows) and problems == 1
  assert peak < 1_500_000, peak  # a batch of 1024 rows is ~0.6 MB of Python strings


@pytest.mark.slow  # ~6 s: tracemalloc slows every allocation of tokenizing 1 M tokens
def test_memory_holds_batches_not_the_corpus(tmp_path, monkeypatch):
  import tracemalloc

  from transformer_jax.data import shards, stream

  rng = random.Random(3)
  docs = [" ".join(rng.choice(WORDS[:10]) for _ in range(400)) for _ in range(2000)]
  path = tmp_path / "c.jsonl"
  path.write_bytes(_jsonl(docs))  # ~5 MB of text, ~0.9 M tokens (3.6 MB as uint32)
  monkeypatch.setattr(stream, "BATCH_DOCS", 8)
  monkeypatch.setattr(shards, "CHUNK_TOKENS", 1 << 14)
  prepare([str(path)], str(tmp_path / "warm"), progress=False)  # loads the tokenizer's tables
  tracemalloc.start()
  try:
    meta = prepare([str(path)], str(tmp_path / "o"), progress=False, workers=1, seed=1)
    peak = tracemalloc.get_traced_memory()[1]
  finally:
    tracemalloc.stop()
  tokens = sum(s["tokens"] for s in meta["splits"].values())
  # Holding the corpus costs its text (5 MB) plus its tokens (4 bytes each, 3.8 MB). The stream
  # holds the content hash's two 1 MiB read blocks, a few batches of 8 documents (~0.1 MB as
  # Python int lists), one 16 Ki-token chunk (~0.3 MB with its gather indices) and 16 bytes a
  # document: under 3 MB.
  assert tokens > 900_000 and peak < 3_000_000, (peak, tokens)
