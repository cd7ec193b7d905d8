"""models.config generation: valid for TF Serving's parser and for our server's validation."""

import subprocess
import sys
from pathlib import Path

import pytest
from google.protobuf import text_format
from tensorflow_serving.config import model_server_config_pb2

from pipeline.config import ConfigError, load_config
from pipeline.errors import ExportError
from pipeline.export.models_config import models_config
from serving.manager.model_config import validate_model_config

REPO = Path(__file__).resolve().parents[3]


def _exported(base_path: Path, name: str, version: int = 1) -> None:
    """A version directory as export leaves it, as far as models-config looks: one holding saved_model.pb."""
    (base_path / name / str(version)).mkdir(parents=True)
    (base_path / name / str(version) / "saved_model.pb").write_bytes(b"")


def test_models_config_lists_each_experiment_with_container_or_host_paths(tmp_path):
    digits = load_config(None, [f"export.base_path={tmp_path}"])
    diabetes = load_config(None, ["experiment=diabetes_mlp", "data.source=diabetes", f"export.base_path={tmp_path}"])
    _exported(tmp_path, "digits_mlp")
    _exported(tmp_path, "diabetes_mlp", version=3)
    parsed = text_format.Parse(models_config([digits, diabetes], container_base="/models"),
                               model_server_config_pb2.ModelServerConfig())
    assert [(c.name, c.base_path, c.model_platform) for c in parsed.model_config_list.config] == [
        ("digits_mlp", "/models/digits_mlp", "tensorflow"), ("diabetes_mlp", "/models/diabetes_mlp", "tensorflow")]
    host = text_format.Parse(models_config([digits]), model_server_config_pb2.ModelServerConfig())
    assert host.model_config_list.config[0].base_path == str(tmp_path / "digits_mlp")
    validate_model_config(host)  # what `python -m serving --model_config_file` checks


def test_duplicate_model_names_are_refused():
    cfg = load_config(None)
    with pytest.raises(ConfigError, match="'digits_mlp' is listed twice"):
        models_config([cfg, cfg])


def test_a_model_never_exported_is_refused_by_name_and_nothing_is_written(tmp_path):
    digits = load_config(None, [f"export.base_path={tmp_path}"])
    diabetes = load_config(None, ["experiment=diabetes_mlp", "data.source=diabetes", f"export.base_path={tmp_path}"])
    _exported(tmp_path, "digits_mlp")
    (tmp_path / "diabetes_mlp" / "1").mkdir(parents=True)  # a version directory without a SavedModel
    with pytest.raises(ExportError, match=rf"^diabetes_mlp has no exported version under {tmp_path}/diabetes_mlp "
                                          r"\(make export CONFIG=d\.yaml\); TF Serving would wait for it forever"):
        models_config([digits, diabetes], sources=["a.yaml", "d.yaml"])


@pytest.mark.subprocess  # the CLI in a child process
def test_cli_writes_the_file_only_for_exported_models(tmp_path):
    configs = []
    for name in ("digits_mlp", "diabetes_mlp"):
        configs.append(tmp_path / f"{name}.yaml")
        configs[-1].write_text(f"experiment: {name}\nexport: {{base_path: {tmp_path / 'models'}}}\n")
    out = tmp_path / "models.config"
    argv = [sys.executable, "-m", "pipeline", "models-config", *map(str, configs), "--container_base", "/models",
            "--output", str(out)]
    _exported(tmp_path / "models", "digits_mlp")
    refused = subprocess.run(argv, capture_output=True, text=True, timeout=120, cwd=REPO)
    assert (refused.returncode, refused.stdout) == (1, "")
    assert refused.stderr.splitlines() == [f"error: diabetes_mlp has no exported version under {tmp_path}/models/"
                                           f"diabetes_mlp (make export CONFIG={configs[1]}); TF Serving would wait "
                                           "for it forever at start-up; nothing was written"]
    assert not out.exists()

    _exported(tmp_path / "models", "diabetes_mlp")
    result = subprocess.run(argv, capture_output=True, text=True, timeout=120, cwd=REPO)
    assert result.returncode == 0, result.stderr
    parsed = text_format.Parse(out.read_text(), model_server_config_pb2.ModelServerConfig())
    assert [c.base_path for c in parsed.model_config_list.config] == ["/models/digits_mlp", "/models/diabetes_mlp"]
