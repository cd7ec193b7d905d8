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
dtype: a float16 output goes out as DT_HALF in half_val. `to_tensor_proto(array, content=True)` writes
tensor_content instead (the array's bytes, little-endian, C order), as tf.make_tensor_proto does;
strings always go in string_val.

No request runs TensorFlow here: dtypes are looked up in tables built at import. tensor_content is
read with np.frombuffer over the bytes protobuf hands out (its Python API copies a bytes field once per
read and has no view of it; the array is read-only), a typed field with one numpy conversion. Fixed-width
values (float_val, double_val, the complex fields, tensor_content) are written as the bytes of their
packed wire encoding for protobuf to parse, so neither direction has a Python loop over the values;
varint fields (int_val, int64_val, half_val, bool_val, ...) take the same route when every value fits
in one byte, else protobuf's own extend.
"""

from __future__ import annotations

import functools
import math
import sys

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
# The numpy type of each field's values (np.asarray(field).dtype).
_FIELD_DTYPES = {"float_val": np.float32, "double_val": np.float64, "int_val": np.int32, "int64_val": np.int64,
                 "uint32_val": np.uint32, "uint64_val": np.uint64, "bool_val": np.bool_, "scomplex_val": np.float32,
                 "dcomplex_val": np.float64, "half_val": np.int32}
_ITERATE_BELOW = 64  # values: np.fromiter reads fewer quicker than np.asarray


def _dtype_tables() -> tuple[dict[int, np.dtype], dict[np.dtype, int]]:
    """DataType -> numpy dtype and back, for every DataType TF has a numpy dtype for: tf.as_dtype's
    answers, asked once at import so that no request asks TensorFlow."""
    to_numpy, to_datatype = {}, {}
    for dtype in types_pb2.DataType.values():
        try:
            to_numpy[dtype] = np.dtype(tf.as_dtype(dtype).as_numpy_dtype)  # ref types too (DT_FLOAT_REF: float32)
        except (TypeError, KeyError):  # DT_INVALID, DT_RESOURCE and DT_VARIANT have none
            continue
        to_datatype[to_numpy[dtype]] = tf.as_dtype(to_numpy[dtype]).as_datatype_enum  # object: DT_STRING
    return to_numpy, to_datatype


_NUMPY_DTYPES, _DATATYPES = _dtype_tables()
# The dtypes a request may carry, with the numpy dtype each decodes to.
_NUMPY = {dtype: _NUMPY_DTYPES[dtype] for dtype in (
    types_pb2.DT_FLOAT, types_pb2.DT_DOUBLE, types_pb2.DT_INT32, types_pb2.DT_INT16, types_pb2.DT_INT8,
    types_pb2.DT_UINT8, types_pb2.DT_UINT16, types_pb2.DT_INT64, types_pb2.DT_UINT32, types_pb2.DT_UINT64,
    types_pb2.DT_BOOL, types_pb2.DT_COMPLEX64, types_pb2.DT_COMPLEX128, types_pb2.DT_HALF, types_pb2.DT_BFLOAT16,
    types_pb2.DT_STRING)}
_ITEMSIZE = {dtype: np.dtype(numpy_dtype).itemsize for dtype, numpy_dtype in _NUMPY.items()}
_INTEGERS = {dtype for dtype, numpy_dtype in _NUMPY.items() if np.issubdtype(numpy_dtype, np.integer)}
_COMPLEX = (types_pb2.DT_COMPLEX64, types_pb2.DT_COMPLEX128)
# numpy refuses a shape whose non-zero dims make more than this many bytes ("array is too big"), even when
# another dim is 0: such a shape is the client's mistake, refused like any other.
_MAX_ARRAY_BYTES = np.iinfo(np.intp).max


def numpy_dtype(dtype: int) -> np.dtype:
    """np.dtype(tf.as_dtype(dtype).as_numpy_dtype), looked up; for a DataType without one, TF's own error."""
    try:
        return _NUMPY_DTYPES[dtype]
    except KeyError:
        return np.dtype(tf.as_dtype(dtype).as_numpy_dtype)


def datatype(array: np.ndarray) -> int | str:
    """The DataType TensorFlow feeds an array as, from the table (no TensorFlow call); "object" for an object
    array that is not all text, and numpy's name for a dtype TensorFlow has no DataType for."""
    if array.dtype.kind == "O":
        return types_pb2.DT_STRING if all(isinstance(item, (bytes, str)) for item in array.flat) else "object"
    try:
        return _datatype_enum(array.dtype)
    except TypeError:
        return array.dtype.name


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
    rank = len(proto.tensor_shape.dim)  # before the dims are read: a request may send 80,000 of them
    if rank > MAX_RANK:
        raise error(f"{rank} dimensions; at most {MAX_RANK} are allowed")
    shape = [dim.size for dim in proto.tensor_shape.dim]
    if any(size < 0 for size in shape):
        raise error(f"shape {shape} has a negative dimension")
    if math.prod(max(size, 1) for size in shape) * _ITEMSIZE[proto.dtype] > _MAX_ARRAY_BYTES:
        raise error(f"shape {shape} is too large for any array, even with no elements")
    size = math.prod(shape)
    content = len(proto.tensor_content)  # each read of the field is a copy of its bytes: read it once
    if content:
        if proto.dtype == types_pb2.DT_STRING:
            raise error("DT_STRING values go in string_val, not tensor_content")
        needed = size * _ITEMSIZE[proto.dtype]
        if content != needed:
            raise error(f"tensor_content has {content} bytes; shape {shape} of "
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
    if proto.dtype in _COMPLEX:
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
    content = proto.tensor_content  # protobuf's copy of the bytes, read once
    if content:
        return np.frombuffer(content, dtype).reshape(shape)  # read-only, no further copy
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
    name = "half_val" if proto.dtype in _HALF_BITS else _FIELDS[proto.dtype]
    field = getattr(proto, name)
    # A new array of the field's own type (float32 for float_val, int32 for int_val and half_val), without a
    # Python loop: np.asarray has protobuf fill it in C, in a fixed ~2 us that a short field reads quicker
    # one by one. The dtype is always given: protobuf 7 hands out float_val as float32, protobuf 6 as
    # float64 (and uint64 above 2**53 inexactly). astype(copy=False) then copies only where the types
    # differ (int_val of a DT_UINT8 tensor).
    field_dtype = _FIELD_DTYPES[name]
    raw = (np.fromiter(field, field_dtype, len(field)) if len(field) < _ITERATE_BELOW
           else np.asarray(field, dtype=field_dtype))
    if proto.dtype in _HALF_BITS:
        return _in_range(raw, np.uint16).view(dtype)
    if proto.dtype in _COMPLEX:  # scomplex_val and dcomplex_val are already float32 and float64
        return raw.view(dtype)
    if proto.dtype in _INTEGERS:
        return _in_range(raw, dtype)
    return raw.astype(dtype, copy=False)


def _in_range(raw: np.ndarray, dtype: type) -> np.ndarray:
    """raw as dtype; OverflowError naming the first value dtype cannot hold (astype would wrap it)."""
    if raw.dtype == dtype:  # int_val of DT_INT32, int64_val, uint32_val, uint64_val: nothing to check
        return raw
    info = np.iinfo(dtype)
    outside = (raw < info.min) | (raw > info.max)
    if outside.any():
        raise OverflowError(f"value {raw[outside][0]} is out of range for {np.dtype(dtype).name}")
    return raw.astype(dtype)


# TensorProto's field numbers (tensorflow/core/framework/tensor.proto), as the tags that start their
# length-delimited (packed) encodings: (field number << 3) | 2, as a varint.
_TENSOR_CONTENT = b"\x22"  # 4
_TAGS = {"float_val": b"\x2a", "double_val": b"\x32", "int_val": b"\x3a", "scomplex_val": b"\x4a",
         "int64_val": b"\x52", "bool_val": b"\x5a", "dcomplex_val": b"\x62", "half_val": b"\x6a",
         "uint32_val": b"\x82\x01", "uint64_val": b"\x8a\x01", "float8_val": b"\x92\x01"}
# Their encodings are the array's bytes (float8_val is one bytes value, one byte an element).
_FIXED_WIDTH = ("float_val", "double_val", "scomplex_val", "dcomplex_val", "float8_val")
# Arrays of at least this many elements whose values all fit in one varint byte are written as bytes; below
# it, protobuf's extend(tolist()) is as quick as the numpy checks.
_ONE_BYTE_VARINTS_FROM = 256
# Dtypes TF Serving's fields above leave out, encoded as tf.make_tensor_proto encoded them: the 4- and 2-bit
# integers in int_val; 8- and 4-bit floats and quantized integers in tensor_content, their bytes, but in
# float8_val and int_val when there is at most one element.
_SMALL_INTS = {types_pb2.DT_INT4, types_pb2.DT_UINT4, types_pb2.DT_INT2, types_pb2.DT_UINT2}
_FLOAT8 = {types_pb2.DT_FLOAT8_E5M2, types_pb2.DT_FLOAT8_E4M3FN, types_pb2.DT_FLOAT8_E4M3FNUZ,
           types_pb2.DT_FLOAT8_E4M3B11FNUZ, types_pb2.DT_FLOAT8_E5M2FNUZ, types_pb2.DT_FLOAT4_E2M1FN}
_QUANTIZED = {types_pb2.DT_QINT8, types_pb2.DT_QUINT8, types_pb2.DT_QINT16, types_pb2.DT_QUINT16, types_pb2.DT_QINT32}
_LITTLE_ENDIAN = sys.byteorder == "little"


def _datatype_enum(dtype: np.dtype) -> int:
    """The DataType of a numpy dtype, as tf.as_dtype gives it."""
    try:
        return _DATATYPES[dtype]
    except KeyError:
        pass
    if dtype.kind in "SU":  # bytes and str of any width
        return types_pb2.DT_STRING
    return _other_datatype_enum(dtype)


@functools.lru_cache(maxsize=None)
def _other_datatype_enum(dtype: np.dtype) -> int:
    """tf.as_dtype for a dtype the table lacks: with TF 2.21, a TypeError (a dtype TF has no DataType for)."""
    return tf.as_dtype(dtype).as_datatype_enum


def _varint(value: int) -> bytes:
    out = bytearray()
    while value > 0x7F:
        out.append(value & 0x7F | 0x80)
        value >>= 7
    out.append(value)
    return bytes(out)


@functools.lru_cache(maxsize=4096)
def _head(dtype: int, shape: tuple[int, ...]) -> bytes:
    """A serialized TensorProto with dtype and tensor_shape and no values: what every encoding starts with."""
    return tensor_pb2.TensorProto(dtype=dtype, tensor_shape=_shape_proto(shape)).SerializeToString()


def _shape_proto(shape: tuple[int, ...]) -> tensor_shape_pb2.TensorShapeProto:
    """What tf.TensorShape(shape).as_proto() gives, without its Python overhead (~10 us a response tensor)."""
    return tensor_shape_pb2.TensorShapeProto(dim=[tensor_shape_pb2.TensorShapeProto.Dim(size=size) for size in shape])


def to_tensor_proto(array: np.ndarray, content: bool = False) -> tensor_pb2.TensorProto:
    """Encodes a response array in its own dtype, in the typed field TF Serving uses.

    content: write the values as tensor_content (the array's bytes, little-endian, C order) instead, as
        tf.make_tensor_proto does; cheaper for large tensors, for clients that decode tensor_content
        (tf.make_ndarray, tensors.to_ndarray). DT_STRING values go in string_val either way, as TF
        never puts strings in tensor_content, and so do the 4- and 2-bit integers (int_val).
    """
    encoded = _encode(array, content)
    return encoded if isinstance(encoded, tensor_pb2.TensorProto) else tensor_pb2.TensorProto.FromString(encoded)


def serialize_tensor_proto(array: np.ndarray, content: bool = False) -> bytes:
    """to_tensor_proto(array, content).SerializeToString(), usually without building the message.

    To fill a field of a larger message, `message.inputs[name].ParseFromString(serialize_tensor_proto(array))`
    is cheaper than CopyFrom(to_tensor_proto(array)): protobuf copies a message's repeated float_val
    value by value, but parses packed bytes with a memcpy.
    """
    encoded = _encode(array, content)
    return encoded if isinstance(encoded, bytes) else encoded.SerializeToString()


def serialize_content(dtype: int, shape: tuple[int, ...], content: bytes | memoryview) -> bytes:
    """The serialized TensorProto of values already in tensor_content's layout (little-endian, C order; the
    caller has checked their length against the shape): the bytes as they came, not decoded and encoded again."""
    head = _head(dtype, shape)
    return head + _TENSOR_CONTENT + _varint(len(content)) + content if len(content) else head


def _encode(array: np.ndarray, content: bool) -> tensor_pb2.TensorProto | bytes:
    """The TensorProto of an array, as a message or (for most dtypes) its serialization."""
    array = np.asarray(array)
    if not array.dtype.isnative or not _LITTLE_ENDIAN:  # TensorProtos hold little-endian values
        array = array.astype(array.dtype.newbyteorder("<"))
    dtype = _datatype_enum(array.dtype)
    if dtype == types_pb2.DT_STRING:
        proto = tensor_pb2.TensorProto(dtype=dtype, tensor_shape=_shape_proto(array.shape))
        proto.string_val.extend(v.encode() if isinstance(v, str) else bytes(v) for v in array.ravel().tolist())
        return proto
    if dtype in _SMALL_INTS:
        array, field = array.astype(np.int32), "int_val"
    elif content or (array.size > 1 and (dtype in _FLOAT8 or dtype in _QUANTIZED)):
        field = None
    elif dtype in _FLOAT8:
        field = "float8_val"
    elif dtype in _QUANTIZED:  # a structured dtype with one integer field
        array, field = array.view(array.dtype[0]), "int_val"
    elif dtype in _HALF_BITS:
        array, field = array.view(np.uint16), "half_val"
    elif dtype in _FIELDS:
        field = _FIELDS[dtype]
    else:  # a dtype this module does not know (none of TF 2.21's, so a later TF's): TensorFlow's encoding
        return tf.make_tensor_proto(array)
    head = _head(dtype, array.shape)
    if not array.size:
        return head
    if field is None or field in _FIXED_WIDTH:
        values = array.tobytes()  # C order, whatever the array's strides
    elif array.size >= _ONE_BYTE_VARINTS_FROM and array.dtype.kind in "biu" and 0 <= array.min() and array.max() < 0x80:
        values = array.astype(np.uint8).tobytes()  # each value its own one-byte varint (a bool is 0 or 1)
    else:
        proto = tensor_pb2.TensorProto.FromString(head)
        getattr(proto, field).extend(array.ravel().tolist())
        return proto
    return head + (_TAGS[field] if field else _TENSOR_CONTENT) + _varint(len(values)) + values
