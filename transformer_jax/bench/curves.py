"""``tjax bench train --curve-steps``: float32 and bfloat16 trained from the same weights on the
same batches of real text, the bfloat16 loss curve against float32's."""

from __future__ import annotations

import dataclasses
import os
import statistics

from transformer_jax import data as data_lib
from transformer_jax.bench.train_sides import Ours
from transformer_jax.models.config import GPTConfig
from transformer_jax.train.config import TrainConfig


def loss_curves(
  config, steps: int, batch_size: int, seq_len: int, seed: int, data_dir: str | None = None
) -> dict:
  """float32 and bfloat16 each trained ``steps`` steps from the same initial weights on the same
  batches of real text, with the same schedule (AdamW, 6e-4 peak, linear warmup over a tenth of the
  steps, cosine decay): the bfloat16 mode's loss curve against float32's.

  The text is the embedded corpus (the Python standard library's sources, ``tjax prepare stdlib``)
  in cl100k ids renumbered densely by frequency, so they fit the preset's vocabulary; it is
  prepared once in ``data_dir`` (default ``runs/data/stdlib-VOCAB``). The curves are compared
  through their 10-step trailing means (single steps' losses swing with their batch):
  ``max_relative_gap`` is the largest ``|bf16 - fp32| / fp32`` of those means.
  """

  if not isinstance(config, GPTConfig):
    raise ValueError(
      f"--curve-steps trains on text with the GPT task; {type(config).__name__} is not a GPT preset"
    )
  out = data_dir or os.path.join("runs", "data", f"stdlib-{config.vocab_size}")
  # The most frequent ids, plus the separator and the special tokens, fill at most vocab_size.
  keep = config.vocab_size - len(data_lib.SPECIAL_TOKENS) - 1
  data_lib.prepare(["stdlib"], out, compact_vocab=keep, progress=False)
  dataset = data_lib.load_dataset(out)
  if dataset.vocab_size > config.vocab_size:
    raise ValueError(f"{out}: {dataset.vocab_size} ids do not fit vocab_size={config.vocab_size}")
  loader = data_lib.GPTLoader(dataset, batch_size=batch_size, seq_len=seq_len, seed=seed)
  batches = [loader.batch_at(i) for i in range(steps)]
  tcfg = TrainConfig(
    steps=steps,
    batch_size=batch_size,
    seq_len=seq_len,
    seed=seed,
    lr=6e-4,
    warmup_steps=max(1, steps // 10),
    schedule="cosine",
  )
  curves = {}
  for dtype in ("float32", "bfloat16"):
    side = Ours(
      dataclasses.replace(config, dtype=dtype), batches[0], "gpt", tcfg.lr, seed, tcfg=tcfg
    )
    for batch in batches:
      side.step(batch)
    curves[dtype] = side.losses
    del side

  def mean10(xs):
    return [statistics.fmean(xs[max(0, i - 9) : i + 1]) for i in range(len(xs))]

  gaps = [abs(b - f) / f for f, b in zip(mean10(curves["float32"]), mean10(curves["bfloat16"]))]
  return {
    "steps": steps,
    "data": out,
    "ids_used": dataset.vocab_size,
    "lr": tcfg.lr,
    "warmup_steps": tcfg.warmup_steps,
    "schedule": tcfg.schedule,
    "losses": curves,
    "relative_gap_10_step_mean": gaps,
    "max_relative_gap": max(gaps),
    "final_relative_gap": gaps[-1],
  }
