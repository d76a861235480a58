"""Qwen2/2.5 and Qwen3 against transformers: cached greedy decoding equals transformers'
``generate``, sliding-window settings read as transformers applies them (or refused by name),
the presets' parameter counts equal transformers' for the published configs, and ``tjax convert``
round trips. Logit parity and save/load round trips are in test_hf_parity.py and
test_hf_roundtrip.py, which run every case of hf_cases.py."""

import contextlib
import dataclasses
import io
import re

import numpy as np
import pytest
import torch
import transformers

import hf_cases as hc
import transformer_jax as tj
import transformer_jax.generate  # a submodule `import transformer_jax` does not load
import transformer_jax.hf as tjhf
from transformer_jax import cli
from transformer_jax.hf import configs
from transformer_jax.hf.io import write_directory

QWEN_CASES = [name for name in hc.CASES if name.startswith("qwen")]


@pytest.mark.parametrize("name", QWEN_CASES)
def test_cached_generate_48_tokens_equals_transformers_generate(name):
  hf_model = hc.build(name)
  config, model = tjhf.load(hf_model)
  prompt = hc.batch(config.vocab_size, b=2, t=9, seed=3)["ids"]  # past the 5-token windows
  new = 48
  with torch.no_grad():
    theirs = hf_model.generate(
      torch.as_tensor(prompt),
      max_new_tokens=new,
      min_new_tokens=new,
      do_sample=False,
      pad_token_id=0,
    ).numpy()[:, prompt.shape[1] :]
  ours = np.asarray(tj.generate.generate(model, prompt, max_new_tokens=new))
  np.testing.assert_array_equal(ours, theirs)


def test_config_translation_reads_the_qwen_fields():
  c, _ = tjhf.load(hc.build("qwen2-gqa"))
  assert (c.use_bias, c.qkv_bias, c.out_bias, c.mlp_bias, c.qk_norm) == (
    False,
    True,
    None,
    None,
    False,
  )
  assert c.rope_theta == 1e6 and c.sliding_window is None and not c.tie_embeddings
  c, _ = tjhf.load(hc.build("qwen2-tied-window"))
  assert c.sliding_window == 5 and c.tie_embeddings and c.rope_scaling.kind == "linear"
  c, _ = tjhf.load(hc.build("qwen3-headdim"))
  assert c.qk_norm and not c.use_bias and c.qkv_bias is None and c.head_size == 24
  assert c.norm_eps == 1e-5
  c, model = tjhf.load(hc.build("qwen3-tied-bias-window"))
  assert c.qk_norm and c.qkv_bias and c.out_bias and c.mlp_bias is None
  assert c.sliding_window == 5 and c.rope_scaling.kind == "llama3"
  assert model.blocks.layers.mlp.up.bias is None and model.blocks.layers.attn.out.bias is not None


def _qwen2_dict(**kw) -> dict:
  hf = transformers.Qwen2Config(**{**hc.CASES["qwen2-gqa"][1], **kw}).to_dict()
  return {**hf, "architectures": ["Qwen2ForCausalLM"]}


def test_window_on_some_layers_only_is_refused_by_name():
  hf = _qwen2_dict(use_sliding_window=True, sliding_window=4, max_window_layers=1)
  assert hf["layer_types"] == ["full_attention", "sliding_attention"]
  with pytest.raises(tjhf.UnsupportedError, match=r"sliding_window=4 on layers \[1\] only"):
    configs.from_hf(hf, "Qwen2ForCausalLM")
  del hf["layer_types"]  # max_window_layers alone says the same
  with pytest.raises(tjhf.UnsupportedError, match="max_window_layers=1"):
    configs.from_hf(hf, "Qwen2ForCausalLM")
  hf["layer_types"] = ["full_attention", "sliding"]
  with pytest.raises(tjhf.CheckpointError, match="layer_types="):
    configs.from_hf(hf, "Qwen2ForCausalLM")


def test_window_fields_without_use_sliding_window_are_full_attention():
  """use_sliding_window false: transformers ignores sliding_window and max_window_layers, and so
  do we; the logits past the would-be window agree with transformers' to 1e-4."""
  hf = _qwen2_dict(use_sliding_window=False, sliding_window=3, max_window_layers=0)
  assert configs.from_hf(hf, "Qwen2ForCausalLM").sliding_window is None
  torch.manual_seed(0)
  kw = {**hc.CASES["qwen2-gqa"][1], "sliding_window": 3, "max_window_layers": 0}
  hf_model = transformers.Qwen2ForCausalLM(transformers.Qwen2Config(**kw)).eval()
  config, model = tjhf.load(hf_model)
  assert config.sliding_window is None
  assert max(hc.compare(hf_model, model, "Qwen2ForCausalLM").values()) <= 1e-4


def test_window_on_every_layer_is_what_changes_the_logits():
  hf_model = hc.build("qwen2-tied-window")
  config, model = tjhf.load(hf_model)
  x = hc.batch(config.vocab_size, b=1, t=12, seed=4)
  ours = hc.our_outputs(model, "Qwen2ForCausalLM", x)["logits"]
  from flax import nnx

  full_config = dataclasses.replace(config, sliding_window=None)
  full = nnx.merge(tj.models.graphdef(full_config), nnx.state(model))
  everything = hc.our_outputs(full, "Qwen2ForCausalLM", x)["logits"]
  np.testing.assert_allclose(ours[:, :5], everything[:, :5], rtol=1e-5, atol=1e-5)
  assert np.abs(ours[:, 5:] - everything[:, 5:]).max() > 1e-3


@pytest.mark.parametrize(
  "preset,arch,field",
  [
    ("qwen3-tiny", "Qwen2ForCausalLM", "qk_norm=True"),
    ("qwen2-tiny", "LlamaForCausalLM", "qkv_bias=True"),
    ("qwen2-tiny", "Qwen3ForCausalLM", "out_bias=None, qk_norm=False"),
  ],
)
def test_writer_refuses_what_the_architecture_cannot_express(preset, arch, field):
  config = tj.models.get_config(preset)
  with pytest.raises(tjhf.UnsupportedError, match=field):
    configs.to_hf(config, arch)


# The published config.json values (Qwen/Qwen2.5-0.5B, Qwen/Qwen2.5-7B, Qwen/Qwen3-0.6B,
# Qwen/Qwen3-8B on the Hugging Face hub), written out by hand.
PUBLISHED = {
  "qwen2.5-0.5b": (
    "Qwen2",
    dict(
      vocab_size=151936,
      hidden_size=896,
      intermediate_size=4864,
      num_hidden_layers=24,
      num_attention_heads=14,
      num_key_value_heads=2,
      max_position_embeddings=32768,
      rms_norm_eps=1e-6,
      rope_theta=1000000.0,
      tie_word_embeddings=True,
      use_sliding_window=False,
      sliding_window=32768,
      max_window_layers=24,
    ),
  ),
  "qwen2.5-7b": (
    "Qwen2",
    dict(
      vocab_size=152064,
      hidden_size=3584,
      intermediate_size=18944,
      num_hidden_layers=28,
      num_attention_heads=28,
      num_key_value_heads=4,
      max_position_embeddings=131072,
      rms_norm_eps=1e-6,
      rope_theta=1000000.0,
      tie_word_embeddings=False,
      use_sliding_window=False,
      sliding_window=131072,
      max_window_layers=28,
    ),
  ),
  "qwen3-0.6b": (
    "Qwen3",
    dict(
      vocab_size=151936,
      hidden_size=1024,
      intermediate_size=3072,
      num_hidden_layers=28,
      num_attention_heads=16,
      num_key_value_heads=8,
      head_dim=128,
      max_position_embeddings=40960,
      rms_norm_eps=1e-6,
      rope_theta=1000000.0,
      tie_word_embeddings=True,
      attention_bias=False,
      use_sliding_window=False,
      sliding_window=None,
      max_window_layers=28,
    ),
  ),
  "qwen3-8b": (
    "Qwen3",
    dict(
      vocab_size=151936,
      hidden_size=4096,
      intermediate_size=12288,
      num_hidden_layers=36,
      num_attention_heads=32,
      num_key_value_heads=8,
      head_dim=128,
      max_position_embeddings=40960,
      rms_norm_eps=1e-6,
      rope_theta=1000000.0,
      tie_word_embeddings=False,
      attention_bias=False,
      use_sliding_window=False,
      sliding_window=None,
      max_window_layers=36,
    ),
  ),
}


@pytest.mark.parametrize("preset", list(PUBLISHED))
def test_preset_is_the_published_config_with_transformers_parameter_count(preset):
  family, kw = PUBLISHED[preset]
  hf_config = getattr(transformers, f"{family}Config")(**kw)
  with torch.device("meta"):
    hf_model = getattr(transformers, f"{family}ForCausalLM")(hf_config)
  # Tied heads share one tensor, which parameters() yields once.
  theirs = sum(p.numel() for p in hf_model.parameters())
  ours = tj.models.get_config(preset)
  assert tj.models.count_params(ours) == theirs
  arch = f"{family}ForCausalLM"
  read = configs.from_hf({**hf_config.to_dict(), "architectures": [arch]}, arch)
  assert (read.head_size, read.kv_heads) == (ours.head_size, ours.kv_heads)
  same = dict(init_std=ours.init_std, head_dim=ours.head_dim, num_kv_heads=ours.num_kv_heads)
  assert dataclasses.replace(read, **same) == ours


def test_checked_reader_names_a_missing_or_misshaped_qk_norm(tmp_path):
  hf_model = hc.build("qwen3-headdim")
  tensors = {k: v.numpy() for k, v in hf_model.state_dict().items()}
  hf = {**hf_model.config.to_dict(), "architectures": ["Qwen3ForCausalLM"]}
  k_norm = "model.layers.1.self_attn.k_norm.weight"
  write_directory(tmp_path / "missing", hf, {k: v for k, v in tensors.items() if k != k_norm})
  with pytest.raises(tjhf.CheckpointError, match=r"(?s)missing tensors.*" + re.escape(k_norm)):
    tjhf.load(tmp_path / "missing")
  q_norm = "model.layers.0.self_attn.q_norm.weight"
  write_directory(tmp_path / "shape", hf, {**tensors, q_norm: np.ones(32, np.float32)})
  with pytest.raises(
    tjhf.CheckpointError, match=re.escape(f"{q_norm}: shape (32,), expected (24,)")
  ):
    tjhf.load(tmp_path / "shape")


def _tjax_here(*args):
  out, err = io.StringIO(), io.StringIO()
  with contextlib.redirect_stdout(out), contextlib.redirect_stderr(err):
    code = cli.main(list(args))
  assert code == 0, err.getvalue()[-3000:]
  return out.getvalue()


def test_tjax_convert_round_trips_qwen3(tmp_path):
  hf_model = hc.build("qwen3-tied-bias-window")
  hf_model.save_pretrained(tmp_path / "hf")
  _tjax_here("convert", "--from-hf", str(tmp_path / "hf"), "--out", str(tmp_path / "run"))
  _tjax_here("convert", "--to-hf", str(tmp_path / "run"), "--out", str(tmp_path / "back"))
  again = transformers.Qwen3ForCausalLM.from_pretrained(tmp_path / "back")
  assert again.config.use_sliding_window and again.config.sliding_window == 5
  before, after = hf_model.state_dict(), again.state_dict()
  assert sorted(before) == sorted(after)
  for k in before:
    assert torch.equal(before[k], after[k]), k
