"""The protocol's tensors: its datatypes (as TF's), and a tensor's values read from and written to the three
forms it travels in: JSON `data`, binary bytes (REST's binary tensor extension, gRPC's raw contents) and
gRPC's typed `contents`.

Every size a client declares is checked against what it actually sent before anything is allocated for it
(a shape against --max_request_elements and against the bytes in the body; each BYTES element's 4-byte length
against what is left of its buffer), so a few bytes can never claim gigabytes. Binary values are the graph's
own bits both ways: FP16 and BF16 reach a client exactly as the model produced them.
"""

from __future__ import annotations

import math
from typing import Any

import numpy as np
from tensorflow.core.framework import types_pb2

from serving import limits
from serving.errors import InvalidArgument, short
from serving.rest import json_codec
from serving.servable import inference
from serving.servable import tensors as tf_tensors

# The protocol's datatypes (BF16 is Triton's extension) as the TF DataTypes they are.
DATATYPES = {
    "BOOL": types_pb2.DT_BOOL, "UINT8": types_pb2.DT_UINT8, "UINT16": types_pb2.DT_UINT16,
    "UINT32": types_pb2.DT_UINT32, "UINT64": types_pb2.DT_UINT64, "INT8": types_pb2.DT_INT8,
    "INT16": types_pb2.DT_INT16, "INT32": types_pb2.DT_INT32, "INT64": types_pb2.DT_INT64,
    "FP16": types_pb2.DT_HALF, "BF16": types_pb2.DT_BFLOAT16, "FP32": types_pb2.DT_FLOAT,
    "FP64": types_pb2.DT_DOUBLE, "BYTES": types_pb2.DT_STRING,
}
_NAMES = {dtype: name for name, dtype in DATATYPES.items()}
# gRPC's typed contents: the field each datatype's values go in (FP16 and BF16 have none: raw contents only).
CONTENTS_FIELDS = {
    "BOOL": "bool_contents", "INT8": "int_contents", "INT16": "int_contents", "INT32": "int_contents",
    "INT64": "int64_contents", "UINT8": "uint_contents", "UINT16": "uint_contents", "UINT32": "uint_contents",
    "UINT64": "uint64_contents", "FP32": "fp32_contents", "FP64": "fp64_contents", "BYTES": "bytes_contents",
}
_LENGTH = np.dtype("<u4")  # a BYTES element's length prefix


def datatype_name(dtype: int) -> str:
    """The protocol's name for a TF DataType; InvalidArgument for one it has no name for (complex, quantized)."""
    try:
        return _NAMES[dtype]
    except KeyError:
        raise InvalidArgument(f"the Open Inference Protocol has no datatype for TensorFlow's "
                              f"{tf_tensors.type_string(dtype)}") from None


def dtype_of(datatype: str, name: str) -> int:
    """The TF DataType of a datatype a client named for input `name`."""
    if not isinstance(datatype, str) or datatype not in DATATYPES:
        raise InvalidArgument(f"input '{short(name)}': unknown datatype {short(repr(datatype))}; "
                              f"expected one of {', '.join(DATATYPES)}")
    return DATATYPES[datatype]


def checked_shape(shape: Any, name: str) -> tuple[int, ...]:
    """A declared shape: a list of at most MAX_RANK non-negative integers."""
    if (not isinstance(shape, (list, tuple)) or len(shape) > limits.MAX_RANK
            or not all(isinstance(size, int) and not isinstance(size, bool) and size >= 0 for size in shape)):
        raise InvalidArgument(f"input '{short(name)}': 'shape' must be a list of at most {limits.MAX_RANK} "
                              f"non-negative integers, got {short(repr(shape))}")
    return tuple(shape)


def check_elements(shapes: dict[str, tuple[int, ...]]) -> None:
    """The request's inputs together declare at most --max_request_elements elements."""
    inference.check_request_size({name: math.prod(shape) for name, shape in shapes.items()},
                                 limits.max_request_elements())


def tensor_proto(array: np.ndarray) -> bytes:
    """An input's values as the serialized TensorProto a PredictRequest holds (in tensor_content)."""
    return tf_tensors.serialize_tensor_proto(array, content=True)


def binary_tensor_proto(name: str, datatype: str, shape: tuple[int, ...], data: memoryview | bytes) -> bytes:
    """tensor_proto(from_binary(...)), numbers' bytes passed through as tensor_content without an array between
    (the layouts are the same); BOOL's (checked 0 or 1) and BYTES' elements are decoded."""
    if datatype in ("BOOL", "BYTES") or datatype not in DATATYPES:
        return tensor_proto(from_binary(name, datatype, shape, data))
    _check_binary_size(name, datatype, shape, len(data))
    return tf_tensors.serialize_content(DATATYPES[datatype], shape, data)


def _check_binary_size(name: str, datatype: str, shape: tuple[int, ...], size: int) -> None:
    itemsize = tf_tensors.numpy_dtype(DATATYPES[datatype]).itemsize
    if size != math.prod(shape) * itemsize:
        raise InvalidArgument(f"input '{short(name)}': shape {list(shape)} of {datatype} takes "
                              f"{math.prod(shape) * itemsize} bytes, but {size} were sent")


def from_binary(name: str, datatype: str, shape: tuple[int, ...], data: memoryview | bytes) -> np.ndarray:
    """An input's values from its bytes: little-endian, row-major; BYTES as elements each prefixed with its
    4-byte little-endian length; BOOL one byte each."""
    count = math.prod(shape)
    if datatype == "BYTES":
        return _bytes_elements(name, count, memoryview(data)).reshape(shape)
    _check_binary_size(name, datatype, shape, len(data))
    dtype = tf_tensors.numpy_dtype(DATATYPES[datatype]).newbyteorder("<")
    if datatype == "BOOL":
        values = np.frombuffer(data, np.uint8)
        if values.size and values.max() > 1:
            raise InvalidArgument(f"input '{short(name)}': a BOOL byte must be 0 or 1")
        return values.astype(np.bool_).reshape(shape)
    return np.frombuffer(data, dtype).reshape(shape)


def _bytes_elements(name: str, count: int, data: memoryview) -> np.ndarray:
    if count * _LENGTH.itemsize > len(data):  # before the loop: each element takes at least its 4-byte length
        raise InvalidArgument(f"input '{short(name)}': {count} BYTES elements need at least {count * 4} bytes, "
                              f"but {len(data)} were sent")
    elements, offset = np.empty(count, dtype=object), 0
    for index in range(count):
        if offset + 4 > len(data):
            raise InvalidArgument(f"input '{short(name)}': BYTES element {index} has no 4-byte length "
                                  f"({len(data) - offset} bytes left)")
        size = int(np.frombuffer(data[offset:offset + 4], _LENGTH)[0])
        offset += 4
        if size > len(data) - offset:
            raise InvalidArgument(f"input '{short(name)}': BYTES element {index} declares {size} bytes, but only "
                                  f"{len(data) - offset} are left")
        elements[index] = bytes(data[offset:offset + size])
        offset += size
    if offset != len(data):
        raise InvalidArgument(f"input '{short(name)}': {len(data) - offset} bytes left over after its "
                              f"{count} BYTES elements")
    return elements


def from_json(name: str, datatype: str, shape: tuple[int, ...], data: Any) -> np.ndarray:
    """An input's values from JSON `data`, flat or nested, row-major: numbers, true/false, or strings for BYTES
    (checked as TF Serving's REST API checks its JSON, serving/rest/json_codec.py)."""
    if not isinstance(data, list):
        raise InvalidArgument(f"input '{short(name)}': 'data' must be a list of values, got "
                              f"{short(type(data).__name__)}")
    array = json_codec.to_array(data, DATATYPES[datatype], name)
    if array.size != math.prod(shape):
        raise InvalidArgument(f"input '{short(name)}': shape {list(shape)} holds {math.prod(shape)} elements, but "
                              f"'data' has {array.size}")
    return array.reshape(shape)


def from_contents(name: str, datatype: str, shape: tuple[int, ...], contents: Any) -> np.ndarray:
    """An input's values from gRPC's typed InferTensorContents."""
    field = CONTENTS_FIELDS.get(datatype)
    if field is None:
        raise InvalidArgument(f"input '{short(name)}': {datatype} has no typed contents; send it in "
                              "raw_input_contents")
    values = getattr(contents, field)
    if len(values) != math.prod(shape):
        raise InvalidArgument(f"input '{short(name)}': shape {list(shape)} holds {math.prod(shape)} elements, but "
                              f"contents.{field} has {len(values)}")
    if datatype == "BYTES":
        array = np.empty(len(values), dtype=object)
        array[:] = list(values)
        return array.reshape(shape)
    target = tf_tensors.numpy_dtype(DATATYPES[datatype])
    wide = np.asarray(values)
    if target.kind in "iu" and wide.size:
        info = np.iinfo(target)
        if wide.min() < info.min or wide.max() > info.max:
            raise InvalidArgument(f"input '{short(name)}': a value is out of {datatype}'s range "
                                  f"[{info.min}, {info.max}]")
    return wide.astype(target).reshape(shape)


def to_binary(array: np.ndarray) -> bytes:
    """An output's bytes, as from_binary reads them."""
    if array.dtype.kind in "OSU":
        parts = []
        for item in array.ravel().tolist():
            item = item.encode() if isinstance(item, str) else bytes(item)
            parts += [np.uint32(len(item)).astype(_LENGTH).tobytes(), item]
        return b"".join(parts)
    if array.dtype == np.bool_:
        return array.astype(np.uint8).tobytes()
    return np.ascontiguousarray(array, array.dtype.newbyteorder("<")).tobytes()


def to_json(array: np.ndarray, name: str) -> list:
    """An output's values as flat JSON: FP16/BF16 as the float32 numbers they are exactly (a client that casts
    them back gets the same bits), BYTES as UTF-8 text (other bytes only travel binary)."""
    flat = array.ravel()
    if flat.dtype.kind in "OSU":
        try:
            return [item.decode("utf-8") if isinstance(item, bytes) else item for item in flat.tolist()]
        except UnicodeDecodeError:
            raise InvalidArgument(f"output '{short(name)}' holds bytes that are not UTF-8, which JSON cannot carry; "
                                  'request it as binary ("parameters": {"binary_data": true})') from None
    if flat.dtype.kind == "f" or flat.dtype == tf_tensors.numpy_dtype(types_pb2.DT_BFLOAT16):
        flat = flat.astype(np.float64) if flat.dtype == np.float64 else flat.astype(np.float32)
    return flat.tolist()
