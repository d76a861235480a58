"""The ``tjax`` command line: ``main`` parses and runs one command, ``launch`` is the program.

Each command group is a module of this package with an ``add_commands(sub, common)`` that adds its
subcommands and their handlers: ``info``, ``prepare``, ``data``, ``train`` (train and eval),
``generate`` (generate and fill-mask), ``convert``, ``bench``, ``report``; ``demo`` is
``make tour``. The library does the work; these modules hold the arguments, the printing and the
exit codes. Nothing outside this package imports it. ``python -m transformer_jax.cli`` runs
``launch``.
"""

from __future__ import annotations

import argparse
import sys

# ``tjax --help``'s description.
DESCRIPTION = (
  "The ``tjax`` command: ``info``, ``prepare``, ``data``, ``train``, ``eval``, ``generate``,\n"
  "``fill-mask``, ``convert``, ``bench``, ``report``."
)


def build_parser(command: str | None = None) -> argparse.ArgumentParser:
  """The ``tjax`` parser: each command module adds its subcommands, in the order ``--help`` lists
  them; ``common`` holds the options every subcommand also takes after its name.

  Args:
    command: the command the parser is for (None: any). Another command than ``bench`` gets the
      benchmarks' kinds without their arguments, which import the training stack: its own
      options are then checked before anything heavy loads.
  """
  from transformer_jax.cli import prepare

  parser, sub, common = _base_parser()
  if command == "prepare":  # the one command that never loads JAX: its start-up is its cost
    prepare.add_commands(sub, common)
    return parser
  from transformer_jax.cli import bench, convert, data, generate, info, report, train

  for commands in (info, prepare, data, train, generate, convert, report):
    commands.add_commands(sub, common)
  bench.add_commands(sub, common, with_args=command in (None, "bench"))
  return parser


def _base_parser():
  """``tjax`` with no commands yet: ``(parser, subparsers, common)``, where ``common`` holds the
  options every subcommand also takes after its name."""
  parser = argparse.ArgumentParser(prog="tjax", description=DESCRIPTION)
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
  return parser, sub, common


def _command_of(argv: list[str]) -> str | None:
  """The command ``argv`` names (its first word that is not an option), or None."""
  return next((a for a in argv if not a.startswith("-")), None)


# Commands that never load JAX: no compilation cache, no restart over mimalloc (tokenizing and
# reading windows compute nothing on JAX's allocations; the restart would only cost start-up).
_WITHOUT_JAX = ("prepare", "data")
# Subcommands whose positional ``key=value`` overrides may come after options.
_OVERRIDES = ("train", "eval", "data")
_error_reported = False  # main caught an exception and reported it in one line (see launch)


def _one_line(e: BaseException) -> str:
  """A one-line description of an error, naming the file for I/O errors."""
  seen = source = e
  while seen is not None and not isinstance(seen, ValueError):  # an OSError wrapped by a library
    if isinstance(seen, OSError):
      if seen.errno is not None:
        from transformer_jax.runs import describe_oserror  # here: it loads orbax

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
  raw_argv = list(sys.argv[1:] if argv is None else argv)
  parser = build_parser(_command_of(raw_argv))
  args, rest = parser.parse_known_args(raw_argv)
  args.raw_argv = raw_argv
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
  if args.command not in _WITHOUT_JAX:
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
  """The ``tjax`` program: when it will compute on CPU (any command but ``prepare`` and
  ``data``), runs itself again over mimalloc
  (``backends.cpu.allocator.allocator_env``; ``TJAX_MALLOC=0`` keeps the system allocator) or,
  without mimalloc installed, says once on stderr that it runs on the system allocator
  (``backends.cpu.allocator.system_allocator_notice``); then ``main``."""
  import os

  computes = (sys.argv[1] if len(sys.argv) > 1 else None) not in _WITHOUT_JAX
  env = None
  if computes:
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
  elif computes and (notice := allocator.system_allocator_notice()) is not None:
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
