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

from server_helpers import serving, wait_for
from serving.batching.parameters import (BatchingConfigError, BatchingParameters, parse_batching_parameters,
                                         read_batching_parameters)
from serving.batching.scheduler import Batcher
from serving.errors import FailedPrecondition, InputError, InvalidArgument, Unavailable, status_for
from serving.servable.runner import Runner
from serving.servable.signature import ModelCall, Signature


class SlowDoubler:
    """A Runner stand-in: y = 2 x over a [-1, 2] float input; run() waits for `release` when given."""

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

    def call(self, inputs, signature_name="serving_default", output_filter=()) -> ModelCall:
        """A call as Runner.call makes it, from the SignatureDef as the test left it."""
        definition = self.signature_defs["serving_default"]
        signature = Signature.read("serving_default", definition,
                                   {name: info.dtype for name, info in definition.inputs.items()}, checks_shapes=True)
        return ModelCall(signature, {name: np.asarray(value) for name, value in inputs.items()},
                         signature.check_output_filter(output_filter))

    def run(self, call: ModelCall):
        self.calls.append(call.inputs["x"])
        self.started.set()
        if self.release is not None:
            self.release.wait(10)
        return {"y": call.inputs["x"] * 2}


@pytest.fixture(scope="module")
def loop():
    """An event loop on a thread of its own: callers await the batcher on it, as on the server's loop."""
    loop = asyncio.new_event_loop()
    thread = threading.Thread(target=loop.run_forever, daemon=True)
    thread.start()
    yield loop
    loop.call_soon_threadsafe(loop.stop)
    thread.join()
    loop.close()


def batched(loop, batcher, model, inputs, output_filter=()) -> futures.Future:
    """One call through the batcher (the call is checked first, here, as the servicer checks it)."""
    return asyncio.run_coroutine_threadsafe(batcher.run(model, model.call(inputs, output_filter=output_filter)), loop)


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


def test_concurrent_requests_are_merged_and_split_back(exported_model, loop):
    runner = Runner.load(exported_model.version_dir)
    rows = exported_model.val_x[:24]
    expected = [runner.predict({exported_model.input_name: row[None]}) for row in rows]
    # Batches close when full, not on a timer, so the test does not depend on how fast the machine is.
    batcher = Batcher(BatchingParameters(max_batch_size=8, batch_timeout_micros=60_000_000, num_batch_threads=1))
    try:
        with futures.ThreadPoolExecutor(len(rows)) as pool:
            answers = list(pool.map(lambda row: batched(loop, batcher, runner, {exported_model.input_name: row[None]})
                                    .result(30), rows))
    finally:
        batcher.stop()
    for got, want in zip(answers, expected):
        assert got.keys() == want.keys()
        for name in want:
            assert got[name].shape == want[name].shape
            np.testing.assert_allclose(got[name], want[name], rtol=1e-5, atol=1e-6)
    assert batcher.batch_sizes() == {8: 3}


def test_batch_is_padded_to_an_allowed_size_and_trimmed(loop):
    model = SlowDoubler()
    batcher = Batcher(BatchingParameters(max_batch_size=8, allowed_batch_sizes=(4, 8), num_batch_threads=1))
    x = np.arange(6, dtype=np.float32).reshape(3, 2)
    try:
        np.testing.assert_array_equal(batched(loop, batcher, model, {"x": x}).result(10)["y"], x * 2)
    finally:
        batcher.stop()
    assert model.calls[0].shape == (4, 2)
    np.testing.assert_array_equal(model.calls[0][3], x[0])  # padding repeats the first row


def test_request_larger_than_max_batch_size_is_invalid_argument(loop):
    batcher = Batcher(BatchingParameters(max_batch_size=2, num_batch_threads=1))
    with pytest.raises(InvalidArgument, match="Task size 3 is larger than maximum input batch size 2"):
        batched(loop, batcher, SlowDoubler(), {"x": np.zeros((3, 2), np.float32)}).result(10)
    batcher.stop()


def test_full_queue_is_unavailable(loop):
    release = threading.Event()
    model = SlowDoubler(release)
    batcher = Batcher(BatchingParameters(max_batch_size=1, max_enqueued_batches=1, num_batch_threads=1))
    x = np.ones((1, 2), np.float32)
    running = batched(loop, batcher, model, {"x": x})
    assert model.started.wait(10)  # the one worker is busy with the first request
    # Of two more, the first fills the one batch the queue may hold; the second is refused.
    more = [batched(loop, batcher, model, {"x": x}) for _ in range(2)]
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

    def run(self, call):
        with self.lock:
            self.running += 1
            self.most_at_once = max(self.most_at_once, self.running)
            self.threads.append(threading.current_thread().name)
        threading.Event().wait(0.05)
        with self.lock:
            self.running -= 1
        return {"y": call.inputs["x"] * 2}


def test_batches_run_on_the_batch_threads_at_most_num_batch_threads_at_once(loop):
    model = CountingDoubler()
    batcher = Batcher(BatchingParameters(max_batch_size=1, num_batch_threads=2, max_enqueued_batches=16))
    x = np.ones((1, 2), np.float32)
    try:
        answers = [batched(loop, batcher, model, {"x": x * i}) for i in range(6)]
        results = [answer.result(10)["y"] for answer in answers]
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
        first = asyncio.ensure_future(batcher.run(model, model.call({"x": np.full((1, 2), -1, np.float32)})))
        while not model.started.is_set():  # the one batch thread is busy with the first request
            await asyncio.sleep(0.01)
        waiting = [asyncio.ensure_future(batcher.run(model, model.call({"x": np.full((1, 2), i, np.float32)})))
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


def test_unbatchable_signature_runs_directly(loop):
    model = SlowDoubler()
    model.signature_defs["serving_default"].inputs["x"].tensor_shape.dim[0].size = 3  # no batch dimension
    batcher = Batcher(BatchingParameters(max_batch_size=1, num_batch_threads=1))
    x = np.ones((3, 2), np.float32)  # more rows than max_batch_size, but never queued
    np.testing.assert_array_equal(batched(loop, batcher, model, {"x": x}).result(10)["y"], x * 2)
    assert batcher.batch_sizes() == {}


def test_retired_queue_drains_first(loop):
    release = threading.Event()
    model = SlowDoubler(release)
    batcher = Batcher(BatchingParameters(max_batch_size=4, batch_timeout_micros=10_000_000, num_batch_threads=1))
    x = np.ones((1, 2), np.float32)
    pending = batched(loop, batcher, model, {"x": x})  # would wait for the 10 s timeout
    wait_for(lambda: batcher.queue_count() == 1)
    batcher.retire([])  # the version was unloaded: what is queued still runs, now
    release.set()
    np.testing.assert_array_equal(pending.result(5)["y"], x * 2)
    batcher.stop()


def test_grpc_predict_requests_are_batched_in_the_server(exported_model):
    """Waiting requests hold no worker thread: a batch merges more requests than the server has threads."""
    import tensorflow as tf
    from tensorflow_serving.apis import predict_pb2, prediction_service_pb2_grpc

    from serving.manager import model_config
    from serving.manager.model_manager import ModelManager

    manager = ModelManager(file_system_poll_wait_seconds=0)
    manager.reload_config(model_config.single_model_config(exported_model.model_name, str(exported_model.base_path)))
    # Batches close when full (8 rows), not on a timer: 3 batches of 8, from 2 worker threads.
    batcher = Batcher(BatchingParameters(max_batch_size=8, batch_timeout_micros=60_000_000, num_batch_threads=1))
    rows = exported_model.val_x[:24]
    runner = Runner.load(exported_model.version_dir)

    def predict(row):
        request = predict_pb2.PredictRequest()
        request.model_spec.name = exported_model.model_name
        request.inputs[exported_model.input_name].CopyFrom(tf.make_tensor_proto(row[None]))
        response = stub.Predict(request, timeout=30)
        return {name: tf.make_ndarray(proto) for name, proto in response.outputs.items()}

    try:
        with serving(manager, batcher=batcher, grpc_max_threads=2) as server, \
                grpc.insecure_channel(server.grpc_address) as channel:
            stub = prediction_service_pb2_grpc.PredictionServiceStub(channel)
            with futures.ThreadPoolExecutor(len(rows)) as pool:
                answers = list(pool.map(predict, rows))
    finally:
        batcher.stop()
    for row, got in zip(rows, answers):
        want = runner.predict({exported_model.input_name: row[None]})
        for name in want:
            np.testing.assert_allclose(got[name], want[name], rtol=1e-5, atol=1e-6)
    assert batcher.batch_sizes() == {8: 3}  # each batch more requests than the 2 worker threads


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

    import tensorflow as tf
    from tensorflow_serving.apis import get_model_status_pb2, predict_pb2, prediction_service_pb2_grpc

    from serving.manager import model_config
    from serving.manager.model_manager import ModelManager

    source = copy_testdata("saved_model_half_plus_two_2_versions", tmp_path / "source")
    base = tmp_path / "hp2"
    base.mkdir()
    shutil.copytree(source / "00000123", base / "00000123")
    manager = ModelManager(file_system_poll_wait_seconds=0)
    manager.reload_config(model_config.single_model_config("hp2", str(base)))
    batcher = Batcher(BatchingParameters(max_batch_size=8, batch_timeout_micros=6_000_000, num_batch_threads=1))
    State = get_model_status_pb2.ModelVersionStatus
    request = predict_pb2.PredictRequest(model_spec={"name": "hp2"})
    request.inputs["x"].CopyFrom(tf.make_tensor_proto(np.array([[1.0], [2.0]], np.float32)))
    try:
        with serving(manager, batcher=batcher) as server, grpc.insecure_channel(server.grpc_address) as channel:
            queued = prediction_service_pb2_grpc.PredictionServiceStub(channel).Predict.future(request, timeout=60)
            wait_for(lambda: batcher.queue_count() == 1)  # the request waits in its queue for the batch timeout
            shutil.copytree(source / "00000124", base / "00000124")
            manager.poll_file_system()  # loads 124, unloads 123 while the queued request holds it
            assert not queued.done()
            assert manager.version_states("hp2")[123].state == State.UNLOADING
            response = queued.result()
            # the server ends the request scope just after answering
            wait_for(lambda: manager.version_states("hp2")[123].state == State.END)
    finally:
        batcher.stop()
    assert response.model_spec.version.value == 123
    np.testing.assert_allclose(tf.make_ndarray(response.outputs["y"]), [[2.5], [3.0]])


class Checker(SlowDoubler):
    """y = 2 x over a [-1, -1] input (any row length); a batch holding a negative value fails as a whole."""

    def __init__(self, release: threading.Event | None = None) -> None:
        super().__init__(release)
        self.signature_defs["serving_default"].inputs["x"].tensor_shape.dim[1].size = -1

    def run(self, call):
        if (call.inputs["x"] < 0).any():
            self.calls.append(call.inputs["x"])
            raise InputError("negative values are not allowed")
        return super().run(call)


def test_a_bad_request_merged_into_a_batch_fails_alone(loop):
    model = Checker()
    batcher = Batcher(BatchingParameters(max_batch_size=8, batch_timeout_micros=60_000_000, num_batch_threads=1))
    rows = [np.full((1, 2), -1.0 if i == 5 else i, np.float32) for i in range(8)]  # the batch closes when full
    try:
        answers = [batched(loop, batcher, model, {"x": row}) for row in rows]
        for i, answer in enumerate(answers):
            if i == 5:
                with pytest.raises(InputError, match="negative"):
                    answer.result(10)
            else:
                np.testing.assert_array_equal(answer.result(10)["y"], rows[i] * 2)
    finally:
        batcher.stop()
    # All eight were merged; then halves: [0-3] ok, [4-7] failed; [4, 5] failed, [4] ok, [5] failed; [6, 7] ok.
    assert [call.shape[0] for call in model.calls] == [8, 4, 4, 2, 1, 1, 2]


def test_a_batch_where_every_request_fails_is_rerun_a_bounded_number_of_times(loop):
    """Each request gets its own answer (split down to single requests), in at most 2n - 1 runs for n requests."""
    model = Checker()
    batcher = Batcher(BatchingParameters(max_batch_size=16, batch_timeout_micros=60_000_000, num_batch_threads=1))
    try:
        answers = [batched(loop, batcher, model, {"x": np.full((1, 2), -1.0, np.float32)}) for _ in range(16)]
        for answer in answers:
            with pytest.raises(InputError, match="negative"):
                answer.result(10)
    finally:
        batcher.stop()
    assert len(model.calls) == 2 * 16 - 1  # the merged batch, then halves down to each request alone


def test_queues_are_keyed_by_checked_values_only(tfserving_testdata, loop):
    runner = Runner.load(tfserving_testdata / "saved_model_half_plus_two_cpu" / "00000123")
    batcher = Batcher(BatchingParameters(max_batch_size=8, num_batch_threads=1))
    x = np.ones((1, 1), np.float32)
    try:
        for i in range(50):  # made-up output names: refused when the call is checked, before the batcher
            with pytest.raises(InputError):  # the Runner's words
                batched(loop, batcher, runner, {"x": x}, output_filter=[f"made_up_{i}" * 100])
        for width in range(2, 12):  # shapes this TF1 signature's [-1, 1] does not describe: unbatched, no queue
            batched(loop, batcher, runner, {"x": np.ones((1, width), np.float32)}).result(10)
        with pytest.raises(InputError):
            batched(loop, batcher, runner, {"x": np.ones((1, 1), np.float64)})
        assert batcher.queue_count() == 0 and batcher.batch_sizes() == {}
        np.testing.assert_allclose(batched(loop, batcher, runner, {"x": x}, output_filter=["y"]).result(10)["y"],
                                   [[2.5]])
        np.testing.assert_allclose(batched(loop, batcher, runner, {"x": x * 2}).result(10)["y"], [[3.0]])
        assert batcher.queue_count() == 1  # the filter ["y"] and no filter fetch the same outputs
    finally:
        batcher.stop()


def test_queue_count_is_bounded_per_version(caplog, loop):
    release = threading.Event()
    model = Checker(release)
    batcher = Batcher(BatchingParameters(max_batch_size=8, num_batch_threads=4), max_queues=3)
    try:
        for width in range(1, 10):  # idle queues make room for new shapes
            release.set()
            np.testing.assert_array_equal(batched(loop, batcher, model, {"x": np.ones((1, width), np.float32)})
                                          .result(10)["y"], np.full((1, width), 2.0))
            assert batcher.queue_count() <= 3
        release.clear()
        with caplog.at_level(logging.WARNING, logger="serving.batching.scheduler"):
            busy = [batched(loop, batcher, model, {"x": np.ones((1, width), np.float32)}) for width in (1, 2, 3)]
            wait_for(lambda: len(model.calls) >= 12)  # the three queues' batches are running, held by `release`
            extra = batched(loop, batcher, model, {"x": np.ones((1, 4), np.float32)})  # runs unbatched
            wait_for(lambda: len(model.calls) >= 13)
            release.set()
            assert [future.result(10)["y"].shape for future in busy + [extra]] == [(1, 1), (1, 2), (1, 3), (1, 4)]
        assert batcher.queue_count() == 3
        assert "run unbatched" in caplog.text
    finally:
        release.set()
        batcher.stop()


def test_scalar_and_unequal_inputs_are_refused_as_tf_serving_does(tfserving_testdata, loop):
    runner = Runner.load(tfserving_testdata / "saved_model_half_plus_two_cpu" / "00000123")
    batcher = Batcher(BatchingParameters(max_batch_size=8, num_batch_threads=1))
    with pytest.raises(InvalidArgument, match="Batching Run\\(\\) input tensors must have at least one dimension"):
        batched(loop, batcher, runner, {"x": np.float32(1.0)}).result(10)  # unbatched, this TF1 graph answers 2.5
    model = SlowDoubler()
    model.signature_defs["serving_default"].inputs["z"].CopyFrom(model.signature_defs["serving_default"].inputs["x"])
    with pytest.raises(InvalidArgument, match="must have equal 0th-dimension size"):
        batched(loop, batcher, model, {"x": np.ones((1, 2), np.float32), "z": np.ones((2, 2), np.float32)}).result(10)
    batcher.stop()


def test_a_batched_output_without_batch_dimension_is_failed_precondition(loop):
    class Scalar(SlowDoubler):
        def run(self, call):
            return {"y": np.float32(1.0)}

    batcher = Batcher(BatchingParameters(max_batch_size=8, num_batch_threads=1))
    with pytest.raises(FailedPrecondition, match="Batched output tensor has 0 dimensions"):
        batched(loop, batcher, Scalar(), {"x": np.ones((1, 2), np.float32)}).result(10)
    batcher.stop()


def test_a_malformed_classify_is_answered_before_it_can_fail_a_batch(copy_testdata, tmp_path, caplog):
    """Issue 12 point 6: with batching on, one bad tf.Example in a merged batch used to fail all 16 requests; then
    the failed batch was split until the bad one was alone (issue 31 #1: good throughput 0.61x of clean with 11%
    of such requests). Now the signature's parser spec answers it before it joins a batch, in the op's words."""
    from tensorflow_serving.apis import classification_pb2, prediction_service_pb2_grpc

    from serving.manager import model_config
    from serving.manager.model_manager import ModelManager

    base = copy_testdata("saved_model_half_plus_two_tf2_cpu", tmp_path / "tf2")
    manager = ModelManager(file_system_poll_wait_seconds=0)
    manager.reload_config(model_config.single_model_config("tf2", str(base)))
    # The batch closes when the 15 good ones are in it (no timer): the bad one would be merged if it got there.
    batcher = Batcher(BatchingParameters(max_batch_size=15, batch_timeout_micros=60_000_000, num_batch_threads=1))

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
            return error.code(), error.details()

    try:
        with serving(manager, batcher=batcher, grpc_max_threads=16) as server, \
                grpc.insecure_channel(server.grpc_address) as channel, \
                caplog.at_level(logging.DEBUG, "serving.batching.scheduler"):
            stub = prediction_service_pb2_grpc.PredictionServiceStub(channel)
            with futures.ThreadPoolExecutor(16) as pool:
                answers = list(pool.map(classify, range(16)))
    finally:
        batcher.stop()
        manager.stop()
    assert "requests failed" not in caplog.text and batcher.batch_sizes() == {15: 1}
    assert answers[7] == (grpc.StatusCode.INVALID_ARGUMENT, "signature 'classify_x_to_y': Name: <unknown>, Key: x, "
                                                            "Index: 0.  Data types don't match. Data type: string but "
                                                            "expected type: float")
    assert [answers[i] for i in range(16) if i != 7] == pytest.approx([0.5 * i + 2 for i in range(16) if i != 7])


def test_a_request_whose_caller_gave_up_is_dropped_from_its_batch(loop):
    """A caller cancelled (or past its deadline, gRPC's or --rest_api_timeout_in_ms) while its request waits for
    a batch: the batch runs without its rows."""
    model = SlowDoubler()
    batcher = Batcher(BatchingParameters(max_batch_size=2, batch_timeout_micros=60_000_000, num_batch_threads=1))
    try:
        gone = batched(loop, batcher, model, {"x": np.full((1, 2), 7.0, np.float32)})
        wait_for(lambda: batcher.queue_count() == 1)
        gone.cancel()
        wait_for(gone.cancelled)
        kept = batched(loop, batcher, model, {"x": np.full((1, 2), 3.0, np.float32)})  # fills the batch: it runs
        np.testing.assert_array_equal(kept.result(10)["y"], np.full((1, 2), 6.0))
    finally:
        batcher.stop()
    assert [call.tolist() for call in model.calls] == [[[3.0, 3.0]]]
