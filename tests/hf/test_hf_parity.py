"""Logits of transformers (PyTorch) and transformer_jax agree to float32 precision."""

import numpy as np
import pytest

import hf_cases as hc
import transformer_jax.hf as tjhf

TOL = 1e-4


@pytest.mark.parametrize("name", list(hc.CASES))
def test_logits_match_transformers_loaded_from_directory(name, tmp_path):
  arch = hc.CASES[name][0]
  hf_model = hc.build(name)
  hf_model.save_pretrained(tmp_path)
  config, model = tjhf.load(tmp_path)
  diffs = hc.compare(hf_model, model, arch)
  print(f"\n[hf parity] {name} ({arch}): max |logit diff| = {diffs}")
  assert max(diffs.values()) <= TOL, diffs


@pytest.mark.parametrize(
  "name", ["gpt2-3heads-untied", "llama-gqa", "bert-pretraining", "t5-v1.1-untied"]
)
def test_load_in_memory_model_matches(name):
  arch = hc.CASES[name][0]
  hf_model = hc.build(name, seed=1)
  config, model = tjhf.load(hf_model)
  diffs = hc.compare(hf_model, model, arch, seed=1)
  assert max(diffs.values()) <= TOL, diffs


@pytest.mark.parametrize(
  "name",
  [
    "gpt2-base",
    "gpt2-3heads-untied",
    "llama-gqa",
    "llama-tied-linear",
    "llama-llama3-headdim",
    "mistral-window",
  ],
)
def test_greedy_continuation_matches(name):
  hf_model = hc.build(name)
  _, model = tjhf.load(hf_model)
  ours, theirs = hc.greedy_pair(hf_model, model, steps=6)
  assert ours.shape == (2, 11)
  np.testing.assert_array_equal(ours, theirs)


def test_config_translation_reads_every_field():
  cfg, _ = tjhf.load(hc.build("llama-llama3-headdim"))
  assert (cfg.num_heads, cfg.kv_heads, cfg.head_size, cfg.d_ff) == (4, 2, 16, 64)
  assert cfg.use_bias and not cfg.tie_embeddings
  assert cfg.rope_scaling.kind == "llama3" and cfg.rope_scaling.factor == 8.0
  assert cfg.rope_scaling.original_max_len == 16
  cfg, _ = tjhf.load(hc.build("t5-v1.1-untied"))
  assert cfg.gated and cfg.activation == "gelu_tanh" and not cfg.tie_embeddings
  assert not cfg.logits_rescale and cfg.relative_num_buckets == 16
  assert cfg.relative_max_distance == 32 and cfg.num_decoder_layers == 3
  cfg, _ = tjhf.load(hc.build("t5-v1.0"))
  assert cfg.tie_embeddings and cfg.logits_rescale and cfg.activation == "relu" and not cfg.gated
  cfg, _ = tjhf.load(hc.build("bert-classifier"))
  assert cfg.num_labels == 3
  cfg, _ = tjhf.load(hc.build("gpt2-3heads-untied"))
  assert (cfg.max_len, cfg.norm_eps, cfg.activation, cfg.d_ff) == (32, 1e-6, "gelu", 80)


def test_parity_check_detects_a_wrong_weight():
  # The comparison must be able to fail: one perturbed norm scale shows up in the logits.
  hf_model = hc.build("llama-gqa")
  _, model = tjhf.load(hf_model)
  model.final_norm.scale[...] = model.final_norm.scale[...] * 1.01
  assert max(hc.compare(hf_model, model, "LlamaForCausalLM").values()) > 1e-3
