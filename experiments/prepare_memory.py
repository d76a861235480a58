"""Peak memory of ``tjax prepare`` on a corpus and on one 4x larger, in zstd-compressed JSON lines
and in Parquet.

Each corpus is generated text (numbered documents of sentences drawn from a fixed pool of random
words, ``--mb`` and ``4 * --mb`` megabytes of text) written as one ``.jsonl.zst`` file and as one
Parquet file of 1,000-row row groups. Each ``python -m transformer_jax.cli prepare FILE --out DIR
--no-progress`` runs as its own process; its peak resident memory is the kernel's ``ru_maxrss``
for that process (``os.wait4``). ``startup`` is the same for ``tjax prepare --help`` (the
interpreter and the imports); ``growth`` divides the peaks above it.

    PYTHONPATH=$PWD .venv/bin/python experiments/prepare_memory.py \\
        [--mb 25] [--json experiments/results/prepare_memory.json]
"""

from __future__ import annotations

import argparse
import json
import os
import platform
import random
import subprocess
import sys
import tempfile

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
_WORDS = (
  "alpha beta gamma delta return import class def self value index total count node item tree "
  "über naïve café the of and to in is was for on with as by at from this that which"
).split()


def documents(megabytes: float, seed: int = 0):
  """Numbered documents of 5-60 pool sentences, ``megabytes`` MB of text in all."""
  rng = random.Random(seed)
  pool = [
    " ".join(rng.choice(_WORDS) for _ in range(rng.randint(5, 20))) + "." for _ in range(4000)
  ]
  size, i = 0, 0
  while size < megabytes * 1e6:
    text = f"document {i}. " + " ".join(rng.choices(pool, k=rng.randint(5, 60)))
    size += len(text.encode("utf-8"))
    i += 1
    yield text


def write_corpus(folder: str, megabytes: float) -> dict[str, str]:
  import pyarrow as pa
  import pyarrow.parquet as pq
  import zstandard

  os.makedirs(folder, exist_ok=True)
  paths = {
    "jsonl.zst": os.path.join(folder, "c.jsonl.zst"),
    "parquet": os.path.join(folder, "c.parquet"),
  }
  batch: list[str] = []
  schema = pa.schema([("text", pa.string())])
  with (
    open(paths["jsonl.zst"], "wb") as raw,
    zstandard.ZstdCompressor().stream_writer(raw) as zst,
    pq.ParquetWriter(paths["parquet"], schema) as parquet,
  ):
    for text in documents(megabytes):
      zst.write((json.dumps({"text": text}) + "\n").encode())
      batch.append(text)
      if len(batch) == 1000:
        parquet.write_table(pa.table({"text": batch}, schema=schema))
        batch = []
    if batch:
      parquet.write_table(pa.table({"text": batch}, schema=schema))
  return paths


def peak_rss(args: list[str]) -> int:
  """Peak resident bytes of ``tjax ARGS`` run as a child process."""
  env = {**os.environ, "PYTHONPATH": ROOT}
  command = [sys.executable, "-m", "transformer_jax.cli", *args]
  process = subprocess.Popen(command, env=env, stdout=subprocess.DEVNULL)
  _, status, usage = os.wait4(process.pid, 0)
  if os.waitstatus_to_exitcode(status) != 0:
    raise SystemExit(f"{' '.join(command)} failed")
  return usage.ru_maxrss * 1024  # kilobytes on Linux


def main() -> None:
  parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
  parser.add_argument("--mb", type=float, default=25.0)
  parser.add_argument("--workers", type=int, default=2)
  parser.add_argument(
    "--json", default=os.path.join(ROOT, "experiments/results/prepare_memory.json")
  )
  args = parser.parse_args()
  startup = min(peak_rss(["prepare", "--help"]) for _ in range(2))
  runs = {}
  with tempfile.TemporaryDirectory() as tmp:
    for scale in (1, 4):
      paths = write_corpus(os.path.join(tmp, f"x{scale}"), args.mb * scale)
      for fmt, path in paths.items():
        out = os.path.join(tmp, f"out_{fmt}_{scale}")
        peak = peak_rss(
          ["prepare", path, "--out", out, "--no-progress", "--workers", str(args.workers)]
        )
        with open(os.path.join(out, "metadata.json")) as f:
          meta = json.load(f)
        runs[f"{fmt}_x{scale}"] = {
          "text_megabytes": args.mb * scale,
          "file_bytes": os.path.getsize(path),
          "documents": sum(s["documents"] for s in meta["splits"].values()),
          "tokens": sum(s["tokens"] for s in meta["splits"].values()),
          "peak_rss_bytes": peak,
        }
        print(f"{fmt} x{scale}: peak {peak / 2**20:.0f} MiB", flush=True)
  growth = {}
  for fmt in ("jsonl.zst", "parquet"):
    small, big = runs[f"{fmt}_x1"]["peak_rss_bytes"], runs[f"{fmt}_x4"]["peak_rss_bytes"]
    growth[fmt] = {
      "peak_ratio": big / small,
      "above_startup_ratio": (big - startup) / max(small - startup, 1),
    }
  result = {
    "command": " ".join([os.path.relpath(sys.argv[0], ROOT), *sys.argv[1:]]),
    "machine": {
      "cpu": platform.processor() or platform.machine(),
      "cores": os.cpu_count(),
      "python": platform.python_version(),
      "load_average_at_end": list(os.getloadavg()),
    },
    "startup_peak_rss_bytes": startup,
    "runs": runs,
    "growth_for_4x_corpus": growth,
  }
  os.makedirs(os.path.dirname(os.path.abspath(args.json)), exist_ok=True)
  with open(args.json, "w") as f:
    json.dump(result, f, indent=2)
  print(json.dumps(growth, indent=2))


if __name__ == "__main__":
  main()
