"""The run directory: the one owner of its format. Programs (train, eval, generate, fill-mask,
convert, bench) open runs only through this module.

```
RUN_DIR/
  config.yaml      the experiment as run (dataset path absolute)
  model.yaml       the model config (family + every field)
  dataset.json     the dataset: absolute path, content hash, vocabulary size, task
  checkpoints/     orbax steps <N>/{params, opt_state, meta} (last N kept) and best/
  metrics.jsonl    one JSON object a line (training lines: step, loss, ...; eval lines: val_loss)
  final.json       the last metrics and learning-bar results of a finished run
  .lock            held (flock) by the trainer that owns the directory
```

Every snapshot file is written atomically (temporary file + rename), and only once the caller has
validated what it writes. A checkpoint step is verified when restored (tree structure, shapes and
dtypes against the target, finite parameters); a damaged step is named in a warning and the newest
good one is used. Multi-host: every process calls the checkpoint methods (orbax synchronises them);
process 0 alone writes the snapshot files.
"""

from __future__ import annotations

import contextlib
import errno
import gc
import hashlib
import json
import logging
import os
import shutil
import sys
from typing import Any, Iterator

import jax
import jax.numpy as jnp
import numpy as np
import orbax.checkpoint as ocp
import yaml
from jax.sharding import Mesh, NamedSharding, PartitionSpec as P, Sharding

from transformer_jax import models

CONFIG, MODEL, DATASET, METRICS, FINAL, LOCK = (
    "config.yaml", "model.yaml", "dataset.json", "metrics.jsonl", "final.json", ".lock")
CHECKPOINTS = "checkpoints"
# What a run writes: removed by ``RunDir.clear`` (``--force-new``), nothing else is touched.
_OWNED = (CONFIG, MODEL, DATASET, METRICS, FINAL, CHECKPOINTS, "tensorboard", "loss.png",
          "samples.txt")


class RunLocked(ValueError):
  """Another process holds the run directory."""


class CheckpointDamaged(ValueError):
  """No checkpoint step of a directory can be restored intact."""


# -------------------------------------------------------------------------------------------------
# Files.


def load_yaml(path: str) -> Any:
  """The YAML document in ``path``; a ``ValueError`` naming the file and line when it is broken."""
  with open(path) as f:
    text = f.read()
  try:
    return yaml.safe_load(text)
  except yaml.YAMLError as e:
    mark = getattr(e, "problem_mark", None)
    where = f"{path}:{mark.line + 1}" if mark is not None else path
    problem = getattr(e, "problem", None) or str(e).splitlines()[0]
    raise ValueError(f"{where}: broken YAML: {problem}") from None


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
  return {"path": path, "hash": dataset_fingerprint(path), "vocab_size": dataset.vocab_size,
          "task": dataset.task}


def check_vocab(dataset_vocab: int, config: models.ModelConfig, where: str) -> None:
  """Refuses a dataset whose ids do not fit the model's vocabulary (or that leaves it unused)."""
  if dataset_vocab != config.vocab_size:
    raise ValueError(f"the dataset {where} has vocab_size={dataset_vocab} but the model has "
                     f"vocab_size={config.vocab_size}; use the dataset the model was trained on")


def model_spec(config: models.ModelConfig) -> dict[str, Any]:
  """A YAML-able description of ``config``: its family and every field."""
  return models.config_to_dict(config)


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
    spec = load_yaml(path)
    try:
      return models.config_from_dict(spec)
    except (TypeError, KeyError) as e:
      raise ValueError(f"{path}: not a model config ({type(e).__name__}: {e})") from None

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
    path = self.file(DATASET)
    if not os.path.exists(path):
      return None
    with open(path) as f:
      try:
        return json.load(f)
      except json.JSONDecodeError as e:
        raise ValueError(f"{path}:{e.lineno}: broken JSON: {e.msg}") from None

  def write_snapshot(self, config: dict | None, model_config: models.ModelConfig,
                     dataset: dict | None) -> None:
    """Writes ``config.yaml``, ``model.yaml`` and ``dataset.json`` (process 0; call it only once
    everything they describe has been checked)."""
    if jax.process_index() != 0:
      return
    os.makedirs(self.path, exist_ok=True)
    if config is not None:
      write_atomic(self.file(CONFIG), yaml.safe_dump(config, sort_keys=False))
    write_atomic(self.file(MODEL), yaml.safe_dump(model_spec(model_config), sort_keys=False))
    if dataset is not None:
      write_atomic(self.file(DATASET), json.dumps(dataset, indent=2) + "\n")

  def read_final(self) -> dict | None:
    path = self.file(FINAL)
    if not os.path.exists(path):
      return None
    with open(path) as f:
      return json.load(f)

  def write_final(self, final: dict) -> None:
    if jax.process_index() == 0:
      write_atomic(self.file(FINAL), json.dumps(final, indent=2) + "\n")

  def clear(self) -> None:
    """Removes what a run wrote (``--force-new``); other files in the directory stay."""
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
    """Holds ``.lock`` (an exclusive ``flock``) while the body runs; a second holder is refused."""
    import fcntl
    os.makedirs(self.path, exist_ok=True)
    f = open(self.file(LOCK), "a+")
    try:
      fcntl.flock(f, fcntl.LOCK_EX | fcntl.LOCK_NB)
    except BlockingIOError:
      f.seek(0)
      holder = f.read().strip() or "another process"
      f.close()
      raise RunLocked(f"run_dir {self.path} is in use by {holder} (lock {self.file(LOCK)}); "
                      "wait for it to finish or use another run_dir") from None
    f.seek(0)
    f.truncate()
    f.write(f"pid {os.getpid()}\n")
    f.flush()
    try:
      yield
    finally:
      fcntl.flock(f, fcntl.LOCK_UN)
      f.close()


# -------------------------------------------------------------------------------------------------
# Checkpoints.


def default_sharding() -> Sharding:
  """Where a restored array goes when its target names no sharding.

  A single process: its first local device. A multi-process job: replicated over every device, so
  that each process holds the arrays it computes with.
  """
  if jax.process_count() == 1:
    return jax.sharding.SingleDeviceSharding(jax.local_devices()[0])
  return NamedSharding(Mesh(np.asarray(jax.devices()), ("devices",)), P())


def abstract_target(tree, sharding: Sharding | None = None):
  """``tree`` as ``ShapeDtypeStruct`` leaves for a restore, each with a sharding.

  Leaves may be arrays or ``ShapeDtypeStruct``; a leaf's own sharding is kept. Leaves without one
  get ``sharding`` (default :func:`default_sharding`), since orbax can only fall back on the
  sharding saved in the checkpoint, which names the devices of the job that wrote it.
  """
  fallback = default_sharding() if sharding is None else sharding

  def leaf(x):
    s = ocp.utils.to_shape_dtype_struct(x)
    if not isinstance(s, jax.ShapeDtypeStruct) or s.sharding is not None:
      return s
    return jax.ShapeDtypeStruct(s.shape, s.dtype, sharding=fallback)

  return jax.tree.map(leaf, tree)


@jax.jit
def _finite_leaves(tree):
  return [jnp.all(jnp.isfinite(x)) for x in jax.tree.leaves(tree)
          if jnp.issubdtype(x.dtype, jnp.inexact)]


def _path(path) -> str:
  keys = [getattr(k, "key", getattr(k, "name", getattr(k, "idx", k))) for k in path]
  return ".".join(str(k) for k in keys if k != "value")


def nonfinite_leaves(tree) -> list[str]:
  """Paths of the floating-point leaves of ``tree`` holding a NaN or an infinity."""
  flags = jax.device_get(_finite_leaves(tree))
  paths = [_path(p) for p, x in jax.tree_util.tree_leaves_with_path(tree)
           if jnp.issubdtype(x.dtype, jnp.inexact)]
  return [p for p, ok in zip(paths, flags) if not ok]


def verify_tree(what: str, tree, target) -> None:
  """Raises ``ValueError`` unless ``tree`` has ``target``'s structure, shapes and dtypes."""
  got, want = jax.tree.structure(tree), jax.tree.structure(target)
  if got != want:
    got_paths = {_path(p) for p, _ in jax.tree_util.tree_leaves_with_path(tree)}
    want_paths = {_path(p) for p, _ in jax.tree_util.tree_leaves_with_path(target)}
    missing, extra = sorted(want_paths - got_paths), sorted(got_paths - want_paths)
    raise ValueError(f"{what}: tree structure differs (missing {missing[:3]}, unexpected "
                     f"{extra[:3]})")
  for (path, x), t in zip(jax.tree_util.tree_leaves_with_path(tree), jax.tree.leaves(target)):
    if tuple(x.shape) != tuple(t.shape) or jnp.dtype(x.dtype) != jnp.dtype(t.dtype):
      raise ValueError(f"{what}.{_path(path)}: {x.dtype}{list(x.shape)}, expected "
                       f"{t.dtype}{list(t.shape)}")


def warn(message: str) -> None:
  """One warning line on stderr (process 0)."""
  if jax.process_index() == 0:
    print(f"warning: {message}", file=sys.stderr, flush=True)


def _reason(e: BaseException) -> str:
  text = str(e).strip().splitlines()
  first = text[0].split(" See full TensorStore details")[0] if text else ""
  return f"{type(e).__name__}: {first}"[:240]


def _is_abandoned_read(unraisable) -> bool:
  """An "Exception ignored in coroutine" report of a read orbax abandoned on a damaged step."""
  return (getattr(unraisable.object, "__qualname__", "").startswith("_read_array")
          or _raised_by_a_read(unraisable.exc_value))


# How orbax and TensorStore word a failed read of a checkpoint's array.
_READ_ERROR = "while reading array index"
_STORE_READ_ERROR = 'Error reading "'


def _raised_by_a_read(exc: BaseException | None) -> bool:
  """Whether ``exc`` (or an exception it chains) comes from orbax's array reads."""
  seen = 0
  while exc is not None and seen < 8:
    if _READ_ERROR in str(exc) or _STORE_READ_ERROR in str(exc):
      return True
    tb = exc.__traceback__
    while tb is not None:
      if tb.tb_frame.f_code.co_name.startswith("_read_array"):
        return True
      tb = tb.tb_next
    exc, seen = exc.__cause__ or exc.__context__, seen + 1
  return False


class _DropAbandonedReads(logging.Filter):
  """Drops asyncio's "Task exception was never retrieved" / "Exception in callback" records of
  the reads orbax abandons on a damaged step (they can come after the loop is closed)."""

  def filter(self, record: logging.LogRecord) -> bool:
    text = record.getMessage()
    if "_read_array" in text or _READ_ERROR in text or _STORE_READ_ERROR in text:
      return False
    return not (record.exc_info and _raised_by_a_read(record.exc_info[1]))


@contextlib.contextmanager
def _quiet_aborted_reads():
  """Drops the "Exception ignored in coroutine" reports of the reads orbax abandons when a step
  is damaged: the damage is reported once, by name, instead. Those coroutines may be collected
  later, on orbax's event-loop thread or at exit, so the filter stays installed (once) and drops
  nothing else."""
  hook = sys.unraisablehook
  if not getattr(hook, "drops_abandoned_reads", False):
    def drop(unraisable, previous=hook):
      if not _is_abandoned_read(unraisable):
        previous(unraisable)
    drop.drops_abandoned_reads = True
    sys.unraisablehook = drop
  asyncio_log = logging.getLogger("asyncio")
  if not any(isinstance(f, _DropAbandonedReads) for f in asyncio_log.filters):
    asyncio_log.addFilter(_DropAbandonedReads())
  try:
    yield
  finally:
    gc.collect()


@contextlib.contextmanager
def _naming(directory: str):
  """Gives an ``OSError`` that names no file (orbax's background metadata writes raise a bare
  ``[Errno 28]`` when the disk fills) the checkpoint directory it was writing to."""
  try:
    yield
  except OSError as e:
    if e.errno is None or e.filename is not None:
      raise
    raise OSError(e.errno, e.strerror or os.strerror(e.errno), directory) from e


class Checkpoints:
  """Last-N training checkpoints plus the best parameters by validation loss.

  A training step holds ``params``, ``opt_state`` and ``meta`` (JSON: step, loader state, and
  ``params_only`` for a converted model, which has no optimizer state).
  """

  def __init__(self, directory: str, *, keep: int = 3, async_save: bool = True):
    directory = os.path.abspath(directory)
    self.directory = directory
    self.latest = ocp.CheckpointManager(
        directory, options=ocp.CheckpointManagerOptions(
            max_to_keep=keep, enable_async_checkpointing=async_save, create=True))
    self.best = ocp.CheckpointManager(
        os.path.join(directory, "best"), options=ocp.CheckpointManagerOptions(
            max_to_keep=1, best_fn=lambda m: m["val_loss"], best_mode="min",
            enable_async_checkpointing=async_save, create=True))

  def latest_step(self) -> int | None:
    return self.latest.latest_step()

  def save(self, step: int, params, opt_state, meta: dict[str, Any]) -> None:
    with _naming(self.directory):   # a failed earlier async save surfaces here
      self.latest.save(step, args=ocp.args.Composite(
          params=ocp.args.StandardSave(params), opt_state=ocp.args.StandardSave(opt_state),
          meta=ocp.args.JsonSave(meta)))

  def save_best(self, step: int, params, val_loss: float) -> None:
    # Two managers saving the same step at once would run orbax's multi-host barriers under the
    # same names ("... is already ongoing"): let the training checkpoint finish first.
    with _naming(self.directory):
      if jax.process_count() > 1:
        self.latest.wait_until_finished()
      self.best.save(step, args=ocp.args.Composite(params=ocp.args.StandardSave(params)),
                     metrics={"val_loss": float(val_loss)})

  def read_meta(self, step: int) -> dict:
    """The ``meta`` item of ``step``, read from its file."""
    path = os.path.join(self.directory, str(step), "meta", "metadata")
    if not os.path.exists(path):
      raise ValueError(f"item meta/ is missing ({path})")
    with open(path) as f:
      return json.load(f)

  def restore(self, step: int, params, opt_state, *, sharding: Sharding | None = None):
    """Restores and verifies ``(params, opt_state, meta)`` of ``step``.

    Args:
      step: The checkpoint step.
      params: Target parameters: arrays or ``ShapeDtypeStruct`` leaves. Each restored array takes
        the leaf's sharding, so a mesh different from the one that saved is fine.
      opt_state: Target optimizer state, likewise.
      sharding: For leaves without a sharding (default :func:`default_sharding`).

    Returns:
      ``(params, opt_state, meta)``; ``opt_state`` is None only for a step written by
      :func:`save_model` (``meta["params_only"]``): start a fresh optimizer then.

    Raises:
      ValueError: the step is damaged (a missing item, unreadable or truncated files, a tree,
        shape or dtype that differs from the target, or non-finite parameters), named.
    """
    meta = self.read_meta(step)
    params_only = bool(meta.get("params_only"))
    has_opt = os.path.isdir(os.path.join(self.directory, str(step), "opt_state"))
    if not params_only and not has_opt:
      raise ValueError("item opt_state/ is missing (the optimizer state would be lost)")
    for item in ("params",) + (() if params_only else ("opt_state",)):
      if not os.path.exists(os.path.join(self.directory, str(step), item, "_METADATA")):
        raise ValueError(f"{item}/_METADATA is missing")
    target_p = abstract_target(params, sharding)
    items = dict(params=ocp.args.StandardRestore(target_p))
    if not params_only:
      target_o = abstract_target(opt_state, sharding)
      items["opt_state"] = ocp.args.StandardRestore(target_o)
    out = self.latest.restore(step, args=ocp.args.Composite(**items))
    verify_tree("params", out.params, target_p)
    restored_opt = None
    if not params_only:
      restored_opt = out.opt_state
      verify_tree("opt_state", restored_opt, target_o)
    bad = nonfinite_leaves(out.params)
    if bad:
      raise ValueError(f"non-finite parameters in {', '.join(bad[:3])}")
    return out.params, restored_opt, meta

  def restore_newest_good(self, params, opt_state, *, sharding: Sharding | None = None):
    """Restores the newest step that passes :meth:`restore`'s checks.

    Returns:
      ``(step, params, opt_state, meta, damaged)`` with ``damaged`` the newer steps skipped, as
      ``[(step, reason)]``; each was named in a warning line. ``step`` is None when there is none.

    Raises:
      CheckpointDamaged: steps exist but none is intact (every reason listed).
    """
    damaged = []
    steps = sorted(self.latest.all_steps(), reverse=True)
    for step in steps:
      try:
        with _quiet_aborted_reads():
          p, o, meta = self.restore(step, params, opt_state, sharding=sharding)
      except Exception as e:  # orbax, tensorstore and our checks each have their own errors
        reason = _reason(e)
        damaged.append((step, reason))
        warn(f"checkpoint step {step} in {self.directory} is damaged ({reason}); trying the "
             "previous step")
        continue
      return step, p, o, meta, damaged
    if damaged:
      raise CheckpointDamaged(f"no intact checkpoint in {self.directory}: " + "; ".join(
          f"step {s}: {r}" for s, r in damaged))
    return None, None, None, None, []

  def set_aside(self, steps: list[int]) -> None:
    """Moves damaged steps to ``damaged-<step>`` (kept for inspection, out of orbax's sight), so
    that training can write those steps again. Reopens the manager."""
    if not steps:
      return
    options = self.latest._options  # noqa: SLF001 (the same options as when opened)
    self.latest.close()
    if jax.process_index() == 0:
      for step in steps:
        src = os.path.join(self.directory, str(step))
        dst = os.path.join(self.directory, f"damaged-{step}")
        if os.path.exists(dst):
          shutil.rmtree(dst)
        os.rename(src, dst)
    self.latest = ocp.CheckpointManager(self.directory, options=options)

  def wait(self) -> None:
    with _naming(self.directory):
      self.latest.wait_until_finished()
      self.best.wait_until_finished()

  def close(self) -> None:
    with _naming(self.directory):
      self.latest.close()
      self.best.close()


def restore_params(directory: str, config: models.ModelConfig, *, best: bool = False,
                   target=None, sharding: Sharding | None = None):
  """The verified model parameters of the latest (or best) intact checkpoint, and its step.

  Args:
    directory: A ``checkpoints/`` directory.
    config: The model's config (gives the parameter shapes).
    best: Restore ``best/`` (the lowest validation loss) instead of the latest step.
    target: Parameter shapes with shardings (``ShapeDtypeStruct`` leaves) to restore into; default
      the model's shapes.
    sharding: For target leaves without a sharding (default :func:`default_sharding`).

  Raises:
    ValueError: no checkpoint, or none intact (each damaged step named).
  """
  directory = os.path.abspath(directory)
  if best:
    directory = os.path.join(directory, "best")
  if not os.path.isdir(directory):
    raise ValueError(f"no checkpoint found in {directory}")
  abstract = abstract_target(models.init_abstract(config) if target is None else target, sharding)
  manager = ocp.CheckpointManager(directory)
  try:
    steps = sorted(manager.all_steps(), reverse=True)
    if best and manager.best_step() is not None:
      steps.remove(manager.best_step())
      steps.insert(0, manager.best_step())
    if not steps:
      raise ValueError(f"no checkpoint found in {directory}")
    damaged = []
    for step in steps:
      try:
        with _quiet_aborted_reads():
          params = manager.restore(step, args=ocp.args.Composite(
              params=ocp.args.StandardRestore(abstract))).params
        verify_tree("params", params, abstract)
        bad = nonfinite_leaves(params)
        if bad:
          raise ValueError(f"non-finite parameters in {', '.join(bad[:3])}")
      except Exception as e:  # orbax, tensorstore and our checks each have their own errors
        damaged.append((step, _reason(e)))
        warn(f"checkpoint step {step} in {directory} is damaged ({_reason(e)}); trying the "
             "previous step")
        continue
      return params, step
    raise CheckpointDamaged(f"no intact checkpoint in {directory}: " + "; ".join(
        f"step {s}: {r}" for s, r in damaged))
  finally:
    manager.close()


# -------------------------------------------------------------------------------------------------
# Models alone (``tjax convert``).


def save_model(run_dir: str, config: models.ModelConfig, params) -> None:
  """Writes a new run directory holding ``config`` and ``params`` (step 0, no optimizer state).

  ``tjax eval`` reads it, and ``tjax train`` fine-tunes from it (the optimizer starts fresh).

  Raises:
    ValueError: ``run_dir`` exists and is not empty (nothing there is touched).
  """
  rd = RunDir(run_dir)
  if not rd.is_empty():
    raise ValueError(f"{rd.path} exists and is not empty; give a new directory to write to")
  rd.check_usable()
  bad = nonfinite_leaves(params)
  if bad:
    raise ValueError(f"non-finite parameters in {', '.join(bad[:3])}; nothing written")
  ckpt = Checkpoints(rd.checkpoint_dir, async_save=False)
  try:
    ckpt.latest.save(0, args=ocp.args.Composite(
        params=ocp.args.StandardSave(params),
        meta=ocp.args.JsonSave({"step": 0, "loader": None, "params_only": True})))
    ckpt.wait()
  finally:
    ckpt.close()
  rd.write_snapshot(None, config, None)  # last: a directory with model.yaml is complete


def load_model(run_dir: str, *, best: bool = False):
  """``(config, params)`` from a run directory written by ``tjax train`` or ``save_model``."""
  rd = RunDir(run_dir)
  config = rd.require_model()
  params, _ = restore_params(rd.checkpoint_dir, config, best=best)
  return config, params


def describe_oserror(e: OSError) -> str:
  """One line for an ``OSError``: what failed and on which path."""
  reason = e.strerror or os.strerror(e.errno) if e.errno else str(e)
  if e.errno == errno.ENOSPC:
    reason = "no space left on the device"
  path = e.filename if e.filename is not None else ""
  return f"{path}: {reason}" if path else reason
