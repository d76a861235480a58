"""``make tour`` (``python -m transformer_jax.cli.demo``): build each family's tiny preset, run a
forward pass, print ``tjax info``."""

from __future__ import annotations

import time

import jax
import jax.numpy as jnp

from transformer_jax import models
from transformer_jax.cli.info import info_text


def main() -> None:
  key = jax.random.key(0)
  tokens = jax.random.randint(key, (2, 32), 0, 512)
  for name in (
    "gpt2-tiny",
    "llama-tiny",
    "gpt-alibi-tiny",
    "bert-tiny",
    "transformer-tiny",
    "t5-tiny",
  ):
    cfg = models.get_config(name, vocab_size=512)
    model = models.create(cfg)
    start = time.perf_counter()
    match cfg:
      case models.BERTConfig():
        out = model(tokens, jnp.zeros_like(tokens), jnp.ones_like(tokens)).mlm_logits
      case models.Seq2SeqConfig():
        out = model(tokens, tokens[:, :16])
      case _:
        out = model(tokens)
    out.block_until_ready()
    print(
      f"{name:<18s} {models.count_params(cfg):>9,d} params  forward {tuple(out.shape)} "
      f"in {time.perf_counter() - start:.2f}s"
    )
  print()
  for preset in ("gpt2-small", "bert-base", "t5-small", "llama3-8b"):
    print(info_text(preset))
    print()


if __name__ == "__main__":
  main()
