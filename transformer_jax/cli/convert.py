"""``tjax convert``: a Hugging Face checkpoint to a run directory, or a run directory to one
(``hf.convert`` does the work).

The conversion is written into a temporary folder next to ``--out`` and renamed to ``--out`` once
it is whole: a conversion that fails leaves ``--out`` as it was (absent or empty), so the same
command can run again.
"""

from __future__ import annotations

import contextlib
import os
import shutil
from typing import Iterator


@contextlib.contextmanager
def _written_whole(out: str) -> Iterator[str]:
  """A new temporary folder next to ``out`` for the body to write into, renamed to ``out`` when
  the body returns and removed when it fails.

  Raises:
    ValueError: ``out`` exists and is not an empty directory (before anything is read).
  """
  out = os.path.abspath(out)
  if os.path.lexists(out) and not (os.path.isdir(out) and not os.listdir(out)):
    raise ValueError(f"--out {out} exists and is not empty; give a new directory")
  parent = os.path.dirname(out)
  missing, folder = [], parent  # the folders above ``out`` made here, innermost first
  while not os.path.exists(folder):
    missing.append(folder)
    folder = os.path.dirname(folder)
  os.makedirs(parent, exist_ok=True)
  tmp = os.path.join(parent, f".{os.path.basename(out)}.converting-{os.getpid()}")
  if os.path.lexists(tmp):  # left by a killed conversion of this pid: never another's files
    shutil.rmtree(tmp)
  done = False
  try:
    yield tmp
    os.rename(tmp, out)  # replaces an empty directory; refused by the OS if one appeared meanwhile
    done = True
  finally:
    if os.path.lexists(tmp):
      shutil.rmtree(tmp)
    for folder in [] if done else missing:
      with contextlib.suppress(OSError):
        os.rmdir(folder)


def _cmd_convert(args) -> int:
  from transformer_jax.hf import convert

  if (args.from_hf is None) == (args.to_hf is None):
    raise ValueError("give exactly one of --from-hf HF_DIR or --to-hf RUN_DIR")
  with _written_whole(args.out) as tmp:
    if args.from_hf is not None:
      convert.from_hf(args.from_hf, tmp)
    else:
      convert.to_hf(args.to_hf, tmp)
  print(f"wrote {args.out}")
  return 0


def add_commands(sub, common) -> None:
  """Adds ``convert`` to the ``tjax`` subcommands ``sub`` (see ``build_parser``)."""
  conv = sub.add_parser("convert", help="Hugging Face checkpoint <-> run directory")
  conv.add_argument("--from-hf", metavar="HF_DIR")
  conv.add_argument("--to-hf", metavar="RUN_DIR")
  conv.add_argument("--out", required=True)
  conv.set_defaults(func=_cmd_convert)
