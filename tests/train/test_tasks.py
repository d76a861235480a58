"""Task objectives: the BERT masked-position gather equals the full MLM computation."""

import jax
import jax.numpy as jnp
import numpy as np
from flax import nnx

from transformer_jax import models
from transformer_jax.train import tasks


def test_bert_gathered_mlm_equals_full_mlm():
  config = models.get_config("bert-tiny", vocab_size=101, d_model=32, num_heads=2, d_ff=64)
  model = nnx.merge(models.graphdef(config), models.init(config, jax.random.key(0)))
  rng = np.random.default_rng(0)
  b, t = 3, 20
  mask = np.zeros((b, t), bool)
  for i, n in enumerate((1, 3, 4)):
    mask[i, rng.choice(np.arange(1, t), n, replace=False)] = True
  batch = {"tokens": jnp.asarray(rng.integers(0, 101, (b, t))),
           "token_types": jnp.zeros((b, t), jnp.int32),
           "attention_mask": jnp.ones((b, t), bool),
           "mlm_labels": jnp.asarray(np.where(mask, rng.integers(0, 101, (b, t)), 0)),
           "mlm_mask": jnp.asarray(mask), "nsp_labels": jnp.asarray([0, 1, 0])}
  full_loss, full_metrics = tasks.get_task("bert").sums(model, batch, None)
  gathered_loss, gathered_metrics = tasks.get_task("bert", max_predictions=4).sums(model, batch, None)
  for key in full_loss:
    np.testing.assert_allclose(gathered_loss[key], full_loss[key], rtol=1e-5)
  for key in full_metrics:
    np.testing.assert_allclose(gathered_metrics[key], full_metrics[key])
  # Independent check of the MLM sum: cross-entropy of the full logits at the masked positions.
  logits = np.asarray(model(batch["tokens"], batch["token_types"], batch["attention_mask"]).mlm_logits,
                      np.float64)
  logp = logits - np.log(np.exp(logits - logits.max(-1, keepdims=True)).sum(-1, keepdims=True)) \
      - logits.max(-1, keepdims=True)
  labels = np.asarray(batch["mlm_labels"])
  expected = -sum(logp[i, j, labels[i, j]] for i, j in zip(*np.nonzero(mask)))
  np.testing.assert_allclose(float(full_loss["mlm"]), expected, rtol=1e-5)
