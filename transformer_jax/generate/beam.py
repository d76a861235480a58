"""``beam_search``: deterministic beam search with a key/value cache, the whole search in one
``jax.jit``.

The beams of a row are batch rows of the cache (``B * num_beams`` rows; row ``b * num_beams + j`` is
beam j of input b). Each step scores every one-token extension of every live beam, keeps the best
``2 * num_beams`` candidates, and

- moves the candidates that end in ``eos_id`` (or reach ``max_new_tokens``) into a separate buffer
  of ``num_beams`` finished hypotheses, if they rank among the first ``num_beams`` candidates;
- keeps the best ``num_beams`` other candidates as the new live beams, gathering the cache rows of
  their parent beams (``jnp.take`` along the cache's batch axis).

Scores follow Hugging Face transformers: a finished hypothesis of ``n`` new tokens (EOS included)
scores ``sum(log p) / n ** length_penalty``; live beams are ranked by their plain ``sum(log p)``.

Stopping rule (transformers' default, ``early_stopping=False``): once a row holds ``num_beams``
finished hypotheses, it stops (accepts no more) as soon as its best live beam, scored as if it ended
at the current length, ``sum(log p) / n ** length_penalty``, is not better than the worst finished
one. This is a heuristic: with ``length_penalty > 0`` a longer continuation could in principle still
overtake. The loop ends when every row has stopped or after ``max_new_tokens`` steps. A stopped row
is frozen, so a row's result never depends on the other rows of the batch.
"""

from __future__ import annotations

import functools
from typing import NamedTuple, Sequence

import jax
import jax.numpy as jnp
import numpy as np
from flax import nnx

from transformer_jax.generate.cache import KVCache, extend, init_cache, with_encoder
from transformer_jax.generate.decode import (
  check_options,
  padded_inputs,
  split_model,
  decode_layers,
  suppress_mask,
)
from transformer_jax.models.config import Seq2SeqConfig

# Score of an empty slot / a candidate that must not be chosen (transformers uses the same value,
# so ties and fill-ins behave the same way).
_NEG = -1.0e9

# Number of times the search has been traced (each trace is one compilation); tests read it.
trace_count = 0


class BeamSearchOutput(NamedTuple):
  """The finished hypotheses of every row, best first."""

  sequences: jax.Array  # [B, M] int32: the best hypothesis, eos_id after its EOS (0 without one)
  scores: jax.Array  # [B] float32: its sum(log p) / length ** length_penalty
  all_sequences: jax.Array  # [B, num_beams, M] int32: every finished hypothesis, best first
  all_scores: jax.Array  # [B, num_beams] float32


class _Options(NamedTuple):
  eos_id: jax.Array  # int32, -1 = none
  pad_id: jax.Array  # int32: eos_id, or 0 without one
  length_penalty: jax.Array  # float32
  start_id: jax.Array  # int32: Seq2Seq decoder start
  suppress_V: jax.Array  # [V] bool: ids never produced


class _State(NamedTuple):
  running_seqs_BKM: jax.Array  # new tokens of the live beams (pad after the current step)
  running_scores_BK: jax.Array  # their sum of log-probabilities, best first
  done_seqs_BKM: jax.Array  # finished hypotheses
  done_scores_BK: jax.Array  # their length-penalised scores, best first (_NEG = empty slot)
  done_filled_BK: jax.Array  # bool: the slot holds a hypothesis
  active_B: jax.Array  # bool: the row may still accept finished hypotheses


def beam_search(
  model,
  inputs,
  *,
  num_beams: int,
  length_penalty: float = 1.0,
  max_new_tokens: int,
  eos_id: int | None = None,
  prompt_lengths=None,
  decoder_start_id: int | None = None,
  suppress_ids: Sequence[int] = (),
) -> BeamSearchOutput:
  """Beam search: continues GPT prompts, or decodes Seq2Seq sources from ``decoder_start_id``.

  Args:
    model: a ``GPT`` or ``Seq2Seq`` module, or a ``(config, params)`` pair.
    inputs: ``[B, P]`` ids (right-padded, see ``prompt_lengths``) or a list of B id lists: the GPT
      prompts, or the Seq2Seq encoder inputs.
    num_beams: live beams per row (1 is greedy decoding).
    length_penalty: exponent of the length normalisation of finished hypotheses; above 0 favours
      longer ones, 0 compares plain sums of log-probabilities.
    max_new_tokens: tokens to generate per row; GPT prompt + new tokens must fit in ``max_len``.
    eos_id: a hypothesis ends when it produces this id (None: all run to ``max_new_tokens``).
    prompt_lengths: ``[B]`` real lengths of the rows of ``inputs`` (default: all P).
    decoder_start_id: Seq2Seq only (required there): the first decoder input.
    suppress_ids: ids never produced (their log-probability is set to -inf, as transformers'
      ``suppress_tokens``), e.g. a tokenizer's special ids: ``special_ids(tokenizer,
      keep=[eos_id])``.

  Returns:
    ``BeamSearchOutput``: the best hypothesis ``[B, max_new_tokens]`` and its score ``[B]``, and all
    ``num_beams`` finished hypotheses and scores. Each row is what that input alone would give.

  Raises:
    ValueError: empty prompt, prompt longer than the context, ``max_new_tokens`` beyond it, ids
      outside the vocabulary, ``num_beams < 1`` and other bad options.
    TypeError: a model that is neither GPT nor Seq2Seq.
  """
  config, graphdef, params = split_model(model)
  seq2seq = isinstance(config, Seq2SeqConfig)
  check_options(config, max_new_tokens, 0.0, None, None, eos_id, 1.0)
  if not isinstance(num_beams, (int, np.integer)) or num_beams < 1:
    raise ValueError(f"num_beams={num_beams!r} must be a positive integer")
  if not np.isfinite(length_penalty):
    raise ValueError(f"length_penalty={length_penalty!r} must be a finite number")
  suppress_V = suppress_mask(suppress_ids, config.vocab_size)
  padded, lengths, cache_len = padded_inputs(
    config, inputs, prompt_lengths, "right", max_new_tokens, decoder_start_id, "inputs"
  )
  run = _compiled(graphdef, cache_len, int(num_beams), int(max_new_tokens), seq2seq)
  # Options that do not change shapes are traced arguments: one compilation serves them all.
  options = _Options(
    eos_id=jnp.int32(-1 if eos_id is None else eos_id),
    pad_id=jnp.int32(0 if eos_id is None else eos_id),
    length_penalty=jnp.float32(length_penalty),
    start_id=jnp.int32(0 if decoder_start_id is None else decoder_start_id),
    suppress_V=jnp.asarray(suppress_V),
  )
  layers = decode_layers(graphdef, params)
  return run(params, layers, jnp.asarray(padded), jnp.asarray(lengths, jnp.int32), options)


def _gather(x_BN, idx_BJ):
  """``x[b, idx[b, j]]`` for ``x`` of shape ``[B, N, ...]``: ``[B, J, ...]``."""
  idx = idx_BJ.reshape(idx_BJ.shape + (1,) * (x_BN.ndim - 2))
  return jnp.take_along_axis(x_BN, idx, axis=1)


@functools.lru_cache(maxsize=32)
def _compiled(graphdef, cache_len, num_beams, max_new_tokens, seq2seq):
  """The jitted search for one model structure, beam count and length (jit caches per shape)."""
  k, m = num_beams, max_new_tokens

  def select(i, logp_BKV, st: _State, opt: _Options) -> tuple[_State, jax.Array]:
    """Step ``i`` (the (i+1)-th new token): new live beams, their parents ``[B, K]``, finished."""
    b, _, vocab = logp_BKV.shape
    logp_BKV = jnp.where(opt.suppress_V[None, None], -jnp.inf, logp_BKV)
    cand_BKV = st.running_scores_BK[:, :, None] + logp_BKV
    top_BC, flat_BC = jax.lax.top_k(cand_BKV.reshape(b, k * vocab), 2 * k)  # C = 2K candidates
    parent_BC, tok_BC = flat_BC // vocab, (flat_BC % vocab).astype(jnp.int32)
    at_i_11M = (jnp.arange(m) == i)[None, None]
    seqs_BCM = jnp.where(at_i_11M, tok_BC[:, :, None], _gather(st.running_seqs_BKM, parent_BC))
    stop_BC = (tok_BC == opt.eos_id) | (i == m - 1)

    # Live beams: the best K candidates that did not stop.
    live_BC = top_BC + jnp.where(stop_BC, _NEG, 0.0)
    keep_BK = jax.lax.top_k(live_BC, k)[1]
    running_scores_BK = _gather(live_BC, keep_BK)
    running_seqs_BKM = _gather(seqs_BCM, keep_BK)
    parents_BK = _gather(parent_BC, keep_BK)

    # Finished: stopped candidates among the first K, length-penalised, merged into the buffer.
    length = (i + 1).astype(jnp.float32)
    finished_BC = stop_BC & (jnp.arange(2 * k) < k)[None, :]
    norm_BC = top_BC / length**opt.length_penalty
    norm_BC = norm_BC + jnp.where(st.active_B[:, None], 0.0, _NEG)
    norm_BC = norm_BC + jnp.where(finished_BC, 0.0, _NEG)
    merged_scores = jnp.concatenate([st.done_scores_BK, norm_BC], axis=1)
    best_BK = jax.lax.top_k(merged_scores, k)[1]
    done_scores_BK = _gather(merged_scores, best_BK)
    done_seqs_BKM = _gather(jnp.concatenate([st.done_seqs_BKM, seqs_BCM], axis=1), best_BK)
    done_filled_BK = _gather(jnp.concatenate([st.done_filled_BK, finished_BC], axis=1), best_BK)

    # Can the best live beam, ended now, still beat the worst finished hypothesis?
    best_live_B1 = running_scores_BK[:, :1] / length**opt.length_penalty
    worst_BK = jnp.where(done_filled_BK, jnp.min(done_scores_BK, axis=1, keepdims=True), _NEG)
    active_B = st.active_B & jnp.any(best_live_B1 > worst_BK, axis=1)
    return _State(
      running_seqs_BKM, running_scores_BK, done_seqs_BKM, done_scores_BK, done_filled_BK, active_B
    ), parents_BK

  def reorder(cache: KVCache, parents_BK) -> KVCache:
    """Cache rows of the parents of the new live beams (beams of one row share the rest)."""
    b = parents_BK.shape[0]
    rows = (jnp.arange(b)[:, None] * k + parents_BK).reshape(-1)
    return cache.take_rows(rows)

  def run(params, layers, inputs_BP, lengths_B, opt: _Options):
    global trace_count
    trace_count += 1
    model = nnx.merge(graphdef, params)
    b = inputs_BP.shape[0]
    cache = init_cache(model.config, b, cache_len)
    if not seq2seq:  # GPT: prefill each prompt once, before it is split into beams
      logits_BPV, cache = extend(model, inputs_BP, cache, num_valid=lengths_B, layers=layers)
      last_BV = jnp.take_along_axis(logits_BPV, (lengths_B - 1)[:, None, None], axis=1)[:, 0]
    else:  # Seq2Seq: encode once, then the start token
      src_mask_BP = jnp.arange(inputs_BP.shape[1])[None, :] < lengths_B[:, None]
      cache = with_encoder(model, cache, model.encode(inputs_BP, src_mask_BP), src_mask_BP)
      last_B1V, cache = extend(
        model, jnp.full((b, 1), opt.start_id, jnp.int32), cache, layers=layers
      )
      last_BV = last_B1V[:, 0]
    cache = cache.take_rows(jnp.repeat(jnp.arange(b), k))  # row b -> rows b*k .. b*k + k - 1
    vocab = last_BV.shape[-1]
    logp_BKV = jnp.broadcast_to(jax.nn.log_softmax(last_BV)[:, None], (b, k, vocab))
    # Only beam 0 is live at first (the others are copies), as in transformers.
    st = _State(
      running_seqs_BKM=jnp.full((b, k, m), opt.pad_id, jnp.int32),
      running_scores_BK=jnp.where(jnp.arange(k) == 0, 0.0, _NEG)[None].repeat(b, 0),
      done_seqs_BKM=jnp.full((b, k, m), opt.pad_id, jnp.int32),
      done_scores_BK=jnp.full((b, k), _NEG, jnp.float32),
      done_filled_BK=jnp.zeros((b, k), bool),
      active_B=jnp.ones((b,), bool),
    )
    st, parents_BK = select(jnp.int32(0), logp_BKV, st, opt)
    cache = reorder(cache, parents_BK)

    def cond(carry):
      i, _, st = carry
      return (i < m) & jnp.any(st.active_B)

    def body(carry):
      i, cache, st = carry
      last_tok = st.running_seqs_BKM[:, :, i - 1].reshape(b * k, 1)
      logits_N1V, cache = extend(model, last_tok, cache, layers=layers)
      logp_BKV = jax.nn.log_softmax(logits_N1V[:, 0]).reshape(b, k, vocab)
      st, parents_BK = select(i, logp_BKV, st, opt)
      return i + 1, reorder(cache, parents_BK), st

    _, _, st = jax.lax.while_loop(cond, body, (jnp.int32(1), cache, st))
    return BeamSearchOutput(
      st.done_seqs_BKM[:, 0], st.done_scores_BK[:, 0], st.done_seqs_BKM, st.done_scores_BK
    )

  return jax.jit(run)
