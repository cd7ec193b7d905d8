"""The REST JSON codec: orjson where it reads and writes as the json module does, the json module elsewhere."""

from __future__ import annotations

import json
import math
import random
import types

import ml_dtypes
import numpy as np
import orjson
import pytest
from tensorflow.core.framework import types_pb2
from tensorflow_serving.apis import predict_pb2

from serving.rest import json_codec
from serving.servable import tensors
from serving.errors import InvalidArgument


def json_outcome(body: bytes):
    """What parse_body gave when it parsed with json.loads alone."""
    try:
        value = json.loads(body or b"{}")
    except (ValueError, RecursionError) as error:
        return "error", f"JSON Parse error: {str(error).strip().splitlines()[0]}"
    return ("value", repr(value)) if isinstance(value, dict) else ("error", "Is not an object")


def outcome(body: bytes):
    try:
        return "value", repr(json_codec.parse_body(body))
    except InvalidArgument as error:
        return "error", "Is not an object" if str(error).endswith("Is not an object") else str(error)


@pytest.mark.parametrize("body", [
    b'{"x": [1, -2, 0.5, 1e5, 1E-7, -0, -0.0, 2.2250738585072011e-308, 5e-324, 1.7976931348623157e308]}',
    b'{"x": [9223372036854775807, -9223372036854775808, 18446744073709551615]}',
    b'{"x": [18446744073709551616, -9223372036854775809, 123456789012345678901234567890]}',  # orjson: floats
    b'{"x": 12345678901234567890.5, "y": 0.00012345678901234567890, "z": 1e-0000000000000000000001}',
    b'{"x": [NaN, Infinity, -Infinity, 1e400, -1e400, 1e-400]}',
    b'{"x": "\\ud800", "\\udfff": 1}', b'\xef\xbb\xbf{"x": 1}', '{"x": "\u00e9"}'.encode("utf-16"),
    b'{"x": 1, "x": 2}', b' {"x": {"b64": "YWJj"}, "y": [true, false, null], "z": "null"} ', b'{}', b'',
    b'{"x": [1.]}', b'{"x": [01]}', b'{"x": [1,]}', b'{"x": "\x01"}', b'{"x": 1}x', b'{"x": ', b'{"\xff": 1}',
    b'[1, 2]', b'"text"', b'123456789012345678901', b'null',
], ids=lambda body: body[:40].decode("latin-1"))
def test_parse_body_reads_what_json_loads_reads(body):
    assert outcome(body) == json_outcome(body)


def random_json(rng: random.Random, depth: int = 0) -> str:
    kind = rng.randrange(10 if depth < 4 else 6)
    if kind < 5:
        return rng.choice([
            str(rng.randint(-10**22, 10**22)), str(rng.randint(-2**64, 2**64)), repr(rng.uniform(-1e3, 1e3)),
            repr(float(np.float32(rng.uniform(0, 1e-3)))), f"{rng.uniform(-9, 9):.{rng.randint(0, 25)}e}",
            "0." + "".join(rng.choice("0123456789") for _ in range(rng.randint(1, 40))), repr(rng.gauss(0, 1) * 1e200),
            rng.choice(["NaN", "-Infinity", "1e400", "-0", "01", "1.", "+1", "-", '"\\ud800"', '"\\u00e9"', "true",
                        "null"])])
    if kind == 5:
        return rng.choice(['"a"', '"b\\"c"', '{"b64": "YWJj"}', "false"])
    if kind < 8:
        return "[" + ", ".join(random_json(rng, depth + 1) for _ in range(rng.randint(0, 4))) + "]"
    return "{" + ", ".join(f'"k{i}": {random_json(rng, depth + 1)}' for i in range(rng.randint(0, 3))) + "}"


def test_parse_body_agrees_with_json_loads_on_random_bodies():
    rng = random.Random(0)
    for _ in range(3000):
        text = '{"instances": ' + random_json(rng) + "}"
        body = text[:rng.randint(0, len(text))] if rng.random() < 0.05 else text
        body = body.encode("utf-8", "surrogatepass")
        assert outcome(body) == json_outcome(body), body


def test_long_integers_take_the_json_path_and_fractions_do_not(monkeypatch):
    calls, loads = [], json.loads
    monkeypatch.setattr(json_codec.json, "loads", lambda body: calls.append(body) or loads(body))
    ordinary = json.dumps({"instances": [[0.0012958765029907227, 1.2345678901234567e-05, 10**18 - 1, -10**18 + 1]]})
    assert json_codec.parse_body(ordinary.encode()) == loads(ordinary) and not calls
    for big in (b"[12345678901234567890]", b"[-9223372036854775809]", b"12345678901234567890"):
        json_codec._loads(big, big)
    assert len(calls) == 3


@pytest.mark.parametrize("body, message", [
    (b'{"instances": [[' + b"9" * 1001 + b"]]}", "a number of 1001 characters; at most 1000 are allowed"),
    (b'{"instances": [[1, ' + b"1" * 1500 + b", " + b"2" * 3000 + b"]]}", "a number of 1500 characters"),
    (b'{"instances": ' + b"-1.5e+" * 200, "a number of 1200 characters"),  # a run that reaches the end
    (b'{"instances": ' + b"[" * 101 + b"]" * 101 + b"}", "arrays and objects nested deeper than 100 levels"),
    (b'{"a": [' + b'{"b": ' * 100 + b"1" + b"}" * 100 + b"]}", "arrays and objects nested deeper than 100 levels"),
])
def test_json_limits_are_checked_before_parsing(body, message):
    with pytest.raises(InvalidArgument, match=f"^JSON Parse error: {message}"):
        json_codec.parse_body(body)


def test_json_limits_leave_strings_and_shallow_bodies_alone():
    assert json_codec.parse_body(b'{"s": "' + b"9" * 5000 + b"[" * 500 + b'"}')["s"].startswith("999")
    assert len(json_codec.parse_body(b'{"x": [' + b"[1], " * 5000 + b"[2]]}")["x"]) == 5001
    assert json_codec.parse_body(b'{"x": ' + b"[" * 99 + b"1" + b"]" * 99 + b"}")
    assert json_codec.parse_body(b'{"x": ' + b"1" * 1000 + b"}")["x"] == int("1" * 1000)


@pytest.mark.parametrize("payload", [
    {"predictions": [[0.10000000149011612, 1e-05, 1.5e-07, 1e+16, -0.0, 3, True, None, "é", {"b64": "YQ=="}]]},
    {"outputs": {"a": [[1, 2], [3, 4]], "b": []}, "model_spec": {"name": "m", "version": "1"}},
    {"results": [[["", 2.5]], [["cat", 0.25]]]}, {"error": "a \"quoted\" message\nwith two lines"}, {}, [],
])
def test_dumps_writes_the_same_values_as_json_dumps(payload):
    for pretty in (False, True):
        body = json_codec.dumps(payload, pretty=pretty)
        assert json.loads(body) == json.loads(json.dumps(payload, indent=1)) == payload
    if "None" not in repr(payload):
        assert json_codec.dumps(payload) == orjson.dumps(payload)
        assert json_codec.dumps(payload, pretty=True) == json.dumps(payload, indent=2, ensure_ascii=False).encode() or \
            "e-" in repr(payload)  # orjson spells 1e-05 as 0.00001: the same float


def test_dumps_writes_non_finite_floats_as_tf_serving_does():
    payload = json_codec.predictions_json({"y": np.array([[np.nan, np.inf, -np.inf, 0.5]], np.float32)})
    assert json_codec.dumps(payload) == b'{"predictions":[[NaN,Infinity,-Infinity,0.5]]}'
    assert json_codec.dumps(payload, pretty=True) == json.dumps(payload, indent=2).encode()
    assert json_codec.dumps({"results": [float("nan")]}) == b'{"results":[NaN]}'


@pytest.mark.parametrize("payload", [{"x": 2**70}, {"x": "\ud800"}, {"x": np.float64(0.5)}, {1: "a"}])
def test_dumps_leaves_what_orjson_refuses_to_json(payload):
    assert json_codec.dumps(payload) == json.dumps(payload, separators=(",", ":")).encode()


def test_float32_outputs_are_written_as_their_float64_widening():
    outputs = {"y": np.array([[0.1, 1e-5, 3.0]], np.float32)}
    body = json_codec.dumps(json_codec.outputs_json(outputs))
    assert body == b'{"outputs":[[0.10000000149011612,9.999999747378752e-6,3.0]]}'  # json.dumps: e-06
    assert json.loads(body)["outputs"] == np.float32(outputs["y"]).astype(np.float64).tolist()
    halves = {"y": np.array([0.1], np.float16), "z": np.array([0.1], ml_dtypes.bfloat16)}
    assert json.loads(json_codec.dumps(json_codec.outputs_json(halves)))["outputs"] == {
        "y": [float(np.float32(np.float16(0.1)))], "z": [float(np.float32(ml_dtypes.bfloat16(0.1)))]}


@pytest.mark.parametrize("dtype, values", [
    (types_pb2.DT_FLOAT, [[0.5, 1e-5], [3.0, -2.0]]), (types_pb2.DT_DOUBLE, [1.0, 2.5]),
    (types_pb2.DT_INT32, [[1, -2]]), (types_pb2.DT_INT64, [2**62]), (types_pb2.DT_UINT8, [255, 0]),
    (types_pb2.DT_BOOL, [True, False]), (types_pb2.DT_HALF, [0.5]), (types_pb2.DT_BFLOAT16, [[1.5]]),
    (types_pb2.DT_FLOAT, 3.0), (types_pb2.DT_FLOAT, []),
])
def test_predict_inputs_fill_tensor_content(dtype, values):
    signature = types.SimpleNamespace(inputs={"x": types.SimpleNamespace(dtype=dtype)})
    request = predict_pb2.PredictRequest()
    assert json_codec.predict_inputs({"inputs": values}, signature, request) is False
    proto = request.inputs["x"]
    expected = np.array(values).astype(tensors.numpy_dtype(dtype))
    assert proto.dtype == dtype and proto.tensor_content == expected.tobytes()
    assert not proto.float_val and not proto.int_val and not proto.half_val
    decoded = tensors.to_ndarray(proto, "x")
    assert decoded.dtype == expected.dtype and decoded.shape == expected.shape
    np.testing.assert_array_equal(decoded, expected)


def test_predict_inputs_strings_stay_in_string_val():
    signature = types.SimpleNamespace(inputs={"x": types.SimpleNamespace(dtype=types_pb2.DT_STRING)})
    request = predict_pb2.PredictRequest()
    json_codec.predict_inputs({"instances": ["a", {"b64": "AAE="}]}, signature, request)
    assert list(request.inputs["x"].string_val) == [b"a", b"\x00\x01"] and not request.inputs["x"].tensor_content


def test_no_tensorflow_call_per_request(monkeypatch):
    monkeypatch.setattr(tensors, "tf", None)
    assert not hasattr(json_codec, "tf")
    for dtype in (types_pb2.DT_FLOAT, types_pb2.DT_BFLOAT16, types_pb2.DT_STRING, types_pb2.DT_INT8):
        signature = types.SimpleNamespace(inputs={"x": types.SimpleNamespace(dtype=dtype)})
        text = b'{"instances": [["1"]]}' if dtype == types_pb2.DT_STRING else b'{"instances": [[1]]}'
        body = json_codec.parse_body(text)
        request = predict_pb2.PredictRequest()
        json_codec.predict_inputs(body, signature, request)
        outputs = {"y": tensors.to_ndarray(request.inputs["x"], "x")}
        assert json_codec.dumps(json_codec.predictions_json(outputs)) in (
            b'{"predictions":[[1]]}', b'{"predictions":[[1.0]]}', b'{"predictions":[["1"]]}')
    assert math.isnan(json.loads(json_codec.dumps({"x": float("nan")}))["x"])


def test_uint64_values_beyond_int64_are_read_exactly():
    """numpy reads [0, 2**64 - 1] as float64 (rounded): such values are read as uint64, every one exactly."""
    values = [0, 2**64 - 1, 3]
    array = json_codec.to_array(json_codec.parse_body(json.dumps({"v": values}).encode())["v"], types_pb2.DT_UINT64, "x")
    assert array.dtype == np.uint64 and array.tolist() == values
    with pytest.raises(InvalidArgument, match="must all be integers"):
        json_codec.to_array([0, 2**64 - 1, 1.5], types_pb2.DT_UINT64, "x")
    with pytest.raises(InvalidArgument, match="must all be integers"):
        json_codec.to_array([-1, 2**64 - 1], types_pb2.DT_UINT64, "x")
