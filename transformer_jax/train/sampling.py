"""Simple decoding for the demos: full forward passes over a fixed-size buffer (one compilation),
no key/value cache. Fast cached generation lives in ``transformer_jax.generate`` (another issue)."""

from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np
from flax import nnx


def sample_gpt(graphdef, params, prompts: list[list[int]], *, max_new_tokens: int, max_len: int,
               temperature: float = 0.8, top_k: int = 40, seed: int = 0,
               stop_id: int | None = None, banned_ids=()) -> list[list[int]]:
  """Samples continuations of each prompt (temperature + top-k); returns the new tokens.

  ``banned_ids`` (e.g. ``[UNK]`` and the other special tokens) are never sampled.
  """
  n = len(prompts)
  width = min(max_len, max(len(p) for p in prompts) + max_new_tokens)
  buf = np.zeros((n, width), np.int32)
  lengths = np.array([len(p) for p in prompts])
  for i, p in enumerate(prompts):
    buf[i, :len(p)] = p

  banned = sorted(set(int(i) for i in banned_ids) - {stop_id})

  @jax.jit
  def next_token(params, buf, pos, key):
    logits = nnx.merge(graphdef, params)(buf)                      # [n, W, V]
    logits = jnp.take_along_axis(logits, (pos - 1)[:, None, None], axis=1)[:, 0]
    if banned:
      logits = logits.at[:, jnp.asarray(banned)].set(-jnp.inf)
    if temperature == 0.0:
      return jnp.argmax(logits, -1)
    kth = jax.lax.top_k(logits, top_k)[0][:, -1:]
    logits = jnp.where(logits < kth, -jnp.inf, logits) / temperature
    return jax.random.categorical(key, logits)

  key = jax.random.key(seed)
  out = [[] for _ in range(n)]
  done = np.zeros(n, bool)
  pos = lengths.copy()
  for t in range(max_new_tokens):
    if (pos >= width).all() or done.all():
      break
    tok = np.asarray(next_token(params, jnp.asarray(buf), jnp.asarray(np.minimum(pos, width - 1)),
                                jax.random.fold_in(key, t)))
    for i in range(n):
      if done[i] or pos[i] >= width:
        continue
      buf[i, pos[i]] = tok[i]
      out[i].append(int(tok[i]))
      pos[i] += 1
      if stop_id is not None and tok[i] == stop_id:
        done[i] = True
  return out


def greedy_seq2seq(graphdef, params, src: np.ndarray, src_mask: np.ndarray, *, bos_id: int,
                   eos_id: int, max_len: int) -> np.ndarray:
  """Greedy decoding ``[B, max_len]`` (tokens after BOS; EOS then padding)."""
  b = src.shape[0]

  @jax.jit
  def step(params, src, src_mask, tgt, t):
    model = nnx.merge(graphdef, params)
    logits = model(src, tgt, src_mask)                               # [B, T, V]
    return jnp.argmax(logits[:, t], -1)

  tgt = np.zeros((b, max_len + 1), np.int32)
  tgt[:, 0] = bos_id
  finished = np.zeros(b, bool)
  for t in range(max_len):
    nxt = np.asarray(step(params, src, src_mask, jnp.asarray(tgt[:, :max_len]), t))
    nxt = np.where(finished, eos_id, nxt)
    tgt[:, t + 1] = nxt
    finished |= nxt == eos_id
    if finished.all():
      break
  return tgt[:, 1:]
