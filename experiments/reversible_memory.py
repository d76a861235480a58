"""Memory of a training step with reversible residual layers against plain ones (compiled).

A small-width, long-sequence GPT (so activations, not weights, dominate), one gradient step of
the language-model loss, compiled on this machine's backend; XLA's memory analysis of the
compiled step gives the bytes of its arguments (parameters and batch), outputs (gradients) and
temporaries (saved activations and work space). Plain stacks (``lax.scan`` over the layers,
every layer's activations saved for the backward) at 3 and 12 layers, reversible ones
(``GPTConfig.reversible``: activations recomputed layer by layer in the backward) at 3 and 12.

  python experiments/reversible_memory.py           # ~1 min on 2 CPU cores
  python experiments/reversible_memory.py --length 512 --out /tmp/rev.json

Writes experiments/results/reversible_memory.json: per row the three sizes and their sum
(``peak_bytes``, an upper bound: XLA may reuse an argument's buffer), and whether the 12-layer
reversible step needs less than the 3-layer plain one.
"""

from __future__ import annotations

import argparse
import json
import os
import platform

import jax
import jax.numpy as jnp

from transformer_jax import hardware, models, ops
from transformer_jax.bench import machine

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))


def step_memory(config, batch: int, length: int) -> dict:
  """Bytes of the compiled gradient step of ``config`` on ``[batch, length]`` tokens."""
  params = models.init_abstract(config)
  tokens = jax.ShapeDtypeStruct((batch, length), jnp.int32)

  def loss(params, tokens):
    logits = models.apply(config, params, tokens)
    return ops.cross_entropy(logits[:, :-1], tokens[:, 1:])[0]

  compiled = jax.jit(jax.grad(loss)).lower(params, tokens).compile()
  mem = compiled.memory_analysis()
  row = {
    "argument_bytes": int(mem.argument_size_in_bytes),
    "output_bytes": int(mem.output_size_in_bytes),
    "temp_bytes": int(mem.temp_size_in_bytes),
  }
  row["peak_bytes"] = sum(row.values())
  row["param_count"] = int(models.count_params(config))
  return row


def main(argv=None) -> dict:
  p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
  p.add_argument("--length", type=int, default=2048)
  p.add_argument("--batch", type=int, default=4)
  p.add_argument("--d-model", type=int, default=128)
  p.add_argument("--out", default=os.path.join(ROOT, "experiments/results/reversible_memory.json"))
  args = p.parse_args(argv)
  rows = {}
  for reversible in (False, True):
    for layers in (3, 12):
      config = models.get_config(
        "llama-tiny",
        vocab_size=256,
        d_model=args.d_model,
        num_heads=4,
        num_kv_heads=4,
        d_ff=4 * args.d_model,
        num_layers=layers,
        max_len=args.length,
        scan_layers=True,
        reversible=reversible,
      )
      name = f"{'reversible' if reversible else 'plain'}_{layers}"
      rows[name] = step_memory(config, args.batch, args.length)
      print(name, json.dumps(rows[name]), flush=True)
  result = {
    "what": "compiled memory of one gradient step (XLA memory analysis), llama-tiny shape",
    "batch": args.batch,
    "length": args.length,
    "d_model": args.d_model,
    "rows": rows,
    "reversible_12_below_plain_3": rows["reversible_12"]["peak_bytes"]
    < rows["plain_3"]["peak_bytes"],
    "machine": {
      "cpu": hardware.cpu_name(),
      "platform": platform.platform(),
      "jax": jax.__version__,
      "backend": jax.default_backend(),
    },
  }
  machine.write_json(args.out, result)
  return result


if __name__ == "__main__":
  main()
