"""``hf.save`` and ``tjax convert --to-hf`` write the special-token ids of the model's own tokenizer
into ``config.json`` (a GPT's ``<|endoftext|>`` as bos and eos, BERT's ``[PAD]``, a Seq2Seq model's
``<bos>``/``<eos>``/``[PAD]``), and ``null`` for a GPT whose tokenizer is unknown, where
transformers would otherwise put GPT-2's 50256, outside a small vocabulary."""

import dataclasses
import json

import jax
import numpy as np
import pytest

transformers = pytest.importorskip("transformers")
pytest.importorskip("torch")

import transformer_jax as tj  # noqa: E402
from transformer_jax import data, hf, runs  # noqa: E402
from transformer_jax.hf import convert  # noqa: E402


@pytest.fixture(scope="module")
def dataset(tmp_path_factory):
  """A tiny prepared dataset with a compact vocabulary: its special ids are small numbers."""
  root = tmp_path_factory.mktemp("ids")
  corpus = root / "corpus"
  corpus.mkdir()
  rng = np.random.default_rng(0)
  words = ["alpha", "beta", "gamma", "return", "value", "self"]
  for d in range(6):
    (corpus / f"d{d}.txt").write_text("\n".join(" ".join(rng.choice(words, 6)) for _ in range(10)))
  path = str(root / "ds")
  data.prepare([str(corpus)], path, compact_vocab=True, progress=False, val_fraction=2)
  return data.load_dataset(path)


def _config(preset, vocab_size):
  return dataclasses.replace(tj.models.get_config(preset), vocab_size=vocab_size)


def _written(path):
  return json.loads((path / "config.json").read_text())


@pytest.mark.parametrize(
  "preset, cls", [("gpt2-tiny", "GPT2LMHeadModel"), ("llama-tiny", "LlamaForCausalLM")]
)
def test_gpt_save_writes_the_tokenizers_end_of_text(tmp_path, dataset, preset, cls):
  tok = dataset.tokenizer
  config = _config(preset, tok.vocab_size)
  hf.save(tj.models.create(config), config, tmp_path / "out", tokenizer=tok)
  written = _written(tmp_path / "out")
  assert written["bos_token_id"] == written["eos_token_id"] == tok.eot_id < config.vocab_size
  model = getattr(transformers, cls).from_pretrained(tmp_path / "out")
  assert model.config.bos_token_id == model.config.eos_token_id == tok.eot_id
  assert model.generation_config.eos_token_id == tok.eot_id


def test_gpt_save_without_a_tokenizer_writes_unknown_ids(tmp_path):
  config = tj.models.get_config("gpt2-tiny")  # V=512: GPT-2's 50256 would lie outside it
  hf.save(tj.models.create(config), config, tmp_path / "out")
  written = _written(tmp_path / "out")
  assert written["bos_token_id"] is None and written["eos_token_id"] is None
  model = transformers.GPT2LMHeadModel.from_pretrained(tmp_path / "out")
  assert model.config.bos_token_id is None and model.config.eos_token_id is None


def test_bert_and_seq2seq_ids(tmp_path, dataset):
  tok = dataset.tokenizer
  bert = _config("bert-tiny", tok.vocab_size)
  hf.save(tj.models.create(bert), bert, tmp_path / "bert", tokenizer=tok)
  assert _written(tmp_path / "bert")["pad_token_id"] == tok.pad_id
  t5 = _config("t5-tiny", tok.vocab_size)
  hf.save(tj.models.create(t5), t5, tmp_path / "t5", tokenizer=tok)
  written = _written(tmp_path / "t5")
  ids = (tok.bos_id, tok.eos_id, tok.pad_id)
  assert (
    written["decoder_start_token_id"],
    written["eos_token_id"],
    written["pad_token_id"],
  ) == ids
  marian = hf.configs.token_ids("MarianMTModel", tok)
  assert (marian["decoder_start_token_id"], marian["eos_token_id"], marian["pad_token_id"]) == ids
  assert hf.configs.token_ids("MarianMTModel") == {}  # without a tokenizer: the writer's own


def test_ids_outside_the_vocabulary_are_refused(tmp_path, dataset):
  config = tj.models.get_config("gpt2-tiny")
  tok = dataset.tokenizer
  if tok.eot_id < config.vocab_size:
    config = dataclasses.replace(config, vocab_size=tok.eot_id)
  with pytest.raises(ValueError, match="outside the model's vocabulary"):
    hf.save(tj.models.create(config), config, tmp_path / "out", tokenizer=tok)


def test_convert_to_hf_takes_the_runs_tokenizer(tmp_path, dataset):
  tok = dataset.tokenizer
  config = _config("gpt2-tiny", tok.vocab_size)
  run_dir = tmp_path / "run"
  runs.save_model(str(run_dir), config, tj.models.init(config, jax.random.key(0)))
  assert convert.run_tokenizer(run_dir) is None  # a converted run names no dataset
  runs.RunDir(run_dir).write_snapshot(None, config, runs.dataset_ref(dataset))
  convert.to_hf(run_dir, tmp_path / "out")
  written = _written(tmp_path / "out")
  assert written["bos_token_id"] == written["eos_token_id"] == tok.eot_id
