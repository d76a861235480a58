"""The ``tjax`` command: ``info``, ``prepare``, ``train``, ``eval``, ``generate``, ``fill-mask``,
``convert``, ``bench``."""

from __future__ import annotations

import argparse
import sys


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


def info_text(preset: str, *, vocab_size: int | None = None, batch_size: int = 8,
              seq_len: int | None = None) -> str:
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
      f"  train FLOPs/token {flops:>16,.0f}  ({_human(flops)}; 6N + attention at T={seq_len})",
      f"  memory estimate   batch={batch_size} seq_len={seq_len}, AdamW fp32, dtype={cfg.dtype}:",
  ]
  lines += [f"    {k:<12s}{_bytes(v):>14s}" for k, v in mem.items()]
  return "\n".join(lines)


def presets_table() -> str:
  from transformer_jax import models

  rows = [f"{'preset':<18s}{'family':<15s}{'parameters':>16s}"]
  for name in models.list_presets():
    cfg = models.get_config(name)
    rows.append(f"{name:<18s}{type(cfg).__name__:<15s}{models.count_params(cfg):>16,d}")
  return "\n".join(rows)


def _cmd_info(args) -> int:
  if args.preset is None:
    print(presets_table())
    return 0
  print(info_text(args.preset, vocab_size=args.vocab_size, batch_size=args.batch_size,
                  seq_len=args.seq_len))
  return 0


def _cmd_prepare(args) -> int:
  from transformer_jax.data import run_prepare
  return run_prepare(args)


def _cmd_train(args) -> int:
  if args.dry_run:
    return _dry_run(args)
  from transformer_jax.parallel import distributed
  # Before anything touches JAX: a multi-process job must be joined before its backend starts.
  if distributed.initialize(args.coordinator_address, args.num_processes, args.process_id,
                            auto=args.distributed):
    distributed.log_topology()
  from transformer_jax.train import TrainingDiverged, load_experiment, train
  exp = load_experiment(args.config, args.overrides)
  try:
    final = train(exp, progress=not args.no_progress)
  except TrainingDiverged as e:
    print(f"tjax train: {e}", file=sys.stderr)
    return 1
  failed = [name for name, r in final.get("bars", {}).items() if not r["passed"]]
  if failed:
    print(f"tjax train: learning bar(s) not reached: {', '.join(failed)}", file=sys.stderr)
    return 3
  return 0


def _dry_run(args) -> int:
  from transformer_jax.train import load_experiment
  from transformer_jax.train import dry_run as dry
  exp = load_experiment(args.config, args.overrides)
  dry.simulate_devices(exp, args.devices)   # before JAX starts its backend
  print(dry.format_report(dry.dry_run(exp)))
  return 0


def _cmd_eval(args) -> int:
  import json
  from transformer_jax.train import evaluate_run
  print(json.dumps(evaluate_run(args.run_dir, args.overrides, best=args.best), indent=2))
  return 0


def _cmd_generate(args) -> int:
  from transformer_jax.generate.commands import run_generate
  return run_generate(args)


def _cmd_fill_mask(args) -> int:
  from transformer_jax.generate.commands import run_fill_mask
  return run_fill_mask(args)


def _cmd_convert(args) -> int:
  from transformer_jax.hf import convert
  if (args.from_hf is None) == (args.to_hf is None):
    raise ValueError("give exactly one of --from-hf HF_DIR or --to-hf RUN_DIR")
  if args.from_hf is not None:
    convert.from_hf(args.from_hf, args.out)
  else:
    convert.to_hf(args.to_hf, args.out)
  print(f"wrote {args.out}")
  return 0


def _cmd_bench(args) -> int:
  import runpy
  import os
  script = os.path.join(os.getcwd(), "experiments", "bench_train.py")
  if not os.path.exists(script):
    raise ValueError("tjax bench runs experiments/bench_train.py from the repository root")
  sys.argv = [script, *args.bench_args]
  runpy.run_path(script, run_name="__main__")
  return 0


def build_parser() -> argparse.ArgumentParser:
  parser = argparse.ArgumentParser(prog="tjax", description=__doc__)
  sub = parser.add_subparsers(dest="command", required=True)

  info = sub.add_parser("info", help="parameters, FLOPs and memory of a preset (no preset: list)")
  info.add_argument("preset", nargs="?")
  info.add_argument("--vocab-size", type=int, default=None)
  info.add_argument("--batch-size", type=int, default=8)
  info.add_argument("--seq-len", type=int, default=None)
  info.set_defaults(func=_cmd_info)

  from transformer_jax.data import add_prepare_args
  prep = sub.add_parser("prepare", help="tokenize text/jsonl/TSV/stdlib/synthetic into a dataset")
  add_prepare_args(prep)
  prep.set_defaults(func=_cmd_prepare)

  train = sub.add_parser("train", help="train (or resume) an experiment: CONFIG.yaml key=value ...")
  train.add_argument("config")
  train.add_argument("overrides", nargs="*", help="dotted overrides, e.g. train.steps=200")
  train.add_argument("--no-progress", action="store_true", help="no tqdm progress bar")
  train.add_argument("--distributed", action="store_true",
                     help="multi-process: jax.distributed.initialize() detects the cluster (TPU "
                     "pod, SLURM, Open MPI)")
  train.add_argument("--coordinator-address", metavar="HOST:PORT", default=None,
                     help="multi-process: process 0's address (else $JAX_COORDINATOR_ADDRESS)")
  train.add_argument("--num-processes", metavar="N", type=int, default=None,
                     help="multi-process: number of processes (else $JAX_NUM_PROCESSES)")
  train.add_argument("--process-id", metavar="I", type=int, default=None,
                     help="multi-process: this process's id in [0, N) (else $JAX_PROCESS_ID)")
  train.add_argument("--dry-run", action="store_true",
                     help="compile the train step for the configured mesh on simulated CPU devices "
                     "and print per-device memory; trains nothing, reads no data")
  train.add_argument("--devices", metavar="N", type=int, default=None,
                     help="--dry-run: devices to simulate (default: the product of the mesh sizes)")
  train.set_defaults(func=_cmd_train)

  ev = sub.add_parser("eval", help="evaluate a run directory's latest (or best) checkpoint")
  ev.add_argument("run_dir")
  ev.add_argument("overrides", nargs="*", help="e.g. data.path=DIR for a converted checkpoint")
  ev.add_argument("--best", action="store_true")
  ev.set_defaults(func=_cmd_eval)

  from transformer_jax.generate.commands import add_fill_mask_args, add_generate_args
  gen = sub.add_parser("generate", help="continue a prompt with a run's model (sampling or beams)")
  add_generate_args(gen)
  gen.set_defaults(func=_cmd_generate)

  fill = sub.add_parser("fill-mask", help="a BERT run's top candidates for each [MASK] in a text")
  add_fill_mask_args(fill)
  fill.set_defaults(func=_cmd_fill_mask)

  conv = sub.add_parser("convert", help="Hugging Face checkpoint <-> run directory")
  conv.add_argument("--from-hf", metavar="HF_DIR")
  conv.add_argument("--to-hf", metavar="RUN_DIR")
  conv.add_argument("--out", required=True)
  conv.set_defaults(func=_cmd_convert)

  bench = sub.add_parser("bench", help="time the train step (experiments/bench_train.py)")
  bench.add_argument("bench_args", nargs=argparse.REMAINDER)
  bench.set_defaults(func=_cmd_bench)
  return parser


def main(argv: list[str] | None = None) -> int:
  args = build_parser().parse_args(argv)
  try:
    return args.func(args)
  except ValueError as e:  # bad input: one clear line, no traceback
    print(f"tjax {args.command}: error: {e}", file=sys.stderr)
    return 2


if __name__ == "__main__":
  sys.exit(main())
