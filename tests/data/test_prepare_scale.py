"""``prepare`` at corpus scale: tokenizing on every core, shards with a size limit read as one
stream, resuming an interrupted run, and the dry run's estimate."""

import argparse
import importlib

import os

import numpy as np
import pytest

from transformer_jax.cli.prepare import add_prepare_args
from transformer_jax.data import Tokenizer, prepare
from transformer_jax.data.shards import _gather

# The module (``transformer_jax.data.prepare`` is also the name of the function).
prepare_module = importlib.import_module("transformer_jax.data.prepare")


@pytest.mark.parametrize("name", ["cl100k_base", "chars:abdefnotx<|>"])
def test_encode_full_array_equals_encode_full(name):
  tok = Tokenizer(name)
  texts = ["abd", "", "a<|endoftext|>b"]
  if not name.startswith("chars:"):
    texts += ["naïve 日本 café\n\tdef f(x):\n", "lone \ud800 surrogate", "x" * 10_000]
  for text in texts:
    array = tok.encode_full_array(text)
    assert array.dtype == np.uint32
    assert array.tolist() == tok.encode_full(text), text


def test_gather_copies_runs_of_documents():
  rng = np.random.default_rng(0)
  lengths = rng.integers(0, 9, 200)
  offsets = np.concatenate([[0], np.cumsum(lengths)])
  tokens = rng.integers(0, 1000, int(offsets[-1])).astype(np.uint32)
  for p in (0.05, 0.5, 1.0):
    docs = np.flatnonzero(rng.random(200) < p)
    want = np.concatenate([tokens[offsets[d] : offsets[d + 1]] for d in docs])
    np.testing.assert_array_equal(_gather(tokens, offsets, docs), want)


def test_the_command_tokenizes_in_forked_processes_without_loading_jax(corpus_dir, tmp_path):
  """``tjax prepare`` never imports JAX (its start-up is most of a small corpus's time), so its
  workers are forked; here, with JAX loaded, they are spawned: the bytes are the same."""
  import subprocess
  import sys

  from transformer_jax.data import stream

  program = (
    "import sys\nfrom transformer_jax.cli import main\n"
    f"code = main(['prepare', {str(corpus_dir)!r}, '--out', {str(tmp_path / 'cli')!r}, "
    "'--workers', '2', '--no-progress'])\n"
    "assert code == 0 and 'jax' not in sys.modules, (code, 'jax' in sys.modules)\n"
  )
  env = {**os.environ, "PYTHONPATH": os.getcwd()}
  done = subprocess.run([sys.executable, "-c", program], env=env, capture_output=True, text=True)
  assert done.returncode == 0, done.stderr
  pools = []
  real = stream.tokenizer_pool

  def spy(workers, tok):
    pools.append(pool := real(workers, tok))
    return pool

  for workers in (1, 2):
    prepare_module.tokenizer_pool = spy
    try:
      prepare([str(corpus_dir)], str(tmp_path / f"w{workers}"), progress=False, workers=workers)
    finally:
      prepare_module.tokenizer_pool = real
  assert [type(p).__name__ for p in pools] == ["ThreadPoolExecutor", "ProcessPoolExecutor"]
  assert pools[1]._mp_context.get_start_method() == "spawn"  # JAX is loaded here
  for other in ("w1", "w2"):
    _same_dataset(tmp_path / "cli", tmp_path / other)


def test_a_script_without_a_main_guard_is_told_to_add_one(corpus_dir, tmp_path):
  """With JAX loaded the workers are spawned, and each first runs the main script again: a script
  that calls prepare at its top level gets one error naming the guard (not a broken pool), and no
  dataset that looks complete."""
  import subprocess
  import sys

  out = tmp_path / "out"
  script = tmp_path / "prep.py"
  script.write_text(
    "import jax  # noqa: F401\nfrom transformer_jax import data\n"
    f"data.prepare([{str(corpus_dir)!r}], {str(out)!r}, workers=2, progress=False)\n"
  )
  env = {**os.environ, "PYTHONPATH": os.getcwd()}
  done = subprocess.run(
    [sys.executable, str(script)],
    cwd=tmp_path,
    env=env,
    capture_output=True,
    text=True,
    timeout=300,
  )
  assert done.returncode == 1, done.stderr[-3000:]
  last = done.stderr.strip().splitlines()[-1]
  assert last.startswith("RuntimeError: prepare's 2 tokenizing processes ended as they started"), (
    done.stderr[-3000:]
  )
  assert 'if __name__ == "__main__":' in last and "workers=1" in last
  assert not (out / "metadata.json").exists()


@pytest.mark.parametrize("parts", [1, 2, 3, 7])
def test_a_batch_is_shared_among_workers_by_characters_in_order(parts):
  from transformer_jax.data.stream import split_by_size

  rng = np.random.default_rng(parts)
  docs = [("x" * int(n),) for n in rng.integers(1, 2000, size=50)] + [("", "y" * 5)]
  shares = split_by_size(docs, parts)
  assert [d for s in shares for d in s] == docs and all(shares) and len(shares) <= parts
  chars = [sum(len(t) for d in share for t in d) for share in shares]
  # Each share is within one document of an equal share of the characters.
  assert max(chars) - sum(chars) / len(chars) <= 2001, chars
  assert split_by_size(docs[:1], parts) == [docs[:1]]


def test_workers_default_to_every_core_past_a_small_corpus(corpus_dir, tmp_path, monkeypatch):
  """Without ``workers``: one a core, or on the local engine this process alone for a corpus
  under ``SMALL_CORPUS_BYTES`` (its files' bytes, 64 a synthetic example); a URL's size is not
  asked."""
  args = add_prepare_args(argparse.ArgumentParser()).parse_args(["x", "--out", "y"])
  assert args.workers is None
  seen = []
  real = prepare_module.Pipeline.__init__

  def spy(self, pool, workers, *rest):
    seen.append(workers)
    real(self, pool, workers, *rest)

  monkeypatch.setattr(prepare_module, "available_cores", lambda: 3)
  monkeypatch.setattr(prepare_module.Pipeline, "__init__", spy)
  size = sum(p.stat().st_size for p in corpus_dir.rglob("*") if p.is_file())
  for limit, out, workers in ((size + 1, "small", 1), (size, "at_the_limit", 3)):
    monkeypatch.setattr(prepare_module, "SMALL_CORPUS_BYTES", limit)
    prepare([str(corpus_dir)], str(tmp_path / out), progress=False)
    assert seen.pop() == workers
  # A Ray job's local instance gets every core, whatever the corpus.
  monkeypatch.setattr(prepare_module, "SMALL_CORPUS_BYTES", size + 1)

  class Started(Exception):
    pass

  def ray_job(sources, synthetic, pipeline, **kw):
    seen.append(pipeline.workers)
    raise Started

  monkeypatch.setitem(prepare_module._ENGINE_STREAM, "ray", lambda: ray_job)
  with pytest.raises(Started):
    prepare([str(corpus_dir)], str(tmp_path / "ray"), progress=False, engine="ray")
  assert seen.pop() == 3
  default = prepare_module.default_workers
  monkeypatch.setattr(prepare_module, "SMALL_CORPUS_BYTES", 64 * 100)
  assert default([], ["synthetic:reverse:99"]) == 1
  assert default([], ["synthetic:reverse:50", "synthetic:reverse:50"]) == 3
  remote = prepare_module.Source(key="a.jsonl", path="memory://corpus/a.jsonl", kind="jsonl")
  assert default([remote], []) == 3


# ---- shards with a size limit --------------------------------------------------------------------


def _batches(ds, kind, steps=4, **kw):
  from transformer_jax.data import make_loader

  loader = make_loader(kind, ds, **kw)
  return [loader.batch_at(s) for s in range(steps)]


def _assert_same(a, b):
  assert len(a) == len(b)
  for x, y in zip(a, b):
    assert x.keys() == y.keys()
    for k in x:
      np.testing.assert_array_equal(x[k], y[k], err_msg=k)


def test_many_small_shards_read_as_the_one_stream(corpus_dir, text_dataset_dir, tmp_path):
  from transformer_jax.data import gpt_eval_batches, load_dataset, unigram_cross_entropy

  out = tmp_path / "sharded"
  meta = prepare(
    [str(corpus_dir)], str(out), val_fraction=4, seed=0, progress=False, shard_bytes=400
  )
  one, many = load_dataset(str(text_dataset_dir)), load_dataset(str(out))
  train = meta["splits"]["train"]["streams"]["tokens"]
  assert len(train["shards"]) > 5 and max(train["shard_tokens"]) == 100
  assert sum(train["shard_tokens"]) == train["tokens"]
  for split in ("train", "val"):
    a, b = one.stream(split), many.stream(split)
    np.testing.assert_array_equal(np.asarray(a.tokens), np.asarray(b.tokens))
    np.testing.assert_array_equal(a.offsets, b.offsets)
    for d in range(a.num_docs):
      np.testing.assert_array_equal(a.doc(d), b.doc(d))
  gpt = dict(batch_size=4, seq_len=32, seed=3)
  _assert_same(_batches(one, "gpt", **gpt), _batches(many, "gpt", **gpt))
  _assert_same(_batches(one, "bert", **gpt), _batches(many, "bert", **gpt))
  evals = dict(batch_size=4, seq_len=32)
  _assert_same(list(gpt_eval_batches(one, **evals)), list(gpt_eval_batches(many, **evals)))
  assert unigram_cross_entropy(one) == unigram_cross_entropy(many)


def test_sharded_pairs_give_the_same_seq2seq_batches(tmp_path):
  from transformer_jax.data import load_dataset

  kw = dict(task="seq2seq", val_fraction=0.1, seed=0, progress=False)
  prepare(["synthetic:reverse:300"], str(tmp_path / "one"), **kw)
  prepare(["synthetic:reverse:300"], str(tmp_path / "many"), shard_bytes=64, **kw)
  one, many = load_dataset(str(tmp_path / "one")), load_dataset(str(tmp_path / "many"))
  assert len(many.meta["splits"]["train"]["streams"]["src"]["shards"]) > 10
  _assert_same(_batches(one, "seq2seq", batch_size=8), _batches(many, "seq2seq", batch_size=8))


def test_sharded_tokens_index_like_the_concatenation():
  from transformer_jax.data.dataset import ShardedTokens

  rng = np.random.default_rng(1)
  parts = [rng.integers(0, 99, n).astype(np.uint32) for n in (5, 0, 7, 1, 9)]
  whole, view = np.concatenate(parts), ShardedTokens(parts)
  assert view.size == len(view) == whole.size and view.max() == whole.max()
  for key in (
    slice(None),
    slice(3, 14),
    slice(4, 5),
    slice(12, 12),
    slice(-6, None),
    slice(1, 20, 3),
  ):
    np.testing.assert_array_equal(view[key], whole[key])
  index = rng.integers(-whole.size, whole.size, (3, 4))
  np.testing.assert_array_equal(view[index], whole[index])
  assert view[13] == whole[13] and view[-1] == whole[-1]
  with pytest.raises(IndexError):
    view[np.array([whole.size])]


def test_a_shard_that_disagrees_with_its_index_is_named(corpus_dir, tmp_path):
  from transformer_jax.data import load_dataset

  out = tmp_path / "ds"
  prepare([str(corpus_dir)], str(out), val_fraction=4, progress=False, shard_bytes=400)
  shard = out / "train_001.bin"
  shard.write_bytes(shard.read_bytes()[:-4])
  with pytest.raises(ValueError, match="train_001.bin: 99 tokens, the shard index"):
    load_dataset(str(out))
  # ... and a rebuild does not take the folder for up to date.
  prepare([str(corpus_dir)], str(out), val_fraction=4, progress=False, shard_bytes=400)
  assert load_dataset(str(out)).stream("train").tokens.size > 0


def test_a_rebuild_with_bigger_shards_removes_the_extra_ones(corpus_dir, tmp_path):
  out = tmp_path / "ds"
  prepare([str(corpus_dir)], str(out), val_fraction=4, progress=False, shard_bytes=400)
  assert (out / "train_005.bin").exists()
  meta = prepare([str(corpus_dir)], str(out), val_fraction=4, progress=False)
  assert meta["splits"]["train"]["streams"]["tokens"]["shards"] == ["train_000.bin"]
  assert sorted(p.name for p in out.glob("train_*.bin")) == ["train_000.bin"]


# ---- progress and resumption ---------------------------------------------------------------------


def _jsonl_corpus(root, files=6, docs=400, words=300, seed=0):
  import json
  import random

  rng = random.Random(seed)
  vocab = "alpha beta gamma delta return import class def self value index total node".split()
  root.mkdir(parents=True, exist_ok=True)
  for f in range(files):
    lines = [
      json.dumps({"text": f"{f}-{d} " + " ".join(rng.choice(vocab) for _ in range(words))})
      for d in range(docs)
    ]
    (root / f"part_{f}.jsonl").write_text("\n".join(lines) + "\n")
  return root


def _same_dataset(a, b):
  import json

  names = sorted(p.name for p in a.iterdir())
  assert names == sorted(p.name for p in b.iterdir())
  for name in names:
    if name == "metadata.json":
      assert json.loads((a / name).read_text()) == json.loads((b / name).read_text())
    else:
      assert (a / name).read_bytes() == (b / name).read_bytes(), name


def test_an_interrupted_prepare_resumes_from_its_checkpoint(tmp_path, monkeypatch, capsys):
  from transformer_jax.data import stream

  corpus = _jsonl_corpus(tmp_path / "c", files=3, docs=40, words=20)
  kw = dict(val_fraction=0.2, progress=False, workers=2, shard_bytes=4096)
  prepare([str(corpus)], str(tmp_path / "whole"), **kw)
  monkeypatch.setattr(stream, "BATCH_DOCS", 7)
  monkeypatch.setattr(stream, "CHECKPOINT_SECONDS", 1e9)  # no checkpoint but Ctrl-C's
  written = []
  real = stream.PendingDocs.extend

  def interrupt_after_five_batches(self, docs):
    written.append(len(docs))
    if sum(1 for n in written if n) > 10:  # a batch is split in two parts (two workers)
      raise KeyboardInterrupt
    real(self, docs)

  monkeypatch.setattr(stream.PendingDocs, "extend", interrupt_after_five_batches)
  out = tmp_path / "out"
  with pytest.raises(KeyboardInterrupt):
    prepare([str(corpus)], str(out), **kw)
  assert "the same command resumes" in capsys.readouterr().err
  assert (out / "progress.json").exists() and not (out / "metadata.json").exists()
  monkeypatch.setattr(stream.PendingDocs, "extend", real)
  prepare([str(corpus)], str(out), **kw)
  # Ctrl-C checkpoints what was written: the five whole batches of seven documents.
  assert "resuming " + str(out) + ": 35 documents" in capsys.readouterr().err
  _same_dataset(tmp_path / "whole", out)


def test_a_resumed_run_keeps_the_counts_of_skipped_records(tmp_path, monkeypatch):
  from transformer_jax.data import stream

  corpus = _jsonl_corpus(tmp_path / "c", files=2, docs=30, words=10)
  with open(corpus / "part_0.jsonl", "a") as f:
    f.write("not json\n" + '{"text": "after the bad line"}\n' * 20)
  kw = dict(val_fraction=0.2, progress=False, workers=1, skip_bad=True)
  whole = prepare([str(corpus)], str(tmp_path / "whole"), **kw)
  monkeypatch.setattr(stream, "BATCH_DOCS", 5)
  monkeypatch.setattr(stream, "CHECKPOINT_SECONDS", 0.0)
  real, calls = stream.PendingDocs.extend, []

  def interrupt(self, docs):
    calls.append(1)
    if len(calls) == 9:  # past the bad line (document 31)
      raise KeyboardInterrupt
    real(self, docs)

  monkeypatch.setattr(stream.PendingDocs, "extend", interrupt)
  with pytest.raises(KeyboardInterrupt):
    prepare([str(corpus)], str(tmp_path / "out"), **kw)
  monkeypatch.setattr(stream.PendingDocs, "extend", real)
  resumed = prepare([str(corpus)], str(tmp_path / "out"), **kw)
  assert resumed["skipped"] == whole["skipped"] and resumed["skipped"]["records"] == 1
  _same_dataset(tmp_path / "whole", tmp_path / "out")


def _children(pid: int) -> list[int]:
  with open(f"/proc/{pid}/task/{pid}/children") as f:
    return [int(c) for c in f.read().split()]


@pytest.mark.long
@pytest.mark.skipif(not os.path.exists("/proc/self/task"), reason="reads /proc (Linux)")
@pytest.mark.slow  # ~10 s: a real `tjax prepare` process, killed, then the rerun
def test_a_killed_prepare_process_resumes_and_never_looks_complete(tmp_path, capsys):
  import signal
  import subprocess
  import sys
  import time

  from transformer_jax.data import load_dataset

  corpus = _jsonl_corpus(tmp_path / "c", files=8, docs=1500, words=300)
  out = tmp_path / "out"
  args = [
    str(corpus),
    "--out",
    str(out),
    "--val-fraction",
    "0.1",
    "--no-progress",
    "--workers",
    "2",
  ]
  env = {**os.environ, "PYTHONPATH": os.getcwd()}
  process = subprocess.Popen(
    [sys.executable, "-m", "transformer_jax.cli", "prepare", *args], env=env
  )
  deadline = time.monotonic() + 120
  while not (out / "progress.json").exists() and process.poll() is None:
    assert time.monotonic() < deadline
    time.sleep(0.01)
  workers = _children(process.pid)
  assert len(workers) == 2, workers  # the tokenizing processes
  process.send_signal(signal.SIGKILL)
  process.wait()
  assert process.returncode == -signal.SIGKILL, "the run ended before it was killed"
  while (
    alive := [w for w in workers if os.path.exists(f"/proc/{w}")]
  ) and time.monotonic() < deadline:
    time.sleep(0.05)
  assert not alive, f"tokenizing processes {alive} outlived their killed parent"
  assert not (out / "metadata.json").exists()
  with pytest.raises(FileNotFoundError):
    load_dataset(str(out))
  meta = prepare([str(corpus)], str(out), val_fraction=0.1, progress=False)
  err = capsys.readouterr().err
  assert "resuming" in err and int(err.split(": ")[1].split()[0]) > 0, err
  assert meta["splits"]["train"]["documents"] + meta["splits"]["val"]["documents"] == 12_000
  prepare([str(corpus)], str(tmp_path / "whole"), val_fraction=0.1, progress=False)
  _same_dataset(tmp_path / "whole", out)


def test_the_progress_bar_counts_bytes_documents_and_tokens(tmp_path, capsys):
  corpus = _jsonl_corpus(tmp_path / "c", files=2, docs=30, words=10)
  meta = prepare([str(corpus)], str(tmp_path / "o"), val_fraction=0, workers=1)
  last = capsys.readouterr().err.strip().split("\r")[-1]
  tokens = meta["splits"]["train"]["tokens"]
  size = sum(p.stat().st_size for p in corpus.iterdir()) / 1000
  assert f"60 docs, {tokens:,} tokens" in last and "B/s" in last, last
  assert f"100%|██████████| {size:.3g}k/{size:.3g}k" in last, last


# ---- how big, before the work --------------------------------------------------------------------


def test_prepare_dry_run_counts_and_estimates_without_writing(tmp_path):
  from tests.train.conftest import run_cli

  corpus = _jsonl_corpus(tmp_path / "c", files=5, docs=200, words=60)
  size = sum(p.stat().st_size for p in corpus.iterdir())
  code, out, err = run_cli("prepare", str(corpus), "--out", str(tmp_path / "o"), "--dry-run")
  assert code == 0, err
  assert not (tmp_path / "o").exists()
  assert out.splitlines()[0] == f"5 files (5 jsonl), {size / 1e3:.1f} KB", out
  estimated = int(out.split("estimate: ")[1].split(" tokens")[0].replace(",", ""))
  meta = prepare([str(corpus)], str(tmp_path / "o"), progress=False)
  tokens = sum(s["tokens"] for s in meta["splits"].values())
  assert abs(estimated - tokens) < 0.1 * tokens, (estimated, tokens)


def _write_columnar_and_compressed(root, name, docs):
  """``docs`` as one file of format ``name``, larger than the estimate's sample of it."""
  import json

  pa = pytest.importorskip("pyarrow", reason="the 'data' extra (pyarrow) is missing")
  path = root / {"parquet": "c.parquet", "arrow file": "c.arrow", "jsonl.zst": "c.jsonl.zst"}[name]
  table = pa.table({"text": docs})
  if name == "parquet":
    import pyarrow.parquet as pq

    pq.write_table(table, path, row_group_size=1500)
  elif name == "arrow file":
    with pa.ipc.new_file(path, table.schema) as writer:
      for batch in table.to_batches(max_chunksize=500):
        writer.write_batch(batch)
  else:
    zstandard = pytest.importorskip("zstandard", reason="the 'data' extra (zstandard) is missing")
    lines = "".join(json.dumps({"text": d}) + "\n" for d in docs).encode()
    path.write_bytes(zstandard.ZstdCompressor().compress(lines))
  return path


@pytest.mark.parametrize("name", ["parquet", "arrow file", "jsonl.zst"])
def test_the_estimate_of_a_file_read_in_chunks_counts_what_they_hold(tmp_path, name):
  """A Parquet or Arrow IPC file is read out of order (its footer first) and a compressed one a
  chunk of compressed bytes at a time: the sample's size is what its records stand for, not
  where the file handle stands."""
  from transformer_jax.data.estimate import estimate_corpus

  rng = np.random.default_rng(4)
  vocab = "alpha beta gamma delta return import class def self value index total node".split()
  docs = [" ".join(rng.choice(vocab, rng.integers(5, 60))) for _ in range(6000)]
  path = _write_columnar_and_compressed(tmp_path, name, docs)
  tokens = sum(Tokenizer("cl100k_base").encode_full_array(d).size for d in docs)
  est = estimate_corpus([str(path)], sample_bytes=16 * 4096)  # 4 KiB of each file, or a chunk
  assert est["sample"]["documents"] < len(docs) or name == "jsonl.zst", est["sample"]
  assert abs(est["tokens"] - tokens) < 0.1 * tokens, (est, tokens)


def test_dataset_facts_count_tokens_shards_bytes_and_epochs(corpus_dir, tmp_path):
  from transformer_jax.data import GPTLoader, load_dataset
  from transformer_jax.data.estimate import dataset_facts, describe_facts

  out = tmp_path / "ds"
  meta = prepare([str(corpus_dir)], str(out), val_fraction=4, progress=False, shard_bytes=400)
  facts = dataset_facts(out, steps=30, batch_size=4, seq_len=32)
  files = [p for p in out.iterdir() if p.name.endswith((".bin", ".npy"))]
  assert facts["bytes"] == sum(p.stat().st_size for p in files)
  assert facts["shards"] == sum(p.name.endswith(".bin") for p in files) > 2
  assert facts["tokens"] == sum(s["tokens"] for s in meta["splits"].values())
  loader = GPTLoader(load_dataset(str(out)), batch_size=4, seq_len=32)
  assert facts["epochs"] == pytest.approx(30 * 4 / loader.num_windows)
  assert f"{facts['tokens']:,} tokens" in describe_facts(facts) and "epoch" in describe_facts(facts)
  assert "epochs" not in dataset_facts(out)


@pytest.mark.long
@pytest.mark.slow  # ~10 s: writes, hashes and tokenizes 10,000 files under tracemalloc
def test_ten_thousand_files_prepare_without_holding_their_documents(tmp_path, monkeypatch):
  import random
  import tracemalloc

  from transformer_jax.data import shards, stream

  rng = random.Random(0)
  words = "alpha beta gamma delta return import class def self value index total node".split()
  root = tmp_path / "c"
  for d in range(10_000):
    sub = root / f"{d // 1000:02d}"
    sub.mkdir(parents=True, exist_ok=True)
    text = f"doc {d} " + " ".join(rng.choice(words) for _ in range(180))  # ~1 KB
    (sub / f"{d:05d}.txt").write_text(text)
  monkeypatch.setattr(stream, "BATCH_DOCS", 64)
  monkeypatch.setattr(shards, "CHUNK_TOKENS", 1 << 16)
  prepare([str(root / "00" / "00000.txt")], str(tmp_path / "warm"), progress=False)  # tokenizer
  tracemalloc.start()
  try:
    meta = prepare([str(root)], str(tmp_path / "o"), progress=False, workers=2)
    peak = tracemalloc.get_traced_memory()[1]
  finally:
    tracemalloc.stop()
  assert meta["num_files"] == 10_000
  assert sum(s["documents"] for s in meta["splits"].values()) == 10_000
  text_bytes = sum(p.stat().st_size for p in root.rglob("*.txt"))
  # The documents are ~10 MB of text. What is held is the list of files (~0.26 KB a file, 2.6 MB),
  # the content hash's read blocks (1 MiB a thread), a few batches of 64 documents, one chunk of
  # 64 Ki tokens and 16 bytes a document: ~5 MB.
  assert text_bytes > 10_000_000 and peak < 0.7 * text_bytes, (peak, text_bytes)


def test_the_local_engines_earlier_name_is_still_read(corpus_dir, tmp_path):
  a = prepare([str(corpus_dir)], str(tmp_path / "a"), progress=False, engine="threads")
  b = prepare([str(corpus_dir)], str(tmp_path / "b"), progress=False, engine="local")
  assert a["content_hash"] == b["content_hash"] and a["splits"] == b["splits"]


def test_an_unknown_engine_is_named(corpus_dir, tmp_path):
  with pytest.raises(ValueError, match="engine='spark': expected one of local, ray"):
    prepare([str(corpus_dir)], str(tmp_path / "o"), engine="spark")
