"""The key/value cache of decoding: one small pytree per layer stack, passed in and out of the
layers."""

from __future__ import annotations

import flax.struct
import jax
import jax.numpy as jnp


@flax.struct.dataclass
class KVCache:
  """Keys and values of a stack of attention layers for decoding, one heads-major array per layer.

  Each layer's keys (and values) are one ``[B * K, S, H]`` array: ``S`` slots per row, the token at
  position ``p`` in slot ``p``. On CPU a one-token step reads this layout several times faster than
  one ``[L, B, S, K, H]`` array: slicing a layer out of the stacked array copies it, and a
  ``[B, S, K, H]`` layer is transposed to heads-major for the batched products of attention (copied
  again), at every layer of every step. Batch and heads are merged so that the products read the
  array as stored, with no size-1 axis to drop when B = 1.

  A self-attention cache has ``lengths``: row ``b`` holds ``lengths[b]`` tokens, its new tokens are
  written at slots ``lengths[b] ..`` and attend causally by position (slots past a row's position
  may hold stale entries; they are masked). A rolling cache (``window`` W, for sliding-window
  attention) has W slots used as a ring: position ``p`` lives in slot ``p mod W``, so its size and
  a step's time stay flat however long the generation runs (``ordered`` and ``write_rolling``). A
  read-only cache (``lengths`` None) holds keys/values projected once, e.g. an encoder's output for
  cross-attention, with ``kv_valid`` marking padding; a decoder's cache carries it in ``cross``.
  ``layer(i)`` is the one-layer view an attention layer reads and returns.
  """

  k: tuple[jax.Array, ...]  # L arrays [B * K, S, H] (keys already rotated by RoPE)
  v: tuple[jax.Array, ...]  # L arrays [B * K, S, H]
  lengths: jax.Array | None  # [B] int32 tokens cached per row; None: read-only
  kv_heads: int = flax.struct.field(pytree_node=False)  # K
  kv_valid: jax.Array | None = None  # [B, S] bool, False = padding key (read-only caches)
  cross: KVCache | None = None  # a decoder's cross-attention keys/values (read-only)
  window: int | None = flax.struct.field(pytree_node=False, default=None)  # rolling: W = S slots
  # [B] how many of the tokens being written are real (right padding after them), while a call
  # writes them: a rolling cache drops the padding instead of letting it overwrite real entries.
  new_valid: jax.Array | None = None
  # Per layer (a stack of local and global layers): each layer's rolling window, None for a layer
  # of max_len slots; ``layer(i)`` gives layer i its own ``window``.
  windows: tuple[int | None, ...] | None = flax.struct.field(pytree_node=False, default=None)

  @classmethod
  def zeros(
    cls,
    num_layers: int,
    batch_size: int,
    max_len: int,
    kv_heads: int,
    head_dim: int,
    dtype: jnp.dtype,
    window: int | None = None,
    windows: tuple[int | None, ...] | None = None,
  ) -> KVCache:
    """An empty self-attention cache for ``max_len`` tokens per row: ``max_len`` slots, or with
    a sliding ``window`` shorter than that, a rolling cache of ``window`` slots. ``windows``
    (instead of ``window``): one per layer, for a stack of local and global layers."""
    if windows is not None:
      if window is not None or len(windows) != num_layers:
        raise ValueError(
          f"windows needs one entry per layer ({len(windows)} for num_layers={num_layers}) "
          "and no window"
        )
      rolls = tuple(w if w is not None and w < max_len else None for w in windows)
      slots = [max_len if w is None else w for w in rolls]
      k, v = (
        tuple(jnp.zeros((batch_size * kv_heads, n, head_dim), dtype) for n in slots)
        for _ in range(2)
      )
      lengths = jnp.zeros((batch_size,), jnp.int32)
      return cls(k, v, lengths, kv_heads, windows=rolls if any(rolls) else None)
    rolling = window is not None and window < max_len
    slots = window if rolling else max_len

    def empty():
      return tuple(
        jnp.zeros((batch_size * kv_heads, slots, head_dim), dtype) for _ in range(num_layers)
      )

    return cls(
      empty(),
      empty(),
      jnp.zeros((batch_size,), jnp.int32),
      kv_heads,
      window=window if rolling else None,
    )

  @classmethod
  def read_only(
    cls, k_LBSKH: jax.Array, v_LBSKH: jax.Array, kv_valid_BS: jax.Array | None = None
  ) -> KVCache:
    """A read-only cache of stacked keys/values ``[L, B, S, K, H]`` (cross-attention)."""
    l, b, s, k, h = k_LBSKH.shape

    def heads_major(x):
      return tuple(jnp.transpose(x[i], (0, 2, 1, 3)).reshape(b * k, s, h) for i in range(l))

    valid = None if kv_valid_BS is None else jnp.asarray(kv_valid_BS, bool)
    return cls(heads_major(k_LBSKH), heads_major(v_LBSKH), None, k, kv_valid=valid)

  @property
  def shape(self) -> tuple[int, int, int, int, int]:
    """The logical ``(L, B, S, K, H)``."""
    bk, s, h = self.k[0].shape
    return (len(self.k), bk // self.kv_heads, s, self.kv_heads, h)

  @property
  def max_len(self) -> int:
    """S, the number of slots per row."""
    return self.k[0].shape[1]

  def layer(self, i: int) -> KVCache:
    """Layer ``i`` alone (with its cross-attention layer)."""
    cross = None if self.cross is None else self.cross.layer(i)
    if self.windows is not None:
      return self.replace(
        k=(self.k[i],), v=(self.v[i],), cross=cross, window=self.windows[i], windows=None
      )
    return self.replace(k=(self.k[i],), v=(self.v[i],), cross=cross)

  def read(self) -> tuple[jax.Array, jax.Array]:
    """A one-layer cache's keys and values ``[B, S, K, H]`` (a transpose XLA folds into the
    attention products, which want heads-major operands)."""
    _, b, s, k, h = self.shape
    return tuple(jnp.transpose(x[0].reshape(b, k, s, h), (0, 2, 1, 3)) for x in (self.k, self.v))

  def write(self, k_BTKH: jax.Array, v_BTKH: jax.Array) -> KVCache:
    """A one-layer cache with row b's T new entries in slots ``lengths[b] .. + T - 1``.

    Updated in place under ``jit``: a scatter (rows may sit at different slots) or, for one row, a
    ``dynamic_update_slice`` (XLA rewrites a one-row scatter into a bounds-checked update that it
    then duplicates into each consumer, copying the layer's cache several times per step).
    """
    b, t = k_BTKH.shape[:2]
    index_B = self.lengths.astype(jnp.int32)

    def put(x, new_BTKH):
      new_BTKH = new_BTKH.astype(x.dtype)
      if b == 1:  # x is [K, S, H]
        zero = jnp.zeros((), jnp.int32)
        return jax.lax.dynamic_update_slice(
          x, jnp.swapaxes(new_BTKH[0], 0, 1), (zero, index_B[0], zero)
        )
      # [B, K, S, H] indexed by (rows, :, slots): the [B, T] index dimensions come first.
      rows_B1 = jnp.arange(b)[:, None]
      slots_BT = index_B[:, None] + jnp.arange(t, dtype=jnp.int32)[None, :]
      x = x.reshape(b, -1, *x.shape[1:]).at[rows_B1, :, slots_BT].set(new_BTKH, mode="clip")
      return x.reshape(-1, *x.shape[2:])

    return self.replace(k=(put(self.k[0], k_BTKH),), v=(put(self.v[0], v_BTKH),))

  def ordered(self) -> tuple[jax.Array, jax.Array, jax.Array]:
    """A one-layer rolling cache's keys and values ``[B, W, K, H]`` in position order, before new
    tokens are written: index ``j`` holds position ``lengths[b] - W + j``, and ``valid [B, W]``
    is False where that position is negative (a row with fewer than W tokens)."""
    _, b, w, k, h = self.shape
    first_B1 = self.lengths.astype(jnp.int32)[:, None] - w
    positions_BW = first_B1 + jnp.arange(w, dtype=jnp.int32)[None, :]
    slots_BW = jnp.mod(positions_BW, w)

    def gather(x):  # [B * K, W, H] -> [B, W, K, H], slots in position order
      x_BKWH = x[0].reshape(b, k, w, h)
      x_BKWH = jnp.take_along_axis(x_BKWH, slots_BW[:, None, :, None], axis=2)
      return jnp.transpose(x_BKWH, (0, 2, 1, 3))

    return gather(self.k), gather(self.v), positions_BW >= 0

  def write_rolling(self, k_BTKH: jax.Array, v_BTKH: jax.Array) -> KVCache:
    """A one-layer rolling cache with row b's T new entries at slots ``position mod W``: its real
    ones (``new_valid``, default all T), of more than W only the last W (the older ones are
    outside every later window)."""
    w = self.max_len
    b, t = k_BTKH.shape[:2]
    t_BT = jnp.broadcast_to(jnp.arange(t, dtype=jnp.int32)[None, :], (b, t))
    n_B1 = (
      jnp.full((b, 1), t, jnp.int32)
      if self.new_valid is None
      else jnp.asarray(self.new_valid, jnp.int32)[:, None]
    )
    # Row b keeps its real tokens t < n_b, the last W of them; the rest go to slot W (dropped).
    kept_BT = (t_BT < n_B1) & (t_BT >= n_B1 - w)
    slots_BT = jnp.where(kept_BT, jnp.mod(self.lengths.astype(jnp.int32)[:, None] + t_BT, w), w)
    rows_B1 = jnp.arange(b)[:, None]

    def put(x, new_BTKH):  # [B * K, W, H] indexed by (rows, :, slots); kept slots are distinct
      x = (
        x.reshape(b, -1, *x.shape[1:])
        .at[rows_B1, :, slots_BT]
        .set(new_BTKH.astype(x.dtype), mode="drop")
      )
      return x.reshape(-1, *x.shape[2:])

    return self.replace(k=(put(self.k[0], k_BTKH),), v=(put(self.v[0], v_BTKH),))

  def positions(self, t: int) -> jax.Array:
    """``[B, T]`` positions of T new tokens per row."""
    return self.lengths[:, None].astype(jnp.int32) + jnp.arange(t, dtype=jnp.int32)[None, :]

  def joined(self, layers: list[KVCache], t: int) -> KVCache:
    """The stack's cache from its layers' one-layer caches, ``t`` tokens later."""
    return self.replace(
      k=tuple(c.k[0] for c in layers), v=tuple(c.v[0] for c in layers), lengths=self.lengths + t
    )

  def take_rows(self, rows_R: jax.Array) -> KVCache:
    """The cache of batch rows ``rows`` (repeated or reordered beams), ``cross`` included."""
    k = self.kv_heads

    def take(x):  # [B * K, S, H] -> [R * K, S, H]
      x = jnp.take(x.reshape(-1, k, *x.shape[1:]), rows_R, axis=0)
      return x.reshape(-1, *x.shape[2:])

    def pick(x):
      return None if x is None else jnp.take(x, rows_R, axis=0)

    return self.replace(
      k=tuple(map(take, self.k)),
      v=tuple(map(take, self.v)),
      lengths=pick(self.lengths),
      kv_valid=pick(self.kv_valid),
      cross=None if self.cross is None else self.cross.take_rows(rows_R),
    )


@flax.struct.dataclass
class LinearCache:
  """The decoding state of a stack of linear-attention layers (``ops.linear_attention``): per
  layer the running sums ``s [B, N, H, E]`` and ``z [B, N, H]``, the same size for any length.
  The same interface as ``KVCache`` where decoding uses it (``layer``, ``positions``,
  ``joined``, ``take_rows``)."""

  s: tuple[jax.Array, ...]  # L arrays [B, N, H, E], float32
  z: tuple[jax.Array, ...]  # L arrays [B, N, H], float32
  lengths: jax.Array  # [B] int32 tokens seen per row
  new_valid: jax.Array | None = None  # as KVCache.new_valid
  cross = None  # no encoder side

  @classmethod
  def zeros(cls, num_layers: int, batch_size: int, num_heads: int, head_dim: int) -> LinearCache:
    """An empty state for ``num_layers`` layers of ``num_heads`` heads of ``head_dim``."""
    return cls(
      tuple(
        jnp.zeros((batch_size, num_heads, head_dim, head_dim), jnp.float32)
        for _ in range(num_layers)
      ),
      tuple(jnp.zeros((batch_size, num_heads, head_dim), jnp.float32) for _ in range(num_layers)),
      jnp.zeros((batch_size,), jnp.int32),
    )

  def layer(self, i: int) -> LinearCache:
    """Layer ``i`` alone."""
    return self.replace(s=(self.s[i],), z=(self.z[i],))

  def joined(self, layers: list[LinearCache], t: int) -> LinearCache:
    """The stack's state from its layers' one-layer states, ``t`` tokens later."""
    return self.replace(
      s=tuple(c.s[0] for c in layers), z=tuple(c.z[0] for c in layers), lengths=self.lengths + t
    )

  def positions(self, t: int) -> jax.Array:
    """``[B, T]`` positions of T new tokens per row."""
    return self.lengths[:, None].astype(jnp.int32) + jnp.arange(t, dtype=jnp.int32)[None, :]

  def take_rows(self, rows_R: jax.Array) -> LinearCache:
    """The state of batch rows ``rows`` (repeated or reordered beams)."""

    def pick(x):
      return jnp.take(x, rows_R, axis=0)

    return self.replace(
      s=tuple(map(pick, self.s)),
      z=tuple(map(pick, self.z)),
      lengths=pick(self.lengths),
      new_valid=None if self.new_valid is None else pick(self.new_valid),
    )
