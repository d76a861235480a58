"""``beam_search``: equals a naive beam search over full forward passes, greedy at one beam, batch
independence, and Hugging Face transformers' ``generate(num_beams=...)`` on the same GPT-2
weights."""

import functools

import numpy as np
import pytest
from flax import nnx

from transformer_jax import generate, models
from transformer_jax.generate import beam
from tests.generate.conftest import VOCAB, gpt_model, last_logits, naive_greedy, random_prompts
from tests.generate.test_seq2seq import naive_greedy_seq2seq, reference_last_logits, seq2seq

NEW = 6


def log_softmax64(logits):
  x = np.asarray(logits, np.float64)
  x = x - x.max()
  return x - np.log(np.exp(x).sum())


def naive_beam_search(next_logp, *, num_beams, max_new_tokens, eos_id=None, length_penalty=1.0):
  """Beam search over Python lists, written from the description of transformers' algorithm.

  ``next_logp(new_tokens)`` is the float64 log-distribution of the next token after the new tokens
  so far (a full forward pass, no cache). Returns the finished hypotheses ``[(score, tokens)]``,
  best first, and whether any ended with EOS before ``max_new_tokens``.
  """
  live = [(0.0, [])]
  finished = []
  early_eos = False
  for step in range(max_new_tokens):
    cands = []
    for score, seq in live:
      logp = next_logp(seq)
      cands += [(score + logp[t], seq + [t]) for t in range(len(logp))]
    cands = sorted(cands, key=lambda c: -c[0])[: 2 * num_beams]
    live = []
    for rank, (score, seq) in enumerate(cands):
      if seq[-1] == eos_id or step == max_new_tokens - 1:
        if rank < num_beams:  # only the first num_beams candidates may finish
          finished.append((score / len(seq) ** length_penalty, seq))
          early_eos |= step < max_new_tokens - 1
      elif len(live) < num_beams:
        live.append((score, seq))
    finished = sorted(finished, key=lambda c: -c[0])[:num_beams]
    if not live:  # the last step: every candidate finished
      break
    if len(finished) == num_beams and live[0][0] / (step + 1) ** length_penalty <= finished[-1][0]:
      break  # the best live beam ended now would not beat the worst finished one
  return finished, early_eos


def gpt_next_logp(model, prompt):
  _, params = nnx.split(model)
  return lambda seq: log_softmax64(last_logits(params, model.config, list(prompt) + seq))


def seq2seq_next_logp(model, src, start):
  return lambda seq: log_softmax64(reference_last_logits(model, src, [start] + seq))


def padded(seq, width, pad):
  return list(seq) + [pad] * (width - len(seq))


def assert_matches_naive(out, row, finished, num_beams, pad):
  got = np.asarray(out.all_sequences[row])
  want = [padded(seq, got.shape[1], pad) for _, seq in finished]
  assert got.tolist() == want
  np.testing.assert_allclose(
    np.asarray(out.all_scores[row]), [s for s, _ in finished], rtol=1e-5, atol=1e-5
  )
  assert np.asarray(out.sequences[row]).tolist() == want[0]
  assert len(finished) == num_beams


def test_one_beam_equals_greedy_generate_gpt():
  # The prompts, length and EOS of test_generate's EOS test (so its compilation serves both).
  model = gpt_model("gpt2-learned")
  prompts = random_prompts(8, [5, 6])
  eos = naive_greedy(model, prompts[0], 8)[2]
  greedy = np.asarray(generate.generate(model, prompts, max_new_tokens=8, eos_id=eos))
  out = beam.beam_search(model, prompts, num_beams=1, max_new_tokens=8, eos_id=eos)
  np.testing.assert_array_equal(out.sequences, greedy)
  assert out.sequences.dtype == np.int32 and out.scores.shape == (2,)
  assert (greedy == eos).any() and not (greedy == eos).all()


def test_one_beam_equals_greedy_generate_seq2seq():
  # The sources, length and EOS of test_seq2seq's EOS test (so its compilation serves both).
  model = seq2seq("t5-tiny")
  srcs = random_prompts(24, [6, 3])
  eos = naive_greedy_seq2seq(model, srcs[0], 0, 6)[1]
  greedy = np.asarray(
    generate.generate(model, srcs, max_new_tokens=6, decoder_start_id=0, eos_id=eos)
  )
  out = beam.beam_search(model, srcs, num_beams=1, max_new_tokens=6, decoder_start_id=0, eos_id=eos)
  np.testing.assert_array_equal(out.sequences, greedy)
  assert (greedy == eos).any()


@pytest.mark.parametrize(
  "length_penalty, with_eos", [(1.0, False), (2.0, True), (0.5, True), (-1.0, True)]
)
def test_gpt_equals_naive_beam_search(length_penalty, with_eos):
  model, num_beams = gpt_model("gpt2-learned"), 3
  prompts = random_prompts(32, [4, 12])
  eos = None
  if with_eos:  # an id the beams like: the second token of the best hypothesis without EOS
    free, _ = naive_beam_search(
      gpt_next_logp(model, prompts[0]), num_beams=num_beams, max_new_tokens=NEW
    )
    eos = free[0][1][1]
  out = beam.beam_search(
    model,
    prompts,
    num_beams=num_beams,
    max_new_tokens=NEW,
    eos_id=eos,
    length_penalty=length_penalty,
  )
  for row, prompt in enumerate(prompts):
    finished, early_eos = naive_beam_search(
      gpt_next_logp(model, prompt),
      num_beams=num_beams,
      max_new_tokens=NEW,
      eos_id=eos,
      length_penalty=length_penalty,
    )
    assert_matches_naive(out, row, finished, num_beams, pad=0 if eos is None else eos)
    if with_eos and row == 0:
      assert early_eos  # EOS really ended a hypothesis early


def test_seq2seq_equals_naive_beam_search():
  model = seq2seq("t5-tiny")
  srcs = random_prompts(33, [8, 3])
  free, _ = naive_beam_search(seq2seq_next_logp(model, srcs[0], 1), num_beams=3, max_new_tokens=NEW)
  eos = free[0][1][2]
  out = beam.beam_search(
    model, srcs, num_beams=3, max_new_tokens=NEW, eos_id=eos, decoder_start_id=1, length_penalty=1.5
  )
  for row, src in enumerate(srcs):
    finished, _ = naive_beam_search(
      seq2seq_next_logp(model, src, 1),
      num_beams=3,
      max_new_tokens=NEW,
      eos_id=eos,
      length_penalty=1.5,
    )
    assert_matches_naive(out, row, finished, 3, pad=eos)


def test_batch_of_different_lengths_equals_each_alone():
  """(The naive-search tests also compare every row of a batch with one prompt alone.)"""
  model = gpt_model("gpt2-learned")
  prompts = random_prompts(34, [3, 12])  # buckets 8 and 16: alone and together differ
  kw = dict(num_beams=3, max_new_tokens=NEW, eos_id=5, length_penalty=1.2)
  width = 12
  ids = np.zeros((2, width), np.int32)
  for i, p in enumerate(prompts):
    ids[i, : len(p)] = p
  together = beam.beam_search(model, ids, prompt_lengths=[len(p) for p in prompts], **kw)
  for row, p in enumerate(prompts):
    alone = beam.beam_search(model, [p], **kw)
    np.testing.assert_array_equal(together.all_sequences[row], alone.all_sequences[0])
    np.testing.assert_allclose(together.all_scores[row], alone.all_scores[0], rtol=1e-5)


def test_beam_score_at_least_greedy_sequence_log_prob():
  """Not a theorem for beam search in general, but it holds for these prompts, and beam search
  finds a strictly more likely sequence for at least one of them."""
  model = gpt_model("gpt2-learned")
  _, params = nnx.split(model)
  prompts = random_prompts(40, [13, 5])
  out = beam.beam_search(model, prompts, num_beams=3, max_new_tokens=NEW, length_penalty=0.0)
  better = 0
  for row, p in enumerate(prompts):
    greedy = naive_greedy(model, p, NEW)
    seq = list(p)
    greedy_logp = 0.0
    for t in greedy:
      greedy_logp += log_softmax64(last_logits(params, model.config, seq))[t]
      seq.append(t)
    score = float(out.scores[row])
    assert score >= greedy_logp - 1e-4, (row, score, greedy_logp)
    better += score > greedy_logp + 1e-3
  assert better >= 1


def test_all_beams_sorted_and_padded_with_eos():
  model = gpt_model("gpt2-learned")
  prompts = random_prompts(37, [9, 2])
  free = naive_greedy(model, prompts[0], NEW)
  eos = free[1]
  out = beam.beam_search(model, prompts, num_beams=3, max_new_tokens=NEW, eos_id=eos)
  scores = np.asarray(out.all_scores[0])
  assert (np.diff(scores) <= 0).all() and np.isfinite(scores).all()
  for seq in np.asarray(out.all_sequences[0]).tolist():
    if eos in seq:
      assert all(t == eos for t in seq[seq.index(eos) :])


def test_prompt_lengths_in_one_bucket_compile_once():
  model = gpt_model("gpt2-learned")
  kw = dict(num_beams=3, max_new_tokens=NEW)
  beam.beam_search(model, random_prompts(38, [7, 12]), **kw)
  before = beam.trace_count
  beam.beam_search(model, random_prompts(39, [16, 1]), eos_id=4, length_penalty=2.0, **kw)
  beam.beam_search(model, random_prompts(39, [2, 9]), suppress_ids=[3], **kw)
  assert beam.trace_count == before  # same bucket; options are traced arguments


@pytest.mark.parametrize(
  "kwargs, error, match",
  [
    (dict(num_beams=0), ValueError, "num_beams=0"),
    (dict(max_new_tokens=0), ValueError, "max_new_tokens=0"),
    (dict(inputs=[[1] * 62]), ValueError, r"62 \+ max_new_tokens=4"),
    (dict(inputs=[[1], []]), ValueError, "prompt 1 is empty"),
    (dict(eos_id=VOCAB), ValueError, f"eos_id={VOCAB}"),
    (dict(decoder_start_id=1), ValueError, "decoder_start_id=1"),
    (dict(length_penalty=float("nan")), ValueError, "length_penalty=nan"),
    (dict(suppress_ids=[VOCAB + 3]), ValueError, "suppress_ids"),
  ],
)
def test_bad_input_raises(kwargs, error, match):
  kwargs = {"inputs": [[1, 2, 3]], "num_beams": 2, "max_new_tokens": 4, **kwargs}
  with pytest.raises(error, match=match):
    beam.beam_search(gpt_model("gpt2-learned"), **kwargs)


def test_bert_and_missing_start_id_are_rejected():
  config = models.get_config("bert-tiny", vocab_size=VOCAB)
  with pytest.raises(TypeError, match="BERTConfig"):
    beam.beam_search((config, None), [[1]], num_beams=2, max_new_tokens=2)
  with pytest.raises(ValueError, match="decoder_start_id=None"):
    beam.beam_search(seq2seq("t5-tiny"), [[1]], num_beams=2, max_new_tokens=2)


def test_suppressed_ids_never_appear():
  model = gpt_model("gpt2-learned")
  prompts = random_prompts(40, [5, 10])
  plain = np.asarray(
    beam.beam_search(model, prompts, num_beams=3, max_new_tokens=NEW).all_sequences
  )
  banned = sorted(set(plain.reshape(-1).tolist()))[:3]
  out = beam.beam_search(model, prompts, num_beams=3, max_new_tokens=NEW, suppress_ids=banned)
  assert not np.isin(np.asarray(out.all_sequences), banned).any()


# --- Hugging Face transformers, same random GPT-2 weights -----------------------------------------


@functools.lru_cache(maxsize=None)
def _hf_gpt2():
  torch = pytest.importorskip("torch")
  transformers = pytest.importorskip("transformers")
  import transformer_jax.hf as tjhf

  transformers.logging.set_verbosity_error()
  torch.manual_seed(0)
  config = transformers.GPT2Config(
    vocab_size=61, n_embd=32, n_layer=2, n_head=4, n_positions=40, bos_token_id=0, eos_token_id=0
  )
  config.architectures = ["GPT2LMHeadModel"]
  hf_model = transformers.GPT2LMHeadModel(config).float().eval()
  with torch.no_grad():  # wide weights: peaked, O(1)-separated log-probabilities
    for _, p in hf_model.named_parameters():
      p.add_(torch.randn_like(p) * (0.3 if p.ndim > 1 else 0.1))
  _, model = tjhf.load(hf_model)
  return torch, hf_model, model


@pytest.mark.parametrize(
  "num_beams, length_penalty, eos_id",
  [(3, 1.0, None), (3, 1.0, 58), (3, 2.0, 13), (3, 0.5, 54), (3, -1.0, 58)],
)
def test_equals_transformers_generate_num_beams(num_beams, length_penalty, eos_id):
  torch, hf_model, model = _hf_gpt2()
  prompt = np.array([[5, 17, 3, 40, 22]])
  new = 10
  pad = 0 if eos_id is None else eos_id
  with torch.no_grad():
    hf_out = hf_model.generate(
      torch.tensor(prompt),
      attention_mask=torch.ones(prompt.shape, dtype=torch.long),
      num_beams=num_beams,
      num_return_sequences=num_beams,
      do_sample=False,
      max_new_tokens=new,
      length_penalty=length_penalty,
      early_stopping=False,
      eos_token_id=eos_id,
      pad_token_id=pad,
      return_dict_in_generate=True,
      output_scores=True,
    )
  theirs = hf_out.sequences[:, prompt.shape[1] :].numpy()
  theirs = np.pad(theirs, ((0, 0), (0, new - theirs.shape[1])), constant_values=pad)
  ours = beam.beam_search(
    model,
    prompt,
    num_beams=num_beams,
    max_new_tokens=new,
    eos_id=eos_id,
    length_penalty=length_penalty,
  )
  np.testing.assert_array_equal(ours.all_sequences[0], theirs)
  np.testing.assert_allclose(ours.all_scores[0], hf_out.sequences_scores.numpy(), rtol=1e-5)
  if eos_id in (58, 54):
    assert (theirs[:, -1] == eos_id).any()  # some hypotheses did end with EOS
