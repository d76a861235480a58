"""Block-sparse attention patterns: which keys each query sees, described once, as layouts of
key blocks and as the dense mask they stand for (the kernel is ``ops.sparse``).

A ``SparsePattern`` says which keys each query sees, in blocks of ``block`` positions (query block
``a`` holds positions ``a*block .. a*block + block - 1``, and so does key block ``c``):

  ``local_blocks`` w   key blocks within w blocks of the query block (``a - w < c <= a`` under
                       ``causal``, ``|a - c| < w`` otherwise); 1 = the query's own block.
  ``global_blocks``    blocks whose queries see every key and whose keys every query sees
                       (negative indices count from the end: BigBird's first and last blocks).
  ``random_blocks`` r  r more key blocks per query block, drawn once from ``seed`` (BigBird).
  ``summary`` c        the last c positions of every block, seen by every query (the "fixed"
                       pattern of Child et al. 2019: its ``A(2)``).
  ``strided``          keys ``j`` with ``(i - j) % block == 0`` (Child et al.'s "strided" ``A(2)``).
  ``random_first``     the random blocks are all block 0, as transformers' BigBird has them in
                       eval mode: a row with random blocks counts key block 0 once more for each
                       (``SparsePattern.bias``: ``log`` of that count on its logits).
  ``dense_up_to``      a sequence of at most this many positions attends densely (BigBird falls
                       back to full attention below ``(5 + 2 * random_blocks) * block``).

The keys a query sees are the union of these, ANDed with ``causal``; ``SparsePattern.mask``
materialises them as a dense ``[T, T]`` array (the reference and the "xla" path of
``ops.sparse_attention``), ``SparsePattern.layout`` as the ``[nq, nk]`` key blocks the kernel
visits.
"""

from __future__ import annotations

import dataclasses

import jax
import jax.numpy as jnp
import numpy as np


@dataclasses.dataclass(frozen=True)
class SparsePattern:
  """Which keys each query sees, by blocks (see the module docstring); hashable, so it can be a
  static argument and a config field.

  Raises:
    ValueError: naming the field, for a block below 1, negative counts, ``summary > block``, or a
      pattern that holds nothing (no local, global, random, summary or strided part).
  """

  block: int = 128  # positions per block (and the stride of summary / strided)
  local_blocks: int = 1  # key blocks within this many blocks; 0: none
  summary: int = 0  # last positions of every block seen by all queries
  strided: bool = False  # keys an exact multiple of `block` positions away
  global_blocks: tuple[int, ...] = ()  # blocks that see and are seen by every position
  random_blocks: int = 0  # random key blocks per query block, drawn from `seed`
  seed: int = 0
  random_first: bool = False  # the random blocks are all block 0 (BigBird's eval mode)
  dense_up_to: int = 0  # sequences up to this length attend densely

  def __post_init__(self):
    for name in ("block", "local_blocks", "summary", "random_blocks", "seed", "dense_up_to"):
      value = getattr(self, name)
      if isinstance(value, bool) or not isinstance(value, int):
        raise ValueError(f"{name}={value!r} must be an integer")
    if self.block < 1:
      raise ValueError(f"block={self.block} must be >= 1")
    for name in ("local_blocks", "summary", "random_blocks", "seed", "dense_up_to"):
      if getattr(self, name) < 0:
        raise ValueError(f"{name}={getattr(self, name)} must be >= 0")
    if self.summary > self.block:
      raise ValueError(f"summary={self.summary} must be <= block={self.block}")
    if not isinstance(self.global_blocks, tuple) or not all(
      isinstance(g, int) and not isinstance(g, bool) for g in self.global_blocks
    ):
      raise ValueError(f"global_blocks={self.global_blocks!r} must be a tuple of integers")
    if not (
      self.local_blocks or self.summary or self.strided or self.global_blocks or self.random_blocks
    ):
      raise ValueError(
        f"{self} holds no keys: give local_blocks, summary, strided, global_blocks or random_blocks"
      )

  @classmethod
  def fixed(cls, block: int = 128, summary: int = 8) -> SparsePattern:
    """Child et al.'s "fixed" pattern: a query sees its own block and the last ``summary``
    positions of every block."""
    return cls(block=block, local_blocks=1, summary=summary)

  @classmethod
  def strided_pattern(cls, block: int = 128) -> SparsePattern:
    """Child et al.'s "strided" pattern: the previous ``block`` positions (here: the own and
    previous block) and every ``block``-th position before."""
    return cls(block=block, local_blocks=2, strided=True)

  @classmethod
  def bigbird(
    cls, block: int = 64, random_blocks: int = 3, seed: int = 0, *, eval_mode: bool = False
  ) -> SparsePattern:
    """BigBird's ITC layout: a sliding window of three blocks, the first and last blocks
    global, and ``random_blocks`` random blocks per query block. ``eval_mode``: exactly what
    transformers' ``BigBirdModel`` computes in eval mode (random blocks all block 0, full
    attention up to ``(5 + 2 * random_blocks) * block`` positions)."""
    return cls(
      block=block,
      local_blocks=2,
      global_blocks=(0, -1),
      random_blocks=random_blocks,
      seed=seed,
      random_first=eval_mode,
      dense_up_to=(5 + 2 * random_blocks) * block if eval_mode else 0,
    )

  def num_blocks(self, length: int) -> int:
    return -(-length // self.block)

  def layout(self, num_blocks: int, *, causal: bool) -> np.ndarray:
    """The whole key blocks each query block sees: ``[nq, nk]`` bool (nq = nk = ``num_blocks``).

    Global block indices at or past the number of blocks (or before it, negative) are ignored.
    Random blocks are drawn in query-block order from ``numpy.random.default_rng(seed)`` among
    the blocks not yet seen (and, under ``causal``, not after the query block); under
    ``random_first`` they are block 0."""
    return self._layout(num_blocks, causal, draw=True)

  def _layout(self, num_blocks: int, causal: bool, draw: bool) -> np.ndarray:
    n, w = num_blocks, self.local_blocks
    a, c = np.arange(n)[:, None], np.arange(n)[None, :]
    lay = (a - c < w) & (c <= a) if causal else (np.abs(a - c) < w)
    for gb in self.global_blocks:
      if -n <= gb < n:
        lay[gb % n, :] = True
        lay[:, gb % n] = True
    if causal:
      lay &= c <= a
    if not draw or not self.random_blocks:
      return lay
    if self.random_first:
      lay[self._random_rows(n), 0] = True
    else:
      rng = np.random.default_rng(self.seed)
      for row in range(n):
        free = np.flatnonzero(~lay[row] & ((np.arange(n) <= row) if causal else True))
        take = min(self.random_blocks, free.size)
        if take:
          lay[row, rng.choice(free, size=take, replace=False)] = True
    return lay

  def _random_rows(self, n: int) -> np.ndarray:
    """The query blocks that get random blocks under ``random_first``: those not global."""
    rows = np.ones(n, bool)
    for gb in self.global_blocks:
      if -n <= gb < n:
        rows[gb % n] = False
    return rows

  def first_block_count(self, num_blocks: int, *, causal: bool) -> np.ndarray:
    """How many times each query block counts key block 0: ``[nq]`` int (0 or 1; under
    ``random_first`` plus ``random_blocks`` in the rows that have random blocks)."""
    count = self._layout(num_blocks, causal, draw=False)[:, 0].astype(np.int32)
    if self.random_first and self.random_blocks:
      count = np.where(self._random_rows(num_blocks), count + self.random_blocks, count)
    return count

  def is_dense(self, length: int) -> bool:
    return length <= self.dense_up_to

  def bias(self, length: int, *, causal: bool) -> np.ndarray | None:
    """The additive logits bias ``[T, T]`` of ``random_first`` (``log`` of how many times a
    query counts key block 0), or None when every key counts once."""
    if not (self.random_first and self.random_blocks) or self.is_dense(length):
      return None
    count = self.first_block_count(self.num_blocks(length), causal=causal)
    pos = np.arange(length)
    first = (pos < self.block)[None, :]
    return np.where(first, np.log(np.maximum(count, 1))[pos // self.block][:, None], 0.0)

  def summary_positions(self, length: int) -> np.ndarray:
    """The summary positions below ``length``, ascending: ``[P]`` int."""
    pos = np.arange(length)
    return pos[pos % self.block >= self.block - self.summary] if self.summary else pos[:0]

  def mask(self, length: int, *, causal: bool) -> np.ndarray:
    """The pattern materialised: ``[T, T]`` bool, True = query ``i`` sees key ``j``."""
    b = self.block
    pos = np.arange(length)
    if self.is_dense(length):
      return pos[None, :] <= pos[:, None] if causal else np.ones((length, length), bool)
    blk = pos // b
    m = self.layout(self.num_blocks(length), causal=causal)[blk[:, None], blk[None, :]]
    if self.summary:
      m = m | (pos % b >= b - self.summary)[None, :]
    if self.strided:
      m = m | ((pos[:, None] - pos[None, :]) % b == 0)
    if causal:
      m = m & (pos[None, :] <= pos[:, None])
    return m

  def rows(self, q_pos: jax.Array, length: int, *, causal: bool) -> jax.Array:
    """The rows of ``mask(length, causal=causal)`` of the queries at positions ``q_pos``
    ``[B, T]`` (traced): ``[B, T, S]`` bool with ``S = length``. For decoding: a query at
    position p of a longer sequence gets the row it has in ``mask`` when the pattern's layout
    does not depend on the length (causal, no negative ``global_blocks``)."""
    b = self.block
    lay = jnp.asarray(self.layout(self.num_blocks(length), causal=causal))
    k_pos = jnp.arange(length, dtype=jnp.int32)
    q_pos = q_pos.astype(jnp.int32)[..., None]
    m = lay[jnp.clip(q_pos // b, 0, lay.shape[0] - 1), k_pos // b]
    if self.summary:
      m = m | (k_pos % b >= b - self.summary)
    if self.strided:
      m = m | ((q_pos - k_pos) % b == 0)
    return m & (k_pos <= q_pos) if causal else m

  def keys_per_query(self, length: int, *, causal: bool) -> float:
    """Mean number of keys a query sees (the kernel's work, relative to ``length`` for full)."""
    return float(self.mask(length, causal=causal).sum()) / length
