"""`pipeline predict --local` and `pipeline demo`: the user-facing paths over the runner and the server.

The regression report (MAE/RMSE) is tested with the regressor in test_model_kinds.py and over gRPC in
tests/serving/test_model_kinds_served.py."""

import re
import subprocess
import sys

import numpy as np
import pytest

from pipeline.predict import evaluate_locally


def test_local_predict_reports_the_trained_models_accuracy(exported_model, tiny_config, capsys):
    metrics = evaluate_locally(tiny_config)
    expected = np.mean(exported_model.keras_probabilities.argmax(-1) == exported_model.val_y)
    assert metrics == {"accuracy": expected}
    out = capsys.readouterr().out
    assert f"accuracy over {len(exported_model.val_y)} validation rows, in-process" in out
    assert "row 0: predicted" in out


@pytest.mark.subprocess  # make demo starts `python -m pipeline demo`, which starts a model server
def test_demo_trains_exports_serves_and_measures_accuracy_over_grpc(tiny_config_path, tmp_path):
    """The main job end to end, as `make demo` runs it, on the tiny config in its own directories."""
    result = subprocess.run(
        [sys.executable, "-m", "pipeline", "demo", str(tiny_config_path), "--set", "experiment=demo_test",
         "--set", f"train.runs_dir={tmp_path / 'runs'}", "--set", f"export.base_path={tmp_path / 'models'}"],
        cwd=tmp_path, capture_output=True, text=True, timeout=300)
    assert result.returncode == 0, result.stderr[-3000:]
    summary = re.search(r"val_accuracy (\S+) in-process, (\S+) over gRPC", result.stdout)
    assert summary, result.stdout
    assert summary[1] == summary[2], "served accuracy equals the trained model's"
    assert (tmp_path / "models/demo_test/1/saved_model.pb").is_file()
    assert "Running gRPC ModelServer at" in (tmp_path / "runs/demo_test/server.log.stdout").read_text()
    assert "server stopped" in (tmp_path / "runs/demo_test/server.log").read_text()  # its log, to the end
