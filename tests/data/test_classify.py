"""Classification data: label files, the label mapping, the split by file, batches and metrics."""

import json

import numpy as np
import pytest

from transformer_jax.data import classify, load_dataset, prepare


def _tsv(path, rows):
  path.write_text("".join("\t".join(r) + "\n" for r in rows), encoding="utf-8")
  return str(path)


@pytest.fixture(scope="module")
def labelled(tmp_path_factory):
  root = tmp_path_factory.mktemp("labelled")
  rng = np.random.default_rng(0)
  names = ["spam", "ham", "eggs"]
  rows = [
    (f"text number {i} " + " ".join(["word"] * int(rng.integers(1, 9))), names[i % 3])
    for i in range(60)
  ]
  tsv = _tsv(root / "a.tsv", rows)
  out = str(root / "ds")
  meta = prepare(
    [tsv], out, task="classify", tokenizer="cl100k_base", val_fraction=0.25, progress=False
  )
  return tsv, out, meta, rows


def test_labels_sorted_and_mapped_to_ids(labelled):
  _, out, meta, rows = labelled
  assert meta["labels"] == ["eggs", "ham", "spam"]
  ds = load_dataset(out)
  labels = np.concatenate([classify.labels_of(ds, "train"), classify.labels_of(ds, "val")])
  want = np.bincount([meta["labels"].index(label) for _, label in rows], minlength=3)
  np.testing.assert_array_equal(np.bincount(labels, minlength=3), want)
  assert np.sum(meta["label_counts"]["train"]) + np.sum(meta["label_counts"]["val"]) == 60
  # The majority baseline: the most frequent training label's share of validation.
  train, val = classify.labels_of(ds, "train"), classify.labels_of(ds, "val")
  top = np.argmax(np.bincount(train))
  assert meta["majority_baseline"]["val_accuracy"] == pytest.approx(np.mean(val == top))


def test_example_texts_survive_tokenization(labelled):
  _, out, meta, rows = labelled
  ds = load_dataset(out)
  texts = {ds.tokenizer.decode(ds.stream("train").doc(i)) for i in range(3)}
  assert texts <= {t for t, _ in rows}


def test_jsonl_pairs_get_token_types(tmp_path):
  path = tmp_path / "p.jsonl"
  path.write_text(
    "\n".join(
      json.dumps({"text": f"first {i}", "text_b": f"second {i} x", "label": i % 2})
      for i in range(8)
    )
    + "\n"
  )
  meta = prepare([str(path)], str(tmp_path / "ds"), task="classify", val_fraction=2, progress=False)
  assert meta["labels"] == ["0", "1"]
  ds = load_dataset(str(tmp_path / "ds"))
  batch = classify.ClassifyLoader(ds, batch_size=4, seq_len=16).batch_at(0)
  ids = ds.meta["special_tokens"]
  row, types, mask = batch["tokens"][0], batch["token_types"][0], batch["attention_mask"][0]
  n = int(mask.sum())
  assert row[0] == ids["[CLS]"] and row[n - 1] == ids["[SEP]"]
  assert np.sum(row[:n] == ids["[SEP]"]) == 2
  first_sep = int(np.flatnonzero(row == ids["[SEP]"])[0])
  assert (types[: first_sep + 1] == 0).all() and (types[first_sep + 1 : n] == 1).all()
  assert (row[n:] == ids["[PAD]"]).all()


@pytest.mark.parametrize(
  "text, message",
  [
    ("only text no tab\n", "a.tsv:1: expected 'text<TAB>label'"),
    ("good\tx\nbad\t\n", "a.tsv:2: empty label"),
    ("a\tb\tc\td\n", "a.tsv:1: expected"),
  ],
)
def test_bad_tsv_lines_name_the_line(tmp_path, text, message):
  (tmp_path / "a.tsv").write_text(text)
  with pytest.raises(ValueError, match=message) as e:
    prepare([str(tmp_path / "a.tsv")], str(tmp_path / "ds"), task="classify", progress=False)
  assert "\n" not in str(e.value)


@pytest.mark.parametrize(
  "line, message",
  [
    ("{not json", "b.jsonl:1: invalid JSON"),
    ('{"text": 3, "label": "x"}', "b.jsonl:1: field 'text' must be a string"),
    ('{"text": "t"}', "b.jsonl:1: field 'label' must be a string or an integer"),
    ('{"text": "t", "label": true}', "b.jsonl:1: field 'label'"),
  ],
)
def test_bad_jsonl_lines_name_the_line(tmp_path, line, message):
  (tmp_path / "b.jsonl").write_text(line + "\n")
  with pytest.raises(ValueError, match=message):
    prepare([str(tmp_path / "b.jsonl")], str(tmp_path / "ds"), task="classify", progress=False)


def test_stdlib_task_split_by_file():
  examples = classify.stdlib_examples()
  assert {e.label for e in examples} <= set(classify.STDLIB_PACKAGES)
  assert all(e.group.startswith(e.label + "/") for e in examples)
  is_val = classify.split_by_group(examples, 0.2, seed=0)
  val_files = {e.group for e, v in zip(examples, is_val) if v}
  train_files = {e.group for e, v in zip(examples, is_val) if not v}
  assert val_files and train_files and not val_files & train_files
  assert 0.1 < is_val.mean() < 0.35


def test_eval_batches_cover_every_example_once(labelled):
  _, out, _, _ = labelled
  ds = load_dataset(out)
  labels = classify.labels_of(ds, "val")
  seen = []
  for batch in classify.classify_eval_batches(ds, batch_size=4, seq_len=16):
    seen.extend(batch["labels"][batch["label_mask"]].tolist())
  assert sorted(seen) == sorted(labels.tolist())


def test_loader_is_a_function_of_step(labelled):
  _, out, _, _ = labelled
  ds = load_dataset(out)
  a = classify.ClassifyLoader(ds, batch_size=8, seq_len=16, seed=3)
  b = classify.ClassifyLoader(ds, batch_size=8, seq_len=16, seed=3)
  for step in (0, 5, 9):
    for k, v in a.batch_at(step).items():
      np.testing.assert_array_equal(v, b.batch_at(step)[k])
  # One epoch visits every training example once.
  n = classify.labels_of(ds, "train").size
  idx = np.concatenate([a.indices_at(s) for s in range(n // 8)])
  assert len(set(idx.tolist())) == idx.size


def test_a_compressed_labelled_file_is_refused_by_name(tmp_path):
  import gzip

  path = tmp_path / "pairs.tsv"
  path.write_bytes(gzip.compress(b"good film\tpos\nbad film\tneg\n" * 10))
  with pytest.raises(ValueError, match=rf"{path}: a gzip file, not text"):
    prepare([str(path)], str(tmp_path / "o"), task="classify", progress=False)
