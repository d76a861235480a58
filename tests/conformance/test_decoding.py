"""Decoding, for every registered kind that decodes: a ragged prefill and token-by-token steps give
the full forward pass's logits (past the sliding window and past linear attention's chunk
boundaries), and ``generate`` (greedy and sampling) and ``beam_search`` give each row of a ragged
batch what that row gives alone."""

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from hypothesis import given, settings, strategies as st

from tests.conformance import harness as h
from tests.conformance.kinds import DECODES, KINDS, SEQ2SEQ, VOCAB
from transformer_jax import generate

DECODING = [k for k in KINDS if k.has(DECODES)]
IDS = [k.name for k in DECODING]
PROMPT, STEPS = 10, 6  # PROMPT + STEPS = WIDTH: the references share one forward program
START = 1  # Seq2Seq decoder start id


def _pair(kind):
  config = kind.config()
  return config, (config, h.params(config))


def _start(kind):
  return dict(decoder_start_id=START) if kind.has(SEQ2SEQ) else {}


@pytest.mark.parametrize("kind", DECODING, ids=IDS)
@settings(max_examples=3, deadline=None, derandomize=True)
@given(
  lengths=st.lists(st.integers(1, PROMPT), min_size=h.ROWS, max_size=h.ROWS),
  seed=st.integers(0, 2**16),
)
def test_ragged_prefill_and_steps_equal_the_full_forward(kind, lengths, seed):
  config = kind.config()
  rng = np.random.default_rng(seed)
  full, mask, _ = h.ragged(rng, [n + STEPS for n in lengths])
  lengths = np.array(lengths)
  prompt = np.where(np.arange(PROMPT)[None, :] < lengths[:, None], full[:, :PROMPT], 0)
  steps = np.stack([full[b, n : n + STEPS] for b, n in enumerate(lengths)])
  # Seq2Seq: the source is the whole row, the decoder inputs as a decoder's.
  extra = dict(src=jnp.asarray(full), src_mask=jnp.asarray(mask)) if kind.has(SEQ2SEQ) else {}
  fn = h.decode_fn(kind, config, PROMPT + STEPS)
  prefill, stepped, cache = fn(
    h.params(config),
    jnp.asarray(prompt, jnp.int32),
    jnp.asarray(lengths, jnp.int32),
    jnp.asarray(steps, jnp.int32),
    **extra,
  )
  want = h.forward(kind, config, full, mask)
  assert h.finite(cache) and h.finite(prefill) and h.finite(stepped), "non-finite decoding"
  # The cache sums the same terms in another order (a recurrence for a chunked scan, one query
  # for a block of them): harness.bound.
  atol = h.bound(config, want[mask])
  for b, n in enumerate(lengths):
    np.testing.assert_allclose(
      np.asarray(prefill)[b, :n],
      want[b, :n],
      atol=atol,
      rtol=0,
      err_msg=f"prefill of row {b}, lengths {list(lengths)}",
    )
    np.testing.assert_allclose(
      np.asarray(stepped)[b],
      want[b, n : n + STEPS],
      atol=atol,
      rtol=0,
      err_msg=f"steps of row {b}, lengths {list(lengths)}",
    )


@pytest.mark.parametrize("kind", DECODING, ids=IDS)
def test_greedy_generate_equals_the_full_forward_row_by_row(kind):
  config, pair = _pair(kind)
  rng = np.random.default_rng(1)
  prompts = [list(rng.integers(0, VOCAB, n)) for n in (3, PROMPT, 6)]
  got = np.asarray(generate.generate(pair, prompts, max_new_tokens=STEPS, **_start(kind)))
  if kind.has(SEQ2SEQ):
    src, src_mask, _ = h.ragged(rng, [len(p) for p in prompts])
    for b, p in enumerate(prompts):
      src[b, : len(p)] = p
    want = h.greedy_by_forward(kind, config, [[START]] * h.ROWS, STEPS, src, src_mask)
  else:
    want = h.greedy_by_forward(kind, config, prompts, STEPS)
  np.testing.assert_array_equal(got, want)


def _ragged_prompts(seed):
  """Rows of 9 .. 16 tokens: one prompt bucket (16), so a batch of any of them compiles once."""
  rng = np.random.default_rng(seed)
  return [list(rng.integers(0, VOCAB, n)) for n in (9, h.WIDTH, 12)]


@pytest.mark.parametrize("kind", DECODING, ids=IDS)
def test_sampling_gives_each_row_what_it_gives_alone(kind):
  """Alone: in a batch of copies of itself, so that the row meets the same random draws (the
  key's draws are per batch position)."""
  _, pair = _pair(kind)
  prompts = _ragged_prompts(2)
  kw = dict(
    max_new_tokens=STEPS, temperature=0.9, top_p=0.95, key=jax.random.key(5), **_start(kind)
  )
  batched = np.asarray(generate.generate(pair, prompts, **kw))
  for b, p in enumerate(prompts):
    alone = np.asarray(generate.generate(pair, [p] * h.ROWS, **kw))
    np.testing.assert_array_equal(batched[b], alone[b], err_msg=f"row {b}")
  assert len({tuple(r) for r in batched}) > 1  # the rows did sample different tokens


@pytest.mark.parametrize("kind", DECODING, ids=IDS)
def test_beam_search_gives_each_row_what_it_gives_alone(kind):
  _, pair = _pair(kind)
  prompts = _ragged_prompts(3)
  kw = dict(num_beams=2, max_new_tokens=4, **_start(kind))
  batched = generate.beam_search(pair, prompts, **kw)
  assert h.finite(batched.all_scores)
  # A score adds max_new_tokens log-probabilities, each moved by at most twice its logits' change
  # (log-softmax), which harness.bound bounds at the scale of these rows' logits.
  config = pair[0]
  tokens, mask, _ = h.ragged(np.random.default_rng(0), [len(p) for p in prompts])
  for b, p in enumerate(prompts):
    tokens[b, : len(p)] = p
  atol = 2 * kw["max_new_tokens"] * h.bound(config, h.forward(kind, config, tokens, mask)[mask])
  for b, p in enumerate(prompts):
    alone = generate.beam_search(pair, [p] * h.ROWS, **kw)
    np.testing.assert_array_equal(
      batched.all_sequences[b], alone.all_sequences[b], err_msg=f"row {b}"
    )
    np.testing.assert_allclose(batched.all_scores[b], alone.all_scores[b], atol=atol, rtol=0)
