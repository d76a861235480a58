"""The run directory's files: snapshots written atomically, the dataset reference, the lock.

Checkpoints live in ``checkpoints/`` and belong to :mod:`transformer_jax.runs.checkpoints`; this
module only lists their committed steps (from the directory names).
"""

from __future__ import annotations

import contextlib
import dataclasses
import errno
import hashlib
import json
import os
import shutil
import sys
from typing import Any, Iterator

import jax
import yaml

from transformer_jax import models
from transformer_jax.runs.schema import parse_yaml, typed_fields

CONFIG, MODEL, DATASET, METRICS, FINAL, LOCK, MARKER = (
  "config.yaml",
  "model.yaml",
  "dataset.json",
  "metrics.jsonl",
  "final.json",
  ".lock",
  ".tjax-run",
)
CHECKPOINTS = "checkpoints"
# A model converted from Hugging Face: the checkpoint's special-token ids (``hf.convert``).
HF_SPECIAL_IDS = "hf_special_ids.json"
# What the marker says to a reader who finds it.
_MARKER_TEXT = "A transformer_jax run directory: tjax writes, resumes and clears what it made.\n"
# What a run writes: removed by ``RunDir.clear`` (``--force-new``), nothing else is touched.
_OWNED = (
  CONFIG,
  MODEL,
  DATASET,
  METRICS,
  FINAL,
  CHECKPOINTS,
  "tensorboard",
  "loss.png",
  "samples.txt",
  "init_from.json",
  HF_SPECIAL_IDS,
)
# What a start leaves before its snapshot: the lock, and the dataset prepared into the default
# ``data.path`` (RUN_DIR/data).
_STARTED = (LOCK, "data")


def _finite(value: Any) -> bool:
  return (
    isinstance(value, (int, float))
    and not isinstance(value, bool)
    and value == value
    and abs(value) != float("inf")
  )


class RunLocked(ValueError):
  """Another process holds the run directory."""


# -------------------------------------------------------------------------------------------------
# Files.


def load_yaml(path: str) -> Any:
  """The YAML document in ``path`` (``schema.parse_yaml``: exponent floats are floats).

  Raises:
    ValueError: the file is not UTF-8 or not valid YAML (naming the file and line).
  """
  with open(path, "rb") as f:
    data = f.read()
  try:
    text = data.decode("utf-8")
  except UnicodeDecodeError as e:
    raise ValueError(
      f"{path}: not UTF-8 text (byte {data[e.start]:#04x} at offset {e.start})"
    ) from None
  try:
    return parse_yaml(text)
  except yaml.YAMLError as e:
    mark = getattr(e, "problem_mark", None)
    where = f"{path}:{mark.line + 1}" if mark is not None else path
    problem = getattr(e, "problem", None) or str(e).splitlines()[0]
    raise ValueError(f"{where}: broken YAML: {problem}") from None


def read_json(path: str, expect: type = dict) -> Any:
  """The JSON document in ``path``, which must be a ``expect`` (an object by default).

  Raises:
    ValueError: the file is not UTF-8, not valid JSON or not a ``expect`` (naming the file).
  """
  with open(path, "rb") as f:
    data = f.read()
  try:
    value = json.loads(data.decode("utf-8"))
  except UnicodeDecodeError as e:
    raise ValueError(f"{path}: not UTF-8 text (offset {e.start})") from None
  except json.JSONDecodeError as e:
    raise ValueError(f"{path}:{e.lineno}: broken JSON: {e.msg}") from None
  if not isinstance(value, expect):
    kind = "an object" if expect is dict else f"a JSON {expect.__name__}"
    raise ValueError(f"{path}: expected {kind}, got a JSON {type(value).__name__}")
  return value


def model_from_spec(spec: Any, where: str) -> models.ModelConfig:
  """The model config of a ``model.yaml``-style mapping (``family`` plus fields), each field
  checked against its type.

  Raises:
    ValueError: naming ``where`` and the field: not a mapping, an unknown family or field, a
      value of the wrong type or out of range.
  """
  if not isinstance(spec, dict):
    raise ValueError(f"{where}: expected a mapping of model fields, got {type(spec).__name__}")
  try:
    cls = type(models.config_from_dict({"family": spec.get("family")}))
    fields = {f.name for f in dataclasses.fields(cls)}
    unknown = sorted(set(spec) - fields - {"family"})
    if unknown:
      raise ValueError(f"{cls.__name__} has no field(s) {', '.join(map(str, unknown))}")
    return models.config_from_dict(typed_fields(cls, spec, ""))
  except (ValueError, TypeError) as e:
    raise ValueError(f"{where}: {e}") from None


def write_atomic(path: str, text: str) -> None:
  """Writes ``text`` to ``path`` through a temporary file and a rename: never half a file."""
  tmp = f"{path}.tmp{os.getpid()}"
  try:
    with open(tmp, "w") as f:
      f.write(text)
      f.flush()
      os.fsync(f.fileno())
    os.replace(tmp, path)
  finally:
    if os.path.exists(tmp):
      os.remove(tmp)


def dataset_fingerprint(path: str) -> str:
  """SHA-256 over the names and contents of the files of a prepared dataset directory."""
  h = hashlib.sha256()
  for name in sorted(os.listdir(path)):
    file = os.path.join(path, name)
    if not os.path.isfile(file):
      continue
    h.update(name.encode() + b"\0")
    with open(file, "rb") as f:
      for block in iter(lambda: f.read(1 << 20), b""):
        h.update(block)
  return h.hexdigest()


def dataset_ref(dataset) -> dict[str, Any]:
  """What ``dataset.json`` records of a loaded ``data.Dataset``."""
  path = os.path.abspath(dataset.path)
  return {
    "path": path,
    "hash": dataset_fingerprint(path),
    "vocab_size": dataset.vocab_size,
    "task": dataset.task,
  }


def check_vocab(dataset_vocab: int, config: models.ModelConfig, where: str) -> None:
  """Refuses a dataset whose ids do not fit the model's vocabulary (or that leaves it unused)."""
  if dataset_vocab != config.vocab_size:
    raise ValueError(
      f"the dataset {where} has vocab_size={dataset_vocab} but the model has "
      f"vocab_size={config.vocab_size}; use the dataset the model was trained on"
    )


def model_spec(config: models.ModelConfig) -> dict[str, Any]:
  """A YAML-able description of ``config``: its family and every field."""
  return models.config_to_dict(config)


def warn(message: str) -> None:
  """One warning line on stderr (process 0)."""
  if jax.process_index() == 0:
    print(f"warning: {message}", file=sys.stderr, flush=True)


def describe_oserror(e: OSError) -> str:
  """One line for an ``OSError``: what failed and on which path."""
  reason = e.strerror or os.strerror(e.errno) if e.errno else str(e)
  if e.errno == errno.ENOSPC:
    reason = "no space left on the device"
  path = e.filename if e.filename is not None else ""
  return f"{path}: {reason}" if path else reason


# -------------------------------------------------------------------------------------------------
# The directory.


class RunDir:
  """A run directory (it need not exist yet). Paths are absolute."""

  def __init__(self, path: str | os.PathLike):
    self.path = os.path.abspath(os.fspath(path))
    self._lock_file = None

  def file(self, name: str) -> str:
    return os.path.join(self.path, name)

  @property
  def checkpoint_dir(self) -> str:
    return self.file(CHECKPOINTS)

  def exists(self) -> bool:
    return os.path.isdir(self.path)

  def is_empty(self) -> bool:
    return not self.exists() or not os.listdir(self.path)

  def check_usable(self) -> None:
    """Raises one line when the path cannot hold a run (a file, or no write permission)."""
    if os.path.exists(self.path) and not os.path.isdir(self.path):
      raise ValueError(f"run_dir {self.path} is not a directory")
    probe = self.path
    while not os.path.exists(probe):
      probe = os.path.dirname(probe)
    if not os.access(probe, os.W_OK | os.X_OK):
      raise ValueError(f"run_dir {self.path}: {probe} is not writable (permission denied)")
    if os.path.isdir(self.path) and not os.access(self.path, os.R_OK):
      raise ValueError(f"run_dir {self.path} is not readable (permission denied)")

  def is_marked(self) -> bool:
    """Whether the directory carries the marker (``.tjax-run``) every run and converted model
    writes first."""
    return os.path.isfile(self.file(MARKER))

  def mark(self) -> None:
    """Writes the marker (process 0), creating the directory: call it once the directory is known
    to be new, empty or a run's (``check_owned``)."""
    if jax.process_index() == 0 and not self.is_marked():
      os.makedirs(self.path, exist_ok=True)
      write_atomic(self.file(MARKER), _MARKER_TEXT)

  def check_owned(self) -> None:
    """Refuses a directory that holds something other than a run: a run writes ``config.yaml``,
    ``checkpoints/`` and more, and must neither replace nor (``--force-new``) delete files of the
    same names it did not create.

    A directory is a run's when it is empty, carries the marker (``.tjax-run``), holds only what a
    start leaves (``.lock``, ``data/``), or is a run written before the marker existed
    (``is_unmarked_run``).

    Raises:
      ValueError: naming the directory and (some of) the entries that are not a run's.
    """
    if not os.path.isdir(self.path) or self.is_marked():
      return
    entries = sorted(os.listdir(self.path))
    foreign = [e for e in entries if e not in _STARTED]
    if not foreign or self.is_unmarked_run():
      return
    listed = ", ".join(foreign[:5]) + (f" and {len(foreign) - 5} more" if len(foreign) > 5 else "")
    hint = ""
    if any(e in _OWNED for e in foreign):
      hint = (
        f"; if transformer_jax wrote them (before runs carried {MARKER}), create "
        f"{self.file(MARKER)} to take the directory as its run"
      )
    raise ValueError(
      f"run_dir {self.path} holds files that are not a run's ({listed}): it has no {MARKER}; "
      f"give a new or empty directory{hint}"
    )

  def is_unmarked_run(self) -> bool:
    """Whether the directory is a run written before runs carried the marker: a ``model.yaml``
    that reads as a model config, and either a ``config.yaml`` laid out as an experiment (a
    ``run_dir`` and ``model``, ``data`` and ``train`` sections) with ``metrics.jsonl`` or a
    committed checkpoint, or no ``config.yaml`` and a committed checkpoint (a converted model)."""
    try:
      if self.read_model() is None:
        return False
      config = self.read_config()
    except (ValueError, OSError):
      return False
    steps = self.checkpoint_steps()
    if config is None:
      return bool(steps)
    experiment = isinstance(config.get("run_dir"), str) and all(
      isinstance(config.get(k), dict) for k in ("model", "data", "train")
    )
    return experiment and (bool(steps) or os.path.isfile(self.file(METRICS)))

  # Snapshots.

  def read_config(self) -> dict | None:
    path = self.file(CONFIG)
    if not os.path.exists(path):
      return None
    raw = load_yaml(path)
    if not isinstance(raw, dict):
      raise ValueError(f"{path}: expected a mapping of sections")
    return raw

  def read_model(self) -> models.ModelConfig | None:
    path = self.file(MODEL)
    if not os.path.exists(path):
      return None
    return model_from_spec(load_yaml(path), path)

  def require_model(self) -> models.ModelConfig:
    """The model config of an existing run directory (what eval, generate and convert open).

    Raises:
      ValueError: the path is not a directory, or holds no model config.
    """
    if not self.exists():
      raise ValueError(f"{self.path} is not a directory")
    config = self.read_model()
    if config is None:
      raise ValueError(f"{self.path} is not a run directory (no {MODEL})")
    return config

  def read_dataset_ref(self) -> dict | None:
    """``dataset.json``: ``path`` (a string), ``hash`` (a string where given) and the rest as
    written; None when the file is absent.

    Raises:
      ValueError: a damaged file or a field of the wrong type (naming the file and the field).
    """
    path = self.file(DATASET)
    if not os.path.exists(path):
      return None
    ref = read_json(path)
    for key in ("path", "hash"):
      if (key == "path" or key in ref) and not isinstance(ref.get(key), str):
        raise ValueError(f"{path}: {key}={ref.get(key)!r}: expected a string")
    return ref

  def write_snapshot(
    self, config: dict | None, model_config: models.ModelConfig, dataset: dict | None
  ) -> None:
    """Writes ``config.yaml``, ``model.yaml`` and ``dataset.json`` (process 0; call it only once
    everything they describe has been checked)."""
    if jax.process_index() != 0:
      return
    self.mark()
    if config is not None:
      write_atomic(self.file(CONFIG), yaml.safe_dump(config, sort_keys=False))
    write_atomic(self.file(MODEL), yaml.safe_dump(model_spec(model_config), sort_keys=False))
    if dataset is not None:
      write_atomic(self.file(DATASET), json.dumps(dataset, indent=2) + "\n")

  def read_final(self) -> dict | None:
    """``final.json`` (an object), or None when the file is absent.

    Raises:
      ValueError: a damaged file (naming it).
    """
    path = self.file(FINAL)
    if not os.path.exists(path):
      return None
    final = read_json(path)
    if "step" in final and (isinstance(final["step"], bool) or not isinstance(final["step"], int)):
      raise ValueError(f"{path}: step={final['step']!r}: expected an integer")
    return final

  def read_metrics(self) -> list[dict]:
    """The records of ``metrics.jsonl``: JSON objects with an integer ``step`` whose ``loss`` and
    ``val_loss``, where present, are finite numbers. A line cut short by a crash (or otherwise
    damaged) is skipped: the checkpoint, not the log, is what a run resumes from."""
    path = self.file(METRICS)
    if not os.path.isfile(path):
      return []
    records = []
    with open(path, "rb") as f:
      for line in f:
        try:
          record = json.loads(line)
        except ValueError:  # not JSON, not UTF-8
          continue
        if (
          isinstance(record, dict)
          and isinstance(record.get("step"), int)
          and not isinstance(record["step"], bool)
          and all(_finite(record[k]) for k in ("loss", "val_loss") if k in record)
        ):
          records.append(record)
    return records

  def write_final(self, final: dict) -> None:
    if jax.process_index() == 0:
      write_atomic(self.file(FINAL), json.dumps(final, indent=2) + "\n")

  def clear(self) -> None:
    """Removes what a run wrote (``--force-new``); other files in the directory, and the marker,
    stay.

    Raises:
      ValueError: the directory is not a run's (``check_owned``); nothing is removed.
    """
    self.check_owned()
    for name in _OWNED:
      path = self.file(name)
      if os.path.isdir(path):
        shutil.rmtree(path)
      elif os.path.exists(path):
        os.remove(path)

  # Checkpoint steps, read from the directory names (no orbax manager needed).

  def checkpoint_steps(self, best: bool = False) -> list[int]:
    """The committed steps, ascending (orbax renames a step into place only once it is whole)."""
    root = os.path.join(self.checkpoint_dir, "best") if best else self.checkpoint_dir
    if not os.path.isdir(root):
      return []
    return sorted(int(n) for n in os.listdir(root) if n.isdigit())

  # The lock.

  @contextlib.contextmanager
  def lock(self) -> Iterator[None]:
    """Holds ``.lock`` (an exclusive ``flock``) while the body runs; a second holder is refused.

    When the body fails, what the lock itself created goes again: the ``.lock`` file, and the
    directory when the lock made it and nothing else was written into it (a refused start leaves
    no trace).
    """
    import fcntl  # noqa: PLC0415 - POSIX only; reading a run takes no lock

    created_dir = not os.path.isdir(self.path)
    os.makedirs(self.path, exist_ok=True)
    created_lock = not os.path.lexists(self.file(LOCK))
    try:
      # Never through a symbolic link: the lock's text is rewritten, and would be written into
      # whatever file the link names.
      fd = os.open(self.file(LOCK), os.O_RDWR | os.O_CREAT | getattr(os, "O_NOFOLLOW", 0), 0o644)
    except OSError as e:
      if created_dir:
        os.rmdir(self.path)
      if os.path.islink(self.file(LOCK)):
        raise ValueError(
          f"run_dir {self.path}: {LOCK} is a symbolic link; remove it (a run's "
          "lock is a plain file)"
        ) from None
      raise e
    f = os.fdopen(fd, "r+")
    try:
      fcntl.flock(f, fcntl.LOCK_EX | fcntl.LOCK_NB)
    except BlockingIOError:
      f.seek(0)
      holder = f.read().strip() or "another process"
      f.close()
      raise RunLocked(
        f"run_dir {self.path} is in use by {holder} (lock {self.file(LOCK)}); "
        "wait for it to finish or use another run_dir"
      ) from None
    f.seek(0)
    f.truncate()
    f.write(f"pid {os.getpid()}\n")
    f.flush()
    try:
      yield
    except BaseException:
      if created_lock:  # removed while still held: no other process takes a lock on it meanwhile
        with contextlib.suppress(OSError):
          os.remove(self.file(LOCK))
          if created_dir and not os.listdir(self.path):
            os.rmdir(self.path)
      raise
    finally:
      fcntl.flock(f, fcntl.LOCK_UN)
      f.close()
