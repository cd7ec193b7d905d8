"""The reference an audit replays requests through: the served version's trained weights rebuilt under a policy.

Against float32 this is the parity gate's `float32` path (pipeline/export/publish.py): the training run's
model.keras (pipeline.json's run_dir), loaded under its recorded training policy, rebuilt under float32
with the same weights (models.rebuild), with the export's named outputs. It is then written as a
SavedModel with the export's signatures (pipeline/export/signatures.py), so that the audit's workers run
the reference through the same Runner, the same request preparation and the same responses as the server
ran the served version: the only difference left between the two answers is the precision. A model trained
on an image folder gets predict_images and classify_images too, with the image limits the version's
pipeline.json records, so logged image bytes replay through the same header checks and decode. A language model's
reference is generate.save's SavedModel of the rebuild (serving_default: ids -> float32 logits, as the export
writes it, pipeline/export/lm.py), which the language-model replay (pipeline/audit/lm.py) teacher-forces.

Why a rebuild from the run and not the SavedModel: a mixed-precision SavedModel's graph has float16 casts
baked in; the float32 master weights live in the run (and its pipeline.json names it). A version copied to a
serving host without its run can be audited where the run is (--run_dir).
"""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

from pipeline import artifacts, data, models, precision
from pipeline.lm import generate
from pipeline.artifacts import DATA_DIR, MODEL_FILE
from pipeline.config import WEIGHT_SECTIONS, ExportConfig, validate_config
from pipeline.errors import DataError
from pipeline.export import signatures
from serving.servable import saved_model

LANGUAGE_MODEL = "language_model"  # pipeline.json's task of a causal_lm export (pipeline/export/lm.py)


def build(version_dir: Path, against: str, destination: Path, run_dir: str | Path | None = None) -> dict[str, Any]:
    """Writes the reference SavedModel of version_dir under policy `against` into destination; returns its
    pipeline.json (serving_policy: `against`; reference_of: the version it stands in for).

    Raises:
        DataError: the version was not exported by this pipeline, its training run is not here, or the run
            was trained again since this version was exported (its weights would not be the served ones).
    """
    from pipeline.train.run import weights_sha1

    metadata = saved_model.read_pipeline_json(version_dir)
    if not metadata or not isinstance(metadata.get("config"), dict):
        raise DataError(f"{version_dir}: no {saved_model.PIPELINE_JSON} with a config: not exported by this pipeline, "
                        "so there is no training run to rebuild a reference from")
    run = Path(run_dir or metadata.get("run_dir") or "")
    if not (run / MODEL_FILE).is_file():
        raise DataError(f"{version_dir}: the reference is rebuilt from the training run's {MODEL_FILE}, which is not "
                        f"at {run} (pipeline.json run_dir); pass --run_dir where a copy of the run lies")
    run_cfg = validate_config({key: metadata["config"][key] for key in WEIGHT_SECTIONS})
    precision.restore_trained_policy(run_cfg.precision, run, recorded=metadata.get("policy"))
    trained = models.load_trained_model(run / MODEL_FILE, run_cfg.model, run_cfg.precision.float32_layers,
                                        run_cfg.precision.float16_layers)
    recorded = (metadata.get("metrics") or {}).get("weights_sha1")
    if recorded and weights_sha1(trained) != recorded:
        raise DataError(f"{run}/{MODEL_FILE} is not what version {version_dir.name} was exported from (weights sha1 "
                        f"{weights_sha1(trained)}, pipeline.json records {recorded}): the run was trained again; "
                        "pass --run_dir with the run this version came from")
    datasets = data.load_datasets(run_cfg.data, seed=run_cfg.seed, recorded=run / DATA_DIR)
    with precision.policy_scope(against):
        rebuilt = models.rebuild(trained, run_cfg.model, datasets.spec, datasets.statistics,
                                 run_cfg.precision.float32_layers, run_cfg.precision.float16_layers)
    destination.parent.mkdir(parents=True, exist_ok=True)
    if metadata.get("task") == LANGUAGE_MODEL:
        generate.save(generate.Generator(rebuilt, tokenizer=datasets.tokenizer), destination)
    else:
        reference = models.serving_model(rebuilt, datasets.spec)
        signatures.write_saved_model(reference, datasets.spec, destination, _image_limits(metadata, datasets.spec))
    copied = ("model_name", "task", "label_names", "policy", "language_model", saved_model.OP_LIBRARIES)
    written = {**{key: metadata[key] for key in copied if key in metadata},
               "version": metadata.get("version"), "serving_policy": precision.describe_policy(against).to_dict(),
               "reference_of": {"version_dir": str(version_dir), "serving_policy": saved_model.serving_policy(metadata),
                                "run_dir": str(run)}}
    artifacts.write_json_atomic(destination / saved_model.PIPELINE_JSON, written)
    return written


def _image_limits(metadata: dict[str, Any], spec: data.DataSpec) -> signatures.ImageLimits | None:
    """The served version's image limits (pipeline.json's predict_images entry), so the reference refuses and
    decodes images as the served graph did; a version exported before predict_images existed gets the
    configured ones (export.min_image_side, export.max_image_pixels)."""
    if not spec.encoded_images:
        return None
    recorded = (((metadata.get("signatures") or {}).get(signatures.IMAGES_SIGNATURE) or {}).get("inputs") or {}) \
        .get(signatures.IMAGES_INPUT) or {}
    if "max_image_pixels" in recorded:
        return signatures.ImageLimits(int(recorded["min_image_side"]), int(recorded["max_image_pixels"]))
    export = ExportConfig(**{key: value for key, value in ((metadata.get("config") or {}).get("export") or {}).items()
                             if key in ("min_image_side", "max_image_pixels")})
    return signatures.ImageLimits.of(export.min_image_side, export.max_image_pixels, spec.image_shape)


def parity_figures(version_dir: Path) -> dict[str, Any] | None:
    """What the export's parity gate measured between the trained model and its float32 rebuild (parity.json):
    {"rows", "max_abs_diff_per_output", "tolerances"}; None without a parity.json."""
    path = version_dir / artifacts.PARITY_JSON
    if not path.is_file():
        return None
    report = json.loads(path.read_text())
    if report.get("task") == LANGUAGE_MODEL:
        return _language_model_parity(report)
    served_path = "serving" if "serving" in report.get("paths", {}) else "trained"
    comparison = next((c for c in report.get("comparisons", [])
                       if c.get("path") == served_path and c.get("reference") == "float32"), None)
    return {"rows": report.get("rows"), "tolerances": report.get("tolerances") or {},
            "max_abs_diff_per_output": (comparison or {}).get("max_abs_diff_per_output"),
            "max_rel_diff_per_output": (comparison or {}).get("max_rel_diff_per_output")}


def _language_model_parity(report: dict[str, Any]) -> dict[str, Any]:
    """parity_figures of a language model's parity.json (pipeline/export/lm_parity.py): its teacher-forcing check of
    the served weights against float32 on the validation windows (rows: windows), and the tolerance it was held
    to, under the served policy's name."""
    check = next((c for c in report.get("checks", []) if c.get("kind") == "teacher forcing"
                  and c.get("reference") == "float32" and c.get("path") in ("serving", "trained")
                  and c.get("tolerance")), None)
    policies = report.get("policies") or {}
    tolerances = {"parity_tolerance": report["parity_tolerance"]} if "parity_tolerance" in report else {}
    if check:
        tolerances[policies.get(check["path"])] = check["tolerance"]
    return {"rows": report.get("windows"), "tolerances": tolerances,
            "max_abs_diff_per_output": {"logits": check["max_abs_diff"]} if check else None,
            "max_rel_diff_per_output": {"logits": check["max_rel_diff"]} if check else None}
