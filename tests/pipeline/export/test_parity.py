"""The export's parity gate: golden rows through trained, float32, SavedModel and live-server paths;
export.serving_policy rebuilds the same weights under another policy, covered by the same gate."""

import json
import re

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
    cfg = load_config(tiny_config_path, [f"export.base_path={tmp_path}", "export.tolerances.mixed_float16.max_rel_diff=0"])
    with pytest.raises(ExportError) as error:
        export(cfg)
    # One line naming the rule, the worst output and the key that bounds it.
    assert len(str(error.value).splitlines()) == 1
    assert re.search(r"trained vs float32 \(precision\): output '(logits|probabilities)' max rel diff [\d.e-]+ \(max abs "
                     r"diff [\d.e-]+\) > 0 \(export.tolerances.mixed_float16.max_rel_diff\)", str(error.value))
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


def _gate():
    golden = parity.golden_batch(np.zeros((4, 2), np.float32), np.array([0, 1, 1, 0]), rows=4, task="classification")
    return parity.Gate(golden, trained_policy="mixed_float16", serving_policy="mixed_float16", parity_tolerance=1e-5,
                       validation=golden)


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
    gate = _gate()
    nan = np.where(reference > 0.85, np.nan, reference).astype(np.float32)
    gate.add("float32", {"probabilities": reference}, "", validation_outputs={"probabilities": reference})
    gate.add("flipped", {"probabilities": flipped}, "", validation_outputs={"probabilities": flipped})
    gate.add("nan", {"probabilities": nan}, "", validation_outputs={"probabilities": nan})
    tolerance = precision.Tolerance("bfloat16", max_rel_diff=0.15, min_argmax_agreement=0.98, max_metric_drop=50)
    gate.precision("flipped", tolerance)
    gate.precision("nan", tolerance)
    assert not gate.passed and [c["passed"] for c in gate.comparisons] == [False, False]
    assert gate.comparisons[0]["argmax_agreement"] == 0.75
    assert gate.comparisons[0]["metric_delta"] == {"accuracy": -0.25}
    assert "output 'probabilities' argmax agreement 0.7500 < 0.98 (export.tolerances.bfloat16.min_argmax_agreement)" \
        in gate.failures()[0]
    assert "output 'probabilities' max rel diff nan" in gate.failures()[1]


def test_precision_rule_bounds_the_abs_diff_and_the_validation_metric_when_asked():
    reference = np.array([[0.9, 0.1], [0.2, 0.8], [0.3, 0.7], [0.6, 0.4]], np.float32)
    nudged = reference + np.array([0.04, -0.04], np.float32)  # rel diff 0.044: within 0.05, same classes
    flipped_val = reference.copy()
    flipped_val[0] = [0.4, 0.6]  # one of the four validation rows now wrong: 25 pt
    gate = _gate()
    gate.add("float32", {"probabilities": reference}, "", validation_outputs={"probabilities": reference})
    gate.add("nudged", {"probabilities": nudged}, "", validation_outputs={"probabilities": flipped_val})
    lenient = precision.Tolerance("float16", max_rel_diff=0.05, min_argmax_agreement=0.98, max_metric_drop=30)
    strict = precision.Tolerance("bfloat16", max_rel_diff=0.05, min_argmax_agreement=0.98, max_metric_drop=20,
                                 max_abs_diff=0.01)
    gate.precision("nudged", lenient)
    gate.precision("nudged", strict)
    assert [c["passed"] for c in gate.comparisons] == [True, False]
    assert gate.comparisons[1]["metric_drop"] == pytest.approx(25.0)
    failure = gate.failures()[0]
    assert "output 'probabilities' max abs diff 0.04 > 0.01 (export.tolerances.bfloat16.max_abs_diff)" in failure
    assert "validation rows: 25 pt accuracy drop > 20 (export.tolerances.bfloat16.max_metric_drop)" in failure
    assert gate.report()["tolerances"]["bfloat16"]["max_abs_diff"] == 0.01


def test_a_nonfinite_output_at_the_input_limits_fails_the_gate():
    gate = _gate()
    gate.probe_input_limits("saved_model", {"rows": 6, "low": 0.0, "high": 16.0, "nonfinite_rows": 2,
                                            "example": "feature 3 at 16, the others at 0"})
    assert not gate.passed and gate.report()["input_limits"]["passed"] is False
    assert gate.failures() == ["saved_model at the input limits: 6 rows with each feature at 0 or 16 (the training "
                               "rows' range): 2 give NaN or inf, e.g. feature 3 at 16, the others at 0"]


def test_each_policy_has_its_tolerance_and_the_config_overrides_single_values():
    from pipeline.config import PolicyTolerance

    assert precision.tolerance("bfloat16").max_rel_diff == 0.15
    assert precision.tolerance("float16").max_rel_diff == 0.05
    assert precision.tolerance("float32").max_metric_drop == 0.0
    chosen = precision.tolerance("bfloat16", {"bfloat16": PolicyTolerance(max_metric_drop=1.0)})
    assert (chosen.max_metric_drop, chosen.max_rel_diff, chosen.max_abs_diff) == (1.0, 0.15, None)


@pytest.mark.parametrize("override, message", [
    ("export.tolerances.float8.max_rel_diff=1", "export.tolerances.float8: unknown key; expected one of 'float32'"),
    ("export.tolerances.bfloat16.max_rel=1", "export.tolerances.bfloat16.max_rel: unknown key; did you mean "
                                            "'max_rel_diff'?"),
    ("export.tolerances.float16.max_metric_drop=-1", "export.tolerances.float16.max_metric_drop: expected a number >= 0"),
    ("export.policy_tolerance=0.1", "export.policy_tolerance: replaced by export.tolerances.<policy>.max_rel_diff"),
])
def test_a_bad_tolerance_is_one_line_naming_the_key(override, message):
    with pytest.raises(ConfigError) as error:
        load_config(None, [override])
    assert message in str(error.value) and len(str(error.value).splitlines()) == 1
