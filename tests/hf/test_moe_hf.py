"""Mixtral and Qwen3-MoE against transformers (float32, random weights, built from configs):
logits, greedy decoding, and load/save in both layouts of the experts' weights."""

from __future__ import annotations

import dataclasses

import numpy as np
import pytest
import torch
import transformers

import hf_cases as hc
import transformer_jax as tj
import transformer_jax.generate  # a submodule `import transformer_jax` does not load
import transformer_jax.hf as tjhf
from transformer_jax.hf import experts as hf_experts
from transformer_jax.hf.errors import CheckpointError, UnsupportedError

COMMON = dict(
  vocab_size=160, hidden_size=64, num_hidden_layers=2, num_attention_heads=4,
  num_key_value_heads=2, max_position_embeddings=128, tie_word_embeddings=False,
)  # fmt: skip
CASES = {
  "MixtralForCausalLM": ("MixtralConfig", dict(intermediate_size=48, num_local_experts=4)),
  "Qwen3MoeForCausalLM": (
    "Qwen3MoeConfig",
    dict(
      intermediate_size=96,
      moe_intermediate_size=32,
      num_experts=8,
      num_experts_per_tok=3,
      norm_topk_prob=False,
      head_dim=24,
    ),
  ),  # fmt: skip
}
# Qwen3-MoE with plain MLP layers among the expert layers (the config's dense_layers): layer 0 by
# mlp_only_layers (then two expert layers, scanned), or every odd-numbered one by the step.
MIXED = {
  "Qwen3Moe-mlp_only_layers": dict(num_hidden_layers=3, mlp_only_layers=[0]),
  "Qwen3Moe-decoder_sparse_step": dict(num_hidden_layers=4, decoder_sparse_step=2),
}
DENSE_LAYERS = {"Qwen3Moe-mlp_only_layers": (0,), "Qwen3Moe-decoder_sparse_step": (0, 2)}


def build(arch: str, **overrides):
  if arch in MIXED:
    arch, overrides = "Qwen3MoeForCausalLM", {**MIXED[arch], **overrides}
  cls, kw = CASES[arch]
  torch.manual_seed(0)
  config = getattr(transformers, cls)(**{**COMMON, **kw, **overrides})
  config.architectures = [arch]
  model = getattr(transformers, arch)(config).float().eval()
  with torch.no_grad():  # noise on top of the init: norms and routers far from their defaults
    for _, p in model.named_parameters():
      p.add_(torch.randn_like(p) * (0.1 if p.ndim == 1 else 0.05))
  return model


def logits_pair(hf_model, model):
  x = hc.batch(hf_model.config.vocab_size, b=3, t=12, seed=1)
  with torch.no_grad():
    theirs = hf_model(
      input_ids=torch.as_tensor(x["ids"]), attention_mask=torch.as_tensor(x["mask"])
    ).logits.numpy()
  ours = np.asarray(model(x["ids"], attention_mask=x["mask"].astype(bool)))
  valid = x["mask"].astype(bool)
  return ours[valid], theirs[valid]


@pytest.fixture(scope="module", params=[*CASES, *MIXED])
def pair(request):
  hf_model = build(request.param)
  config, model = tjhf.load(hf_model)
  assert config.dense_layers == DENSE_LAYERS.get(request.param, ())
  return hf_model.config.architectures[0], hf_model, config, model


def test_config_reads_the_experts(pair):
  arch, hf_model, config, _ = pair
  c = hf_model.config
  assert config.dense_layers == tuple(
    i for i, layer in enumerate(hf_model.model.layers) if not hasattr(layer.mlp, "experts")
  )
  assert config.num_experts == (
    c.num_local_experts if arch.startswith("Mixtral") else c.num_experts
  )
  assert config.experts_per_token == c.num_experts_per_tok
  assert config.qk_norm == arch.startswith("Qwen3")
  assert config.router_norm_topk == (arch.startswith("Mixtral") or c.norm_topk_prob)


def test_logits_match_transformers(pair):
  _, hf_model, _, model = pair
  ours, theirs = logits_pair(hf_model, model)
  np.testing.assert_allclose(ours, theirs, atol=1e-4, rtol=0)


def test_greedy_48_tokens_match_transformers(pair):
  _, hf_model, config, model = pair
  prompt = hc.batch(config.vocab_size, b=2, t=6, seed=3)["ids"]
  with torch.no_grad():
    theirs = hf_model.generate(
      torch.as_tensor(prompt), max_new_tokens=48, min_new_tokens=48, do_sample=False,
      pad_token_id=0,
    ).numpy()[:, prompt.shape[1] :]  # fmt: skip
  ours = np.asarray(tj.generate.generate(model, prompt, max_new_tokens=48))
  np.testing.assert_array_equal(ours, theirs)


@pytest.mark.parametrize("per_expert", [False, True])
def test_save_loads_in_transformers_and_back(pair, tmp_path, per_expert):
  arch, hf_model, config, model = pair
  path = str(tmp_path / "ckpt")
  assert tjhf.save(model, config, path, per_expert=per_expert) == arch
  keys = set(tjhf.io.read_directory(path)[1])
  stacked = any(k.endswith("experts.gate_up_proj") for k in keys)
  assert stacked != per_expert
  if per_expert:
    name = "block_sparse_moe.experts.3.w1.weight" if arch.startswith("Mixtral") else (
      "mlp.experts.3.gate_proj.weight"
    )  # fmt: skip
    assert f"model.layers.1.{name}" in keys
  # transformers reads either layout (the older one through its own conversion).
  back = getattr(transformers, arch).from_pretrained(path).float().eval()
  ours, theirs = logits_pair(back, model)
  np.testing.assert_allclose(ours, theirs, atol=1e-4, rtol=0)
  config2, model2 = tjhf.load(path)
  assert config2.num_experts == config.num_experts
  ours2, _ = logits_pair(hf_model, model2)
  np.testing.assert_array_equal(ours2, ours)


def test_per_expert_keys_must_be_complete():
  t = {"m.layers.0.block_sparse_moe.experts.0.w1.weight": np.zeros((2, 3))}
  t["m.layers.0.block_sparse_moe.experts.1.w1.weight"] = np.zeros((2, 3))
  t["m.layers.0.block_sparse_moe.experts.0.w3.weight"] = np.zeros((2, 3))
  with pytest.raises(CheckpointError, match="expert 1 up") as e:
    hf_experts.stack(t)
  assert "expert 0 down" in str(e.value)


def test_dense_layers_out_of_range_are_refused_by_name():
  hf = build("Qwen3MoeForCausalLM").config.to_dict()
  with pytest.raises(UnsupportedError, match="mlp_only_layers=\\[0, 2\\]: \\[2\\] outside"):
    tjhf.configs.from_hf({**hf, "mlp_only_layers": [0, 2]}, "Qwen3MoeForCausalLM")
  with pytest.raises(UnsupportedError, match="decoder_sparse_step=0"):
    tjhf.configs.from_hf({**hf, "decoder_sparse_step": 0}, "Qwen3MoeForCausalLM")
  # Every layer dense: a dense model, which this architecture does not make.
  with pytest.raises(ValueError, match="every layer dense"):
    tjhf.configs.from_hf({**hf, "decoder_sparse_step": 3}, "Qwen3MoeForCausalLM")


def test_mixtral_cannot_express_dense_layers():
  config = tj.models.get_config("moe-tiny", num_layers=3, dense_layers=[1])
  with pytest.raises(UnsupportedError, match="dense_layers"):
    tjhf.configs.to_hf(config, "MixtralForCausalLM")


def test_capacity_factor_is_not_expressible(pair, tmp_path):
  _, _, config, model = pair
  capped = dataclasses.replace(config, capacity_factor=1.25)
  with pytest.raises(UnsupportedError, match="capacity_factor=1.25"):
    tjhf.save(model, capped, str(tmp_path / "x"))


@pytest.mark.parametrize(
  "preset,dense_layers",
  [("mixtral-8x7b", ()), ("qwen3-30b-a3b", ()), ("moe-tiny", ()), ("qwen3-30b-a3b", (0, 1, 47))],
)
def test_preset_counts_equal_transformers(preset, dense_layers, tmp_path):
  config = tj.models.get_config(preset, dense_layers=dense_layers)
  arch = tjhf.configs.default_architecture(config)
  hf = tjhf.configs.to_hf(config, arch)
  cls = CASES[arch][0]
  hf_config = getattr(transformers, cls)(**{k: v for k, v in hf.items() if k != "architectures"})
  with torch.device("meta"):  # shapes only: no memory for 47B parameters
    hf_model = getattr(transformers, arch)(hf_config)
  total = sum(p.numel() for p in hf_model.parameters())
  pc = tj.models.param_count(config)
  assert pc.total == total
  # Active: all but the unchosen experts' three matrices in every layer.
  e, k = config.num_experts, config.experts_per_token
  f = config.expert_d_ff or config.d_ff
  expert_layers = config.num_layers - len(dense_layers)
  assert pc.active == total - expert_layers * (e - k) * 3 * config.d_model * f
  if preset == "mixtral-8x7b":
    assert total == 46_702_792_704  # Mixtral 8x7B's published count
  if preset == "qwen3-30b-a3b" and not dense_layers:
    assert total == 30_532_122_624
  if dense_layers:  # each dense layer: a gated MLP of d_ff in place of the experts and router
    dense_mlp = 3 * config.d_model * config.d_ff
    experts = e * 3 * config.d_model * f + config.d_model * e
    assert total == 30_532_122_624 + len(dense_layers) * (dense_mlp - experts)


def test_info_reports_total_and_active(capsys):
  from transformer_jax import cli

  assert cli.main(["info", "mixtral-8x7b"]) == 0
  out = capsys.readouterr().out
  c = tj.models.get_config("mixtral-8x7b")
  pc = tj.models.param_count(c)
  assert "46,702,792,704" in out and f"active per token  {pc.active:>16,d}" in out
  # MFU's FLOPs count the active parameters (and the vocabulary projection).
  attn = 12 * c.num_layers * 1024 * c.num_heads * c.head_size
  assert tj.models.train_flops_per_token(c, 1024) == 6 * (pc.active - pc.embedding) + attn
