"""Training objectives per family, written as token-weighted sums so gradient accumulation over
microbatches gives exactly the full-batch gradient.

Each task gives ``counts(batch)`` (the denominators, computed on the whole batch) and
``sums(model, batch, rng, ...)`` (numerators: loss sums and metric sums over one microbatch). The
loss is ``sum_c sums[c] / counts[c]`` over the loss components ``c``.

Every task is built by ``from_experiment(exp, model_config)`` (checked against the model by
:func:`for_experiment`) and answers for itself what differs between tasks: the model's defaults
from the dataset (``model_defaults``), what an evaluation adds to the mean losses
(``eval_summary``) and what ``final.json`` adds (``final_summary``). Nothing outside this module
asks a task its name.
"""

from __future__ import annotations

import math
from typing import Any

import jax
import jax.numpy as jnp
import numpy as np

from transformer_jax import data as data_lib
from transformer_jax import models, ops

Batch = dict[str, jax.Array]


def _shapes(batch_size: int, seq_len: int, ints=(), bools=(), rows=()) -> dict:
  """``ShapeDtypeStruct`` batch: int32/bool ``[B, T]`` fields and int32 ``[B]`` fields."""
  out = {k: jax.ShapeDtypeStruct((batch_size, seq_len), jnp.int32) for k in ints}
  out.update({k: jax.ShapeDtypeStruct((batch_size, seq_len), jnp.bool_) for k in bools})
  out.update({k: jax.ShapeDtypeStruct((batch_size,), jnp.int32) for k in rows})
  return out


def _ce_sum(logits, labels, mask, label_smoothing, z_loss):
  loss, count = ops.cross_entropy(
    logits, labels, mask=mask, label_smoothing=label_smoothing, z_loss=z_loss
  )
  return loss * count


def _correct(logits, labels, mask):
  """How many (masked-in) rows give their label the largest logit; a tie for the top counts.

  No argmax: the label's logit is compared with the row's max, which the cross-entropy's
  logsumexp computes from the same logits, so XLA computes it once. An argmax over a GPT-2 batch's
  ``[4, 256, 50257]`` logits cost 40 ms more per step on a 2-core AMD EPYC (Zen 4); this costs
  nothing measurable (experiments/PERFORMANCE.md). A row holding a NaN counts as wrong.
  """
  top = jnp.max(logits, axis=-1)
  picked = jnp.take_along_axis(logits, labels[..., None].astype(jnp.int32), axis=-1)[..., 0]
  return jnp.sum((picked >= top) * mask.astype(jnp.float32))


class _Task:
  """What the tasks share: the defaults and summaries of a language-modelling task."""

  samples = False  # the run ends with generated text samples (train.samples)
  packed = False  # batches pack several documents per row, kept apart by segment ids

  @staticmethod
  def model_defaults(dataset) -> dict[str, Any]:
    """Model-config fields the dataset decides (its vocabulary)."""
    return {"vocab_size": dataset.vocab_size}

  def eval_summary(self, sums, means: dict[str, float]) -> tuple[dict[str, float], Any]:
    """What an evaluation reports beyond the mean losses and accuracies (``means``: the summed
    metrics' :func:`summarize`): the first term's perplexity; and its per-class report (None)."""
    first = self.loss_terms[0]
    return {"val_perplexity": math.exp(min(means[f"{first}_loss"], 50.0))}, None

  @staticmethod
  def final_summary(dataset, per_class) -> dict[str, Any]:
    """What ``final.json`` records beyond the last evaluation (nothing here)."""
    return {}


class GPTTask(_Task):
  """Next-token prediction on packed windows (segment ids keep documents apart).

  ``loss_head``: ``train.loss_head``: "logits" (the model's ``[B, T, V]`` logits, then
  ``ops.cross_entropy``) or "fused" (``GPT.lm_loss``: no ``[B, T, V]`` array)."""

  name = "gpt"
  config_type = (models.GPTConfig, models.MambaConfig)  # every decoder-only language model
  loss_terms = ("lm",)
  keys = ("tokens", "labels", "segment_ids", "positions", "loss_mask")
  token_keys = ("tokens", "labels")  # ids checked against the vocabulary on the host
  uses_seq_len = True
  bars = ("val_loss_below_unigram",)  # learning bars this task can check
  samples = True
  packed = True

  def __init__(self, loss_head: str = "logits"):
    self.loss_head = loss_head

  @classmethod
  def from_experiment(cls, exp, model_config=None) -> "GPTTask":
    return cls(loss_head=exp.train.loss_head)

  @staticmethod
  def loader(dataset, exp):
    t, d = exp.train, exp.data
    if d.mixture:  # the sources by weight; ``dataset`` is the one evaluated on
      return data_lib.load_mixture(
        d.mixture,
        d.stages,
        batch_size=t.batch_size,
        seq_len=t.seq_len,
        seed=t.seed,
        max_epochs=d.max_epochs,
      )
    return data_lib.GPTLoader(dataset, batch_size=t.batch_size, seq_len=t.seq_len, seed=t.seed)

  @staticmethod
  def eval_batches(dataset, exp):
    t = exp.train
    return data_lib.gpt_eval_batches(
      dataset, batch_size=t.batch_size, seq_len=t.seq_len, max_batches=t.eval_batches
    )

  @staticmethod
  def counts(batch: Batch) -> dict[str, jax.Array]:
    return {"lm": jnp.sum(batch["loss_mask"].astype(jnp.float32))}

  @staticmethod
  def batch_shapes(batch_size: int, seq_len: int) -> dict[str, jax.ShapeDtypeStruct]:
    """The shapes of a batch (what ``--dry-run`` compiles against)."""
    return _shapes(
      batch_size,
      seq_len,
      ints=("tokens", "labels", "segment_ids", "positions"),
      bools=("loss_mask",),
    )

  def sums(self, model, batch: Batch, rng, *, label_smoothing=0.0, z_loss=0.0):
    mask = batch["loss_mask"]
    moe = {"moe_stats": []} if getattr(model.config, "num_experts", 0) else {}
    if self.loss_head == "fused":
      loss_sum, correct = model.lm_loss(
        batch["tokens"],
        batch["labels"],
        mask,
        batch["positions"],
        batch["segment_ids"],
        dropout_rng=rng,
        label_smoothing=label_smoothing,
        z_loss=z_loss,
        **moe,
      )
      metrics = {"lm_correct": correct}
      if moe:
        metrics.update(moe_sums(model.config, moe["moe_stats"][0], mask))
      return {"lm": loss_sum}, metrics
    logits = model(
      batch["tokens"], batch["positions"], batch["segment_ids"], dropout_rng=rng, **moe
    )
    loss = {"lm": _ce_sum(logits, batch["labels"], mask, label_smoothing, z_loss)}
    metrics = {"lm_correct": _correct(logits, batch["labels"], mask)}
    if moe:
      metrics.update(moe_sums(model.config, moe["moe_stats"][0], mask))
    return loss, metrics


class BERTTask(_Task):
  """Masked-LM plus next-sentence prediction (the two losses added, as in the BERT paper).

  Only the masked positions go through the MLM head: each row's (at most ``max_predictions``)
  masked positions are gathered first, as BERT's own pretraining code does, which saves most of
  the vocabulary projection.
  """

  name = "bert"
  config_type = models.BERTConfig
  loss_terms = ("mlm", "nsp")
  keys = ("tokens", "token_types", "attention_mask", "mlm_labels", "mlm_mask", "nsp_labels")
  token_keys = ("tokens", "mlm_labels")
  uses_seq_len = True
  bars = ("mlm_accuracy_over_baseline",)

  def __init__(self, max_predictions: int | None = None):
    self.max_predictions = max_predictions

  @classmethod
  def from_experiment(cls, exp, model_config=None) -> "BERTTask":
    # The loader masks max(1, round(mask_prob * n)) of n <= seq_len tokens per row.
    return cls(max_predictions=int(math.ceil(exp.data.mask_prob * exp.train.seq_len)) + 1)

  @staticmethod
  def loader(dataset, exp):
    t = exp.train
    return data_lib.BertLoader(
      dataset, batch_size=t.batch_size, seq_len=t.seq_len, seed=t.seed, mask_prob=exp.data.mask_prob
    )

  @staticmethod
  def eval_batches(dataset, exp):
    t = exp.train
    return data_lib.bert_eval_batches(
      dataset, batch_size=t.batch_size, seq_len=t.seq_len, num_batches=t.eval_batches
    )

  @staticmethod
  def counts(batch: Batch) -> dict[str, jax.Array]:
    return {
      "mlm": jnp.sum(batch["mlm_mask"].astype(jnp.float32)),
      "nsp": jnp.sum(jnp.any(batch["attention_mask"], -1).astype(jnp.float32)),
    }

  @staticmethod
  def batch_shapes(batch_size: int, seq_len: int) -> dict[str, jax.ShapeDtypeStruct]:
    return _shapes(
      batch_size,
      seq_len,
      ints=("tokens", "token_types", "mlm_labels"),
      bools=("attention_mask", "mlm_mask"),
      rows=("nsp_labels",),
    )

  def sums(self, model, batch: Batch, rng, *, label_smoothing=0.0, z_loss=0.0):
    x_BTD, pooled_BD = model.encode(
      batch["tokens"], batch["token_types"], batch["attention_mask"], dropout_rng=rng
    )
    mask_BT, labels_BT = batch["mlm_mask"], batch["mlm_labels"]
    t = mask_BT.shape[1]
    k = t if self.max_predictions is None else min(self.max_predictions, t)
    # Masked positions first (stable), then the first k of them: [B, K].
    idx_BK = jnp.argsort(~mask_BT, axis=1, stable=True)[:, :k]
    x_BKD = jnp.take_along_axis(x_BTD, idx_BK[..., None], axis=1)
    mask_BK = jnp.take_along_axis(mask_BT, idx_BK, axis=1)
    labels_BK = jnp.take_along_axis(labels_BT, idx_BK, axis=1)
    mlm_logits = model.mlm_logits(x_BKD)
    nsp_logits = model.nsp(pooled_BD).astype(jnp.float32)
    real = jnp.any(batch["attention_mask"], -1)
    loss = {
      "mlm": _ce_sum(mlm_logits, labels_BK, mask_BK, label_smoothing, z_loss),
      "nsp": _ce_sum(nsp_logits, batch["nsp_labels"], real, 0.0, 0.0),
    }
    metrics = {
      "mlm_correct": _correct(mlm_logits, labels_BK, mask_BK),
      "nsp_correct": _correct(nsp_logits, batch["nsp_labels"], real),
    }
    return loss, metrics


class Seq2SeqTask(_Task):
  """Teacher-forced target prediction."""

  name = "seq2seq"
  config_type = models.Seq2SeqConfig
  loss_terms = ("s2s",)
  keys = ("src", "src_mask", "tgt_in", "tgt_out", "tgt_mask")
  token_keys = ("src", "tgt_in", "tgt_out")
  uses_seq_len = False  # length-bucketed batches
  bars = ("exact_match",)

  @classmethod
  def from_experiment(cls, exp, model_config=None) -> "Seq2SeqTask":
    return cls()

  @staticmethod
  def loader(dataset, exp):
    return data_lib.Seq2SeqLoader(dataset, batch_size=exp.train.batch_size, seed=exp.train.seed)

  @staticmethod
  def eval_batches(dataset, exp):
    batches = data_lib.seq2seq_eval_batches(dataset, batch_size=exp.train.batch_size)
    return (b for _, b in zip(range(exp.train.eval_batches), batches))

  @staticmethod
  def counts(batch: Batch) -> dict[str, jax.Array]:
    return {"s2s": jnp.sum(batch["tgt_mask"].astype(jnp.float32))}

  @staticmethod
  def batch_shapes(batch_size: int, seq_len: int) -> dict[str, jax.ShapeDtypeStruct]:
    """Source and target both ``seq_len`` long (the loader's buckets vary; this is the longest)."""
    return _shapes(
      batch_size, seq_len, ints=("src", "tgt_in", "tgt_out"), bools=("src_mask", "tgt_mask")
    )

  @staticmethod
  def sums(model, batch: Batch, rng, *, label_smoothing=0.0, z_loss=0.0):
    logits = model(
      batch["src"], batch["tgt_in"], batch["src_mask"], batch["tgt_mask"], dropout_rng=rng
    )
    mask = batch["tgt_mask"]
    loss = {"s2s": _ce_sum(logits, batch["tgt_out"], mask, label_smoothing, z_loss)}
    metrics = {"s2s_correct": _correct(logits, batch["tgt_out"], mask)}
    return loss, metrics


class ClassifyTask(_Task):
  """Sequence classification: cross-entropy over labels, one prediction per example.

  The same task serves every family, each pooling in its own way: BERT the [CLS] position (its
  pooler), GPT the last real token, a seq2seq model the mean of its encoder states. Eval sums a
  confusion summary per class (true, predicted, correct) for macro-F1 and per-class counts.
  """

  name = "classify"
  config_type = (models.BERTConfig, models.GPTConfig, models.Seq2SeqConfig)
  loss_terms = ("cls",)
  keys = ("tokens", "token_types", "attention_mask", "labels", "label_mask")
  token_keys = ("tokens",)
  uses_seq_len = True
  bars = ("accuracy_over_majority",)

  def __init__(self, family: str = "bert", num_labels: int | None = None):
    if family not in ("bert", "gpt", "seq2seq"):
      raise ValueError(f"family={family!r}: expected 'bert', 'gpt' or 'seq2seq'")
    self.family = family
    self.num_labels = num_labels

  @classmethod
  def from_experiment(cls, exp, model_config=None) -> "ClassifyTask":
    """The task for ``model_config``'s family and labels.

    Raises:
      ValueError: a model without labels (``num_labels`` comes from the dataset's labels).
    """
    if model_config is None:
      return cls("bert")
    if not getattr(model_config, "num_labels", 0):
      raise ValueError(
        "data.task='classify' needs a model with num_labels > 0 (taken from the dataset's labels)"
      )
    return cls(family_task(model_config), model_config.num_labels)

  @staticmethod
  def model_defaults(dataset) -> dict[str, Any]:
    """The dataset's vocabulary and its number of labels."""
    return {"vocab_size": dataset.vocab_size, "num_labels": len(dataset.meta["labels"])}

  def eval_summary(self, sums, means: dict[str, float]) -> tuple[dict[str, float], Any]:
    """Accuracy and macro-F1 (:meth:`report`), and the per-class report."""
    report = self.report(sums)
    extra = {"val_accuracy": report["accuracy"], "val_macro_f1": report["macro_f1"]}
    return extra, report["per_class"]

  @staticmethod
  def final_summary(dataset, per_class) -> dict[str, Any]:
    """The majority-class baseline, the labels and the last per-class report."""
    return {
      "majority_baseline": dataset.meta["majority_baseline"]["val_accuracy"],
      "labels": dataset.meta["labels"],
      "per_class": per_class,
    }

  def loader(self, dataset, exp):
    t = exp.train
    return data_lib.ClassifyLoader(
      dataset,
      batch_size=t.batch_size,
      seq_len=t.seq_len,
      seed=t.seed,
      cls_token=self.family == "bert",
    )

  def eval_batches(self, dataset, exp):
    t = exp.train
    return data_lib.classify_eval_batches(
      dataset,
      batch_size=t.batch_size,
      seq_len=t.seq_len,
      cls_token=self.family == "bert",
      max_batches=t.eval_batches,
    )

  @staticmethod
  def counts(batch: Batch) -> dict[str, jax.Array]:
    return {"cls": jnp.sum(batch["label_mask"].astype(jnp.float32))}

  @staticmethod
  def batch_shapes(batch_size: int, seq_len: int) -> dict[str, jax.ShapeDtypeStruct]:
    out = _shapes(
      batch_size,
      seq_len,
      ints=("tokens", "token_types"),
      bools=("attention_mask",),
      rows=("labels",),
    )
    out["label_mask"] = jax.ShapeDtypeStruct((batch_size,), jnp.bool_)
    return out

  def logits(self, model, batch: Batch, rng) -> jax.Array:
    """``[B, C]`` float32 logits of the family's classification entry point."""
    mask = batch["attention_mask"]
    match self.family:
      case "bert":
        return model.classify(batch["tokens"], batch["token_types"], mask, dropout_rng=rng)
      case "gpt":
        return model.classify(batch["tokens"], mask, dropout_rng=rng)
      case _:
        return model.classify(batch["tokens"], mask, dropout_rng=rng)

  def sums(self, model, batch: Batch, rng, *, label_smoothing=0.0, z_loss=0.0):
    logits_BC = self.logits(model, batch, rng)
    labels_B, mask_B = batch["labels"], batch["label_mask"]
    loss = {
      "cls": _ce_sum(
        logits_BC[:, None], labels_B[:, None], mask_B[:, None], label_smoothing, z_loss
      )
    }
    pred_B = ops.argmax(logits_BC, -1)
    w_B = mask_B.astype(jnp.float32)
    c = logits_BC.shape[-1]
    true_BC = jax.nn.one_hot(labels_B, c) * w_B[:, None]
    pred_BC = jax.nn.one_hot(pred_B, c) * w_B[:, None]
    metrics = {
      "cls_correct": jnp.sum((pred_B == labels_B) * w_B),
      "cls_true": jnp.sum(true_BC, 0),
      "cls_pred": jnp.sum(pred_BC, 0),
      "cls_hit": jnp.sum(true_BC * pred_BC, 0),
    }
    return loss, metrics

  @staticmethod
  def report(sums) -> dict:
    """Accuracy, macro-F1 and per-class counts from summed eval metrics. The macro-F1 averages
    the classes present in the split (at least one example): a class without one has no recall,
    and its wrong predictions already cost the present classes theirs."""
    true, pred, hit = (np.asarray(sums[k], np.float64) for k in ("cls_true", "cls_pred", "cls_hit"))
    present = true > 0
    f1 = np.where(present, 2 * hit / np.maximum(true + pred, 1), 0.0)
    return {
      "accuracy": float(hit.sum() / max(true.sum(), 1)),
      "macro_f1": float(f1[present].mean()) if present.any() else 0.0,
      "per_class": {
        "true": true.astype(int).tolist(),
        "predicted": pred.astype(int).tolist(),
        "correct": hit.astype(int).tolist(),
      },
    }


TASKS = {"gpt": GPTTask, "bert": BERTTask, "seq2seq": Seq2SeqTask, "classify": ClassifyTask}


def get_task(name: str, **options):
  """An instance of the task ``name`` (``gpt``, ``bert``, ``seq2seq``); BERT takes
  ``max_predictions``."""
  try:
    cls = TASKS[name]
  except KeyError:
    raise ValueError(f"data.task={name!r}: expected one of {', '.join(TASKS)}") from None
  return cls(**options)


def for_experiment(exp, model_config: models.ModelConfig):
  """The task of ``exp`` (``data.task``), checked against the model's family."""
  if exp.data.task not in TASKS:
    raise ValueError(f"data.task={exp.data.task!r}: expected one of {', '.join(TASKS)}")
  cls = TASKS[exp.data.task]
  if not isinstance(model_config, cls.config_type):
    fits = family_task(model_config)
    raise ValueError(
      f"data.task={exp.data.task!r} does not fit a {type(model_config).__name__}"
      f" (use data.task={fits!r})"
    )
  for bar in exp.bars:
    if bar not in cls.bars:
      raise ValueError(
        f"bars.{bar}: not a learning bar of data.task={cls.name!r} (it has {', '.join(cls.bars)})"
      )
  return cls.from_experiment(exp, model_config)


def family_task(config: models.ModelConfig) -> str:
  """The task name of a model's family (``gpt``, ``bert``, ``seq2seq``)."""
  return next(
    name for name, c in TASKS.items() if name != "classify" and isinstance(config, c.config_type)
  )


def check_token_ids(task, batch, vocab_size: int) -> None:
  """Refuses a host batch holding ids outside ``[0, vocab_size)`` before it enters a jitted step
  (where a gather would clamp them silently)."""
  for key in task.token_keys:
    ids = batch[key]
    if ids.size and (int(ids.min()) < 0 or int(ids.max()) >= vocab_size):
      bad = ids[(ids < 0) | (ids >= vocab_size)].flat[0]
      raise ValueError(
        f"batch field {key!r} holds token id {int(bad)}, outside the model's "
        f"vocabulary [0, {vocab_size})"
      )


def moe_sums(config, stats: dict[str, jax.Array], mask) -> dict[str, jax.Array]:
  """A mixture of experts' router losses and counts as sums over one (micro)batch: the losses
  (means over layers) weighted by its loss tokens, so that summed over microbatches and divided by
  the batch's tokens they are a token-weighted mean (``stats``: ``layers.moe.MoE``'s, ``[L]``
  each). ``moe_aux``: what the training loss adds (the coefficients times the losses)."""
  n = jnp.sum(mask.astype(jnp.float32))
  balance, z = jnp.mean(stats["load_balancing"]), jnp.mean(stats["z"])
  return {
    "moe_aux": n * (config.router_aux_coef * balance + config.router_z_coef * z),
    "moe_balance": n * balance,
    "moe_z": n * z,
    "moe_tokens": stats["tokens_per_expert"],  # [L, E] copies routed to each expert
    "moe_dropped": jnp.sum(stats["dropped"]),
  }


def aux_loss(task, sums: dict[str, jax.Array], counts: dict[str, jax.Array]) -> jax.Array:
  """The regularisers the training loss adds beyond the task's terms: a mixture of experts'
  router losses per loss token (0 without experts)."""
  if "moe_aux" not in sums:
    return jnp.zeros((), jnp.float32)
  return sums["moe_aux"] / jnp.maximum(counts[task.loss_terms[0]], 1.0)


def summarize(
  task, sums: dict[str, jax.Array], counts: dict[str, jax.Array]
) -> dict[str, jax.Array]:
  """Per-term mean losses and accuracies from accumulated sums and counts."""
  out = {}
  for term in task.loss_terms:
    c = jnp.maximum(counts[term], 1.0)
    out[f"{term}_loss"] = sums[term] / c
    out[f"{term}_accuracy"] = sums[f"{term}_correct"] / c
  out["loss"] = sum(out[f"{t}_loss"] for t in task.loss_terms)
  if "moe_aux" in sums:  # router losses (not in "loss": the task's own terms, as eval reports)
    c = jnp.maximum(counts[task.loss_terms[0]], 1.0)
    out["moe_aux_loss"] = sums["moe_aux"] / c
    out["moe_balance_loss"] = sums["moe_balance"] / c
    out["moe_router_z_loss"] = sums["moe_z"] / c
    out["moe_tokens_per_expert"] = sums["moe_tokens"]
    out["moe_dropped_fraction"] = sums["moe_dropped"] / jnp.maximum(
      jnp.sum(sums["moe_tokens"]), 1.0
    )
  return out
