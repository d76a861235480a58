"""experiments/loader_throughput.py in a tiny mode: the figures it writes follow from the batch
times it keeps, for one host's share of the global batch."""

import json
import os
import statistics
import subprocess
import sys

import pytest

REPO = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
SCRIPT = os.path.join(REPO, "experiments", "loader_throughput.py")


@pytest.mark.long
def test_one_hosts_share_is_timed_and_its_rates_follow_from_the_times(tmp_path):
  out = tmp_path / "loader.json"
  args = ["--mb", "0.2", "--batch-size", "8", "--seq-len", "32", "--hosts", "2"]
  subprocess.run(
    [sys.executable, SCRIPT, *args, "--warmup", "1", "--steps", "4", "--json", str(out)],
    check=True,
    capture_output=True,
    cwd=REPO,
    env={**os.environ, "PYTHONPATH": REPO},
  )
  result = json.loads(out.read_text())
  ours = result["sides"]["ours"]
  assert result["config"]["rows_per_host"] == 4
  assert ours["tokens_per_batch"] == 4 * 32  # half the rows of each global batch
  times = ours["batch_seconds_all"]
  assert len(times) == 4 and all(t > 0 for t in times)
  assert ours["tokens_per_sec_median"] == 4 * 32 / statistics.median(times)
  assert ours["tokens_per_sec_best"] == 4 * 32 / min(times)
  assert len(result["load_average_before"]) == 3 and "cpu" in result["machine"]
  # Grain's side reads the same share: as many tokens a batch, its rates from its own times.
  for grain in (result["sides"]["grain"], result["grain_workers"]):
    assert grain["tokens_per_batch"] == 4 * 32 and len(grain["batch_seconds_all"]) == 4
    assert grain["tokens_per_sec_median"] == 4 * 32 / statistics.median(grain["batch_seconds_all"])
  assert result["ratios"]["ours_over_grain"] == (
    ours["tokens_per_sec_median"] / result["sides"]["grain"]["tokens_per_sec_median"]
  )
