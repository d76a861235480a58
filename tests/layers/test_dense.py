"""The tied output projection's padded form (``layers.dense.padded_attend``) against float64."""

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from flax import nnx

from transformer_jax import models
from transformer_jax.layers import dense
from transformer_jax.ops import dispatch


@pytest.mark.parametrize("v,multiple", [(37, 16), (50, 8), (64, 16)])
def test_padded_attend_matches_float64(v, multiple):
  rng = np.random.default_rng(0)
  x = rng.standard_normal((2, 5, 12))
  table = rng.standard_normal((v, 12))
  g = rng.standard_normal((2, 5, v))   # the cotangent of the logits

  def f(x, table):
    return jnp.sum(dense.padded_attend(x, table, multiple) * g)

  out = dense.padded_attend(jnp.asarray(x, jnp.float32), jnp.asarray(table, jnp.float32), multiple)
  assert out.shape == (2, 5, v)
  np.testing.assert_allclose(np.asarray(out), x @ table.T, rtol=1e-5, atol=1e-5)
  dx, dtable = jax.grad(f, argnums=(0, 1))(jnp.asarray(x, jnp.float32),
                                           jnp.asarray(table, jnp.float32))
  assert dtable.shape == (v, 12)
  np.testing.assert_allclose(np.asarray(dx), g @ table, rtol=1e-5, atol=1e-5)
  np.testing.assert_allclose(np.asarray(dtable), np.einsum("btv,btd->vd", g, x), rtol=1e-5,
                             atol=1e-5)


def test_model_logits_are_unchanged_when_the_table_pads(monkeypatch):
  config = models.get_config("gpt2-tiny", vocab_size=97)
  model = nnx.merge(models.graphdef(config), models.init(config, jax.random.key(0)))
  tokens = jnp.asarray(np.random.default_rng(1).integers(0, 97, (2, 9)), jnp.int32)
  plain = model(tokens)
  monkeypatch.setitem(dispatch.PAD_COLS, jax.default_backend(), 32)
  # The table itself picks the padded product for the tied head (97 columns, 18 rows).
  assert dispatch.choose_product(config.dtype, rows=18, cols=97) == "padded"
  padded = model(tokens)
  assert padded.shape == plain.shape == (2, 9, 97)
  np.testing.assert_allclose(np.asarray(padded), np.asarray(plain), rtol=1e-5, atol=1e-5)
