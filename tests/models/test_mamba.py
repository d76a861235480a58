"""Mamba-1, Mamba-2 and hybrid models: exact preset counts, config validation, logical axes, the
hybrid's layer order, padding, packing, causality, scan == unroll, remat and LoRA targets."""

import dataclasses
import functools

import jax
import jax.numpy as jnp
import numpy as np
import pytest
import yaml
from flax import nnx

from transformer_jax import lora, models
from tests.models.conftest import compiled
from transformer_jax.parallel import rules

VOCAB = 97
NAMES = ["mamba-tiny", "mamba2-tiny", "hybrid-tiny"]


@functools.lru_cache(maxsize=None)
def config(name, **overrides):
  # A wide initialisation: logits differ by O(1), so a wrong mask or state shows far above 1e-5.
  return models.get_config(name, vocab_size=VOCAB, init_std=0.3, **overrides)


@functools.lru_cache(maxsize=None)
def model(name, **overrides):
  return models.create(config(name, **overrides))


@functools.lru_cache(maxsize=None)
def jitted(name, **overrides):
  """``(tokens, **kw) -> logits`` compiled once per model."""
  graphdef, params = nnx.split(model(name, **overrides))
  run = jax.jit(lambda params, tokens, **kw: nnx.merge(graphdef, params)(tokens, **kw))
  return lambda tokens, **kw: run(params, jnp.asarray(tokens), **kw)


def tokens(seed, b, t):
  return np.random.default_rng(seed).integers(0, VOCAB, (b, t)).astype(np.int32)


def test_preset_counts_are_exact():
  assert models.count_params(models.get_config("mamba-130m")) == 129_135_360
  assert models.count_params(models.get_config("mamba-2.8b")) == 2_768_345_600
  assert models.count_params(models.get_config("mamba-codestral-7b")) == 7_285_403_648
  codestral = models.get_config("mamba-codestral-7b")
  assert (
    codestral.d_model,
    codestral.num_layers,
    codestral.ssm_heads,
    codestral.ssm_head_dim,
    codestral.d_state,
    codestral.ssm_groups,
    codestral.vocab_size,
  ) == (4096, 64, 128, 64, 128, 8, 32768)


@pytest.mark.parametrize(
  "overrides",
  [
    dict(mixer="mamba2", ssm_head_dim=16, ssm_groups=4, use_bias=True, conv_bias=False),
    dict(dt_rank=3, tie_embeddings=False, use_bias=True),
    dict(layer_types=["attention", "mamba"], num_layers=2, d_ff=32, position="rope"),
  ],
)
def test_count_params_equals_the_instantiated_model(overrides):
  c = models.get_config("mamba-tiny", **overrides)
  state = nnx.state(models.abstract(c), nnx.Param)
  assert models.count_params(c) == sum(x.size for x in jax.tree.leaves(state))


@pytest.mark.parametrize(
  "field,value,message",
  [
    ("mixer", "mamba3", "mixer='mamba3' must be one of"),
    ("d_state", 0, "d_state=0 must be a positive integer"),
    ("ssm_head_dim", 48, "ssm_head_dim=48 does not divide d_inner"),
    ("time_step_limit", (0.5, 0.1), r"time_step_limit=\(0.5, 0.1\) must have 0 <= low <= high"),
    ("time_step_min", "fast", "time_step_min='fast' must be a number"),
    ("layer_types", ("mamba", "mlp"), "layer_types: 'mlp' must be 'mamba' or 'attention'"),
    ("layer_types", ("mamba",), "layer_types has 1 entries for num_layers=2"),
    ("d_ff", -1, "d_ff=-1 must be an integer >= 0"),
    ("position", "learned", "position='learned' must be one of"),
  ],
)
def test_config_errors_name_the_field_and_value(field, value, message):
  overrides = {field: value}
  if field == "ssm_head_dim":
    overrides["mixer"] = "mamba2"
  with pytest.raises(ValueError, match=message):
    models.get_config("mamba-tiny", **overrides)
  with pytest.raises(ValueError, match="MambaConfig has no field"):
    models.get_config("mamba-tiny", d_sate=8)


def test_yaml_exponent_floats_lists_and_the_round_trip():
  spec = yaml.safe_load("""
    family: mamba
    vocab_size: 64
    d_model: 32
    num_layers: 2
    time_step_min: 1e-3
    time_step_floor: 5e-5
    norm_eps: 1e-6
    time_step_limit: [0.0, .inf]
    layer_types: [mamba, attention]
  """)
  assert spec["time_step_min"] == "1e-3"  # YAML 1.1 reads it as a string
  c = models.config_from_dict(spec)
  assert c.time_step_min == 1e-3 and c.time_step_floor == 5e-5 and c.norm_eps == 1e-6
  assert c.layer_types == ("mamba", "attention") and c.time_step_limit == (0.0, float("inf"))
  hash(c)  # static argument of jit
  back = models.config_from_dict(yaml.safe_load(yaml.safe_dump(models.config_to_dict(c))))
  assert back == c


@pytest.mark.parametrize("name", NAMES + ["mamba-codestral-7b"])
def test_every_parameter_names_its_logical_axes(name):
  state = nnx.state(models.abstract(models.get_config(name)), nnx.Param)
  specs = rules.logical_specs(state)
  known = dict(rules.RULES)
  for (path, spec), leaf in zip(nnx.to_flat_state(specs), jax.tree.leaves(state)):
    assert len(tuple(spec)) == leaf.ndim, path
    assert all(a in known for a in spec), (path, spec)


def test_mamba1_channels_split_over_tensor_like_an_mlp():
  state = nnx.state(models.abstract(models.get_config("mamba-tiny")), nnx.Param)
  flat = {".".join(map(str, p)): tuple(s) for p, s in nnx.to_flat_state(rules.logical_specs(state))}
  assert rules.mesh_axes(flat["blocks.mamba.mixer.in_proj.kernel"]) == jax.sharding.PartitionSpec(
    None, "fsdp", None, "tensor"
  )
  assert rules.mesh_axes(flat["blocks.mamba.mixer.out_proj.kernel"]) == (
    jax.sharding.PartitionSpec(None, "tensor", "fsdp")
  )


def test_a_hybrid_preset_at_another_depth_repeats_its_mixers():
  config = models.get_config("hybrid-tiny", num_layers=5)
  assert config.layer_types == ("mamba", "attention", "mamba", "attention", "mamba")


@pytest.mark.slow
def test_hybrid_layers_follow_layer_types():
  c = config("hybrid-tiny")
  m = model("hybrid-tiny")
  assert (
    m.blocks.mamba.mixer.A_log.shape[0] == 2 and m.blocks.attention.mixer.query.kernel.shape[0] == 1
  )
  toks = tokens(0, 2, 10)
  # The same parameters in another order compute another function.
  swapped = dataclasses.replace(c, layer_types=("mamba", "mamba", "attention"))
  state = nnx.state(m)
  other = jax.jit(lambda s, t: nnx.merge(models.graphdef(swapped), s)(t))(state, toks)
  assert not np.allclose(jitted("hybrid-tiny")(toks), other, atol=1e-3)

  @jax.jit
  def by_hand(state, toks):  # the blocks one by one: mamba 0, attention 0, mamba 1
    m = nnx.merge(models.graphdef(c), state)
    x = m.embed(toks)
    for stacked, j in ((m.blocks.mamba, 0), (m.blocks.attention, 0), (m.blocks.mamba, 1)):
      graphdef, params = nnx.split(stacked)
      x = nnx.merge(graphdef, jax.tree.map(lambda a: a[j], params))(x)[0]
    return m.logits(m.final_norm(x))

  np.testing.assert_allclose(
    by_hand(state, toks), jitted("hybrid-tiny")(toks), rtol=1e-5, atol=1e-5
  )


@pytest.mark.slow
@pytest.mark.parametrize("name", NAMES)
def test_padding_never_changes_a_rows_logits(name):
  """Rows of lengths 12, 5 and 8, right- and left-padded with other tokens, give each row's logits
  as that row alone."""
  toks = tokens(1, 3, 12)
  lengths = [12, 5, 8]
  alone = [np.asarray(jitted(name)(toks[r : r + 1, :n]))[0] for r, n in enumerate(lengths)]
  for side in ("right", "left"):
    padded = tokens(2, 3, 12)
    mask = np.zeros((3, 12), bool)
    for r, n in enumerate(lengths):
      cols = slice(0, n) if side == "right" else slice(12 - n, 12)
      padded[r, cols] = toks[r, :n]
      mask[r, cols] = True
    got = np.asarray(jitted(name)(padded, attention_mask=mask))
    for r, n in enumerate(lengths):
      np.testing.assert_allclose(
        got[r][mask[r]], alone[r], rtol=0, atol=1e-4, err_msg=f"{side} row {r}"
      )


@pytest.mark.parametrize("name", NAMES)
def test_packed_documents_equal_separate_runs(name):
  toks = tokens(3, 1, 14)
  seg = np.array([[1] * 5 + [2] * 9], np.int32)
  got = np.asarray(jitted(name)(toks, segment_ids=seg))
  # float32 logits of O(1), computed in other shapes: 1e-4 (the transformers parity tolerance).
  np.testing.assert_allclose(got[0, :5], jitted(name)(toks[:, :5])[0], rtol=0, atol=1e-4)
  np.testing.assert_allclose(got[0, 5:], jitted(name)(toks[:, 5:])[0], rtol=0, atol=1e-4)


@pytest.mark.parametrize("name", NAMES)
def test_changing_a_later_token_leaves_earlier_logits_unchanged(name):
  toks = tokens(4, 1, 11)
  changed = toks.copy()
  changed[0, 7] = (changed[0, 7] + 1) % VOCAB
  a, b = np.asarray(jitted(name)(toks)), np.asarray(jitted(name)(changed))
  np.testing.assert_array_equal(a[0, :7], b[0, :7])
  assert not np.allclose(a[0, 7:], b[0, 7:])


@pytest.mark.slow
@pytest.mark.parametrize(
  "name,other", [("mamba-tiny", dict(scan_layers=False)), ("mamba2-tiny", dict(remat="full"))]
)
def test_scanned_stack_equals_unrolled_stack_and_remat_gives_the_same_gradients(name, other):
  toks = jnp.asarray(tokens(5, 2, 9))

  def loss(c):
    graphdef, params = nnx.split(models.create(c))
    f = lambda p: jnp.mean(nnx.merge(graphdef, p)(toks) ** 2)  # noqa: E731
    return jax.jit(jax.value_and_grad(f))(params)

  base = loss(config(name, scan_layers=True))
  v, g = loss(config(name, **other))
  np.testing.assert_allclose(v, base[0], rtol=1e-5)
  for a, b in zip(jax.tree.leaves(g), jax.tree.leaves(base[1])):
    assert np.abs(a - b).max() <= 1e-4 * np.abs(b).max()


@pytest.mark.slow
def test_lora_targets_the_mixers_projections():
  cfg = lora.LoRAConfig(rank=2, alpha=4.0, targets=("ssm_in", "ssm_x", "ssm_dt", "ssm_out"))
  c = config("mamba-tiny")
  adapted = lora.create(c, cfg, jax.random.key(0))
  paths = {
    ".".join(map(str, p[:-2])) for p, _ in nnx.to_flat_state(nnx.state(adapted, nnx.LoRAParam))
  }
  assert {
    f"blocks.mamba.mixer.{n}.lora" for n in ("in_proj", "x_proj", "dt_proj", "out_proj")
  } == paths
  toks = tokens(6, 2, 8)
  before = np.asarray(adapted(toks))
  lora.merge(adapted)  # B = 0: the adapters add exactly nothing
  np.testing.assert_array_equal(before, adapted(toks))


@pytest.mark.parametrize(
  "overrides",
  [
    dict(ssm_chunk=1, d_conv=1, ssm_scan="associative", time_step_min=1.0, time_step_max=100.0),
    dict(mixer="mamba2", ssm_head_dim=16, ssm_chunk=64, time_step_limit=(0.0, 1e-4)),
    dict(
      mixer="mamba2",
      ssm_head_dim=32,
      time_step_min=1.0,
      time_step_max=10.0,
      time_step_limit=(0.5, 1e3),
    ),
  ],
  ids=["chunk1-conv1-huge-dt", "mamba2-tiny-dt", "mamba2-huge-dt"],
)
@pytest.mark.slow
def test_logits_and_states_are_finite_at_the_edges_of_the_config(overrides):
  """Chunks of 1 or 64 positions, a 1-tap convolution, time steps near 0 or in the hundreds
  (every decay underflows to 0): finite logits over 1 to 4 chunks and a finite decoding state."""
  from transformer_jax import generate

  c = config("mamba-tiny", **overrides)
  m = models.create(c)
  forward = compiled(m)
  for t in sorted({1, 4 * c.ssm_chunk + 1}):
    assert np.all(np.isfinite(np.asarray(forward(tokens(7, 2, t))))), t
  logits, cache = generate.extend(m, jnp.asarray(tokens(8, 2, 9)), generate.init_cache(c, 2, 16))
  assert np.all(np.isfinite(np.asarray(logits)))
  assert all(np.all(np.isfinite(np.asarray(x))) for x in jax.tree.leaves(cache))


def test_bad_ids_and_a_cache_with_masks_are_refused_by_name():
  m = model("mamba-tiny")
  with pytest.raises(ValueError, match=r"tokens\[0, 2\] = 97 is outside the vocabulary"):
    m(np.array([[1, 2, VOCAB]]))
  with pytest.raises(ValueError, match=r"attention_mask.shape=\(1, 2\) must equal"):
    m(np.array([[1, 2, 3]]), attention_mask=np.ones((1, 2), bool))
  from transformer_jax import generate

  cache = generate.init_cache(config("mamba-tiny"), 1, 8)
  with pytest.raises(ValueError, match="with a cache, positions/segment_ids/attention_mask"):
    m(np.array([[1, 2]]), segment_ids=np.zeros((1, 2), np.int32), cache=cache)
