"""`python -m pipeline export CONFIG`: publishes the trained run as <base_path>/<model_name>/<version>/.

The version is written into a temporary sibling directory, checked (float32 signature I/O, parity
with the trained Keras model on held-out rows), and only then renamed into place, so TF Serving or
`python -m serving` polling the base path never sees a half-written or unchecked version.
"""

from __future__ import annotations

import datetime
import logging
import platform
from pathlib import Path

import keras
import numpy as np
import tensorflow as tf
import yaml

from pipeline import artifacts, data, models, parity, precision, train
from pipeline.config import Config, validate_config

log = logging.getLogger(__name__)

SIGNATURE = "serving_default"
CLASSIFY_SIGNATURE = "classification"
REGRESS_SIGNATURE = "regression"
WARMUP_FILE = "tf_serving_warmup_requests"  # TF Serving replays it before a version becomes AVAILABLE
# Sections that change what the model is; export/serving settings may differ between train and export.
TRAINING_SECTIONS = ("seed", "precision", "data", "model")


class ExportError(Exception):
    """The run cannot be exported (not trained, config mismatch, parity or dtype check failed)."""


def export(cfg: Config) -> Path:
    """Exports the finished run of cfg.experiment; returns the published version directory.

    The serving graph computes under export.serving_policy (default: the training policy). Before the
    version is renamed into place, the parity gate (pipeline/parity.py) runs a golden batch of held-out
    rows through the trained model, its float32 rebuild, the SavedModel and the live server, and writes
    the numbers to assets.extra/parity.json; any failed rule aborts the export with nothing published.
    """
    run_cfg = _finished_run_config(cfg)
    metrics = artifacts.read_json(cfg.run_dir / train.METRICS_FILE)
    # The run's policy (what `auto` resolved to when it trained), before the model is rebuilt.
    trained_policy = precision.apply_policy(run_cfg.precision, recorded=metrics.get("policy"))
    policy = precision.serving_policy(cfg.export.serving_policy, trained_policy)
    model = models.load_trained_model(cfg.run_dir / train.MODEL_FILE, run_cfg.model)
    datasets = data.load_datasets(run_cfg.data, seed=run_cfg.seed)
    spec = datasets.spec
    golden = parity.golden_batch(datasets.val_x, datasets.val_y, cfg.export.parity_rows, spec.task)
    gate = parity.Gate(golden, trained_policy=trained_policy.name, serving_policy=policy.name,
                       parity_tolerance=precision.parity_tolerance(policy.compute_dtype, cfg.export.parity_tolerance),
                       policy_tolerance=precision.policy_tolerance(
                           _reduced_dtype(trained_policy, policy), cfg.export.policy_tolerance),
                       min_argmax_agreement=cfg.export.min_argmax_agreement)

    def rebuilt(policy_name: str) -> keras.Model:
        with precision.policy_scope(policy_name):
            return models.rebuild(model, run_cfg.model, spec, datasets.train_x, run_cfg.precision.float32_layers)

    served_keras = models.serving_model(model, spec)
    gate.add("trained", _outputs(served_keras, golden.x), f"trained Keras model under {trained_policy.name}")
    gate.add("float32", _outputs(models.serving_model(rebuilt("float32"), spec), golden.x),
             "the same weights rebuilt under float32")
    gate.precision("trained")
    exported_from = "trained"
    if policy.name != trained_policy.name:
        served_keras = models.serving_model(rebuilt(policy.name), spec)
        gate.add("serving", _outputs(served_keras, golden.x), f"the same weights rebuilt under {policy.name} "
                 f"(export.serving_policy {cfg.export.serving_policy})")
        gate.precision("serving")
        exported_from = "serving"

    base = cfg.model_base_path
    version = cfg.export.version or artifacts.next_version(base)
    if version in artifacts.list_versions(base):
        raise ExportError(f"export.version: {base}/{version} already exists; versions are immutable, "
                          "omit export.version to publish the next one")
    with artifacts.atomic_dir(base / str(version)) as tmp:
        _write_saved_model(served_keras, spec, tmp)
        loaded = tf.saved_model.load(str(tmp))
        signature = loaded.signatures[SIGNATURE]
        specs = _check_float32_io(signature)
        saved_outputs = {name: t.numpy() for name, t in signature(**{spec.input_name: tf.constant(golden.x)}).items()}
        gate.add("saved_model", saved_outputs, "the reloaded SavedModel's serving_default signature")
        gate.same_graph("saved_model", exported_from)
        if spec.task == "regression":
            _check_regression(loaded.signatures[REGRESS_SIGNATURE], spec, golden.x, saved_outputs)
            task_signature = {REGRESS_SIGNATURE: _regression_spec(spec)}
        else:
            _check_classification(loaded.signatures[CLASSIFY_SIGNATURE], spec, golden.x, saved_outputs)
            task_signature = {CLASSIFY_SIGNATURE: _classification_spec(spec)}
        del loaded, signature
        _write_warmup_requests(tmp / artifacts.PIPELINE_JSON.parent / WARMUP_FILE, cfg, spec, golden.x)
        same_path = next(c for c in gate.comparisons if c["path"] == "saved_model")
        metadata = {
            "format": 1,
            "model_name": cfg.export.model_name,
            "version": version,
            "created": datetime.datetime.now(datetime.timezone.utc).isoformat(timespec="seconds"),
            "policy": trained_policy.to_dict(),
            "serving_policy": {**policy.to_dict(), "setting": cfg.export.serving_policy},
            "signatures": {SIGNATURE: specs, **task_signature},
            "task": spec.task,
            "label_names": list(spec.label_names),
            "config": {**run_cfg.to_dict(), "export": cfg.export.model_dump(mode="json"),
                       "serving": cfg.serving.model_dump(mode="json")},
            "metrics": metrics,
            "parity": {"rows": len(golden.x), "max_abs_diff": same_path["max_abs_diff"],
                       "max_abs_diff_per_output": same_path["max_abs_diff_per_output"],
                       "argmax_agreement": same_path["argmax_agreement"], "tolerance": gate.parity_tolerance,
                       "report": str(parity.PARITY_JSON)},
            "run_dir": str(cfg.run_dir),
            "versions": {"tensorflow": tf.__version__, "keras": keras.__version__,
                         "numpy": np.__version__, "python": platform.python_version()},
        }
        artifacts.write_json_atomic(tmp / artifacts.PIPELINE_JSON, metadata)
        if gate.passed:  # the server loads only a version that passed every offline rule
            served = parity.served_outputs(tmp, cfg.export.model_name, version, spec.input_name, golden,
                                           next(iter(task_signature)))
            for path, outputs in served.items():
                gate.add(path, outputs, f"the live server over gRPC ({path.split('_')[1].capitalize()})")
                gate.same_bits(path, "saved_model")
        log.info("parity gate on %d golden rows:\n%s", len(golden.x), gate.summary())
        if not gate.passed:
            rejected = cfg.run_dir / "parity-rejected.json"
            artifacts.write_json_atomic(rejected, gate.report())
            raise ExportError(f"parity gate failed: {'; '.join(gate.failures())}; nothing was published "
                              f"(report: {rejected})")
        parity.write_report(gate, tmp)
    published = base / str(version)
    log.info("exported %s version %d (trained %s, serving %s; parity report %s) → %s", cfg.export.model_name,
             version, trained_policy.name, policy.name, parity.PARITY_JSON, published)
    return published


def _reduced_dtype(*policies: precision.PolicyInfo) -> str:
    """The coarsest compute dtype among the policies: it sets how far from float32 outputs may stray."""
    dtypes = {p.compute_dtype for p in policies}
    return next((d for d in ("bfloat16", "float16") if d in dtypes), "float32")


def _outputs(served: keras.Model, x: np.ndarray) -> dict[str, np.ndarray]:
    return {name: keras.ops.convert_to_numpy(t) for name, t in served(x, training=False).items()}


def _finished_run_config(cfg: Config) -> Config:
    """The config the run was trained with; refuses unfinished runs and mismatched training settings."""
    run_dir = cfg.run_dir
    if not (run_dir / train.MODEL_FILE).is_file() or not (run_dir / train.METRICS_FILE).is_file():
        raise ExportError(f"{run_dir}: no finished training run (model.keras and metrics.json missing); "
                          f"run `make train` with the same config first")
    run_cfg = validate_config(yaml.safe_load((run_dir / train.CONFIG_FILE).read_text()), str(run_dir / train.CONFIG_FILE))
    trained, wanted = run_cfg.to_dict(), cfg.to_dict()
    differences = [f"{key}" for key in TRAINING_SECTIONS if trained[key] != wanted[key]]
    if differences:
        raise ExportError(f"{run_dir} was trained with different {', '.join(differences)} settings than this config; "
                          "train again with this config, or export with the config (and --set overrides) used for training")
    return run_cfg


def _write_saved_model(served: keras.Model, spec: data.DataSpec, path: Path) -> None:
    """Two signatures over the same weights, so every TF Serving RPC works on the export:

    serving_default (Predict): float32 features [batch, ...] → {probabilities, logits} float32
    (regression: {predictions} float32 [batch, 1]).
    classification (Classify, classifiers only): serialized tf.Example `inputs` [batch] → classes
    (label strings) and scores (float32), the contract TF Serving's classifier checks.
    regression (Regress, regressors only): serialized tf.Example `inputs` [batch] → outputs float32
    [batch], the contract TF Serving's regressor checks.

    No archive.track(): tracking writes every weight twice (shared notes §5).
    """
    archive = keras.export.ExportArchive()
    archive.add_endpoint(
        SIGNATURE,
        lambda features: served(features, training=False),
        input_signature=[tf.TensorSpec([None, *spec.input_shape], tf.float32, name=spec.input_name)],
    )
    feature_spec = {spec.input_name: tf.io.FixedLenFeature(spec.input_shape, tf.float32)}
    label_names = tf.constant(spec.label_names)

    def classify(inputs):
        features = tf.io.parse_example(inputs, feature_spec)[spec.input_name]
        scores = served(features, training=False)["probabilities"]
        return {"classes": tf.tile(label_names[tf.newaxis], [tf.shape(scores)[0], 1]), "scores": scores}

    def regress(inputs):
        features = tf.io.parse_example(inputs, feature_spec)[spec.input_name]
        return {"outputs": tf.reshape(served(features, training=False)["predictions"], [-1])}

    examples = [tf.TensorSpec([None], tf.string, name="inputs")]
    if spec.task == "regression":
        archive.add_endpoint(REGRESS_SIGNATURE, regress, input_signature=examples)
        method_names = {REGRESS_SIGNATURE: tf.saved_model.REGRESS_METHOD_NAME}
    else:
        archive.add_endpoint(CLASSIFY_SIGNATURE, classify, input_signature=examples)
        method_names = {CLASSIFY_SIGNATURE: tf.saved_model.CLASSIFY_METHOD_NAME}
    archive.write_out(str(path), verbose=False)
    _set_method_names(path, method_names)


def _set_method_names(path: Path, method_names: dict[str, str]) -> None:
    """TF2's saver writes every signature as tensorflow/serving/predict; TF Serving's
    --enable_signature_method_name_check wants classify/regress names, so set them in saved_model.pb
    (shared notes §5, route B) and rewrite the fingerprint that covers the file."""
    from tensorflow.core.protobuf import saved_model_pb2
    from tensorflow.python.saved_model.pywrap_saved_model import fingerprinting

    saved_model = saved_model_pb2.SavedModel()
    saved_model.ParseFromString((path / "saved_model.pb").read_bytes())
    for meta_graph in saved_model.meta_graphs:
        for name, method_name in method_names.items():
            meta_graph.signature_def[name].method_name = method_name
    (path / "saved_model.pb").write_bytes(saved_model.SerializeToString())
    (path / "fingerprint.pb").write_bytes(fingerprinting.CreateFingerprintDef(str(path)))


def to_examples(rows: np.ndarray, input_name: str) -> list[tf.train.Example]:
    """Feature rows as the tf.Examples the classification signature parses (one float_list per row)."""
    return [tf.train.Example(features=tf.train.Features(feature={
        input_name: tf.train.Feature(float_list=tf.train.FloatList(value=row.reshape(-1)))})) for row in rows]


def _classification_spec(spec: data.DataSpec) -> dict:
    return {"inputs": {"inputs": {"dtype": "string", "shape": [None], "example_feature": spec.input_name,
                                  "example_feature_shape": list(spec.input_shape)}},
            "outputs": {"classes": {"dtype": "string", "shape": [None, spec.num_classes]},
                        "scores": {"dtype": "float32", "shape": [None, spec.num_classes]}},
            "method_name": "tensorflow/serving/classify"}


def _check_classification(signature, spec: data.DataSpec, x: np.ndarray, expected: dict) -> None:
    """The classification signature scores exactly what serving_default returns as probabilities."""
    serialized = tf.constant([e.SerializeToString() for e in to_examples(x, spec.input_name)])
    result = signature(inputs=serialized)
    scores, classes = result["scores"].numpy(), result["classes"].numpy()
    if scores.dtype != np.float32 or not np.array_equal(scores, expected["probabilities"]):
        raise ExportError("classification signature: scores differ from serving_default's probabilities")
    if classes[0].tolist() != [name.encode() for name in spec.label_names]:
        raise ExportError(f"classification signature: classes {classes[0].tolist()} are not the label names")


def _regression_spec(spec: data.DataSpec) -> dict:
    return {"inputs": {"inputs": {"dtype": "string", "shape": [None], "example_feature": spec.input_name,
                                  "example_feature_shape": list(spec.input_shape)}},
            "outputs": {"outputs": {"dtype": "float32", "shape": [None]}},
            "method_name": "tensorflow/serving/regress"}


def _check_regression(signature, spec: data.DataSpec, x: np.ndarray, expected: dict) -> None:
    """The regression signature returns exactly serving_default's predictions, one float32 per example."""
    serialized = tf.constant([e.SerializeToString() for e in to_examples(x, spec.input_name)])
    outputs = signature(inputs=serialized)["outputs"].numpy()
    if outputs.dtype != np.float32 or not np.array_equal(outputs, expected["predictions"].reshape(-1)):
        raise ExportError("regression signature: outputs differ from serving_default's predictions")


def _write_warmup_requests(path: Path, cfg: Config, spec: data.DataSpec, rows: np.ndarray) -> None:
    """TF Serving's warmup file: PredictionLog records (a TFRecord) built from real held-out rows,
    one Predict at batch size 1 and one at the client batch size, and one Classify (or Regress)."""
    from tensorflow_serving.apis import classification_pb2, predict_pb2, prediction_log_pb2, regression_pb2

    logs = []
    for size in sorted({1, min(cfg.serving.batch_size, len(rows))}):
        request = predict_pb2.PredictRequest()
        request.model_spec.name = cfg.export.model_name
        request.model_spec.signature_name = SIGNATURE
        request.inputs[spec.input_name].CopyFrom(tf.make_tensor_proto(rows[:size]))
        logs.append(prediction_log_pb2.PredictionLog(predict_log=prediction_log_pb2.PredictLog(request=request)))
    if spec.task == "regression":
        regress = regression_pb2.RegressionRequest()
        regress.model_spec.name = cfg.export.model_name
        regress.model_spec.signature_name = REGRESS_SIGNATURE
        regress.input.example_list.examples.extend(to_examples(rows[:1], spec.input_name))
        logs.append(prediction_log_pb2.PredictionLog(regress_log=prediction_log_pb2.RegressLog(request=regress)))
    else:
        classify = classification_pb2.ClassificationRequest()
        classify.model_spec.name = cfg.export.model_name
        classify.model_spec.signature_name = CLASSIFY_SIGNATURE
        classify.input.example_list.examples.extend(to_examples(rows[:1], spec.input_name))
        logs.append(prediction_log_pb2.PredictionLog(classify_log=prediction_log_pb2.ClassifyLog(request=classify)))
    path.parent.mkdir(parents=True, exist_ok=True)
    with tf.io.TFRecordWriter(str(path)) as writer:
        for log_record in logs:
            writer.write(log_record.SerializeToString())


def _check_float32_io(signature) -> dict:
    """The signature's input/output specs; raises ExportError if any is not float32."""
    _, input_specs = signature.structured_input_signature
    specs = {"inputs": {name: _spec(s) for name, s in input_specs.items()},
             "outputs": {name: _spec(s) for name, s in signature.structured_outputs.items()}}
    wrong = [f"{kind[:-1]} '{name}' is {s['dtype']}" for kind in ("inputs", "outputs")
             for name, s in specs[kind].items() if s["dtype"] != "float32"]
    if wrong:
        raise ExportError(f"{SIGNATURE}: {'; '.join(wrong)}; exported models must have float32 inputs and outputs")
    return specs


def _spec(tensor_spec) -> dict:
    return {"dtype": tensor_spec.dtype.name, "shape": tensor_spec.shape.as_list()}
