"""``tjax report``: one self-contained HTML page of one or several runs, and a PNG per picture.

The page holds each run's configuration, loss curves, final metrics and learning bars, samples,
attention maps for a text, its position encoding, learning-rate schedule and parameter breakdown;
with several runs, a comparison table and their curves on one figure. Images are embedded as
base64 data URIs, so the page opens offline and can be mailed as one file.
"""

from __future__ import annotations

import base64
import dataclasses
import html
import io
import math
import os
import re
from typing import Any

import numpy as np
import yaml
from flax import nnx
from matplotlib.figure import Figure

from transformer_jax import models, ops, runs, viz
from transformer_jax.data import load_dataset
from transformer_jax.train.config import load_experiment
from transformer_jax.train.optim import learning_rate_schedule

MAX_TEXT_TOKENS = 48  # attention maps past this many tokens are unreadable


@dataclasses.dataclass
class _Picture:
  file: str  # PNG name inside the output directory
  caption: str
  png: bytes


@dataclasses.dataclass
class _Run:
  name: str
  path: str
  config: models.ModelConfig
  raw_config: dict | None
  records: list[dict]
  final: dict
  samples: list[str]
  pictures: list[_Picture] = dataclasses.field(default_factory=list)
  notes: list[str] = dataclasses.field(default_factory=list)


def _png(fig: Figure) -> bytes:
  buf = io.BytesIO()
  fig.savefig(buf, format="png", dpi=100)
  return buf.getvalue()


def _number(value: Any) -> bool:
  return isinstance(value, (int, float)) and not isinstance(value, bool) and math.isfinite(value)


def _read_final(rd: runs.RunDir) -> dict:
  """``final.json`` of a run (empty when absent), its ``bars`` and ``samples`` checked.

  Raises:
    ValueError: a damaged file or field, naming the file and the field.
  """
  final = rd.read_final() or {}
  where = rd.file(runs.FINAL)
  bars = final.get("bars", {})
  if not isinstance(bars, dict) or not all(isinstance(v, dict) for v in bars.values()):
    raise ValueError(f"{where}: bars: expected an object of objects (bar -> its figures)")
  samples = final.get("samples", [])
  if not isinstance(samples, list) or not all(isinstance(x, str) for x in samples):
    raise ValueError(f"{where}: samples: expected a list of strings")
  return final


def _tokenizer(rd: runs.RunDir):
  """The tokenizer of the run's dataset, or None when the run names none that can be read."""
  ref = rd.read_dataset_ref()
  path = ref["path"] if ref else ((rd.read_config() or {}).get("data") or {}).get("path")
  if not path:
    return None
  try:
    return load_dataset(path).tokenizer
  except (FileNotFoundError, ValueError):
    return None


def _position_picture(config: models.ModelConfig, model) -> tuple[Figure, str] | None:
  # BERT has no choice: a learned table.
  position = getattr(config, "position", "learned")
  length = min(config.max_len, 256)
  match position:
    case "learned":
      table = np.asarray(model.pos_embed.embedding[...], np.float32)[:length]
      return (
        viz.positional_encoding(table, title="Learned position embeddings"),
        "Learned position table (rows of the trained embedding).",
      )
    case "sinusoidal":
      table = np.asarray(ops.sinusoidal_positions(length, config.d_model))
      return (
        viz.positional_encoding(table, title="Sinusoidal positional encoding"),
        "The fixed sinusoidal table added to the token embeddings.",
      )
    case "rope":
      return (
        viz.rope_angles(
          config.head_size, length, theta=config.rope_theta, scaling=config.rope_scaling
        ),
        "RoPE rotation angle of each feature pair at each position.",
      )
    case "alibi":
      return (
        viz.alibi_biases(config.num_heads, min(config.max_len, 24)),
        "ALiBi: the linear distance penalty each head adds to its logits.",
      )
  return None


def _attention_picture(config, model, tokenizer, text: str) -> tuple[Figure, str]:
  """Every layer's and head's attention weights for ``text`` (GPT: causal; BERT: all keys)."""
  ids = tokenizer.encode(text)
  if not ids:
    raise ValueError(f"--text {text!r} encodes to no tokens")
  limit = min(MAX_TEXT_TOKENS, config.max_len)
  note = ""
  if len(ids) > limit:
    note = f" (first {limit} of {len(ids)} tokens)"
    ids = ids[:limit]
  tokens = np.asarray(ids, np.int32)[None]
  labels = [tokenizer.decode([i]) for i in ids]
  weights = np.asarray(model.attention_weights(tokens))[:, 0]  # [L, N, T, S]
  t = len(ids)
  causal = isinstance(config, models.GPTConfig)
  mask = np.tril(np.ones((t, t), bool)) if causal else None
  kind = "causal self-attention" if causal else "bidirectional self-attention"
  fig = viz.attention_maps(
    weights, query_tokens=labels, mask=mask, title=f"Attention weights for {text!r}{note}"
  )
  caption = (
    f"Attention weights of every layer (rows) and head (columns), {kind}; each row of a "
    f"map is one query and sums to 1." + (" Grey: keys the causal mask hides." if causal else "")
  )
  return fig, caption


def _lr_picture(raw_config: dict | None) -> Figure | None:
  if not raw_config or "train" not in raw_config:
    return None
  try:
    train = load_experiment(None, raw={**raw_config, "run_dir": "-"}).train
  except ValueError:
    return None
  return viz.lr_schedule(
    learning_rate_schedule(train),
    train.steps,
    title=f"Learning rate ({train.schedule}, warmup {train.warmup_steps})",
  )


def _safe_name(name: str) -> str:
  return re.sub(r"[^A-Za-z0-9_.-]+", "_", name).strip("._") or "run"


def _collect(path: str, name: str, text: str | None, best: bool) -> _Run:
  rd = runs.RunDir(path)
  config = rd.require_model()
  final = _read_final(rd)
  samples = list(final.get("samples") or [])
  if not samples and os.path.isfile(rd.file("samples.txt")):
    with open(rd.file("samples.txt")) as f:
      samples = [s for s in f.read().split("\n\n") if s.strip()]
  run = _Run(name, path, config, rd.read_config(), rd.read_metrics(), final, samples)

  def add(kind: str, fig: Figure, caption: str) -> None:
    run.pictures.append(_Picture(f"{name}-{kind}.png", caption, _png(fig)))

  if any("loss" in r or "val_loss" in r for r in run.records):
    add("loss", viz.loss_curves({name: run.records}), "Training loss and validation loss.")
  if any(k.startswith("tokens/") for r in run.records for k in r):
    add("sources", viz.source_tokens(run.records), "Tokens read from each mixture source.")
  lr = _lr_picture(run.raw_config)
  if lr is not None:
    add("lr", lr, "Learning-rate schedule of the run's configuration.")

  model = None
  if rd.checkpoint_steps(best=best):
    _, params = runs.load_model(path, best=best)
    model = nnx.merge(models.graphdef(config), params)
    add("params", viz.parameter_breakdown(params, title=None), "Parameters per component.")
  else:
    run.notes.append("no checkpoint: the pictures that need trained weights are left out")
    add(
      "params",
      viz.parameter_breakdown(models.init_abstract(config)),
      "Parameters per component (from the configuration).",
    )

  position = (
    _position_picture(config, model)
    if (model is not None or getattr(config, "position", None) != "learned")
    else None
  )
  if position is not None:
    add("positions", *position)

  if text is not None and model is not None:
    if not hasattr(model, "attention_weights"):
      run.notes.append(f"attention maps: not drawn for a {type(config).__name__} model")
    else:
      tokenizer = _tokenizer(rd)
      if tokenizer is None:
        run.notes.append("attention maps: the run names no readable dataset for its tokenizer")
      else:
        add("attention", *_attention_picture(config, model, tokenizer, text))
  return run


def _last(records: list[dict], key: str) -> float | None:
  values = [r[key] for r in records if isinstance(r.get(key), (int, float))]
  return values[-1] if values else None


def _summary(run: _Run) -> dict[str, Any]:
  bars = run.final.get("bars") or {}
  return {
    "family": type(run.config).__name__.removesuffix("Config"),
    "position": getattr(run.config, "position", "-"),
    "parameters": f"{models.count_params(run.config):,}",
    "steps": run.final.get("step", _last(run.records, "step")),
    "train loss": _last(run.records, "loss"),
    "val loss": run.final.get("val_loss", _last(run.records, "val_loss")),
    "tokens/s": _last(run.records, "tokens_per_sec"),
    "bars": ", ".join(f"{k}: {'passed' if v.get('passed') else 'FAILED'}" for k, v in bars.items())
    or "-",
  }


def _fmt(value: Any) -> str:
  if value is None:
    return "-"
  if isinstance(value, float):
    return f"{value:.4g}"
  return str(value)


def _table(rows: list[dict[str, Any]], first: str) -> str:
  keys = list(rows[0][1].keys()) if rows else []
  head = "".join(f"<th>{html.escape(k)}</th>" for k in [first, *keys])
  body = "".join(
    "<tr><td>"
    + html.escape(name)
    + "</td>"
    + "".join(f"<td>{html.escape(_fmt(row[k]))}</td>" for k in keys)
    + "</tr>"
    for name, row in rows
  )
  return f"<table><tr>{head}</tr>{body}</table>"


def _img(p: _Picture) -> str:
  data = base64.b64encode(p.png).decode("ascii")
  return (
    f'<figure><img alt="{html.escape(p.file)}" src="data:image/png;base64,{data}">'
    f"<figcaption>{html.escape(p.caption)} <code>{html.escape(p.file)}</code>"
    f"</figcaption></figure>"
  )


_STYLE = """body{font-family:sans-serif;max-width:1200px;margin:2em auto;padding:0 1em;color:#222}
table{border-collapse:collapse;margin:0.5em 0}td,th{border:1px solid #ccc;padding:3px 8px;
text-align:left;font-size:14px}th{background:#f3f3f3}pre{background:#f7f7f7;padding:0.6em;
overflow-x:auto;font-size:13px}img{max-width:100%}figure{margin:1em 0}figcaption{font-size:13px;
color:#555}.note{color:#a40}"""


def _run_html(run: _Run) -> str:
  parts = [
    f"<h2>{html.escape(run.name)}</h2>",
    f"<p><code>{html.escape(os.path.abspath(run.path))}</code></p>",
  ]
  parts += [f'<p class="note">{html.escape(n)}</p>' for n in run.notes]
  parts.append("<h3>Configuration</h3>")
  spec = yaml.safe_dump(runs.model_spec(run.config), sort_keys=False)
  parts.append(f"<pre>{html.escape(spec)}</pre>")
  if run.raw_config:
    rest = {k: v for k, v in run.raw_config.items() if k != "model"}
    parts.append(f"<pre>{html.escape(yaml.safe_dump(rest, sort_keys=False))}</pre>")
  final = {k: v for k, v in run.final.items() if k not in ("samples", "bars")}
  if final:
    parts.append(
      "<h3>Final metrics</h3>" + _table([(k, {"value": v}) for k, v in final.items()], "metric")
    )
  bars = run.final.get("bars") or {}
  if bars:
    rows = [
      (
        k,
        {
          "passed": v.get("passed"),
          "figures": ", ".join(f"{a}={_fmt(b)}" for a, b in v.items() if a != "passed"),
        },
      )
      for k, v in bars.items()
    ]
    parts.append("<h3>Learning bars</h3>" + _table(rows, "bar"))
  if run.samples:
    parts.append("<h3>Samples</h3>" + "".join(f"<pre>{html.escape(s)}</pre>" for s in run.samples))
  parts.append("<h3>Pictures</h3>" + "".join(_img(p) for p in run.pictures))
  return "\n".join(parts)


def _field(path: str, prefix: str, value: dict, key: str, kind: str) -> Any:
  """``value[key]`` of the result file ``path`` (at the dotted ``prefix``), checked to be
  ``kind`` ("object" or "number")."""
  name = f"{prefix}.{key}" if prefix else key
  if key not in value:
    raise ValueError(f"{path}: {name}: missing")
  got = value[key]
  if kind == "object" and not isinstance(got, dict):
    raise ValueError(f"{path}: {name}: expected an object")
  if kind == "number" and not _number(got):
    raise ValueError(f"{path}: {name}={got!r}: expected a number")
  return got


def read_attention_result(path: str) -> dict:
  """``experiments/efficient_attention.py``'s result file, every field the page draws checked:
  ``setup`` (``steps``, ``train_len``), ``learning`` (kind -> ``val_loss``, ``params``), and
  ``train_step`` / ``decode`` (kind of ``learning`` -> token count -> ``step_s`` /
  ``step_ms``, ``cache_bytes``).

  Raises:
    ValueError: one line naming the file and the field.
  """
  result = runs.read_json(path)
  if not any(k in result for k in ("learning", "train_step", "decode")):
    raise ValueError(
      f"{path} is not a result of experiments/efficient_attention.py (it has no "
      "learning, train_step and decode)"
    )
  setup = _field(path, "", result, "setup", "object")
  for key in ("steps", "train_len"):
    _field(path, "setup", setup, key, "number")
  learning = _field(path, "", result, "learning", "object")
  for kind in learning:
    row = _field(path, "learning", learning, kind, "object")
    for key in ("val_loss", "params"):
      _field(path, f"learning.{kind}", row, key, "number")
  for section, values in (("train_step", ("step_s",)), ("decode", ("step_ms", "cache_bytes"))):
    rows = _field(path, "", result, section, "object")
    for kind in rows:
      if kind not in learning:
        raise ValueError(
          f"{path}: {section}.{kind}: not a kind of learning ({', '.join(learning)})"
        )
      by_length = _field(path, section, rows, kind, "object")
      for length in by_length:
        if not length.isdigit():
          raise ValueError(f"{path}: {section}.{kind}.{length}: expected a whole number of tokens")
        row = _field(path, f"{section}.{kind}", by_length, length, "object")
        for key in values:
          _field(path, f"{section}.{kind}.{length}", row, key, "number")
  return result


def _experiment_picture(path: str) -> tuple[dict, _Picture]:
  """An experiment's result file and its picture (``experiments/efficient_attention.py``'s JSON:
  validation loss, train step and decoding costs per attention kind)."""
  result = read_attention_result(path)
  name = _safe_name(os.path.splitext(os.path.basename(path))[0])
  return result, _Picture(
    f"{name}.png",
    "Attention kinds: validation loss, train step time "
    "against the context, decoding time and memory against the generated "
    "length.",
    _png(viz.efficient_attention(result)),
  )


def _experiment_html(path: str, result: dict, picture: _Picture) -> str:
  """Per kind: task, validation loss, parameters; train step speed against full attention's (its
  task's baseline, same run) and temporaries (MiB) at each length; decoding at the longest."""
  speed = {s: viz.attention_speedups(result, s, k) for s, k in _COSTS.items()}
  lengths = {s: sorted({int(t) for r in result[s].values() for t in r}) for s in _COSTS}
  rows = []
  for kind, r in result["learning"].items():
    row = {"task": r.get("task", "causal"), "val_loss": r["val_loss"], "params": r["params"]}
    for section, ts in (("train_step", lengths["train_step"]), ("decode", lengths["decode"][-1:])):
      name, memory = ("train step", "temp_bytes") if section == "train_step" else _DECODE
      for t in map(str, ts):
        row[f"{name} x full, {t}"] = speed[section].get(kind, {}).get(t)
        mem = result[section].get(kind, {}).get(t, {}).get(memory)
        row[f"{memory[:-6]} MiB, {t}"] = None if mem is None else mem / 2**20
    rows.append((kind, row))
  machine = result.get("machine", {})
  where = ", ".join(str(machine[k]) for k in ("cpu", "cores", "device") if k in machine)
  note = f"{where}; {result['conditions']}" if result.get("conditions") else where
  return (
    f"<h2>{html.escape(os.path.basename(path))}</h2><p>{html.escape(note)}</p>"
    + _table(rows, "attention")
    + _img(picture)
  )


_COSTS = {"train_step": "step_s", "decode": "step_ms"}  # section -> the time its speeds compare
_DECODE = ("decode", "cache_bytes")


def _unique_files(pictures: list[_Picture]) -> None:
  """Renames pictures whose file names repeat (``a.png``, ``a-2.png``): a run named ``compare``
  or a result named ``compare-loss.json`` never writes over another picture."""
  taken = set()
  for p in pictures:
    stem, i = p.file.removesuffix(".png"), 2
    while p.file in taken:
      p.file, i = f"{stem}-{i}.png", i + 1
    taken.add(p.file)


# The page's generator tag: a folder whose index.html carries it is a report's, written again.
_GENERATOR = '<meta name="generator" content="tjax report">'


def _check_out(out_dir: str) -> None:
  """Refuses an output folder that holds something other than an earlier report.

  Raises:
    ValueError: the path is not a folder, or the folder is neither empty nor a report's.
  """
  if not os.path.lexists(out_dir):
    return
  if not os.path.isdir(out_dir):
    raise ValueError(f"--out {out_dir} exists and is not a directory")
  entries = sorted(os.listdir(out_dir))
  index = os.path.join(out_dir, "index.html")
  if not entries:
    return
  if os.path.isfile(index):
    with open(index, "rb") as f:
      head = f.read(4096)
    # Pages written before the generator tag have the same title.
    if _GENERATOR.encode() in head or b"<title>tjax report: " in head:
      return
  listed = ", ".join(entries[:5]) + (f" and {len(entries) - 5} more" if len(entries) > 5 else "")
  raise ValueError(
    f"--out {out_dir} holds files that are not a tjax report's ({listed}); give a "
    "new or empty directory"
  )


def write_report(
  run_dirs: list[str],
  out_dir: str,
  *,
  text: str | None = None,
  best: bool = False,
  experiments: list[str] = (),
) -> str:
  """Writes ``out_dir/index.html`` and one PNG per picture for ``run_dirs`` (and experiment
  result files); returns the page's path.

  Args:
    run_dirs: directories written by ``tjax train`` (or ``tjax convert``).
    out_dir: created if needed; new, empty, or an earlier report's folder (whose files of the
      same names are replaced).
    text: draw the attention maps of each run's model on this text.
    best: read the best checkpoint by validation loss instead of the latest.
    experiments: result files of ``experiments/efficient_attention.py`` to show after the runs.

  Raises:
    ValueError: neither a run directory nor an experiment given, a path that is not a run
      directory, a damaged file of a run or a result (naming the file and the field), or an
      ``out_dir`` holding files that are not a report's.
  """
  if not run_dirs and not experiments:
    raise ValueError("report: give at least one run directory (or --experiment FILE)")
  _check_out(out_dir)
  names, collected = set(), []
  for path in run_dirs:
    base = _safe_name(os.path.basename(os.path.normpath(path)))
    name, i = base, 2
    while name in names:
      name, i = f"{base}-{i}", i + 1
    names.add(name)
    collected.append(_collect(path, name, text, best))

  extra = [(path, *_experiment_picture(path)) for path in experiments]
  compare = None
  if len(collected) > 1:
    compare = _Picture(
      "compare-loss.png",
      "All runs' losses on one axis.",
      _png(viz.loss_curves({r.name: r.records for r in collected})),
    )
  pictures = (
    ([compare] if compare else [])
    + [p for r in collected for p in r.pictures]
    + [p for _, _, p in extra]
  )
  _unique_files(pictures)

  sections = []
  if compare is not None:
    sections.append(
      "<h2>Comparison</h2>"
      + _table([(r.name, _summary(r)) for r in collected], "run")
      + _img(compare)
    )
  elif collected:
    sections.append(
      "<h2>Summary</h2>" + _table([(collected[0].name, _summary(collected[0]))], "run")
    )
  sections += [_run_html(r) for r in collected]
  sections += [_experiment_html(path, result, p) for path, result, p in extra]
  title = "tjax report: " + ", ".join(
    [r.name for r in collected] + [os.path.basename(p) for p in experiments]
  )
  text_line = "" if text is None else f"<p>Attention text: <code>{html.escape(text)}</code></p>"
  page = (
    f"<!DOCTYPE html>\n<html><head><meta charset='utf-8'>{_GENERATOR}<title>"
    f"{html.escape(title)}"
    f"</title><style>{_STYLE}</style></head><body><h1>{html.escape(title)}</h1>{text_line}"
    + "\n".join(sections)
    + "</body></html>\n"
  )

  os.makedirs(out_dir, exist_ok=True)
  for p in pictures:  # through a temporary file: never into what a link of that name points to
    path = os.path.join(out_dir, p.file)
    with open(f"{path}.tmp", "wb") as f:
      f.write(p.png)
    os.replace(f"{path}.tmp", path)
  index = os.path.join(out_dir, "index.html")
  runs.write_atomic(index, page)
  return index
