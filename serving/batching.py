"""Server-side batching: concurrent requests to one signature are merged into one Runner.predict call.

TF Serving's `--enable_batching --batching_parameters_file=FILE`. The file is its BatchingParameters
text proto (session_bundle_config.proto), checked with its rules and wording (batching_session.cc).
Scheduling follows its SharedBatchScheduler queue (shared_batch_scheduler.h):

- Requests that can be merged share a queue: same Runner (model version), signature, output_filter,
  and input dtypes and trailing shapes. Each queue holds an open batch and closed batches waiting
  for one of num_batch_threads slots; a batch runs on the thread of one of the callers waiting in
  the queue, so there are no worker threads and, at low load, no handoff between threads.
- A request joins the open batch if its rows fit under max_batch_size, else it closes the open batch
  and starts a new one; if max_enqueued_batches are already waiting, it is refused UNAVAILABLE.
  A request of more than max_batch_size rows is INVALID_ARGUMENT.
- A closed batch runs as soon as a slot is free, and the open batch once it is full or its first
  request has waited batch_timeout_micros (0: whenever a slot is free, so batches form under load only).
- A batch's rows are concatenated along dim 0, padded up to the next allowed_batch_sizes entry by
  repeating the first row, run, and split back: each caller gets exactly its own rows.

Only signatures whose inputs all have a batch dimension (dim 0 of unknown size) are batched; other
calls, and requests whose inputs do not agree on a row count, go straight to the Runner.

Callers block until their batch has run, inside their request scope: the Runner of a version that is
unloaded meanwhile stays open until every merged request has its answer, so its queue drains first.
Inputs are merged as they are, so requests with equal dtypes and trailing shapes never need
pad_variable_length_inputs; the field is accepted for compatibility.
"""

from __future__ import annotations

import collections
import dataclasses
import logging
import os
import threading
import time
from typing import Any, Callable, Mapping, Sequence

import numpy as np
from google.protobuf import wrappers_pb2

from serving.runner import DEFAULT_SIGNATURE, Runner
from serving import text_proto
from serving.errors import InvalidArgument, Unavailable

log = logging.getLogger(__name__)


class BatchingConfigError(ValueError):
    """A --batching_parameters_file that does not parse or breaks TF Serving's rules."""


# TF Serving's BatchingParameters message (session_bundle_config.proto, which the pip package lacks).
BatchingParametersProto = text_proto.message_class(
    "serving/batching_parameters.proto", "tensorflow.serving.BatchingParameters",
    {"BatchingParameters": [("max_batch_size", 1, ".google.protobuf.Int64Value"),
                            ("batch_timeout_micros", 2, ".google.protobuf.Int64Value"),
                            ("max_enqueued_batches", 3, ".google.protobuf.Int64Value"),
                            ("num_batch_threads", 4, ".google.protobuf.Int64Value"),
                            ("thread_pool_name", 5, ".google.protobuf.StringValue"),
                            ("allowed_batch_sizes", 6, "repeated int64"),
                            ("pad_variable_length_inputs", 7, "bool")]},
    dependencies=[wrappers_pb2.DESCRIPTOR])


@dataclasses.dataclass(frozen=True)
class BatchingParameters:
    """The resolved settings; defaults are SharedBatchScheduler's where the file leaves a field out."""

    max_batch_size: int = 1000
    batch_timeout_micros: int = 0
    max_enqueued_batches: int = 10
    num_batch_threads: int = dataclasses.field(default_factory=lambda: os.cpu_count() or 1)
    allowed_batch_sizes: tuple[int, ...] = ()
    pad_variable_length_inputs: bool = False


def parse_batching_parameters(text: str, source: str = "batching parameters") -> BatchingParameters:
    """Parses and checks a BatchingParameters text proto.

    Raises:
        BatchingConfigError: the text does not parse, or a value breaks TF Serving's rules.
    """
    return _resolved(text_proto.parse_text_proto(text, BatchingParametersProto, BatchingConfigError, source), source)


def read_batching_parameters(path: str | os.PathLike) -> BatchingParameters:
    """Reads a --batching_parameters_file; BatchingConfigError names the file and what is wrong."""
    proto = text_proto.read_text_proto(path, BatchingParametersProto, BatchingConfigError,
                                       what="--batching_parameters_file")
    return _resolved(proto, str(path))


def _resolved(proto: Any, source: str) -> BatchingParameters:
    """The settings a parsed BatchingParameters stands for, checked with TF Serving's rules."""
    defaults = BatchingParameters()
    values = {name: getattr(proto, name).value if proto.HasField(name) else getattr(defaults, name)
              for name in ("max_batch_size", "batch_timeout_micros", "max_enqueued_batches", "num_batch_threads")}
    parameters = BatchingParameters(**values, allowed_batch_sizes=tuple(proto.allowed_batch_sizes),
                                    pad_variable_length_inputs=proto.pad_variable_length_inputs)
    problems = _problems(parameters)
    if problems:
        raise BatchingConfigError(f"{source}: " + "; ".join(problems))
    return parameters


def _problems(parameters: BatchingParameters) -> list[str]:
    """TF Serving's checks (batching_session.cc, shared_batch_scheduler.h), in its words where it has them."""
    problems = []
    for name in ("max_batch_size", "max_enqueued_batches", "num_batch_threads"):
        if getattr(parameters, name) < 1:
            problems.append(f"{name} must be positive; was {getattr(parameters, name)}")
    if parameters.batch_timeout_micros < 0:
        problems.append(f"batch_timeout_micros must be non-negative; was {parameters.batch_timeout_micros}")
    sizes = parameters.allowed_batch_sizes
    if any(later <= earlier for earlier, later in zip(sizes, sizes[1:])):
        problems.append("allowed_batch_sizes entries must be monotonically increasing")
    if sizes and sizes[-1] != parameters.max_batch_size:
        problems.append(f"Last entry in allowed_batch_sizes must match max_batch_size; last entry was {sizes[-1]}; "
                        f"expected {parameters.max_batch_size}")
    return problems


class _Task:
    """One request waiting in a queue: its inputs, row count, and where its answer goes.

    Its condition shares the queue's lock, so a batch wakes exactly the callers it answered.
    """

    def __init__(self, inputs: dict[str, np.ndarray], size: int) -> None:
        self.inputs, self.size = inputs, size
        self.enqueued = time.monotonic()  # for the queue delay: enqueue to the start of its batch's run
        self.wake: threading.Condition | None = None  # set by the queue that holds it
        self.done = False
        self.waiting = False  # its caller is blocked in wait(), not running a batch
        self.outputs: dict[str, np.ndarray] | None = None
        self.error: BaseException | None = None


class _Queue:
    """One SharedBatchScheduler queue: an open batch, closed batches, at most num_batch_threads running.

    No worker threads: a batch is run by the thread of a caller still waiting in the queue (often its
    own first request's), so a request at low load runs on its own thread with no handoff at all, and
    under load each merged batch costs one wake-up per request it answers.
    """

    def __init__(self, parameters: BatchingParameters, runner: Runner, signature_name: str,
                 output_filter: tuple[str, ...], on_batch: Callable[[int, int, list[float]], None]) -> None:
        self._runner, self._on_batch = runner, on_batch
        self._signature_name, self._output_filter = signature_name, list(output_filter)
        self._parameters = parameters
        self._batches: collections.deque[list[_Task]] = collections.deque([[]])  # the last one is open
        self._open_rows = 0
        self._open_since = 0.0
        self._running = 0  # batches being run, at most num_batch_threads
        self._closed = False
        self._lock = threading.Lock()

    def submit(self, task: _Task) -> bool:
        """Enqueues a task; False if the queue was closed meanwhile (the caller makes a new one)."""
        limit = self._parameters.max_batch_size
        if task.size > limit:
            raise InvalidArgument(f"Task size {task.size} is larger than maximum input batch size {limit}")
        with self._lock:
            if self._closed:
                return False
            if self._open_rows + task.size > limit:
                if len(self._batches) >= self._parameters.max_enqueued_batches:
                    raise Unavailable("The batch scheduling queue to which this task was submitted is full; "
                                      f"currently {len(self._batches)} batches enqueued and max_enqueued_batches "
                                      f"is {self._parameters.max_enqueued_batches}")
                self._batches.append([])
                self._open_rows = 0
            if not self._batches[-1]:
                self._open_since = time.monotonic()
            task.wake = threading.Condition(self._lock)
            self._batches[-1].append(task)
            self._open_rows += task.size
        return True

    def wait(self, task: _Task) -> None:
        """Blocks until task is answered, running ready batches (its own or others') while a slot is free."""
        with self._lock:
            while not task.done:
                batch = self._next_batch() if self._running < self._parameters.num_batch_threads else None
                if batch is None:
                    task.waiting = True
                    task.wake.wait(self._wait_s() if self._running < self._parameters.num_batch_threads else None)
                    task.waiting = False
                    continue
                self._running += 1
                self._wake_next()  # another slot may be free for the batch behind this one
                self._lock.release()
                try:
                    self._run(batch)
                finally:
                    self._lock.acquire()
                    self._running -= 1
                    for other in batch:
                        other.done = True
                        other.wake.notify()
                    self._wake_next()

    def close(self) -> None:
        """Runs what is queued (without waiting for timeouts): its callers stop waiting for the timeout."""
        with self._lock:
            self._closed = True
            for batch in self._batches:
                for task in batch:
                    task.wake.notify()

    def _wake_next(self) -> None:
        """Wakes a caller of the oldest waiting batch if a slot is free; caller holds _lock."""
        if self._running < self._parameters.num_batch_threads:
            waiting = next((task for task in self._batches[0] if task.waiting), None)
            if waiting is not None:
                waiting.wake.notify()

    def _next_batch(self) -> list[_Task] | None:
        """A closed batch, or the open one once it is full, timed out or the queue closes; caller holds _lock."""
        if len(self._batches) >= 2:
            return self._batches.popleft()
        open_batch = self._batches[0]
        if not open_batch:
            return None
        full = self._open_rows >= self._parameters.max_batch_size
        timed_out = time.monotonic() >= self._open_since + self._parameters.batch_timeout_micros / 1e6
        if self._closed or full or timed_out:
            self._batches[0] = []
            self._open_rows = 0
            return open_batch
        return None

    def _wait_s(self) -> float | None:
        if self._batches[0] and len(self._batches) == 1:
            return max(self._open_since + self._parameters.batch_timeout_micros / 1e6 - time.monotonic(), 0.0)
        return None  # until a slot frees, a batch answers this task, or the queue closes

    def _run(self, batch: list[_Task]) -> None:
        """Merges, pads, runs and splits one batch; every task gets its rows or the batch's error."""
        rows = sum(task.size for task in batch)
        started = time.monotonic()
        queue_delays_s = [started - task.enqueued for task in batch]
        padded = _padded_size(rows, self._parameters.allowed_batch_sizes)
        try:
            inputs = {name: _concatenate([task.inputs[name] for task in batch], padded)
                      for name in batch[0].inputs}
            outputs = self._runner.predict(inputs, signature_name=self._signature_name,
                                           output_filter=self._output_filter)
            self._on_batch(len(batch), rows, queue_delays_s)
            start = 0
            for task in batch:
                task.outputs = {name: array[start:start + task.size] for name, array in outputs.items()}
                start += task.size
        except BaseException as error:  # noqa: BLE001 - every waiting caller must get an answer
            for task in batch:
                task.error = error


def _padded_size(rows: int, allowed_batch_sizes: Sequence[int]) -> int:
    return next((size for size in allowed_batch_sizes if size >= rows), rows)


def _concatenate(arrays: list[np.ndarray], padded_rows: int) -> np.ndarray:
    merged = np.concatenate(arrays, axis=0) if len(arrays) > 1 else arrays[0]
    missing = padded_rows - merged.shape[0]
    if missing > 0:  # TF Serving pads with copies of the first row; the extra outputs are dropped
        merged = np.concatenate([merged, np.repeat(merged[:1], missing, axis=0)], axis=0)
    return merged


class Batcher:
    """Merges concurrent predict() calls per (Runner, signature, output_filter, input dtypes and shapes).

    Args:
        parameters: the resolved BatchingParameters (read_batching_parameters).
    """

    def __init__(self, parameters: BatchingParameters) -> None:
        self.parameters = parameters
        self._queues: dict[tuple, _Queue] = {}
        self._lock = threading.Lock()
        self._batch_sizes: collections.Counter[int] = collections.Counter()
        self._listeners: list[Callable[[int, int, Sequence[float]], None]] = []

    def add_listener(self, callback: Callable[[int, int, Sequence[float]], None]) -> None:
        """Calls callback(requests, rows, queue_delays_s) after every merged batch runs (e.g. metrics)."""
        self._listeners.append(callback)

    def predict(self, runner: Runner, inputs: Mapping[str, Any], signature_name: str = DEFAULT_SIGNATURE,
                output_filter: Sequence[str] = ()) -> dict[str, np.ndarray]:
        """Runner.predict, merged with concurrent calls that can share a batch; blocks until answered.

        Raises:
            InvalidArgument: more rows than max_batch_size (and whatever Runner.predict raises).
            Unavailable: max_enqueued_batches are already waiting.
        """
        signature_name = signature_name or DEFAULT_SIGNATURE
        arrays = {name: np.asarray(value) for name, value in inputs.items()}
        size = _batch_size(runner, signature_name, arrays)
        if size is None:
            return runner.predict(arrays, signature_name=signature_name, output_filter=output_filter)
        task = _Task(arrays, size)
        key = (id(runner), signature_name, tuple(output_filter),
               tuple(sorted((name, array.dtype.str, array.shape[1:]) for name, array in arrays.items())))
        queue = self._queue(key, runner, signature_name, tuple(output_filter))
        while not queue.submit(task):  # retire() closed and dropped it after we looked it up: make a fresh one
            queue = self._queue(key, runner, signature_name, tuple(output_filter))
        queue.wait(task)
        if task.error is not None:
            raise task.error
        return task.outputs

    def wrap(self, runner: Runner) -> "BatchingRunner":
        """runner, with predict() going through this batcher (for serving/inference.py's functions)."""
        return BatchingRunner(runner, self)

    def batch_sizes(self) -> dict[int, int]:
        """How many merged batches of each size (rows, before padding) have run: {rows: count}."""
        with self._lock:
            return dict(self._batch_sizes)

    def retire(self, live_runners: Sequence[Runner]) -> None:
        """Closes the queues of Runners not in live_runners; what they hold still runs (drain, then stop)."""
        live = {id(runner) for runner in live_runners}
        with self._lock:
            retired = [key for key in self._queues if key[0] not in live]
            queues = [self._queues.pop(key) for key in retired]
        for queue in queues:
            queue.close()

    def stop(self) -> None:
        """Drains and closes every queue."""
        self.retire([])

    def _queue(self, key: tuple, runner: Runner, signature_name: str, output_filter: tuple[str, ...]) -> _Queue:
        with self._lock:
            queue = self._queues.get(key)
            if queue is None:
                queue = self._queues[key] = _Queue(self.parameters, runner, signature_name, output_filter,
                                                   on_batch=self._record)
            return queue

    def _record(self, requests: int, rows: int, queue_delays_s: Sequence[float] = ()) -> None:
        with self._lock:
            self._batch_sizes[rows] += 1
        if requests > 1:
            log.debug("ran a batch of %d requests, %d rows", requests, rows)
        for listener in self._listeners:
            listener(requests, rows, queue_delays_s)


def _batch_size(runner: Runner, signature_name: str, arrays: Mapping[str, np.ndarray]) -> int | None:
    """The rows a request adds to a batch, or None if it must run on its own.

    Batchable: every signature input is given, has dim 0 of unknown size in the signature, and all
    inputs agree on a row count of at least 1. Anything else (including unknown signatures or
    inputs) goes straight to the Runner, which reports the problem in its own words.
    """
    signature = runner.signature_defs.get(signature_name)
    if signature is None or set(arrays) != set(signature.inputs) or not arrays:
        return None
    sizes = set()
    for name, info in signature.inputs.items():
        shape = info.tensor_shape
        if shape.unknown_rank or not shape.dim or shape.dim[0].size != -1 or arrays[name].ndim == 0:
            return None
        sizes.add(arrays[name].shape[0])
    if len(sizes) != 1 or 0 in sizes:
        return None
    return sizes.pop()


class BatchingRunner:
    """A Runner whose predict() is batched; everything else is the wrapped Runner's."""

    def __init__(self, runner: Runner, batcher: Batcher) -> None:
        self._runner, self._batcher = runner, batcher

    def predict(self, inputs: Mapping[str, Any], signature_name: str = DEFAULT_SIGNATURE,
                output_filter: Sequence[str] = ()) -> dict[str, np.ndarray]:
        return self._batcher.predict(self._runner, inputs, signature_name, output_filter)

    def __getattr__(self, name: str) -> Any:
        return getattr(self._runner, name)
