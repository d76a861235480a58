"""Benchmarks a user runs with one command: ``tjax bench train|generate|attention``.

Each prints a table and writes one JSON file holding the machine (CPU, flags, allocator, versions),
the exact command, the limits measured in the same run (``machine``) and the result as a fraction
of them: ``--json PATH``, by default ``runs/bench/bench_KIND.json`` under the current folder
(``runs/`` is ignored by git; the results kept in the repository are copied into
``experiments/results/`` by hand). Targets are not asserted here: these only measure.
"""

from __future__ import annotations

import datetime
import importlib
import json
import os
import sys

from transformer_jax.bench import machine

KINDS = ("train", "generate", "attention")


def module(kind: str):
  """The benchmark module of ``kind`` (imported on demand: generate needs torch)."""
  if kind not in KINDS:
    raise ValueError(f"benchmark {kind!r} is not one of {', '.join(KINDS)}")
  return importlib.import_module(f"transformer_jax.bench.{kind}")


# Where a benchmark writes its JSON without --json, under the current folder.
DEFAULT_JSON_DIR = os.path.join("runs", "bench")


def default_json(kind: str) -> str:
  """``runs/bench/bench_<kind>.json``: where ``tjax bench KIND`` writes its JSON without
  ``--json``."""
  return os.path.join(DEFAULT_JSON_DIR, f"bench_{kind}.json")


def run(kind: str, args, argv: list[str]) -> dict:
  """Runs benchmark ``kind`` with parsed ``args``; prints its table; writes ``args.json`` (None:
  ``default_json(kind)``; "": nothing) and says where on stderr."""

  command = " ".join(["tjax", "bench", kind, *argv])
  mod = module(kind)
  load_before = os.getloadavg()
  result = mod.run(args)
  result["command"] = command
  result["machine"] = {
    **machine.describe(("torch", "transformers")),
    **result.get("machine", {}),
    "load_average_before": list(load_before),
    "load_average_after": list(os.getloadavg()),
  }
  result["timestamp"] = datetime.datetime.now(datetime.timezone.utc).isoformat(timespec="seconds")
  print(mod.table(result), flush=True)
  out = args.json if args.json is not None else default_json(kind)
  if out:
    os.makedirs(os.path.dirname(os.path.abspath(out)), exist_ok=True)
    with open(out, "w") as f:
      f.write(json.dumps(result, indent=2) + "\n")
    print(f"wrote {out}", file=sys.stderr)
  return result
