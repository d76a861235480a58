"""Mistral (sliding-window attention) against transformers: the cached ``generate`` past the
window gives transformers' greedy tokens, and the window is what makes the difference."""

import dataclasses

import numpy as np
import torch

import hf_cases as hc
import transformer_jax as tj
import transformer_jax.generate  # a submodule `import transformer_jax` does not load
import transformer_jax.hf as tjhf


def test_cached_generation_past_the_window_equals_transformers_generate():
  hf_model = hc.build("mistral-window")
  config, model = tjhf.load(hf_model)
  assert config.sliding_window == 5 and config.kv_heads == 2
  prompt = hc.batch(config.vocab_size, b=2, t=9, seed=3)["ids"]  # already past the window
  new = 20
  with torch.no_grad():
    theirs = hf_model.generate(
      torch.as_tensor(prompt),
      max_new_tokens=new,
      do_sample=False,
      min_new_tokens=new,
      pad_token_id=0,
    ).numpy()[:, prompt.shape[1] :]
  ours = np.asarray(tj.generate.generate(model, prompt, max_new_tokens=new))
  np.testing.assert_array_equal(ours, theirs)


def test_window_changes_the_logits_past_it():
  hf_model = hc.build("mistral-window")
  config, model = tjhf.load(hf_model)
  x = hc.batch(config.vocab_size, b=1, t=12, seed=4)
  ours = hc.our_outputs(model, "MistralForCausalLM", x)["logits"]
  from flax import nnx

  full = nnx.merge(
    tj.models.graphdef(dataclasses.replace(config, sliding_window=None)), nnx.state(model)
  )
  everything = hc.our_outputs(full, "MistralForCausalLM", x)["logits"]
  np.testing.assert_allclose(ours[:, :5], everything[:, :5], rtol=1e-5, atol=1e-5)
  assert np.abs(ours[:, 5:] - everything[:, 5:]).max() > 1e-3
