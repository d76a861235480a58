"""The rows of ``efficient_attention.py``: each kind's config at matched sizes, its loss, and a
row of random tokens for timing its train step.

Causal rows are GPTs (one size whatever the attention), a Reformer of LSH layers and state-space
models; masked-LM rows are BERT encoders. ``BASELINES``: the row each task's speeds are relative
to.
"""

from __future__ import annotations

import dataclasses

import jax
import jax.numpy as jnp
import numpy as np

import transformer_jax as tj
from transformer_jax import ops

BASELINES = {"causal": "softmax", "masked": "mlm-full"}  # task -> the row speeds are relative to


def variants(windows: list[int]) -> dict[str, dict]:
  """Name -> GPTConfig overrides of each attention kind."""
  out = {"softmax": {}}
  out.update({f"window-{w}": {"sliding_window": w} for w in windows})
  out["linear"] = {"attention_kind": "linear"}
  out["linear-decay"] = {"attention_kind": "linear", "linear_decay": "retnet"}
  out["sparse-fixed"] = {
    "attention_kind": "sparse",
    "sparse_pattern": ops.SparsePattern.fixed(block=64, summary=8),
  }
  out["sparse-strided"] = {
    "attention_kind": "sparse",
    "sparse_pattern": ops.SparsePattern.strided_pattern(block=64),
  }
  return out


def num_params(config) -> int:
  """Every parameter the model of ``config`` holds (counted on its shapes, nothing computed)."""
  shapes = jax.eval_shape(lambda key: tj.models.init(config, key), jax.random.key(0))
  return sum(int(np.prod(x.shape)) for x in jax.tree.leaves(shapes))


def ssm_configs(args, vocab: int) -> dict[str, tj.models.MambaConfig]:
  """The state-space rows, their depths (and the hybrid's MLP width) chosen so that each has the
  GPTs' parameters within 4% (at the defaults: 1.29M to 1.34M non-embedding, output projection
  included, against the GPTs' 1.31M)."""
  d = args.d_model
  common = dict(
    vocab_size=vocab, d_model=d, d_state=16, ssm_chunk=64, tie_embeddings=False, max_len=1 << 16
  )
  gpt = tj.models.param_count(config_for(args, vocab)).non_embedding
  rows = {
    "mamba1": tj.models.MambaConfig(mixer="mamba1", **common),
    "mamba2": tj.models.MambaConfig(
      mixer="mamba2",
      ssm_head_dim=d // 4,
      d_state=32,
      **{k: v for k, v in common.items() if k != "d_state"},
    ),
    "hybrid": tj.models.MambaConfig(
      mixer="mamba1",
      layer_types=("mamba", "attention", "mamba"),
      num_layers=3,
      num_heads=args.heads,
      position="rope",
      d_ff=7 * d // 2,
      **common,
    ),
  }
  out = {}
  for name, config in rows.items():
    if name != "hybrid":  # as many Mamba blocks as the GPTs' parameters pay for
      one, two = (
        tj.models.param_count(dataclasses.replace(config, num_layers=n)).non_embedding
        for n in (1, 2)
      )
      head = one - (two - one)  # the output projection and the final norm
      config = dataclasses.replace(config, num_layers=max(1, round((gpt - head) / (two - one))))
    out[name] = config
  return out


def lsh_config(args, vocab: int) -> tj.models.ReformerConfig:
  """A Reformer of ``args.layers`` LSH layers, the GPTs' width and heads, axial positions up to
  64k tokens (initialised as the token embeddings); its feed-forward width (a multiple of 8) the
  one whose total parameters come nearest the GPTs' (its head reads both streams, ``[2D, V]``: at
  the defaults d_ff = 96)."""
  d, heads = args.d_model, args.heads
  config = tj.models.ReformerConfig(
    vocab_size=vocab,
    d_model=d,
    num_heads=heads,
    head_dim=d // heads,
    d_ff=8,
    attn_layers=("lsh",) * args.layers,
    max_len=1 << 16,
    axial_pos_shape=(256, 256),
    axial_pos_dims=(d // 2, d - d // 2),
    # The token embeddings' std, not transformers' 1.0, which swamps them: at the defaults the
    # LSH row's validation loss is 5.31 so, about 5.95 with 1.0 (and with full attention too).
    axial_init_std=0.02,
    lsh_chunk_length=args.lsh_chunk,
    n_buckets=args.lsh_buckets,
  )
  gpt = tj.models.count_params(config_for(args, vocab))
  base, per8 = num_params(config), num_params(dataclasses.replace(config, d_ff=16))
  width = 8 * max(1, 1 + round((gpt - base) / (per8 - base)))
  return dataclasses.replace(config, d_ff=width)


def encoder_configs(args, vocab: int, max_len: int) -> dict[str, tj.models.BERTConfig]:
  """The masked-LM rows: one BERT size, no dropout, position table and Linformer projections of
  ``max_len`` rows / columns."""
  common = dict(
    vocab_size=vocab,
    d_model=args.d_model,
    num_layers=args.layers,
    num_heads=args.heads,
    d_ff=4 * args.d_model,
    max_len=max_len,
    dropout_rate=0.0,
    attention_dropout_rate=0.0,
  )
  return {
    "mlm-full": tj.models.BERTConfig(**common),
    "mlm-bigbird": tj.models.BERTConfig(
      attention_kind="sparse",
      sparse_pattern=ops.SparsePattern.bigbird(block=args.bigbird_block),
      **common,
    ),
    "mlm-linformer": tj.models.BERTConfig(
      attention_kind="linformer",
      linformer_rows=args.linformer_rows,
      linformer_share_kv=True,
      **common,
    ),
  }


def config_for(args, vocab: int, **overrides) -> tj.models.GPTConfig:
  return tj.models.get_config(
    "llama-tiny",
    vocab_size=vocab,
    d_model=args.d_model,
    num_layers=args.layers,
    num_heads=args.heads,
    num_kv_heads=args.heads,
    d_ff=4 * args.d_model,
    max_len=1 << 16,
    dropout_rate=0.0,
    **overrides,
  )


def task_of(config) -> str:
  return "masked" if isinstance(config, tj.models.BERTConfig) else "causal"


def loss_of(config, params, batch):
  """``(mean loss, tokens)``: next-token loss of a causal row (a Reformer sees only the tokens),
  masked-token loss of an encoder."""
  apply = tj.models.apply
  if task_of(config) == "masked":
    out = apply(config, params, batch["tokens"], batch["token_types"], batch["attention_mask"])
    return ops.cross_entropy(out.mlm_logits, batch["mlm_labels"], mask=batch["mlm_mask"])
  if isinstance(config, tj.models.ReformerConfig):
    logits = apply(config, params, batch["tokens"])
  else:
    logits = apply(config, params, batch["tokens"], batch["positions"], batch["segment_ids"])
  return ops.cross_entropy(logits, batch["labels"], mask=batch["loss_mask"])


def cost_batch(config, t: int) -> dict:
  """One row of ``t`` random tokens, as the loader of ``config``'s task gives it (an encoder's
  with 15% of the positions predicted)."""
  ids = jax.random.randint(jax.random.key(t), (1, t + 1), 0, config.vocab_size)
  if task_of(config) == "masked":
    return {
      "tokens": ids[:, :-1],
      "token_types": jnp.zeros((1, t), jnp.int32),
      "attention_mask": jnp.ones((1, t), bool),
      "mlm_labels": ids[:, 1:],
      "mlm_mask": jax.random.uniform(jax.random.key(-t), (1, t)) < 0.15,
    }
  return {
    "tokens": ids[:, :-1],
    "labels": ids[:, 1:],
    "positions": jnp.arange(t)[None],
    "segment_ids": jnp.ones((1, t), jnp.int32),
    "loss_mask": jnp.ones((1, t), bool),
  }
