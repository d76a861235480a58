"""The training loader's tokens per second per host (``GPTLoader.batch_at``).

The corpus is the running Python's standard library (``.py`` files), cycled with a numbered header
to ``--mb`` megabytes, prepared once by ``data.prepare`` (cl100k_base, compact vocabulary) into a
temporary folder, or ``--data DIR``: a dataset ``tjax prepare`` made. Each side reads the batches
of one host of ``--hosts`` (``process_index=0``: its ``batch_size / hosts`` rows of each global
batch of ``--seq-len`` tokens). The sides (``sides``) take turns batch by batch
(``bench.interleave``: one first batch each, ``--warmup`` untimed rounds, ``--steps`` timed
rounds), so load on a shared machine hits all alike; the JSON keeps every batch's time, the median
and best rates, the machine (``bench.machine.describe``) and the load average before and after.

The one side is ours. Grain's ``DataLoader`` over the same shards would be a second; Grain is not
a dependency of this package, so the script has no Grain side and the JSON records only whether
the ``grain`` package can be imported (``grain``).

    PYTHONPATH=$PWD .venv/bin/python experiments/loader_throughput.py \\
        [--mb 16] [--batch-size 32] [--seq-len 1024] [--hosts 1] [--steps 50] \\
        [--json experiments/results/loader_throughput_NAME.json]
"""

from __future__ import annotations

import argparse
import glob
import json
import os
import statistics
import sys
import sysconfig
import tempfile
import time

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
sys.path.insert(0, ROOT)


def corpus(path: str, megabytes: float) -> int:
  """Writes standard-library sources, cycled with a numbered header to ``megabytes`` MB, as JSON
  lines to ``path``; returns the documents written."""
  files = sorted(
    glob.glob(os.path.join(sysconfig.get_paths()["stdlib"], "**", "*.py"), recursive=True)
  )
  sources = []
  for p in files:
    with open(p, encoding="utf-8", errors="replace") as f:
      text = f.read()
    if text.strip():
      sources.append(text)
  size = i = 0
  with open(path, "w") as out:
    while size < megabytes * 1e6:
      text = f"# copy {i // len(sources)}\n{sources[i % len(sources)]}"
      out.write(json.dumps({"text": text}) + "\n")
      size += len(text.encode("utf-8"))
      i += 1
  return i


class Ours:
  """``GPTLoader.batch_at`` for consecutive steps: one call a batch."""

  def __init__(self, dataset, batch_size: int, seq_len: int, hosts: int):
    from transformer_jax.data import GPTLoader

    self.loader = GPTLoader(
      dataset, batch_size=batch_size, seq_len=seq_len, process_index=0, process_count=hosts
    )
    self.next = 0
    self.tokens = 0  # of the last batch

  def step(self) -> float:
    t = time.perf_counter()
    batch = self.loader.batch_at(self.next)
    seconds = time.perf_counter() - t
    self.next += 1
    self.tokens = int(batch["tokens"].size)
    return seconds


def grain_status() -> dict:
  """Whether Grain can be imported here (and its version)."""
  try:
    import grain
  except ImportError as e:
    return {
      "available": False,
      "reason": f"{e}; grain is not a dependency of this package (pyproject.toml)",
    }
  return {"available": True, "version": getattr(grain, "__version__", "unknown")}


def rates(times: list[float], tokens: int) -> dict:
  """A side's figures from its batch times: tokens per second at the median and best batch."""
  return {
    "tokens_per_batch": tokens,
    "tokens_per_sec_median": tokens / statistics.median(times),
    "tokens_per_sec_best": tokens / min(times),
    "batch_seconds_median": statistics.median(times),
    "batch_seconds_all": times,
  }


def main(argv: list[str] | None = None) -> dict:
  p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
  p.add_argument("--data", help="a prepared GPT dataset (default: the stdlib corpus, prepared)")
  p.add_argument("--mb", type=float, default=16.0, help="corpus megabytes (without --data)")
  p.add_argument("--batch-size", type=int, default=32)
  p.add_argument("--seq-len", type=int, default=1024)
  p.add_argument("--hosts", type=int, default=1, help="the host count whose one share is read")
  p.add_argument("--warmup", type=int, default=3)
  p.add_argument("--steps", type=int, default=50)
  p.add_argument("--json", help="where to write the result")
  a = p.parse_args(argv)
  if a.batch_size % a.hosts:
    p.error(f"--hosts {a.hosts} does not divide --batch-size {a.batch_size}")

  from transformer_jax import data
  from transformer_jax.bench import machine
  from transformer_jax.bench.interleave import interleave, progress

  load_before = list(os.getloadavg())
  with tempfile.TemporaryDirectory() as tmp:
    path, documents = a.data, None
    if path is None:
      documents = corpus(os.path.join(tmp, "stdlib.jsonl"), a.mb)
      path = os.path.join(tmp, "data")
      t = time.perf_counter()
      data.prepare([os.path.join(tmp, "stdlib.jsonl")], path, compact_vocab=True, progress=False)
      progress(f"prepared {documents} documents in {time.perf_counter() - t:.1f} s")
    dataset = data.load_dataset(path)
    sides = {"ours": Ours(dataset, a.batch_size, a.seq_len, a.hosts)}
    grain = grain_status()
    first, times, _ = interleave(sides, a.warmup, a.steps)
    train_tokens = int(dataset.meta["splits"]["train"]["tokens"])
  result = {
    "what": "tokens per second one host's training loader delivers (batch_at), per side",
    "config": {
      "batch_size": a.batch_size,
      "seq_len": a.seq_len,
      "hosts": a.hosts,
      "rows_per_host": a.batch_size // a.hosts,
      "warmup": a.warmup,
      "steps": a.steps,
      "data": a.data or f"stdlib corpus, {a.mb} MB ({documents} documents), prepared here",
      "train_tokens": train_tokens,
    },
    "machine": machine.describe(),
    "load_average_before": load_before,
    "load_average_after": list(os.getloadavg()),
    "first_batch_seconds": first,
    "sides": {name: rates(times[name], side.tokens) for name, side in sides.items()},
    "grain": grain,
  }
  for name, r in result["sides"].items():
    progress(f"{name}: {r['tokens_per_sec_median']:,.0f} tokens/s per host (median)")
  if a.json:
    with open(a.json, "w") as f:
      json.dump(result, f, indent=1)
      f.write("\n")
  return result


if __name__ == "__main__":
  main()
