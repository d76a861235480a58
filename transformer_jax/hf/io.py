"""Reading and writing checkpoint files: safetensors (single or sharded), ``pytorch_model.bin``.

Safetensors is parsed here directly (an 8-byte header length, a JSON header, raw little-endian
data), so loading needs neither torch nor the ``safetensors`` package and a damaged file gives a
``CheckpointError`` that says what is wrong. ``pytorch_model.bin`` is read only through
``torch.load(..., weights_only=True)``: no arbitrary unpickling.
"""

from __future__ import annotations

import json
import math
import os
import struct
from pathlib import Path

import ml_dtypes
import numpy as np

from transformer_jax.hf.errors import CheckpointError, UnsupportedError

SAFETENSORS = "model.safetensors"
SAFETENSORS_INDEX = "model.safetensors.index.json"
PYTORCH_BIN = "pytorch_model.bin"
CONFIG = "config.json"

_DTYPES = {
  "F64": np.dtype(np.float64),
  "F32": np.dtype(np.float32),
  "F16": np.dtype(np.float16),
  "BF16": np.dtype(ml_dtypes.bfloat16),
  "I64": np.dtype(np.int64),
  "I32": np.dtype(np.int32),
  "I16": np.dtype(np.int16),
  "I8": np.dtype(np.int8),
  "U8": np.dtype(np.uint8),
  "BOOL": np.dtype(np.bool_),
}
_NAMES = {v: k for k, v in _DTYPES.items()}


def _entry(path: Path, name: str, info, data_size: int) -> tuple[np.dtype, int, int, tuple]:
  """``(dtype, begin, end, shape)`` of one safetensors header entry, every field checked."""
  if not isinstance(info, dict) or not {"dtype", "shape", "data_offsets"} <= set(info):
    raise CheckpointError(f"{path}: tensor {name!r} has a malformed header entry {info!r}")
  dtype, shape, offsets = info["dtype"], info["shape"], info["data_offsets"]
  if not isinstance(dtype, str) or dtype not in _DTYPES:
    raise CheckpointError(
      f"{path}: tensor {name!r}: dtype {dtype!r} is not one of {', '.join(_DTYPES)}"
    )
  if not isinstance(shape, list) or not all(
    isinstance(n, int) and not isinstance(n, bool) and n >= 0 for n in shape
  ):
    raise CheckpointError(f"{path}: tensor {name!r}: shape {shape!r} is not a list of sizes >= 0")
  if (
    not isinstance(offsets, list)
    or len(offsets) != 2
    or not all(isinstance(n, int) and not isinstance(n, bool) for n in offsets)
    or not 0 <= offsets[0] <= offsets[1]
  ):
    raise CheckpointError(
      f"{path}: tensor {name!r}: data_offsets {offsets!r} is not "
      "[begin, end] with 0 <= begin <= end"
    )
  begin, end = offsets
  if end > data_size:
    raise CheckpointError(
      f"{path} is truncated: tensor {name!r} needs bytes up to {end} of the data section, "
      f"which has {data_size}"
    )
  if end - begin != math.prod(shape) * _DTYPES[dtype].itemsize:
    raise CheckpointError(
      f"{path}: tensor {name!r} has {end - begin} bytes for shape {tuple(shape)}"
    )
  return _DTYPES[dtype], begin, end, tuple(shape)


def read_safetensors(path: str | os.PathLike) -> dict[str, np.ndarray]:
  """All tensors of one ``.safetensors`` file, as NumPy arrays (memory-mapped, read-only).

  Raises:
    CheckpointError: the file is truncated, its header is not valid (the field and the tensor
      named), or a tensor lies outside it.
  """
  path = Path(path)
  size = path.stat().st_size
  with open(path, "rb") as f:
    head = f.read(8)
    if len(head) < 8:
      raise CheckpointError(f"{path} is truncated or not a safetensors file ({size} bytes)")
    (n,) = struct.unpack("<Q", head)
    if 8 + n > size:
      raise CheckpointError(
        f"{path} is truncated: its header claims {n} bytes but the file has {size}"
      )
    try:
      header = json.loads(f.read(n))
    except (UnicodeDecodeError, json.JSONDecodeError) as e:
      raise CheckpointError(f"{path} has a corrupt safetensors header: {e}") from None
  if not isinstance(header, dict):
    raise CheckpointError(f"{path}: the safetensors header is not an object")
  header.pop("__metadata__", None)
  data_size = size - 8 - n
  data = (
    np.memmap(path, dtype=np.uint8, mode="r", offset=8 + n) if data_size else np.zeros(0, np.uint8)
  )
  out = {}
  for name, info in header.items():
    dtype, begin, end, shape = _entry(path, name, info, data_size)
    out[name] = data[begin:end].view(dtype).reshape(shape)
  return out


def write_safetensors(path: str | os.PathLike, tensors: dict[str, np.ndarray]) -> None:
  """Writes ``tensors`` (sorted by name, contiguous, little-endian) with ``{"format": "pt"}``."""
  header, offset, arrays = {}, 0, []
  for name in sorted(tensors):
    arr = np.ascontiguousarray(tensors[name])
    if arr.dtype not in _NAMES:
      raise ValueError(f"cannot write tensor {name!r} of dtype {arr.dtype} to safetensors")
    header[name] = {
      "dtype": _NAMES[arr.dtype],
      "shape": list(arr.shape),
      "data_offsets": [offset, offset + arr.nbytes],
    }
    offset += arr.nbytes
    arrays.append(arr)
  header["__metadata__"] = {"format": "pt"}
  blob = json.dumps(header, separators=(",", ":")).encode()
  blob += b" " * (-len(blob) % 8)  # align the data section to 8 bytes
  with open(path, "wb") as f:
    f.write(struct.pack("<Q", len(blob)))
    f.write(blob)
    for arr in arrays:
      f.write(arr.astype(arr.dtype.newbyteorder("<"), copy=False).tobytes())


def _read_bin(path: Path) -> dict[str, np.ndarray]:
  import torch  # noqa: PLC0415 - torch is optional (the hf extra)

  try:
    state = torch.load(path, map_location="cpu", weights_only=True)
  except Exception as e:  # noqa: BLE001 - torch raises many types for corrupt or unsafe pickles
    raise CheckpointError(
      f"{path} could not be read with torch.load(weights_only=True): {type(e).__name__}: {e}"
    ) from None
  if not isinstance(state, dict):
    raise CheckpointError(f"{path} does not hold a state dict (got {type(state).__name__})")
  for name, value in state.items():
    if not isinstance(value, torch.Tensor):
      raise CheckpointError(f"{path}: {name!r} is a {type(value).__name__}, not a tensor")
  return torch_to_numpy(state)


def torch_to_numpy(state) -> dict[str, np.ndarray]:
  """A torch state dict as float32/int NumPy arrays (bfloat16 is widened: NumPy lacks it in
  torch)."""
  import torch  # noqa: PLC0415 - torch is optional (the hf extra)

  out = {}
  for name, t in state.items():
    t = t.detach().cpu()
    if t.dtype == torch.bfloat16:
      out[name] = t.float().numpy().astype(ml_dtypes.bfloat16)
    else:
      out[name] = t.numpy()
  return out


# transformers writes a non-finite float of a config as {"__float__": "Infinity"} (also
# "-Infinity", "NaN"), so that config.json stays strict JSON, and reads it back as the float.
_FLOAT_TAG = "__float__"
_FLOAT_TAGS = {"Infinity": math.inf, "-Infinity": -math.inf, "NaN": math.nan}


def encode_floats(obj):
  """``obj`` with every non-finite float boxed as transformers boxes it in ``config.json``."""
  if isinstance(obj, float) and not math.isfinite(obj):
    return {_FLOAT_TAG: "NaN" if math.isnan(obj) else ("Infinity" if obj > 0 else "-Infinity")}
  if isinstance(obj, dict):
    return {k: encode_floats(v) for k, v in obj.items()}
  if isinstance(obj, (list, tuple)):
    return [encode_floats(v) for v in obj]
  return obj


def decode_floats(obj):
  """Inverse of ``encode_floats`` (what transformers' ``from_pretrained`` reads back)."""
  if isinstance(obj, dict):
    if (
      set(obj) == {_FLOAT_TAG}
      and isinstance(obj[_FLOAT_TAG], str)
      and obj[_FLOAT_TAG] in _FLOAT_TAGS
    ):
      return _FLOAT_TAGS[obj[_FLOAT_TAG]]
    return {k: decode_floats(v) for k, v in obj.items()}
  if isinstance(obj, list):
    return [decode_floats(v) for v in obj]
  return obj


def _read_json_object(path: Path) -> dict:
  """The JSON object in ``path`` (boxed floats unboxed); a ``CheckpointError`` naming the file
  otherwise."""
  try:
    value = decode_floats(json.loads(path.read_bytes().decode("utf-8")))
  except UnicodeDecodeError as e:
    raise CheckpointError(f"{path}: not UTF-8 text (offset {e.start})") from None
  except json.JSONDecodeError as e:
    raise CheckpointError(f"{path} is not valid JSON: {e}") from None
  if not isinstance(value, dict):
    raise CheckpointError(f"{path}: expected an object, got a JSON {type(value).__name__}")
  return value


def _shard_path(folder: Path, index: Path, shard) -> Path:
  """The file of a shard named in ``index``: a relative name that stays inside ``folder`` (a name
  with ``..``, an absolute path or no name at all is refused, so an index never reads elsewhere).
  The names are checked as written; a symbolic link inside the folder is followed, as in the
  Hugging Face cache, whose snapshot files link to its blobs."""
  if not isinstance(shard, str) or not shard or os.path.isabs(shard):
    raise CheckpointError(f"{index}: shard {shard!r} is not a file name inside {folder}")
  parts = Path(shard).parts
  if ".." in parts:
    raise CheckpointError(f"{index}: shard {shard!r} lies outside {folder}")
  return folder / shard


def read_directory(path: str | os.PathLike) -> tuple[dict, dict[str, np.ndarray]]:
  """``(config dict, tensors)`` of a local Hugging Face checkpoint directory.

  Looks for ``model.safetensors``, then ``model.safetensors.index.json`` (shards, named inside
  the directory), then ``pytorch_model.bin``.

  Raises:
    CheckpointError: a missing or damaged file, naming it (and the field or tensor).
  """
  path = Path(path)
  if not path.is_dir():
    raise CheckpointError(f"{path} is not a directory (expected config.json plus weights)")
  if not (path / CONFIG).is_file():
    raise CheckpointError(f"{path} has no {CONFIG}")
  config = _read_json_object(path / CONFIG)
  if (path / SAFETENSORS).is_file():
    return config, read_safetensors(path / SAFETENSORS)
  if (path / SAFETENSORS_INDEX).is_file():
    index_file = path / SAFETENSORS_INDEX
    weight_map = _read_json_object(index_file).get("weight_map")
    if not isinstance(weight_map, dict):
      raise CheckpointError(f"{index_file}: weight_map: expected an object (tensor -> shard)")
    shards = {}
    for shard in weight_map.values():
      if shard not in shards:
        shards[shard] = _shard_path(path, index_file, shard)
    tensors = {}
    for shard, file in sorted(shards.items()):
      if not file.is_file():
        raise CheckpointError(f"{path} lacks the shard {shard} named in {SAFETENSORS_INDEX}")
      tensors.update(read_safetensors(file))
    absent = sorted(set(weight_map) - set(tensors))
    if absent:
      raise CheckpointError(
        f"{path}: tensors listed in the index are absent from their shards: "
        f"{', '.join(absent[:20])}"
      )
    return config, tensors
  if (path / PYTORCH_BIN).is_file():
    return config, _read_bin(path / PYTORCH_BIN)
  if any(path.glob("*.h5")) or any(path.glob("*.msgpack")):
    raise UnsupportedError(
      f"{path} holds only TensorFlow/Flax weights; convert them to safetensors"
    )
  raise CheckpointError(
    f"{path} has no weights: expected {SAFETENSORS}, {SAFETENSORS_INDEX} or {PYTORCH_BIN}"
  )


def write_directory(path: str | os.PathLike, config: dict, tensors: dict[str, np.ndarray]) -> None:
  """Writes ``config.json`` and ``model.safetensors`` into ``path`` (created if needed).

  ``config.json`` is strict JSON: a non-finite float (Mamba-2's open ``time_step_limit``) is
  written boxed, ``{"__float__": "Infinity"}``, as transformers writes and reads it."""
  text = json.dumps(encode_floats(config), indent=2, sort_keys=True, allow_nan=False) + "\n"
  path = Path(path)
  path.mkdir(parents=True, exist_ok=True)
  (path / CONFIG).write_text(text)
  write_safetensors(path / SAFETENSORS, tensors)
