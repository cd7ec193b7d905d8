"""TF Serving's REST API: routes, JSON tensor rules, error mapping, and REST == gRPC on a real server."""

from __future__ import annotations

import json
import urllib.error
import urllib.request

import grpc
import numpy as np
import pytest
import tensorflow as tf
from tensorflow_serving.apis import predict_pb2, prediction_service_pb2_grpc

from serving import model_config
from serving.model_manager import ModelManager
from serving.prediction_service import PredictionService
from serving.rest import HTTP_STATUS, RestApi, RestServer

pytestmark = pytest.mark.timeout(300)


@pytest.fixture(scope="module")
def api(copy_testdata, tmp_path_factory):
    base_path = copy_testdata("saved_model_half_plus_two_cpu", tmp_path_factory.mktemp("rest") / "half_plus_two")
    config = model_config.single_model_config("half_plus_two", str(base_path))
    config.model_config_list.config[0].version_labels["stable"] = 123
    manager = ModelManager(file_system_poll_wait_seconds=0, allow_version_labels_for_unavailable_models=True)
    manager.reload_config(config)
    return RestApi(manager, PredictionService(manager))


def call(api, method, path, body=None):
    return api.handle(method, path, json.dumps(body).encode() if isinstance(body, dict) else (body or b""))


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
    api = RestApi(manager, PredictionService(manager))
    assert call(api, "POST", "/v1/models/halver:predict", {"instances": [[1.0, 3.0]]}) == \
        (200, {"predictions": [[0.5, 1.5]]})  # DT_HALF written as numbers, unlike TF Serving


def test_http_server_answers_on_a_free_port(api):
    server = RestServer(api, max_threads=2)
    port = server.start("127.0.0.1", 0)
    try:
        status, body = _http("GET", f"http://127.0.0.1:{port}/v1/models/half_plus_two")
        assert status == 200 and body["model_version_status"][0]["state"] == "AVAILABLE"
        status, body = _http("POST", f"http://127.0.0.1:{port}/v1/models/half_plus_two:predict", {"instances": [[1.0]]})
        assert (status, body) == (200, {"predictions": [[2.5]]})
        status, body = _http("POST", f"http://127.0.0.1:{port}/v1/models/nope:predict", {"instances": [[1.0]]})
        assert status == 404 and "error" in body
    finally:
        server.stop(grace_s=1)


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
