"""The compiled programs of a tree, as fingerprints: are two versions of the package the same
program where nothing was meant to change them?

For each case (a preset's train step in float32 and bfloat16, its decoding step) the script builds
the program the way ``tjax train`` and ``tjax generate`` do, compiles it for this machine and
prints the SHA-256 of XLA's optimized HLO with the source metadata (file names, line numbers, op
names) removed: a moved function changes no fingerprint, a changed instruction does.

  git worktree add /tmp/old REV
  PYTHONPATH=/tmp/old python experiments/program_identity.py --json /tmp/old.json
  PYTHONPATH=$PWD python experiments/program_identity.py --json /tmp/new.json \
      --against /tmp/old.json

Writes the fingerprints (and, with ``--against``, which cases differ) to ``--json``.
"""

from __future__ import annotations

import argparse
import hashlib
import inspect
import json
import os
import re
import sys

import jax
import jax.numpy as jnp
import optax

import transformer_jax as tj
from transformer_jax import generate as generate_lib
from transformer_jax import hardware, parallel
from transformer_jax.train import step as step_lib
from transformer_jax.train import tasks as tasks_lib

_METADATA = re.compile(r",? ?metadata=\{[^}]*\}")
_STACK_FRAME = re.compile(r",? ?stack_frame_id=\d+")


def stripped(text: str) -> str:
  """An optimized HLO text without its source metadata: the instructions' ``metadata={...}`` and
  the module's tables of file names, function names and stack frames."""
  lines, in_tables = [], False
  for line in text.splitlines():
    if line in ("FileNames", "FunctionNames", "FileLocations", "StackFrames"):
      in_tables = True
    elif in_tables and (line.startswith("%") or line.startswith("ENTRY")):
      in_tables = False
    if not in_tables:
      lines.append(_STACK_FRAME.sub("", _METADATA.sub("", line)))
  return "\n".join(lines)


def fingerprint(text: str) -> str:
  """SHA-256 of ``stripped(text)``."""
  return hashlib.sha256(stripped(text).encode()).hexdigest()


def _mesh():
  make_mesh = getattr(parallel, "make_mesh", None) or step_lib.make_mesh
  return make_mesh({"data": 1})


def train_step_text(preset: str, dtype: str, batch: int, seq: int, layers: int) -> str:
  config = tj.models.get_config(preset, dtype=dtype, num_layers=layers)
  mesh = _mesh()
  task = tasks_lib.get_task("gpt")
  optimizer = optax.adamw(1e-4)
  graphdef = (
    tj.models.graphdef(config, mesh)
    if "mesh" in inspect.signature(tj.models.graphdef).parameters
    else tj.models.graphdef(config)
  )
  fn = step_lib.make_train_step(graphdef, task, optimizer, seed=0)
  state = step_lib.abstract_state(config, optimizer, mesh)
  step = step_lib.jit_train_step(fn, mesh, state)
  sharding = parallel.batch_sharding(mesh)
  shapes = {
    k: jax.ShapeDtypeStruct(v.shape, v.dtype, sharding=sharding)
    for k, v in task.batch_shapes(batch, seq).items()
  }
  return step.lower(state, shapes).compile().as_text()


def logits_text(preset: str, dtype: str, seq: int, layers: int) -> str:
  """The model's forward pass on one row (``models.apply``), as a library user compiles it."""
  config = tj.models.get_config(preset, dtype=dtype, num_layers=layers)
  params = tj.models.init_abstract(config)
  tokens = jax.ShapeDtypeStruct((1, seq), jnp.int32)
  return (
    jax.jit(lambda p, t: tj.models.apply(config, p, t)).lower(params, tokens).compile().as_text()
  )


def decode_text(preset: str, dtype: str, prompt: int, new_tokens: int, layers: int) -> str:
  """Batch-1 greedy decoding as ``tjax generate`` runs it (``generate.generate`` on a ``(config,
  params)`` pair): every program it compiles (the layer split, the decode loop), in call order."""
  config = tj.models.get_config(preset, dtype=dtype, num_layers=layers)
  params = tj.models.init(config, jax.random.key(0))
  texts, real_jit = [], jax.jit

  def recording_jit(fun, *a, **kw):
    jitted = real_jit(fun, *a, **kw)

    def call(*args, **kwargs):
      texts.append(jitted.lower(*args, **kwargs).compile().as_text())
      return jitted(*args, **kwargs)

    return call

  jax.jit = recording_jit
  try:
    ids = jnp.arange(1, prompt + 1, dtype=jnp.int32)[None]
    out = generate_lib.generate((config, params), ids, max_new_tokens=new_tokens)
    jax.block_until_ready(out)
  finally:
    jax.jit = real_jit
  if not texts:
    raise RuntimeError("generate compiled no program through jax.jit")
  return "\n".join(texts)


def main(argv=None) -> dict:
  p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
  p.add_argument("--preset", default="gpt2-small")
  p.add_argument("--layers", type=int, default=2, help="layers kept (each layer compiles alike)")
  p.add_argument("--batch-size", type=int, default=4)
  p.add_argument("--seq-len", type=int, default=256)
  p.add_argument("--json", required=True)
  p.add_argument("--against", help="an earlier output of this script to compare with")
  p.add_argument("--dump", help="a folder to write each case's stripped HLO text to (for a diff)")
  p.add_argument("--prompt-len", type=int, default=64, help="decode: the prompt's length")
  p.add_argument("--new-tokens", type=int, default=32, help="decode: tokens generated")
  p.add_argument("--cases", default="train_step,forward,decode")
  args = p.parse_args(argv)
  cases = {}
  build = {
    "train_step": lambda dtype: train_step_text(
      args.preset, dtype, args.batch_size, args.seq_len, args.layers
    ),
    "forward": lambda dtype: logits_text(args.preset, dtype, args.seq_len, args.layers),
    "decode": lambda dtype: decode_text(
      args.preset, dtype, args.prompt_len, args.new_tokens, args.layers
    ),
  }
  for dtype in ("float32", "bfloat16"):
    for kind in args.cases.split(","):
      text = build[kind](dtype)
      cases[f"{kind}_{dtype}"] = fingerprint(text)
      if args.dump:
        os.makedirs(args.dump, exist_ok=True)
        with open(os.path.join(args.dump, f"{kind}_{dtype}.hlo"), "w") as f:
          f.write(stripped(text))
    print(f"{dtype}: done", file=sys.stderr, flush=True)
  out = {
    "command": " ".join(["python", *sys.argv]),
    "tree": os.environ.get("PYTHONPATH", ""),
    "machine": {
      "cpu": hardware.cpu_name(),
      "cpu_flags": hardware.cpu_flags(),
      "jax": jax.__version__,
    },
    "setup": vars(args),
    "fingerprints": cases,
  }
  if args.against:
    with open(args.against) as f:
      old = json.load(f)["fingerprints"]
    out["same_as_against"] = {k: old.get(k) == v for k, v in cases.items()}
  with open(args.json, "w") as f:
    json.dump(out, f, indent=1)
  print(json.dumps(out.get("same_as_against", cases), indent=1))
  return out


if __name__ == "__main__":
  main()
