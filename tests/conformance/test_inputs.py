"""Bad ids and positions, for every registered kind: refused with an error naming them, called
eagerly and under ``tj.models.checked``, whatever the integer dtype (int8 .. int64, uint32): never
clamped, never wrapped."""

import jax.numpy as jnp
import numpy as np
import pytest
from flax import nnx

from tests.conformance import harness as h
from tests.conformance.kinds import DECODER, KINDS, TABLE_POSITIONS, VOCAB
from transformer_jax import models

IDS = [k.name for k in KINDS]
DTYPES = [np.int8, np.int16, np.int32, np.int64, np.uint32]


def _ids(dtype, bad=None):
  ids = np.random.default_rng(0).integers(0, VOCAB, (2, 6)).astype(dtype)
  if bad is not None:
    ids[1, 4] = bad
  return ids


def _bad_values(dtype):
  """Ids outside ``[0, VOCAB)`` that ``dtype`` holds: the first past the end, the largest, a
  negative one, and for int64 one that int32 would wrap into the vocabulary."""
  info = np.iinfo(dtype)
  values = [VOCAB, int(info.max)]
  if info.min < 0:
    values.append(-1)
  if info.bits == 64:
    values.append(2**32 + 3)  # int32(2**32 + 3) == 3
  return values


def _eager(kind, config):
  m = h.model(config)
  return lambda ids, **kw: h.call(kind, m, ids, **kw)


@pytest.fixture(scope="module")
def checked_calls():
  """One ``models.checked`` forward per kind (and argument pattern), kept for the module: each
  dtype of ids is one more compilation of it."""
  cache = {}

  def get(kind, with_positions=False):
    key = (kind.name, with_positions)
    if key not in cache:
      config = kind.config()
      graphdef = models.graphdef(config)
      if with_positions:

        def fn(p, ids, positions):
          return h.call(kind, nnx.merge(graphdef, p), ids, positions=positions)
      else:

        def fn(p, ids):
          return h.call(kind, nnx.merge(graphdef, p), ids)

      cache[key] = (models.checked(fn), h.params(config))
    return cache[key]

  return get


@pytest.mark.parametrize("kind", KINDS, ids=IDS)
@pytest.mark.parametrize("dtype", DTYPES, ids=lambda d: d.__name__)
def test_ids_outside_the_vocabulary_are_refused_eagerly(kind, dtype):
  call = _eager(kind, kind.config())
  for bad in _bad_values(dtype):
    with pytest.raises(ValueError, match=rf"\[1, 4\] = {bad} is outside the vocabulary"):
      call(_ids(dtype, bad))


@pytest.mark.parametrize("kind", KINDS, ids=IDS)
def test_ids_outside_the_vocabulary_are_refused_under_checked(kind, checked_calls):
  fn, params = checked_calls(kind)
  assert h.finite(fn(params, _ids(np.int32)))  # (tests/models/test_checked_ids.py: the values)
  for bad in (VOCAB, -1, 2**31 - 1):
    with pytest.raises(ValueError, match=rf"outside the vocabulary \[0, {VOCAB}\)"):
      fn(params, _ids(np.int32, bad))
  # Wider than int32: JAX would wrap 2**32 + 3 to 3, a valid id; refused before the call.
  with pytest.raises(ValueError, match=r"ids\[1, 4\] = 4294967299 does not fit in int32"):
    fn(params, _ids(np.int64, 2**32 + 3))


@pytest.mark.parametrize("dtype", DTYPES, ids=lambda d: d.__name__)
def test_every_integer_dtype_is_checked_by_value_under_checked(dtype):
  """The device check compares values, not their dtype's wrap-around: a vocabulary of 300 ids
  (more than int8 holds) takes every dtype's good ids and refuses its bad ones."""
  kind = KINDS[0]
  config = kind.config(vocab_size=300)
  graphdef = models.graphdef(config)
  fn = models.checked(lambda p, ids: h.call(kind, nnx.merge(graphdef, p), ids))
  params = h.params(config)
  good = np.random.default_rng(0).integers(0, 127, (2, 6))
  want = h.forward(kind, config, good.astype(np.int32))
  # Another program of the same function (harness.bound).
  np.testing.assert_allclose(
    np.asarray(fn(params, good.astype(dtype))), want, atol=h.bound(config, want), rtol=0
  )
  info = np.iinfo(dtype)
  for bad in [
    v for v in (300, int(info.max), -1, 2**32 + 3) if info.min <= v <= info.max and not 0 <= v < 300
  ]:
    ids = good.astype(dtype)
    ids[1, 4] = bad
    with pytest.raises(ValueError, match="outside the vocabulary|does not fit in int32"):
      fn(params, ids)


@pytest.mark.parametrize(
  "kind", [k for k in KINDS if k.has(DECODER)], ids=[k.name for k in KINDS if k.has(DECODER)]
)
def test_positions_outside_the_table_are_refused(kind, checked_calls):
  if not kind.has(TABLE_POSITIONS):
    pytest.skip(f"{kind.name}: positions are values (RoPE, ALiBi, none), not table rows")
  config = kind.config()
  call = _eager(kind, config)
  ids = _ids(np.int32)
  fn, params = checked_calls(kind, with_positions=True)
  for bad in (config.max_len, config.max_len + 7, -1):
    positions = np.broadcast_to(np.arange(6), (2, 6)).copy()
    positions[1, 4] = bad
    with pytest.raises(ValueError, match=rf"positions\[1, 4\] = {bad} is outside"):
      call(ids, positions=positions)
    with pytest.raises(ValueError, match=rf"positions .*outside .*max_len={config.max_len}"):
      fn(params, ids, jnp.asarray(positions))
  with pytest.raises(ValueError, match=r"positions\[0, 4\] = 4294967300 does not fit in int32"):
    fn(params, ids, np.where(np.arange(6) == 4, 2**32 + 4, np.arange(6))[None].repeat(2, 0))
