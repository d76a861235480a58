"""The training loader's tokens per second per host (``GPTLoader.batch_at``).

The corpus is the running Python's standard library (``.py`` files), cycled with a numbered header
to ``--mb`` megabytes, prepared once by ``data.prepare`` (cl100k_base, compact vocabulary) into a
temporary folder, or ``--data DIR``: a dataset ``tjax prepare`` made. Each side reads the batches
of one host of ``--hosts`` (``process_index=0``: its ``batch_size / hosts`` rows of each global
batch of ``--seq-len`` tokens). The sides (``sides``) take turns batch by batch
(``bench.interleave``: one first batch each, ``--warmup`` untimed rounds, ``--steps`` timed
rounds), so load on a shared machine hits all alike; the JSON keeps every batch's time, the median
and best rates, the machine (``bench.machine.describe``) and the load average before and after.

The sides: ``ours`` (``GPTLoader.batch_at``: a whole batch by vectorised gathers) and ``grain``:
Grain's ``DataLoader`` (in this process, ``worker_count=0``) over the same shards, its
``IndexSampler`` shuffling the windows and sharding them among the hosts, a record a window built
by the same arithmetic (``GPTLoader.gather`` of one row: tokens, labels, segment ids, positions,
loss mask), stacked by ``grain.transforms.Batch``. After the interleaved rounds, ``grain`` with
``--grain-workers`` processes (its prefetching form) is timed alone over ``--steps`` batches
(``grain_workers``). Grain comes with the optional extra ``data``.

    PYTHONPATH=$PWD .venv/bin/python experiments/loader_throughput.py \\
        [--mb 16] [--batch-size 32] [--seq-len 1024] [--hosts 1] [--steps 50] \\
        [--json experiments/results/loader_throughput_NAME.json]
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import sys
import tempfile
import time

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
sys.path.insert(0, ROOT)

from prepare_throughput import corpus_texts  # noqa: E402 (experiments/: this script's own folder)


def corpus(path: str, megabytes: float) -> int:
  """Writes ``prepare_throughput``'s corpus of ``megabytes`` MB as JSON lines to ``path``; returns
  the documents written."""
  texts = corpus_texts(megabytes)
  with open(path, "w") as out:
    for text in texts:
      out.write(json.dumps({"text": text}) + "\n")
  return len(texts)


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


class Windows:
  """Grain's random-access source: record ``i`` is window ``i`` of the packed stream, each array
  of ``GPTLoader.gather`` for that one row."""

  def __init__(self, loader):
    self.loader = loader

  def __len__(self) -> int:
    return self.loader.num_windows

  def __getitem__(self, i: int) -> dict:
    import numpy as np

    batch = self.loader.gather(self.loader.starts_of(np.array([i], np.int64)))
    return {k: v[0] for k, v in batch.items()}


def grain_loader(dataset, batch_size: int, seq_len: int, hosts: int, workers: int, seed: int = 0):
  """Grain's ``DataLoader`` over ``dataset``'s windows: one host's share (index 0 of ``hosts``),
  shuffled by ``seed``, ``batch_size / hosts`` rows a batch; its iterator."""
  import grain
  from absl import flags

  from transformer_jax.data import GPTLoader

  if not flags.FLAGS.is_parsed():  # Grain's worker processes read absl flags (their defaults)
    flags.FLAGS.mark_as_parsed()

  loader = GPTLoader(dataset, batch_size=batch_size, seq_len=seq_len)
  source = Windows(loader)
  sampler = grain.samplers.IndexSampler(
    num_records=len(source),
    shard_options=grain.sharding.ShardOptions(
      shard_index=0, shard_count=hosts, drop_remainder=True
    ),
    shuffle=True,
    num_epochs=None,
    seed=seed,
  )
  return iter(
    grain.DataLoader(
      data_source=source,
      sampler=sampler,
      operations=[grain.transforms.Batch(batch_size // hosts, drop_remainder=True)],
      worker_count=workers,
    )
  )


class Grain:
  """``next`` on Grain's ``DataLoader`` iterator: one call a batch."""

  def __init__(self, dataset, batch_size: int, seq_len: int, hosts: int, workers: int = 0):
    self.it = grain_loader(dataset, batch_size, seq_len, hosts, workers)
    self.tokens = 0

  def step(self) -> float:
    t = time.perf_counter()
    batch = next(self.it)
    seconds = time.perf_counter() - t
    self.tokens = int(batch["tokens"].size)
    return seconds


def grain_version() -> str:
  import importlib.metadata

  return importlib.metadata.version("grain")


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
  p.add_argument("--grain-workers", type=int, default=2, help="Grain's processes, timed alone")
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
    sides = {
      "ours": Ours(dataset, a.batch_size, a.seq_len, a.hosts),
      "grain": Grain(dataset, a.batch_size, a.seq_len, a.hosts),
    }
    first, times, _ = interleave(sides, a.warmup, a.steps)
    alone = Grain(dataset, a.batch_size, a.seq_len, a.hosts, workers=a.grain_workers)
    for _ in range(a.warmup + 1):
      alone.step()
    alone_times = [alone.step() for _ in range(a.steps)]
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
    "grain_workers": {"workers": a.grain_workers, **rates(alone_times, alone.tokens)},
    "grain_version": grain_version(),
  }
  ours = result["sides"]["ours"]["tokens_per_sec_median"]
  result["ratios"] = {
    "ours_over_grain": ours / result["sides"]["grain"]["tokens_per_sec_median"],
    "ours_over_grain_workers": ours / result["grain_workers"]["tokens_per_sec_median"],
  }
  for name, r in [*result["sides"].items(), ("grain_workers", result["grain_workers"])]:
    progress(f"{name}: {r['tokens_per_sec_median']:,.0f} tokens/s per host (median)")
  if a.json:
    with open(a.json, "w") as f:
      json.dump(result, f, indent=1)
      f.write("\n")
  return result


if __name__ == "__main__":
  main()
