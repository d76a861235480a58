"""``tjax prepare``'s tokens per second against tiktoken's own single-threaded batch encoder, on
the same texts in the same run, for each ``--workers`` count.

The corpus is the running Python's standard library (``.py`` files, tests included), one document
a file, cycled with a numbered header until it reaches ``--mb`` megabytes, written as one JSON
lines file. Each repeat times, one after the other:

* ``tiktoken``: ``encode_ordinary_batch(texts, num_threads=1)`` over the corpus's texts, already in
  memory (the reference: tokenizing alone, one core);
* ``tiktoken_N``: the same with ``num_threads=N`` for each worker count above 1 (how far the
  machine itself lets tokenizing scale right now);
* ``prepare_N``: the whole command ``python -m transformer_jax.cli prepare CORPUS --workers N
  --force --no-progress`` as a subprocess: start-up, reading and parsing the JSON lines, hashing,
  tokenizing, writing the pending stream and the train/val shards.

A ratio is ``prepare_N``'s tokens per second over the same repeat's ``tiktoken``; the JSON keeps
every repeat (interleaved, so load on a shared machine hits all alike), their medians and bests,
the load average around each timing, and the fraction of the machine's cores each command used
(its CPU seconds over wall seconds times cores).

    PYTHONPATH=$PWD .venv/bin/python experiments/prepare_throughput.py \\
        [--mb 64] [--workers 1 2] [--repeats 3] [--json experiments/results/prepare_throughput.json]
"""

from __future__ import annotations

import argparse
import glob
import json
import os
import platform
import resource
import statistics
import subprocess
import sys
import sysconfig
import tempfile
import time

_CHUNK = 1024  # texts per encode_ordinary_batch call
ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))


def corpus_texts(megabytes: float) -> list[str]:
  """Standard-library sources, cycled with a numbered header to ``megabytes`` MB of text."""
  paths = sorted(
    glob.glob(os.path.join(sysconfig.get_paths()["stdlib"], "**", "*.py"), recursive=True)
  )
  sources = []
  for p in paths:
    with open(p, encoding="utf-8", errors="replace") as f:
      text = f.read()
    if text.strip():
      sources.append(text)
  texts, size, i = [], 0, 0
  while size < megabytes * 1e6:
    text = f"# copy {i // len(sources)}\n{sources[i % len(sources)]}"
    texts.append(text)
    size += len(text.encode("utf-8"))
    i += 1
  return texts


def cpu_name() -> str:
  try:
    with open("/proc/cpuinfo") as f:
      for line in f:
        if line.startswith("model name"):
          return line.split(":", 1)[1].strip()
  except OSError:
    pass
  return platform.processor() or platform.machine()


def _children_cpu() -> float:
  usage = resource.getrusage(resource.RUSAGE_CHILDREN)
  return usage.ru_utime + usage.ru_stime


def time_tiktoken(enc, texts: list[str], threads: int) -> dict:
  load = os.getloadavg()[0]
  cpu0, t0 = time.process_time(), time.perf_counter()
  tokens = 0
  for i in range(0, len(texts), _CHUNK):  # a chunk at a time: the lists of ids of 100 MB of text
    tokens += sum(map(len, enc.encode_ordinary_batch(texts[i : i + _CHUNK], num_threads=threads)))
  wall = time.perf_counter() - t0
  return {
    "seconds": wall,
    "tokens": tokens,
    "cpu_seconds": time.process_time() - cpu0,
    "load_before": load,
  }


def time_prepare(corpus: str, out: str, workers: int) -> dict:
  load = os.getloadavg()[0]
  command = [sys.executable, "-m", "transformer_jax.cli", "prepare", corpus, "--out", out]
  command += ["--workers", str(workers), "--force", "--no-progress"]
  env = {**os.environ, "PYTHONPATH": ROOT}
  cpu0, t0 = _children_cpu(), time.perf_counter()
  subprocess.run(command, check=True, env=env, stdout=subprocess.DEVNULL)
  wall = time.perf_counter() - t0
  with open(os.path.join(out, "metadata.json")) as f:
    meta = json.load(f)
  return {
    "seconds": wall,
    "tokens": sum(s["tokens"] for s in meta["splits"].values()),
    "cpu_seconds": _children_cpu() - cpu0,
    "load_before": load,
  }


def time_startup() -> float:
  """Wall seconds of ``tjax prepare --help``: the command's fixed cost (interpreter, imports)."""
  env = {**os.environ, "PYTHONPATH": ROOT}
  t0 = time.perf_counter()
  command = [sys.executable, "-m", "transformer_jax.cli", "prepare", "--help"]
  subprocess.run(command, check=True, env=env, stdout=subprocess.DEVNULL)
  return time.perf_counter() - t0


def summarize(runs: list[dict], cores: int) -> dict:
  ratios = [r["ratio"] for r in runs]
  return {
    "ratio_median": statistics.median(ratios),
    "ratio_best": max(ratios),
    "tokens_per_second_median": statistics.median(r["tokens"] / r["seconds"] for r in runs),
    "cores_used_median": statistics.median(r["cpu_seconds"] / r["seconds"] / cores for r in runs),
  }


def main() -> None:
  parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
  parser.add_argument("--mb", type=float, default=64.0, help="corpus size in MB of text")
  parser.add_argument("--workers", type=int, nargs="+", default=[1, 2])
  parser.add_argument("--repeats", type=int, default=3)
  parser.add_argument(
    "--json", default=os.path.join(ROOT, "experiments/results/prepare_throughput.json")
  )
  args = parser.parse_args()
  sys.path.insert(0, ROOT)
  import tiktoken

  from transformer_jax.data.tokenizer import _get_encoding

  enc = _get_encoding("cl100k_base")
  cores = len(os.sched_getaffinity(0))
  texts = corpus_texts(args.mb)
  with tempfile.TemporaryDirectory() as tmp:
    corpus = os.path.join(tmp, "corpus.jsonl")
    with open(corpus, "w", encoding="utf-8") as f:
      for text in texts:
        f.write(json.dumps({"text": text}) + "\n")
    corpus_bytes = os.path.getsize(corpus)
    repeats = []
    for r in range(args.repeats):
      row = {"tiktoken": time_tiktoken(enc, texts, 1)}
      for w in args.workers:
        if w > 1:
          row[f"tiktoken_{w}"] = time_tiktoken(enc, texts, w)
        run = time_prepare(corpus, os.path.join(tmp, "out"), w)
        if run["tokens"] != row["tiktoken"]["tokens"]:
          raise SystemExit(
            f"prepare wrote {run['tokens']} tokens, tiktoken gave {row['tiktoken']['tokens']}"
          )
        run["ratio"] = row["tiktoken"]["seconds"] / run["seconds"]
        row[f"prepare_{w}"] = run
      for w in args.workers:
        if w > 1:
          row[f"tiktoken_{w}"]["ratio"] = (
            row["tiktoken"]["seconds"] / row[f"tiktoken_{w}"]["seconds"]
          )
      repeats.append(row)
      print(
        f"repeat {r}: "
        + ", ".join(
          f"{k} {v['seconds']:.2f}s" + (f" ({v['ratio']:.2f}x)" if "ratio" in v else "")
          for k, v in row.items()
        ),
        flush=True,
      )
    startup = min(time_startup() for _ in range(3))
  result = {
    "command": " ".join([os.path.relpath(sys.argv[0], ROOT), *sys.argv[1:]]),
    "machine": {
      "cpu": cpu_name(),
      "cores": cores,
      "python": platform.python_version(),
      "tiktoken": tiktoken.__version__,
      "load_average_at_end": list(os.getloadavg()),
      "note": "shared machine: other processes ran at the same time; repeats are interleaved and "
      "each ratio divides by the same repeat's tiktoken time",
    },
    "corpus": {
      "documents": len(texts),
      "text_bytes": sum(len(t.encode("utf-8")) for t in texts),
      "jsonl_bytes": corpus_bytes,
      "tokens": repeats[0]["tiktoken"]["tokens"],
    },
    "startup_seconds": startup,
    "repeats": repeats,
    "scaling": {
      f"workers_{w}": summarize([row[f"prepare_{w}"] for row in repeats], cores)
      for w in args.workers
    },
    "machine_scaling": {
      f"threads_{w}": statistics.median(row[f"tiktoken_{w}"]["ratio"] for row in repeats)
      for w in args.workers
      if w > 1
    },
  }
  os.makedirs(os.path.dirname(os.path.abspath(args.json)), exist_ok=True)
  with open(args.json, "w") as f:
    json.dump(result, f, indent=2)
  print(json.dumps(result["scaling"], indent=2), json.dumps(result["machine_scaling"]))


if __name__ == "__main__":
  main()
