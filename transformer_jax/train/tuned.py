"""``make_step``: the train step a run (and ``tjax bench train``) takes, for a library user.

A training loop of one's own gets the step ``tjax train`` compiles without an experiment file:

```python
import jax, transformer_jax as tj

config = tj.models.get_config("gpt2-small")
step = tj.train.make_step(config, tj.train.make_optimizer(tj.train.TrainConfig(lr=3e-4)))
state = step.init(jax.random.key(0))
for batch in batches:   # tokens, labels, segment_ids, positions [B, T] int32; loss_mask [B, T]
  state, metrics = step(state, batch)  # the first call compiles
```

What is tuned for the platform is the backend's (``backends.for_platform``, with a kernel table):
the model is built to call its kernels, the step compiles with its options (on CPU the products
go to oneDNN) and is held as a run holds it, the state is donated, and ``microbatches="auto"``
is resolved as a run resolves it (on CPU over mimalloc: the fewest microbatches whose temporaries
stay within what the allocator reuses), once the first batch shows the shapes.
"""

from __future__ import annotations

from typing import Any

import jax
import numpy as np
import optax
from jax.sharding import Mesh

from transformer_jax import backends, models, parallel
from transformer_jax.train import step as step_lib
from transformer_jax.train import tasks as tasks_lib


class Step:
  """A compiled train step: ``step(state, batch) -> (state, metrics)``; ``init(key)`` gives the
  state of step 0 (parameters initialised directly sharded, optimizer state).

  Attributes:
    config, optimizer, task, mesh, backend: what the step trains and how.
    microbatches: the count the step runs (``"auto"`` until the first call resolves it).
    compiled: the executable (None until the first call): its ``memory_analysis()`` and
      ``cost_analysis()``.
  """

  def __init__(
    self,
    config: models.ModelConfig,
    optimizer: optax.GradientTransformation,
    *,
    task: str | None = None,
    mesh: Mesh | None = None,
    microbatches: int | str = "auto",
    seed: int = 0,
    label_smoothing: float = 0.0,
    z_loss: float = 0.0,
    table: backends.KernelTable | None = None,
  ):
    if microbatches != "auto" and (
      isinstance(microbatches, bool)
      or not isinstance(microbatches, (int, np.integer))
      or microbatches < 1
    ):
      raise ValueError(f"microbatches={microbatches!r}: expected a count >= 1 or 'auto'")
    self.config, self.optimizer = config, optimizer
    self.task = tasks_lib.get_task(task or tasks_lib.family_task(config))
    if not isinstance(config, self.task.config_type):
      raise ValueError(
        f"task={self.task.name!r} does not fit a {type(config).__name__} (use "
        f"task={tasks_lib.family_task(config)!r})"
      )
    self.mesh = mesh if mesh is not None else parallel.make_mesh({"data": -1})
    self.backend = backends.for_platform(self.mesh.devices.flat[0].platform, table)
    self.microbatches = microbatches
    self._options = dict(seed=seed, label_smoothing=label_smoothing, z_loss=z_loss)
    self._graphdef = models.graphdef(config, self.mesh, self.backend)
    self.compiled = None

  def init(self, key: jax.Array) -> step_lib.TrainState:
    """The placed train state of step 0, the parameters drawn from ``key``."""
    return step_lib.init_state(self.config, self.optimizer, self.mesh, key)

  def shard(self, batch: dict[str, Any]) -> dict[str, jax.Array]:
    """A host batch (NumPy arrays) placed on the mesh, split over its data axes.

    Raises:
      ValueError: the batch lacks one of the task's arrays (``task.keys``).
    """
    missing = [k for k in self.task.keys if k not in batch]
    if missing:
      raise ValueError(
        f"the batch has no {', '.join(missing)}: task {self.task.name!r} takes "
        f"{', '.join(self.task.keys)}"
      )
    return step_lib.shard_batch(batch, self.mesh, self.task.keys)

  def compile(self, state: step_lib.TrainState, batch: dict[str, Any]) -> "Step":
    """Resolves the microbatches and compiles the step for ``(state, batch)``'s shapes (what the
    first call does otherwise); nothing runs. Returns the step."""
    if any(isinstance(v, np.ndarray) for v in batch.values()):
      batch = self.shard(batch)
    # The executables are compiled against shapes: the state is donated only when the step runs.
    shapes = jax.tree.map(
      lambda a: jax.ShapeDtypeStruct(a.shape, a.dtype, sharding=a.sharding), (state, batch)
    )

    def compile_for(m):
      jitted = step_lib.jit_train_step(
        step_lib.make_train_step(
          self._graphdef, self.task, self.optimizer, microbatches=m, **self._options
        ),
        self.mesh,
        state,
        backend=self.backend,
      )
      return jitted.lower(*shapes).compile()

    batch_size = next(iter(batch.values())).shape[0]
    n_batch = parallel.batch_shards(self.mesh.shape)
    self.microbatches, compiled = step_lib.pick_microbatches(
      self.microbatches, compile_for, batch_size, n_batch, backend=self.backend
    )
    self.compiled = self.backend.hold(compiled, self.backend.step_compiler_options())
    return self

  def __call__(self, state: step_lib.TrainState, batch: dict[str, Any]):
    """One step: ``(state, metrics)``. ``batch``: the task's arrays (NumPy ones are placed on
    the mesh first); ``state`` is donated. The first call compiles (and resolves
    ``microbatches``); later calls must keep its shapes."""
    if any(isinstance(v, np.ndarray) for v in batch.values()):
      batch = self.shard(batch)
    if self.compiled is None:
      self.compile(state, batch)
    return self.compiled(state, batch)


def make_step(
  config: models.ModelConfig,
  optimizer: optax.GradientTransformation,
  *,
  task: str | None = None,
  mesh: Mesh | None = None,
  microbatches: int | str = "auto",
  seed: int = 0,
  label_smoothing: float = 0.0,
  z_loss: float = 0.0,
  table: backends.KernelTable | None = None,
) -> Step:
  """The tuned train step of ``config`` (the module's docstring).

  Args:
    config: The model.
    optimizer: An optax transformation (``make_optimizer``: AdamW with clipping and a schedule).
    task: ``gpt``, ``bert``, ``seq2seq`` or ``classify``: the loss head and the batch keys
      (default: the model family's).
    mesh: Where the step runs (default: every device on a ``data`` axis).
    microbatches: Gradient accumulation inside the step: a count, or "auto" (the platform's rule).
    seed: The dropout keys' seed (step ``s`` draws from ``fold_in(key(seed), s)``).
    label_smoothing, z_loss: The loss's options, as ``train.label_smoothing`` / ``train.z_loss``.
    table: The kernel table (``backends.KernelTable``; default the library's).

  Raises:
    ValueError: a task that does not fit the model, or a bad ``microbatches``.
  """
  return Step(
    config,
    optimizer,
    task=task,
    mesh=mesh,
    microbatches=microbatches,
    seed=seed,
    label_smoothing=label_smoothing,
    z_loss=z_loss,
    table=table,
  )
