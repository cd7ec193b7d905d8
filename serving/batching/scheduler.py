"""Server-side batching: concurrent requests to one signature are merged into one Runner.predict call.

TF Serving's `--enable_batching` (parameters: serving/batching/parameters.py). Scheduling follows its
SharedBatchScheduler (shared_batch_scheduler.h):

- Only checked model calls reach the batcher (serving/servable/signature.py ModelCall: input names,
  dtypes and shapes the signature allows, output names), so queues are keyed only by values the model
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
- A merged batch that fails (one request's values rejected by the model's ops, say) is split in halves
  and run again, recursively, down to single requests, so only the requests at fault get an error,
  never another client's (TF Serving fails every request of a failed batch). The extra runs are bounded
  by the batch: at most 2n - 2 for n requests, each of a part's rows. Classify and Regress requests whose
  tf.Examples the signature's parser would refuse never get here (serving/servable/example_parsing.py).

Waiting costs no thread: the caller, on the server's event loop, awaits a future that the batch
thread resolves, with one wake-up of the loop per batch. The caller holds its request scope, so the
Runner of a version unloaded meanwhile stays open until every merged request has its answer, and
its queue drains first. `Batcher.run` is the one entry: a call that cannot join a queue runs on the
caller's executor, never on the loop.

With batching on, the inputs of a request that matches its signature must have a dim 0 of one size,
as TF Serving's ComputeTensorBatchSize requires (tensorflow_serving/batching/batching_util.h): a
scalar input is INVALID_ARGUMENT "Batching Run() input tensors must have at least one dimension".
Only signatures whose inputs all have a batch dimension (dim 0 of unknown size) are batched; other
calls, empty ones, and TF1 calls whose shapes do not fit the SignatureDef (TF1 graphs are not
shape-checked; their ops decide) run unbatched. Inputs are merged as they are, so requests with equal dtypes and
trailing shapes never need pad_variable_length_inputs; the field is accepted for compatibility.
"""

from __future__ import annotations

import asyncio
import collections
import concurrent.futures
import logging
import threading
import time
from typing import Callable, Sequence

import numpy as np

from serving.batching.parameters import BatchingParameters
from serving.errors import FailedPrecondition, InvalidArgument, Unavailable
from serving.servable.runner import ModelCall, Runner
from serving.servable.signature import fits

log = logging.getLogger(__name__)

# Batch queues per model version. Each distinct trailing shape of a variable-length input needs a queue
# of its own; idle queues are dropped at the bound, so it only limits shapes in use at the same time.
DEFAULT_MAX_QUEUES = 64
WARNING_INTERVAL_S = 60.0


class _Task:
    """One call in a queue: its inputs, rows, the outputs it wants, and the future its caller awaits on `loop`."""

    __slots__ = ("inputs", "size", "wanted", "enqueued", "outputs", "error", "loop", "future")

    def __init__(self, call: ModelCall, size: int, loop: asyncio.AbstractEventLoop) -> None:
        self.inputs, self.size, self.wanted = call.inputs, size, call.outputs
        self.enqueued = time.monotonic()  # for the queue delay: enqueue to the start of its batch's run
        self.outputs: dict[str, np.ndarray] | None = None
        self.error: BaseException | None = None
        self.loop, self.future = loop, loop.create_future()


def _answer_futures(tasks: list[_Task]) -> None:
    """On the callers' event loop: resolves each caller's future (unless it gave up meanwhile)."""
    for task in tasks:
        if not task.future.done():
            if task.error is not None:
                task.future.set_exception(task.error)
            else:
                task.future.set_result(task.outputs)


def _answer(tasks: list[_Task]) -> None:
    """Wakes the callers of answered tasks: one call into each event loop."""
    by_loop: dict[asyncio.AbstractEventLoop, list[_Task]] = {}
    for task in tasks:
        by_loop.setdefault(task.loop, []).append(task)
    for loop, waiting in by_loop.items():
        try:
            loop.call_soon_threadsafe(_answer_futures, waiting)
        except RuntimeError:  # the loop was closed: its callers are gone
            pass


class _Queue:
    """One SharedBatchScheduler queue: an open batch (the last) and closed batches; the scheduler's lock guards it."""

    def __init__(self, parameters: BatchingParameters, runner: Runner, call: ModelCall) -> None:
        """A queue for calls like `call`: same runner, signature, set of outputs, dtypes and trailing shapes."""
        self.runner, self.signature, self.outputs = runner, call.signature, tuple(sorted(call.outputs))
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
    """Merges concurrent model calls per (Runner, signature, outputs, input dtypes and trailing shapes).

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

    def add_listener(self, callback: Callable[[int, int, Sequence[float]], None]) -> None:
        """Calls callback(requests, rows, queue_delays_s) after every merged batch runs (e.g. metrics)."""
        self._listeners.append(callback)

    async def run(self, runner: Runner, call: ModelCall,
                  executor: concurrent.futures.Executor | None = None) -> dict[str, np.ndarray]:
        """runner.run(call), merged with concurrent calls that can share a batch; waiting holds no thread.
        A call that runs unbatched runs on executor (None: the loop's default), never on the loop.

        Raises:
            InvalidArgument: more rows than max_batch_size, a scalar input, or inputs whose dim 0
                sizes differ (and whatever Runner.run raises).
            Unavailable: max_enqueued_batches are already waiting.
        """
        loop = asyncio.get_running_loop()
        rows = self._rows(call)
        task = None if rows is None else _Task(call, rows, loop)
        if task is None or not self._submit(runner, call, task):
            return await loop.run_in_executor(executor, runner.run, call)
        return await task.future

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

    def _rows(self, call: ModelCall) -> int | None:
        """The rows a call adds to a batch; None for a call that runs on its own.

        TF Serving's batching checks (ComputeTensorBatchSize, tensorflow_serving/batching/batching_util.h)
        refuse a scalar input and inputs of unequal dim 0. A signature without a batch dimension on every
        input, an empty call, or a TF1 call whose shapes the SignatureDef does not describe runs unbatched,
        as TF Serving runs a request that matches none of its batching queues.

        Raises:
            InvalidArgument: a scalar input, unequal dim 0 sizes, or more rows than max_batch_size.
        """
        signature = call.signature
        if not signature.batched:
            return None
        arrays = call.inputs.values()
        if any(array.ndim == 0 for array in arrays):
            raise InvalidArgument("Batching Run() input tensors must have at least one dimension")
        sizes = {array.shape[0] for array in arrays}
        if len(sizes) != 1:
            raise InvalidArgument("Batching Run() input tensors must have equal 0th-dimension size")
        rows = sizes.pop()
        if rows == 0 or not all(fits(array.shape, signature.inputs[name].dims) for name, array in call.inputs.items()):
            return None
        if rows > self.parameters.max_batch_size:
            raise InvalidArgument(f"Task size {rows} is larger than maximum input batch size "
                                  f"{self.parameters.max_batch_size}")
        return rows

    def _submit(self, runner: Runner, call: ModelCall, task: _Task) -> bool:
        """Queues a task; False at max_queues with none idle (the caller runs it unbatched, as TF Serving's
        batcher bypass)."""
        with self._lock:
            queue = None if self._stopping else self._queue(runner, call)
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
        """Runs one batch; each task gets its rows or an error. A failed merged batch is split (_run_part), so
        only the requests at fault fail."""
        started = time.monotonic()
        batch = [task for task in batch if not task.future.cancelled()]  # callers gone (cancelled, past deadline)
        if not batch:
            return
        if self._run_part(queue, batch):
            self._record(len(batch), sum(task.size for task in batch), [started - task.enqueued for task in batch])
        _answer(batch)

    def _run_part(self, queue: _Queue, tasks: list[_Task]) -> bool:
        """Runs tasks as one batch and gives each its outputs; returns whether it ran in one go.

        When a merged batch fails (one request's values rejected by the model's ops, say), its halves are
        run again, recursively down to single requests, so a request fails only for its own values: k bad
        requests among n cost about 2k log2(n/k) extra runs, never more than 2n - 2. TF Serving instead
        answers every request of a failed batch with its error (batching_session.cc).
        """
        try:
            answers = run_tasks(queue, tasks, self.parameters.allowed_batch_sizes)
        except Exception as error:  # noqa: BLE001 - every waiting caller must get an answer
            if len(tasks) == 1:
                tasks[0].error = error
            else:
                log.debug("a batch of %d requests failed (%s); running its halves", len(tasks), error)
                half = len(tasks) // 2
                self._run_part(queue, tasks[:half])
                self._run_part(queue, tasks[half:])
            return False
        for task, outputs in zip(tasks, answers):
            task.outputs = outputs
        return True

    def _queue(self, runner: Runner, call: ModelCall) -> _Queue | None:
        """The queue for a call, made if needed; None (run it unbatched) at max_queues; caller holds _lock."""
        shapes = tuple((name, array.dtype.str, array.shape[1:]) for name, array in sorted(call.inputs.items()))
        key = (id(runner), call.signature.name, tuple(sorted(call.outputs)), shapes)
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
        queue = self._queues[key] = _Queue(self.parameters, runner, call)
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
            checks and words, batching_session.cc); and whatever Runner.run raises.
    """
    rows = sum(task.size for task in tasks)
    padded = _padded_size(rows, allowed_batch_sizes)
    inputs = {name: _concatenate([task.inputs[name] for task in tasks], padded) for name in tasks[0].inputs}
    outputs = queue.runner.run(ModelCall(queue.signature, inputs, queue.outputs))
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
