"""Does a position scheme extrapolate? Train at 128 tokens, evaluate at 128, 256, 512 and 1024.

The same small GPT (same data, steps, seed and optimizer) is trained four times on the embedded
corpus (the Python standard library's sources) with learned, sinusoidal, rotary (RoPE) and ALiBi
positions, at 128 tokens per row. Each is then evaluated on the same validation text: the first
1024 + 1 tokens of every validation file that long, cut into non-overlapping windows of L tokens
(the ALiBi paper's protocol, so every L scores the same 1024 target tokens per file, with at most L
tokens of context). A learned position table has only 128 rows and cannot run on longer inputs:
for L > 128 it is evaluated with sliding windows of 128 tokens (stride 64, each token scored once
with 64 to 127 tokens of context), and its entries say so (`"context"`).

  python experiments/pe_extrapolation.py        # ~15-20 min on 2 CPU cores
  python experiments/pe_extrapolation.py --steps 50 --json /tmp/pe.json   # a quick look

Writes `experiments/results/pe_extrapolation.json` and `pe_extrapolation.png`.
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import os
import sys
import time

import jax
import jax.numpy as jnp
import numpy as np
import optax

import transformer_jax as tj
from transformer_jax import data, ops

_HERE = os.path.dirname(os.path.abspath(__file__))
_ROOT = os.path.dirname(_HERE)
SCHEMES = ("learned", "sinusoidal", "rope", "alibi")


def _config(scheme: str, vocab_size: int, max_len: int, args) -> tj.models.GPTConfig:
  return tj.models.get_config(
    "gpt2-tiny",
    vocab_size=vocab_size,
    d_model=args.d_model,
    num_layers=args.layers,
    num_heads=args.heads,
    d_ff=4 * args.d_model,
    max_len=max_len,
    position=scheme,
  )


def train(scheme: str, dataset, args) -> tuple[tj.models.GPTConfig, object, list[float]]:
  """``args.steps`` AdamW steps at ``args.train_len`` tokens; returns config, params, losses."""
  config = _config(scheme, dataset.vocab_size, args.train_len, args)
  return (config, *train_steps(config, dataset, args))


def train_steps(config, dataset, args) -> tuple[object, list[float]]:
  """A GPT of ``config`` from ``args.seed``, trained ``args.steps`` AdamW steps (warmup over an
  eighth, cosine to a tenth, clipping at 1) on ``dataset``'s rows of ``args.train_len`` tokens,
  ``args.batch_size`` a step: ``(params, losses)``."""
  params = tj.models.init(config, jax.random.key(args.seed))
  schedule = optax.warmup_cosine_decay_schedule(
    0.0, args.lr, args.steps // 8, args.steps, end_value=args.lr / 10
  )
  optimizer = optax.chain(optax.clip_by_global_norm(1.0), optax.adamw(schedule, weight_decay=0.1))
  opt_state = optimizer.init(params)
  loader = data.GPTLoader(
    dataset, batch_size=args.batch_size, seq_len=args.train_len, seed=args.seed
  )

  @jax.jit
  def step(params, opt_state, batch):
    def loss_fn(p):
      logits = tj.models.apply(config, p, batch["tokens"], batch["positions"], batch["segment_ids"])
      return ops.cross_entropy(logits, batch["labels"], mask=batch["loss_mask"])[0]

    loss, grads = jax.value_and_grad(loss_fn)(params)
    updates, opt_state = optimizer.update(grads, opt_state, params)
    return optax.apply_updates(params, updates), opt_state, loss

  losses = []
  for i in range(args.steps):
    params, opt_state, loss = step(params, opt_state, loader.batch_at(i))
    losses.append(float(loss))
  return params, losses


def eval_docs(dataset, args) -> np.ndarray:
  """``[D, 1025]`` int32: the first 1025 tokens of each validation file at least that long."""
  stream = dataset.stream("val")
  need = max(args.lengths) + 1
  docs = [stream.doc(d)[:need] for d in range(stream.num_docs) if stream.lengths[d] >= need]
  if not docs:
    raise SystemExit(f"no validation document has {need} tokens")
  return np.stack(docs[: args.eval_docs]).astype(np.int32)


def _loss_sums(config, params, windows_WL1: np.ndarray, score_from: int) -> tuple[float, int]:
  """Summed next-token loss over ``windows[:, score_from:]`` targets (batched, one jit per
  shape)."""
  tokens, labels = jnp.asarray(windows_WL1[:, :-1]), jnp.asarray(windows_WL1[:, 1:])
  mask = jnp.zeros(labels.shape, bool).at[:, score_from:].set(True)

  @jax.jit
  def total(params):
    logits = tj.models.apply(config, params, tokens)
    mean, count = ops.cross_entropy(logits, labels, mask=mask)
    return mean * count, count

  s, c = total(params)
  return float(s), int(c)


def evaluate(scheme: str, config, params, docs_DN: np.ndarray, length: int, args) -> dict:
  """Mean loss over the same ``1024`` target tokens per document, context at most ``length``."""
  n = docs_DN.shape[1] - 1
  if scheme != "learned" or length <= args.train_len:
    windows = np.concatenate([docs_DN[:, i : i + length + 1] for i in range(0, n, length)])
    cfg = dataclasses.replace(config, max_len=max(length, config.max_len))
    s, c = _loss_sums(cfg, params, windows, 0)
    context = f"non-overlapping windows of {length}"
  else:
    ctx, stride = args.train_len, args.train_len // 2
    s, c = _loss_sums(config, params, docs_DN[:, : ctx + 1], 0)  # the first window: every token
    starts = range(stride, n - ctx + 1, stride)
    windows = np.concatenate([docs_DN[:, i : i + ctx + 1] for i in starts])
    s2, c2 = _loss_sums(config, params, windows, ctx - stride)  # then the last `stride` of each
    s, c = s + s2, c + c2
    context = f"sliding windows of {ctx}, stride {stride} (a learned table has {ctx} rows)"
  return {"loss": s / c, "tokens": c, "context": context}


def plot(results: dict, lengths, train_len: int, path: str) -> None:
  from matplotlib.figure import Figure

  fig = Figure(figsize=(7, 4.5), layout="constrained")
  ax = fig.subplots()
  for scheme, by_len in results.items():
    xs = [int(k) for k in by_len]
    ys = [v["loss"] for v in by_len.values()]
    style = "o:" if scheme == "learned" else "o-"
    label = scheme + (" (sliding windows past 128)" if scheme == "learned" else "")
    ax.plot(xs, ys, style, label=label)
  ax.axvline(train_len, color="grey", lw=0.8, ls="--")
  ax.text(train_len, ax.get_ylim()[1], " trained at 128", va="top", fontsize=8, color="grey")
  ax.set_xscale("log", base=2)
  ax.set_xticks(list(lengths), [str(x) for x in lengths])
  ax.set(
    xlabel="evaluation length (tokens)",
    ylabel="validation loss (nats/token)",
    title="Position schemes: train at 128, evaluate longer",
  )
  ax.grid(alpha=0.3)
  ax.legend()
  fig.savefig(path, dpi=110)


def main() -> None:
  parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
  parser.add_argument("--schemes", nargs="+", default=list(SCHEMES), choices=SCHEMES)
  parser.add_argument("--lengths", type=int, nargs="+", default=[128, 256, 512, 1024])
  parser.add_argument("--train-len", type=int, default=128)
  parser.add_argument("--steps", type=int, default=400)
  parser.add_argument("--batch-size", type=int, default=16)
  parser.add_argument("--lr", type=float, default=3e-3)
  parser.add_argument("--d-model", type=int, default=128)
  parser.add_argument("--layers", type=int, default=3)
  parser.add_argument("--heads", type=int, default=4)
  parser.add_argument("--seed", type=int, default=0)
  parser.add_argument("--eval-docs", type=int, default=64, help="validation files (>= 1025 tokens)")
  parser.add_argument("--data", default=os.path.join(_ROOT, "runs", "data", "stdlib-4k"))
  parser.add_argument("--json", default=os.path.join(_HERE, "results", "pe_extrapolation.json"))
  args = parser.parse_args()
  if any(n % args.train_len and args.train_len % n for n in args.lengths):
    parser.error("--lengths must be multiples or divisors of --train-len")

  if not os.path.exists(os.path.join(args.data, "metadata.json")):
    data.prepare(["stdlib"], args.data, compact_vocab=4096)
  dataset = data.load_dataset(args.data)
  docs = eval_docs(dataset, args)
  results, train_info = {}, {}
  for scheme in args.schemes:
    t0 = time.perf_counter()
    config, params, losses = train(scheme, dataset, args)
    train_info[scheme] = {
      "first_loss": losses[0],
      "last_loss": losses[-1],
      "seconds": round(time.perf_counter() - t0, 1),
    }
    results[scheme] = {
      str(n): evaluate(scheme, config, params, docs, n, args) for n in args.lengths
    }
    shown = "  ".join(f"{n}: {results[scheme][str(n)]['loss']:.3f}" for n in args.lengths)
    print(
      f"{scheme:10s} train loss {losses[0]:.2f} -> {losses[-1]:.2f}   val loss {shown}", flush=True
    )

  out = {
    "results": results,
    "command": " ".join(["python"] + [os.path.relpath(sys.argv[0], _ROOT)] + sys.argv[1:]),
    "setup": {
      "model": {"d_model": args.d_model, "num_layers": args.layers, "num_heads": args.heads},
      "train_len": args.train_len,
      "steps": args.steps,
      "batch_size": args.batch_size,
      "lr": args.lr,
      "seed": args.seed,
      "eval_docs": int(docs.shape[0]),
      "vocab_size": dataset.vocab_size,
      "jax": jax.__version__,
    },
    "training": train_info,
  }
  os.makedirs(os.path.dirname(os.path.abspath(args.json)), exist_ok=True)
  with open(args.json, "w") as f:
    json.dump(out, f, indent=1)
  png = os.path.splitext(args.json)[0] + ".png"
  plot(results, args.lengths, args.train_len, png)
  print(f"wrote {args.json} and {png}")


if __name__ == "__main__":
  main()
