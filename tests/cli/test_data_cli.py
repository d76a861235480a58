"""``tjax data``: the rows of a mixture's batches as the command prints them, and a mixture run's
tokens per source."""

import json
import os

import numpy as np
import pytest
import yaml

from tests.data.conftest import write_corpus
from tests.data.test_mixture import reference_counts
from tests.train.conftest import run_cli
from transformer_jax import viz
from transformer_jax.data import GPTLoader, load_dataset, prepare

B, T = 8, 32


@pytest.fixture(scope="module")
def paths(tmp_path_factory):
  """Two prepared datasets with one vocabulary (``tjax prepare``'s code path) and a directory."""
  root = tmp_path_factory.mktemp("data_cli")
  write_corpus(root / "web_text", num_docs=24, seed=1)
  write_corpus(root / "code_text", num_docs=6, seed=2)
  web, code = str(root / "web"), str(root / "code")
  prepare([str(root / "web_text")], web, compact_vocab=True, val_fraction=2, progress=False)
  prepare(
    [str(root / "code_text")],
    code,
    compact_vocab=True,
    vocab_from=web,
    val_fraction=1,
    progress=False,
  )
  return {"web": web, "code": code, "root": root}


def config(paths, name: str, stages=(), **data) -> str:
  """An experiment YAML mixing web 0.7 / code 0.3 (with ``stages``), its path."""
  mixture = [
    {"name": "web", "path": paths["web"], "weight": 0.7},
    {"name": "code", "path": paths["code"], "weight": 0.3},
  ]
  exp = {
    "run_dir": str(paths["root"] / f"run_{name}"),
    "model": {"preset": "gpt2-tiny"},
    "data": {"mixture": mixture, "stages": list(stages), **data},
    "train": {"steps": 4, "batch_size": B, "seq_len": T, "seed": 1},
  }
  path = paths["root"] / f"{name}.yaml"
  path.write_text(yaml.safe_dump(exp))
  return str(path)


def data_json(*argv) -> list[dict]:
  code, out, err = run_cli("data", *argv, "--json")
  assert code == 0, err
  return [json.loads(line) for line in out.splitlines()]


def web_rows(lines: list[dict]) -> np.ndarray:
  for line in lines:
    assert len(line["rows"]) == B and {r["source"] for r in line["rows"]} <= {"web", "code"}
  return np.array([sum(r["source"] == "web" for r in line["rows"]) for line in lines])


def assert_windows_hold(web_B: np.ndarray, share: float) -> None:
  """Every window of 100 consecutive steps holds ``share`` of web rows within 1%."""
  sums = np.convolve(web_B, np.ones(100, np.int64), mode="valid")
  assert sums.size == web_B.size - 99
  np.testing.assert_allclose(sums / (100 * B), share, atol=0.01)


def test_weights_hold_within_one_percent_in_every_window_of_100_steps(paths):
  lines = data_json(config(paths, "plain"), "--steps", "0:300")
  assert [line["step"] for line in lines] == list(range(300))
  assert_windows_hold(web_rows(lines), 0.7)


def test_stages_switch_at_their_steps(paths):
  stages = [{"step": 150, "weights": {"web": 0.5, "code": 0.5}}]
  lines = data_json(config(paths, "staged", stages), "--steps", "0:300")
  web_B = web_rows(lines)
  assert_windows_hold(web_B[:150], 0.7)
  assert_windows_hold(web_B[150:], 0.5)
  expected = reference_counts([(0.7, 0.3), (0.5, 0.5)], [0, 150], B, 300)
  np.testing.assert_array_equal(web_B, expected[:, 0])
  # A stage applies from its step on: the steps before it are the unstaged mixture's.
  before = web_rows(data_json(config(paths, "plain"), "--steps", "0:150"))
  np.testing.assert_array_equal(web_B[:150], before)
  assert not np.array_equal(
    web_B[150:], web_rows(data_json(config(paths, "plain"), "--steps", "150:300"))
  )


def test_overrides_and_the_plain_output(paths):
  path = config(paths, "plain")
  lines = data_json(path, "--steps", "3:5", "train.batch_size=4")
  assert [len(line["rows"]) for line in lines] == [4, 4]
  code, out, _ = run_cli("data", path, "--steps", "7")
  assert code == 0 and out.startswith("step 7: ") and len(out.split()) == 2 + B


def test_a_single_dataset_is_the_source_data_with_its_window_documents(paths):
  path = config(paths, "single")
  raw = yaml.safe_load(open(path))
  raw["data"] = {"path": paths["web"]}
  with open(path, "w") as f:
    yaml.safe_dump(raw, f)
  lines = data_json(path, "--steps", "2:4")
  loader = GPTLoader(
    load_dataset(paths["web"]), batch_size=B, seq_len=T, seed=1, process_index=0, process_count=1
  )
  for line in lines:
    starts = loader.window_starts(line["step"])
    docs = np.searchsorted(loader._vstarts, starts, side="right") - 1
    assert line["rows"] == [{"source": "data", "document": int(d)} for d in docs]


@pytest.mark.parametrize(
  "argv, message",
  [
    (["--steps", "5:5"], "--steps '5:5': expected A:B"),
    (["--steps", "a:b"], "--steps 'a:b': expected A:B"),
    (["--steps", "0:2", "data.task=bert"], "data.mixture applies to the gpt task"),
    (["--steps", "0:2", "data.stages=[{step: 1, weights: {wbe: 1}}]"], "did you mean 'web'"),
  ],
)
def test_bad_input_is_one_named_line(paths, argv, message):
  code, _, err = run_cli("data", config(paths, "plain"), *argv)
  assert code == 2 and message in err


def test_train_refuses_a_run_past_max_epochs_before_it_starts(paths):
  path = config(paths, "limited", max_epochs=1)
  code, _, err = run_cli("train", path, "--no-progress", "train.steps=500")
  assert code == 2 and "data.max_epochs=1: mixture source 'code'" in err
  assert not os.path.exists(os.path.join(str(paths["root"] / "run_limited"), "checkpoints"))


def test_train_refuses_an_evaluation_dataset_of_another_vocabulary(paths, tmp_path):
  write_corpus(tmp_path / "text", num_docs=4, seed=5)
  other = str(tmp_path / "ds")
  prepare([str(tmp_path / "text")], other, compact_vocab=True, progress=False)
  code, _, err = run_cli("train", config(paths, "other_vocab", path=other), "--no-progress")
  assert code == 2 and f"data.path={other!r} ({other}) has another tokenizer or vocabulary" in err


TRAIN = ("--no-progress", "train.eval_batches=1", "train.samples=0", "train.warmup_steps=1")


def train_lines(run_dir: str) -> list[dict]:
  with open(os.path.join(run_dir, "metrics.jsonl")) as f:
    return [r for r in map(json.loads, f) if "loss" in r]


@pytest.fixture(scope="module")
def trained(paths):
  """A 4-step mixture run (tiny model): its config and run directory."""
  path = config(paths, "train")
  code, _, err = run_cli("train", path, *TRAIN, "train.log_every=2")
  assert code == 0, err
  return path, str(paths["root"] / "run_train")


@pytest.mark.slow
def test_a_mixture_run_records_its_tokens_per_source(trained):
  path, run_dir = trained
  with open(os.path.join(run_dir, "final.json")) as f:
    final = json.load(f)
  lines = data_json(path, "--steps", "0:4")
  rows = {
    name: sum(r["source"] == name for x in lines for r in x["rows"]) for name in ("web", "code")
  }
  assert final["tokens_per_source"] == {name: n * T for name, n in rows.items()}
  records = train_lines(run_dir)
  assert [r["step"] for r in records] == [1, 2, 3, 4]
  assert records[-1]["tokens/web"] == final["tokens_per_source"]["web"]
  assert records[0]["tokens/web"] + records[0]["tokens/code"] == B * T
  # tjax report's picture draws exactly these counts, one line per source.
  ax = viz.source_tokens(records).axes[0]
  drawn = {line.get_label(): list(line.get_ydata()) for line in ax.lines}
  assert drawn == {n: [r[f"tokens/{n}"] for r in records] for n in ("code", "web")}


@pytest.mark.slow
def test_a_resumed_mixture_run_reads_the_same_batches(paths, trained):
  path = config(paths, "resumed")
  for steps in (2, 4):  # stopped after step 2 (its checkpoint), then continued
    code, _, err = run_cli("train", path, *TRAIN, f"train.steps={steps}")
    assert code == 0, err
  keys = ("step", "batch_hash", "tokens/web", "tokens/code")
  resumed = [{k: r[k] for k in keys} for r in train_lines(str(paths["root"] / "run_resumed"))]
  assert resumed == [{k: r[k] for k in keys} for r in train_lines(trained[1])]
