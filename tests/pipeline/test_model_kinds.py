"""Every model kind through the whole path: train → export → Runner.predict, on tiny runs.

mlp as a regressor (diabetes: predictions, the regression signature, MAE/RMSE), cnn as a classifier
(digits as 8×8×1 images, float16 convolutions in the served graph), custom (a user's builder with
precision.float32_layers) on synthetic rows.
"""

import json
import textwrap

import keras
import numpy as np
import pytest
import tensorflow as tf
from tensorflow.core.protobuf import saved_model_pb2

from pipeline.config import load_config
from pipeline.export import export
from serving.client.grpc_client import float_examples as to_examples
from pipeline.predict import compute_metrics, evaluate_locally
from serving.servable.runner import Runner
from pipeline.train import train

pytestmark = pytest.mark.timeout(300)

BUILDER = '''
import keras
from keras import layers


def build(input_shape, num_classes, width=16):
    inputs = keras.Input(input_shape)
    x = layers.Dense(width, activation="relu", name="hidden")(inputs)
    x = layers.BatchNormalization(name="bn")(x)
    logits = layers.Dense(num_classes, name="class_scores")(x)
    return keras.Model(inputs, layers.Activation("softmax", dtype="float32", name="probs")(logits), name="user_net")
'''


def train_and_export(tmp_path, *overrides):
    cfg = load_config(None, [f"train.runs_dir={tmp_path / 'runs'}", f"export.base_path={tmp_path / 'models'}",
                             "train.batch_size=64", *overrides])
    run = train(cfg)
    version_dir = export(cfg)
    keras.config.set_dtype_policy("float32")
    return cfg, run, version_dir, Runner.load(version_dir)


def signature_defs(version_dir):
    saved_model = saved_model_pb2.SavedModel()
    saved_model.ParseFromString((version_dir / "saved_model.pb").read_bytes())
    return saved_model.meta_graphs[0].signature_def


def keras_outputs(run, x):
    """The trained model's outputs as a graph, as exported (docs/keras3-mixed-precision.md §10)."""
    return keras.ops.convert_to_numpy(tf.function(lambda rows: run.model(rows, training=False))(tf.constant(x)))


def test_mlp_regressor_serves_predictions_and_a_regression_signature(tmp_path, capsys):
    cfg, run, version_dir, runner = train_and_export(
        tmp_path, "experiment=diabetes_tiny", "data.source=diabetes", "model.hidden_units=[16]", "train.epochs=2",
        "train.learning_rate=0.01")
    assert {"val_mae", "val_loss"} <= set(run.metrics) and "val_accuracy" not in run.metrics
    x = run.datasets.val.x
    served = runner.predict({"features": x})
    assert list(served) == ["predictions"] and served["predictions"].dtype == np.float32
    assert served["predictions"].shape == (len(x), 1)
    np.testing.assert_array_equal(served["predictions"], keras_outputs(run, x))
    assert runner.compute_ops.get("float16")  # the served graph computes in the policy's dtype

    signatures = signature_defs(version_dir)
    assert sorted(signatures) == ["__saved_model_init_op", "regression", "serving_default"]
    regression = signatures["regression"]
    assert regression.method_name == "tensorflow/serving/regress"
    assert {k: v.dtype for k, v in regression.inputs.items()} == {"inputs": tf.string.as_datatype_enum}
    assert {k: v.dtype for k, v in regression.outputs.items()} == {"outputs": tf.float32.as_datatype_enum}
    regressed = runner.predict({"inputs": np.array([e.SerializeToString() for e in to_examples(x[:5], "features")],
                                                   dtype=object)}, signature_name="regression")
    np.testing.assert_array_equal(regressed["outputs"], served["predictions"][:5, 0])

    meta = json.loads((version_dir / "assets.extra/pipeline.json").read_text())
    assert meta["task"] == "regression" and meta["label_names"] == []
    assert meta["signatures"]["serving_default"]["outputs"] == {"predictions": {"dtype": "float32", "shape": [None, 1]}}
    assert meta["signatures"]["regression"]["method_name"] == "tensorflow/serving/regress"
    assert meta["parity"]["max_abs_diff"] == 0.0 and meta["parity"]["argmax_agreement"] is None
    assert meta["config"]["data"]["source"] == "diabetes" and meta["config"]["data"]["task"] == "regression"

    from tensorflow_serving.apis import prediction_log_pb2

    warmup = version_dir / "assets.extra" / "tf_serving_warmup_requests"
    logs = [prediction_log_pb2.PredictionLog.FromString(r.numpy()) for r in tf.data.TFRecordDataset(str(warmup))]
    assert [log.WhichOneof("log_type") for log in logs] == ["predict_log", "predict_log", "regress_log"]

    capsys.readouterr()
    metrics = evaluate_locally(cfg)
    assert metrics == compute_metrics(keras_outputs(run, x), run.datasets.val.y, "regression")
    out = capsys.readouterr().out
    assert f"MAE {metrics['mae']:.4f}, RMSE {metrics['rmse']:.4f} over {len(x)} validation rows, in-process" in out
    assert "accuracy" not in out


def test_cnn_classifier_on_digit_images(tmp_path):
    cfg, run, version_dir, runner = train_and_export(
        tmp_path, "experiment=digits_cnn_tiny", "data.image_shape=[8, 8, 1]", "model.kind=cnn", "model.filters=[8, 16]",
        "model.hidden_units=[32]", "train.epochs=2", "train.learning_rate=0.003")
    assert run.metrics["val_accuracy"] > 0.3  # 10 classes: chance is 0.1
    assert runner.compute_ops.get("float16", 0) >= 2  # the two Conv2Ds (and the Denses) run in float16
    x = run.datasets.val.x
    assert x.shape[1:] == (8, 8, 1)
    served = runner.predict({"features": x})
    assert sorted(served) == ["logits", "probabilities"]
    np.testing.assert_array_equal(served["probabilities"], keras_outputs(run, x))
    signatures = signature_defs(version_dir)
    assert "classification" in signatures and "regression" not in signatures
    assert [d.size for d in signatures["serving_default"].inputs["features"].tensor_shape.dim] == [-1, 8, 8, 1]


def test_custom_builder_with_float32_layers(tmp_path, monkeypatch):
    (tmp_path / "tests_kind_builders.py").write_text(textwrap.dedent(BUILDER))
    monkeypatch.syspath_prepend(str(tmp_path))
    cfg, run, version_dir, runner = train_and_export(
        tmp_path, "experiment=custom_tiny", "data.source=synthetic", "data.num_examples=300", "data.num_classes=3",
        "model.kind=custom", "model.builder=tests_kind_builders:build", "model.params={width: 12}",
        "precision.float32_layers=[bn]", "train.epochs=2", "train.learning_rate=0.01")
    model = run.model
    assert model.get_layer("bn").compute_dtype == "float32" and model.get_layer("hidden").compute_dtype == "float16"
    assert model.get_layer("hidden").units == 12
    x = run.datasets.val.x
    served = runner.predict({"features": x})
    assert sorted(served) == ["logits", "probabilities"]
    np.testing.assert_array_equal(served["probabilities"], keras_outputs(run, x))
    meta = json.loads((version_dir / "assets.extra/pipeline.json").read_text())
    assert meta["policy"]["name"] == "mixed_float16" and meta["task"] == "classification"
    assert meta["config"]["model"]["builder"] == "tests_kind_builders:build"
    assert meta["config"]["precision"]["float32_layers"] == ["bn"]
