"""Experiment configs: YAML files in ``experiments/`` plus dotted ``key=value`` overrides.

Sections: ``model`` (a preset plus any model-config field), ``data``, ``train``, ``mesh``,
``kernels`` (the kernel table, ``backends.KernelTable``) and the top-level ``run_dir``. Every key
is checked: an unknown key or a wrong type raises ``ValueError`` naming it (``train.stpes: unknown
key; expected one of ...``).
"""

from __future__ import annotations

import dataclasses
import difflib
import math
import os
from typing import Any, Literal

import yaml

from transformer_jax import models, runs
from transformer_jax.backends import KernelTable
from transformer_jax.data.mixture import MixtureError, MixtureSource, MixtureStage, check_mixture
from transformer_jax.train import finetune
from transformer_jax.lora import LoRAConfig
from transformer_jax.runs.schema import FieldError, build_section, coerce, parse_yaml, typed_fields


@dataclasses.dataclass(frozen=True)
class DataConfig:
  path: str | None = None  # a prepared dataset directory (tjax prepare)
  inputs: tuple[str, ...] = ()  # prepared into `path` on first use if it is missing
  task: Literal["gpt", "bert", "seq2seq", "classify"] = "gpt"
  tokenizer: str = "cl100k_base"
  compact_vocab: bool | int = False  # true: ids the corpus uses; N: its N most frequent
  val_fraction: float = 0.05
  mask_prob: float = 0.15  # BERT masked-LM rate
  vocab_from: str | None = None  # classify: reuse this dataset's tokenizer/vocabulary
  # GPT only: prepared datasets read by weight (data.mixture); `path` then names the one whose
  # validation split evaluates (default the first source).
  mixture: tuple[MixtureSource, ...] = ()
  stages: tuple[MixtureStage, ...] = ()  # the mixture's weights from a step on
  max_epochs: int | None = None  # a mixture source may not start more epochs than this

  @property
  def dataset_path(self) -> str | None:
    """The dataset the run evaluates on and takes its vocabulary from."""
    return self.path or (self.mixture[0].path if self.mixture else None)


@dataclasses.dataclass(frozen=True)
class TrainConfig:
  steps: int = 1000
  batch_size: int = 16  # global batch (all processes, all devices)
  seq_len: int = 128  # GPT/BERT window; ignored by seq2seq (bucketed)
  # Gradient accumulation inside the step. "auto": 1 unless the step's temporaries pass what the
  # CPU allocator reuses, then the fewest that fit (backends.cpu.microbatches).
  microbatches: int | Literal["auto"] = "auto"
  seed: int = 0
  lr: float = 1e-3
  schedule: Literal["cosine", "linear", "rsqrt", "constant"] = "cosine"
  warmup_steps: int = 100
  min_lr_ratio: float = 0.1  # cosine/linear decay to lr * min_lr_ratio
  weight_decay: float = 0.1  # not applied to biases, norm scales
  b1: float = 0.9
  b2: float = 0.95
  eps: float = 1e-8
  clip_norm: float | None = 1.0
  label_smoothing: float = 0.0
  z_loss: float = 0.0
  # GPT's loss head: "logits" (the [B, T, V] logits, then the cross-entropy) or "fused"
  # (ops.linear_cross_entropy chunk by chunk: no [B, T, V] array, less memory).
  loss_head: Literal["logits", "fused"] = "logits"
  dtype: str | None = None  # compute dtype override (e.g. bfloat16); params stay fp32
  log_every: int = 10
  # [a, b]: a profiler trace of steps a + 1 to b in RUN_DIR/profile/ (train.profile).
  profile_steps: tuple[int, ...] | None = None
  # Seconds a step is meant to take: the dry run prints the loader rate it needs.
  target_step_time: float | None = None
  eval_every: int = 200
  eval_batches: int = 20
  checkpoint_every: int = 200
  keep_checkpoints: int = 3
  async_checkpoints: bool = True
  samples: int = 3  # generated samples printed at the end (GPT)
  sample_tokens: int = 48
  lora: LoRAConfig | None = None  # rank/alpha/targets: train only adapters (and a head)


@dataclasses.dataclass(frozen=True)
class MeshConfig:
  data: int = -1  # -1: every remaining device
  fsdp: int = 1
  tensor: int = 1
  sequence: int = 1
  expert: int = 1  # mixture-of-experts weights split over this many devices (parallel/experts.py)


@dataclasses.dataclass(frozen=True)
class Experiment:
  run_dir: str
  model: dict[str, Any]  # {"preset": name, **model-config overrides}
  data: DataConfig
  train: TrainConfig
  mesh: MeshConfig
  bars: dict[str, Any] = dataclasses.field(
    default_factory=dict
  )  # learning bars to check at the end
  # The experiment whose run is model.init_from: trained first when that run directory is absent.
  pretrain: str | None = None
  # The kernels' levers (backends.KernelTable): they change the compiled program, not the model.
  kernels: KernelTable = dataclasses.field(default_factory=KernelTable)

  def model_config(self, **defaults) -> models.ModelConfig:
    """The model config: preset, then ``defaults`` (e.g. the dataset's vocab size), then the
    YAML."""
    spec = dict(self.model)
    if self.train.dtype is not None:
      spec.setdefault("dtype", self.train.dtype)
    init_from = spec.pop("init_from", None)
    if init_from is not None:  # the pretrained model's architecture, the YAML's keys on top
      extra = {k: v for k, v in defaults.items() if k != "vocab_size"}
      return finetune.model_config(init_from, {**extra, **spec})
    if "family" in spec:  # a complete config, as in a run directory's model.yaml
      return models.config_from_dict({**defaults, **spec})
    preset = spec.pop("preset", None)
    if preset is None:
      raise ValueError(
        "model.preset (or a full model with model.family) is required; "
        "see `tjax info` for the presets"
      )
    return models.get_config(preset, **{**defaults, **spec})

  def to_dict(self) -> dict[str, Any]:
    out = dataclasses.asdict(self)
    out["data"]["inputs"] = list(self.data.inputs)
    out["data"]["mixture"] = [dataclasses.asdict(m) for m in self.data.mixture]
    out["data"]["stages"] = [dataclasses.asdict(m) for m in self.data.stages]
    if self.train.profile_steps is not None:
      out["train"]["profile_steps"] = list(self.train.profile_steps)
    if out["train"]["lora"] is not None:
      out["train"]["lora"]["targets"] = list(self.train.lora.targets)
    out["kernels"] = self.kernels.to_dict()
    return out

  def absolute(self) -> "Experiment":
    """This experiment with ``run_dir``, ``data.path`` and ``data.inputs`` made absolute (a run
    directory must work from any folder)."""

    def absolute(p):
      return None if p is None else os.path.abspath(p)

    def absolute_input(p):  # the named inputs (stdlib, synthetic:TASK) are not paths
      named = (
        p.startswith("synthetic:")
        or p.startswith("stdlib:")
        or (p in ("stdlib", "stdlib-tests") and not os.path.exists(p))
      )
      return p if named else os.path.abspath(p)

    data = dataclasses.replace(
      self.data,
      path=absolute(self.data.path),
      inputs=tuple(absolute_input(p) for p in self.data.inputs),
      vocab_from=absolute(self.data.vocab_from),
      mixture=tuple(dataclasses.replace(m, path=absolute(m.path)) for m in self.data.mixture),
    )
    model = dict(self.model)
    if isinstance(model.get("init_from"), str):
      model["init_from"] = os.path.abspath(model["init_from"])
    return dataclasses.replace(
      self,
      run_dir=os.path.abspath(self.run_dir),
      data=data,
      model=model,
      pretrain=absolute(self.pretrain),
    )


def flatten(tree: dict, prefix: str = "") -> dict[str, Any]:
  """``{"train": {"lr": 1}}`` -> ``{"train.lr": 1}`` (``bars`` stays one value)."""
  out = {}
  for key, value in tree.items():
    name = f"{prefix}{key}"
    if isinstance(value, dict) and name != "bars":
      out.update(flatten(value, name + "."))
    else:
      out[name] = value
  return out


def changed_keys(old: dict, new: dict) -> list[tuple[str, Any, Any]]:
  """``(key, old, new)`` of every dotted key whose value differs between two ``to_dict`` trees."""
  a, b = flatten(old), flatten(new)
  return [(k, a.get(k), b.get(k)) for k in sorted(set(a) | set(b)) if a.get(k) != b.get(k)]


def fixed_changes(old: dict, new: dict) -> list[tuple[str, Any, Any]]:
  """The changes from ``old`` to ``new`` that an existing run refuses: :data:`FIXED` keys, and
  turning clipping on or off (the optimizer state changes structure)."""
  out = []
  for key, a, b in changed_keys(old, new):
    fixed = any(key == f or key.startswith(f + ".") for f in FIXED)
    if fixed or (key == "train.clip_norm" and (a is None) != (b is None)):
      out.append((key, a, b))
  return out


# Learning bars: checked and reported at the end of a run (enforced with ``--check-bars``).
BARS = (
  "val_loss_below_unigram",
  "mlm_accuracy_over_baseline",
  "exact_match",
  "accuracy_over_majority",
)
# What defines an existing run: its model, its data and the order it reads them in. A resumed run
# may change anything else (steps, optimisation, logging, mesh), as MaxText and HF Trainer allow.
FIXED = (
  "model",
  "data",
  "train.batch_size",
  "train.seq_len",
  "train.seed",
  "train.dtype",
  "train.lora",
)

_TOP = ("run_dir", "model", "data", "train", "mesh", "bars", "pretrain", "kernels")
# The sections every experiment file spells out; mesh, bars, pretrain and kernels may be left out.
REQUIRED = ("run_dir", "model", "data", "train")


def _unknown(where: str, key: str, choices) -> FieldError:
  close = difflib.get_close_matches(str(key), list(choices), n=1)
  hint = f" (did you mean {close[0]!r}?)" if close else ""
  return FieldError(
    f"{where}{key}", f"{where}{key}: unknown key{hint}; expected one of {', '.join(choices)}"
  )


def _set_dotted(tree: dict, dotted: str, value: Any) -> None:
  keys = dotted.split(".")
  node = tree
  for key in keys[:-1]:
    node = node.setdefault(key, {})
    if not isinstance(node, dict):
      raise ValueError(f"{dotted}: {key} is not a section")
  node[keys[-1]] = value


def parse_overrides(items: list[str]) -> list[tuple[str, Any]]:
  """``["train.steps=200", "model.d_model=64"]`` -> ``[("train.steps", 200), ...]`` (YAML
  values)."""
  out = []
  for item in items:
    if "=" not in item:
      raise ValueError(f"override {item!r} must look like section.key=value")
    key, text = item.split("=", 1)
    if not all(part.strip() for part in key.split(".")):
      raise ValueError(
        f"override {item!r}: the key {key!r} has an empty part; it looks like section.key=value"
      )
    try:
      value = parse_yaml(text) if text != "" else None
    except yaml.YAMLError:
      raise ValueError(f"override {item!r}: the value is not valid YAML") from None
    out.append((key.strip(), value))
  return out


def read_config_file(path: str) -> dict:
  """The mapping of sections in the YAML file ``path``.

  Raises:
    ValueError: the path is missing or not a file, the file is empty, not UTF-8, not valid YAML,
      or not a mapping (each message names the file).
  """
  if not os.path.isfile(path):
    raise ValueError(
      f"experiment config {path!r} not found"
      if not os.path.exists(path)
      else f"experiment config {path!r} is not a file"
    )
  raw = runs.load_yaml(path)
  if raw is None:
    raise ValueError(f"{path} is empty; an experiment has the sections {', '.join(REQUIRED)}")
  if not isinstance(raw, dict):
    raise ValueError(
      f"{path}: expected a mapping of sections ({', '.join(_TOP)}), got {type(raw).__name__}"
    )
  return raw


def load_experiment(
  path: str | None, overrides: list[str] = (), *, raw: dict | None = None, source: str | None = None
) -> Experiment:
  """Reads a YAML experiment (or ``raw``), applies ``key=value`` overrides and validates it.

  A file must hold every section of :data:`REQUIRED` (after the overrides); ``raw`` (a stored
  ``config.yaml``, a mapping built in Python) takes the defaults of the sections it lacks.

  Args:
    path: the YAML file (None: ``raw``).
    overrides: dotted ``key=value`` overrides.
    raw: the sections, read already.
    source: the file ``raw`` was read from, to name in errors (a run's ``config.yaml``).

  Raises:
    ValueError: the file cannot be read, lacks a required section, or a key or value is wrong.
      A bad key or value from the file is named with the file (``e.yaml: train.lr='x': expected a
      number``); one given as an override is named alone.
  """
  parsed = parse_overrides(list(overrides))
  if raw is None:
    raw = read_config_file(path)
  try:
    return _build(dict(raw), parsed, path)
  except FieldError as e:
    overridden = any(e.key == k or e.key.startswith(k + ".") for k, _ in parsed)
    where = path or source
    if where is None or overridden:
      raise
    raise ValueError(f"{where}: {e}") from None


def _build(raw: dict, overrides: list[tuple[str, Any]], path: str | None) -> Experiment:
  for key in raw:
    if key not in _TOP:
      raise _unknown("", key, _TOP)
  for key, value in overrides:
    top = key.split(".")[0]
    if top not in _TOP:
      raise _unknown("", top, _TOP)
    if "." not in key:
      raw[key] = value
    else:
      if raw.get(top) is not None and not isinstance(raw[top], dict):
        raise FieldError(top, f"{top}: expected a mapping, got {raw[top]!r}")
      raw[top] = dict(raw.get(top) or {})
      _set_dotted(raw, key, value)
  if path is not None:
    missing = [k for k in REQUIRED if raw.get(k) in (None, {})]
    if missing:
      plural = "s" if len(missing) > 1 else ""
      raise ValueError(
        f"{path} has no {', '.join(missing)} section{plural}; an experiment "
        f"needs {', '.join(REQUIRED)} (the defaults of a whole section are never "
        "taken silently)"
      )
  run_dir = raw.get("run_dir")
  if not isinstance(run_dir, str) or not run_dir:
    raise FieldError("run_dir", f"run_dir={run_dir!r}: expected a directory path")
  model = raw.get("model")
  if model is not None and not isinstance(model, dict):
    raise FieldError("model", f"model: expected a mapping, got {model!r}")
  bars = raw.get("bars")
  if bars is not None and not isinstance(bars, dict):
    raise FieldError("bars", f"bars: expected a mapping, got {bars!r}")
  exp = Experiment(
    run_dir=run_dir,
    model=model_section(dict(model or {})),
    data=build_section(DataConfig, "data", _indexed(raw.get("data"))),
    train=build_section(TrainConfig, "train", raw.get("train")),
    mesh=build_section(MeshConfig, "mesh", raw.get("mesh")),
    bars=dict(bars or {}),
    pretrain=raw.get("pretrain"),
    kernels=KernelTable.from_dict(raw.get("kernels"), where="kernels"),
  )
  if exp.pretrain is not None and not isinstance(exp.pretrain, str):
    raise FieldError(
      "pretrain", f"pretrain={exp.pretrain!r}: expected the path of an experiment YAML"
    )
  _validate(exp)
  return exp


# What names the model rather than being one of its config fields.
_MODEL_KEYS = ("preset", "family", "init_from")


def model_section(model: dict) -> dict:
  """The ``model`` section with every model-config field checked against its type (the preset's
  or family's config class): ``rope_theta: 1e6`` is the float 1e6, ``d_model: 6.5`` is refused
  naming ``model.d_model``. Unknown fields are refused with the closest name. With
  ``model.init_from`` the class is the pretrained run's, checked when the config is built.

  Raises:
    FieldError: a bad preset or family, an unknown field, or a value of the wrong type.
  """
  for key in _MODEL_KEYS:
    if key in model and not isinstance(model[key], str):
      raise FieldError(
        f"model.{key}",
        f"model.{key}={model[key]!r}: expected a "
        + ("run directory path" if key == "init_from" else "name"),
      )
  if "family" in model:
    try:
      cls = type(models.config_from_dict({"family": model["family"]}))
    except ValueError as e:
      raise FieldError("model.family", f"model.{e}") from None
  elif "preset" in model:
    try:
      cls = type(models.get_config(model["preset"]))
    except ValueError as e:
      raise FieldError("model.preset", f"model.preset: {e}") from None
  else:
    return model
  fields = [f.name for f in dataclasses.fields(cls)]
  for key in model:
    if key not in fields and key not in _MODEL_KEYS:
      raise _unknown("model.", key, fields)
  return typed_fields(cls, model, "model.")


def _check_range(name: str, value, lo, hi, lo_in: bool, hi_in: bool) -> None:
  ok = (value >= lo if lo_in else value > lo) and (value <= hi if hi_in else value < hi)
  if not ok:
    interval = f"{'[' if lo_in else '('}{lo}, {hi}{']' if hi_in else ')'}"
    raise FieldError(name, f"{name}={value} must lie in {interval}")


def _check_profile_steps(t: TrainConfig) -> None:
  p = t.profile_steps
  if p is None:
    return
  if len(p) != 2 or not 0 <= p[0] < p[1] <= t.steps:
    raise FieldError(
      "train.profile_steps",
      f"train.profile_steps={list(p)}: expected [a, b] with 0 <= a < b <= "
      f"train.steps={t.steps} (the trace covers steps a + 1 to b)",
    )


def _validate(exp: Experiment) -> None:
  t = exp.train
  for name in (
    "steps",
    "batch_size",
    "seq_len",
    "microbatches",
    "log_every",
    "eval_every",
    "eval_batches",
    "checkpoint_every",
    "keep_checkpoints",
  ):
    if name == "microbatches" and t.microbatches == "auto":
      continue
    if getattr(t, name) < 1:
      raise FieldError(f"train.{name}", f"train.{name}={getattr(t, name)} must be >= 1")
  if t.microbatches != "auto" and t.batch_size % t.microbatches:
    raise FieldError(
      "train.microbatches",
      f"train.microbatches={t.microbatches} does not divide train.batch_size={t.batch_size}",
    )
  _check_profile_steps(t)
  ranges = {  # name: (low, high, low included, high included)
    "lr": (0.0, math.inf, False, False),
    "min_lr_ratio": (0.0, 1.0, True, True),
    "weight_decay": (0.0, math.inf, True, False),
    "b1": (0.0, 1.0, True, False),
    "b2": (0.0, 1.0, True, False),
    "eps": (0.0, math.inf, False, False),
    "label_smoothing": (0.0, 1.0, True, False),
    "z_loss": (0.0, math.inf, True, False),
    "warmup_steps": (0, math.inf, True, False),
    "samples": (0, math.inf, True, False),
    "sample_tokens": (1, math.inf, True, False),
  }
  for name, (lo, hi, lo_in, hi_in) in ranges.items():
    _check_range(f"train.{name}", getattr(t, name), lo, hi, lo_in, hi_in)
  if t.clip_norm is not None:
    _check_range("train.clip_norm", t.clip_norm, 0.0, math.inf, False, False)
  if t.target_step_time is not None:
    _check_range("train.target_step_time", t.target_step_time, 0.0, math.inf, False, False)
  d = exp.data
  _check_range("data.mask_prob", d.mask_prob, 0.0, 1.0, False, False)
  if not isinstance(d.compact_vocab, bool) and d.compact_vocab < 1:
    raise FieldError(
      "data.compact_vocab",
      f"data.compact_vocab={d.compact_vocab}: expected true, false or a count of ids >= 1",
    )
  if d.val_fraction <= 0:
    raise FieldError(
      "data.val_fraction",
      f"data.val_fraction={d.val_fraction} must be > 0 (a fraction, or a count of documents)",
    )
  for name in ("data", "fsdp", "tensor", "sequence", "expert"):
    size = getattr(exp.mesh, name)
    if size != -1 and size < 1:
      raise FieldError(
        f"mesh.{name}", f"mesh.{name}={size} must be >= 1 (or -1: every remaining device)"
      )
  for key, value in exp.bars.items():
    if key not in BARS:
      raise _unknown("bars.", key, BARS)
    if isinstance(value, bool) or not isinstance(value, (int, float)) or not math.isfinite(value):
      raise FieldError(f"bars.{key}", f"bars.{key}={value!r}: expected a finite number")
  _validate_mixture(d)
  if d.path is None and not d.inputs and not d.mixture:
    raise FieldError("data", "data.path, data.inputs or data.mixture must be given")
  init_from = exp.model.get("init_from")
  if init_from is not None and ("preset" in exp.model or "family" in exp.model):
    raise FieldError(
      "model.init_from",
      "model.init_from takes the pretrained model's architecture: drop model.preset/model.family",
    )
  if "preset" not in exp.model and "family" not in exp.model and init_from is None:
    raise FieldError(
      "model.preset",
      "model.preset (or a full model with model.family) is "
      "required; see `tjax info` for the presets",
    )


def _indexed(data: Any) -> Any:
  """``data``, its mixture and stage entries checked first with their index in the error
  (``data.mixture[1].weight=inf: ...``)."""
  for key, cls in (("mixture", MixtureSource), ("stages", MixtureStage)):
    items = data.get(key) if isinstance(data, dict) else None
    for i, item in enumerate(items if isinstance(items, list) else ()):
      coerce(f"data.{key}[{i}]", item, cls)
  return data


def _validate_mixture(d: DataConfig) -> None:
  """``data.mixture``/``stages``/``max_epochs`` (``data.mixture.check_mixture``): GPT only, from
  prepared datasets."""
  try:
    check_mixture(d.mixture, d.stages, d.max_epochs)
  except MixtureError as e:
    raise FieldError(e.key, str(e)) from None
  if d.mixture and d.task != "gpt":
    raise FieldError(
      "data.mixture", f"data.mixture applies to the gpt task (causal LM), not data.task={d.task!r}"
    )
  if d.mixture and d.inputs:
    raise FieldError(
      "data.inputs", "data.inputs with data.mixture: prepare each source (tjax prepare) first"
    )
