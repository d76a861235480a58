"""LoRA: exact equality with the base at B = 0, gradients only into adapters (and a head),
merging, the sharding of adapters, and a resumed LoRA run equal to an uninterrupted one."""

import functools
import json
import os

import jax
import jax.numpy as jnp
import numpy as np
import optax
import pytest
import yaml
from flax import nnx

from transformer_jax import lora, models, parallel
from transformer_jax.train import load_experiment, tasks, train
from transformer_jax.train import step as step_lib

CONFIGS = {
  "gpt": models.get_config(
    "gpt2-tiny", vocab_size=64, d_model=32, num_layers=2, num_heads=4, d_ff=64, max_len=16
  ),
  "llama": models.get_config(
    "llama-tiny",
    vocab_size=64,
    d_model=32,
    num_layers=2,
    num_heads=4,
    num_kv_heads=2,
    d_ff=64,
    max_len=16,
  ),
  "qwen3": models.get_config(
    "qwen3-tiny",
    vocab_size=64,
    d_model=32,
    num_layers=2,
    num_heads=4,
    num_kv_heads=2,
    head_dim=12,
    d_ff=64,
    max_len=16,
  ),
  "bert": models.get_config(
    "bert-tiny",
    vocab_size=64,
    d_model=32,
    num_layers=2,
    num_heads=2,
    d_ff=64,
    max_len=16,
    dropout_rate=0.0,
    attention_dropout_rate=0.0,
    num_labels=3,
  ),
  "seq2seq": models.get_config(
    "t5-tiny",
    vocab_size=64,
    d_model=32,
    num_encoder_layers=1,
    num_decoder_layers=1,
    num_heads=2,
    d_ff=64,
    max_len=16,
  ),
}
ALL = lora.LoRAConfig(rank=4, alpha=8.0, targets=lora.TARGETS)
TOKENS = jnp.asarray(np.random.default_rng(0).integers(0, 64, (2, 8)), jnp.int32)
KEY = jax.random.key(0)


def _forward(model, name):
  if name == "bert":
    return model(TOKENS).mlm_logits
  if name == "seq2seq":
    return model(TOKENS, TOKENS)
  return model(TOKENS)


@functools.lru_cache(maxsize=None)
def _initializer(name, config):
  """``(graphdef, jitted key -> adapted state)``: one initialisation program per model and
  adapter config, shared by the tests that build it (each call of ``_adapted`` gets fresh
  arrays)."""
  graphdef = nnx.split(lora.abstract(CONFIGS[name], config))[0]
  return graphdef, jax.jit(lambda k: nnx.state(lora.create(CONFIGS[name], config, k)))


def _adapted(name, config=ALL):
  graphdef, init = _initializer(name, config)
  return nnx.merge(graphdef, init(KEY))


def _random_b(model, scale=0.05):
  """Gives every B a random value (fresh adapters have B = 0)."""
  rng = np.random.default_rng(1)
  for _, m in nnx.iter_modules(model):
    if isinstance(m, nnx.LoRA):
      m.lora_b[...] = jnp.asarray(rng.normal(0, scale, m.lora_b.shape), jnp.float32)
  return model


@pytest.mark.parametrize("name", list(CONFIGS))
def test_zero_b_equals_the_base_model_exactly(name):
  # The adapter adds an exact zero. In BERT (post-norm) alone, XLA on CPU lays out the attention
  # output [B, T, N, H] differently once the out projection's adapter reads it too, and the
  # projection's (N, H) contraction then sums in another order: equal to 1e-7, not bitwise.
  # That target is checked to that tolerance below; every other one bitwise.
  targets = tuple(t for t in lora.TARGETS if name != "bert" or t != "out")
  adapted = _adapted(name, lora.LoRAConfig(rank=4, alpha=8.0, targets=targets))
  # The same weights without the adapters, in the plain model.
  _, _, weights = nnx.split(adapted, nnx.LoRAParam, nnx.Param)
  base = nnx.merge(models.graphdef(CONFIGS[name]), weights)
  assert lora.has_adapters(adapted) and not lora.has_adapters(base)
  np.testing.assert_array_equal(
    np.asarray(_forward(base, name)), np.asarray(_forward(adapted, name))
  )


def test_zero_b_bert_out_projection_to_float_rounding():
  adapted = _adapted("bert")
  _, _, weights = nnx.split(adapted, nnx.LoRAParam, nnx.Param)
  base = nnx.merge(models.graphdef(CONFIGS["bert"]), weights)
  np.testing.assert_allclose(
    np.asarray(_forward(base, "bert")), np.asarray(_forward(adapted, "bert")), rtol=0, atol=2e-7
  )


@pytest.mark.parametrize("name", ["gpt", "llama", "qwen3", "seq2seq"])
def test_merge_equals_the_unmerged_forward(name):
  model = _random_b(_adapted(name))
  before = np.asarray(_forward(model, name))
  assert np.abs(before - np.asarray(_forward(_adapted(name), name))).max() > 1e-4  # B matters
  # The folded kernel, checked against float64 NumPy for one stacked query kernel.
  proj = model.decoder.layers.attn.query if name == "seq2seq" else model.blocks.layers.attn.query
  w = np.asarray(proj.kernel[...], np.float64)
  a = np.asarray(proj.lora.lora.lora_a[...], np.float64)
  b = np.asarray(proj.lora.lora.lora_b[...], np.float64)
  want = w + (ALL.alpha / ALL.rank) * np.matmul(a, b).reshape(w.shape)
  lora.merge(model)
  assert not lora.has_adapters(model)
  np.testing.assert_allclose(np.asarray(proj.kernel[...]), want, rtol=1e-6, atol=1e-7)
  np.testing.assert_allclose(np.asarray(_forward(model, name)), before, rtol=1e-5, atol=1e-5)

  # The merged model is the base architecture: same parameter paths and shapes.
  def shapes(s):
    return jax.tree.map(lambda x: tuple(x.shape), nnx.to_pure_dict(s))

  assert shapes(nnx.state(model, nnx.Param)) == shapes(models.init_abstract(CONFIGS[name]))


def test_kernels_keep_their_shapes_and_adapters_flatten_heads():
  model = _adapted("gpt")
  q = model.blocks.layers.attn.query
  assert q.kernel.shape == (2, 32, 4, 8)  # [L, D, N, H]
  assert q.lora.lora.lora_a.shape == (2, 32, 4)  # [L, D, r]
  assert q.lora.lora.lora_b.shape == (2, 4, 32)  # [L, r, N*H]
  out = model.blocks.layers.attn.out
  assert out.lora.lora.lora_a.shape == (2, 32, 4)  # [L, N*H, r]


def test_only_adapters_and_head_train():
  model = _adapted("bert", lora.LoRAConfig(rank=2, targets=("query", "value")))
  graphdef, trainable, frozen = lora.split(model)
  paths = [
    "/".join(map(str, p)) for p in nnx.traversals.flatten_mapping(nnx.to_pure_dict(trainable))
  ]
  assert paths and all(("lora" in p.split("/")) or p.startswith("classifier/") for p in paths)
  assert any(p.startswith("classifier/") for p in paths)
  assert {p.split("/")[3] for p in paths if "lora" in p.split("/")} == {"query", "value"}

  task = tasks.ClassifyTask("bert", 3)
  optimizer = optax.adam(1e-2)
  state = step_lib.TrainState(
    step=jnp.zeros((), jnp.int32),
    params=trainable,
    opt_state=optimizer.init(trainable),
    frozen=frozen,
  )
  # The optimizer holds moments of the trainable parameters only.
  n_train = sum(x.size for x in jax.tree.leaves(trainable))
  assert sum(x.size for x in jax.tree.leaves(state.opt_state)) == 2 * n_train + 1
  rng = np.random.default_rng(0)
  batch = {
    "tokens": rng.integers(0, 64, (4, 8)).astype(np.int32),
    "token_types": np.zeros((4, 8), np.int32),
    "attention_mask": np.ones((4, 8), bool),
    "labels": np.array([0, 1, 2, 1], np.int32),
    "label_mask": np.ones(4, bool),
  }
  step = jax.jit(step_lib.make_train_step(graphdef, task, optimizer, seed=0))
  frozen_before = jax.tree.map(np.asarray, frozen)
  trainable_before = jax.tree.map(np.asarray, trainable)
  for _ in range(2):
    state, metrics = step(state, batch)
  assert float(metrics["grad_norm"]) > 0
  jax.tree.map(np.testing.assert_array_equal, frozen_before, jax.tree.map(np.asarray, state.frozen))
  changed = jax.tree.map(
    lambda a, b: bool(np.any(a != np.asarray(b))), trainable_before, state.params
  )
  assert all(jax.tree.leaves(changed))  # A, B and the head all moved


def test_adapter_axes_in_the_rules_table():
  model = _adapted("gpt")
  q = nnx.state(model.blocks.layers.attn.query.lora)
  specs = nnx.get_partition_spec(q)["lora"]
  rules = parallel.RULES
  assert parallel.mesh_axes(tuple(specs["lora_a"]), rules) == jax.sharding.PartitionSpec(
    None, "fsdp"
  )
  assert parallel.mesh_axes(tuple(specs["lora_b"]), rules) == jax.sharding.PartitionSpec(
    None, None, "tensor"
  )


def test_bad_lora_config_is_named():
  with pytest.raises(ValueError, match="lora.targets: 'qkv' is not one of"):
    lora.LoRAConfig(targets=("qkv",))
  with pytest.raises(ValueError, match="lora.rank=0"):
    lora.LoRAConfig(rank=0)
  with pytest.raises(ValueError, match="train.lora.rnak: unknown key"):
    load_experiment(
      None,
      ["train.lora.rnak=3"],
      raw={"run_dir": "r", "model": {"preset": "gpt2-tiny"}, "data": {"path": "d"}},
    )


@pytest.mark.slow
@pytest.mark.long
def test_resumed_lora_run_equals_an_uninterrupted_one(tmp_path, text_dataset):
  def experiment(run_dir, steps):
    raw = {
      "run_dir": str(run_dir),
      "model": {
        "preset": "gpt2-tiny",
        "d_model": 32,
        "num_layers": 2,
        "num_heads": 2,
        "d_ff": 64,
        "max_len": 32,
        "dropout_rate": 0.1,
      },
      "data": {"path": text_dataset, "task": "gpt"},
      "train": {
        "steps": steps,
        "batch_size": 4,
        "seq_len": 32,
        "lr": 3e-3,
        "warmup_steps": 2,
        "log_every": 1,
        "eval_every": 1000,
        "eval_batches": 2,
        "checkpoint_every": 2,
        "samples": 0,
        "async_checkpoints": False,
        "lora": {"rank": 2, "alpha": 4, "targets": ["query", "value", "mlp_in"]},
      },
    }
    return load_experiment(None, raw=raw)

  straight = train(experiment(tmp_path / "a", 6), progress=False)
  train(experiment(tmp_path / "b", 3), progress=False)
  resumed = train(experiment(tmp_path / "b", 6), progress=False)
  assert resumed["val_loss"] == straight["val_loss"]
  assert straight["lora"]["fraction"] < 0.2

  def losses(run_dir):
    with open(os.path.join(run_dir, "metrics.jsonl")) as f:
      return {r["step"]: r["loss"] for r in map(json.loads, f) if "loss" in r}

  assert losses(tmp_path / "a") == losses(tmp_path / "b")
  with open(tmp_path / "b" / "config.yaml") as f:
    assert yaml.safe_load(f)["train"]["lora"]["rank"] == 2


@pytest.mark.slow
@pytest.mark.long
def test_lora_run_exports_merged_weights_that_transformers_reproduces(tmp_path, text_dataset):
  torch = pytest.importorskip("torch")
  transformers = pytest.importorskip("transformers")
  from transformer_jax.hf import convert
  from transformer_jax.train import method

  raw = {
    "run_dir": str(tmp_path / "run"),
    "model": {
      "preset": "gpt2-tiny",
      "d_model": 32,
      "num_layers": 2,
      "num_heads": 2,
      "d_ff": 64,
      "max_len": 32,
    },
    "data": {"path": text_dataset, "task": "gpt"},
    "train": {
      "steps": 3,
      "batch_size": 4,
      "seq_len": 32,
      "lr": 1e-2,
      "warmup_steps": 1,
      "eval_every": 1000,
      "eval_batches": 1,
      "samples": 0,
      "async_checkpoints": False,
      "lora": {"rank": 4, "alpha": 8, "targets": list(lora.TARGETS)},
    },
  }
  exp = load_experiment(None, raw=raw)
  train(exp, progress=False)
  # The run's own (unmerged) forward: base rebuilt from the seed, adapters from the checkpoint.
  config = models.config_from_dict(yaml.safe_load(open(tmp_path / "run" / "model.yaml")))
  graphdef, trainable_abs, _ = lora.split(lora.abstract(config, exp.train.lora))
  from transformer_jax import runs

  trainable, _ = runs.restore_params(
    str(tmp_path / "run" / "checkpoints"), config, target=trainable_abs
  )
  _, frozen, _ = method.LoRA(config, exp.train.seed, None, exp.train.lora).start()
  model = nnx.merge(graphdef, trainable, frozen)
  assert any(
    np.abs(np.asarray(x)).max() > 0 for x in jax.tree.leaves(nnx.state(model, nnx.LoRAParam))
  )
  tokens = np.random.default_rng(0).integers(0, config.vocab_size, (2, 16))
  ours = np.asarray(model(jnp.asarray(tokens, jnp.int32)))
  out = tmp_path / "hf"
  convert.to_hf(str(tmp_path / "run"), str(out))
  hf_model = transformers.GPT2LMHeadModel.from_pretrained(out).eval()
  with torch.no_grad():
    theirs = hf_model(torch.tensor(tokens)).logits.numpy()
  np.testing.assert_allclose(theirs, ours, atol=1e-5, rtol=1e-5)
