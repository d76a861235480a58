"""Opening a prepared dataset: a damaged ``metadata.json`` is one error naming the file."""

import json
import shutil

import pytest
import yaml

from transformer_jax.data import load_dataset, prepare
from tests.train.conftest import run_cli


def _damaged_copy(text_dataset_dir, tmp_path, keep_chars=91):
  bad = tmp_path / "bad"
  shutil.copytree(text_dataset_dir, bad)
  meta = bad / "metadata.json"
  meta.write_text(meta.read_text()[:keep_chars])  # an interrupted copy or a full disk
  return bad


def test_a_damaged_metadata_file_is_named_with_how_to_rebuild_it(text_dataset_dir, tmp_path):
  bad = _damaged_copy(text_dataset_dir, tmp_path)
  with pytest.raises(ValueError) as err:
    load_dataset(bad)
  message = str(err.value)
  assert message.startswith(f"{bad / 'metadata.json'} is damaged (")
  assert "line " in message and "column " in message  # where the JSON breaks
  assert "tjax prepare" in message and f"delete {bad}" in message
  (bad / "metadata.json").write_text("[1, 2]")
  with pytest.raises(ValueError, match=r"metadata.json is damaged \(a JSON list, not an object\)"):
    load_dataset(bad)


def test_prepare_rebuilds_a_damaged_metadata_file(corpus_dir, tmp_path):
  out = tmp_path / "ds"
  prepare([str(corpus_dir)], str(out), val_fraction=4, seed=0, progress=False)
  good = json.loads((out / "metadata.json").read_text())
  (out / "metadata.json").write_text("{\"format_version\": 1, \"tok")
  prepare([str(corpus_dir)], str(out), val_fraction=4, seed=0, progress=False)  # no --force
  assert load_dataset(out).meta == good


def test_a_damaged_vocab_from_dataset_is_named(text_dataset_dir, tmp_path, corpus_dir):
  bad = _damaged_copy(text_dataset_dir, tmp_path)
  with pytest.raises(ValueError, match=f"{bad / 'metadata.json'} is damaged"):
    prepare([str(corpus_dir)], str(tmp_path / "out"), vocab_from=str(bad), progress=False)


def test_tjax_train_on_a_damaged_dataset_is_one_line_naming_the_file(text_dataset_dir, tmp_path):
  bad = _damaged_copy(text_dataset_dir, tmp_path)
  cfg = tmp_path / "e.yaml"
  cfg.write_text(
    yaml.safe_dump(
      {
        "run_dir": str(tmp_path / "r"),
        "data": {"path": str(bad)},
        "model": {
          "preset": "gpt2-tiny",
          "d_model": 32,
          "num_layers": 1,
          "num_heads": 2,
          "d_ff": 64,
          "max_len": 32,
        },
        "train": {"steps": 1, "batch_size": 2, "seq_len": 16},
      }
    )
  )
  code, _, err = run_cli("train", str(cfg), "--no-progress")
  assert code == 2 and err.count("\n") == 1, err
  assert f"{bad / 'metadata.json'} is damaged" in err and "tjax prepare" in err
  assert not (tmp_path / "r" / "model.yaml").exists()


def _edited_copy(text_dataset_dir, tmp_path, edit):
  bad = tmp_path / "bad"
  shutil.copytree(text_dataset_dir, bad)
  meta = json.loads((bad / "metadata.json").read_text())
  edit(meta)
  (bad / "metadata.json").write_text(json.dumps(meta))
  return bad


def _set(path, value):
  def edit(meta):
    node = meta
    for key in path[:-1]:
      node = node[key]
    if value is _DELETE:
      del node[path[-1]]
    else:
      node[path[-1]] = value

  return edit


_DELETE = object()
_TOKENS = ("splits", "train", "streams", "tokens")


@pytest.mark.parametrize(
  "path, value, named",
  [
    (("vocab_size",), "big", "vocab_size='big': expected an integer >= 1"),
    (("vocab_size",), _DELETE, "vocab_size=None: expected an integer >= 1"),
    (("task",), "poetry", "task='poetry': expected one of"),
    (("tokenizer",), 3, "tokenizer=3: expected a tokenizer name"),
    (("num_regular_tokens",), -1, "num_regular_tokens=-1"),
    (("special_tokens",), [1], "special_tokens=[1]: expected an object"),
    (("special_tokens", "[PAD]"), 10**9, "special_tokens.[PAD]=1000000000: expected an id in"),
    (("splits",), [], "splits=[]: expected an object with the splits train, val"),
    (("splits", "train", "documents"), "x", "splits.train.documents='x'"),
    (("splits", "train", "streams"), {}, "splits.train.streams: expected the streams tokens"),
    (_TOKENS + ("shards",), ["../../elsewhere.bin"], "splits.train.streams.tokens.shards="),
    (_TOKENS + ("shards",), ["/etc/passwd"], "expected a list of file names inside the dataset"),
    (_TOKENS + ("offsets",), None, "splits.train.streams.tokens.offsets=None"),
    (("compact_vocab",), "../vocab.json", "compact_vocab='../vocab.json'"),
  ],
)
def test_every_metadata_field_is_checked_naming_it(text_dataset_dir, tmp_path, path, value, named):
  bad = _edited_copy(text_dataset_dir, tmp_path, _set(path, value))
  with pytest.raises(ValueError) as e:
    load_dataset(bad)
  message = str(e.value)
  assert message.startswith(f"{bad / 'metadata.json'} is damaged (") and named in message, message


@pytest.mark.parametrize(
  "name, content, named",
  [
    ("train_offsets.npy", b"\x93NUMPY garbage", "train_offsets.npy: not a document offsets array"),
    ("train_offsets.npy", b"", "train_offsets.npy: not a document offsets array"),
    ("vocab.json", b"{", "vocab.json is damaged"),
    (
      "vocab.json",
      b'{"base_ids": [1], "base_vocab_size": 1000000000000}',
      "vocab.json: base_vocab_size=1000000000000 but the tokenizer has",
    ),
  ],
)
def test_damaged_stream_and_vocabulary_files_are_named(corpus_dir, tmp_path, name, content, named):
  ds = tmp_path / "ds"
  prepare([str(corpus_dir)], str(ds), val_fraction=4, compact_vocab=True, progress=False)
  (ds / name).write_bytes(content)
  with pytest.raises(ValueError, match=named):
    load_dataset(ds).tokenizer
