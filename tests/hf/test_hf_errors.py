"""Bad checkpoints and unsupported options give the documented errors, naming what is wrong."""

import json
import subprocess
import sys

import dataclasses
import pytest

import hf_cases as hc
import transformer_jax as tj
import transformer_jax.hf as tjhf
from transformer_jax.hf import io


@pytest.fixture
def gpt2_dir(tmp_path):
  hc.build("gpt2-base").save_pretrained(tmp_path)
  return tmp_path


def _edit_tensors(path, fn):
  tensors = {k: v.copy() for k, v in io.read_safetensors(path / "model.safetensors").items()}
  fn(tensors)
  io.write_safetensors(path / "model.safetensors", tensors)


def _edit_config(path, **changes):
  cfg = json.loads((path / "config.json").read_text())
  cfg.update(changes)
  (path / "config.json").write_text(json.dumps(cfg))


def test_missing_unexpected_and_misshaped_tensors_are_all_listed(gpt2_dir):
  def damage(t):
    del t["transformer.h.1.mlp.c_fc.weight"]
    del t["transformer.ln_f.bias"]
    t["transformer.wpe.weight"] = t["transformer.wpe.weight"][:-1]
    t["transformer.h.0.extra.weight"] = t["transformer.ln_f.weight"]

  _edit_tensors(gpt2_dir, damage)
  with pytest.raises(tjhf.CheckpointError) as e:
    tjhf.load(gpt2_dir)
  msg = str(e.value)
  assert isinstance(e.value, ValueError)
  for s in (
    "missing tensors (2)",
    "transformer.h.1.mlp.c_fc.weight",
    "transformer.ln_f.bias",
    "unexpected tensors (1)",
    "transformer.h.0.extra.weight",
    "wrong shape (1)",
    "transformer.wpe.weight: shape (39, 48), expected (40, 48)",
  ):
    assert s in msg, msg


@pytest.mark.parametrize("dtype", ["int32", "bool"])
def test_integer_and_bool_weights_are_refused_by_name(gpt2_dir, dtype):
  def damage(t):
    t["transformer.h.0.attn.c_attn.bias"] = t["transformer.h.0.attn.c_attn.bias"].astype(dtype)

  _edit_tensors(gpt2_dir, damage)
  with pytest.raises(
    tjhf.CheckpointError,
    match=(rf"(?s)non-float dtype.*transformer.h.0.attn.c_attn.bias: dtype {dtype}"),
  ) as e:
    tjhf.load(gpt2_dir)
  assert "c_attn.weight" not in str(e.value)  # only the bad tensor is named


def test_convert_refuses_a_non_empty_out_directory(gpt2_dir, tmp_path):
  out = tmp_path / "run"
  out.mkdir()
  (out / "model.yaml").write_text("kept: true\n")
  res = subprocess.run(
    [
      sys.executable,
      "-m",
      "transformer_jax.cli",
      "convert",
      "--from-hf",
      str(gpt2_dir),
      "--out",
      str(out),
    ],
    capture_output=True,
    text=True,
  )
  assert res.returncode == 2, res.stderr
  assert res.stderr.count("\n") == 1 and "exists and is not empty" in res.stderr
  assert (out / "model.yaml").read_text() == "kept: true\n"
  assert sorted(p.name for p in out.iterdir()) == ["model.yaml"]


def test_truncated_safetensors_is_a_checkpoint_error(gpt2_dir):
  f = gpt2_dir / "model.safetensors"
  f.write_bytes(f.read_bytes()[:-1000])
  with pytest.raises(tjhf.CheckpointError, match="truncated"):
    tjhf.load(gpt2_dir)
  f.write_bytes(f.read_bytes()[:20])
  with pytest.raises(tjhf.CheckpointError, match="truncated"):
    tjhf.load(gpt2_dir)


def test_unsupported_model_type_is_refused_by_name(gpt2_dir):
  _edit_config(gpt2_dir, model_type="gpt_neox", architectures=["GPTNeoXForCausalLM"])
  with pytest.raises(tjhf.UnsupportedError, match="model_type='gpt_neox'"):
    tjhf.load(gpt2_dir)


def test_unsupported_architecture_is_refused_by_name(gpt2_dir):
  _edit_config(gpt2_dir, architectures=["GPT2ForTokenClassification"])
  with pytest.raises(tjhf.UnsupportedError, match="GPT2ForTokenClassification"):
    tjhf.load(gpt2_dir)


@pytest.mark.parametrize(
  "name,changes,match",
  [
    (
      "llama-gqa",
      dict(rope_parameters={"rope_type": "yarn", "factor": 4.0, "rope_theta": 1e4}),
      "'yarn'",
    ),
    (
      "llama-gqa",
      dict(rope_parameters={"rope_type": "dynamic", "factor": 4.0, "rope_theta": 1e4}),
      "'dynamic'",
    ),
    ("llama-gqa", dict(attention_bias=True), "attention_bias=True with mlp_bias=False"),
    ("bert-model", dict(position_embedding_type="relative_key"), "position_embedding_type"),
    ("gpt2-base", dict(scale_attn_by_inverse_layer_idx=True), "scale_attn_by_inverse_layer_idx"),
    ("gpt2-base", dict(activation_function="quick_gelu"), "quick_gelu"),
    ("t5-v1.0", dict(feed_forward_proj="gated-quick_gelu"), "quick_gelu"),
  ],
)
def test_unsupported_config_options_are_refused_by_name(name, changes, match, tmp_path):
  hc.build(name).save_pretrained(tmp_path)
  _edit_config(tmp_path, **changes)
  with pytest.raises(tjhf.UnsupportedError, match=match):
    tjhf.load(tmp_path)


def test_tied_tensors_that_differ_are_an_error(tmp_path):
  hc.build("bert-pretraining").save_pretrained(tmp_path)

  def untie(t):
    t["cls.predictions.decoder.bias"] = t["cls.predictions.bias"] + 1

  _edit_tensors(tmp_path, untie)
  with pytest.raises(tjhf.CheckpointError, match="cls.predictions.decoder.bias"):
    tjhf.load(tmp_path)


def test_save_refuses_what_the_architecture_cannot_express(tmp_path):
  cfg = tj.models.get_config("gpt-alibi-tiny")
  with pytest.raises(tjhf.UnsupportedError, match="position='alibi'"):
    tjhf.save(tj.models.abstract(cfg), cfg, tmp_path)
  cfg = tj.models.get_config("transformer-tiny")  # norm_eps 1e-6; Marian's LayerNorm uses 1e-5
  with pytest.raises(tjhf.UnsupportedError, match="norm_eps"):
    tjhf.save(tj.models.abstract(cfg), cfg, tmp_path)
  cfg = dataclasses.replace(tj.models.get_config("llama-tiny"), rope_interleaved=True)
  with pytest.raises(tjhf.UnsupportedError, match="rope_interleaved"):
    tjhf.save(tj.models.abstract(cfg), cfg, tmp_path)


def test_no_weights_and_not_a_directory(tmp_path):
  (tmp_path / "config.json").write_text("{}")
  with pytest.raises(tjhf.CheckpointError, match="no weights"):
    tjhf.load(tmp_path)
  with pytest.raises(tjhf.CheckpointError, match="not a directory"):
    tjhf.load(tmp_path / "absent")


def test_importing_transformer_jax_needs_no_torch():
  code = (
    "import sys, transformer_jax, transformer_jax.hf; "
    "assert 'torch' not in sys.modules and 'transformers' not in sys.modules"
  )
  subprocess.run([sys.executable, "-c", code], check=True)


def test_convert_to_hf_refuses_a_non_empty_out_directory(gpt2_dir, tmp_path_factory):
  from tests.train.conftest import run_cli
  from transformer_jax.hf import convert

  root = tmp_path_factory.mktemp("to_hf")
  convert.from_hf(gpt2_dir, root / "run")
  out = root / "hf"
  out.mkdir()
  (out / "config.json").write_text('{"mine": true}\n')
  code, _, err = run_cli("convert", "--to-hf", str(root / "run"), "--out", str(out))
  assert code == 2 and err.count("\n") == 1 and "exists and is not empty" in err, err
  assert sorted(p.name for p in out.iterdir()) == ["config.json"]
  assert (out / "config.json").read_text() == '{"mine": true}\n'
  code, _, err = run_cli("convert", "--to-hf", str(root / "run"), "--out", str(root / "new"))
  assert code == 0, err


@pytest.fixture(scope="module")
def saved(tmp_path_factory):
  """One saved checkpoint folder per family, copied and damaged by each case."""
  root = tmp_path_factory.mktemp("saved")
  for name in (
    "gpt2-base",
    "mistral-window",
    "llama-tied-linear",
    "bert-classifier",
    "t5-v1.0",
    "marian",
  ):
    hc.build(name).save_pretrained(root / name)
  return root


def _damaged_config(saved, tmp_path, case, **changes):
  import shutil

  folder = tmp_path / case
  shutil.copytree(saved / case, folder)
  _edit_config(folder, **changes)
  return folder


@pytest.mark.parametrize(
  "case, changes, named",
  [
    ("mistral-window", {"sliding_window": 4.7}, "sliding_window=4.7: expected an integer"),
    ("mistral-window", {"sliding_window": True}, "sliding_window=True: expected an integer"),
    ("mistral-window", {"sliding_window": "four"}, "sliding_window='four': expected an integer"),
    ("mistral-window", {"rms_norm_eps": "1e-6"}, "rms_norm_eps='1e-6': expected a number"),
    (
      "mistral-window",
      {"num_key_value_heads": 2.5},
      "num_key_value_heads=2.5: expected an integer",
    ),
    (
      "llama-tied-linear",
      {"rope_parameters": {"rope_type": "linear", "factor": "2"}},
      "rope_parameters.factor='2': expected a number",
    ),
    (
      "llama-tied-linear",
      {"rope_parameters": [1, 2]},
      "rope_parameters=[1, 2]: expected an object",
    ),
    ("llama-tied-linear", {"attention_bias": 1}, "attention_bias=1: expected true or false"),
    ("gpt2-base", {"n_embd": "48"}, "n_embd='48': expected an integer"),
    (
      "gpt2-base",
      {"tie_word_embeddings": "yes"},
      "tie_word_embeddings='yes': expected true or false",
    ),
    ("gpt2-base", {"resid_pdrop": None}, "resid_pdrop=None: expected a number"),
    ("gpt2-base", {"scale_attn_weights": 1}, "scale_attn_weights=1 is not supported (only True)"),
    ("gpt2-base", {"model_type": ["gpt2"]}, "model_type=['gpt2']: expected a string"),
    (
      "gpt2-base",
      {"architectures": "GPT2LMHeadModel"},
      "architectures='GPT2LMHeadModel': expected a list of one name",
    ),
    ("bert-classifier", {"id2label": "x"}, "id2label='x': expected an object"),
    (
      "bert-classifier",
      {"layer_norm_eps": float("inf")},
      "layer_norm_eps=inf: expected a finite number",
    ),
    ("t5-v1.0", {"feed_forward_proj": 3}, "feed_forward_proj=3: expected a string"),
    ("t5-v1.0", {"num_decoder_layers": -1}, "num_decoder_layers=-1"),
    ("marian", {"scale_embedding": "true"}, "scale_embedding='true': expected true or false"),
  ],
)
def test_hf_config_fields_are_checked_by_type_naming_the_file(
  saved, tmp_path, case, changes, named
):
  folder = _damaged_config(saved, tmp_path, case, **changes)
  with pytest.raises(tjhf.CheckpointError) as e:
    tjhf.load(folder)
  assert str(e.value).startswith(f"{folder / 'config.json'}: ") and named in str(e.value), e.value


@pytest.mark.parametrize(
  "content, named",
  [(b"[1, 2]", "expected an object"), (b"\xff\xfe{}", "not UTF-8"), (b"{", "not valid JSON")],
)
def test_an_unreadable_config_json_is_named(saved, tmp_path, content, named):
  import shutil

  folder = tmp_path / "c"
  shutil.copytree(saved / "gpt2-base", folder)
  (folder / "config.json").write_bytes(content)
  with pytest.raises(tjhf.CheckpointError, match=rf"^{folder / 'config.json'}:? .*{named}"):
    tjhf.load(folder)


def _safetensors(path, header, data=b""):
  blob = json.dumps(header).encode()
  path.write_bytes(len(blob).to_bytes(8, "little") + blob + data)
  return path


@pytest.mark.parametrize(
  "header, data, named",
  [
    ([1, 2], b"", "header is not an object"),
    ({"w": [1]}, b"", "tensor 'w' has a malformed header entry"),
    (
      {"w": {"dtype": "F99", "shape": [1], "data_offsets": [0, 4]}},
      b"\0" * 4,
      "tensor 'w': dtype 'F99' is not one of",
    ),
    (
      {"w": {"dtype": "F32", "shape": [-1, 4], "data_offsets": [0, 16]}},
      b"\0" * 16,
      "tensor 'w': shape [-1, 4]",
    ),
    (
      {"w": {"dtype": "F32", "shape": "x", "data_offsets": [0, 4]}},
      b"\0" * 4,
      "tensor 'w': shape 'x'",
    ),
    (
      {"w": {"dtype": "F32", "shape": [1], "data_offsets": [8, 4]}},
      b"\0" * 8,
      "tensor 'w': data_offsets [8, 4]",
    ),
    (
      {"w": {"dtype": "F32", "shape": [1], "data_offsets": [0.5, 4]}},
      b"\0" * 4,
      "tensor 'w': data_offsets [0.5, 4]",
    ),
    (
      {"w": {"dtype": "F32", "shape": [3], "data_offsets": [0, 8]}},
      b"\0" * 8,
      "tensor 'w' has 8 bytes for shape (3,)",
    ),
    (
      {"w": {"dtype": "F32", "shape": [2**40, 2**40], "data_offsets": [0, 8]}},
      b"\0" * 8,
      "tensor 'w' has 8 bytes for shape",
    ),
  ],
)
def test_malformed_safetensors_headers_name_file_and_tensor(tmp_path, header, data, named):
  path = _safetensors(tmp_path / "model.safetensors", header, data)
  with pytest.raises(tjhf.CheckpointError) as e:
    io.read_safetensors(path)
  assert str(e.value).startswith(str(path)) and named in str(e.value), e.value


@pytest.mark.parametrize(
  "shard",
  [
    "../other/model.safetensors",
    "/abs/model.safetensors",
    "sub/../../other/model.safetensors",
    "",
    7,
  ],
)
def test_an_index_never_reads_outside_its_folder(saved, tmp_path, shard):
  import shutil

  folder = tmp_path / "ckpt"
  shutil.copytree(saved / "gpt2-base", folder)
  other = tmp_path / "other"
  other.mkdir()
  (folder / "model.safetensors").rename(other / "model.safetensors")
  names = io.read_safetensors(other / "model.safetensors")
  (folder / "model.safetensors.index.json").write_text(
    json.dumps({"weight_map": {k: shard for k in names}})
  )
  with pytest.raises(
    tjhf.CheckpointError,
    match=rf"{folder / 'model.safetensors.index.json'}: "
    r"shard .* (lies outside|is not a file name)",
  ):
    tjhf.load(folder)


@pytest.mark.parametrize(
  "content, named",
  [
    (b"{", "not valid JSON"),
    (b"[]", "expected an object"),
    (b'{"weight_map": [1]}', "weight_map: expected an object"),
  ],
)
def test_a_damaged_index_is_named(saved, tmp_path, content, named):
  import shutil

  folder = tmp_path / "ckpt"
  shutil.copytree(saved / "gpt2-base", folder)
  (folder / "model.safetensors").unlink()
  (folder / "model.safetensors.index.json").write_bytes(content)
  with pytest.raises(
    tjhf.CheckpointError,
    match=rf"^{folder / 'model.safetensors.index.json'}"
    rf":? .*{named}",
  ):
    tjhf.load(folder)
