"""How straight ``train()`` reads: the modules its calls go through, and how often it returns to
a module it has left.

Runs a tiny GPT training (2 steps on a generated corpus, in a temporary directory) under
``sys.setprofile`` and records, in call order, every call of a ``transformer_jax`` function made
at most ``DEPTH`` package frames below ``train()`` (frames of jax and other libraries between
them are not counted, so functions that JAX traces count like any other call). Consecutive calls
into the same module are one *stretch*; a *return* is a stretch into a module an earlier stretch
already entered. Nested calls count too: ``a.f -> b.g -> a.h`` is one return to ``a``.

    PYTHONPATH=$PWD .venv/bin/python experiments/train_path.py [--depth 1 2 3] [--list]

Prints, per depth: calls, stretches, modules and returns (``--list``: the stretches themselves).
"""

from __future__ import annotations

import argparse
import os
import sys
import tempfile

PACKAGE = (
  os.path.join(os.path.dirname(os.path.dirname(os.path.abspath(__file__))), "transformer_jax")
  + os.sep
)


def _module(code) -> str | None:
  """The dotted module of a code object defined in the package, else None."""
  path = code.co_filename
  if not path.startswith(PACKAGE):
    return None
  rel = path[len(PACKAGE) : -len(".py")].replace(os.sep, ".")
  return "transformer_jax." + rel.removesuffix(".__init__")


def trace_train(exp) -> list[tuple[int, str, str]]:
  """``(depth, module, function)`` of every package call under ``train(exp)`` (depth 1: the calls
  ``train`` itself makes)."""
  from transformer_jax.train import train

  calls: list[tuple[int, str, str]] = []
  stack: list[int] = []  # per frame on the stack below train(): its package depth (0: other)
  inside = [False]

  def profile(frame, event, _arg):
    if event not in ("call", "return"):
      return
    code = frame.f_code
    if event == "call":
      if not inside[0]:
        if code is train.__code__:
          inside[0] = True
          stack.append(0)
        return
      parent = next((d for d in reversed(stack) if d), 0)
      module = _module(code)
      if module is None or code.co_name.startswith("<"):  # genexprs, lambdas, comprehensions
        stack.append(0)
        return
      calls.append((parent + 1, module, code.co_qualname))
      stack.append(parent + 1)
    elif inside[0]:
      stack.pop()
      if not stack:
        inside[0] = False

  sys.setprofile(profile)
  try:
    train(exp, progress=False)
  finally:
    sys.setprofile(None)
  return calls


def stretches(calls, depth: int) -> list[tuple[str, int]]:
  """``(module, calls)`` stretches of the calls at most ``depth`` deep."""
  out: list[list] = []
  for d, module, _ in calls:
    if d > depth:
      continue
    if out and out[-1][0] == module:
      out[-1][1] += 1
    else:
      out.append([module, 1])
  return [tuple(s) for s in out]


def tiny_experiment(root: str):
  """A 2-step GPT experiment on 40 generated text documents (prepared on first use)."""
  import random

  from transformer_jax.train import load_experiment

  corpus = os.path.join(root, "corpus")
  os.makedirs(corpus)
  rng = random.Random(0)
  words = ["alpha", "beta", "gamma", "delta", "return", "def", "class", "for", "in", "the"]
  for d in range(40):
    with open(os.path.join(corpus, f"doc{d:02d}.txt"), "w") as f:
      f.write("\n".join(" ".join(rng.choice(words) for _ in range(8)) for _ in range(30)))
  raw = {
    "run_dir": os.path.join(root, "run"),
    "model": {
      "preset": "gpt2-tiny",
      "d_model": 32,
      "num_layers": 2,
      "num_heads": 2,
      "d_ff": 64,
      "max_len": 32,
    },
    "data": {
      "inputs": [corpus],
      "path": os.path.join(root, "data"),
      "task": "gpt",
      "compact_vocab": True,
      "val_fraction": 4,
    },
    "train": {
      "steps": 2,
      "batch_size": 4,
      "seq_len": 32,
      "log_every": 1,
      "eval_every": 2,
      "eval_batches": 1,
      "checkpoint_every": 2,
      "samples": 0,
    },
  }
  return load_experiment(None, raw=raw)


def main() -> None:
  parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
  parser.add_argument("--depth", type=int, nargs="+", default=[1, 2, 3])
  parser.add_argument("--list", action="store_true", help="print the stretches")
  args = parser.parse_args()
  with tempfile.TemporaryDirectory() as root:
    calls = trace_train(tiny_experiment(root))
  for depth in args.depth:
    s = stretches(calls, depth)
    modules = {m for m, _ in s}
    n = sum(c for _, c in s)
    print(
      f"depth {depth}: {n} calls in {len(s)} stretches over {len(modules)} modules: "
      f"{len(s) - len(modules)} returns to a module left before"
    )
    if args.list:
      for m, c in s:
        print(f"  {m.removeprefix('transformer_jax.')} x{c}")


if __name__ == "__main__":
  main()
