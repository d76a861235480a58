"""``tjax train`` (also ``--dry-run`` and ``--export-for``) and ``tjax eval``: an experiment's
training, its compile-only checks, and a run directory's evaluation."""

from __future__ import annotations

import os
import sys


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
      exp,
      progress=False if args.no_progress else None,
      force_new=args.force_new,
      resume_hint=hint,
      accept_data_change=args.accept_data_change,
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


def add_commands(sub, common) -> None:
  """Adds ``train`` and ``eval`` to the ``tjax`` subcommands ``sub`` (see ``build_parser``)."""
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
    "--accept-data-change",
    action="store_true",
    help="resume on a dataset whose content (or data.path) changed since the run trained on it, "
    "at the same data position",
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
