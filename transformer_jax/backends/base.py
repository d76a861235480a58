"""``Backend``: a platform's kernels as the methods of one frozen, hashable object.

Layers are given a backend when they are built (as they are given the mesh) and call it; they never
ask which platform they run on. A backend is a static field of the model's graph (``nnx.split``
keeps it in the graph definition, ``jax.jit`` hashes it), so two models with equal backends share
compiled programs and a different kernel table compiles a different program.

This class holds what every platform does alike; ``CpuBackend``, ``GpuBackend`` and
``TpuBackend`` override what is theirs.
"""

from __future__ import annotations

import contextlib
import dataclasses
import math
from collections.abc import Callable
from typing import Any, ClassVar

import jax
import jax.numpy as jnp
from jax.sharding import Mesh

from transformer_jax import ops
from transformer_jax.backends import per_device, splash
from transformer_jax.backends.table import KernelTable
from transformer_jax.ops.dispatch import Choice
from transformer_jax.parallel.ring import ring_attention


def sequence_shards(mesh: Mesh | None, b: int, t: int) -> int:
  """How many devices ``mesh`` splits a ``[B, T, ...]`` input's sequence over (1: not split, or
  the mesh's ``sequence`` axis does not divide this batch and length)."""
  if mesh is None:
    return 1
  sizes = mesh.shape
  n = sizes.get("sequence", 1)
  rows = sizes.get("data", 1) * sizes.get("fsdp", 1) * sizes.get("expert", 1)  # batch rows
  return n if t % n == 0 and b % rows == 0 else 1


def padded_attend(x_BTD: jax.Array, table_VD: jax.Array, multiple: int) -> jax.Array:
  """``x @ E^T`` (``[B, T, V]``) through a table padded with zero rows to a multiple of
  ``multiple``, the padded columns sliced off: the same values, with the product and its
  transposes at an aligned width (``KernelTable.pad_cols``)."""
  v = table_VD.shape[0]
  table_PD = jnp.pad(table_VD, ((0, -v % multiple), (0, 0)))
  return jnp.einsum("BTD,PD->BTP", x_BTD, table_PD)[..., :v]


def einsum_dims(einsum: str) -> tuple[str, str, str]:
  """``"BTD,DNH->BTNH"`` -> (x letters, kernel letters, output letters)."""
  lhs, out = einsum.replace(" ", "").split("->")
  x, kernel = lhs.split(",")
  return x, kernel, out


def value(variable) -> jax.Array:
  """The array of an ``nnx.Variable`` (or an array as it is)."""
  return variable[...] if hasattr(variable, "get_value") else variable


@dataclasses.dataclass(frozen=True)
class Backend:
  """The kernels of one platform, built from a kernel table (``KernelTable``).

  Attributes:
    table: the run's kernel levers.
  """

  table: KernelTable = KernelTable()

  platform: ClassVar[str] = ""
  # The most query rows and keys per block of the "chunked" attention kernel.
  chunk_block: ClassVar[int | None] = None

  # -- attention -------------------------------------------------------------------------------

  def dense_core(self, q, k, v) -> ops.attention.DenseCore | None:
    """The core of the dense ("xla") kernel for these inputs; None: the heads-major one."""
    del q, k, v
    return None

  def choose_attention(self, q, k, v, **parts) -> Choice:
    """``ops.choose_implementation`` for these inputs on this platform (``parts``: its keyword
    arguments but ``platform``), with what only the platform knows."""
    return ops.choose_implementation(
      q, k, v, platform=self.platform, **parts, rowmajor_core=self.dense_core(q, k, v) is not None
    )

  def attention(
    self,
    q: jax.Array,
    k: jax.Array,
    v: jax.Array,
    *,
    causal: bool = False,
    window: int | None = None,
    kv_valid: jax.Array | None = None,
    q_segment_ids: jax.Array | None = None,
    kv_segment_ids: jax.Array | None = None,
    q_positions: jax.Array | None = None,
    bias_fn=None,
    bias_params: Any = None,
    scale: float | None = None,
    dropout_rate: float = 0.0,
    dropout_rng: jax.Array | None = None,
    implementation: ops.Implementation | None = None,
    mesh: Mesh | None = None,
    self_attention: bool = False,
    softcap: float | None = None,
  ) -> jax.Array:
    """``softmax(scale * q k^T + bias, masked) v`` by the kernel the table chooses for these
    inputs here (or ``implementation``): chosen and called in one place.

    Args:
      q: ``[B, T, N, H]`` queries.
      k: ``[B, S, K, H]`` keys, q's dtype.
      v: ``[B, S, K, H]`` values, q's dtype.
      causal, window, kv_valid, q_segment_ids, kv_segment_ids, q_positions, bias_fn,
        bias_params, scale, dropout_rate, dropout_rng: the mask and bias parts, as in
        ``ops.dot_product_attention``.
      implementation: a kernel to use instead of the table's ("xla", "chunked", "cudnn",
        "splash"); ring attention, where the table picks it, still wins.
      mesh: the mesh the model runs on: its ``sequence`` axis makes self-attention ring
        attention (``parallel.ring``), and splash runs per device where it splits the batch or
        heads.
      self_attention: the call is self-attention without a cache (ring attention may take it).
      softcap: the logits' soft-cap (``ops.dot_product_attention``); "xla", "chunked" and
        "splash" take one, and asking cuDNN for it is refused by name.

    Returns:
      ``[B, T, N, H]`` in q's dtype.
    """
    dropout = dropout_rate > 0.0 and dropout_rng is not None
    shards = sequence_shards(mesh, q.shape[0], q.shape[1]) if self_attention else 1
    choice = self.choose_attention(
      q,
      k,
      v,
      causal=causal,
      window=window,
      segment_ids=q_segment_ids is not None,
      bias=bias_fn is not None,
      dropout=dropout,
      kv_valid=kv_valid is not None,
      q_positions=q_positions is not None,
      sequence_shards=shards,
      softcap=softcap is not None,
    )
    kernel = implementation or choice
    if softcap is not None and kernel not in ("xla", "chunked", "splash"):
      raise ValueError(
        f"implementation={kernel!r} takes no attention soft-cap (softcap={softcap!r}): use "
        "'xla' or 'chunked', or None for the table's choice"
      )
    parts = dict(
      causal=causal,
      window=window,
      kv_valid=kv_valid,
      q_segment_ids=q_segment_ids,
      kv_segment_ids=kv_segment_ids,
      q_positions=q_positions,
      bias_fn=bias_fn,
      bias_params=bias_params,
      scale=scale,
      dropout_rate=dropout_rate,
      dropout_rng=dropout_rng,
    )
    if choice == "ring":
      return ring_attention(
        q,
        k,
        v,
        mesh=mesh,
        causal=causal,
        kv_mask_BS=kv_valid,
        segment_ids_BT=q_segment_ids,
        scale=scale,
      )
    match kernel:
      case "xla" | "chunked":
        block = self.chunk_block
        return ops.dot_product_attention(
          q,
          k,
          v,
          **parts,
          implementation=kernel,
          dense_core=self.dense_core(q, k, v),
          block_q=block,
          block_k=block,
          **({} if softcap is None else {"softcap": softcap}),
        )
      case "splash":
        if per_device.mesh_splits(mesh, q):
          return per_device.attention(
            mesh,
            lambda q, k, v, seg: splash.attention(
              q, k, v, causal=causal, window=window, q_segment_ids=seg, scale=scale, softcap=softcap
            ),
            q,
            k,
            v,
            q_segment_ids,
          )
        return splash.attention(q, k, v, **parts, softcap=softcap)
      case "cudnn":
        from transformer_jax.backends import cudnn  # noqa: PLC0415 - cuDNN's module, on GPUs

        segments = self.table.cudnn_packed_segments
        if per_device.mesh_splits(mesh, q) and (
          kv_valid is None and bias_fn is None and not dropout and q_positions is None
        ):
          return per_device.attention(
            mesh,
            lambda q, k, v, seg: cudnn.attention(
              q,
              k,
              v,
              causal=causal,
              window=window,
              q_segment_ids=seg,
              scale=scale,
              table_segments=segments,
            ),
            q,
            k,
            v,
            q_segment_ids,
          )
        return cudnn.attention(q, k, v, **parts, table_segments=segments)
      case _:
        raise ValueError(
          f"implementation={kernel!r} must be None, 'xla', 'chunked', 'cudnn' or 'splash'"
        )

  # -- products ----------------------------------------------------------------------------------

  def project(
    self, x: jax.Array, kernel, bias, *, einsum: str, n_in: int, dtype, merged: bool = False
  ) -> jax.Array:
    """A projection's product ``einsum(x, kernel) + bias`` in ``dtype``.

    Args:
      x: the input, its last ``n_in`` dims contracted.
      kernel: the kernel ``nnx.Variable`` (``[in..., out...]``, or a backend's decoding layout).
      bias: the bias ``nnx.Variable`` (``[out...]``) or None.
      einsum: the product, e.g. ``"BTD,DNH->BTNH"`` (contracted dims close x and lead the kernel).
      n_in: how many dims are contracted.
      dtype: the compute dtype.
      merged: contract the ``n_in`` dims as one (the same numbers: ``[..., I] @ [I, out...]``);
        the output projection of decoding reads its kernel where it is so.
    """
    w = value(kernel)
    if merged:
      x_letters, _, out_letters = einsum_dims(einsum)
      lead = x_letters[: len(x_letters) - n_in]
      outs = out_letters[len(lead) :]
      k_in = math.prod(w.shape[:n_in])
      w_EO = w.reshape(k_in, *w.shape[n_in:]).astype(dtype)  # E: the contracted dims as one
      x_E = x.reshape(*x.shape[: x.ndim - n_in], k_in).astype(dtype)
      y = jnp.einsum(f"{lead}E,E{outs}->{lead}{outs}", x_E, w_EO)
    else:
      y = jnp.einsum(einsum, x.astype(dtype), w.astype(dtype))
    if bias is not None:
      y = y + value(bias).astype(dtype)
    return y

  def vocab_head(self, x_BTD: jax.Array, table, dtype) -> jax.Array:
    """Logits ``x @ E^T`` ``[B, T, V]`` of a weight stored ``[V, D]`` (a tied embedding table
    ``nnx.Variable``), in ``dtype``; padded to a multiple of the table's ``pad_cols`` columns
    where it is set and does not divide V."""
    x_BTD = x_BTD.astype(dtype)
    table_VD = value(table).astype(dtype)
    multiple = self.table.pad_cols
    if multiple and table_VD.shape[0] % multiple:
      return padded_attend(x_BTD, table_VD, multiple)
    return jnp.einsum("BTD,VD->BTV", x_BTD, table_VD)

  def linear_cross_entropy(self, x_ND, w, labels_N, weights_N=None, **kwargs):
    """``ops.linear_cross_entropy`` in this platform's layout (``kwargs``: its options)."""
    return ops.linear_cross_entropy(x_ND, w, labels_N, weights_N, **kwargs)

  def activate(
    self, activation: ops.Activation, x: jax.Array, up: jax.Array | None = None, *, dtype
  ) -> jax.Array:
    """The feed-forward activation ``act(x)``, or ``gated(act, x, up)``, between products
    computed in ``dtype``."""
    del dtype
    if up is None:
      return ops.get_activation(activation)(x)
    return ops.gated(activation, x, up)

  def grouped_matmul(self, x_MK: jax.Array, w_EKN, group_sizes_E: jax.Array, *, dtype) -> jax.Array:
    """The grouped product of a mixture of experts: rows ``x[start_e:start_e + size_e]`` times
    ``w[e]`` for each expert e, rows sorted by expert (``ops.moe.sort_by_expert``).

    Args:
      x_MK: ``[M, K]`` rows in expert order.
      w_EKN: the experts' stacked weights ``[E, K, N]`` (an ``nnx.Variable`` or an array).
      group_sizes_E: int32 ``[E]`` rows per expert, summing to M.
      dtype: the compute dtype (and the output's).

    Returns:
      ``[M, N]`` in ``dtype``; here ``jax.lax.ragged_dot`` (differentiable; XLA:CPU lowers it
      and its transposes as masked dense products over all experts).
    """
    w = value(w_EKN).astype(dtype)
    return jax.lax.ragged_dot(
      x_MK.astype(dtype), w, group_sizes_E.astype(jnp.int32), preferred_element_type=dtype
    )

  # -- decoding --------------------------------------------------------------------------------

  def decode_layout(self, kernel, *, n_in: int, dtype, threads: int | None = None):
    """A projection kernel (``nnx.Variable``, ``n_in`` contracted dims first) in this platform's
    decoding layout; here the kernel as it is."""
    del n_in, dtype, threads
    return kernel

  def in_decode_layout(self, kernel) -> bool:
    """Whether ``kernel`` is in this platform's decoding layout (``decode_layout``)."""
    del kernel
    return False

  # -- layer stacks ------------------------------------------------------------------------------

  def unrolls_layers(self, dtype) -> bool:
    """Whether a small stack of layers computing in ``dtype`` runs unrolled rather than under
    ``lax.scan`` (``models.unrolls_layers``' "auto")."""
    del dtype
    return False

  # -- compiling the steps -----------------------------------------------------------------------

  def step_compiler_options(self) -> dict:
    """Compile options of the train and eval steps: a new dict, the platform's own with the
    table's ``step_options`` over them. Pass them as ``jax.jit(..., compiler_options=...)``
    (they are part of the persistent cache's key) and what compiles with them to ``hold``."""
    return dict(self.table.step_options)

  def decode_compiler_options(self) -> dict:
    """Compile options of ``generate``'s decoding loop: the platform's own with the table's
    ``decode_options`` over them."""
    return dict(self.table.decode_options)

  def compiling(self):
    """A block that compiles programs with ``step_compiler_options`` (quiet where the platform's
    programs warn about the cache)."""
    return contextlib.nullcontext()

  def hold(self, compiled, options: dict | None):
    """``compiled`` (a ``jax.jit`` function or a ``Compiled``), kept alive where the platform
    needs it; here as it is."""
    del options
    return compiled

  def jit_step(self, fn: Callable, **jit_kwargs):
    """``jax.jit(fn, **jit_kwargs)`` with ``step_compiler_options``, held (``hold``)."""
    options = self.step_compiler_options()
    return self.hold(jax.jit(fn, compiler_options=options or None, **jit_kwargs), options)

  def microbatches(
    self, setting: int | str, compile_step: Callable[[int], Any], batch_size: int, n_batch: int = 1
  ) -> tuple[int, Any]:
    """``train.microbatches`` resolved, with the step compiled for it: a number is taken as
    given; "auto" is 1 here.

    Args:
      setting: a count, or "auto".
      compile_step: compiles the train step for a number of microbatches.
      batch_size: the global batch.
      n_batch: the devices the batch is split over.

    Returns:
      ``(microbatches, compiled)``.
    """
    del batch_size, n_batch
    with self.compiling():
      m = 1 if setting == "auto" else setting
      return m, compile_step(m)

  def scratch_notice(self, temp_bytes: int | None) -> str | None:
    """A notice when one compiled step's temporaries cost time on this platform; None here."""
    del temp_bytes
    return None

  def bf16_notice(self, dtype) -> str | None:
    """A notice when ``dtype`` computes slower than float32 on this platform; None here."""
    del dtype
    return None
