"""`tjax convert --from-hf` makes a run directory that `tjax eval` reads and `tjax train`
fine-tunes, and `--to-hf` writes it back for transformers. The first command runs in a fresh
interpreter, as a user starts it; the others through ``cli.main`` in this process."""

import contextlib
import io
import json
import os
import subprocess
import sys

import numpy as np
import pytest

transformers = pytest.importorskip("transformers")
torch = pytest.importorskip("torch")

from transformer_jax import cli, data  # noqa: E402

REPO = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))


def _tjax(*args):
  """``tjax ARGS`` in a fresh interpreter (the program as a user starts it)."""
  res = subprocess.run(
    [sys.executable, "-m", "transformer_jax.cli", *args],
    cwd=REPO,
    capture_output=True,
    text=True,
    timeout=600,
  )
  assert res.returncode == 0, res.stderr[-3000:]
  return res.stdout


def _tjax_here(*args):
  """``tjax ARGS`` in this process (``cli.main``): no second interpreter to start."""
  out, err = io.StringIO(), io.StringIO()
  with contextlib.redirect_stdout(out), contextlib.redirect_stderr(err):
    code = cli.main(list(args))
  assert code == 0, err.getvalue()[-3000:]
  return out.getvalue()


@pytest.mark.long
def test_convert_eval_finetune_and_back(tmp_path):
  corpus = tmp_path / "corpus"
  corpus.mkdir()
  rng = np.random.default_rng(0)
  words = ["alpha", "beta", "gamma", "return", "value", "self", "the", "of"]
  for d in range(12):
    (corpus / f"d{d}.txt").write_text("\n".join(" ".join(rng.choice(words, 8)) for _ in range(20)))
  ds = str(tmp_path / "ds")
  meta = data.prepare([str(corpus)], ds, compact_vocab=True, progress=False, val_fraction=2)

  torch.manual_seed(0)
  hf_model = transformers.GPT2LMHeadModel(
    transformers.GPT2Config(
      vocab_size=meta["vocab_size"], n_positions=64, n_embd=32, n_layer=2, n_head=2
    )
  )
  hf_dir = tmp_path / "hf"
  hf_model.save_pretrained(hf_dir)

  run_dir = tmp_path / "run"
  _tjax("convert", "--from-hf", str(hf_dir), "--out", str(run_dir))
  out = _tjax_here(
    "eval",
    str(run_dir),
    f"data.path={ds}",
    "train.seq_len=32",
    "train.batch_size=4",
    "train.eval_batches=2",
  )
  before = json.loads(out[out.index("{") :])
  assert before["step"] == 0 and np.isfinite(before["val_loss"])

  exp = tmp_path / "ft.yaml"
  exp.write_text(
    f"run_dir: {run_dir}\nmodel: {{preset: gpt2-tiny}}\n"
    f"data: {{path: {ds}, task: gpt}}\n"
    "train: {steps: 6, batch_size: 4, seq_len: 32, lr: 1.0e-3, warmup_steps: 1,\n"
    "        eval_every: 6, checkpoint_every: 6, eval_batches: 2, samples: 0}\n"
  )
  _tjax_here("train", str(exp), "--no-progress")
  with open(run_dir / "metrics.jsonl") as f:
    lines = [json.loads(line) for line in f]
  first = next(r for r in lines if "loss" in r)
  assert first["step"] == 1  # fine-tuning starts from the converted weights at step 0
  after = [r for r in lines if "val_loss" in r][-1]["val_loss"]
  assert after < before["val_loss"]

  back = tmp_path / "back"
  _tjax_here("convert", "--to-hf", str(run_dir), "--out", str(back))
  reloaded = transformers.GPT2LMHeadModel.from_pretrained(back)
  assert reloaded.config.n_embd == 32
  changed = any(
    not torch.equal(a, b)
    for a, b in zip(reloaded.state_dict().values(), hf_model.state_dict().values())
  )
  assert changed  # the fine-tuned weights, not the originals
