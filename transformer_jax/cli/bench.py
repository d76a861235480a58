"""``tjax bench train|generate|attention``: the benchmarks' command lines (each ``bench`` module
adds its own arguments) and the guard on the ``--json`` file they write."""

from __future__ import annotations

import argparse


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


def add_commands(sub, common, *, with_args: bool = True) -> None:
  """Adds ``bench`` and its kinds to the ``tjax`` subcommands ``sub`` (see ``build_parser``);
  each kind's parser also takes ``common``'s options. Without ``with_args`` the kinds are listed
  without their arguments: those import the benchmarks and the training stack, which another
  command does not need to parse its own."""
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
    if not with_args:
      continue
    _bench_args(kind, kp)
    kp.add_argument(
      "--json",
      default=None,
      help="where to write the JSON (default runs/bench/bench_KIND.json under the "
      "current folder; '' writes none)",
    )
    kp.set_defaults(func=_cmd_bench, parser=kp)
