"""bfloat16 compute and parameters (the default dtype of every accelerator), for every registered
kind: finite logits, and for kinds that decode, a ragged prefill and token-by-token steps give the
full forward pass's logits within bfloat16's rounding (``harness.bound_bf16``).

One short ragged batch per kind, the forward pass and the decoding in one program: one
compilation per kind (the float32 properties cover lengths, padding and chunk boundaries). The
layers run under one scan, as on a TPU or a CPU without bfloat16 units, whatever this machine's
``scan_layers="auto"`` would choose: the same program on every machine."""

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from flax import nnx

from tests.conformance import harness as h
from tests.conformance.kinds import DECODER, DECODES, KINDS, MASK
from transformer_jax import models

PROMPT, STEPS = 5, 3  # the prompts cross a scan chunk (CHUNK = 4), the steps one more
LENGTHS = (PROMPT, 2)  # ragged prompts


def _program(kind, config):
  """Jitted ``(params, tokens [B, T], mask, positions, prompt, lengths, steps) -> (logits,
  decoded)``: the full forward pass (Seq2Seq: ``tokens`` both sides) and, for a kind that
  decodes, ``harness.decoded`` (else None)."""
  graphdef = models.graphdef(config)

  def run(p, tokens, mask, positions, prompt, lengths, steps):
    m = nnx.merge(graphdef, p)
    mask = mask if kind.has(MASK) else None
    positions = positions if kind.has(DECODER) else None
    logits = h.call(kind, m, tokens, mask, positions, src=tokens, src_mask=mask)
    if not kind.has(DECODES):
      return logits, None
    return logits, h.decoded(kind, config, m, tokens.shape[1], prompt, lengths, steps, tokens, mask)

  return jax.jit(run)


@pytest.mark.parametrize("kind", KINDS, ids=[k.name for k in KINDS])
def test_bfloat16_logits_are_finite_and_the_cache_gives_them(kind):
  config = kind.config(dtype="bfloat16", param_dtype="bfloat16", scan_layers=True)
  full, mask, positions = h.ragged(
    np.random.default_rng(0), [n + STEPS for n in LENGTHS], PROMPT + STEPS
  )
  lengths = np.array(LENGTHS)
  prompt = np.where(np.arange(PROMPT)[None, :] < lengths[:, None], full[:, :PROMPT], 0)
  steps = np.stack([full[b, n : n + STEPS] for b, n in enumerate(lengths)])
  logits, decoded = _program(kind, config)(
    h.params(config), *map(jnp.asarray, (full, mask, positions, prompt, lengths, steps))
  )
  want = np.asarray(logits, np.float32)
  assert h.finite(want), "non-finite bfloat16 logits"
  if decoded is None:
    return
  prefill, stepped, cache = decoded
  assert h.finite(cache) and h.finite(prefill) and h.finite(stepped), "non-finite decoding"
  atol = h.bound_bf16(config, want[mask])
  for b, n in enumerate(lengths):
    got = np.concatenate([np.asarray(prefill, np.float32)[b, :n], np.asarray(stepped)[b]])
    np.testing.assert_allclose(
      got, want[b, : n + STEPS], atol=atol, rtol=0, err_msg=f"row {b}, prompt of {n} tokens"
    )
