"""Gemma 2 / 3 presets and fields: parameter counts equal to transformers' models (on the meta
device, from the published config values written out here), the local/global stack scanned ==
unrolled (forward and gradients), the global layers seeing past the window, the output soft-cap
in the loss, and malformed fields refused by name."""

import dataclasses

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from flax import nnx

from transformer_jax import models, ops
from transformer_jax.cli.info import info_text

# The published config.json values (google/gemma-2-2b, gemma-2-9b, gemma-3-1b-pt, and the text
# config of gemma-3-4b-pt), by hand.
PUBLISHED = {
  "gemma2-2b": (
    "Gemma2",
    dict(
      vocab_size=256000,
      hidden_size=2304,
      intermediate_size=9216,
      num_hidden_layers=26,
      num_attention_heads=8,
      num_key_value_heads=4,
      head_dim=256,
    ),
  ),
  "gemma2-9b": (
    "Gemma2",
    dict(
      vocab_size=256000,
      hidden_size=3584,
      intermediate_size=14336,
      num_hidden_layers=42,
      num_attention_heads=16,
      num_key_value_heads=8,
      head_dim=256,
    ),
  ),
  "gemma3-1b": (
    "Gemma3",
    dict(
      vocab_size=262144,
      hidden_size=1152,
      intermediate_size=6912,
      num_hidden_layers=26,
      num_attention_heads=4,
      num_key_value_heads=1,
      head_dim=256,
      sliding_window=512,
    ),
  ),
  "gemma3-4b": (
    "Gemma3",
    dict(
      vocab_size=262208,
      hidden_size=2560,
      intermediate_size=10240,
      num_hidden_layers=34,
      num_attention_heads=8,
      num_key_value_heads=4,
      head_dim=256,
      sliding_window=1024,
      rope_scaling={"rope_type": "linear", "factor": 8.0},
    ),
  ),
}


@pytest.mark.parametrize("name", list(PUBLISHED))
def test_preset_counts_equal_transformers(name):
  torch = pytest.importorskip("torch")
  transformers = pytest.importorskip("transformers")
  family, kwargs = PUBLISHED[name]
  cfg_cls = transformers.Gemma2Config if family == "Gemma2" else transformers.Gemma3TextConfig
  arch = getattr(transformers, f"{family}ForCausalLM")
  with torch.device("meta"):
    hf_model = arch(cfg_cls(**kwargs))
  # Tied heads: parameters() lists the shared embedding once.
  theirs = sum(p.numel() for p in hf_model.parameters())
  assert models.count_params(models.get_config(name)) == theirs


@pytest.mark.parametrize("name", list(PUBLISHED))
@pytest.mark.parametrize("layers", [1, 3, 6, 7, 13])
def test_another_depth_keeps_the_layer_pattern_transformers_derives(name, layers):
  """``num_layers`` alone: the preset's sliding/full pattern over the new depth, as transformers
  derives ``layer_types`` from the same depth (no ``layer_types`` given either side)."""
  transformers = pytest.importorskip("transformers")
  family, kwargs = PUBLISHED[name]
  cfg_cls = transformers.Gemma2Config if family == "Gemma2" else transformers.Gemma3TextConfig
  theirs = cfg_cls(**{**kwargs, "num_hidden_layers": layers}).layer_types
  config = models.get_config(name, num_layers=layers)
  assert config.num_layers == layers and list(config.layer_types) == list(theirs)
  # Given explicitly, layer_types is taken as it is (and checked against the depth).
  with pytest.raises(ValueError, match=f"it needs one per layer \\(num_layers={layers + 1}\\)"):
    models.get_config(name, num_layers=layers + 1, layer_types=config.layer_types)


@pytest.mark.parametrize("name", [*PUBLISHED, "gemma2-tiny", "gemma3-tiny"])
def test_info_describes_gemma_presets(name):
  text = info_text(name)
  assert text.startswith(f"{name}: GPTConfig") and "parameters" in text


def test_tiny_preset_counts_equal_the_built_models():
  for name in ("gemma2-tiny", "gemma3-tiny"):
    c = models.get_config(name)
    model = nnx.eval_shape(lambda c=c: models.GPT(c, rngs=nnx.Rngs(0)))
    built = sum(x.size for x in jax.tree.leaves(nnx.state(model, nnx.Param)))
    assert models.count_params(c) == built


def _tiny(**kw):
  return models.get_config("gemma3-tiny", num_layers=4, vocab_size=61, max_len=48, **kw)


@pytest.fixture(scope="module")
def mixed():
  """gemma3-tiny with layers local, global, local, local and a window of 4: the scanned and the
  unrolled model share parameters."""
  types = ("sliding_attention", "full_attention", "sliding_attention", "sliding_attention")
  c = _tiny(layer_types=types, sliding_window=4, scan_layers=True)
  scanned = models.GPT(c, rngs=nnx.Rngs(0))
  params = nnx.state(scanned)
  # Norm scales away from 0 so that their (1 + w) and placement matter.
  params = jax.tree.map(lambda x: x + 0.1 * jnp.sin(jnp.arange(x.size).reshape(x.shape)), params)
  nnx.update(scanned, params)
  unrolled = nnx.merge(models.graphdef(dataclasses.replace(c, scan_layers=False)), params)
  return c, scanned, unrolled


def _tokens(c, t=13, seed=0):
  return jnp.asarray(np.random.default_rng(seed).integers(0, c.vocab_size, (2, t)))


def test_scanned_mixed_stack_equals_unrolled_with_gradients(mixed):
  c, scanned, unrolled = mixed
  assert not scanned.blocks.unroll and unrolled.blocks.unroll
  tok = _tokens(c)

  def loss(model):
    return jnp.sum(model(tok) ** 2) / tok.size

  ls, gs = nnx.jit(nnx.value_and_grad(loss))(scanned)
  lu, gu = nnx.jit(nnx.value_and_grad(loss))(unrolled)
  # The same operations compiled apart: float32 rounding only, ~100 ulps of each array's largest
  # entry (entries much smaller than it carry the same absolute rounding).
  np.testing.assert_allclose(ls, lu, rtol=1e-5)
  for a, b in zip(jax.tree.leaves(gs), jax.tree.leaves(gu)):
    assert float(jnp.abs(a - b).max()) <= 1e-5 * float(jnp.abs(b).max())


def test_only_the_global_layer_sees_past_the_window(mixed):
  """Changing token 0 changes the output at position 15 through the one global layer; with that
  layer made local too it cannot (4 layers with a window of 4 reach back 4 * 3 = 12 positions)."""
  c, scanned, _ = mixed
  a = _tokens(c, t=16)
  b = a.at[:, 0].set((a[:, 0] + 1) % c.vocab_size)
  assert float(jnp.abs(scanned(a)[:, 15] - scanned(b)[:, 15]).max()) > 1e-4
  local = dataclasses.replace(c, layer_types=("sliding_attention",) * 4)
  all_local = nnx.merge(models.graphdef(local), nnx.state(scanned))
  np.testing.assert_array_equal(np.asarray(all_local(a)[:, 15]), np.asarray(all_local(b)[:, 15]))


def test_final_softcap_bounds_logits_and_reaches_the_loss():
  c = models.get_config("gemma2-tiny", final_softcap=0.5, vocab_size=61, max_len=48)
  model = models.GPT(c, rngs=nnx.Rngs(1))
  tok = _tokens(c, t=9)
  logits = model(tok)
  assert float(jnp.abs(logits).max()) < 0.5
  labels, weights = jnp.roll(tok, -1, axis=1), jnp.ones(tok.shape).at[:, -1].set(0.0)
  loss_sum, correct = model.lm_loss(tok, labels, weights)
  mean, count = ops.cross_entropy(logits, labels, mask=weights)
  np.testing.assert_allclose(loss_sum, mean * count, rtol=1e-6)
  hits = (jnp.argmax(logits, -1) == labels) * weights
  assert float(correct) == float(hits.sum())


@pytest.mark.parametrize(
  "field, value, match",
  [
    ("norm_offset", "1", "norm_offset='1'"),
    ("attn_softcap", 0.0, "attn_softcap=0.0"),
    ("final_softcap", -1.0, "final_softcap=-1.0"),
    ("query_pre_attn_scalar", 0, "query_pre_attn_scalar=0"),
    ("post_norms", 1, "post_norms=1"),
    ("embed_scale", "yes", "embed_scale='yes'"),
    ("layer_types", ("full_attention",), "layer_types has 1 entries"),
    ("layer_types", ("global",) * 6, r"layer_types\[0\]='global'"),
    ("sliding_window", None, "set sliding_window"),
  ],
)
def test_malformed_gemma_fields_are_refused_by_name(field, value, match):
  with pytest.raises(ValueError, match=match):
    models.get_config("gemma3-tiny", **{field: value})


def test_offset_needs_rmsnorm_and_local_theta_needs_layer_types():
  with pytest.raises(ValueError, match="norm_offset=1.0 needs norm='rmsnorm'"):
    models.get_config("gemma2-tiny", norm="layernorm")
  with pytest.raises(ValueError, match="rope_local_theta=10000.0 needs layer_types"):
    models.get_config("gemma3-tiny", layer_types=None)


def test_dry_run_lists_each_layer_window_and_no_fused_kernel_under_softcap():
  from transformer_jax.train import dry_run

  c = models.get_config("gemma2-tiny", dtype="bfloat16")
  rows = dry_run.attention_kernels(c, {"data": 1}, 8, 256, packed=False)
  assert [r["attention"] for r in rows] == [
    "self-attention (window None)",
    "self-attention (window 16)",
  ]
  for r in rows:
    assert r["kernels"]["gpu"] == "xla" and r["kernels"]["tpu"] == "xla"
  # Without the soft-cap the same shapes go to cuDNN on a GPU.
  plain = dry_run.attention_kernels(
    dataclasses.replace(c, attn_softcap=None), {"data": 1}, 8, 256, packed=False
  )
  assert plain[0]["kernels"]["gpu"] == "cudnn"
