import functools

import jax
import jax.numpy as jnp
import numpy as np
from flax import nnx

from transformer_jax import models

VOCAB = 97

# Wider initialisation than the presets' 0.02, so logits differ by O(1) between tokens and a wrong
# position, mask or cache slot shows up far above the 1e-4 tolerance.
GPT_CASES = {
  "gpt2-learned": ("gpt2-tiny", {}),
  "gpt2-sinusoidal": ("gpt2-tiny", {"position": "sinusoidal"}),
  "gpt2-unrolled": ("gpt2-tiny", {"scan_layers": False}),
  "llama-rope-gqa": ("llama-tiny", {}),
  "llama-rope-mqa": ("llama-tiny", {"num_kv_heads": 1}),
  "alibi": ("gpt-alibi-tiny", {}),
  "sliding-window": ("llama-tiny", {"sliding_window": 3}),
}


@functools.lru_cache(maxsize=None)
def gpt_config(case: str):
  name, overrides = GPT_CASES[case]
  return models.get_config(name, vocab_size=VOCAB, init_std=0.3, max_len=64, **overrides)


@functools.lru_cache(maxsize=None)
def gpt_model(case: str) -> nnx.Module:
  return models.create(gpt_config(case))


@functools.lru_cache(maxsize=None)
def full_forward(config):
  """Jitted ``(params, tokens [1, T]) -> logits [1, T, V]``: the model without a cache."""
  graphdef = models.graphdef(config)
  return jax.jit(lambda params, tokens: nnx.merge(graphdef, params)(tokens))


BUFFER = 32


def last_logits(params, config, seq):
  """Logits ``[V]`` of a full forward pass over ``seq`` (no cache) at its last token.

  The sequence is right-padded to a fixed ``BUFFER`` (one compilation per config) and the padding
  keys are masked out with ``attention_mask``; under the causal mask they are invisible anyway.
  """
  buf = np.zeros((1, BUFFER), np.int32)
  buf[0, : len(seq)] = seq
  valid = np.arange(BUFFER)[None, :] < len(seq)
  logits = full_forward_masked(config)(params, jnp.asarray(buf), jnp.asarray(valid))
  return np.asarray(logits[0, len(seq) - 1])


@functools.lru_cache(maxsize=None)
def full_forward_masked(config):
  graphdef = models.graphdef(config)
  return jax.jit(
    lambda params, tokens, valid: nnx.merge(graphdef, params)(tokens, attention_mask=valid)
  )


def naive_greedy(model, prompt, max_new_tokens, eos_id=None):
  """A Python loop of full forward passes + argmax for one prompt (list of ids)."""
  _, params = nnx.split(model)
  seq = list(prompt)
  out = []
  for _ in range(max_new_tokens):
    tok = int(np.argmax(last_logits(params, model.config, seq)))
    out.append(tok)
    seq.append(tok)
    if eos_id is not None and tok == eos_id:
      break
  return out


def random_prompts(seed, lengths):
  rng = np.random.RandomState(seed)
  return [list(rng.randint(0, VOCAB, size=n)) for n in lengths]
