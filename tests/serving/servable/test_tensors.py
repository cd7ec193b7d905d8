"""TensorProto <-> numpy: requests decode from either encoding, responses keep their dtype in TF Serving's fields."""

from __future__ import annotations

import math

import ml_dtypes
import numpy as np
import pytest
import tensorflow as tf
from tensorflow.core.framework import tensor_pb2, types_pb2

from serving.servable import tensors
from serving.errors import InvalidArgument


@pytest.mark.parametrize("array, dtype, field", [
    (np.array([[1.5, -2.0], [3.25, 4.0]], np.float32), types_pb2.DT_FLOAT, "float_val"),
    (np.array([0.5, 65504.0, -1e-3], np.float16), types_pb2.DT_HALF, "half_val"),
    (np.array([1.0, -2.5], ml_dtypes.bfloat16), types_pb2.DT_BFLOAT16, "half_val"),
    (np.array([1e-300, 2.0]), types_pb2.DT_DOUBLE, "double_val"),
    (np.array([[1, -2, 3]], np.int32), types_pb2.DT_INT32, "int_val"),
    (np.array([2**40], np.int64), types_pb2.DT_INT64, "int64_val"),
    (np.array([200], np.uint8), types_pb2.DT_UINT8, "int_val"),
    (np.array([True, False]), types_pb2.DT_BOOL, "bool_val"),
    (np.array([b"cat", b"dog"], object), types_pb2.DT_STRING, "string_val"),
    (np.array([1 + 2j], np.complex64), types_pb2.DT_COMPLEX64, "scomplex_val"),
    (np.zeros((0, 3), np.float32), types_pb2.DT_FLOAT, "float_val"),
])
def test_round_trip_keeps_dtype_shape_and_values(array, dtype, field):
    proto = tensors.to_tensor_proto(array)
    assert proto.dtype == dtype
    assert [d.size for d in proto.tensor_shape.dim] == list(array.shape)
    assert len(getattr(proto, field)) == array.size * (2 if array.dtype.kind == "c" else 1)
    assert not proto.tensor_content
    decoded = tensors.to_ndarray(proto, "x")
    assert decoded.dtype == array.dtype and decoded.shape == array.shape
    np.testing.assert_array_equal(decoded, array)


def test_decodes_tensor_content_as_sent_by_make_tensor_proto():
    for array in (np.arange(6, dtype=np.float32).reshape(2, 3), np.array([0.1, 0.2], np.float16)):
        proto = tf.make_tensor_proto(array)
        assert proto.tensor_content
        decoded = tensors.to_ndarray(proto, "x")
        assert decoded.dtype == array.dtype
        np.testing.assert_array_equal(decoded, array)


def test_decodes_hand_built_half_val():
    proto = tensor_pb2.TensorProto(dtype=types_pb2.DT_HALF, tensor_shape={"dim": [{"size": 2}]},
                                   half_val=[0x3C00, 0x4000])  # float16 bit patterns of 1.0 and 2.0
    decoded = tensors.to_ndarray(proto, "x")
    assert decoded.dtype == np.float16
    np.testing.assert_array_equal(decoded, [1.0, 2.0])


@pytest.mark.parametrize("proto, reason", [
    (tensor_pb2.TensorProto(tensor_shape={"dim": [{"size": 1}]}, float_val=[1.0]), "dtype is not set"),
    (tensor_pb2.TensorProto(dtype=types_pb2.DT_FLOAT, tensor_shape={"unknown_rank": True}, float_val=[1.0]), "unknown_rank"),
    (tensor_pb2.TensorProto(dtype=types_pb2.DT_FLOAT, tensor_shape={"dim": [{"size": 2}]}, float_val=[1, 2, 3]), ""),
    (tensor_pb2.TensorProto(dtype=types_pb2.DT_FLOAT, tensor_shape={"dim": [{"size": 2}]}, tensor_content=b"abc"), ""),
    (tensor_pb2.TensorProto(dtype=types_pb2.DT_FLOAT, tensor_shape={"dim": [{"size": -3}]}), ""),
])
def test_malformed_protos_are_invalid_argument_naming_the_input(proto, reason):
    with pytest.raises(InvalidArgument, match=rf"^tensor parsing error: features.*{reason}"):
        tensors.to_ndarray(proto, "features")


def proto(dtype=types_pb2.DT_FLOAT, shape=(2,), **values) -> tensor_pb2.TensorProto:
    return tensor_pb2.TensorProto(dtype=dtype, tensor_shape={"dim": [{"size": size} for size in shape]}, **values)


@pytest.mark.parametrize("bad, reason", [
    (proto(shape=[1] * 65, float_val=[1.0]), r"65 dimensions; at most 64 are allowed"),
    (proto(shape=(2, -1)), r"shape \[2, -1\] has a negative dimension"),
    (proto(dtype=types_pb2.DT_RESOURCE), r"dtype resource cannot be sent in a request"),
    (proto(dtype=types_pb2.DT_FLOAT_REF), r"dtype float_ref cannot be sent in a request"),
    (proto(dtype=999), r"dtype 999 cannot be sent in a request"),
    (proto(dtype=types_pb2.DT_STRING, tensor_content=b"ab"), r"DT_STRING values go in string_val"),
    (proto(dtype=types_pb2.DT_COMPLEX64, scomplex_val=[1.0, 2.0, 3.0]),
     r"complex values come as \(real, imaginary\) pairs"),
    (proto(shape=(1 << 40,)), r"shape \[1099511627776\] declares 1099511627776 elements but 0 values were sent"),
    (proto(shape=(65537,), float_val=[1.0]), r"at most 65536 elements"),
    (proto(shape=(2**62, 2**62, 2**62), tensor_content=b"\0" * 4), r"is too large for any array"),
    (proto(shape=(2**63 - 1, 0)), r"shape \[9223372036854775807, 0\] is too large for any array, even with no elements"),
])
def test_check_tensor_refuses_what_cannot_be_decoded_safely(bad, reason):
    with pytest.raises(InvalidArgument, match=rf"^tensor parsing error: x \(.*{reason}"):
        tensors.check_tensor(bad, "x")
    with pytest.raises(InvalidArgument, match=rf"^tensor parsing error: x \(.*{reason}"):
        tensors.to_ndarray(bad, "x")


@pytest.mark.parametrize("bad, reason", [
    (proto(dtype=types_pb2.DT_UINT8, int_val=[1, 300]), "300"),
    (proto(dtype=types_pb2.DT_INT8, int_val=[-129, 0]), "-129"),
    (proto(dtype=types_pb2.DT_UINT16, int_val=[-1, 0]), "-1"),
    (proto(dtype=types_pb2.DT_HALF, half_val=[70000, 0]), "70000"),
])
def test_values_out_of_the_dtypes_range_are_invalid_argument(bad, reason):
    """TF's FromProto would wrap them; a client that sends 300 for a uint8 learns about it instead."""
    with pytest.raises(InvalidArgument, match=rf"^tensor parsing error: x \(.*{reason}"):
        tensors.to_ndarray(bad, "x")


@pytest.mark.parametrize("sent, shape, expected", [
    (proto(shape=(2, 2)), (2, 2), [[0.0, 0.0], [0.0, 0.0]]),
    (proto(shape=(3,), float_val=[1.0, 2.0]), (3,), [1.0, 2.0, 2.0]),
    (proto(shape=(), float_val=[]), (), 0.0),
    (proto(dtype=types_pb2.DT_STRING, shape=(3,), string_val=[b"a"]), (3,), [b"a", b"a", b"a"]),
    (proto(dtype=types_pb2.DT_BOOL, shape=(2,), bool_val=[True]), (2,), [True, True]),
    (proto(dtype=types_pb2.DT_HALF, shape=(2,), half_val=[0x3C00]), (2,), [1.0, 1.0]),
    (proto(dtype=types_pb2.DT_COMPLEX64, shape=(2,), scomplex_val=[1.0, 2.0]), (2,), [1 + 2j, 1 + 2j]),
    (proto(shape=(65536,)), (65536,), None),
])
def test_values_that_do_not_fill_the_shape_follow_tensor_from_proto(sent, shape, expected):
    """No values: zeros; fewer values: the last one repeated (tensorflow/core/framework/tensor.cc)."""
    decoded = tensors.to_ndarray(sent, "x")
    assert decoded.shape == shape
    if expected is not None:
        assert decoded.tolist() == expected


def test_check_tensor_returns_the_element_count_without_decoding():
    assert tensors.check_tensor(tf.make_tensor_proto(np.zeros((3, 4), np.float32)), "x") == 12
    assert tensors.check_tensor(proto(shape=(0, 5)), "x") == 0
    assert tensors.type_string(types_pb2.DT_FLOAT) == "float" and tensors.type_string(12345) == "12345"


def typed_fields(array: np.ndarray) -> tensor_pb2.TensorProto:
    """The typed-field encoding, value by value through protobuf (what to_tensor_proto wrote before it
    wrote packed bytes)."""
    array = np.asarray(array)
    proto = tensor_pb2.TensorProto(dtype=tf.as_dtype(array.dtype).as_datatype_enum,
                                   tensor_shape=tf.TensorShape(array.shape).as_proto())
    flat = array.ravel()
    if proto.dtype in (types_pb2.DT_HALF, types_pb2.DT_BFLOAT16):
        proto.half_val.extend(flat.view(np.uint16).astype(np.int32).tolist())
    elif proto.dtype == types_pb2.DT_STRING:
        proto.string_val.extend(v.encode() if isinstance(v, str) else bytes(v) for v in flat.tolist())
    elif array.dtype.kind == "c":
        getattr(proto, tensors._FIELDS[proto.dtype]).extend(flat.view(flat.real.dtype).tolist())
    else:
        getattr(proto, tensors._FIELDS[proto.dtype]).extend(flat.tolist())
    return proto


def _arrays() -> list[np.ndarray]:
    rng = np.random.default_rng(7)
    arrays = []
    for shape in [(), (0,), (1,), (3, 2), (1, 784), (300,)]:  # 300: one-byte varints written as bytes
        arrays += [rng.standard_normal(shape).astype(np.float32), rng.standard_normal(shape),
                   rng.standard_normal(shape).astype(np.float16), rng.standard_normal(shape).astype(ml_dtypes.bfloat16),
                   (rng.standard_normal(shape) + 1j * rng.standard_normal(shape)).astype(np.complex64),
                   rng.standard_normal(shape) + 1j * rng.standard_normal(shape), rng.integers(0, 2, shape).astype(bool)]
        for dtype in (np.int8, np.int16, np.int32, np.int64, np.uint8, np.uint16, np.uint32, np.uint64):
            info = np.iinfo(dtype)
            arrays += [rng.integers(info.min, info.max, shape, dtype, endpoint=True),  # negatives: 10-byte varints
                       rng.integers(0, 128, shape).astype(dtype), rng.integers(0, 129, shape).astype(dtype)]
        arrays += [np.array(["x", "yz", ""] * 300)[:math.prod(shape)].reshape(shape)]
    arrays += [np.array([np.nan, np.inf, -np.inf, -0.0], np.float32), np.array([b"a\0", b"", "é"], object),
               rng.standard_normal((4, 3)).astype(">f4"), rng.integers(-9, 9, (2, 300)).astype(">i8"),
               rng.standard_normal((5, 7)).astype(np.float32).T, np.asfortranarray(rng.integers(0, 9, (20, 30)))]
    return arrays


@pytest.mark.parametrize("array", _arrays(), ids=lambda a: f"{a.dtype}{list(a.shape)}")
def test_typed_encoding_is_protobufs_own(array):
    """Packed bytes where the values allow, protobuf's extend elsewhere: the same message either way."""
    expected = typed_fields(array)
    proto = tensors.to_tensor_proto(array)
    assert proto.SerializeToString() == expected.SerializeToString()
    assert tensors.serialize_tensor_proto(array) == expected.SerializeToString()
    assert not proto.tensor_content
    if array.dtype.kind not in "OU" and array.dtype.isnative:
        decoded = tensors.to_ndarray(proto, "x")
        assert decoded.dtype == array.dtype and decoded.tobytes() == np.ascontiguousarray(array).tobytes()


@pytest.mark.parametrize("array", _arrays(), ids=lambda a: f"{a.dtype}{list(a.shape)}")
def test_content_encoding_is_the_arrays_little_endian_bytes(array):
    proto = tensors.to_tensor_proto(array, content=True)
    assert tensors.serialize_tensor_proto(array, content=True) == proto.SerializeToString()
    assert [dim.size for dim in proto.tensor_shape.dim] == list(array.shape)
    if array.dtype.kind in "OU":  # TF never puts strings in tensor_content
        assert proto == typed_fields(array)
        return
    little = array.astype(array.dtype.newbyteorder("<"), order="C")
    assert proto.tensor_content == little.tobytes()
    assert proto.ListFields()[-1][0].name == ("tensor_content" if array.size else "tensor_shape")
    decoded = tensors.to_ndarray(proto, "x")
    assert decoded.shape == array.shape and decoded.tobytes() == little.astype(little.dtype.newbyteorder("=")).tobytes()
    np.testing.assert_array_equal(tf.make_ndarray(proto), array)


_SUB_BYTE_INTS = ("int4", "uint4", "int2", "uint2")  # int_val, never tensor_content


@pytest.mark.parametrize("array", [a for a in _arrays() if a.dtype.kind not in "OU" and a.dtype.name not in _SUB_BYTE_INTS],
                         ids=lambda a: f"{a.dtype}{list(a.shape)}")
def test_bytes_already_in_tensor_contents_layout_encode_as_the_array_would(array):
    """serialize_content (the v2 protocol's binary inputs, serving/v2/tensors.py) writes the same TensorProto as
    encoding the array they stand for, from the bytes as they came (a memoryview over a body)."""
    proto = tensors.to_tensor_proto(array, content=True)
    little = np.ascontiguousarray(array.astype(array.dtype.newbyteorder("<")))
    encoded = tensors.serialize_content(proto.dtype, array.shape, memoryview(little.tobytes()))
    assert encoded == tensors.serialize_tensor_proto(array, content=True)


@pytest.mark.parametrize("dtype", [ml_dtypes.float8_e4m3fn, ml_dtypes.float8_e5m2, ml_dtypes.float4_e2m1fn,
                                   tf.qint8.as_numpy_dtype, tf.quint8.as_numpy_dtype, tf.qint16.as_numpy_dtype,
                                   tf.quint16.as_numpy_dtype, tf.qint32.as_numpy_dtype, ml_dtypes.int4,
                                   ml_dtypes.uint4, ml_dtypes.int2, ml_dtypes.uint2])
@pytest.mark.parametrize("shape", [(), (1,), (3,), (2, 0), (2, 3)])
def test_dtypes_without_a_typed_field_are_encoded_as_make_tensor_proto_does(dtype, shape):
    """float8/float4 and quantized ints: tensor_content (float8_val, int_val for one element); int4/int2: int_val."""
    array = np.ones(shape, dtype) if np.dtype(dtype).names else np.arange(math.prod(shape)).reshape(shape).astype(dtype)
    assert tensors.to_tensor_proto(array) == tf.make_tensor_proto(array)
    assert tensors.serialize_tensor_proto(array) == tf.make_tensor_proto(array).SerializeToString()


def test_float8_fnuz_scalars_are_encoded_though_make_tensor_proto_refuses_them():
    array = np.array(1.5, ml_dtypes.float8_e4m3fnuz)
    with pytest.raises(TypeError):
        tf.make_tensor_proto(array)
    proto = tensors.to_tensor_proto(array)
    assert proto.dtype == types_pb2.DT_FLOAT8_E4M3FNUZ and proto.float8_val == array.tobytes()


@pytest.mark.parametrize("size", [1, 63, 64, 65, 784])
def test_typed_fields_decode_to_new_writable_arrays(size):
    """Short fields are read value by value (np.fromiter), long ones by protobuf (np.asarray): the same arrays."""
    values = np.arange(size, dtype=np.float32) / 7
    for array in (values, values.astype(np.int32), values > 3, values.astype(np.uint8), values.astype(np.float16)):
        proto = tensors.to_tensor_proto(array)
        first, second = tensors.to_ndarray(proto, "x"), tensors.to_ndarray(proto, "x")
        assert first.dtype == array.dtype and first.tobytes() == array.tobytes()
        assert first.flags.writeable and not np.shares_memory(first, second)


def test_no_tensorflow_call_per_request(monkeypatch):
    """Every dtype a request can carry encodes and decodes from the tables built at import."""
    arrays = [np.zeros((2, 3), tensors._NUMPY[dtype]) for dtype in tensors._NUMPY if dtype != types_pb2.DT_STRING]
    arrays += [np.array([b"a", b"b"], object), np.array(["a", "bc"])]
    monkeypatch.setattr(tensors, "tf", None)
    for array in arrays:
        for content in (False, True):
            proto = tensors.to_tensor_proto(array, content=content)
            decoded = tensors.to_ndarray(proto, "x")
            assert decoded.shape == array.shape
    assert tensors.numpy_dtype(types_pb2.DT_BFLOAT16) == ml_dtypes.bfloat16
    assert tensors.numpy_dtype(types_pb2.DT_FLOAT_REF) == np.float32


@pytest.mark.parametrize("dtype, field, values", [
    (types_pb2.DT_FLOAT, "float_val", [0.1] * 100),
    (types_pb2.DT_COMPLEX64, "scomplex_val", [1.5, -2.0] * 50),
    (types_pb2.DT_UINT64, "uint64_val", [2**64 - 1, 2**53 + 1] * 50),
    (types_pb2.DT_INT64, "int64_val", [-(2**63), 2**53 + 1] * 50),
])
def test_typed_fields_decode_to_their_own_dtype_whatever_protobuf_hands_out(dtype, field, values):
    """protobuf 6 hands a float_val to numpy as float64 (and uint64 above 2**53 inexactly), protobuf 7 as
    float32: a repeated field given as a plain Python list plays protobuf 6, and the values come out exact."""
    import types

    fake = types.SimpleNamespace(dtype=dtype, **{field: list(values)})
    decoded = tensors._typed_values(fake, tensors.numpy_dtype(dtype))  # noqa: SLF001 - the decoding step itself
    real = tensors.to_ndarray(tensors.to_tensor_proto(decoded), "x")  # protobuf 7 on this path
    assert decoded.dtype == tensors.numpy_dtype(dtype) == real.dtype
    np.testing.assert_array_equal(decoded, real)
    if dtype in (types_pb2.DT_UINT64, types_pb2.DT_INT64):
        assert decoded.tolist()[:2] == values[:2]  # exact, not through float64
