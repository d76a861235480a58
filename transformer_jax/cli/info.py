"""``tjax info``: a preset's parameters, training FLOPs per token and memory estimate, a prepared
dataset's size, or (no argument) the table of presets."""

from __future__ import annotations

import os


def _human(n: float) -> str:
  for unit, div in (("T", 1e12), ("B", 1e9), ("M", 1e6), ("K", 1e3)):
    if abs(n) >= div:
      return f"{n / div:.2f}{unit}"
  return f"{n:.0f}"


def _bytes(n: float) -> str:
  for unit, div in (("TiB", 2**40), ("GiB", 2**30), ("MiB", 2**20), ("KiB", 2**10)):
    if n >= div:
      return f"{n / div:.2f} {unit}"
  return f"{n:.0f} B"


def info_text(
  preset: str, *, vocab_size: int | None = None, batch_size: int = 8, seq_len: int | None = None
) -> str:
  """What ``tjax info PRESET`` prints: parameters, training FLOPs per token, memory estimate."""
  from transformer_jax import models

  overrides = {} if vocab_size is None else {"vocab_size": vocab_size}
  cfg = models.get_config(preset, **overrides)
  seq_len = min(cfg.max_len, 1024) if seq_len is None else seq_len
  pc = models.param_count(cfg)
  flops = models.train_flops_per_token(cfg, seq_len)
  mem = models.train_memory_bytes(cfg, batch_size, seq_len)
  lines = [
    f"{preset}: {type(cfg).__name__}",
    f"  parameters        {pc.total:>16,d}  ({_human(pc.total)})",
    f"  embedding         {pc.embedding:>16,d}",
    f"  non-embedding     {pc.non_embedding:>16,d}  ({_human(pc.non_embedding)})",
    *(
      [f"  active per token  {pc.active:>16,d}  ({_human(pc.active)}; chosen experts only)"]
      if pc.inactive
      else []
    ),
    f"  train FLOPs/token {flops:>16,.0f}  ({_human(flops)}; 6N + attention at T={seq_len})",
    f"  memory estimate   batch={batch_size} seq_len={seq_len}, AdamW fp32, dtype={cfg.dtype}:",
  ]
  lines += [f"    {k:<12s}{_bytes(v):>14s}" for k, v in mem.items()]
  return "\n".join(lines)


def dataset_text(
  path: str, *, steps: int | None = None, batch_size: int = 8, seq_len: int | None = None
) -> str:
  """What ``tjax info DATASET_DIR`` prints: each split's tokens, documents, shards and bytes, and
  with ``steps`` the epochs of the train split that many batches read (``data.dataset_facts``)."""
  from transformer_jax.data import estimate
  from transformer_jax.data.layout import read_metadata

  try:
    meta = read_metadata(path)
  except FileNotFoundError as e:
    raise ValueError(str(e)) from None
  if steps is not None and meta["task"] in ("gpt", "bert") and seq_len is None:
    raise ValueError(f"the epochs of a {meta['task']} dataset need --seq-len")
  facts = estimate.dataset_facts(path, steps=steps, batch_size=batch_size, seq_len=seq_len)
  lines = [f"{path}: {facts['task']} dataset, tokenizer {meta['tokenizer']}"]
  width = max(map(len, facts["splits"]))
  for name, split in facts["splits"].items():
    lines.append(f"  {name:<{width}s}  {estimate.describe_facts(split)}")
  if "epochs" in facts:
    shape = f"{steps} steps of {batch_size}" + (f" x {seq_len}" if seq_len else "")
    lines.append(f"  {shape}: {facts['epochs']:.3g} epoch(s) of train")
  return "\n".join(lines)


def presets_table() -> str:
  """What ``tjax info`` prints without a preset: each preset's family and parameter count."""
  from transformer_jax import models

  names = models.list_presets()
  families = {name: type(models.get_config(name)).__name__ for name in names}
  # Each column as wide as its longest entry, two spaces apart.
  w_name = max(map(len, ["preset", *names])) + 2
  w_family = max(map(len, ["family", *families.values()])) + 2
  rows = [f"{'preset':<{w_name}s}{'family':<{w_family}s}{'parameters':>16s}"]
  for name in names:
    count = models.count_params(models.get_config(name))
    rows.append(f"{name:<{w_name}s}{families[name]:<{w_family}s}{count:>16,d}")
  return "\n".join(rows)


def _cmd_info(args) -> int:
  for flag, value in (
    ("--steps", args.steps),
    ("--batch-size", args.batch_size),
    ("--seq-len", args.seq_len),
    ("--vocab-size", args.vocab_size),
  ):
    if value is not None and value < 1:
      raise ValueError(f"{flag} {value}: expected an integer >= 1")
  if args.preset is None:
    print(presets_table())
    return 0
  if os.path.isdir(args.preset):
    print(
      dataset_text(args.preset, steps=args.steps, batch_size=args.batch_size, seq_len=args.seq_len)
    )
    return 0
  if args.steps is not None:
    raise ValueError("--steps is for a prepared dataset (tjax info DATASET_DIR --steps N)")
  print(
    info_text(
      args.preset, vocab_size=args.vocab_size, batch_size=args.batch_size, seq_len=args.seq_len
    )
  )
  return 0


def add_commands(sub, common) -> None:
  """Adds ``info`` to the ``tjax`` subcommands ``sub`` (see ``build_parser``)."""
  info = sub.add_parser(
    "info",
    help="parameters, FLOPs and memory of a preset (no preset: list), or a prepared dataset's size",
  )
  info.add_argument("preset", nargs="?", help="a preset, or a prepared dataset's folder")
  info.add_argument(
    "--steps", type=int, default=None, help="dataset: the epochs this many batches read"
  )
  info.add_argument("--vocab-size", type=int, default=None)
  info.add_argument("--batch-size", type=int, default=8)
  info.add_argument("--seq-len", type=int, default=None)
  info.set_defaults(func=_cmd_info)
