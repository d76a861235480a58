"""The ``tjax`` command: ``info``, ``prepare``, ``train``, ``eval``, ``generate``, ``fill-mask``,
``convert``, ``bench``, ``report``."""

from __future__ import annotations

import argparse
import os
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
  for flag, value in (
    ("--batch-size", args.batch_size),
    ("--seq-len", args.seq_len),
    ("--vocab-size", args.vocab_size),
  ):
    if value is not None and value < 1:
      raise ValueError(f"{flag} {value}: expected an integer >= 1")
  if args.preset is None:
    print(presets_table())
    return 0
  print(
    info_text(
      args.preset, vocab_size=args.vocab_size, batch_size=args.batch_size, seq_len=args.seq_len
    )
  )
  return 0


def _cmd_prepare(args) -> int:
  from transformer_jax.data import run_prepare

  return run_prepare(args)


def _cmd_train(args) -> int:
  if args.dry_run or args.export_for:
    return _dry_run(args)
  if args.devices is not None:
    raise ValueError(
      f"--devices {args.devices}: --devices is for --dry-run (a real run uses the "
      "devices the machine has)"
    )
  from transformer_jax.parallel import distributed

  # Before anything touches JAX: a multi-process job must be joined before its backend starts.
  if distributed.initialize(
    args.coordinator_address, args.num_processes, args.process_id, auto=args.distributed
  ):
    distributed.log_topology()
  from transformer_jax.train import TrainingDiverged, load_experiment, train

  exp = load_experiment(args.config, args.overrides)
  hint = " ".join(["tjax train", args.config, *args.overrides])
  try:
    final = train(
      exp, progress=False if args.no_progress else None, force_new=args.force_new, resume_hint=hint
    )
  except TrainingDiverged as e:
    print(f"tjax train: {e}", file=sys.stderr)
    return 1
  failed = [name for name, r in final.get("bars", {}).items() if not r["passed"]]
  if failed and args.check_bars:
    print(f"tjax train: learning bar(s) not reached: {', '.join(failed)}", file=sys.stderr)
    return 3
  return 0


def _dry_run(args) -> int:
  from transformer_jax.train import load_experiment
  from transformer_jax.train import dry_run as dry

  exp = load_experiment(args.config, args.overrides)
  dry.simulate_devices(exp, args.devices)  # before JAX starts its backend
  if args.export_for:
    from transformer_jax.train import export

    stem = os.path.splitext(os.path.basename(args.config))[0]
    if export.run(exp, args.export_for, args.export_dir, stem):
      return 1
  if args.dry_run:
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


def _check_bench_out(path: str) -> None:
  """Refuses a ``--json`` path that holds something other than an earlier benchmark's result
  (what ``bench.run`` writes: a JSON object whose ``command`` is a ``tjax bench`` command), before
  the benchmark runs."""
  import json
  import os

  if not path or not os.path.lexists(path):
    return
  if not os.path.isfile(path):
    raise ValueError(f"--json {path} exists and is not a file")
  try:
    with open(path, "rb") as f:
      old = json.loads(f.read().decode("utf-8"))
  except (UnicodeDecodeError, json.JSONDecodeError):
    old = None
  if not (isinstance(old, dict) and str(old.get("command", "")).startswith("tjax bench ")):
    raise ValueError(f"--json {path} exists and is not a tjax bench result; give another path")


def _cmd_bench(args) -> int:
  from transformer_jax import bench

  _check_bench_out(args.json if args.json is not None else bench.default_json(args.kind))
  if args.kind == "generate":
    from transformer_jax.bench import generate

    generate.check_args(args.parser, args)
  raw = args.raw_argv
  rest = raw[raw.index(args.kind) + 1 :] if args.kind in raw else raw
  bench.run(args.kind, args, rest)
  return 0


def _bench_args(kind: str, p: argparse.ArgumentParser) -> None:
  if kind == "train":
    from transformer_jax.bench.train import add_args
  elif kind == "attention":
    from transformer_jax.bench.attention import add_args
  else:
    from transformer_jax.bench.generate import add_args
  add_args(p)


def _cmd_report(args) -> int:
  from transformer_jax.report import write_report

  index = write_report(
    args.run_dirs, args.out, text=args.text, best=args.best, experiments=args.experiment
  )
  print(f"wrote {index}")
  return 0


def build_parser() -> argparse.ArgumentParser:
  parser = argparse.ArgumentParser(prog="tjax", description=__doc__)
  parser.add_argument("-v", "--verbose", action="store_true", help="show the traceback of an error")
  common = argparse.ArgumentParser(add_help=False)  # -v also after the command
  common.add_argument(
    "-v",
    "--verbose",
    action="store_true",
    default=argparse.SUPPRESS,
    help="show the traceback of an error",
  )
  sub = parser.add_subparsers(dest="command", required=True)
  add = sub.add_parser

  def add_parser(name, **kw):
    return add(name, parents=[common], **kw)

  sub.add_parser = add_parser

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
  train.add_argument(
    "--no-progress",
    action="store_true",
    help="plain log lines instead of the tqdm bar (the default without a terminal)",
  )
  train.add_argument(
    "--check-bars",
    action="store_true",
    help="exit 3 when a learning bar of the experiment is not reached (they are always reported)",
  )
  train.add_argument(
    "--force-new",
    action="store_true",
    help="start over in an existing run_dir (what the old run wrote is removed)",
  )
  train.add_argument(
    "--distributed",
    action="store_true",
    help="multi-process: jax.distributed.initialize() detects the cluster (TPU "
    "pod, SLURM, Open MPI)",
  )
  train.add_argument(
    "--coordinator-address",
    metavar="HOST:PORT",
    default=None,
    help="multi-process: process 0's address (else $JAX_COORDINATOR_ADDRESS)",
  )
  train.add_argument(
    "--num-processes",
    metavar="N",
    type=int,
    default=None,
    help="multi-process: number of processes (else $JAX_NUM_PROCESSES)",
  )
  train.add_argument(
    "--process-id",
    metavar="I",
    type=int,
    default=None,
    help="multi-process: this process's id in [0, N) (else $JAX_PROCESS_ID)",
  )
  train.add_argument(
    "--dry-run",
    action="store_true",
    help="compile the train step for the configured mesh on simulated CPU devices "
    "and print per-device memory; trains nothing, reads no data",
  )
  train.add_argument(
    "--devices",
    metavar="N",
    type=int,
    default=None,
    help="--dry-run: devices to simulate (default: the product of the mesh sizes)",
  )
  train.add_argument(
    "--export-for",
    choices=("tpu", "cuda"),
    default=None,
    help="export the train step for this platform from this host (jax.export, "
    "on simulated devices) and check its kernels, shardings and host transfers",
  )
  train.add_argument(
    "--export-dir",
    default=os.path.join("runs", "export"),
    help="--export-for: where the module and its report go",
  )
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

  bench = sub.add_parser("bench", help="benchmarks against PyTorch and the machine's limits")
  kinds = bench.add_subparsers(dest="kind", required=True)
  from transformer_jax.bench import KINDS

  helps = {
    "train": "the training step vs PyTorch eager (interleaved), MFU",
    "generate": "greedy generation vs transformers, share of the bandwidth floor",
    "attention": "attention forward+backward per implementation",
  }
  for kind in KINDS:
    kp = kinds.add_parser(
      kind,
      help=helps[kind],
      parents=[common],
      formatter_class=argparse.ArgumentDefaultsHelpFormatter,
    )
    _bench_args(kind, kp)
    kp.add_argument(
      "--json",
      default=None,
      help="where to write the JSON (default runs/bench/bench_KIND.json under the "
      "current folder; '' writes none)",
    )
    kp.set_defaults(func=_cmd_bench, parser=kp)

  report = sub.add_parser("report", help="one self-contained HTML page (and PNGs) of runs")
  report.add_argument("run_dirs", nargs="*", metavar="RUN_DIR")
  report.add_argument(
    "--experiment",
    action="append",
    default=[],
    metavar="JSON",
    help="also show an experiment's result (experiments/efficient_attention.py)",
  )
  report.add_argument("--text", default=None, help="draw the attention maps for this text")
  report.add_argument("--out", required=True, metavar="DIR", help="writes DIR/index.html")
  report.add_argument("--best", action="store_true", help="the best checkpoint, not the latest")
  report.set_defaults(func=_cmd_report)
  return parser


# Subcommands whose positional ``key=value`` overrides may come after options.
_OVERRIDES = ("train", "eval")
_error_reported = False  # main caught an exception and reported it in one line (see launch)


def _one_line(e: BaseException) -> str:
  """A one-line description of an error, naming the file for I/O errors."""
  from transformer_jax.runs import describe_oserror

  seen = source = e
  while seen is not None and not isinstance(seen, ValueError):  # an OSError wrapped by a library
    if isinstance(seen, OSError):
      if seen.errno is not None:
        return describe_oserror(seen)
      source = seen  # a library's OSError without an errno: its (multi-line) text says what failed
      break
    seen = seen.__cause__ or (None if seen.__suppress_context__ else seen.__context__)
  import re

  text = " ".join(str(source).split()) or type(source).__name__
  # Checkpoint writes go through tensorstore, whose errors carry an absl status and the file.
  file = re.search(r'(?:local )?file "([^"]+)"', text)
  for marks, reason in (
    (("RESOURCE_EXHAUSTED", "No space left"), "no space left on the device"),
    (("PERMISSION_DENIED", "Permission denied"), "permission denied"),
  ):
    if any(m in text for m in marks):
      return f"{file.group(1) if file else text}: {reason}"
  text = text.split(" See full TensorStore details")[0]
  return text if isinstance(e, ValueError) else f"{type(e).__name__}: {text}"


def _drop_closed_loop_reports(unraisable, _default=sys.unraisablehook) -> None:
  # When a checkpoint write fails, tensorstore's pending callbacks reach orbax's closed asyncio
  # loop and each reports "Event loop is closed": echoes of the failure reported in one line.
  if isinstance(unraisable.exc_value, RuntimeError) and "Event loop is closed" in str(
    unraisable.exc_value
  ):
    return
  _default(unraisable)


def main(argv: list[str] | None = None) -> int:
  """Runs one ``tjax`` command. Bad input (``ValueError``, ``OSError``, YAML and checkpoint errors)
  is one line on stderr and exit 2, any other failure one line and exit 1; ``-v`` re-raises with
  the traceback."""
  global _error_reported
  _error_reported = False
  parser = build_parser()
  args, rest = parser.parse_known_args(argv)
  args.raw_argv = list(sys.argv[1:] if argv is None else argv)
  if rest:  # ``tjax train CONFIG --no-progress key=value``: overrides after options
    if args.command in _OVERRIDES and not any(r.startswith("-") for r in rest):
      args.overrides = list(args.overrides) + rest
    else:
      parser.error(f"unrecognized arguments: {' '.join(rest)}")
  if not args.verbose:
    # orbax logs the tracebacks of its background threads through absl; the one line below
    # reports the failure (-v keeps them).
    import logging

    logging.getLogger("absl").setLevel(logging.CRITICAL)
    logging.getLogger("tensorboardX").setLevel(logging.ERROR)  # the guard reports a NaN itself
    sys.unraisablehook = _drop_closed_loop_reports
  from transformer_jax import runtime

  runtime.enable_compilation_cache()
  try:
    return args.func(args)
  except KeyboardInterrupt:
    if args.verbose:
      raise
    print(f"tjax {args.command}: interrupted", file=sys.stderr)
    return 130
  except Exception as e:
    if args.verbose:
      raise
    bad_input = isinstance(e, (ValueError, OSError)) or type(e).__module__.startswith(
      ("yaml", "orbax", "tensorstore")
    )
    hint = "" if bad_input else " (-v for the traceback)"
    print(f"tjax {args.command}: error: {_one_line(e)}{hint}", file=sys.stderr)
    _error_reported = True
    return 2 if bad_input else 1


def launch() -> None:
  """The ``tjax`` program: when it will compute on CPU, runs itself again over mimalloc
  (``backends.cpu.allocator.allocator_env``; ``TJAX_MALLOC=0`` keeps the system allocator) or,
  without mimalloc installed, says once on stderr that it runs on the system allocator
  (``backends.cpu.allocator.system_allocator_notice``); then ``main``."""
  import os

  from transformer_jax.backends.cpu import allocator

  try:
    env = allocator.allocator_env()
  except ValueError as e:  # a bad TJAX_MALLOC: one line, before anything runs
    print(f"tjax: error: {e}", file=sys.stderr)
    sys.exit(2)
  if env is not None:
    try:
      os.execve(sys.executable, [sys.executable, "-m", "transformer_jax.cli", *sys.argv[1:]], env)
    except OSError:
      pass  # run on as we are
  elif (notice := allocator.system_allocator_notice()) is not None:
    print(notice, file=sys.stderr)
  global _error_reported
  _error_reported = False
  code = main()
  if _error_reported:
    _quiet_after_the_error()
  sys.exit(code)


def _quiet_after_the_error() -> None:
  """Sends whatever the process writes to stderr from now on to /dev/null: the error has been
  reported in one line, and what abandoned background work prints at exit (orbax's save thread,
  tensorstore's pending writes reaching a closed event loop, with tracebacks hundreds of lines
  long) only echoes it. Only after a caught exception: ``-v`` re-raises before this point and
  keeps everything, and other non-zero exits (a diverged run, an unmet learning bar) too."""
  import os

  sys.stderr.flush()
  devnull = os.open(os.devnull, os.O_WRONLY)
  os.dup2(devnull, sys.stderr.fileno())  # C++ logging writes to fd 2 directly
  os.close(devnull)


if __name__ == "__main__":
  launch()
