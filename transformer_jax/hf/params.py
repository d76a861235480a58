"""The parameter mapping: one table per family from Hugging Face tensor names to our parameter
paths.

A ``Rule`` names a Hugging Face tensor (``{i}`` stands for the layer index), the parameter path(s)
it becomes, and a ``Transform`` saying how the layout changes. Rules whose name has ``{i}`` are per
layer: the L tensors are stacked along our leading ``layers`` axis. The same table serves both
directions.

Layouts: torch ``Linear`` weights are ``[out, in]``; GPT-2's ``Conv1D`` weights are ``[in, out]``;
our kernels are einsum-shaped: query ``[D, N, H]``, key/value ``[D, K, H]``, output ``[N, H, D]``,
MLP ``[D, F]`` / ``[F, D]``, heads ``[D, C]``.
"""

from __future__ import annotations

import dataclasses
import enum

import numpy as np

from transformer_jax.hf import experts
from transformer_jax.hf.configs import ARCHITECTURES
from transformer_jax.models import ModelConfig


class Transform(enum.Enum):
  COPY = "copy"  # same layout
  LINEAR = "linear"  # [out, in] -> [in, out]
  LINEAR_Q = "linear_q"  # [N*H, D] -> [D, N, H]
  LINEAR_KV = "linear_kv"  # [K*H, D] -> [D, K, H]
  LINEAR_O = "linear_o"  # [D, N*H] -> [N, H, D]
  BIAS_Q = "bias_q"  # [N*H] -> [N, H]
  BIAS_KV = "bias_kv"  # [K*H] -> [K, H]
  CONV_QKV = "conv_qkv"  # GPT-2 c_attn [D, 3*N*H] -> [D, N, H] x 3 (query, key, value)
  CONV_QKV_BIAS = "conv_qkv_b"  # [3*N*H] -> [N, H] x 3
  CONV_O = "conv_o"  # GPT-2 c_proj [N*H, D] -> [N, H, D]
  LINEAR_HALVES = "linear_halves"  # Mamba in_proj [2*E, D] -> [D, 2, E] (x and gate)
  BIAS_HALVES = "bias_halves"  # [2*E] -> [2, E]
  DEPTHWISE = "depthwise"  # Conv1d(groups=C) weight [C, 1, W] -> [W, C]
  EXPERTS_GATE_UP = "experts_gate_up"  # gate_up_proj [E, 2F, D] -> gate [E, D, F], up [E, D, F]
  EXPERTS_DOWN = "experts_down"  # down_proj [E, D, F] -> [E, F, D]


@dataclasses.dataclass(frozen=True)
class Dims:
  n: int  # query heads N
  k: int  # key/value heads K
  h: int  # head dim H


def to_ours(t: Transform, x: np.ndarray, d: Dims) -> tuple[np.ndarray, ...]:
  """One Hugging Face tensor (one layer) -> our parameter(s)."""
  match t:
    case Transform.COPY:
      return (x,)
    case Transform.LINEAR:
      return (x.T,)
    case Transform.LINEAR_Q:
      return (x.T.reshape(x.shape[1], d.n, d.h),)
    case Transform.LINEAR_KV:
      return (x.T.reshape(x.shape[1], d.k, d.h),)
    case Transform.LINEAR_O:
      return (x.T.reshape(d.n, d.h, x.shape[0]),)
    case Transform.BIAS_Q:
      return (x.reshape(d.n, d.h),)
    case Transform.BIAS_KV:
      return (x.reshape(d.k, d.h),)
    case Transform.CONV_QKV:
      return tuple(w.reshape(x.shape[0], d.n, d.h) for w in np.split(x, 3, axis=1))
    case Transform.CONV_QKV_BIAS:
      return tuple(b.reshape(d.n, d.h) for b in np.split(x, 3))
    case Transform.CONV_O:
      return (x.reshape(d.n, d.h, x.shape[1]),)
    case Transform.LINEAR_HALVES:
      return (x.T.reshape(x.shape[1], 2, x.shape[0] // 2),)
    case Transform.BIAS_HALVES:
      return (x.reshape(2, -1),)
    case Transform.DEPTHWISE:
      return (x[:, 0, :].T,)
    case Transform.EXPERTS_GATE_UP:
      gate, up = np.split(x, 2, axis=1)
      return gate.transpose(0, 2, 1), up.transpose(0, 2, 1)
    case Transform.EXPERTS_DOWN:
      return (x.transpose(0, 2, 1),)
    case _:
      raise ValueError(f"unknown transform {t}")


def to_hf(t: Transform, xs: tuple[np.ndarray, ...], d: Dims) -> np.ndarray:
  """Our parameter(s) (one layer) -> the Hugging Face tensor; the inverse of ``to_ours``."""
  x = xs[0]
  match t:
    case Transform.COPY:
      return x
    case Transform.LINEAR:
      return x.T
    case Transform.LINEAR_Q | Transform.LINEAR_KV | Transform.LINEAR_HALVES:
      return x.reshape(x.shape[0], -1).T
    case Transform.LINEAR_O:
      return x.reshape(-1, x.shape[-1]).T
    case Transform.BIAS_Q | Transform.BIAS_KV | Transform.BIAS_HALVES:
      return x.reshape(-1)
    case Transform.DEPTHWISE:
      return x.T[:, None, :]
    case Transform.CONV_QKV:
      return np.concatenate([w.reshape(w.shape[0], -1) for w in xs], axis=1)
    case Transform.CONV_QKV_BIAS:
      return np.concatenate([b.reshape(-1) for b in xs])
    case Transform.CONV_O:
      return x.reshape(-1, x.shape[-1])
    case Transform.EXPERTS_GATE_UP:
      return np.concatenate([w.transpose(0, 2, 1) for w in xs], axis=1)
    case Transform.EXPERTS_DOWN:
      return x.transpose(0, 2, 1)
    case _:
      raise ValueError(f"unknown transform {t}")


def hf_shape(t: Transform, shapes: tuple[tuple[int, ...], ...]) -> tuple[int, ...]:
  """The Hugging Face shape that ``to_hf`` makes from our (per-layer) shapes."""
  s = shapes[0]
  match t:
    case Transform.COPY:
      return s
    case Transform.LINEAR:
      return s[::-1]
    case Transform.LINEAR_Q | Transform.LINEAR_KV | Transform.LINEAR_HALVES:
      return (s[1] * s[2], s[0])
    case Transform.LINEAR_O:
      return (s[2], s[0] * s[1])
    case Transform.BIAS_Q | Transform.BIAS_KV | Transform.BIAS_HALVES:
      return (s[0] * s[1],)
    case Transform.DEPTHWISE:
      return (s[1], 1, s[0])
    case Transform.CONV_QKV:
      return (s[0], 3 * s[1] * s[2])
    case Transform.CONV_QKV_BIAS:
      return (3 * s[0] * s[1],)
    case Transform.CONV_O:
      return (s[0] * s[1], s[2])
    case Transform.EXPERTS_GATE_UP:
      return (s[0], 2 * s[2], s[1])
    case Transform.EXPERTS_DOWN:
      return (s[0], s[2], s[1])
    case _:
      raise ValueError(f"unknown transform {t}")


@dataclasses.dataclass(frozen=True)
class Rule:
  hf: str  # Hugging Face name; "{i}" = layer index
  ours: tuple[str, ...]  # our parameter path(s), dotted
  transform: Transform = Transform.COPY
  num_layers: int = 0  # > 0: per-layer rule, stacked on our leading axis
  # The Hugging Face layer index ("{i}") of each entry of our stacked axis; None: 0 .. L-1.
  layer_ids: tuple[int, ...] | None = None

  def layers(self) -> tuple[tuple[int, int], ...]:
    """``(entry of our stacked axis, Hugging Face layer index)`` pairs; ``((0, 0),)`` for a rule
    that is not per layer."""
    ids = range(self.num_layers or 1) if self.layer_ids is None else self.layer_ids
    return tuple(enumerate(ids))


@dataclasses.dataclass(frozen=True)
class Table:
  rules: list[Rule]
  aliases: dict[str, str]  # tied duplicate -> canonical HF name (must be equal when both given)
  ignore: tuple[str, ...]  # regexes of buffers that carry no parameters
  prefix: str  # the base model's prefix ("transformer.", "model.", "bert." or "")
  permute_embed: bool = (
    False  # Marian: our interleaved sinusoid vs its concatenated one (see below)
  )


def _linear(
  hf: str, ours: str, bias: bool, w=Transform.LINEAR, b=Transform.COPY, L=0
) -> list[Rule]:
  rules = [Rule(f"{hf}.weight", (f"{ours}.kernel",), w, L)]
  if bias:
    rules.append(Rule(f"{hf}.bias", (f"{ours}.bias",), b, L))
  return rules


def _norm(hf: str, ours: str, bias: bool, L=0) -> list[Rule]:
  rules = [Rule(f"{hf}.weight", (f"{ours}.scale",), Transform.COPY, L)]
  if bias:
    rules.append(Rule(f"{hf}.bias", (f"{ours}.bias",), Transform.COPY, L))
  return rules


def _attention(
  hf: str,
  ours: str,
  names: tuple[str, str, str, str],
  bias: bool,
  L: int,
  out_bias: bool | None = None,
) -> list[Rule]:
  """Query, key, value (biases: ``bias``) and output (``out_bias``, None: ``bias``)."""
  q, k, v, o = names
  out_bias = bias if out_bias is None else out_bias
  return (
    _linear(f"{hf}.{q}", f"{ours}.query", bias, Transform.LINEAR_Q, Transform.BIAS_Q, L)
    + _linear(f"{hf}.{k}", f"{ours}.key", bias, Transform.LINEAR_KV, Transform.BIAS_KV, L)
    + _linear(f"{hf}.{v}", f"{ours}.value", bias, Transform.LINEAR_KV, Transform.BIAS_KV, L)
    + _linear(f"{hf}.{o}", f"{ours}.out", out_bias, Transform.LINEAR_O, Transform.COPY, L)
  )


def _gpt2(c) -> Table:
  L, P, B = c.num_layers, "transformer.", "blocks.layers"
  h = f"{P}h.{{i}}"
  rules = [
    Rule(f"{P}wte.weight", ("embed.embedding",)),
    Rule(f"{P}wpe.weight", ("pos_embed.embedding",)),
    *_norm(f"{h}.ln_1", f"{B}.attn_norm", True, L),
    Rule(
      f"{h}.attn.c_attn.weight",
      tuple(f"{B}.attn.{x}.kernel" for x in ("query", "key", "value")),
      Transform.CONV_QKV,
      L,
    ),
    Rule(
      f"{h}.attn.c_attn.bias",
      tuple(f"{B}.attn.{x}.bias" for x in ("query", "key", "value")),
      Transform.CONV_QKV_BIAS,
      L,
    ),
    *_linear(f"{h}.attn.c_proj", f"{B}.attn.out", True, Transform.CONV_O, Transform.COPY, L),
    *_norm(f"{h}.ln_2", f"{B}.mlp_norm", True, L),
    *_linear(f"{h}.mlp.c_fc", f"{B}.mlp.up", True, Transform.COPY, Transform.COPY, L),
    *_linear(f"{h}.mlp.c_proj", f"{B}.mlp.down", True, Transform.COPY, Transform.COPY, L),
    *_norm(f"{P}ln_f", "final_norm", True),
  ]
  aliases = {}
  if c.tie_embeddings:
    aliases["lm_head.weight"] = f"{P}wte.weight"
  else:
    rules.append(Rule("lm_head.weight", ("lm_head.kernel",), Transform.LINEAR))
  return Table(rules, aliases, (r"\.attn\.bias$", r"\.attn\.masked_bias$"), P)


def _experts(h: str, B: str, L: int) -> list[Rule]:
  """A mixture of experts (Mixtral, Qwen3-MoE) in transformers 5's stacked layout (older
  per-expert keys are stacked first: ``stack_experts``)."""
  return [
    Rule(f"{h}.mlp.gate.weight", (f"{B}.mlp.router.kernel",), Transform.LINEAR, L),
    Rule(
      f"{h}.mlp.experts.gate_up_proj",
      (f"{B}.mlp.gate", f"{B}.mlp.up"),
      Transform.EXPERTS_GATE_UP,
      L,
    ),
    Rule(f"{h}.mlp.experts.down_proj", (f"{B}.mlp.down",), Transform.EXPERTS_DOWN, L),
  ]


def _decoder_table(c, rules: list[Rule], ignored: str) -> Table:
  """A LLaMA-named decoder's table from its ``rules``: with Qwen3/Gemma 3's per-head q/k norms,
  and the output head tied to the embedding (an alias) or its own ``lm_head``."""
  L, P, B = c.num_layers, "model.", "blocks.layers"
  h = f"{P}layers.{{i}}"
  if c.qk_norm:
    rules += _norm(f"{h}.self_attn.q_norm", f"{B}.attn.q_norm", False, L)
    rules += _norm(f"{h}.self_attn.k_norm", f"{B}.attn.k_norm", False, L)
  aliases = {}
  if c.tie_embeddings:
    aliases["lm_head.weight"] = f"{P}embed_tokens.weight"
  else:
    rules.append(Rule("lm_head.weight", ("lm_head.kernel",), Transform.LINEAR))
  return Table(rules, aliases, (ignored,), P)


def _llama(c) -> Table:
  """LLaMA, Mistral, Qwen2 and Qwen3: biases per projection group, Qwen3's q_norm/k_norm."""
  L, P, B = c.num_layers, "model.", "blocks.layers"
  qkv, out, mlp = (c.use_bias if b is None else b for b in (c.qkv_bias, c.out_bias, c.mlp_bias))
  h = f"{P}layers.{{i}}"
  qkvo = ("q_proj", "k_proj", "v_proj", "o_proj")
  mlp_rules = (
    _experts(h, B, L)
    if c.num_experts
    else [
      *_linear(f"{h}.mlp.gate_proj", f"{B}.mlp.gate", mlp, L=L),
      *_linear(f"{h}.mlp.up_proj", f"{B}.mlp.up", mlp, L=L),
      *_linear(f"{h}.mlp.down_proj", f"{B}.mlp.down", mlp, L=L),
    ]
  )
  rules = [
    Rule(f"{P}embed_tokens.weight", ("embed.embedding",)),
    *_attention(f"{h}.self_attn", f"{B}.attn", qkvo, qkv, L, out_bias=out),
    *mlp_rules,
    *_norm(f"{h}.input_layernorm", f"{B}.attn_norm", False, L),
    *_norm(f"{h}.post_attention_layernorm", f"{B}.mlp_norm", False, L),
    *_norm(f"{P}norm", "final_norm", False),
  ]
  return _decoder_table(c, rules, r"rotary_emb\.inv_freq$")


def _gemma(c) -> Table:
  """Gemma 2 / 3: LLaMA's names plus the sandwich norms (and Gemma 3's per-head q/k norms)."""
  L, P, B = c.num_layers, "model.", "blocks.layers"
  h = f"{P}layers.{{i}}"
  rules = [
    Rule(f"{P}embed_tokens.weight", ("embed.embedding",)),
    *_attention(
      f"{h}.self_attn", f"{B}.attn", ("q_proj", "k_proj", "v_proj", "o_proj"), bool(c.qkv_bias), L
    ),
    *_linear(f"{h}.mlp.gate_proj", f"{B}.mlp.gate", False, L=L),
    *_linear(f"{h}.mlp.up_proj", f"{B}.mlp.up", False, L=L),
    *_linear(f"{h}.mlp.down_proj", f"{B}.mlp.down", False, L=L),
    *_norm(f"{h}.input_layernorm", f"{B}.attn_norm", False, L),
    *_norm(f"{h}.post_attention_layernorm", f"{B}.attn_post_norm", False, L),
    *_norm(f"{h}.pre_feedforward_layernorm", f"{B}.mlp_norm", False, L),
    *_norm(f"{h}.post_feedforward_layernorm", f"{B}.mlp_post_norm", False, L),
    *_norm(f"{P}norm", "final_norm", False),
  ]
  return _decoder_table(c, rules, r"rotary_emb(_local)?\.inv_freq$")


def _bert(c, arch: str) -> Table:
  L, B = c.num_layers, "blocks.layers"
  P = "" if arch == "BertModel" else "bert."
  h = f"{P}encoder.layer.{{i}}"
  rules = [
    Rule(f"{P}embeddings.word_embeddings.weight", ("embed.embedding",)),
    Rule(f"{P}embeddings.position_embeddings.weight", ("pos_embed.embedding",)),
    Rule(f"{P}embeddings.token_type_embeddings.weight", ("type_embed.embedding",)),
    *_norm(f"{P}embeddings.LayerNorm", "embed_norm", True),
    *_attention(
      f"{h}.attention",
      f"{B}.attn",
      ("self.query", "self.key", "self.value", "output.dense"),
      True,
      L,
    ),
    *_norm(f"{h}.attention.output.LayerNorm", f"{B}.attn_norm", True, L),
    *_linear(f"{h}.intermediate.dense", f"{B}.mlp.up", True, L=L),
    *_linear(f"{h}.output.dense", f"{B}.mlp.down", True, L=L),
    *_norm(f"{h}.output.LayerNorm", f"{B}.mlp_norm", True, L),
  ]
  aliases = {}
  if arch != "BertForMaskedLM":
    rules += _linear(f"{P}pooler.dense", "pooler", True)
  if arch in ("BertForPreTraining", "BertForMaskedLM"):
    rules += [
      *_linear("cls.predictions.transform.dense", "mlm_dense", True),
      *_norm("cls.predictions.transform.LayerNorm", "mlm_norm", True),
      Rule("cls.predictions.bias", ("mlm_bias",)),
    ]
    aliases = {
      "cls.predictions.decoder.weight": f"{P}embeddings.word_embeddings.weight",
      "cls.predictions.decoder.bias": "cls.predictions.bias",
    }
  if arch == "BertForPreTraining":
    rules += _linear("cls.seq_relationship", "nsp", True)
  if arch == "BertForSequenceClassification":
    rules += _linear("classifier", "classifier", True)
  return Table(rules, aliases, (r"position_ids$", r"token_type_ids$"), P)


def _bigbird(c, arch: str) -> Table:
  """BigBird's names are BERT's, but its pooler is ``pooler`` (not ``pooler.dense``) and its
  masked LM keeps it."""
  bert = {
    "BigBirdModel": "BertModel",
    "BigBirdForMaskedLM": "BertForPreTraining",
    "BigBirdForPreTraining": "BertForPreTraining",
  }[arch]
  t = _bert(c, bert)
  rules = [
    dataclasses.replace(r, hf=r.hf.replace("pooler.dense.", "pooler."))
    for r in t.rules
    if not (arch == "BigBirdForMaskedLM" and r.hf.startswith("cls.seq_relationship"))
  ]
  return dataclasses.replace(t, rules=rules)


def _t5(c) -> Table:
  Le, Ld = c.num_encoder_layers, c.num_decoder_layers
  qkvo = ("q", "k", "v", "o")

  def mlp(hf, ours, L):
    if c.gated:
      return (
        _linear(f"{hf}.wi_0", f"{ours}.gate", False, L=L)
        + _linear(f"{hf}.wi_1", f"{ours}.up", False, L=L)
        + _linear(f"{hf}.wo", f"{ours}.down", False, L=L)
      )
    return _linear(f"{hf}.wi", f"{ours}.up", False, L=L) + _linear(
      f"{hf}.wo", f"{ours}.down", False, L=L
    )

  e, d = "encoder.block.{i}.layer", "decoder.block.{i}.layer"
  rules = [
    Rule("shared.weight", ("embed.embedding",)),
    *_attention(f"{e}.0.SelfAttention", "encoder.layers.attn", qkvo, False, Le),
    *_norm(f"{e}.0.layer_norm", "encoder.layers.attn_norm", False, Le),
    *mlp(f"{e}.1.DenseReluDense", "encoder.layers.mlp", Le),
    *_norm(f"{e}.1.layer_norm", "encoder.layers.mlp_norm", False, Le),
    Rule(
      "encoder.block.0.layer.0.SelfAttention.relative_attention_bias.weight",
      ("encoder_rel_bias.embedding",),
    ),
    *_norm("encoder.final_layer_norm", "encoder_norm", False),
    *_attention(f"{d}.0.SelfAttention", "decoder.layers.attn", qkvo, False, Ld),
    *_norm(f"{d}.0.layer_norm", "decoder.layers.attn_norm", False, Ld),
    *_attention(f"{d}.1.EncDecAttention", "decoder.layers.cross_attn", qkvo, False, Ld),
    *_norm(f"{d}.1.layer_norm", "decoder.layers.cross_norm", False, Ld),
    *mlp(f"{d}.2.DenseReluDense", "decoder.layers.mlp", Ld),
    *_norm(f"{d}.2.layer_norm", "decoder.layers.mlp_norm", False, Ld),
    Rule(
      "decoder.block.0.layer.0.SelfAttention.relative_attention_bias.weight",
      ("decoder_rel_bias.embedding",),
    ),
    *_norm("decoder.final_layer_norm", "decoder_norm", False),
  ]
  aliases = {
    "encoder.embed_tokens.weight": "shared.weight",
    "decoder.embed_tokens.weight": "shared.weight",
  }
  if c.tie_embeddings:
    aliases["lm_head.weight"] = "shared.weight"
  else:
    rules.append(Rule("lm_head.weight", ("lm_head.kernel",), Transform.LINEAR))
  ignore = (r"^decoder\.block\.0\.layer\.1\.EncDecAttention\.relative_attention_bias\.weight$",)
  return Table(rules, aliases, ignore, "")


def _marian(c) -> Table:
  Le, Ld, P = c.num_encoder_layers, c.num_decoder_layers, "model."
  qkvo = ("q_proj", "k_proj", "v_proj", "out_proj")
  e, d = f"{P}encoder.layers.{{i}}", f"{P}decoder.layers.{{i}}"
  E, D = "encoder.layers", "decoder.layers"
  rules = [
    Rule(f"{P}shared.weight", ("embed.embedding",)),
    *_attention(f"{e}.self_attn", f"{E}.attn", qkvo, True, Le),
    *_norm(f"{e}.self_attn_layer_norm", f"{E}.attn_norm", True, Le),
    *_linear(f"{e}.fc1", f"{E}.mlp.up", True, L=Le),
    *_linear(f"{e}.fc2", f"{E}.mlp.down", True, L=Le),
    *_norm(f"{e}.final_layer_norm", f"{E}.mlp_norm", True, Le),
    *_attention(f"{d}.self_attn", f"{D}.attn", qkvo, True, Ld),
    *_norm(f"{d}.self_attn_layer_norm", f"{D}.attn_norm", True, Ld),
    *_attention(f"{d}.encoder_attn", f"{D}.cross_attn", qkvo, True, Ld),
    *_norm(f"{d}.encoder_attn_layer_norm", f"{D}.cross_norm", True, Ld),
    *_linear(f"{d}.fc1", f"{D}.mlp.up", True, L=Ld),
    *_linear(f"{d}.fc2", f"{D}.mlp.down", True, L=Ld),
    *_norm(f"{d}.final_layer_norm", f"{D}.mlp_norm", True, Ld),
  ]
  aliases = {
    f"{P}encoder.embed_tokens.weight": f"{P}shared.weight",
    f"{P}decoder.embed_tokens.weight": f"{P}shared.weight",
    "lm_head.weight": f"{P}shared.weight",
  }
  # The sinusoid tables are constants (checked by the loader); final_logits_bias must be zero.
  ignore = (r"embed_positions\.weight$",)
  return Table(rules, aliases, ignore, P, permute_embed=True)


def _mamba(c) -> Table:
  """Mamba and Mamba-2 (``MambaForCausalLM``, ``Mamba2ForCausalLM``): ``backbone.layers.{i}`` is
  ``norm`` and ``mixer``; the mixers' names are ours too."""
  L, P, B = c.num_layers, "backbone.", "blocks.mamba"
  h, m = f"{P}layers.{{i}}", f"{B}.mixer"
  v1 = c.mixer == "mamba1"
  rules = [
    Rule(f"{P}embeddings.weight", ("embed.embedding",)),
    *_norm(f"{h}.norm", f"{B}.norm", False, L),
    *_linear(
      f"{h}.mixer.in_proj",
      f"{m}.in_proj",
      c.use_bias,
      Transform.LINEAR_HALVES if v1 else Transform.LINEAR,
      Transform.BIAS_HALVES if v1 else Transform.COPY,
      L,
    ),
    Rule(f"{h}.mixer.conv1d.weight", (f"{m}.conv_kernel",), Transform.DEPTHWISE, L),
    Rule(f"{h}.mixer.A_log", (f"{m}.A_log",), Transform.COPY, L),
    Rule(f"{h}.mixer.D", (f"{m}.D",), Transform.COPY, L),
    *_linear(f"{h}.mixer.out_proj", f"{m}.out_proj", c.use_bias, L=L),
    *_norm(f"{P}norm_f", "final_norm", False),
  ]
  if c.conv_bias:
    rules.append(Rule(f"{h}.mixer.conv1d.bias", (f"{m}.conv_bias",), Transform.COPY, L))
  if v1:
    rules += [
      *_linear(f"{h}.mixer.x_proj", f"{m}.x_proj", False, L=L),
      *_linear(f"{h}.mixer.dt_proj", f"{m}.dt_proj", True, L=L),
    ]
  else:
    rules += [
      Rule(f"{h}.mixer.dt_bias", (f"{m}.dt_bias",), Transform.COPY, L),
      *_norm(f"{h}.mixer.norm", f"{m}.norm", False, L),
    ]
  # Older checkpoints name the embedding "backbone.embedding" (transformers renames it on load).
  aliases = {f"{P}embedding.weight": f"{P}embeddings.weight"}
  if c.tie_embeddings:
    aliases["lm_head.weight"] = f"{P}embeddings.weight"
  else:
    rules.append(Rule("lm_head.weight", ("lm_head.kernel",), Transform.LINEAR))
  return Table(rules, aliases, (), P)


def table(config: ModelConfig, arch: str) -> Table:
  """The mapping for ``config`` saved as ``arch``."""
  if getattr(config, "dense_layers", ()) and config.num_experts:
    return experts.with_dense_layers(config, lambda c: table(c, arch))
  match ARCHITECTURES[arch][0]:
    case "gpt2":
      return _gpt2(config)
    case "llama" | "mistral" | "qwen2" | "qwen3" | "mixtral" | "qwen3_moe":
      return _llama(config)
    case "gemma2" | "gemma3":
      return _gemma(config)
    case "bert":
      return _bert(config, arch)
    case "bigbird":
      return _bigbird(config, arch)
    case "t5":
      return _t5(config)
    case "marian":
      return _marian(config)
    case "mamba" | "mamba2":
      return _mamba(config)
    case family:
      raise ValueError(f"no parameter table for family {family!r}")


def dims(config: ModelConfig) -> Dims:
  return Dims(config.num_heads, config.kv_heads, config.head_size)


# Marian's sinusoid is [sin(p w_0), ..., sin(p w_{D/2-1}), cos(p w_0), ...] where ours interleaves
# (sin(p w_0), cos(p w_0), ...). The two models are the same function up to a fixed permutation of
# the model dimension, so Marian maps exactly onto ours once every "embed" axis is permuted.
def marian_permutation(d_model: int) -> np.ndarray:
  """``perm`` with ``ours[..., perm] == marian`` along every model-width axis."""
  return np.concatenate([np.arange(0, d_model, 2), np.arange(1, d_model, 2)])


def marian_sinusoid(num_positions: int, dim: int) -> np.ndarray:
  """Marian's (concatenated) sinusoid table ``[num_positions, dim]``, as transformers builds it."""
  pos = np.arange(num_positions, dtype=np.float64)[:, None]
  inv = 1.0 / 10000.0 ** (np.arange(0, dim, 2, dtype=np.float64) / dim)
  return np.concatenate([np.sin(pos * inv), np.cos(pos * inv)], axis=1).astype(np.float32)
