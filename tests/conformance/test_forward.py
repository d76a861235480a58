"""Forward passes, for every registered kind: ragged rows batched give what each gives alone,
padding (right and left) with ``attention_mask`` gives the unpadded result or the mask is refused
by name, and packed documents give what each gives alone."""

import jax.numpy as jnp
import numpy as np
import pytest
from hypothesis import given, settings, strategies as st

from tests.conformance import harness as h
from tests.conformance.kinds import DECODER, KINDS, LEFT_PADDING, MASK, PACKING, SEQ2SEQ, VOCAB

EXAMPLES = settings(max_examples=4, deadline=None, derandomize=True)
IDS = [k.name for k in KINDS]


@pytest.mark.parametrize("kind", KINDS, ids=IDS)
@EXAMPLES
@given(
  lengths=st.lists(st.integers(1, h.WIDTH), min_size=h.ROWS, max_size=h.ROWS),
  seed=st.integers(0, 2**16),
)
def test_ragged_rows_batched_equal_each_row_alone(kind, lengths, seed):
  if not kind.has(MASK) and not kind.has(DECODER):
    pytest.skip(f"{kind.name}: no attention_mask, and not causal: ragged rows cannot be batched")
  config = kind.config()
  tokens, mask, _ = h.ragged(np.random.default_rng(seed), lengths)
  if not kind.has(MASK):
    mask = None  # a causal kind: right padding comes after every real token
  batched = h.forward(kind, config, tokens, mask)
  assert h.finite(batched)
  for b, n in enumerate(lengths):
    alone = h.forward(kind, config, tokens[b : b + 1], None if mask is None else mask[b : b + 1])
    np.testing.assert_allclose(
      batched[b, :n],
      alone[0, :n],
      atol=h.bound(config, alone[0, :n]),  # the same sums in other orders (harness.bound)
      rtol=0,
      err_msg=f"row {b} of lengths {lengths}",
    )


@pytest.mark.parametrize("kind", KINDS, ids=IDS)
@EXAMPLES
@given(
  pads=st.lists(st.integers(0, 5), min_size=h.ROWS, max_size=h.ROWS), seed=st.integers(0, 2**16)
)
def test_padding_with_the_mask_gives_the_unpadded_result(kind, pads, seed):
  """Rows of WIDTH - 5 real tokens: unpadded, then with ``pads[b]`` columns of padding before
  them (the rest after) where the kind takes left padding, all after them otherwise."""
  config = kind.config()
  n = h.WIDTH - 5
  rng = np.random.default_rng(seed)
  real = rng.integers(0, VOCAB, (h.ROWS, n)).astype(np.int32)
  if not kind.has(MASK):
    with pytest.raises(ValueError, match="attention_mask"):
      h.forward(kind, config, real, np.ones_like(real, bool))
    return
  left = pads if kind.has(LEFT_PADDING) else [0] * h.ROWS
  tokens, mask, _ = h.ragged(rng, [n] * h.ROWS, left=left)
  tokens[mask] = real.reshape(-1)
  tokens[~mask] = rng.integers(0, VOCAB, int((~mask).sum()))  # padding ids must not matter
  unpadded = h.forward(kind, config, real, np.ones_like(real, bool))
  padded = h.forward(kind, config, tokens, mask)  # decoders: positions count the real tokens
  np.testing.assert_allclose(
    padded[mask].reshape(h.ROWS, n, -1),
    unpadded,
    atol=h.bound(config, unpadded),
    rtol=0,
    err_msg=f"padding before each row: {left}",
  )


@pytest.mark.parametrize("kind", KINDS, ids=IDS)
@EXAMPLES
@given(first=st.integers(1, h.WIDTH - 1), seed=st.integers(0, 2**16))
def test_packed_documents_equal_each_document_alone(kind, first, seed):
  if not kind.has(PACKING):
    pytest.skip(f"{kind.name} does not claim {PACKING}")
  config = kind.config()
  rng = np.random.default_rng(seed)
  second = h.WIDTH - first
  packed = rng.integers(0, VOCAB, (1, h.WIDTH)).astype(np.int32)
  segments = np.where(np.arange(h.WIDTH) < first, 1, 2)[None].astype(np.int32)
  positions = np.where(np.arange(h.WIDTH) < first, np.arange(h.WIDTH), np.arange(h.WIDTH) - first)[
    None
  ].astype(np.int32)
  got = np.asarray(
    h.forward_fn(kind, config)(
      h.params(config), jnp.asarray(packed), None, jnp.asarray(positions), jnp.asarray(segments)
    )
  )
  # Each document alone: right-padded rows of one batch (rows are independent: test above).
  docs, mask, alone_pos = h.ragged(rng, [first, second])
  docs[0, :first], docs[1, :second] = packed[0, :first], packed[0, first:]
  alone = h.forward(kind, config, docs, mask)
  # A document's sums start at another position of the scans' chunks and of the matmuls' blocks
  # (harness.bound).
  np.testing.assert_allclose(
    got[0, :first], alone[0, :first], atol=h.bound(config, alone[0, :first]), rtol=0
  )
  np.testing.assert_allclose(
    got[0, first:],
    alone[1, :second],
    atol=h.bound(config, alone[1, :second]),
    rtol=0,
    err_msg=f"the second document, after {first} tokens of the first",
  )


@pytest.mark.parametrize(
  "kind", [k for k in KINDS if k.has(DECODER) or k.has(SEQ2SEQ)], ids=lambda k: k.name
)
def test_a_later_token_never_changes_earlier_logits(kind):
  config = kind.config()
  tokens = np.random.default_rng(0).integers(0, VOCAB, (h.ROWS, h.WIDTH)).astype(np.int32)
  changed = tokens.copy()
  changed[:, 9] = (changed[:, 9] + 1) % VOCAB
  ones = np.ones_like(tokens, bool)
  # Seq2Seq: the source held fixed, the decoder input changed.
  a = h.forward(kind, config, tokens, ones, src=tokens, src_mask=ones)
  b = h.forward(kind, config, changed, ones, src=tokens, src_mask=ones)
  np.testing.assert_array_equal(a[:, :9], b[:, :9])
  assert not np.allclose(a[:, 9:], b[:, 9:])
