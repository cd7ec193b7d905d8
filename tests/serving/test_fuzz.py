"""A seeded mutation fuzz of a live server: malformed Predict, Classify, Regress, MultiInference and REST requests.

Each request starts from a good one for TF Serving's half_plus_two models (the TF1 Session model and the
TF2 one, served together) and has its dtype, shape, rank, values, names, signature, version or JSON
mutated, or its serialized bytes flipped, cut or extended (raw byte mutations, sent as they are). With
batching off and on, whatever a client sends, the server must answer it with a status that is not
INTERNAL or UNKNOWN (REST: not 5xx), log no traceback, keep answering health probes, and not grow (RSS)
by more than a bound.

The suite sends FUZZ_REQUESTS requests (default 5000, a few seconds); a longer run, by hand:
    FUZZ_REQUESTS=10000 .venv/bin/python -m pytest -q -p no:cacheprovider tests/serving/test_fuzz.py
"""

from __future__ import annotations

import base64
import collections
import json
import os
import random
import shutil
import urllib.error
import urllib.parse
import urllib.request

import grpc
import psutil
import pytest
from grpc_health.v1 import health_pb2, health_pb2_grpc
from tensorflow.core.framework import tensor_pb2, types_pb2
from tensorflow.core.example import example_pb2
from tensorflow_serving.apis import (classification_pb2, inference_pb2, predict_pb2, prediction_service_pb2_grpc,
                                     regression_pb2)

pytestmark = pytest.mark.timeout(900)

REQUESTS = int(os.environ.get("FUZZ_REQUESTS", "5000"))
SEED = 20240612
RSS_GROWTH_LIMIT_MB = 200
MODELS = {"tf1": "saved_model_half_plus_two_cpu", "tf2": "saved_model_half_plus_two_tf2_cpu"}
SIGNATURES = ["", "serving_default", "classify_x_to_y", "regress_x_to_y", "regress_x_to_y2", "regress_x2_to_y3",
              "nope", "x" * 300]
DTYPES = [value for value in types_pb2.DataType.values()] + [999, -1, 2**31 - 1]
FIELDS = ["float_val", "double_val", "int_val", "int64_val", "uint32_val", "uint64_val", "bool_val", "half_val",
          "string_val", "scomplex_val", "dcomplex_val", "tensor_content"]
SIZES = [0, 1, 1, 2, 3, -1, -7, 65537, 2**20, 2**31, 2**40, 2**62, 2**63 - 1]


@pytest.fixture(scope="module", params=["batching off", "batching on"])
def server(built_testdata, start_server, tmp_path_factory, request):
    root = tmp_path_factory.mktemp("fuzz")
    entries = []
    for name, fixture in MODELS.items():
        shutil.copytree(built_testdata / fixture, root / name, copy_function=shutil.copyfile)
        for path in [root / name, *(root / name).rglob("*")]:
            path.chmod(path.stat().st_mode | 0o200)
        entries.append(f'config {{ name: "{name}" base_path: "{root / name}" model_platform: "tensorflow" }}')
    (root / "models.config").write_text("model_config_list { " + " ".join(entries) + " }")
    batching = ["--enable_batching"] if request.param == "batching on" else []
    server = start_server(f"--model_config_file={root / 'models.config'}", "--rest_api_port=-1", *batching,
                          log_dir=root)
    yield server
    assert server.stop() == 0, server.stderr_tail()


def test_mutated_requests_never_get_internal(server):
    rng = random.Random(SEED)
    process = psutil.Process(server.process.pid)
    channel = grpc.insecure_channel(server.address)
    stub = prediction_service_pb2_grpc.PredictionServiceStub(channel)
    rest = f"http://{server.rest_address}"
    outcomes: collections.Counter = collections.Counter()
    failures = []
    rss_start = None
    for i in range(REQUESTS):
        if i == 200:  # after every path has run once (lazy imports, first session runs)
            rss_start = process.memory_info().rss
        kind = rng.choice(["predict"] * 5 + ["classify", "regress", "multi"] + ["rest"] * 4 + ["raw"] * 2)
        if kind == "raw":
            rpc, payload = raw_request(rng)
            code = _status(channel.unary_unary(f"/tensorflow.serving.PredictionService/{rpc}"), payload)
            outcomes[f"raw {rpc} {code.name}"] += 1
            if code in (grpc.StatusCode.INTERNAL, grpc.StatusCode.UNKNOWN, grpc.StatusCode.DEADLINE_EXCEEDED):
                failures.append(f"raw {rpc} {payload[:200]!r} -> {code.name}")
        elif kind == "rest":
            method, path, body = rest_request(rng)
            status = send_rest(f"{rest}{path}", method, body)
            outcomes[f"rest {status}"] += 1
            if status >= 500:
                failures.append(f"REST {method} {path[:80]} {body[:200]!r} -> {status}")
        else:
            rpc, request = grpc_request(rng, kind)
            code = _status(getattr(stub, rpc), request)
            outcomes[f"{rpc} {code.name}"] += 1
            if code in (grpc.StatusCode.INTERNAL, grpc.StatusCode.UNKNOWN, grpc.StatusCode.DEADLINE_EXCEEDED):
                failures.append(f"{rpc} {str(request)[:300]!r} -> {code.name}")
    growth_mb = (process.memory_info().rss - rss_start) / 2**20
    health = health_pb2_grpc.HealthStub(channel).Check(health_pb2.HealthCheckRequest(service=""), timeout=10)
    channel.close()
    print(f"fuzz: {REQUESTS} requests, RSS growth {growth_mb:.0f} MiB after request 200; "
          f"{sorted(outcomes.items())}")
    assert not failures, f"{len(failures)} server errors, e.g. {failures[:5]}"
    assert health.status == health_pb2.HealthCheckResponse.SERVING
    assert send_rest(f"{rest}/v1/models/tf1", "GET", b"") == 200
    assert growth_mb < RSS_GROWTH_LIMIT_MB
    log = server.stderr_path.read_text(errors="replace")
    assert "Traceback" not in log, log[log.index("Traceback") - 500:][:3000]
    assert sum(count for key, count in outcomes.items() if key.endswith(" OK") or key.endswith(" 200")) > 0


def _status(call, request) -> grpc.StatusCode:
    """The status one gRPC call ends with: OK, or its error's code."""
    try:
        call(request, timeout=30)
    except grpc.RpcError as error:
        return error.code()
    return grpc.StatusCode.OK


def send_rest(url: str, method: str, body: bytes) -> int:
    request = urllib.request.Request(url, data=body if method != "GET" else None, method=method)
    try:
        with urllib.request.urlopen(request, timeout=30) as response:
            response.read()
            return response.status
    except urllib.error.HTTPError as error:
        error.read()
        return error.code


# --- gRPC requests -------------------------------------------------------------------------------------


def raw_request(rng: random.Random) -> tuple[str, bytes]:
    """A mutated request's serialization with bytes flipped, cut, duplicated or inserted: what a broken client or
    a hostile one sends (it may not parse at all, or parse as a different message)."""
    kind = rng.choice(["predict"] * 3 + ["classify", "regress", "multi"])
    rpc, request = grpc_request(rng, kind)
    data = bytearray(request.SerializeToString())
    for _ in range(rng.choice([1, 1, 2, 5, 20])):
        position = rng.randrange(len(data) + 1)
        action = rng.choice(["flip", "cut", "insert", "duplicate"])
        if action == "flip" and position < len(data):
            data[position] ^= 1 << rng.randrange(8)
        elif action == "cut":
            del data[position:position + rng.choice([1, 4, 64])]
        elif action == "insert":
            data[position:position] = rng.randbytes(rng.choice([1, 3, 10]))
        else:
            data[position:position] = data[max(position - 16, 0):position]
    return rpc, bytes(data)


def grpc_request(rng: random.Random, kind: str):
    if kind == "predict":
        return "Predict", predict_request(rng)
    if kind == "multi":
        request = inference_pb2.MultiInferenceRequest()
        model = rng.choice(list(MODELS) + ["nope"])
        for _ in range(rng.choice([0, 1, 2, 2, 3])):
            request.tasks.add(model_spec={"name": rng.choice([model, model, "", "other"]),
                                          "signature_name": rng.choice(SIGNATURES)},
                              method_name=rng.choice(["tensorflow/serving/classify", "tensorflow/serving/regress",
                                                      "tensorflow/serving/predict", "", "x"]))
        fill_input(rng, request.input)
        return "MultiInference", request
    request = (classification_pb2.ClassificationRequest() if kind == "classify"
               else regression_pb2.RegressionRequest())
    if rng.random() < 0.95:
        request.model_spec.name = rng.choice(list(MODELS) + ["nope"])
        request.model_spec.signature_name = rng.choice(SIGNATURES)
        maybe_version(rng, request.model_spec)
    fill_input(rng, request.input)
    return kind.capitalize(), request


def predict_request(rng: random.Random) -> predict_pb2.PredictRequest:
    request = predict_pb2.PredictRequest()
    request.model_spec.name = rng.choice(list(MODELS) * 4 + ["nope", ""])
    if rng.random() < 0.3:
        request.model_spec.signature_name = rng.choice(SIGNATURES)
    maybe_version(rng, request.model_spec)
    names = ["x"]
    if rng.random() < 0.2:
        names = rng.sample(["x", "inputs", "nope", "", "é" * 50, "y" * 500], rng.randint(0, 3))
    for name in names:
        request.inputs[name].CopyFrom(tensor(rng))
    if rng.random() < 0.2:
        request.output_filter.extend(rng.choices(["y", "nope", "scores", ""], k=rng.randint(1, 3)))
    return request


def maybe_version(rng: random.Random, spec) -> None:
    roll = rng.random()
    if roll < 0.1:
        spec.version.value = rng.choice([0, 1, 123, -5, 2**63 - 1, -(2**63)])
    elif roll < 0.15:
        spec.version_label = rng.choice(["stable", "", "x" * 100])


def tensor(rng: random.Random) -> tensor_pb2.TensorProto:
    """A float [n, 1] tensor, or one with its dtype, shape, rank or values mutated."""
    rows = rng.choice([1, 2, 3])
    proto = tensor_pb2.TensorProto(dtype=types_pb2.DT_FLOAT, tensor_shape={"dim": [{"size": rows}, {"size": 1}]},
                                   float_val=[rng.uniform(-10, 10) for _ in range(rows)])
    for _ in range(rng.choice([0, 1, 1, 2, 3])):
        mutation = rng.choice(["dtype", "dims", "rank", "unknown_rank", "values", "content", "clear"])
        if mutation == "dtype":
            proto.dtype = rng.choice(DTYPES)
        elif mutation == "dims":
            for dim in proto.tensor_shape.dim:
                if rng.random() < 0.5:
                    dim.size = rng.choice(SIZES)
        elif mutation == "rank":
            del proto.tensor_shape.dim[:]
            for _ in range(rng.choice([0, 1, 3, 8, 33, 64, 65, 100, 300])):
                proto.tensor_shape.dim.add().size = rng.choice([1, 1, 1, 2, 0])
        elif mutation == "unknown_rank":
            proto.tensor_shape.unknown_rank = True
        elif mutation == "values":
            add_values(rng, proto, rng.choice(FIELDS[:-1]))
        elif mutation == "content":
            proto.tensor_content = rng.randbytes(rng.choice([0, 1, 3, 4, 8, 12, 4096]))
        else:
            proto.ClearField(rng.choice(FIELDS))
    return proto


def add_values(rng: random.Random, proto: tensor_pb2.TensorProto, field: str) -> None:
    count = rng.choice([0, 1, 2, 3, 5, 100])
    values = getattr(proto, field)
    if field == "string_val":
        values.extend(rng.randbytes(rng.choice([0, 3, 50])) for _ in range(count))
    elif field == "bool_val":
        values.extend(rng.random() < 0.5 for _ in range(count))
    elif field in ("float_val", "double_val", "scomplex_val", "dcomplex_val"):
        values.extend(rng.choice([0.0, -1.5, 3e38, float("inf"), float("nan"), 1e-45]) for _ in range(count))
    else:
        ranges = {"uint32_val": (0, 2**32 - 1), "uint64_val": (0, 2**64 - 1), "int64_val": (-(2**63), 2**63 - 1)}
        low, high = ranges.get(field, (-(2**31), 2**31 - 1))
        values.extend(rng.choice([low, high, 0, 255, 256, 65536, -1 if low < 0 else 1]) for _ in range(count))


def fill_input(rng: random.Random, input) -> None:
    roll = rng.random()
    if roll < 0.1:
        return  # no input at all
    target = input.example_list_with_context if roll < 0.35 else input.example_list
    if roll < 0.35:
        target.context.CopyFrom(example(rng))
    for _ in range(rng.choice([0, 1, 2, 5, 20])):
        target.examples.add().CopyFrom(example(rng))


def example(rng: random.Random) -> example_pb2.Example:
    result = example_pb2.Example()
    for name in rng.sample(["x", "x2", "y", "", "é"], rng.randint(0, 3)):
        feature = result.features.feature[name]
        kind = rng.choice(["float", "float", "int", "bytes", "empty"])
        if kind == "float":
            count = rng.choice([1, 1, 2, 0])
            feature.float_list.value.extend(rng.choice([2.0, -1.0, 1e38, float("nan")]) for _ in range(count))
        elif kind == "int":
            feature.int64_list.value.extend([rng.choice([0, 2**63 - 1, -5])])
        elif kind == "bytes":
            feature.bytes_list.value.append(rng.randbytes(rng.choice([0, 5, 100])))
    return result


# --- REST requests -------------------------------------------------------------------------------------


def rest_request(rng: random.Random) -> tuple[str, str, bytes]:
    model = rng.choice(["tf1", "tf1", "tf2", "nope", "%00", "%ED%A0%80", "%ff", "x" * 300])
    version = rng.choice(["", "", "", "/versions/123", "/versions/0", "/versions/" + "9" * rng.choice([19, 20, 400]),
                          "/versions/-1", "/versions/\u0663", "/labels/stable", "/labels/" + "é" * 5])
    verb = rng.choice([":predict"] * 6 + [":classify", ":regress", "", "/metadata", ":nope"])
    method = "GET" if verb in ("", "/metadata") else rng.choice(["POST"] * 9 + ["PUT"])
    body = json_body(rng, verb).encode() if method != "GET" else b""
    if body and rng.random() < 0.25:  # byte-level damage: truncation, a flipped byte, a stray token
        position = rng.randrange(len(body))
        body = rng.choice([body[:position], body[:position] + bytes([rng.randrange(256)]) + body[position + 1:],
                           body[:position] + b"]}NaN" + body[position:]])
    return method, urllib.parse.quote(f"/v1/models/{model}{version}{verb}", safe="/:%"), body


def json_body(rng: random.Random, verb: str) -> str:
    if verb in (":classify", ":regress"):
        body = {"examples": [{"x": json_value(rng, 0)} for _ in range(rng.choice([0, 1, 3]))]}
        if rng.random() < 0.3:
            body["context"] = {"x": json_value(rng, 0)}
        if rng.random() < 0.5:
            body["signature_name"] = rng.choice(SIGNATURES + [5, None])
        if rng.random() < 0.2:
            body["examples"] = json_value(rng, 0)
        return json.dumps(body)
    roll = rng.random()
    if roll < 0.05:
        return "[" * rng.choice([50, 101, 5000]) + "1" + "]" * rng.choice([0, 50, 101, 5000])
    if roll < 0.1:
        return '{"instances": [[' + "9" * rng.choice([20, 400, 1001, 5000]) + "]]}"
    rows = [[rng.uniform(-5, 5)] for _ in range(rng.choice([1, 2, 3]))]
    body = {"instances": rows} if rng.random() < 0.5 else {"inputs": {"x": rows} if rng.random() < 0.5 else rows}
    for _ in range(rng.choice([0, 1, 1, 2])):
        mutation = rng.choice(["leaf", "shape", "key", "signature", "both", "extra"])
        key = "instances" if "instances" in body else "inputs"
        if mutation == "leaf":
            body[key] = json_value(rng, 0)
        elif mutation == "shape":
            body[key] = rng.choice([[], [[]], [[1.0], [2.0, 3.0]], [[[1.0]]], [{"x": [1.0]}, {"y": [2.0]}],
                                    [{"x": [1.0]}, [2.0]], {"x": [[1.0]], "nope": [[2.0]]}, {"b64": "@@"}])
        elif mutation == "key":
            body = {rng.choice(["instance", "", "inputs"]): body.get(key, rows)}
        elif mutation == "signature":
            body["signature_name"] = rng.choice(SIGNATURES + [5, None, ["x"], {"b64": "eA=="}])
        elif mutation == "both":
            body["inputs"] = body["instances"] = rows
        else:
            body["x" * rng.choice([1, 500])] = json_value(rng, 0)
    return json.dumps(body, allow_nan=True)


def json_value(rng: random.Random, depth: int):
    roll = rng.random()
    if depth < 6 and roll < 0.35:
        return [json_value(rng, depth + 1) for _ in range(rng.choice([0, 1, 2, 3]))]
    return rng.choice([None, True, False, 0, -1, 2**31, 2**63, 2**64, -(2**70), 1.5, 1e308, -1e-320, float("nan"),
                       float("inf"), "", "a", "é", "\u0000", {"b64": base64.b64encode(b"xy").decode()},
                       {"b64": "!!"}, {"b64": 5}, {"x": 1.0}, {}])


if __name__ == "__main__":  # pragma: no cover - documentation of how the module is meant to run
    raise SystemExit(f"run with pytest: FUZZ_REQUESTS=10000 pytest {__file__}")
