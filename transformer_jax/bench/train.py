"""``tjax bench train``: the jitted training step against PyTorch eager, interleaved in one process.

Ours is the real step (``train.step.make_train_step`` + ``jit_train_step``: the task's token-mean
cross-entropy, clipping and AdamW from ``train.optim.make_optimizer``) on a batch built once with
NumPy and placed on the device, so host loading is not timed. Theirs (``--against torch``, GPT
and Mamba presets) is the ``transformers`` class of the preset's family holding the same weights
(written by ``transformer_jax.hf.save``: ``GPT2LMHeadModel``, ``LlamaForCausalLM`` for the LLaMA
flavour, e.g. ``tinyllama-1.1b``, ``MistralForCausalLM``, ``MambaForCausalLM``,
``Mamba2ForCausalLM``; on CPU transformers' Mamba runs its sequential PyTorch path), in train mode,
with the same tokens, the same loss (token-mean cross-entropy over the same labels),
``clip_grad_norm_`` and ``torch.optim.AdamW`` with the same hyper-parameters; dropout is off on
both sides. Steps alternate (ours, theirs, ours, ...) so both
see the same machine, and medians are compared, after ``--warmup`` untimed steps per side (default
2: the first steps fault each side's scratch memory in, several seconds of kernel time each, and the
per-step page faults and kernel time of the timed steps are in the JSON, ``*_all``).
``--against torch.compile`` adds a ``torch.compile``-d forward+backward when it compiles within
``--compile-timeout`` seconds.

The machine's limit is measured in the same run: the best matmul rate on the step's own shapes
(``machine.run_matmul_limit``; on a GPU or TPU also a large square product), from which
``mfu = model FLOP/s / limit`` and the step's floor ``model FLOPs / limit`` follow. Where
``hardware.PEAK_FLOPS`` knows the device, ``mfu_vs_peak`` sets the same rate against the
datasheet's peak.

PyTorch runs on JAX's device: on CPU in float32 (its ``--dtype bfloat16`` runs float32 too); on an
NVIDIA GPU on "cuda", under ``torch.autocast("cuda", torch.bfloat16)`` for ``--dtype bfloat16``
(master weights float32, as ours), with the fused AdamW, synchronized before the clock is read at
both ends of a step. On a TPU, or a GPU where torch has no CUDA, the rivals are left out
(``left_out`` in the JSON says why). On a GPU, JAX is asked not to preallocate three quarters of
the memory (``hardware.share_gpu_memory``), so the rival finds room.

``--model KEY=VALUE`` (repeatable) overrides a field of the preset's config, the value read as YAML
(``true``, ``null``, ``4``, ``1e-5``, ``cudnn``): ``--model scan_layers=false --model
attention_impl=cudnn``.

``--table NAME=N`` (repeatable) adds a side ``ours+table``: our step again, from the same weights,
built with a kernel table (``backends.KernelTable``) whose entry ``NAME`` is ``N``
(``TABLE_ENTRIES``), and timed in the same interleaved loop: a lever against the default and the
rivals in one run. Values are range-checked, and an entry that changes nothing on this backend is
refused, before anything compiles.

``--library`` adds a side ``library``: the step a library user writes from the README
(``train.make_step(config, make_optimizer(...))``, a state from ``Step.init``, host batches
passed to each call), timed in the same interleaved loop; ``library_vs_ours`` is its median step
over ours (1.0: the library path is as fast as the command's).
"""

from __future__ import annotations

import argparse
import dataclasses
import os
import re
import resource
import statistics
import sys
import tempfile
import time
import warnings

from flax import nnx
import jax
import numpy as np
import yaml

from transformer_jax import backends, hardware, models, parallel, runtime
from transformer_jax import data as data_lib
from transformer_jax import hf as tjhf
from transformer_jax.backends import table as table_lib
from transformer_jax.bench import machine
from transformer_jax.bench import profile
from transformer_jax.hf.configs import default_architecture
from transformer_jax.models.config import BERTConfig, GPTConfig, MambaConfig, Seq2SeqConfig
from transformer_jax.train import step as step_lib
from transformer_jax.train import tasks as tasks_lib
from transformer_jax.train.config import TrainConfig
from transformer_jax.train.optim import make_optimizer


def add_args(p: argparse.ArgumentParser) -> None:
  p.add_argument("--preset", default="gpt2-small", help="model preset (tjax info lists them)")
  p.add_argument("--batch-size", type=int, default=4)
  p.add_argument(
    "--seq-len",
    type=int,
    default=None,
    help=f"tokens per row (default: {DEFAULT_SEQ_LEN}, or the preset's max_len where "
    "that is shorter)",
  )
  p.add_argument(
    "--dtype",
    choices=("float32", "bfloat16"),
    default="float32",
    help="compute dtype (parameters stay float32)",
  )
  p.add_argument("--steps", type=int, default=5, help="timed steps per side")
  p.add_argument(
    "--warmup",
    type=int,
    default=2,
    help="untimed steps per side after the first (each side's first steps fault its "
    "scratch memory in, more of it while the other side's steps take freed pages)",
  )
  p.add_argument(
    "--against", default="torch", help="comma-separated rivals: torch (eager), torch.compile, none"
  )
  p.add_argument(
    "--compile-timeout",
    type=float,
    default=180.0,
    help="seconds torch.compile may take before it is left out",
  )
  p.add_argument("--remat", choices=("none", "full", "dots"), default="none")
  p.add_argument("--seed", type=int, default=0)
  p.add_argument(
    "--curve-steps",
    type=int,
    default=0,
    help="also train float32 and bfloat16 this many steps each (GPT presets), "
    "from the same weights on the same batches of the embedded corpus, and "
    "compare the two loss curves",
  )
  p.add_argument(
    "--curve-data",
    default=None,
    help="dataset folder for --curve-steps (default runs/data/stdlib-VOCAB, prepared "
    "from the embedded corpus on first use)",
  )
  p.add_argument(
    "--profile",
    type=int,
    default=0,
    metavar="N",
    help="after the timed steps, trace N more steps per side and record their device "
    "kernels by kind (bench.profile; GPU kernels only)",
  )
  p.add_argument(
    "--profile-dir",
    default=None,
    help="with --profile: also keep each side's trace there, gzipped Chrome JSON "
    "(SIDE.trace.json.gz)",
  )
  p.add_argument(
    "--model",
    action="append",
    default=[],
    metavar="KEY=VALUE",
    help="override a field of the preset's model config, the value read as YAML "
    "(repeatable): --model scan_layers=false --model attention_impl=cudnn",
  )
  p.add_argument(
    "--table",
    action="append",
    default=[],
    metavar="NAME=N",
    help="also time our step traced with this kernel-table entry set (repeatable; "
    f"side 'ours+table'): {', '.join(TABLE_ENTRIES)}",
  )
  p.add_argument(
    "--library",
    action="store_true",
    help="also time the library's step (train.make_step, as the README writes it; side 'library')",
  )


# ``--seq-len`` without a value: GPT-2 small's CPU benchmark shape, cut to a shorter context.
DEFAULT_SEQ_LEN = 256


def resolve_seq_len(args, config) -> int:
  """``args.seq_len``, or the default that fits ``config``'s context; checked before anything runs.

  The default is ``DEFAULT_SEQ_LEN`` cut to ``max_len``. An explicit length may pass ``max_len``
  only where the model has no position table (RoPE, ALiBi, T5's relative buckets), as the model
  itself allows.

  Raises:
    ValueError: for a length below 1, or past ``max_len`` of a model with a position table.
  """
  if args.seq_len is None:
    return min(DEFAULT_SEQ_LEN, config.max_len)
  if args.seq_len < 1:
    raise ValueError(f"--seq-len {args.seq_len}: must be at least 1")
  has_table = getattr(config, "position", "learned") in ("learned", "sinusoidal")  # BERT: learned
  if has_table and args.seq_len > config.max_len:
    raise ValueError(
      f"--seq-len {args.seq_len}: longer than {args.preset}'s max_len={config.max_len}"
    )
  return args.seq_len


# The kernel-table entries ``--table`` sets, for the side "ours+table" (backends.KernelTable's
# integer levers; a name is read in any case, PAD_COLS as pad_cols).
TABLE_ENTRIES = {name: what for name, (_, _, what) in table_lib.INT_LEVERS.items()}


def _pairs(items: list[str], flag: str, expected: str) -> list[tuple[str, str, str]]:
  """``KEY=VALUE`` items of ``flag`` as ``(item, key, value text)``, each key at most once.

  Raises:
    ValueError: for an item without ``=`` or a key, or a key given twice.
  """
  out, seen = [], set()
  for item in items:
    key, sep, text = item.partition("=")
    key = key.strip()
    if not sep or not key:
      raise ValueError(f"{flag} {item!r}: expected {expected}")
    if key in seen:
      raise ValueError(f"{flag} {item!r}: {key} is given twice")
    seen.add(key)
    out.append((item, key, text))
  return out


def parse_table(items: list[str], platform: str | None = None) -> backends.KernelTable | None:
  """``--table`` values (``"NAME=N"``) as a kernel table, checked before anything compiles.

  Args:
    items: the ``--table`` values.
    platform: the backend the bench runs on: an entry that changes nothing there is refused.

  Returns:
    The table, or None without items.

  Raises:
    ValueError: one line naming the item, for an item without ``=``, a name not in
      ``TABLE_ENTRIES``, a name given twice, a value that is not an integer or out of the
      entry's range, the entry's default, or an entry that does nothing on ``platform``.
  """
  if not items:
    return None
  out = {}
  for item, name, text in _pairs(
    [i.strip() for i in items], "--table", "NAME=N (e.g. --table pad_cols=128)"
  ):
    field = name.lower()
    if field not in TABLE_ENTRIES:
      raise ValueError(f"--table {item!r}: {name} is not one of {', '.join(TABLE_ENTRIES)}")
    if field in out:
      raise ValueError(f"--table {item!r}: {field} is given twice")
    out[field] = text.strip()
    try:
      table = backends.KernelTable.from_dict({field: out[field]}, where="--table")
    except ValueError as e:
      raise ValueError(f"--table {item!r}: {str(e).removeprefix('--table.')}") from None
    if not table.changed():
      raise ValueError(
        f"--table {item!r}: {field}={getattr(table, field)} is the default, so "
        "ours+table would be ours"
      )
    if platform is not None and table.no_effect_on(platform):
      raise ValueError(
        f"--table {item!r}: {field} has no effect on {platform} (it applies on "
        f"{', '.join(table_lib.APPLIES_ON[field])})"
      )
  return backends.KernelTable.from_dict(out, where="--table")


# Config fields the bench sets itself: its own flags, and no dropout on either side.
_OWN_FIELDS = {
  "dtype": "--dtype",
  "remat": "--remat",
  "dropout_rate": "no dropout",
  "attention_dropout_rate": "no dropout",
}
_FLOAT = re.compile(r"[-+]?(\d+\.?\d*|\.\d+)[eE][-+]?\d+")


def parse_model_overrides(items: list[str]) -> dict:
  """``--model`` values (``"KEY=VALUE"``) as a dict of config overrides.

  Each value is read with ``yaml.safe_load`` (``true``/``false``, ``null``, ints, floats, else the
  string); an exponent without a dot (``1e-5``, a string to YAML 1.1) is a float.

  Raises:
    ValueError: for an item without ``=`` or a key, a key given twice, or a field the bench sets
      itself (``dtype``, ``remat``: their own flags; dropout: off on both sides).
  """

  out = {}
  for item, key, text in _pairs(items, "--model", "KEY=VALUE (e.g. --model scan_layers=false)"):
    if key in _OWN_FIELDS:
      raise ValueError(f"--model {item!r}: {key} is set by the bench ({_OWN_FIELDS[key]})")
    value = yaml.safe_load(text)
    if isinstance(value, str) and _FLOAT.fullmatch(value.strip()):
      value = float(value)
    out[key] = value
  return out


def random_batch(config, batch: int, seq_len: int, seed: int) -> tuple[dict[str, np.ndarray], str]:
  """A batch shaped like the loaders' output for ``config``'s family, and the task's name."""
  rng = np.random.default_rng(seed)
  ids = lambda: rng.integers(0, config.vocab_size, (batch, seq_len), dtype=np.int32)  # noqa: E731
  match config:
    case GPTConfig() | MambaConfig():
      return {
        "tokens": ids(),
        "labels": ids(),
        "segment_ids": np.ones((batch, seq_len), np.int32),
        "positions": np.tile(np.arange(seq_len, dtype=np.int32), (batch, 1)),
        "loss_mask": np.ones((batch, seq_len), bool),
      }, "gpt"
    case BERTConfig():
      token_types = np.zeros((batch, seq_len), np.int32)
      token_types[:, seq_len // 2 :] = 1
      mlm_mask = rng.random((batch, seq_len)) < 0.15
      mlm_mask[:, 0] = True
      return {
        "tokens": ids(),
        "token_types": token_types,
        "attention_mask": np.ones((batch, seq_len), bool),
        "mlm_labels": np.where(mlm_mask, ids(), 0).astype(np.int32),
        "mlm_mask": mlm_mask,
        "nsp_labels": rng.integers(0, 2, (batch,), dtype=np.int32),
      }, "bert"
    case Seq2SeqConfig():
      return {
        "src": ids(),
        "src_mask": np.ones((batch, seq_len), bool),
        "tgt_in": ids(),
        "tgt_out": ids(),
        "tgt_mask": np.ones((batch, seq_len), bool),
      }, "seq2seq"
  raise TypeError(f"not a model config: {type(config).__name__}")


def step_matmul_shapes(config, tokens: int) -> list[tuple[int, int, int]]:
  """``(m, k, n)`` of the step's projections: attention, feed-forward and vocabulary (a Mamba
  model: its mixers' in- and out-projections)."""
  d = config.d_model
  if isinstance(config, MambaConfig):
    e = config.d_inner
    return [(tokens, d, 2 * e), (tokens, e, d), (tokens, d, config.vocab_size)]
  return [
    (tokens, d, 3 * d),
    (tokens, d, config.d_ff),
    (tokens, config.d_ff, d),
    (tokens, d, config.vocab_size),
  ]


class Ours:
  """The project's jitted train step on a one-device mesh."""

  def __init__(
    self,
    config,
    host_batch,
    task_name: str,
    lr: float,
    seed: int,
    tcfg=None,
    table: backends.KernelTable | None = None,
  ):
    """``table``: the kernel table the model and step are built with (default the library's)."""

    self.config = config
    mesh = parallel.make_mesh({"data": -1})
    task = tasks_lib.get_task(task_name)
    self._shard = lambda batch: step_lib.shard_batch(batch, mesh, task.keys)
    b, t = host_batch["tokens"].shape if "tokens" in host_batch else host_batch["src"].shape
    tcfg = tcfg or TrainConfig(
      steps=1000, batch_size=b, seq_len=t, seed=seed, lr=lr, warmup_steps=0, schedule="constant"
    )
    optimizer = make_optimizer(tcfg)
    self.params = models.init(config, jax.random.key(seed))
    state = jax.device_put(step_lib.create_state(self.params, optimizer), step_lib.replicated(mesh))
    self.batch = self._shard(host_batch)
    backend = backends.current(table)
    graphdef = models.graphdef(config, mesh, backend)
    times = {}

    def compile_for(m):  # the step a run would take: train.microbatches' "auto" rule on CPU
      jitted = step_lib.jit_train_step(
        step_lib.make_train_step(graphdef, task, optimizer, seed=seed, microbatches=m),
        mesh,
        state,
        backend=backend,
      )
      start = time.perf_counter()
      lowered = jitted.lower(state, self.batch)
      mid = time.perf_counter()
      compiled = lowered.compile()
      times[m] = (mid - start, time.perf_counter() - mid)
      return compiled

    self.microbatches, self.step_fn = step_lib.pick_microbatches(
      tcfg.microbatches, compile_for, b, backend=backend
    )
    self.trace_s, self.compile_s = times[self.microbatches]
    # Every count the rule compiled (a step over the limit is compiled whole first).
    self.compile_s_by_microbatches = {m: c for m, (_, c) in times.items()}
    # The jitted step is held (jit_train_step); this ahead-of-time executable is another one.
    backend.hold(self.step_fn, backend.step_compiler_options())
    # XLA:CPU takes a step's temporaries as one block per call (see backends.cpu.microbatches).
    self.temp_bytes = runtime.temp_bytes(self.step_fn)
    self.state = state
    self.losses: list[float] = []

  def step(self, host_batch=None) -> float:
    """One training step (on ``host_batch`` if given, else on the batch it was built with)."""
    batch = self.batch if host_batch is None else self._shard(host_batch)
    start = time.perf_counter()
    self.state, metrics = self.step_fn(self.state, batch)
    loss = float(metrics["loss"])  # blocks until the step is done
    self.losses.append(loss)
    return time.perf_counter() - start


class Library:
  """The library user's step: ``train.make_step`` with the optimizer the bench gives ours, a
  state from ``Step.init``, and the host batch handed to every call (as the README's loop does).
  """

  def __init__(self, config, host_batch, task_name: str, lr: float, seed: int):
    from transformer_jax.train import TrainConfig, make_optimizer, make_step  # noqa: PLC0415 - the library side only

    b, t = host_batch["tokens"].shape if "tokens" in host_batch else host_batch["src"].shape
    optimizer = make_optimizer(
      TrainConfig(
        steps=1000, batch_size=b, seq_len=t, seed=seed, lr=lr, warmup_steps=0, schedule="constant"
      )
    )
    self.host_batch = host_batch
    self.step_fn = make_step(config, optimizer, task=task_name, seed=seed)
    self.state = self.step_fn.init(jax.random.key(seed))
    start = time.perf_counter()
    self.step_fn.compile(self.state, host_batch)
    self.trace_s, self.compile_s = 0.0, time.perf_counter() - start  # tracing included
    self.microbatches = self.step_fn.microbatches
    self.temp_bytes = runtime.temp_bytes(self.step_fn.compiled)
    self.losses: list[float] = []

  def step(self) -> float:
    """One training step on the host batch; returns its time."""
    start = time.perf_counter()
    self.state, metrics = self.step_fn(self.state, self.host_batch)
    self.losses.append(float(metrics["loss"]))
    return time.perf_counter() - start


class Torch:
  """The preset's ``transformers`` causal LM (``hf.save``'s architecture: ``GPT2LMHeadModel``,
  ``LlamaForCausalLM``, ``MistralForCausalLM``) on the same weights: forward, token-mean
  cross-entropy, backward, clipping, AdamW, in eager mode (or with the forward+loss
  ``torch.compile``-d).

  On ``device`` "cpu" everything is float32. On "cuda" the model and batch live on the GPU, the
  forward+loss runs under ``torch.autocast`` to ``autocast`` when given ("bfloat16"; the weights
  and optimizer stay float32), AdamW is the fused kernel, and a step synchronizes the device
  before it reads the clock at either end.
  """

  def __init__(
    self,
    config,
    params,
    host_batch,
    lr: float,
    weight_decay: float,
    clip: float,
    b1: float,
    b2: float,
    eps: float,
    compiled: bool = False,
    device: str = "cpu",
    autocast: str | None = None,
  ):

    import torch  # noqa: PLC0415 - torch is optional (the hf extra)
    import transformers  # noqa: PLC0415 - transformers is optional (the hf extra)

    if device not in ("cpu", "cuda"):
      raise ValueError(f"device={device!r}: the PyTorch rival runs on 'cpu' or 'cuda'")
    if autocast is not None and device != "cuda":
      raise ValueError(f"autocast={autocast!r} on device={device!r}: autocast is for 'cuda'")
    self.torch = torch
    transformers.logging.set_verbosity_error()
    model = nnx.merge(models.graphdef(config), params)
    self.architecture = default_architecture(config)
    with tempfile.TemporaryDirectory() as tmp:
      tjhf.save(model, config, tmp)
      # PyTorch's fused attention; Mamba's mixers have no attention to choose.
      extra = (
        {}
        if self.architecture in ("MambaForCausalLM", "Mamba2ForCausalLM")
        else {"attn_implementation": "sdpa"}
      )
      with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        self.model = getattr(transformers, self.architecture).from_pretrained(tmp, **extra).train()
    self.device, self.autocast = device, autocast
    self.fused_adamw = device == "cuda"
    self._sync = torch.cuda.synchronize if device == "cuda" else (lambda: None)
    self.model.to(device)
    # No decay on biases and norm scales, as on our side.
    decay = [p for n, p in self.model.named_parameters() if p.dim() >= 2]
    rest = [p for n, p in self.model.named_parameters() if p.dim() < 2]
    self.opt = torch.optim.AdamW(
      [{"params": decay, "weight_decay": weight_decay}, {"params": rest, "weight_decay": 0.0}],
      lr=lr,
      betas=(b1, b2),
      eps=eps,
      **({"fused": True} if self.fused_adamw else {}),
    )
    self.clip = clip
    self.tokens = torch.as_tensor(host_batch["tokens"], dtype=torch.long).to(device)
    self.labels = torch.as_tensor(host_batch["labels"], dtype=torch.long).to(device)

    def loss_fn(tokens, labels):
      logits = self.model(tokens).logits
      return torch.nn.functional.cross_entropy(logits.flatten(0, 1).float(), labels.flatten())

    if autocast:
      plain, cast_to = loss_fn, getattr(torch, autocast)

      def loss_fn(tokens, labels):
        with torch.autocast("cuda", dtype=cast_to):
          return plain(tokens, labels)

    self.loss_fn = torch.compile(loss_fn) if compiled else loss_fn
    self.losses: list[float] = []

  def compile(self) -> float:
    """One forward + backward without an update (``torch.compile`` compiles here), so the weights
    stay in step with ours; returns its time."""
    self._sync()
    start = time.perf_counter()
    self.loss_fn(self.tokens, self.labels).backward()
    self.opt.zero_grad(set_to_none=True)
    self._sync()
    return time.perf_counter() - start

  def step(self) -> float:
    """One training step; returns its time."""
    self._sync()
    start = time.perf_counter()
    self.opt.zero_grad(set_to_none=True)
    loss = self.loss_fn(self.tokens, self.labels)
    loss.backward()
    self.torch.nn.utils.clip_grad_norm_(self.model.parameters(), self.clip)
    self.opt.step()
    self.losses.append(float(loss.detach()))
    self._sync()
    return time.perf_counter() - start


def loss_curves(
  config, steps: int, batch_size: int, seq_len: int, seed: int, data_dir: str | None = None
) -> dict:
  """float32 and bfloat16 each trained ``steps`` steps from the same initial weights on the same
  batches of real text, with the same schedule (AdamW, 6e-4 peak, linear warmup over a tenth of the
  steps, cosine decay): the bfloat16 mode's loss curve against float32's.

  The text is the embedded corpus (the Python standard library's sources, ``tjax prepare stdlib``)
  in cl100k ids renumbered densely by frequency, so they fit the preset's vocabulary; it is
  prepared once in ``data_dir`` (default ``runs/data/stdlib-VOCAB``). The curves are compared
  through their 10-step trailing means (single steps' losses swing with their batch):
  ``max_relative_gap`` is the largest ``|bf16 - fp32| / fp32`` of those means.
  """

  if not isinstance(config, GPTConfig):
    raise ValueError(
      f"--curve-steps trains on text with the GPT task; {type(config).__name__} is not a GPT preset"
    )
  out = data_dir or os.path.join("runs", "data", f"stdlib-{config.vocab_size}")
  # The most frequent ids, plus the separator and the special tokens, fill at most vocab_size.
  keep = config.vocab_size - len(data_lib.SPECIAL_TOKENS) - 1
  data_lib.prepare(["stdlib"], out, compact_vocab=keep, progress=False)
  dataset = data_lib.load_dataset(out)
  if dataset.vocab_size > config.vocab_size:
    raise ValueError(f"{out}: {dataset.vocab_size} ids do not fit vocab_size={config.vocab_size}")
  loader = data_lib.GPTLoader(dataset, batch_size=batch_size, seq_len=seq_len, seed=seed)
  batches = [loader.batch_at(i) for i in range(steps)]
  tcfg = TrainConfig(
    steps=steps,
    batch_size=batch_size,
    seq_len=seq_len,
    seed=seed,
    lr=6e-4,
    warmup_steps=max(1, steps // 10),
    schedule="cosine",
  )
  curves = {}
  for dtype in ("float32", "bfloat16"):
    side = Ours(
      dataclasses.replace(config, dtype=dtype), batches[0], "gpt", tcfg.lr, seed, tcfg=tcfg
    )
    for batch in batches:
      side.step(batch)
    curves[dtype] = side.losses
    del side

  def mean10(xs):
    return [statistics.fmean(xs[max(0, i - 9) : i + 1]) for i in range(len(xs))]

  gaps = [abs(b - f) / f for f, b in zip(mean10(curves["float32"]), mean10(curves["bfloat16"]))]
  return {
    "steps": steps,
    "data": out,
    "ids_used": dataset.vocab_size,
    "lr": tcfg.lr,
    "warmup_steps": tcfg.warmup_steps,
    "schedule": tcfg.schedule,
    "losses": curves,
    "relative_gap_10_step_mean": gaps,
    "max_relative_gap": max(gaps),
    "final_relative_gap": gaps[-1],
  }


def _summary(times: list[float]) -> dict:
  return {"median": statistics.median(times), "min": min(times), "all": times}


def _progress(text: str) -> None:
  """One line on stderr as the run goes (a run stopped by a time limit leaves its trace)."""
  print(f"# {text}", file=sys.stderr, flush=True)


def _profiles(sides: dict, steps: int, keep_dir: str | None = None) -> dict:
  """Each side's device kernels over ``steps`` more steps (``bench.profile``), with the same
  steps' median wall time; each trace kept in ``keep_dir`` when given."""

  if keep_dir:
    os.makedirs(keep_dir, exist_ok=True)
  out = {}
  for name, side in sides.items():
    walls: list[float] = []
    record = lambda side=side, walls=walls: walls.append(side.step())  # noqa: E731
    keep = os.path.join(keep_dir, f"{name}.trace.json.gz") if keep_dir else None
    out[name] = (
      profile.jax_kernels(record, steps, keep)
      if isinstance(side, (Ours, Library))
      else profile.torch_kernels(record, steps, keep)
    )
    out[name]["wall_ms_per_step"] = 1e3 * statistics.median(walls)
    _progress(
      f"{name} profiled: {out[name].get('device_ms_per_step', 0):.1f} ms of kernels "
      f"in a {out[name]['wall_ms_per_step']:.1f} ms step"
    )
  return out


def run(args) -> dict:
  """Runs the benchmark described by ``args`` (see ``add_args``); returns the result dict."""

  hardware.share_gpu_memory()  # before JAX starts its backend, where it has not yet
  runtime.bf16_notice(args.dtype)
  if args.curve_steps < 0:
    raise ValueError(f"--curve-steps {args.curve_steps}: must be 0 (off) or a number of steps")
  if args.profile < 0:
    raise ValueError(f"--profile {args.profile}: must be 0 (off) or a number of steps")
  rivals = [r for r in args.against.split(",") if r and r != "none"]
  for r in rivals:
    if r not in ("torch", "torch.compile"):
      raise ValueError(f"--against: {r!r} is not one of torch, torch.compile, none")
  overrides = parse_model_overrides(getattr(args, "model", None) or [])
  table = parse_table(getattr(args, "table", None) or [], backends.platform())
  config = models.get_config(args.preset, dtype=args.dtype, remat=args.remat, **overrides)
  if rivals and not isinstance(config, (GPTConfig, MambaConfig)):
    raise ValueError(
      f"--against {args.against}: the PyTorch rival is a causal LM (GPT presets, "
      f"Mamba presets); {args.preset} is a {type(config).__name__} (use --against "
      "none)"
    )
  args.seq_len = resolve_seq_len(args, config)
  config = dataclasses.replace(
    config, **{f: 0.0 for f in ("dropout_rate", "attention_dropout_rate") if hasattr(config, f)}
  )
  host_batch, task_name = random_batch(config, args.batch_size, args.seq_len, args.seed)
  tc = TrainConfig()
  lr = 1e-4
  platform, kind = backends.platform(), hardware.device_kind()
  shapes = step_matmul_shapes(config, args.batch_size * args.seq_len)
  start = time.perf_counter()
  # The float32 limit on CPU always (the bfloat16 step is also compared with it there); on an
  # accelerator only the run's own dtype.
  limits = (
    {"float32": machine.run_matmul_limit(shapes, dtype="float32")}
    if platform == "cpu" or args.dtype == "float32"
    else {}
  )
  if args.dtype == "bfloat16" and (platform != "cpu" or hardware.has_bf16_units()):
    limits["bfloat16"] = machine.run_matmul_limit(shapes, dtype="bfloat16")
  _progress(f"matmul limit measured in {time.perf_counter() - start:.0f} s")

  start = time.perf_counter()
  sides = {"ours": Ours(config, host_batch, task_name, lr, args.seed)}
  _progress(f"our step compiled in {time.perf_counter() - start:.0f} s")
  if table is not None:
    start = time.perf_counter()
    sides["ours+table"] = Ours(config, host_batch, task_name, lr, args.seed, table=table)
    _progress(f"our step with {table.changed()} compiled in {time.perf_counter() - start:.0f} s")
  if getattr(args, "library", False):
    start = time.perf_counter()
    sides["library"] = Library(config, host_batch, task_name, lr, args.seed)
    _progress(f"the library's step compiled in {time.perf_counter() - start:.0f} s")
  left_out = {}
  device, why_not = machine.torch_device() if rivals else (None, "")
  autocast = "bfloat16" if device == "cuda" and args.dtype == "bfloat16" else None
  for r in rivals:
    if device is None:
      left_out[r] = why_not
      print(f"# {r}: left out ({why_not})", file=sys.stderr)
      continue
    try:
      side = Torch(
        config,
        sides["ours"].params,
        host_batch,
        lr,
        tc.weight_decay,
        tc.clip_norm,
        tc.b1,
        tc.b2,
        tc.eps,
        compiled=r == "torch.compile",
        device=device,
        autocast=autocast,
      )
      _progress(f"{r} built")
      if r == "torch.compile":
        took = side.compile()
        _progress(f"torch.compile compiled in {took:.0f} s")
        if took > args.compile_timeout:
          left_out[r] = f"torch.compile took {took:.0f} s, over --compile-timeout"
          print(f"# torch.compile took {took:.0f} s: left out", file=sys.stderr)
          continue
      sides[r] = side
    except Exception as e:  # noqa: BLE001 - a rival that fails to build is reported, not fatal
      left_out[r] = f"could not run ({type(e).__name__}: {e})"
      print(f"# {r}: could not run ({type(e).__name__}: {e})", file=sys.stderr)
  first = {name: side.step() for name, side in sides.items()}
  _progress("first steps: " + ", ".join(f"{name} {t:.2f} s" for name, t in first.items()))
  for _ in range(args.warmup):
    for side in sides.values():
      side.step()
  times = {name: [] for name in sides}
  kernel = {name: {"minor_faults": [], "sys_s": []} for name in sides}
  for _ in range(args.steps):
    for name, side in sides.items():
      before = resource.getrusage(resource.RUSAGE_SELF)
      times[name].append(side.step())
      after = resource.getrusage(resource.RUSAGE_SELF)
      # Fresh pages the step faulted in (and the kernel time they cost): memory the allocator
      # gave back to the kernel and took again.
      kernel[name]["minor_faults"].append(after.ru_minflt - before.ru_minflt)
      kernel[name]["sys_s"].append(after.ru_stime - before.ru_stime)
  med = {name: statistics.median(t) for name, t in times.items()}
  per_step = {
    name: {
      **{f"{k}_per_step": statistics.median(v) for k, v in kernel[name].items()},
      **{f"{k}_all": v for k, v in kernel[name].items()},
    }
    for name in sides
  }

  tokens = args.batch_size * args.seq_len
  is_s2s = isinstance(config, Seq2SeqConfig)
  flops_per_token = models.train_flops_per_token(config, args.seq_len) / (2 if is_s2s else 1)
  tokens_per_step = tokens * (2 if is_s2s else 1)
  step_flops = flops_per_token * tokens_per_step
  ref = (limits.get(args.dtype) or limits["float32"])["flops_per_sec"]
  peak = hardware.peak_flops(kind, args.dtype)

  def vs_peak(name: str) -> dict:  # the same rate against the datasheet, where it is known
    return {"mfu_vs_peak": step_flops / med[name] / peak} if peak else {}

  def our_row(name: str) -> dict:  # one of our sides ("ours", "ours+table", "library")
    side = sides[name]
    return {
      "compile_s": side.compile_s,
      "trace_s": side.trace_s,
      "first_step_s": first[name],
      "step_s": _summary(times[name]),
      "tokens_per_sec": tokens_per_step / med[name],
      "model_flops_per_sec": step_flops / med[name],
      "mfu": step_flops / med[name] / ref,
      **vs_peak(name),
      "losses": side.losses,
      "temp_bytes": side.temp_bytes,
      **per_step[name],
    }

  ours = sides["ours"]
  result = {
    "benchmark": "train step",
    "preset": args.preset,
    "batch_size": args.batch_size,
    "seq_len": args.seq_len,
    "dtype": args.dtype,
    "remat": args.remat,
    "model_overrides": overrides,
    "device_kind": kind,
    "platform": platform,
    # "auto" resolves by dtype and CPU (models.unrolls_layers): the layers ran unrolled or scanned.
    "layers": "unrolled" if models.unrolls_layers(config) else "scanned",
    "microbatches": ours.microbatches,
    "compile_s_by_microbatches": ours.compile_s_by_microbatches,
    "params": models.count_params(config),
    "model_flops_per_step": step_flops,
    "ours": our_row("ours"),
    "limit": {"matmul": limits, "step_floor_s": step_flops / ref},
  }
  if peak:
    result["limit"]["peak_flops"] = peak
  if platform == "gpu":
    result["xla_python_client_preallocate"] = os.environ.get("XLA_PYTHON_CLIENT_PREALLOCATE")
  for name in rivals:
    if name in sides:
      side = sides[name]
      result[name] = {
        "first_step_s": first[name],
        "step_s": _summary(times[name]),
        "tokens_per_sec": tokens_per_step / med[name],
        "mfu": step_flops / med[name] / ref,
        **vs_peak(name),
        "architecture": side.architecture,
        "losses": side.losses,
        "device": side.device,
        "autocast": side.autocast,
        "fused_adamw": side.fused_adamw,
        **per_step[name],
      }
      result[f"speedup_vs_{name}"] = med[name] / med["ours"]
      # Same weights, tokens and loss: the first losses agree to float32 rounding.
      result[f"first_loss_diff_vs_{name}"] = abs(side.losses[0] - ours.losses[0])
  if "torch.compile" in sides:
    result["ratio_vs_torch_compile"] = med["torch.compile"] / med["ours"]
  if table is not None:
    result["table"] = table.changed()
    result["ours+table"] = our_row("ours+table")
    result["speedup_of_table"] = med["ours"] / med["ours+table"]
    # The same step from the same weights: the first losses agree to the levers' rounding.
    result["first_loss_diff_of_table"] = abs(sides["ours+table"].losses[0] - ours.losses[0])
    if "torch.compile" in sides:
      result["ratio_vs_torch_compile_with_table"] = med["torch.compile"] / med["ours+table"]
  if "library" in sides:
    result["library"] = {**our_row("library"), "microbatches": sides["library"].microbatches}
    result["library_vs_ours"] = med["library"] / med["ours"]
  if left_out:
    result["left_out"] = left_out
  if args.profile:
    result["profile"] = _profiles(sides, args.profile, getattr(args, "profile_dir", None))
  if args.curve_steps:
    del sides
    result["loss_curves"] = loss_curves(
      config, args.curve_steps, args.batch_size, args.seq_len, args.seed, args.curve_data
    )
  return result


def table(result: dict) -> str:
  """The result as a few aligned lines."""
  ref = result["limit"]["step_floor_s"]
  on_cpu = result.get("platform", "cpu") == "cpu"
  on = "" if on_cpu else f" on {result['device_kind']}"
  matmul = result["limit"]["matmul"]
  widest = matmul[list(matmul)[-1]]["flops_per_sec"]
  lines = [
    f"train step {result['preset']} {result['batch_size']}x{result['seq_len']} "
    f"{result['dtype']}{on}, layers {result['layers']}: floor "
    f"{ref:.{2 if on_cpu else 4}f} s at "
    "the measured matmul limit "
    f"({widest / 1e9:.0f} GFLOP/s)"
  ]
  if result.get("model_overrides"):
    lines.append(
      "  model overrides: " + ", ".join(f"{k}={v}" for k, v in result["model_overrides"].items())
    )
  if result.get("table"):
    lines.append("  ours+table: " + ", ".join(f"{k}={v}" for k, v in result["table"].items()))
  for name in ("ours", "ours+table", "library", "torch", "torch.compile"):
    if name in result:
      r = result[name]
      extra = (
        f"  {result.get(f'speedup_vs_{name}', 1.0):.2f}x"
        if name not in ("ours", "ours+table", "library")
        else ""
      )
      peak = f" ({100 * r['mfu_vs_peak']:.1f}% of peak)" if "mfu_vs_peak" in r else ""
      where = (
        f"  [{r['device']}" + (f", autocast {r['autocast']}" if r.get("autocast") else "") + "]"
        if r.get("device", "cpu") != "cpu"
        else ""
      )
      step = f"{r['step_s']['median']:7.2f}" if on_cpu else f"{r['step_s']['median']:7.4f}"
      lines.append(
        f"  {name:<14s} {step} s/step  "
        f"{r['tokens_per_sec']:8.0f} tok/s  MFU {100 * r['mfu']:5.1f}%{peak}"
        + (f"  (ours is{extra} faster)" if extra else "")
        + where
      )
  if "ratio_vs_torch_compile" in result:
    lines.append(
      f"  ratio vs torch.compile: {result['ratio_vs_torch_compile']:.2f}x "
      "(their median step / ours)"
    )
  if "speedup_of_table" in result:
    lines.append(
      f"  ours+table: {result['speedup_of_table']:.3f}x ours"
      + (
        f", {result['ratio_vs_torch_compile_with_table']:.2f}x vs torch.compile"
        if "ratio_vs_torch_compile_with_table" in result
        else ""
      )
    )
  if "library_vs_ours" in result:
    lines.append(f"  library: {result['library_vs_ours']:.3f}x ours' step time")
  for name, why in result.get("left_out", {}).items():
    lines.append(f"  {name}: left out ({why})")
  if "loss_curves" in result:
    c = result["loss_curves"]
    lines.append(
      f"  loss curves over {c['steps']} steps: bfloat16 within "
      f"{100 * c['max_relative_gap']:.2f}% of float32 (10-step means; final "
      f"{c['losses']['float32'][-1]:.3f} vs {c['losses']['bfloat16'][-1]:.3f})"
    )
  return "\n".join(lines)
