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


@pytest.mark.slow
@pytest.mark.parametrize("decay", [None, 0.9, "retnet"])
def test_recurrent_decoding_equals_the_parallel_forward(decay):
  config = tiny(linear_decay=decay)
  model = nnx.merge(models.graphdef(config), models.init(config, jax.random.key(1)))
  rng = np.random.default_rng(2)
  rows = [rng.integers(0, 512, 13), rng.integers(0, 512, 5)]  # rows padded to one length
  ours = np.asarray(generate.generate(model, [list(r) for r in rows], max_new_tokens=20))
  for i, row in enumerate(rows):
    np.testing.assert_array_equal(ours[i], full_forward_greedy(model, row[None], 20)[0])


def test_the_decoding_state_is_the_same_size_for_any_length():
  config = tiny()
  sizes = {
    jax.tree.map(lambda x: x.shape, generate.init_cache(config, 2, n).s)
    for n in (16, 4096, 1 << 20)
  }
  assert sizes == {((2, 4, 16, 16),) * 2}
  model = nnx.merge(models.graphdef(config), models.init(config, jax.random.key(0)))
  step = jax.jit(lambda c, t: generate.extend(model, t, c))
  cache = generate.init_cache(config, 1, 1 << 20)
  for _ in range(5):
    _, cache = step(cache, jnp.zeros((1, 1), jnp.int32))
  assert step._cache_size() == 1 and int(cache.lengths[0]) == 5


@pytest.mark.slow
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


@pytest.mark.slow
@pytest.mark.long
def test_a_small_model_learns_from_the_ids_its_row_has_used():
  # Each row draws its tokens from 4 ids of 64, its own: a model that reads its context gets
  # near log(4) = 1.39 nats; one that does not stays at log(64) = 4.16 at best. The bar is their
  # midpoint.
  config = models.get_config(
    "llama-tiny",
    vocab_size=64,
    d_model=64,
    num_layers=2,
    num_heads=4,
    num_kv_heads=4,
    d_ff=128,
    attention_kind="linear",
    linear_chunk=16,
  )
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
    return jnp.mean(nll[:, 16:])  # once the row has shown its ids

  @jax.jit
  def step(p, o, ids):
    loss, g = jax.value_and_grad(loss_fn)(p, ids)
    updates, o = optimizer.update(g, o, p)
    return optax.apply_updates(p, updates), o, loss

  for _ in range(120):  # held-out loss about 2.5 by then
    params, opt_state, _ = step(params, opt_state, batch(32))
  held_out = float(jax.jit(loss_fn)(params, batch(256)))
  assert held_out < (np.log(4) + np.log(64)) / 2, held_out


@pytest.mark.slow
@pytest.mark.parametrize("decay,lengths", [(0.5, (2, 200)), ("retnet", (3, 3000))])
def test_a_short_row_beside_a_long_one_decodes_as_it_does_alone(decay, lengths):
  """The short row's prefill is padded to the long row's bucket; padding must neither add to nor
  decay its state (decayed and multiplied back, 0.5 over 254 positions overflows to a NaN
  state, which decodes as id 0 forever)."""
  config = models.get_config(
    "gpt2-tiny",
    vocab_size=97,
    d_model=16,
    num_layers=1,
    num_heads=2,
    d_ff=32,
    max_len=4096,
    attention_kind="linear",
    linear_decay=decay,
    init_std=0.3,
  )
  params = models.init(config, jax.random.key(0))
  rng = np.random.default_rng(0)
  rows = [list(rng.integers(0, 97, n)) for n in lengths]
  both = np.asarray(generate.generate((config, params), rows, max_new_tokens=4))
  for i, row in enumerate(rows):
    alone = np.asarray(generate.generate((config, params), [row], max_new_tokens=4))[0]
    np.testing.assert_array_equal(both[i], alone, err_msg=f"row {i} of {lengths}")


@pytest.mark.slow
@pytest.mark.parametrize("decay", [None, (0.9, 0.3)])
def test_linear_attention_weights_are_the_ones_its_output_uses(decay):
  """``Attention.weights`` of a linear layer, with padding and two packed documents: the
  weights times the values give ``ops.linear_attention``'s output at every real position."""
  from transformer_jax import ops
  from transformer_jax.layers import Attention, LinearKind

  layer = Attention(
    16,
    2,
    2,
    8,
    use_bias=False,
    init_std=0.3,
    out_init_std=0.3,
    dtype=jnp.float32,
    param_dtype=jnp.float32,
    rngs=nnx.Rngs(0),
    linear=LinearKind(chunk_size=4, decay=decay),
  )
  x = jax.random.normal(jax.random.key(1), (2, 11, 16))
  valid = np.ones((2, 11), bool)
  valid[0, :3] = valid[1, 9:] = False
  segments = np.where(np.arange(11) < 6, 1, 2)[None].repeat(2, 0)
  w_BNTS = layer.weights(x, causal=True, kv_valid=valid, segment_ids=segments)
  q, k, v = layer.query(x), layer.key(x), layer.value(x)
  want = ops.linear_attention(
    q, k, v, chunk_size=4, decay=decay, kv_valid=valid, segment_ids=segments
  )
  got = jnp.einsum("bnij,bjne->bine", w_BNTS, v)
  np.testing.assert_allclose(np.asarray(got)[valid], np.asarray(want)[valid], atol=2e-5)
