"""Models with the approximate attention kinds of ``layers.approx``: a BERT with Linformer or a
block-sparse pattern, a GPT with a block-sparse pattern (decoding from a cache included)."""

import dataclasses

import jax
import jax.numpy as jnp
import numpy as np
import optax
import pytest
from flax import nnx

from transformer_jax import generate, models, ops
from tests.models.conftest import full_forward_greedy


def bert(**kw):
  base = dict(
    vocab_size=64,
    d_model=32,
    num_layers=2,
    num_heads=4,
    d_ff=64,
    max_len=48,
    dropout_rate=0.0,
    attention_dropout_rate=0.0,
  )
  return models.BERTConfig(**{**base, **kw})


@pytest.mark.slow
def test_bert_linformer_at_identity_rank_equals_softmax_bert():
  softmax = bert()
  lin = bert(attention_kind="linformer", linformer_rows=48, linformer_share_kv=True)
  params = models.init(softmax, jax.random.key(0))
  lin_params = models.init(lin, jax.random.key(1))
  # The softmax parameters, and identity projections at R = S = max_len.
  flat = dict(nnx.to_flat_state(params))
  for path, var in nnx.to_flat_state(lin_params):
    if path[-1] == "lowrank_k":
      var.set_value(jnp.broadcast_to(jnp.eye(48), var.get_value().shape))
    else:
      var.set_value(flat[path].get_value())
  tokens = jnp.asarray(np.random.default_rng(0).integers(0, 64, (2, 48)))
  want = models.apply(softmax, params, tokens).mlm_logits
  got = models.apply(lin, lin_params, tokens).mlm_logits
  np.testing.assert_allclose(np.asarray(got), np.asarray(want), atol=2e-5, rtol=1e-5)


def _train(config, batches, steps=30):
  params = models.init(config, jax.random.key(0))
  opt = optax.adam(3e-3)
  state = opt.init(params)

  def loss_fn(p, tokens):
    logits = models.apply(config, p, tokens).mlm_logits
    return ops.cross_entropy(logits, tokens)[0]

  @jax.jit
  def step(p, s, tokens):
    loss, g = jax.value_and_grad(loss_fn)(p, tokens)
    updates, s = opt.update(g, s, p)
    return optax.apply_updates(p, updates), s, loss

  losses = []
  for i in range(steps):
    params, state, loss = step(params, state, batches[i % len(batches)])
    losses.append(float(loss))
  return losses


@pytest.mark.slow
@pytest.mark.parametrize("kind", ["linformer", "sparse"])
def test_bert_with_the_kind_trains(kind):
  # Reconstructing the (unmasked) tokens: the loss falls from log(64) = 4.2 well below it.
  extra = (
    dict(linformer_rows=16)
    if kind == "linformer"
    else dict(sparse_pattern=ops.SparsePattern.bigbird(block=8, random_blocks=1))
  )
  config = bert(attention_kind=kind, **extra)
  rng = np.random.default_rng(1)
  batches = [jnp.asarray(rng.integers(0, 64, (4, 48))) for _ in range(4)]
  losses = _train(config, batches)
  assert losses[-1] < 0.6 * losses[0], losses


@pytest.mark.slow
def test_sparse_kind_with_a_covering_pattern_equals_softmax():
  pattern = ops.SparsePattern(block=8, local_blocks=8)  # 8 blocks of 8 see all of T <= 64
  tokens = jnp.asarray(np.random.default_rng(2).integers(0, 64, (2, 40)))
  mask = jnp.asarray(np.arange(40)[None] < np.array([[40], [29]]))
  for family in ("bert", "gpt"):
    if family == "bert":
      base = bert()

      def run(c, p):
        return models.apply(c, p, tokens, None, mask).mlm_logits
    else:
      base = models.get_config("llama-tiny", vocab_size=64, max_len=64)

      def run(c, p):
        return models.apply(c, p, tokens, attention_mask=mask)

    sparse = dataclasses.replace(base, attention_kind="sparse", sparse_pattern=pattern)
    params = models.init(base, jax.random.key(3))
    np.testing.assert_allclose(
      np.asarray(run(sparse, params)), np.asarray(run(base, params)), atol=2e-5, rtol=1e-5
    )


@pytest.mark.slow
def test_gpt_sparse_decoding_from_a_cache_equals_the_full_forward():
  config = models.get_config(
    "llama-tiny",
    vocab_size=64,
    max_len=64,
    attention_kind="sparse",
    sparse_pattern=ops.SparsePattern(block=4, local_blocks=1, summary=1, strided=True),
  )
  model = nnx.merge(models.graphdef(config), models.init(config, jax.random.key(4)))
  rows = [np.random.default_rng(5).integers(0, 64, 9), np.random.default_rng(6).integers(0, 64, 4)]
  ours = np.asarray(generate.generate(model, [list(r) for r in rows], max_new_tokens=14))
  for i, row in enumerate(rows):
    np.testing.assert_array_equal(ours[i], full_forward_greedy(model, row[None], 14)[0])


def test_bad_kind_options_are_named():
  with pytest.raises(ValueError, match="attention_dropout_rate=0.1 must be 0"):
    bert(attention_kind="linformer", attention_dropout_rate=0.1)
  with pytest.raises(ValueError, match="sparse_pattern needs attention_kind='sparse'"):
    bert(sparse_pattern=ops.SparsePattern())
  with pytest.raises(ValueError, match="count from the start"):
    models.get_config(
      "llama-tiny", attention_kind="sparse", sparse_pattern=ops.SparsePattern.bigbird()
    )


@pytest.mark.slow
@pytest.mark.long
def test_bigbird_bert_fine_tunes_for_classification():
  # Label: does token 5 occur anywhere in the 48 tokens? Only the global [CLS] block sees them
  # all (blocks of 8: a window of 3 blocks, 1 random block per row).
  config = bert(
    attention_kind="sparse",
    num_labels=2,
    sparse_pattern=ops.SparsePattern.bigbird(block=8, random_blocks=1),
  )
  rng = np.random.default_rng(7)
  tokens = rng.integers(6, 64, (64, 48))
  labels = rng.integers(0, 2, 64)
  where = rng.integers(1, 48, 64)
  tokens[np.arange(64), where] = np.where(labels == 1, 5, tokens[np.arange(64), where])
  tokens[:, 0] = 1
  tokens, labels = jnp.asarray(tokens), jnp.asarray(labels)
  params = models.init(config, jax.random.key(0))
  opt = optax.adam(1e-2)
  state = opt.init(params)

  def loss_fn(p):
    logits = models.apply(config, p, tokens, method="classify")
    return ops.cross_entropy(logits, labels)[0], logits

  @jax.jit
  def step(p, s):
    (loss, logits), g = jax.value_and_grad(loss_fn, has_aux=True)(p)
    u, s = opt.update(g, s, p)
    return optax.apply_updates(p, u), s, loss, jnp.mean(jnp.argmax(logits, -1) == labels)

  for _ in range(40):
    params, state, loss, accuracy = step(params, state)
  assert float(accuracy) > 0.9 and float(loss) < 0.3, (float(loss), float(accuracy))
