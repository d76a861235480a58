"""The decoder fields Qwen needs: biases per projection group and ``qk_norm`` (per-head norm of
queries and keys before RoPE), against a float64 NumPy reference, counted exactly, and refused
by name when malformed."""

import itertools
import re

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from flax import nnx

from transformer_jax import models
from transformer_jax.layers import Attention
from tests.conftest import FORCED_IMPL

# head_dim 12 is neither d_model // num_heads (4) nor a power of two; GQA with G = 3.
D, N, K, H, THETA, EPS = 16, 6, 2, 12, 500.0, 1e-6


def _f64(a):
  return np.asarray(a, np.float64)


def _rms(x, scale):
  return x / np.sqrt(np.mean(x * x, axis=-1, keepdims=True) + EPS) * scale


def _rope(x_BTNH, positions):
  """LLaMA's rotate-half RoPE in float64."""
  half = x_BTNH.shape[-1] // 2
  freq = THETA ** (-np.arange(half, dtype=np.float64) * 2 / x_BTNH.shape[-1])
  angle = positions[:, None] * freq[None, :]  # [T, H/2]
  cos = np.concatenate([np.cos(angle)] * 2, -1)[None, :, None, :]
  sin = np.concatenate([np.sin(angle)] * 2, -1)[None, :, None, :]
  rotated = np.concatenate([-x_BTNH[..., half:], x_BTNH[..., :half]], -1)
  return x_BTNH * cos + rotated * sin


def _reference(attn, x):
  """Causal self-attention: biased q/k/v, RMSNorm over H of each head, RoPE, softmax, output."""
  x = _f64(x)
  q = np.einsum("btd,dnh->btnh", x, _f64(attn.query.kernel[...])) + _f64(attn.query.bias[...])
  k = np.einsum("bsd,dkh->bskh", x, _f64(attn.key.kernel[...])) + _f64(attn.key.bias[...])
  v = np.einsum("bsd,dkh->bskh", x, _f64(attn.value.kernel[...])) + _f64(attn.value.bias[...])
  q, k = _rms(q, _f64(attn.q_norm.scale[...])), _rms(k, _f64(attn.k_norm.scale[...]))
  t = x.shape[1]
  q, k = _rope(q, np.arange(t, dtype=np.float64)), _rope(k, np.arange(t, dtype=np.float64))
  k, v = np.repeat(k, N // K, axis=2), np.repeat(v, N // K, axis=2)
  logits = np.einsum("btnh,bsnh->bnts", q, k) / np.sqrt(H)
  logits = np.where(np.tril(np.ones((t, t), bool)), logits, -np.inf)
  w = np.exp(logits - logits.max(-1, keepdims=True))
  w = w / w.sum(-1, keepdims=True)
  return np.einsum("bnts,bsnh,nhd->btd", w, v, _f64(attn.out.kernel[...]))


@pytest.fixture(scope="module")
def qwen_attention():
  attn = Attention(
    D,
    N,
    K,
    H,
    use_bias=False,
    qkv_bias=True,
    qk_norm="rmsnorm",
    qk_norm_eps=EPS,
    rope_theta=THETA,
    init_std=0.3,
    out_init_std=0.3,
    dtype=jnp.float32,
    param_dtype=jnp.float32,
    rngs=nnx.Rngs(0),
    implementation=FORCED_IMPL,
  )
  # Biases and norm scales away from their zero/one init, so a misplaced one shows.
  keys = jax.random.split(jax.random.key(1), 5)
  for key, p in zip(keys, (attn.query.bias, attn.key.bias, attn.value.bias)):
    p[...] = jax.random.normal(key, p.shape)
  for key, p in zip(keys[3:], (attn.q_norm.scale, attn.k_norm.scale)):
    p[...] = 1.0 + 0.5 * jax.random.normal(key, p.shape)
  return attn


def test_qk_norm_and_qkv_bias_match_float64_reference(qwen_attention):
  attn = qwen_attention
  assert attn.out.bias is None and attn.q_norm.scale.shape == (H,)
  x = jax.random.normal(jax.random.key(2), (2, 9, D))
  out, _ = attn(x, causal=True)
  # float32 rounding: products of <= D + H terms of size ~1, relative 2^-24 each: well under 1e-5.
  np.testing.assert_allclose(np.asarray(out), _reference(attn, x), rtol=1e-5, atol=1e-5)


def test_qk_norm_is_applied_before_rope(qwen_attention):
  """The same layer with the norm applied after RoPE would differ: the norm's scale is not
  constant over H, so it does not commute with the rotation."""
  attn = qwen_attention
  x = jax.random.normal(jax.random.key(2), (1, 5, D))
  out, _ = attn(x, causal=True)
  xf = _f64(x)
  q = np.einsum("btd,dnh->btnh", xf, _f64(attn.query.kernel[...])) + _f64(attn.query.bias[...])
  pos = np.arange(5, dtype=np.float64)
  after = _rms(_rope(q, pos), _f64(attn.q_norm.scale[...]))
  before = _rope(_rms(q, _f64(attn.q_norm.scale[...])), pos)
  assert np.abs(after - before).max() > 1e-2
  np.testing.assert_allclose(np.asarray(out), _reference(attn, x), rtol=1e-5, atol=1e-5)


@pytest.mark.parametrize(
  "qkv,out,mlp,qk_norm,norm",
  [
    c
    for c in itertools.product(
      (None, True, False), (None, True, False), (None, True, False), (False, True), ("rmsnorm",)
    )
  ]
  + [(True, None, False, True, "layernorm"), (None, None, None, True, "layernorm")],
)
@pytest.mark.parametrize("use_bias", (False, True))
def test_count_params_equals_the_built_model(qkv, out, mlp, qk_norm, norm, use_bias):
  c = models.get_config(
    "llama-tiny",
    use_bias=use_bias,
    qkv_bias=qkv,
    out_bias=out,
    mlp_bias=mlp,
    qk_norm=qk_norm,
    norm=norm,
    head_dim=24,
    num_layers=1,
  )
  model = nnx.eval_shape(lambda: models.GPT(c, rngs=nnx.Rngs(0)))
  built = sum(x.size for x in jax.tree.leaves(nnx.state(model, nnx.Param)))
  assert models.count_params(c) == built
  attn = model.blocks.layers.attn
  assert (attn.query.bias is not None) == (use_bias if qkv is None else qkv)
  assert (attn.out.bias is not None) == (use_bias if out is None else out)
  assert (model.blocks.layers.mlp.up.bias is not None) == (use_bias if mlp is None else mlp)
  assert (attn.q_norm is not None) == qk_norm


def test_new_params_carry_logical_axes():
  c = models.get_config("llama-tiny", qkv_bias=True, qk_norm=True, num_layers=1)
  attn = nnx.eval_shape(lambda: models.GPT(c, rngs=nnx.Rngs(0))).blocks.layers.attn
  assert attn.q_norm.scale.out_sharding == ("layers", "head_dim")
  assert attn.k_norm.scale.out_sharding == ("layers", "head_dim")
  assert attn.query.bias.out_sharding == ("layers", "heads", "head_dim")
  assert attn.key.bias.out_sharding == ("layers", "kv_heads", "head_dim")


@pytest.mark.parametrize(
  "field,value",
  [("qkv_bias", 1), ("out_bias", "yes"), ("mlp_bias", 0.0), ("qk_norm", None), ("qk_norm", 1)],
)
def test_malformed_fields_are_refused_by_name(field, value):
  with pytest.raises(ValueError, match=f"{field}={value!r}"):
    models.get_config("llama-tiny", **{field: value})


def test_tjax_info_shows_a_qwen_presets_count_flops_and_memory():
  from tests.train.conftest import run_cli

  code, out, _ = run_cli("info", "qwen3-0.6b")
  c = models.get_config("qwen3-0.6b")
  assert code == 0 and re.search(rf"parameters +{models.count_params(c):,} ", out)
  # 6 N + 12 L T N_h H at T = 1024 with N the matmul parameters (tied: the embedding counts once,
  # as the head) and H = head_dim 128, not d_model / num_heads = 64.
  flops = models.train_flops_per_token(c, 1024)
  assert flops == 6 * models.count_params(c) + 12 * 28 * 1024 * 16 * 128
  assert re.search(rf"train FLOPs/token +{int(flops):,} ", out) and "memory estimate" in out
