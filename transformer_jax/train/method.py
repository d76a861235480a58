"""What a run trains: every parameter (:class:`Full`), or LoRA adapters over a frozen base
(:class:`LoRA`, ``train.lora``), behind one interface.

A method knows the graph of the model it trains, the train state's shapes (the restore target and
what the step compiles against), the state at step 0, and how to get the base architecture's
parameters back (what samples, learning bars, ``tjax eval`` and ``tjax convert`` run). The
trainer, the loop and the evaluation call these and never ask which method they hold.

A LoRA run keeps its trainable adapters (and a classification head) in ``TrainState.params`` and
the frozen base in ``TrainState.frozen``; the base is rebuilt from ``train.seed`` (and
``model.init_from``) whenever it is needed, and is never checkpointed.
"""

from __future__ import annotations

import dataclasses
import os
from typing import Any

import jax
import jax.numpy as jnp
import numpy as np
from flax import nnx

from transformer_jax import lora as lora_lib
from transformer_jax import models, runs
from transformer_jax.train import finetune
from transformer_jax.train import step as step_lib
from transformer_jax.train.config import Experiment, load_experiment
from transformer_jax.train.console import log0


def all_params(state: step_lib.TrainState):
  """Every parameter of the model a state trains (a LoRA run's adapters and frozen base): what
  the plan's graph merges with."""
  return state.params if state.frozen is None else nnx.merge_state(state.params, state.frozen)


@dataclasses.dataclass(frozen=True)
class Full:
  """Every parameter trains; step 0 is ``train.seed``'s initialisation with ``model.init_from``'s
  tensors loaded."""

  model_config: models.ModelConfig
  seed: int
  init_from: str | None = None

  def graphdef(self, mesh=None, backend=None) -> nnx.GraphDef:
    """The graph of the model the step trains, its layers pinned to ``mesh`` and calling
    ``backend``'s kernels (default: the platform JAX computes on's)."""
    return models.graphdef(self.model_config, mesh, backend)

  def abstract_state(self, optimizer, mesh) -> step_lib.TrainState:
    """The train state as sharded shapes (nothing allocated)."""
    return step_lib.abstract_state(self.model_config, optimizer, mesh)

  def fresh_state(self, optimizer, mesh, run_dir: str) -> step_lib.TrainState:
    """The placed state of step 0; ``model.init_from``'s report goes to ``run_dir``."""
    state = step_lib.init_state(self.model_config, optimizer, mesh, jax.random.key(self.seed))
    if not self.init_from:
      return state
    params, report = finetune.load_pretrained(jax.device_get(state.params), self.init_from)
    finetune.record_loaded(run_dir, self.init_from, report)
    return step_lib.place_state(
      step_lib.TrainState(step=state.step, params=params, opt_state=optimizer.init(params)), mesh
    )

  def restored(self, state: step_lib.TrainState, run_dir: str) -> step_lib.TrainState:
    """A state restored from a checkpoint, completed with what a checkpoint does not hold
    (nothing: it holds every parameter)."""
    return state

  def base_params(self, graphdef: nnx.GraphDef, state: step_lib.TrainState):
    """The base architecture's parameters of ``state``."""
    return state.params

  def summary(self, state: step_lib.TrainState) -> dict[str, Any]:
    """What ``final.json`` records of the method (nothing for full training)."""
    return {}

  def restore_base(self, rd: runs.RunDir, best: bool = False) -> tuple[Any, int]:
    """``(params, step)``: the base architecture's parameters of ``rd``'s latest (or best)
    intact checkpoint."""
    return runs.restore_params(rd.checkpoint_dir, self.model_config, best=best)


@dataclasses.dataclass(frozen=True)
class LoRA:
  """Only adapters (and a classification head) train; the base is ``train.seed``'s
  initialisation with ``model.init_from``'s tensors loaded, rebuilt identically on resume."""

  model_config: models.ModelConfig
  seed: int
  init_from: str | None
  config: lora_lib.LoRAConfig

  def graphdef(self, mesh=None, backend=None) -> nnx.GraphDef:
    """The adapted model's graph (its adapters are parameters too), as :meth:`Full.graphdef`."""
    return nnx.split(lora_lib.abstract(self.model_config, self.config, mesh, backend))[0]

  def abstract_state(self, optimizer, mesh) -> step_lib.TrainState:
    """The train state as sharded shapes, ``frozen`` included."""
    _, trainable, frozen = lora_lib.split(lora_lib.abstract(self.model_config, self.config))
    state = step_lib.TrainState(
      step=jax.ShapeDtypeStruct((), jnp.int32),
      params=trainable,
      opt_state=jax.eval_shape(optimizer.init, trainable),
      frozen=frozen,
    )
    return jax.tree.map(
      lambda a, s: jax.ShapeDtypeStruct(a.shape, a.dtype, sharding=s),
      state,
      step_lib.state_shardings(state, mesh),
    )

  def start(self) -> tuple[Any, Any, dict | None]:
    """``(trainable, frozen, report)`` at step 0: the base from ``seed`` (``init_from``'s tensors
    loaded into it), adapters with B = 0, split by ``lora.TRAINABLE``. A pure function of the
    method, so a resumed run rebuilds the same frozen base. ``report``: see
    ``finetune.load_pretrained`` (None without ``init_from``)."""
    full = jax.jit(
      lambda k: nnx.state(lora_lib.create(self.model_config, self.config, k), nnx.Param)
    )(jax.random.key(self.seed))
    report = None
    if self.init_from:
      full, report = finetune.load_pretrained(jax.device_get(full), self.init_from)
    trainable, frozen = nnx.split_state(full, lora_lib.TRAINABLE, nnx.Param)
    return trainable, frozen, report

  def _begin(self, run_dir: str):
    """:meth:`start`, with ``init_from``'s report written to ``run_dir`` and how many
    parameters train printed."""
    trainable, frozen, report = self.start()
    if report is not None:
      finetune.record_loaded(run_dir, self.init_from, report)
    n = lora_lib.count(trainable, frozen)
    log0(
      f"LoRA rank {self.config.rank} on {', '.join(self.config.targets)}: "
      f"{n['trainable']:,} of {n['total']:,} parameters train ({100 * n['fraction']:.2f}%)"
    )
    return trainable, frozen

  def fresh_state(self, optimizer, mesh, run_dir: str) -> step_lib.TrainState:
    """The placed state of step 0: fresh adapters over the base."""
    trainable, frozen = self._begin(run_dir)
    return step_lib.place_state(
      step_lib.TrainState(
        step=np.int32(0), params=trainable, opt_state=optimizer.init(trainable), frozen=frozen
      ),
      mesh,
    )

  def restored(self, state: step_lib.TrainState, run_dir: str) -> step_lib.TrainState:
    """A state restored from a checkpoint (adapters and their optimizer state), completed with
    the rebuilt frozen base."""
    _, frozen = self._begin(run_dir)
    return state.replace(frozen=frozen)

  def base_params(self, graphdef: nnx.GraphDef, state: step_lib.TrainState):
    """The base architecture's parameters of ``state``: its adapters merged in."""
    return lora_lib.merged_params(graphdef, state.params, state.frozen)

  def summary(self, state: step_lib.TrainState) -> dict[str, Any]:
    """``{"lora": counts}``: trainable, total and the fraction."""
    return {"lora": lora_lib.count(state.params, state.frozen)}

  def restore_base(self, rd: runs.RunDir, best: bool = False) -> tuple[Any, int]:
    """``(params, step)``: the base architecture's parameters of ``rd``'s latest (or best)
    checkpoint, adapters merged into the rebuilt base."""
    _, trainable_abs, _ = lora_lib.split(lora_lib.abstract(self.model_config, self.config))
    trainable, step = runs.restore_params(
      rd.checkpoint_dir, self.model_config, best=best, target=trainable_abs
    )
    graphdef = nnx.split(lora_lib.abstract(self.model_config, self.config))[0]
    return lora_lib.merged_params(graphdef, trainable, self.start()[1]), step


Method = Full | LoRA


def method_of(exp: Experiment, model_config: models.ModelConfig) -> Method:
  """The method ``exp`` trains ``model_config`` with: LoRA when ``train.lora`` is set."""
  t = exp.train
  init_from = exp.model.get("init_from")
  if t.lora is not None:
    return LoRA(model_config, t.seed, init_from, t.lora)
  return Full(model_config, t.seed, init_from)


def stored_method(rd: runs.RunDir, model_config: models.ModelConfig | None = None) -> Method:
  """The method of the run in ``rd``, from its ``config.yaml`` (a directory without one, such as
  one ``tjax convert`` wrote, trained every parameter).

  Raises:
    ValueError: no model config, or a stored experiment that does not validate (naming the file).
  """
  config = model_config or rd.require_model()
  raw = rd.read_config()
  train = (raw or {}).get("train")
  if not isinstance(train, dict) or not train.get("lora"):
    return Full(config, 0)
  exp = load_experiment(None, raw={**raw, "run_dir": rd.path}, source=rd.file(runs.CONFIG))
  return method_of(exp, config)


def load_base(run_dir: str | os.PathLike, *, best: bool = False):
  """``(config, params)`` of a run directory's latest (or best) checkpoint in the base
  architecture: a LoRA run's adapters merged into its rebuilt base."""
  rd = runs.RunDir(run_dir)
  method = stored_method(rd)
  params, _ = method.restore_base(rd, best)
  return method.model_config, params
