"""``generate.stream.stream_generate``: the tokens of ``generate.generate``, chunk by chunk."""

import jax
import numpy as np

from transformer_jax import generate
from transformer_jax.generate import stream
from tests.generate.conftest import gpt_model, random_prompts


def test_stream_equals_generate_and_compiles_once_per_chunk_size():
  model = gpt_model("gpt2-learned")
  prompts = random_prompts(7, [4, 8])  # as test_generate's sampling test: its compilation
  kw = dict(max_new_tokens=16, temperature=1.0, top_p=0.9, key=jax.random.key(11))
  whole = np.asarray(generate.generate(model, prompts, **kw))
  before = stream.trace_count
  chunks = list(stream.stream_generate(model, prompts, chunk_size=6, **kw))
  assert [c.shape[1] for c in chunks] == [1, 6, 6, 3]
  np.testing.assert_array_equal(np.concatenate(chunks, axis=1), whole)
  assert stream.trace_count - before <= 1  # one trace for every chunk, the short last too
  eos = int(whole[0, next(j for j in range(2, 7) if whole[0, j] not in whole[0, :j])])
  # With EOS: the same tokens up to each row's EOS (same keys), then EOS; the stream stops after
  # the chunk where the last row ends.
  want = whole.copy()
  for row in want:
    if eos in row.tolist():
      row[row.tolist().index(eos) :] = eos
  streamed = np.concatenate(
    list(stream.stream_generate(model, prompts, chunk_size=6, eos_id=eos, **kw)), axis=1
  )
  np.testing.assert_array_equal(streamed, want[:, : streamed.shape[1]])
  assert (want[:, streamed.shape[1] :] == eos).all()
  assert (eos in want[1]) == (streamed.shape[1] < 16)
  # Suppressed ids: the same rule in both (traced: no new compilation).
  banned = sorted(set(whole.reshape(-1).tolist()))[:4]
  suppressed = np.asarray(generate.generate(model, prompts, suppress_ids=banned, **kw))
  streamed = np.concatenate(
    list(stream.stream_generate(model, prompts, chunk_size=6, suppress_ids=banned, **kw)), axis=1
  )
  np.testing.assert_array_equal(streamed, suppressed)
  assert not np.isin(suppressed, banned).any()
  assert stream.trace_count - before <= 1
