"""TF Serving's REST API: routes, JSON tensor rules, error mapping, and REST == gRPC on a real server."""

from __future__ import annotations

import asyncio
import concurrent.futures
import json
import logging
import shutil
import socket
import time
import urllib.error
import urllib.request

import grpc
import numpy as np
import psutil
import pytest
import tensorflow as tf
from tensorflow_serving.apis import predict_pb2, prediction_service_pb2_grpc

from server_helpers import serving, wait_for
from serving.manager import model_config
from serving.manager.model_manager import ModelManager
from serving.model_service import ModelService
from serving.prediction_service import PredictionService
from serving.rest.routes import HTTP_STATUS, RestApi

pytestmark = pytest.mark.timeout(300)


@pytest.fixture(scope="module")
def api(copy_testdata, tmp_path_factory):
    base_path = copy_testdata("saved_model_half_plus_two_cpu", tmp_path_factory.mktemp("rest") / "half_plus_two")
    config = model_config.single_model_config("half_plus_two", str(base_path))
    config.model_config_list.config[0].version_labels["stable"] = 123
    manager = ModelManager(file_system_poll_wait_seconds=0, allow_version_labels_for_unavailable_models=True)
    manager.reload_config(config)
    with concurrent.futures.ThreadPoolExecutor(2) as pool:
        yield rest_api(manager, pool)


def rest_api(manager, pool=None) -> RestApi:
    """The REST routes over the servicers, as the server builds them (serving/app.py)."""
    return RestApi(manager, (PredictionService(manager, api="rest", executor=pool), ModelService(manager, executor=pool)),
                   executor=pool)


def call(api, method, path, body=None):
    """One request as the HTTP server hands it over (RestApi.handle on an event loop)."""
    body = json.dumps(body).encode() if isinstance(body, dict) else (body or b"")
    return asyncio.run(api.handle(method, path, bytearray(body)))


@pytest.mark.parametrize("path", ["/v1/models/half_plus_two", "/v1/models/half_plus_two/versions/123",
                                  "/v1/models/half_plus_two/labels/stable"])
def test_status_is_tf_serving_json(api, path):
    assert call(api, "GET", path) == (200, {"model_version_status": [
        {"version": "123", "state": "AVAILABLE", "status": {"error_code": "OK", "error_message": ""}}]})


def test_metadata_matches_tf_serving_layout(api, tfserving_testdata):
    status, body = call(api, "GET", "/v1/models/half_plus_two/versions/123/metadata")
    assert status == 200
    assert body["model_spec"] == {"name": "half_plus_two", "version": "123", "signature_name": ""}
    expected = json.loads((tfserving_testdata / "half_plus_two_model_metadata.json").read_text())
    assert set(body["metadata"]["signature_def"]["signature_def"]) == \
        set(expected["metadata"]["signature_def"]["signature_def"])
    serving_default = body["metadata"]["signature_def"]["signature_def"]["serving_default"]
    assert serving_default["inputs"]["x"]["dtype"] == "DT_FLOAT"


def test_predict_row_and_columnar_formats(api):
    assert call(api, "POST", "/v1/models/half_plus_two:predict", {"instances": [[1.0], [2.0]]}) == \
        (200, {"predictions": [[2.5], [3.0]]})
    assert call(api, "POST", "/v1/models/half_plus_two/versions/123:predict", {"inputs": {"x": [[1.0], [5.0]]}}) == \
        (200, {"outputs": [[2.5], [4.5]]})
    assert call(api, "POST", "/v1/models/half_plus_two/labels/stable:predict", {"inputs": [[3.0]]}) == \
        (200, {"outputs": [[3.5]]})


@pytest.mark.parametrize("rows", [2, 20_000])  # parsed on the event loop, and on the worker pool (INLINE_BYTES)
def test_a_body_is_freed_once_parsed_not_held_while_the_model_runs(api, rows):
    """Issue 31 #3: a pending request held its JSON body beside its tensors until answered."""
    body = bytearray(json.dumps({"instances": [[1.0]] * rows}).encode())
    status, answer = asyncio.run(api.handle("POST", "/v1/models/half_plus_two:predict", body))
    assert status == 200 and len(answer["predictions"]) == rows and len(body) == 0


def test_predict_reads_and_writes_nan_and_infinity(api):
    status, body = call(api, "POST", "/v1/models/half_plus_two:predict", b'{"instances": [[NaN], [Infinity]]}')
    assert status == 200
    assert np.isnan(body["predictions"][0][0]) and body["predictions"][1][0] == float("inf")


def test_classify_and_regress(api):
    status, body = call(api, "POST", "/v1/models/half_plus_two:classify",
                        {"signature_name": "classify_x_to_y", "examples": [{"x": 1.0}, {"x": 2.0}]})
    assert (status, body) == (200, {"results": [[["", 2.5]], [["", 3.0]]]})
    status, body = call(api, "POST", "/v1/models/half_plus_two:regress",
                        {"signature_name": "regress_x_to_y", "context": {"x": 3.0}, "examples": [{}, {"x": 1.5}]})
    assert (status, body) == (200, {"results": [3.5, 2.75]})


@pytest.mark.parametrize("method, path, body, status, message", [
    ("POST", "/v1/models/missing:predict", {"instances": [[1.0]]}, 404, "Servable not found for request: Latest"),
    ("GET", "/v1/models/half_plus_two/versions/9", None, 404, "Could not find version 9 of model half_plus_two"),
    ("GET", "/v1/models/half_plus_two/labels/nope", None, 400, "Unrecognized servable version label: nope"),
    ("POST", "/v1/models/half_plus_two:predict", b'{"instances": ', 400, "JSON Parse error"),
    ("POST", "/v1/models/half_plus_two:predict", {}, 400, "Missing 'inputs' or 'instances' key"),
    ("POST", "/v1/models/half_plus_two:predict", {"inputs": [[1.0]], "instances": [[1.0]]}, 400,
     "expecting only one of 'inputs' or 'instances'"),
    ("POST", "/v1/models/half_plus_two:predict", {"signature_name": "nope", "instances": [1.0]}, 400,
     'Serving signature name: "nope" not found'),
    ("POST", "/v1/models/half_plus_two:predict", {"inputs": {"y": [[1.0]]}}, 400, "does not have named input: y"),
    ("POST", "/v1/models/half_plus_two:predict", {"instances": [["a"]]}, 400, "Failed to process element"),
    ("POST", "/v1/models/half_plus_two:regress", {"signature_name": "nope", "examples": [{}]}, 400,
     "No signature was found with the name: nope"),
    ("POST", "/v1/models/half_plus_two:classify", {"signature_name": "classify_x_to_y"}, 400, "'examples'"),
    ("PUT", "/v1/models/half_plus_two", None, 400, "Malformed request: PUT /v1/models/half_plus_two"),
    ("GET", "/v2/health", None, 404, "Not found"),
])
def test_errors_are_json_with_tf_serving_status(api, method, path, body, status, message):
    got_status, got = call(api, method, path, body)
    assert got_status == status, got
    assert set(got) == {"error"} and message in got["error"]


def test_status_mapping_follows_http_server_cc():
    assert HTTP_STATUS[grpc.StatusCode.FAILED_PRECONDITION] == 400
    assert HTTP_STATUS[grpc.StatusCode.UNAVAILABLE] == 503
    assert HTTP_STATUS[grpc.StatusCode.UNIMPLEMENTED] == 501
    assert HTTP_STATUS[grpc.StatusCode.RESOURCE_EXHAUSTED] == 429


def test_b64_strings_and_float16_outputs(write_float16_model, tmp_path):
    write_float16_model(tmp_path / "halver" / "1")
    manager = ModelManager(file_system_poll_wait_seconds=0)
    manager.reload_config(model_config.single_model_config("halver", str(tmp_path / "halver")))
    api = rest_api(manager)
    assert call(api, "POST", "/v1/models/halver:predict", {"instances": [[1.0, 3.0]]}) == \
        (200, {"predictions": [[0.5, 1.5]]})  # DT_HALF written as numbers, unlike TF Serving


def test_http_server_answers_on_a_free_port(api):
    with serving(api._manager, rest_api_port=-1) as server:
        url = f"http://{server.rest_address}"
        status, body = _http("GET", f"{url}/v1/models/half_plus_two")
        assert status == 200 and body["model_version_status"][0]["state"] == "AVAILABLE"
        status, body = _http("POST", f"{url}/v1/models/half_plus_two:predict", {"instances": [[1.0]]})
        assert (status, body) == (200, {"predictions": [[2.5]]})
        status, body = _http("POST", f"{url}/v1/models/nope:predict", {"instances": [[1.0]]})
        assert status == 404 and "error" in body


def _http(method, url, body=None):
    data = json.dumps(body).encode() if body is not None else None
    request = urllib.request.Request(url, data=data, method=method, headers={"Content-Type": "application/json"})
    try:
        with urllib.request.urlopen(request, timeout=30) as response:
            return response.status, json.loads(response.read())
    except urllib.error.HTTPError as error:
        return error.code, json.loads(error.read())


@pytest.fixture(scope="module")
def served(exported_model, start_server, tmp_path_factory):
    log_dir = tmp_path_factory.mktemp("rest_e2e")
    parameters = log_dir / "batching.txt"
    parameters.write_text("max_batch_size { value: 64 }\nbatch_timeout_micros { value: 1000 }\n")
    server = start_server(f"--model_name={exported_model.model_name}", f"--model_base_path={exported_model.base_path}",
                          "--rest_api_port=-1", "--enable_batching", f"--batching_parameters_file={parameters}",
                          log_dir=log_dir)
    yield server, f"http://{server.rest_address}"
    assert server.stop() == 0, server.stderr_tail()


def test_rest_equals_grpc_on_a_real_server(served, exported_model):
    server, url = served
    rows = exported_model.val_x[:5]
    request = predict_pb2.PredictRequest()
    request.model_spec.name = exported_model.model_name
    request.inputs[exported_model.input_name].CopyFrom(tf.make_tensor_proto(rows))
    with grpc.insecure_channel(server.address) as channel:
        response = prediction_service_pb2_grpc.PredictionServiceStub(channel).Predict(request, timeout=30)
    grpc_outputs = {name: tf.make_ndarray(proto) for name, proto in response.outputs.items()}

    status, body = _http("POST", f"{url}/v1/models/{exported_model.model_name}:predict",
                         {"inputs": {exported_model.input_name: rows.tolist()}})
    assert status == 200, body
    columnar = body["outputs"] if len(grpc_outputs) > 1 else {next(iter(grpc_outputs)): body["outputs"]}
    status, body = _http("POST", f"{url}/v1/models/{exported_model.model_name}:predict",
                         {"instances": [{exported_model.input_name: row.tolist()} for row in rows]})
    assert status == 200, body
    for name, array in grpc_outputs.items():
        np.testing.assert_allclose(np.array(columnar[name]), array, rtol=1e-6, atol=1e-7, err_msg=name)
        by_row = [row[name] for row in body["predictions"]] if len(grpc_outputs) > 1 else body["predictions"]
        np.testing.assert_allclose(np.array(by_row), array, rtol=1e-6, atol=1e-7, err_msg=name)

    status, body = _http("GET", f"{url}/v1/models/{exported_model.model_name}")
    assert status == 200 and body["model_version_status"][0]["state"] == "AVAILABLE"


def _nested(depth: int, leaf: str = "1.0") -> bytes:
    return ('{"instances": ' + "[" * depth + leaf + "]" * depth + "}").encode()


PREDICT = "/v1/models/half_plus_two:predict"


@pytest.mark.parametrize("method, path, body, status, message", [
    ("POST", PREDICT, _nested(5000), 400, "JSON Parse error: arrays and objects nested deeper than 100 levels"),
    ("POST", PREDICT, b'{"instances": [[' + b"9" * 5000 + b"]]}", 400,
     "JSON Parse error: a number of 5000 characters; at most 1000 are allowed"),
    ("POST", PREDICT, _nested(70), 400, "Failed to process element: input 'x' of type float"),
    ("POST", PREDICT, b'{"instances": [[' + b"9" * 400 + b"]]}", 400, "its JSON values must all be numbers"),
    ("POST", PREDICT, b'{"instances": [[null]]}', 400, "its JSON values must all be numbers"),
    ("POST", PREDICT, b'{"instances": [["1.5"]]}', 400, "its JSON values must all be numbers"),
    ("POST", PREDICT, b'{"instances": [[1.0], [2.0, 3.0]]}', 400, "inhomogeneous"),
    ("POST", PREDICT, b'{"signature_name": "classify_x_to_y", "inputs": [["a"], ["b", "c"]]}', 400,
     "Failed to process element: input 'inputs' of type string: lists at one level must all have the same length"),
    ("POST", PREDICT, b'{"signature_name": "classify_x_to_y", "inputs": ' + b"[" * 40 + b'"a"' + b"]" * 40 + b"}", 400,
     "Failed to process element: input 'inputs' of type string"),
    ("POST", PREDICT, b'{"signature_name": "\\ud800", "instances": [[1.0]]}', 400, "is not valid UTF-8 text"),
    ("POST", "/v1/models/half_plus_two:regress", b'{"examples": [{"x": ' + b"9" * 30 + b"}]}", 400,
     "feature 'x': Value out of range"),
    ("POST", "/v1/models/half_plus_two/versions/" + "9" * 30 + ":predict", {"instances": [[1.0]]}, 400,
     "Failed to convert version: " + "9" * 30 + " to numeric."),
    ("GET", "/v1/models/half_plus_two/versions/" + "9" * 5000, None, 400, "Failed to convert version: 999"),
    ("GET", "/v1/models/half_plus_two/versions/\u0663", None, 400, "Malformed request: GET"),
    ("POST", PREDICT, b'{"instances": [[1.0]]', 400, "JSON Parse error"),
    ("POST", PREDICT, b"\xff\xfe{", 400, "JSON Parse error"),
], ids=["deep", "5000 digits", "rank 70", "400 digits", "null", "string number", "ragged", "ragged strings",
        "deep strings", "lone surrogate", "int beyond int64", "huge version", "5000-digit version",
        "arabic digit version", "truncated", "not utf-8"])
def test_malformed_json_is_400_in_one_line(api, caplog, method, path, body, status, message):
    with caplog.at_level(logging.DEBUG):
        got_status, got = call(api, method, path, body)
    assert got_status == status, got
    assert message in got["error"] and "\n" not in got["error"] and len(got["error"]) < 400
    assert not [record for record in caplog.records if record.exc_info], "a client's mistake logged a traceback"


def test_json_limits_leave_ordinary_bodies_alone(api):
    rows = [[float(i)] for i in range(2000)]  # more brackets than the depth limit, none of them deep
    status, body = call(api, "POST", PREDICT, {"instances": rows, "signature_name": "[[[[" * 30})
    assert status == 400 and 'Serving signature name: "[[[[' in body["error"]  # brackets in strings do not count
    assert call(api, "POST", PREDICT, {"instances": rows})[1]["predictions"][-1] == [1001.5]
    assert call(api, "POST", PREDICT, b'{"instances": [[1e300], [' + b"1" * 300 + b'.5]]}')[0] == 200


@pytest.fixture(scope="module")
def guarded(built_testdata, start_server, tmp_path_factory):
    """A server with a small REST connection cap and one-second timeouts."""
    root = tmp_path_factory.mktemp("rest_guarded")
    base_path = root / "half_plus_two"
    shutil.copytree(built_testdata / "saved_model_half_plus_two_cpu", base_path, copy_function=shutil.copyfile)
    for path in [base_path, *base_path.rglob("*")]:
        path.chmod(path.stat().st_mode | 0o200)
    server = start_server("--model_name=half_plus_two", f"--model_base_path={base_path}", "--rest_api_port=-1",
                          "--rest_api_max_connections=40", "--rest_api_idle_timeout_s=1",
                          "--rest_api_read_timeout_s=1", log_dir=root)
    yield server
    assert server.stop() == 0, server.stderr_tail()


def test_half_sent_requests_do_not_exhaust_the_server(guarded):
    """200 sockets that never finish their request: past the cap they get 503 at once, the rest are closed
    after the timeouts, gRPC answers throughout, and REST answers again once they are gone."""
    host, port = guarded.rest_address.rsplit(":", 1)
    process = psutil.Process(guarded.process.pid)
    descriptors = process.num_fds()
    sockets = []
    try:
        for i in range(200):
            sock = socket.create_connection((host, int(port)), timeout=10)
            head = f"POST {PREDICT} HTTP/1.1\r\nHost: x\r\nContent-Length: 100\r\n"
            sock.sendall((head + '\r\n{"inst').encode() if i % 2 else head.encode())  # body cut / head cut
            sockets.append(sock)
        # the cap (40), not 200: refused connections close on the server's next event-loop turns
        wait_for(lambda: process.num_fds() < descriptors + 50, timeout_s=10)
        assert _grpc_predict(guarded.address) == [2.5]  # gRPC unaffected
        answers = [_read_all(sock) for sock in sockets]  # each closed by the server: 503, 408, or nothing
    finally:
        for sock in sockets:
            sock.close()
    refused = sum(answer.startswith(b"HTTP/1.1 503") for answer in answers)
    timed_out = sum(answer.startswith(b"HTTP/1.1 408") for answer in answers)
    assert refused and timed_out and refused + timed_out + answers.count(b"") == 200, answers[:3]
    status, body = _http("POST", f"http://{guarded.rest_address}{PREDICT}", {"instances": [[1.0]]})
    assert (status, body) == (200, {"predictions": [[2.5]]})
    assert "Traceback" not in guarded.stderr_path.read_text()


@pytest.mark.parametrize("raw", [b"NOT HTTP AT ALL\r\n\r\n", b"GET /v1/models/half_plus_two HTTP/1.1\r\nX: " +
                                 b"a" * 10000 + b"\r\n\r\n", b"POST /v1/models/x:predict HTTP/1.1\r\nContent-Length: -5\r\n\r\n"],
                         ids=["garbage", "long header", "negative length"])
def test_malformed_http_is_400_without_a_traceback(guarded, raw):
    host, port = guarded.rest_address.rsplit(":", 1)
    with socket.create_connection((host, int(port)), timeout=10) as sock:
        sock.sendall(raw)
        assert _read_all(sock).split(b" ")[1] == b"400"
    assert "Traceback" not in guarded.stderr_path.read_text()


def _grpc_predict(address):
    request = predict_pb2.PredictRequest()
    request.model_spec.name = "half_plus_two"
    request.inputs["x"].CopyFrom(tf.make_tensor_proto(np.array([[1.0]], np.float32)))
    with grpc.insecure_channel(address) as channel:
        return list(prediction_service_pb2_grpc.PredictionServiceStub(channel).Predict(request, timeout=10)
                    .outputs["y"].float_val)


def _read_all(sock) -> bytes:
    """What the server sends until it closes the connection (at most 10 s)."""
    sock.settimeout(10)
    data = b""
    try:
        while chunk := sock.recv(4096):
            data += chunk
    except ConnectionResetError:
        pass
    return data


def test_a_rest_request_past_rest_api_timeout_in_ms_gets_504(tmp_path, write_gate_model):
    """--rest_api_timeout_in_ms, TF Serving's deadline on a REST model run (KServe passes 60000): past it,
    DEADLINE_EXCEEDED "Timed out waiting for notification", HTTP 504; the server answers the next request."""
    write_gate_model(tmp_path / "gate" / "1")
    manager = ModelManager(file_system_poll_wait_seconds=0, enable_model_warmup=False)
    manager.reload_config(model_config.single_model_config("gate", str(tmp_path / "gate")))
    try:
        with serving(manager, rest_api_port=-1, rest_api_timeout_in_ms=500) as server:
            url = f"http://{server.rest_address}/v1/models/gate:predict"
            start = time.monotonic()
            status, body = _http("POST", url, {"inputs": {"dir": str(tmp_path)}})
            assert (status, body) == (504, {"error": "Timed out waiting for notification"})
            assert time.monotonic() - start < 10
            (tmp_path / "release").touch()
            status, body = _http("POST", url, {"inputs": {"dir": str(tmp_path)}})
            assert status == 200 and body["outputs"] >= 0
    finally:
        (tmp_path / "release").touch()
        manager.stop()
