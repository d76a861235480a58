"""The two layouts of a mixture of experts' weights in Hugging Face checkpoints.

transformers 5 stores each layer's experts stacked: ``mlp.experts.gate_up_proj`` ``[E, 2F, D]``
(gate rows, then up rows) and ``mlp.experts.down_proj`` ``[E, D, F]``, with the router as
``mlp.gate.weight``. Older checkpoints keep one tensor per expert: Mixtral's
``block_sparse_moe.experts.{e}.w1/w3/w2.weight`` (gate, up, down) and ``block_sparse_moe.gate``,
Qwen-MoE's ``mlp.experts.{e}.gate_proj/up_proj/down_proj.weight``. ``stack`` turns the older
layout into the stacked one (what the parameter table reads); ``unstack`` writes it back.
``with_dense_layers``: the table of a model with plain MLP layers among the expert layers
(Qwen3-MoE's ``mlp_only_layers``), whose two kinds of layer are stacked apart.
"""

from __future__ import annotations

import dataclasses
import re

import numpy as np

from transformer_jax.hf.errors import CheckpointError, listing

_PER_EXPERT = re.compile(
  r"^(?P<layer>.*)\.(?P<block>block_sparse_moe|mlp)\.experts\.(?P<e>\d+)\."
  r"(?P<name>w1|w2|w3|gate_proj|up_proj|down_proj)\.weight$"
)
_ROLE = {"w1": "gate", "w3": "up", "w2": "down", "gate_proj": "gate", "up_proj": "up"}
_ROLE["down_proj"] = "down"
NAMES = {"mixtral": ("w1", "w3", "w2"), "qwen3_moe": ("gate_proj", "up_proj", "down_proj")}
BLOCK = {"mixtral": "block_sparse_moe", "qwen3_moe": "mlp"}


def stack(tensors: dict[str, np.ndarray]) -> dict[str, np.ndarray]:
  """``tensors`` with every layer's per-expert weights stacked (and Mixtral's
  ``block_sparse_moe.gate`` named ``mlp.gate``); a checkpoint already stacked comes back as is.

  Raises:
    CheckpointError: a layer whose experts are not numbered 0..E-1 for each of gate, up and down
      (the missing ones listed).
  """
  layers: dict[str, dict[str, dict[int, np.ndarray]]] = {}
  out = {}
  for key, value in tensors.items():
    m = _PER_EXPERT.match(key)
    if m is None:
      out[re.sub(r"\.block_sparse_moe\.gate\.weight$", ".mlp.gate.weight", key)] = value
      continue
    roles = layers.setdefault(m["layer"], {"gate": {}, "up": {}, "down": {}})
    roles[_ROLE[m["name"]]][int(m["e"])] = value
  missing = []
  for layer, roles in layers.items():
    e = 1 + max(max(r, default=-1) for r in roles.values())
    for role, by_expert in roles.items():
      missing += [f"{layer} expert {i} {role}" for i in range(e) if i not in by_expert]
    if missing:
      continue
    gate, up, down = (np.stack([roles[r][i] for i in range(e)]) for r in ("gate", "up", "down"))
    out[f"{layer}.mlp.experts.gate_up_proj"] = np.concatenate([gate, up], axis=1)
    out[f"{layer}.mlp.experts.down_proj"] = down
  if missing:
    raise CheckpointError("per-expert weights are incomplete:\n" + listing("missing", missing))
  return out


def unstack(tensors: dict[str, np.ndarray], family: str) -> dict[str, np.ndarray]:
  """The stacked layout of ``tensors`` written per expert, with the names of ``family``
  ("mixtral" or "qwen3_moe")."""
  gate_name, up_name, down_name = NAMES[family]
  block = BLOCK[family]
  out = {}
  for key, value in tensors.items():
    if key.endswith(".mlp.experts.gate_up_proj"):
      layer = key[: -len(".mlp.experts.gate_up_proj")]
      gate, up = np.split(value, 2, axis=1)
      for e in range(value.shape[0]):
        out[f"{layer}.{block}.experts.{e}.{gate_name}.weight"] = np.ascontiguousarray(gate[e])
        out[f"{layer}.{block}.experts.{e}.{up_name}.weight"] = np.ascontiguousarray(up[e])
    elif key.endswith(".mlp.experts.down_proj"):
      layer = key[: -len(".mlp.experts.down_proj")]
      for e in range(value.shape[0]):
        out[f"{layer}.{block}.experts.{e}.{down_name}.weight"] = np.ascontiguousarray(value[e])
    elif key.endswith(".mlp.gate.weight"):
      out[key.replace(".mlp.gate.weight", f".{block}.gate.weight")] = value
    else:
      out[key] = value
  return out


def with_dense_layers(c, build):
  """The parameter table (``params.Table``) of a decoder whose ``dense_layers`` keep the plain
  MLP among mixture-of-experts layers: the per-layer rules of the expert layers
  (``blocks.layers``) and of the dense ones (``blocks.dense_layers``), each at its Hugging Face
  layer indices. ``build(config)``: the table of a config without ``dense_layers``."""
  dense_ids = tuple(c.dense_layers)
  moe_ids = tuple(i for i in range(c.num_layers) if i not in dense_ids)
  moe_table = build(dataclasses.replace(c, dense_layers=()))
  dense = build(dataclasses.replace(c, num_experts=0, dense_layers=()))
  rules = [r for r in moe_table.rules if not r.num_layers]
  rules += [
    dataclasses.replace(r, num_layers=len(moe_ids), layer_ids=moe_ids)
    for r in moe_table.rules
    if r.num_layers
  ]
  rules += [
    dataclasses.replace(
      r,
      ours=tuple(p.replace("blocks.layers.", "blocks.dense_layers.", 1) for p in r.ours),
      num_layers=len(dense_ids),
      layer_ids=dense_ids,
    )
    for r in dense.rules
    if r.num_layers
  ]
  return dataclasses.replace(moe_table, rules=rules)
