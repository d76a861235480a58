"""Pure, jitted train and eval steps.

NNX meets ``jax.jit`` at one boundary: the model is split once into ``(graphdef, params)``; the
steps
are plain functions of ``(state, batch)`` that ``nnx.merge`` inside. Gradient accumulation runs as a
``lax.scan`` over microbatches inside the step, so there is no Python work per microbatch.
"""

from __future__ import annotations

from typing import Any, Callable

import jax
import jax.numpy as jnp
import numpy as np
import optax
from flax import nnx, struct
from jax.sharding import Mesh

from transformer_jax import backends, models, parallel
from transformer_jax.parallel.mesh import batch_sharding, replicated
from transformer_jax.train import tasks as tasks_lib


@struct.dataclass
class TrainState:
  step: jax.Array  # int32 scalar: optimizer steps taken
  params: Any  # nnx.State of nnx.Param (float32 master weights)
  opt_state: Any  # optax state
  # Parameters held fixed (the base model of a LoRA run): an input of the forward pass only, not
  # differentiated, not in the optimizer, not checkpointed. None when every parameter trains.
  frozen: Any = None


def create_state(params, optimizer: optax.GradientTransformation) -> TrainState:
  return TrainState(step=jnp.zeros((), jnp.int32), params=params, opt_state=optimizer.init(params))


def step_rng(seed: int, step) -> jax.Array:
  """The dropout key of ``step``: a pure function of (seed, step), so a resumed run draws the
  same."""
  return jax.random.fold_in(jax.random.key(seed), step)


def _split_micro(batch, m: int):
  return jax.tree.map(lambda x: x.reshape(m, x.shape[0] // m, *x.shape[1:]), batch)


def make_train_step(
  graphdef: nnx.GraphDef,
  task,
  optimizer: optax.GradientTransformation,
  *,
  seed: int,
  microbatches: int = 1,
  label_smoothing: float = 0.0,
  z_loss: float = 0.0,
) -> Callable:
  """``train_step(state, batch) -> (state, metrics)``; jit it (``jit_train_step`` adds shardings).

  Raises:
    ValueError: ``microbatches`` is not a count (``train.microbatches: auto`` is resolved by the
      run's plan, which compiles the step to see its memory).
  """
  if (
    isinstance(microbatches, bool)
    or not isinstance(microbatches, (int, np.integer))
    or microbatches < 1
  ):
    raise ValueError(
      f"microbatches={microbatches!r} must be a count >= 1 (train.microbatches="
      "'auto' is resolved by the run's plan)"
    )

  def train_step(state: TrainState, batch):
    counts = task.counts(batch)  # denominators over the whole batch
    rng = step_rng(seed, state.step)

    def micro_loss(params, micro, key):
      model = (
        nnx.merge(graphdef, params)
        if state.frozen is None
        else nnx.merge(graphdef, params, state.frozen)
      )
      loss_sums, metric_sums = task.sums(
        model, micro, key, label_smoothing=label_smoothing, z_loss=z_loss
      )
      loss = sum(loss_sums[t] / jnp.maximum(counts[t], 1.0) for t in task.loss_terms)
      loss = loss + tasks_lib.aux_loss(task, metric_sums, counts)  # router losses of experts
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
        return (
          jax.tree.map(jnp.add, g_acc, g),
          loss_acc + loss,
          jax.tree.map(jnp.add, sums_acc, sums),
        ), None

      zeros_g = jax.tree.map(jnp.zeros_like, state.params)
      _, sums_shape = jax.eval_shape(
        lambda: micro_loss(state.params, jax.tree.map(lambda x: x[0], micro), keys[0])
      )
      zeros_s = jax.tree.map(lambda s: jnp.zeros(s.shape, s.dtype), sums_shape)
      (grads, loss, sums), _ = jax.lax.scan(body, (zeros_g, jnp.zeros(()), zeros_s), (micro, keys))

    updates, opt_state = optimizer.update(grads, state.opt_state, state.params)
    params = optax.apply_updates(state.params, updates)
    metrics = tasks_lib.summarize(task, sums, counts)
    metrics["loss"] = loss
    metrics["grad_norm"] = optax.tree.norm(grads)
    return TrainState(
      step=state.step + 1, params=params, opt_state=opt_state, frozen=state.frozen
    ), metrics

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
# Sharded state and steps on a mesh (data, fsdp, tensor, sequence; see
# ``transformer_jax.parallel``).


def state_shardings(state: TrainState, mesh: Mesh, rules: parallel.Rules = parallel.RULES):
  """``NamedSharding`` of every leaf of ``state`` (arrays or shapes): parameters by their logical
  axes, optimizer moments like their parameters, counters replicated."""
  params = parallel.param_shardings(state.params, mesh, rules)
  frozen = None if state.frozen is None else parallel.param_shardings(state.frozen, mesh, rules)
  return TrainState(
    step=replicated(mesh),
    params=params,
    opt_state=parallel.shardings_like(state.opt_state, state.params, params, mesh),
    frozen=frozen,
  )


def abstract_state(
  model_config,
  optimizer: optax.GradientTransformation,
  mesh: Mesh,
  rules: parallel.Rules = parallel.RULES,
) -> TrainState:
  """The train state as ``ShapeDtypeStruct`` leaves carrying their shardings: nothing allocated.

  A restore target (orbax places each array straight onto its shards) and what ``--dry-run``
  compiles against."""
  params = models.init_abstract(model_config)
  state = TrainState(
    step=jax.ShapeDtypeStruct((), jnp.int32),
    params=params,
    opt_state=jax.eval_shape(optimizer.init, params),
  )
  return jax.tree.map(
    lambda a, s: jax.ShapeDtypeStruct(a.shape, a.dtype, sharding=s),
    state,
    state_shardings(state, mesh, rules),
  )


def init_state(
  model_config,
  optimizer: optax.GradientTransformation,
  mesh: Mesh,
  key: jax.Array,
  rules: parallel.Rules = parallel.RULES,
) -> TrainState:
  """A fresh train state initialised directly sharded: one jitted function whose outputs are laid
  out on the mesh, so no device ever holds more than its shards (a model too large for one device
  is never materialised on one)."""
  shardings = jax.tree.map(
    lambda a: a.sharding, abstract_state(model_config, optimizer, mesh, rules)
  )

  def make(k):
    return create_state(models.init(model_config, k), optimizer)

  return jax.jit(make, out_shardings=shardings)(key)


def place_state(state: TrainState, mesh: Mesh, rules: parallel.Rules = parallel.RULES):
  """``state`` (host or device arrays) laid out on ``mesh``."""
  return jax.device_put(state, state_shardings(state, mesh, rules))


def mesh_backend(mesh: Mesh, backend: backends.Backend | None = None) -> backends.Backend:
  """``backend``, or the default one of the platform ``mesh``'s devices are on."""
  return backend or backends.for_platform(mesh.devices.flat[0].platform)


def jit_train_step(
  train_step: Callable,
  mesh: Mesh,
  state: TrainState,
  rules: parallel.Rules = parallel.RULES,
  *,
  backend: backends.Backend | None = None,
):
  """Compiles ``train_step`` for ``mesh``: state sharded by the rules (and donated), the batch split
  over the data axes, metrics replicated. Build the step's model for the same mesh and backend
  (``models.graphdef(config, mesh, backend)``): its layers then pin activations to it and may run
  ring attention. The step compiles with the backend's options
  (``Backend.step_compiler_options``: on CPU the products go to oneDNN) and comes back held
  (``Backend.jit_step``); ``backend`` defaults to the mesh platform's default one."""
  shardings = state_shardings(state, mesh, rules)
  return mesh_backend(mesh, backend).jit_step(
    train_step,
    in_shardings=(shardings, batch_sharding(mesh)),
    out_shardings=(shardings, replicated(mesh)),
    donate_argnums=(0,),
  )


def pick_microbatches(
  setting: int | str,
  compile_step: Callable[[int], Any],
  batch_size: int,
  n_batch: int = 1,
  *,
  backend: backends.Backend,
) -> tuple[int, Any]:
  """``train.microbatches`` resolved, with the step compiled for it: ``(microbatches, compiled)``.

  A number is taken as given; "auto" is the backend's rule (``Backend.microbatches``: on CPU over
  mimalloc the fewest microbatches that keep the step's temporaries within what it reuses, 1
  elsewhere).
  """
  return backend.microbatches(setting, compile_step, batch_size, n_batch)


def jit_eval_step(
  eval_step: Callable,
  mesh: Mesh,
  params,
  rules: parallel.Rules = parallel.RULES,
  *,
  backend: backends.Backend | None = None,
):
  """Compiles ``eval_step(params, batch)`` for ``mesh`` (parameters sharded as in training), with
  the backend's options (as ``jit_train_step``)."""
  return mesh_backend(mesh, backend).jit_step(
    eval_step,
    in_shardings=(parallel.param_shardings(params, mesh, rules), batch_sharding(mesh)),
    out_shardings=replicated(mesh),
  )


def shard_batch(batch: dict[str, np.ndarray], mesh: Mesh, keys=None) -> dict[str, jax.Array]:
  """Places a host batch on the mesh, rows split over the data axes (each process passes its
  rows)."""
  sharding = batch_sharding(mesh)
  keys = batch.keys() if keys is None else keys
  return {k: jax.make_array_from_process_local_data(sharding, np.asarray(batch[k])) for k in keys}
