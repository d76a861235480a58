"""Pure, jitted train and eval steps.

NNX meets ``jax.jit`` at one boundary: the model is split once into ``(graphdef, params)``; the steps
are plain functions of ``(state, batch)`` that ``nnx.merge`` inside. Gradient accumulation runs as a
``lax.scan`` over microbatches inside the step, so there is no Python work per microbatch.
"""

from __future__ import annotations

import dataclasses
from typing import Any, Callable

import jax
import jax.numpy as jnp
import numpy as np
import optax
from flax import nnx, struct
from jax.sharding import Mesh, NamedSharding, PartitionSpec as P

from transformer_jax.train import tasks as tasks_lib


@struct.dataclass
class TrainState:
  step: jax.Array            # int32 scalar: optimizer steps taken
  params: Any                # nnx.State of nnx.Param (float32 master weights)
  opt_state: Any             # optax state


def create_state(params, optimizer: optax.GradientTransformation) -> TrainState:
  return TrainState(step=jnp.zeros((), jnp.int32), params=params, opt_state=optimizer.init(params))


def step_rng(seed: int, step) -> jax.Array:
  """The dropout key of ``step``: a pure function of (seed, step), so a resumed run draws the same."""
  return jax.random.fold_in(jax.random.key(seed), step)


def _split_micro(batch, m: int):
  return jax.tree.map(lambda x: x.reshape(m, x.shape[0] // m, *x.shape[1:]), batch)


def make_train_step(graphdef: nnx.GraphDef, task, optimizer: optax.GradientTransformation, *,
                    seed: int, microbatches: int = 1, label_smoothing: float = 0.0,
                    z_loss: float = 0.0) -> Callable:
  """``train_step(state, batch) -> (state, metrics)``; jit it (``jit_train_step`` adds shardings)."""

  def train_step(state: TrainState, batch):
    counts = task.counts(batch)                        # denominators over the whole batch
    rng = step_rng(seed, state.step)

    def micro_loss(params, micro, key):
      model = nnx.merge(graphdef, params)
      loss_sums, metric_sums = task.sums(model, micro, key, label_smoothing=label_smoothing,
                                         z_loss=z_loss)
      loss = sum(loss_sums[t] / jnp.maximum(counts[t], 1.0) for t in task.loss_terms)
      return loss, {**loss_sums, **metric_sums}

    grad_fn = jax.value_and_grad(micro_loss, has_aux=True)
    if microbatches == 1:
      (loss, sums), grads = grad_fn(state.params, batch, rng)
    else:
      micro = _split_micro(batch, microbatches)
      keys = jax.random.split(rng, microbatches)

      def body(carry, xs):
        g_acc, loss_acc, sums_acc = carry
        (loss, sums), g = grad_fn(state.params, *xs)
        return (jax.tree.map(jnp.add, g_acc, g), loss_acc + loss,
                jax.tree.map(jnp.add, sums_acc, sums)), None

      zeros_g = jax.tree.map(jnp.zeros_like, state.params)
      _, sums_shape = jax.eval_shape(lambda: micro_loss(state.params, jax.tree.map(
          lambda x: x[0], micro), keys[0]))
      zeros_s = jax.tree.map(lambda s: jnp.zeros(s.shape, s.dtype), sums_shape)
      (grads, loss, sums), _ = jax.lax.scan(body, (zeros_g, jnp.zeros(()), zeros_s),
                                            (micro, keys))

    updates, opt_state = optimizer.update(grads, state.opt_state, state.params)
    params = optax.apply_updates(state.params, updates)
    metrics = tasks_lib.summarize(task, sums, counts)
    metrics["loss"] = loss
    metrics["grad_norm"] = optax.tree.norm(grads)
    return TrainState(step=state.step + 1, params=params, opt_state=opt_state), metrics

  return train_step


def make_eval_step(graphdef: nnx.GraphDef, task) -> Callable:
  """``eval_step(params, batch) -> (sums, counts)``: accumulate these over batches, then
  ``tasks.summarize``."""

  def eval_step(params, batch):
    model = nnx.merge(graphdef, params)
    loss_sums, metric_sums = task.sums(model, batch, None)
    return {**loss_sums, **metric_sums}, task.counts(batch)

  return eval_step


# -------------------------------------------------------------------------------------------------
# Data parallelism over a mesh.


def make_mesh(shape: dict[str, int] | None = None, devices=None) -> Mesh:
  """A mesh with axes (data, fsdp, tensor, sequence); one entry may be -1 (the remaining devices)."""
  devices = np.asarray(jax.devices() if devices is None else devices)
  shape = dict(shape or {"data": -1})
  names = ("data", "fsdp", "tensor", "sequence")
  sizes = [shape.get(n, 1) for n in names]
  free = [i for i, s in enumerate(sizes) if s == -1]
  if len(free) > 1:
    raise ValueError(f"only one mesh axis may be -1; got {dict(zip(names, sizes))}")
  known = int(np.prod([s for s in sizes if s != -1]))
  if free:
    if devices.size % known:
      raise ValueError(f"mesh {dict(zip(names, sizes))} does not divide {devices.size} devices")
    sizes[free[0]] = devices.size // known
  if int(np.prod(sizes)) != devices.size:
    raise ValueError(
        f"mesh {dict(zip(names, sizes))} has {int(np.prod(sizes))} devices, but there are "
        f"{devices.size}")
  return Mesh(devices.reshape(sizes), names)


def batch_sharding(mesh: Mesh) -> NamedSharding:
  """Batch rows split over the data-parallel axes."""
  return NamedSharding(mesh, P(("data", "fsdp")))


def replicated(mesh: Mesh) -> NamedSharding:
  return NamedSharding(mesh, P())


def jit_train_step(train_step: Callable, mesh: Mesh, state: TrainState):
  """Compiles ``train_step`` with replicated state and a data-sharded batch (donating the state)."""
  rep = replicated(mesh)
  state_sharding = jax.tree.map(lambda _: rep, state)
  return jax.jit(train_step, in_shardings=(state_sharding, batch_sharding(mesh)),
                 out_shardings=(state_sharding, rep), donate_argnums=(0,))


def shard_batch(batch: dict[str, np.ndarray], mesh: Mesh, keys=None) -> dict[str, jax.Array]:
  """Places a host batch on the mesh, rows split over the data axes (each process passes its rows)."""
  sharding = batch_sharding(mesh)
  keys = batch.keys() if keys is None else keys
  return {k: jax.make_array_from_process_local_data(sharding, np.asarray(batch[k])) for k in keys}
