"""Our sides of ``tjax bench train``: the command's jitted step (``Ours``) and the step a library
user writes from the README (``Library``), both on a batch shaped like the loaders' output
(``random_batch``), built once on the host.
"""

from __future__ import annotations

import time

import jax
import numpy as np

from transformer_jax import backends, models, parallel, runtime
from transformer_jax.models.config import BERTConfig, GPTConfig, MambaConfig, Seq2SeqConfig
from transformer_jax.train import step as step_lib
from transformer_jax.train import tasks as tasks_lib
from transformer_jax.train.config import TrainConfig
from transformer_jax.train.optim import make_optimizer


def random_batch(config, batch: int, seq_len: int, seed: int) -> tuple[dict[str, np.ndarray], str]:
  """A batch shaped like the loaders' output for ``config``'s family, and the task's name."""
  rng = np.random.default_rng(seed)
  ids = lambda: rng.integers(0, config.vocab_size, (batch, seq_len), dtype=np.int32)  # noqa: E731
  match config:
    case GPTConfig() | MambaConfig():
      return {
        "tokens": ids(),
        "labels": ids(),
        "segment_ids": np.ones((batch, seq_len), np.int32),
        "positions": np.tile(np.arange(seq_len, dtype=np.int32), (batch, 1)),
        "loss_mask": np.ones((batch, seq_len), bool),
      }, "gpt"
    case BERTConfig():
      token_types = np.zeros((batch, seq_len), np.int32)
      token_types[:, seq_len // 2 :] = 1
      mlm_mask = rng.random((batch, seq_len)) < 0.15
      mlm_mask[:, 0] = True
      return {
        "tokens": ids(),
        "token_types": token_types,
        "attention_mask": np.ones((batch, seq_len), bool),
        "mlm_labels": np.where(mlm_mask, ids(), 0).astype(np.int32),
        "mlm_mask": mlm_mask,
        "nsp_labels": rng.integers(0, 2, (batch,), dtype=np.int32),
      }, "bert"
    case Seq2SeqConfig():
      return {
        "src": ids(),
        "src_mask": np.ones((batch, seq_len), bool),
        "tgt_in": ids(),
        "tgt_out": ids(),
        "tgt_mask": np.ones((batch, seq_len), bool),
      }, "seq2seq"
  raise TypeError(f"not a model config: {type(config).__name__}")


class Ours:
  """The project's jitted train step on a one-device mesh."""

  def __init__(
    self,
    config,
    host_batch,
    task_name: str,
    lr: float,
    seed: int,
    tcfg=None,
    table: backends.KernelTable | None = None,
  ):
    """``table``: the kernel table the model and step are built with (default the library's)."""

    self.config = config
    mesh = parallel.make_mesh({"data": -1})
    task = tasks_lib.get_task(task_name)
    self._shard = lambda batch: step_lib.shard_batch(batch, mesh, task.keys)
    b, t = host_batch["tokens"].shape if "tokens" in host_batch else host_batch["src"].shape
    tcfg = tcfg or TrainConfig(
      steps=1000, batch_size=b, seq_len=t, seed=seed, lr=lr, warmup_steps=0, schedule="constant"
    )
    optimizer = make_optimizer(tcfg)
    self.params = models.init(config, jax.random.key(seed))
    state = jax.device_put(step_lib.create_state(self.params, optimizer), step_lib.replicated(mesh))
    self.batch = self._shard(host_batch)
    backend = backends.current(table)
    graphdef = models.graphdef(config, mesh, backend)
    times = {}

    def compile_for(m):  # the step a run would take: train.microbatches' "auto" rule on CPU
      jitted = step_lib.jit_train_step(
        step_lib.make_train_step(graphdef, task, optimizer, seed=seed, microbatches=m),
        mesh,
        state,
        backend=backend,
      )
      start = time.perf_counter()
      lowered = jitted.lower(state, self.batch)
      mid = time.perf_counter()
      compiled = lowered.compile()
      times[m] = (mid - start, time.perf_counter() - mid)
      return compiled

    self.microbatches, self.step_fn = step_lib.pick_microbatches(
      tcfg.microbatches, compile_for, b, backend=backend
    )
    self.trace_s, self.compile_s = times[self.microbatches]
    # Every count the rule compiled (a step over the limit is compiled whole first).
    self.compile_s_by_microbatches = {m: c for m, (_, c) in times.items()}
    # The jitted step is held (jit_train_step); this ahead-of-time executable is another one.
    backend.hold(self.step_fn, backend.step_compiler_options())
    # XLA:CPU takes a step's temporaries as one block per call (see backends.cpu.microbatches).
    self.temp_bytes = runtime.temp_bytes(self.step_fn)
    self.state = state
    self.losses: list[float] = []

  def step(self, host_batch=None) -> float:
    """One training step (on ``host_batch`` if given, else on the batch it was built with)."""
    batch = self.batch if host_batch is None else self._shard(host_batch)
    start = time.perf_counter()
    self.state, metrics = self.step_fn(self.state, batch)
    loss = float(metrics["loss"])  # blocks until the step is done
    self.losses.append(loss)
    return time.perf_counter() - start


class Library:
  """The library user's step: ``train.make_step`` with the optimizer the bench gives ours, a
  state from ``Step.init``, and the host batch handed to every call (as the README's loop does).
  """

  def __init__(self, config, host_batch, task_name: str, lr: float, seed: int):
    from transformer_jax.train import TrainConfig, make_optimizer, make_step  # noqa: PLC0415 - the library side only

    b, t = host_batch["tokens"].shape if "tokens" in host_batch else host_batch["src"].shape
    optimizer = make_optimizer(
      TrainConfig(
        steps=1000, batch_size=b, seq_len=t, seed=seed, lr=lr, warmup_steps=0, schedule="constant"
      )
    )
    self.host_batch = host_batch
    self.step_fn = make_step(config, optimizer, task=task_name, seed=seed)
    self.state = self.step_fn.init(jax.random.key(seed))
    start = time.perf_counter()
    self.step_fn.compile(self.state, host_batch)
    self.trace_s, self.compile_s = 0.0, time.perf_counter() - start  # tracing included
    self.microbatches = self.step_fn.microbatches
    self.temp_bytes = runtime.temp_bytes(self.step_fn.compiled)
    self.losses: list[float] = []

  def step(self) -> float:
    """One training step on the host batch; returns its time."""
    start = time.perf_counter()
    self.state, metrics = self.step_fn(self.state, self.host_batch)
    self.losses.append(float(metrics["loss"]))
    return time.perf_counter() - start
