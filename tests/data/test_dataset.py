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
    meta.write_text(meta.read_text()[:keep_chars])   # an interrupted copy or a full disk
    return bad


def test_a_damaged_metadata_file_is_named_with_how_to_rebuild_it(text_dataset_dir, tmp_path):
    bad = _damaged_copy(text_dataset_dir, tmp_path)
    with pytest.raises(ValueError) as err:
        load_dataset(bad)
    message = str(err.value)
    assert message.startswith(f"{bad / 'metadata.json'} is damaged (")
    assert "line " in message and "column " in message    # where the JSON breaks
    assert "tjax prepare" in message and f"delete {bad}" in message
    (bad / "metadata.json").write_text("[1, 2]")
    with pytest.raises(ValueError, match=r"metadata.json is damaged \(a JSON list, not an object\)"):
        load_dataset(bad)


def test_prepare_rebuilds_a_damaged_metadata_file(corpus_dir, tmp_path):
    out = tmp_path / "ds"
    prepare([str(corpus_dir)], str(out), val_fraction=4, seed=0, progress=False)
    good = json.loads((out / "metadata.json").read_text())
    (out / "metadata.json").write_text("{\"format_version\": 1, \"tok")
    prepare([str(corpus_dir)], str(out), val_fraction=4, seed=0, progress=False)   # no --force
    assert load_dataset(out).meta == good


def test_a_damaged_vocab_from_dataset_is_named(text_dataset_dir, tmp_path, corpus_dir):
    bad = _damaged_copy(text_dataset_dir, tmp_path)
    with pytest.raises(ValueError, match=f"{bad / 'metadata.json'} is damaged"):
        prepare([str(corpus_dir)], str(tmp_path / "out"), vocab_from=str(bad), progress=False)


def test_tjax_train_on_a_damaged_dataset_is_one_line_naming_the_file(text_dataset_dir, tmp_path):
    bad = _damaged_copy(text_dataset_dir, tmp_path)
    cfg = tmp_path / "e.yaml"
    cfg.write_text(yaml.safe_dump({
        "run_dir": str(tmp_path / "r"), "data": {"path": str(bad)},
        "model": {"preset": "gpt2-tiny", "d_model": 32, "num_layers": 1, "num_heads": 2,
                  "d_ff": 64, "max_len": 32},
        "train": {"steps": 1, "batch_size": 2, "seq_len": 16}}))
    code, _, err = run_cli("train", str(cfg), "--no-progress")
    assert code == 2 and err.count("\n") == 1, err
    assert f"{bad / 'metadata.json'} is damaged" in err and "tjax prepare" in err
    assert not (tmp_path / "r" / "model.yaml").exists()
