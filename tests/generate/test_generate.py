"""``generate``: greedy equals a naive loop, sampling options, batching, bucketing, bad input."""

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from transformer_jax import generate, models
from transformer_jax.generate import decode
from tests.generate.conftest import VOCAB, gpt_config, gpt_model, naive_greedy, random_prompts

NEW = 8


@pytest.mark.parametrize("case", ["gpt2-learned", "llama-rope-gqa", "alibi", "sliding-window"])
def test_greedy_equals_naive_full_forward_loop(case):
  model = gpt_model(case)
  prompts = random_prompts(3, [5, 9, 1])
  out = np.asarray(generate.generate(model, prompts, max_new_tokens=NEW))
  assert out.shape == (3, NEW) and out.dtype == np.int32
  for i, p in enumerate(prompts):
    assert out[i].tolist() == naive_greedy(model, p, NEW), (case, i)


def test_batch_of_different_lengths_equals_each_alone_left_and_right_padding():
  model = gpt_model("llama-rope-gqa")
  prompts = random_prompts(4, [3, 11, 6])
  alone = [np.asarray(generate.generate(model, [p], max_new_tokens=NEW))[0] for p in prompts]
  width = 11
  right = np.zeros((3, width), np.int32)
  left = np.zeros((3, width), np.int32)
  for i, p in enumerate(prompts):
    right[i, : len(p)] = p
    left[i, width - len(p) :] = p
  lengths = [len(p) for p in prompts]
  got_right = np.asarray(
    generate.generate(model, right, prompt_lengths=lengths, max_new_tokens=NEW)
  )
  got_left = np.asarray(
    generate.generate(model, left, prompt_lengths=lengths, max_new_tokens=NEW, padding_side="left")
  )
  np.testing.assert_array_equal(got_right, np.stack(alone))
  np.testing.assert_array_equal(got_left, np.stack(alone))


def test_config_params_pair_equals_module():
  config = gpt_config("gpt2-learned")
  params = models.init(config, jax.random.key(1))
  model = models.create(config)  # key 0: different weights from params
  prompts = random_prompts(5, [4, 7])
  got = np.asarray(generate.generate((config, params), prompts, max_new_tokens=NEW))
  from flax import nnx

  same = nnx.merge(models.graphdef(config), params)
  np.testing.assert_array_equal(got, generate.generate(same, prompts, max_new_tokens=NEW))
  assert not np.array_equal(got, generate.generate(model, prompts, max_new_tokens=NEW))


def test_top_k_one_equals_greedy():
  model = gpt_model("llama-rope-gqa")
  prompts = random_prompts(6, [4, 8])
  greedy = generate.generate(model, prompts, max_new_tokens=NEW)
  top1 = generate.generate(
    model, prompts, max_new_tokens=NEW, temperature=1.5, top_k=1, key=jax.random.key(3)
  )
  np.testing.assert_array_equal(greedy, top1)


def test_sampling_reproducible_with_same_key_and_varies_with_key():
  model = gpt_model("gpt2-learned")
  prompts = random_prompts(7, [4, 8])
  kw = dict(max_new_tokens=16, temperature=1.0, top_p=0.9)
  a = generate.generate(model, prompts, key=jax.random.key(11), **kw)
  b = generate.generate(model, prompts, key=jax.random.key(11), **kw)
  c = generate.generate(model, prompts, key=jax.random.key(12), **kw)
  np.testing.assert_array_equal(a, b)
  assert not np.array_equal(a, c)


def test_eos_stops_row_and_pads_with_eos():
  model = gpt_model("gpt2-learned")
  prompts = random_prompts(8, [5, 6])
  free = naive_greedy(model, prompts[0], NEW)
  eos = free[2]
  out = np.asarray(generate.generate(model, prompts, max_new_tokens=NEW, eos_id=eos))
  row0 = out[0].tolist()
  first = row0.index(eos)
  assert row0[: first + 1] == free[: first + 1]
  assert all(t == eos for t in row0[first:])
  want1 = naive_greedy(model, prompts[1], NEW, eos_id=eos)
  assert out[1, : len(want1)].tolist() == want1
  assert all(t == eos for t in out[1, len(want1) :])


def test_prompt_lengths_in_one_bucket_compile_once():
  model = gpt_model("alibi")
  generate.generate(model, random_prompts(9, [9, 3]), max_new_tokens=5)
  before = decode.trace_count
  for lengths in ([10, 2], [16, 16], [12, 1]):  # all in the 16 bucket
    generate.generate(model, random_prompts(10, lengths), max_new_tokens=5)
  assert decode.trace_count == before
  generate.generate(model, random_prompts(10, [17, 2]), max_new_tokens=5)  # the 32 bucket
  assert decode.trace_count == before + 1


def test_truncate_logits_top_k_and_top_p():
  logits = jnp.log(jnp.asarray([[0.5, 0.3, 0.15, 0.05]]))
  top2 = generate.truncate_logits(logits, top_k=2)
  assert np.isfinite(np.asarray(top2)).tolist() == [[True, True, False, False]]
  nucleus = generate.truncate_logits(logits, top_p=0.8)  # 0.5 + 0.3 reaches 0.8
  assert np.isfinite(np.asarray(nucleus)).tolist() == [[True, True, False, False]]
  nucleus = generate.truncate_logits(logits, top_p=0.81)
  assert np.isfinite(np.asarray(nucleus)).tolist() == [[True, True, True, False]]
  assert np.isfinite(np.asarray(generate.truncate_logits(logits, top_p=0.1))).sum() == 1
  np.testing.assert_array_equal(generate.truncate_logits(logits, top_p=1.0), logits)


def test_sampled_frequencies_match_truncated_distribution():
  probs = np.asarray([0.4, 0.25, 0.15, 0.1, 0.06, 0.04])
  logits = jnp.log(jnp.asarray(probs, jnp.float32))[None]
  n = 20000
  keys = jax.random.split(jax.random.key(0), n)
  draws = jax.vmap(lambda k: generate.next_token(logits, k, temperature=1.0, top_k=4, top_p=0.85))(
    keys
  )[:, 0]
  counts = np.bincount(np.asarray(draws), minlength=len(probs))
  kept = probs[:3] / probs[:3].sum()  # top-k 4, then the 0.85 nucleus keeps 3 tokens
  assert counts[3:].sum() == 0
  expected = kept * n
  chi2 = float((((counts[:3] - expected) ** 2) / expected).sum())
  assert chi2 < 13.8  # chi-square, 2 degrees of freedom, p = 0.001


@pytest.mark.parametrize(
  "kwargs, match",
  [
    (dict(prompt_ids=[[1, 2], []]), "prompt 1 is empty"),
    (dict(prompt_ids=np.zeros((1, 65), np.int32)), "length 65 is longer than the model's context"),
    (dict(prompt_ids=[[1, 2]], max_new_tokens=64), "max_new_tokens=64"),
    (dict(prompt_ids=[[1] * 60], max_new_tokens=5), r"60 \+ max_new_tokens=5"),
    (dict(top_p=0.0), "top_p=0.0"),
    (dict(top_p=1.5), "top_p=1.5"),
    (dict(max_new_tokens=0), "max_new_tokens=0"),
    (dict(top_k=0), "top_k=0"),
    (dict(temperature=-1.0), "temperature=-1.0"),
    (dict(prompt_ids=[[1, VOCAB]]), f"= {VOCAB} is outside the vocabulary"),
    (dict(prompt_ids=np.zeros((2, 3), np.int32), prompt_lengths=[3, 0]), "prompt 1 is empty"),
  ],
)
def test_bad_input_raises_value_error_naming_value(kwargs, match):
  kwargs = {"prompt_ids": [[1, 2, 3]], "max_new_tokens": 4, **kwargs}
  with pytest.raises(ValueError, match=match):
    generate.generate(gpt_model("gpt2-learned"), **kwargs)


def test_bert_model_is_rejected():
  config = models.get_config("bert-tiny", vocab_size=VOCAB)
  with pytest.raises(TypeError, match="BERTConfig"):
    generate.generate((config, None), [[1]], max_new_tokens=2)


def test_decoder_start_id_is_rejected_for_gpt():
  with pytest.raises(ValueError, match="decoder_start_id=1"):
    generate.generate(gpt_model("gpt2-learned"), [[1]], max_new_tokens=2, decoder_start_id=1)


def test_repetition_penalty_greedy_equals_naive_penalised_loop():
  from flax import nnx
  from tests.generate.conftest import last_logits

  model = gpt_model("gpt2-learned")
  _, params = nnx.split(model)
  prompts = random_prompts(12, [6, 3])
  penalty = 3.0
  out = np.asarray(
    generate.generate(model, prompts, max_new_tokens=NEW, repetition_penalty=penalty)
  )
  for i, p in enumerate(prompts):
    seq = list(p)
    for _ in range(NEW):
      logits = last_logits(params, model.config, seq)
      seen = np.isin(np.arange(VOCAB), seq)
      logits = np.where(seen, np.where(logits > 0, logits / penalty, logits * penalty), logits)
      seq.append(int(np.argmax(logits)))
    assert out[i].tolist() == seq[len(p) :], i
  plain = np.asarray(generate.generate(model, prompts, max_new_tokens=NEW))
  assert not np.array_equal(out, plain)  # the penalty changes something here
  same = generate.generate(model, prompts, max_new_tokens=NEW, repetition_penalty=1.0)
  np.testing.assert_array_equal(same, plain)
  with pytest.raises(ValueError, match="repetition_penalty=0.0"):
    generate.generate(model, prompts, max_new_tokens=NEW, repetition_penalty=0.0)


def test_suppressed_ids_never_appear_and_greedy_is_the_naive_loop_without_them():
  from flax import nnx
  from tests.generate.conftest import last_logits

  model = gpt_model("gpt2-learned")
  _, params = nnx.split(model)
  prompts = random_prompts(13, [6, 3])
  plain = np.asarray(generate.generate(model, prompts, max_new_tokens=NEW))
  banned = sorted(set(plain.reshape(-1).tolist()))[:3]
  out = np.asarray(
    generate.generate(
      model, prompts, max_new_tokens=NEW, suppress_ids=banned, repetition_penalty=2.0
    )
  )
  for i, p in enumerate(prompts):
    seq = list(p)
    for _ in range(NEW):
      logits = last_logits(params, model.config, seq)
      seen = np.isin(np.arange(VOCAB), seq)
      logits = np.where(seen, np.where(logits > 0, logits / 2.0, logits * 2.0), logits)
      logits[banned] = -np.inf
      seq.append(int(np.argmax(logits)))
    assert out[i].tolist() == seq[len(p) :], i
  sampled = generate.generate(
    model,
    prompts * 8,
    max_new_tokens=NEW,
    temperature=2.0,
    suppress_ids=banned,
    key=jax.random.key(3),
  )
  assert not np.isin(np.asarray(sampled), banned).any()


@pytest.mark.parametrize(
  "suppress, match",
  [
    ([VOCAB], rf"suppress_ids \[{VOCAB}\] must lie in the vocabulary \[0, {VOCAB}\)"),
    ([-1, 2], r"suppress_ids \[-1, 2\] must lie in the vocabulary"),
    (list(range(VOCAB)), rf"suppress_ids hold all {VOCAB} ids of the vocabulary"),
  ],
)
def test_bad_suppress_ids_are_refused_by_name(suppress, match):
  model = gpt_model("gpt2-learned")
  with pytest.raises(ValueError, match=match):
    generate.generate(model, [[1, 2]], max_new_tokens=2, suppress_ids=suppress)
  with pytest.raises(ValueError, match=match):
    generate.beam_search(model, [[1, 2]], num_beams=2, max_new_tokens=2, suppress_ids=suppress)


def test_special_ids_are_every_special_token_but_the_kept_ones(text_dataset):
  from transformer_jax import data

  tok = data.load_dataset(text_dataset).tokenizer
  got = generate.special_ids(tok, keep=[tok.eot_id])
  assert got == sorted(set(tok.special_ids.values()) - {tok.eot_id})
  assert tok.unk_id in got and tok.eot_id not in got
  assert generate.special_ids(tok) == sorted(set(tok.special_ids.values()))
