"""The decoding layout: projection kernels stored ``[out, in]`` and multiplied weight-first, the
tied output projection weight-first for a few rows, and the per-params reuse of the split layers."""

import gc

import chex
import jax
import jax.numpy as jnp
import numpy as np
import pytest
from flax import nnx

from transformer_jax import generate
from transformer_jax.generate import decode
from transformer_jax.layers.dense import SKINNY_ROWS, Embed, OutInKernel, Projection
from tests.generate.conftest import gpt_model, naive_greedy, random_prompts

# Every einsum form the models' projections use: (einsum, x shape, kernel shape, bias shape).
FORMS = [
    ("BTD,DNH->BTNH", (3, 2, 8), (8, 4, 5), (4, 5)),      # query
    ("BSD,DKH->BSKH", (3, 2, 8), (8, 2, 5), None),        # key/value (GQA), no bias
    ("BTNH,NHD->BTD", (3, 2, 4, 5), (4, 5, 8), (8,)),     # attention output
    ("BTD,DF->BTF", (3, 2, 8), (8, 12), (12,)),           # MLP up/gate
    ("BTF,FD->BTD", (3, 2, 12), (12, 8), None),           # MLP down
]


def projection(einsum, kernel_shape, bias_shape):
  proj = Projection(einsum, kernel_shape, ("embed",) * len(kernel_shape),
                    bias_shape=bias_shape, bias_axes=None if bias_shape is None else
                    ("embed",) * len(bias_shape), init_std=1.0, dtype=jnp.float32,
                    param_dtype=jnp.float32, rngs=nnx.Rngs(0))
  if bias_shape is not None:
    proj.bias[...] = jax.random.normal(jax.random.key(1), bias_shape)
  return proj


@pytest.mark.parametrize("einsum,x_shape,kernel_shape,bias_shape", FORMS)
def test_decode_layout_projection_equals_float64_reference(einsum, x_shape, kernel_shape,
                                                           bias_shape):
  proj = projection(einsum, kernel_shape, bias_shape)
  x = np.random.default_rng(0).standard_normal(x_shape).astype(np.float32)
  kernel = np.asarray(proj.kernel[...], np.float64)
  want = np.einsum(einsum, x.astype(np.float64), kernel)
  if bias_shape is not None:
    want = want + np.asarray(proj.bias[...], np.float64)
  proj.decode_layout()
  assert isinstance(proj.kernel, OutInKernel)
  x_letters, k_letters = einsum.split("->")[0].split(",")
  n_in = sum(c in x_letters for c in k_letters)
  # [in..., out...] -> [out..., in...]
  chex.assert_shape(proj.kernel[...], (*kernel_shape[n_in:], *kernel_shape[:n_in]))
  got = jax.jit(lambda x: proj(x))(x)
  np.testing.assert_allclose(np.asarray(got), want, rtol=1e-5, atol=1e-5)
  proj.decode_layout()  # a second call leaves the layout as it is
  np.testing.assert_allclose(np.asarray(proj(x)), want, rtol=1e-5, atol=1e-5)


@pytest.mark.parametrize("rows", [(1, 1), (8, 1), (2, 32), (4, 20)])  # the last is over SKINNY_ROWS
def test_embed_attend_equals_float64_reference_and_differentiates(rows):
  b, t = rows
  assert (b * t <= SKINNY_ROWS) == (rows != (4, 20))
  embed = Embed(50, 8, init_std=1.0, dtype=jnp.float32, param_dtype=jnp.float32,
                rngs=nnx.Rngs(0))
  table = np.asarray(embed.embedding[...], np.float64)
  x = np.random.default_rng(1).standard_normal((b, t, 8)).astype(np.float32)
  np.testing.assert_allclose(np.asarray(embed.attend(x)), x.astype(np.float64) @ table.T,
                             rtol=1e-5, atol=1e-5)
  # Gradients through the weight-first product (optimization barrier included) equal the
  # closed form of sum(w * x E^T): dE = w^T x, dx = w E.
  w = np.random.default_rng(2).standard_normal((b, t, 50)).astype(np.float32)
  graphdef, state = nnx.split(embed)

  def loss(state, x):
    return jnp.sum(nnx.merge(graphdef, state).attend(x) * w)

  d_state, d_x = jax.grad(loss, argnums=(0, 1))(state, x)
  w64 = w.astype(np.float64).reshape(-1, 50)
  np.testing.assert_allclose(np.asarray(d_state["embedding"][...]),
                             w64.T @ x.astype(np.float64).reshape(-1, 8), rtol=1e-4, atol=1e-4)
  np.testing.assert_allclose(np.asarray(d_x), (w64 @ table).reshape(b, t, 8), rtol=1e-4,
                             atol=1e-4)


def test_split_layers_puts_every_projection_in_decode_layout_and_leaves_the_model_alone():
  model = gpt_model("llama-rope-gqa")
  layers = model.split_layers()
  assert len(layers) == model.config.num_layers
  kernels = [v for v in jax.tree.leaves(layers, is_leaf=lambda v: isinstance(v, nnx.Variable))
             if isinstance(v, OutInKernel)]
  # query, key, value, out, and the gated MLP's gate, up and down: 7 per layer
  assert len(kernels) == 7 * model.config.num_layers
  for _, node in nnx.iter_graph(model):
    if isinstance(node, Projection):
      assert not isinstance(node.kernel, OutInKernel)


def test_decode_layers_are_made_once_per_params_and_freed_with_them():
  model = gpt_model("gpt2-learned")
  prompts = random_prompts(3, [4, 7])
  graphdef, params = nnx.split(model)
  first = decode.decode_layers(graphdef, params)
  assert decode.decode_layers(graphdef, nnx.split(model)[1]) is first  # the same arrays
  # New weights (as after a training step): a new split, and generation follows the new weights.
  params2 = jax.tree.map(lambda a: a * 1.5, params)
  assert decode.decode_layers(graphdef, params2) is not first
  model2 = nnx.merge(graphdef, params2)
  got = np.asarray(generate.generate(model2, prompts, max_new_tokens=5))
  for row, prompt in enumerate(prompts):
    assert got[row].tolist() == naive_greedy(model2, prompt, 5)
  assert decode._DECODE_LAYERS[graphdef][1] is decode.decode_layers(graphdef, params2)
  del model2, params2
  gc.collect()
  assert graphdef not in decode._DECODE_LAYERS  # released with the weights it was made from
