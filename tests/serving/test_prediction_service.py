"""PredictionService in-process over a real channel: model resolution, Missing ModelSpec, the method-name flag.

The servicer needs one thing from the model manager, resolve(model_spec) -> (version, Runner); the
tests give it a stand-in over real Runners of TF Serving's fixtures (half_plus_two TF1, tf2 = native
TF2 classify/regress signatures, half_plus_three TF1), so they check the servicer alone. The real
manager behind a real server is tested in test_server_tfserving.py. What each RPC computes is tested
in test_inference.py.
"""

from __future__ import annotations

import contextlib

import grpc
import pytest
import tensorflow as tf
from tensorflow_serving.apis import (classification_pb2, inference_pb2, model_pb2, predict_pb2,
                                     prediction_service_pb2_grpc, regression_pb2)

from serving.servable.runner import Runner
from serving.errors import InvalidArgument, NotFound
from server_helpers import serving

pytestmark = pytest.mark.timeout(120)
CLASSIFY, REGRESS = "tensorflow/serving/classify", "tensorflow/serving/regress"


class Models:
    """Stands in for ModelManager: resolve(model_spec), name (and optional version) -> the one loaded Runner;
    no request scopes, no models to report to health."""

    model_names: list[str] = []

    def __init__(self) -> None:
        self.runners: dict[str, Runner] = {}
        self.resolved: list[model_pb2.ModelSpec] = []

    def request_scope(self):
        return contextlib.nullcontext()

    def add_listener(self, listener) -> None:
        pass

    def remove_listener(self, listener) -> None:
        pass

    def resolve(self, model_spec: model_pb2.ModelSpec) -> tuple[int, Runner]:
        self.resolved.append(model_pb2.ModelSpec())
        self.resolved[-1].CopyFrom(model_spec)
        if not model_spec.name:
            raise InvalidArgument("ModelSpec has no name specified.")
        runner = self.runners.get(model_spec.name)
        if runner is None or (model_spec.HasField("version") and model_spec.version.value != runner.version):
            raise NotFound(f"Servable not found for request: {model_spec.name}")
        return runner.version, runner


@pytest.fixture(scope="module")
def manager(tmp_path_factory, copy_testdata) -> Models:
    root = tmp_path_factory.mktemp("prediction_service")
    models = Models()
    for name, fixture in (("half_plus_two", "saved_model_half_plus_two_cpu"),
                          ("tf2", "saved_model_half_plus_two_tf2_cpu")):
        models.runners[name] = Runner.load(copy_testdata(fixture, root / name), model_name=name)
    return models


@pytest.fixture(scope="module")
def stubs(manager):
    """{False: a server as tensorflow_model_server starts by default, True: one with the method-name check}."""
    with serving(manager, grpc_max_threads=2) as default, serving(
            manager, grpc_max_threads=2, enable_signature_method_name_check=True) as checking:
        channels = {False: grpc.insecure_channel(default.grpc_address),
                    True: grpc.insecure_channel(checking.grpc_address)}
        yield {check: prediction_service_pb2_grpc.PredictionServiceStub(channel) for check, channel in channels.items()}
        for channel in channels.values():
            channel.close()


@pytest.fixture(scope="module")
def default_stub(stubs):
    return stubs[False]


def add_example(input, x: float) -> None:
    input.example_list.examples.add().features.feature["x"].float_list.value.append(x)


def classification_request(model="half_plus_two", signature_name="classify_x_to_y", x=2.0):
    request = classification_pb2.ClassificationRequest(model_spec={"name": model, "signature_name": signature_name})
    add_example(request.input, x)
    return request


def regression_request(model="half_plus_two", signature_name="regress_x_to_y", x=2.0):
    request = regression_pb2.RegressionRequest(model_spec={"name": model, "signature_name": signature_name})
    add_example(request.input, x)
    return request


def multi_request(*tasks, model="half_plus_two", x=2.0):
    request = inference_pb2.MultiInferenceRequest()
    for signature_name, method_name in tasks:
        request.tasks.add(model_spec={"name": model, "signature_name": signature_name}, method_name=method_name)
    add_example(request.input, x)
    return request


def rpc_error(call, request) -> grpc.RpcError:
    with pytest.raises(grpc.RpcError) as raised:
        call(request, timeout=10)
    return raised.value


@pytest.mark.parametrize("check", [False, True])
def test_tf1_classify_regress_multi_inference_with_or_without_the_check(stubs, check):
    """TF Serving's testClassify/testRegress/testMultiInference: TF1 signatures have the right method names."""
    stub = stubs[check]
    classified = stub.Classify(classification_request(), timeout=10)
    assert classified.result.classifications[0].classes[0].score == 3.0
    assert (classified.model_spec.name, classified.model_spec.version.value) == ("half_plus_two", 123)
    assert stub.Regress(regression_request(), timeout=10).result.regressions[0].value == 3.0
    response = stub.MultiInference(multi_request(("regress_x_to_y", REGRESS), ("classify_x_to_y", CLASSIFY)),
                                   timeout=10)
    assert [result.model_spec.signature_name for result in response.results] == ["regress_x_to_y", "classify_x_to_y"]


def test_method_name_flag_decides_for_native_tf2_signatures(stubs):
    default, checking = stubs[False], stubs[True]
    request = classification_request("tf2", "classify_x_to_y", x=4.0)
    assert default.Classify(request, timeout=10).result.classifications[0].classes[0].score == 4.0
    error = rpc_error(checking.Classify, request)
    assert error.code() == grpc.StatusCode.INVALID_ARGUMENT
    assert error.details().startswith("Expected classification signature method_name to be "
                                      "tensorflow/serving/classify. Was: tensorflow/serving/predict")
    request = regression_request("tf2", "regress_x_to_y2", x=4.0)
    assert default.Regress(request, timeout=10).result.regressions[0].value == 5.0
    assert rpc_error(checking.Regress, request).code() == grpc.StatusCode.INVALID_ARGUMENT


@pytest.mark.parametrize("rpc, request_type", [
    ("Predict", predict_pb2.PredictRequest), ("Classify", classification_pb2.ClassificationRequest),
    ("Regress", regression_pb2.RegressionRequest)])
def test_missing_model_spec(default_stub, rpc, request_type):
    """predict_impl.cc, classification_service.cc, regression_service.cc: checked before the model is looked up."""
    error = rpc_error(getattr(default_stub, rpc), request_type())
    assert (error.code(), error.details()) == (grpc.StatusCode.INVALID_ARGUMENT, "Missing ModelSpec")


@pytest.mark.parametrize("rpc, request_factory", [
    ("Classify", classification_request), ("Regress", regression_request),
    ("MultiInference", lambda model: multi_request(("regress_x_to_y", REGRESS), model=model))])
def test_unknown_model_is_not_found(default_stub, rpc, request_factory):
    error = rpc_error(getattr(default_stub, rpc), request_factory(model="nope"))
    assert (error.code(), error.details()) == (grpc.StatusCode.NOT_FOUND, "Servable not found for request: nope")


def test_multi_inference_takes_model_and_version_from_the_first_task(manager, default_stub):
    """multi_inference_helper.cc GetModelSpecFromRequest: tasks[0].model_spec, or an empty one."""
    request = multi_request(("regress_x_to_y", REGRESS), ("classify_x_to_y", CLASSIFY))
    request.tasks[0].model_spec.version.value = 123
    assert [r.model_spec.version.value for r in default_stub.MultiInference(request, timeout=10).results] == [123, 123]
    assert manager.resolved[-1] == request.tasks[0].model_spec
    request.tasks[0].model_spec.version.value = 42
    assert rpc_error(default_stub.MultiInference, request).code() == grpc.StatusCode.NOT_FOUND
    error = rpc_error(default_stub.MultiInference, inference_pb2.MultiInferenceRequest())
    assert (error.code(), error.details()) == (grpc.StatusCode.INVALID_ARGUMENT, "ModelSpec has no name specified.")
    assert manager.resolved[-1] == model_pb2.ModelSpec()


def test_half_plus_three_beside_half_plus_two(manager, default_stub, tmp_path, copy_testdata):
    """tensorflow_model_server_test.py testGoodModelConfig: one server, half_plus_two 3.0 and half_plus_three 4.0."""
    manager.runners["half_plus_three"] = Runner.load(
        copy_testdata("saved_model_half_plus_three", tmp_path / "half_plus_three"), model_name="half_plus_three")
    for model, expected in (("half_plus_two", 3.0), ("half_plus_three", 4.0)):
        for output_filter in (["y"], []):
            request = predict_pb2.PredictRequest(model_spec={"name": model}, output_filter=output_filter)
            request.inputs["x"].CopyFrom(tf.make_tensor_proto([2.0], shape=[1]))
            response = default_stub.Predict(request, timeout=10)
            assert list(response.outputs["y"].float_val) == [expected]
            assert (response.model_spec.name, response.model_spec.version.value,
                    response.model_spec.signature_name) == (model, 123, "serving_default")
    response = default_stub.Regress(regression_request("half_plus_three", "tensorflow/serving/regress"), timeout=10)
    assert response.result.regressions[0].value == 4.0


def test_outputs_as_tensor_content_with_tf_servings_flag(manager):
    """--enable_serialization_as_tensor_content: Predict outputs as tensor_content bytes, not float_val."""
    import numpy as np

    from serving.servable import tensors

    request = predict_pb2.PredictRequest(model_spec={"name": "half_plus_two"})
    request.inputs["x"].CopyFrom(tf.make_tensor_proto(np.array([[1.0], [3.0]], np.float32)))
    with serving(manager, enable_serialization_as_tensor_content=True) as server, \
            grpc.insecure_channel(server.grpc_address) as channel:
        response = prediction_service_pb2_grpc.PredictionServiceStub(channel).Predict(request, timeout=10)
    assert response.outputs["y"].tensor_content and not response.outputs["y"].float_val
    np.testing.assert_array_equal(tensors.to_ndarray(response.outputs["y"], "y"), [[2.5], [3.5]])
