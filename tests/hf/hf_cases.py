"""Random-weight transformers models (built offline from config objects) and the logits to compare.

Shared by the tests in this folder and by ``experiments/hf_parity.py``.
"""

from __future__ import annotations

import jax
import numpy as np
import torch
from flax import nnx
import transformers

from tests.models.conftest import compiled

# name -> (architecture, config kwargs). Tiny, with odd shapes: 3 heads, GQA 8:2, untied heads,
# intermediate sizes that are not 4 D, head_dim != D / N.
CASES: dict[str, tuple[str, dict]] = {
  "gpt2-base": (
    "GPT2LMHeadModel",
    dict(vocab_size=211, n_embd=48, n_layer=2, n_head=4, n_positions=40),
  ),
  "gpt2-3heads-untied": (
    "GPT2LMHeadModel",
    dict(
      vocab_size=150,
      n_embd=48,
      n_layer=2,
      n_head=3,
      n_inner=80,
      n_positions=32,
      tie_word_embeddings=False,
      activation_function="gelu",
      layer_norm_epsilon=1e-6,
    ),
  ),
  "llama-gqa": (
    "LlamaForCausalLM",
    dict(
      vocab_size=256,
      hidden_size=64,
      intermediate_size=96,
      num_hidden_layers=2,
      num_attention_heads=8,
      num_key_value_heads=2,
      max_position_embeddings=64,
    ),
  ),
  "llama-tied-linear": (
    "LlamaForCausalLM",
    dict(
      vocab_size=120,
      hidden_size=48,
      intermediate_size=72,
      num_hidden_layers=2,
      num_attention_heads=3,
      num_key_value_heads=1,
      tie_word_embeddings=True,
      rms_norm_eps=1e-5,
      rope_parameters={"rope_type": "linear", "factor": 2.0, "rope_theta": 500.0},
    ),
  ),
  "llama-llama3-headdim": (
    "LlamaForCausalLM",
    dict(
      vocab_size=200,
      hidden_size=32,
      intermediate_size=64,
      num_hidden_layers=2,
      num_attention_heads=4,
      num_key_value_heads=2,
      head_dim=16,
      max_position_embeddings=64,
      attention_bias=True,
      mlp_bias=True,
      rope_parameters={
        "rope_type": "llama3",
        "factor": 8.0,
        "low_freq_factor": 1.0,
        "high_freq_factor": 4.0,
        "original_max_position_embeddings": 16,
        "rope_theta": 10000.0,
      },
    ),
  ),
  # Mistral: a 5-token window, shorter than the test prompts (12 tokens).
  "mistral-window": (
    "MistralForCausalLM",
    dict(
      vocab_size=160,
      hidden_size=64,
      intermediate_size=96,
      num_hidden_layers=2,
      num_attention_heads=4,
      num_key_value_heads=2,
      max_position_embeddings=64,
      sliding_window=5,
    ),
  ),
  # Qwen2: biases on q/k/v only; one with a 5-token window on every layer (max_window_layers 0),
  # tied, with linear RoPE scaling. Qwen3: q_norm/k_norm, head_dim != D / N.
  "qwen2-gqa": (
    "Qwen2ForCausalLM",
    dict(
      vocab_size=180,
      hidden_size=64,
      intermediate_size=96,
      num_hidden_layers=2,
      num_attention_heads=4,
      num_key_value_heads=2,
      max_position_embeddings=128,
      rope_parameters={"rope_type": "default", "rope_theta": 1000000.0},
    ),
  ),
  "qwen2-tied-window": (
    "Qwen2ForCausalLM",
    dict(
      vocab_size=150,
      hidden_size=48,
      intermediate_size=80,
      num_hidden_layers=2,
      num_attention_heads=6,
      num_key_value_heads=2,
      max_position_embeddings=128,
      tie_word_embeddings=True,
      use_sliding_window=True,
      sliding_window=5,
      max_window_layers=0,
      rope_parameters={"rope_type": "linear", "factor": 2.0, "rope_theta": 10000.0},
    ),
  ),
  "qwen3-headdim": (
    "Qwen3ForCausalLM",
    dict(
      vocab_size=170,
      hidden_size=32,
      intermediate_size=72,
      num_hidden_layers=2,
      num_attention_heads=4,
      num_key_value_heads=2,
      head_dim=24,
      max_position_embeddings=128,
      rms_norm_eps=1e-5,
    ),
  ),
  "qwen3-tied-bias-window": (
    "Qwen3ForCausalLM",
    dict(
      vocab_size=140,
      hidden_size=48,
      intermediate_size=64,
      num_hidden_layers=2,
      num_attention_heads=4,
      num_key_value_heads=1,
      head_dim=16,
      max_position_embeddings=128,
      tie_word_embeddings=True,
      attention_bias=True,
      use_sliding_window=True,
      sliding_window=5,
      max_window_layers=0,
      rope_parameters={
        "rope_type": "llama3",
        "factor": 8.0,
        "low_freq_factor": 1.0,
        "high_freq_factor": 4.0,
        "original_max_position_embeddings": 16,
        "rope_theta": 10000.0,
      },
    ),
  ),
  "bert-pretraining": (
    "BertForPreTraining",
    dict(
      vocab_size=130,
      hidden_size=48,
      num_hidden_layers=2,
      num_attention_heads=3,
      intermediate_size=80,
      max_position_embeddings=40,
      type_vocab_size=3,
    ),
  ),
  "bert-maskedlm": (
    "BertForMaskedLM",
    dict(
      vocab_size=100,
      hidden_size=32,
      num_hidden_layers=2,
      num_attention_heads=4,
      intermediate_size=64,
      max_position_embeddings=32,
      hidden_act="gelu_new",
    ),
  ),
  "bert-classifier": (
    "BertForSequenceClassification",
    dict(
      vocab_size=100,
      hidden_size=32,
      num_hidden_layers=2,
      num_attention_heads=2,
      intermediate_size=48,
      max_position_embeddings=32,
      num_labels=3,
    ),
  ),
  "bert-model": (
    "BertModel",
    dict(
      vocab_size=90,
      hidden_size=32,
      num_hidden_layers=1,
      num_attention_heads=4,
      intermediate_size=40,
      max_position_embeddings=32,
    ),
  ),
  "t5-v1.0": (
    "T5ForConditionalGeneration",
    dict(
      vocab_size=150,
      d_model=48,
      d_kv=16,
      d_ff=96,
      num_layers=2,
      num_decoder_layers=2,
      num_heads=3,
      relative_attention_num_buckets=8,
      relative_attention_max_distance=20,
    ),
  ),
  "t5-v1.1-untied": (
    "T5ForConditionalGeneration",
    dict(
      vocab_size=128,
      d_model=32,
      d_kv=8,
      d_ff=72,
      num_layers=2,
      num_decoder_layers=3,
      num_heads=4,
      feed_forward_proj="gated-gelu",
      tie_word_embeddings=False,
      relative_attention_num_buckets=16,
      relative_attention_max_distance=32,
    ),
  ),
  "marian": (
    "MarianMTModel",
    dict(
      vocab_size=120,
      d_model=32,
      encoder_layers=2,
      decoder_layers=2,
      encoder_attention_heads=4,
      decoder_attention_heads=4,
      encoder_ffn_dim=56,
      decoder_ffn_dim=56,
      max_position_embeddings=40,
      activation_function="swish",
      scale_embedding=True,
      pad_token_id=119,
      decoder_start_token_id=119,
      eos_token_id=0,
    ),
  ),
}

_CONFIGS = {
  "GPT2LMHeadModel": "GPT2Config",
  "LlamaForCausalLM": "LlamaConfig",
  "MistralForCausalLM": "MistralConfig",
  "Qwen2ForCausalLM": "Qwen2Config",
  "Qwen3ForCausalLM": "Qwen3Config",
  "BertForPreTraining": "BertConfig",
  "BertForMaskedLM": "BertConfig",
  "BertForSequenceClassification": "BertConfig",
  "BertModel": "BertConfig",
  "T5ForConditionalGeneration": "T5Config",
  "MarianMTModel": "MarianConfig",
}


def build(name: str, seed: int = 0):
  """The random-weight transformers model for case ``name`` (eval mode, float32).

  Every parameter gets noise on top of transformers' init, so norm scales and biases are not the
  identity (a swapped norm or a dropped bias would otherwise go unnoticed) and logits are O(1).
  """
  arch, kw = CASES[name]
  torch.manual_seed(seed)
  config = getattr(transformers, _CONFIGS[arch])(**kw)
  config.architectures = [arch]
  model = getattr(transformers, arch)(config).float().eval()
  with torch.no_grad():
    if name == "t5-v1.1-untied":
      # transformers 5 ties T5's lm_head on construction; give it its own weights, as v1.1 has.
      model.lm_head.weight = torch.nn.Parameter(torch.randn_like(model.lm_head.weight) * 0.5)
    for pname, p in model.named_parameters():
      if "embed_positions" in pname:  # Marian's sinusoid: a constant
        continue
      p.add_(torch.randn_like(p) * (0.1 if p.ndim == 1 else 0.05))
  return model


def family(arch: str) -> str:
  return {
    "GPT2LMHeadModel": "causal",
    "LlamaForCausalLM": "causal",
    "MistralForCausalLM": "causal",
    "Qwen2ForCausalLM": "causal",
    "Qwen3ForCausalLM": "causal",
    "MixtralForCausalLM": "causal",
    "Qwen3MoeForCausalLM": "causal",
    "MambaForCausalLM": "causal",
    "Mamba2ForCausalLM": "causal",
    "MarianMTModel": "seq2seq",
    "T5ForConditionalGeneration": "seq2seq",
  }.get(arch, "bert")


def batch(vocab: int, *, b: int = 3, t: int = 12, seed: int = 0, left: bool = False) -> dict:
  """Random ids ``[b, t]`` and a 0/1 mask with padding: row 0 full, the others padded (right or
  left)."""
  rng = np.random.default_rng(seed)
  ids = rng.integers(0, vocab, (b, t)).astype(np.int64)
  mask = np.ones((b, t), np.int64)
  for r in range(1, b):
    n = 2 + 2 * r
    if left:
      mask[r, :n] = 0
    else:
      mask[r, t - n :] = 0
  # Left padding: positions count real tokens (as generate() does for both libraries).
  pos = np.maximum(np.cumsum(mask, axis=1) - 1, 0)
  return dict(ids=ids, mask=mask, positions=pos, types=rng.integers(0, 2, (b, t)))


def hf_outputs(model, arch: str, x: dict, tgt: dict | None = None) -> dict[str, np.ndarray]:
  """Named float32 outputs of the transformers model."""

  def tt(a):
    return torch.as_tensor(a)

  with torch.no_grad():
    match arch:
      case (
        "GPT2LMHeadModel"
        | "LlamaForCausalLM"
        | "MistralForCausalLM"
        | "Gemma2ForCausalLM"
        | "Gemma3ForCausalLM"
        | "Qwen2ForCausalLM"
        | "Qwen3ForCausalLM"
        | "MixtralForCausalLM"
        | "Qwen3MoeForCausalLM"
      ):
        out = model(
          input_ids=tt(x["ids"]), attention_mask=tt(x["mask"]), position_ids=tt(x["positions"])
        )
        res = {"logits": out.logits}
      case "MambaForCausalLM" | "Mamba2ForCausalLM":  # no positions: order is the sequence's
        res = {"logits": model(input_ids=tt(x["ids"]), attention_mask=tt(x["mask"])).logits}
      case "BertForPreTraining":
        out = model(
          input_ids=tt(x["ids"]), attention_mask=tt(x["mask"]), token_type_ids=tt(x["types"])
        )
        res = {"mlm": out.prediction_logits, "nsp": out.seq_relationship_logits}
      case "BertForMaskedLM":
        out = model(
          input_ids=tt(x["ids"]), attention_mask=tt(x["mask"]), token_type_ids=tt(x["types"])
        )
        res = {"mlm": out.logits}
      case "BertForSequenceClassification":
        out = model(
          input_ids=tt(x["ids"]), attention_mask=tt(x["mask"]), token_type_ids=tt(x["types"])
        )
        res = {"classes": out.logits}
      case "BertModel":
        out = model(
          input_ids=tt(x["ids"]), attention_mask=tt(x["mask"]), token_type_ids=tt(x["types"])
        )
        res = {"hidden": out.last_hidden_state, "pooled": out.pooler_output}
      case _:
        out = model(
          input_ids=tt(x["ids"]),
          attention_mask=tt(x["mask"]),
          decoder_input_ids=tt(tgt["ids"]),
          decoder_attention_mask=tt(tgt["mask"]),
        )
        res = {"logits": out.logits}
  return {k: v.float().numpy() for k, v in res.items()}


def our_outputs(model, arch: str, x: dict, tgt: dict | None = None) -> dict[str, np.ndarray]:
  """The same outputs from the transformer_jax model."""
  ids, mask = np.asarray(x["ids"]), np.asarray(x["mask"]).astype(bool)
  # One compiled program per call, not each operation on its own.
  model, classify, encode = compiled(model), compiled(model, "classify"), compiled(model, "encode")
  match arch:
    case (
      "GPT2LMHeadModel"
      | "LlamaForCausalLM"
      | "MistralForCausalLM"
      | "Gemma2ForCausalLM"
      | "Gemma3ForCausalLM"
      | "Qwen2ForCausalLM"
      | "Qwen3ForCausalLM"
      | "MixtralForCausalLM"
      | "Qwen3MoeForCausalLM"
    ):
      res = {"logits": model(ids, positions=np.asarray(x["positions"]), attention_mask=mask)}
    case "MambaForCausalLM" | "Mamba2ForCausalLM":
      res = {"logits": model(ids, attention_mask=mask)}
    case "BertForPreTraining":
      mlm, nsp = model(ids, np.asarray(x["types"]), mask)
      res = {"mlm": mlm, "nsp": nsp}
    case "BertForMaskedLM":
      res = {"mlm": model(ids, np.asarray(x["types"]), mask).mlm_logits}
    case "BertForSequenceClassification":
      res = {"classes": classify(ids, np.asarray(x["types"]), mask)}
    case "BertModel":
      hidden, pooled = encode(ids, np.asarray(x["types"]), mask)
      res = {"hidden": hidden, "pooled": pooled}
    case _:
      res = {
        "logits": model(ids, np.asarray(tgt["ids"]), mask, np.asarray(tgt["mask"]).astype(bool))
      }
  return {k: np.asarray(v, np.float32) for k, v in res.items()}


def max_diff(a: dict, b: dict, valid: np.ndarray | None) -> dict[str, float]:
  """Largest |a - b| per output; per-token outputs only where ``valid`` (non-padded)."""
  out = {}
  for k in a:
    x, y = a[k], b[k]
    assert x.shape == y.shape, (k, x.shape, y.shape)
    if valid is not None and x.ndim == 3:
      x, y = x[valid.astype(bool)], y[valid.astype(bool)]
    out[k] = float(np.max(np.abs(x - y)))
  return out


def compare(
  hf_model, our_model, arch: str, *, seed: int = 0, paddings: tuple[bool, ...] = (False, True)
) -> dict[str, float]:
  """Max abs difference per output on a padded random batch (causal models: right and/or left
  padding, ``paddings`` being the ``left`` flags)."""
  vocab = hf_model.config.vocab_size
  diffs = {}
  if family(arch) == "causal":
    for left in paddings:
      x = batch(vocab, seed=seed, left=left)
      d = max_diff(hf_outputs(hf_model, arch, x), our_outputs(our_model, arch, x), x["mask"])
      diffs.update({f"{k}{'-left' if left else ''}": v for k, v in d.items()})
  elif family(arch) == "seq2seq":
    src, tgt = batch(vocab, seed=seed), batch(vocab, t=9, seed=seed + 1)
    diffs = max_diff(
      hf_outputs(hf_model, arch, src, tgt), our_outputs(our_model, arch, src, tgt), tgt["mask"]
    )
  else:
    x = batch(vocab, seed=seed)
    diffs = max_diff(hf_outputs(hf_model, arch, x), our_outputs(our_model, arch, x), x["mask"])
  return diffs


def greedy(step_fn, prompt: np.ndarray, steps: int) -> np.ndarray:
  """Naive greedy continuation: a full forward pass per step, argmax of the last position."""
  ids = np.asarray(prompt)
  for _ in range(steps):
    nxt = np.argmax(np.asarray(step_fn(ids))[:, -1], axis=-1)
    ids = np.concatenate([ids, nxt[:, None]], axis=1)
  return ids


def greedy_pair(hf_model, our_model, *, steps: int = 6, seed: int = 0):
  prompt = batch(hf_model.config.vocab_size, b=2, t=5, seed=seed)["ids"]

  def hf_step(ids):
    with torch.no_grad():
      return hf_model(input_ids=torch.as_tensor(ids)).logits.numpy()

  total = prompt.shape[1] + steps
  graphdef, state = nnx.split(our_model)
  forward = jax.jit(lambda st, ids: nnx.merge(graphdef, st)(ids))

  def our_step(ids):
    # Causal: padding on the right cannot change earlier logits, and one shape means one compile.
    n = ids.shape[1]
    return np.asarray(forward(state, np.pad(ids, ((0, 0), (0, total - n)))))[:, :n]

  return greedy(hf_step, prompt, steps), greedy(our_step, prompt, steps)
