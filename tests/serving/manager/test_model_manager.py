"""ModelManager in-process: version policies, labels, TF Serving's lookup wording, load failures and retries,
unloading, odd version directory names."""

from __future__ import annotations

import logging
import shutil
import time
from pathlib import Path

import grpc
import numpy as np
import pytest
from google.protobuf import text_format
from tensorflow_serving.apis import model_pb2
from tensorflow_serving.config import model_server_config_pb2

from serving.manager import model_config
from serving.errors import InvalidArgument, NotFound
from serving.manager.model_config import ModelConfigError
from serving.manager.model_manager import AVAILABLE, END, LOADING, UNLOADING, ModelManager

X = np.array([[1.0], [2.0]], np.float32)


def config(*models: str) -> model_server_config_pb2.ModelServerConfig:
    """A ModelServerConfig from `name base_path [extra text-proto fields]` entries."""
    entries = []
    for model in models:
        name, base_path, *extra = model.split(" ", 2)
        entries.append(f'config {{ name: "{name}" base_path: "{base_path}" model_platform: "tensorflow" '
                       f'{extra[0] if extra else ""} }}')
    return text_format.Parse(f"model_config_list {{ {' '.join(entries)} }}",
                             model_server_config_pb2.ModelServerConfig())


def states(manager: ModelManager, name: str) -> dict[int, int]:
    return {version: status.state for version, status in manager.version_states(name).items()}


@pytest.fixture(scope="module")
def hp2(tmp_path_factory, copy_testdata):
    """TF Serving's half_plus_two with versions 123 and 124 (y = x / 2 + 2 in both)."""
    return copy_testdata("saved_model_half_plus_two_2_versions", tmp_path_factory.mktemp("mm") / "hp2")


@pytest.fixture(scope="module")
def manager(hp2):
    """hp2 served with policy all, then relabelled and narrowed to latest 1: label 'gone' names unloaded 123."""
    manager = ModelManager(file_system_poll_wait_seconds=0)
    manager.reload_config(config(f"hp2 {hp2} model_version_policy {{ all {{}} }}"))
    manager.reload_config(config(f'hp2 {hp2} version_labels {{ key: "canary" value: 124 }} '
                                 'version_labels { key: "gone" value: 123 }'))
    return manager


def test_serves_latest_version_only(manager):
    assert manager.model_names == ["hp2"]
    assert list(manager.versions("hp2")) == [124]
    assert states(manager, "hp2") == {123: END, 124: AVAILABLE}
    version, runner = manager.resolve(model_pb2.ModelSpec(name="hp2"))
    assert version == 124 and runner.version == 124 and runner.model_name == "hp2"
    assert manager.resolve(model_pb2.ModelSpec(name="hp2", version={"value": 124}))[1] is runner
    assert manager.resolve(model_pb2.ModelSpec(name="hp2", version_label="canary"))[1] is runner
    np.testing.assert_array_equal(runner.predict({"x": X})["y"], [[2.5], [3.0]])


@pytest.mark.parametrize("spec, error, message", [
    ({"name": "nope"}, NotFound, "Servable not found for request: Latest(nope)"),
    ({"name": "hp2", "version": {"value": 123}}, NotFound, "Servable not found for request: Specific(hp2, 123)"),
    ({}, InvalidArgument, "ModelSpec has no name specified."),
    ({"name": "hp2", "version_label": "stable"}, InvalidArgument, "Unrecognized servable version label: stable"),
    ({"name": "hp2", "version_label": "gone"}, NotFound, "Servable not found for request: Specific(hp2, 123)"),
])
def test_resolve_errors(manager, spec, error, message):
    with pytest.raises(error) as raised:
        manager.resolve(model_pb2.ModelSpec(**spec))
    assert str(raised.value) == message


@pytest.mark.parametrize("policy, served", [
    ("model_version_policy { latest { num_versions: 2 } }", [123, 124]),
    ("model_version_policy { all {} }", [123, 124]),
    ("model_version_policy { specific { versions: 123 } }", [123]),
])
def test_version_policies(hp2, policy, served):
    manager = ModelManager(file_system_poll_wait_seconds=0)
    manager.reload_config(config(f"hp2 {hp2} {policy}"))
    assert sorted(manager.versions("hp2")) == served
    assert manager.resolve(model_pb2.ModelSpec(name="hp2"))[0] == max(served)


def test_labels_need_available_versions_unless_allowed(hp2):
    labelled = config(f'hp2 {hp2} model_version_policy {{ all {{}} }} '
                      'version_labels { key: "stable" value: 123 } version_labels { key: "canary" value: 124 }')
    strict = ModelManager(file_system_poll_wait_seconds=0)
    with pytest.raises(ModelConfigError) as error:  # at start-up nothing is loaded yet: TF Serving refuses too
        strict.reload_config(labelled)
    assert error.value.code == grpc.StatusCode.FAILED_PRECONDITION
    assert str(error.value) == ("Request to assign label to version 124 of model hp2, which is not currently "
                                "available for inference")
    assert strict.model_names == []  # a refused config changes nothing

    allowing = ModelManager(file_system_poll_wait_seconds=0, allow_version_labels_for_unavailable_models=True)
    allowing.reload_config(labelled)
    for label, version in (("stable", 123), ("canary", 124)):
        assert allowing.resolve(model_pb2.ModelSpec(name="hp2", version_label=label))[0] == version
    # Even with the flag, an existing label may not move to a version that is not available.
    moved = config(f'hp2 {hp2} model_version_policy {{ all {{}} }} version_labels {{ key: "stable" value: 125 }}')
    with pytest.raises(ModelConfigError, match="assign label to version 125 of model hp2"):
        allowing.reload_config(moved)
    assert allowing.resolve(model_pb2.ModelSpec(name="hp2", version_label="stable"))[0] == 123


def test_invalid_reload_keeps_the_old_config(manager, hp2):
    with pytest.raises(ModelConfigError, match="Illegal to list model hp2 multiple times in config list"):
        manager.reload_config(config(f"hp2 {hp2}", f"hp2 {hp2}"))
    assert manager.resolve(model_pb2.ModelSpec(name="hp2", version_label="canary"))[0] == 124


def test_policy_change_unloads_after_replacement_and_reports_end(hp2):
    manager = ModelManager(file_system_poll_wait_seconds=0)
    manager.reload_config(config(f"hp2 {hp2}"))
    manager.reload_config(config(f"hp2 {hp2} model_version_policy {{ specific {{ versions: 123 }} }}"))
    assert states(manager, "hp2") == {123: AVAILABLE, 124: END}
    assert manager.version_states("hp2")[124].error_code == 0
    manager.reload_config(config())  # an empty model list removes every model
    assert manager.model_names == [] and states(manager, "hp2") == {123: END, 124: END}
    with pytest.raises(NotFound, match=r"Latest\(hp2\)"):
        manager.resolve(model_pb2.ModelSpec(name="hp2"))


def test_unload_waits_for_requests_holding_the_runner(hp2):
    manager = ModelManager(file_system_poll_wait_seconds=0)
    manager.reload_config(config(f"hp2 {hp2}"))
    closed = []
    with manager.request_scope():
        _, runner = manager.resolve(model_pb2.ModelSpec(name="hp2"))
        runner.close = lambda: closed.append(runner.version)  # observe the unload's close()
        manager.reload_config(config(f"hp2 {hp2} model_version_policy {{ specific {{ versions: 123 }} }}"))
        assert states(manager, "hp2") == {123: AVAILABLE, 124: UNLOADING}
        assert closed == []
        np.testing.assert_array_equal(runner.predict({"x": X})["y"], [[2.5], [3.0]])  # still usable
    assert closed == [124] and states(manager, "hp2") == {123: AVAILABLE, 124: END}


def test_start_up_fails_when_a_models_latest_version_cannot_load(tmp_path, copy_testdata):
    bad = copy_testdata("bad_half_plus_two", tmp_path / "bad")  # a legacy SessionBundle: no saved_model.pb
    manager = ModelManager(file_system_poll_wait_seconds=0)
    with pytest.raises(ModelConfigError) as error:
        manager.reload_config(config(f"bad {bad}"))
    assert error.value.code == grpc.StatusCode.UNKNOWN
    assert str(error.value).startswith("1 model(s) did not become available: {name: bad version: 123} "
                                       "due to error: NOT_FOUND: ")
    [status] = manager.version_states("bad").values()
    assert (status.version, status.state, status.error_code) == (123, END, grpc.StatusCode.NOT_FOUND.value[0])
    assert "saved_model.pb" in status.error_message and "\n" not in status.error_message


# Load retries and odd directory names (TF Serving's --max_num_load_retries, file_system_storage_path_source.cc).

def _wait_for(condition, timeout_s: float = 30.0) -> None:
    deadline = time.monotonic() + timeout_s
    while not condition():
        assert time.monotonic() < deadline, "timed out"
        time.sleep(0.02)


def _half_copy(source: Path, destination: Path) -> None:
    """A version copied in non-atomically, caught halfway: its variables, not yet its saved_model.pb."""
    shutil.copytree(source, destination, ignore=shutil.ignore_patterns("saved_model.pb"))


def _failures(caplog, version: int) -> int:
    return sum(f"version {version} failed to load" in message for message in caplog.messages)


@pytest.fixture
def halver(tmp_path, write_float16_model) -> Path:
    """A base path with version 1 of a small model (y = x / 2)."""
    write_float16_model(tmp_path / "halver" / "1")
    return tmp_path / "halver"


def test_a_half_copied_version_is_retried_and_then_served(halver, caplog):
    manager = ModelManager(file_system_poll_wait_seconds=0.05, max_num_load_retries=50, load_retry_interval_s=0.05)
    manager.reload_config(config(f"halver {halver}"))
    manager.start_polling()
    try:
        with caplog.at_level(logging.INFO, logger="serving.manager.model_manager"):
            _half_copy(halver / "1", halver / "2")
            _wait_for(lambda: _failures(caplog, 2) >= 2)
            assert states(manager, "halver") == {1: AVAILABLE, 2: LOADING}  # retrying: not END, 1 serves
            shutil.copy(halver / "1" / "saved_model.pb", halver / "2")  # the copy completes
            _wait_for(lambda: states(manager, "halver") == {1: END, 2: AVAILABLE})
    finally:
        manager.stop()
    assert manager.version_states("halver")[2].error_code == 0
    assert any("retrying load of model halver version 2 (retry 1 of 50)" in m for m in caplog.messages)


def test_retries_end_when_spent_or_when_the_policy_drops_the_version(halver, caplog):
    manager = ModelManager(file_system_poll_wait_seconds=0, max_num_load_retries=2, load_retry_interval_s=0)
    manager.reload_config(config(f"halver {halver}"))
    _half_copy(halver / "1", halver / "2")
    with caplog.at_level(logging.INFO, logger="serving.manager.model_manager"):
        manager.poll_file_system()
    assert _failures(caplog, 2) == 3  # the first try and two retries
    status = manager.version_states("halver")[2]
    assert (status.state, status.error_code) == (END, grpc.StatusCode.NOT_FOUND.value[0])
    manager.poll_file_system()
    assert _failures(caplog, 2) == 3  # spent: not tried again while the policy keeps selecting it

    # A version the policy stops selecting (3 arrives; latest 1) is not retried any more.
    retrying = ModelManager(file_system_poll_wait_seconds=0.05, max_num_load_retries=1000, load_retry_interval_s=0.05)
    shutil.rmtree(halver / "2")
    retrying.reload_config(config(f"halver {halver}"))
    retrying.start_polling()
    try:
        _half_copy(halver / "1", halver / "2")
        _wait_for(lambda: states(retrying, "halver").get(2) == LOADING)
        shutil.copytree(halver / "1", halver / "3")
        _wait_for(lambda: states(retrying, "halver") == {1: END, 2: END, 3: AVAILABLE})
    finally:
        retrying.stop()
    assert retrying.version_states("halver")[2].error_code == grpc.StatusCode.NOT_FOUND.value[0]


def test_odd_directory_names_break_neither_start_up_nor_polling_and_warn_once(halver, caplog):
    for name in ("²", "99999999999999999999", "1e3"):
        (halver / name).mkdir()
    start_up = config(f"halver {halver}")
    model_config.check_versions_exist(start_up)  # python -m serving's start-up check
    manager = ModelManager(file_system_poll_wait_seconds=0)
    with caplog.at_level(logging.WARNING, logger="serving.manager.model_manager"):
        manager.reload_config(start_up)
        manager.poll_file_system()
        shutil.copytree(halver / "1", halver / "2")
        manager.poll_file_system()
        manager.poll_file_system()
    assert states(manager, "halver") == {1: END, 2: AVAILABLE}  # polling still finds new versions
    warnings = [m for m in caplog.messages if "ignoring directory" in m]
    assert sorted(warnings) == sorted(f"model halver: ignoring directory {name!r} under its base path: a version's "
                                      "name is plain decimal digits that fit in int64"
                                      for name in ("²", "99999999999999999999", "1e3"))


def test_a_reload_may_not_change_a_models_platform(halver):
    manager = ModelManager(file_system_poll_wait_seconds=0)
    manager.reload_config(config(f"halver {halver}"))
    with pytest.raises(ModelConfigError) as error:
        manager.reload_config(text_format.Parse(
            f'model_config_list {{ config {{ name: "halver" base_path: "{halver}" model_platform: "onnx" }} }}',
            model_server_config_pb2.ModelServerConfig()))
    assert str(error.value) == ("Illegal to change a model's platform. For model halver platform was tensorflow "
                                "and new platform requested is onnx")
    assert list(manager.versions("halver")) == [1]
