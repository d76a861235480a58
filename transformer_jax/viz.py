"""Pictures of models and runs, as pure functions returning matplotlib Figures.

Every function takes arrays or plain records (no run directory, no model), draws them, and returns
the ``Figure``; the caller saves it (``fig.savefig("x.png")``) or embeds it. What is drawn is
exactly the data passed in (tests read it back from the figure), so a picture never disagrees with
the numbers. Uses matplotlib's non-interactive Agg canvas: no display is needed.

Letters as in ``ops/attention.py``: L layers, N heads, T queries, S keys, P positions, D width.
"""

from __future__ import annotations

import math
from collections.abc import Callable, Mapping, Sequence
from typing import Any

import jax
import numpy as np
from matplotlib import colormaps
from matplotlib.figure import Figure
from matplotlib.ticker import FuncFormatter, LogLocator, NullFormatter

from transformer_jax import ops

_MASKED_COLOUR = "#d9d9d9"  # cells a mask removes: light grey, distinct from weight 0 (white)


def _grid(
  rows: int, cols: int, *, cell: float = 2.6, extra_w: float = 0.8
) -> tuple[Figure, np.ndarray]:
  fig = Figure(figsize=(cols * cell + extra_w, rows * cell + 0.6), layout="constrained")
  axes = np.asarray(fig.subplots(rows, cols, squeeze=False))
  return fig, axes


def _token_ticks(ax, labels: Sequence[str] | None, axis: str, limit: int = 48) -> None:
  if labels is None:
    return
  if len(labels) > limit:  # too many to read: label every k-th
    step = math.ceil(len(labels) / limit)
    idx = np.arange(0, len(labels), step)
  else:
    idx = np.arange(len(labels))
  names = [repr(labels[i])[1:-1] for i in idx]  # show whitespace and newlines visibly
  if axis == "x":
    ax.set_xticks(idx, names, rotation=90, fontsize=7)
  else:
    ax.set_yticks(idx, names, fontsize=7)


def attention_maps(
  weights: np.ndarray,
  *,
  query_tokens: Sequence[str] | None = None,
  key_tokens: Sequence[str] | None = None,
  mask: np.ndarray | None = None,
  layers: Sequence[int] | None = None,
  heads: Sequence[int] | None = None,
  title: str | None = None,
) -> Figure:
  """Attention weights as heatmaps: one row per layer, one column per head.

  Args:
    weights: ``[L, N, T, S]`` (or ``[N, T, S]`` for one layer) attention probabilities, e.g.
      ``ops.dot_product_attention(..., return_weights=True)[1][b]``.
    query_tokens / key_tokens: labels of the ``T`` rows and ``S`` columns (key labels default to
      the query labels when ``T == S``).
    mask: ``[T, S]`` (or broadcastable to ``[L, N, T, S]``) bool, True = attend; masked cells are
      drawn grey, so causal and padding masks are visible.
    layers / heads: which layers and heads to draw (default all).
    title: figure title.

  Returns:
    The figure; axis ``[i, j]`` shows layer ``layers[i]``, head ``heads[j]``.
  """
  w = np.asarray(weights, np.float32)
  if w.ndim == 3:
    w = w[None]
  if w.ndim != 4:
    raise ValueError(f"weights must be [L, N, T, S] or [N, T, S]; got shape {np.shape(weights)}")
  num_layers, num_heads, t, s = w.shape
  layers = list(range(num_layers)) if layers is None else list(layers)
  heads = list(range(num_heads)) if heads is None else list(heads)
  for name, chosen, size in (("layer", layers, num_layers), ("head", heads, num_heads)):
    bad = [i for i in chosen if not 0 <= i < size]
    if bad:
      raise ValueError(f"{name} {bad[0]} is out of range: the weights have {size} {name}s")
  if key_tokens is None and t == s:
    key_tokens = query_tokens
  for name, labels, size in (("query_tokens", query_tokens, t), ("key_tokens", key_tokens, s)):
    if labels is not None and len(labels) != size:
      raise ValueError(f"{name} has {len(labels)} labels for {size} positions")
  full_mask = None if mask is None else np.broadcast_to(np.asarray(mask, bool), w.shape)
  fig, axes = _grid(len(layers), len(heads))
  cmap = _cmap_with_bad("viridis")
  image = None
  for i, layer in enumerate(layers):
    for j, head in enumerate(heads):
      ax = axes[i, j]
      data = w[layer, head]
      if full_mask is not None:
        data = np.ma.masked_where(~full_mask[layer, head], data)
      image = ax.imshow(data, cmap=cmap, vmin=0.0, vmax=1.0, interpolation="nearest", aspect="auto")
      ax.set_title(f"layer {layer}, head {head}", fontsize=9)
      _token_ticks(ax, key_tokens, "x")
      _token_ticks(ax, query_tokens, "y")
      if j == 0:
        ax.set_ylabel("query")
      if i == len(layers) - 1:
        ax.set_xlabel("key")
  fig.colorbar(image, ax=axes, shrink=0.8, label="attention weight")
  if title:
    fig.suptitle(title)
  return fig


def _cmap_with_bad(name: str):
  import matplotlib  # noqa: PLC0415 - matplotlib loads only to draw

  return matplotlib.colormaps[name].with_extremes(bad=_MASKED_COLOUR)


def _heatmap(
  data: np.ndarray,
  *,
  title: str,
  xlabel: str,
  ylabel: str,
  colorbar: str,
  cmap: str = "RdBu_r",
  symmetric: bool = True,
) -> Figure:
  fig = Figure(figsize=(7.5, 4.8), layout="constrained")
  ax = fig.subplots()
  limit = float(np.abs(data).max()) if symmetric and data.size else None
  image = ax.imshow(
    data,
    cmap=cmap,
    aspect="auto",
    interpolation="nearest",
    vmin=-limit if limit else None,
    vmax=limit,
  )
  ax.set(title=title, xlabel=xlabel, ylabel=ylabel)
  fig.colorbar(image, ax=ax, label=colorbar)
  return fig


def positional_encoding(table_PD: np.ndarray, *, title: str = "Positional encoding") -> Figure:
  """A position table ``[P, D]`` (``ops.sinusoidal_positions`` or a learned embedding's rows)
  as a heatmap: positions down, features across."""
  table = np.asarray(table_PD, np.float32)
  if table.ndim != 2:
    raise ValueError(f"table must be [positions, dim]; got shape {table.shape}")
  return _heatmap(table, title=title, xlabel="feature", ylabel="position", colorbar="value")


def rope_angles(
  head_dim: int,
  num_positions: int,
  *,
  theta: float = 10000.0,
  scaling: ops.RopeScaling | None = None,
) -> Figure:
  """RoPE's rotation angle ``p * inv_freq[i]`` (mod 2 pi) for each position and feature pair."""
  inv_freq = ops.rope_frequencies(head_dim, theta=theta, scaling=scaling)
  angles = np.mod(np.arange(num_positions)[:, None] * inv_freq[None, :], 2 * np.pi)
  return _heatmap(
    angles,
    title=f"RoPE rotation angles (theta={theta:g}, mod 2pi)",
    xlabel="feature pair i (frequency falls left to right)",
    ylabel="position",
    colorbar="angle (rad)",
    cmap="twilight",
    symmetric=False,
  )


def alibi_biases(num_heads: int, length: int, *, causal: bool = True) -> Figure:
  """ALiBi's additive bias ``-slope_n * |i - j|`` for each head (``ops.alibi_bias``), with the
  causal mask greyed out when ``causal``."""
  bias_NTS = np.asarray(ops.alibi_bias(num_heads, length, length))[0]
  cols = min(num_heads, 4)
  rows = math.ceil(num_heads / cols)
  fig, axes = _grid(rows, cols, cell=2.4)
  slopes = ops.alibi_slopes(num_heads)
  low = float(bias_NTS.min())
  cmap = _cmap_with_bad("magma")
  image = None
  for n in range(rows * cols):
    ax = axes[n // cols, n % cols]
    if n >= num_heads:
      ax.axis("off")
      continue
    data = bias_NTS[n]
    if causal:
      data = np.ma.masked_where(np.triu(np.ones_like(data, bool), k=1), data)
    image = ax.imshow(data, cmap=cmap, vmin=low, vmax=0.0, interpolation="nearest")
    ax.set_title(f"head {n}: slope {slopes[n]:.3g}", fontsize=9)
    ax.set(xlabel="key", ylabel="query")
  fig.colorbar(image, ax=axes, shrink=0.8, label="bias added to the logits")
  fig.suptitle(f"ALiBi biases, {num_heads} heads")
  return fig


def loss_curves(
  runs: Mapping[str, Sequence[Mapping[str, Any]]], *, perplexity: bool = False
) -> Figure:
  """Training and validation loss (or perplexity) of several runs on one axis.

  Args:
    runs: run name -> its metrics records (the lines of ``metrics.jsonl``): training lines carry
      ``step`` and ``loss``, evaluation lines ``step`` and ``val_loss``.
    perplexity: plot ``exp(loss)`` on a log axis instead of the loss.
  """
  fig = Figure(figsize=(7.5, 4.5), layout="constrained")
  ax = fig.subplots()
  for i, (name, records) in enumerate(runs.items()):
    colour = f"C{i % 10}"
    for key, style, label in (("loss", "-", "train"), ("val_loss", "o--", "val")):
      points = [(r["step"], r[key]) for r in records if key in r and "step" in r]
      if not points:
        continue
      steps, values = np.asarray(points, np.float64).T
      if perplexity:
        values = np.exp(values)
      ax.plot(
        steps,
        values,
        style,
        color=colour,
        label=f"{name} {label}",
        alpha=0.8 if key == "loss" else 1.0,
        markersize=4,
      )
  ax.set(
    xlabel="step",
    ylabel="perplexity" if perplexity else "loss (nats/token)",
    title="Perplexity" if perplexity else "Loss",
  )
  if perplexity:
    ax.set_yscale("log")
  ax.grid(alpha=0.3)
  if ax.lines:
    ax.legend(fontsize=8)
  return fig


def source_tokens(records: Sequence[Mapping[str, Any]]) -> Figure:
  """Tokens read from each mixture source over the steps (the ``tokens/NAME`` of training lines),
  one line per source, and their shares of all tokens read (dashed, right axis)."""
  names = sorted({k[len("tokens/") :] for r in records for k in r if k.startswith("tokens/")})
  fig = Figure(figsize=(7.5, 4.5), layout="constrained")
  ax = fig.subplots()
  share_ax = ax.twinx()
  lines = [r for r in records if "step" in r and any(f"tokens/{n}" in r for n in names)]
  steps = np.asarray([r["step"] for r in lines], np.float64)
  counts = np.asarray([[r.get(f"tokens/{n}", 0) for n in names] for r in lines], np.float64)
  total = np.maximum(counts.sum(axis=1, keepdims=True), 1.0)
  for i, name in enumerate(names):
    ax.plot(steps, counts[:, i], "-", color=f"C{i % 10}", label=name)
    share_ax.plot(steps, counts[:, i] / total[:, 0], "--", color=f"C{i % 10}", alpha=0.6)
  ax.set(xlabel="step", ylabel="tokens read", title="Tokens per mixture source")
  share_ax.set(ylabel="share of tokens (dashed)", ylim=(0.0, 1.0))
  ax.grid(alpha=0.3)
  if names:
    ax.legend(fontsize=8)
  return fig


def lr_schedule(
  schedule: Callable[[int], float], steps: int, *, title: str = "Learning rate"
) -> Figure:
  """``schedule(step)`` for ``step`` in ``0 .. steps`` (an optax schedule, say)."""
  xs = np.arange(steps + 1)
  ys = np.asarray([float(schedule(int(x))) for x in xs])
  fig = Figure(figsize=(6.5, 3.5), layout="constrained")
  ax = fig.subplots()
  ax.plot(xs, ys)
  ax.set(xlabel="step", ylabel="learning rate", title=title)
  ax.ticklabel_format(axis="y", style="sci", scilimits=(-3, 3))
  ax.grid(alpha=0.3)
  return fig


def parameter_counts(params: Any, *, depth: int = 2) -> dict[str, int]:
  """Parameters per component: leaves grouped by the first ``depth`` names of their path
  (``{"blocks/attn": 28_348_416, ...}``; the stacked ``layers`` level is skipped). ``params`` is any
  pytree (an ``nnx.State`` too)."""

  counts: dict[str, int] = {}
  for path, leaf in jax.tree_util.tree_flatten_with_path(params)[0]:
    names = [str(getattr(p, "key", getattr(p, "name", getattr(p, "idx", p)))) for p in path]
    # "layers" is the stacked-parameters attribute of every ``Stack``: not a component.
    names = [n for n in names if n not in ("value", "raw_value", "layers")]
    key = "/".join(names[:depth])
    counts[key] = counts.get(key, 0) + int(np.prod(np.shape(leaf)))
  return counts


def parameter_breakdown(params: Any, *, depth: int = 2, title: str | None = None) -> Figure:
  """A horizontal bar per component (``parameter_counts``), largest first, with counts and
  shares."""
  counts = sorted(parameter_counts(params, depth=depth).items(), key=lambda kv: kv[1])
  total = sum(v for _, v in counts)
  fig = Figure(figsize=(7.5, 0.35 * len(counts) + 1.2), layout="constrained")
  ax = fig.subplots()
  names = [k for k, _ in counts]
  values = np.asarray([v for _, v in counts], np.float64)
  bars = ax.barh(names, values)
  for bar, v in zip(bars, values):
    ax.text(
      bar.get_width(),
      bar.get_y() + bar.get_height() / 2,
      f" {int(v):,} ({v / max(total, 1):.1%})",
      va="center",
      fontsize=8,
    )
  ax.set(xlabel="parameters", title=title or f"Parameters: {total:,}")
  ax.set_xlim(0, values.max() * 1.35 if values.size else 1)
  return fig


_ATTENTION_BASELINES = {"causal": "softmax", "masked": "mlm-full"}


def attention_speedups(result: Mapping[str, Any], section: str, key: str) -> dict[str, dict]:
  """``experiments/efficient_attention.py``'s speeds as ratios: kind -> length -> the time
  ``key`` of its task's baseline (``setup.baselines``; causal: softmax, masked LM: mlm-full) at
  that length over its own, in ``section`` (``train_step``, ``decode``). Kinds whose baseline
  was not timed at a length are left out there."""
  baselines = result.get("setup", {}).get("baselines", _ATTENTION_BASELINES)
  out = {}
  for name, rows in result.get(section, {}).items():
    task = result["learning"].get(name, {}).get("task", "causal")
    base = result[section].get(baselines.get(task, ""), {})
    out[name] = {t: base[t][key] / r[key] for t, r in rows.items() if t in base and r[key] > 0}
  return out


def efficient_attention(result: Mapping[str, Any]) -> Figure:
  """The six panels of ``experiments/efficient_attention.py``'s result: validation loss of the
  causal and the masked-LM kinds; the train step's speed relative to full attention (the task's
  baseline, same run) and its compiled temporaries against the context length (encoders dashed);
  decoding speed relative to softmax and the cache's size against the generated length."""
  fig = Figure(figsize=(16, 8.5))
  axes = fig.subplots(2, 3)
  names = list(result["learning"])
  task = {n: result["learning"][n].get("task", "causal") for n in names}
  order = [*range(0, 20, 2), *range(1, 20, 2)]  # tab20's ten dark colours, then the light ones

  def colour(name: str):
    return colormaps["tab20"](order[names.index(name) % 20]) if name in names else None

  setup = result["setup"]
  for ax, kind, title in (
    (axes[0][0], "causal", f"causal LM: {setup['steps']} steps at {setup['train_len']} tokens"),
    (
      axes[0][1],
      "masked",
      f"masked LM: {setup['steps']} steps at {setup.get('mlm_train_len', '?')} tokens",
    ),
  ):
    shown = [n for n in names if task[n] == kind]
    if not shown:
      ax.set_axis_off()
      continue
    vals = [result["learning"][n]["val_loss"] for n in shown]
    ax.bar(shown, vals, color=[colour(n) for n in shown])
    ax.set_ylim(min(vals) * 0.95, max(vals) * 1.03)
    ax.set(ylabel="validation loss (nats/token)", title=title)
    ax.tick_params(axis="x", rotation=30)
  panels = (  # (axes, values per kind and length, y label, title)
    (
      axes[0][2],
      attention_speedups(result, "train_step", "step_s"),
      "train step speed (x full attention's)",
      "train step speed against context length",
    ),
    (
      axes[1][0],
      _values(result, "train_step", "temp_bytes", 2.0**-20),
      "train step temporaries (MiB)",
      "train step memory against context length",
    ),
    (
      axes[1][1],
      attention_speedups(result, "decode", "step_ms"),
      "decoding speed (x softmax's)",
      "decoding speed per token against generated length",
    ),
    (
      axes[1][2],
      _values(result, "decode", "cache_bytes", 2.0**-20),
      "decoding cache (MiB)",
      "decoding memory against generated length",
    ),
  )
  for ax, values, ylabel, title in panels:
    if not any(values.values()):  # nothing timed (a run that left this out)
      ax.set_axis_off()
      continue
    lengths = set()
    for name, rows in values.items():
      xs = sorted(int(x) for x in rows)
      lengths.update(xs)
      style = "s--" if task.get(name) == "masked" else "o-"
      ax.loglog(xs, [rows[str(x)] for x in xs], style, color=colour(name), label=name)
    xlabel = "generated length (tokens)" if "decod" in ylabel else "context length (tokens)"
    ax.set(xlabel=xlabel, ylabel=ylabel, title=title)
    ticks = sorted(lengths)
    ax.set_xticks(ticks, [f"{x // 1024}k" if x % 1024 == 0 else str(x) for x in ticks])
    ax.xaxis.set_minor_formatter(NullFormatter())
    if "speed" in ylabel:
      ax.yaxis.set_major_locator(LogLocator(subs=(1.0, 2.0, 5.0)))
      ax.yaxis.set_major_formatter(FuncFormatter(lambda v, _: f"{v:g}x"))
      ax.yaxis.set_minor_formatter(NullFormatter())
    ax.legend(fontsize=7, ncol=2)
  fig.tight_layout()
  return fig


def _values(result: Mapping[str, Any], section: str, key: str, scale: float) -> dict[str, dict]:
  """kind -> length -> ``key`` times ``scale`` in ``section``, where the value is a number."""
  return {
    name: {t: r[key] * scale for t, r in rows.items() if isinstance(r.get(key), (int, float))}
    for name, rows in result.get(section, {}).items()
  }
