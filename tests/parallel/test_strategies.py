"""Every parallelism strategy trains exactly like one device: the real sharded train step
(``jit_train_step`` with the rules table) against the same step on a single device, for each family.
"""

import functools

import jax
import jax.numpy as jnp
import numpy as np
import optax
import pytest

from transformer_jax import models, parallel
from transformer_jax.train import step as step_lib
from transformer_jax.train import tasks as tasks_lib

STEPS = 2
BATCH, LENGTH, VOCAB = 8, 32, 128

MESHES = {
  "data8": {"data": 8},
  "fsdp8": {"fsdp": 8},
  "tensor4x2": {"tensor": 4, "data": 2},
  "sequence8": {"sequence": 8},
  "data2_fsdp2_tensor2": {"data": 2, "fsdp": 2, "tensor": 2},
  "fsdp4_sequence2": {"fsdp": 4, "sequence": 2},
}

FAMILIES = {
  "gpt": ("gpt2-tiny", {}),
  "bert": ("bert-tiny", {}),
  "t5": ("t5-tiny", {}),
  "llama": ("llama-tiny", {}),  # RoPE, GQA (kv_heads=2 < tensor=4 is replicated), SwiGLU
  "transformer": ("transformer-tiny", {}),  # no relative bias: ring attention in both stacks
}
MATRIX = [(f, m) for f in ("gpt", "bert", "t5") for m in MESHES] + [
  ("llama", "data2_fsdp2_tensor2"),
  ("llama", "tensor4x2"),
  ("transformer", "sequence8"),
]


def _config(family):
  preset, overrides = FAMILIES[family]
  config = models.get_config(preset, vocab_size=VOCAB, **overrides)
  zero = {f: 0.0 for f in ("dropout_rate", "attention_dropout_rate") if hasattr(config, f)}
  return models.get_config(preset, vocab_size=VOCAB, **overrides, **zero)


def _batch(family, seed=0):
  rng = np.random.default_rng(seed)
  b, t = BATCH, LENGTH
  tokens = rng.integers(1, VOCAB, (b, t)).astype(np.int32)
  match family:
    case "gpt" | "llama":
      segments = np.cumsum(rng.random((b, t)) < 0.05, axis=1).astype(np.int32)
      starts = np.concatenate([np.ones((b, 1), bool), segments[:, 1:] != segments[:, :-1]], 1)
      positions = np.zeros((b, t), np.int32)
      for i in range(b):
        for j in range(1, t):
          positions[i, j] = 0 if starts[i, j] else positions[i, j - 1] + 1
      return {
        "tokens": tokens,
        "labels": np.roll(tokens, -1, 1),
        "segment_ids": segments,
        "positions": positions,
        "loss_mask": rng.random((b, t)) < 0.9,
      }
    case "bert":
      lengths = rng.integers(t // 2, t + 1, b)
      attention = np.arange(t)[None, :] < lengths[:, None]
      return {
        "tokens": tokens,
        "token_types": (np.arange(t)[None, :] >= lengths[:, None] // 2).astype(np.int32),
        "attention_mask": attention,
        "mlm_labels": rng.integers(0, VOCAB, (b, t)).astype(np.int32),
        "mlm_mask": (rng.random((b, t)) < 0.15) & attention,
        "nsp_labels": rng.integers(0, 2, b).astype(np.int32),
      }
    case "t5" | "transformer":
      src_len = rng.integers(t // 2, t + 1, b)
      tgt_len = rng.integers(t // 4, t + 1, b)
      return {
        "src": tokens,
        "src_mask": np.arange(t)[None, :] < src_len[:, None],
        "tgt_in": rng.integers(1, VOCAB, (b, t)).astype(np.int32),
        "tgt_out": rng.integers(1, VOCAB, (b, t)).astype(np.int32),
        "tgt_mask": np.arange(t)[None, :] < tgt_len[:, None],
      }


def _task(family):
  return tasks_lib.get_task(
    {"gpt": "gpt", "llama": "gpt", "bert": "bert", "t5": "seq2seq", "transformer": "seq2seq"}[
      family
    ]
  )


@functools.lru_cache(maxsize=None)
def _reference(family):
  """Losses, gradient norms and final parameters of STEPS steps on one device."""
  mesh = parallel.make_mesh({"data": 1}, jax.devices()[:1])
  return _train(family, mesh)


def _train(family, mesh):
  config = _config(family)
  task = _task(family)
  # Plain SGD: Adam would turn the round-off in analytically zero gradients (a key bias does not
  # change attention) into full-size updates, hiding real differences behind noise.
  optimizer = optax.sgd(0.5)
  state = step_lib.place_state(
    step_lib.create_state(models.init(config, jax.random.key(0)), optimizer), mesh
  )
  fn = step_lib.jit_train_step(
    step_lib.make_train_step(models.graphdef(config, mesh), task, optimizer, seed=0), mesh, state
  )
  losses, grad_norms = [], []
  for s in range(STEPS):
    batch = step_lib.shard_batch(_batch(family, s), mesh, task.keys)
    state, metrics = fn(state, batch)
    losses.append(float(metrics["loss"]))
    grad_norms.append(float(metrics["grad_norm"]))
  return np.array(losses), np.array(grad_norms), jax.device_get(state.params), state


def _rel(a, b):
  return float(
    np.linalg.norm(np.asarray(a, np.float64) - np.asarray(b, np.float64))
    / max(np.linalg.norm(np.asarray(b, np.float64)), 1e-30)
  )


@pytest.mark.parametrize("family,mesh_name", MATRIX)
def test_same_training_as_one_device(family, mesh_name):
  mesh = parallel.make_mesh(MESHES[mesh_name])
  ref_losses, ref_norms, ref_params, _ = _reference(family)
  losses, norms, params, _ = _train(family, mesh)
  # Losses and gradient norms of every step, then every parameter after STEPS updates.
  np.testing.assert_allclose(losses, ref_losses, rtol=1e-5)
  np.testing.assert_allclose(norms, ref_norms, rtol=1e-5)
  for (path, got), want in zip(
    jax.tree_util.tree_leaves_with_path(params), jax.tree.leaves(ref_params)
  ):
    np.testing.assert_allclose(got, want, rtol=1e-5, atol=1e-6, err_msg=jax.tree_util.keystr(path))


@pytest.mark.parametrize(
  "family,ring", [("gpt", True), ("bert", True), ("transformer", True), ("t5", False)]
)
def test_sequence_parallel_runs_ring_attention(family, ring):
  """Under mesh.sequence > 1 self-attention is ring attention (collective permutes in the step),
  except where an additive bias (T5's relative positions) needs the dense path."""
  config = _config(family)
  task = _task(family)
  mesh = parallel.make_mesh({"sequence": 8})
  optimizer = optax.sgd(0.1)
  state = step_lib.abstract_state(config, optimizer, mesh)
  batch = {
    k: jax.ShapeDtypeStruct(v.shape, v.dtype, sharding=parallel.batch_sharding(mesh))
    for k, v in task.batch_shapes(BATCH, LENGTH).items()
  }
  fn = step_lib.jit_train_step(
    step_lib.make_train_step(models.graphdef(config, mesh), task, optimizer, seed=0), mesh, state
  )
  hlo = fn.lower(state, batch).as_text()
  assert ("collective_permute" in hlo or "ppermute" in hlo) == ring


def test_gradients_match_one_device():
  """Gradients themselves (not only their norm), leaf by leaf, under data x fsdp x tensor."""
  config = _config("llama")
  task = _task("llama")
  params = models.init(config, jax.random.key(1))
  host = _batch("llama", 7)

  def loss_fn(graphdef, p, batch):
    from flax import nnx

    sums, _ = task.sums(nnx.merge(graphdef, p), batch, None)
    return sums["lm"] / task.counts(batch)["lm"]

  ref = jax.jit(jax.grad(functools.partial(loss_fn, models.graphdef(config))))(
    params, {k: jnp.asarray(v) for k, v in host.items()}
  )
  mesh = parallel.make_mesh({"data": 2, "fsdp": 2, "tensor": 2})
  shardings = parallel.param_shardings(params, mesh)
  got = jax.jit(
    jax.grad(functools.partial(loss_fn, models.graphdef(config, mesh))),
    in_shardings=(shardings, parallel.batch_sharding(mesh)),
  )(jax.device_put(params, shardings), step_lib.shard_batch(host, mesh))
  # Each leaf within 1e-5 of its own norm; leaves whose gradient is analytically zero (key biases)
  # hold only round-off, measured against the whole gradient's norm instead.
  total = float(optax.tree.norm(ref))
  for (path, g), r in zip(jax.tree_util.tree_leaves_with_path(got), jax.tree.leaves(ref)):
    diff = np.linalg.norm(np.asarray(g, np.float64) - np.asarray(r, np.float64))
    assert diff <= 1e-5 * max(np.linalg.norm(r), 1e-2 * total), (jax.tree_util.keystr(path), diff)


def test_fsdp_splits_parameters_and_optimizer_state():
  """Under fsdp=8 each device holds 1/8 of every matrix; only small vectors are replicated."""
  config = _config("gpt")
  optimizer = optax.adamw(1e-3)
  mesh = parallel.make_mesh({"fsdp": 8})
  state = step_lib.init_state(config, optimizer, mesh, jax.random.key(0))
  total = sum(x.size * x.dtype.itemsize for x in jax.tree.leaves(state.params))
  small = sum(
    x.size * x.dtype.itemsize
    for x in jax.tree.leaves(state.params)
    if x.sharding.is_fully_replicated
  )
  for device in jax.devices():
    held = sum(
      s.data.size * s.data.dtype.itemsize
      for x in jax.tree.leaves(state.params)
      for s in x.addressable_shards
      if s.device == device
    )
    assert held <= total / 8 + small, (held, total, small)
  assert small <= 0.02 * total  # only the norms' scales/biases are replicated... and few of them
  # Adam's moments are split exactly like their parameters.
  want = [x.sharding for x in jax.tree.leaves(state.params)]
  adam = state.opt_state[0]
  for moments in (adam.mu, adam.nu):
    assert [x.sharding for x in jax.tree.leaves(moments)] == want


def test_tensor_parallel_splits_heads_and_mlp():
  config = _config("gpt")
  mesh = parallel.make_mesh({"tensor": 4, "data": 2})
  params = models.init_abstract(config)
  shardings = parallel.param_shardings(params, mesh)
  q = shardings["blocks"]["layers"]["attn"]["query"]["kernel"]
  out = shardings["blocks"]["layers"]["attn"]["out"]["kernel"]
  wi = [
    s
    for p, s in jax.tree_util.tree_leaves_with_path(shardings)
    if "mlp" in jax.tree_util.keystr(p) and "kernel" in jax.tree_util.keystr(p)
  ]
  assert q.spec == jax.sharding.PartitionSpec(None, None, "tensor")  # [L, D, N, H]: heads
  assert out.spec == jax.sharding.PartitionSpec(None, "tensor")  # [L, N, H, D]: rows
  assert all("tensor" in str(s.spec) for s in wi)


def test_bad_configurations_fail_before_compiling():
  config = _config("gpt")  # 4 heads
  with pytest.raises(ValueError, match=r"mesh .* has 6 devices, but there are 8"):
    parallel.make_mesh({"data": 3, "tensor": 2})
  with pytest.raises(ValueError, match=r"num_heads=4 is not divisible by mesh.tensor=8"):
    parallel.check_config(config, parallel.make_mesh({"tensor": 8}))
  with pytest.raises(ValueError, match=r"sequence length 30 is not divisible by mesh.sequence=4"):
    parallel.check_config(config, parallel.make_mesh({"sequence": 4, "data": 2}), seq_len=30)
  with pytest.raises(ValueError, match=r"batch size 6 is not divisible by the 8 data-parallel"):
    parallel.check_config(config, parallel.make_mesh({"data": 4, "fsdp": 2}), batch_size=6)
  with pytest.raises(ValueError, match=r"only one mesh axis may be -1"):
    parallel.make_mesh({"data": -1, "fsdp": -1})
