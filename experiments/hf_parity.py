"""Largest logit difference between transformers (PyTorch) and transformer_jax, per test case.

    python experiments/hf_parity.py            # JSON on stdout, one entry per case plus a summary

Uses the random-weight, offline cases of tests/hf/hf_cases.py (padded batches; causal models both
right- and left-padded, compared on real tokens) and the naive greedy continuation of the causal
ones.
"""

from __future__ import annotations

import json
import os
import sys
import warnings

sys.path.insert(0, os.path.join(os.path.dirname(__file__), "..", "tests", "hf"))

import numpy as np
import transformers

import hf_cases as hc
import transformer_jax.hf as tjhf


def main() -> None:
  transformers.logging.set_verbosity_error()
  cases, per_arch = {}, {}
  for name, (arch, _) in hc.CASES.items():
    hf_model = hc.build(name)
    with warnings.catch_warnings():
      warnings.simplefilter("ignore")
      _, model = tjhf.load(hf_model)
    diffs = hc.compare(hf_model, model, arch)
    entry = {"architecture": arch, "max_abs_diff": diffs}
    if hc.family(arch) == "causal":
      ours, theirs = hc.greedy_pair(hf_model, model)
      entry["greedy_equal"] = bool(np.array_equal(ours, theirs))
    cases[name] = entry
    per_arch[arch] = max(per_arch.get(arch, 0.0), max(diffs.values()))
  print(
    json.dumps(
      {
        "transformers": transformers.__version__,
        "cases": cases,
        "max_abs_diff_per_architecture": per_arch,
      },
      indent=2,
    )
  )


if __name__ == "__main__":
  main()
