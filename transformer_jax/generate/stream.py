"""``stream_generate``: a GPT's (or Mamba's) continuation handed out a chunk at a time, with the
same tokens as ``generate``.

The first token comes from the prefill; then each jitted call runs a chunk of up to ``chunk_size``
one-token steps, with the key/value cache carried from call to call (compiled once per chunk size,
not per token). ``tjax generate`` prints its chunks as they arrive.
"""

from __future__ import annotations

import functools
from typing import Iterator, Sequence

import jax
import jax.numpy as jnp
import numpy as np
from flax import nnx

from transformer_jax.generate.cache import KVCache, extend, init_cache
from transformer_jax.generate.cache import prefill as prefill_cache
from transformer_jax.generate.decode import (
  check_options,
  decode_layers,
  prompt_bucket,
  right_padded,
  split_model,
  suppress_mask,
)
from transformer_jax.generate.sampling import next_token
from transformer_jax.models.common import check_tokens
from transformer_jax.models.config import GPTConfig, MambaConfig

# Number of times the streaming step loop has been traced (each trace is one compilation).
trace_count = 0


def stream_generate(
  model,
  prompt_ids,
  *,
  max_new_tokens: int,
  chunk_size: int = 16,
  temperature: float = 0.0,
  top_k: int | None = None,
  top_p: float | None = None,
  eos_id: int | None = None,
  key: jax.Array | None = None,
  suppress_ids: Sequence[int] = (),
) -> Iterator[np.ndarray]:
  """Continues GPT prompts like ``generate``, yielding the new tokens as they are produced.

  With the same arguments the concatenated chunks equal ``generate``'s output up to the point
  where every row has produced ``eos_id``: the sampling keys are the same.

  Args:
    model: a ``GPT`` module or a ``(config, params)`` pair.
    prompt_ids: ``[B, P]`` ids (all P real) or a list of B id lists.
    max_new_tokens: tokens to generate per row; prompt + new tokens must fit in ``max_len``.
    chunk_size: one-token steps per jitted call after the first token.
    temperature, top_k, top_p, eos_id, key: as for ``generate``.
    suppress_ids: ids never produced (their logits are set to -inf before choosing).

  Yields:
    int32 ``[B, n]`` arrays of new tokens: first ``n = 1`` (from the prefill), then chunks of up
    to ``chunk_size``. After a row's ``eos_id`` its entries are ``eos_id``; the stream ends early
    once every row has produced it.

  Raises:
    ValueError: as ``generate`` (empty or too long prompts, bad options), or ``chunk_size < 1``.
    TypeError: a model that is not a GPT.
  """
  config, graphdef, params = split_model(model)
  if not isinstance(config, (GPTConfig, MambaConfig)):
    raise TypeError(f"stream_generate needs a GPT or Mamba model; got a {type(config).__name__}")
  check_options(config, max_new_tokens, temperature, top_k, top_p, eos_id, 1.0)
  if not isinstance(chunk_size, (int, np.integer)) or chunk_size < 1:
    raise ValueError(f"chunk_size={chunk_size!r} must be a positive integer")
  tokens, lengths = right_padded(prompt_ids, None, "right")
  longest = int(lengths.max())
  if longest + max_new_tokens > config.max_len:
    raise ValueError(
      f"prompt length {longest} + max_new_tokens={max_new_tokens} exceeds the "
      f"model's context max_len={config.max_len}"
    )
  check_tokens("prompt_ids", tokens, config.vocab_size)
  bucket = prompt_bucket(longest, config.max_len)
  padded = np.zeros((tokens.shape[0], bucket), np.int32)
  padded[:, : tokens.shape[1]] = tokens
  suppress_V = suppress_mask(suppress_ids, config.vocab_size)
  prefill, steps = _stream_fns(
    graphdef,
    min(bucket + max_new_tokens, config.max_len),
    int(chunk_size),
    float(temperature),
    None if top_k is None else int(top_k),
    None if top_p is None else float(top_p),
  )
  key = jax.random.key(0) if key is None else key
  # Traced, so that they share one compilation: the ids to suppress and EOS (-1: none).
  opts = (jnp.asarray(suppress_V), jnp.int32(-1 if eos_id is None else eos_id))
  layers = decode_layers(graphdef, params)
  tok_B, done_B, cache = prefill(
    params, layers, jnp.asarray(padded), jnp.asarray(lengths, jnp.int32), key, opts
  )
  yield np.asarray(tok_B)[:, None]
  produced = 1
  while produced < max_new_tokens and not bool(np.all(done_B)):
    count = min(chunk_size, max_new_tokens - produced)
    out_BC, tok_B, done_B, cache = steps(
      params, layers, tok_B, done_B, cache, jnp.int32(produced), jnp.int32(count), key, opts
    )
    yield np.asarray(out_BC)[:, :count]
    produced += count


@functools.lru_cache(maxsize=16)
def _stream_fns(graphdef, cache_len, chunk_size, temperature, top_k, top_p):
  """Jitted ``prefill`` (prompt -> first token + cache) and ``steps`` (up to a chunk of tokens).

  Both take ``opts = (suppress_V, eos_id)``: a ``[V]`` bool mask of ids never produced and the
  int32 EOS id (-1 for none).
  """
  choose = functools.partial(next_token, temperature=temperature, top_k=top_k, top_p=top_p)

  def pick(logits_BV, suppress_V, key):
    return choose(jnp.where(suppress_V[None], -jnp.inf, logits_BV), key)

  def prefill(params, layers, prompt_BP, lengths_B, key, opts):
    suppress_V, eos_id = opts
    model = nnx.merge(graphdef, params)
    cache = init_cache(model.config, prompt_BP.shape[0], cache_len)
    last_BV, cache = prefill_cache(model, prompt_BP, cache, lengths_B, layers=layers)
    tok_B = pick(last_BV, suppress_V, jax.random.fold_in(key, 0))
    return tok_B, tok_B == eos_id, cache

  def steps(params, layers, tok_B, done_B, cache: KVCache, start, count, key, opts):
    """Tokens ``start .. start + count - 1`` (count <= chunk_size), fed ``tok_B`` = token
    start-1."""
    global trace_count
    trace_count += 1
    suppress_V, eos_id = opts
    pad = jnp.maximum(eos_id, 0)
    model = nnx.merge(graphdef, params)
    out_BC = jnp.full((tok_B.shape[0], chunk_size), pad, jnp.int32)

    def cond(state):
      j, _, _, _, done_B = state
      return (j < count) & ~jnp.all(done_B)

    def body(state):
      j, tok_B, out_BC, cache, done_B = state
      logits_B1V, cache = extend(model, tok_B[:, None], cache, layers=layers)
      new_B = pick(logits_B1V[:, 0], suppress_V, jax.random.fold_in(key, start + j))
      new_B = jnp.where(done_B, pad, new_B)
      out_BC = jax.lax.dynamic_update_slice_in_dim(out_BC, new_B[:, None], j, axis=1)
      return j + 1, new_B, out_BC, cache, done_B | (new_B == eos_id)

    _, tok_B, out_BC, cache, done_B = jax.lax.while_loop(
      cond, body, (jnp.int32(0), tok_B, out_BC, cache, done_B)
    )
    return out_BC, tok_B, done_B, cache

  return jax.jit(prefill), jax.jit(steps, donate_argnums=(4,))
