"""``train.optim``: the clipping transformation against a float64 NumPy reference and optax."""

from __future__ import annotations

import chex
import jax.numpy as jnp
import numpy as np
import optax
import pytest

from transformer_jax.train import optim


def _grads(scale: float):
  rng = np.random.default_rng(0)
  return {
    "w": jnp.asarray(rng.standard_normal((5, 3)) * scale, jnp.float32),
    "b": {"x": jnp.asarray(rng.standard_normal((7,)) * scale, jnp.float32)},
  }


@pytest.mark.parametrize("scale", [0.01, 10.0])
def test_clip_by_global_norm_matches_float64(scale):
  g = _grads(scale)
  max_norm = 1.0
  out, state = optim.clip_by_global_norm(max_norm).update(g, optax.EmptyState())
  leaves = [np.asarray(x, np.float64) for x in (g["w"], g["b"]["x"])]
  norm = np.sqrt(sum((x**2).sum() for x in leaves))
  ref = [x * min(1.0, max_norm / norm) for x in leaves]
  chex.assert_trees_all_equal_shapes_and_dtypes(out, g)
  np.testing.assert_allclose(out["w"], ref[0], rtol=1e-6)
  np.testing.assert_allclose(out["b"]["x"], ref[1], rtol=1e-6)
  # And optax's own, which selects instead of multiplying.
  chex.assert_trees_all_close(
    out, optax.clip_by_global_norm(max_norm).update(g, state)[0], rtol=1e-6
  )
  if norm < max_norm:  # below the limit the updates are the same bits
    chex.assert_trees_all_equal(out, g)
  else:
    assert np.sqrt(sum(float(jnp.sum(x**2)) for x in (out["w"], out["b"]["x"]))) == pytest.approx(
      max_norm, rel=1e-6
    )


def test_clip_of_zero_gradients_is_zero():
  g = {"w": jnp.zeros((3, 2))}
  out, _ = optim.clip_by_global_norm(1.0).update(g, optax.EmptyState())
  chex.assert_trees_all_equal(out, g)


def test_optimizer_clips_before_adamw():
  from transformer_jax.train.config import TrainConfig

  params = {"kernel": jnp.ones((2, 3)), "bias": jnp.ones((2,))}
  cfg = TrainConfig(
    clip_norm=1.0, lr=0.5, eps=1.0, weight_decay=0.0, warmup_steps=0, schedule="constant"
  )
  tx = optim.make_optimizer(cfg)
  g = {"kernel": jnp.full((2, 3), 100.0), "bias": jnp.full((2,), -100.0)}
  updates, _ = tx.update(g, tx.init(params), params)
  # Step 1 of AdamW: m_hat = g', v_hat = g'^2, so the update is -lr * g' / (|g'| + eps), with
  # g' = g / ||g|| (clipped to norm 1): every entry of g has magnitude 100, ||g|| = 100 * sqrt(8).
  c = 1.0 / np.sqrt(8.0)
  np.testing.assert_allclose(updates["kernel"], np.full((2, 3), -0.5 * c / (c + 1.0)), rtol=1e-5)
  np.testing.assert_allclose(updates["bias"], np.full((2,), 0.5 * c / (c + 1.0)), rtol=1e-5)
