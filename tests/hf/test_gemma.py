"""Gemma 2 and Gemma 3 (text) against transformers on small random configs: logits within 1e-4
in float32 (eager attention as the reference) on prompts longer than the sliding window, greedy
tokens equal to transformers' ``generate``, and a saved model that transformers reloads to the
same logits."""

import numpy as np
import pytest
import torch
import transformers

import transformer_jax as tj
import transformer_jax.generate  # a submodule `import transformer_jax` does not load
import transformer_jax.hf as tjhf

# Tiny and odd: head_dim 12 != d_model / heads, GQA 4:2, a window of 5 over prompts of 11+ tokens,
# soft-caps small enough that tanh bends the logits, query_pre_attn_scalar != head_dim.
COMMON = dict(
  vocab_size=97,
  hidden_size=32,
  intermediate_size=56,
  num_hidden_layers=4,
  num_attention_heads=4,
  num_key_value_heads=2,
  head_dim=12,
  max_position_embeddings=96,
  sliding_window=5,
  query_pre_attn_scalar=20,
  pad_token_id=0,
  bos_token_id=1,
  eos_token_id=None,  # no end token: transformers would hold it back under min_new_tokens
)
CASES = {
  "gemma2": (
    "Gemma2ForCausalLM",
    transformers.Gemma2Config,
    dict(COMMON, attn_logit_softcapping=3.0, final_logit_softcapping=4.0),
  ),
  "gemma2-untied": (
    "Gemma2ForCausalLM",
    transformers.Gemma2Config,
    dict(
      COMMON, attn_logit_softcapping=3.0, final_logit_softcapping=4.0, tie_word_embeddings=False
    ),
  ),
  "gemma3": (
    "Gemma3ForCausalLM",
    transformers.Gemma3TextConfig,
    dict(
      COMMON,
      layer_types=["sliding_attention", "sliding_attention", "full_attention", "sliding_attention"],
      rope_parameters={
        "full_attention": {"rope_type": "linear", "factor": 4.0, "rope_theta": 1e5},
        "sliding_attention": {"rope_type": "default", "rope_theta": 100.0},
      },
    ),
  ),
  "gemma3-softcap": (
    "Gemma3ForCausalLM",
    transformers.Gemma3TextConfig,
    dict(COMMON, final_logit_softcapping=4.0, num_hidden_layers=7),
  ),
}


def build(name: str, seed: int = 0):
  """A transformers model of case ``name`` with every parameter drawn at random (norm weights
  too, so a missing (1 + w) or a misplaced norm shows), eager attention, float32."""
  arch, cfg_cls, kwargs = CASES[name]
  cfg = cfg_cls(**kwargs, attn_implementation="eager")
  torch.manual_seed(seed)
  model = getattr(transformers, arch)(cfg).eval()
  with torch.no_grad():
    for p in model.parameters():
      p.normal_(0.0, 0.35)
  return model


def _ids(vocab, b, t, seed):
  return np.random.default_rng(seed).integers(3, vocab, size=(b, t)).astype(np.int64)


def _hf_logits(model, ids):
  with torch.no_grad():
    return model(torch.as_tensor(ids)).logits.numpy()


@pytest.fixture(scope="module", params=list(CASES))
def case(request):
  hf_model = build(request.param)
  config, model = tjhf.load(hf_model)
  return request.param, hf_model, config, model


def test_config_reads_gemma_fields(case):
  name, hf_model, config, _ = case
  assert config.norm_offset == 1.0 and config.post_norms and config.embed_scale
  assert config.query_pre_attn_scalar == 20.0 and config.head_size == 12
  assert config.layer_types == tuple(hf_model.config.layer_types)
  assert config.qk_norm == name.startswith("gemma3")
  assert config.tie_embeddings == (name != "gemma2-untied")
  if name == "gemma3":
    assert config.rope_local_theta == 100.0 and config.rope_theta == 1e5
    assert config.rope_scaling.kind == "linear" and config.rope_scaling.factor == 4.0


def test_logits_match_transformers_past_the_window(case):
  _, hf_model, config, model = case
  ids = _ids(config.vocab_size, 2, 13, seed=1)  # 13 tokens, a window of 5
  ours = np.asarray(model(ids))
  theirs = _hf_logits(hf_model, ids)
  assert np.abs(theirs).max() > 1.0  # logits large enough that the final cap bends them
  np.testing.assert_allclose(ours, theirs, rtol=0, atol=1e-4)


def test_greedy_generation_equals_transformers(case):
  _, hf_model, config, model = case
  prompt = _ids(config.vocab_size, 2, 11, seed=3)
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


def test_save_reloads_in_transformers_to_the_same_logits(case, tmp_path):
  name, hf_model, config, model = case
  tjhf.save(model, config, tmp_path)
  back = transformers.AutoModelForCausalLM.from_pretrained(tmp_path, attn_implementation="eager")
  assert type(back).__name__ == CASES[name][0]
  ids = _ids(config.vocab_size, 1, 12, seed=5)
  np.testing.assert_allclose(_hf_logits(back, ids), _hf_logits(hf_model, ids), rtol=0, atol=1e-5)
  config2, model2 = tjhf.load(tmp_path)
  assert config2 == config
  np.testing.assert_array_equal(np.asarray(model2(ids)), np.asarray(model(ids)))


def test_gemma3_attention_softcap_is_refused_by_name():
  """transformers' Gemma 3 keeps ``attn_logit_softcapping`` but never applies it: refused rather
  than read as a soft-cap that its model does not compute."""
  hf = build("gemma3").config.to_dict()
  hf.update(architectures=["Gemma3ForCausalLM"], attn_logit_softcapping=3.0)
  with pytest.raises(tjhf.UnsupportedError, match="attn_logit_softcapping=3.0"):
    tjhf.configs.from_hf(hf, "Gemma3ForCausalLM")


def test_convert_to_a_run_directory_and_back(tmp_path):
  """``tjax convert``'s two directions (``hf.convert``): a Gemma 3 checkpoint into a run
  directory and back out reloads in transformers to the same logits."""
  from transformer_jax.hf import convert

  hf_model = build("gemma3")
  hf_model.save_pretrained(tmp_path / "hf")
  assert convert.from_hf(tmp_path / "hf", tmp_path / "run") == "Gemma3ForCausalLM"
  convert.to_hf(tmp_path / "run", tmp_path / "back")
  back = transformers.AutoModelForCausalLM.from_pretrained(
    tmp_path / "back", attn_implementation="eager"
  )
  ids = _ids(97, 1, 12, seed=6)
  np.testing.assert_allclose(_hf_logits(back, ids), _hf_logits(hf_model, ids), rtol=0, atol=1e-5)
