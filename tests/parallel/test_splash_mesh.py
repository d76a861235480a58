"""The splash kernel on a mesh: each device runs it on its own rows and heads (``shard_map``),
and a sharded GPT step with ``attention_impl="splash"`` (Pallas interpret mode here) gives the
gradients of the same model with dense attention on one device. With GQA (LLaMA's 2 key/value
heads) and packed documents."""

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from flax import nnx

from transformer_jax import models, parallel
from transformer_jax.train import step as step_lib
from transformer_jax.train import tasks as tasks_lib

B, T, VOCAB = 4, 128, 64


def _batch(seed):
  rng = np.random.default_rng(seed)
  segments = np.repeat([[1] * 50 + [2] * 78], B, 0).astype(np.int32)
  positions = np.where(segments == 1, np.arange(T), np.arange(T) - 50).astype(np.int32)
  return {
    "tokens": rng.integers(0, VOCAB, (B, T)).astype(np.int32),
    "labels": rng.integers(0, VOCAB, (B, T)).astype(np.int32),
    "segment_ids": segments,
    "positions": positions,
    "loss_mask": np.ones((B, T), bool),
  }


@pytest.mark.parametrize(
  "preset,sizes",
  [("gpt2-tiny", {"data": 2, "fsdp": 2, "tensor": 2}), ("llama-tiny", {"fsdp": 4, "tensor": 2})],
)
def test_sharded_splash_step_has_the_gradients_of_dense_attention(preset, sizes):
  config = models.get_config(preset, vocab_size=VOCAB, dropout_rate=0.0)
  task = tasks_lib.get_task("gpt")
  params = models.init(config, jax.random.key(0))
  host = _batch(1)

  def loss_fn(graphdef, p, batch):
    sums, _ = task.sums(nnx.merge(graphdef, p), batch, None)
    return sums["lm"] / task.counts(batch)["lm"]

  dense = models.get_config(preset, vocab_size=VOCAB, dropout_rate=0.0, attention_impl="xla")
  ref = jax.jit(jax.grad(lambda p, b: loss_fn(models.graphdef(dense), p, b)))(
    params, {k: jnp.asarray(v) for k, v in host.items()}
  )

  mesh = parallel.make_mesh(sizes)
  splash = models.get_config(preset, vocab_size=VOCAB, dropout_rate=0.0, attention_impl="splash")
  graphdef = models.graphdef(splash, mesh)
  placed = jax.device_put(params, parallel.param_shardings(params, mesh))
  batch = step_lib.shard_batch(host, mesh, task.keys)
  grad_fn = jax.jit(jax.grad(lambda p, b: loss_fn(graphdef, p, b)))
  assert "shard_map" in str(jax.make_jaxpr(grad_fn)(placed, batch))
  got = grad_fn(placed, batch)
  for (path, g), want in zip(jax.tree_util.tree_leaves_with_path(got), jax.tree.leaves(ref)):
    scale = max(float(np.abs(np.asarray(want)).max()), 1e-6)
    np.testing.assert_allclose(
      np.asarray(g), np.asarray(want), atol=2e-5 * scale, err_msg=jax.tree_util.keystr(path)
    )
