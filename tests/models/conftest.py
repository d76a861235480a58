import functools

import jax
import jax.numpy as jnp
import pytest

from transformer_jax import models

VOCAB = 97


def tiny(name, **overrides):
  return models.get_config(name, **{"vocab_size": VOCAB, **overrides})


@pytest.fixture
def tokens():
  return jax.random.randint(jax.random.key(7), (2, 12), 0, VOCAB)


def forward(model, config, tokens, **kw):
  """The family's main output as one array (MLM logits for BERT, decoder logits for Seq2Seq)."""
  match config:
    case models.BERTConfig():
      return model(tokens, jnp.zeros_like(tokens), jnp.ones_like(tokens), **kw).mlm_logits
    case models.Seq2SeqConfig():
      return model(tokens, tokens[:, ::-1], **kw)
    case _:
      return model(tokens, **kw)


@functools.lru_cache(maxsize=None)
def jit_forward(config):
  """``(params, tokens, dropout_rng=None) -> output`` compiled once per config in each test module
  (tests/conftest.py releases compiled programs after each)."""

  @jax.jit
  def fn(params, tokens, dropout_rng=None):
    from flax import nnx

    return forward(
      nnx.merge(models.graphdef(config), params), config, tokens, dropout_rng=dropout_rng
    )

  return fn


def compiled(model, method: str | None = None):
  """``model``'s call, or its ``method`` (positional and keyword arguments, all traced), as one
  compiled program, a program per input shape: a whole forward compiles in less time than its
  operations dispatched one by one, each compiled for its shapes."""
  from flax import nnx

  graphdef, state = nnx.split(model)

  def run(state, args, kwargs):
    m = nnx.merge(graphdef, state)
    return (m if method is None else getattr(m, method))(*args, **kwargs)

  fn = jax.jit(run)
  return lambda *args, **kwargs: fn(state, args, kwargs)


@functools.lru_cache(maxsize=None)
def params_for(config, seed=0):
  return models.init(config, jax.random.key(seed))


def full_forward_greedy(model, prompt, steps: int):
  """Greedy continuation by the full forward pass over the whole sequence at every step (no
  cache): ``[B, steps]`` new ids."""
  import numpy as np

  forward = jax.jit(lambda ids: model(ids))
  ids = np.asarray(prompt)
  p = ids.shape[1]
  # Right padding to one length: a causal model's earlier logits do not see it, and one shape
  # is one compile.
  ids = np.pad(ids, ((0, 0), (0, steps)))
  for i in range(steps):
    ids[:, p + i] = np.argmax(np.asarray(forward(ids))[:, p + i - 1], -1)
  return ids[:, p:]
