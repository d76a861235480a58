"""transformers' ``ReformerModelWithLMHead`` <-> ``models.Reformer``.

transformers draws the LSH rotations inside every forward pass, from ``torch.manual_seed(
hash_seed)`` when the config has a ``hash_seed``; ``load`` draws the same ones (with torch) into
the model's ``lsh_rotations``, so the logits match. Without a ``hash_seed`` transformers draws
new rotations at every call: ``load`` then warns and uses those of seed 0.
"""

from __future__ import annotations

import dataclasses
import math
import os
import warnings

import jax.numpy as jnp
import numpy as np
from flax import nnx

from transformer_jax import models
from transformer_jax.hf import checked, io
from transformer_jax.hf.configs import common
from transformer_jax.hf.errors import CheckpointError, UnsupportedError
from transformer_jax.models import ReformerConfig
from transformer_jax.models.reformer import layer_period
from transformer_jax.ops import lsh

ARCHITECTURE = "ReformerModelWithLMHead"
MODEL_TYPE = "reformer"


def from_hf(hf: dict) -> ReformerConfig:
  """Our config for a transformers Reformer ``config.json`` dict, each field read by its type
  (``common.Fields``: ``"is_decoder": "false"`` is refused by name, not read as true)."""
  f = common.Fields(hf)
  archs = hf.get("architectures") or [ARCHITECTURE]
  if not isinstance(archs, list) or archs != [ARCHITECTURE]:
    raise UnsupportedError(
      f"architectures={archs!r} is not supported for model_type 'reformer'; supported: "
      f"[{ARCHITECTURE!r}]"
    )
  if hf.get("num_buckets") is None:
    raise UnsupportedError(
      "num_buckets=None (transformers picks it from the first input's "
      "length) is not supported: set num_buckets"
    )
  if f.bool("tie_word_embeddings", False, null=True):
    raise UnsupportedError(
      "tie_word_embeddings=True is not supported (the LM head reads 2 * hidden_size)"
    )
  seed = f.int("hash_seed", null=True)
  if seed is None:
    warnings.warn(
      "hash_seed=None: transformers draws new LSH rotations at every call; the "
      "loaded model uses those of hash_seed=0",
      stacklevel=3,
    )
    seed = 0
  buckets = hf["num_buckets"]
  buckets = f.ints("num_buckets") if isinstance(buckets, list) else f.int("num_buckets")
  return ReformerConfig(
    vocab_size=f.int("vocab_size", 320),
    d_model=f.int("hidden_size", 256),
    num_heads=f.int("num_attention_heads", 12),
    head_dim=f.int("attention_head_size", 64),
    d_ff=f.int("feed_forward_size", 512),
    attn_layers=f.strs("attn_layers", ["local", "lsh"] * 3),
    max_len=f.int("max_position_embeddings", 4096),
    axial_pos_shape=f.ints("axial_pos_shape", [64, 64])
    if f.bool("axial_pos_embds", True)
    else None,
    axial_pos_dims=f.ints("axial_pos_embds_dim", [64, 192]),
    axial_init_std=f.float("axial_norm_std", 1.0),
    causal=f.bool("is_decoder", False),
    lsh_chunk_length=f.int("lsh_attn_chunk_length", 64),
    lsh_chunks_before=f.int("lsh_num_chunks_before", 1),
    lsh_chunks_after=f.int("lsh_num_chunks_after", 0),
    n_hashes=f.int("num_hashes", 1),
    n_buckets=buckets,
    hash_seed=seed,
    local_chunk_length=f.int("local_attn_chunk_length", 64),
    local_chunks_before=f.int("local_num_chunks_before", 1),
    local_chunks_after=f.int("local_num_chunks_after", 0),
    ff_chunk=f.int("chunk_size_feed_forward", 0, null=True) or 0,
    activation=common.activation(f.str("hidden_act", "relu"), "hidden_act"),
    norm_eps=f.float("layer_norm_eps", 1e-12),
    dropout_rate=f.float("hidden_dropout_prob", 0.05),
    init_std=f.float("initializer_range", 0.02),
  )


def to_hf(c: ReformerConfig) -> dict:
  """The transformers ``config.json`` dict of ``c``."""
  return dict(
    architectures=[ARCHITECTURE],
    model_type=MODEL_TYPE,
    vocab_size=c.vocab_size,
    hidden_size=c.d_model,
    num_attention_heads=c.num_heads,
    attention_head_size=c.head_dim,
    feed_forward_size=c.d_ff,
    attn_layers=list(c.attn_layers),
    num_hidden_layers=c.num_layers,
    max_position_embeddings=c.max_len,
    axial_pos_embds=c.axial_pos_shape is not None,
    axial_pos_shape=list(c.axial_pos_shape or (64, 64)),
    axial_pos_embds_dim=list(c.axial_pos_dims),
    axial_norm_std=c.axial_init_std,
    is_decoder=c.causal,
    lsh_attn_chunk_length=c.lsh_chunk_length,
    lsh_num_chunks_before=c.lsh_chunks_before,
    lsh_num_chunks_after=c.lsh_chunks_after,
    num_hashes=c.n_hashes,
    num_buckets=c.n_buckets if isinstance(c.n_buckets, int) else list(c.n_buckets),
    hash_seed=c.hash_seed,
    local_attn_chunk_length=c.local_chunk_length,
    local_num_chunks_before=c.local_chunks_before,
    local_num_chunks_after=c.local_chunks_after,
    chunk_size_feed_forward=c.ff_chunk,
    hidden_act=common.ACTIVATIONS_BACK[c.activation],
    layer_norm_eps=c.norm_eps,
    hidden_dropout_prob=c.dropout_rate,
    lsh_attention_probs_dropout_prob=0.0,
    local_attention_probs_dropout_prob=0.0,
    initializer_range=c.init_std,
    tie_word_embeddings=False,
    dtype=str(c.param_dtype),
  )


def torch_rotations(c: ReformerConfig) -> np.ndarray:
  """The rotations transformers draws for ``c``: ``torch.manual_seed(hash_seed)`` then
  ``torch.randn([N, H, n_hashes, R / 2])``."""
  try:
    import torch  # noqa: PLC0415 - torch is optional (the hf extra)
  except ImportError:
    raise UnsupportedError(
      "loading a Reformer needs torch, to draw transformers' LSH rotations (pip install torch)"
    ) from None
  torch.manual_seed(c.hash_seed)
  shape = (c.num_heads, c.head_dim, c.n_hashes, lsh.rotation_size(c.n_buckets) // 2)
  return torch.randn(shape, dtype=torch.float32).numpy()


# (our path under a layer's stack, transformers' name under reformer.encoder.layers.{i}., how)
# "linear_in": a torch Linear [out, in] that our kernel holds as [in, ...out dims];
# "linear_out": a torch Linear [D, N*H] that our kernel holds as [N, H, D]; "copy": as is.
def _layer_rules(kind: str) -> list[tuple[str, str, str]]:
  attn = "attention.self_attention."
  qk = (
    [("query_key.kernel", attn + "query_key.weight", "linear_in")]
    if kind == "lsh"
    else [
      ("query.kernel", attn + "query.weight", "linear_in"),
      ("key.kernel", attn + "key.weight", "linear_in"),
    ]
  )
  return [
    ("attn_norm.scale", "attention.layer_norm.weight", "copy"),
    ("attn_norm.bias", "attention.layer_norm.bias", "copy"),
    *qk,
    ("value.kernel", attn + "value.weight", "linear_in"),
    ("out.kernel", "attention.output.dense.weight", "linear_out"),
    ("mlp_norm.scale", "feed_forward.layer_norm.weight", "copy"),
    ("mlp_norm.bias", "feed_forward.layer_norm.bias", "copy"),
    ("mlp.up.kernel", "feed_forward.dense.dense.weight", "linear_in"),
    ("mlp.up.bias", "feed_forward.dense.dense.bias", "copy"),
    ("mlp.down.kernel", "feed_forward.output.dense.weight", "linear_in"),
    ("mlp.down.bias", "feed_forward.output.dense.bias", "copy"),
  ]


def _top_rules(c: ReformerConfig) -> list[tuple[str, str, str]]:
  emb = "reformer.embeddings."
  pos = (
    [
      ("pos_embed.rows", emb + "position_embeddings.weights.0", "axial_rows"),
      ("pos_embed.cols", emb + "position_embeddings.weights.1", "axial_cols"),
    ]
    if c.axial_pos_shape is not None
    else [("pos_embed.embedding", emb + "position_embeddings.embedding.weight", "copy")]
  )
  return [
    ("embed.embedding", emb + "word_embeddings.weight", "copy"),
    *pos,
    ("final_norm.scale", "reformer.encoder.layer_norm.weight", "copy"),
    ("final_norm.bias", "reformer.encoder.layer_norm.bias", "copy"),
    ("lm_head.kernel", "lm_head.decoder.weight", "linear_in"),
    ("lm_head.bias", "lm_head.decoder.bias", "copy"),
  ]


def _hf_shape(how: str, shape: tuple[int, ...]) -> tuple[int, ...]:
  """The shape transformers holds a parameter of our (per-layer) ``shape`` in."""
  match how:
    case "copy":
      return shape
    case "linear_in":  # ours [in, out...]; a torch Linear [out, in]
      return (math.prod(shape[1:]), shape[0])
    case "linear_out":  # ours [N, H, D]; a torch Linear [D, N*H]
      return (shape[-1], math.prod(shape[:-1]))
    case "axial_rows":  # ours [h, d0]; transformers [h, 1, d0]
      return (shape[0], 1, shape[1])
    case "axial_cols":  # ours [w, d1]; transformers [1, w, d1]
      return (1, *shape)
    case _:
      raise ValueError(how)


def _to_ours(how: str, x: np.ndarray, shape: tuple[int, ...]) -> np.ndarray:
  """Our layout of ``x``, whose shape ``checked.read`` found to be ``_hf_shape(how, shape)``."""
  match how:
    case "copy":
      return x
    case "linear_in" | "linear_out":  # [out..., in] -> [in, out...]; [D, N*H] -> [N, H, D]
      return x.T.reshape(shape)
    case "axial_rows":
      return x[:, 0]
    case "axial_cols":
      return x[0]
    case _:
      raise ValueError(how)


def _to_hf(how: str, x: np.ndarray) -> np.ndarray:
  match how:
    case "copy":
      return x
    case "linear_in" | "linear_out":
      return x.reshape(x.shape[0], -1).T if how == "linear_in" else x.reshape(-1, x.shape[-1]).T
    case "axial_rows":
      return x[:, None]
    case "axial_cols":
      return x[None]
    case _:
      raise ValueError(how)


def _rules(c: ReformerConfig):
  """``(our flat path, transformers name, how, layer index or None)`` for every tensor."""
  period = layer_period(c.attn_layers)
  out = [(ours, theirs, how, None) for ours, theirs, how in _top_rules(c)]
  for i, kind in enumerate(c.attn_layers):
    j = i % period
    for ours, theirs, how in _layer_rules(kind):
      out.append((f"stacks.{j}.{ours}", f"reformer.encoder.layers.{i}.{theirs}", how, i // period))
  return out


def load(
  hf: dict,
  tensors: dict[str, np.ndarray],
  *,
  param_dtype: str | None = None,
  dtype: str | None = None,
  where: str = "config.json",
):
  """``(config, model)`` of a transformers Reformer (``tj.hf.load`` calls this); ``where``
  names the config in errors."""
  try:
    config = from_hf(hf)
  except CheckpointError as e:  # a field refused by name
    raise type(e)(f"{where}: {e}") from None
  except (TypeError, KeyError, ValueError) as e:  # a value our config refuses
    raise CheckpointError(f"{where}: {ARCHITECTURE} config is malformed: {e}") from None
  config = dataclasses.replace(
    config, param_dtype=param_dtype or "float32", dtype=dtype or "float32"
  )
  graphdef, state = nnx.split(models.abstract(config))
  expected = {".".join(map(str, p)): v.get_value() for p, v in nnx.to_flat_state(state)}
  tensors = dict(tensors)
  # transformers' head adds lm_head.decoder.bias; its lm_head.bias takes no part in the
  # forward pass (older versions tied the two), so only a lone one stands in for the other.
  bias = tensors.pop("lm_head.bias", None)
  if bias is not None:
    tensors.setdefault("lm_head.decoder.bias", bias)
  rules = [
    (ours, theirs, how, step, expected[ours].shape[0 if step is None else 1 :])
    for ours, theirs, how, step in _rules(config)
  ]
  shapes = {theirs: _hf_shape(how, shape) for _, theirs, how, _, shape in rules}
  read = checked.read(tensors, checked.Expected(shapes), ARCHITECTURE)
  out = {p: [None] * (config.num_layers // layer_period(config.attn_layers)) for p in expected}
  for ours, theirs, how, step, shape in rules:
    value = _to_ours(how, read[theirs], shape)
    if step is None:
      out[ours] = value
    else:
      out[ours][step] = value
  if "lsh_rotations" in expected:
    out["lsh_rotations"] = torch_rotations(config)
  pure: dict = {}
  pdt = jnp.dtype(config.param_dtype)
  for path, var in nnx.to_flat_state(state):
    value = out[".".join(map(str, path))]
    value = np.stack(value) if isinstance(value, list) else value
    node = pure
    for key in path[:-1]:
      node = node.setdefault(key, {})
    node[path[-1]] = jnp.asarray(value, dtype=pdt)
  nnx.replace_by_pure_dict(state, pure)
  return config, nnx.merge(graphdef, state)


def save(
  model, config: ReformerConfig, path: str | os.PathLike, token_ids: dict | None = None
) -> str:
  """Writes ``config.json`` + ``model.safetensors`` for transformers (``tj.hf.save``), with the
  special-token fields ``token_ids`` (``bos_token_id``, ...) where given."""
  state = model if isinstance(model, nnx.State) else nnx.state(model, nnx.Param)
  flat = {".".join(map(str, p)): np.asarray(v.get_value()) for p, v in nnx.to_flat_state(state)}
  if "lsh_rotations" in flat:
    try:
      same = np.allclose(flat["lsh_rotations"], torch_rotations(config))
    except UnsupportedError:
      same = False
    if not same:
      warnings.warn(
        "the model's LSH rotations are not the ones transformers draws from "
        f"hash_seed={config.hash_seed}: the saved model hashes differently",
        stacklevel=3,
      )
  tensors = {}
  for ours, theirs, how, step in _rules(config):
    x = flat[ours] if step is None else flat[ours][step]
    tensors[theirs] = np.ascontiguousarray(_to_hf(how, x))
  tensors["lm_head.bias"] = tensors["lm_head.decoder.bias"].copy()
  io.write_directory(path, {**to_hf(config), **(token_ids or {})}, tensors)
  return ARCHITECTURE
