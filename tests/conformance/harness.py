"""How the conformance properties call a registered kind: parameters, compiled forward and decoding
functions (one per kind and shape, shared by every property), batches of ragged rows, and the
references they are compared with.

Parameters are drawn with NumPy (no initialisation program to compile) at a scale that makes logits
O(1) apart, so a wrong mask, position or cache slot shows far above the tolerances and greedy
argmaxes do not tie.

Two programs that compute the same function (a batch and a row alone, packed and separate
documents, a cache and the full pass) differ by rounding only; ``bound`` (float32) and
``bound_bf16`` (bfloat16 compute) say by how much at most, from the model's size and the
reference's scale, and hold on every CPU (AVX2 or AVX-512 vector widths, any matmul blocking).
"""

from __future__ import annotations

import functools

import jax
import jax.numpy as jnp
import numpy as np
from flax import nnx

from transformer_jax import generate, models
from tests.conformance.kinds import DECODER, ENCODER, SEQ2SEQ, VOCAB, Kind

WIDTH = 16  # columns of every padded batch the suite builds
ROWS = 3  # rows of every batch
EPS32 = float(np.finfo(np.float32).eps)  # 2^-23: one float32 rounding is off by <= EPS32 / 2
U_BF16 = 2.0**-8  # bfloat16 keeps 8 significant bits: one rounding is off by <= 2^-8 relative


def depth(config: models.ModelConfig) -> int:
  """The layers between an id and a logit, plus the output projection (Seq2Seq: both stacks,
  the encoder's output feeding every decoder layer)."""
  fields = ("num_layers", "num_encoder_layers", "num_decoder_layers")
  return 1 + sum(getattr(config, f, 0) or 0 for f in fields)


def longest_reduction(config: models.ModelConfig) -> int:
  """n, the most terms any one sum of the model adds: over positions (attention, the scans: at
  most WIDTH here), the width, the MLP's hidden width, Mamba's inner width."""
  d = config.d_model
  return max(WIDTH, d, getattr(config, "d_ff", 0) or 0, d * (getattr(config, "expand", 1) or 1))


def bound(config: models.ModelConfig, reference) -> float:
  """How far two float32 programs of the same function may differ: ``depth * n^1.5 * EPS32 *
  max|reference|``.

  A float32 sum of n terms is off by at most ``n * EPS32 / 2 * sum|terms|`` in any order
  (Higham's gamma_n), so two orders (a shape's matmul blocking, a CPU's vector width, a scan's
  chunk boundaries) differ by up to ``n * EPS32 * sum|terms|``. With random weights the terms
  have random signs: ``sum|terms|`` is about ``sqrt(n)`` times the sum, whose scale is that of
  the logits (``max|reference|``). Each layer on the way adds its own (``depth``). For the
  suite's tiny configs this is about 3e-4 at logits of 4: far below the O(1) change of a wrong
  mask, position or cache slot.
  """
  n = longest_reduction(config)
  return depth(config) * n**1.5 * EPS32 * float(np.max(np.abs(reference)))


def bound_bf16(config: models.ModelConfig, reference) -> float:
  """How far two programs of the same function in bfloat16 compute may differ: ``8 * depth *
  U_BF16 * max|reference|``.

  Products accumulate in float32 (``bound``: negligible here), but every activation is then
  rounded to 8 significant bits: where two programs' float32 values differ in their last bits, a
  rounding can land one bfloat16 unit apart, up to ``2 * U_BF16`` relative to values of the
  logits' scale. A block's path to the logits passes about four such roundings (the normed
  input, the mixer's output, the MLP's output, the residual sum), and the blocks' changes add up
  (``depth``, the last being the logits' own rounding).
  """
  return 8 * depth(config) * U_BF16 * float(np.max(np.abs(reference)))


@functools.lru_cache(maxsize=None)
def params(config: models.ModelConfig, seed: int = 0) -> nnx.State:
  """Random parameters for ``config``: N(0, 0.3) matrices, norm scales near 1."""
  rng = np.random.default_rng(seed)
  abstract = models.init_abstract(config)

  def draw(path, x):
    name = jax.tree_util.keystr(path)
    values = rng.normal(0.0, 0.3, x.shape)
    if "['scale']" in name:
      values = 1.0 + 0.1 * values
    return jnp.asarray(values, x.dtype)

  return jax.tree_util.tree_map_with_path(draw, abstract)


def model(config: models.ModelConfig, seed: int = 0) -> nnx.Module:
  return nnx.merge(models.graphdef(config), params(config, seed))


def call(kind: Kind, m, tokens, mask=None, positions=None, segments=None, src=None, src_mask=None):
  """The kind's main logits ``[B, T, V]`` for ``tokens`` by its calling convention (see
  ``kinds``). Seq2Seq: ``tokens`` are the decoder inputs; the source is ``src`` (default the same
  ids and mask)."""
  if kind.has(DECODER):
    return m(tokens, positions, segments, mask)
  if kind.has(ENCODER):
    return m(tokens, None, mask).mlm_logits
  if kind.has(SEQ2SEQ):
    if src is None:
      src, src_mask = tokens, mask
    return m(src, tokens, src_mask, mask)
  raise AssertionError(f"kind {kind.name} claims no calling convention")


@functools.lru_cache(maxsize=None)
def forward_fn(kind: Kind, config: models.ModelConfig):
  """Jitted ``(params, tokens, mask=None, positions=None, segments=None, src=None,
  src_mask=None) -> logits``; jit keeps one program per shape and argument pattern."""
  graphdef = models.graphdef(config)

  def run(p, tokens, mask=None, positions=None, segments=None, src=None, src_mask=None):
    return call(kind, nnx.merge(graphdef, p), tokens, mask, positions, segments, src, src_mask)

  return jax.jit(run)


def forward(
  kind, config, tokens, mask=None, *, positions=None, src=None, src_mask=None
) -> np.ndarray:
  """The kind's logits as NumPy, through ``forward_fn`` with one argument pattern per kind (so
  that calls of one shape share a program): a decoder always gets positions (default: counting
  each row's real tokens), a Seq2Seq model always a source (default: ``tokens`` and ``mask``)."""
  kw = {}
  if kind.has(DECODER):
    if positions is None:
      real = np.ones(np.shape(tokens), bool) if mask is None else np.asarray(mask, bool)
      positions = np.maximum(np.cumsum(real, axis=1) - 1, 0)
    kw["positions"] = jnp.asarray(positions, jnp.int32)
  if kind.has(SEQ2SEQ):
    src, src_mask = (tokens, mask) if src is None else (src, src_mask)
    kw.update(src=jnp.asarray(src), src_mask=None if src_mask is None else jnp.asarray(src_mask))
  return np.asarray(
    forward_fn(kind, config)(
      params(config), jnp.asarray(tokens), None if mask is None else jnp.asarray(mask), **kw
    )
  )


def decoded(kind: Kind, config, m, cache_len: int, prompt_BP, lengths_B, steps_BS, src, src_mask):
  """``decode_fn``'s computation with the model ``m``: ``(prefill logits [B, P, V], step logits
  [B, S, V], cache)``."""
  cache = generate.init_cache(config, prompt_BP.shape[0], cache_len)
  if kind.has(SEQ2SEQ):
    cache = generate.with_encoder(m, cache, m.encode(src, src_mask), src_mask)
  prefill_BPV, cache = generate.extend(m, prompt_BP, cache, num_valid=lengths_B)

  def step(cache, tok_B):
    logits_B1V, cache = generate.extend(m, tok_B[:, None], cache)
    return cache, logits_B1V[:, 0]

  cache, steps_SBV = jax.lax.scan(step, cache, steps_BS.T)
  return prefill_BPV, steps_SBV.swapaxes(0, 1), cache


@functools.lru_cache(maxsize=None)
def decode_fn(kind: Kind, config: models.ModelConfig, cache_len: int):
  """Jitted ``(params, prompt [B, P], lengths [B], steps [B, S], src, src_mask) ->
  (prefill logits [B, P, V], step logits [B, S, V], cache)``: row b's ``lengths[b]`` prompt
  tokens prefilled in one ragged call, then its S step tokens fed one at a time (teacher forcing),
  each at the position after the row's last. Seq2Seq: the source is encoded into the cache first
  (``src``, ``src_mask``), the prompt and steps are decoder inputs."""
  graphdef = models.graphdef(config)

  def run(p, prompt_BP, lengths_B, steps_BS, src=None, src_mask=None):
    m = nnx.merge(graphdef, p)
    return decoded(kind, config, m, cache_len, prompt_BP, lengths_B, steps_BS, src, src_mask)

  return jax.jit(run)


def ragged(rng: np.random.Generator, lengths, width: int = WIDTH, left=None):
  """Random rows of ``lengths`` real tokens in a ``[B, width]`` batch, padded on the right (or,
  for rows where ``left[b]`` is given, ``left[b]`` pad columns before the row): ``(tokens, mask,
  positions)``, positions counting each row's real tokens from 0."""
  b = len(lengths)
  tokens = np.zeros((b, width), np.int32)
  mask = np.zeros((b, width), bool)
  for i, n in enumerate(lengths):
    start = 0 if left is None else left[i]
    tokens[i, start : start + n] = rng.integers(0, VOCAB, n)
    mask[i, start : start + n] = True
  positions = np.maximum(np.cumsum(mask, axis=1) - 1, 0).astype(np.int32)
  return tokens, mask, positions


def greedy_by_forward(kind, config, prompts, new: int, src=None, src_mask=None) -> np.ndarray:
  """Greedy continuation of each prompt (a list of id lists) by the full forward pass over the
  whole sequence at every step, all rows in one ``[B, WIDTH]`` right-padded batch:
  ``[B, new]`` ids. Seq2Seq: ``prompts`` are the decoder starts and ``src`` the sources."""
  width = WIDTH
  b = len(prompts)
  assert max(map(len, prompts)) + new <= width, "the references are WIDTH columns wide"
  tokens = np.zeros((b, width), np.int32)
  lengths = np.array([len(p) for p in prompts])
  for i, p in enumerate(prompts):
    tokens[i, : len(p)] = p
  out = np.zeros((b, new), np.int32)
  for s in range(new):
    mask = np.arange(width)[None, :] < (lengths + s)[:, None]
    logits = forward(kind, config, tokens, mask, src=src, src_mask=src_mask)
    nxt = np.argmax(logits[np.arange(b), lengths + s - 1], axis=-1)
    out[:, s] = nxt
    tokens[np.arange(b), lengths + s] = nxt
  return out


def finite(tree) -> bool:
  """Every float leaf of ``tree`` is free of NaN and Inf."""
  return all(
    np.all(np.isfinite(np.asarray(x)))
    for x in jax.tree.leaves(tree)
    if jnp.issubdtype(jnp.asarray(x).dtype, jnp.floating)
  )
