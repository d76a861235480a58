"""Training: experiment configs, Optax steps, checkpoints and the ``tjax train`` path (config ->
plan -> state -> loop)."""

from transformer_jax.runs import Checkpoints, load_model, save_model
from transformer_jax.train.config import Experiment, TrainConfig, load_experiment
from transformer_jax.train.optim import learning_rate_schedule, make_optimizer
from transformer_jax.parallel.mesh import make_mesh
from transformer_jax.train.step import (
  TrainState,
  create_state,
  make_eval_step,
  make_train_step,
  shard_batch,
)
from transformer_jax.train.divergence import TrainingDiverged
from transformer_jax.train.evaluation import evaluate_run
from transformer_jax.train.plan import Plan, make_plan
from transformer_jax.train.trainer import train
from transformer_jax.train.tuned import Step, make_step

__all__ = [
  "Checkpoints",
  "Experiment",
  "Plan",
  "Step",
  "TrainConfig",
  "TrainState",
  "TrainingDiverged",
  "create_state",
  "evaluate_run",
  "learning_rate_schedule",
  "load_experiment",
  "load_model",
  "make_eval_step",
  "make_mesh",
  "make_optimizer",
  "make_plan",
  "make_step",
  "make_train_step",
  "save_model",
  "shard_batch",
  "train",
]
