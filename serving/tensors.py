"""TensorProto <-> numpy, as TF Serving reads requests and writes responses.

Requests are decoded with tf.make_ndarray, which reads tensor_content and the typed *_val fields
alike (clients use both). Responses use the typed fields, TF Serving's default (AsProtoField), so
clients that read `outputs["y"].float_val` work as they do against tensorflow_model_server.
Each array keeps its dtype: a float16 output goes out as DT_HALF in half_val.
"""

from __future__ import annotations

import functools
import math

import numpy as np
import tensorflow as tf
from tensorflow.core.framework import tensor_pb2, tensor_shape_pb2, types_pb2

from serving.errors import InvalidArgument

# dtype -> the TensorProto field TF's Tensor::AsProtoField fills for it.
_FIELDS = {
    types_pb2.DT_FLOAT: "float_val",
    types_pb2.DT_DOUBLE: "double_val",
    types_pb2.DT_INT32: "int_val",
    types_pb2.DT_INT16: "int_val",
    types_pb2.DT_INT8: "int_val",
    types_pb2.DT_UINT8: "int_val",
    types_pb2.DT_UINT16: "int_val",
    types_pb2.DT_INT64: "int64_val",
    types_pb2.DT_UINT32: "uint32_val",
    types_pb2.DT_UINT64: "uint64_val",
    types_pb2.DT_BOOL: "bool_val",
    types_pb2.DT_COMPLEX64: "scomplex_val",
    types_pb2.DT_COMPLEX128: "dcomplex_val",
}
_HALF_BITS = (types_pb2.DT_HALF, types_pb2.DT_BFLOAT16)  # sent as their 16-bit patterns in half_val
# Request dtypes decoded without tf.make_ndarray when the proto is well-formed (the common case: a
# client's tensor_content or typed field of exactly the tensor's size): ~15 us less per input.
_FAST_DECODE = {types_pb2.DT_FLOAT: (np.float32, "float_val"), types_pb2.DT_DOUBLE: (np.float64, "double_val"),
                types_pb2.DT_INT32: (np.int32, "int_val"), types_pb2.DT_INT64: (np.int64, "int64_val")}


def to_ndarray(proto: tensor_pb2.TensorProto, name: str) -> np.ndarray:
    """Decodes one request tensor; a malformed proto is InvalidArgument naming the input.

    The message starts with TF Serving's wording ("tensor parsing error: <name>").
    """
    if proto.dtype == types_pb2.DT_INVALID:
        raise InvalidArgument(f"tensor parsing error: {name} (dtype is not set)")
    if proto.tensor_shape.unknown_rank:
        raise InvalidArgument(f"tensor parsing error: {name} (tensor_shape has unknown_rank; give its dims)")
    fast = _decode_fast(proto)
    if fast is not None:
        return fast
    try:
        return tf.make_ndarray(proto)
    except (ValueError, TypeError) as error:
        raise InvalidArgument(f"tensor parsing error: {name} ({error})") from None


def _decode_fast(proto: tensor_pb2.TensorProto) -> np.ndarray | None:
    """The array for a plain float/int proto whose values fill its shape exactly; None for anything
    else (other dtypes, broadcast or malformed values), which tf.make_ndarray decodes or rejects."""
    known = _FAST_DECODE.get(proto.dtype)
    if known is None:
        return None
    shape = [dim.size for dim in proto.tensor_shape.dim]
    if any(size < 0 for size in shape):
        return None
    numpy_dtype, field = known
    size = math.prod(shape)
    if proto.tensor_content:
        if len(proto.tensor_content) != size * np.dtype(numpy_dtype).itemsize:
            return None
        return np.frombuffer(proto.tensor_content, numpy_dtype).reshape(shape)  # read-only, no copy
    values = getattr(proto, field)
    if len(values) != size:
        return None
    return np.array(values, numpy_dtype).reshape(shape)


@functools.lru_cache(maxsize=None)
def _datatype_enum(dtype: np.dtype) -> int:
    return tf.as_dtype(dtype).as_datatype_enum


def _shape_proto(shape: tuple[int, ...]) -> tensor_shape_pb2.TensorShapeProto:
    """What tf.TensorShape(shape).as_proto() gives, without its Python overhead (~10 us a response tensor)."""
    return tensor_shape_pb2.TensorShapeProto(dim=[tensor_shape_pb2.TensorShapeProto.Dim(size=size) for size in shape])


def to_tensor_proto(array: np.ndarray) -> tensor_pb2.TensorProto:
    """Encodes a response array in its own dtype, in the typed field TF Serving uses."""
    array = np.asarray(array)
    dtype = _datatype_enum(array.dtype)
    proto = tensor_pb2.TensorProto(dtype=dtype, tensor_shape=_shape_proto(array.shape))
    flat = array.ravel()
    if dtype in _HALF_BITS:
        proto.half_val.extend(flat.view(np.uint16).astype(np.int32).tolist())
    elif dtype == types_pb2.DT_STRING:
        proto.string_val.extend(v.encode() if isinstance(v, str) else bytes(v) for v in flat.tolist())
    elif dtype in (types_pb2.DT_COMPLEX64, types_pb2.DT_COMPLEX128):
        getattr(proto, _FIELDS[dtype]).extend(flat.view(flat.real.dtype).tolist())
    elif dtype in _FIELDS:
        getattr(proto, _FIELDS[dtype]).extend(flat.tolist())
    else:
        return tf.make_tensor_proto(array)
    return proto
