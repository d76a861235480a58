"""Greedy generation speed against Hugging Face ``generate``: ``tjax bench generate`` under its
former name and command line (``--out``), kept for scripts that call it.

    python experiments/bench_generate.py --batch-sizes 1,8 --dtypes float32 --out x.json
"""

import os
import sys

sys.path.insert(0, os.path.join(os.path.dirname(os.path.abspath(__file__)), ".."))

from transformer_jax.bench.generate import main

if __name__ == "__main__":
  main()
