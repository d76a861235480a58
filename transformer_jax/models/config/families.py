"""What the model config families share beyond their fields: the union, layer scanning, dicts.

``ModelConfig`` is the union of the five config classes. ``unrolls_layers`` decides whether a
model's layer stack runs as one ``lax.scan`` or an unrolled loop. ``config_to_dict`` and
``config_from_dict`` turn any config into a YAML-able ``{"family": ..., **fields}`` mapping and
back, through one table from family name to class, so every family is found by both.
"""

from __future__ import annotations

import dataclasses

from transformer_jax import backends, ops
from transformer_jax.models.config.bert import BERTConfig
from transformer_jax.models.config.gpt import GPTConfig
from transformer_jax.models.config.mamba import MambaConfig
from transformer_jax.models.config.reformer import ReformerConfig
from transformer_jax.models.config.seq2seq import Seq2SeqConfig

ModelConfig = GPTConfig | BERTConfig | Seq2SeqConfig | MambaConfig | ReformerConfig

# "auto" unrolls at most this many layers in all (encoder and decoder together): the unrolled
# program's compile time grows with every layer (experiments/PERFORMANCE.md, "Unrolled layers").
UNROLL_MAX_LAYERS = 12


def unrolls_layers(config: ModelConfig, backend: backends.Backend | None = None) -> bool:
  """Whether ``config``'s layer stacks run as an unrolled loop instead of one ``lax.scan``.

  ``scan_layers`` true or false says so. ``"auto"`` (the default) unrolls a model of at most
  ``UNROLL_MAX_LAYERS`` layers where the backend asks for it (``Backend.unrolls_layers``: on a
  GPU, and on a CPU whose bfloat16 products run on its bf16 units); anything else, and
  everything on a TPU, is scanned. Unrolled, the step skips the scan's
  stacking of each layer's saved residuals and gradients, at the price of compiling every layer
  (experiments/PERFORMANCE.md, "Unrolled layers"). The parameters are stacked either way, so
  checkpoints do not depend on it.

  Args:
    config: a model config.
    backend: the backend the model runs on; default ``backends.current()``.
  """
  if config.scan_layers != "auto":
    return not config.scan_layers
  layers = (
    config.num_encoder_layers + config.num_decoder_layers
    if isinstance(config, Seq2SeqConfig)
    else config.num_layers
  )
  if layers > UNROLL_MAX_LAYERS:
    return False
  return (backend or backends.current()).unrolls_layers(config.dtype)


_FAMILIES = {
  "gpt": GPTConfig,
  "bert": BERTConfig,
  "seq2seq": Seq2SeqConfig,
  "mamba": MambaConfig,
  "reformer": ReformerConfig,
}


def config_to_dict(config: ModelConfig) -> dict:
  """``{"family": "gpt", **fields}``, YAML-able (RoPE scaling becomes a nested mapping)."""
  family = next(k for k, v in _FAMILIES.items() if isinstance(config, v))
  fields = {f.name: getattr(config, f.name) for f in dataclasses.fields(config)}
  if fields.get("rope_scaling") is not None:
    fields["rope_scaling"] = dataclasses.asdict(fields["rope_scaling"])
  # Tuples (per-head linear_decay, Mamba's layer_types, time_step_limit) as lists: YAML has no
  # tuple.
  fields = {k: list(v) if isinstance(v, tuple) else v for k, v in fields.items()}
  if fields.get("sparse_pattern") is not None:
    fields["sparse_pattern"] = dataclasses.asdict(fields["sparse_pattern"])
    fields["sparse_pattern"]["global_blocks"] = list(fields["sparse_pattern"]["global_blocks"])
  return {"family": family, **fields}


def config_from_dict(spec: dict) -> ModelConfig:
  """Inverse of ``config_to_dict``; unknown fields raise ``ValueError`` naming them."""
  spec = dict(spec)
  family = spec.pop("family", None)
  if family not in _FAMILIES:
    raise ValueError(f"family={family!r} must be one of {', '.join(_FAMILIES)}")
  cls = _FAMILIES[family]
  known = {f.name for f in dataclasses.fields(cls)}
  unknown = sorted(set(spec) - known)
  if unknown:
    raise ValueError(f"{cls.__name__} has no field(s) {', '.join(unknown)}")
  if isinstance(spec.get("rope_scaling"), dict):
    spec["rope_scaling"] = ops.RopeScaling(**spec["rope_scaling"])
  return cls(**spec)
