"""``tjax bench train``: the jitted training step against PyTorch eager, interleaved in one process.

Ours is the real step (``train.step.make_train_step`` + ``jit_train_step``: the task's token-mean
cross-entropy, clipping and AdamW from ``train.optim.make_optimizer``) on a batch built once with
NumPy and placed on the device, so host loading is not timed. Theirs (``--against torch``, GPT
and Mamba presets) is the ``transformers`` class of the preset's family holding the same weights
(written by ``transformer_jax.hf.save``: ``GPT2LMHeadModel``, ``LlamaForCausalLM`` for the LLaMA
flavour, e.g. ``tinyllama-1.1b``, ``MistralForCausalLM``, ``MambaForCausalLM``,
``Mamba2ForCausalLM``; on CPU transformers' Mamba runs its sequential PyTorch path), in train mode,
with the same tokens, the same loss (token-mean cross-entropy over the same labels),
``clip_grad_norm_`` and ``torch.optim.AdamW`` with the same hyper-parameters; dropout is off on
both sides. Steps alternate (ours, theirs, ours, ...) so both
see the same machine, and medians are compared, after ``--warmup`` untimed steps per side (default
2: the first steps fault each side's scratch memory in, several seconds of kernel time each, and the
per-step page faults and kernel time of the timed steps are in the JSON, ``*_all``).
``--against torch.compile`` adds a ``torch.compile``-d forward+backward when it compiles within
``--compile-timeout`` seconds.

The machine's limit is measured in the same run: the best matmul rate on the step's own shapes
(``machine.run_matmul_limit``; on a GPU or TPU also a large square product), from which
``mfu = model FLOP/s / limit`` and the step's floor ``model FLOPs / limit`` follow. Where
``hardware.PEAK_FLOPS`` knows the device, ``mfu_vs_peak`` sets the same rate against the
datasheet's peak.

PyTorch runs on JAX's device: on CPU in float32 (its ``--dtype bfloat16`` runs float32 too); on an
NVIDIA GPU on "cuda", under ``torch.autocast("cuda", torch.bfloat16)`` for ``--dtype bfloat16``
(master weights float32, as ours), with the fused AdamW, synchronized before the clock is read at
both ends of a step. On a TPU, or a GPU where torch has no CUDA, the rivals are left out
(``left_out`` in the JSON says why). On a GPU, JAX is asked not to preallocate three quarters of
the memory (``hardware.share_gpu_memory``), so the rival finds room.

``--model KEY=VALUE`` (repeatable) overrides a field of the preset's config, the value read as YAML
(``true``, ``null``, ``4``, ``1e-5``, ``cudnn``): ``--model scan_layers=false --model
attention_impl=cudnn``.

``--table NAME=N`` (repeatable) adds a side ``ours+table``: our step again, from the same weights,
built with a kernel table (``backends.KernelTable``) whose entry ``NAME`` is ``N``
(``TABLE_ENTRIES``), and timed in the same interleaved loop: a lever against the default and the
rivals in one run. Values are range-checked, and an entry that changes nothing on this backend is
refused, before anything compiles.

``--library`` adds a side ``library``: the step a library user writes from the README
(``train.make_step(config, make_optimizer(...))``, a state from ``Step.init``, host batches
passed to each call), timed in the same interleaved loop; ``library_vs_ours`` is its median step
over ours (1.0: the library path is as fast as the command's).
"""

from __future__ import annotations

import argparse
import dataclasses
import os
import statistics
import sys
import time

from transformer_jax import backends, hardware, models, runtime
from transformer_jax.bench import machine
from transformer_jax.bench.curves import loss_curves
from transformer_jax.bench.interleave import interleave, profiles, progress, summary
from transformer_jax.bench.overrides import TABLE_ENTRIES, parse_model_overrides, parse_table
from transformer_jax.bench.rivals import Torch
from transformer_jax.bench.train_sides import Library, Ours, random_batch
from transformer_jax.models.config import GPTConfig, MambaConfig, Seq2SeqConfig
from transformer_jax.train.config import TrainConfig


def add_args(p: argparse.ArgumentParser) -> None:
  p.add_argument("--preset", default="gpt2-small", help="model preset (tjax info lists them)")
  p.add_argument("--batch-size", type=int, default=4)
  p.add_argument(
    "--seq-len",
    type=int,
    default=None,
    help=f"tokens per row (default: {DEFAULT_SEQ_LEN}, or the preset's max_len where "
    "that is shorter)",
  )
  p.add_argument(
    "--dtype",
    choices=("float32", "bfloat16"),
    default="float32",
    help="compute dtype (parameters stay float32)",
  )
  p.add_argument("--steps", type=int, default=5, help="timed steps per side")
  p.add_argument(
    "--warmup",
    type=int,
    default=2,
    help="untimed steps per side after the first (each side's first steps fault its "
    "scratch memory in, more of it while the other side's steps take freed pages)",
  )
  p.add_argument(
    "--against", default="torch", help="comma-separated rivals: torch (eager), torch.compile, none"
  )
  p.add_argument(
    "--compile-timeout",
    type=float,
    default=180.0,
    help="seconds torch.compile may take before it is left out",
  )
  p.add_argument("--remat", choices=("none", "full", "dots"), default="none")
  p.add_argument("--seed", type=int, default=0)
  p.add_argument(
    "--curve-steps",
    type=int,
    default=0,
    help="also train float32 and bfloat16 this many steps each (GPT presets), "
    "from the same weights on the same batches of the embedded corpus, and "
    "compare the two loss curves",
  )
  p.add_argument(
    "--curve-data",
    default=None,
    help="dataset folder for --curve-steps (default runs/data/stdlib-VOCAB, prepared "
    "from the embedded corpus on first use)",
  )
  p.add_argument(
    "--profile",
    type=int,
    default=0,
    metavar="N",
    help="after the timed steps, trace N more steps per side and record their device "
    "kernels by kind (bench.profile; GPU kernels only)",
  )
  p.add_argument(
    "--profile-dir",
    default=None,
    help="with --profile: also keep each side's trace there, gzipped Chrome JSON "
    "(SIDE.trace.json.gz)",
  )
  p.add_argument(
    "--model",
    action="append",
    default=[],
    metavar="KEY=VALUE",
    help="override a field of the preset's model config, the value read as YAML "
    "(repeatable): --model scan_layers=false --model attention_impl=cudnn",
  )
  p.add_argument(
    "--table",
    action="append",
    default=[],
    metavar="NAME=N",
    help="also time our step traced with this kernel-table entry set (repeatable; "
    f"side 'ours+table'): {', '.join(TABLE_ENTRIES)}",
  )
  p.add_argument(
    "--library",
    action="store_true",
    help="also time the library's step (train.make_step, as the README writes it; side 'library')",
  )


# ``--seq-len`` without a value: GPT-2 small's CPU benchmark shape, cut to a shorter context.
DEFAULT_SEQ_LEN = 256


def resolve_seq_len(args, config) -> int:
  """``args.seq_len``, or the default that fits ``config``'s context; checked before anything runs.

  The default is ``DEFAULT_SEQ_LEN`` cut to ``max_len``. An explicit length may pass ``max_len``
  only where the model has no position table (RoPE, ALiBi, T5's relative buckets), as the model
  itself allows.

  Raises:
    ValueError: for a length below 1, or past ``max_len`` of a model with a position table.
  """
  if args.seq_len is None:
    return min(DEFAULT_SEQ_LEN, config.max_len)
  if args.seq_len < 1:
    raise ValueError(f"--seq-len {args.seq_len}: must be at least 1")
  has_table = getattr(config, "position", "learned") in ("learned", "sinusoidal")  # BERT: learned
  if has_table and args.seq_len > config.max_len:
    raise ValueError(
      f"--seq-len {args.seq_len}: longer than {args.preset}'s max_len={config.max_len}"
    )
  return args.seq_len


def step_matmul_shapes(config, tokens: int) -> list[tuple[int, int, int]]:
  """``(m, k, n)`` of the step's projections: attention, feed-forward and vocabulary (a Mamba
  model: its mixers' in- and out-projections)."""
  d = config.d_model
  if isinstance(config, MambaConfig):
    e = config.d_inner
    return [(tokens, d, 2 * e), (tokens, e, d), (tokens, d, config.vocab_size)]
  return [
    (tokens, d, 3 * d),
    (tokens, d, config.d_ff),
    (tokens, config.d_ff, d),
    (tokens, d, config.vocab_size),
  ]


def run(args) -> dict:
  """Runs the benchmark described by ``args`` (see ``add_args``); returns the result dict."""

  hardware.share_gpu_memory()  # before JAX starts its backend, where it has not yet
  runtime.bf16_notice(args.dtype)
  if args.curve_steps < 0:
    raise ValueError(f"--curve-steps {args.curve_steps}: must be 0 (off) or a number of steps")
  if args.profile < 0:
    raise ValueError(f"--profile {args.profile}: must be 0 (off) or a number of steps")
  rivals = [r for r in args.against.split(",") if r and r != "none"]
  for r in rivals:
    if r not in ("torch", "torch.compile"):
      raise ValueError(f"--against: {r!r} is not one of torch, torch.compile, none")
  overrides = parse_model_overrides(getattr(args, "model", None) or [])
  table = parse_table(getattr(args, "table", None) or [], backends.platform())
  config = models.get_config(args.preset, dtype=args.dtype, remat=args.remat, **overrides)
  if rivals and not isinstance(config, (GPTConfig, MambaConfig)):
    raise ValueError(
      f"--against {args.against}: the PyTorch rival is a causal LM (GPT presets, "
      f"Mamba presets); {args.preset} is a {type(config).__name__} (use --against "
      "none)"
    )
  args.seq_len = resolve_seq_len(args, config)
  config = dataclasses.replace(
    config, **{f: 0.0 for f in ("dropout_rate", "attention_dropout_rate") if hasattr(config, f)}
  )
  host_batch, task_name = random_batch(config, args.batch_size, args.seq_len, args.seed)
  tc = TrainConfig()
  lr = 1e-4
  platform, kind = backends.platform(), hardware.device_kind()
  shapes = step_matmul_shapes(config, args.batch_size * args.seq_len)
  start = time.perf_counter()
  # The float32 limit on CPU always (the bfloat16 step is also compared with it there); on an
  # accelerator only the run's own dtype.
  limits = (
    {"float32": machine.run_matmul_limit(shapes, dtype="float32")}
    if platform == "cpu" or args.dtype == "float32"
    else {}
  )
  if args.dtype == "bfloat16" and (platform != "cpu" or hardware.has_bf16_units()):
    limits["bfloat16"] = machine.run_matmul_limit(shapes, dtype="bfloat16")
  progress(f"matmul limit measured in {time.perf_counter() - start:.0f} s")

  start = time.perf_counter()
  sides = {"ours": Ours(config, host_batch, task_name, lr, args.seed)}
  progress(f"our step compiled in {time.perf_counter() - start:.0f} s")
  if table is not None:
    start = time.perf_counter()
    sides["ours+table"] = Ours(config, host_batch, task_name, lr, args.seed, table=table)
    progress(f"our step with {table.changed()} compiled in {time.perf_counter() - start:.0f} s")
  if getattr(args, "library", False):
    start = time.perf_counter()
    sides["library"] = Library(config, host_batch, task_name, lr, args.seed)
    progress(f"the library's step compiled in {time.perf_counter() - start:.0f} s")
  left_out = {}
  device, why_not = machine.torch_device() if rivals else (None, "")
  autocast = "bfloat16" if device == "cuda" and args.dtype == "bfloat16" else None
  for r in rivals:
    if device is None:
      left_out[r] = why_not
      print(f"# {r}: left out ({why_not})", file=sys.stderr)
      continue
    try:
      side = Torch(
        config,
        sides["ours"].params,
        host_batch,
        lr,
        tc.weight_decay,
        tc.clip_norm,
        tc.b1,
        tc.b2,
        tc.eps,
        compiled=r == "torch.compile",
        device=device,
        autocast=autocast,
      )
      progress(f"{r} built")
      if r == "torch.compile":
        took = side.compile()
        progress(f"torch.compile compiled in {took:.0f} s")
        if took > args.compile_timeout:
          left_out[r] = f"torch.compile took {took:.0f} s, over --compile-timeout"
          print(f"# torch.compile took {took:.0f} s: left out", file=sys.stderr)
          continue
      sides[r] = side
    except Exception as e:  # noqa: BLE001 - a rival that fails to build is reported, not fatal
      left_out[r] = f"could not run ({type(e).__name__}: {e})"
      print(f"# {r}: could not run ({type(e).__name__}: {e})", file=sys.stderr)
  first, times, per_step = interleave(sides, args.warmup, args.steps)
  med = {name: statistics.median(t) for name, t in times.items()}

  tokens = args.batch_size * args.seq_len
  is_s2s = isinstance(config, Seq2SeqConfig)
  flops_per_token = models.train_flops_per_token(config, args.seq_len) / (2 if is_s2s else 1)
  tokens_per_step = tokens * (2 if is_s2s else 1)
  step_flops = flops_per_token * tokens_per_step
  ref = (limits.get(args.dtype) or limits["float32"])["flops_per_sec"]
  peak = hardware.peak_flops(kind, args.dtype)

  def vs_peak(name: str) -> dict:  # the same rate against the datasheet, where it is known
    return {"mfu_vs_peak": step_flops / med[name] / peak} if peak else {}

  def our_row(name: str) -> dict:  # one of our sides ("ours", "ours+table", "library")
    side = sides[name]
    return {
      "compile_s": side.compile_s,
      "trace_s": side.trace_s,
      "first_step_s": first[name],
      "step_s": summary(times[name]),
      "tokens_per_sec": tokens_per_step / med[name],
      "model_flops_per_sec": step_flops / med[name],
      "mfu": step_flops / med[name] / ref,
      **vs_peak(name),
      "losses": side.losses,
      "temp_bytes": side.temp_bytes,
      **per_step[name],
    }

  ours = sides["ours"]
  result = {
    "benchmark": "train step",
    "preset": args.preset,
    "batch_size": args.batch_size,
    "seq_len": args.seq_len,
    "dtype": args.dtype,
    "remat": args.remat,
    "model_overrides": overrides,
    "device_kind": kind,
    "platform": platform,
    # "auto" resolves by dtype and CPU (models.unrolls_layers): the layers ran unrolled or scanned.
    "layers": "unrolled" if models.unrolls_layers(config) else "scanned",
    "microbatches": ours.microbatches,
    "compile_s_by_microbatches": ours.compile_s_by_microbatches,
    "params": models.count_params(config),
    "model_flops_per_step": step_flops,
    "ours": our_row("ours"),
    "limit": {"matmul": limits, "step_floor_s": step_flops / ref},
  }
  if peak:
    result["limit"]["peak_flops"] = peak
  if platform == "gpu":
    result["xla_python_client_preallocate"] = os.environ.get("XLA_PYTHON_CLIENT_PREALLOCATE")
  for name in rivals:
    if name in sides:
      side = sides[name]
      result[name] = {
        "first_step_s": first[name],
        "step_s": summary(times[name]),
        "tokens_per_sec": tokens_per_step / med[name],
        "mfu": step_flops / med[name] / ref,
        **vs_peak(name),
        "architecture": side.architecture,
        "losses": side.losses,
        "device": side.device,
        "autocast": side.autocast,
        "fused_adamw": side.fused_adamw,
        **per_step[name],
      }
      result[f"speedup_vs_{name}"] = med[name] / med["ours"]
      # Same weights, tokens and loss: the first losses agree to float32 rounding.
      result[f"first_loss_diff_vs_{name}"] = abs(side.losses[0] - ours.losses[0])
  if "torch.compile" in sides:
    result["ratio_vs_torch_compile"] = med["torch.compile"] / med["ours"]
  if table is not None:
    result["table"] = table.changed()
    result["ours+table"] = our_row("ours+table")
    result["speedup_of_table"] = med["ours"] / med["ours+table"]
    # The same step from the same weights: the first losses agree to the levers' rounding.
    result["first_loss_diff_of_table"] = abs(sides["ours+table"].losses[0] - ours.losses[0])
    if "torch.compile" in sides:
      result["ratio_vs_torch_compile_with_table"] = med["torch.compile"] / med["ours+table"]
  if "library" in sides:
    result["library"] = {**our_row("library"), "microbatches": sides["library"].microbatches}
    result["library_vs_ours"] = med["library"] / med["ours"]
  if left_out:
    result["left_out"] = left_out
  if args.profile:
    result["profile"] = profiles(sides, args.profile, getattr(args, "profile_dir", None))
  if args.curve_steps:
    del sides
    result["loss_curves"] = loss_curves(
      config, args.curve_steps, args.batch_size, args.seq_len, args.seed, args.curve_data
    )
  return result


def table(result: dict) -> str:
  """The result as a few aligned lines."""
  ref = result["limit"]["step_floor_s"]
  on_cpu = result.get("platform", "cpu") == "cpu"
  on = "" if on_cpu else f" on {result['device_kind']}"
  matmul = result["limit"]["matmul"]
  widest = matmul[list(matmul)[-1]]["flops_per_sec"]
  lines = [
    f"train step {result['preset']} {result['batch_size']}x{result['seq_len']} "
    f"{result['dtype']}{on}, layers {result['layers']}: floor "
    f"{ref:.{2 if on_cpu else 4}f} s at "
    "the measured matmul limit "
    f"({widest / 1e9:.0f} GFLOP/s)"
  ]
  if result.get("model_overrides"):
    lines.append(
      "  model overrides: " + ", ".join(f"{k}={v}" for k, v in result["model_overrides"].items())
    )
  if result.get("table"):
    lines.append("  ours+table: " + ", ".join(f"{k}={v}" for k, v in result["table"].items()))
  for name in ("ours", "ours+table", "library", "torch", "torch.compile"):
    if name in result:
      r = result[name]
      extra = (
        f"  {result.get(f'speedup_vs_{name}', 1.0):.2f}x"
        if name not in ("ours", "ours+table", "library")
        else ""
      )
      peak = f" ({100 * r['mfu_vs_peak']:.1f}% of peak)" if "mfu_vs_peak" in r else ""
      where = (
        f"  [{r['device']}" + (f", autocast {r['autocast']}" if r.get("autocast") else "") + "]"
        if r.get("device", "cpu") != "cpu"
        else ""
      )
      step = f"{r['step_s']['median']:7.2f}" if on_cpu else f"{r['step_s']['median']:7.4f}"
      lines.append(
        f"  {name:<14s} {step} s/step  "
        f"{r['tokens_per_sec']:8.0f} tok/s  MFU {100 * r['mfu']:5.1f}%{peak}"
        + (f"  (ours is{extra} faster)" if extra else "")
        + where
      )
  if "ratio_vs_torch_compile" in result:
    lines.append(
      f"  ratio vs torch.compile: {result['ratio_vs_torch_compile']:.2f}x "
      "(their median step / ours)"
    )
  if "speedup_of_table" in result:
    lines.append(
      f"  ours+table: {result['speedup_of_table']:.3f}x ours"
      + (
        f", {result['ratio_vs_torch_compile_with_table']:.2f}x vs torch.compile"
        if "ratio_vs_torch_compile_with_table" in result
        else ""
      )
    )
  if "library_vs_ours" in result:
    lines.append(f"  library: {result['library_vs_ours']:.3f}x ours' step time")
  for name, why in result.get("left_out", {}).items():
    lines.append(f"  {name}: left out ({why})")
  if "loss_curves" in result:
    c = result["loss_curves"]
    lines.append(
      f"  loss curves over {c['steps']} steps: bfloat16 within "
      f"{100 * c['max_relative_gap']:.2f}% of float32 (10-step means; final "
      f"{c['losses']['float32'][-1]:.3f} vs {c['losses']['bfloat16'][-1]:.3f})"
    )
  return "\n".join(lines)
