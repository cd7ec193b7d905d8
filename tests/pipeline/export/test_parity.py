"""The export's parity gate: golden rows through trained, float32, SavedModel and live-server paths;
export.serving_policy rebuilds the same weights under another policy, covered by the same gate."""

import json

import numpy as np
import pytest

from pipeline import precision
from pipeline.export import parity
from serving.servable import saved_model
from pipeline.config import ConfigError, load_config
from pipeline.export import ExportError, export
from serving.servable.runner import Runner
from pipeline.verify import verify


def _report(version_dir):
    return json.loads((version_dir / "assets.extra/parity.json").read_text())


def _comparison(report, path):
    return next(c for c in report["comparisons"] if c["path"] == path)


def test_every_path_is_in_the_report_and_the_served_paths_match_the_saved_model_bit_for_bit(exported_model):
    report = _report(exported_model.version_dir)
    assert report["passed"] and report["rows"] == 256  # export.parity_rows
    assert set(report["paths"]) == {"trained", "float32", "saved_model", "server_predict", "server_classify"}
    assert report["policies"] == {"trained": "mixed_float16", "serving": "mixed_float16"}
    for path in ("server_predict", "server_classify"):
        assert _comparison(report, path)["identical"]
        assert _comparison(report, path)["reference"] == "saved_model"
    assert _comparison(report, "saved_model")["max_abs_diff"] == 0.0  # same graph on CPU: same bits
    precision_check = _comparison(report, "trained")
    assert precision_check["reference"] == "float32" and precision_check["kind"] == "precision"
    assert 0 < precision_check["max_abs_diff"] and precision_check["argmax_agreement"] >= 0.98  # float16 is not float32
    golden = slice(0, 256)
    accuracy = report["paths"]["saved_model"]["metric"]["accuracy"]
    assert accuracy == np.mean(exported_model.keras_probabilities[golden].argmax(-1) == exported_model.val_y[golden])
    assert report["paths"]["float32"]["metric_delta_vs_float32"] == {"accuracy": 0.0}


def test_a_failed_rule_publishes_nothing_and_keeps_the_rejected_report(trained_run, tiny_config_path, tmp_path):
    cfg = load_config(tiny_config_path, [f"export.base_path={tmp_path}", "export.policy_tolerance=0"])
    with pytest.raises(ExportError, match=r"trained vs float32 \(precision\).*export.policy_tolerance"):
        export(cfg)
    assert saved_model.list_versions(cfg.model_base_path) == []
    assert not list(cfg.model_base_path.glob(".tmp-*")), "no staged version or server copy left behind"
    rejected = json.loads((cfg.run_dir / "parity-rejected.json").read_text())
    assert not rejected["passed"] and not _comparison(rejected, "trained")["passed"]


@pytest.mark.parametrize("serving_policy, compute_dtype", [("float32", "float32"), ("mixed_bfloat16", "bfloat16")])
def test_serving_policy_rebuilds_the_trained_weights_under_another_policy(trained_run, tiny_config_path, tmp_path,
                                                                          serving_policy, compute_dtype):
    cfg = load_config(tiny_config_path, [f"export.base_path={tmp_path}", f"export.serving_policy={serving_policy}"])
    version_dir = export(cfg)
    meta = saved_model.read_pipeline_json(version_dir)
    assert meta["policy"]["name"] == "mixed_float16"  # what it trained under stays on record
    assert meta["serving_policy"]["name"] == serving_policy and meta["serving_policy"]["setting"] == serving_policy
    report = _report(version_dir)
    assert report["policies"] == {"trained": "mixed_float16", "serving": serving_policy}
    assert _comparison(report, "serving")["reference"] == "float32"
    assert _comparison(report, "saved_model")["reference"] == "serving"
    runner = Runner.load(version_dir)
    try:
        assert runner.policy == serving_policy and set(runner.compute_ops) == {compute_dtype}
    finally:
        runner.close()
    statuses = {check.name: check.status for check in verify(version_dir).checks}
    assert statuses["policy"] == "PASS" and statuses["parity"] == "PASS"


def test_serving_policy_auto_follows_the_detected_hardware(trained_run, tiny_config_path, tmp_path, monkeypatch):
    monkeypatch.setattr(precision, "detect_hardware", lambda: precision.Hardware(cpu_flags=frozenset({"avx2"})))
    cfg = load_config(tiny_config_path, [f"export.base_path={tmp_path}", "export.serving_policy=auto"])
    meta = saved_model.read_pipeline_json(export(cfg))
    assert meta["serving_policy"]["name"] == "float32" and meta["serving_policy"]["requested"] == "auto"
    assert "without native bfloat16" in meta["serving_policy"]["reason"]


def test_a_bad_serving_policy_is_one_line_naming_the_key_and_the_choices(tiny_config_path):
    with pytest.raises(ConfigError) as error:
        load_config(tiny_config_path, ["export.serving_policy=float8"])
    assert "export.serving_policy" in str(error.value) and "mixed_bfloat16" in str(error.value)
    assert len(str(error.value).splitlines()) == 1


def _gate(**tolerances):
    golden = parity.golden_batch(np.zeros((4, 2), np.float32), np.array([0, 1, 1, 0]), rows=4, task="classification")
    return parity.Gate(golden, trained_policy="mixed_float16", serving_policy="mixed_float16",
                       **{"parity_tolerance": 1e-5, "policy_tolerance": 0.05, "min_argmax_agreement": 0.98,
                          **tolerances})


def test_same_bits_means_identical_values_and_dtypes():
    probabilities = np.array([[0.9, 0.1], [0.2, 0.8], [0.3, 0.7], [0.6, 0.4]], np.float32)
    gate = _gate()
    gate.add("saved_model", {"probabilities": probabilities}, "")
    gate.add("one_ulp_off", {"probabilities": np.nextafter(probabilities, 1, dtype=np.float32)}, "")
    gate.add("float16", {"probabilities": probabilities.astype(np.float16)}, "")
    gate.add("copy", {"probabilities": probabilities.copy()}, "")
    for path in ("one_ulp_off", "float16", "copy"):
        gate.same_bits(path, "saved_model")
    assert [c["passed"] for c in gate.comparisons] == [False, False, True]
    assert gate.paths["copy"]["metric"] == {"accuracy": 1.0}


def test_precision_rule_fails_on_a_changed_prediction_or_a_nan():
    reference = np.array([[0.9, 0.1], [0.2, 0.8], [0.3, 0.7], [0.6, 0.4]], np.float32)
    flipped = reference.copy()
    flipped[3] = [0.49, 0.51]  # within 0.15 of float32, but another class
    gate = _gate(policy_tolerance=0.15)
    gate.add("float32", {"probabilities": reference}, "")
    gate.add("flipped", {"probabilities": flipped}, "")
    gate.add("nan", {"probabilities": np.where(reference > 0.85, np.nan, reference).astype(np.float32)}, "")
    gate.precision("flipped")
    gate.precision("nan")
    assert not gate.passed and [c["passed"] for c in gate.comparisons] == [False, False]
    assert gate.comparisons[0]["argmax_agreement"] == 0.75
    assert gate.comparisons[0]["metric_delta"] == {"accuracy": -0.25}
    assert "argmax agreement 0.7500" in gate.failures()[0]
