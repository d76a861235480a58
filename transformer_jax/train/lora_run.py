"""A LoRA run's state: trainable adapters (and head) in ``TrainState.params``, the frozen base in
``TrainState.frozen`` (rebuilt from ``train.seed`` and ``model.init_from``, never checkpointed)."""

from __future__ import annotations

import jax
import jax.numpy as jnp
from flax import nnx

from transformer_jax import lora as lora_lib
from transformer_jax import runs
from transformer_jax.train import finetune
from transformer_jax.train import step as step_lib
from transformer_jax.train.console import log0
from transformer_jax.train.plan import Run


def all_params(state: step_lib.TrainState):
  """Every parameter of the model a state trains (a LoRA run's adapters and frozen base)."""
  return state.params if state.frozen is None else nnx.merge_state(state.params, state.frozen)


def base_params(run: Run, state: step_lib.TrainState):
  """The base architecture's parameters of ``state`` (a LoRA run's adapters merged in): what
  samples and learning bars run."""
  if state.frozen is None:
    return state.params
  return lora_lib.merged_params(run.graphdef, state.params, state.frozen)


def start(run: Run, rd: runs.RunDir):
  """``(trainable, frozen)`` of a LoRA run at step 0, split by ``lora.TRAINABLE``; prints how many
  parameters train."""
  cfg, lcfg = run.model_config, run.exp.train.lora
  init_from = run.exp.model.get("init_from")
  trainable, frozen, report = finetune.lora_start(cfg, lcfg, run.exp.train.seed, init_from)
  if report is not None:
    finetune.record_loaded(rd.path, init_from, report)
  n = lora_lib.count(trainable, frozen)
  log0(f"LoRA rank {lcfg.rank} on {', '.join(lcfg.targets)}: {n['trainable']:,} of "
       f"{n['total']:,} parameters train ({100 * n['fraction']:.2f}%)")
  return trainable, frozen


def abstract_state(run: Run) -> step_lib.TrainState:
  """A LoRA run's train state as sharded shapes (``frozen`` included): the restore target."""
  _, trainable, frozen = lora_lib.split(lora_lib.abstract(run.model_config, run.exp.train.lora))
  state = step_lib.TrainState(step=jax.ShapeDtypeStruct((), jnp.int32), params=trainable,
                              opt_state=jax.eval_shape(run.optimizer.init, trainable),
                              frozen=frozen)
  return jax.tree.map(lambda a, s: jax.ShapeDtypeStruct(a.shape, a.dtype, sharding=s), state,
                      step_lib.state_shardings(state, run.mesh))
