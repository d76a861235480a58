"""``ReformerConfig``: the Reformer's config (``models.Reformer``).

Reversible layers alternating LSH and local chunked attention, a chunked feed-forward and axial
position embeddings, with transformers' ``ReformerConfig`` defaults. It has no ``num_kv_heads`` and
its ``head_dim`` is always given, so it does without ``checks.Heads``; lists from YAML or JSON
become tuples so the config hashes.
"""

from __future__ import annotations

import dataclasses

from transformer_jax import ops
from transformer_jax.ops import lsh
from transformer_jax.models.config import checks

_REFORMER_KINDS = ("lsh", "local")


@dataclasses.dataclass(frozen=True, slots=True)
class ReformerConfig:
  """The Reformer (Kitaev et al. 2020) as a causal LM (``models.Reformer``): reversible layers of
  LSH or local attention, chunked feed-forward, axial positions. Field names follow the other
  families; the defaults are transformers' ``ReformerConfig``'s."""

  vocab_size: int = 320
  d_model: int = 256
  num_heads: int = 12
  head_dim: int = 64
  d_ff: int = 512
  attn_layers: tuple[str, ...] = ("local", "lsh", "local", "lsh", "local", "lsh")  # "lsh"/"local"
  max_len: int = 4096
  # Axial positions: position p gets [A0[p // w], A1[p % w]] for axial_pos_shape (h, w), widths
  # axial_pos_dims (summing to d_model), h * w >= max_len; None: a learned [max_len, D] table.
  axial_pos_shape: tuple[int, int] | None = (64, 64)
  axial_pos_dims: tuple[int, int] = (64, 192)
  axial_init_std: float = 1.0
  causal: bool = True  # a decoder (transformers' is_decoder)
  lsh_chunk_length: int = 64
  lsh_chunks_before: int = 1
  lsh_chunks_after: int = 0
  n_hashes: int = 1
  n_buckets: int | tuple[int, ...] = 64  # even; or even factors whose product is the buckets
  hash_seed: int = 0  # the random rotations' seed (ops.lsh.random_rotations)
  local_chunk_length: int = 64
  local_chunks_before: int = 1
  local_chunks_after: int = 0
  ff_chunk: int = 0  # chunked feed-forward: positions per chunk; 0: at once
  activation: ops.Activation = "relu"
  norm_eps: float = 1e-12
  dropout_rate: float = 0.0  # embeddings, residual branches and the final norm
  init_std: float = 0.02
  dtype: str = "float32"
  param_dtype: str = "float32"
  matmul_precision: str = "float32"

  def __post_init__(self):
    for name in ("attn_layers", "axial_pos_shape", "axial_pos_dims", "n_buckets"):
      if isinstance(getattr(self, name), list):  # from YAML / JSON
        object.__setattr__(self, name, tuple(getattr(self, name)))
    checks.positive(
      self,
      "vocab_size",
      "d_model",
      "num_heads",
      "head_dim",
      "d_ff",
      "max_len",
      "lsh_chunk_length",
      "local_chunk_length",
      "n_hashes",
    )
    for name in (
      "lsh_chunks_before",
      "lsh_chunks_after",
      "local_chunks_before",
      "local_chunks_after",
      "ff_chunk",
      "hash_seed",
    ):
      if not isinstance(getattr(self, name), int) or getattr(self, name) < 0:
        raise ValueError(f"{name}={getattr(self, name)!r} must be an integer >= 0")
    if (
      not isinstance(self.attn_layers, tuple)
      or not self.attn_layers
      or any(k not in _REFORMER_KINDS for k in self.attn_layers)
    ):
      raise ValueError(
        f"attn_layers={self.attn_layers!r} must be a non-empty list of 'lsh' and 'local'"
      )
    factors = (self.n_buckets,) if isinstance(self.n_buckets, int) else self.n_buckets
    if not factors or any(
      isinstance(f, bool) or not isinstance(f, int) or f < 2 or f % 2 for f in factors
    ):
      raise ValueError(
        f"n_buckets={self.n_buckets!r} must be an even integer >= 2 or a list of them"
      )
    if "lsh" in self.attn_layers:  # LSH's int32 sort keys over max_len positions
      lsh.check_sizes(self.max_len, self.n_hashes, self.n_buckets)
    if self.axial_pos_shape is not None:
      shape, dims = self.axial_pos_shape, self.axial_pos_dims
      if len(shape) != 2 or any(not isinstance(x, int) or x < 1 for x in shape):
        raise ValueError(f"axial_pos_shape={shape!r} must be two positive integers")
      if len(dims) != 2 or sum(dims) != self.d_model:
        raise ValueError(
          f"axial_pos_dims={dims!r} must be two widths summing to d_model={self.d_model}"
        )
      if shape[0] * shape[1] < self.max_len:
        raise ValueError(
          f"axial_pos_shape={shape!r} covers {shape[0] * shape[1]} positions, "
          f"fewer than max_len={self.max_len}"
        )
    checks.choice(self, "activation", checks.ACTIVATIONS)
    checks.rate(self, "dropout_rate")
    checks.dtype(self, "dtype", "param_dtype")
    checks.choice(self, "matmul_precision", ops.precision.PRECISIONS)
    if not self.norm_eps > 0:
      raise ValueError(f"norm_eps={self.norm_eps!r} must be > 0")

  @property
  def num_layers(self) -> int:
    return len(self.attn_layers)
