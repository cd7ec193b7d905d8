"""The request log: ModelConfig.logging_config samples answered requests into TFRecord files of PredictionLog."""

from __future__ import annotations

import logging
import random
import shutil
import sys
import time
import urllib.request

import grpc
import numpy as np
import pytest
import tensorflow as tf
from google.protobuf import text_format
from tensorflow_serving.apis import predict_pb2, prediction_log_pb2, prediction_service_pb2_grpc, regression_pb2
from tensorflow_serving.config import model_server_config_pb2

from serving.manager.model_config import ModelConfigError, validate_model_config
from serving.request_log import RequestLog

pytestmark = pytest.mark.timeout(180)


def logging_config(prefix, rate, collector_type="tfrecord") -> str:
    return (f'logging_config {{ log_collector_config {{ type: "{collector_type}" filename_prefix: "{prefix}" }} '
            f'sampling_config {{ sampling_rate: {rate} }} }}')


@pytest.fixture(scope="module")
def served(tmp_path_factory, start_server, copy_testdata):
    """A server logging every request of half_plus_two and none of quiet (the same model)."""
    root = tmp_path_factory.mktemp("request_log")
    base = copy_testdata("saved_model_half_plus_two_cpu", root / "half_plus_two")
    (root / "logs").mkdir()
    prefix = root / "logs" / "requests"
    config = root / "models.config"
    config.write_text(f"""model_config_list {{
  config {{ name: "half_plus_two" base_path: "{base}" model_platform: "tensorflow" {logging_config(prefix, 1.0)} }}
  config {{ name: "quiet" base_path: "{base}" model_platform: "tensorflow" {logging_config(prefix, 0.0)} }}
}}
""")
    server = start_server(f"--model_config_file={config}", "--rest_api_port=-1", log_dir=root)
    yield server, f"http://{server.rest_address}", root / "logs"
    server.stop()


def log_file(logs, model):
    [path] = logs.glob(f"requests-{model}-*.tfrecord")
    return path


def records(path, at_least=0, timeout_s=20.0):
    """The PredictionLogs in a log file, once it holds at least that many (the writer flushes when it catches up)."""
    deadline = time.monotonic() + timeout_s
    while True:
        logs = [prediction_log_pb2.PredictionLog.FromString(record)
                for record in tf.data.TFRecordDataset(str(path)).as_numpy_iterator()]
        if len(logs) >= at_least or time.monotonic() > deadline:
            return logs
        time.sleep(0.1)


def predict_request(model, values):
    request = predict_pb2.PredictRequest()
    request.model_spec.name = model
    request.inputs["x"].CopyFrom(tf.make_tensor_proto(np.array(values, np.float32).reshape(-1, 1)))
    return request


def regression_request(x):
    request = regression_pb2.RegressionRequest(model_spec={"name": "half_plus_two", "signature_name": "regress_x_to_y"})
    request.input.example_list.examples.add().features.feature["x"].float_list.value.append(x)
    return request


def test_every_request_is_logged_with_its_request_response_and_metadata(served):
    server, url, logs = served
    with grpc.insecure_channel(server.address) as channel:
        stub = prediction_service_pb2_grpc.PredictionServiceStub(channel)
        sent = [predict_request("half_plus_two", [1.0, 2.0]), regression_request(4.0)]
        answers = [stub.Predict(sent[0], timeout=20), stub.Regress(sent[1], timeout=20)]
        stub.Predict(predict_request("quiet", [1.0]), timeout=20)  # sampling_rate 0: never logged
        with pytest.raises(grpc.RpcError):  # failed requests are not logged, as in TF Serving
            stub.Predict(predict_pb2.PredictRequest(model_spec={"name": "half_plus_two"}), timeout=20)  # no input
    body = b'{"instances": [[3.0]]}'
    with urllib.request.urlopen(urllib.request.Request(f"{url}/v1/models/half_plus_two:predict", data=body),
                                timeout=20) as response:
        assert response.status == 200

    logged = records(log_file(logs, "half_plus_two"), at_least=3)
    assert [log.WhichOneof("log_type") for log in logged] == ["predict_log", "regress_log", "predict_log"]
    assert logged[0].predict_log.request == sent[0] and logged[0].predict_log.response == answers[0]
    assert logged[1].regress_log.request == sent[1] and logged[1].regress_log.response == answers[1]
    rest = logged[2].predict_log  # REST requests are logged as the request proto the servicer answered
    assert tf.make_ndarray(rest.request.inputs["x"]).tolist() == [[3.0]]
    assert tf.make_ndarray(rest.response.outputs["y"]).tolist() == [[3.5]]
    metadata = logged[0].log_metadata
    assert (metadata.model_spec.name, metadata.model_spec.version.value) == ("half_plus_two", 123)
    assert metadata.sampling_config.sampling_rate == 1.0 and list(metadata.saved_model_tags) == ["serve"]
    assert abs(metadata.timestamp_secs - time.time()) < 600
    assert records(log_file(logs, "quiet")) == []


def test_a_logged_request_replays_to_the_same_response(served):
    server, _, logs = served
    logged = records(log_file(logs, "half_plus_two"), at_least=1)[0].predict_log
    with grpc.insecure_channel(server.address) as channel:
        replayed = prediction_service_pb2_grpc.PredictionServiceStub(channel).Predict(logged.request, timeout=20)
    assert replayed == logged.response


def test_a_request_log_is_warmup_data(served, tmp_path, tfserving_testdata):
    from serving.servable.runner import Runner
    from serving.servable.warmup import WARMUP_FILE, run_warmup

    _, _, logs = served
    version = tmp_path / "123"
    shutil.copytree(tfserving_testdata / "saved_model_half_plus_two_cpu" / "00000123", version)
    (version / WARMUP_FILE).parent.mkdir(exist_ok=True)
    shutil.copyfile(log_file(logs, "half_plus_two"), version / WARMUP_FILE)
    count = len(records(version / WARMUP_FILE))
    assert count >= 3 and run_warmup(Runner.load(version, model_name="half_plus_two"), version) == count


def test_stopping_the_server_writes_what_was_sampled(served):
    server, _, logs = served
    with grpc.insecure_channel(server.address) as channel:
        prediction_service_pb2_grpc.PredictionServiceStub(channel).Predict(predict_request("half_plus_two", [9.0]),
                                                                          timeout=20)
    assert server.stop() == 0
    last = records(log_file(logs, "half_plus_two"), timeout_s=0)[-1]
    assert tf.make_ndarray(last.predict_log.request.inputs["x"]).tolist() == [[9.0]]


def model_config(text: str) -> model_server_config_pb2.ModelConfig:
    return text_format.Parse(text, model_server_config_pb2.ModelConfig())


def test_sampling_is_a_seeded_draw_per_request(tmp_path):
    prefix = tmp_path / "requests"
    request_log = RequestLog(seed=7)
    request_log.update({"m": model_config(f'name: "m" {logging_config(prefix, 0.25)}')})
    request = predict_request("m", [1.0])
    response = predict_pb2.PredictResponse(model_spec={"name": "m", "version": {"value": 1}})
    for _ in range(200):
        request_log.log("Predict", request, response)
    request_log.log("GetModelMetadata", request, response)  # not a logged RPC
    request_log.log("Predict", predict_request("other", [1.0]), response)  # a model without logging_config
    path = request_log.paths()["m"]
    request_log.close()
    draws = random.Random(7)
    assert len(records(path, timeout_s=0)) == sum(draws.random() < 0.25 for _ in range(200)) > 0


def test_a_changed_logging_config_starts_a_new_file_and_closes_the_old(tmp_path):
    request_log = RequestLog()
    request = predict_request("m", [1.0])
    response = predict_pb2.PredictResponse(model_spec={"name": "m"})
    request_log.update({"m": model_config(f'name: "m" {logging_config(tmp_path / "a", 1.0)}')})
    request_log.log("Predict", request, response)
    old = request_log.paths()["m"]
    request_log.update({"m": model_config(f'name: "m" {logging_config(tmp_path / "a", 1.0)}')})  # unchanged
    assert request_log.paths()["m"] == old
    request_log.update({"m": model_config(f'name: "m" {logging_config(tmp_path / "b", 1.0)}')})
    assert request_log.paths()["m"] != old and len(records(old, timeout_s=0)) == 1
    request_log.update({})  # the model left the config (or lost its logging_config)
    assert request_log.paths() == {}


def test_a_full_queue_drops_and_counts_instead_of_blocking(tmp_path, caplog):
    from serving.monitoring import Metrics

    # Hold the GIL for up to a second per slice: the writer thread cannot take a record off the
    # queue while this loop runs, so records beyond the queue's one slot are dropped, not waited for.
    previous = sys.getswitchinterval()
    metrics = Metrics()
    request_log = RequestLog(queue_size=1, metrics=metrics)
    request_log.update({"m": model_config(f'name: "m" {logging_config(tmp_path / "r", 1.0)}')})
    request, response = predict_request("m", [1.0]), predict_pb2.PredictResponse(model_spec={"name": "m"})
    sys.setswitchinterval(1.0)
    try:
        with caplog.at_level(logging.WARNING, logger="serving.request_log"):
            for _ in range(10):
                request_log.log("Predict", request, response)
    finally:
        sys.setswitchinterval(previous)
    dropped = request_log.dropped()["m"]
    path = request_log.paths()["m"]
    request_log.close()
    assert dropped >= 1 and len(records(path, timeout_s=0)) + dropped == 10
    assert [r.getMessage() for r in caplog.records if "dropped" in r.getMessage()] == [
        "model m: request log: the writer is behind; 1 sampled requests dropped so far (warned at most every 60 s)"]
    text = metrics.exposition().decode()
    assert f'tensorflow_serving_request_log_dropped_total{{model_name="m"}} {float(dropped)}' in text


def test_the_queue_holds_a_bounded_number_of_bytes(tmp_path):
    request = predict_request("m", [1.0] * 4096)  # 16 KB of values
    response = predict_pb2.PredictResponse(model_spec={"name": "m"})
    request_log = RequestLog(queue_bytes=2 * (request.ByteSize() + response.ByteSize()))  # two records
    request_log.update({"m": model_config(f'name: "m" {logging_config(tmp_path / "r", 1.0)}')})
    previous = sys.getswitchinterval()
    sys.setswitchinterval(1.0)  # the writer cannot take records off the queue while this loop runs
    try:
        for _ in range(10):
            request_log.log("Predict", request, response)
    finally:
        sys.setswitchinterval(previous)
    dropped = request_log.dropped()["m"]
    path = request_log.paths()["m"]
    request_log.close()
    assert dropped >= 5 and len(records(path, timeout_s=0)) + dropped == 10  # 1024 record slots, but 2 records' bytes


BAD_LOGGING_CONFIGS = {
    "unknown collector": (lambda d: logging_config(d / "r", 1.0, collector_type="kafka"),
                          "Cannot find LogCollector::Factory for type: kafka"),
    "no prefix": (lambda d: logging_config("", 1.0), "filename_prefix is empty"),
    "missing directory": (lambda d: logging_config(d / "nowhere" / "r", 1.0), "does not exist"),
    "rate above 1": (lambda d: logging_config(d / "r", 1.5), "sampling_rate must be between 0 and 1, got 1.5"),
    "custom config": (lambda d: 'logging_config { custom_logging_config { type_url: "x" } }',
                      "custom_logging_config is not supported"),
}


@pytest.mark.parametrize("case", list(BAD_LOGGING_CONFIGS))
def test_bad_logging_configs_are_refused_with_the_model_named(tmp_path, case):
    text, message = BAD_LOGGING_CONFIGS[case]
    config = text_format.Parse(f'model_config_list {{ config {{ name: "m" base_path: "/m" model_platform: "tensorflow" '
                               f'{text(tmp_path)} }} }}', model_server_config_pb2.ModelServerConfig())
    with pytest.raises(ModelConfigError, match=message) as error:
        validate_model_config(config)
    assert "model m: logging_config" in str(error.value)
