"""Server-side batching: merged requests get exactly their own rows; TF Serving's limits and errors."""

from __future__ import annotations

import threading
from concurrent import futures

import grpc
import numpy as np
import pytest
from tensorflow.core.protobuf import meta_graph_pb2

from serving.runner import Runner
from serving.batching import (Batcher, BatchingConfigError, BatchingParameters, parse_batching_parameters,
                              read_batching_parameters)
from serving.errors import InvalidArgument, Unavailable, status_for


class SlowDoubler:
    """A Runner stand-in: y = 2 x over a [-1, 2] float input; predict() waits for `release` when given."""

    model_name, version = "slow", 1

    def __init__(self, release: threading.Event | None = None) -> None:
        signature = meta_graph_pb2.SignatureDef(method_name="tensorflow/serving/predict")
        signature.inputs["x"].tensor_shape.dim.add(size=-1)
        signature.inputs["x"].tensor_shape.dim.add(size=2)
        signature.outputs["y"].name = "y"
        self.signature_defs = {"serving_default": signature}
        self.release, self.started = release, threading.Event()
        self.calls: list[np.ndarray] = []

    def predict(self, inputs, signature_name="serving_default", output_filter=()):
        self.calls.append(inputs["x"])
        self.started.set()
        if self.release is not None:
            self.release.wait(10)
        return {"y": inputs["x"] * 2}


def test_shared_batching_config_parses(tfserving_testdata):
    parameters = read_batching_parameters(tfserving_testdata / "batching_config.txt")
    assert parameters == BatchingParameters(max_batch_size=128, batch_timeout_micros=0, max_enqueued_batches=1000000,
                                            num_batch_threads=8)


@pytest.mark.parametrize("text, message", [
    ("max_batch_size { value: 8 } allowed_batch_sizes: 4 allowed_batch_sizes: 2 allowed_batch_sizes: 8",
     "allowed_batch_sizes entries must be monotonically increasing"),
    ("max_batch_size { value: 8 } allowed_batch_sizes: 2 allowed_batch_sizes: 4",
     "Last entry in allowed_batch_sizes must match max_batch_size; last entry was 4; expected 8"),
    ("num_batch_threads { value: 0 }", "num_batch_threads must be positive"),
    ("max_batch_siz { value: 8 }", 'has no field named "max_batch_siz"'),
])
def test_bad_parameters_are_refused(text, message):
    with pytest.raises(BatchingConfigError, match=message):
        parse_batching_parameters(text)


def test_unreadable_parameters_file_names_it(tmp_path):
    with pytest.raises(BatchingConfigError, match="missing.txt"):
        read_batching_parameters(tmp_path / "missing.txt")


def test_concurrent_requests_are_merged_and_split_back(exported_model):
    runner = Runner.load(exported_model.version_dir)
    rows = exported_model.val_x[:24]
    expected = [runner.predict({exported_model.input_name: row[None]}) for row in rows]
    batcher = Batcher(BatchingParameters(max_batch_size=8, batch_timeout_micros=200_000, num_batch_threads=1))
    try:
        with futures.ThreadPoolExecutor(len(rows)) as pool:
            answers = list(pool.map(lambda row: batcher.predict(runner, {exported_model.input_name: row[None]}), rows))
    finally:
        batcher.stop()
    for got, want in zip(answers, expected):
        assert got.keys() == want.keys()
        for name in want:
            assert got[name].shape == want[name].shape
            np.testing.assert_allclose(got[name], want[name], rtol=1e-5, atol=1e-6)
    sizes = batcher.batch_sizes()
    assert sum(size * count for size, count in sizes.items()) == len(rows)
    assert max(sizes) > 1, sizes


def test_batch_is_padded_to_an_allowed_size_and_trimmed():
    model = SlowDoubler()
    batcher = Batcher(BatchingParameters(max_batch_size=8, allowed_batch_sizes=(4, 8), num_batch_threads=1))
    x = np.arange(6, dtype=np.float32).reshape(3, 2)
    try:
        np.testing.assert_array_equal(batcher.predict(model, {"x": x})["y"], x * 2)
    finally:
        batcher.stop()
    assert model.calls[0].shape == (4, 2)
    np.testing.assert_array_equal(model.calls[0][3], x[0])  # padding repeats the first row


def test_request_larger_than_max_batch_size_is_invalid_argument():
    batcher = Batcher(BatchingParameters(max_batch_size=2, num_batch_threads=1))
    with pytest.raises(InvalidArgument, match="Task size 3 is larger than maximum input batch size 2"):
        batcher.predict(SlowDoubler(), {"x": np.zeros((3, 2), np.float32)})
    batcher.stop()


def test_full_queue_is_unavailable():
    release = threading.Event()
    model = SlowDoubler(release)
    batcher = Batcher(BatchingParameters(max_batch_size=1, max_enqueued_batches=1, num_batch_threads=1))
    x = np.ones((1, 2), np.float32)
    with futures.ThreadPoolExecutor(3) as pool:
        running = pool.submit(batcher.predict, model, {"x": x})
        assert model.started.wait(10)  # the one worker is busy with the first request
        # Of two more, whichever comes first fills the one batch the queue may hold; the other is refused.
        more = [pool.submit(batcher.predict, model, {"x": x}) for _ in range(2)]
        refused = next(futures.as_completed(more, timeout=10))
        release.set()
        error = refused.exception(10)
        assert isinstance(error, Unavailable), error
        assert "max_enqueued_batches is 1" in str(error)
        assert status_for(error)[0] == grpc.StatusCode.UNAVAILABLE
        np.testing.assert_array_equal(running.result(10)["y"], x * 2)
        accepted = [future for future in more if future is not refused]
        np.testing.assert_array_equal(accepted[0].result(10)["y"], x * 2)
    batcher.stop()


class CountingDoubler(SlowDoubler):
    """Records which thread ran each batch and how many ran at once."""

    def __init__(self) -> None:
        super().__init__()
        self.lock, self.running, self.most_at_once, self.threads = threading.Lock(), 0, 0, []

    def predict(self, inputs, signature_name="serving_default", output_filter=()):
        with self.lock:
            self.running += 1
            self.most_at_once = max(self.most_at_once, self.running)
            self.threads.append(threading.current_thread().name)
        threading.Event().wait(0.05)
        with self.lock:
            self.running -= 1
        return {"y": inputs["x"] * 2}


def test_batches_run_on_the_callers_threads_at_most_num_batch_threads_at_once():
    model = CountingDoubler()
    batcher = Batcher(BatchingParameters(max_batch_size=1, num_batch_threads=2, max_enqueued_batches=16))
    x = np.ones((1, 2), np.float32)
    try:
        batcher.predict(model, {"x": x})
        assert model.threads == [threading.current_thread().name]  # a lone request: no handoff to a worker
        with futures.ThreadPoolExecutor(6, thread_name_prefix="caller") as pool:
            results = list(pool.map(lambda i: batcher.predict(model, {"x": x * i})["y"], range(6)))
    finally:
        batcher.stop()
    for i, y in enumerate(results):
        np.testing.assert_array_equal(y, x * i * 2)
    assert model.most_at_once == 2 and len(model.threads) == 7
    assert all(name.startswith("caller") for name in model.threads[1:])


def test_unbatchable_signature_runs_directly():
    model = SlowDoubler()
    model.signature_defs["serving_default"].inputs["x"].tensor_shape.dim[0].size = 3  # no batch dimension
    batcher = Batcher(BatchingParameters(max_batch_size=1, num_batch_threads=1))
    x = np.ones((3, 2), np.float32)  # more rows than max_batch_size, but never queued
    np.testing.assert_array_equal(batcher.predict(model, {"x": x})["y"], x * 2)
    assert batcher.batch_sizes() == {}


def test_retired_queue_drains_first():
    release = threading.Event()
    model = SlowDoubler(release)
    batcher = Batcher(BatchingParameters(max_batch_size=4, batch_timeout_micros=10_000_000, num_batch_threads=1))
    x = np.ones((1, 2), np.float32)
    with futures.ThreadPoolExecutor(1) as pool:
        pending = pool.submit(batcher.predict, model, {"x": x})  # waits for the 10 s timeout
        threading.Event().wait(0.2)
        batcher.retire([])  # the version was unloaded: what is queued still runs, now
        release.set()
        np.testing.assert_array_equal(pending.result(5)["y"], x * 2)


def test_grpc_predict_requests_are_batched_in_the_server(exported_model):
    import tensorflow as tf
    from tensorflow_serving.apis import predict_pb2, prediction_service_pb2_grpc

    from serving import model_config
    from serving.model_manager import ModelManager
    from serving.server import create_server

    manager = ModelManager(file_system_poll_wait_seconds=0)
    manager.reload_config(model_config.single_model_config(exported_model.model_name, str(exported_model.base_path)))
    batcher = Batcher(BatchingParameters(max_batch_size=16, batch_timeout_micros=200_000, num_batch_threads=1))
    server, port, _ = create_server("127.0.0.1:0", manager, max_threads=16, batcher=batcher)
    rows = exported_model.val_x[:12]
    runner = Runner.load(exported_model.version_dir)

    def predict(row):
        request = predict_pb2.PredictRequest()
        request.model_spec.name = exported_model.model_name
        request.inputs[exported_model.input_name].CopyFrom(tf.make_tensor_proto(row[None]))
        response = stub.Predict(request, timeout=30)
        return {name: tf.make_ndarray(proto) for name, proto in response.outputs.items()}

    try:
        with grpc.insecure_channel(f"127.0.0.1:{port}") as channel:
            stub = prediction_service_pb2_grpc.PredictionServiceStub(channel)
            with futures.ThreadPoolExecutor(len(rows)) as pool:
                answers = list(pool.map(predict, rows))
    finally:
        server.stop(0)
        batcher.stop()
    for row, got in zip(rows, answers):
        want = runner.predict({exported_model.input_name: row[None]})
        for name in want:
            np.testing.assert_allclose(got[name], want[name], rtol=1e-5, atol=1e-6)
    assert max(batcher.batch_sizes()) > 1, batcher.batch_sizes()


def test_server_refuses_a_bad_parameters_file(exported_model, tmp_path, capsys):
    from serving.__main__ import main

    bad = tmp_path / "batching.txt"
    bad.write_text("max_batch_size { value: 8 }\nallowed_batch_sizes: 4\n")
    code = main([f"--model_name={exported_model.model_name}", f"--model_base_path={exported_model.base_path}",
                 "--enable_batching", f"--batching_parameters_file={bad}"])
    assert code == 1
    assert "Last entry in allowed_batch_sizes must match max_batch_size" in capsys.readouterr().err


def test_a_version_unloaded_with_queued_requests_answers_them_first(copy_testdata, tmp_path):
    import shutil
    import time

    import tensorflow as tf
    from tensorflow_serving.apis import get_model_status_pb2, predict_pb2, prediction_service_pb2_grpc

    from serving import model_config
    from serving.model_manager import ModelManager
    from serving.server import create_server

    source = copy_testdata("saved_model_half_plus_two_2_versions", tmp_path / "source")
    base = tmp_path / "hp2"
    base.mkdir()
    shutil.copytree(source / "00000123", base / "00000123")
    manager = ModelManager(file_system_poll_wait_seconds=0)
    manager.reload_config(model_config.single_model_config("hp2", str(base)))
    batcher = Batcher(BatchingParameters(max_batch_size=8, batch_timeout_micros=6_000_000, num_batch_threads=1))
    server, port, _ = create_server("127.0.0.1:0", manager, batcher=batcher)
    State = get_model_status_pb2.ModelVersionStatus
    request = predict_pb2.PredictRequest(model_spec={"name": "hp2"})
    request.inputs["x"].CopyFrom(tf.make_tensor_proto(np.array([[1.0], [2.0]], np.float32)))
    try:
        with grpc.insecure_channel(f"127.0.0.1:{port}") as channel:
            queued = prediction_service_pb2_grpc.PredictionServiceStub(channel).Predict.future(request, timeout=60)
            time.sleep(0.3)  # the request waits in its queue for the batch timeout
            shutil.copytree(source / "00000124", base / "00000124")
            manager.poll_file_system()  # loads 124, unloads 123 while the queued request holds it
            assert not queued.done()
            assert manager.version_states("hp2")[123].state == State.UNLOADING
            response = queued.result()
    finally:
        server.stop(0)
        batcher.stop()
    assert response.model_spec.version.value == 123
    np.testing.assert_allclose(tf.make_ndarray(response.outputs["y"]), [[2.5], [3.0]])
    for _ in range(100):  # the server ends the request scope just after answering
        if manager.version_states("hp2")[123].state == State.END:
            break
        time.sleep(0.1)
    assert manager.version_states("hp2")[123].state == State.END
