"""`python -m pipeline export CONFIG`: publishes the trained run as <base_path>/<model_name>/<version>/.

The version is written into a temporary sibling directory, checked (float32 signature I/O, parity
with the trained Keras model on held-out rows), and only then renamed into place, so TF Serving or
`python -m serving` polling the base path never sees a half-written or unchecked version.
"""

from __future__ import annotations

import json
import logging
import platform
from pathlib import Path

import keras
import numpy as np
import tensorflow as tf
import yaml

from pipeline import artifacts, data, models, precision
from pipeline.artifacts import CONFIG_FILE, DATA_DIR, METRICS_FILE, MODEL_FILE, PARITY_JSON, PARITY_REJECTED_FILE
from pipeline.config import Config, differences, validate_config
from pipeline.errors import ExportError
from pipeline.export import auto, lm, metadata, parity, signatures
from pipeline.export.signatures import CLASSIFY_SIGNATURE, REGRESS_SIGNATURE, SIGNATURE
from serving.servable import saved_model
from serving.servable.warmup import WARMUP_FILE

log = logging.getLogger(__name__)


def export(cfg: Config, force: bool = False) -> Path:
    """Exports the finished run of cfg.experiment; returns the published version directory, or the newest
    version's when it already holds these weights and this config (nothing is published; force publishes anyway).

    The serving graph computes under export.serving_policy (default: the training policy). Before the
    version is renamed into place, the parity gate (pipeline/export/parity.py) runs a golden batch of held-out
    rows through the trained model, its float32 rebuild, the SavedModel and the live server, the validation
    rows through the reduced-precision paths and the SavedModel at its input limits, and writes the numbers to
    assets.extra/parity.json; any failed rule aborts the export with nothing published.
    """
    run_cfg = _finished_run_config(cfg)
    same = None if force or cfg.export.version else _same_as_newest(cfg, run_cfg)
    if same is not None:
        return same
    if cfg.model.kind == "causal_lm":  # its own signatures and parity gate (lm.py), the same atomic publish
        return lm.export_lm(cfg, run_cfg, _recorded_config(cfg, run_cfg))
    # The run's policy (what `auto` resolved to when it trained), before the model is rebuilt.
    trained_policy = precision.restore_trained_policy(run_cfg.precision, cfg.run_dir)
    model = models.load_trained_model(cfg.run_dir / MODEL_FILE, run_cfg.model, run_cfg.precision.float32_layers,
                                      run_cfg.precision.float16_layers)
    datasets = data.load_datasets(run_cfg.data, seed=run_cfg.seed, recorded=cfg.run_dir / DATA_DIR)
    spec = datasets.spec
    val_x, val_y = datasets.validation_rows(max(cfg.export.parity_rows, cfg.export.validation_rows)
                                            if cfg.export.validation_rows else None)
    golden = parity.golden_batch(val_x, val_y, cfg.export.parity_rows, spec.task,
                                 _golden_files(datasets, val_x[:cfg.export.parity_rows]))
    validation = parity.GoldenBatch(np.asarray(val_x[:cfg.export.validation_rows or None], np.float32),
                                    np.asarray(val_y[:cfg.export.validation_rows or None]), spec.task)
    rebuilds = auto.Rebuilds(model, run_cfg, datasets, golden, validation)
    policy = precision.resolve_serving_policy(
        cfg.export.serving_policy, trained_policy,
        measure=lambda candidates: auto.measure(rebuilds, candidates, cfg, trained_policy.name))
    gate = parity.Gate(golden, trained_policy=trained_policy.name, serving_policy=policy.name,
                       parity_tolerance=cfg.export.parity_tolerance, validation=validation)
    served_keras, exported_from = _keras_paths(gate, cfg, model, rebuilds, trained_policy, policy)

    base = cfg.model_base_path
    version = metadata.version_to_publish(cfg)
    with artifacts.atomic_dir(base / str(version)) as tmp:
        _write_checked_saved_model(tmp, served_keras, gate, exported_from, cfg, datasets)
        weights = saved_model.weights_by_dtype(tmp)
        problem = saved_model.weights_problem(policy.to_dict(), weights)
        if problem:
            raise ExportError(f"{problem}; nothing was published")
        artifacts.write_json_atomic(tmp / saved_model.PIPELINE_JSON,
                                    _metadata(tmp, cfg, run_cfg, version, (trained_policy, policy), gate, spec))
        if gate.passed:  # the server loads only a version that passed every offline rule
            served = parity.served_outputs(tmp, cfg.export.model_name, version, spec.input_name, gate.golden,
                                           REGRESS_SIGNATURE if spec.task == "regression" else CLASSIFY_SIGNATURE)
            for path, outputs in served.items():
                how = "Predict, predict_images" if path == "server_images" else path.split('_')[1].capitalize()
                gate.add(path, outputs, f"the live server over gRPC ({how})")
                gate.same_bits(path, "saved_model")
        log.info("parity gate on %d golden rows, %d validation rows:\n%s", len(gate.golden.x),
                 len(gate.validation.x), gate.summary())
        if not gate.passed:
            rejected = cfg.run_dir / PARITY_REJECTED_FILE
            artifacts.write_json_atomic(rejected, gate.report())
            raise ExportError(f"parity gate failed: {'; '.join(gate.failures())}; nothing was published "
                              f"(report: {rejected})")
        parity.write_report(gate, tmp)
    published = base / str(version)
    log.info("exported %s version %d (trained %s, serving %s, weights %s; parity report %s) → %s",
             cfg.export.model_name, version, trained_policy.name, policy.name, saved_model.describe_bytes(weights),
             PARITY_JSON, published)
    return published


def _keras_paths(gate: parity.Gate, cfg: Config, model: keras.Model, rebuilds: auto.Rebuilds,
                 trained_policy: precision.PolicyInfo, policy: precision.PolicyInfo) -> tuple[keras.Model, str]:
    """Adds the trained model, its float32 rebuild and (when export.serving_policy differs) its serving rebuild to
    the gate, each reduced-precision one judged against float32 by its policy's tolerance. Returns the serving
    model to export and its path's name."""
    served_keras = models.serving_model(model, rebuilds.datasets.spec)
    # Golden and validation rows in separate calls: a graph's rounding may depend on the batch's size.
    golden, validation = models.graph_outputs(served_keras, gate.golden.x, gate.validation.x)
    gate.add("trained", golden, f"trained Keras model under {trained_policy.name}", validation_outputs=validation)
    float32 = rebuilds["float32"]
    gate.add("float32", float32.golden, "the same weights rebuilt under float32", validation_outputs=float32.validation)
    gate.precision("trained", precision.tolerance(trained_policy.name, cfg.export.tolerances))
    if policy.name == trained_policy.name:
        return served_keras, "trained"
    weights = "stored in " + policy.variable_dtype if policy.variable_dtype != "float32" else "float32 master weights"
    serving = rebuilds[policy.name]
    gate.add("serving", serving.golden, f"the same weights rebuilt under {policy.name}, {weights} "
             f"(export.serving_policy {cfg.export.serving_policy})", validation_outputs=serving.validation)
    gate.precision("serving", precision.tolerance(policy.name, cfg.export.tolerances))
    return serving.model, "serving"


def _golden_files(datasets: data.Datasets, golden_x: np.ndarray) -> tuple[bytes, ...]:
    """An image-folder model's golden rows as their files' bytes (the parity gate sends them to predict_images),
    checked to decode to exactly the golden rows; () for other models."""
    if not datasets.spec.encoded_images:
        return ()
    files, decoded, _ = datasets.val.encoded_rows(len(golden_x))
    if not np.array_equal(decoded, golden_x):
        raise ExportError("the validation images decode to other rows than the validation pipeline's; nothing was "
                          "published (did the image files change during the export?)")
    return tuple(files)


def image_limits(cfg: Config, spec: data.DataSpec) -> signatures.ImageLimits | None:
    """What the bytes signatures of an image-folder model decode (export.min_image_side, export.max_image_pixels)."""
    if not spec.encoded_images:
        return None
    return signatures.ImageLimits.of(cfg.export.min_image_side, cfg.export.max_image_pixels, spec.image_shape)


def _write_checked_saved_model(tmp: Path, served_keras: keras.Model, gate: parity.Gate, exported_from: str,
                               cfg: Config, datasets: data.Datasets) -> None:
    """Writes the SavedModel and its warmup file into tmp and checks them: float32 signatures, the same graph as
    the Keras model (gate), the task signature's answers, finite outputs at the input limits (gate)."""
    spec, golden = datasets.spec, gate.golden
    signatures.write_saved_model(served_keras, spec, tmp, image_limits(cfg, spec))
    signature_defs = saved_model.read_signature_defs(tmp)
    wrong = [f"{name}: {problem}" for name in sorted(signature_defs) if not name.startswith("__")
             for problem in signatures.signature_problems(name, signature_defs[name])]
    if wrong:
        raise ExportError(f"{'; '.join(wrong)}; exported models must have float32 inputs and outputs")
    loaded = tf.saved_model.load(str(tmp))
    signature = loaded.signatures[SIGNATURE]

    def run(x: np.ndarray) -> dict[str, np.ndarray]:
        return {name: t.numpy() for name, t in signature(**{spec.input_name: tf.constant(x)}).items()}

    saved_outputs = run(golden.x)
    gate.add("saved_model", saved_outputs, "the reloaded SavedModel's serving_default signature",
             validation_outputs=run(gate.validation.x))
    gate.same_graph("saved_model", exported_from)
    gate.probe_input_limits("saved_model", parity.probe_input_limits(signature, spec.input_name, datasets.statistics,
                                                                     spec.input_shape,
                                                                     per_column=spec.image_shape is None,
                                                                     ids=spec.categorical))
    if spec.task == "regression":
        signatures.check_regression(loaded.signatures[REGRESS_SIGNATURE], spec, golden.x, saved_outputs)
    else:
        signatures.check_classification(loaded.signatures[CLASSIFY_SIGNATURE], spec, golden.x, saved_outputs)
    if golden.encoded:  # the same rows as image files, decoded in the graph: the same bits (docs/serving.md)
        images = loaded.signatures[signatures.IMAGES_SIGNATURE]
        gate.add("image_bytes", {name: t.numpy() for name, t in images(image_bytes=tf.constant(golden.encoded)).items()},
                 "the reloaded SavedModel's predict_images signature on the same rows' image files")
        gate.same_bits("image_bytes", "saved_model")
        if spec.task == "classification":
            signatures.check_classify_images(loaded.signatures[signatures.CLASSIFY_IMAGES_SIGNATURE], spec,
                                             golden.encoded, saved_outputs)
    signatures.write_warmup_requests(tmp / WARMUP_FILE, cfg.export.model_name, cfg.serving.batch_size, spec, golden.x,
                                     golden.encoded)


def _metadata(tmp: Path, cfg: Config, run_cfg: Config, version: int,
              policies: tuple[precision.PolicyInfo, precision.PolicyInfo], gate: parity.Gate,
              spec: data.DataSpec) -> dict:
    """assets.extra/pipeline.json (docs/export.md) of the version staged in tmp; policies: (trained, serving)."""
    signature_defs = saved_model.read_signature_defs(tmp)
    task_signature = ({REGRESS_SIGNATURE: signatures.regression_spec(spec)} if spec.task == "regression"
                      else {CLASSIFY_SIGNATURE: signatures.classification_spec(spec)})
    limits = image_limits(cfg, spec)
    if limits is not None:
        default_outputs = signatures.tensor_specs(signature_defs[SIGNATURE])["outputs"]
        task_signature[signatures.IMAGES_SIGNATURE] = signatures.images_spec(spec, limits, default_outputs)
        if spec.task == "classification":
            task_signature[signatures.CLASSIFY_IMAGES_SIGNATURE] = signatures.classify_images_spec(spec, limits)
    same_graph = next(c for c in gate.comparisons if c["path"] == "saved_model")
    served_path = "serving" if "serving" in gate.paths else "trained"
    vs_float32 = next(c for c in gate.comparisons if c["kind"] == "precision" and c["path"] == served_path)
    return {
        **metadata.version_header(cfg, version, policies, tmp),
        "signatures": {SIGNATURE: signatures.tensor_specs(signature_defs[SIGNATURE]), **task_signature},
        "task": spec.task,
        "label_names": list(spec.label_names),
        "config": _recorded_config(cfg, run_cfg),
        "metrics": artifacts.read_json(cfg.run_dir / METRICS_FILE),
        "parity": {"rows": len(gate.golden.x), "max_abs_diff": same_graph["max_abs_diff"],
                   "max_abs_diff_per_output": same_graph["max_abs_diff_per_output"],
                   "argmax_agreement": same_graph["argmax_agreement"], "tolerance": gate.parity_tolerance,
                   "vs_float32": {key: vs_float32[key] for key in ("path", "policy", "max_abs_diff_per_output",
                                                                   "max_rel_diff", "argmax_agreement", "metric_drop",
                                                                   "tolerance")},
                   "input_limits": gate.input_limits and {key: gate.input_limits[key]
                                                          for key in ("rows", "low", "high", "nonfinite_rows")},
                   "report": str(PARITY_JSON)},
        "run_dir": str(cfg.run_dir),
        "versions": {"tensorflow": tf.__version__, "keras": keras.__version__,
                     "numpy": np.__version__, "python": platform.python_version()},
    }


def _same_as_newest(cfg: Config, run_cfg: Config) -> Path | None:
    """The newest version's directory when its pipeline.json records the run's weights (metrics.json's
    weights_sha1) and the config this export would record; None otherwise, or when it cannot be read (issue 23:
    `make export` twice published two identical versions)."""
    versions = saved_model.list_versions(cfg.model_base_path)
    if not versions:
        return None
    newest = cfg.model_base_path / str(versions[-1])
    try:
        recorded = saved_model.read_pipeline_json(newest) or {}
        weights = artifacts.read_json(cfg.run_dir / METRICS_FILE).get("weights_sha1")
    except Exception:  # noqa: BLE001 - a version we cannot read is not the same: publish a new one
        return None
    config = json.loads(json.dumps(_recorded_config(cfg, run_cfg)))
    if weights is None or recorded.get("metrics", {}).get("weights_sha1") != weights or recorded.get("config") != config:
        return None
    log.info("%s already holds these weights (sha1 %s) and this config: nothing published; --force publishes a new "
             "version anyway", newest, weights)
    return newest


def _recorded_config(cfg: Config, run_cfg: Config) -> dict:
    """The config pipeline.json records: the run's, with this export's export and serving sections."""
    return {**run_cfg.to_dict(), "export": cfg.export.model_dump(mode="json"),
            "serving": cfg.serving.model_dump(mode="json")}


def _finished_run_config(cfg: Config) -> Config:
    """The config the run was trained with; refuses unfinished runs and mismatched training settings."""
    run_dir = cfg.run_dir
    if not (run_dir / MODEL_FILE).is_file() or not (run_dir / METRICS_FILE).is_file():
        raise ExportError(f"{run_dir}: no finished training run (model.keras and metrics.json missing); "
                          f"run `make train` with the same config first")
    run_cfg = validate_config(yaml.safe_load((run_dir / CONFIG_FILE).read_text()), str(run_dir / CONFIG_FILE))
    changed = differences(run_cfg.to_dict(), cfg.to_dict())
    if changed:
        raise ExportError(f"{run_dir} was trained with other settings than this config: {'; '.join(changed)}; export "
                          "with the config (and --set overrides) used for training, or train again with this config")
    return run_cfg
