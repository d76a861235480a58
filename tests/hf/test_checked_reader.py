"""Every Hugging Face reader takes its tensors through ``hf.checked.read`` and its config fields by
type: NaN or infinite weights, a shape other than the expected one (a transposed matrix), integer
weights and wrong-typed fields are refused by name in every family, the Reformer's included. And
what ``save`` writes: strict JSON (Mamba-2's open time-step limit boxed as transformers boxes it)
with the special-token ids of the checkpoint it was loaded from."""

import json
import math
import shutil

import jax
import numpy as np
import pytest
import torch
import transformers
from flax import nnx

import hf_cases as hc
import transformer_jax as tj
import transformer_jax.hf as tjhf
from transformer_jax.hf import io
from tests.hf.tiny_configs import TINY_REFORMER

_TINY_SSM = dict(vocab_size=40, hidden_size=16, num_hidden_layers=2, state_size=4, expand=2)

# One tiny transformers model per family the readers support (built offline, random weights).
_FAMILIES = {
  "gpt2": lambda: hc.build("gpt2-base"),
  "llama": lambda: hc.build("llama-gqa"),
  "mistral": lambda: hc.build("mistral-window"),
  "qwen2": lambda: hc.build("qwen2-tied-window"),
  "qwen3": lambda: hc.build("qwen3-tied-bias-window"),
  "bert": lambda: hc.build("bert-pretraining"),
  "t5": lambda: hc.build("t5-v1.0"),
  "marian": lambda: hc.build("marian"),
  "bigbird": lambda: transformers.BigBirdForMaskedLM(
    transformers.BigBirdConfig(
      vocab_size=50,
      hidden_size=16,
      num_attention_heads=2,
      intermediate_size=32,
      num_hidden_layers=2,
      max_position_embeddings=256,
      block_size=16,
      num_random_blocks=2,
    )
  ),
  "mamba": lambda: transformers.MambaForCausalLM(transformers.MambaConfig(**_TINY_SSM)),
  "mamba2": lambda: transformers.Mamba2ForCausalLM(
    transformers.Mamba2Config(**_TINY_SSM, num_heads=4, head_dim=8, n_groups=1, chunk_size=8)
  ),
  "reformer": lambda: _reformer(),
}


def _reformer(**kw):
  config = transformers.ReformerConfig(**{**TINY_REFORMER, "num_hashes": 1, **kw})
  return transformers.ReformerModelWithLMHead(config).eval()


def _second_layer_weight(model) -> str:
  """A weight of the second layer: every family has one, and it is read by the layer stack."""
  return next(n for n, _ in model.named_parameters() if ".1." in n and n.endswith("weight"))


@pytest.mark.parametrize("family", list(_FAMILIES))
@pytest.mark.parametrize("value", [float("nan"), float("-inf")], ids=["nan", "inf"])
def test_non_finite_weights_are_refused_by_name_in_every_family(family, value):
  torch.manual_seed(0)
  model = _FAMILIES[family]()
  name = _second_layer_weight(model)
  with torch.no_grad():
    dict(model.named_parameters())[name].view(-1)[[0, 3]] = value
  with pytest.raises(tjhf.CheckpointError) as e:
    tjhf.load(model)
  msg = str(e.value)
  assert "tensors with non-finite values (1)" in msg, msg
  assert f"{name}: 2 of " in msg and "values are NaN or infinite" in msg, msg


@pytest.fixture(scope="module")
def reformer_dir(tmp_path_factory):
  path = tmp_path_factory.mktemp("reformer") / "hf"
  torch.manual_seed(0)
  _reformer().save_pretrained(path)
  return path


def _copy(src, tmp_path, config=None, tensors=None):
  folder = tmp_path / "copy"
  shutil.copytree(src, folder)
  if config:
    hf = json.loads((folder / "config.json").read_text())
    (folder / "config.json").write_text(json.dumps({**hf, **config}))
  if tensors:
    t = {k: v.copy() for k, v in io.read_safetensors(folder / "model.safetensors").items()}
    tensors(t)
    io.write_safetensors(folder / "model.safetensors", t)
  return folder


def test_reformer_transposed_head_is_refused_not_reshaped(reformer_dir, tmp_path):
  # [V, 2D] = [61, 32] stored as [32, 61]: the old reader transposed and reshaped it to fit.
  def transpose(t):
    t["lm_head.decoder.weight"] = np.ascontiguousarray(t["lm_head.decoder.weight"].T)

  folder = _copy(reformer_dir, tmp_path, tensors=transpose)
  with pytest.raises(tjhf.CheckpointError) as e:
    tjhf.load(folder)
  assert "lm_head.decoder.weight: shape (32, 61), expected (61, 32)" in str(e.value), e.value


def test_reformer_integer_weights_are_refused(reformer_dir, tmp_path):
  def to_int(t):
    t["reformer.encoder.layer_norm.weight"] = t["reformer.encoder.layer_norm.weight"].astype(
      np.int32
    )

  folder = _copy(reformer_dir, tmp_path, tensors=to_int)
  with pytest.raises(tjhf.CheckpointError, match="non-float dtype") as e:
    tjhf.load(folder)
  assert "reformer.encoder.layer_norm.weight: dtype int32" in str(e.value)


@pytest.mark.parametrize(
  "changes, named",
  [
    ({"is_decoder": "false"}, "is_decoder='false': expected true or false"),
    ({"num_hashes": "2"}, "num_hashes='2': expected an integer"),
    ({"num_buckets": [2, "2"]}, "num_buckets[1]='2': expected an integer"),
    ({"attn_layers": ["local", 3]}, "attn_layers=['local', 3]: expected a list of strings"),
    ({"axial_pos_shape": "8x8"}, "axial_pos_shape='8x8': expected a list of integers"),
    ({"layer_norm_eps": None}, "layer_norm_eps=None: expected a number"),
    ({"eos_token_id": "2"}, "eos_token_id='2': expected an integer"),
  ],
)
def test_reformer_config_fields_are_read_by_type(reformer_dir, tmp_path, changes, named):
  folder = _copy(reformer_dir, tmp_path, config=changes)
  with pytest.raises(tjhf.CheckpointError) as e:
    tjhf.load(folder)
  assert str(e.value).startswith(f"{folder / 'config.json'}: ") and named in str(e.value), e.value


@pytest.mark.parametrize(
  "field, value, named",
  [
    ("block_size", "16", "block_size='16': expected an integer"),
    ("num_random_blocks", 2.5, "num_random_blocks=2.5: expected an integer"),
    ("attention_type", 3, "attention_type=3: expected a string"),
  ],
)
def test_bigbird_config_fields_are_read_by_type(tmp_path, field, value, named):
  _FAMILIES["bigbird"]().save_pretrained(tmp_path / "hf")
  folder = _copy(tmp_path / "hf", tmp_path, config={field: value})
  with pytest.raises(tjhf.CheckpointError) as e:
    tjhf.load(folder)
  assert str(e.value).startswith(f"{folder / 'config.json'}: ") and named in str(e.value), e.value


def test_mamba2_config_json_is_strict_json_that_transformers_reads(tmp_path):
  config = tj.models.get_config("mamba2-tiny")
  assert config.time_step_limit[1] == math.inf
  _, state = nnx.split(tj.models.abstract(config))  # zeros: only config.json is looked at
  tjhf.save(jax.tree.map(lambda x: np.zeros(x.shape, x.dtype), state), config, tmp_path)
  text = (tmp_path / "config.json").read_text()

  def refuse(constant):
    raise AssertionError(f"{constant} is not strict JSON")

  written = json.loads(text, parse_constant=refuse)
  assert written["time_step_limit"] == [0.0, {"__float__": "Infinity"}]
  theirs = transformers.Mamba2Config.from_pretrained(tmp_path)
  assert tuple(theirs.time_step_limit) == (0.0, math.inf)
  back, _ = tjhf.load(tmp_path)
  assert back.time_step_limit == config.time_step_limit


def test_round_trip_keeps_the_special_ids(tmp_path):
  arch, kw = hc.CASES["llama-gqa"]
  hf_config = transformers.LlamaConfig(**kw, bos_token_id=3, eos_token_id=[4, 5], pad_token_id=6)
  transformers.LlamaForCausalLM(hf_config).save_pretrained(tmp_path / "hf")
  config, model = tjhf.load(tmp_path / "hf")
  tjhf.save(model, config, tmp_path / "back")
  written = json.loads((tmp_path / "back" / "config.json").read_text())
  ids = {"bos_token_id": 3, "eos_token_id": [4, 5], "pad_token_id": 6}
  assert {k: written[k] for k in ids} == ids
  back = transformers.AutoConfig.from_pretrained(tmp_path / "back")
  assert (back.bos_token_id, back.eos_token_id, back.pad_token_id) == (3, [4, 5], 6)
  # Through nnx.split / merge too (the ids are a static attribute of the model).
  graphdef, state = nnx.split(model)
  tjhf.save(nnx.merge(graphdef, state), config, tmp_path / "merged")
  assert json.loads((tmp_path / "merged" / "config.json").read_text())["eos_token_id"] == [4, 5]


def test_reformer_round_trip_keeps_the_special_ids(reformer_dir, tmp_path):
  before = json.loads((reformer_dir / "config.json").read_text())
  config, model = tjhf.load(reformer_dir)
  tjhf.save(model, config, tmp_path / "back")
  after = json.loads((tmp_path / "back" / "config.json").read_text())
  ids = [k for k in ("bos_token_id", "eos_token_id", "pad_token_id") if k in before]
  assert ids and all(after[k] == before[k] for k in ids), (before, after)


def test_package_docstring_lists_every_supported_architecture():
  doc = tjhf.__doc__
  for arch in [*tjhf.ARCHITECTURES, "ReformerModelWithLMHead"]:
    assert arch in doc, arch
  assert "BERTOutput" in doc  # what BigBird's model returns
