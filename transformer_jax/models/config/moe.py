"""The mixture-of-experts fields of a decoder config (``GPTConfig``): their checks and the
``layers.moe.MoEKind`` they make. ``num_experts=0`` is a dense model and every other MoE field is
then ignored."""

from __future__ import annotations

from transformer_jax.layers.moe import MoEKind
from transformer_jax.models.config import checks


def validate(cfg) -> None:
  """Raises ``ValueError`` naming the MoE field and value the model cannot run."""
  n = cfg.num_experts
  if isinstance(n, bool) or not isinstance(n, int) or n < 0:
    raise ValueError(f"num_experts={n!r} must be an integer >= 0 (0: a dense model)")
  _dense_layers(cfg)
  if n == 0:
    return
  checks.positive(cfg, "experts_per_token", "router_groups", "router_topk_groups")
  if cfg.experts_per_token > n:
    raise ValueError(f"experts_per_token={cfg.experts_per_token} must be <= num_experts={n}")
  if cfg.expert_d_ff is not None:
    checks.positive(cfg, "expert_d_ff")
  if cfg.shared_expert_d_ff is not None:
    checks.positive(cfg, "shared_expert_d_ff")
  s = cfg.num_shared_experts
  if isinstance(s, bool) or not isinstance(s, int) or s < 0:
    raise ValueError(f"num_shared_experts={s!r} must be an integer >= 0")
  checks.choice(cfg, "router_scoring", ("softmax", "sigmoid"))
  if cfg.router_groups != 1:
    if cfg.router_scoring != "sigmoid":
      raise ValueError(f"router_groups={cfg.router_groups} needs router_scoring='sigmoid'")
    if n % cfg.router_groups:
      raise ValueError(f"router_groups={cfg.router_groups} must divide num_experts={n}")
    per_group = n // cfg.router_groups
    if not cfg.router_topk_groups <= cfg.router_groups or (
      cfg.router_topk_groups * per_group < cfg.experts_per_token
    ):
      raise ValueError(
        f"router_topk_groups={cfg.router_topk_groups} must be <= router_groups="
        f"{cfg.router_groups} and leave experts_per_token={cfg.experts_per_token} experts"
      )
  if cfg.capacity_factor is not None and not cfg.capacity_factor > 0:
    raise ValueError(f"capacity_factor={cfg.capacity_factor!r} must be > 0 or None (dropless)")
  for name in ("router_aux_coef", "router_z_coef"):
    if not getattr(cfg, name) >= 0:
      raise ValueError(f"{name}={getattr(cfg, name)!r} must be >= 0")
  mlp_bias = cfg.use_bias if getattr(cfg, "mlp_bias", None) is None else cfg.mlp_bias
  if mlp_bias:
    raise ValueError(
      "num_experts > 0: the experts and router have no biases; set mlp_bias=False (or "
      "use_bias=False)"
    )
  if not cfg.gated:
    raise ValueError("num_experts > 0: the experts are gated (SwiGLU); set gated=True")
  if cfg.reversible:
    raise ValueError("num_experts > 0 does not run as reversible layers: set reversible=False")
  if cfg.attention_kind != "softmax":
    raise ValueError(
      f"num_experts > 0 runs with softmax attention (attention_kind={cfg.attention_kind!r})"
    )


def _dense_layers(cfg) -> None:
  """``dense_layers``: distinct layer indices in ``[0, num_layers)``, not all of them, with
  experts; stored sorted, as a tuple (a YAML list is read as one)."""
  ids = cfg.dense_layers
  if isinstance(ids, list):
    ids = tuple(ids)
  if not isinstance(ids, tuple) or any(isinstance(i, bool) or not isinstance(i, int) for i in ids):
    raise ValueError(f"dense_layers={ids!r} must be a list of layer indices")
  object.__setattr__(cfg, "dense_layers", tuple(sorted(ids)))
  if not ids:
    return
  if not cfg.num_experts:
    raise ValueError(
      f"dense_layers={list(ids)} needs num_experts > 0 (without experts every layer is dense)"
    )
  outside = [i for i in ids if not 0 <= i < cfg.num_layers]
  if outside:
    raise ValueError(
      f"dense_layers={list(ids)}: {outside} outside [0, num_layers={cfg.num_layers})"
    )
  if len(set(ids)) != len(ids):
    twice = sorted({i for i in ids if ids.count(i) > 1})
    raise ValueError(f"dense_layers={list(ids)} names layers {twice} more than once")
  if len(ids) == cfg.num_layers:
    raise ValueError(f"dense_layers={list(ids)} makes every layer dense: set num_experts=0 instead")


def expert_layers(cfg) -> int:
  """How many layers are mixtures of experts (0 for a dense model)."""
  return cfg.num_layers - len(cfg.dense_layers) if cfg.num_experts else 0


def expert_width(cfg) -> int:
  """Each expert's hidden width (``expert_d_ff``, or ``d_ff``)."""
  return cfg.d_ff if cfg.expert_d_ff is None else cfg.expert_d_ff


def kind(cfg) -> MoEKind | None:
  """The blocks' ``MoEKind``, or None for a dense model."""
  if not cfg.num_experts:
    return None
  f = expert_width(cfg)
  return MoEKind(
    num_experts=cfg.num_experts,
    top_k=cfg.experts_per_token,
    d_ff=f,
    num_shared=cfg.num_shared_experts,
    shared_d_ff=f if cfg.shared_expert_d_ff is None else cfg.shared_expert_d_ff,
    scoring=cfg.router_scoring,
    normalize=cfg.router_norm_topk,
    num_groups=cfg.router_groups,
    topk_groups=cfg.router_topk_groups,
    routed_scale=cfg.routed_scale,
    capacity_factor=cfg.capacity_factor,
  )
