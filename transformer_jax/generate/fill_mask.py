"""``fill_mask``: a BERT's most likely tokens, with probabilities, at every ``[MASK]`` position.

One jitted call encodes the batch and runs the masked-LM head only at the mask positions (their
number is padded to a power of two, so a new count rarely compiles again). ``encode_masked`` turns
a text with ``[MASK]`` markers into the ``[CLS] ... [SEP]`` ids it takes.
"""

from __future__ import annotations

import functools
from typing import NamedTuple

import jax
import jax.numpy as jnp
import numpy as np
from flax import nnx

from transformer_jax.generate.decode import split_model
from transformer_jax.models.common import check_tokens
from transformer_jax.models.config import BERTConfig


MASK_TEXT = "[MASK]"  # what stands for a mask in a text (``encode_masked``)


class FillMaskOutput(NamedTuple):
  """Candidates for each mask, masks in row-major order (row, then column)."""

  positions: np.ndarray  # [M, 2] int: (row, column) of each mask in ``tokens``
  token_ids: np.ndarray  # [M, top_k] int32: most likely first
  probs: np.ndarray  # [M, top_k] float32: softmax over the whole vocabulary


def fill_mask(
  model, tokens, *, top_k: int = 5, mask_id: int, attention_mask=None, token_types=None
) -> FillMaskOutput:
  """The ``top_k`` most likely tokens at every ``mask_id`` position of ``tokens``.

  Args:
    model: a ``BERT`` module or a ``(config, params)`` pair.
    tokens: ``[B, T]`` ids (or one row ``[T]``), e.g. ``[CLS] ... [MASK] ... [SEP]``.
    top_k: candidates per mask (at most the vocabulary size).
    mask_id: the id of ``[MASK]``.
    attention_mask: ``[B, T]`` bool/0-1, False for padding (masks under padding are ignored).
    token_types: ``[B, T]`` segment ids (default 0).

  Returns:
    ``FillMaskOutput``: each mask's ``(row, column)``, its candidate ids and their probabilities.

  Raises:
    ValueError: no ``mask_id`` in ``tokens``, ids outside the vocabulary, bad ``top_k`` or shapes.
    TypeError: a model that is not a BERT.
  """
  config, graphdef, params = split_model(
    model, BERTConfig, what="a BERT", needs="fill_mask needs a BERT (masked language) model"
  )
  tokens = np.asarray(tokens)
  if tokens.ndim == 1:
    tokens = tokens[None]
  if tokens.ndim != 2 or tokens.shape[1] == 0:
    raise ValueError(f"tokens must be [batch, length] ids; got shape {tokens.shape}")
  check_tokens("tokens", tokens, config.vocab_size)
  if tokens.shape[1] > config.max_len:
    raise ValueError(
      f"tokens have length {tokens.shape[1]}, more than the model's context "
      f"max_len={config.max_len}"
    )
  if not 0 <= mask_id < config.vocab_size:
    raise ValueError(f"mask_id={mask_id!r} is outside the vocabulary [0, {config.vocab_size})")
  if not isinstance(top_k, (int, np.integer)) or not 1 <= top_k <= config.vocab_size:
    raise ValueError(f"top_k={top_k!r} must be an integer in [1, {config.vocab_size}]")
  valid = (
    np.ones(tokens.shape, bool)
    if attention_mask is None
    else np.asarray(attention_mask).astype(bool).reshape(tokens.shape)
  )
  types = (
    np.zeros(tokens.shape, np.int32)
    if token_types is None
    else np.asarray(token_types).reshape(tokens.shape)
  )
  positions = np.argwhere((tokens == mask_id) & valid)
  if positions.shape[0] == 0:
    raise ValueError(f"no mask token (id {mask_id}) in tokens: nothing to fill")
  count = positions.shape[0]
  bucket = 1 << (count - 1).bit_length()  # next power of two >= count
  flat = np.zeros((bucket,), np.int32)
  flat[:count] = positions[:, 0] * tokens.shape[1] + positions[:, 1]
  ids_MK, probs_MK = _compiled(graphdef, int(top_k))(
    params,
    jnp.asarray(tokens, jnp.int32),
    jnp.asarray(types, jnp.int32),
    jnp.asarray(valid),
    jnp.asarray(flat),
  )
  return FillMaskOutput(positions, np.asarray(ids_MK)[:count], np.asarray(probs_MK)[:count])


@functools.lru_cache(maxsize=16)
def _compiled(graphdef, top_k):
  def run(params, tokens_BT, types_BT, valid_BT, flat_M):
    model = nnx.merge(graphdef, params)
    x_BTD, _ = model.encode(tokens_BT, types_BT, valid_BT)
    x_MD = x_BTD.reshape(-1, x_BTD.shape[-1])[flat_M]
    probs_MV = jax.nn.softmax(model.mlm_logits(x_MD[None])[0], axis=-1)
    probs_MK, ids_MK = jax.lax.top_k(probs_MV, top_k)
    return ids_MK.astype(jnp.int32), probs_MK

  return jax.jit(run)


def encode_masked(tokenizer, text: str) -> list[int]:
  """``[CLS] text [SEP]`` ids with each ``[MASK]`` in ``text`` as the mask id.

  Pieces between masks are encoded as plain text. A space just before a mask is left to the mask:
  BPE tokens carry their leading space (`` self``), so that is the token the mask stands for.

  Raises:
    ValueError: ``text`` holds no ``[MASK]``.
  """
  pieces = text.split(MASK_TEXT)
  if len(pieces) == 1:
    raise ValueError(f"the text has no {MASK_TEXT} to fill: {text!r}")
  ids = [tokenizer.cls_id]
  for i, piece in enumerate(pieces):
    if i < len(pieces) - 1 and piece.endswith(" "):
      piece = piece[:-1]
    ids += tokenizer.encode(piece)
    if i < len(pieces) - 1:
      ids.append(tokenizer.mask_id)
  return ids + [tokenizer.sep_id]
