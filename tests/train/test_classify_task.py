"""The classify task: head shapes and pooling per family, loss and metrics against NumPy."""

import chex
import jax
import jax.numpy as jnp
import numpy as np
import pytest

from transformer_jax import models
from transformer_jax.train import tasks

C = 5
CONFIGS = {
  "bert": models.get_config(
    "bert-tiny",
    vocab_size=50,
    d_model=32,
    num_layers=1,
    num_heads=2,
    d_ff=64,
    max_len=16,
    num_labels=C,
    dropout_rate=0.0,
    attention_dropout_rate=0.0,
  ),
  "gpt": models.get_config(
    "gpt2-tiny",
    vocab_size=50,
    d_model=32,
    num_layers=1,
    num_heads=2,
    d_ff=64,
    max_len=16,
    num_labels=C,
  ),
  "seq2seq": models.get_config(
    "transformer-tiny",
    vocab_size=50,
    d_model=32,
    num_encoder_layers=1,
    num_decoder_layers=1,
    num_heads=2,
    d_ff=64,
    max_len=16,
    num_labels=C,
    dropout_rate=0.0,
  ),
}


def _batch(seed=0, b=6, t=12):
  rng = np.random.default_rng(seed)
  lengths = rng.integers(2, t + 1, b)
  mask = np.arange(t)[None] < lengths[:, None]
  return {
    "tokens": np.where(mask, rng.integers(0, 50, (b, t)), 0).astype(np.int32),
    "token_types": np.zeros((b, t), np.int32),
    "attention_mask": mask,
    "labels": rng.integers(0, C, b).astype(np.int32),
    "label_mask": np.array([True] * (b - 1) + [False]),
  }


@pytest.fixture(scope="module", params=list(CONFIGS))
def family_model(request):
  return request.param, models.create(CONFIGS[request.param])


def test_head_shapes_and_parameter_count(family_model):
  family, model = family_model
  chex.assert_shape(model.classifier.kernel[...], (32, C))
  chex.assert_shape(model.classifier.bias[...], (C,))
  n = sum(x.size for x in jax.tree.leaves(models.init_abstract(CONFIGS[family])))
  assert n == models.count_params(CONFIGS[family])


def test_pooling_per_family(family_model):
  family, model = family_model
  batch = _batch()
  task = tasks.ClassifyTask(family, C)
  logits = np.asarray(task.logits(model, batch, None), np.float64)
  chex.assert_shape(logits, (6, C))
  w = np.asarray(model.classifier.kernel[...], np.float64)
  bias = np.asarray(model.classifier.bias[...], np.float64)
  mask = batch["attention_mask"]
  if family == "gpt":
    h = np.asarray(model.hidden_states(batch["tokens"], attention_mask=mask), np.float64)
    last = mask.sum(1) - 1
    pooled = h[np.arange(6), last]
  elif family == "seq2seq":
    h = np.asarray(model.encode(batch["tokens"], mask), np.float64)
    pooled = (h * mask[..., None]).sum(1) / mask.sum(1, keepdims=True)
  else:
    _, pooled = model.encode(batch["tokens"], batch["token_types"], mask)
    pooled = np.asarray(pooled, np.float64)
  np.testing.assert_allclose(logits, pooled @ w + bias, rtol=1e-4, atol=1e-5)


def test_padding_after_the_last_token_changes_nothing():
  model = models.create(CONFIGS["gpt"])
  batch = _batch(1)
  task = tasks.ClassifyTask("gpt", C)
  a = task.logits(model, batch, None)
  other = dict(batch, tokens=np.where(batch["attention_mask"], batch["tokens"], 7))
  np.testing.assert_allclose(a, task.logits(model, other, None), atol=1e-6)


def test_loss_and_metrics_match_numpy(family_model):
  family, model = family_model
  task = tasks.ClassifyTask(family, C)
  batch = _batch(2, b=8)
  loss, metrics = task.sums(model, batch, None)
  logits = np.asarray(task.logits(model, batch, None), np.float64)
  m = batch["label_mask"]
  logp = logits - np.log(np.exp(logits).sum(-1, keepdims=True))
  want = -np.sum(logp[np.arange(8), batch["labels"]] * m)
  np.testing.assert_allclose(float(loss["cls"]), want, rtol=1e-5)
  pred = logits.argmax(-1)
  assert float(metrics["cls_correct"]) == np.sum((pred == batch["labels"]) & m)
  np.testing.assert_array_equal(metrics["cls_true"], np.bincount(batch["labels"][m], minlength=C))
  np.testing.assert_array_equal(metrics["cls_pred"], np.bincount(pred[m], minlength=C))
  counts = task.counts(batch)
  assert float(counts["cls"]) == m.sum()


def test_macro_f1_against_numpy():
  rng = np.random.default_rng(0)
  true, pred = rng.integers(0, 4, 200), rng.integers(0, 4, 200)
  pred[:50] = true[:50]

  def onehot(y):
    return np.eye(5)[y]  # class 4 never occurs: left out of the mean

  sums = {
    "cls_true": onehot(true).sum(0),
    "cls_pred": onehot(pred).sum(0),
    "cls_hit": (onehot(true) * onehot(pred)).sum(0),
  }
  report = tasks.ClassifyTask.report(sums)
  f1s = []
  for c in range(4):
    tp = np.sum((pred == c) & (true == c))
    prec, rec = tp / np.sum(pred == c), tp / np.sum(true == c)
    f1s.append(2 * prec * rec / (prec + rec))
  assert report["macro_f1"] == pytest.approx(np.mean(f1s))
  assert report["accuracy"] == pytest.approx(np.mean(true == pred))
  assert report["per_class"]["true"] == np.bincount(true, minlength=5).tolist()


def test_macro_f1_counts_only_classes_present_in_the_split():
  # Class 2 has no example in the split but is predicted (the stdlib task's validation split has
  # no tkinter function): its F1 is undefined and stays out of the mean, as the classes with
  # neither; the wrong predictions still cost the true classes their recall.
  true = np.array([0, 0, 0, 1, 1, 3, 3, 3])
  pred = np.array([0, 2, 0, 1, 2, 3, 0, 3])
  eye = np.eye(5)
  sums = {
    "cls_true": eye[true].sum(0),
    "cls_pred": eye[pred].sum(0),
    "cls_hit": (eye[true] * eye[pred]).sum(0),
  }
  f1s = []
  for c in np.unique(true):  # an independent computation: the classes the split holds
    tp = np.sum((pred == c) & (true == c))
    prec, rec = tp / max(np.sum(pred == c), 1), tp / np.sum(true == c)
    f1s.append(0.0 if tp == 0 else 2 * prec * rec / (prec + rec))
  report = tasks.ClassifyTask.report(sums)
  assert report["macro_f1"] == pytest.approx(np.mean(f1s))
  assert report["macro_f1"] == pytest.approx((2 / 3 + 2 / 3 + 0.8) / 3)  # classes 0, 1, 3
  assert report["accuracy"] == pytest.approx(5 / 8)


def test_classify_needs_a_head():
  cfg = CONFIGS["gpt"].__class__(
    vocab_size=50, d_model=32, num_layers=1, num_heads=2, d_ff=64, max_len=16
  )
  model = models.create(cfg)
  with pytest.raises(ValueError, match="num_labels > 0"):
    model.classify(jnp.zeros((1, 4), jnp.int32))
