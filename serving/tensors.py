"""TensorProto <-> numpy, as TF Serving reads requests and writes responses.

A request tensor is checked before it is decoded (`check_tensor`): a dtype a request can carry, a
shape of at most 64 non-negative dimensions, and values that match the shape. Values are read as
TF's Tensor::FromProto reads them (tensorflow/core/framework/tensor.cc, cited by TF Serving's
tensorflow/cc/saved_model/util.cc GetInputValues): tensor_content must hold exactly the shape's
bytes; otherwise the dtype's typed field (float_val, int_val, half_val, ...), where no values fill
the shape with zeros and fewer values repeat the last one. That fill is bounded
(serving/limits.py MAX_FILLED_ELEMENTS), so what a tensor costs stays proportional to what was sent.
More values than the shape holds, and integers out of the dtype's range, are errors here (TF drops
or wraps them). Every failure is InvalidArgument "tensor parsing error: <input> (...)", TF Serving's
wording with the reason added.

Responses use the typed fields, TF Serving's default (AsProtoField), so clients that read
`outputs["y"].float_val` work as they do against tensorflow_model_server. Each array keeps its
dtype: a float16 output goes out as DT_HALF in half_val.
"""

from __future__ import annotations

import functools
import math

import numpy as np
import tensorflow as tf
from tensorflow.core.framework import tensor_pb2, tensor_shape_pb2, types_pb2

from serving.errors import InvalidArgument
from serving.limits import MAX_FILLED_ELEMENTS, MAX_RANK

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
# The dtypes a request may carry, with the numpy dtype each decodes to.
_NUMPY = {
    types_pb2.DT_FLOAT: np.float32, types_pb2.DT_DOUBLE: np.float64, types_pb2.DT_INT32: np.int32,
    types_pb2.DT_INT16: np.int16, types_pb2.DT_INT8: np.int8, types_pb2.DT_UINT8: np.uint8,
    types_pb2.DT_UINT16: np.uint16, types_pb2.DT_INT64: np.int64, types_pb2.DT_UINT32: np.uint32,
    types_pb2.DT_UINT64: np.uint64, types_pb2.DT_BOOL: np.bool_, types_pb2.DT_COMPLEX64: np.complex64,
    types_pb2.DT_COMPLEX128: np.complex128, types_pb2.DT_HALF: np.float16,
    types_pb2.DT_BFLOAT16: tf.bfloat16.as_numpy_dtype, types_pb2.DT_STRING: np.object_,
}


def type_string(dtype: int) -> str:
    """TF's DataTypeString for a DataType value: "float", "double", "half", "string", "int32", ...;
    the number itself for a value TF does not define."""
    try:
        return types_pb2.DataType.Name(dtype)[3:].lower()
    except ValueError:
        return str(dtype)


def check_tensor(proto: tensor_pb2.TensorProto, name: str) -> int:
    """Checks a request tensor without decoding it; returns its element count.

    Raises:
        InvalidArgument: "tensor parsing error: <name> (...)": no or an unusable dtype, an unknown
            rank, more than 64 dimensions, a negative dimension, tensor_content of the wrong length,
            more values than the shape holds, or fewer values filling more than MAX_FILLED_ELEMENTS.
    """
    def error(reason: str) -> InvalidArgument:
        return InvalidArgument(f"tensor parsing error: {name} ({reason})")

    if proto.dtype == types_pb2.DT_INVALID:
        raise error("dtype is not set")
    if proto.dtype not in _NUMPY:
        raise error(f"dtype {type_string(proto.dtype)} cannot be sent in a request")
    if proto.tensor_shape.unknown_rank:
        raise error("tensor_shape has unknown_rank; give its dims")
    shape = [dim.size for dim in proto.tensor_shape.dim]
    if len(shape) > MAX_RANK:
        raise error(f"{len(shape)} dimensions; at most {MAX_RANK} are allowed")
    if any(size < 0 for size in shape):
        raise error(f"shape {shape} has a negative dimension")
    size = math.prod(shape)
    if proto.tensor_content:
        if proto.dtype == types_pb2.DT_STRING:
            raise error("DT_STRING values go in string_val, not tensor_content")
        needed = size * np.dtype(_NUMPY[proto.dtype]).itemsize
        if len(proto.tensor_content) != needed:
            raise error(f"tensor_content has {len(proto.tensor_content)} bytes; shape {shape} of "
                        f"{type_string(proto.dtype)} needs {needed}")
        return size
    sent = _values_sent(proto, error)
    if sent > size:
        raise error(f"{sent} values for shape {shape}, which holds {size}")
    if sent < size and size > MAX_FILLED_ELEMENTS:
        raise error(f"shape {shape} declares {size} elements but {sent} values were sent; a tensor "
                    f"whose values do not fill its shape may have at most {MAX_FILLED_ELEMENTS} elements")
    return size


def _values_sent(proto: tensor_pb2.TensorProto, error) -> int:  # noqa: ANN001 - check_tensor's error builder
    """How many elements the dtype's typed field holds (complex numbers come as real, imaginary pairs)."""
    if proto.dtype == types_pb2.DT_STRING:
        return len(proto.string_val)
    if proto.dtype in _HALF_BITS:
        return len(proto.half_val)
    values = len(getattr(proto, _FIELDS[proto.dtype]))
    if proto.dtype in (types_pb2.DT_COMPLEX64, types_pb2.DT_COMPLEX128):
        if values % 2:
            raise error(f"{_FIELDS[proto.dtype]} has {values} numbers; complex values come as (real, imaginary) pairs")
        return values // 2
    return values


def to_ndarray(proto: tensor_pb2.TensorProto, name: str, size: int | None = None) -> np.ndarray:
    """Decodes one request tensor; a malformed proto is InvalidArgument naming the input.

    size: what check_tensor returned for this proto, if the caller has checked it already.
    The message starts with TF Serving's wording ("tensor parsing error: <name>").
    """
    if size is None:
        size = check_tensor(proto, name)
    dtype = _NUMPY[proto.dtype]
    shape = [dim.size for dim in proto.tensor_shape.dim]
    if proto.tensor_content:
        return np.frombuffer(proto.tensor_content, dtype).reshape(shape)  # read-only, no copy
    try:
        values = _typed_values(proto, dtype)
    except (OverflowError, ValueError, TypeError) as error:  # e.g. 300 in int_val of a DT_UINT8 tensor
        raise InvalidArgument(f"tensor parsing error: {name} ({error})") from None
    if len(values) < size:  # Tensor::FromProto: no values are zeros, fewer repeat the last one
        values = (np.zeros(size, dtype) if not len(values) else
                  np.concatenate([values, np.full(size - len(values), values[-1], dtype)]))
    return values.reshape(shape)


def _typed_values(proto: tensor_pb2.TensorProto, dtype: type) -> np.ndarray:
    """The typed field's values as a new 1-D array of dtype.

    Raises:
        OverflowError: an integer (or half_val bit pattern) outside the dtype's range.
    """
    if proto.dtype == types_pb2.DT_STRING:  # an object array: a fixed-width "S" array would drop trailing NULs
        values = np.empty(len(proto.string_val), object)
        values[:] = list(proto.string_val)
        return values
    field = proto.half_val if proto.dtype in _HALF_BITS else getattr(proto, _FIELDS[proto.dtype])
    raw = np.asarray(field)  # the field's own type (int32 for int_val and half_val), without a Python loop
    if proto.dtype in _HALF_BITS:
        return _in_range(raw, np.uint16).view(dtype)
    if proto.dtype in (types_pb2.DT_COMPLEX64, types_pb2.DT_COMPLEX128):
        return raw.astype(np.float32 if proto.dtype == types_pb2.DT_COMPLEX64 else np.float64).view(dtype)
    if np.issubdtype(dtype, np.integer):
        return _in_range(raw, dtype)
    return raw.astype(dtype)


def _in_range(raw: np.ndarray, dtype: type) -> np.ndarray:
    """raw as dtype; OverflowError naming the first value dtype cannot hold (astype would wrap it)."""
    info = np.iinfo(dtype)
    outside = (raw < info.min) | (raw > info.max)
    if outside.any():
        raise OverflowError(f"value {raw[outside][0]} is out of range for {np.dtype(dtype).name}")
    return raw.astype(dtype)


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
