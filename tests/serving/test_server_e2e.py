"""The pipeline's own exported model, served by `python -m serving` and queried over a real channel.

The server must answer exactly what the in-process Runner answers (it is the same code path), in
float32 (DT_FLOAT) at the boundary, and match the trained Keras model.
"""

from __future__ import annotations

import re

import grpc
import numpy as np
import pytest
import tensorflow as tf
from tensorflow.core.framework import types_pb2
from tensorflow_serving.apis import (classification_pb2, get_model_metadata_pb2, get_model_status_pb2,
                                     inference_pb2, model_service_pb2_grpc, predict_pb2, prediction_service_pb2_grpc)

from serving.client.grpc_client import float_examples as to_examples

from serving.servable.runner import Runner
from pipeline import cli
from serving.client import grpc_client

pytestmark = pytest.mark.timeout(300)


@pytest.fixture(scope="module")
def served(exported_model, start_server, tmp_path_factory):
    # With TF Serving's method-name check on: our export names its classification signature correctly.
    server = start_server(f"--model_name={exported_model.model_name}", f"--model_base_path={exported_model.base_path}",
                          "--enable_signature_method_name_check", log_dir=tmp_path_factory.mktemp("e2e"))
    yield server
    assert server.stop() == 0, server.stderr_tail()


@pytest.fixture(scope="module")
def runner(exported_model):
    return Runner.load(exported_model.version_dir)


def test_predict_is_dt_float_and_equals_runner_and_keras(served, exported_model, runner):
    request = predict_pb2.PredictRequest()
    request.model_spec.name = exported_model.model_name
    request.inputs[exported_model.input_name].CopyFrom(tf.make_tensor_proto(exported_model.val_x))
    with grpc.insecure_channel(served.address, options=grpc_client.CHANNEL_OPTIONS) as channel:
        response = prediction_service_pb2_grpc.PredictionServiceStub(channel).Predict(request, timeout=30)
    assert response.model_spec.version.value == int(exported_model.version_dir.name)
    local = runner.predict({exported_model.input_name: exported_model.val_x})
    assert set(response.outputs) == set(local) and "probabilities" in local
    for name, proto in response.outputs.items():
        assert proto.dtype == types_pb2.DT_FLOAT, name
        np.testing.assert_allclose(tf.make_ndarray(proto), local[name], rtol=0, atol=1e-6, err_msg=name)
    np.testing.assert_allclose(tf.make_ndarray(response.outputs["probabilities"]), exported_model.keras_probabilities,
                               rtol=0, atol=1e-6)


def test_predict_rows_in_batches(served, exported_model, runner):
    """Each call's rows come back in order: the concatenation equals the same 7-row calls run in process. (Not the
    whole set in one call: with float16 compute, Eigen's kernels on an AVX2-only CPU round a 7-row batch and a
    359-row one differently, by up to 7e-5 here.)"""
    outputs = grpc_client.predict_rows(served.address, exported_model.model_name, exported_model.input_name,
                                       exported_model.val_x, batch_size=7)
    assert outputs["probabilities"].dtype == np.float32
    x = exported_model.val_x
    local = np.concatenate([runner.predict({exported_model.input_name: x[i:i + 7]})["probabilities"]
                            for i in range(0, len(x), 7)])
    np.testing.assert_allclose(outputs["probabilities"], local, rtol=0, atol=1e-6)
    assert (outputs["probabilities"].argmax(-1) == exported_model.keras_probabilities.argmax(-1)).mean() > 0.99


def test_pipeline_predict_reports_accuracy_over_grpc(served, exported_model, tiny_config_path, capsys):
    assert cli.main(["predict", str(tiny_config_path), "--server", served.address]) == 0
    out = capsys.readouterr().out
    match = re.search(r"accuracy over (\d+) validation rows, over gRPC \(.*\): ([0-9.]+)", out)
    assert match, out
    expected = np.mean(exported_model.keras_probabilities.argmax(-1) == exported_model.val_y)
    assert int(match[1]) == len(exported_model.val_y)
    assert abs(float(match[2]) - expected) < 1e-4
    assert out.count("row ") == 5


def test_metadata_and_status(served, exported_model):
    with grpc.insecure_channel(served.address) as channel:
        metadata = prediction_service_pb2_grpc.PredictionServiceStub(channel).GetModelMetadata(
            get_model_metadata_pb2.GetModelMetadataRequest(model_spec={"name": exported_model.model_name},
                                                           metadata_field=["signature_def"]), timeout=10)
        status = model_service_pb2_grpc.ModelServiceStub(channel).GetModelStatus(
            get_model_status_pb2.GetModelStatusRequest(model_spec={"name": exported_model.model_name}), timeout=10)
    signatures = get_model_metadata_pb2.SignatureDefMap()
    metadata.metadata["signature_def"].Unpack(signatures)
    serving_default = signatures.signature_def["serving_default"]
    assert [(name, info.dtype) for name, info in serving_default.inputs.items()] == \
        [(exported_model.input_name, types_pb2.DT_FLOAT)]
    assert {info.dtype for info in serving_default.outputs.values()} == {types_pb2.DT_FLOAT}
    [version] = status.model_version_status
    assert (version.version, version.state) == (int(exported_model.version_dir.name),
                                                get_model_status_pb2.ModelVersionStatus.AVAILABLE)


def test_warmup_requests_were_replayed_before_the_version_became_available(served):
    log = served.stderr_path.read_text()
    replayed = [m.start() for m in re.finditer(r"warmup: model \S+ version \d+ replayed record", log)]
    assert len(replayed) == 3, "two Predict records and one Classify record"
    assert max(replayed) < log.index("is AVAILABLE")
    # by default oneDNN's weights are not frozen, and the log says how to freeze them (serving/frozen_weights.py)
    assert "oneDNN reorders weights on every call (TF_ONEDNN_ASSUME_FROZEN_WEIGHTS=1 keeps them pre-packed" in log


def test_classify_and_multi_inference_score_what_the_trained_model_scores(served, exported_model):
    rows = exported_model.val_x[:6]
    request = classification_pb2.ClassificationRequest()
    request.model_spec.name = exported_model.model_name
    request.model_spec.signature_name = "classification"
    request.input.example_list.examples.extend(to_examples(rows, exported_model.input_name))
    multi = inference_pb2.MultiInferenceRequest()
    task = multi.tasks.add()
    task.model_spec.CopyFrom(request.model_spec)
    task.method_name = "tensorflow/serving/classify"
    multi.input.CopyFrom(request.input)
    with grpc.insecure_channel(served.address) as channel:
        stub = prediction_service_pb2_grpc.PredictionServiceStub(channel)
        classified = stub.Classify(request, timeout=30)
        multi_result = stub.MultiInference(multi, timeout=30)
    predicted = grpc_client.predict_rows(served.address, exported_model.model_name, exported_model.input_name, rows, 6)
    assert classified.model_spec.signature_name == "classification"
    for result in (classified.result, multi_result.results[0].classification_result):
        labels = [[c.label for c in row.classes] for row in result.classifications]
        scores = np.array([[c.score for c in row.classes] for row in result.classifications], np.float32)
        assert labels == [[str(i) for i in range(10)]] * len(rows)
        # Bit for bit: serving_default's probabilities for the same six rows (the same graph at the same batch
        # size); the trained model's, computed on every validation row at once, within float32 rounding, since a
        # CPU kernel may round by batch size (docs/testing.md; Eigen's do, with TF_ENABLE_ONEDNN_OPTS=0).
        np.testing.assert_array_equal(scores, predicted["probabilities"])
        np.testing.assert_allclose(scores, exported_model.keras_probabilities[:6], rtol=1e-5, atol=1e-7)
