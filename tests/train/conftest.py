import contextlib
import io
import os
import subprocess
import sys


REPO = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))


def run_tjax(*args, env=None, **kw):
  """Runs the CLI in a fresh interpreter (its own JAX device setup)."""
  full_env = {**os.environ, **(env or {})}
  return subprocess.run(
    [sys.executable, "-m", "transformer_jax.cli", *args],
    cwd=REPO,
    env=full_env,
    capture_output=True,
    text=True,
    **kw,
  )


def run_cli(*argv):
  """Runs ``tjax ARGV`` in this process (``cli.main``: no interpreter to start, compilations
  shared); returns ``(exit code, stdout, stderr)``. The CLI wiring itself (a fresh process, the
  launcher) is what the few ``run_tjax`` tests check."""
  from transformer_jax import cli

  out, err = io.StringIO(), io.StringIO()
  with contextlib.redirect_stdout(out), contextlib.redirect_stderr(err):
    code = cli.main(list(argv))
  return code, out.getvalue(), err.getvalue()


def pytest_configure(config):
  config.addinivalue_line("markers", "slow: end-to-end runs of the CLI in subprocesses")


class CompiledStandIn:
  """A stand-in for a compiled step: only its temporaries' size (``memory_analysis``)."""

  def __init__(self, temp):
    self.temp = temp

  def memory_analysis(self):
    return type("Analysis", (), {"temp_size_in_bytes": self.temp})()
