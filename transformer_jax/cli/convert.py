"""``tjax convert``: a Hugging Face checkpoint to a run directory, or a run directory to one
(``hf.convert`` does the work)."""

from __future__ import annotations


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


def add_commands(sub, common) -> None:
  """Adds ``convert`` to the ``tjax`` subcommands ``sub`` (see ``build_parser``)."""
  conv = sub.add_parser("convert", help="Hugging Face checkpoint <-> run directory")
  conv.add_argument("--from-hf", metavar="HF_DIR")
  conv.add_argument("--to-hf", metavar="RUN_DIR")
  conv.add_argument("--out", required=True)
  conv.set_defaults(func=_cmd_convert)
