"""``tjax convert`` writes ``--out`` whole or not at all, and converts a Reformer both ways.

Run through ``cli.main`` in this process (the program itself is tests/hf/test_convert_cli.py's)."""

import contextlib
import errno
import io
import os

import numpy as np
import pytest

transformers = pytest.importorskip("transformers")
torch = pytest.importorskip("torch")

import transformer_jax as tj  # noqa: E402
from transformer_jax import cli, runs  # noqa: E402
from tests.hf.tiny_configs import TINY_REFORMER  # noqa: E402


def _tjax(*argv):
  out, err = io.StringIO(), io.StringIO()
  with contextlib.redirect_stdout(out), contextlib.redirect_stderr(err):
    code = cli.main(list(argv))
  return code, out.getvalue(), err.getvalue()


@pytest.fixture(scope="module")
def reformer_dir(tmp_path_factory):
  """A tiny transformers ReformerModelWithLMHead (local and LSH layers), saved."""
  config = transformers.ReformerConfig(**TINY_REFORMER)
  torch.manual_seed(0)
  path = tmp_path_factory.mktemp("hf") / "reformer"
  transformers.ReformerModelWithLMHead(config).save_pretrained(path)
  return str(path)


@pytest.mark.slow
def test_a_reformer_converts_to_a_run_and_back(reformer_dir, tmp_path):
  run_dir, back = str(tmp_path / "run"), str(tmp_path / "back")
  code, out, err = _tjax("convert", "--from-hf", reformer_dir, "--out", run_dir)
  assert (code, out) == (0, f"wrote {run_dir}\n"), err
  config, params = runs.load_model(run_dir)
  hf_config, hf_model = tj.hf.load(reformer_dir)
  assert config == hf_config
  ids = np.arange(32, dtype=np.int32).reshape(1, 32) % config.vocab_size
  expected = np.asarray(hf_model(ids))
  np.testing.assert_array_equal(np.asarray(tj.models.apply(config, params, ids)), expected)
  assert sorted(os.listdir(tmp_path)) == ["run"]  # no temporary folder left

  code, _, err = _tjax("convert", "--to-hf", run_dir, "--out", back)
  assert code == 0, err
  original = transformers.ReformerModelWithLMHead.from_pretrained(reformer_dir).state_dict()
  written = transformers.ReformerModelWithLMHead.from_pretrained(back).state_dict()
  assert original.keys() == written.keys()
  for name, tensor in original.items():
    assert torch.equal(tensor, written[name]), name


@pytest.mark.slow
def test_a_failed_conversion_leaves_out_as_it_was_and_runs_again(
  reformer_dir, tmp_path, monkeypatch
):
  out = tmp_path / "new" / "run"  # its parent is made, and goes again with the failure
  real = runs.RunDir.write_snapshot

  def disk_full(self, *args, **kwargs):
    raise OSError(errno.ENOSPC, "No space left on device", self.file(runs.MODEL))

  monkeypatch.setattr(runs.RunDir, "write_snapshot", disk_full)  # after the checkpoint's write
  code, _, err = _tjax("convert", "--from-hf", reformer_dir, "--out", str(out))
  assert code == 2 and "no space left on the device" in err
  assert os.listdir(tmp_path) == []

  out.parent.mkdir()
  out.mkdir()  # an empty --out is taken too
  code, _, err = _tjax("convert", "--from-hf", reformer_dir, "--out", str(out))
  assert code == 2 and os.listdir(out) == [] and os.listdir(out.parent) == ["run"]

  monkeypatch.setattr(runs.RunDir, "write_snapshot", real)
  code, _, err = _tjax("convert", "--from-hf", reformer_dir, "--out", str(out))
  assert code == 0, err
  assert runs.RunDir(out).is_marked() and runs.MODEL in os.listdir(out)
  code, _, err = _tjax("convert", "--from-hf", reformer_dir, "--out", str(out))
  assert code == 2 and f"--out {out} exists and is not empty" in err
