"""Beyond quadratic attention: full softmax, sliding windows, linear attention and state-space
models, side by side.

Small RoPE GPTs with the same parameters (the attention kind changes no weight), and three
state-space models with as many parameters within 4%, are trained on the same corpus (the
embedded Python standard library) for the same steps:

  softmax       full causal softmax attention
  window-W      softmax over the last W tokens (two widths; decoding with a rolling cache)
  linear        linear attention (elu + 1 features, Katharopoulos et al. 2020)
  linear-decay  linear attention with RetNet's per-head decay
  sparse-fixed, sparse-strided
                block-sparse softmax (ops.sparse): Child et al.'s fixed pattern (own block of 64
                and 8 summary positions per block) and strided pattern (two blocks of 64 and
                every 64th position)
  mamba1        Mamba blocks (selective scan; Gu and Dao 2023), no attention
  mamba2        Mamba-2 blocks (SSD; Dao and Gu 2024)
  hybrid        Mamba, attention, Mamba blocks, each with a gated MLP (Jamba's pattern)

and compared by validation loss. Then, in the same run, what each kind costs:

  * the attention kernel alone, causal, forward + backward, full against windowed, at 4k and 16k
    tokens (interleaved repetitions, medians);
  * a train step's time and its compiled temporaries (XLA's memory analysis) against the context
    length, 512 to 16k tokens;
  * a decoding step's time and the cache's bytes against the generated length, 1k to 32k tokens
    (one step with the cache holding that many tokens).

  python experiments/efficient_attention.py                 # ~20 min on 2 CPU cores
  python experiments/efficient_attention.py --steps 20 --lengths 512,2048 \\
      --decode-lengths 1024,4096 --json /tmp/ea.json       # a quick look

Writes experiments/results/efficient_attention.json and efficient_attention.png.
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import os
import statistics
import sys
import time

import jax
import jax.numpy as jnp
import optax
from flax import nnx

import transformer_jax as tj
from transformer_jax import data, generate, hardware, ops, runtime, viz
from pe_extrapolation import train_steps  # experiments/: this script's own folder

_HERE = os.path.dirname(os.path.abspath(__file__))
_ROOT = os.path.dirname(_HERE)


def variants(windows: list[int]) -> dict[str, dict]:
  """Name -> GPTConfig overrides of each attention kind."""
  out = {"softmax": {}}
  out.update({f"window-{w}": {"sliding_window": w} for w in windows})
  out["linear"] = {"attention_kind": "linear"}
  out["linear-decay"] = {"attention_kind": "linear", "linear_decay": "retnet"}
  out["sparse-fixed"] = {
    "attention_kind": "sparse",
    "sparse_pattern": ops.SparsePattern.fixed(block=64, summary=8),
  }
  out["sparse-strided"] = {
    "attention_kind": "sparse",
    "sparse_pattern": ops.SparsePattern.strided_pattern(block=64),
  }
  return out


def ssm_configs(args, vocab: int) -> dict[str, tj.models.MambaConfig]:
  """The state-space rows, their depths (and the hybrid's MLP width) chosen so that each has the
  GPTs' parameters within 4% (at the defaults: 1.29M to 1.34M non-embedding, output projection
  included, against the GPTs' 1.31M)."""
  d = args.d_model
  common = dict(
    vocab_size=vocab, d_model=d, d_state=16, ssm_chunk=64, tie_embeddings=False, max_len=1 << 16
  )
  gpt = tj.models.param_count(config_for(args, vocab)).non_embedding
  rows = {
    "mamba1": tj.models.MambaConfig(mixer="mamba1", **common),
    "mamba2": tj.models.MambaConfig(
      mixer="mamba2",
      ssm_head_dim=d // 4,
      d_state=32,
      **{k: v for k, v in common.items() if k != "d_state"},
    ),
    "hybrid": tj.models.MambaConfig(
      mixer="mamba1",
      layer_types=("mamba", "attention", "mamba"),
      num_layers=3,
      num_heads=args.heads,
      position="rope",
      d_ff=7 * d // 2,
      **common,
    ),
  }
  out = {}
  for name, config in rows.items():
    if name != "hybrid":  # as many Mamba blocks as the GPTs' parameters pay for
      one, two = (
        tj.models.param_count(dataclasses.replace(config, num_layers=n)).non_embedding
        for n in (1, 2)
      )
      head = one - (two - one)  # the output projection and the final norm
      config = dataclasses.replace(config, num_layers=max(1, round((gpt - head) / (two - one))))
    out[name] = config
  return out


def config_for(args, vocab: int, **overrides) -> tj.models.GPTConfig:
  return tj.models.get_config(
    "llama-tiny",
    vocab_size=vocab,
    d_model=args.d_model,
    num_layers=args.layers,
    num_heads=args.heads,
    num_kv_heads=args.heads,
    d_ff=4 * args.d_model,
    max_len=1 << 16,
    dropout_rate=0.0,
    **overrides,
  )


def _lm_loss(config, params, batch):
  logits = tj.models.apply(
    config, params, batch["tokens"], batch["positions"], batch["segment_ids"]
  )
  return ops.cross_entropy(logits, batch["labels"], mask=batch["loss_mask"])


def train_and_evaluate(name: str, config, dataset, args) -> dict:
  """``args.steps`` AdamW steps at ``args.train_len`` tokens (``pe_extrapolation.train_steps``,
  the same schedule); the validation loss after."""
  start = time.perf_counter()
  params, losses = train_steps(config, dataset, args)
  seconds = time.perf_counter() - start
  evaluate = jax.jit(lambda p, b: _lm_loss(config, p, b))
  total = count = 0.0
  for batch in data.gpt_eval_batches(
    dataset, batch_size=args.batch_size, seq_len=args.train_len, max_batches=args.eval_batches
  ):
    loss, n = evaluate(params, batch)
    total, count = total + float(loss) * float(n), count + float(n)
  val = total / max(count, 1.0)
  print(
    f"{name:14s} train loss {losses[0]:.3f} -> {losses[-1]:.3f}   val loss {val:.4f}  "
    f"({seconds:.0f} s)",
    flush=True,
  )
  return {
    "val_loss": val,
    "first_loss": losses[0],
    "last_loss": losses[-1],
    "train_seconds": seconds,
    "params": tj.models.count_params(config),
  }


def _median_times(fns: dict, args_of: dict, reps: int) -> dict[str, float]:
  """Each function's median seconds over ``reps`` calls, the functions interleaved."""
  for name, fn in fns.items():
    jax.block_until_ready(fn(*args_of[name]))
  times = {name: [] for name in fns}
  for _ in range(reps):
    for name, fn in fns.items():
      start = time.perf_counter()
      jax.block_until_ready(fn(*args_of[name]))
      times[name].append(time.perf_counter() - start)
  return {name: statistics.median(t) for name, t in times.items()}


def kernel_speed(lengths: list[int], window: int, heads: int, head_dim: int, reps: int) -> list:
  """Causal attention forward + backward, full against a sliding window, same shapes."""
  rows = []
  for t in lengths:
    keys = jax.random.split(jax.random.key(t), 3)
    q, k, v = (jax.random.normal(key, (1, t, heads, head_dim), jnp.float32) for key in keys)

    def grad_fn(win):
      def loss(q, k, v):
        return jnp.sum(
          tj.backends.current().attention(
            q, k, v, causal=True, window=win, implementation="chunked"
          )
        )

      return jax.jit(jax.grad(loss, argnums=(0, 1, 2)))

    med = _median_times(
      {"full": grad_fn(None), "window": grad_fn(window)},
      {"full": (q, k, v), "window": (q, k, v)},
      reps,
    )
    rows.append(
      {
        "T": t,
        "window": window,
        "full_s": med["full"],
        "window_s": med["window"],
        "speedup": med["full"] / med["window"],
      }
    )
    print(
      f"attention fwd+bwd T={t}: full {med['full']:.3f} s, window {window} "
      f"{med['window']:.3f} s, {med['full'] / med['window']:.1f}x",
      flush=True,
    )
  return rows


def train_step_cost(name: str, config, lengths: list[int], reps: int) -> dict:
  """One row's train step (forward, backward, AdamW) at each length: seconds and temporaries."""
  optimizer = optax.adamw(1e-3)
  out = {}
  for t in lengths:
    params = tj.models.init(config, jax.random.key(0))
    opt_state = optimizer.init(params)
    ids = jax.random.randint(jax.random.key(t), (1, t + 1), 0, config.vocab_size)
    batch = {
      "tokens": ids[:, :-1],
      "labels": ids[:, 1:],
      "positions": jnp.arange(t)[None],
      "segment_ids": jnp.ones((1, t), jnp.int32),
      "loss_mask": jnp.ones((1, t), bool),
    }

    def step(params, opt_state, batch):
      loss, grads = jax.value_and_grad(lambda p: _lm_loss(config, p, batch)[0])(params)
      updates, opt_state = optimizer.update(grads, opt_state, params)
      return optax.apply_updates(params, updates), opt_state, loss

    compiled = jax.jit(step).lower(params, opt_state, batch).compile()
    temp = runtime.temp_bytes(compiled)
    seconds = _median_times({"s": compiled}, {"s": (params, opt_state, batch)}, reps)["s"]
    out[str(t)] = {"step_s": seconds, "temp_bytes": temp}
    print(
      f"train step {name:14s} T={t:6d}: {seconds:.3f} s, temporaries "
      f"{temp / 2**20 if temp is not None else float('nan'):.0f} MiB",
      flush=True,
    )
  return out


def decode_cost(name: str, config, lengths: list[int], reps: int) -> dict:
  """One decoding step with the cache holding ``L - 1`` tokens, for each generated length L:
  seconds and the cache's bytes (the step is the same program at any L for a rolling or linear
  cache; a full cache grows with L)."""
  model = nnx.merge(tj.models.graphdef(config), tj.models.init(config, jax.random.key(0)))
  step = jax.jit(lambda cache, tok: generate.extend(model, tok, cache))
  tok = jnp.zeros((1, 1), jnp.int32)
  out = {}
  for n in lengths:
    cache = generate.init_cache(config, 1, n)
    cache = cache.replace(lengths=jnp.full((1,), n - 1, jnp.int32))
    nbytes = sum(x.nbytes for x in jax.tree.leaves(cache))
    seconds = _median_times({"s": step}, {"s": (cache, tok)}, reps)["s"]
    out[str(n)] = {"step_ms": 1e3 * seconds, "cache_bytes": int(nbytes)}
    print(
      f"decode {name:14s} L={n:6d}: {1e3 * seconds:.2f} ms/token, cache {nbytes / 2**20:.2f} MiB",
      flush=True,
    )
  return out


def plot(result: dict, path: str) -> None:
  viz.efficient_attention(result).savefig(path, dpi=100)


def main(argv=None) -> dict:
  p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
  p.add_argument("--steps", type=int, default=300)
  p.add_argument("--train-len", type=int, default=256)
  p.add_argument("--batch-size", type=int, default=16)
  p.add_argument("--lr", type=float, default=3e-3)
  p.add_argument("--d-model", type=int, default=128)
  p.add_argument("--layers", type=int, default=3)
  p.add_argument("--heads", type=int, default=4)
  p.add_argument("--windows", default="32,128", help="two sliding-window widths")
  p.add_argument("--seed", type=int, default=0)
  p.add_argument("--eval-batches", type=int, default=16)
  p.add_argument("--kernel-lengths", default="4096,16384")
  p.add_argument("--kernel-window", type=int, default=512)
  p.add_argument("--lengths", default="512,2048,8192,16384", help="train-step context lengths")
  p.add_argument("--decode-lengths", default="1024,4096,16384,32768")
  p.add_argument("--reps", type=int, default=3)
  p.add_argument("--data", default=os.path.join(_ROOT, "runs", "data", "stdlib-4k"))
  p.add_argument("--json", default=os.path.join(_HERE, "results", "efficient_attention.json"))
  args = p.parse_args(argv)
  windows = [int(w) for w in args.windows.split(",") if w]
  ints = lambda s: [int(x) for x in s.split(",") if x]  # noqa: E731

  if not os.path.exists(os.path.join(args.data, "metadata.json")):
    data.prepare(["stdlib"], args.data, compact_vocab=4096)
  dataset = data.load_dataset(args.data)
  kinds = variants(windows)
  configs = {name: config_for(args, dataset.vocab_size, **kw) for name, kw in kinds.items()}
  configs.update(ssm_configs(args, dataset.vocab_size))
  result = {
    "command": " ".join(
      [
        "python",
        os.path.relpath(os.path.abspath(sys.argv[0]), _ROOT),
        *(argv if argv is not None else sys.argv[1:]),
      ]
    ),
    "machine": {
      "cpu": hardware.cpu_name(),
      "cpu_flags": hardware.cpu_flags(),
      "cores": os.cpu_count(),
      "device": hardware.device_kind(),
      "jax": jax.__version__,
    },
    "setup": {
      "d_model": args.d_model,
      "layers": args.layers,
      "heads": args.heads,
      "train_len": args.train_len,
      "steps": args.steps,
      "batch_size": args.batch_size,
      "lr": args.lr,
      "seed": args.seed,
      "vocab_size": dataset.vocab_size,
      "windows": windows,
    },
    "learning": {},
  }
  for name, config in configs.items():
    result["learning"][name] = train_and_evaluate(name, config, dataset, args)
  head_dim = args.d_model // args.heads
  result["attention_kernel"] = kernel_speed(
    ints(args.kernel_lengths), args.kernel_window, args.heads, head_dim, args.reps
  )
  costed = {n: c for n, c in configs.items() if n != f"window-{windows[0]}"}
  result["train_step"] = {
    n: train_step_cost(n, c, ints(args.lengths), args.reps) for n, c in costed.items()
  }
  result["decode"] = {
    n: decode_cost(n, c, ints(args.decode_lengths), 5 * args.reps) for n, c in costed.items()
  }
  os.makedirs(os.path.dirname(os.path.abspath(args.json)), exist_ok=True)
  with open(args.json, "w") as f:
    json.dump(result, f, indent=1)
  png = os.path.splitext(args.json)[0] + ".png"
  plot(result, png)
  print(f"wrote {args.json} and {png}")
  return result


if __name__ == "__main__":
  main()
