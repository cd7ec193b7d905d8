"""The default digits model at the limits of its declared input range (issue #14, points 1, 2 and 7).

Digits pixels are integers 0-16; three pixels are 0 in every training row. Before the standardisation
floors, lighting one of them sent ~1e8 into the first float16 layer and the model answered NaN for every
class (504 of 566 legal rows under mixed_float16). One training of configs/default.yaml (about 10 s on 2
cores) is shared by the module: its exports under each serving policy, `verify` and `diagnose` on it, and on a
copy whose standardisation has Keras' own 1e-7 floor back (what a model trained before the fix holds).
"""

import shutil
from pathlib import Path

import keras
import numpy as np
import pytest

from pipeline import cli
from pipeline.config import load_config
from pipeline.diagnose import diagnose
from pipeline.verify import print_report, verify
from serving.servable.runner import Runner

pytestmark = pytest.mark.timeout(300)

REPO_ROOT = Path(__file__).resolve().parents[2]
DECLARED_RANGE = (0.0, 16.0)  # scikit-learn's digits: 8x8 images of pixels 0..16


def legal_rows(n_features: int = 64) -> np.ndarray:
    """Every pixel at 0 and at 16, each pixel alone at 16 (the others 0) and alone at 0 (the others 16), and 200
    random legal images: inputs a model must answer whatever its training rows showed."""
    low, high = DECLARED_RANGE
    rows = [np.full(n_features, low), np.full(n_features, high)]
    for j in range(n_features):
        rows += [np.where(np.arange(n_features) == j, high, low), np.where(np.arange(n_features) == j, low, high)]
    rows += list(np.random.default_rng(0).integers(low, high + 1, size=(200, n_features)))
    return np.asarray(rows, np.float32)


def config(workdir: Path, *overrides: str):
    return load_config(REPO_ROOT / "configs" / "default.yaml",
                       [f"train.runs_dir={workdir / 'runs'}", f"export.base_path={workdir / 'models'}", *overrides])


@pytest.fixture(scope="module")
def default_run(tmp_path_factory):
    from pipeline.train import train

    workdir = tmp_path_factory.mktemp("default_model")
    cfg = config(workdir)
    run = train(cfg)
    keras.config.set_dtype_policy("float32")
    return workdir, cfg, run


@pytest.mark.parametrize("policy", ["mixed_float16", "mixed_bfloat16", "float32", "float16", "bfloat16"])
def test_the_served_default_model_is_finite_at_the_limits_of_its_input_range(default_run, policy):
    from pipeline.export import export

    workdir, _, run = default_run
    never_lit = np.flatnonzero(run.datasets.train.x.max(axis=0) == 0)
    assert len(never_lit) >= 1  # the case of the issue: pixels that were 0 in every training row
    version_dir = export(config(workdir, f"export.serving_policy={policy}", f"export.model_name=digits_{policy}"))
    runner = Runner.load(version_dir)
    outputs = runner.predict({"features": legal_rows()})
    for name, values in outputs.items():
        assert np.isfinite(values).all(), f"{name}: {np.sum(~np.isfinite(values).all(axis=1))} rows not finite"
    np.testing.assert_allclose(outputs["probabilities"].sum(axis=1), 1.0, atol=1e-2)
    assert runner.compute_ops.get(policy.removeprefix("mixed_"))  # the served graph computes in that policy


def test_diagnose_and_verify_find_nothing_on_the_healthy_default_model(default_run, capsys):
    workdir, cfg, _ = default_run
    diagnosis = diagnose(cfg)
    # Regression (issue #14 point 7): "no findings", then three layers at risk with initial_scale 16777216.
    # Rows 100 training ranges beyond the limits (-1600) overflow the float16 logits: a warning, not an error.
    far = [finding for finding in diagnosis.findings if "beyond the input limits" in finding.problem]
    assert diagnosis.ok and diagnosis.at_risk == [] and diagnosis.findings == far
    assert [(finding.severity, finding.fix) for finding in far] == [("warning", "precision:\n  float32_layers: [logits]")]
    text = diagnosis.text()
    assert "at risk in float16: none" in text and "ERROR" not in text
    # The numbers the old rule read as risk are still there: scaled gradients below float16's normal range.
    assert any(g.scaled_subnormal_fraction + g.scaled_zero_fraction >= 0.01 for g in diagnosis.gradients
               if g.compute_dtype == "float16")
    assert diagnosis.edge["nonfinite"] == 0 and diagnosis.edge["rows"] == 130
    assert cli.main(["diagnose", str(REPO_ROOT / "configs" / "default.yaml"), "--set",
                     f"train.runs_dir={workdir / 'runs'}", "--batches", "1"]) == 0
    capsys.readouterr()

    report = verify(workdir / "models" / "digits_mixed_float16")
    statuses = {check.name: check.status for check in report.checks}
    assert statuses["constants"] == "PASS" and statuses["input limits"] == "PASS", report.text()
    assert statuses["far inputs"] == "WARN" and report.ok and print_report(report) == 0


def test_a_model_with_keras_1e7_standardisation_floor_fails_export_verify_and_diagnose(default_run, tmp_path, capsys,
                                                                                       monkeypatch):
    """A copy of the run whose standardisation divides never-lit pixels by Keras' floor 1e-7, as every model
    trained before the floors did. The validation rows never light those pixels, so only the gate's input-limits
    probe refuses it; exported as before that probe, it answers NaN at the input limits, and verify and diagnose
    name the layer and the fix."""
    from pipeline.errors import ExportError
    from pipeline.export import export, parity

    workdir, cfg, run = default_run
    old = config(tmp_path, "export.model_name=digits_old")
    shutil.copytree(cfg.run_dir, old.run_dir)
    model = keras.saving.load_model(old.run_dir / "model.keras", compile=False)
    standardize = model.get_layer("standardize")
    never_lit = run.datasets.train.x.max(axis=0) == 0
    variance = keras.ops.convert_to_numpy(standardize.adapt_variance)
    standardize.adapt_variance.assign(np.where(never_lit, 0.0, variance).astype(np.float32))
    standardize.finalize_state()
    model.save(old.run_dir / "model.keras")
    keras.config.set_dtype_policy("float32")

    with pytest.raises(ExportError, match=r"parity gate failed: saved_model at the input limits: 130 rows with each "
                                          r"feature at 0 or 16 \(the training rows' range\): \d+ give NaN or inf"):
        export(old)
    keras.config.set_dtype_policy("float32")
    monkeypatch.setattr(parity.Gate, "probe_input_limits", lambda *args: None)  # an export from before the probe
    version_dir = export(old)
    outputs = Runner.load(version_dir).predict({"features": legal_rows()})["probabilities"]
    assert np.sum(~np.isfinite(outputs).all(axis=1)) > 0  # the bug, reproduced

    report = verify(version_dir)
    checks = {check.name: check for check in report.checks}
    assert checks["parity"].status == "PASS" and not report.ok
    assert checks["constants"].status == "FAIL" and checks["input limits"].status == "FAIL"
    assert ("standardize: divides 3 feature(s) (e.g. feature 0) by 1e-07, below float16's smallest normal number "
            "6.1e-05 (read by dense_1 in float16)") in checks["constants"].detail
    assert "retrain it from scratch (python -m pipeline train CONFIG --fresh" in checks["constants"].detail

    diagnosis = diagnose(old, probe_batches=1)
    errors = {f.layer: f for f in diagnosis.findings if f.severity == "error"}
    assert set(errors) == {"standardize", "probabilities"} and not diagnosis.ok
    assert "rows at the input limits give NaN or inf outputs" in errors["probabilities"].problem
    assert errors["probabilities"].fix == errors["standardize"].fix  # the cause's fix, not a float32 layer
    assert diagnosis.edge["nonfinite"] > 0
    assert cli.main(["verify", str(version_dir)]) == 1
    capsys.readouterr()
