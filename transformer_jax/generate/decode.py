"""``generate``: GPT decoding with a key/value cache, the whole loop inside one ``jax.jit``.

The prompt is prefilled in one call, then a ``lax.while_loop`` runs one-token steps until
``max_new_tokens`` or until every row has produced ``eos_id``. Nothing runs in Python per token.
Prompts are right-padded to a power-of-two bucket, so a new prompt length compiles again only when
it crosses a bucket: one compilation per (batch size, prompt bucket, max_new_tokens, strategy).
"""

from __future__ import annotations

import functools
import weakref
from collections.abc import Sequence
from typing import Literal

import jax
import jax.numpy as jnp
import numpy as np
from flax import nnx

from transformer_jax import backends, models
from transformer_jax.generate.cache import extend, init_cache, prefill, split_layers, with_encoder
from transformer_jax.generate.sampling import apply_repetition_penalty, next_token
from transformer_jax.models.common import check_tokens
from transformer_jax.models.config import GPTConfig, MambaConfig, Seq2SeqConfig

_MIN_BUCKET = 8

# Number of times the decode loop has been traced (each trace is one compilation); tests read it.
trace_count = 0


def prompt_bucket(length: int, max_len: int) -> int:
  """The padded prompt length: the next power of two >= ``length`` (at least 8), capped at
  max_len."""
  bucket = _MIN_BUCKET
  while bucket < length:
    bucket *= 2
  return min(bucket, max_len)


def split_model(
  model,
  kinds=(GPTConfig, MambaConfig, Seq2SeqConfig),
  *,
  what: str = "a GPT",
  needs: str = "generate needs a GPT, Mamba or Seq2Seq model",
) -> tuple[GPTConfig | MambaConfig | Seq2SeqConfig, nnx.GraphDef, nnx.State]:
  """``(config, graphdef, params)`` of a module or a ``(config, params)`` pair whose config is one
  of ``kinds`` (``what``/``needs`` word the errors)."""
  if isinstance(model, nnx.Module):
    graphdef, params = nnx.split(model)
    config = model.config
  elif isinstance(model, tuple) and len(model) == 2:
    config, params = model
    graphdef = models.graphdef(config)
  else:
    raise TypeError(f"model must be {what} module or a (config, params) pair; got {type(model)}")
  if not isinstance(config, kinds):
    raise TypeError(f"{needs}; got a {type(config).__name__}")
  return config, graphdef, params


def right_padded(prompt_ids, prompt_lengths, padding_side) -> tuple[np.ndarray, np.ndarray]:
  """``[B, P]`` int32 right-padded prompts and their ``[B]`` lengths (validated)."""
  if isinstance(prompt_ids, (list, tuple)) and all(
    isinstance(p, (list, tuple, np.ndarray)) for p in prompt_ids
  ):
    if prompt_lengths is not None:
      raise ValueError("prompt_lengths must be None when prompt_ids is a list of lists")
    lengths = np.array([len(p) for p in prompt_ids], np.int64)
    width = max(1, int(lengths.max(initial=0)))
    tokens = np.zeros((len(prompt_ids), width), np.int64)
    for i, p in enumerate(prompt_ids):
      tokens[i, : len(p)] = p
    padding_side = "right"
  else:
    tokens = np.asarray(prompt_ids)
    if tokens.ndim != 2:
      raise ValueError(f"prompt_ids must be [batch, length]; got shape {tokens.shape}")
    lengths = (
      np.full(tokens.shape[0], tokens.shape[1], np.int64)
      if prompt_lengths is None
      else np.asarray(prompt_lengths, np.int64).reshape(-1)
    )
    if lengths.shape != (tokens.shape[0],):
      raise ValueError(f"prompt_lengths has {lengths.size} entries for {tokens.shape[0]} prompts")
  if tokens.shape[0] == 0:
    raise ValueError("prompt_ids holds no prompts")
  if (lengths < 1).any():
    i = int(np.argmin(lengths))
    raise ValueError(f"prompt {i} is empty (length {int(lengths[i])}); every prompt needs a token")
  if (lengths > tokens.shape[1]).any():
    i = int(np.argmax(lengths))
    raise ValueError(
      f"prompt_lengths[{i}]={int(lengths[i])} exceeds the {tokens.shape[1]} columns of prompt_ids"
    )
  match padding_side:
    case "right":
      pass
    case "left":  # move each row's tokens to the front
      cols = np.arange(tokens.shape[1])[None, :] + (tokens.shape[1] - lengths)[:, None]
      tokens = np.take_along_axis(tokens, np.minimum(cols, tokens.shape[1] - 1), axis=1)
    case _:
      raise ValueError(f"padding_side={padding_side!r} must be 'right' or 'left'")
  valid = np.arange(tokens.shape[1])[None, :] < lengths[:, None]
  return np.where(valid, tokens, 0), lengths


def check_options(config, max_new_tokens, temperature, top_k, top_p, eos_id, repetition_penalty):
  if not isinstance(max_new_tokens, (int, np.integer)) or max_new_tokens < 1:
    raise ValueError(f"max_new_tokens={max_new_tokens!r} must be a positive integer")
  if isinstance(config, Seq2SeqConfig):
    if max_new_tokens > config.max_len:
      raise ValueError(
        f"max_new_tokens={max_new_tokens} exceeds the decoder's context max_len={config.max_len}"
      )
  elif max_new_tokens >= config.max_len:
    raise ValueError(
      f"max_new_tokens={max_new_tokens} leaves no room for a prompt in the model's "
      f"context max_len={config.max_len}"
    )
  if not temperature >= 0.0:
    raise ValueError(f"temperature={temperature!r} must be >= 0")
  if top_k is not None and (not isinstance(top_k, (int, np.integer)) or top_k < 1):
    raise ValueError(f"top_k={top_k!r} must be a positive integer or None")
  if not repetition_penalty > 0.0:
    raise ValueError(f"repetition_penalty={repetition_penalty!r} must be > 0")
  if top_p is not None and not 0.0 < top_p <= 1.0:
    raise ValueError(f"top_p={top_p!r} must be in (0, 1]")
  if eos_id is not None and not 0 <= eos_id < config.vocab_size:
    raise ValueError(f"eos_id={eos_id!r} is outside the vocabulary [0, {config.vocab_size})")


def suppress_mask(suppress_ids: Sequence[int], vocab_size: int) -> np.ndarray:
  """``[V]`` bool, True at the ids never to be produced (validated: in the vocabulary, and at
  least one id left to produce)."""
  suppress = sorted({int(i) for i in suppress_ids})
  if suppress and not 0 <= suppress[0] <= suppress[-1] < vocab_size:
    raise ValueError(f"suppress_ids {suppress} must lie in the vocabulary [0, {vocab_size})")
  if len(suppress) >= vocab_size:
    raise ValueError(
      f"suppress_ids hold all {vocab_size} ids of the vocabulary: none is left to produce"
    )
  mask_V = np.zeros((vocab_size,), bool)
  mask_V[suppress] = True
  return mask_V


def special_ids(tokenizer, keep: Sequence[int] = ()) -> list[int]:
  """The ids of ``tokenizer``'s special tokens (``[UNK]``, ``[PAD]``, ``[MASK]``, BOS/EOS,
  ``<|endoftext|>``...) except ``keep``: the ``suppress_ids`` that keep them out of generated
  text, as ``tjax generate`` does (keeping the id that ends a text: ``eot_id`` for a GPT,
  ``eos_id`` for a Seq2Seq model)."""
  return sorted(set(tokenizer.special_ids.values()) - {int(i) for i in keep})


def generate(
  model,
  prompt_ids,
  *,
  prompt_lengths=None,
  max_new_tokens: int,
  temperature: float = 0.0,
  top_k: int | None = None,
  top_p: float | None = None,
  eos_id: int | None = None,
  key: jax.Array | None = None,
  padding_side: Literal["right", "left"] = "right",
  decoder_start_id: int | None = None,
  repetition_penalty: float = 1.0,
  suppress_ids: Sequence[int] = (),
) -> jax.Array:
  """Continues each prompt with up to ``max_new_tokens`` tokens (GPT), or decodes from each source
  (Seq2Seq: ``prompt_ids`` are the encoder inputs and decoding starts from ``decoder_start_id``).

  Args:
    model: a ``GPT`` or ``Seq2Seq`` module, or a ``(config, params)`` pair as from
      ``tj.models.init``.
    prompt_ids: ``[B, P]`` ids (padded, see ``prompt_lengths``) or a list of B id lists.
    prompt_lengths: ``[B]`` real lengths of the rows of ``prompt_ids`` (default: all P).
    max_new_tokens: tokens to generate per row; prompt + new tokens must fit in ``max_len``.
    temperature: 0 means greedy (argmax); otherwise logits are divided by it and sampled.
    top_k: sample only among the k most likely tokens.
    top_p: sample only from the nucleus of probability ``top_p`` (in (0, 1]).
    eos_id: a row stops after producing it; the loop stops when every row has.
    key: PRNG key for sampling (default ``jax.random.key(0)``).
    padding_side: where the padding of ``prompt_ids`` is (``"left"`` rows end at column P-1).
    decoder_start_id: Seq2Seq only (required there): the first decoder input (BOS; T5 uses 0).
    repetition_penalty: > 0; above 1 discourages tokens already in the prompt (GPT) or the decoder
      input (Seq2Seq) or generated so far (CTRL's rule; applied before temperature).
    suppress_ids: ids never produced (their logits are set to -inf before choosing), e.g. a
      tokenizer's special ids: ``special_ids(tokenizer, keep=[eos_id])``.

  Returns:
    int32 ``[B, max_new_tokens]``: the new tokens of each row. After a row's ``eos_id`` (or when
    the loop stopped early) the remaining entries are ``eos_id`` (0 without one). Each row is what
    that prompt alone would give.

  Raises:
    ValueError: empty prompt, prompt longer than the context, ``max_new_tokens`` beyond it,
      top-p outside (0, 1], ids outside the vocabulary, and other bad options.
  """
  config, graphdef, params = split_model(model)
  check_options(config, max_new_tokens, temperature, top_k, top_p, eos_id, repetition_penalty)
  suppress_V = suppress_mask(suppress_ids, config.vocab_size)
  padded, lengths, cache_len = padded_inputs(
    config, prompt_ids, prompt_lengths, padding_side, max_new_tokens, decoder_start_id, "prompt_ids"
  )
  backend = getattr(model, "backend", None) or backends.current()
  run = _compiled(
    graphdef,
    backend,
    cache_len,
    int(max_new_tokens),
    float(temperature),
    None if top_k is None else int(top_k),
    None if top_p is None else float(top_p),
    None if eos_id is None else int(eos_id),
    None if decoder_start_id is None else int(decoder_start_id),
    float(repetition_penalty),
  )
  key = jax.random.key(0) if key is None else key
  layers = decode_layers(graphdef, params)
  # Traced: one compilation serves every set of suppressed ids.
  return run(
    params,
    layers,
    jnp.asarray(padded),
    jnp.asarray(lengths, jnp.int32),
    key,
    jnp.asarray(suppress_V),
  )


@functools.lru_cache(maxsize=64)
def _layer_splitter(graphdef):
  """Jitted ``params -> split_layers(model)``: each decoder layer's weights as arrays of their own,
  every projection kernel in the backend's decoding layout (``Backend.decode_layout``: on CPU
  ``backends.cpu.decode``).

  The decode loop reads them where they are, instead of slicing (copying) every layer out of the
  layer-stacked arrays at every step. The split is a program of its own because XLA then copies
  each slice with a plain memory copy; inside the decode program the slices are fused into loops
  that run several times slower.
  """
  return jax.jit(lambda params: split_layers(nnx.merge(graphdef, params)))


# graphdef -> (weak references to the params' arrays, their decoding layers): the last model of
# each structure that generated, kept while its arrays live.
_DECODE_LAYERS: dict = {}


def decode_layers(graphdef, params: nnx.State) -> tuple[nnx.State, ...]:
  """The decoding layers of ``params`` (``split_layers`` in a program of its own), made once per
  set of weights.

  Splitting (and on CPU transposing) the layers costs about as much as a prefill, so the result
  for the last params of each model structure is kept while those arrays live (an update of the
  model's weights makes new arrays and a new split). The copy holds as much memory as the layers'
  weights.
  """
  leaves = jax.tree.leaves(params)
  entry = _DECODE_LAYERS.get(graphdef)
  if (
    entry is not None
    and len(entry[0]) == len(leaves)
    and all(ref() is leaf for ref, leaf in zip(entry[0], leaves))
  ):
    return entry[1]
  layers = _layer_splitter(graphdef)(params)
  if leaves and not any(isinstance(leaf, jax.core.Tracer) for leaf in leaves):
    try:
      refs = tuple(weakref.ref(leaf) for leaf in leaves)
    except TypeError:  # a leaf that cannot be weakly referenced: no reuse
      return layers
    _DECODE_LAYERS[graphdef] = (refs, layers)
    weakref.finalize(leaves[0], _forget, graphdef, refs)
  return layers


def _forget(graphdef, refs) -> None:
  entry = _DECODE_LAYERS.get(graphdef)
  if entry is not None and entry[0] is refs:
    del _DECODE_LAYERS[graphdef]


def padded_inputs(
  config, inputs, prompt_lengths, padding_side, max_new_tokens, decoder_start_id, name: str
) -> tuple[np.ndarray, np.ndarray, int]:
  """Validated inputs right-padded to their power-of-two bucket: ``(padded [B, bucket] int32,
  lengths [B], cache_len)``. Checks the decoder start id, the prompt lengths against the context
  and the ids against the vocabulary (``name`` is the argument named in errors)."""
  seq2seq = isinstance(config, Seq2SeqConfig)
  if seq2seq:
    if decoder_start_id is None or not 0 <= decoder_start_id < config.vocab_size:
      raise ValueError(
        f"decoder_start_id={decoder_start_id!r} must be an id in "
        f"[0, {config.vocab_size}) for a Seq2Seq model"
      )
  elif decoder_start_id is not None:
    raise ValueError(f"decoder_start_id={decoder_start_id!r} is for Seq2Seq models only")
  tokens, lengths = right_padded(inputs, prompt_lengths, padding_side)
  longest = int(lengths.max())
  if longest > config.max_len:
    raise ValueError(
      f"a prompt of length {longest} is longer than the model's context max_len={config.max_len}"
    )
  if not seq2seq and longest + max_new_tokens > config.max_len:
    raise ValueError(
      f"prompt length {longest} + max_new_tokens={max_new_tokens} exceeds the "
      f"model's context max_len={config.max_len}"
    )
  check_tokens(name, tokens, config.vocab_size)
  bucket = prompt_bucket(longest, config.max_len)
  padded = np.zeros((tokens.shape[0], bucket), np.int32)
  width = min(bucket, tokens.shape[1])
  padded[:, :width] = tokens[:, :width]
  # GPT: prompt and new tokens share the cache. Seq2Seq: the decoder cache holds the start token
  # and the new tokens but the last one (the source lives in the cross-attention cache).
  cache_len = max_new_tokens if seq2seq else min(bucket + max_new_tokens, config.max_len)
  return padded, lengths, cache_len


@functools.lru_cache(maxsize=64)
def _compiled(
  graphdef,
  backend,
  cache_len,
  max_new_tokens,
  temperature,
  top_k,
  top_p,
  eos_id,
  decoder_start_id,
  repetition_penalty,
):
  """The jitted decode loop for one model structure and strategy (jit then caches per shape),
  compiled with ``backend``'s decoding options (the model's)."""
  choose = functools.partial(next_token, temperature=temperature, top_k=top_k, top_p=top_p)

  def pick(logits_BV, seen_BV, key, suppress_V):
    if repetition_penalty != 1.0:
      logits_BV = apply_repetition_penalty(logits_BV, seen_BV, repetition_penalty)
    return choose(jnp.where(suppress_V[None], -jnp.inf, logits_BV), key)

  def mark(seen_BV, tok_B):
    if repetition_penalty == 1.0:  # nothing reads it: keep it empty
      return seen_BV
    return seen_BV.at[jnp.arange(tok_B.shape[0]), tok_B].set(True)

  pad = 0 if eos_id is None else eos_id

  def run(params, layers, prompt_BP, lengths_B, key, suppress_V):
    global trace_count
    trace_count += 1
    model = nnx.merge(graphdef, params)
    b = prompt_BP.shape[0]
    cache = init_cache(model.config, b, cache_len)
    vocab = model.config.vocab_size
    if decoder_start_id is None:  # GPT: prefill the prompt in one call
      last_BV, cache = prefill(model, prompt_BP, cache, lengths_B, layers=layers)
      in_prompt_BP = jnp.arange(prompt_BP.shape[1])[None, :] < lengths_B[:, None]
      seen_BV = (
        jnp.zeros((b, 0), bool)
        if repetition_penalty == 1.0
        else jnp.any(jax.nn.one_hot(prompt_BP, vocab, dtype=bool) & in_prompt_BP[..., None], axis=1)
      )
    else:  # Seq2Seq: encode once, project cross-attention keys/values once, feed the start token
      src_mask_BP = jnp.arange(prompt_BP.shape[1])[None, :] < lengths_B[:, None]
      cache = with_encoder(model, cache, model.encode(prompt_BP, src_mask_BP), src_mask_BP)
      start_B1 = jnp.full((b, 1), decoder_start_id, jnp.int32)
      last_BV, cache = extend(model, start_B1, cache, layers=layers)
      last_BV = last_BV[:, 0]
      seen_BV = mark(
        jnp.zeros((b, vocab if repetition_penalty != 1.0 else 0), bool), start_B1[:, 0]
      )
    tok_B = pick(last_BV, seen_BV, jax.random.fold_in(key, 0), suppress_V)
    seen_BV = mark(seen_BV, tok_B)
    done_B = jnp.zeros((b,), bool) if eos_id is None else tok_B == eos_id
    out_BM = jnp.full((b, max_new_tokens), pad, jnp.int32).at[:, 0].set(tok_B)

    def cond(state):
      i, _, _, _, done_B, _ = state
      return (i < max_new_tokens) & ~jnp.all(done_B)

    def body(state):
      i, tok_B, out_BM, cache, done_B, seen_BV = state
      logits_B1V, cache = extend(model, tok_B[:, None], cache, layers=layers)
      new_B = pick(logits_B1V[:, 0], seen_BV, jax.random.fold_in(key, i), suppress_V)
      new_B = jnp.where(done_B, pad, new_B)
      out_BM = jax.lax.dynamic_update_slice_in_dim(out_BM, new_B[:, None], i, axis=1)
      if eos_id is not None:
        done_B = done_B | (new_B == eos_id)
      return i + 1, new_B, out_BM, cache, done_B, mark(seen_BV, new_B)

    state = (jnp.int32(1), tok_B, out_BM, cache, done_B, seen_BV)
    return jax.lax.while_loop(cond, body, state)[2]

  return jax.jit(run, compiler_options=backend.decode_compiler_options() or None)
