"""bench/peers.py without installing or starting anything: the files it writes for the peers, its
judgement of the rows, and its install step's cache and failure."""

from __future__ import annotations

import ast
import math
import stat
import sys
from pathlib import Path

import numpy as np
import pytest

from bench import peers
from bench.exported_model import ExportedModel
from bench.workloads import FULL, QUICK


@pytest.fixture
def model(tmp_path):
    return ExportedModel(tmp_path / "models" / "digits", "digits", "features",
                         np.arange(2 * 64, dtype=np.float32).reshape(2, 64) / 128, "float32")


def _call_keywords(tree: ast.AST, name: str) -> dict:
    """Keyword arguments of the first call to `<anything>.name(...)` in tree: literals, other expressions as source."""
    for node in ast.walk(tree):
        if isinstance(node, ast.Call) and isinstance(node.func, ast.Attribute) and node.func.attr == name:
            return {keyword.arg: _literal(keyword.value) for keyword in node.keywords}
    raise AssertionError(f"no call to {name}")


def _literal(node: ast.AST):
    try:
        return ast.literal_eval(node)
    except ValueError:
        return ast.unparse(node)


def test_bento_service_is_valid_python_with_adaptive_batching(model, tmp_path):
    source = peers.bento_service_source(model, tmp_path / "models" / "digits" / "3", max_batch_size=64)
    tree = ast.parse(compile(source, "service.py", "exec", flags=ast.PyCF_ONLY_AST))
    assert _call_keywords(tree, "api") == {"batchable": True, "batch_dim": 0, "max_batch_size": 64}
    assert _call_keywords(tree, "service") == {"workers": 1}
    assigned = {node.targets[0].id: ast.literal_eval(node.value) for node in tree.body if isinstance(node, ast.Assign)}
    assert assigned["SAVED_MODEL"] == str(tmp_path / "models" / "digits" / "3")
    assert "'features'" in source and "'probabilities'" in source
    (service,) = [node for node in tree.body if isinstance(node, ast.ClassDef)]
    predict = next(node for node in service.body if isinstance(node, ast.FunctionDef) and node.name == "predict")
    assert [arg.arg for arg in predict.args.args] == ["self", "instances"]  # the JSON body's key, as for ours


def test_mlflow_sources_are_valid_python(model):
    code = peers.mlflow_model_source(model)
    tree = ast.parse(compile(code, "saved_model_pyfunc.py", "exec", flags=ast.PyCF_ONLY_AST))
    (pyfunc,) = [node for node in tree.body if isinstance(node, ast.ClassDef)]
    assert {node.name for node in pyfunc.body if isinstance(node, ast.FunctionDef)} == {"load_context", "predict"}
    assert "mlflow.models.set_model(SavedModelPyfunc())" in code and "'features'" in code

    save = peers.mlflow_save_source(model, 10, ["mlflow==1.0", "tensorflow==2.0"])
    tree = ast.parse(compile(save, "save.py", "exec", flags=ast.PyCF_ONLY_AST))
    keywords = _call_keywords(tree, "save_model")
    assert keywords["pip_requirements"] == ["mlflow==1.0", "tensorflow==2.0"]
    assert keywords["python_model"] == "code"  # models from code: the pyfunc's file, nothing pickled
    assert "(-1, 64)" in save and "(-1, 10)" in save


def test_requirements_pin_every_package():
    lines = [line for line in peers.REQUIREMENTS.read_text().splitlines() if line.strip() and not line.startswith("#")]
    assert {line.split("==")[0] for line in lines} >= {"mlflow", "bentoml"}
    assert all("==" in line for line in lines)
    assert any(line.startswith(("tensorflow==2.21.", "tensorflow-cpu==2.21.")) for line in lines)
    assert [line.split("==")[0] for line in peers._pinned(("mlflow",))] == ["mlflow"]


def test_probabilities_from_each_servers_json():
    assert peers.probabilities({"predictions": [{"probabilities": [0.25, 0.75], "logits": [0, 1]}]}) == [0.25, 0.75]
    assert peers.probabilities({"predictions": [[0.25, 0.75]]}) == [0.25, 0.75]  # MLflow
    assert peers.probabilities([[0.25, 0.75]]) == [0.25, 0.75]  # BentoML
    assert peers.probabilities({"predictions": {"probabilities": [[0.25, 0.75]]}}) == [0.25, 0.75]


def _rows(qps: dict, diffs: dict | None = None, errors: dict | None = None, clients=(1, 8, 32)) -> list[dict]:
    return [{"server": server, "clients": n, "qps": qps[server] * n, "p50_ms": 1.0, "p99_ms": 2.0,
             "errors": (errors or {}).get(server, 0), "max_abs_diff": (diffs or {}).get(server, 0.0)}
            for n in clients for server in ("mlflow", "bentoml", "ours (rest)", "ours (grpc)")]


def _by(rows: list[dict]) -> dict:
    return {(row["server"], row["clients"]): row for row in rows}


def test_judge_ratio_and_target_met():
    rows = _rows({"mlflow": 100.0, "bentoml": 150.0, "ours (rest)": 450.0, "ours (grpc)": 600.0})
    summary = peers.judge(rows)
    assert summary["best_peer_32"] == "bentoml" and summary["best_peer_qps_32"] == 150.0 * 32
    assert summary["ratio_to_best_peer_32"] == {"ours (rest)": pytest.approx(3.0), "ours (grpc)": pytest.approx(4.0)}
    by = _by(rows)
    assert by["ours (rest)", 32]["target_met"] is True and by["ours (grpc)", 32]["target_met"] is True
    assert by["ours (rest)", 32]["target"].startswith(">= 3x bentoml")
    assert by["mlflow", 8]["ratio_to_best_peer"] == pytest.approx(100 / 150)
    assert all(row["target_met"] is True and row["note"] is None for row in rows)


def test_judge_fails_ours_below_three_times_the_best_peer():
    rows = _rows({"mlflow": 100.0, "bentoml": 150.0, "ours (rest)": 449.0, "ours (grpc)": 600.0})
    peers.judge(rows)
    by = _by(rows)
    assert by["ours (rest)", 32]["target_met"] is False and "2.99x the best peer" in by["ours (rest)", 32]["note"]
    assert by["ours (grpc)", 32]["target_met"] is True
    assert by["ours (rest)", 8]["target_met"] is True  # only 32 clients is compared with the peers


def test_judge_fails_wrong_probabilities_and_failed_requests():
    rows = _rows({"mlflow": 100.0, "bentoml": 500.0, "ours (rest)": 310.0, "ours (grpc)": 320.0},
                 diffs={"bentoml": 3e-4, "ours (grpc)": math.nan}, errors={"mlflow": 2})
    summary = peers.judge(rows)
    by = _by(rows)
    assert by["bentoml", 1]["target_met"] is False and "differ by 0.0003 > 1e-05" in by["bentoml", 1]["note"]
    assert by["mlflow", 8]["target_met"] is False and "2 failed requests" in by["mlflow", 8]["note"]
    assert by["ours (grpc)", 1]["target_met"] is False  # NaN is no match
    # A peer that answers wrongly or drops requests is no yardstick: none is left at 32 clients.
    assert summary["best_peer_qps_32"] is None and summary["ratio_to_best_peer_32"] == {}
    assert by["ours (rest)", 32]["target_met"] is False
    assert "no peer measured correctly" in by["ours (rest)", 32]["note"]


def test_judge_smoke_sizes_have_no_ratio_at_32_clients():
    rows = _rows({"mlflow": 100.0, "bentoml": 150.0, "ours (rest)": 10.0, "ours (grpc)": 10.0}, clients=(1,))
    summary = peers.judge(rows)
    assert summary == {"best_peer_32": None, "best_peer_qps_32": None, "ratio_to_best_peer_32": {}}
    assert all(row["target_met"] is True for row in rows)  # result_files.judge blanks them in a smoke run


def test_sizes_measure_1_8_32_clients():
    assert FULL.peer_clients == (1, 8, 32) and QUICK.peer_clients == (1,)


def _fake_python(venv: Path, script: str) -> None:
    python = venv / "bin" / "python"
    python.parent.mkdir(parents=True)
    python.write_text(f"#!/bin/sh\n{script}\n")
    python.chmod(python.stat().st_mode | stat.S_IXUSR)


@pytest.mark.skipif(sys.platform == "win32", reason="a shell script stands in for the venv's python")
def test_ensure_venv_installs_once_and_fails_in_one_line(tmp_path):
    requirements = tmp_path / "requirements.txt"
    requirements.write_text("mlflow==0.0.0\n")
    venv = tmp_path / "venv"
    _fake_python(venv, 'echo "Looking in indexes"\n'
                       'echo "ERROR: No matching distribution found for mlflow==0.0.0"\nexit 1')
    with pytest.raises(RuntimeError, match=r"could not install .*No matching distribution found for mlflow==0\.0\.0\); "
                                           r"log: .*install\.log") as error:
        peers.ensure_venv(venv, requirements)
    assert "\n" not in str(error.value)

    (venv / "bin" / "python").write_text("#!/bin/sh\nexit 0\n")  # pip succeeds: the stamp is written
    assert peers.ensure_venv(venv, requirements) == venv / "bin" / "python"
    (venv / "bin" / "python").write_text("#!/bin/sh\nexit 1\n")  # cached: pip is not run again
    assert peers.ensure_venv(venv, requirements) == venv / "bin" / "python"
    requirements.write_text("mlflow==0.0.1\n")  # a changed requirements file reinstalls
    with pytest.raises(RuntimeError, match="could not install"):
        peers.ensure_venv(venv, requirements)
