"""Every layer's attention weights from a model, against a float64 NumPy forward pass."""

import jax
import numpy as np
import pytest
from flax import nnx

from tests.models.conftest import VOCAB, tiny
from transformer_jax import models, ops


def _np(x):
  return np.asarray(x, np.float64)


def _layer_norm(x, scale, bias, eps=1e-5):
  mu = x.mean(-1, keepdims=True)
  var = ((x - mu) ** 2).mean(-1, keepdims=True)
  return (x - mu) / np.sqrt(var + eps) * scale + bias


def _gelu_tanh(x):
  return 0.5 * x * (1 + np.tanh(np.sqrt(2 / np.pi) * (x + 0.044715 * x**3)))


def _reference_weights(model, tokens_BT, valid_BS, alibi: bool):
  """A GPT-2 forward pass in float64 NumPy that records each layer's softmax ``[L, B, N, T, S]``."""
  c = model.config
  b, t = tokens_BT.shape
  x = _np(model.embed.embedding[...])[tokens_BT]
  if model.pos_embed is not None:
    x = x + _np(model.pos_embed.embedding[...])[np.arange(t)]
  p = jax.tree.map(_np, nnx.to_pure_dict(nnx.state(model.blocks.layers, nnx.Param)))
  mask_BTS = np.tril(np.ones((t, t), bool))[None] & valid_BS[:, None, :]
  dist_TS = np.arange(t)[None, :] - np.arange(t)[:, None]
  slopes = np.asarray(ops.alibi_slopes(c.num_heads), np.float64)
  out = []
  for i in range(c.num_layers):
    lp = jax.tree.map(lambda a: a[i], p)
    a, m = lp["attn"], lp["mlp"]
    h = _layer_norm(x, lp["attn_norm"]["scale"], lp["attn_norm"]["bias"])
    q = np.einsum("btd,dnh->btnh", h, a["query"]["kernel"]) + a["query"]["bias"]
    k = np.einsum("btd,dnh->btnh", h, a["key"]["kernel"]) + a["key"]["bias"]
    v = np.einsum("btd,dnh->btnh", h, a["value"]["kernel"]) + a["value"]["bias"]
    s = np.einsum("btnh,bsnh->bnts", q, k) / np.sqrt(q.shape[-1])
    if alibi:
      s = s + slopes[None, :, None, None] * np.minimum(dist_TS, 0)[None, None]
    s = np.where(mask_BTS[:, None], s, -np.inf)
    w = np.exp(s - s.max(-1, keepdims=True))
    w = w / w.sum(-1, keepdims=True)
    out.append(w)
    o = np.einsum("bnts,bsnh->btnh", w, v)
    x = x + np.einsum("btnh,nhd->btd", o, a["out"]["kernel"]) + a["out"]["bias"]
    h = _layer_norm(x, lp["mlp_norm"]["scale"], lp["mlp_norm"]["bias"])
    f = _gelu_tanh(np.einsum("btd,df->btf", h, m["up"]["kernel"]) + m["up"]["bias"])
    x = x + np.einsum("btf,fd->btd", f, m["down"]["kernel"]) + m["down"]["bias"]
  return np.stack(out)


@pytest.mark.parametrize("position", ["learned", "alibi"])
def test_gpt_attention_weights_match_a_float64_forward_pass(position):
  # A large init so that the weights are far from uniform and every layer's input matters.
  config = tiny(
    "gpt2-tiny",
    d_model=16,
    num_layers=3,
    num_heads=2,
    d_ff=32,
    max_len=16,
    position=position,
    init_std=0.4,
  )
  model = models.create(config)  # one compiled initialisation, not op by op
  tokens = np.asarray(jax.random.randint(jax.random.key(1), (2, 9), 0, VOCAB))
  valid = np.ones((2, 9), bool)
  valid[1, 6:] = False  # row 1: three padding keys
  weights = np.asarray(model.attention_weights(tokens, attention_mask=valid))
  assert weights.shape == (3, 2, 2, 9, 9)
  ref = _reference_weights(model, tokens, valid, alibi=position == "alibi")
  np.testing.assert_allclose(weights, ref, rtol=2e-4, atol=2e-6)
  assert weights[1:].std() > 0.05  # not near-uniform: the check has teeth
  np.testing.assert_array_equal(weights[:, 1, :, :, 6:], 0.0)


@pytest.mark.slow
def test_gpt_attention_weights_agree_with_the_ops_return_weights_in_layer_zero():
  config = tiny(
    "gpt2-tiny",
    d_model=16,
    num_layers=2,
    num_heads=4,
    num_kv_heads=2,
    d_ff=32,
    max_len=16,
    position="rope",
  )
  model = models.create(config)
  tokens = jax.random.randint(jax.random.key(2), (1, 7), 0, VOCAB)
  weights = model.attention_weights(tokens)
  layer0 = jax.tree.map(lambda a: a[0], nnx.state(model.blocks.layers))
  block = nnx.merge(nnx.graphdef(model.blocks.layers), layer0)
  h = block.attn_norm(model.embed(tokens))
  pos = np.arange(7)
  q = ops.apply_rope(block.attn.query(h), pos)
  k = ops.apply_rope(block.attn.key(h), pos)
  _, expected = ops.dot_product_attention(
    q, k, block.attn.value(h), causal=True, return_weights=True
  )
  np.testing.assert_allclose(weights[0], expected, rtol=1e-5, atol=1e-7)


def test_bert_attention_weights_mask_padding_and_see_both_ways():
  config = tiny("bert-tiny")
  model = models.create(config)
  tokens = jax.random.randint(jax.random.key(4), (1, 8), 0, VOCAB)
  valid = np.array([[True] * 6 + [False] * 2])
  weights = np.asarray(model.attention_weights(tokens, attention_mask=valid))
  assert weights.shape == (config.num_layers, 1, config.num_heads, 8, 8)
  np.testing.assert_allclose(weights.sum(-1), 1.0, rtol=1e-5)
  np.testing.assert_array_equal(weights[..., 6:], 0.0)
  assert (weights[..., :6] > 0).all()  # bidirectional: future keys too
