"""The Reformer (Kitaev et al. 2020) as a causal language model, like transformers'
``ReformerModelWithLMHead``.

Tokens plus axial positions feed two streams of width D; each layer is reversible
(``layers.reversible``): ``y1 = x1 + attention(norm x2)``, ``y2 = x2 + feed_forward(norm y1)``,
with LSH attention (``ops.lsh_attention``, one shared query/key projection) or local chunked
attention (``ops.local_attention``) as ``attn_layers`` says. The streams are concatenated
(``[B, T, 2D]``), normalised and projected to the vocabulary. Training memory does not grow
with depth: the backward pass recomputes each layer's activations from the next layer's
inputs. The feed-forward can run ``ff_chunk`` positions at a time.

The random rotations of the LSH layers are a parameter (``lsh_rotations``, drawn from
``hash_seed``, shared by every LSH layer as in transformers with a ``hash_seed``) that no
gradient reaches: the hash is the argmax of a rotation, so optimiser weight decay (a uniform
scale) leaves it unchanged. ``tj.hf.load`` puts transformers' own rotations there.
"""

from __future__ import annotations

import functools
import math

import jax
import jax.numpy as jnp
from flax import nnx
from jax.sharding import Mesh

from transformer_jax import backends, ops
from transformer_jax.layers import MLP, Embed, Norm, Projection
from transformer_jax.layers.common import normal, param
from transformer_jax.layers.reversible import reversible_layers
from transformer_jax.models.common import check_length, check_same_shape, check_tokens
from transformer_jax.models.common import with_matmul_precision
from transformer_jax.models.config import ReformerConfig
from transformer_jax.ops import lsh
from transformer_jax.parallel import axes as ax


def layer_period(kinds: tuple[str, ...]) -> int:
  """The fewest layers P whose kinds repeat to make ``kinds`` (the scan runs P layers a step)."""
  n = len(kinds)
  return next(p for p in range(1, n + 1) if n % p == 0 and kinds == kinds[:p] * (n // p))


class AxialPositions(nnx.Module):
  """Axial position embeddings: position ``p`` of an ``(h, w)`` grid gets
  ``[A0[p // w], A1[p % w]]``, two tables of ``h`` and ``w`` rows instead of ``h * w``."""

  def __init__(
    self,
    shape: tuple[int, int],
    dims: tuple[int, int],
    *,
    init_std: float,
    param_dtype: jnp.dtype,
    rngs: nnx.Rngs,
  ):
    self.width = shape[1]
    self.rows = param(
      rngs, normal(init_std), (shape[0], dims[0]), (ax.POSITIONS, ax.EMBED), param_dtype
    )
    self.cols = param(
      rngs, normal(init_std), (shape[1], dims[1]), (ax.POSITIONS, ax.EMBED), param_dtype
    )

  def __call__(self, positions: jax.Array) -> jax.Array:
    return jnp.concatenate(
      [
        jnp.take(self.rows[...], positions // self.width, axis=0),
        jnp.take(self.cols[...], positions % self.width, axis=0),
      ],
      axis=-1,
    )


class ReformerLayer(nnx.Module):
  """One reversible layer's two branches: attention of ``kind`` ("lsh" or "local") and the
  feed-forward, each behind its LayerNorm."""

  def __init__(
    self,
    config: ReformerConfig,
    kind: str,
    *,
    rngs: nnx.Rngs,
    backend: backends.Backend | None = None,
  ):
    c = config
    self.kind = kind
    dtype, param_dtype = jnp.dtype(c.dtype), jnp.dtype(c.param_dtype)
    common = dict(
      init_std=c.init_std, dtype=dtype, param_dtype=param_dtype, rngs=rngs, backend=backend
    )
    norm = dict(kind="layernorm", eps=c.norm_eps, param_dtype=param_dtype, rngs=rngs)

    def proj():
      return Projection(
        "BTD,DNH->BTNH",
        (c.d_model, c.num_heads, c.head_dim),
        (ax.EMBED, ax.HEADS, ax.HEAD_DIM),
        **common,
      )

    self.attn_norm = Norm(c.d_model, **norm)
    if kind == "lsh":
      self.query_key, self.query, self.key = proj(), None, None
    else:
      self.query_key, self.query, self.key = None, proj(), proj()
    self.value = proj()
    self.out = Projection(
      "BTNH,NHD->BTD",
      (c.num_heads, c.head_dim, c.d_model),
      (ax.HEADS, ax.HEAD_DIM, ax.EMBED),
      **common,
    )
    self.mlp_norm = Norm(c.d_model, **norm)
    self.mlp = MLP(
      c.d_model,
      c.d_ff,
      activation=c.activation,
      gated=False,
      use_bias=True,
      init_std=c.init_std,
      out_init_std=c.init_std,
      dtype=dtype,
      param_dtype=param_dtype,
      rngs=rngs,
      backend=backend,
    )

  def attention(self, x_BTD, config: ReformerConfig, kv_valid, rotations, key):
    """The attention branch ``[B, T, D]`` (without the residual)."""
    c = config
    h = self.attn_norm(x_BTD)
    if self.kind == "lsh":
      out = ops.lsh_attention(
        self.query_key(h),
        self.value(h),
        n_buckets=c.n_buckets,
        n_hashes=c.n_hashes,
        chunk_length=c.lsh_chunk_length,
        chunks_before=c.lsh_chunks_before,
        chunks_after=c.lsh_chunks_after,
        causal=c.causal,
        kv_valid=kv_valid,
        rotations=jax.lax.stop_gradient(rotations),
      )
    else:
      out = ops.local_attention(
        self.query(h),
        self.key(h),
        self.value(h),
        chunk_length=c.local_chunk_length,
        chunks_before=c.local_chunks_before,
        chunks_after=c.local_chunks_after,
        causal=c.causal,
        kv_valid=kv_valid,
      )
    return ops.dropout(self.out(out), c.dropout_rate, key)

  def feed_forward(self, x_BTD, config: ReformerConfig, key):
    """The feed-forward branch, ``ff_chunk`` positions at a time when set (the ``[B, T, F]``
    hidden activations then exist for one chunk only)."""
    c = config
    r_in, r_out = (None, None) if key is None else jax.random.split(key)

    def ff(x, i):
      k_in = None if r_in is None else jax.random.fold_in(r_in, i)
      k_out = None if r_out is None else jax.random.fold_in(r_out, i)
      y = self.mlp(self.mlp_norm(x), dropout_rate=c.dropout_rate, dropout_rng=k_in)
      return ops.dropout(y, c.dropout_rate, k_out)

    b, t, d = x_BTD.shape
    chunk = c.ff_chunk
    if not chunk or t <= chunk:
      return ff(x_BTD, 0)
    n = -(-t // chunk)
    x = jnp.pad(x_BTD, ((0, 0), (0, n * chunk - t), (0, 0)))
    xs_NBcD = x.reshape(b, n, chunk, d).transpose(1, 0, 2, 3)
    ys = jax.lax.map(lambda args: ff(*args), (xs_NBcD, jnp.arange(n)))
    return ys.transpose(1, 0, 2, 3).reshape(b, n * chunk, d)[:, :t]


def _attention_branch(graphdef, config, p, x, shared, key):
  return nnx.merge(graphdef, p).attention(x, config, shared["kv_valid"], shared["rotations"], key)


def _feed_forward_branch(graphdef, config, p, x, shared, key):
  del shared
  return nnx.merge(graphdef, p).feed_forward(
    x, config, None if key is None else jax.random.fold_in(key, 1)
  )


class Reformer(nnx.Module):
  """``Reformer(config, rngs=...)(tokens, attention_mask) -> logits [B, T, V]``."""

  def __init__(
    self,
    config: ReformerConfig,
    *,
    rngs: nnx.Rngs,
    mesh: Mesh | None = None,
    backend: backends.Backend | None = None,
  ):
    """``mesh``: accepted for the families' common signature; the Reformer runs on one
    device's arrays (GSPMD splits them under a mesh). ``backend``: the kernels its projections
    call (default ``backends.current()``)."""
    del mesh
    self.config = c = config
    self.backend = backend = backend or backends.current()
    dtype, param_dtype = jnp.dtype(c.dtype), jnp.dtype(c.param_dtype)
    self.embed = Embed(
      c.vocab_size,
      c.d_model,
      init_std=c.init_std,
      dtype=dtype,
      param_dtype=param_dtype,
      rngs=rngs,
      backend=backend,
    )
    if c.axial_pos_shape is None:
      self.pos_embed = Embed(
        c.max_len,
        c.d_model,
        init_std=c.init_std,
        dtype=dtype,
        param_dtype=param_dtype,
        rngs=rngs,
        axes=(ax.POSITIONS, ax.EMBED),
      )
    else:
      self.pos_embed = AxialPositions(
        c.axial_pos_shape,
        c.axial_pos_dims,
        init_std=c.axial_init_std,
        param_dtype=param_dtype,
        rngs=rngs,
      )
    if "lsh" in c.attn_layers:
      rot = lsh.random_rotations(
        jax.random.key(c.hash_seed), c.num_heads, c.head_dim, c.n_hashes, c.n_buckets
      )
      self.lsh_rotations = nnx.Param(
        rot.astype(param_dtype),
        out_sharding=(ax.HEADS, ax.HEAD_DIM, ax.BUCKETS, ax.BUCKETS),
        eager_sharding=False,
      )
    else:
      self.lsh_rotations = None
    period = layer_period(c.attn_layers)
    steps = c.num_layers // period

    def stack(kind):
      @nnx.split_rngs(splits=steps)
      @nnx.vmap(in_axes=(0,), out_axes=0, transform_metadata={nnx.PARTITION_NAME: ax.LAYERS})
      def make(rngs):
        return ReformerLayer(c, kind, rngs=rngs, backend=backend)

      return make(rngs)

    # Layer s * P + j is step s of stack j (P = layer_period(attn_layers)).
    self.stacks = nnx.List([stack(kind) for kind in c.attn_layers[:period]])
    self.final_norm = Norm(
      2 * c.d_model, kind="layernorm", eps=c.norm_eps, param_dtype=param_dtype, rngs=rngs
    )
    self.lm_head = Projection(
      "BTE,EV->BTV",
      (2 * c.d_model, c.vocab_size),
      (ax.EMBED, ax.VOCAB),
      bias_shape=(c.vocab_size,),
      bias_axes=(ax.VOCAB,),
      init_std=c.init_std,
      dtype=dtype,
      param_dtype=param_dtype,
      rngs=rngs,
      backend=backend,
    )

  def padded_length(self, t: int) -> int:
    """The length the layers see: ``t`` rounded up to a whole number of chunks of every kind
    (the least common multiple), unless ``t`` fits in the shortest chunk."""
    c = self.config
    lengths = {"lsh": c.lsh_chunk_length, "local": c.local_chunk_length}
    used = [lengths[k] for k in set(c.attn_layers)]
    if t <= min(used):
      return t
    lcm = math.lcm(*used)
    return -(-t // lcm) * lcm

  @with_matmul_precision
  def hidden_states(
    self,
    tokens: jax.Array,
    attention_mask: jax.Array | None = None,
    *,
    dropout_rng: jax.Array | None = None,
    recompute: bool = True,
  ) -> jax.Array:
    """The normalised concatenated streams ``[B, T, 2D]``.

    Args:
      tokens: ``[B, T]`` ids in ``[0, vocab_size)``; T up to ``max_len``. A length that is not a
        whole number of chunks is padded (masked keys) and the padding cut off again.
      attention_mask: ``[B, T]`` bool/0-1, False for padding tokens (default all real).
      dropout_rng: a key turns dropout on.
      recompute: the layers' recomputing backward (``layers.reversible``); False: ordinary
        autodiff through the same layers.

    Raises:
      ValueError: for ids outside the vocabulary, a mask of another shape, or more than
        ``max_len`` tokens (after padding to whole chunks).
    """
    c = self.config
    check_tokens("tokens", tokens, c.vocab_size)
    check_same_shape("attention_mask", attention_mask, "tokens", tokens)
    b, t = tokens.shape
    check_length("tokens", t, c.max_len)
    tp = self.padded_length(t)
    if tp > c.max_len:
      raise ValueError(
        f"{t} tokens are padded to {tp} (whole chunks of the attention layers), "
        f"more than max_len={c.max_len}"
      )
    valid_BT = None
    if attention_mask is not None:
      valid_BT = jnp.broadcast_to(jnp.asarray(attention_mask).astype(bool), tokens.shape)
    if tp != t:
      tokens = jnp.pad(tokens, ((0, 0), (0, tp - t)))
      valid_BT = jnp.pad(
        jnp.ones((b, t), bool) if valid_BT is None else valid_BT, ((0, 0), (0, tp - t))
      )
    keys = [None] * 3 if dropout_rng is None else list(jax.random.split(dropout_rng, 3))
    positions = jnp.arange(tp)[None, :]
    x_BTD = self.embed(tokens) + self.pos_embed(positions).astype(c.dtype)
    x_BTD = ops.dropout(x_BTD, c.dropout_rate, keys[0])
    period = len(self.stacks)
    graphdefs, params = zip(*(nnx.split(s) for s in self.stacks))
    f = tuple(functools.partial(_attention_branch, gd, c) for gd in graphdefs)
    g = tuple(functools.partial(_feed_forward_branch, gd, c) for gd in graphdefs)
    rotations = None if self.lsh_rotations is None else self.lsh_rotations[...]
    per_layer = None
    if keys[1] is not None:
      per_layer = jax.random.split(keys[1], c.num_layers).reshape(c.num_layers // period, period)
    y1, y2 = reversible_layers(
      f,
      g,
      tuple(params),
      x_BTD,
      x_BTD,
      shared={"kv_valid": valid_BT, "rotations": rotations},
      per_layer=per_layer,
      recompute=recompute,
    )
    # The streams come back float32 (layers.reversible); the norm reads them so.
    h_BTE = self.final_norm(jnp.concatenate([y1, y2], axis=-1)).astype(c.dtype)
    return ops.dropout(h_BTE, c.dropout_rate, keys[2])[:, :t]

  @with_matmul_precision
  def __call__(
    self,
    tokens: jax.Array,
    attention_mask: jax.Array | None = None,
    *,
    dropout_rng: jax.Array | None = None,
    recompute: bool = True,
  ) -> jax.Array:
    """Logits ``[B, T, V]`` (float32); arguments as ``hidden_states``."""
    h_BTE = self.hidden_states(tokens, attention_mask, dropout_rng=dropout_rng, recompute=recompute)
    return self.lm_head(h_BTE).astype(jnp.float32)
