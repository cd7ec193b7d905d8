"""Server-side batching: concurrent requests to one signature are merged into one Runner.predict call.

TF Serving's `--enable_batching` (parameters: serving/batching/parameters.py). Scheduling follows its
SharedBatchScheduler (shared_batch_scheduler.h):

- A request is checked against its signature before it may join a queue (input names and dtypes,
  shapes the signature allows, output_filter names), so queues are keyed only by values the model
  defines: Runner (model version), signature, the set of outputs asked for, and input dtypes and
  trailing shapes. At most max_queues queues per model version (DEFAULT_MAX_QUEUES); at the bound,
  idle queues are dropped, and if none is idle the request runs unbatched, as TF Serving runs a
  request that matches none of its batching queues (batching_session.cc, "Bypassing batcher").
- A request joins its queue's open batch if its rows fit under max_batch_size, else it closes the
  open batch and starts a new one; if max_enqueued_batches are already waiting, it is refused
  UNAVAILABLE. A request of more than max_batch_size rows is INVALID_ARGUMENT.
- num_batch_threads threads, shared by every queue (taken in turn), run the batches: a closed batch
  as soon as a thread is free, the open batch once it is full or its first request has waited
  batch_timeout_micros (0: whenever a thread is free, so batches form under load only and a lone
  request waits for nothing).
- A batch's rows are concatenated along dim 0, padded up to the next allowed_batch_sizes entry by
  repeating the first row, run, and split back: each caller gets exactly its own rows.
- A merged batch that fails (one request's values rejected by the model's ops, say) is run again one
  request at a time, so only the request at fault gets an error.

Waiting costs no thread: a caller on an asyncio event loop (the gRPC and REST front ends) awaits a
future that the batch thread resolves, with one wake-up of its loop per batch; a caller on a thread
(Classify, Regress, warmup) blocks on an event. Either way the caller holds its request scope, so
the Runner of a version unloaded meanwhile stays open until every merged request has its answer,
and its queue drains first.

With batching on, the inputs of a request that matches its signature must have a dim 0 of one size,
as TF Serving's ComputeTensorBatchSize requires (tensorflow_serving/batching/batching_util.h): a
scalar input is INVALID_ARGUMENT "Batching Run() input tensors must have at least one dimension".
Only signatures whose inputs all have a batch dimension (dim 0 of unknown size) are batched; other
requests, and requests that do not fit their signature (which the Runner then refuses in its own
words), go straight to the Runner. Inputs are merged as they are, so requests with equal dtypes and
trailing shapes never need pad_variable_length_inputs; the field is accepted for compatibility.
"""

from __future__ import annotations

import asyncio
import collections
import concurrent.futures
import functools
import logging
import threading
import time
from typing import Any, Callable, Mapping, NamedTuple, Sequence

import numpy as np
import tensorflow as tf
from tensorflow.core.protobuf import meta_graph_pb2

from serving.batching.parameters import BatchingParameters
from serving.errors import FailedPrecondition, InvalidArgument, Unavailable
from serving.servable.runner import DEFAULT_SIGNATURE, Runner

log = logging.getLogger(__name__)

# Batch queues per model version. Each distinct trailing shape of a variable-length input needs a queue
# of its own; idle queues are dropped at the bound, so it only limits shapes in use at the same time.
DEFAULT_MAX_QUEUES = 64
WARNING_INTERVAL_S = 60.0


class _Task:
    """One request in a queue: its inputs, rows, the outputs it wants, and how its caller hears the answer.

    A thread caller waits on `event`; an asyncio caller awaits `future` on `loop`.
    """

    __slots__ = ("inputs", "size", "wanted", "enqueued", "outputs", "error", "event", "loop", "future")

    def __init__(self, inputs: dict[str, np.ndarray], size: int, wanted: Sequence[str]) -> None:
        self.inputs, self.size, self.wanted = inputs, size, list(wanted)
        self.enqueued = time.monotonic()  # for the queue delay: enqueue to the start of its batch's run
        self.outputs: dict[str, np.ndarray] | None = None
        self.error: BaseException | None = None
        self.event: threading.Event | None = None
        self.loop: asyncio.AbstractEventLoop | None = None
        self.future: asyncio.Future | None = None


def _answer_futures(tasks: list[_Task]) -> None:
    """On the callers' event loop: resolves each asyncio caller's future (unless it gave up meanwhile)."""
    for task in tasks:
        if not task.future.done():
            if task.error is not None:
                task.future.set_exception(task.error)
            else:
                task.future.set_result(task.outputs)


def _answer(tasks: list[_Task]) -> None:
    """Wakes the callers of answered tasks: one call into each event loop, one event per thread caller."""
    by_loop: dict[asyncio.AbstractEventLoop, list[_Task]] = {}
    for task in tasks:
        if task.loop is not None:
            by_loop.setdefault(task.loop, []).append(task)
        else:
            task.event.set()
    for loop, waiting in by_loop.items():
        try:
            loop.call_soon_threadsafe(_answer_futures, waiting)
        except RuntimeError:  # the loop was closed: its callers are gone
            pass


class _Queue:
    """One SharedBatchScheduler queue: an open batch (the last) and closed batches; the scheduler's lock guards it."""

    def __init__(self, parameters: BatchingParameters, runner: Runner, signature_name: str,
                 outputs: tuple[str, ...]) -> None:
        self.runner, self.signature_name, self.outputs = runner, signature_name, outputs
        self._parameters = parameters
        self._batches: collections.deque[list[_Task]] = collections.deque([[]])
        self._open_rows = 0
        self._open_since = 0.0
        self.closed = False  # retired: what it holds runs at once, nothing more joins
        self.running = 0  # its batches being run now

    def add(self, task: _Task) -> None:
        """Puts a task in the open batch, or in a new one if its rows do not fit.

        Raises:
            Unavailable: max_enqueued_batches are waiting already.
        """
        limit = self._parameters.max_batch_size
        if self._open_rows + task.size > limit:
            if len(self._batches) >= self._parameters.max_enqueued_batches:
                raise Unavailable("The batch scheduling queue to which this task was submitted is full; "
                                  f"currently {len(self._batches)} batches enqueued and max_enqueued_batches "
                                  f"is {self._parameters.max_enqueued_batches}")
            self._batches.append([])
            self._open_rows = 0
        if not self._batches[-1]:
            self._open_since = task.enqueued
        self._batches[-1].append(task)
        self._open_rows += task.size

    def take(self, now: float) -> list[_Task] | None:
        """A closed batch, or the open one once it is full, timed out or the queue is retired."""
        if len(self._batches) >= 2:
            return self._batches.popleft()
        open_batch = self._batches[0]
        if not open_batch:
            return None
        if (self.closed or self._open_rows >= self._parameters.max_batch_size
                or now >= self._open_since + self._parameters.batch_timeout_micros / 1e6):
            self._batches[0] = []
            self._open_rows = 0
            return open_batch
        return None

    def deadline(self) -> float | None:
        """When the open batch times out, if it is the only one waiting."""
        if len(self._batches) == 1 and self._batches[0]:
            return self._open_since + self._parameters.batch_timeout_micros / 1e6
        return None

    def empty(self) -> bool:
        return len(self._batches) == 1 and not self._batches[0]

    def idle(self) -> bool:
        """Nothing waiting and nothing running: the queue may be dropped."""
        return self.running == 0 and self.empty()


class Batcher:
    """Merges concurrent predict() calls per (Runner, signature, outputs, input dtypes and trailing shapes).

    Args:
        parameters: the resolved BatchingParameters (serving/batching/parameters.py).
        max_queues: batch queues per model version (Runner) at most; see DEFAULT_MAX_QUEUES.
    """

    def __init__(self, parameters: BatchingParameters, max_queues: int = DEFAULT_MAX_QUEUES) -> None:
        self.parameters = parameters
        self.max_queues = max_queues
        self._queues: dict[tuple, _Queue] = {}
        self._retired: list[_Queue] = []  # closed, still holding requests: run before they are dropped
        self._turn = 0  # where the next batch thread starts looking, so every queue gets its turn
        self._lock = threading.Lock()
        self._work = threading.Condition(self._lock)
        self._threads: list[threading.Thread] = []
        self._idle_threads = 0  # batch threads waiting for work: a new request wakes one only if there is one
        self._stopping = False
        self._batch_sizes: collections.Counter[int] = collections.Counter()
        self._listeners: list[Callable[[int, int, Sequence[float]], None]] = []
        self._warned_at: float | None = None
        # (id(runner), signature name) -> (runner, its _Signature); the runner held so its id stays its own.
        self._signatures: dict[tuple[int, str], tuple[Runner, _Signature]] = {}

    def add_listener(self, callback: Callable[[int, int, Sequence[float]], None]) -> None:
        """Calls callback(requests, rows, queue_delays_s) after every merged batch runs (e.g. metrics)."""
        self._listeners.append(callback)

    def predict(self, runner: Runner, inputs: Mapping[str, Any], signature_name: str = DEFAULT_SIGNATURE,
                output_filter: Sequence[str] = ()) -> dict[str, np.ndarray]:
        """Runner.predict, merged with concurrent calls that can share a batch; blocks its thread until answered.

        Raises:
            InvalidArgument: more rows than max_batch_size, a scalar input, or inputs whose dim 0
                sizes differ (and whatever Runner.predict raises).
            Unavailable: max_enqueued_batches are already waiting.
        """
        signature_name = signature_name or DEFAULT_SIGNATURE
        task, plan, arrays = self._task(runner, inputs, signature_name, output_filter)
        if task is not None:
            task.event = threading.Event()
        if task is None or not self._submit(runner, signature_name, task, plan):
            return runner.predict(arrays, signature_name=signature_name, output_filter=output_filter)
        task.event.wait()
        if task.error is not None:
            raise task.error
        return task.outputs

    async def predict_async(self, runner: Runner, inputs: Mapping[str, Any], signature_name: str = DEFAULT_SIGNATURE,
                            output_filter: Sequence[str] = (),
                            executor: concurrent.futures.Executor | None = None) -> dict[str, np.ndarray]:
        """predict() for a caller on an event loop: waiting holds no thread. A request that runs unbatched
        runs on executor (None: the loop's default), never on the loop."""
        signature_name = signature_name or DEFAULT_SIGNATURE
        task, plan, arrays = self._task(runner, inputs, signature_name, output_filter)
        loop = asyncio.get_running_loop()
        if task is not None:
            task.loop, task.future = loop, loop.create_future()
        if task is None or not self._submit(runner, signature_name, task, plan):
            return await loop.run_in_executor(executor, functools.partial(
                runner.predict, arrays, signature_name=signature_name, output_filter=output_filter))
        return await task.future

    def wrap(self, runner: Runner) -> "BatchingRunner":
        """runner, with predict() going through this batcher (for serving/servable/inference.py's functions)."""
        return BatchingRunner(runner, self)

    def batch_sizes(self) -> dict[int, int]:
        """How many merged batches of each size (rows, before padding) have run: {rows: count}."""
        with self._lock:
            return dict(self._batch_sizes)

    def queue_count(self) -> int:
        """Batch queues open now, all model versions together."""
        with self._lock:
            return len(self._queues)

    def retire(self, live_runners: Sequence[Runner]) -> None:
        """Closes the queues of Runners not in live_runners; what they hold still runs, at once (drain, then stop)."""
        live = {id(runner) for runner in live_runners}
        with self._lock:
            for key in [key for key in self._queues if key[0] not in live]:
                queue = self._queues.pop(key)
                queue.closed = True
                if not queue.empty():
                    self._retired.append(queue)
            self._signatures = {key: value for key, value in self._signatures.items() if key[0] in live}
            self._work.notify_all()

    def stop(self, timeout_s: float = 30.0) -> None:
        """Runs what is queued, then stops the batch threads."""
        self.retire([])
        with self._lock:
            self._stopping = True
            self._work.notify_all()
            threads = list(self._threads)
        for thread in threads:
            thread.join(timeout_s)

    def _task(self, runner: Runner, inputs: Mapping[str, Any], signature_name: str,
              output_filter: Sequence[str]) -> tuple[_Task | None, _Plan | None, dict[str, np.ndarray]]:
        """(task, its place in a queue, inputs as arrays) for a request; (None, None, arrays) for one that
        runs unbatched."""
        arrays = {name: np.asarray(value) for name, value in inputs.items()}
        signature = self._signature(runner, signature_name or DEFAULT_SIGNATURE)
        plan = None if signature is None else _plan(signature, arrays, output_filter)
        if plan is None:
            return None, None, arrays
        if plan.size > self.parameters.max_batch_size:
            raise InvalidArgument(f"Task size {plan.size} is larger than maximum input batch size "
                                  f"{self.parameters.max_batch_size}")
        return _Task(arrays, plan.size, list(output_filter) or list(plan.outputs)), plan, arrays

    def _submit(self, runner: Runner, signature_name: str, task: _Task, plan: _Plan) -> bool:
        """Queues a planned task; False at max_queues with none idle (the caller runs it unbatched, as TF
        Serving's batcher bypass)."""
        with self._lock:
            queue = None if self._stopping else self._queue(runner, signature_name, plan.outputs, plan.inputs_key)
            if queue is None:
                return False
            queue.add(task)
            self._start_threads()
            if self._idle_threads:
                self._work.notify()
            return True

    def _start_threads(self) -> None:
        """Starts the num_batch_threads batch threads on first use; caller holds _lock."""
        if not self._threads:
            for index in range(self.parameters.num_batch_threads):
                thread = threading.Thread(target=self._batch_thread, name=f"batch_{index}", daemon=True)
                self._threads.append(thread)
                thread.start()

    def _batch_thread(self) -> None:
        """A batch thread: takes the next ready batch of any queue, runs it, answers its callers."""
        while True:
            with self._lock:
                while True:
                    found = self._next_batch()
                    if found is not None:
                        break
                    if self._stopping:
                        return
                    self._idle_threads += 1
                    self._work.wait(self._wait_s())
                    self._idle_threads -= 1
            queue, batch = found
            try:
                self._run(queue, batch)
            finally:
                with self._lock:
                    queue.running -= 1

    def _next_batch(self) -> tuple[_Queue, list[_Task]] | None:
        """The next ready batch, taking queues in turn (retired ones first); caller holds _lock."""
        now = time.monotonic()
        for queue in list(self._retired):
            batch = queue.take(now)
            if queue.empty():
                self._retired.remove(queue)
            if batch:
                queue.running += 1
                return queue, batch
        queues = list(self._queues.values())
        for offset in range(len(queues)):
            queue = queues[(self._turn + offset) % len(queues)]
            batch = queue.take(now)
            if batch:
                self._turn = (self._turn + offset + 1) % len(queues)
                queue.running += 1
                return queue, batch
        return None

    def _wait_s(self) -> float | None:
        """How long a batch thread may sleep: until the earliest open batch times out; caller holds _lock."""
        deadlines = [deadline for queue in self._queues.values() if (deadline := queue.deadline()) is not None]
        return max(min(deadlines) - time.monotonic(), 0.0) if deadlines else None

    def _run(self, queue: _Queue, batch: list[_Task]) -> None:
        """Runs one batch; each task gets its rows or an error (a failed merged batch is rerun one task at a time)."""
        started = time.monotonic()
        try:
            answers = run_tasks(queue, batch, self.parameters.allowed_batch_sizes)
        except Exception as error:  # noqa: BLE001 - every waiting caller must get an answer
            if len(batch) == 1:
                batch[0].error = error
            else:
                log.debug("a batch of %d requests failed (%s); running them one at a time", len(batch), error)
                for task in batch:
                    try:
                        task.outputs = run_tasks(queue, [task], self.parameters.allowed_batch_sizes)[0]
                    except Exception as own_error:  # noqa: BLE001
                        task.error = own_error
        else:
            for task, outputs in zip(batch, answers):
                task.outputs = outputs
            self._record(len(batch), sum(task.size for task in batch), [started - task.enqueued for task in batch])
        _answer(batch)

    def _signature(self, runner: Runner, name: str) -> _Signature | None:
        """The runner's signature `name`, read once per version; None if it has none of that name."""
        found = self._signatures.get((id(runner), name))
        if found is not None:
            return found[1]
        signature = runner.signature_defs.get(name)
        if signature is None:
            return None
        with self._lock:
            self._signatures[(id(runner), name)] = (runner, _Signature.of(signature))
        return self._signatures[(id(runner), name)][1]

    def _queue(self, runner: Runner, signature_name: str, outputs: tuple[str, ...], inputs_key: tuple) -> _Queue | None:
        """The queue for a checked request, made if needed; None (run it unbatched) at max_queues; caller holds _lock."""
        key = (id(runner), signature_name, outputs, inputs_key)
        queue = self._queues.get(key)
        if queue is not None:
            return queue
        mine = [other for other in self._queues if other[0] == key[0]]
        if len(mine) >= self.max_queues:
            idle = [other for other in mine if self._queues[other].idle()]
            for other in idle:
                del self._queues[other]
            if len(mine) - len(idle) >= self.max_queues:
                self._warn_full(runner)
                return None
        queue = self._queues[key] = _Queue(self.parameters, runner, signature_name, outputs)
        return queue

    def _warn_full(self, runner: Runner) -> None:
        """Logs, at most once a minute, that requests run unbatched because max_queues are busy; caller holds _lock."""
        now = time.monotonic()
        if self._warned_at is not None and now - self._warned_at < WARNING_INTERVAL_S:
            return
        self._warned_at = now
        log.warning("model %s version %s has %d batch queues in use (the most per version); requests that need "
                    "another one run unbatched (warned at most every %.0f s)", getattr(runner, "model_name", "?"),
                    getattr(runner, "version", "?"), self.max_queues, WARNING_INTERVAL_S)

    def _record(self, requests: int, rows: int, queue_delays_s: Sequence[float] = ()) -> None:
        with self._lock:
            self._batch_sizes[rows] += 1
        if requests > 1:
            log.debug("ran a batch of %d requests, %d rows", requests, rows)
        for listener in self._listeners:
            listener(requests, rows, queue_delays_s)


def run_tasks(queue: _Queue, tasks: list[_Task], allowed_batch_sizes: Sequence[int]) -> list[dict[str, np.ndarray]]:
    """Merges, pads, runs and splits tasks; each task's outputs are the ones it asked for, in its order.

    Raises:
        FailedPrecondition: an output has no dim 0 of the batch's size (TF Serving's SplitOutputTensors
            checks and words, batching_session.cc); and whatever Runner.predict raises.
    """
    rows = sum(task.size for task in tasks)
    padded = _padded_size(rows, allowed_batch_sizes)
    inputs = {name: _concatenate([task.inputs[name] for task in tasks], padded) for name in tasks[0].inputs}
    outputs = queue.runner.predict(inputs, signature_name=queue.signature_name, output_filter=queue.outputs)
    for array in outputs.values():
        if np.ndim(array) == 0:
            raise FailedPrecondition("Batched output tensor has 0 dimensions")
        if np.shape(array)[0] != padded:
            raise FailedPrecondition("Batched output tensor's 0th dimension does not equal the sum of the "
                                     "0th dimension sizes of the input tensors")
    answers, start = [], 0
    for task in tasks:
        answers.append({name: outputs[name][start:start + task.size] for name in task.wanted})
        start += task.size
    return answers


def _padded_size(rows: int, allowed_batch_sizes: Sequence[int]) -> int:
    return next((size for size in allowed_batch_sizes if size >= rows), rows)


def _concatenate(arrays: list[np.ndarray], padded_rows: int) -> np.ndarray:
    merged = np.concatenate(arrays, axis=0) if len(arrays) > 1 else arrays[0]
    missing = padded_rows - merged.shape[0]
    if missing > 0:  # TF Serving pads with copies of the first row; the extra outputs are dropped
        merged = np.concatenate([merged, np.repeat(merged[:1], missing, axis=0)], axis=0)
    return merged


class _Plan(NamedTuple):
    """A checked request's place in a queue."""

    size: int  # its rows
    outputs: tuple[str, ...]  # what its batch fetches: the signature's outputs it asked for, sorted
    inputs_key: tuple  # (name, dtype, trailing shape) of each input, by name


class _Signature(NamedTuple):
    """What _plan needs of a SignatureDef, as plain Python (reading the proto costs ~10 us a request)."""

    inputs: dict[str, tuple[str, tuple[int, ...] | None]]  # name -> (dtype name, dims; None: unknown rank)
    outputs: tuple[str, ...]  # sorted
    batched: bool  # every input has a dim 0 of unknown size

    @classmethod
    def of(cls, signature: meta_graph_pb2.SignatureDef) -> "_Signature":
        inputs = {name: (_tf_name(info.dtype), None if info.tensor_shape.unknown_rank
                         else tuple(dim.size for dim in info.tensor_shape.dim))
                  for name, info in signature.inputs.items()}
        batched = all(dims and dims[0] == -1 for _, dims in inputs.values())
        return cls(inputs, tuple(sorted(signature.outputs)), batched)


def _plan(signature: _Signature, arrays: Mapping[str, np.ndarray], output_filter: Sequence[str]) -> _Plan | None:
    """Where a request may join a queue; None for one that must run on its own.

    A request joins a queue only once its input names, dtypes and output_filter match the signature
    and its shapes fit it, so every queue key holds values the signature defines. A request that does
    not match goes straight to the Runner, which refuses it in its own words (or, where the SignatureDef
    misstates a TF1 graph's dtype, runs it).

    Raises:
        InvalidArgument: TF Serving's batching checks on a matching request (ComputeTensorBatchSize,
            tensorflow_serving/batching/batching_util.h): a scalar input, or inputs of unequal dim 0.
    """
    if arrays.keys() != signature.inputs.keys() or not _outputs_known(signature.outputs, output_filter):
        return None
    dtypes = {name: _dtype_name(array) for name, array in arrays.items()}
    if any(dtype != signature.inputs[name][0] for name, dtype in dtypes.items()):
        return None
    if not arrays:
        return None
    if any(array.ndim == 0 for array in arrays.values()):
        raise InvalidArgument("Batching Run() input tensors must have at least one dimension")
    sizes = {array.shape[0] for array in arrays.values()}
    if len(sizes) != 1:
        raise InvalidArgument("Batching Run() input tensors must have equal 0th-dimension size")
    size = sizes.pop()
    if size == 0 or not signature.batched:
        return None
    if not all(_fits(array.shape, signature.inputs[name][1]) for name, array in arrays.items()):
        return None
    outputs = tuple(sorted(output_filter)) if output_filter else signature.outputs
    return _Plan(size, outputs, tuple((name, dtypes[name], arrays[name].shape[1:]) for name in sorted(arrays)))


def _outputs_known(outputs: Sequence[str], output_filter: Sequence[str]) -> bool:
    return all(name in outputs for name in output_filter) and len(set(output_filter)) == len(output_filter)


def _fits(shape: tuple[int, ...], dims: tuple[int, ...]) -> bool:
    """Rank and fixed dims match the signature's (-1 dims take any size)."""
    return len(shape) == len(dims) and all(want < 0 or want == got for want, got in zip(dims, shape))


def _dtype_name(array: np.ndarray) -> str:
    """TF's name for an input array's dtype ("string" for bytes and str; "object" for anything else in an object array)."""
    if array.dtype.kind == "O":
        return "string" if all(isinstance(item, (bytes, str)) for item in array.flat) else "object"
    if array.dtype.kind in "SU":
        return "string"
    return _tf_name(array.dtype)


@functools.lru_cache(maxsize=256)
def _tf_name(dtype: Any) -> str:
    """TF's name for a numpy dtype or DataType enum value (cached: tf.as_dtype costs microseconds a call)."""
    try:
        return tf.as_dtype(dtype).name
    except TypeError:
        return str(dtype)


class BatchingRunner:
    """A Runner whose predict() is batched; everything else is the wrapped Runner's."""

    def __init__(self, runner: Runner, batcher: Batcher) -> None:
        self._runner, self._batcher = runner, batcher

    def predict(self, inputs: Mapping[str, Any], signature_name: str = DEFAULT_SIGNATURE,
                output_filter: Sequence[str] = ()) -> dict[str, np.ndarray]:
        return self._batcher.predict(self._runner, inputs, signature_name, output_filter)

    def __getattr__(self, name: str) -> Any:
        return getattr(self._runner, name)
