"""The README's dry-run figures: ``tjax train experiments/gpt2_xl_pod.yaml --dry-run`` recomputed
for both CPU classes the README names, on whatever CPU runs the tests.

The figure is XLA:CPU's plan of the step as the CPU backend builds it, and the backend reads one
fact of the host: whether it has bfloat16 units (``hardware.has_bf16_units``). Each class is
therefore planned here with that answer set, in its own interpreter (64 simulated devices).
"""

import os
import re
import subprocess
import sys

import pytest

REPO = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

PLAN = """
import sys
from transformer_jax import cli, hardware
hardware.has_bf16_units = lambda: {bf16}
sys.exit(cli.main(["train", "experiments/gpt2_xl_pod.yaml", "--dry-run"]))
"""


def _readme_figures() -> dict[bool, float]:
  """bf16 units -> the README's peak estimate in GiB: the example's output is the bf16 class's,
  its command's comment gives the other."""
  with open(os.path.join(REPO, "README.md")) as f:
    text = f.read()
  block = re.search(
    r"\$ \.venv/bin/tjax train experiments/gpt2_xl_pod\.yaml --dry-run +# CPU with bf16 units; "
    r"AVX2: (\d+\.\d+) GiB.*?\n(.*?)```",
    text,
    re.S,
  )
  shown = re.search(r"peak estimate (\d+\.\d+) GiB", block.group(2))
  return {True: float(shown.group(1)), False: float(block.group(1))}


@pytest.mark.long
@pytest.mark.slow
@pytest.mark.parametrize("bf16", [True, False], ids=["bf16_units", "avx2"])
def test_the_readme_peak_estimate_of_the_pod_recipe_is_what_the_dry_run_prints(bf16):
  """About 25 s each on 2 busy cores: one compile of GPT-2 XL's step for 64 simulated devices."""
  want = _readme_figures()[bf16]
  out = subprocess.run(
    [sys.executable, "-c", PLAN.format(bf16=bf16)],
    cwd=REPO,
    env={**os.environ, "PYTHONPATH": REPO},
    capture_output=True,
    text=True,
    timeout=600,
  )
  assert out.returncode == 0, out.stderr[-2000:]
  got = float(re.search(r"peak estimate\s+(\d+\.\d+) GiB", out.stdout).group(1))
  assert got == want, f"dry run prints {got:.3f} GiB, the README {want:.3f} GiB"
