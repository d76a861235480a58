"""Round trips: ours -> save -> transformers, and transformers -> load -> save -> transformers."""

import json

import jax
import numpy as np
import pytest
import torch
import transformers
from flax import nnx

import hf_cases as hc
import transformer_jax as tj
import transformer_jax.hf as tjhf

OURS = {
  "gpt2-tiny": ({}, "GPT2LMHeadModel"),
  "llama-tiny": ({}, "LlamaForCausalLM"),
  "mistral-tiny": (dict(sliding_window=5), "MistralForCausalLM"),
  "qwen2-tiny": (dict(sliding_window=5), "Qwen2ForCausalLM"),
  "qwen3-tiny": (dict(tie_embeddings=False), "Qwen3ForCausalLM"),
  "bert-tiny": (dict(vocab_size=300), "BertForPreTraining"),
  "t5-tiny": ({}, "T5ForConditionalGeneration"),
  "t5-v1.1-small": (
    dict(
      vocab_size=200,
      d_model=32,
      num_heads=2,
      head_dim=8,
      d_ff=48,
      num_encoder_layers=1,
      num_decoder_layers=2,
    ),
    "T5ForConditionalGeneration",
  ),
  "transformer-tiny": (dict(norm_eps=1e-5), "MarianMTModel"),
}


@pytest.mark.parametrize("preset", list(OURS))
def test_ours_saved_loads_in_transformers_with_same_logits(preset, tmp_path):
  overrides, arch = OURS[preset]
  config = tj.models.get_config(preset, **overrides)
  model = tj.models.create(config, rngs=nnx.Rngs(3))
  assert tjhf.save(model, config, tmp_path) == arch
  hf_model, info = getattr(transformers, arch).from_pretrained(tmp_path, output_loading_info=True)
  assert not info["missing_keys"] and not info["unexpected_keys"] and not info["mismatched_keys"]
  diffs = hc.compare(hf_model.float().eval(), model, arch, paddings=(True,))
  assert max(diffs.values()) <= 1e-4, diffs
  # And back: our loader reads what we wrote, to the same parameters.
  config2, model2 = tjhf.load(tmp_path)
  before = nnx.state(model, nnx.Param).to_pure_dict()
  after = nnx.state(model2, nnx.Param).to_pure_dict()
  jax.tree.map(np.testing.assert_array_equal, before, after)


@pytest.mark.parametrize("name", list(hc.CASES))
def test_hf_load_save_gives_identical_tensors(name, tmp_path):
  arch = hc.CASES[name][0]
  hf_model = hc.build(name)
  config, model = tjhf.load(hf_model)
  tjhf.save(model, config, tmp_path, architecture=arch)
  again = getattr(transformers, arch).from_pretrained(tmp_path).float()
  before, after = hf_model.state_dict(), again.state_dict()
  assert sorted(before) == sorted(after)
  for k in before:
    assert torch.equal(before[k], after[k]), k


def test_sharded_safetensors_and_pytorch_bin_load(tmp_path):
  hf_model = hc.build("llama-gqa")
  sharded = tmp_path / "sharded"
  hf_model.save_pretrained(sharded, max_shard_size="40KB")
  assert (sharded / "model.safetensors.index.json").is_file()
  _, model = tjhf.load(sharded)
  assert max(hc.compare(hf_model, model, "LlamaForCausalLM").values()) <= 1e-4

  binary = tmp_path / "bin"
  binary.mkdir()
  torch.save(hf_model.state_dict(), binary / "pytorch_model.bin")
  (binary / "config.json").write_text(
    json.dumps({**hf_model.config.to_dict(), "architectures": ["LlamaForCausalLM"]})
  )
  _, model = tjhf.load(binary)
  assert max(hc.compare(hf_model, model, "LlamaForCausalLM").values()) <= 1e-4


def test_bert_heads_missing_from_architecture_are_filled(tmp_path):
  hf_model = hc.build("bert-maskedlm")
  with pytest.warns(UserWarning, match="pooler.kernel"):
    config, model = tjhf.load(hf_model)
  np.testing.assert_array_equal(np.asarray(model.nsp.kernel[...]), 0.0)
  # Saved as the same architecture, the filled heads are not written.
  tjhf.save(model, config, tmp_path, architecture="BertForMaskedLM")
  from transformer_jax.hf import io

  assert not any(
    k.startswith(("bert.pooler", "cls.seq_relationship"))
    for k in io.read_safetensors(tmp_path / "model.safetensors")
  )


def test_convert_run_directory_round_trip(tmp_path):
  from transformer_jax.hf import convert

  hf_model = hc.build("gpt2-base")
  hf_model.save_pretrained(tmp_path / "hf")
  convert.from_hf(tmp_path / "hf", tmp_path / "run")
  convert.to_hf(tmp_path / "run", tmp_path / "back")
  again = transformers.GPT2LMHeadModel.from_pretrained(tmp_path / "back")
  for k, v in hf_model.state_dict().items():
    assert torch.equal(v, again.state_dict()[k]), k
