"""Token ids under ``jit``: clamped silently by the embedding lookup, refused by
``models.checked``."""

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from transformer_jax import models
from tests.models.conftest import tiny


@pytest.mark.parametrize("name", ["gpt2-tiny", "bert-tiny", "t5-tiny"])
def test_checked_refuses_ids_outside_the_vocabulary_inside_jit(name):
  config = tiny(name)
  params = models.init(config, jax.random.key(0))
  v = config.vocab_size
  good = jnp.asarray(np.random.default_rng(0).integers(0, v, (2, 6)), jnp.int32)
  bad = good.at[1, 4].set(v + 2)
  args = (lambda ids: (ids, ids)) if name == "t5-tiny" else (lambda ids: (ids,))
  fn = models.checked(lambda p, *ids: models.apply(config, p, *ids))
  out = fn(params, *args(good))
  want = models.apply(config, params, *args(good))
  for a, b in zip(jax.tree.leaves(out), jax.tree.leaves(want)):
    np.testing.assert_allclose(np.asarray(a), np.asarray(b), rtol=1e-6, atol=1e-6)
  with pytest.raises(ValueError, match=rf"outside the vocabulary \[0, {v}\): min \d+, max {v + 2}"):
    fn(params, *args(bad))
  with pytest.raises(ValueError, match="outside the vocabulary"):
    fn(params, *args(good.at[0, 0].set(-1)))


def test_plain_jit_clamps_what_an_eager_call_refuses():
  # The documented behaviour that `checked` exists for: eager calls see the ids and refuse them;
  # under jax.jit the lookup clamps v + 2 to v - 1.
  config = tiny("gpt2-tiny")
  params = models.init(config, jax.random.key(0))
  v = config.vocab_size
  ids = jnp.asarray([[1, 2, v + 2]], jnp.int32)
  with pytest.raises(ValueError, match="outside the vocabulary"):
    models.apply(config, params, ids)
  clamped = jax.jit(lambda p, t: models.apply(config, p, t))(params, ids)
  edge = jax.jit(lambda p, t: models.apply(config, p, t))(params, ids.at[0, 2].set(v - 1))
  np.testing.assert_array_equal(np.asarray(clamped), np.asarray(edge))


@pytest.mark.parametrize("position", ["learned", "sinusoidal"])
def test_positions_past_the_table_are_refused_not_clamped(position):
  config = tiny("gpt2-tiny", position=position, max_len=16)
  params = models.init(config, jax.random.key(0))
  ids = jnp.zeros((1, 4), jnp.int32)
  past = np.array([[0, 1, 2, 16]])
  with pytest.raises(
    ValueError,
    match=r"positions\[0, 3\] = 16 is outside the position table "
    r"\[0, max_len=16\)",
  ):
    models.apply(config, params, ids, past)
  fn = models.checked(lambda p, t, pos: models.apply(config, p, t, pos))
  with pytest.raises(
    ValueError,
    match=r"positions holds positions outside the table "
    r"\[0, max_len=16\): min 0, max 16",
  ):
    fn(params, ids, jnp.asarray(past))
  last = np.array([[0, 1, 2, 15]])
  np.testing.assert_allclose(
    np.asarray(fn(params, ids, jnp.asarray(last))),
    np.asarray(models.apply(config, params, ids, last)),
    rtol=1e-5,
    atol=1e-5,
  )


def test_ids_wider_than_int32_are_refused_not_wrapped():
  config = tiny("gpt2-tiny")
  params = models.init(config, jax.random.key(0))
  fn = models.checked(lambda p, tokens: models.apply(config, p, tokens))
  ids = np.array([[1, 2, 2**32 + 3]], np.int64)  # int32 would read 3
  with pytest.raises(ValueError, match=r"tokens\[0, 2\] = 4294967299 does not fit in int32"):
    fn(params, ids)
