"""`tjax convert --from-hf` then `--to-hf` keeps the checkpoint's special-token ids: the run
directory has no tokenizer to take them from, so convert keeps them beside the model."""

import contextlib
import io
import json

import pytest

transformers = pytest.importorskip("transformers")
torch = pytest.importorskip("torch")

from transformer_jax import cli, runs  # noqa: E402


def _tjax(*args):
  out, err = io.StringIO(), io.StringIO()
  with contextlib.redirect_stdout(out), contextlib.redirect_stderr(err):
    code = cli.main(list(args))
  assert code == 0, err.getvalue()[-3000:]


def test_convert_round_trip_keeps_bos_and_eos(tmp_path):
  torch.manual_seed(0)
  config = transformers.GPT2Config(
    vocab_size=96, n_positions=32, n_embd=16, n_layer=1, n_head=2, bos_token_id=5, eos_token_id=7
  )
  hf_dir, run_dir, back = tmp_path / "hf", tmp_path / "run", tmp_path / "back"
  transformers.GPT2LMHeadModel(config).save_pretrained(hf_dir)
  _tjax("convert", "--from-hf", str(hf_dir), "--out", str(run_dir))
  _tjax("convert", "--to-hf", str(run_dir), "--out", str(back))
  written = json.loads((back / "config.json").read_text())
  assert (written["bos_token_id"], written["eos_token_id"]) == (5, 7)
  reread = transformers.AutoConfig.from_pretrained(back)
  assert (reread.bos_token_id, reread.eos_token_id) == (5, 7)
  assert json.loads((run_dir / runs.HF_SPECIAL_IDS).read_text())["bos_token_id"] == 5
