"""Reformer's attention (Kitaev et al. 2020): LSH attention and local chunked attention.

``lsh_attention``: queries and keys are one shared projection ``qk``. Each of ``n_hashes`` rounds
hashes every position into one of ``n_buckets`` buckets by a random rotation (angular LSH:
``argmax([x R, -x R])``), sorts the positions by (round, bucket, position) and cuts the sorted
sequence into chunks of ``chunk_length``; each chunk attends to itself and the ``chunks_before``
chunks before it (and ``chunks_after`` after; the chunk list wraps around, as in the reference
implementations). A query never attends to its own position unless nothing else is visible
(its logit is ``SELF_LOGIT`` against ``MASKED_LOGIT`` for the masked ones), keys are
length-normalised (``k = qk / rms(qk) / sqrt(H)``), and the rounds' outputs are combined by
their log-sum-exp: ``out = sum_r softmax_r(lse_r) out_r``. A sequence no longer than one chunk
gets ordinary attention under the same masks.

``local_attention``: the same chunking on the positions in order (no hashing), with separate
queries, keys and values.

Both follow the Hugging Face ``transformers`` Reformer numerically (masked logits ``-1e9``, the
self logit ``-1e5``), so its checkpoints load (``tj.hf.load``). Gradients are JAX's own through
the gathers and sorts (the bucket ids are integers; the rotations are not differentiated).

Letters beyond the legend: R the random rotation size (``n_buckets`` or the sum of its
factors), C chunks, L ``chunk_length``, A the keys each chunk attends (``(1 + before + after) L``).
"""

from __future__ import annotations

import math

import jax
import jax.numpy as jnp

MASKED_LOGIT = -1e9  # a masked key (padding, the future)
SELF_LOGIT = -1e5  # the query's own position: above every masked key, below any real logit
_INT32_MAX = 2**31 - 1


def rotation_size(n_buckets: int | tuple[int, ...]) -> int:
  """R: the columns of the random rotation per round (``sum`` of the bucket factors)."""
  return n_buckets if isinstance(n_buckets, int) else sum(n_buckets)


def total_buckets(n_buckets: int | tuple[int, ...]) -> int:
  """Buckets per round (the product of the factors)."""
  return n_buckets if isinstance(n_buckets, int) else math.prod(n_buckets)


def random_rotations(
  key: jax.Array, num_heads: int, head_dim: int, n_hashes: int, n_buckets: int | tuple[int, ...]
) -> jax.Array:
  """Gaussian rotations ``[N, H, n_hashes, R / 2]`` (float32) for ``lsh_attention``."""
  return jax.random.normal(
    key, (num_heads, head_dim, n_hashes, rotation_size(n_buckets) // 2), jnp.float32
  )


def hash_buckets(
  qk_BNTH: jax.Array, rotations: jax.Array, n_buckets: int | tuple[int, ...]
) -> jax.Array:
  """Bucket ids ``[B, N, n_hashes, T]`` in ``[0, total_buckets)`` of each position and round."""
  rot_BNhTr = jnp.einsum(
    "BNTH,NHhr->BNhTr",
    jax.lax.stop_gradient(qk_BNTH).astype(jnp.float32),
    rotations.astype(jnp.float32),
  )
  factors = (n_buckets,) if isinstance(n_buckets, int) else tuple(n_buckets)
  buckets, start, product = None, 0, 1
  for f in factors:  # one argmax per factor, combined as mixed-radix digits
    part = rot_BNhTr[..., start : start + f // 2]
    digit = jnp.argmax(jnp.concatenate([part, -part], axis=-1), axis=-1)
    buckets = digit if buckets is None else buckets + product * digit
    start, product = start + f // 2, product * f
  return buckets.astype(jnp.int32)


def check_sizes(t: int, n_hashes: int, n_buckets: int | tuple[int, ...]) -> None:
  """Raises ``ValueError`` where ``sort_order``'s int32 keys or indices would overflow: the
  ``n_hashes * T`` sorted entries, or ``n_hashes * (buckets + 1)`` round-bucket keys, past
  ``2**31 - 1``."""
  entries, keys = n_hashes * t, n_hashes * (total_buckets(n_buckets) + 1)
  if entries > _INT32_MAX:
    raise ValueError(
      f"n_hashes * T = {n_hashes} * {t} = {entries} entries exceed int32 indices (2**31 - 1)"
    )
  if keys > _INT32_MAX:
    raise ValueError(
      f"n_hashes * (buckets + 1) = {n_hashes} * {total_buckets(n_buckets) + 1} = {keys} "
      "exceeds int32 sort keys (2**31 - 1)"
    )


def sort_order(buckets_BNhT: jax.Array, n_buckets: int) -> jax.Array:
  """The permutation ``[B, N, n_hashes * T]`` sorting the entries ``round * T + position`` by
  (round, bucket, position), for bucket ids ``[B, N, n_hashes, T]`` in ``[0, n_buckets]``
  (``n_buckets`` itself: padding).

  Two int32 sort keys, (round, bucket) and the entry index, rather than one packed
  ``(round * (n_buckets + 1) + bucket) * T + position``, which overflows int32 once
  ``n_hashes * (n_buckets + 1) * T`` passes ``2**31`` (JAX has no int64 by default). Within one
  (round, bucket) the entry index orders by position. ``check_sizes`` bounds the rest.
  """
  b, n, n_hashes, t = buckets_BNhT.shape
  rounds = jnp.arange(n_hashes, dtype=jnp.int32)[:, None]
  bucket_key_BNM = (rounds * (n_buckets + 1) + buckets_BNhT.astype(jnp.int32)).reshape(
    b, n, n_hashes * t
  )
  entry_BNM = jax.lax.broadcasted_iota(jnp.int32, bucket_key_BNM.shape, 2)
  return jax.lax.sort((bucket_key_BNM, entry_BNM), dimension=2, num_keys=2)[1]


def _look_adjacent(x, before: int, after: int):
  """``[B, N, C, L, ...]`` -> ``[B, N, C, (1 + before + after) L, ...]``: each chunk followed by
  its neighbours, the chunk list wrapping around."""
  if before == 0 and after == 0:
    return x
  parts = [x if i == 0 else jnp.roll(x, -i, axis=2) for i in range(-before, after + 1)]
  return jnp.concatenate(parts, axis=3)


def _masked_softmax(dots, q_pos, k_pos, k_valid, causal: bool, self_masked: bool):
  """Probabilities and log-sum-exp of ``dots`` ``[..., Tq, Tk]`` under the padding, causal and
  self masks (positions ``q_pos`` ``[..., Tq]``, ``k_pos`` / ``k_valid`` ``[..., Tk]``)."""
  keep = None if k_valid is None else k_valid[..., None, :]
  if causal:
    later = q_pos[..., :, None] >= k_pos[..., None, :]
    keep = later if keep is None else keep & later
  if keep is not None:
    dots = jnp.where(keep, dots, MASKED_LOGIT)
  if self_masked:
    dots = jnp.where(q_pos[..., :, None] == k_pos[..., None, :], SELF_LOGIT, dots)
  lse = jax.nn.logsumexp(dots, axis=-1)
  return jnp.exp(dots - lse[..., None]), lse


def _check(name, x, b, t):
  if x is not None and x.shape != (b, t):
    raise ValueError(f"{name} must be [B, T] = {(b, t)}; got shape {x.shape}")


def _chunks(t: int, chunk_length: int, name: str = "chunk_length"):
  if chunk_length < 1:
    raise ValueError(f"{name}={chunk_length} must be >= 1")
  if t > chunk_length and t % chunk_length:
    raise ValueError(f"the length T={t} must be a multiple of {name}={chunk_length} (pad it)")


def lsh_attention(
  qk: jax.Array,
  v: jax.Array,
  *,
  n_buckets: int | tuple[int, ...],
  n_hashes: int = 1,
  chunk_length: int = 64,
  chunks_before: int = 1,
  chunks_after: int = 0,
  causal: bool = False,
  kv_valid: jax.Array | None = None,
  rotations: jax.Array | None = None,
  seed: int = 0,
) -> jax.Array:
  """LSH self-attention (see the module docstring).

  Args:
    qk: shared queries/keys ``[B, T, N, H]``.
    v: values ``[B, T, N, H]``.
    n_buckets: buckets per round, even; or a tuple of even factors (their product is the
      number of buckets, hashed factor by factor with ``R = sum`` rotation columns).
    n_hashes: hashing rounds.
    chunk_length: L, positions per chunk of the sorted sequence; T must be a multiple of it
      when longer.
    chunks_before, chunks_after: neighbouring chunks each chunk attends to.
    causal: a query sees keys at positions up to its own.
    kv_valid: ``[B, T]`` bool, False for padding (hashed into a bucket of its own, after the
      others, and masked).
    rotations: ``[N, H, n_hashes, R / 2]``; default ``random_rotations(PRNGKey(seed), ...)``.
    seed: the rotations' seed when ``rotations`` is None.

  Returns:
    ``[B, T, N, H]`` in qk's dtype.

  Raises:
    ValueError: for mismatched shapes, odd bucket counts, a length that is not a multiple of
      ``chunk_length``, rotations of the wrong shape, or sizes past int32 (``check_sizes``).
  """
  if qk.ndim != 4 or v.shape != qk.shape:
    raise ValueError(f"qk and v must be one [B, T, N, H] shape; got {qk.shape} and {v.shape}")
  b, t, n, h = qk.shape
  factors = (n_buckets,) if isinstance(n_buckets, int) else tuple(n_buckets)
  if not factors or any(f < 2 or f % 2 for f in factors):
    raise ValueError(f"n_buckets={n_buckets!r} must be even (or a tuple of even factors)")
  if n_hashes < 1:
    raise ValueError(f"n_hashes={n_hashes} must be >= 1")
  _chunks(t, chunk_length)
  _check("kv_valid", kv_valid, b, t)
  check_sizes(t, n_hashes, n_buckets)
  r = rotation_size(n_buckets)
  if rotations is None:
    rotations = random_rotations(jax.random.key(seed), n, h, n_hashes, n_buckets)
  if rotations.shape != (n, h, n_hashes, r // 2):
    raise ValueError(
      f"rotations must be [N, H, n_hashes, R/2] = {(n, h, n_hashes, r // 2)}; got {rotations.shape}"
    )
  qk_BNTH, v_BNTH = qk.transpose(0, 2, 1, 3), v.transpose(0, 2, 1, 3)
  f32 = jnp.float32
  k_BNTH = qk_BNTH.astype(f32)
  k_BNTH = k_BNTH * jax.lax.rsqrt(jnp.mean(k_BNTH**2, axis=-1, keepdims=True) + 1e-6) / h**0.5
  pos = jnp.arange(t, dtype=jnp.int32)
  if t <= chunk_length:  # one chunk: ordinary attention under the same masks
    dots = jnp.einsum("BNTH,BNSH->BNTS", qk_BNTH.astype(f32), k_BNTH)
    valid = None if kv_valid is None else kv_valid.astype(bool)[:, None, :]
    p, _ = _masked_softmax(dots, pos, pos, valid, causal, True)
    out = jnp.einsum("BNTS,BNSH->BNTH", p, v_BNTH.astype(f32))
    return out.transpose(0, 2, 1, 3).astype(qk.dtype)

  nb = total_buckets(n_buckets)
  buckets_BNhT = hash_buckets(qk_BNTH, rotations, n_buckets)
  if kv_valid is not None:
    buckets_BNhT = jnp.where(kv_valid.astype(bool)[:, None, None, :], buckets_BNhT, nb)
  order_BNM = sort_order(buckets_BNhT, nb)
  undo_BNM = jnp.argsort(order_BNM, axis=-1)
  pos_BNM = order_BNM % t

  def gather(x):
    return jnp.take_along_axis(x, pos_BNM[..., None], axis=2)

  c, chunk = n_hashes * t // chunk_length, chunk_length

  def split(x):
    return x.reshape(b, n, c, chunk, *x.shape[3:])

  q_BNCLH = split(gather(qk_BNTH.astype(f32)))
  k_BNCAH = _look_adjacent(split(gather(k_BNTH)), chunks_before, chunks_after)
  v_BNCAH = _look_adjacent(split(gather(v_BNTH.astype(f32))), chunks_before, chunks_after)
  q_pos_BNCL = split(pos_BNM)
  k_pos_BNCA = _look_adjacent(q_pos_BNCL, chunks_before, chunks_after)
  k_valid = None
  if kv_valid is not None:
    k_valid = jnp.take_along_axis(
      kv_valid.astype(bool)[:, None, :], k_pos_BNCA.reshape(b, n, -1), axis=2
    ).reshape(k_pos_BNCA.shape)
  dots = jnp.einsum("BNCLH,BNCAH->BNCLA", q_BNCLH, k_BNCAH)
  p, lse_BNCL = _masked_softmax(dots, q_pos_BNCL, k_pos_BNCA, k_valid, causal, True)
  out_BNCLH = jnp.einsum("BNCLA,BNCAH->BNCLH", p, v_BNCAH)

  # Back to (round, position) order, then the rounds weighted by their log-sum-exp.
  def unsort(x):
    return jnp.take_along_axis(x, undo_BNM.reshape(b, n, -1, *([1] * (x.ndim - 3))), axis=2)

  out_BNhTH = unsort(out_BNCLH.reshape(b, n, -1, h)).reshape(b, n, n_hashes, t, h)
  lse_BNhT = unsort(lse_BNCL.reshape(b, n, -1)).reshape(b, n, n_hashes, t)
  # exp(lse - logsumexp(lse)) rather than a max-shifted softmax: the same rounding as the
  # reference implementation where a query sees only itself (lse = -1e5 in float32).
  w_BNhT = jnp.exp(lse_BNhT - jax.nn.logsumexp(lse_BNhT, axis=2, keepdims=True))
  out_BNTH = jnp.sum(out_BNhTH * w_BNhT[..., None], axis=2)
  return out_BNTH.transpose(0, 2, 1, 3).astype(qk.dtype)


def local_attention(
  q: jax.Array,
  k: jax.Array,
  v: jax.Array,
  *,
  chunk_length: int = 64,
  chunks_before: int = 1,
  chunks_after: int = 0,
  causal: bool = False,
  kv_valid: jax.Array | None = None,
) -> jax.Array:
  """Reformer's local attention: chunks of ``chunk_length`` positions, each attending to itself
  and its neighbouring chunks (the chunk list wraps around), logits ``q k / sqrt(H)``.

  Args:
    q, k, v: ``[B, T, N, H]`` (T a multiple of ``chunk_length`` when longer than it).
    chunk_length, chunks_before, chunks_after: as in ``lsh_attention``.
    causal: a query sees keys at positions up to its own.
    kv_valid: ``[B, T]`` bool, False for padding keys.

  Returns:
    ``[B, T, N, H]`` in q's dtype.

  Raises:
    ValueError: for mismatched shapes or a length that is not a multiple of ``chunk_length``.
  """
  if q.ndim != 4 or k.shape != q.shape or v.shape != q.shape:
    raise ValueError(
      f"q, k and v must be one [B, T, N, H] shape; got {q.shape}, {k.shape}, {v.shape}"
    )
  b, t, n, h = q.shape
  _chunks(t, chunk_length)
  _check("kv_valid", kv_valid, b, t)
  f32 = jnp.float32
  q_BNTH, k_BNTH, v_BNTH = (x.transpose(0, 2, 1, 3).astype(f32) for x in (q, k, v))
  k_BNTH = k_BNTH / h**0.5
  pos = jnp.arange(t, dtype=jnp.int32)
  valid = None if kv_valid is None else jnp.broadcast_to(kv_valid.astype(bool)[:, None], (b, n, t))
  if t <= chunk_length:
    dots = jnp.einsum("BNTH,BNSH->BNTS", q_BNTH, k_BNTH)
    p, _ = _masked_softmax(dots, pos, pos, valid, causal, False)
    return jnp.einsum("BNTS,BNSH->BNTH", p, v_BNTH).transpose(0, 2, 1, 3).astype(q.dtype)
  c = t // chunk_length

  def split(x):
    return x.reshape(*x.shape[:2], c, chunk_length, *x.shape[3:])

  def adjacent(x):
    return _look_adjacent(split(x), chunks_before, chunks_after)

  pos_BNT = jnp.broadcast_to(pos, (b, n, t))
  dots = jnp.einsum("BNCLH,BNCAH->BNCLA", split(q_BNTH), adjacent(k_BNTH))
  p, _ = _masked_softmax(
    dots,
    split(pos_BNT),
    adjacent(pos_BNT),
    None if valid is None else adjacent(valid),
    causal,
    False,
  )
  out = jnp.einsum("BNCLA,BNCAH->BNCLH", p, adjacent(v_BNTH)).reshape(b, n, t, h)
  return out.transpose(0, 2, 1, 3).astype(q.dtype)
