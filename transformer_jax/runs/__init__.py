"""The run directory: the one owner of its format. Programs (train, eval, generate, fill-mask,
convert, bench) open runs only through this package.

```
RUN_DIR/
  config.yaml      the experiment as run (dataset path absolute)
  model.yaml       the model config (family + every field)
  dataset.json     the dataset: absolute path, content hash, vocabulary size, task
  checkpoints/     orbax steps <N>/{params, opt_state, meta} (last N kept) and best/
  metrics.jsonl    one JSON object a line (training lines: step, loss, ...; eval lines: val_loss)
  final.json       the last metrics and learning-bar results of a finished run
  .lock            held (flock) by the trainer that owns the directory
  .tjax-run        the marker, written first: only a directory carrying it (or an older run's
                   files, ``RunDir.is_unmarked_run``) is trained in, resumed or cleared
```

Every snapshot file is written atomically (temporary file + rename), and only once the caller has
validated what it writes. Multi-host: every process calls the checkpoint methods (orbax
synchronises them); process 0 alone writes the snapshot files.

Modules: ``schema`` (the YAML loader and typed fields every reader uses), ``directory`` (the
files, the snapshot and the lock), ``checkpoints`` (orbax steps, best
parameters, models saved alone), ``load`` (a trained run's model and tokenizer: ``load_run``),
``trees`` (restore targets and tree verification),
``orbax_errors`` (orbax's failures as one named line).
"""

from transformer_jax.runs.checkpoints import (
  CheckpointDamaged,
  Checkpoints,
  load_model,
  restore_params,
  save_model,
)
from transformer_jax.runs.directory import (
  CHECKPOINTS,
  CONFIG,
  DATASET,
  FINAL,
  HF_SPECIAL_IDS,
  LOCK,
  MARKER,
  METRICS,
  MODEL,
  RunDir,
  RunLocked,
  check_vocab,
  dataset_fingerprint,
  dataset_ref,
  describe_oserror,
  load_yaml,
  model_from_spec,
  model_spec,
  read_json,
  warn,
  write_atomic,
)
from transformer_jax.runs.load import load_run
from transformer_jax.runs.schema import FieldError, parse_yaml
from transformer_jax.runs.trees import (
  abstract_target,
  default_sharding,
  nonfinite_leaves,
  verify_tree,
)

__all__ = [
  "CHECKPOINTS",
  "CONFIG",
  "CheckpointDamaged",
  "Checkpoints",
  "DATASET",
  "FINAL",
  "HF_SPECIAL_IDS",
  "LOCK",
  "MARKER",
  "METRICS",
  "MODEL",
  "RunDir",
  "RunLocked",
  "abstract_target",
  "check_vocab",
  "dataset_fingerprint",
  "dataset_ref",
  "default_sharding",
  "describe_oserror",
  "FieldError",
  "load_model",
  "load_run",
  "load_yaml",
  "model_from_spec",
  "model_spec",
  "nonfinite_leaves",
  "parse_yaml",
  "read_json",
  "restore_params",
  "save_model",
  "verify_tree",
  "warn",
  "write_atomic",
]
