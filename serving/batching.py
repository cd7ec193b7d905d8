"""Server-side batching: concurrent requests to one signature are merged into one Runner.predict call.

TF Serving's `--enable_batching --batching_parameters_file=FILE`. The file is its BatchingParameters
text proto (session_bundle_config.proto), checked with its rules and wording (batching_session.cc).
Scheduling follows its SharedBatchScheduler queue (shared_batch_scheduler.h):

- A request is checked against its signature before it may join a queue (input names and dtypes,
  shapes the signature allows, output_filter names), so queues are keyed only by values the model
  defines: Runner (model version), signature, the set of outputs asked for, and input dtypes and
  trailing shapes. Each queue holds an open batch and closed batches waiting for one of
  num_batch_threads slots; a batch runs on the thread of one of the callers waiting in the queue, so
  there are no worker threads and, at low load, no handoff between threads.
- At most max_queues queues per model version (DEFAULT_MAX_QUEUES); at the bound, idle queues are
  dropped, and if none is idle the request runs unbatched, as TF Serving runs a request that matches
  none of its batching queues (batching_session.cc, "Bypassing batcher").
- A request joins the open batch if its rows fit under max_batch_size, else it closes the open batch
  and starts a new one; if max_enqueued_batches are already waiting, it is refused UNAVAILABLE.
  A request of more than max_batch_size rows is INVALID_ARGUMENT.
- A closed batch runs as soon as a slot is free, and the open batch once it is full or its first
  request has waited batch_timeout_micros (0: whenever a slot is free, so batches form under load only).
- A batch's rows are concatenated along dim 0, padded up to the next allowed_batch_sizes entry by
  repeating the first row, run, and split back: each caller gets exactly its own rows.
- A merged batch that fails (one request's values rejected by the model's ops, say) is run again one
  request at a time, each on its own caller's thread, so only the request at fault gets an error.

With batching on, the inputs of a request that matches its signature must have a dim 0 of one size,
as TF Serving's ComputeTensorBatchSize requires (tensorflow_serving/batching/batching_util.h): a
scalar input is INVALID_ARGUMENT "Batching Run() input tensors must have at least one dimension". Only signatures whose inputs all have a batch
dimension (dim 0 of unknown size) are batched; other requests, and requests that do not fit their
signature (which the Runner then refuses in its own words), go straight to the Runner.

Callers block until their batch has run, inside their request scope: the Runner of a version that is
unloaded meanwhile stays open until every merged request has its answer, so its queue drains first.
Inputs are merged as they are, so requests with equal dtypes and trailing shapes never need
pad_variable_length_inputs; the field is accepted for compatibility.
"""

from __future__ import annotations

import collections
import dataclasses
import functools
import logging
import os
import threading
import time
from typing import Any, Callable, Mapping, NamedTuple, Sequence

import numpy as np
import tensorflow as tf
from google.protobuf import wrappers_pb2
from tensorflow.core.protobuf import meta_graph_pb2

from serving.runner import DEFAULT_SIGNATURE, Runner
from serving import text_proto
from serving.errors import FailedPrecondition, InvalidArgument, Unavailable

log = logging.getLogger(__name__)

# Batch queues per model version. Each distinct trailing shape of a variable-length input needs a queue
# of its own; idle queues are dropped at the bound, so it only limits shapes in use at the same time.
DEFAULT_MAX_QUEUES = 64
WARNING_INTERVAL_S = 60.0


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
    """One request waiting in a queue: its inputs, row count, the outputs it wants, and where its answer goes.

    Its condition shares the queue's lock, so a batch wakes exactly the callers it answered.
    """

    def __init__(self, inputs: dict[str, np.ndarray], size: int, wanted: Sequence[str]) -> None:
        self.inputs, self.size, self.wanted = inputs, size, list(wanted)
        self.enqueued = time.monotonic()  # for the queue delay: enqueue to the start of its batch's run
        self.wake: threading.Condition | None = None  # set by the queue that holds it
        self.done = False
        self.waiting = False  # its caller is blocked in wait(), not running a batch
        self.outputs: dict[str, np.ndarray] | None = None
        self.error: BaseException | None = None
        self.rerun = False  # its merged batch failed: its caller runs it again on its own


class _Queue:
    """One SharedBatchScheduler queue: an open batch, closed batches, at most num_batch_threads running.

    No worker threads: a batch is run by the thread of a caller still waiting in the queue (often its
    own first request's), so a request at low load runs on its own thread with no handoff at all, and
    under load each merged batch costs one wake-up per request it answers.
    """

    def __init__(self, parameters: BatchingParameters, runner: Runner, signature_name: str,
                 outputs: tuple[str, ...], on_batch: Callable[[int, int, list[float]], None]) -> None:
        self._runner, self._on_batch = runner, on_batch
        self._signature_name, self._outputs = signature_name, outputs
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

    def close_if_idle(self) -> bool:
        """Closes the queue if no request is in it or running; True if it did (the Batcher then drops it)."""
        with self._lock:
            if self._running or len(self._batches) > 1 or self._batches[0]:
                return False
            self._closed = True
            return True

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
        """Runs one batch; every task gets its rows, its batch's error, or (a merged batch failed) a rerun."""
        started = time.monotonic()
        queue_delays_s = [started - task.enqueued for task in batch]
        try:
            answers = self.run_tasks(batch)
        except BaseException as error:  # noqa: BLE001 - every waiting caller must get an answer
            if len(batch) > 1 and isinstance(error, Exception):
                log.debug("a batch of %d requests failed (%s); running them one at a time", len(batch), error)
                for task in batch:
                    task.rerun = True
            else:
                for task in batch:
                    task.error = error
            return
        self._on_batch(len(batch), sum(task.size for task in batch), queue_delays_s)
        for task, outputs in zip(batch, answers):
            task.outputs = outputs

    def run_tasks(self, tasks: list[_Task]) -> list[dict[str, np.ndarray]]:
        """Merges, pads, runs and splits tasks; each task's outputs are the ones it asked for, in its order.

        Raises:
            FailedPrecondition: an output has no dim 0 of the batch's size (TF Serving's
                SplitOutputTensors checks and words, batching_session.cc); and whatever Runner.predict raises.
        """
        rows = sum(task.size for task in tasks)
        padded = _padded_size(rows, self._parameters.allowed_batch_sizes)
        inputs = {name: _concatenate([task.inputs[name] for task in tasks], padded) for name in tasks[0].inputs}
        outputs = self._runner.predict(inputs, signature_name=self._signature_name, output_filter=self._outputs)
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


class Batcher:
    """Merges concurrent predict() calls per (Runner, signature, outputs, input dtypes and trailing shapes).

    Args:
        parameters: the resolved BatchingParameters (read_batching_parameters).
        max_queues: batch queues per model version (Runner) at most; see DEFAULT_MAX_QUEUES.
    """

    def __init__(self, parameters: BatchingParameters, max_queues: int = DEFAULT_MAX_QUEUES) -> None:
        self.parameters = parameters
        self.max_queues = max_queues
        self._queues: dict[tuple, _Queue] = {}
        self._lock = threading.Lock()
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
        """Runner.predict, merged with concurrent calls that can share a batch; blocks until answered.

        Raises:
            InvalidArgument: more rows than max_batch_size, a scalar input, or inputs whose dim 0
                sizes differ (and whatever Runner.predict raises).
            Unavailable: max_enqueued_batches are already waiting.
        """
        signature_name = signature_name or DEFAULT_SIGNATURE
        arrays = {name: np.asarray(value) for name, value in inputs.items()}
        signature = self._signature(runner, signature_name)
        plan = None if signature is None else _plan(signature, arrays, output_filter)
        queue = None if plan is None else self._queue(runner, signature_name, plan.outputs, plan.inputs_key)
        if queue is None:
            return runner.predict(arrays, signature_name=signature_name, output_filter=output_filter)
        task = _Task(arrays, plan.size, list(output_filter) or list(plan.outputs))
        while not queue.submit(task):  # closed (retired or idle) after we looked it up: find or make another
            queue = self._queue(runner, signature_name, plan.outputs, plan.inputs_key)
            if queue is None:
                return runner.predict(arrays, signature_name=signature_name, output_filter=output_filter)
        queue.wait(task)
        if task.rerun:  # its merged batch failed: run it on its own, so only a request at fault fails
            return queue.run_tasks([task])[0]
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

    def queue_count(self) -> int:
        """Batch queues open now, all model versions together."""
        with self._lock:
            return len(self._queues)

    def retire(self, live_runners: Sequence[Runner]) -> None:
        """Closes the queues of Runners not in live_runners; what they hold still runs (drain, then stop)."""
        live = {id(runner) for runner in live_runners}
        with self._lock:
            retired = [key for key in self._queues if key[0] not in live]
            queues = [self._queues.pop(key) for key in retired]
            self._signatures = {key: value for key, value in self._signatures.items() if key[0] in live}
        for queue in queues:
            queue.close()

    def stop(self) -> None:
        """Drains and closes every queue."""
        self.retire([])

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
        """The queue for a checked request, made if needed; None (run it unbatched) at max_queues."""
        key = (id(runner), signature_name, outputs, inputs_key)
        with self._lock:
            queue = self._queues.get(key)
            if queue is not None:
                return queue
            mine = [other for other in self._queues if other[0] == key[0]]
            if len(mine) >= self.max_queues:
                idle = [other for other in mine if self._queues[other].close_if_idle()]
                for other in idle:
                    del self._queues[other]
                if len(mine) - len(idle) >= self.max_queues:
                    self._warn_full(runner)
                    return None
            queue = self._queues[key] = _Queue(self.parameters, runner, signature_name, outputs,
                                               on_batch=self._record)
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
