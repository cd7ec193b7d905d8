"""Server-side batching: merged requests get exactly their own rows; TF Serving's limits and errors."""

from __future__ import annotations

import asyncio
import logging
import threading
from concurrent import futures

import grpc
import numpy as np
import pytest
from tensorflow.core.framework import types_pb2
from tensorflow.core.protobuf import meta_graph_pb2

from serving.servable.runner import Runner
from serving.batching.scheduler import Batcher
from serving.batching.parameters import (BatchingConfigError, BatchingParameters, parse_batching_parameters,
                                         read_batching_parameters)
from serving.errors import FailedPrecondition, InputError, InvalidArgument, Unavailable, status_for


class SlowDoubler:
    """A Runner stand-in: y = 2 x over a [-1, 2] float input; predict() waits for `release` when given."""

    model_name, version = "slow", 1

    def __init__(self, release: threading.Event | None = None) -> None:
        signature = meta_graph_pb2.SignatureDef(method_name="tensorflow/serving/predict")
        signature.inputs["x"].dtype = types_pb2.DT_FLOAT
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


def test_batches_run_on_the_batch_threads_at_most_num_batch_threads_at_once():
    model = CountingDoubler()
    batcher = Batcher(BatchingParameters(max_batch_size=1, num_batch_threads=2, max_enqueued_batches=16))
    x = np.ones((1, 2), np.float32)
    try:
        with futures.ThreadPoolExecutor(6, thread_name_prefix="caller") as pool:
            results = list(pool.map(lambda i: batcher.predict(model, {"x": x * i})["y"], range(6)))
    finally:
        batcher.stop()
    for i, y in enumerate(results):
        np.testing.assert_array_equal(y, x * i * 2)
    assert model.most_at_once == 2 and len(model.threads) == 6
    assert set(model.threads) == {"batch_0", "batch_1"}


def test_waiting_on_an_event_loop_holds_no_thread():
    """64 requests wait on one event loop thread and merge into batches; each gets exactly its own rows."""
    release = threading.Event()
    model = SlowDoubler(release)
    batcher = Batcher(BatchingParameters(max_batch_size=64, num_batch_threads=1, max_enqueued_batches=4))

    async def many():
        first = asyncio.ensure_future(batcher.predict_async(model, {"x": np.full((1, 2), -1, np.float32)}))
        while not model.started.is_set():  # the one batch thread is busy with the first request
            await asyncio.sleep(0.01)
        waiting = [asyncio.ensure_future(batcher.predict_async(model, {"x": np.full((1, 2), i, np.float32)}))
                   for i in range(64)]
        await asyncio.sleep(0.05)
        release.set()
        return await first, await asyncio.gather(*waiting)

    try:
        first, answers = asyncio.run(many())
    finally:
        batcher.stop()
    np.testing.assert_array_equal(first["y"], np.full((1, 2), -2, np.float32))
    for i, answer in enumerate(answers):
        np.testing.assert_array_equal(answer["y"], np.full((1, 2), 2 * i, np.float32))
    assert [call.shape[0] for call in model.calls] == [1, 64]  # all 64 merged while the first ran


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
    """Waiting requests hold no worker thread: a batch merges more requests than the server has threads."""
    import tensorflow as tf
    from tensorflow_serving.apis import predict_pb2, prediction_service_pb2_grpc

    from serving.manager import model_config
    from serving.manager.model_manager import ModelManager
    from serving.server import create_server

    manager = ModelManager(file_system_poll_wait_seconds=0)
    manager.reload_config(model_config.single_model_config(exported_model.model_name, str(exported_model.base_path)))
    batcher = Batcher(BatchingParameters(max_batch_size=16, batch_timeout_micros=200_000, num_batch_threads=1))
    server, port, _ = create_server("127.0.0.1:0", manager, max_threads=2, batcher=batcher)
    rows = exported_model.val_x[:24]
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
    assert max(batcher.batch_sizes()) > 2, batcher.batch_sizes()  # more rows than the 2 worker threads


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

    from serving.manager import model_config
    from serving.manager.model_manager import ModelManager
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


class Checker(SlowDoubler):
    """y = 2 x over a [-1, -1] input (any row length); a batch holding a negative value fails as a whole."""

    def __init__(self, release: threading.Event | None = None) -> None:
        super().__init__(release)
        self.signature_defs["serving_default"].inputs["x"].tensor_shape.dim[1].size = -1

    def predict(self, inputs, signature_name="serving_default", output_filter=()):
        if (inputs["x"] < 0).any():
            self.calls.append(inputs["x"])
            raise InputError("negative values are not allowed")
        return super().predict(inputs, signature_name, output_filter)


def test_a_bad_request_merged_into_a_batch_fails_alone():
    model = Checker()
    batcher = Batcher(BatchingParameters(max_batch_size=8, batch_timeout_micros=2_000_000, num_batch_threads=1))
    rows = [np.full((1, 2), -1.0 if i == 5 else i, np.float32) for i in range(8)]
    try:
        with futures.ThreadPoolExecutor(len(rows)) as pool:
            answers = [pool.submit(batcher.predict, model, {"x": row}) for row in rows]
            for i, answer in enumerate(answers):
                if i == 5:
                    with pytest.raises(InputError, match="negative"):
                        answer.result(10)
                else:
                    np.testing.assert_array_equal(answer.result(10)["y"], rows[i] * 2)
    finally:
        batcher.stop()
    assert model.calls[0].shape == (8, 2)  # all eight were merged, then run one at a time
    assert sorted(call.shape[0] for call in model.calls[1:]) == [1] * 8


def test_queues_are_keyed_by_checked_values_only(tfserving_testdata):
    runner = Runner.load(tfserving_testdata / "saved_model_half_plus_two_cpu" / "00000123")
    batcher = Batcher(BatchingParameters(max_batch_size=8, num_batch_threads=1))
    x = np.ones((1, 1), np.float32)
    try:
        for i in range(50):  # made-up output names: refused by the Runner, no queue
            with pytest.raises(InputError):  # the Runner's words
                batcher.predict(runner, {"x": x}, output_filter=[f"made_up_{i}" * 100])
        for width in range(2, 12):  # shapes the signature [-1, 1] does not take: run unbatched, no queue
            batcher.predict(runner, {"x": np.ones((1, width), np.float32)})
        with pytest.raises(InputError):
            batcher.predict(runner, {"x": np.ones((1, 1), np.float64)})
        assert batcher.queue_count() == 0 and batcher.batch_sizes() == {}
        np.testing.assert_allclose(batcher.predict(runner, {"x": x}, output_filter=["y"])["y"], [[2.5]])
        np.testing.assert_allclose(batcher.predict(runner, {"x": x * 2})["y"], [[3.0]])
        assert batcher.queue_count() == 1  # the filter ["y"] and no filter fetch the same outputs
    finally:
        batcher.stop()


def test_queue_count_is_bounded_per_version(caplog):
    release = threading.Event()
    model = Checker(release)
    batcher = Batcher(BatchingParameters(max_batch_size=8, num_batch_threads=4), max_queues=3)
    try:
        for width in range(1, 10):  # idle queues make room for new shapes
            release.set()
            np.testing.assert_array_equal(batcher.predict(model, {"x": np.ones((1, width), np.float32)})["y"],
                                          np.full((1, width), 2.0))
            assert batcher.queue_count() <= 3
        release.clear()
        with futures.ThreadPoolExecutor(4) as pool, caplog.at_level(logging.WARNING, logger="serving.batching.scheduler"):
            busy = [pool.submit(batcher.predict, model, {"x": np.ones((1, width), np.float32)}) for width in (1, 2, 3)]
            while len(model.calls) < 12:  # the three queues' batches are running, held by `release`
                threading.Event().wait(0.01)
            extra = pool.submit(batcher.predict, model, {"x": np.ones((1, 4), np.float32)})  # runs unbatched
            while len(model.calls) < 13:
                threading.Event().wait(0.01)
            release.set()
            assert [future.result(10)["y"].shape for future in busy + [extra]] == [(1, 1), (1, 2), (1, 3), (1, 4)]
        assert batcher.queue_count() == 3
        assert "run unbatched" in caplog.text
    finally:
        release.set()
        batcher.stop()


def test_scalar_and_unequal_inputs_are_refused_as_tf_serving_does(tfserving_testdata):
    runner = Runner.load(tfserving_testdata / "saved_model_half_plus_two_cpu" / "00000123")
    batcher = Batcher(BatchingParameters(max_batch_size=8, num_batch_threads=1))
    with pytest.raises(InvalidArgument, match="Batching Run\\(\\) input tensors must have at least one dimension"):
        batcher.predict(runner, {"x": np.float32(1.0)})  # unbatched, this TF1 graph would answer 2.5
    model = SlowDoubler()
    model.signature_defs["serving_default"].inputs["z"].CopyFrom(model.signature_defs["serving_default"].inputs["x"])
    with pytest.raises(InvalidArgument, match="must have equal 0th-dimension size"):
        batcher.predict(model, {"x": np.ones((1, 2), np.float32), "z": np.ones((2, 2), np.float32)})
    batcher.stop()


def test_a_batched_output_without_batch_dimension_is_failed_precondition():
    class Scalar(SlowDoubler):
        def predict(self, inputs, signature_name="serving_default", output_filter=()):
            return {"y": np.float32(1.0)}

    batcher = Batcher(BatchingParameters(max_batch_size=8, num_batch_threads=1))
    with pytest.raises(FailedPrecondition, match="Batched output tensor has 0 dimensions"):
        batcher.predict(Scalar(), {"x": np.ones((1, 2), np.float32)})
    batcher.stop()


def test_a_malformed_classify_merged_with_good_ones_fails_alone(copy_testdata, tmp_path, caplog):
    """Issue 12 point 6: with batching on, one bad tf.Example in a merged batch used to fail all 16 requests."""
    from tensorflow_serving.apis import classification_pb2, prediction_service_pb2_grpc

    from serving.manager import model_config
    from serving.manager.model_manager import ModelManager
    from serving.server import create_server

    base = copy_testdata("saved_model_half_plus_two_tf2_cpu", tmp_path / "tf2")
    manager = ModelManager(file_system_poll_wait_seconds=0)
    manager.reload_config(model_config.single_model_config("tf2", str(base)))
    batcher = Batcher(BatchingParameters(max_batch_size=16, batch_timeout_micros=1_000_000, num_batch_threads=1))
    server, port, _ = create_server("127.0.0.1:0", manager, max_threads=16, batcher=batcher)

    def classify(i):
        request = classification_pb2.ClassificationRequest(model_spec={"name": "tf2",
                                                                       "signature_name": "classify_x_to_y"})
        feature = request.input.example_list.examples.add().features.feature["x"]
        if i == 7:
            feature.bytes_list.value.append(b"not a float")  # the model's ParseExample rejects it
        else:
            feature.float_list.value.append(float(i))
        try:
            return stub.Classify(request, timeout=30).result.classifications[0].classes[0].score
        except grpc.RpcError as error:
            return error.code()

    try:
        with grpc.insecure_channel(f"127.0.0.1:{port}") as channel, caplog.at_level(logging.DEBUG, "serving.batching.scheduler"):
            stub = prediction_service_pb2_grpc.PredictionServiceStub(channel)
            with futures.ThreadPoolExecutor(16) as pool:
                answers = list(pool.map(classify, range(16)))
    finally:
        server.stop(0)
        batcher.stop()
        manager.stop()
    assert "requests failed" in caplog.text  # the bad one was merged with good ones
    assert answers[7] == grpc.StatusCode.INVALID_ARGUMENT
    assert [answers[i] for i in range(16) if i != 7] == pytest.approx([0.5 * i + 2 for i in range(16) if i != 7])
