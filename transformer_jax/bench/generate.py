"""``tjax bench generate``: greedy generation, transformer_jax against Hugging Face ``generate``.

    tjax bench generate                          # gpt2-small shape, prompt 32, 128 new tokens,
                                                 # batch 1 and 8, float32 and bfloat16
    tjax bench generate --batch-sizes 1 --dtypes float32 --reps 3 --json x.json
    python experiments/bench_generate.py ...     # the same (its former command line)

Both sides run the same random weights (``init_std`` 0.02): a transformer_jax model is initialised,
written with ``transformer_jax.hf.save`` and read back by ``transformers.GPT2LMHeadModel`` (a Mamba
preset: ``MambaForCausalLM`` or ``Mamba2ForCausalLM``, its PyTorch path on CPU). They do the
same work: greedy, exactly ``--new-tokens`` tokens per row (no EOS), batch rows of one prompt
length. Hugging Face runs its normal path: ``model.generate`` with its KV cache under
``torch.inference_mode()``, ``torch.set_num_threads(--torch-threads)`` (default: all cores). It is
also timed with ``--torch-threads-alt`` threads (default 1): when other processes load the machine,
torch's OpenMP threads wait for each other at every operation and one thread can be several times
faster than all cores, so ``ratio_vs_their_best_threads`` (against their faster setting) is the
figure that does not flatter us. bfloat16 means bfloat16 weights and compute on both sides (our
``dtype`` and ``param_dtype``, ``model.to(torch.bfloat16)`` there).

Repetitions alternate (ours, theirs, ours, theirs, ...) so that both see the same machine load, and
medians are reported. Numbers per (dtype, batch):
  * ``new_tokens_per_sec``: ``batch * new_tokens / median wall time of one generate call`` (prompt
    processing included; ``ratio`` = ours / theirs).
  * ``ttft_s``: time to first token, the median wall time of ``generate`` with one new token
    (prefill + the first token).
  * ``decode_tokens_per_sec``: ``batch * (new_tokens - 1) / decode_s``, the rate of the one-token
    steps alone. ``decode_s`` is the median over repetitions of (full call - one-token call), the
    two calls made back to back in each repetition so that their difference comes from the same
    moments. When that median is not positive (a tiny model's steps are shorter than the calls'
    jitter) the step time, its rate and its fractions of the floor are ``None`` and
    ``step_unresolved`` says why: never a negative or clamped time.
  * ``compile_s`` (ours): first call minus the median steady call, for the full call and for the
    one-token call (separate compilations).
  * ``tokens_equal``: whether the greedy tokens agree. Random weights give near-ties; when the
    tokens part, the first index where they do and both models' logit gap between the two
    candidates there are recorded.

The machine's weight-streaming bandwidth (``machine.weight_bandwidth``: a matrix-vector product over
a 512 MB matrix, which is what a batch-1 step does with every weight) and the weights' size are
measured in the same run, between the timed calls of each case (the rate drifts when other machines
share the memory bus): ``weight_bytes / median bandwidth`` is a floor on a batch-1 step's time for
both sides, and ``fraction_of_bandwidth_floor`` = that floor / our median step time. Each reading
is the best of 5 products, a limit; ``fraction_of_sustained_floor`` uses the same products' mean
rate instead, the like-for-like figure for a step time that is itself a mean over many tokens (the
same product's calls spread on a shared cloud VM). ``fraction_of_best_floor`` is the
strictest: the floor at the case's fastest reading, for a machine whose memory moves between a
slow and a fast state within one case (the median reading can then fall on the slow side while the
timed calls ran on the fast one). ``fraction_of_paired_floor`` follows the state instead: each
repetition's step against the reading taken right before its calls, the median over repetitions
(``all`` lists them). Other processes share the machine;
the load average is recorded before and after.

With ``--cpu-poll`` (or ``TJAX_CPU_POLL=1``) the whole run holds
``backends.cpu.poll.cpu_poll``'s request (idle CPUs poll instead of halting, where the OS lets
this process ask; it covers the whole machine, so it is off unless asked for): both sides and the
bandwidth readings run under the same setting either way, and ``cpu_poll`` in the JSON says
whether it was requested and held, or why
not. ``machine.cpu_idle`` records how the machine's idle CPUs wait.

Hugging Face runs on JAX's device: on CPU as above; when JAX runs on a GPU, on "cuda" (model and
inputs on the GPU, the device synchronized at both ends of each timed call), where the thread
settings (``--torch-threads``, ``--torch-threads-alt``) do not apply: there is one setting, and
``torch_threads`` is None. JAX does not preallocate the GPU's memory (``hardware.share_gpu_memory``)
so that both fit. On a TPU, or a GPU where torch has no CUDA, there is no rival on the same device
and the run stops with an error. ``device_kind``, ``platform`` and ``hf_device`` record where each
side ran.
"""

from __future__ import annotations

import argparse
import copy
import dataclasses
import datetime
import json
import os
import sys
import tempfile
import warnings

import jax
import numpy as np
from flax import nnx

import transformer_jax.hf as tjhf
from transformer_jax import backends, hardware, models
from transformer_jax.bench import machine
from transformer_jax.bench.generate_case import (
  Ours,
  bench_case,
  divergence,
  paired_fraction,
  step_time,
)
from transformer_jax.bench.rivals import Theirs, hf_device
from transformer_jax.backends.cpu import poll

# The case's parts live in bench.generate_case and bench.rivals; callers also import them from here.
__all__ = [
  "DEFAULT_NEW_TOKENS",
  "DEFAULT_PROMPT_LEN",
  "Ours",
  "Theirs",
  "add_args",
  "bench_case",
  "check_args",
  "divergence",
  "fit_lengths",
  "hf_device",
  "main",
  "paired_fraction",
  "parse_args",
  "run",
  "step_time",
  "table",
]

_DTYPES = ("float32", "bfloat16")


def parse_args(argv=None) -> argparse.Namespace:
  p = argparse.ArgumentParser(
    description=__doc__.split("\n")[0], formatter_class=argparse.ArgumentDefaultsHelpFormatter
  )
  add_args(p)
  return check_args(p, p.parse_args(argv))


def add_args(p: argparse.ArgumentParser) -> None:
  p.add_argument(
    "--preset",
    default="gpt2-small",
    help="a GPT-2 or Mamba preset (GPT2LMHeadModel, MambaForCausalLM or "
    "Mamba2ForCausalLM on their side)",
  )
  p.add_argument("--batch-sizes", default="1,8", help="comma-separated")
  p.add_argument(
    "--prompt-len",
    type=int,
    default=None,
    help=f"prompt tokens per row (default: {DEFAULT_PROMPT_LEN}, less where the "
    "preset's max_len needs it)",
  )
  p.add_argument(
    "--new-tokens",
    type=int,
    default=None,
    help=f"tokens generated per row (default: {DEFAULT_NEW_TOKENS}, less where the "
    "prompt and the preset's max_len need it)",
  )
  p.add_argument("--dtypes", default="float32,bfloat16", help="comma-separated: float32, bfloat16")
  p.add_argument("--reps", type=int, default=5, help="timed generate calls per side (float32)")
  p.add_argument(
    "--bf16-reps",
    type=int,
    default=2,
    help="timed calls per side in bfloat16 (slow on CPUs: both sides take ~10x longer)",
  )
  p.add_argument("--ttft-reps", type=int, default=5, help="timed one-token calls per side")
  p.add_argument("--torch-threads", type=int, default=os.cpu_count())
  p.add_argument(
    "--torch-threads-alt",
    type=int,
    default=1 if (os.cpu_count() or 1) > 1 else 0,
    help="also time their generate with this many threads (0: don't); on a loaded "
    "machine one thread can beat all cores, and the ratio against their faster "
    "setting is reported as well",
  )
  p.add_argument("--seed", type=int, default=0)
  p.add_argument(
    "--cpu-poll",
    action=argparse.BooleanOptionalAction,
    default=None,
    help="keep idle CPUs polling during the whole run, for both sides and the "
    "bandwidth readings (writes /dev/cpu_dma_latency, usually root only; affects "
    f"the whole machine while it runs). Default: ${poll.POLL_ENV}=1, else off",
  )
  p.add_argument("--out", default=None, help="also write the JSON here")


def check_args(p: argparse.ArgumentParser, args: argparse.Namespace) -> argparse.Namespace:
  args.batch_sizes = [int(b) for b in args.batch_sizes.split(",")]
  args.dtypes = args.dtypes.split(",")
  for d in args.dtypes:
    if d not in _DTYPES:
      p.error(f"--dtypes: {d!r} is not one of {', '.join(_DTYPES)}")
  if args.torch_threads_alt < 0:
    p.error(f"--torch-threads-alt={args.torch_threads_alt} must be >= 0")
  for name in ("prompt_len", "new_tokens", "reps", "bf16_reps", "ttft_reps", "torch_threads"):
    if getattr(args, name) is not None and getattr(args, name) < 1:
      p.error(f"--{name.replace('_', '-')}={getattr(args, name)} must be >= 1")
  if min(args.batch_sizes) < 1:
    p.error(f"--batch-sizes={args.batch_sizes} must be positive")
  args.prompt_len, args.new_tokens = fit_lengths(args.preset, args.prompt_len, args.new_tokens)
  return args


# The lengths without --prompt-len / --new-tokens, where the preset's context holds them.
DEFAULT_PROMPT_LEN, DEFAULT_NEW_TOKENS = 32, 128


def fit_lengths(preset: str, prompt_len: int | None, new_tokens: int | None) -> tuple[int, int]:
  """``(prompt_len, new_tokens)`` within ``preset``'s ``max_len``; a length not given shrinks from
  its default to fit the other (given or default), a given one is kept.

  Raises:
    ValueError: when the given lengths pass ``max_len``, or leave no room for the other.
  """
  max_len = models.get_config(preset).max_len
  where = f"{preset}'s max_len={max_len}"
  if prompt_len is not None and new_tokens is not None:
    if prompt_len + new_tokens > max_len:
      raise ValueError(
        f"--prompt-len {prompt_len} + --new-tokens {new_tokens} = "
        f"{prompt_len + new_tokens}: longer than {where}"
      )
    return prompt_len, new_tokens
  if new_tokens is not None:
    if new_tokens >= max_len:
      raise ValueError(f"--new-tokens {new_tokens}: leaves no room for a prompt in {where}")
    return min(DEFAULT_PROMPT_LEN, max_len - new_tokens), new_tokens
  if prompt_len is None:
    prompt_len = min(DEFAULT_PROMPT_LEN, max(1, max_len // 4))
  elif prompt_len >= max_len:
    raise ValueError(f"--prompt-len {prompt_len}: leaves no room for a new token in {where}")
  if prompt_len >= max_len:
    raise ValueError(f"{where} leaves no room for a prompt and a new token")
  return prompt_len, min(DEFAULT_NEW_TOKENS, max_len - prompt_len)


def main(argv=None) -> dict:
  """``experiments/bench_generate.py``'s entry: parse, run, print and write the JSON."""
  args = parse_args(argv)
  result = run(
    args,
    command=" ".join(
      ["python", "experiments/bench_generate.py"] + (sys.argv[1:] if argv is None else list(argv))
    ),
  )
  text = json.dumps(result, indent=2)
  print(text)
  if args.out:
    os.makedirs(os.path.dirname(os.path.abspath(args.out)), exist_ok=True)
    with open(args.out, "w") as f:
      f.write(text + "\n")
  return result


def run(args, command: str | None = None) -> dict:
  """The benchmark of ``args`` (``add_args``/``check_args``): the result dict.

  When ``args.cpu_poll`` (or, when it is None, ``$TJAX_CPU_POLL``) asks for it, the whole run
  (both sides, every bandwidth reading) holds ``backends.cpu.poll.cpu_poll``; ``result["cpu_poll"]``
  records whether it was requested and held, or why not.

  Raises:
    ValueError: ``$TJAX_CPU_POLL`` is not a yes or no.
  """
  wanted = poll.requested(getattr(args, "cpu_poll", None))
  hardware.share_gpu_memory()  # before JAX starts its backend, where it has not yet
  with poll.cpu_poll_if(wanted) as request:
    result = _run(args, command)
  result["cpu_poll"] = dataclasses.asdict(request)
  return result


def _run(args, command: str | None) -> dict:
  import torch  # noqa: PLC0415 - torch is optional (the hf extra)
  import transformers  # noqa: PLC0415 - transformers is optional (the hf extra)

  transformers.logging.set_verbosity_error()
  device = hf_device()
  on_cpu = device == "cpu"
  threads = args.torch_threads if on_cpu else None
  alt_threads = args.torch_threads_alt if on_cpu else 0
  if on_cpu:
    torch.set_num_threads(args.torch_threads)
  load_before = os.getloadavg()
  config32 = models.get_config(args.preset)

  model32 = models.create(config32, rngs=nnx.Rngs(args.seed))
  with tempfile.TemporaryDirectory() as tmp:
    arch = tjhf.save(model32, config32, tmp)
    with warnings.catch_warnings():
      warnings.simplefilter("ignore")
      hf32 = getattr(transformers, arch).from_pretrained(tmp).eval()
  if not on_cpu:
    hf32.to(device)
  _, params32 = nnx.split(model32)
  weight_bytes = {"float32": sum(a.nbytes for a in jax.tree.leaves(params32))}

  # The same weights on both sides: compare one forward pass.
  check_ids = np.random.default_rng(args.seed).integers(0, config32.vocab_size, (1, 16))
  ours32, theirs32 = Ours(config32, params32), Theirs(hf32, threads, device)
  weights_max_abs_logit_diff = float(
    np.abs(ours32.logits(check_ids) - theirs32.logits(check_ids)).max()
  )

  bandwidth = machine.weight_bandwidth()
  cases = []
  for dtype in args.dtypes:
    if dtype == "float32":
      ours, hf = ours32, hf32
    else:
      config = models.get_config(args.preset, dtype=dtype, param_dtype=dtype)
      params = jax.tree.map(lambda a: a.astype(dtype), params32)
      weight_bytes[dtype] = sum(a.nbytes for a in jax.tree.leaves(params))
      ours = Ours(config, params)
      hf = copy.deepcopy(hf32).to(getattr(torch, dtype))
    theirs = Theirs(hf, threads, device)
    alt = Theirs(hf, alt_threads, device) if alt_threads else None
    reps = args.reps if dtype == "float32" else args.bf16_reps
    for batch in args.batch_sizes:
      rng = np.random.default_rng([args.seed, batch])
      case = {"dtype": dtype, **bench_case(ours, theirs, alt, batch, args, reps, rng)}
      print(
        f"# {dtype} batch {batch}: ours {case['ours']['new_tokens_per_sec']:.1f} tok/s, "
        f"theirs {case['theirs']['new_tokens_per_sec']:.1f} tok/s, ratio {case['ratio']:.2f}, "
        f"tokens equal {case['tokens_equal']}",
        file=sys.stderr,
        flush=True,
      )
      cases.append(case)

  floor = {d: weight_bytes[d] / bandwidth["bytes_per_sec"] for d in weight_bytes}
  for c in cases:
    # A step at batch 1 reads every weight once; at batch b it still reads them once per step.
    ms = c["ours"]["ms_per_step"]
    case_floor_s = weight_bytes[c["dtype"]] / c["bandwidth_bytes_per_sec"]["median"]
    c["ours"]["step_floor_ms"] = 1e3 * case_floor_s
    c["ours"]["fraction_of_bandwidth_floor"] = 1e3 * case_floor_s / ms if ms else None
    sustained_floor_s = weight_bytes[c["dtype"]] / c["sustained_bandwidth_bytes_per_sec"]["median"]
    c["ours"]["sustained_step_floor_ms"] = 1e3 * sustained_floor_s
    c["ours"]["fraction_of_sustained_floor"] = 1e3 * sustained_floor_s / ms if ms else None
    # The strictest floor: the fastest reading of the case. When the machine's memory moves
    # between a slow and a fast state within a case, the median reading can fall on the slow side
    # while the timed calls ran on the fast one.
    c["bandwidth_bytes_per_sec"]["best"] = max(c["bandwidth_bytes_per_sec"]["all"])
    best_floor_s = weight_bytes[c["dtype"]] / c["bandwidth_bytes_per_sec"]["best"]
    c["ours"]["best_step_floor_ms"] = 1e3 * best_floor_s
    c["ours"]["fraction_of_best_floor"] = 1e3 * best_floor_s / ms if ms else None
    c["ours"]["fraction_of_paired_floor"] = paired_fraction(
      weight_bytes[c["dtype"]],
      c["bandwidth_bytes_per_sec"]["all"],
      c["ours"]["decode_s"]["all"],
      args.new_tokens,
    )
  result = {
    "benchmark": "greedy generation, transformer_jax vs transformers",
    "command": command,
    "preset": args.preset,
    "config": {
      "params": models.count_params(config32),
      "d_model": config32.d_model,
      "num_layers": config32.num_layers,
      "num_heads": config32.num_heads,
      "vocab_size": config32.vocab_size,
      "init_std": config32.init_std,
    },
    "prompt_len": args.prompt_len,
    "new_tokens": args.new_tokens,
    "greedy": True,
    "weights_max_abs_logit_diff_float32": weights_max_abs_logit_diff,
    "summary": {
      f"{c['dtype']}_batch{c['batch']}": {
        "ours_tokens_per_sec": c["ours"]["new_tokens_per_sec"],
        "theirs_tokens_per_sec": c["theirs"]["new_tokens_per_sec"],
        "ratio": c["ratio"],
        "ratio_vs_their_best_threads": c.get("ratio_vs_their_best_threads"),
        "decode_ratio": c["decode_ratio"],
        "ttft_ratio": c["ttft_ratio"],
        "ours_ttft_s": c["ours"]["ttft_s"]["median"],
        "theirs_ttft_s": c["theirs"]["ttft_s"]["median"],
        "ours_compile_s": c["ours"]["compile_s"],
        "tokens_equal": c["tokens_equal"],
        "ours_fraction_of_bandwidth_floor": c["ours"]["fraction_of_bandwidth_floor"],
        "ours_ms_per_step": c["ours"]["ms_per_step"],
        "step_floor_ms": c["ours"]["step_floor_ms"],
        "ours_step_unresolved": c["ours"]["step_unresolved"],
        "bandwidth_bytes_per_sec": c["bandwidth_bytes_per_sec"]["median"],
        "ours_fraction_of_sustained_floor": c["ours"]["fraction_of_sustained_floor"],
        "ours_fraction_of_best_floor": c["ours"]["fraction_of_best_floor"],
        "ours_fraction_of_paired_floor": (c["ours"]["fraction_of_paired_floor"] or {}).get(
          "median"
        ),
        "best_bandwidth_bytes_per_sec": c["bandwidth_bytes_per_sec"]["best"],
        "sustained_bandwidth_bytes_per_sec": c["sustained_bandwidth_bytes_per_sec"]["median"],
      }
      for c in cases
    },
    "cases": cases,
    "weight_bytes": weight_bytes,
    "memory_bandwidth": bandwidth,
    "step_floor_s_at_batch1": floor,
    "device_kind": hardware.device_kind(),
    "platform": backends.platform(),
    "hf_device": device,
    "machine": {
      **machine.describe(("torch", "transformers")),
      "torch_threads": threads,
      "torch_threads_alt": alt_threads or None,
      "load_average_before": load_before,
      "load_average_after": os.getloadavg(),
    },
    "hf_attn_implementation": getattr(hf32.config, "_attn_implementation", None),
    "timestamp": datetime.datetime.now(datetime.timezone.utc).isoformat(timespec="seconds"),
  }
  return result


def table(result: dict) -> str:
  """The summary as aligned lines."""
  on = (
    ""
    if result.get("platform", "cpu") == "cpu"
    else f" on {result['device_kind']} (Hugging Face on {result['hf_device']})"
  )
  lines = [
    f"greedy generation {result['preset']}{on}, prompt {result['prompt_len']} + "
    f"{result['new_tokens']} new tokens; weights stream at "
    f"{result['memory_bandwidth']['bytes_per_sec'] / 1e9:.1f} GB/s at the start"
  ]
  request = result.get("cpu_poll")
  if request:
    lines.append(
      "  idle CPUs polled during the run (--cpu-poll)"
      if request["held"]
      else f"  idle CPUs could halt during the run: {request['reason']}"
    )
  for name, c in result["summary"].items():
    frac = c.get("ours_fraction_of_bandwidth_floor")
    lines.append(
      f"  {name:<16s} ours {c['ours_tokens_per_sec']:7.1f} tok/s  theirs "
      f"{c['theirs_tokens_per_sec']:7.1f}  ratio {c['ratio']:.2f}x  TTFT ratio "
      f"{c['ttft_ratio']:.2f}"
      + (
        f"  step {c['ours_ms_per_step']:.1f} ms = {100 * frac:.0f}% of the bandwidth floor "
        f"({c['step_floor_ms']:.1f} ms at {c['bandwidth_bytes_per_sec'] / 1e9:.1f} GB/s), "
        f"{100 * c['ours_fraction_of_sustained_floor']:.0f}% of the sustained floor "
        f"({c['sustained_bandwidth_bytes_per_sec'] / 1e9:.1f} GB/s), "
        f"{100 * c['ours_fraction_of_best_floor']:.0f}% of the fastest reading's "
        f"({c['best_bandwidth_bytes_per_sec'] / 1e9:.1f} GB/s)"
        + (
          f", {100 * c['ours_fraction_of_paired_floor']:.0f}% repetition by repetition"
          if c.get("ours_fraction_of_paired_floor")
          else ""
        )
        if frac
        else f"  step not resolved: {c['ours_step_unresolved']}"
        if c.get("ours_step_unresolved")
        else ""
      )
      + ("" if c["tokens_equal"] else "  (tokens differ)")
    )
  return "\n".join(lines)


if __name__ == "__main__":
  main()
