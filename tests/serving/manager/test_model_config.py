"""serving/manager/model_config.py: ModelServerConfig parsing, TF Serving's validation messages, version policies."""

from __future__ import annotations

import grpc
import pytest
from google.protobuf import text_format
from tensorflow_serving.config import model_server_config_pb2

from serving.manager import model_config
from serving.manager.model_config import ModelConfigError


def parse(text: str) -> model_server_config_pb2.ModelServerConfig:
    return text_format.Parse(text, model_server_config_pb2.ModelServerConfig())


def test_good_model_config_with_placeholders_substituted(tfserving_testdata, tmp_path):
    template = (tfserving_testdata / "good_model_config.txt").read_text()
    path = tmp_path / "good.config"
    path.write_text(template.replace("${TEST_HALF_PLUS_TWO_DIR}", "/models/hp2")
                    .replace("${TEST_HALF_PLUS_THREE_DIR}", "/models/hp3"))
    config = model_config.read_model_config(path)
    model_config.validate_model_config(config)
    assert [(c.name, c.base_path, c.model_platform) for c in config.model_config_list.config] == [
        ("half_plus_two", "/models/hp2", "tensorflow"), ("half_plus_three", "/models/hp3", "tensorflow")]


def test_bad_model_config_is_an_invalid_protobuf_file(tfserving_testdata):
    path = tfserving_testdata / "bad_model_config.txt"
    with pytest.raises(ModelConfigError) as error:
        model_config.read_model_config(path)
    # TF Serving's two lines (proto_util.h, and protobuf's parser that its testBadModelConfig greps for), in one.
    assert str(error.value).startswith(f"Invalid protobuf file: '{path}': "
                                       "Error parsing text-format tensorflow.serving.ModelServerConfig: 1:")
    assert "\n" not in str(error.value) and error.value.code == grpc.StatusCode.INVALID_ARGUMENT


def test_a_parse_error_names_line_and_column(tmp_path):
    path = tmp_path / "models.config"
    path.write_text('model_config_list {\n  config { nme: "a" }\n}\n')
    with pytest.raises(ModelConfigError) as error:
        model_config.read_model_config(path)
    assert str(error.value) == (f"Invalid protobuf file: '{path}': Error parsing text-format "
                                'tensorflow.serving.ModelServerConfig: 2:12: Message type '
                                '"tensorflow.serving.ModelConfig" has no field named "nme".')


def test_missing_config_file_is_not_found(tmp_path):
    with pytest.raises(ModelConfigError, match="No such file") as error:
        model_config.read_model_config(tmp_path / "nope.config")
    assert error.value.code == grpc.StatusCode.NOT_FOUND


def test_single_model_config_is_latest_1_with_an_absolute_path(tmp_path, monkeypatch):
    monkeypatch.chdir(tmp_path)
    [model] = model_config.single_model_config("m", "models/m").model_config_list.config
    assert (model.name, model.base_path, model.model_platform) == ("m", str(tmp_path / "models/m"), "tensorflow")
    assert model_config.describe_policy(model) == "latest 1"


# server_core.cc's ValidateModelConfigList, GetPlatform and CreateStoragePathRoutes, word for word.
@pytest.mark.parametrize("configs, message", [
    ('config { name: "a" base_path: "/m/a" model_platform: "tensorflow" } '
     'config { name: "a" base_path: "/m/b" model_platform: "tensorflow" }',
     "Illegal to list model a multiple times in config list"),
    ('config { name: "a" base_path: "m/a" model_platform: "tensorflow" }',
     "Expected model a to have an absolute path or URI; got base_path()=m/a"),
    ('config { name: "a" base_path: "/m/a" model_platform: "pytorch" }',
     "Model a requests unsupported platform pytorch"),
    ('config { name: "a" base_path: "/m/a" }',
     "Illegal setting neither ModelServerConfig::model_type (deprecated) nor ModelServerConfig::model_platform, "
     "model name is a"),
    ('config { name: "a" base_path: "/m/a" model_type: TENSORFLOW model_platform: "tensorflow" }',
     "Illegal setting both ModelServerConfig::model_type (deprecated) and ModelServerConfig::model_platform."),
    ('config { name: "a" base_path: "/m/a" model_type: OTHER }',
     "ModelServerConfig::model_type choice 2 not supported."),
])
def test_invalid_configs_get_tf_servings_messages(configs, message):
    with pytest.raises(ModelConfigError) as error:
        model_config.validate_model_config(parse(f"model_config_list {{ {configs} }}"))
    assert (str(error.value), error.value.code) == (message, grpc.StatusCode.INVALID_ARGUMENT)


def test_a_reload_may_not_change_a_models_platform():
    """server_core.cc's ValidateNoModelsChangePlatforms runs before the unsupported-platform check."""
    previous = parse('model_config_list { config { name: "a" base_path: "/m/a" model_platform: "tensorflow" } }')
    changed = parse('model_config_list { config { name: "a" base_path: "/m/a" model_platform: "pytorch" } '
                    'config { name: "b" base_path: "/m/b" model_type: TENSORFLOW } }')
    with pytest.raises(ModelConfigError) as error:
        model_config.validate_model_config(changed, previous)
    assert (str(error.value), error.value.code) == (
        "Illegal to change a model's platform. For model a platform was tensorflow and new platform requested "
        "is pytorch", grpc.StatusCode.INVALID_ARGUMENT)
    # model_type TENSORFLOW is the same platform as model_platform "tensorflow"; a new model may be anything valid.
    same = parse('model_config_list { config { name: "a" base_path: "/m/a" model_type: TENSORFLOW } }')
    model_config.validate_model_config(same, previous)


@pytest.mark.parametrize("name", ["../etc", "a/b", ""])
def test_model_names_that_could_leave_a_directory_are_refused_on_every_reload(name):
    """Names become log file names and metric labels; HandleReloadConfigRequest goes through this check too."""
    with pytest.raises(ModelConfigError, match="is not allowed") as error:
        model_config.validate_model_config(parse(f'model_config_list {{ config {{ name: "{name}" base_path: "/m" '
                                                 'model_platform: "tensorflow" } }'))
    assert error.value.code == grpc.StatusCode.INVALID_ARGUMENT


def test_valid_configs_pass():
    model_config.validate_model_config(parse(""))  # empty: TF Serving takes no action
    model_config.validate_model_config(parse('model_config_list { config { name: "a" base_path: "gs://b/a" '
                                             'model_type: TENSORFLOW } }'))


@pytest.fixture
def base(tmp_path):
    for name in ("00000123", "124", "7", ".tmp-99-125", "notes"):
        (tmp_path / name).mkdir()
    (tmp_path / "200").write_text("a file, not a version")
    return tmp_path


@pytest.mark.parametrize("policy, versions", [
    ("", [124]),
    ("model_version_policy { latest { num_versions: 2 } }", [123, 124]),
    ("model_version_policy { all {} }", [7, 123, 124]),
    ("model_version_policy { specific { versions: 7 versions: 123 versions: 999 } }", [7, 123]),
])
def test_version_policies(base, policy, versions):
    [model] = parse(f'model_config_list {{ config {{ name: "m" base_path: "{base}" {policy} }} }}'
                    ).model_config_list.config
    on_disk = model_config.version_dirs(model)
    assert on_disk == {7: base / "7", 123: base / "00000123", 124: base / "124"}  # zero-padded is 123
    assert sorted(model_config.aspired_versions(model, on_disk)) == versions


def test_odd_version_names_are_the_directories_that_are_not_versions(base):
    for name in ("²", "99999999999999999999", "1e3"):
        (base / name).mkdir()
    [model] = parse(f'model_config_list {{ config {{ name: "m" base_path: "{base}" }} }}').model_config_list.config
    # Not the versions, not the hidden '.tmp-…' export, not the file "200".
    assert model_config.odd_version_names(model) == ["1e3", "99999999999999999999", "notes", "²"]
    assert sorted(model_config.version_dirs(model)) == [7, 123, 124]
    model_config.check_versions_exist(parse(f'model_config_list {{ config {{ name: "m" base_path: "{base}" }} }}'))


def test_check_versions_exist(tmp_path, base):
    def config(path, policy=""):
        return parse(f'model_config_list {{ config {{ name: "m" base_path: "{path}" {policy} }} }}')

    model_config.check_versions_exist(config(base))
    with pytest.raises(ModelConfigError, match=f"Could not find base path {tmp_path}/nope for servable m"):
        model_config.check_versions_exist(config(tmp_path / "nope"))
    (tmp_path / "empty").mkdir()
    with pytest.raises(ModelConfigError) as error:
        model_config.check_versions_exist(config(tmp_path / "empty"))
    empty = tmp_path / "empty"
    assert str(error.value) == f"{empty}: no numeric version directories (expected e.g. {empty}/1/saved_model.pb)"
    with pytest.raises(ModelConfigError) as error:
        model_config.check_versions_exist(config(base, "model_version_policy { specific { versions: 5 } }"))
    assert str(error.value) == (f"No versions of servable m found under base path {base} for its version policy "
                                "(specific 5); found versions 7, 123, 124")
