"""The end of a run: its learning bars (figures a trained model must reach, with their baselines)
and a few generated samples."""

from __future__ import annotations

import os
from typing import Any

import jax
import numpy as np

from transformer_jax import data as data_lib
from transformer_jax import runs
from transformer_jax.train.plan import Plan


def check_bars(run: Plan, params, last_eval: dict[str, float]) -> dict[str, Any]:
  """Checks the experiment's ``bars`` and prints one line each.

  Args:
    run: The plan of the run.
    params: The model's parameters (a LoRA run's adapters merged).
    last_eval: The final evaluation (``val_*`` figures).

  Returns:
    ``{bar: {figure..., "passed": bool}}``: each figure, the bar and pass/fail (reported only:
    ``tjax train --check-bars`` makes a failure an error).
  """
  bars = run.exp.bars
  results = {}
  if "val_loss_below_unigram" in bars:
    unigram = data_lib.unigram_cross_entropy(run.dataset)
    margin = float(bars["val_loss_below_unigram"])
    results["val_loss_below_unigram"] = {
      "val_loss": last_eval["val_loss"],
      "unigram_cross_entropy": unigram,
      "required_margin": margin,
      "margin": unigram - last_eval["val_loss"],
      "passed": unigram - last_eval["val_loss"] >= margin,
    }
  if "mlm_accuracy_over_baseline" in bars:
    results["mlm_accuracy_over_baseline"] = _over_baseline(
      "mlm_accuracy",
      last_eval["val_mlm_accuracy"],
      "most_frequent_token_baseline",
      most_frequent_token_accuracy(run),
      bars["mlm_accuracy_over_baseline"],
    )
  if "accuracy_over_majority" in bars:
    results["accuracy_over_majority"] = _over_baseline(
      "val_accuracy",
      last_eval["val_accuracy"],
      "majority_baseline",
      run.dataset.meta["majority_baseline"]["val_accuracy"],
      bars["accuracy_over_majority"],
    )
  if "exact_match" in bars:
    em = seq2seq_exact_match(run, params)
    results["exact_match"] = {
      "exact_match": em,
      "required": float(bars["exact_match"]),
      "passed": em >= float(bars["exact_match"]),
    }
  for name, r in results.items():
    figures = ", ".join(f"{k}={v:.4g}" for k, v in r.items() if k != "passed")
    print(
      f"learning bar {name}: {'reached' if r['passed'] else 'NOT reached'} ({figures})", flush=True
    )
  return results


def _over_baseline(
  figure: str, value: float, baseline_name: str, baseline: float, margin
) -> dict[str, Any]:
  """A bar reached when ``value`` beats ``baseline`` by at least ``margin``: the figure, its
  baseline, the margin asked for and whether it passed."""
  margin = float(margin)
  return {
    figure: value,
    baseline_name: baseline,
    "required_margin": margin,
    "passed": value - baseline >= margin,
  }


def most_frequent_token_accuracy(run: Plan) -> float:
  """Masked-token accuracy of always predicting the most frequent masked target (eval batches)."""
  counts = np.zeros(run.dataset.vocab_size, np.int64)
  for batch in run.eval_batches():
    counts += np.bincount(batch["mlm_labels"][batch["mlm_mask"]], minlength=counts.size)
  return float(counts.max() / max(counts.sum(), 1))


def seq2seq_exact_match(run: Plan, params, max_examples: int = 512) -> float:
  """Greedy-decoding exact match on held-out (validation) examples (``generate``, cached)."""
  from transformer_jax.generate import generate  # noqa: PLC0415 - a sampling bar only

  specials = run.dataset.meta["special_tokens"]
  bos, eos = specials["<bos>"], specials["<eos>"]
  right = total = 0
  for batch in data_lib.seq2seq_eval_batches(run.dataset, batch_size=run.exp.train.batch_size):
    rows = np.flatnonzero(batch["src_mask"].any(-1))
    if not rows.size:
      continue
    width = min(batch["tgt_out"].shape[1], run.model_config.max_len)
    pred = np.asarray(
      generate(
        (run.model_config, params),
        batch["src"][rows],
        prompt_lengths=batch["src_mask"][rows].sum(-1),
        max_new_tokens=width,
        eos_id=eos,
        decoder_start_id=bos,
      )
    )
    for j, i in enumerate(rows):
      target = batch["tgt_out"][i][batch["tgt_mask"][i]]  # target + EOS
      right += int(np.array_equal(pred[j, : target.size], target))
      total += 1
    if total >= max_examples:
      break
  return right / max(total, 1)


def print_samples(run: Plan, params) -> list[str]:
  """Samples a few continuations (``tjax generate``'s sampler: temperature 0.8, top-k 40; special
  tokens such as [UNK] are never drawn), prints them and writes them to ``samples.txt``."""
  from transformer_jax.generate.stream import stream_generate  # noqa: PLC0415 - a sampling bar only

  tok = run.dataset.tokenizer
  prompts_text = ["def ", "import ", "class ", "    return "][: run.exp.train.samples]
  prompts = [tok.encode(p) for p in prompts_text]
  room = min(run.model_config.max_len, run.exp.train.seq_len) - max(len(p) for p in prompts)
  suppress = sorted(set(tok.special_ids.values()) - {tok.eot_id})
  rows = [[] for _ in prompts]
  for chunk in stream_generate(
    (run.model_config, params),
    prompts,
    max_new_tokens=max(1, min(run.exp.train.sample_tokens, room)),
    temperature=0.8,
    top_k=40,
    eos_id=tok.eot_id,
    key=jax.random.key(run.exp.train.seed),
    suppress_ids=suppress,
  ):
    for row, new in zip(rows, np.asarray(chunk)):
      row.extend(int(i) for i in new)
  rows = [r[: r.index(tok.eot_id)] if tok.eot_id in r else r for r in rows]
  texts = [p + tok.decode(n) for p, n in zip(prompts_text, rows)]
  print("\nsamples:", flush=True)
  for text in texts:
    print("-" * 60 + "\n" + text, flush=True)
  runs.write_atomic(
    os.path.join(run.exp.run_dir, "samples.txt"), ("\n" + "-" * 60 + "\n").join(texts)
  )
  return texts
