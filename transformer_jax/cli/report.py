"""``tjax report``: one self-contained HTML page (and PNGs) of run directories and experiment
results (``report.write_report`` does the work)."""

from __future__ import annotations


def _cmd_report(args) -> int:
  from transformer_jax.report import write_report

  index = write_report(
    args.run_dirs, args.out, text=args.text, best=args.best, experiments=args.experiment
  )
  print(f"wrote {index}")
  return 0


def add_commands(sub, common) -> None:
  """Adds ``report`` to the ``tjax`` subcommands ``sub`` (see ``build_parser``)."""
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
