"""One case of ``tjax bench generate`` (a dtype and a batch size): our side (``Ours``), the calls
of every side interleaved with the weight-streaming readings between them, the decoding step from
paired calls (``step_time``), its floor repetition by repetition (``paired_fraction``), and where
the greedy tokens part (``divergence``).
"""

from __future__ import annotations

import statistics
import time

import jax
import jax.numpy as jnp
import numpy as np
from flax import nnx

from transformer_jax import models
from transformer_jax.bench import machine
from transformer_jax.bench.rivals import Theirs
from transformer_jax.generate import generate


class Ours:
  """transformer_jax ``generate`` on ``(config, params)``."""

  def __init__(self, config, params):
    self.config, self.params = config, params
    self.module = nnx.merge(models.graphdef(config), params)

  def generate(self, prompt_BP: np.ndarray, new_tokens: int) -> np.ndarray:
    out = generate((self.config, self.params), prompt_BP, max_new_tokens=new_tokens)
    return np.asarray(jax.block_until_ready(out))

  def logits(self, ids_1T: np.ndarray) -> np.ndarray:
    return np.asarray(self.module(jnp.asarray(ids_1T, jnp.int32))[0], np.float32)


def _timed(fn, *args):
  t0 = time.perf_counter()
  out = fn(*args)
  return out, time.perf_counter() - t0


def divergence(ours: Ours, theirs: Theirs, prompt_BP, ours_BN, theirs_BN) -> dict | None:
  """Where the greedy tokens first differ and how close a call it was under each model."""
  rows = [r for r in range(ours_BN.shape[0]) if not np.array_equal(ours_BN[r], theirs_BN[r])]
  if not rows:
    return None
  firsts = {r: int(np.argmax(ours_BN[r] != theirs_BN[r])) for r in rows}
  r = min(rows, key=lambda r: firsts[r])
  i = firsts[r]
  prefix = np.concatenate([prompt_BP[r], ours_BN[r, :i]])[None]
  a, b = int(ours_BN[r, i]), int(theirs_BN[r, i])
  gaps = {}
  for name, side in (("ours", ours), ("theirs", theirs)):
    last_V = side.logits(prefix)[-1]
    gaps[name] = {
      "logit_ours_token_minus_theirs": float(last_V[a] - last_V[b]),
      "top2_gap": float(np.diff(np.sort(last_V)[-2:])[0]),
    }
  return {
    "rows_differing": rows,
    "first_row": r,
    "first_index": i,
    "ours_token": a,
    "theirs_token": b,
    "matching_tokens_fraction": float(np.mean(ours_BN == theirs_BN)),
    "logit_gap_at_first": gaps,
  }


def step_time(full_s: list[float], one_token_s: list[float], new_tokens: int) -> dict:
  """A decoding step's time from paired calls: ``full_s[i]`` generates ``new_tokens`` and
  ``one_token_s[i]`` one token, back to back in repetition ``i``.

  The median of the paired differences over ``new_tokens - 1`` is the step. When it is not positive
  the steps drowned in the calls' jitter: ``ms_per_step`` is ``None`` and ``step_unresolved`` names
  the median difference, rather than a negative time or a clamp."""
  if len(full_s) != len(one_token_s) or not full_s:
    raise ValueError(
      f"step_time: {len(full_s)} full calls and {len(one_token_s)} one-token calls; "
      "need the same positive number of each"
    )
  diffs = [f - o for f, o in zip(full_s, one_token_s)]
  decode_s = statistics.median(diffs)
  out = {
    "decode_s": {"median": decode_s, "all": diffs},
    "ms_per_step": None,
    "step_unresolved": None,
  }
  if new_tokens < 2:
    out["step_unresolved"] = "one new token: no decoding step to time"
  elif decode_s <= 0:
    out["step_unresolved"] = (
      f"the {new_tokens - 1} decoding steps took less than the calls' jitter (median of full call "
      f"- one-token call = {1e3 * decode_s:.3f} ms); time more --new-tokens or a larger preset"
    )
  else:
    out["ms_per_step"] = 1e3 * decode_s / (new_tokens - 1)
  return out


def paired_fraction(
  weight_bytes: int, readings: list[float], decode_s: list[float], new_tokens: int
) -> dict | None:
  """Each repetition's step against the floor at the bandwidth reading taken right before its calls
  (``readings[i]`` and ``decode_s[i]``, the full call minus its one-token partner): ``{"median",
  "all"}``. This floor follows the machine when its memory moves between a slow and a fast state
  within a case, where the median and fastest readings can each fall on the other side of the
  timed calls. None when a repetition's difference is not positive (steps lost in jitter)."""
  if len(readings) != len(decode_s):
    raise ValueError(f"paired_fraction: {len(readings)} readings for {len(decode_s)} repetitions")
  if new_tokens < 2 or min(decode_s) <= 0:
    return None
  fractions = [weight_bytes / bw / (d / (new_tokens - 1)) for bw, d in zip(readings, decode_s)]
  return {"median": statistics.median(fractions), "all": fractions}


def bench_case(
  ours: Ours, theirs: Theirs, alt: Theirs | None, batch: int, args, reps: int, rng
) -> dict:
  prompt_BP = rng.integers(0, ours.config.vocab_size, (batch, args.prompt_len), dtype=np.int64)
  n = args.new_tokens
  # First calls: ours compiles (full call and one-token call); theirs warms up.
  _, first_full = _timed(ours.generate, prompt_BP, n)
  _, first_one = _timed(ours.generate, prompt_BP, 1)
  sides = {"ours": ours, "theirs": theirs}
  if alt is not None:
    sides["theirs_alt_threads"] = alt
  for obj in sides.values():
    obj.generate(prompt_BP, 1)
  times = {k: [] for side in sides for k in (side, side + "_ttft", side + "_paired_one")}
  outs = {}
  bandwidth, sustained = [], []
  for _ in range(reps):
    # The machine's weight-streaming rate, read between the timed calls (it drifts when other
    # machines share the memory bus): the floor of this case comes from the same moments.
    reading = machine.weight_bandwidth(reps=5)
    bandwidth.append(reading["bytes_per_sec"])
    sustained.append(reading["sustained_bytes_per_sec"])
    for side, obj in sides.items():
      outs[side], dt = _timed(obj.generate, prompt_BP, n)
      times[side].append(dt)
      # Its one-token partner, right after: the step time is the pair's difference.
      _, dt = _timed(obj.generate, prompt_BP, 1)
      times[side + "_paired_one"].append(dt)
  for _ in range(args.ttft_reps):
    for side, obj in sides.items():
      _, dt = _timed(obj.generate, prompt_BP, 1)
      times[side + "_ttft"].append(dt)
  med = {k: statistics.median(v) for k, v in times.items()}
  result = {
    "batch": batch,
    "reps": reps,
    "ttft_reps": args.ttft_reps,
    "bandwidth_bytes_per_sec": {"median": statistics.median(bandwidth), "all": bandwidth},
    "sustained_bandwidth_bytes_per_sec": {"median": statistics.median(sustained), "all": sustained},
  }
  for side in sides:
    step = step_time(times[side], times[side + "_paired_one"], n)
    ms = step["ms_per_step"]
    result[side] = {
      "new_tokens_per_sec": batch * n / med[side],
      "generate_s": {"median": med[side], "min": min(times[side]), "all": times[side]},
      "ttft_s": {
        "median": med[side + "_ttft"],
        "min": min(times[side + "_ttft"]),
        "all": times[side + "_ttft"],
      },
      "paired_one_token_s": times[side + "_paired_one"],
      "decode_tokens_per_sec": 1e3 * batch / ms if ms else None,
      **step,
    }
  result["ours"]["first_call_s"] = first_full
  result["ours"]["compile_s"] = first_full - med["ours"]
  result["ours"]["first_call_one_token_s"] = first_one
  result["ours"]["compile_one_token_s"] = first_one - med["ours_ttft"]
  result["ratio"] = result["ours"]["new_tokens_per_sec"] / result["theirs"]["new_tokens_per_sec"]
  dec_o, dec_t = result["ours"]["decode_tokens_per_sec"], result["theirs"]["decode_tokens_per_sec"]
  result["decode_ratio"] = dec_o / dec_t if dec_o and dec_t else None
  result["ttft_ratio"] = med["theirs_ttft"] / med["ours_ttft"]
  result["theirs"]["torch_threads"] = theirs.threads
  if alt is not None:
    result["theirs_alt_threads"]["torch_threads"] = alt.threads
    best = min(med["theirs"], med["theirs_alt_threads"])
    result["ratio_vs_their_best_threads"] = best / med["ours"]
    result["alt_threads_tokens_equal"] = bool(
      np.array_equal(outs["theirs"], outs["theirs_alt_threads"])
    )
  result["tokens_equal"] = bool(np.array_equal(outs["ours"], outs["theirs"]))
  result["divergence"] = divergence(ours, theirs, prompt_BP, outs["ours"], outs["theirs"])
  return result
