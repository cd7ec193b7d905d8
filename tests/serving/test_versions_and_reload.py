"""Versions over time, through a real gRPC server in this process: polling, hot swaps, reloads (and who
may send them), warmup.

The server runs on a thread of the test process around a ModelManager (server_helpers.serving), so the tests can publish version
directories and poll without waiting for a subprocess to import TensorFlow. New versions are
published as the pipeline's export does it: copied into a '.tmp-' sibling, then renamed into place.
"""

from __future__ import annotations

import contextlib
import logging
import os
import shutil
import threading
from pathlib import Path

import grpc
import numpy as np
import pytest
import tensorflow as tf
from google.protobuf import text_format
from grpc_health.v1 import health_pb2, health_pb2_grpc
from tensorflow_serving.apis import (get_model_status_pb2, model_management_pb2, model_service_pb2_grpc,
                                     predict_pb2, prediction_log_pb2, prediction_service_pb2_grpc)
from tensorflow_serving.config import model_server_config_pb2

from serving.manager.model_config import ModelConfigError
from serving.manager.model_manager import AVAILABLE, END, LOADING, UNLOADING, ModelManager
import server_helpers
from server_helpers import wait_for
from serving.model_service import ReloadPolicy
from serving.servable.warmup import WARMUP_FILE

pytestmark = pytest.mark.timeout(120)
X = np.array([[2.0]], np.float32)  # half_plus_two -> 3.0, half_plus_three -> 4.0


def config(*models: str) -> model_server_config_pb2.ModelServerConfig:
    """A ModelServerConfig from `name base_path [extra text-proto fields]` entries."""
    entries = [f'config {{ name: "{name}" base_path: "{base}" model_platform: "tensorflow" {" ".join(extra)} }}'
               for name, base, *extra in (model.split(" ", 2) for model in models)]
    return text_format.Parse(f"model_config_list {{ {' '.join(entries)} }}",
                             model_server_config_pb2.ModelServerConfig())


def publish(source: Path, base: Path, version: int) -> None:
    """Publishes a copy of source as base/<version> atomically (copy to a '.tmp-' sibling, then rename)."""
    tmp = base / f".tmp-{version}"
    shutil.copytree(source, tmp)
    os.rename(tmp, base / str(version))


def states(manager: ModelManager, name: str) -> dict[int, int]:
    return {version: status.state for version, status in manager.version_states(name).items()}


def predict_request(model: str, **spec) -> predict_pb2.PredictRequest:
    request = predict_pb2.PredictRequest(model_spec={"name": model, **spec})
    request.inputs["x"].CopyFrom(tf.make_tensor_proto(X))
    return request


@contextlib.contextmanager
def serving(manager: ModelManager, reload_policy: ReloadPolicy | None = None, max_threads: int = 8):
    """An in-process gRPC server for manager; yields (prediction stub, model service stub, channel)."""
    with server_helpers.serving(manager, reload_policy=reload_policy, grpc_max_threads=max_threads) as server:
        channel = grpc.insecure_channel(server.grpc_address)
        try:
            yield (prediction_service_pb2_grpc.PredictionServiceStub(channel),
                   model_service_pb2_grpc.ModelServiceStub(channel), channel)
        finally:
            channel.close()
    manager.stop()


class Clients:
    """Threads sending Predict to one model until stopped; every answer and every failure is kept."""

    def __init__(self, stub, model: str, threads: int = 3):
        self.answers: list[tuple[int, float]] = []  # (version, y)
        self.failures: list[str] = []
        self._stub, self._model, self._stop = stub, model, threading.Event()
        self._threads = [threading.Thread(target=self._run, daemon=True) for _ in range(threads)]

    def __enter__(self) -> "Clients":
        for thread in self._threads:
            thread.start()
        wait_for(lambda: len(self.answers) >= 3 or self.failures)
        return self

    def __exit__(self, *exc) -> None:
        self._stop.set()
        for thread in self._threads:
            thread.join(30)

    def _run(self) -> None:
        while not self._stop.is_set():
            try:
                response = self._stub.Predict(predict_request(self._model), timeout=30)
                self.answers.append((response.model_spec.version.value, response.outputs["y"].float_val[0]))
            except grpc.RpcError as error:
                self.failures.append(f"{error.code()}: {error.details()}")


def status(model_service, name: str) -> dict[int, get_model_status_pb2.ModelVersionStatus]:
    response = model_service.GetModelStatus(get_model_status_pb2.GetModelStatusRequest(model_spec={"name": name}),
                                            timeout=10)
    return {entry.version: entry for entry in response.model_version_status}


@pytest.fixture(scope="module")
def testdata(tmp_path_factory, copy_testdata):
    """Writable copies of TF Serving's models: hp2 (versions 123, 124), hp3, and a bad (SessionBundle) version."""
    root = tmp_path_factory.mktemp("versions")
    hp2 = copy_testdata("saved_model_half_plus_two_2_versions", root / "hp2")
    hp3 = copy_testdata("saved_model_half_plus_three", root / "hp3")
    bad = copy_testdata("bad_half_plus_two", root / "bad")
    return {"hp2": hp2, "hp2_124": hp2 / "00000124", "hp3_123": hp3 / "00000123", "hp3": hp3,
            "bad_123": bad / "00000123"}


@pytest.fixture
def hp2(tmp_path, testdata) -> Path:
    """A fresh base path holding hp2's versions 123 and 124."""
    return Path(shutil.copytree(testdata["hp2"], tmp_path / "hp2"))


def test_polling_loads_a_new_version_unloads_the_old_and_reports_a_broken_one(hp2, testdata):
    manager = ModelManager(file_system_poll_wait_seconds=0.1)
    manager.reload_config(config(f"hp2 {hp2}"))
    manager.start_polling()
    with serving(manager) as (prediction, model_service, _):
        assert {v: s.state for v, s in status(model_service, "hp2").items()} == {124: AVAILABLE}
        publish(testdata["hp3_123"], hp2, 125)  # half_plus_three: the answers change with the version
        wait_for(lambda: prediction.Predict(predict_request("hp2"), timeout=10).model_spec.version.value == 125)
        assert prediction.Predict(predict_request("hp2"), timeout=10).outputs["y"].float_val == [4.0]
        wait_for(lambda: states(manager, "hp2") == {124: END, 125: AVAILABLE})

        publish(testdata["bad_123"], hp2, 126)  # cannot load: 125 keeps serving, 126 reports its error
        wait_for(lambda: states(manager, "hp2").get(126) == END)
        reported = status(model_service, "hp2")
        assert list(reported) == [126, 125, 124]  # newest first, as TF Serving lists them
        assert reported[126].status.error_code == grpc.StatusCode.NOT_FOUND.value[0]
        assert "saved_model.pb" in reported[126].status.error_message
        assert str(hp2) not in reported[126].status.error_message  # no server paths for clients
        assert reported[126].status.error_message.startswith("<path>: ")
        assert str(hp2) in manager.version_states("hp2")[126].error_message  # the server's log keeps them
        assert (reported[125].state, reported[125].status.error_code, reported[125].status.error_message) == \
            (AVAILABLE, 0, "")
        assert reported[124].state == END and reported[124].status.error_code == 0
        for _ in range(3):  # a few more polls: the failed version is not retried and 125 stays
            manager.poll_file_system()
        assert states(manager, "hp2") == {124: END, 125: AVAILABLE, 126: END}
        assert prediction.Predict(predict_request("hp2"), timeout=10).model_spec.version.value == 125
        with pytest.raises(grpc.RpcError) as error:
            model_service.GetModelStatus(get_model_status_pb2.GetModelStatusRequest(
                model_spec={"name": "hp2", "version": {"value": 7}}), timeout=10)
        assert (error.value.code(), error.value.details()) == (grpc.StatusCode.NOT_FOUND,
                                                               "Could not find version 7 of model hp2")


def test_hot_swap_under_load_fails_no_request(hp2, testdata):
    manager = ModelManager(file_system_poll_wait_seconds=0.1)
    manager.reload_config(config(f"hp2 {hp2}"))
    manager.start_polling()
    with serving(manager) as (prediction, _, _), Clients(prediction, "hp2") as clients:
        for version, source in ((125, testdata["hp3_123"]), (126, testdata["hp2_124"])):
            publish(source, hp2, version)
            wait_for(lambda: states(manager, "hp2").get(version) == AVAILABLE and
                     sum(v == version for v, _ in clients.answers) >= 3)
        wait_for(lambda: states(manager, "hp2") == {124: END, 125: END, 126: AVAILABLE})
    assert clients.failures == []
    expected = {124: 3.0, 125: 4.0, 126: 3.0}
    assert {version for version, _ in clients.answers} == set(expected)
    assert all(y == expected[version] for version, y in clients.answers)


def test_reload_adds_removes_and_repolices_while_a_staying_model_serves(hp2, testdata):
    manager = ModelManager(file_system_poll_wait_seconds=0)
    manager.reload_config(config(f"hp2 {hp2}"))
    allowed = ReloadPolicy(allowed=True, roots=(str(hp2), str(testdata["hp3"])))

    def reload(stub, *models: str, code=grpc.StatusCode.OK) -> str:
        request = model_management_pb2.ReloadConfigRequest(config=config(*models) if models else None)
        try:
            response = stub.HandleReloadConfigRequest(request, timeout=60)
        except grpc.RpcError as error:
            assert error.code() == code, error.details()
            return error.details()
        assert code == grpc.StatusCode.OK and response.status.error_code == 0
        return ""

    hp3 = f"hp3 {testdata['hp3']}"
    labels = 'version_labels { key: "stable" value: 123 } version_labels { key: "canary" value: 124 }'
    with serving(manager, allowed) as (prediction, model_service, channel), Clients(prediction, "hp2") as clients:
        reload(model_service, f"hp2 {hp2}", hp3)  # add a model
        assert prediction.Predict(predict_request("hp3"), timeout=10).outputs["y"].float_val == [4.0]
        reload(model_service, f"hp2 {hp2} model_version_policy {{ all {{}} }}", hp3)  # re-policy
        assert states(manager, "hp2") == {123: AVAILABLE, 124: AVAILABLE}
        reload(model_service, f"hp2 {hp2} model_version_policy {{ all {{}} }} {labels}", hp3)  # label them
        for label, version in (("stable", 123), ("canary", 124)):
            response = prediction.Predict(predict_request("hp2", version_label=label), timeout=10)
            assert response.model_spec.version.value == version
        # Refused configs change nothing.
        assert reload(model_service, f"hp2 {hp2}", f"hp2 {hp2}", code=grpc.StatusCode.INVALID_ARGUMENT) == \
            "Illegal to list model hp2 multiple times in config list"
        assert reload(model_service, f'hp2 {hp2} version_labels {{ key: "x" value: 9 }}',
                      code=grpc.StatusCode.FAILED_PRECONDITION) == \
            "Request to assign label to version 9 of model hp2, which is not currently available for inference"
        assert reload(model_service, code=grpc.StatusCode.INVALID_ARGUMENT).startswith(
            "ServerModelConfig type not supported by HandleReloadConfigRequest")
        assert manager.model_names == ["hp2", "hp3"] and len(manager.versions("hp2")) == 2
        # Remove hp3; narrow hp2 to 123.
        reload(model_service, f'hp2 {hp2} model_version_policy {{ specific {{ versions: 123 }} }} '
                              'version_labels { key: "stable" value: 123 }')
        wait_for(lambda: states(manager, "hp2") == {123: AVAILABLE, 124: END})  # once the clients let go of 124
        assert {v: s.state for v, s in status(model_service, "hp3").items()} == {123: END}
        with pytest.raises(grpc.RpcError) as error:
            prediction.Predict(predict_request("hp3"), timeout=10)
        assert (error.value.code(), error.value.details()) == (grpc.StatusCode.NOT_FOUND,
                                                               "Servable not found for request: Latest(hp3)")
        health = health_pb2_grpc.HealthStub(channel)
        assert health.Check(health_pb2.HealthCheckRequest(service="hp2"), timeout=10).status == \
            health_pb2.HealthCheckResponse.SERVING
        assert health.Check(health_pb2.HealthCheckRequest(service="hp3"), timeout=10).status == \
            health_pb2.HealthCheckResponse.SERVICE_UNKNOWN
    assert clients.failures == []
    assert {version for version, _ in clients.answers} >= {123, 124}


# Who may reload over the network (serving/model_service.py, ReloadPolicy; docs/operations.md's threat model).

def reload_request(*models: str) -> model_management_pb2.ReloadConfigRequest:
    return model_management_pb2.ReloadConfigRequest(config=config(*models))


def refusal(model_service, request) -> tuple[grpc.StatusCode, str]:
    with pytest.raises(grpc.RpcError) as error:
        model_service.HandleReloadConfigRequest(request, timeout=60)
    return error.value.code(), error.value.details()


@pytest.fixture
def halver(tmp_path, write_float16_model) -> Path:
    """<tmp>/models/halver/1: a small model (y = x / 2), under the root the operator allows reloads from."""
    write_float16_model(tmp_path / "models" / "halver" / "1")
    return tmp_path / "models" / "halver"


def test_network_reloads_are_refused_unless_the_operator_allows_them(halver):
    manager = ModelManager(file_system_poll_wait_seconds=0)
    manager.reload_config(config(f"halver {halver}"))
    disabled = (grpc.StatusCode.UNIMPLEMENTED, "HandleReloadConfigRequest is disabled on this server; the operator "
                                               "can enable it with --allow_network_model_config_reload")
    with serving(manager) as (_, model_service, _):
        assert refusal(model_service, reload_request()) == disabled  # an empty model list would unload everything
        assert refusal(model_service, reload_request(f"halver {halver.parent}")) == disabled
        assert refusal(model_service, model_management_pb2.ReloadConfigRequest()) == disabled
    assert manager.model_names == ["halver"] and list(manager.versions("halver")) == [1]


def test_network_reloads_stay_under_the_roots_keep_the_operators_logging_config_and_name_no_paths(
        halver, tmp_path, write_float16_model):
    root = tmp_path / "models"
    write_float16_model(root / "m" / "1")
    outside = write_float16_model(tmp_path / "elsewhere" / "m" / "1").parent
    (root / "link").symlink_to(outside)  # inside the root by name, outside once resolved
    (tmp_path / "logs").mkdir()
    operator_log = f'logging_config {{ log_collector_config {{ type: "tfrecord" filename_prefix: "{tmp_path}/logs/r" }} }}'
    manager = ModelManager(file_system_poll_wait_seconds=0)
    manager.reload_config(config(f"halver {halver} {operator_log}"))
    outside_roots = (grpc.StatusCode.PERMISSION_DENIED, "model m: base_path is outside the directories this server "
                                                        "loads models from over the network (--model_config_reload_roots)")
    with serving(manager, ReloadPolicy(allowed=True, roots=(str(root),))) as (_, model_service, _):
        # Existing or not, outside the root the answer is the same: a client learns nothing about the path.
        for base in (outside, tmp_path / "nothing-here", root / ".." / "elsewhere" / "m", root / "link", "gs://b/m"):
            assert refusal(model_service, reload_request(f"halver {halver}", f"m {base}")) == outside_roots
        code, message = refusal(model_service, reload_request(f"halver {halver}", f"m {root / 'missing'}"))
        assert code == grpc.StatusCode.UNKNOWN and str(tmp_path) not in message
        assert message == ("1 model(s) did not become available: {name: m} due to error: Could not find base path "
                           "<path> for servable m")
        client_log = operator_log.replace("/logs/r", "/logs/mine")
        for models in ([f"halver {halver} {client_log}"], [f"halver {halver}", f"m {root / 'm'} {operator_log}"]):
            code, message = refusal(model_service, reload_request(*models))
            assert code == grpc.StatusCode.PERMISSION_DENIED and "logging_config can only come from the operator" in message
        model_service.HandleReloadConfigRequest(reload_request(f"halver {halver}", f"m {root / 'm'}"), timeout=60)
    assert manager.model_names == ["halver", "m"] and list(manager.versions("m")) == [1]
    assert manager.model_configs()["halver"].logging_config == config(
        f"halver {halver} {operator_log}").model_config_list.config[0].logging_config  # kept, though left out


def test_a_reload_changing_a_models_platform_is_refused_for_that_first(halver):
    """ServerCore::ReloadConfig checks a platform change before the platform itself (server_core.cc
    ValidateNoModelsChangePlatforms), so the client learns what it did, not that the platform is unknown."""
    manager = ModelManager(file_system_poll_wait_seconds=0)
    manager.reload_config(config(f"halver {halver}"))
    changed = reload_request(f"halver {halver}")
    changed.config.model_config_list.config[0].model_platform = "pytorch"
    added = reload_request(f"halver {halver}", f"other {halver}")
    added.config.model_config_list.config[1].model_platform = "pytorch"
    with serving(manager, ReloadPolicy(allowed=True, roots=(str(halver.parent),))) as (_, model_service, _):
        assert refusal(model_service, changed) == (grpc.StatusCode.INVALID_ARGUMENT, (
            "Illegal to change a model's platform. For model halver platform was tensorflow and new platform "
            "requested is pytorch"))
        assert refusal(model_service, added) == (grpc.StatusCode.INVALID_ARGUMENT,
                                                 "Model other requests unsupported platform pytorch")
    assert manager.model_names == ["halver"]


def test_reloads_run_one_at_a_time_and_leave_the_predict_threads_free(halver, tmp_path):
    slow = tmp_path / "models" / "slow"  # half-copied: its load is retried until the copy completes
    shutil.copytree(halver / "1", slow / "1", ignore=shutil.ignore_patterns("saved_model.pb"))
    manager = ModelManager(file_system_poll_wait_seconds=0, max_num_load_retries=1000, load_retry_interval_s=0.05)
    manager.reload_config(config(f"halver {halver}"))
    request = predict_pb2.PredictRequest(model_spec={"name": "halver"})
    request.inputs["x"].CopyFrom(tf.make_tensor_proto(np.ones((1, 2), np.float32)))
    policy = ReloadPolicy(allowed=True, roots=(str(tmp_path / "models"),))
    with serving(manager, policy, max_threads=4) as (prediction, model_service, _):
        first = model_service.HandleReloadConfigRequest.future(reload_request(f"halver {halver}", f"slow {slow}"),
                                                                timeout=60)
        wait_for(lambda: states(manager, "slow").get(1) == LOADING)
        others = [model_service.HandleReloadConfigRequest.future(reload_request(f"halver {halver}"), timeout=10)
                  for _ in range(8)]
        for other in others:
            assert (other.exception().code(), other.exception().details()) == (
                grpc.StatusCode.UNAVAILABLE, "another HandleReloadConfigRequest is in progress; retry once it has finished")
        assert prediction.Predict(request, timeout=10).outputs["y"].half_val  # 3 of the 4 threads are free
        assert not first.done()
        shutil.copy(halver / "1" / "saved_model.pb", slow / "1")
        assert first.result().status.error_code == 0
    assert states(manager, "slow") == {1: AVAILABLE}


def test_an_unloaded_version_stays_open_until_its_requests_return(tmp_path, write_gate_model):
    gate = write_gate_model(tmp_path / "gate_source")
    base = tmp_path / "gate"
    base.mkdir()
    publish(gate, base, 1)
    manager = ModelManager(file_system_poll_wait_seconds=0)  # polled by hand below
    manager.reload_config(config(f"gate {base}"))
    runner, closed = manager.versions("gate")[1], []
    runner.close = lambda: closed.append(runner.version)
    request = predict_pb2.PredictRequest(model_spec={"name": "gate"})
    request.inputs["dir"].CopyFrom(tf.make_tensor_proto(str(tmp_path)))
    with serving(manager) as (prediction, _, _):
        in_flight = prediction.Predict.future(request, timeout=60)
        try:
            wait_for(lambda: (tmp_path / "started").exists() or in_flight.done())
            publish(gate, base, 2)
            manager.poll_file_system()
            assert states(manager, "gate") == {1: UNLOADING, 2: AVAILABLE}
            assert closed == []  # the RPC that resolved version 1 is still running
        finally:
            (tmp_path / "release").touch()
        assert in_flight.result().model_spec.version.value == 1
        wait_for(lambda: states(manager, "gate")[1] == END)
    assert closed == [1]


def write_counter_model(version_dir: Path, warmup_records: list[bytes] | None = None,
                        warmup_bytes: bytes | None = None) -> Path:
    """counter(x): adds 1 to a variable and returns it, so the first real request shows how many ran before."""

    class Counter(tf.Module):
        def __init__(self):
            super().__init__()
            self.count = tf.Variable(0, dtype=tf.int64)

        @tf.function(input_signature=[tf.TensorSpec([None], tf.float32, name="x")])
        def serve(self, x):
            return {"count": self.count.assign_add(1)}

    module = Counter()
    tf.saved_model.save(module, str(version_dir), signatures={"serving_default": module.serve})
    warmup_path = version_dir / WARMUP_FILE
    warmup_path.parent.mkdir(exist_ok=True)
    if warmup_bytes is not None:
        warmup_path.write_bytes(warmup_bytes)
    elif warmup_records is not None:
        with tf.io.TFRecordWriter(str(warmup_path)) as writer:
            for record in warmup_records:
                writer.write(record)
    return version_dir


def predict_log(input_name: str = "x") -> bytes:
    request = predict_pb2.PredictRequest(model_spec={"name": "counter"})
    request.inputs[input_name].CopyFrom(tf.make_tensor_proto(np.zeros(1, np.float32)))
    return prediction_log_pb2.PredictionLog(predict_log={"request": request}).SerializeToString()


def test_warmup_replays_before_available(tmp_path, caplog):
    base = tmp_path / "counter"
    write_counter_model(base / "1", warmup_records=[predict_log()] * 3 + [prediction_log_pb2.PredictionLog()
                                                                          .SerializeToString()])
    manager = ModelManager(file_system_poll_wait_seconds=0, num_request_iterations_for_warmup=2)
    with caplog.at_level(logging.INFO):
        manager.reload_config(config(f"counter {base}"))
    messages = [record.getMessage() for record in caplog.records]
    replayed = [i for i, m in enumerate(messages) if "replayed record" in m]
    available = messages.index("model counter version 1 is AVAILABLE")
    assert len(replayed) == 4 and max(replayed) < available
    with serving(manager) as (prediction, _, _):
        request = predict_pb2.PredictRequest(model_spec={"name": "counter"})
        request.inputs["x"].CopyFrom(tf.make_tensor_proto(np.zeros(1, np.float32)))
        count = prediction.Predict(request, timeout=10).outputs["count"]
    assert tf.make_ndarray(count) == 3 * 2 + 1  # three predict records, twice each, then this request


def test_warmup_replays_classify_regress_and_multi_inference_logs(tmp_path, testdata, caplog):
    examples = {"example_list": {"examples": [{"features": {"feature": {"x": {"float_list": {"value": [2.0]}}}}}]}}
    logs = [
        {"classify_log": {"request": {"model_spec": {"signature_name": "classify_x_to_y"}, "input": examples}}},
        {"regress_log": {"request": {"model_spec": {"signature_name": "regress_x_to_y"}, "input": examples}}},
        {"multi_inference_log": {"request": {"input": examples, "tasks": [
            {"model_spec": {"name": "hp2", "signature_name": "regress_x_to_y"},
             "method_name": "tensorflow/serving/regress"}]}}},
    ]
    base = tmp_path / "hp2"
    shutil.copytree(testdata["hp2_124"], base / "1")
    (base / "1" / WARMUP_FILE).parent.mkdir()
    with tf.io.TFRecordWriter(str(base / "1" / WARMUP_FILE)) as writer:
        for entry in logs:
            writer.write(prediction_log_pb2.PredictionLog(**entry).SerializeToString())
    manager = ModelManager(file_system_poll_wait_seconds=0)
    with caplog.at_level(logging.INFO, logger="serving.servable.warmup"):
        manager.reload_config(config(f"hp2 {base}"))
    assert states(manager, "hp2") == {1: AVAILABLE}
    assert [m.split("(")[1].split(")")[0] for m in caplog.messages if "replayed record" in m] == \
        ["classify_log", "regress_log", "multi_inference_log"]


@pytest.mark.parametrize("warmup, code, message", [
    ({"warmup_bytes": b"not a TFRecord file"}, grpc.StatusCode.DATA_LOSS,
     "Please verify your warmup data is in TFRecord format."),
    ({"warmup_records": [predict_log("nope")]}, grpc.StatusCode.INVALID_ARGUMENT,
     "warmup record 1 (predict_log) of {path}: "),  # then the request's own INVALID_ARGUMENT message
    ({"warmup_records": [prediction_log_pb2.PredictionLog(session_run_log={}).SerializeToString()]},
     grpc.StatusCode.UNIMPLEMENTED, "Unsupported log_type for warmup: session_run_log"),
    ({"warmup_records": [b""] * 1001}, grpc.StatusCode.INVALID_ARGUMENT,  # empty logs: skipped, but counted
     "Number of warmup records exceeds the maximum (1000) at {path}"),
])
def test_a_failed_warmup_fails_that_versions_load(tmp_path, warmup, code, message):
    base = tmp_path / "counter"
    write_counter_model(base / "1", warmup_records=[predict_log()])
    write_counter_model(base / "2", **warmup)
    manager = ModelManager(file_system_poll_wait_seconds=0)
    with pytest.raises(ModelConfigError, match=r"did not become available: \{name: counter version: 2\}"):
        manager.reload_config(config(f"counter {base} model_version_policy {{ all {{}} }}"))
    reported = manager.version_states("counter")
    assert (reported[1].state, reported[1].error_code) == (AVAILABLE, 0)
    assert (reported[2].state, reported[2].error_code) == (END, code.value[0])
    assert message.format(path=base / "2" / WARMUP_FILE) in reported[2].error_message


def test_a_network_reload_is_bounded_in_models_and_names(halver):
    """With reloads allowed, a client still cannot unload every model, nor load one directory under endless
    names (serving/model_service.py MAX_RELOAD_MODELS)."""
    from serving.model_service import MAX_RELOAD_MODELS

    manager = ModelManager(file_system_poll_wait_seconds=0)
    manager.reload_config(config(f"halver {halver}"))
    with serving(manager, ReloadPolicy(allowed=True, roots=(str(halver.parent),))) as (_, model_service, _):
        assert refusal(model_service, reload_request()) == (
            grpc.StatusCode.FAILED_PRECONDITION, "a reload over the network must keep at least one model; the "
                                                 "operator's model config file can serve none")
        assert refusal(model_service, reload_request(f"halver {halver}", f"again {halver}/")) == (
            grpc.StatusCode.INVALID_ARGUMENT, "model again: its base_path is already model halver's in this config; "
                                              "a reload serves each model directory under one name")
        many = reload_request(*(f"m{i} {halver.parent}/m{i}" for i in range(MAX_RELOAD_MODELS + 1)))
        code, message = refusal(model_service, many)
        assert code == grpc.StatusCode.INVALID_ARGUMENT and f"at most {MAX_RELOAD_MODELS} models" in message
    assert manager.model_names == ["halver"] and list(manager.versions("halver")) == [1]
