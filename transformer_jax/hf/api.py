"""``load`` and ``save``: Hugging Face checkpoints <-> transformer_jax models."""

from __future__ import annotations

import dataclasses
import os
import warnings

import jax.numpy as jnp
import numpy as np
from flax import nnx

from transformer_jax import models
from transformer_jax.hf import checked, configs, experts, io, params
from transformer_jax.hf import reformer as reformer_hf
from transformer_jax.hf.errors import CheckpointError, UnsupportedError
from transformer_jax.models import ModelConfig
from transformer_jax.parallel import axes as ax

# The input embedding of each family whose output projection may be tied to it.
_EMBEDDING = {
  "gpt2": "transformer.wte.weight",
  "llama": "model.embed_tokens.weight",
  "mistral": "model.embed_tokens.weight",
  "gemma2": "model.embed_tokens.weight",
  "gemma3": "model.embed_tokens.weight",
  "qwen2": "model.embed_tokens.weight",
  "qwen3": "model.embed_tokens.weight",
  "t5": "shared.weight",
  "mamba": "backbone.embeddings.weight",
  "mamba2": "backbone.embeddings.weight",
}


def _from_transformers(model) -> tuple[dict, dict[str, np.ndarray]]:
  """Config dict and tensors of an in-memory ``transformers`` model."""
  hf = model.config.to_dict()
  hf["architectures"] = [type(model).__name__]
  return hf, io.torch_to_numpy(model.state_dict())


def _with_prefix(tensors: dict, prefix: str) -> dict:
  # A checkpoint of the bare base model (e.g. the original "gpt2" weights) lacks the prefix that the
  # head model adds; give it the prefix.
  if not prefix or any(k.startswith(prefix) for k in tensors):
    return tensors
  return {prefix + k: v for k, v in tensors.items()}


def _resolve_tie(config: ModelConfig, arch: str, tensors: dict) -> ModelConfig:
  """Unties the output projection when the checkpoint has its own, different ``lm_head.weight``.

  transformers does the same ("both are present with different values, so we will NOT tie them").
  """
  family = configs.ARCHITECTURES[arch][0]
  emb = _EMBEDDING.get(family)
  if emb is None or not config.tie_embeddings or "lm_head.weight" not in tensors:
    return config
  head, table = tensors["lm_head.weight"], tensors.get(emb)
  if table is not None and head.shape == table.shape and np.array_equal(head, table):
    return config
  if getattr(config, "logits_rescale", False):
    raise UnsupportedError(
      "T5 with tie_word_embeddings=True (decoder output scaled by d_model**-0.5) but a separate "
      "lm_head.weight is not supported"
    )
  return dataclasses.replace(config, tie_embeddings=False)


def _flat_params(state: nnx.State) -> dict[str, nnx.Variable]:
  return {".".join(map(str, path)): v for path, v in nnx.to_flat_state(state)}


def _embed_axes(var: nnx.Variable) -> list[int]:
  names = var.get_metadata().get("out_sharding") or ()
  return [i for i, n in enumerate(names) if n == ax.EMBED]


def _check_marian_extras(config, tensors: dict) -> None:
  bias = tensors.pop("final_logits_bias", None)
  if bias is not None and np.any(np.asarray(bias) != 0):
    raise UnsupportedError("a non-zero final_logits_bias is not supported")
  for side in ("encoder", "decoder"):
    table = tensors.get(f"model.{side}.embed_positions.weight")
    if table is not None:
      ref = params.marian_sinusoid(*table.shape)
      if not np.allclose(np.asarray(table, np.float32), ref, atol=1e-5):
        raise UnsupportedError(
          f"model.{side}.embed_positions.weight is not the sinusoid table "
          "(learned positions are not supported)"
        )


def _convert(config: ModelConfig, arch: str, tensors: dict) -> tuple[dict, list[str]]:
  """Our flat parameters from Hugging Face tensors, read through ``checked.read`` (one
  ``CheckpointError`` lists every problem); the heads ``arch`` lacks are filled."""
  t = params.table(config, arch)
  d = params.dims(config)
  _, state = nnx.split(models.abstract(config))
  expected = _flat_params(state)
  shapes = {}
  for rule in t.rules:
    per_layer = tuple(
      expected[p].get_value().shape[1 if rule.num_layers else 0 :] for p in rule.ours
    )
    for _, i in rule.layers():
      shapes[rule.hf.format(i=i)] = params.hf_shape(rule.transform, per_layer)
  read = checked.read(tensors, checked.Expected(shapes, t.aliases, t.ignore), arch)
  out = {}
  for rule in t.rules:
    layers = [
      params.to_ours(rule.transform, read[rule.hf.format(i=i)], d) for _, i in rule.layers()
    ]
    for j, path in enumerate(rule.ours):
      out[path] = np.stack([x[j] for x in layers]) if rule.num_layers else layers[0][j]
  filled = []
  for path, var in expected.items():
    if path not in out:
      # A head this architecture does not have (e.g. NSP for BertForMaskedLM): the identity for norm
      # scales, zeros elsewhere, so it is deterministic and trains from there.
      shape, dtype = var.get_value().shape, var.get_value().dtype
      out[path] = np.ones(shape, dtype) if path.endswith(".scale") else np.zeros(shape, dtype)
      filled.append(path)
  if t.permute_embed:
    inv = np.argsort(params.marian_permutation(config.d_model))
    for path, var in expected.items():
      for axis in _embed_axes(var):
        out[path] = np.take(out[path], inv, axis=axis)
  return out, filled


def _build(config: ModelConfig, flat: dict[str, np.ndarray]) -> nnx.Module:
  graphdef, state = nnx.split(models.abstract(config))
  dtype = jnp.dtype(config.param_dtype)
  pure: dict = {}
  for path, var in nnx.to_flat_state(state):
    node = pure
    for key in path[:-1]:
      node = node.setdefault(key, {})
    node[path[-1]] = jnp.asarray(np.asarray(flat[".".join(map(str, path))]), dtype=dtype)
  nnx.replace_by_pure_dict(state, pure)
  return nnx.merge(graphdef, state)


def _with_ids(model: nnx.Module, hf: dict, where: str) -> nnx.Module:
  """``model`` carrying the checkpoint's special-token ids (``configs.special_ids``) as
  ``hf_token_ids``, a static attribute that ``save`` writes back."""
  try:
    ids = configs.special_ids(hf)
  except CheckpointError as e:
    raise CheckpointError(f"{where}: {e}") from None
  model.hf_token_ids = tuple((k, v) for k, v in ids.items())
  return model


def recorded_ids(model) -> dict:
  """The special-token ids ``load`` recorded on ``model`` (none on an ``nnx.State``)."""
  ids = getattr(model, "hf_token_ids", None) or ()
  return {k: list(v) if isinstance(v, tuple) else v for k, v in ids}


def load(
  path_or_model, *, param_dtype: str | None = None, dtype: str | None = None
) -> tuple[ModelConfig, nnx.Module]:
  """Loads a Hugging Face checkpoint into a transformer_jax model.

  Args:
    path_or_model: a local directory with ``config.json`` and ``model.safetensors`` (or sharded
      safetensors with ``model.safetensors.index.json``, or ``pytorch_model.bin``, read with
      ``torch.load(weights_only=True)``), or an in-memory ``transformers`` model.
    param_dtype: dtype of the loaded parameters (default float32, whatever the file holds).
    dtype: compute dtype (default float32).

  Returns:
    ``(config, model)``: a GPTConfig / BERTConfig / Seq2SeqConfig / MambaConfig /
    ReformerConfig and the NNX module (BigBird: a ``models.BERT``, whose call returns a
    ``BERTOutput``). Weights are written into an abstract (``nnx.eval_shape``) model: no random
    initialisation is materialised. The model carries the checkpoint's special-token ids
    (``bos_token_id``, ``eos_token_id``, ``pad_token_id``, ``decoder_start_token_id``, those it
    names) in ``model.hf_token_ids``, which ``save`` writes back.

  Raises:
    UnsupportedError: the architecture, ``model_type`` or a config option is not supported (named).
    CheckpointError: missing, unexpected or mis-shaped tensors, non-float dtypes, NaN or
      infinite values (all listed, ``checked.read``), tied tensors that differ, a config field of
      the wrong type (named with its value), or a truncated/corrupt file.
  """
  if isinstance(path_or_model, (str, os.PathLike)):
    hf, tensors = io.read_directory(path_or_model)
    where = os.path.join(os.fspath(path_or_model), io.CONFIG)
  elif hasattr(path_or_model, "state_dict") and hasattr(path_or_model, "config"):
    hf, tensors = _from_transformers(path_or_model)
    where = f"the config of the {type(path_or_model).__name__}"
  else:
    raise TypeError(
      f"load() takes a directory or a transformers model, not {type(path_or_model).__name__}"
    )
  if hf.get("model_type") == reformer_hf.MODEL_TYPE:
    config, model = reformer_hf.load(hf, tensors, param_dtype=param_dtype, dtype=dtype, where=where)
    return config, _with_ids(model, hf, where)
  try:
    arch = configs.architecture_of(hf)
    config = configs.from_hf(hf, arch)
  except CheckpointError as e:  # a field refused by name (or unsupported): name the file too
    raise type(e)(f"{where}: {e}") from None
  except (ValueError, TypeError, KeyError) as e:  # a value our config refuses (num_heads=0, ...)
    raise CheckpointError(f"{where}: {e}") from None
  config = dataclasses.replace(
    config, param_dtype=param_dtype or "float32", dtype=dtype or "float32"
  )
  tensors = _with_prefix(tensors, params.table(config, arch).prefix)
  if configs.ARCHITECTURES[arch][0] in experts.NAMES:  # either layout of the experts' weights
    tensors = experts.stack(tensors)
  if configs.ARCHITECTURES[arch][0] == "marian":
    _check_marian_extras(config, tensors)
  config = _resolve_tie(config, arch, tensors)
  flat, filled = _convert(config, arch, tensors)
  if filled:
    warnings.warn(
      f"{arch} has no weights for {', '.join(filled)}; they were set to zeros (norm "
      "scales to ones)",
      stacklevel=2,
    )
  return config, _with_ids(_build(config, flat), hf, where)


def save(
  model: nnx.Module,
  config: ModelConfig,
  path: str | os.PathLike,
  *,
  architecture: str | None = None,
  tokenizer=None,
  special_ids: dict | None = None,
  per_expert: bool = False,
) -> str:
  """Writes ``config.json`` + ``model.safetensors`` that ``transformers`` ``from_pretrained`` loads.

  Args:
    model: a transformer_jax model (or an ``nnx.State`` of its parameters) for ``config``.
    config: its config.
    path: the output directory (created).
    architecture: the transformers class to write (default: GPT2LMHeadModel or LlamaForCausalLM
      for GPTConfig, BertForPreTraining (BertForSequenceClassification when ``num_labels``) for
      BERTConfig, T5ForConditionalGeneration or MarianMTModel for Seq2SeqConfig). Heads the
      architecture lacks are not written.
    tokenizer: the tokenizer the model was trained with (``transformer_jax.data.Tokenizer``, e.g.
      ``data.load_dataset(DIR).tokenizer``): its special ids go into ``config.json``
      (``bos_token_id``/``eos_token_id`` for a GPT, ``pad_token_id`` for BERT, and
      ``decoder_start_token_id`` too for a Seq2Seq model; ``configs.token_ids``). Without it,
      the ids of a model ``load`` read (``model.hf_token_ids``) are written back; otherwise a
      GPT's ``bos_token_id``/``eos_token_id`` are written as ``null``: unknown.
    special_ids: without a tokenizer, the special ids to write in place of the model's recorded
      ones (``recorded_ids``), e.g. those ``tjax convert --from-hf`` kept in a run directory.
    per_expert: a mixture of experts' weights one tensor per expert (the layout before
      transformers 5, ``hf.experts``); default stacked, as transformers 5 writes them.

  Returns:
    The architecture written.

  Raises:
    UnsupportedError: the architecture cannot express ``config`` (the fields are named).
    ValueError: a special id of ``tokenizer`` lies outside the model's vocabulary.
  """
  if isinstance(config, models.ReformerConfig) or architecture == reformer_hf.ARCHITECTURE:
    if not isinstance(config, models.ReformerConfig) or architecture not in (
      None,
      reformer_hf.ARCHITECTURE,
    ):
      raise UnsupportedError(
        f"{reformer_hf.ARCHITECTURE} goes with a ReformerConfig; got "
        f"{type(config).__name__} as {architecture!r}"
      )
    ids = (recorded_ids(model) if special_ids is None else special_ids) if tokenizer is None else {}
    return reformer_hf.save(model, config, path, ids)
  arch = architecture or configs.default_architecture(config)
  hf = configs.to_hf(config, arch, tokenizer)
  if tokenizer is None:
    hf.update(recorded_ids(model) if special_ids is None else special_ids)
  state = model if isinstance(model, nnx.State) else nnx.state(model, nnx.Param)
  variables = _flat_params(state)
  flat = {p: np.asarray(v.get_value()) for p, v in variables.items()}
  t = params.table(config, arch)
  if t.permute_embed:
    perm = params.marian_permutation(config.d_model)
    for name, var in variables.items():
      for axis in _embed_axes(var):
        flat[name] = np.take(flat[name], perm, axis=axis)
  d = params.dims(config)
  tensors = {}
  for rule in t.rules:
    for j, i in rule.layers():
      xs = tuple(flat[p][j] if rule.num_layers else flat[p] for p in rule.ours)
      tensors[rule.hf.format(i=i)] = np.ascontiguousarray(params.to_hf(rule.transform, xs, d))
  family = configs.ARCHITECTURES[arch][0]
  if family == "t5" and config.tie_embeddings and not config.logits_rescale:
    # Tied without the v1.0 rescale is what transformers calls tie_word_embeddings=False: it wants
    # an lm_head.weight of its own.
    tensors["lm_head.weight"] = tensors["shared.weight"]
  if family == "marian":
    table = params.marian_sinusoid(config.max_len, config.d_model)
    tensors["model.encoder.embed_positions.weight"] = table
    tensors["model.decoder.embed_positions.weight"] = table
    tensors["final_logits_bias"] = np.zeros((1, config.vocab_size), flat["embed.embedding"].dtype)
  if per_expert and family in experts.NAMES:
    tensors = experts.unstack(tensors, family)
  io.write_directory(path, hf, tensors)
  return arch
