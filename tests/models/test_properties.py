"""Model-level properties: causality, bidirectionality, padding and packing invariance, relative
positions, GQA == MHA, and a float64 NumPy GPT-2 forward as an independent reference."""

import pathlib

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from flax import nnx

from transformer_jax import models
from transformer_jax.layers import Attention
from tests.models.conftest import VOCAB, compiled, jit_forward, params_for, tiny


@pytest.mark.parametrize(
  "name", ["gpt2-tiny", "llama-tiny", "gpt-alibi-tiny", "t5-tiny", "transformer-tiny"]
)
def test_changing_future_token_leaves_earlier_logits_unchanged(name):
  config = tiny(name)
  fn, params = jit_forward(config), params_for(config)
  tokens = jax.random.randint(jax.random.key(1), (2, 12), 0, VOCAB)
  changed = tokens.at[:, 8].set((tokens[:, 8] + 1) % VOCAB)
  if isinstance(config, models.Seq2SeqConfig):
    # The decoder input is tokens[:, ::-1]: position 8 of `tokens` is decoder position 3; the
    # encoder sees the change everywhere, so hold the source fixed and change only the target.
    model = nnx.merge(models.graphdef(config), params)
    a = model(tokens, tokens)
    b = model(tokens, changed)
  else:
    a, b = fn(params, tokens), fn(params, changed)
  np.testing.assert_array_equal(a[:, :8], b[:, :8])
  assert not np.allclose(a[:, 8:], b[:, 8:])


def test_gpt_gradient_causality():
  # nanodo's test: d logits[t] / d embedding[s] is zero for every s > t.
  config = tiny("gpt2-tiny")
  params = params_for(config)
  graphdef = models.graphdef(config)
  tokens = jax.random.randint(jax.random.key(2), (1, 10), 0, VOCAB)

  def logit_at(pos_table, t):
    p = jax.tree.map(lambda x: x, params)
    p["pos_embed"]["embedding"][...] = pos_table
    return nnx.merge(graphdef, p)(tokens)[0, t].sum()

  table = params["pos_embed"]["embedding"][...]
  grads = jax.jit(jax.vmap(jax.grad(logit_at), in_axes=(None, 0)))(table, jnp.arange(10))
  per_pos = np.abs(np.asarray(grads)[:, :10]).sum(-1)  # [t, s]
  assert np.all(per_pos[np.triu_indices(10, k=1)] == 0.0)
  assert np.all(per_pos[np.tril_indices(10)] > 0.0)


def test_bert_is_bidirectional():
  config = tiny("bert-tiny")
  fn, params = jit_forward(config), params_for(config)
  tokens = jax.random.randint(jax.random.key(1), (2, 12), 0, VOCAB)
  changed = tokens.at[:, -1].set((tokens[:, -1] + 1) % VOCAB)
  assert not np.allclose(fn(params, tokens)[:, 0], fn(params, changed)[:, 0])


@pytest.mark.slow
@pytest.mark.parametrize("name", ["gpt2-tiny", "llama-tiny", "bert-tiny"])
def test_padding_does_not_change_real_positions(name):
  config = tiny(name)
  model = compiled(nnx.merge(models.graphdef(config), params_for(config)))
  tokens = jax.random.randint(jax.random.key(3), (2, 7), 0, VOCAB)
  padded = jnp.concatenate([tokens, jnp.zeros((2, 5), tokens.dtype)], axis=1)
  mask = jnp.arange(12)[None, :] < 7
  mask = jnp.broadcast_to(mask, (2, 12))
  if isinstance(config, models.BERTConfig):
    a = model(tokens, None, jnp.ones_like(tokens)).mlm_logits
    b = model(padded, None, mask).mlm_logits
  else:
    a = model(tokens)
    b = model(padded, attention_mask=mask)
  np.testing.assert_allclose(a, b[:, :7], atol=1e-5)


@pytest.mark.slow
@pytest.mark.parametrize("name", ["t5-tiny", "transformer-tiny"])
def test_source_padding_does_not_change_decoder_logits(name):
  config = tiny(name)
  model = compiled(nnx.merge(models.graphdef(config), params_for(config)))
  src = jax.random.randint(jax.random.key(4), (2, 6), 0, VOCAB)
  tgt = jax.random.randint(jax.random.key(5), (2, 5), 0, VOCAB)
  src_padded = jnp.concatenate([src, jnp.zeros((2, 4), src.dtype)], axis=1)
  src_mask = jnp.broadcast_to(jnp.arange(10)[None] < 6, (2, 10))
  np.testing.assert_allclose(model(src, tgt), model(src_padded, tgt, src_mask=src_mask), atol=1e-5)


@pytest.mark.slow
@pytest.mark.parametrize("name", ["gpt2-tiny", "llama-tiny", "gpt-alibi-tiny"])
def test_packed_documents_equal_separate_runs(name):
  config = tiny(name)
  model = compiled(nnx.merge(models.graphdef(config), params_for(config)))
  doc_a = jax.random.randint(jax.random.key(6), (1, 5), 0, VOCAB)
  doc_b = jax.random.randint(jax.random.key(7), (1, 7), 0, VOCAB)
  packed = jnp.concatenate([doc_a, doc_b], axis=1)
  segments = jnp.array([[1] * 5 + [2] * 7])
  positions = jnp.array([list(range(5)) + list(range(7))])
  out = model(packed, positions=positions, segment_ids=segments)
  np.testing.assert_allclose(out[:, :5], model(doc_a), atol=1e-5)
  # For ALiBi too: it biases by index distance, which within a document is the position distance.
  np.testing.assert_allclose(out[:, 5:], model(doc_b), atol=1e-5)


def test_rope_model_logits_invariant_to_position_shift():
  config = tiny("llama-tiny")
  model = compiled(nnx.merge(models.graphdef(config), params_for(config)))
  tokens = jax.random.randint(jax.random.key(8), (2, 9), 0, VOCAB)
  base = model(tokens, positions=jnp.arange(9))
  shifted = model(tokens, positions=jnp.arange(9) + 37)
  np.testing.assert_allclose(base, shifted, atol=2e-4)
  learned = tiny("gpt2-tiny")
  m2 = compiled(nnx.merge(models.graphdef(learned), params_for(learned)))
  assert not np.allclose(
    m2(tokens, positions=jnp.arange(9)), m2(tokens, positions=jnp.arange(9) + 37), atol=1e-3
  )


def test_sliding_window_limits_receptive_field():
  config = tiny("llama-tiny", sliding_window=3, num_layers=1)
  model = compiled(nnx.merge(models.graphdef(config), params_for(config)))
  tokens = jax.random.randint(jax.random.key(9), (1, 10), 0, VOCAB)
  changed = tokens.at[:, 2].set((tokens[:, 2] + 1) % VOCAB)
  a, b = model(tokens), model(changed)
  # With one layer and window 3, position t sees t-2..t: token 2 affects positions 2, 3, 4 only.
  np.testing.assert_array_equal(a[:, 5:], b[:, 5:])
  assert not np.allclose(a[:, 4], b[:, 4])


def test_gqa_attention_equals_mha_with_repeated_kv_heads():
  d, n, k, h = 16, 4, 2, 8
  gqa = Attention(
    d,
    n,
    k,
    h,
    use_bias=True,
    init_std=0.3,
    out_init_std=0.3,
    dtype=jnp.float32,
    param_dtype=jnp.float32,
    rngs=nnx.Rngs(0),
    rope_theta=10000.0,
  )
  mha = Attention(
    d,
    n,
    n,
    h,
    use_bias=True,
    init_std=0.3,
    out_init_std=0.3,
    dtype=jnp.float32,
    param_dtype=jnp.float32,
    rngs=nnx.Rngs(1),
    rope_theta=10000.0,
  )
  mha.query.kernel[...] = gqa.query.kernel[...]
  mha.query.bias[...] = gqa.query.bias[...]
  mha.out.kernel[...] = gqa.out.kernel[...]
  mha.out.bias[...] = gqa.out.bias[...]
  for name in ("key", "value"):  # query head i uses kv head i // (n // k)
    src, dst = getattr(gqa, name), getattr(mha, name)
    dst.kernel[...] = jnp.repeat(src.kernel[...], n // k, axis=1)
    dst.bias[...] = jnp.repeat(src.bias[...], n // k, axis=0)
  x = jax.random.normal(jax.random.key(0), (2, 6, d))
  run = nnx.jit(lambda m, x: m(x, causal=True)[0])  # one compiled program per module
  np.testing.assert_allclose(run(gqa, x), run(mha, x), atol=1e-5)


# ---------------------------------------------------------------------------------------------
# An independent float64 NumPy GPT-2 forward pass, written from the paper's description.


def _np_layer_norm(x, g, b, eps):
  mu = x.mean(-1, keepdims=True)
  var = ((x - mu) ** 2).mean(-1, keepdims=True)
  return (x - mu) / np.sqrt(var + eps) * g + b


def _np_gelu_tanh(x):
  return 0.5 * x * (1 + np.tanh(np.sqrt(2 / np.pi) * (x + 0.044715 * x**3)))


def _np_gpt2(p, tokens, c):
  def f64(a):
    return np.asarray(a, np.float64)

  x = f64(p["embed"]["embedding"])[tokens] + f64(p["pos_embed"]["embedding"])[: tokens.shape[1]]
  t = tokens.shape[1]
  causal = np.tril(np.ones((t, t), bool))
  blocks = p["blocks"]["layers"]
  for i in range(c.num_layers):

    def get(*path):
      return f64(_dig(blocks, path)[i])

    h = _np_layer_norm(x, get("attn_norm", "scale"), get("attn_norm", "bias"), c.norm_eps)
    q = (
      np.einsum("btd,dnh->bnth", h, get("attn", "query", "kernel"))
      + get("attn", "query", "bias")[None, :, None, :]
    )
    k = (
      np.einsum("btd,dnh->bnth", h, get("attn", "key", "kernel"))
      + get("attn", "key", "bias")[None, :, None, :]
    )
    v = (
      np.einsum("btd,dnh->bnth", h, get("attn", "value", "kernel"))
      + get("attn", "value", "bias")[None, :, None, :]
    )
    s = q @ k.transpose(0, 1, 3, 2) / np.sqrt(q.shape[-1])
    s = np.where(causal, s, -np.inf)
    w = np.exp(s - s.max(-1, keepdims=True))
    w /= w.sum(-1, keepdims=True)
    o = np.einsum("bnts,bnsh->btnh", w, v)
    x = x + np.einsum("btnh,nhd->btd", o, get("attn", "out", "kernel")) + get("attn", "out", "bias")
    h = _np_layer_norm(x, get("mlp_norm", "scale"), get("mlp_norm", "bias"), c.norm_eps)
    h = _np_gelu_tanh(h @ get("mlp", "up", "kernel") + get("mlp", "up", "bias"))
    x = x + h @ get("mlp", "down", "kernel") + get("mlp", "down", "bias")
  x = _np_layer_norm(x, f64(p["final_norm"]["scale"]), f64(p["final_norm"]["bias"]), c.norm_eps)
  return x @ f64(p["embed"]["embedding"]).T


def _dig(tree, path):
  for key in path:
    tree = tree[key]
  return tree


def test_gpt2_matches_float64_numpy_reference():
  config = tiny("gpt2-tiny", init_std=0.2)  # larger weights: a real test of every op
  params = params_for(config)
  tokens = jax.random.randint(jax.random.key(10), (2, 11), 0, VOCAB)
  got = jit_forward(config)(params, tokens)
  ref = _np_gpt2(nnx.to_pure_dict(params), np.asarray(tokens), config)
  np.testing.assert_allclose(np.asarray(got), ref, atol=2e-4, rtol=1e-4)


@pytest.mark.slow
@pytest.mark.parametrize("name", ["gpt2-tiny", "bert-tiny", "t5-tiny"])
def test_attention_impl_reaches_the_kernel_of_every_attention(name, tokens, monkeypatch):
  """The config's ``attention_impl`` is what every attention call passes to its backend."""
  from transformer_jax import backends
  from tests.models.conftest import forward

  seen = []
  real = backends.Backend.attention

  def spy(self, *args, implementation=None, **kw):
    seen.append(implementation)
    return real(self, *args, implementation="xla", **kw)

  monkeypatch.setattr(backends.Backend, "attention", spy)
  config = tiny(name, attention_impl="cudnn", dtype="bfloat16", scan_layers=False)
  # Traced, not compiled: the calls happen as the forward pass is traced.
  graphdef, state = nnx.split(nnx.eval_shape(lambda: models.create(config, rngs=nnx.Rngs(0))))
  jax.eval_shape(lambda s, t: forward(nnx.merge(graphdef, s), config, t), state, tokens)
  layers = (
    config.num_layers
    if hasattr(config, "num_layers")
    else (config.num_encoder_layers + 2 * config.num_decoder_layers)
  )  # decoder: self + cross
  assert seen == ["cudnn"] * layers


def test_attention_impl_is_validated_and_set_from_the_command_line():
  with pytest.raises(ValueError, match=r"attention_impl='flash' must be one of None, 'xla'"):
    tiny("gpt2-tiny", attention_impl="flash")
  with pytest.raises(ValueError, match=r"attention_impl='cudnn' computes in bfloat16.*'float32'"):
    tiny("gpt2-tiny", attention_impl="cudnn")  # cuDNN's fused attention has no float32 kernel
  from transformer_jax.train.config import load_experiment

  path = pathlib.Path(__file__).parents[2] / "experiments" / "gpt_tiny.yaml"
  exp = load_experiment(str(path), ["model.attention_impl=chunked"])
  assert exp.model_config().attention_impl == "chunked"
