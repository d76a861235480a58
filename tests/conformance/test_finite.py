"""Finite everywhere, for each registered kind's ``extremes`` (tiny decays, a window of one token,
chunks of 1 and 64 positions): no NaN or Inf in the logits of a ragged batch of 1 .. 4 chunks and
a position, nor in the cache and logits of a ragged prefill and the steps after it."""

import jax.numpy as jnp
import numpy as np
import pytest

from tests.conformance import harness as h
from tests.conformance.kinds import CHUNK, DECODES, KINDS, MASK, SEQ2SEQ

# The registered configs themselves are checked by every other property (each asserts finite
# results); here, each kind's extremes.
CASES = [(k, extreme) for k in KINDS for extreme in k.extremes]


def _name(case):
  kind, extreme = case
  return kind.name + "".join(f"-{k}={v}" for k, v in extreme.items())


@pytest.mark.parametrize("case", CASES, ids=[_name(c) for c in CASES])
def test_logits_and_caches_are_finite(case):
  kind, extreme = case
  config = kind.config(**extreme)
  linear = getattr(config, "attention_kind", None) == "linear"
  chunk = config.linear_chunk if linear else CHUNK
  # Rows of 1 token, one chunk and a position, 4 chunks and a position (a last chunk padded).
  width = 4 * chunk + 1
  lengths = [1, chunk + 1, width]
  tokens, mask, _ = h.ragged(np.random.default_rng(0), lengths, width)
  logits = h.forward(kind, config, tokens, mask if kind.has(MASK) else None)
  assert h.finite(logits), f"non-finite logits at lengths {lengths}"
  if not kind.has(DECODES):
    return
  # The same rows prefilled into a cache (Seq2Seq: the decoder's), then two steps.
  extra = dict(src=jnp.asarray(tokens), src_mask=jnp.asarray(mask)) if kind.has(SEQ2SEQ) else {}
  prefill, stepped, cache = h.decode_fn(kind, config, width + 2)(
    h.params(config),
    jnp.asarray(tokens),
    jnp.asarray(lengths, jnp.int32),
    jnp.asarray(tokens[:, :2]),
    **extra,
  )
  assert h.finite(cache), f"non-finite cache after a prefill of {lengths} tokens"
  assert h.finite(prefill) and h.finite(stepped), f"non-finite decoding logits at {lengths}"
