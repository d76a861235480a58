"""``tjax report``: one self-contained page whose pictures are the run's own numbers."""

import base64
import json
import os
import re

import jax
import numpy as np
import pytest
import yaml
from flax import nnx

from transformer_jax import cli, models, report, runs
from transformer_jax import data as data_lib

TEXT = "def add(a, b): return a + b"


@pytest.fixture(scope="module")
def tiny_runs(tmp_path_factory):
  """Two tiny GPT run directories (learned and ALiBi positions) on a character-level dataset:
  random weights saved as a checkpoint, a config, metrics and final results as ``tjax train``
  writes them."""
  root = tmp_path_factory.mktemp("report")
  corpus = root / "corpus"
  corpus.mkdir()
  for i in range(6):
    (corpus / f"f{i}.py").write_text(f"def f{i}(a, b):\n  return a + b * {i}\n" * 20)
  ds = str(root / "ds")
  chars = "abcdefghijklmnopqrstuvwxyz0123456789 ():,+*\n"
  data_lib.prepare([str(corpus)], ds, tokenizer=f"chars:{chars}", progress=False, val_fraction=0.2)
  vocab = data_lib.load_dataset(ds).vocab_size
  made = []
  for name, position in (("learned", "learned"), ("alibi", "alibi")):
    config = models.get_config(
      "gpt2-tiny",
      vocab_size=vocab,
      d_model=32,
      num_layers=2,
      num_heads=2,
      d_ff=64,
      max_len=64,
      position=position,
    )
    path = str(root / name)
    runs.save_model(path, config, models.init(config, jax.random.key(0)))
    with open(os.path.join(path, runs.DATASET), "w") as f:
      json.dump({"path": ds}, f)
    with open(os.path.join(path, runs.CONFIG), "w") as f:
      yaml.safe_dump(
        {
          "run_dir": path,
          "model": {"preset": "gpt2-tiny"},
          "data": {"path": ds},
          "train": {"steps": 20, "lr": 1e-3, "warmup_steps": 5},
        },
        f,
      )
    with open(os.path.join(path, runs.METRICS), "w") as f:
      for step in range(1, 21):
        f.write(json.dumps({"step": step, "loss": 4.0 - step / 10, "tokens_per_sec": 100.0}) + "\n")
      f.write(json.dumps({"step": 20, "val_loss": 2.5}) + "\n")
      f.write('{"step": 21, "lo')  # a line cut short by a crash
    with open(os.path.join(path, runs.FINAL), "w") as f:
      json.dump(
        {
          "step": 20,
          "val_loss": 2.5,
          "samples": ["def f(a):\n  return a"],
          "bars": {"val_loss_below_unigram": {"val_loss": 2.5, "passed": True}},
        },
        f,
      )
    made.append(path)
  return made


def _embedded_images(page: str) -> dict[str, bytes]:
  """``file name -> PNG bytes`` of every image of the page (all must be data URIs)."""
  srcs = re.findall(r'<img[^>]*\bsrc="([^"]*)"', page)
  alts = re.findall(r'<img alt="([^"]*)"', page)
  assert len(srcs) == len(alts) and srcs
  images = {}
  for alt, src in zip(alts, srcs):
    assert src.startswith("data:image/png;base64,"), src[:40]
    images[alt] = base64.b64decode(src.split(",", 1)[1])
  return images


def test_report_page_embeds_every_picture_it_writes(tiny_runs, tmp_path):
  out = tmp_path / "report"
  assert cli.main(["report", tiny_runs[0], "--text", TEXT, "--out", str(out)]) == 0
  page = (out / "index.html").read_text()
  images = _embedded_images(page)
  pngs = {p.name: p.read_bytes() for p in out.glob("*.png")}
  assert images == pngs  # the same pictures, nothing fetched
  assert set(pngs) == {
    f"learned-{k}.png" for k in ("loss", "lr", "params", "positions", "attention")
  }
  assert all(png.startswith(b"\x89PNG") for png in pngs.values())
  assert "http" not in page.replace("http-equiv", "")  # nothing to fetch when offline
  for shown in ("Final metrics", "val_loss_below_unigram", "return a", "d_model: 32", TEXT):
    assert shown in page


def test_report_compares_several_runs(tiny_runs, tmp_path):
  index = report.write_report(tiny_runs, str(tmp_path), text=TEXT)
  page = open(index).read()
  assert "<h2>Comparison</h2>" in page and "alibi" in page and "learned" in page
  assert os.path.exists(tmp_path / "compare-loss.png")
  assert os.path.exists(tmp_path / "alibi-positions.png")


def test_report_attention_map_is_the_models_weights(tiny_runs):
  config, params = runs.load_model(tiny_runs[1])
  model = nnx.merge(models.graphdef(config), params)
  tokenizer = data_lib.load_dataset(
    json.load(open(os.path.join(tiny_runs[1], runs.DATASET)))["path"]
  ).tokenizer
  fig, _ = report._attention_picture(config, model, tokenizer, TEXT)
  ids = tokenizer.encode(TEXT)
  weights = np.asarray(model.attention_weights(np.asarray([ids])))[:, 0]
  axes = [ax for ax in fig.axes if ax.images]
  assert len(axes) == config.num_layers * config.num_heads
  causal = np.tril(np.ones((len(ids), len(ids)), bool))
  for i, ax in enumerate(axes):
    drawn = np.ma.asarray(ax.images[0].get_array())
    np.testing.assert_array_equal(drawn.mask, ~causal)
    np.testing.assert_allclose(drawn.filled(0.0), weights[i // 2, i % 2] * causal)
    assert [t.get_text() for t in ax.get_yticklabels()] == [
      repr(tokenizer.decode([t]))[1:-1] for t in ids
    ]


def test_report_refuses_a_directory_that_is_not_a_run(tmp_path, capsys):
  assert cli.main(["report", str(tmp_path), "--out", str(tmp_path / "r")]) == 2
  err = capsys.readouterr().err.strip()
  assert err.endswith("is not a run directory (no model.yaml)") and "\n" not in err


def _attention_result():
  return {
    "setup": {"steps": 3, "train_len": 64},
    "learning": {
      "softmax": {"val_loss": 3.0, "params": 10},
      "linear": {"val_loss": 3.2, "params": 10},
    },
    "train_step": {
      k: {"512": {"step_s": 0.1, "temp_bytes": 1}, "2048": {"step_s": s, "temp_bytes": 2}}
      for k, s in (("softmax", 0.9), ("linear", 0.3))
    },
    "decode": {
      k: {"1024": {"step_ms": 1.0, "cache_bytes": 10}, "4096": {"step_ms": m, "cache_bytes": b}}
      for k, m, b in (("softmax", 3.0, 40), ("linear", 1.0, 10))
    },
  }


def test_report_shows_an_efficient_attention_result(tmp_path, capsys):
  result = _attention_result()
  path = tmp_path / "efficient_attention.json"
  path.write_text(json.dumps(result))
  out = tmp_path / "r"
  assert cli.main(["report", "--experiment", str(path), "--out", str(out)]) == 0
  page = (out / "index.html").read_text()
  assert "efficient_attention.json" in page and "3.2" in page
  assert (out / "efficient_attention.png").stat().st_size > 1000
  bad = tmp_path / "other.json"
  bad.write_text("{}")
  assert cli.main(["report", "--experiment", str(bad), "--out", str(out)]) == 2
  assert "is not a result of experiments/efficient_attention.py" in capsys.readouterr().err
  assert cli.main(["report", "--out", str(out)]) == 2


def _damaged(result, damage):
  exec(damage, {"r": result})  # noqa: S102 (a damage spelled out in the parameter list)
  return result


@pytest.mark.parametrize(
  "damage, named",
  [
    ("del r['learning']['linear']['val_loss']", "learning.linear.val_loss: missing"),
    (
      "r['learning']['softmax']['val_loss'] = 'low'",
      "learning.softmax.val_loss='low': expected a number",
    ),
    ("r['learning'] = [1, 2]", "learning: expected an object"),
    (
      "r['train_step']['window'] = r['train_step']['linear']",
      "train_step.window: not a kind of learning (softmax, linear)",
    ),
    (
      "r['decode']['linear']['long'] = {'step_ms': 1.0, 'cache_bytes': 1}",
      "decode.linear.long: expected a whole number of tokens",
    ),
    (
      "r['decode']['linear']['4096']['cache_bytes'] = None",
      "decode.linear.4096.cache_bytes=None: expected a number",
    ),
    ("del r['setup']['train_len']", "setup.train_len: missing"),
    ("r['train_step']['softmax'] = 3", "train_step.softmax: expected an object"),
  ],
)
def test_a_malformed_experiment_result_is_one_line_naming_file_and_field(
  tmp_path, capsys, damage, named
):
  path = tmp_path / "result.json"
  path.write_text(json.dumps(_damaged(_attention_result(), damage)))
  assert cli.main(["report", "--experiment", str(path), "--out", str(tmp_path / "r")]) == 2
  err = capsys.readouterr().err
  assert err.count("\n") == 1 and f"{path}: {named}" in err, err
  assert not (tmp_path / "r").exists()


def test_picture_names_never_collide(tiny_runs, tmp_path_factory):
  """A result named compare-loss.json, or a run named compare, keeps the comparison picture."""
  root = tmp_path_factory.mktemp("collide")
  compare_run = root / "compare"
  import shutil

  shutil.copytree(tiny_runs[0], compare_run)
  result = root / "compare-loss.json"
  result.write_text(json.dumps(_attention_result()))
  out = root / "r"
  report.write_report([tiny_runs[1], str(compare_run)], str(out), experiments=[str(result)])
  images = _embedded_images((out / "index.html").read_text())
  pngs = {p.name: p.read_bytes() for p in out.glob("*.png")}
  assert images == pngs  # one file per picture: none written over another
  assert len(pngs) == 4 + 4 + 1 + 1  # two runs' pictures, the comparison, the result


def test_report_out_must_be_new_empty_or_a_report(tiny_runs, tmp_path, capsys):
  out = tmp_path / "docs"
  out.mkdir()
  (out / "index.html").write_text("<p>my page</p>")
  assert cli.main(["report", tiny_runs[0], "--out", str(out)]) == 2
  err = capsys.readouterr().err
  assert err.count("\n") == 1 and f"--out {out} holds files that are not a tjax report's" in err
  assert (out / "index.html").read_text() == "<p>my page</p>" and len(os.listdir(out)) == 1
  again = tmp_path / "again"
  for _ in range(2):  # a report's folder is written again
    assert cli.main(["report", tiny_runs[0], "--out", str(again)]) == 0


def test_report_never_writes_through_a_symbolic_link(tiny_runs, tmp_path):
  out = tmp_path / "r"
  report.write_report([tiny_runs[0]], str(out))
  precious = tmp_path / "precious.txt"
  precious.write_text("mine\n")
  (out / "learned-loss.png").unlink()
  (out / "learned-loss.png").symlink_to(precious)
  report.write_report([tiny_runs[0]], str(out))
  assert precious.read_text() == "mine\n"
  assert (out / "learned-loss.png").read_bytes().startswith(b"\x89PNG")
