"""``tjax prepare``: its command-line arguments and the command (``data.prepare`` does the
work)."""

from __future__ import annotations

import argparse
import re

from transformer_jax.data.estimate import describe_estimate, estimate_corpus
from transformer_jax.data.prepare import (
  DEFAULT_SHARD_BYTES,
  ENGINES,
  TASKS,
  available_cores,
  prepare,
)


_SIZE = re.compile(r"^\s*(\d+(?:\.\d*)?)\s*(?:([KMGT])(?:I?B)?|B)?\s*$", re.IGNORECASE)


def parse_size(text: str) -> int:
  """``4096``, ``64KiB``, ``512M``, ``1GiB``, ``1.5GB`` as a whole number of bytes (K, M, G, T are
  powers of 1024)."""
  match = _SIZE.match(text)
  if match is None:
    raise argparse.ArgumentTypeError(f"{text!r}: expected a size: bytes, or with KiB, MiB, GiB")
  power = " KMGT".index(match[2].upper()) if match[2] else 0
  return int(float(match[1]) * 1024**power)


def add_prepare_args(parser: argparse.ArgumentParser) -> argparse.ArgumentParser:
  """Adds the ``tjax prepare`` arguments to ``parser``."""
  parser.add_argument(
    "inputs",
    nargs="+",
    metavar="INPUT",
    help="files (text, .jsonl[.gz|.zst], .parquet, .arrow), globs, directories, datasets "
    "folders, fsspec URLs, 'stdlib', synthetic:reverse|sort|add[:COUNT], or (classify) "
    "stdlib:packages",
  )
  parser.add_argument("--out", required=True, help="output dataset directory")
  parser.add_argument(
    "--tokenizer", default="cl100k_base", help="tiktoken encoding or chars:ALPHABET"
  )
  parser.add_argument(
    "--compact-vocab",
    nargs="?",
    const=True,
    default=False,
    type=int,
    metavar="N",
    help="keep only the ids the corpus uses (or its N most frequent ids; the rest become [UNK])",
  )
  parser.add_argument("--task", choices=TASKS, default="gpt")
  parser.add_argument(
    "--val-fraction",
    type=float,
    default=0.05,
    help="fraction of documents for validation, or a whole number >= 1 of documents",
  )
  parser.add_argument("--seed", type=int, default=0)
  parser.add_argument(
    "--workers",
    type=int,
    default=None,
    help="tokenizing workers, processes when more than one (default: all cores this process may "
    f"use, {available_cores()} here; 1 for a corpus under 4 MiB on the local engine)",
  )
  parser.add_argument(
    "--text-field", default="text", help="text field (column) of JSON lines, Parquet, Arrow inputs"
  )
  parser.add_argument(
    "--shard-size",
    type=parse_size,
    default=DEFAULT_SHARD_BYTES,
    metavar="SIZE",
    help="a token shard's size limit: bytes, or with KiB, MiB, GiB (default 1GiB); a longer "
    "stream is written as several shards, read as one",
  )
  parser.add_argument(
    "--engine",
    choices=(*ENGINES, "threads"),
    default="local",
    help="local: --workers processes on this machine ('threads' is its earlier name); ray: a Ray "
    "Data job (optional extra 'ray'), the same dataset byte for byte",
  )
  parser.add_argument("--force", action="store_true", help="rebuild even if up to date")
  parser.add_argument(
    "--allow-undecodable",
    action="store_true",
    help="replace undecodable bytes by U+FFFD however many (by default over 0.1%% of a file's "
    "bytes is an error naming it)",
  )
  parser.add_argument(
    "--skip-bad",
    action="store_true",
    help="skip and count bad input (undecodable file, empty document, missing text field, "
    "corrupt gzip/zstd stream or Parquet row group) instead of stopping at the first",
  )
  parser.add_argument("--no-progress", action="store_true", help="no progress bar")
  parser.add_argument(
    "--dry-run",
    action="store_true",
    help="count the input files and bytes, estimate the tokens and the time from a timed sample, "
    "and write nothing",
  )
  parser.add_argument(
    "--vocab-from",
    default=None,
    metavar="DIR",
    help="classify: reuse the tokenizer and compact vocabulary of this dataset",
  )
  return parser


def run_prepare(args: argparse.Namespace) -> int:
  """Runs ``tjax prepare`` from parsed arguments; prints a summary. Returns an exit code.

  Raises:
    ValueError: bad input (an input that matches no file included), for the CLI's one line and
      exit 2.
  """
  if args.dry_run:
    workers = args.workers or available_cores()
    print(
      describe_estimate(
        estimate_corpus(
          args.inputs,
          task=args.task,
          tokenizer=args.tokenizer,
          text_field=args.text_field,
          workers=workers,
        ),
        workers,
      )
    )
    return 0
  try:
    meta = prepare(
      args.inputs,
      args.out,
      tokenizer=args.tokenizer,
      compact_vocab=args.compact_vocab,
      task=args.task,
      val_fraction=args.val_fraction,
      seed=args.seed,
      workers=args.workers,
      text_field=args.text_field,
      force=args.force,
      vocab_from=args.vocab_from,
      allow_undecodable=args.allow_undecodable,
      skip_bad=args.skip_bad,
      shard_bytes=args.shard_size,
      engine=args.engine,
      progress=not args.no_progress,
    )
  except FileNotFoundError as e:
    if e.errno is not None:  # the system's, naming its path
      raise
    raise ValueError(str(e)) from None  # an input that matches nothing: bad input, exit 2
  parts = [f"{s}: {m['documents']} docs, {m['tokens']} tokens" for s, m in meta["splits"].items()]
  vocab = f"tokenizer {meta['tokenizer']}, vocab_size {meta['vocab_size']}"
  print(f"{args.out}: {'; '.join(parts)}; {vocab}")
  return 0


def add_commands(sub, common) -> None:
  """Adds ``prepare`` to the ``tjax`` subcommands ``sub`` (see ``build_parser``)."""
  prep = sub.add_parser("prepare", help="tokenize text/jsonl/TSV/stdlib/synthetic into a dataset")
  add_prepare_args(prep)
  prep.set_defaults(func=run_prepare)
