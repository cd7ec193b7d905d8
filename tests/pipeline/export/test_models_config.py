"""models.config generation: valid for TF Serving's parser and for our server's validation."""

import pytest
from google.protobuf import text_format
from tensorflow_serving.config import model_server_config_pb2

from pipeline.config import ConfigError, load_config
from pipeline.export.models_config import models_config
from serving.model_config import validate_model_config


def test_models_config_lists_each_experiment_with_container_or_host_paths(tmp_path):
    digits = load_config(None, [f"export.base_path={tmp_path}"])
    diabetes = load_config(None, ["experiment=diabetes_mlp", "data.source=diabetes", f"export.base_path={tmp_path}"])
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


def test_cli_writes_the_file_for_shipped_configs(tmp_path):
    import subprocess
    import sys

    out = tmp_path / "models.config"
    result = subprocess.run([sys.executable, "-m", "pipeline", "models-config", "configs/default.yaml",
                             "configs/diabetes_mlp.yaml", "--container_base", "/models", "--output", str(out)],
                            capture_output=True, text=True, timeout=120, cwd=__import__("pathlib").Path(__file__).parents[3])
    assert result.returncode == 0, result.stderr
    parsed = text_format.Parse(out.read_text(), model_server_config_pb2.ModelServerConfig())
    assert [c.base_path for c in parsed.model_config_list.config] == ["/models/digits_mlp", "/models/diabetes_mlp"]
