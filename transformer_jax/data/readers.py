"""Reading corpus files as a stream of records, one reader per format (``data.files``).

A reader yields ``Record`` (the texts of one document, or of one seq2seq pair) and ``Problem``
(what is wrong, and where: file, line, row group or record batch). It never raises for bad data
and never holds more than one document, line, record batch or 1,024 rows of a row group:
``prepare`` decides whether a problem stops it or is skipped and counted.

A reader reports how far it is through its file as a byte stream's ``tell()`` does: a byte stream
is given to ``opened`` itself (compressed files report their compressed bytes read, a chunk at a
time); Parquet and Arrow IPC files, read out of order, are given a ``Share`` instead.

A problem with ``whole_file`` set (a corrupt compressed stream, an unreadable Parquet row group,
too many undecodable bytes, a missing column) spoils the file: the records it yielded before are
dropped with it.
"""

from __future__ import annotations

import dataclasses
import gzip
import io
import json
import zlib
from collections.abc import Callable, Iterator
from typing import IO

from transformer_jax.data.files import Source, need, open_binary

# Above this fraction of a file's bytes, undecodable bytes mean the file is not UTF-8 text (a
# binary, compressed or other-encoding file): an error naming it, unless the caller allows them.
MAX_UNDECODABLE_FRACTION = 0.001
_ROWS_PER_BATCH = 1024  # rows a Parquet row group is decoded in: memory does not grow with its size


@dataclasses.dataclass(frozen=True)
class Record:
  """One document (``texts == (text,)``) or seq2seq pair (``(source, target)``)."""

  texts: tuple[str, ...]
  where: str
  replaced: int = 0  # undecodable byte sequences replaced by U+FFFD


@dataclasses.dataclass(frozen=True)
class Problem:
  where: str
  message: str
  whole_file: bool = False

  def __str__(self) -> str:
    return f"{self.where}: {self.message}"


class Share:
  """Where a reader of a Parquet or Arrow IPC file stands, in ``tell()``'s terms: the file's
  ``size`` times the share of its ``total`` rows (or record batches) decoded so far. It moves a
  decoded batch at a time, as a compressed stream's position moves a chunk at a time."""

  def __init__(self, size: int, total: int):
    self.size, self.total, self.done = size, total, 0

  def advance(self, n: int) -> None:
    self.done += n

  def tell(self) -> int:
    return self.size if self.total <= 0 else self.size * min(self.done, self.total) // self.total


def _size(raw: IO[bytes]) -> int:
  """The file's size in bytes; ``raw`` is left at its start."""
  size = raw.seek(0, io.SEEK_END)
  raw.seek(0)
  return size


def decode(data: bytes) -> tuple[str, int]:
  """UTF-8 decode; undecodable bytes become U+FFFD. Returns (text, number of replacement
  characters added)."""
  try:
    return data.decode("utf-8"), 0
  except UnicodeDecodeError:
    text = data.decode("utf-8", errors="replace")
    return text, text.count("\ufffd") - data.decode("utf-8", errors="ignore").count("\ufffd")


def _too_many(replaced: int, size: int, allow: bool) -> str | None:
  if allow or replaced <= MAX_UNDECODABLE_FRACTION * size:
    return None
  return (
    f"{replaced} undecodable byte sequences in {size} bytes (over "
    f"{MAX_UNDECODABLE_FRACTION:.1%}): not UTF-8 text; --allow-undecodable replaces them by U+FFFD"
  )


def _stream_errors() -> tuple[type[BaseException], ...]:
  errors: tuple[type[BaseException], ...] = (OSError, EOFError, zlib.error)
  try:
    import zstandard  # noqa: PLC0415  (optional)

    errors += (zstandard.ZstdError,)
  except ImportError:
    pass
  return errors


class _ZstdFrames(io.RawIOBase):
  """The decompressed bytes of a stream of zstd frames. Where the stream ends inside a frame (a
  cut file) it raises ``EOFError``, as ``gzip`` does: zstandard's own reader ends there silently,
  which would read a cut file as empty."""

  def __init__(self, raw: IO[bytes], zstandard):
    self._raw, self._new = raw, zstandard.ZstdDecompressor().decompressobj
    self._frame, self._out, self._at, self._started = self._new(), b"", 0, False

  def readable(self) -> bool:
    return True

  def readinto(self, buffer) -> int:
    while self._at == len(self._out):
      chunk = self._raw.read(1 << 20)
      if not chunk:
        if self._started and not self._frame.eof:
          raise EOFError("the stream ends inside a zstd frame")
        return 0
      parts = []
      while chunk:
        if self._frame.eof:  # the next frame of a multi-frame file
          self._frame = self._new()
        self._started = True
        parts.append(self._frame.decompress(chunk))
        chunk = self._frame.unused_data if self._frame.eof else b""
      self._out, self._at = b"".join(parts), 0
    n = min(len(buffer), len(self._out) - self._at)
    buffer[:n] = memoryview(self._out)[self._at : self._at + n]
    self._at += n
    return n


def _decompressed(raw: IO[bytes], source: Source) -> IO[bytes]:
  if source.compression == "gzip":
    return gzip.GzipFile(fileobj=raw)
  if source.compression == "zstd":
    return io.BufferedReader(_ZstdFrames(raw, need("zstandard", source.path)))
  return raw


def _text_records(source: Source, data: bytes, allow: bool) -> Iterator[Record | Problem]:
  text, replaced = decode(data)
  if (message := _too_many(replaced, len(data), allow)) is not None:
    yield Problem(source.path, message, whole_file=True)
  else:
    yield Record((text,), source.path, replaced)


def _line_record(source: Source, where: str, text: str, field: str) -> Record | Problem | None:
  if not text.strip():
    return None
  if source.kind == "tsv":
    if "\t" not in text:
      return Problem(where, "expected 'source<TAB>target'")
    return Record(tuple(text.split("\t", 1)), where)
  try:
    record = json.loads(text)
  except json.JSONDecodeError as e:
    return Problem(where, f"invalid JSON ({e.msg})")
  if not isinstance(record, dict) or field not in record:
    return Problem(where, f"expected an object with a string field {field!r}")
  value = record[field]
  if not isinstance(value, str):
    return Problem(where, f"field {field!r} is {type(value).__name__}, expected a string")
  if not value:
    return Problem(where, f"empty document (field {field!r} is '')")
  return Record((value,), where)


def _line_records(
  source: Source, stream: IO[bytes], field: str, allow: bool
) -> Iterator[Record | Problem]:
  size = replaced = 0
  for lineno, raw in enumerate(stream, start=1):
    text, bad = decode(raw.rstrip(b"\r\n"))
    size, replaced = size + len(raw), replaced + bad
    item = _line_record(source, f"{source.path}:{lineno}", text, field)
    if bad and isinstance(item, Record):
      item = dataclasses.replace(item, replaced=bad)
    if item is not None:
      yield item
  if (message := _too_many(replaced, size, allow)) is not None:
    yield Problem(source.path, message, whole_file=True)


def _text_column(source: Source, schema, field: str, what: str) -> Problem | None:
  pa = need("pyarrow", source.path)
  if field not in schema.names:
    return Problem(
      source.path,
      f"no {what} {field!r} (it has {', '.join(schema.names) or 'none'}); give --text-field",
      whole_file=True,
    )
  kind = schema.field(field).type
  if not (pa.types.is_string(kind) or pa.types.is_large_string(kind)):
    return Problem(source.path, f"{what} {field!r} is of type {kind}, not text", whole_file=True)
  return None


def _column_records(
  where: str, values: list, field: str, first: int = 0
) -> Iterator[Record | Problem]:
  for row, value in enumerate(values, start=first):
    if value is None:
      yield Problem(f"{where}, row {row}", f"{field!r} is null")
    elif not value:
      yield Problem(f"{where}, row {row}", f"empty document ({field!r} is '')")
    else:
      yield Record((value,), f"{where}, row {row}")


def _parquet_records(
  source: Source, raw: IO[bytes], field: str, opened: Callable[[Share], None] | None
) -> Iterator[Record | Problem]:
  pa = need("pyarrow", source.path)
  pq = need("pyarrow.parquet", source.path)
  try:
    size = _size(raw)
    parquet = pq.ParquetFile(raw)
    share = Share(size, parquet.metadata.num_rows)
  except (pa.ArrowException, OSError) as e:
    yield Problem(source.path, f"not a readable Parquet file ({e})", whole_file=True)
    return
  if opened is not None:
    opened(share)
  if (problem := _text_column(source, parquet.schema_arrow, field, "column")) is not None:
    yield problem
    return
  for group in range(parquet.num_row_groups):
    where, row, batches = f"{source.path}: row group {group}", 0, None
    while True:
      try:
        if batches is None:
          batches = parquet.iter_batches(_ROWS_PER_BATCH, row_groups=[group], columns=[field])
        batch = next(batches, None)
        values = None if batch is None else batch.column(0).to_pylist()
      except (pa.ArrowException, OSError) as e:
        yield Problem(where, f"unreadable ({e})", whole_file=True)
        return
      if values is None:
        break
      share.advance(len(values))
      yield from _column_records(where, values, field, row)
      row += len(values)


def _arrow_records(
  source: Source, raw: IO[bytes], field: str, opened: Callable[[IO[bytes] | Share], None] | None
) -> Iterator[Record | Problem]:
  pa = need("pyarrow", source.path)
  ipc = need("pyarrow.ipc", source.path)
  try:
    is_file = raw.read(6) == b"ARROW1"
    size = _size(raw)
    reader = ipc.open_file(raw) if is_file else ipc.open_stream(raw)
  except (pa.ArrowException, OSError) as e:
    yield Problem(source.path, f"not a readable Arrow file ({e})", whole_file=True)
    return
  # An IPC file is read by record batch index (its footer first): a Share of its batches says
  # how far; a stream is read in order, its position says it.
  count = reader.num_record_batches if is_file else None
  share = Share(size, count) if is_file else None
  if opened is not None:
    opened(share if share is not None else raw)
  if (problem := _text_column(source, reader.schema, field, "column")) is not None:
    yield problem
    return
  index = reader.schema.get_field_index(field)
  batch_no = 0
  while count is None or batch_no < count:
    where = f"{source.path}: record batch {batch_no}"
    try:
      batch = reader.get_batch(batch_no) if count is not None else reader.read_next_batch()
    except StopIteration:
      return
    except (pa.ArrowException, OSError) as e:
      yield Problem(where, f"unreadable ({e})", whole_file=True)
      return
    if share is not None:
      share.advance(1)
    yield from _column_records(where, batch.column(index).to_pylist(), field)
    batch_no += 1


def read_records(
  source: Source,
  text_field: str,
  allow_undecodable: bool,
  opened: Callable[[IO[bytes] | Share], None] | None = None,
) -> Iterator[Record | Problem]:
  """The records of ``source`` in file order, and the problems met on the way (see the module
  docstring). ``opened`` is given what tells how far the file is read, in its bytes: its byte
  stream (compressed bytes for a compressed file), or a ``Share`` for a Parquet or Arrow IPC file.
  An unreadable file (a missing file, a lost connection) raises ``OSError``."""
  with open_binary(source.path, random_access=source.kind in ("parquet", "arrow")) as raw:
    if source.kind == "parquet":
      yield from _parquet_records(source, raw, text_field, opened)
      return
    if source.kind == "arrow":
      yield from _arrow_records(source, raw, text_field, opened)
      return
    if opened is not None:
      opened(raw)
    errors = _stream_errors() if source.compression else ()
    stream = _decompressed(raw, source)
    lineno = 0
    try:
      if source.kind == "text":
        data = stream.read()
        yield from _text_records(source, data, allow_undecodable)
        return
      for item in _line_records(source, stream, text_field, allow_undecodable):
        if isinstance(item, Record):
          lineno = int(item.where.rsplit(":", 1)[1])
        yield item
    except errors as e:
      where = f"{source.path}:{lineno + 1}" if source.kind != "text" else source.path
      message = f"corrupt {source.compression} stream ({type(e).__name__}: {e})"
      yield Problem(where, message, whole_file=True)
