"""`python -m serving` as a subprocess, over a real channel, against TF Serving's own fixtures and contract.

One server serves two models (via --model_config_file, as tensorflow_model_server would):
  half_plus_two  TF Serving's TF1 fixture: y = x / 2 + 2, version 123
  halver         a foreign TF2 model whose output is float16 (DT_HALF)
  gate           a model whose call blocks until a file appears (to hold a request in flight)
The SIGTERM test runs last and stops that server.
"""

from __future__ import annotations

import json
import re
import signal

import grpc
import numpy as np
import pytest
import tensorflow as tf
from google.protobuf import json_format
from grpc_health.v1 import health_pb2, health_pb2_grpc
from tensorflow.core.framework import tensor_pb2, types_pb2
from tensorflow_serving.apis import (classification_pb2, get_model_metadata_pb2, get_model_status_pb2,
                                     inference_pb2, model_management_pb2, model_service_pb2_grpc, predict_pb2,
                                     prediction_service_pb2_grpc, regression_pb2)

from server_helpers import wait_for

pytestmark = pytest.mark.timeout(180)
X = np.array([[1.0], [2.0], [5.0]], np.float32)
CLASSIFY, REGRESS = "tensorflow/serving/classify", "tensorflow/serving/regress"


@pytest.fixture(scope="module")
def server(tmp_path_factory, start_server, copy_testdata, write_float16_model, write_gate_model):
    root = tmp_path_factory.mktemp("tfserving")
    half_plus_two = copy_testdata("saved_model_half_plus_two_cpu", root / "half_plus_two")
    write_float16_model(root / "halver" / "1")
    write_gate_model(root / "gate" / "1")
    config = root / "models.config"
    config.write_text(f"""model_config_list {{
  config {{ name: "half_plus_two" base_path: "{half_plus_two}" model_platform: "tensorflow" }}
  config {{ name: "halver" base_path: "{root / 'halver'}" model_platform: "tensorflow" }}
  config {{ name: "gate" base_path: "{root / 'gate'}" model_platform: "tensorflow" }}
}}
""")
    process = start_server(f"--model_config_file={config}", "--grace_period_s=30", log_dir=root)
    yield process
    process.stop()


@pytest.fixture(scope="module")
def channel(server):
    with grpc.insecure_channel(server.address) as channel:
        yield channel


@pytest.fixture(scope="module")
def prediction(channel):
    return prediction_service_pb2_grpc.PredictionServiceStub(channel)


def predict_request(model="half_plus_two", x=X, **spec) -> predict_pb2.PredictRequest:
    request = predict_pb2.PredictRequest()
    request.model_spec.name = model
    for key, value in spec.items():
        if key == "version":
            request.model_spec.version.value = value
        else:
            setattr(request.model_spec, key, value)
    request.inputs["x"].CopyFrom(tf.make_tensor_proto(x))
    return request


def test_prints_one_ready_line(server):
    assert server.ready_line.startswith("Running gRPC ModelServer at 127.0.0.1:")
    assert server.stdout_path.read_text().splitlines()[0] == server.ready_line  # the first thing on stdout
    assert re.match(r"\d\d:\d\d:\d\d serving", server.stderr_path.read_text())  # the log starts with ours, not TF's


def test_half_plus_two_predict(prediction):
    response = prediction.Predict(predict_request(), timeout=10)
    assert response.outputs["y"].dtype == types_pb2.DT_FLOAT
    np.testing.assert_array_equal(tf.make_ndarray(response.outputs["y"]), [[2.5], [3.0], [4.5]])
    assert list(response.outputs["y"].float_val) == [2.5, 3.0, 4.5]  # TF Serving's typed-field encoding
    assert (response.model_spec.name, response.model_spec.version.value, response.model_spec.signature_name) == \
        ("half_plus_two", 123, "serving_default")


def test_half_plus_two_predict_specific_version_and_float_val_input(prediction):
    request = predict_request(version=123)
    request.inputs["x"].CopyFrom(tensor_pb2.TensorProto(
        dtype=types_pb2.DT_FLOAT, tensor_shape={"dim": [{"size": 3}, {"size": 1}]}, float_val=[1, 2, 5]))
    response = prediction.Predict(request, timeout=10)
    np.testing.assert_array_equal(tf.make_ndarray(response.outputs["y"]), [[2.5], [3.0], [4.5]])


def test_float16_output_stays_dt_half(prediction):
    x = np.array([[1.0, 3.0]], np.float32)
    response = prediction.Predict(predict_request("halver", x), timeout=10)
    assert response.outputs["y"].dtype == types_pb2.DT_HALF
    y = tf.make_ndarray(response.outputs["y"])
    assert y.dtype == np.float16
    np.testing.assert_array_equal(y, [[0.5, 1.5]])


def test_get_model_metadata_matches_tf_serving(prediction, tfserving_testdata):
    request = get_model_metadata_pb2.GetModelMetadataRequest(metadata_field=["signature_def"])
    request.model_spec.name = "half_plus_two"
    response = prediction.GetModelMetadata(request, timeout=10)
    assert (response.model_spec.name, response.model_spec.version.value) == ("half_plus_two", 123)
    served = get_model_metadata_pb2.SignatureDefMap()
    assert response.metadata["signature_def"].Unpack(served)
    # TF Serving's own expected answer for this model, from its test data.
    expected = get_model_metadata_pb2.SignatureDefMap()
    fixture = json.loads((tfserving_testdata / "half_plus_two_model_metadata.json").read_text())
    json_format.ParseDict(fixture["metadata"]["signature_def"], expected, ignore_unknown_fields=True)
    assert served == expected


def test_get_model_status(channel):
    stub = model_service_pb2_grpc.ModelServiceStub(channel)
    for spec in ({"name": "half_plus_two"}, {"name": "half_plus_two", "version": {"value": 123}}):
        response = stub.GetModelStatus(get_model_status_pb2.GetModelStatusRequest(model_spec=spec), timeout=10)
        [status] = response.model_version_status
        assert (status.version, status.state) == (123, get_model_status_pb2.ModelVersionStatus.AVAILABLE)
        assert status.status.error_code == 0 and status.status.error_message == ""


def test_reload_over_the_network_is_refused_by_default(channel):
    """Unlike TF Serving: any client of the port could otherwise replace the model list (docs/operations.md)."""
    stub = model_service_pb2_grpc.ModelServiceStub(channel)
    request = model_management_pb2.ReloadConfigRequest()
    request.config.model_config_list.SetInParent()  # an empty list: it would unload every model
    with pytest.raises(grpc.RpcError) as error:
        stub.HandleReloadConfigRequest(request, timeout=10)
    assert (error.value.code(), error.value.details()) == (
        grpc.StatusCode.UNIMPLEMENTED, "HandleReloadConfigRequest is disabled on this server; the operator can "
                                       "enable it with --allow_network_model_config_reload")
    assert stub.GetModelStatus(get_model_status_pb2.GetModelStatusRequest(model_spec={"name": "half_plus_two"}),
                               timeout=10).model_version_status[0].state == get_model_status_pb2.ModelVersionStatus.AVAILABLE


def test_health_serving(channel):
    stub = health_pb2_grpc.HealthStub(channel)
    for service in ("", "half_plus_two", "halver"):
        reply = stub.Check(health_pb2.HealthCheckRequest(service=service), timeout=10)
        assert reply.status == health_pb2.HealthCheckResponse.SERVING
    with pytest.raises(grpc.RpcError) as error:
        stub.Check(health_pb2.HealthCheckRequest(service="nope"), timeout=10)
    assert error.value.code() == grpc.StatusCode.NOT_FOUND


def _replace_x(value):
    """A mutator that swaps the request's 'x' for another array or proto."""
    proto = value if isinstance(value, tensor_pb2.TensorProto) else tf.make_tensor_proto(value)
    return lambda request: request.inputs["x"].CopyFrom(proto)


def _to_halver(x):
    """A mutator that sends x to the TF2 model instead."""
    def mutate(request):
        request.model_spec.name = "halver"
        request.inputs["x"].CopyFrom(tf.make_tensor_proto(x))
    return mutate


# case -> (mutate the good request in place, expected code, expected message fragment)
BAD_PREDICTS = {
    "unknown model": (lambda r: setattr(r.model_spec, "name", "nope"),
                      grpc.StatusCode.NOT_FOUND, "Servable not found for request: Latest(nope)"),
    "unknown version": (lambda r: setattr(r.model_spec.version, "value", 42),
                        grpc.StatusCode.NOT_FOUND, "Servable not found for request: Specific(half_plus_two, 42)"),
    "no model name": (lambda r: setattr(r.model_spec, "name", ""),
                      grpc.StatusCode.INVALID_ARGUMENT, "ModelSpec has no name specified"),
    "unknown signature": (lambda r: setattr(r.model_spec, "signature_name", "nope"),
                          grpc.StatusCode.FAILED_PRECONDITION, 'Serving signature key "nope" not found'),
    # TF Serving's wording (predict_util.cc, tensorflow/cc/saved_model/util.cc, TF's dtype check).
    "missing input": (lambda r: r.inputs.clear(), grpc.StatusCode.INVALID_ARGUMENT,
                      "input size does not match signature: 0!=1 len({}) != len({x}). Sent extra: {}. "
                      "Missing but required: {x}."),
    "extra input": (lambda r: r.inputs["z"].CopyFrom(tf.make_tensor_proto(X)),
                    grpc.StatusCode.INVALID_ARGUMENT, "Sent extra: {z}."),
    "wrong dtype": (_replace_x(X.astype(np.float64)),
                    grpc.StatusCode.INVALID_ARGUMENT, "Expects arg[0] to be float but double is provided"),
    # Shapes are checked against a TF2 signature (halver: x [-1, 2]); a TF1 model is fed by tensor name and
    # takes any shape its ops take, as in TF Serving (half_plus_two answers x of shape [3, 2] elementwise).
    "wrong shape": (_to_halver(np.ones((3, 3), np.float32)),
                    grpc.StatusCode.INVALID_ARGUMENT, "input 'x': expected shape [-1, 2], got [3, 3]"),
    "wrong rank": (_to_halver(np.ones(3, np.float32)),
                   grpc.StatusCode.INVALID_ARGUMENT, "input 'x': expected shape [-1, 2], got [3]"),
    "bad output_filter": (lambda r: r.output_filter.append("nope"),
                          grpc.StatusCode.INVALID_ARGUMENT, "output tensor alias not found in signature: nope"),
    "malformed tensor": (_replace_x(tensor_pb2.TensorProto(dtype=types_pb2.DT_FLOAT, tensor_shape={"dim": [{"size": 2}]},
                                                           tensor_content=b"abc")),
                         grpc.StatusCode.INVALID_ARGUMENT, "tensor parsing error: x"),
}


@pytest.mark.parametrize("case", list(BAD_PREDICTS))
def test_bad_predict_gets_status_and_server_keeps_answering(prediction, case):
    mutate, code, message = BAD_PREDICTS[case]
    request = predict_request()
    mutate(request)
    with pytest.raises(grpc.RpcError) as error:
        prediction.Predict(request, timeout=10)
    assert error.value.code() == code
    assert message in error.value.details()
    assert "\n" not in error.value.details()
    assert prediction.Predict(predict_request(), timeout=10).outputs["y"].float_val == [2.5, 3.0, 4.5]


def add_example(input, x: float = 2.0) -> None:
    input.example_list.examples.add().features.feature["x"].float_list.value.append(x)


def classification_request(signature_name="classify_x_to_y", model="half_plus_two"):
    request = classification_pb2.ClassificationRequest(model_spec={"name": model, "signature_name": signature_name})
    add_example(request.input)
    return request


def regression_request(signature_name="regress_x_to_y", model="half_plus_two"):
    request = regression_pb2.RegressionRequest(model_spec={"name": model, "signature_name": signature_name})
    add_example(request.input)
    return request


def multi_inference_request(*tasks, model="half_plus_two"):
    request = inference_pb2.MultiInferenceRequest()
    for signature_name, method_name in tasks or [("regress_x_to_y", REGRESS), ("classify_x_to_y", CLASSIFY)]:
        request.tasks.add(model_spec={"name": model, "signature_name": signature_name}, method_name=method_name)
    add_example(request.input)
    return request


def model_spec_of(message) -> tuple[str, int, str]:
    return message.model_spec.name, message.model_spec.version.value, message.model_spec.signature_name


def test_classify(prediction):
    """tensorflow_model_server_test.py testClassify: x = 2.0 scores 3.0, and the model_spec is echoed."""
    result = prediction.Classify(classification_request(), timeout=10)
    assert [[c.score for c in row.classes] for row in result.result.classifications] == [[3.0]]
    assert model_spec_of(result) == ("half_plus_two", 123, "classify_x_to_y")


def test_regress(prediction):
    """tensorflow_model_server_test.py testRegress."""
    result = prediction.Regress(regression_request(), timeout=10)
    assert [r.value for r in result.result.regressions] == [3.0]
    assert model_spec_of(result) == ("half_plus_two", 123, "regress_x_to_y")


def test_multi_inference(prediction):
    """tensorflow_model_server_test.py testMultiInference: one result per task, in order, each with its model_spec."""
    result = prediction.MultiInference(multi_inference_request(), timeout=10)
    assert len(result.results) == 2
    assert result.results[0].regression_result.regressions[0].value == 3.0
    assert result.results[1].classification_result.classifications[0].classes[0].score == 3.0
    assert [model_spec_of(r) for r in result.results] == [("half_plus_two", 123, "regress_x_to_y"),
                                                          ("half_plus_two", 123, "classify_x_to_y")]


def test_predict_signature_name_and_output_filter(prediction):
    """tensorflow_model_server_test.py VerifyPredictRequest: float_val input, with and without output_filter."""
    for signature_name, output_filter in (("", ["y"]), ("serving_default", [])):
        request = predict_pb2.PredictRequest(model_spec={"name": "half_plus_two", "signature_name": signature_name},
                                             output_filter=output_filter)
        request.inputs["x"].CopyFrom(tensor_pb2.TensorProto(dtype=types_pb2.DT_FLOAT,
                                                            tensor_shape={"dim": [{"size": 1}]}, float_val=[2.0]))
        response = prediction.Predict(request, timeout=10)
        assert list(response.outputs["y"].float_val) == [3.0]
        assert model_spec_of(response) == ("half_plus_two", 123, "serving_default")


def _without_examples(request):
    request.input.Clear()
    return request


# case -> (RPC, request, expected code, expected message start). The unknown-signature code is TF Serving's
# per RPC: FAILED_PRECONDITION in Predict (BAD_PREDICTS), INVALID_ARGUMENT in Classify/Regress/MultiInference.
BAD_INFERENCES = {
    "classify unknown signature": ("Classify", classification_request("nope"), grpc.StatusCode.INVALID_ARGUMENT,
                                   "No signature was found with the name: nope"),
    "regress unknown signature": ("Regress", regression_request("nope"), grpc.StatusCode.INVALID_ARGUMENT,
                                  "No signature was found with the name: nope"),
    "multi unknown signature": ("MultiInference", multi_inference_request(("nope", REGRESS)),
                                grpc.StatusCode.INVALID_ARGUMENT, "Requested signature not found in model graph: nope"),
    "classify no model_spec": ("Classify", classification_pb2.ClassificationRequest(),
                               grpc.StatusCode.INVALID_ARGUMENT, "Missing ModelSpec"),
    "regress unknown model": ("Regress", regression_request(model="nope"), grpc.StatusCode.NOT_FOUND,
                              "Servable not found for request: Latest(nope)"),
    "classify empty input": ("Classify", _without_examples(classification_request()), grpc.StatusCode.INVALID_ARGUMENT,
                             "Input is empty."),
    "regress empty input": ("Regress", _without_examples(regression_request()), grpc.StatusCode.INVALID_ARGUMENT,
                            "Input is empty."),
    "classify a predict signature": ("Classify", classification_request(""), grpc.StatusCode.INVALID_ARGUMENT,
                                     "No classification inputs found in SignatureDef"),
    "regress a classify signature": ("Regress", regression_request("classify_x_to_y"), grpc.StatusCode.INVALID_ARGUMENT,
                                     "No regression outputs found in SignatureDef"),
    "regress a float input": ("Regress", regression_request("regress_x2_to_y3"), grpc.StatusCode.INVALID_ARGUMENT,
                              "Expects arg[0] to be float but string is provided"),
    "multi predict task": ("MultiInference", multi_inference_request(("serving_default", "tensorflow/serving/predict")),
                           grpc.StatusCode.UNIMPLEMENTED,
                           "Unsupported signature method_name: tensorflow/serving/predict"),
    "multi duplicate": ("MultiInference",
                        multi_inference_request(("regress_x_to_y", REGRESS), ("regress_x_to_y", REGRESS)),
                        grpc.StatusCode.INVALID_ARGUMENT, "Duplicate evaluation of signature: regress_x_to_y"),
    "multi different inputs": ("MultiInference",
                               multi_inference_request(("regress_x_to_y", REGRESS), ("regress_x2_to_y3", REGRESS)),
                               # multi_inference.cc feeds the examples to both inputs in one run; x2 is a float
                               grpc.StatusCode.INVALID_ARGUMENT, "Expects arg[0] to be float but string is provided"),
}


@pytest.mark.parametrize("case", list(BAD_INFERENCES))
def test_bad_inference_gets_status_and_server_keeps_answering(prediction, case):
    rpc, request, code, message = BAD_INFERENCES[case]
    with pytest.raises(grpc.RpcError) as error:
        getattr(prediction, rpc)(request, timeout=10)
    assert (error.value.code(), error.value.details()[:len(message)]) == (code, message), error.value.details()
    assert "\n" not in error.value.details()
    assert prediction.Regress(regression_request(), timeout=10).result.regressions[0].value == 3.0


@pytest.mark.parametrize("fields, spec, code, message", [
    (["signature_def", "foo"], {"name": "half_plus_two"}, grpc.StatusCode.INVALID_ARGUMENT, "Metadata field foo is not supported"),
    ([], {"name": "half_plus_two"}, grpc.StatusCode.INVALID_ARGUMENT, "must specify at least one metadata_field"),
    (["signature_def"], None, grpc.StatusCode.INVALID_ARGUMENT, "Missing ModelSpec"),
    (["signature_def"], {"name": "nope"}, grpc.StatusCode.NOT_FOUND, "Servable not found for request: Latest(nope)"),
])
def test_bad_get_model_metadata(prediction, fields, spec, code, message):
    request = get_model_metadata_pb2.GetModelMetadataRequest(metadata_field=fields, model_spec=spec)
    with pytest.raises(grpc.RpcError) as error:
        prediction.GetModelMetadata(request, timeout=10)
    assert (error.value.code(), message in error.value.details()) == (code, True), error.value.details()


@pytest.mark.parametrize("spec, message", [
    ({"name": "half_plus_two", "version": {"value": 42}}, "Could not find version 42 of model half_plus_two"),
    ({"name": "nope"}, "Could not find any versions of model nope"),
])
def test_get_model_status_not_found(channel, spec, message):
    stub = model_service_pb2_grpc.ModelServiceStub(channel)
    with pytest.raises(grpc.RpcError) as error:
        stub.GetModelStatus(get_model_status_pb2.GetModelStatusRequest(model_spec=spec), timeout=10)
    assert (error.value.code(), error.value.details()) == (grpc.StatusCode.NOT_FOUND, message)


def test_sigterm_lets_the_in_flight_request_finish_and_exits_0(server, channel, prediction, tmp_path):
    """Runs last in this module: it stops the shared server. While draining, health says NOT_SERVING and,
    after a moment's grace for calls gRPC already held, new calls are refused (UNAVAILABLE: retry
    elsewhere); the call accepted before is answered."""
    request = predict_pb2.PredictRequest(model_spec={"name": "gate"})
    request.inputs["dir"].CopyFrom(tf.make_tensor_proto(str(tmp_path)))
    in_flight = prediction.Predict.future(request, timeout=60)
    try:
        wait_for(lambda: (tmp_path / "started").exists() or in_flight.done(), timeout_s=20)
        assert (tmp_path / "started").exists(), in_flight.exception()
        server.process.send_signal(signal.SIGTERM)
        wait_for(lambda: "health NOT_SERVING" in server.stderr_path.read_text(), timeout_s=10)
        assert server.process.poll() is None, "the server exited with a request in flight"
        health = health_pb2_grpc.HealthStub(channel)
        for service in ("", "half_plus_two"):
            assert health.Check(health_pb2.HealthCheckRequest(service=service), timeout=10).status == \
                health_pb2.HealthCheckResponse.NOT_SERVING

        def refused():
            try:
                prediction.Predict(predict_request(), timeout=10)  # answered during the moment's grace
            except grpc.RpcError as error:
                return error.code(), error.details()

        assert wait_for(refused, timeout_s=10) == (
            grpc.StatusCode.UNAVAILABLE, "the server is shutting down; send the request to another server")
    finally:
        (tmp_path / "release").touch()  # never leave a server thread polling
    assert tf.make_ndarray(in_flight.result().outputs["polls"]) > 0
    assert server.process.wait(30) == 0
    assert server.stdout_path.read_text().splitlines() == [server.ready_line]  # nothing after the ready line
