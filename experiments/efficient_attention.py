"""Beyond quadratic attention: full softmax, sliding windows, linear attention, block-sparse
patterns, LSH and state-space models as causal language models, and full attention, BigBird and
Linformer as masked-LM encoders, side by side.

Causal rows: small RoPE GPTs with the same parameters (the attention kind changes no weight), and
a Reformer and three state-space models with as many parameters within 2% (all counted), trained
on the same corpus (the embedded Python standard library) for the same steps:

  softmax       full causal softmax attention (the causal rows' baseline)
  window-W      softmax over the last W tokens (two widths; decoding with a rolling cache)
  linear        linear attention (elu + 1 features, Katharopoulos et al. 2020)
  linear-decay  linear attention with RetNet's per-head decay
  sparse-fixed, sparse-strided
                block-sparse softmax (ops.sparse): Child et al.'s fixed pattern (own block of 64
                and 8 summary positions per block) and strided pattern (two blocks of 64 and
                every 64th position)
  lsh           a Reformer of LSH layers only (Kitaev et al. 2020: one hash round, 8 buckets,
                chunks of 64 attending to themselves and the previous chunk, reversible layers);
                its two streams feed a [2D, V] head, so its feed-forward is narrowed to match the
                size; it sees no document boundaries (the GPTs' segment ids)
  mamba1        Mamba blocks (selective scan; Gu and Dao 2023), no attention
  mamba2        Mamba-2 blocks (SSD; Dao and Gu 2024)
  hybrid        Mamba, attention, Mamba blocks, each with a gated MLP (Jamba's pattern)

Masked-LM rows: BERT encoders of one size (every weight shared; Linformer adds its projections),
trained on BERT pairs of the same corpus with BERT's masking, by the masked-token loss only (no
next-sentence loss), 2 rows of 1024 tokens a step (as many tokens as 8 x 256), and compared by
validation masked-LM loss:

  mlm-full      full bidirectional softmax (the encoders' baseline)
  mlm-bigbird   BigBird's block-sparse pattern (blocks of 64: a window of 3, 2 global, 3 random)
  mlm-linformer keys and values projected to 128 rows (one projection per layer for both)

Then, in the same run, what each kind costs, every speed as a ratio to its baseline's, the kinds
timed in turn at each length (interleaved repetitions, medians):

  * the attention kernel alone, causal, forward + backward, full against windowed, at 4k and 16k
    tokens;
  * a train step's time and its compiled temporaries (XLA's memory analysis) against the context
    length: causal rows at 512 and 4k tokens, encoders at 512, 1k, 2k and 4k;
  * a decoding step's time and the cache's bytes against the generated length, 1k and 32k tokens
    (one step with the cache holding that many tokens; the Reformer does not decode here).

  python experiments/efficient_attention.py   # 100 steps of 8 x 256 (encoders 2 x 1024), 3 reps
  python experiments/efficient_attention.py --steps 20 --lengths 512,2048 \\
      --decode-lengths 1024,4096 --json /tmp/ea.json       # a quick look
  python experiments/efficient_attention.py --rows lsh,mlm-bigbird ...   # some rows (and their
                                                                        # baselines)

Writes experiments/results/efficient_attention.json and efficient_attention.png; the JSON records
the machine and its load average while the script ran.
"""

from __future__ import annotations

import argparse
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
from transformer_jax import data, generate, hardware, runtime, viz
from efficient_attention_rows import (  # experiments/: this script's own folder
  BASELINES,
  config_for,
  cost_batch,
  encoder_configs,
  loss_of,
  lsh_config,
  num_params,
  ssm_configs,
  task_of,
  variants,
)

_HERE = os.path.dirname(os.path.abspath(__file__))
_ROOT = os.path.dirname(_HERE)


def shapes(args, task: str) -> tuple[int, int]:
  """(rows, tokens per row) a training step of ``task`` sees."""
  if task == "masked":
    return args.mlm_batch_size, args.mlm_train_len
  return args.batch_size, args.train_len


def train_steps(config, dataset, args) -> tuple[object, list[float]]:
  """``config``'s model from ``args.seed``, trained ``args.steps`` AdamW steps (warmup over an
  eighth, cosine to a tenth, clipping at 1: ``pe_extrapolation.train_steps``'s schedule) on
  ``dataset``'s GPT rows or BERT pairs: ``(params, losses)``."""
  params = tj.models.init(config, jax.random.key(args.seed))
  schedule = optax.warmup_cosine_decay_schedule(
    0.0, args.lr, args.steps // 8, args.steps, end_value=args.lr / 10
  )
  optimizer = optax.chain(optax.clip_by_global_norm(1.0), optax.adamw(schedule, weight_decay=0.1))
  opt_state = optimizer.init(params)
  rows, length = shapes(args, task_of(config))
  kind = "bert" if task_of(config) == "masked" else "gpt"
  loader = data.make_loader(kind, dataset, batch_size=rows, seq_len=length, seed=args.seed)

  @jax.jit
  def step(params, opt_state, batch):
    loss, grads = jax.value_and_grad(lambda p: loss_of(config, p, batch)[0])(params)
    updates, opt_state = optimizer.update(grads, opt_state, params)
    return optax.apply_updates(params, updates), opt_state, loss

  losses = []
  for i in range(args.steps):
    params, opt_state, loss = step(params, opt_state, loader.batch_at(i))
    losses.append(float(loss))
  return params, losses


def eval_batches(dataset, args, task: str):
  rows, length = shapes(args, task)
  if task == "masked":
    return data.bert_eval_batches(
      dataset, batch_size=rows, seq_len=length, num_batches=args.mlm_eval_batches
    )
  return data.gpt_eval_batches(
    dataset, batch_size=rows, seq_len=length, max_batches=args.eval_batches
  )


def train_and_evaluate(name: str, config, dataset, args) -> dict:
  """``args.steps`` training steps; the validation loss after (per predicted token)."""
  start = time.perf_counter()
  params, losses = train_steps(config, dataset, args)
  seconds = time.perf_counter() - start
  evaluate = jax.jit(lambda p, b: loss_of(config, p, b))
  total = count = 0.0
  for batch in eval_batches(dataset, args, task_of(config)):
    loss, n = evaluate(params, batch)
    total, count = total + float(loss) * float(n), count + float(n)
  val = total / max(count, 1.0)
  print(
    f"{name:14s} train loss {losses[0]:.3f} -> {losses[-1]:.3f}   val loss {val:.4f}  "
    f"({seconds:.0f} s)",
    flush=True,
  )
  return {
    "task": task_of(config),
    "val_loss": val,
    "val_tokens": int(count),
    "first_loss": losses[0],
    "last_loss": losses[-1],
    "train_seconds": seconds,
    "params": num_params(config),
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


def train_step_costs(configs: dict, lengths: list[int], reps: int) -> dict:
  """Each row's train step (forward, backward, AdamW) at each length: seconds (the rows timed in
  turn, medians), compiled temporaries, and speed relative to the baseline (rows of one task)."""
  optimizer = optax.adamw(1e-3)
  out = {name: {} for name in configs}
  for t in lengths:
    fns, args_of = {}, {}
    for name, config in configs.items():
      params = tj.models.init(config, jax.random.key(0))
      opt_state = optimizer.init(params)
      batch = cost_batch(config, t)

      def step(params, opt_state, batch, config=config):
        loss, grads = jax.value_and_grad(lambda p: loss_of(config, p, batch)[0])(params)
        updates, opt_state = optimizer.update(grads, opt_state, params)
        return optax.apply_updates(params, updates), opt_state, loss

      fns[name] = jax.jit(step).lower(params, opt_state, batch).compile()
      args_of[name] = (params, opt_state, batch)
      out[name][str(t)] = {"temp_bytes": runtime.temp_bytes(fns[name])}
    for name, seconds in _median_times(fns, args_of, reps).items():
      out[name][str(t)]["step_s"] = seconds
    base = out[BASELINES[task_of(next(iter(configs.values())))]][str(t)]["step_s"]
    for name in configs:
      row = out[name][str(t)]
      row["speedup"] = base / row["step_s"]
      temp = row["temp_bytes"]
      print(
        f"train step {name:14s} T={t:6d}: {row['step_s']:.3f} s ({row['speedup']:.2f}x), "
        f"temporaries {temp / 2**20 if temp is not None else float('nan'):.0f} MiB",
        flush=True,
      )
  return out


def decode_costs(configs: dict, lengths: list[int], reps: int) -> dict:
  """One decoding step with the cache holding ``L - 1`` tokens, for each generated length L, the
  rows timed in turn: seconds, the cache's bytes (the step is the same program at any L for a
  rolling or linear cache; a full cache grows with L) and speed relative to softmax's."""
  out = {name: {} for name in configs}
  tok = jnp.zeros((1, 1), jnp.int32)
  steps = {}
  for name, config in configs.items():
    model = nnx.merge(tj.models.graphdef(config), tj.models.init(config, jax.random.key(0)))
    steps[name] = jax.jit(lambda cache, tok, model=model: generate.extend(model, tok, cache))
  for n in lengths:
    args_of = {}
    for name, config in configs.items():
      cache = generate.init_cache(config, 1, n)
      args_of[name] = (cache.replace(lengths=jnp.full((1,), n - 1, jnp.int32)), tok)
    for name, seconds in _median_times(steps, args_of, reps).items():
      nbytes = sum(x.nbytes for x in jax.tree.leaves(args_of[name][0]))
      out[name][str(n)] = {"step_ms": 1e3 * seconds, "cache_bytes": int(nbytes)}
    for name in configs:
      row = out[name][str(n)]
      row["speedup"] = out["softmax"][str(n)]["step_ms"] / row["step_ms"]
      print(
        f"decode {name:14s} L={n:6d}: {row['step_ms']:.2f} ms/token ({row['speedup']:.1f}x), "
        f"cache {row['cache_bytes'] / 2**20:.2f} MiB",
        flush=True,
      )
  return out


def plot(result: dict, path: str) -> None:
  viz.efficient_attention(result).savefig(path, dpi=100)


def _load(result: dict, phase: str, path: str) -> None:
  """Notes the 1-minute load average as ``phase`` ends (the machine is shared or it is not) and
  writes what there is so far to ``path``."""
  result["machine"]["load_average"][phase] = round(os.getloadavg()[0], 2)
  os.makedirs(os.path.dirname(os.path.abspath(path)), exist_ok=True)
  with open(path, "w") as f:
    json.dump(result, f, indent=1)


def main(argv=None) -> dict:
  p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
  p.add_argument("--steps", type=int, default=100)
  p.add_argument("--train-len", type=int, default=256)
  p.add_argument("--batch-size", type=int, default=8)
  p.add_argument("--lr", type=float, default=3e-3)
  p.add_argument("--d-model", type=int, default=128)
  p.add_argument("--layers", type=int, default=3)
  p.add_argument("--heads", type=int, default=4)
  p.add_argument("--windows", default="32,128", help="two sliding-window widths")
  p.add_argument("--lsh-chunk", type=int, default=64)
  p.add_argument("--lsh-buckets", type=int, default=8, help="2 x train-len / lsh-chunk")
  p.add_argument("--mlm-train-len", type=int, default=1024)
  p.add_argument("--mlm-batch-size", type=int, default=2)
  p.add_argument("--bigbird-block", type=int, default=64)
  p.add_argument("--linformer-rows", type=int, default=128)
  p.add_argument("--seed", type=int, default=0)
  p.add_argument("--eval-batches", type=int, default=4)
  p.add_argument("--mlm-eval-batches", type=int, default=32)
  p.add_argument("--kernel-lengths", default="4096,16384")
  p.add_argument("--kernel-window", type=int, default=512)
  p.add_argument("--lengths", default="512,4096", help="causal train-step context lengths")
  p.add_argument("--mlm-lengths", default="512,1024,2048,4096", help="encoders' train step")
  p.add_argument("--decode-lengths", default="1024,32768")
  p.add_argument("--reps", type=int, default=3)
  p.add_argument("--rows", default="", help="comma-separated rows (and their baselines); all")
  p.add_argument("--conditions", default="", help="what else ran on the machine, for the JSON")
  p.add_argument("--data", default=os.path.join(_ROOT, "runs", "data", "stdlib-4k"))
  p.add_argument("--json", default=os.path.join(_HERE, "results", "efficient_attention.json"))
  args = p.parse_args(argv)
  windows = [int(w) for w in args.windows.split(",") if w]
  ints = lambda s: [int(x) for x in s.split(",") if x]  # noqa: E731

  if not os.path.exists(os.path.join(args.data, "metadata.json")):
    data.prepare(["stdlib"], args.data, compact_vocab=4096)
  dataset = data.load_dataset(args.data)
  vocab = dataset.vocab_size
  configs = {name: config_for(args, vocab, **kw) for name, kw in variants(windows).items()}
  configs["lsh"] = lsh_config(args, vocab)
  configs.update(ssm_configs(args, vocab))
  configs.update(encoder_configs(args, vocab, args.mlm_train_len))
  if args.rows:
    wanted = set(args.rows.split(","))
    unknown = wanted - set(configs)
    if unknown:
      p.error(f"--rows: no row {', '.join(sorted(unknown))} (rows: {', '.join(configs)})")
    wanted |= {BASELINES[task_of(configs[n])] for n in wanted}
    configs = {n: c for n, c in configs.items() if n in wanted}
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
      "load_average": {"start": round(os.getloadavg()[0], 2)},
    },
    "conditions": args.conditions,
    "setup": {
      "d_model": args.d_model,
      "layers": args.layers,
      "heads": args.heads,
      "train_len": args.train_len,
      "steps": args.steps,
      "batch_size": args.batch_size,
      "mlm_train_len": args.mlm_train_len,
      "mlm_batch_size": args.mlm_batch_size,
      "lr": args.lr,
      "seed": args.seed,
      "vocab_size": vocab,
      "unigram_val_loss": data.unigram_cross_entropy(dataset),  # a model that learnt no context
      "windows": windows,
      "lsh": {"chunk": args.lsh_chunk, "buckets": args.lsh_buckets, "hashes": 1},
      "lsh_d_ff": configs["lsh"].d_ff if "lsh" in configs else None,
      "bigbird_block": args.bigbird_block,
      "linformer_rows": args.linformer_rows,
      "baselines": BASELINES,
    },
    "learning": {},
  }
  for name, config in configs.items():
    result["learning"][name] = train_and_evaluate(name, config, dataset, args)
    _load(result, f"learning {name}", args.json)
  head_dim = args.d_model // args.heads
  result["attention_kernel"] = kernel_speed(
    ints(args.kernel_lengths), args.kernel_window, args.heads, head_dim, args.reps
  )
  _load(result, "attention_kernel", args.json)
  causal = {
    n: c for n, c in configs.items() if task_of(c) == "causal" and n != f"window-{windows[0]}"
  }
  encoders = encoder_configs(args, vocab, max(ints(args.mlm_lengths), default=args.mlm_train_len))
  encoders = {n: c for n, c in encoders.items() if n in configs}
  result["train_step"] = {}
  for rows, lengths in ((causal, args.lengths), (encoders, args.mlm_lengths)):
    if rows:
      result["train_step"].update(train_step_costs(rows, ints(lengths), args.reps))
  _load(result, "train_step", args.json)
  decoders = {n: c for n, c in causal.items() if n != "lsh"}  # the Reformer has no cache here
  result["decode"] = decode_costs(decoders, ints(args.decode_lengths), 5 * args.reps)
  _load(result, "decode", args.json)
  loads = result["machine"]["load_average"].values()
  if not result["conditions"]:
    result["conditions"] = (
      f"1-minute load average {min(loads):.1f} to {max(loads):.1f} on "
      f"{os.cpu_count()} cores while it ran"
    )
  _load(result, "end", args.json)
  png = os.path.splitext(args.json)[0] + ".png"
  plot(result, png)
  print(f"wrote {args.json} and {png}")
  return result


if __name__ == "__main__":
  main()
