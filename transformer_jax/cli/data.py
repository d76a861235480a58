"""``tjax data CONFIG --steps A:B``: the source and document of every row of the training batches
of steps ``A`` to ``B - 1``, from the experiment and its prepared data alone (no model, no
compile)."""

from __future__ import annotations

import json
import os


def parse_steps(text: str) -> range:
  """``"A:B"`` -> ``range(A, B)``; ``"N"`` -> ``range(N, N + 1)``.

  Raises:
    ValueError: not two integers ``0 <= A < B`` (or one ``N >= 0``), naming ``--steps``.
  """
  parts = text.split(":")
  try:
    bounds = [int(p) for p in parts]
  except ValueError:
    bounds = []
  if len(parts) == 1 and len(bounds) == 1:
    bounds.append(bounds[0] + 1)
  if len(bounds) != 2 or not 0 <= bounds[0] < bounds[1]:
    raise ValueError(f"--steps {text!r}: expected A:B with integers 0 <= A < B (steps A to B-1)")
  return range(*bounds)


def training_loader(exp):
  """The training loader of ``exp``'s GPT task over its prepared data, as one process sees the
  global batch (``process_count=1``): a mixture's, or the GPT loader of ``data.path``.

  Raises:
    ValueError: another task than gpt, or a dataset that is not prepared.
  """
  from transformer_jax import data as data_lib

  d, t = exp.data, exp.train
  if d.task != "gpt":
    raise ValueError(f"tjax data shows GPT training windows; data.task={d.task!r}")
  one = {"process_index": 0, "process_count": 1}
  if d.mixture:
    return data_lib.load_mixture(
      d.mixture,
      d.stages,
      batch_size=t.batch_size,
      seq_len=t.seq_len,
      seed=t.seed,
      max_epochs=d.max_epochs,
      **one,
    )
  path = d.path or os.path.join(exp.run_dir, "data")
  if not os.path.isfile(os.path.join(path, data_lib.METADATA_FILE)):
    raise ValueError(f"data.path={path!r} holds no prepared dataset (tjax prepare makes one)")
  dataset = data_lib.load_dataset(path)
  return data_lib.GPTLoader(dataset, batch_size=t.batch_size, seq_len=t.seq_len, seed=t.seed, **one)


def _cmd_data(args) -> int:
  from transformer_jax import data as data_lib
  from transformer_jax.train.config import load_experiment

  steps = parse_steps(args.steps)
  loader = training_loader(load_experiment(args.config, args.overrides))
  for step in steps:
    rows = data_lib.row_documents(loader, step)
    if args.json:
      out = {"step": step, "rows": [{"source": s, "document": d} for s, d in rows]}
      print(json.dumps(out), flush=True)
    else:
      print(f"step {step}: " + " ".join(f"{s}:{d}" for s, d in rows), flush=True)
  return 0


def add_commands(sub, common) -> None:
  """Adds ``data`` to the ``tjax`` subcommands ``sub`` (see ``build_parser``)."""
  data = sub.add_parser(
    "data", help="the source and document of every training row: CONFIG --steps A:B key=value ..."
  )
  data.add_argument("config")
  data.add_argument("overrides", nargs="*", help="dotted overrides, as tjax train takes them")
  data.add_argument("--steps", required=True, metavar="A:B", help="steps A to B-1 (or one step N)")
  data.add_argument(
    "--json",
    action="store_true",
    help='one line per step: {"step": N, "rows": [{"source": NAME, "document": INDEX}, ...]}',
  )
  data.set_defaults(func=_cmd_data)
