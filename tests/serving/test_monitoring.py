"""Prometheus metrics (--monitoring_config_file): labelled request counters and latency, the NaN guard."""

from __future__ import annotations

import asyncio
import logging
import re
from concurrent import futures
import urllib.error
import urllib.request

import grpc
import numpy as np
import pytest
import tensorflow as tf
from tensorflow_serving.apis import predict_pb2, prediction_service_pb2_grpc

from serving.monitoring import DEFAULT_PATH, OTHER, Metrics, MonitoringConfigError, read_monitoring_config

pytestmark = pytest.mark.timeout(180)


def write_nan_model(version_dir):
    """A foreign model whose output 'y' = log(-x): NaN for every positive x."""
    class Nan(tf.Module):
        @tf.function(input_signature=[tf.TensorSpec([None, 1], tf.float32, name="x")])
        def serve(self, x):
            return {"y": tf.math.log(-x)}

    module = Nan()
    tf.saved_model.save(module, str(version_dir), signatures={"serving_default": module.serve})


@pytest.fixture(scope="module")
def served(tmp_path_factory, start_server, copy_testdata):
    root = tmp_path_factory.mktemp("monitoring")
    half_plus_two = copy_testdata("saved_model_half_plus_two_cpu", root / "half_plus_two")
    write_nan_model(root / "nan" / "1")
    config = root / "models.config"
    config.write_text(f"""model_config_list {{
  config {{ name: "half_plus_two" base_path: "{half_plus_two}" model_platform: "tensorflow" }}
  config {{ name: "nan" base_path: "{root / 'nan'}" model_platform: "tensorflow" }}
}}
""")
    monitoring = root / "monitoring.config"
    monitoring.write_text('prometheus_config { enable: true, path: "/monitoring/prometheus/metrics" }\n')
    server = start_server(f"--model_config_file={config}", "--rest_api_port=-1",
                          f"--monitoring_config_file={monitoring}", log_dir=root)
    yield server, f"http://{server.rest_address}"
    server.stop()


def grpc_predict(address, model, values):
    request = predict_pb2.PredictRequest()
    request.model_spec.name = model
    request.inputs["x"].CopyFrom(tf.make_tensor_proto(np.array(values, np.float32).reshape(-1, 1)))
    with grpc.insecure_channel(address) as channel:
        return prediction_service_pb2_grpc.PredictionServiceStub(channel).Predict(request, timeout=30)


def rest(url, body=None):
    request = urllib.request.Request(url, data=body, method="POST" if body else "GET")
    with urllib.request.urlopen(request, timeout=30) as response:
        return response.status, response.headers.get("Content-Type"), response.read().decode()


def sample(text, name, **labels):
    """The value of one sample in Prometheus text, or None."""
    for line in text.splitlines():
        if line.startswith(name + "{") and all(f'{key}="{value}"' in line for key, value in labels.items()):
            return float(line.rsplit(" ", 1)[1])
    return None


def test_metrics_count_grpc_and_rest_requests_with_labels(served):
    server, url = served
    grpc_predict(server.address, "half_plus_two", [1.0, 2.0])
    grpc_predict(server.address, "half_plus_two", [3.0])
    assert rest(f"{url}/v1/models/half_plus_two:predict", b'{"instances": [[1.0]]}')[0] == 200
    with pytest.raises(grpc.RpcError) as error:
        grpc_predict(server.address, "missing", [1.0])
    assert error.value.code() == grpc.StatusCode.NOT_FOUND
    status, content_type, text = rest(url + DEFAULT_PATH)
    assert status == 200 and content_type.startswith("text/plain")
    ok = dict(model_name="half_plus_two", version="123", rpc="Predict", status="OK")
    assert sample(text, "tensorflow_serving_request_count_total", api="grpc", **ok) == 2
    assert sample(text, "tensorflow_serving_request_count_total", api="rest", **ok) == 1
    assert sample(text, "tensorflow_serving_request_latency_seconds_count", api="grpc", **ok) == 2
    assert sample(text, "tensorflow_serving_request_count_total", model_name=OTHER, api="grpc",
                  status="NOT_FOUND") == 1  # a name the server does not serve is no label of its own
    assert 'model_name="missing"' not in text
    assert sample(text, "tensorflow_serving_model_events_total", model_name="nan", version="1", event="load") == 1


def test_nan_outputs_are_counted_per_model_version_and_output(served):
    server, url = served
    response = grpc_predict(server.address, "nan", [1.0, 2.0, 3.0])
    assert np.isnan(tf.make_ndarray(response.outputs["y"])).all()  # served as is: the guard only counts
    grpc_predict(server.address, "half_plus_two", [1.0])
    text = rest(url + DEFAULT_PATH)[2]
    assert sample(text, "tensorflow_serving_nonfinite_outputs_total", model_name="nan", version="1", output="y") == 3
    assert sample(text, "tensorflow_serving_nonfinite_outputs_total", model_name="half_plus_two") is None
    assert "output 'y': 3 of 3 values are NaN or Inf" in server.stderr_path.read_text()


def test_nan_warning_is_rate_limited_per_output(caplog):
    from serving.numerics import NumericsGuard

    now = [0.0]
    metrics = Metrics()
    guard = NumericsGuard(metrics, clock=lambda: now[0])
    outputs = {"y": np.array([np.nan, np.inf, 1.0], np.float32), "ok": np.ones(3, np.float16)}
    with caplog.at_level(logging.WARNING, logger="serving.numerics"):
        for seconds in (0.0, 10.0, 59.0, 61.0):
            now[0] = seconds
            guard.check("m", "1", outputs)
        guard.check("m", "2", outputs)  # another version warns on its own
    warnings = [record.getMessage() for record in caplog.records]
    assert len(warnings) == 3 and all("2 of 3 values are NaN or Inf" in message for message in warnings)
    assert sample(metrics.exposition().decode(), "tensorflow_serving_nonfinite_outputs_total",
                  model_name="m", version="1", output="y") == 8


def test_nan_answers_are_refused_when_the_operator_asks(tmp_path):
    """--refuse_nonfinite_outputs: FAILED_PRECONDITION naming the output instead of an OK answer holding NaN
    (off by default: TF Serving returns what a model returns)."""
    from server_helpers import serving
    from serving.manager import model_config
    from serving.manager.model_manager import ModelManager

    write_nan_model(tmp_path / "nan" / "1")
    manager = ModelManager(file_system_poll_wait_seconds=0)
    manager.reload_config(model_config.single_model_config("nan", str(tmp_path / "nan")))
    try:
        with serving(manager, refuse_nonfinite_outputs=True) as server:
            with pytest.raises(grpc.RpcError) as refused:
                grpc_predict(server.grpc_address, "nan", [1.0, -1.0])
            assert refused.value.code() == grpc.StatusCode.FAILED_PRECONDITION
            assert refused.value.details() == ("model nan version 1: output 'y' holds 1 NaN or Inf values of 2; this "
                                               "server refuses such answers (--refuse_nonfinite_outputs)")
            assert list(grpc_predict(server.grpc_address, "nan", [-1.0]).outputs["y"].float_val) == [0.0]
    finally:
        manager.stop()


def test_monitoring_config_defaults_and_errors(tmp_path):
    path = tmp_path / "monitoring.config"
    path.write_text("prometheus_config { enable: true }")
    config = read_monitoring_config(path)
    assert config.enable and config.path == "/monitoring/prometheus/metrics"
    path.write_text("prometheus_config { enabled: true }")
    with pytest.raises(MonitoringConfigError, match="enabled"):
        read_monitoring_config(path)
    with pytest.raises(MonitoringConfigError, match="cannot read"):
        read_monitoring_config(tmp_path / "missing")


def test_metrics_registry_is_not_the_global_one():
    from prometheus_client import REGISTRY

    assert Metrics().registry is not REGISTRY


def test_batch_sizes_are_observed_through_the_batchers_listener(tfserving_testdata):
    from serving.servable.runner import Runner
    from serving.batching.scheduler import Batcher
    from serving.batching.parameters import BatchingParameters

    metrics = Metrics()
    runner = Runner.load(tfserving_testdata / "saved_model_half_plus_two_cpu" / "00000123")
    # A lone request waits in the open batch for batch_timeout_micros: its queue delay is at least that.
    batcher = Batcher(BatchingParameters(max_batch_size=8, num_batch_threads=1, batch_timeout_micros=20000))
    batcher.add_listener(metrics.observe_batch)
    try:
        asyncio.run(batcher.run(runner, runner.call({"x": np.ones((3, 1), np.float32)})))
    finally:
        batcher.stop()
    text = metrics.exposition().decode()
    assert batcher.batch_sizes() == {3: 1}  # the batcher's own record still runs
    assert "tensorflow_serving_batch_size_count 1.0" in text and "tensorflow_serving_batch_size_sum 3.0" in text
    assert "tensorflow_serving_batch_queue_delay_seconds_count 1.0" in text
    assert 0.02 <= float(re.search(r"^tensorflow_serving_batch_queue_delay_seconds_sum (\S+)$", text, re.M)[1]) < 10


def test_rest_requests_refused_before_a_servicer_are_counted_once(served):
    server, url = served
    refusals = [("/v1/models/absent:predict", b'{"instances": [[1.0]]}', 404),  # unknown model
                ("/v1/models/half_plus_two:predict", b'{"instances": [[1.0]', 400),  # bad JSON
                ("/v1/models/half_plus_two:explain", b'{}', 400),  # no such route
                ("/v1/models/nan:predict", b'{"instances": [1.0]}', 400)]  # refused by the servicer (shape)
    for path, body, status in refusals:
        with pytest.raises(urllib.error.HTTPError) as error:
            rest(url + path, body)
        assert error.value.code == status
    text = rest(url + DEFAULT_PATH)[2]
    count = "tensorflow_serving_request_count_total"
    assert sample(text, count, model_name=OTHER, api="rest", rpc="Predict", status="NOT_FOUND") == 1
    assert sample(text, count, model_name="half_plus_two", api="rest", rpc="Predict", status="INVALID_ARGUMENT") == 1
    assert sample(text, count, model_name="", api="rest", rpc="", status="INVALID_ARGUMENT") == 1
    counted = [line for line in text.splitlines() if line.startswith(count + "{") and 'model_name="nan"' in line
               and 'api="rest"' in line and 'status="INVALID_ARGUMENT"' in line]
    assert len(counted) == 1 and counted[0].endswith(" 1.0")  # by the servicer only, not again by the REST layer
    assert sample(text, "tensorflow_serving_model_load_latency_seconds_count", model_name="nan") == 1


def test_model_events_and_load_latency_follow_the_manager(tmp_path, copy_testdata):
    from serving.manager.model_config import ModelConfigError, single_model_config
    from serving.manager.model_manager import ModelManager

    metrics = Metrics()
    base = copy_testdata("saved_model_half_plus_two_cpu", tmp_path / "half_plus_two")
    (tmp_path / "broken" / "1").mkdir(parents=True)  # a version directory without a SavedModel
    both = single_model_config("half_plus_two", base)
    both.model_config_list.config.add(name="broken", base_path=str(tmp_path / "broken"), model_platform="tensorflow")
    manager = ModelManager(file_system_poll_wait_seconds=0)
    manager.reload_config(single_model_config("half_plus_two", base))
    metrics.follow_models(manager)  # after the first load: events from before it count too
    with pytest.raises(ModelConfigError):
        manager.reload_config(both)
    manager.reload_config(single_model_config("broken", tmp_path / "broken"))  # half_plus_two leaves: unloaded
    text = metrics.exposition().decode()
    events = "tensorflow_serving_model_events_total"
    assert sample(text, events, model_name="half_plus_two", version="123", event="load") == 1
    assert sample(text, events, model_name="half_plus_two", version="123", event="unload") == 1
    assert sample(text, events, model_name="broken", version="1", event="load_failed") == 1
    assert sample(text, "tensorflow_serving_model_load_latency_seconds_count", model_name="half_plus_two") == 1
    assert sample(text, "tensorflow_serving_model_load_latency_seconds_sum", model_name="half_plus_two") > 0
    assert sample(text, "tensorflow_serving_model_load_latency_seconds_count", model_name="broken") is None


def test_labels_take_only_served_names(tmp_path, copy_testdata):
    from serving.manager.model_config import single_model_config
    from serving.manager.model_manager import ModelManager

    metrics = Metrics()
    base = copy_testdata("saved_model_half_plus_two_cpu", tmp_path / "half_plus_two")
    manager = ModelManager(file_system_poll_wait_seconds=0)
    manager.reload_config(single_model_config("half_plus_two", base))
    metrics.follow_models(manager)
    observe = dict(api="grpc", rpc="Predict", status="NOT_FOUND", seconds=0.01)
    metrics.observe_request(model_name="half_plus_two", version="123", signature_name="regress_x_to_y", **observe)
    metrics.observe_request(model_name="half_plus_two", version="7", signature_name="made_up", **observe)
    metrics.observe_request(model_name="made_up", version="123", signature_name="regress_x_to_y", **observe)
    metrics.observe_request(model_name="", version="", signature_name="", **observe)
    text = metrics.exposition().decode()
    count = "tensorflow_serving_request_count_total"
    assert sample(text, count, model_name="half_plus_two", version="123", signature_name="regress_x_to_y") == 1
    assert sample(text, count, model_name="half_plus_two", version=OTHER, signature_name=OTHER) == 1
    assert sample(text, count, model_name=OTHER, version=OTHER, signature_name=OTHER) == 1
    assert sample(text, count, model_name="", version="", signature_name="") == 1
    assert "made_up" not in text and 'version="7"' not in text


def test_made_up_names_leave_the_metrics_page_small(served):
    """900 requests naming 16 KB made-up models, signatures and versions add a handful of series, not 900."""
    server, url = served
    before = len(rest(url + DEFAULT_PATH)[2])
    x = tf.make_tensor_proto(np.ones((1, 1), np.float32))

    def predict(i):
        name = f"{i:04d}" + "n" * (16 * 1024 - 4)
        spec = [{"name": name}, {"name": "half_plus_two", "signature_name": name},
                {"name": "half_plus_two", "version": {"value": 10**15 + i}}][i % 3]
        with pytest.raises(grpc.RpcError):  # the details may exceed the client's metadata limit
            stub.Predict(predict_pb2.PredictRequest(model_spec=spec, inputs={"x": x}), timeout=30)

    with grpc.insecure_channel(server.address) as channel:
        stub = prediction_service_pb2_grpc.PredictionServiceStub(channel)
        with futures.ThreadPoolExecutor(4) as pool:
            list(pool.map(predict, range(900)))
    text = rest(url + DEFAULT_PATH)[2]
    assert len(text) - before < 32 * 1024, (before, len(text))
    assert "nnnnnnnn" not in text and str(10**15) not in text
    count = "tensorflow_serving_request_count_total"
    assert sample(text, count, model_name=OTHER, version="", api="grpc", status="NOT_FOUND") >= 300
    assert sample(text, count, model_name="half_plus_two", version=OTHER, status="NOT_FOUND") == 300
    assert sample(text, count, model_name="half_plus_two", signature_name=OTHER, status="FAILED_PRECONDITION") == 300


def test_cancelled_and_expired_calls_are_counted(tmp_path, write_gate_model):
    """Issue 22 #13: calls whose client went away or whose deadline passed never reached the request metrics."""
    from server_helpers import serving, wait_for
    from serving.manager import model_config
    from serving.manager.model_manager import ModelManager

    write_gate_model(tmp_path / "gate" / "1")
    manager = ModelManager(file_system_poll_wait_seconds=0, enable_model_warmup=False)
    manager.reload_config(model_config.single_model_config("gate", str(tmp_path / "gate")))
    metrics = Metrics()
    request = predict_pb2.PredictRequest(model_spec={"name": "gate"})
    request.inputs["dir"].CopyFrom(tf.make_tensor_proto(str(tmp_path)))

    def counted(status: str) -> float:
        """Predict calls counted with this status, whatever their model label: a call that expires before its
        message is read (a stalled loop on a loaded machine) is counted under OTHER, its model unknown."""
        return sum(sample.value for metric in metrics.requests.collect() for sample in metric.samples
                   if sample.name.endswith("_total") and sample.labels["rpc"] == "Predict"
                   and sample.labels["api"] == "grpc" and sample.labels["status"] == status)

    try:
        with serving(manager, metrics=metrics) as server, grpc.insecure_channel(server.grpc_address) as channel:
            stub = prediction_service_pb2_grpc.PredictionServiceStub(channel)
            with pytest.raises(grpc.RpcError) as expired:
                stub.Predict(request, timeout=1)
            assert expired.value.code() == grpc.StatusCode.DEADLINE_EXCEEDED
            # The server's deadline is the timeout counted from when the call reached it, so on a loaded machine
            # the client's clock can fire first and the server sees a cancellation before its own deadline
            # (CANCELLED; CI once): either way the call is counted, once.
            try:
                wait_for(lambda: counted("DEADLINE_EXCEEDED") + counted("CANCELLED") == 1)
            except AssertionError:
                raise AssertionError(metrics.exposition().decode()[-4000:]) from None
            expired_as_cancelled = counted("CANCELLED")
            (tmp_path / "started").unlink()  # the expired call's model call still runs; the next one writes it again
            cancelled = stub.Predict.future(request, timeout=60)
            wait_for(lambda: (tmp_path / "started").exists())  # the call is in the server, its model call running
            cancelled.cancel()
            wait_for(lambda: counted("CANCELLED") == expired_as_cancelled + 1)
    finally:
        (tmp_path / "release").touch()
        manager.stop()


def test_weights_follow_the_loaded_versions(tmp_path, copy_testdata):
    from serving.manager.model_config import single_model_config
    from serving.manager.model_manager import ModelManager

    metrics = Metrics()
    base = copy_testdata("saved_model_half_plus_two_cpu", tmp_path / "half_plus_two")
    other = copy_testdata("saved_model_half_plus_two_cpu", tmp_path / "other")
    manager = ModelManager(file_system_poll_wait_seconds=0)
    manager.reload_config(single_model_config("half_plus_two", base))
    metrics.follow_models(manager)
    weights = "tensorflow_serving_model_weights_bytes"
    text = metrics.exposition().decode()  # a foreign model: no pipeline.json, so its policy is unknown
    # a, b, c, a2, c2: five float32 scalars
    assert sample(text, weights, model_name="half_plus_two", version="123", policy="unknown", dtype="float32") == 20
    manager.reload_config(single_model_config("other", other))  # half_plus_two unloaded: its series goes
    text = metrics.exposition().decode()
    assert sample(text, weights, model_name="other", version="123", policy="unknown", dtype="float32") == 20
    assert sample(text, weights, model_name="half_plus_two", version="123", policy="unknown", dtype="float32") is None
