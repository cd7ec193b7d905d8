"""The safetensors file format, read and written with numpy and ml_dtypes (docs/pretrained.md#the-file): a checkpoint
from a stranger is checked whole before a tensor is read, and memory stays bounded by the file's size.

    8 bytes: N, little-endian u64 · N bytes: a JSON object {name: {dtype, shape, data_offsets: [begin, end]},
    "__metadata__": {str: str}} · the tensors' bytes, offsets relative to where the header ends.

The rules are upstream's (huggingface/safetensors, safetensors/src/tensor.rs): a header of at most 100,000,000 bytes,
the tensors' byte ranges contiguous from 0 to the end of the file, each exactly its shape's elements times its dtype's
size. The `safetensors` package's numpy reader refuses bfloat16, which GPT-2-family checkpoints are often saved in,
hence a reader of our own; its errors name the file and the tensor.
"""

from __future__ import annotations

import json
import math
import os
import struct
from pathlib import Path

import ml_dtypes
import numpy as np

from pipeline.errors import CheckpointError

MAX_HEADER_BYTES = 100_000_000  # upstream's MAX_HEADER_SIZE
DTYPES = {"F64": np.dtype("<f8"), "F32": np.dtype("<f4"), "F16": np.dtype("<f2"),
          "BF16": np.dtype(ml_dtypes.bfloat16), "I64": np.dtype("<i8"), "I32": np.dtype("<i4"),
          "I16": np.dtype("<i2"), "I8": np.dtype("i1"), "U8": np.dtype("u1"), "BOOL": np.dtype("?")}
NAMES = {dtype: name for name, dtype in DTYPES.items()}


class TensorFile:
    """A safetensors file's checked header: names(), shape(name), dtype(name), and read(name) → a numpy array of
    that one tensor (read from disk when asked, so a caller can check shapes before it reads a byte of data)."""

    def __init__(self, path: str | Path):
        self.path = Path(path)
        try:
            size = os.path.getsize(self.path)
            with open(self.path, "rb") as f:
                self._entries, self.metadata, self._data_start = _read_header(f, size, self.path)
        except OSError as e:
            raise CheckpointError(f"{self.path}: cannot read it ({e.strerror or e})") from None

    def names(self) -> list[str]:
        return list(self._entries)

    def shape(self, name: str) -> tuple[int, ...]:
        return self._entries[name][1]

    def dtype(self, name: str) -> np.dtype:
        return self._entries[name][0]

    def read(self, name: str) -> np.ndarray:
        dtype, shape, begin, end = self._entries[name]
        with open(self.path, "rb") as f:
            f.seek(self._data_start + begin)
            data = f.read(end - begin)
        if len(data) != end - begin:
            raise CheckpointError(f"{self.path}: tensor {name!r} ends past the end of the file "
                                  "(it changed while read?)")
        return np.frombuffer(data, dtype=dtype).reshape(shape)


def _read_header(f, size: int, path: Path):
    """(entries {name: (dtype, shape, begin, end)}, metadata, where the data starts), every rule checked."""
    prefix = f.read(8)
    if len(prefix) < 8:
        raise CheckpointError(f"{path}: not a safetensors file ({size} bytes; it starts with an 8-byte header length)")
    (length,) = struct.unpack("<Q", prefix)
    if length > MAX_HEADER_BYTES:
        raise CheckpointError(f"{path}: its header declares {length:,} bytes; a safetensors header is at most "
                         f"{MAX_HEADER_BYTES:,}")
    if length > size - 8:
        raise CheckpointError(f"{path}: its header declares {length:,} bytes, but the file has {size - 8:,} after the "
                         "length (truncated, or not a safetensors file)")
    try:
        header = json.loads(f.read(length).decode("utf-8"))
    except (UnicodeDecodeError, json.JSONDecodeError) as e:
        raise CheckpointError(f"{path}: its header is not JSON ({e})") from None
    except RecursionError:
        raise CheckpointError(f"{path}: its header nests JSON too deeply to be a table of tensors") from None
    if not isinstance(header, dict):
        raise CheckpointError(f"{path}: its header is a JSON {type(header).__name__}, not an object of tensors")
    metadata = header.pop("__metadata__", None) or {}
    if not isinstance(metadata, dict) or not all(isinstance(v, str) for v in metadata.values()):
        raise CheckpointError(f"{path}: __metadata__ must map strings to strings")
    entries = {name: _entry(name, spec, path) for name, spec in header.items()}
    _check_contiguous(entries, size - 8 - length, path)
    return entries, metadata, 8 + length


def _entry(name: str, spec, path: Path):
    if not isinstance(spec, dict) or set(spec) - {"dtype", "shape", "data_offsets"} or len(spec) != 3:
        raise CheckpointError(f"{path}: tensor {name!r} must have exactly dtype, shape and data_offsets")
    if spec["dtype"] not in DTYPES:
        raise CheckpointError(f"{path}: tensor {name!r} has dtype {spec['dtype']!r}; this reader knows "
                         f"{', '.join(DTYPES)}")
    shape, offsets = spec["shape"], spec["data_offsets"]
    if not isinstance(shape, list) or not all(type(n) is int and n >= 0 for n in shape):
        raise CheckpointError(f"{path}: tensor {name!r} has shape {shape!r}; a shape is a list of non-negative "
                              "integers")
    if (not isinstance(offsets, list) or len(offsets) != 2 or not all(type(n) is int and n >= 0 for n in offsets)
            or offsets[0] > offsets[1]):
        raise CheckpointError(f"{path}: tensor {name!r} has data_offsets {offsets!r}; they are [begin, end], "
                         "0 <= begin <= end")
    dtype = DTYPES[spec["dtype"]]
    if math.prod(shape) * dtype.itemsize != offsets[1] - offsets[0]:
        raise CheckpointError(f"{path}: tensor {name!r} is {spec['dtype']} {shape}, "
                              f"{math.prod(shape) * dtype.itemsize:,} bytes, but its data_offsets span "
                              f"{offsets[1] - offsets[0]:,}")
    return dtype, tuple(shape), offsets[0], offsets[1]


def _check_contiguous(entries: dict, data_bytes: int, path: Path) -> None:
    """The byte ranges tile the data exactly, as upstream requires: no gap, no overlap, nothing past the end."""
    position, previous = 0, None
    for name, (_, _, begin, end) in sorted(entries.items(), key=lambda item: (item[1][2], item[1][3])):
        if begin != position:
            where = f"after tensor {previous!r}" if previous else "at the start of the data"
            raise CheckpointError(f"{path}: tensor {name!r} begins at byte {begin:,} of the data, {where} it should "
                                  f"begin at {position:,} (tensors overlap or leave a gap)")
        position, previous = end, name
    if position != data_bytes:
        raise CheckpointError(f"{path}: the tensors end at byte {position:,} of the data, but the file holds "
                         f"{data_bytes:,} (truncated, or bytes that belong to no tensor)")


def write(path: str | Path, tensors: dict[str, np.ndarray], metadata: dict[str, str] | None = None) -> None:
    """Writes tensors (numpy arrays of DTYPES' dtypes) as one safetensors file, atomically: a temporary file renamed
    into place, so a reader never sees half of one."""
    path = Path(path)
    header, position, arrays = {}, 0, []
    for name, array in tensors.items():
        array = np.ascontiguousarray(array)
        dtype = array.dtype.newbyteorder("<") if array.dtype.byteorder == ">" else array.dtype
        if dtype not in NAMES:
            raise CheckpointError(f"safetensors: tensor {name!r} has dtype {array.dtype}; writable: "
                                  f"{', '.join(DTYPES)}")
        array = array.astype(dtype, copy=False)
        header[name] = {"dtype": NAMES[dtype], "shape": list(array.shape),
                        "data_offsets": [position, position + array.nbytes]}
        position += array.nbytes
        arrays.append(array)
    if metadata:
        header["__metadata__"] = dict(metadata)
    encoded = json.dumps(header, separators=(",", ":")).encode("utf-8")
    encoded += b" " * (-len(encoded) % 8)  # upstream pads the header to 8 bytes with spaces
    partial = path.with_name(path.name + ".partial")
    with open(partial, "wb") as f:
        f.write(struct.pack("<Q", len(encoded)) + encoded)
        for array in arrays:
            f.write(array.tobytes())
    os.replace(partial, path)
