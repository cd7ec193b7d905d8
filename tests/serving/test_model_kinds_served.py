"""A regression model (mlp on diabetes) served by `python -m serving`: Predict answers DT_FLOAT
predictions equal to the in-process Runner's, Regress answers through the regression signature, and
the client reports the same MAE/RMSE over gRPC as in-process (same rows, same batches)."""

from __future__ import annotations

import grpc
import keras
import numpy as np
import pytest
from tensorflow.core.framework import types_pb2
from tensorflow_serving.apis import prediction_service_pb2_grpc, regression_pb2

from pipeline.config import load_config
from pipeline.export import export
from serving.client.grpc_client import float_examples as to_examples
from pipeline.predict import evaluate_locally, evaluate_over_grpc
from serving.servable.runner import Runner
from pipeline.train import train
from serving.client import grpc_client

pytestmark = pytest.mark.timeout(300)


@pytest.fixture(scope="module")
def regressor(tmp_path_factory):
    directory = tmp_path_factory.mktemp("regressor")
    cfg = load_config(None, ["experiment=diabetes_served", "data.source=diabetes", "model.hidden_units=[16]",
                             "train.epochs=1", "train.batch_size=64", f"train.runs_dir={directory / 'runs'}",
                             f"export.base_path={directory / 'models'}", "serving.batch_size=25"])
    train(cfg)
    version_dir = export(cfg)
    keras.config.set_dtype_policy("float32")
    return cfg, version_dir


@pytest.fixture(scope="module")
def served(regressor, start_server, tmp_path_factory):
    cfg, _ = regressor
    server = start_server(f"--model_name={cfg.export.model_name}", f"--model_base_path={cfg.model_base_path}",
                          log_dir=tmp_path_factory.mktemp("served"))
    yield server
    assert server.stop() == 0, server.stderr_tail()


def test_predict_and_regress_over_grpc_equal_the_runner(served, regressor):
    cfg, version_dir = regressor
    runner = Runner.load(version_dir)
    from pipeline.data import load_datasets

    x = load_datasets(cfg.data, seed=cfg.seed).val.x[:20]
    local = runner.predict({"features": x})["predictions"]
    outputs = grpc_client.predict_rows(served.address, cfg.export.model_name, "features", x, batch_size=8)
    assert list(outputs) == ["predictions"] and outputs["predictions"].dtype == np.float32
    np.testing.assert_array_equal(outputs["predictions"], local)

    request = regression_pb2.RegressionRequest()
    request.model_spec.name = cfg.export.model_name
    request.model_spec.signature_name = "regression"
    request.input.example_list.examples.extend(to_examples(x, "features"))
    with grpc.insecure_channel(served.address) as channel:
        response = prediction_service_pb2_grpc.PredictionServiceStub(channel).Regress(request, timeout=30)
    np.testing.assert_array_equal(np.array([r.value for r in response.result.regressions], np.float32), local[:, 0])


def test_client_reports_the_same_mae_and_rmse_as_in_process(served, regressor, capsys):
    cfg, _ = regressor
    over_grpc = evaluate_over_grpc(cfg, served.address)
    out = capsys.readouterr().out
    local = evaluate_locally(cfg)
    assert set(over_grpc) == {"mae", "rmse"} and over_grpc == local
    assert f"MAE {local['mae']:.4f}, RMSE {local['rmse']:.4f} over 88 validation rows, over gRPC" in out
    assert out.count("row ") == 5 and "accuracy" not in out


def test_metadata_lists_the_float32_predictions_and_the_regression_signature(served, regressor):
    cfg, _ = regressor
    from tensorflow_serving.apis import get_model_metadata_pb2

    with grpc.insecure_channel(served.address) as channel:
        metadata = prediction_service_pb2_grpc.PredictionServiceStub(channel).GetModelMetadata(
            get_model_metadata_pb2.GetModelMetadataRequest(model_spec={"name": cfg.export.model_name},
                                                           metadata_field=["signature_def"]), timeout=10)
    signatures = get_model_metadata_pb2.SignatureDefMap()
    metadata.metadata["signature_def"].Unpack(signatures)
    assert {name: info.dtype for name, info in signatures.signature_def["serving_default"].outputs.items()} == {
        "predictions": types_pb2.DT_FLOAT}
    assert signatures.signature_def["regression"].method_name == "tensorflow/serving/regress"
