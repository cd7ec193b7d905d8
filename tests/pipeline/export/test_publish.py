"""Export: TF Serving's layout, float32 signature, pipeline.json, parity, atomic publish."""

import errno
import json
import os
from pathlib import Path

import keras
import numpy as np
import pytest
import tensorflow as tf

from pipeline.config import load_config
from pipeline.export import ExportError, export, signatures
from serving.servable import saved_model


def test_layout_is_what_tf_serving_expects(exported_model):
    assert exported_model.version_dir == exported_model.base_path / "1"
    for name in ("saved_model.pb", "variables/variables.index", "assets.extra/pipeline.json"):
        assert (exported_model.version_dir / name).is_file(), name
    assert not list(exported_model.base_path.glob(".tmp-*"))


def test_serving_default_signature_is_float32_in_and_out_with_a_dynamic_batch(exported_model):
    signature = tf.saved_model.load(str(exported_model.version_dir)).signatures["serving_default"]
    _, inputs = signature.structured_input_signature
    assert {name: (s.dtype, s.shape.as_list()) for name, s in inputs.items()} == {"features": (tf.float32, [None, 64])}
    outputs = signature.structured_outputs
    assert {name: (s.dtype, s.shape.as_list()) for name, s in outputs.items()} == {
        "probabilities": (tf.float32, [None, 10]), "logits": (tf.float32, [None, 10])}


def test_saved_model_computes_in_float16_and_matches_the_trained_model(exported_model):
    signature = tf.saved_model.load(str(exported_model.version_dir)).signatures["serving_default"]
    result = signature(features=tf.constant(exported_model.val_x))
    np.testing.assert_array_equal(result["probabilities"].numpy(), exported_model.keras_probabilities)
    graph_ops = [node for f in signature.graph.as_graph_def().library.function for node in f.node_def]
    matmul_dtypes = {tf.as_dtype(node.attr["T"].type).name for node in graph_ops if node.op == "MatMul"}
    assert matmul_dtypes == {"float16"}


def test_pipeline_json_records_policy_config_metrics_specs_and_parity(exported_model, trained_run):
    meta = json.loads((exported_model.version_dir / "assets.extra/pipeline.json").read_text())
    assert meta["policy"] == {"name": "mixed_float16", "compute_dtype": "float16", "variable_dtype": "float32",
                              "loss_scale": "dynamic", "initial_scale": 32768.0, "dynamic_growth_steps": 2000}
    assert meta["model_name"] == exported_model.model_name and meta["version"] == 1
    assert meta["config"]["model"]["hidden_units"] == [32, 16]
    assert meta["metrics"]["val_accuracy"] == trained_run.metrics["val_accuracy"]
    assert meta["signatures"]["serving_default"]["inputs"] == {"features": {"dtype": "float32", "shape": [None, 64]}}
    assert meta["label_names"] == [str(i) for i in range(10)]
    assert meta["parity"]["max_abs_diff"] == 0.0 and meta["parity"]["argmax_agreement"] == 1.0
    assert meta["versions"]["tensorflow"] == tf.__version__ and meta["versions"]["keras"] == keras.__version__


def test_versions_count_up_and_a_failed_export_leaves_nothing(trained_run, tiny_config_path, tmp_path, monkeypatch):
    cfg = load_config(tiny_config_path, [f"export.base_path={tmp_path}"])
    assert export(cfg) == cfg.model_base_path / "1"

    def fail(*args, **kwargs):
        raise ExportError("injected failure after the SavedModel was written")

    monkeypatch.setattr(signatures, "signature_problems", fail)
    with pytest.raises(ExportError, match="injected"):
        export(cfg, force=True)
    assert saved_model.list_versions(cfg.model_base_path) == [1]
    assert not list(cfg.model_base_path.glob(".tmp-*")), "the temporary version was removed"
    monkeypatch.undo()

    assert export(cfg, force=True) == cfg.model_base_path / "2"
    with pytest.raises(ExportError, match="already exists"):
        export(load_config(tiny_config_path, [f"export.base_path={tmp_path}", "export.version=2"]))


def test_a_failure_at_the_publishing_rename_leaves_the_published_versions_as_they_were(trained_run, tiny_config_path,
                                                                                         tmp_path, monkeypatch):
    """The last moment an export can die: the version is complete and fsynced, the rename fails."""
    cfg = load_config(tiny_config_path, [f"export.base_path={tmp_path}"])
    first = export(cfg)
    real_rename, renamed = os.rename, []

    def rename(src, dst):
        if Path(dst).parent == cfg.model_base_path:
            renamed.append(Path(src).name)
            raise OSError(5, "Input/output error")
        real_rename(src, dst)

    monkeypatch.setattr(os, "rename", rename)
    with pytest.raises(OSError, match="Input/output error"):
        export(cfg, force=True)
    monkeypatch.undo()
    assert renamed and renamed[0].startswith(".tmp-"), "failed at the publishing rename itself"
    assert saved_model.list_versions(cfg.model_base_path) == [1]
    assert sorted(p.name for p in cfg.model_base_path.iterdir()) == ["1"]
    assert json.loads((first / "assets.extra/pipeline.json").read_text())["version"] == 1


def test_an_export_of_the_same_weights_and_config_publishes_nothing_unless_forced(trained_run, tiny_config_path,
                                                                                  tmp_path, capsys, caplog):
    # Issue 23: `make export` (and `make demo`) published a new version each time, the weights unchanged.
    from pipeline import cli
    from pipeline.export import publish

    cfg = load_config(tiny_config_path, [f"export.base_path={tmp_path}"])
    first = export(cfg)
    with caplog.at_level("INFO", logger="pipeline.export.publish"):
        assert export(cfg) == first
    assert saved_model.list_versions(cfg.model_base_path) == [1]
    assert any(m.startswith(f"{first} already holds these weights (sha1 {trained_run.metrics['weights_sha1']}) and "
                            "this config: nothing published; --force publishes") for m in caplog.messages)
    assert cli.main(["export", str(tiny_config_path), f"--set=export.base_path={tmp_path}", "--force"]) == 0
    assert capsys.readouterr().out.strip() == str(cfg.model_base_path / "2")
    assert saved_model.list_versions(cfg.model_base_path) == [1, 2]
    # Another recorded setting, or other weights, is another version.
    run_cfg = publish._finished_run_config(cfg)
    other = load_config(tiny_config_path, [f"export.base_path={tmp_path}", "serving.batch_size=7"])
    assert publish._same_as_newest(cfg, run_cfg) == cfg.model_base_path / "2"
    assert publish._same_as_newest(other, run_cfg) is None
    pipeline_json = cfg.model_base_path / "2" / saved_model.PIPELINE_JSON
    meta = json.loads(pipeline_json.read_text())
    meta["metrics"]["weights_sha1"] = "0" * 16
    pipeline_json.write_text(json.dumps(meta))
    assert publish._same_as_newest(cfg, run_cfg) is None


def test_a_full_disk_at_export_is_one_line_and_publishes_nothing(trained_run, tiny_config_path, tmp_path,
                                                                monkeypatch, capsys):
    def full(model, spec, directory, image_limits=None):
        raise OSError(errno.ENOSPC, "No space left on device", str(directory / "variables" / "variables.data"))

    monkeypatch.setattr(signatures, "write_saved_model", full)
    from pipeline import cli

    code = cli.main(["export", str(tiny_config_path), f"--set=export.base_path={tmp_path}"])
    out, err = capsys.readouterr()
    base = tmp_path / trained_run.run_dir.name
    assert code == 1 and "Traceback" not in out + err
    [line] = err.strip().splitlines()[-1:]
    assert line.startswith("error: no space left on device writing ") and "variables.data: nothing was published at " \
        f"{base / '1'} (its temporary directory is removed; what was there before is untouched); free space" in line
    assert not base.exists() or not list(base.iterdir())


def test_export_refuses_a_config_that_trained_differently(trained_run, tiny_config_path, tmp_path):
    other = load_config(tiny_config_path, [f"export.base_path={tmp_path}", "precision.policy=float32"])
    with pytest.raises(ExportError) as refused:
        export(other)
    # The key and both values, as a forgotten --set needs to be found (issue 23).
    assert "precision.policy: 'mixed_float16' in training, 'float32' now" in str(refused.value)
    assert len(str(refused.value).splitlines()) == 1
    assert not any(tmp_path.iterdir())


def test_export_refuses_an_unfinished_run(tmp_path):
    cfg = load_config(None, [f"train.runs_dir={tmp_path}", f"export.base_path={tmp_path}/models"])
    with pytest.raises(ExportError, match="no finished training run"):
        export(cfg)
    assert not (tmp_path / "models").exists()


def test_a_float16_output_fails_the_dtype_check(tmp_path):
    keras.config.set_dtype_policy("mixed_float16")
    inputs = keras.Input((4,), name="features")
    leaky = keras.Model(inputs, {"probabilities": keras.layers.Dense(2, name="head")(inputs)})
    from pipeline.data import DataSpec

    signatures.write_saved_model(leaky, DataSpec("features", (4,), 2, ("a", "b")), tmp_path / "v")
    signature_def = saved_model.read_signature_defs(tmp_path / "v")["serving_default"]
    assert signatures.signature_problems("serving_default", signature_def) == ["output 'probabilities' is float16"]



def test_classification_signature_has_tf_servings_contract_and_method_name(exported_model):
    from tensorflow.core.protobuf import fingerprint_pb2, saved_model_pb2
    from tensorflow.python.saved_model.pywrap_saved_model import fingerprinting

    saved_model = saved_model_pb2.SavedModel()
    saved_model.ParseFromString((exported_model.version_dir / "saved_model.pb").read_bytes())
    signatures = saved_model.meta_graphs[0].signature_def
    assert signatures["serving_default"].method_name == "tensorflow/serving/predict"
    classification = signatures["classification"]
    assert classification.method_name == "tensorflow/serving/classify"
    assert {k: v.dtype for k, v in classification.inputs.items()} == {"inputs": tf.string.as_datatype_enum}
    assert {k: v.dtype for k, v in classification.outputs.items()} == {
        "classes": tf.string.as_datatype_enum, "scores": tf.float32.as_datatype_enum}
    stored = fingerprint_pb2.FingerprintDef.FromString((exported_model.version_dir / "fingerprint.pb").read_bytes())
    fresh = fingerprint_pb2.FingerprintDef.FromString(fingerprinting.CreateFingerprintDef(str(exported_model.version_dir)))
    stored.ClearField("uuid")  # random per call
    fresh.ClearField("uuid")
    assert stored == fresh, "fingerprint.pb matches the rewritten saved_model.pb"

    from serving.client.grpc_client import float_examples as to_examples

    loaded = tf.saved_model.load(str(exported_model.version_dir))
    rows = exported_model.val_x[:5]
    result = loaded.signatures["classification"](
        inputs=tf.constant([e.SerializeToString() for e in to_examples(rows, "features")]))
    # The same graph on the same rows: the same bits on any CPU. Against the trained model's outputs, computed on
    # all validation rows at once, only float32 rounding apart (Eigen's kernels round by batch size: oneDNN off).
    served = loaded.signatures["serving_default"](features=tf.constant(rows))["probabilities"].numpy()
    np.testing.assert_array_equal(result["scores"].numpy(), served)
    np.testing.assert_allclose(result["scores"].numpy(), exported_model.keras_probabilities[:5], rtol=0, atol=1e-6)
    assert result["classes"].numpy()[0].tolist() == [str(i).encode() for i in range(10)]


def test_warmup_file_holds_real_predict_and_classify_requests_the_model_answers(exported_model, tiny_config):
    from tensorflow_serving.apis import prediction_log_pb2

    path = exported_model.version_dir / "assets.extra" / "tf_serving_warmup_requests"
    logs = [prediction_log_pb2.PredictionLog.FromString(r.numpy()) for r in tf.data.TFRecordDataset(str(path))]
    assert [log.WhichOneof("log_type") for log in logs] == ["predict_log", "predict_log", "classify_log"]
    serve = tf.saved_model.load(str(exported_model.version_dir)).signatures["serving_default"]
    sizes = []
    for log in logs[:2]:
        request = log.predict_log.request
        assert request.model_spec.name == exported_model.model_name
        rows = tf.make_ndarray(request.inputs["features"])
        sizes.append(len(rows))
        np.testing.assert_array_equal(rows, exported_model.val_x[: len(rows)])  # real held-out rows
        assert serve(features=tf.constant(rows))["probabilities"].dtype == tf.float32
    assert sizes == [1, tiny_config.serving.batch_size]
    assert len(logs[2].classify_log.request.input.example_list.examples) == 1


def test_bfloat16_runs_export_bit_for_bit(tiny_config_path, tmp_path):
    """bfloat16's fused graph kernels round differently from eager Keras; the gate compares graphs, so the
    export matches the trained model exactly, as float16 and float32 ones do."""
    from pipeline.train import train

    cfg = load_config(tiny_config_path, ["experiment=tiny_bf16", "precision.policy=mixed_bfloat16",
                                         f"train.runs_dir={tmp_path / 'runs'}", f"export.base_path={tmp_path / 'models'}"])
    run = train(cfg)
    assert run.metrics["policy"]["name"] == "mixed_bfloat16"  # recorded, so `auto` never re-resolves at export
    version_dir = export(cfg)
    meta = json.loads((version_dir / "assets.extra/pipeline.json").read_text())
    assert meta["policy"]["compute_dtype"] == "bfloat16"
    assert meta["parity"]["tolerance"] == 1e-5
    report = json.loads((version_dir / "assets.extra/parity.json").read_text())
    same_graph = next(c for c in report["comparisons"] if c["kind"] == "same graph")
    assert report["passed"] and same_graph["identical"]
