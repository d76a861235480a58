"""A GPT with linear attention (``attention_kind="linear"``): recurrent decoding equals the
parallel forward token for token, its state does not grow, and it learns from its context."""

import jax
import jax.numpy as jnp
import numpy as np
import optax
import pytest
from flax import nnx

from transformer_jax import generate, models
from tests.models.conftest import full_forward_greedy


def tiny(**kw):
  return models.get_config("llama-tiny", attention_kind="linear", linear_chunk=8, **kw)


@pytest.mark.parametrize("decay", [None, 0.9, "retnet"])
def test_recurrent_decoding_equals_the_parallel_forward(decay):
  config = tiny(linear_decay=decay)
  model = nnx.merge(models.graphdef(config), models.init(config, jax.random.key(1)))
  rng = np.random.default_rng(2)
  rows = [rng.integers(0, 512, 13), rng.integers(0, 512, 5)]   # rows padded to one length
  ours = np.asarray(generate.generate(model, [list(r) for r in rows], max_new_tokens=20))
  for i, row in enumerate(rows):
    np.testing.assert_array_equal(ours[i], full_forward_greedy(model, row[None], 20)[0])


def test_the_decoding_state_is_the_same_size_for_any_length():
  config = tiny()
  sizes = {jax.tree.map(lambda x: x.shape, generate.init_cache(config, 2, n).s)
           for n in (16, 4096, 1 << 20)}
  assert sizes == {((2, 4, 16, 16),) * 2}
  model = nnx.merge(models.graphdef(config), models.init(config, jax.random.key(0)))
  step = jax.jit(lambda c, t: generate.extend(model, t, c))
  cache = generate.init_cache(config, 1, 1 << 20)
  for _ in range(5):
    _, cache = step(cache, jnp.zeros((1, 1), jnp.int32))
  assert step._cache_size() == 1 and int(cache.lengths[0]) == 5


def test_beam_search_and_sampling_run_with_the_state():
  config = tiny(linear_decay="retnet")
  model = nnx.merge(models.graphdef(config), models.init(config, jax.random.key(3)))
  prompt = np.random.default_rng(4).integers(0, 512, (2, 7))
  a = generate.generate(model, prompt, max_new_tokens=12, temperature=0.9, key=jax.random.key(1))
  b = generate.generate(model, prompt, max_new_tokens=12, temperature=0.9, key=jax.random.key(1))
  np.testing.assert_array_equal(np.asarray(a), np.asarray(b))
  beams = generate.beam_search(model, prompt, num_beams=3, max_new_tokens=12)
  assert beams.all_sequences.shape[:2] == (2, 3)
  assert np.all(np.isfinite(np.asarray(beams.scores)))


def test_a_small_model_learns_from_the_ids_its_row_has_used():
  # Each row draws its tokens from 4 ids of 64, its own: a model that reads its context gets
  # near log(4) = 1.39 nats; one that does not stays at log(64) = 4.16 at best. The bar is their
  # midpoint.
  config = models.get_config("llama-tiny", vocab_size=64, d_model=64, num_layers=2, num_heads=4,
                             num_kv_heads=4, d_ff=128, attention_kind="linear", linear_chunk=16)
  rng = np.random.default_rng(0)

  def batch(n):
    sets = np.stack([rng.choice(64, 4, replace=False) for _ in range(n)])
    return jnp.asarray(np.take_along_axis(sets, rng.integers(0, 4, (n, 48)), 1), jnp.int32)

  optimizer = optax.adam(3e-3)
  params = models.init(config, jax.random.key(0))
  graphdef = models.graphdef(config)
  opt_state = optimizer.init(params)

  def loss_fn(p, ids):
    logits = nnx.merge(graphdef, p)(ids[:, :-1])
    nll = -jnp.take_along_axis(jax.nn.log_softmax(logits), ids[:, 1:, None], -1)[..., 0]
    return jnp.mean(nll[:, 16:])            # once the row has shown its ids

  @jax.jit
  def step(p, o, ids):
    loss, g = jax.value_and_grad(loss_fn)(p, ids)
    updates, o = optimizer.update(g, o, p)
    return optax.apply_updates(p, updates), o, loss

  for _ in range(200):
    params, opt_state, _ = step(params, opt_state, batch(32))
  held_out = float(jax.jit(loss_fn)(params, batch(256)))
  assert held_out < (np.log(4) + np.log(64)) / 2, held_out
