"""Mixture-of-experts routing, its auxiliary losses and the token permutations of a dropless
expert layer. Pure functions on arrays; scores and losses in float32.

Letters (besides the legend of ``ops/attention.py``): N tokens (a flattened ``[B, T]``), E experts,
k experts per token (``top_k``), M = N * k routed copies of the tokens, C an expert's capacity.

- ``route``: top-k routing. ``scoring="softmax"`` is Mixtral's (softmax over all experts, the top k
  renormalised to sum to 1) and Qwen3-MoE's (renormalised only under ``norm_topk_prob``);
  ``scoring="sigmoid"`` is DeepSeek-V3's: sigmoid scores, a bias that only *selects* (the weights
  are the unbiased scores), optionally limited to the best ``topk_groups`` of ``num_groups``
  expert groups, and a ``scale`` on the weights.
- ``load_balancing_loss``: Switch/Mixtral, ``E * sum_e f_e * P_e`` with ``f_e`` the fraction of
  tokens that chose expert e (among their k) and ``P_e`` its mean router probability; k at a
  uniform router (transformers' ``load_balancing_loss_func``).
- ``router_z_loss``: ST-MoE's ``mean_n logsumexp(logits_n)^2``.
- ``sort_by_expert`` / ``unsort``: the routed copies grouped by expert, for a grouped product
  (``jax.lax.ragged_dot``), and back; ``capacity_slots``: the capacity-factor alternative.
"""

from __future__ import annotations

import math
from typing import Literal, NamedTuple

import jax
import jax.numpy as jnp

Scoring = Literal["softmax", "sigmoid"]


class Routing(NamedTuple):
  """What ``route`` returns (``N`` tokens, ``k`` experts each, ``E`` experts)."""

  weights_Nk: jax.Array  # float32 combine weights of the chosen experts
  experts_Nk: jax.Array  # int32 expert ids, best first
  probs_NE: jax.Array  # float32 router probabilities (softmax, or sigmoid scores) of every expert


def route(
  logits_NE: jax.Array,
  *,
  top_k: int,
  scoring: Scoring = "softmax",
  normalize: bool = True,
  bias_E: jax.Array | None = None,
  num_groups: int = 1,
  topk_groups: int = 1,
  scale: float = 1.0,
) -> Routing:
  """Top-k routing of ``N`` tokens over ``E`` experts.

  Args:
    logits_NE: router logits ``[N, E]`` (any float dtype; scored in float32).
    top_k: experts per token, ``1 <= top_k <= E``.
    scoring: "softmax" (probabilities over all experts) or "sigmoid" (independent scores).
    normalize: rescale the k chosen weights to sum to 1 (Mixtral; Qwen3-MoE's ``norm_topk_prob``).
    bias_E: sigmoid only: added to the scores to choose the experts, not to weigh them.
    num_groups: sigmoid only: the experts split into this many equal groups; a token chooses only
      among the ``topk_groups`` groups whose two best (biased) scores sum highest.
    topk_groups: how many groups stay eligible.
    scale: multiplies the final weights (DeepSeek-V3's ``routed_scaling_factor``).

  Returns:
    ``Routing(weights [N, k], experts [N, k], probs [N, E])``.

  Raises:
    ValueError: naming the option that does not fit ``E``.
  """
  n, e = logits_NE.shape
  if not 1 <= top_k <= e:
    raise ValueError(f"top_k={top_k} must be in [1, num_experts={e}]")
  logits = logits_NE.astype(jnp.float32)
  match scoring:
    case "softmax":
      if bias_E is not None or num_groups != 1:
        raise ValueError("bias_E and num_groups > 1 need scoring='sigmoid'")
      probs = jax.nn.softmax(logits, axis=-1)
      choose = probs
    case "sigmoid":
      probs = jax.nn.sigmoid(logits)
      choose = probs if bias_E is None else probs + bias_E.astype(jnp.float32)
      if num_groups != 1:
        choose = _group_limited(choose, num_groups, topk_groups, top_k)
    case _:
      raise ValueError(f"scoring={scoring!r} must be 'softmax' or 'sigmoid'")
  _, experts = jax.lax.top_k(choose, top_k)
  weights = jnp.take_along_axis(probs, experts, axis=-1)
  if normalize:
    weights = weights / jnp.sum(weights, axis=-1, keepdims=True)
  return Routing(weights * scale, experts.astype(jnp.int32), probs)


def _group_limited(choose_NE, num_groups: int, topk_groups: int, top_k: int) -> jax.Array:
  """``choose`` with the experts outside each token's best ``topk_groups`` groups at -inf."""
  n, e = choose_NE.shape
  if num_groups < 1 or e % num_groups:
    raise ValueError(f"num_groups={num_groups} must divide num_experts={e}")
  per_group = e // num_groups
  if not 1 <= topk_groups <= num_groups or topk_groups * per_group < top_k:
    raise ValueError(
      f"topk_groups={topk_groups} must be in [1, num_groups={num_groups}] and leave at least "
      f"top_k={top_k} experts ({per_group} per group)"
    )
  grouped = choose_NE.reshape(n, num_groups, per_group)
  best = jax.lax.top_k(grouped, min(2, per_group))[0]
  _, keep = jax.lax.top_k(jnp.sum(best, axis=-1), topk_groups)  # [N, topk_groups]
  keep_NG = jnp.any(jax.nn.one_hot(keep, num_groups, dtype=jnp.bool_), axis=1)
  return jnp.where(keep_NG[:, :, None], grouped, -jnp.inf).reshape(n, e)


def _token_weights(mask_N: jax.Array | None, n: int) -> jax.Array:
  return jnp.ones((n,), jnp.float32) if mask_N is None else mask_N.astype(jnp.float32)


def tokens_per_expert(
  experts_Nk: jax.Array, num_experts: int, *, mask_N: jax.Array | None = None
) -> jax.Array:
  """How many (unmasked) tokens chose each expert: float32 ``[E]``, summing to ``k * N``."""
  w_N = _token_weights(mask_N, experts_Nk.shape[0])
  onehot_NkE = jax.nn.one_hot(experts_Nk, num_experts, dtype=jnp.float32)
  return jnp.einsum("NkE,N->E", onehot_NkE, w_N)


def load_balancing_loss(
  probs_NE: jax.Array, experts_Nk: jax.Array, *, mask_N: jax.Array | None = None
) -> jax.Array:
  """``E * sum_e f_e * P_e`` over the unmasked tokens (float32 scalar; 0 when all are masked).

  ``f_e``: the fraction of tokens with expert e among their k (so ``sum_e f_e = k``); ``P_e``: the
  mean router probability of e. Differentiable in ``probs`` only (the choice is discrete).
  """
  n, e = probs_NE.shape
  w_N = _token_weights(mask_N, n)
  count = jnp.maximum(jnp.sum(w_N), 1.0)
  f_E = tokens_per_expert(experts_Nk, e, mask_N=mask_N) / count
  p_E = jnp.einsum("NE,N->E", probs_NE.astype(jnp.float32), w_N) / count
  return e * jnp.sum(f_E * p_E)


def router_z_loss(logits_NE: jax.Array, *, mask_N: jax.Array | None = None) -> jax.Array:
  """``mean_n logsumexp(logits_n)^2`` over the unmasked tokens (ST-MoE), float32 scalar."""
  w_N = _token_weights(mask_N, logits_NE.shape[0])
  lse_N = jax.nn.logsumexp(logits_NE.astype(jnp.float32), axis=-1)
  return jnp.sum(jnp.square(lse_N) * w_N) / jnp.maximum(jnp.sum(w_N), 1.0)


class Sorted(NamedTuple):
  """The routed copies of the tokens in expert order (``sort_by_expert``)."""

  order_M: jax.Array  # int32: position m of the sorted list holds flat copy order_M[m] (= n*k + j)
  group_sizes_E: jax.Array  # int32 copies per expert, in expert order; sums to M = N * k


def sort_by_expert(experts_Nk: jax.Array, num_experts: int) -> Sorted:
  """A stable sort of the ``N * k`` token copies by expert: the layout of a grouped product."""
  flat_M = experts_Nk.reshape(-1)
  order = jnp.argsort(flat_M, stable=True).astype(jnp.int32)
  sizes = jnp.bincount(flat_M, length=num_experts).astype(jnp.int32)
  return Sorted(order, sizes)


def permute(x_ND: jax.Array, sorted_: Sorted, top_k: int) -> jax.Array:
  """Token rows copied into expert order: ``[M, D]`` with row m = ``x[order[m] // k]``."""
  return jnp.take(x_ND, sorted_.order_M // top_k, axis=0)


def unsort(y_MD: jax.Array, sorted_: Sorted, weights_Nk: jax.Array) -> jax.Array:
  """The expert outputs ``[M, D]`` (expert order) back per token, weighted and summed:
  ``[N, D]``."""
  n, k = weights_Nk.shape
  inverse_M = jnp.argsort(sorted_.order_M).astype(jnp.int32)
  y_NkD = jnp.take(y_MD, inverse_M, axis=0).reshape(n, k, -1)
  return jnp.einsum("NkD,Nk->ND", y_NkD, weights_Nk.astype(y_MD.dtype))


def capacity(num_tokens: int, top_k: int, num_experts: int, factor: float) -> int:
  """An expert's capacity: ``ceil(factor * N * k / E)`` copies (at least 1)."""
  if not factor > 0:
    raise ValueError(f"capacity_factor={factor!r} must be > 0")
  return max(1, math.ceil(factor * num_tokens * top_k / num_experts))


def capacity_slots(
  experts_Nk: jax.Array, num_experts: int, cap: int
) -> tuple[jax.Array, jax.Array]:
  """Each copy's slot in its expert's buffer of ``cap``, first come first served in token order
  (a token's best choice before its second: Switch's priority by position).

  Returns:
    ``(slot_Nk, kept_Nk)``: int32 slot (``cap`` for a dropped copy) and whether it fits.
  """
  n, k = experts_Nk.shape
  # Order: all first choices by token, then all second choices, ... (choice-major).
  onehot_KNE = jax.nn.one_hot(experts_Nk.T, num_experts, dtype=jnp.int32)
  flat = onehot_KNE.reshape(k * n, num_experts)
  before = jnp.cumsum(flat, axis=0) - flat  # copies of the same expert ahead of this one
  slot_KN = jnp.sum(before * flat, axis=-1).reshape(k, n)
  kept = slot_KN < cap
  return jnp.where(kept, slot_KN, cap).T.astype(jnp.int32), kept.T
