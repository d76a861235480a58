"""Mamba and Mamba-2 against transformers' PyTorch path (random weights): logits within 1e-4
(prompts longer than one chunk, ragged batches padded left and right), greedy continuations of 48
tokens equal to ``generate``, ``hf.save`` reloaded by transformers, and ``tjax convert`` round
trips."""

import functools
import re

import jax
import numpy as np
import pytest
import torch
import transformers
from flax import nnx

import transformer_jax as tj
from transformer_jax import generate, models
import transformer_jax.hf as tjhf
from transformer_jax.hf import convert
from transformer_jax.hf.errors import UnsupportedError

TOL = 1e-4

# Odd shapes: dt rank 6 (not ceil(D / 16)), a 3-tap convolution, grouped B/C, chunks of 5 and 4
# positions (the prompts are 21 long), a clamped time step, biases, tied and untied heads.
CASES = {
  "mamba1-tied": (
    "MambaForCausalLM",
    dict(
      vocab_size=131,
      hidden_size=48,
      num_hidden_layers=2,
      state_size=8,
      expand=2,
      conv_kernel=4,
      time_step_rank=6,
    ),
  ),
  "mamba1-bias-untied": (
    "MambaForCausalLM",
    dict(
      vocab_size=120,
      hidden_size=32,
      num_hidden_layers=3,
      state_size=4,
      expand=3,
      conv_kernel=3,
      use_bias=True,
      tie_word_embeddings=False,
      layer_norm_epsilon=1e-6,
    ),
  ),
  "mamba2-groups": (
    "Mamba2ForCausalLM",
    dict(
      vocab_size=140,
      hidden_size=32,
      num_hidden_layers=2,
      state_size=8,
      expand=2,
      num_heads=8,
      head_dim=8,
      n_groups=2,
      chunk_size=5,
      tie_word_embeddings=False,
    ),
  ),
  "mamba2-limit-tied-bias": (
    "Mamba2ForCausalLM",
    dict(
      vocab_size=100,
      hidden_size=24,
      num_hidden_layers=2,
      state_size=6,
      expand=2,
      num_heads=4,
      head_dim=12,
      n_groups=1,
      chunk_size=4,
      time_step_limit=(0.05, 0.6),
      use_bias=True,
      tie_word_embeddings=True,
    ),
  ),
}


@functools.lru_cache(maxsize=None)
def build(name: str, seed: int = 0, noise: float = 0.05):
  """The random-weight transformers model of case ``name`` (eval, float32), every parameter
  perturbed (matrices by ``noise``) so norm scales, biases and D are not their initial constants."""
  arch, kw = CASES[name]
  torch.manual_seed(seed)
  config = getattr(transformers, arch.replace("ForCausalLM", "Config"))(**kw)
  config.architectures = [arch]
  model = getattr(transformers, arch)(config).float().eval()
  with torch.no_grad():
    for _, p in model.named_parameters():
      p.add_(torch.randn_like(p) * (0.1 if p.ndim == 1 else noise))
  return model


def hf_logits(model, ids, mask=None):
  with torch.no_grad():
    out = model(
      input_ids=torch.as_tensor(ids), attention_mask=None if mask is None else torch.as_tensor(mask)
    )
  return out.logits.float().numpy()


def ragged(vocab, *, left, b=3, t=21, seed=0):
  """Ids ``[b, t]`` and a 0/1 mask: row 0 full, the others 6 and 13 tokens long."""
  rng = np.random.default_rng(seed)
  ids = rng.integers(0, vocab, (b, t)).astype(np.int64)
  mask = np.zeros((b, t), np.int64)
  for r, n in enumerate([t, 6, 13][:b]):
    if left:
      mask[r, t - n :] = 1
    else:
      mask[r, :n] = 1
  return ids, mask


@pytest.mark.parametrize("name", list(CASES))
def test_logits_match_transformers_loaded_from_directory(name, tmp_path):
  """A ragged batch (rows of 21, 6 and 13 tokens, padded on either side): every real position's
  logits equal transformers' on that row alone; right-padded, also transformers' on the batch.
  (transformers' own left-padded batch differs from its rows alone when ``in_proj`` has a bias:
  the padding's projection, the bias, enters its convolution.)"""
  hf_model = build(name)
  hf_model.save_pretrained(tmp_path)
  config, model = tjhf.load(tmp_path)
  run = jax.jit(lambda st, ids, mask: nnx.merge(nnx.graphdef(model), st)(ids, attention_mask=mask))
  state = nnx.state(model)
  for left in (False, True):
    ids, mask = ragged(hf_model.config.vocab_size, left=left)
    valid = mask.astype(bool)
    ours = np.asarray(run(state, ids, valid))
    for r in range(ids.shape[0]):
      alone = hf_logits(hf_model, ids[r : r + 1, valid[r]])[0]
      diff = np.abs(ours[r, valid[r]] - alone).max()
      assert diff <= TOL, (name, left, r, diff)
    if not left:
      diff = np.abs(ours[valid] - hf_logits(hf_model, ids, mask)[valid]).max()
      assert diff <= TOL, (name, "batch", diff)


def test_config_translation_reads_every_field():
  cfg, _ = tjhf.load(build("mamba1-tied"))
  assert (cfg.mixer, cfg.d_model, cfg.d_state, cfg.d_conv, cfg.expand, cfg.time_step_rank) == (
    "mamba1",
    48,
    8,
    4,
    2,
    6,
  )
  assert cfg.tie_embeddings and not cfg.use_bias and cfg.residual_in_fp32
  cfg, _ = tjhf.load(build("mamba1-bias-untied"))
  assert (cfg.d_conv, cfg.expand, cfg.norm_eps, cfg.dt_rank) == (3, 3, 1e-6, None)
  assert cfg.use_bias and not cfg.tie_embeddings
  cfg, _ = tjhf.load(build("mamba2-limit-tied-bias"))
  assert (cfg.mixer, cfg.ssm_heads, cfg.ssm_head_dim, cfg.ssm_groups, cfg.ssm_chunk) == (
    "mamba2",
    4,
    12,
    1,
    4,
  )
  assert cfg.time_step_limit == (0.05, 0.6) and cfg.tie_embeddings and cfg.use_bias


@pytest.mark.parametrize("name", ["mamba1-tied", "mamba2-groups"])
def test_greedy_48_tokens_equal_transformers_generate(name):
  """A batch of two prompts (9 and 5 tokens; transformers pads on the left) continued greedily by
  48 tokens: the same tokens as transformers' ``generate``. (Matrices perturbed by 0.2, so the
  continuations vary: at 0.05 Mamba-1's repeat one token.)"""
  hf_model = build(name, noise=0.2)
  _, model = tjhf.load(hf_model)
  rng = np.random.default_rng(5)
  prompts = [rng.integers(1, hf_model.config.vocab_size, n).tolist() for n in (9, 5)]
  ids = np.zeros((2, 9), np.int64)
  mask = np.zeros((2, 9), np.int64)
  for r, p in enumerate(prompts):
    ids[r, 9 - len(p) :] = p
    mask[r, 9 - len(p) :] = 1
  hf_model.generation_config.eos_token_id = None
  with torch.no_grad():
    theirs = hf_model.generate(
      input_ids=torch.as_tensor(ids),
      attention_mask=torch.as_tensor(mask),
      max_new_tokens=48,
      do_sample=False,
      pad_token_id=0,
    ).numpy()[:, 9:]
  ours = np.asarray(generate.generate(model, prompts, max_new_tokens=48))
  assert theirs.shape == (2, 48) and all(len(set(row)) > 10 for row in theirs.tolist())
  np.testing.assert_array_equal(ours, theirs)


@pytest.mark.parametrize(
  "preset,overrides,arch",
  [
    ("mamba-tiny", dict(dt_rank=3), "MambaForCausalLM"),
    ("mamba2-tiny", dict(use_bias=True), "Mamba2ForCausalLM"),
  ],
)
def test_ours_saved_loads_in_transformers_with_same_logits(preset, overrides, arch, tmp_path):
  config = tj.models.get_config(preset, init_std=0.2, **overrides)
  model = tj.models.create(config, rngs=nnx.Rngs(3))
  assert tjhf.save(model, config, tmp_path) == arch
  hf_model, info = getattr(transformers, arch).from_pretrained(tmp_path, output_loading_info=True)
  assert not info["missing_keys"] and not info["unexpected_keys"] and not info["mismatched_keys"]
  ids, mask = ragged(config.vocab_size, left=True, t=19)
  ours = np.asarray(model(ids, attention_mask=mask.astype(bool)))
  theirs = hf_logits(hf_model.float().eval(), ids, mask)
  assert np.abs(ours[mask == 1] - theirs[mask == 1]).max() <= TOL
  _, model2 = tjhf.load(tmp_path)
  jax.tree.map(
    np.testing.assert_array_equal,
    nnx.state(model, nnx.Param).to_pure_dict(),
    nnx.state(model2, nnx.Param).to_pure_dict(),
  )


@pytest.mark.parametrize("name", list(CASES))
def test_hf_load_save_gives_identical_tensors(name, tmp_path):
  arch = CASES[name][0]
  hf_model = build(name)
  config, model = tjhf.load(hf_model)
  tjhf.save(model, config, tmp_path / "hf", architecture=arch)
  again = getattr(transformers, arch).from_pretrained(tmp_path / "hf").float()
  before, after = hf_model.state_dict(), again.state_dict()
  assert sorted(before) == sorted(after)
  for k in before:
    assert torch.equal(before[k], after[k]), k


def test_convert_round_trip_through_a_run_directory(tmp_path):
  hf_model = build("mamba2-groups")
  hf_model.save_pretrained(tmp_path / "hf")
  assert convert.from_hf(tmp_path / "hf", tmp_path / "run") == "Mamba2ForCausalLM"
  assert convert.to_hf(tmp_path / "run", tmp_path / "back") == "Mamba2ForCausalLM"
  again = transformers.Mamba2ForCausalLM.from_pretrained(tmp_path / "back").float()
  for k, v in hf_model.state_dict().items():
    assert torch.equal(v, again.state_dict()[k]), k


def test_what_transformers_cannot_express_is_refused_by_name(tmp_path):
  hybrid = tj.models.get_config("hybrid-tiny")
  with pytest.raises(UnsupportedError, match="layer_types"):
    tjhf.save(tj.models.create(hybrid), hybrid, tmp_path / "a")
  mamba2 = tj.models.get_config("mamba2-tiny")
  with pytest.raises(UnsupportedError, match="mixer='mamba2'"):
    tjhf.save(tj.models.create(mamba2), mamba2, tmp_path / "b", architecture="MambaForCausalLM")


@pytest.mark.parametrize(
  "arch, changes, named",
  [
    ("MambaForCausalLM", {"state_size": 4.7}, "state_size=4.7: expected an integer"),
    ("MambaForCausalLM", {"use_conv_bias": 1}, "use_conv_bias=1: expected true or false"),
    ("MambaForCausalLM", {"time_step_rank": "four"}, "time_step_rank='four': expected an integer"),
    ("Mamba2ForCausalLM", {"n_groups": "2"}, "n_groups='2': expected an integer"),
    ("Mamba2ForCausalLM", {"time_step_limit": [0.0]}, "time_step_limit=[0.0]: expected a pair"),
    (
      "Mamba2ForCausalLM",
      {"time_step_limit": [0.0, "x"]},
      "time_step_limit[1]='x': expected a number",
    ),
  ],
)
def test_mamba_config_fields_are_read_by_type(arch, changes, named):
  from transformer_jax.hf import configs

  base = {
    "hidden_size": 16,
    "num_hidden_layers": 2,
    "vocab_size": 32,
    "state_size": 4,
    "expand": 2,
    "num_heads": 4,
    "head_dim": 8,
    "n_groups": 1,
  }
  with pytest.raises(tjhf.CheckpointError, match=re.escape(named)):
    configs.from_hf({**base, **changes}, arch)


def test_mamba2_open_time_step_limit_survives_a_run_directory(tmp_path):
  from transformer_jax import runs

  config = models.get_config("mamba2-tiny")
  assert config.time_step_limit[1] == float("inf")
  params = models.init(config, jax.random.key(0))
  runs.save_model(tmp_path / "run", config, params)
  back, _ = runs.load_model(tmp_path / "run")
  assert back.time_step_limit == config.time_step_limit
