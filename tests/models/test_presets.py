"""Presets: analytic counts equal instantiated counts; the papers' sizes; config validation."""

import jax
import pytest
from flax import nnx

import transformer_jax as tj
from transformer_jax import models


def _instantiated_params(config) -> int:
  state = nnx.state(models.abstract(config), nnx.Param)  # eval_shape: no memory, any size
  return sum(x.size for x in jax.tree.leaves(state))


@pytest.mark.parametrize("name", models.list_presets())
def test_count_params_equals_instantiated_model(name):
  config = models.get_config(name)
  assert models.count_params(config) == _instantiated_params(config)


@pytest.mark.parametrize(
  "name,overrides",
  [
    ("gpt2-tiny", dict(tie_embeddings=False, position="rope")),
    ("llama-tiny", dict(num_kv_heads=1, head_dim=8)),
    ("bert-tiny", dict(num_labels=3, vocab_size=100)),
    ("t5-tiny", dict(gated=True, tie_embeddings=False, num_kv_heads=2)),
    ("transformer-tiny", dict(pre_norm=True, norm="rmsnorm", use_bias=False)),
  ],
)
def test_count_params_equals_instantiated_model_with_overrides(name, overrides):
  config = models.get_config(name, **overrides)
  assert models.count_params(config) == _instantiated_params(config)


# Sizes reported by the papers (GPT-2 Table 2 as re-counted by OpenAI's release, BERT section 3,
# T5 section 3.1, the Transformer Table 3), within the tolerance below.
PAPER_COUNTS = [
  ("gpt2-small", 124e6, 0.02),
  ("gpt2-medium", 355e6, 0.02),
  ("gpt2-large", 774e6, 0.02),
  ("gpt2-xl", 1558e6, 0.02),
  ("bert-base", 110e6, 0.02),
  ("bert-large", 340e6, 0.02),
  ("t5-small", 60e6, 0.02),
  ("transformer-base", 65e6, 0.04),
  ("transformer-big", 213e6, 0.04),
]


@pytest.mark.parametrize("name,paper,tol", PAPER_COUNTS)
def test_count_params_matches_paper(name, paper, tol):
  n = models.count_params(models.get_config(name))
  assert abs(n - paper) / paper <= tol, (name, n, paper)


def test_count_params_exact_known_values():
  # Exact counts of the reference implementations (GPT-2 small tied: 124,439,808; T5-small:
  # 60,506,624; LLaMA-2-7B: 6,738,415,616; Mistral-7B: 7,241,732,096; TinyLlama-1.1B:
  # 1,100,048,384).
  assert models.count_params(models.get_config("gpt2-small")) == 124_439_808
  assert models.count_params(models.get_config("t5-small")) == 60_506_624
  assert models.count_params(models.get_config("llama2-7b")) == 6_738_415_616
  assert models.count_params(models.get_config("mistral-7b")) == 7_241_732_096
  assert models.count_params(models.get_config("tinyllama-1.1b")) == 1_100_048_384


def test_get_config_applies_and_validates_overrides():
  config = models.get_config("gpt2-small", vocab_size=1000, num_layers=2)
  assert config.vocab_size == 1000 and config.num_layers == 2 and config.d_model == 768
  with pytest.raises(ValueError, match="num_heads=12 does not divide d_model=770"):
    models.get_config("gpt2-small", d_model=770)
  with pytest.raises(ValueError, match="no field.*hidden_size"):
    models.get_config("gpt2-small", hidden_size=10)
  with pytest.raises(ValueError, match="unknown preset 'gpt2-smal'.*gpt2-small"):
    models.get_config("gpt2-smal")


@pytest.mark.parametrize(
  "field,value,message",
  [
    ("num_kv_heads", 5, "num_kv_heads=5 does not divide num_heads=4"),
    ("position", "spiral", "position='spiral' must be one of"),
    ("dropout_rate", 1.5, "dropout_rate=1.5 must be in"),
    ("dtype", "int8", "dtype='int8' must be a floating dtype"),
    ("num_layers", 0, "num_layers=0 must be a positive integer"),
    ("activation", "tanh", "activation='tanh' must be one of"),
    ("remat", "some", "remat='some' must be one of"),
    ("scan_layers", "yes", "scan_layers='yes' must be true, false or 'auto'"),
    ("scan_layers", 1, "scan_layers=1 must be true, false or 'auto'"),
  ],
)
def test_config_errors_name_field_and_value(field, value, message):
  with pytest.raises(ValueError, match=message):
    models.get_config("llama-tiny", **{field: value})


def test_configs_are_hashable_and_frozen():
  config = models.get_config("t5-tiny")
  assert hash(config) == hash(models.get_config("t5-tiny"))
  with pytest.raises(Exception):
    config.d_model = 3  # frozen


def test_train_flops_per_token_is_6n_plus_attention():
  c = models.get_config("gpt2-small")
  pc = models.param_count(c)
  n_matmul = pc.non_embedding + c.d_model * c.vocab_size
  expected = 6 * n_matmul + 12 * c.num_layers * 1024 * c.d_model
  assert models.train_flops_per_token(c, 1024) == expected


def test_cli_info_prints_counts(capsys):
  from transformer_jax import cli

  assert cli.main(["info", "gpt2-small", "--vocab-size", "50257"]) == 0
  out = capsys.readouterr().out
  assert "124,439,808" in out and "non-embedding" in out and "FLOPs" in out
  assert cli.main(["info", "nope"]) == 2
  assert "unknown preset" in capsys.readouterr().err


def test_top_level_package_exposes_api():
  assert tj.models.GPT is models.GPT and callable(tj.ops.dot_product_attention)
