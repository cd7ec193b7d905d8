"""The distributed engine the batch jobs (`pipeline score`, `pipeline audit`) run on: Dask's distributed scheduler.

A job is one task per input file (a shard of rows, a request-log file): a module-level function and its
arguments, run where a worker is, its small result sent back. Two places to run, one code path:

    local (default)        a scheduler and one worker in this process, --workers threads, over Dask's
                           in-process transport: no child process, nothing downloaded, its two HTTP
                           endpoints (health, metrics) on loopback only
    --cluster ADDRESS      an existing Dask cluster (`dask scheduler` / `dask worker`, dask-kubernetes,
                           Dask Gateway, dask-jobqueue, ...): tcp://host:8786. Its workers need this
                           project installed (`pip install '.[batch]'`) and the model, the inputs and the
                           output directory on a filesystem every node mounts

Why Dask and not Apache Beam or Ray Data, with the numbers: docs/architecture.md ("The batch engine").
Each worker process loads a model once (`cached`) and its threads share it: Runner.run is thread-safe and
TensorFlow releases the GIL while it computes.
"""

from __future__ import annotations

import contextlib
import dataclasses
import logging
import threading
import time
from collections.abc import Callable, Iterator, Sequence
from typing import Any

from pipeline.errors import EngineError

log = logging.getLogger(__name__)

PROGRESS_INTERVAL_S = 5.0
LOCAL_HTTP = "127.0.0.1:0"  # the in-process engine's HTTP endpoints: loopback only, any free port


@dataclasses.dataclass(frozen=True)
class EngineOptions:
    """Where a job's tasks run: this process (`workers` threads) or the Dask cluster at `cluster`."""

    workers: int = 2
    cluster: str | None = None

    def describe(self) -> str:
        return f"Dask cluster {self.cluster}" if self.cluster else f"local Dask engine, {self.workers} threads"


@contextlib.contextmanager
def client(options: EngineOptions) -> Iterator[Any]:
    """A Dask client for the job's lifetime: an in-process cluster, or the one at options.cluster."""
    try:
        import dask
        import distributed
        import pyarrow  # noqa: F401 - the predictions' format: fail here, not in every task
    except ImportError as error:
        raise EngineError(f"the batch jobs need {error.name}: pip install '.[batch]' (make setup installs it)") from None
    quiet = {name: logging.getLogger(name).level for name in ("distributed", "tornado")}
    for name in quiet:  # its start-up banner and per-worker lines would bury the job's own progress
        logging.getLogger(name).setLevel(logging.WARNING)
    try:
        if options.cluster:
            try:
                dask_client = distributed.Client(options.cluster, timeout="20s")
            except (OSError, TimeoutError) as error:
                raise EngineError(f"--cluster {options.cluster}: cannot reach the Dask scheduler: "
                                  f"{str(error).splitlines()[0]}") from None
        else:
            # The scheduler and the worker always start an HTTP server (health, metrics; dashboard_address=None
            # still binds 0.0.0.0:8787): bound to 127.0.0.1 on a free port, nothing is opened to the network.
            # Without Dask's statistical profiler: in this process it would sample every thread's stack, the
            # caller's and TensorFlow's, every 10 ms, for a dashboard nobody opens (a job once hung with it caught
            # mid-sample while a task loaded a SavedModel; docs/batch.md#the-engine).
            with dask.config.set({"distributed.worker.profile.enabled": False}):
                cluster = distributed.LocalCluster(n_workers=1, threads_per_worker=options.workers, processes=False,
                                                   dashboard_address=LOCAL_HTTP, worker_dashboard_address=LOCAL_HTTP)
            dask_client = distributed.Client(cluster)
        try:
            yield dask_client
        finally:
            if options.cluster:  # long-lived workers forget this job's models (another job may still use them)
                with contextlib.suppress(Exception):
                    dask_client.run(release, list(_job_keys), False)
            dask_client.close()
            if not options.cluster:
                cluster.close()
                release()  # the in-process worker's models: this process goes on after the job
            _job_keys.clear()
    finally:
        for name, level in quiet.items():
            logging.getLogger(name).setLevel(level)


def run(dask_client: Any, task: Callable, items: Sequence[Any], *, progress: Callable[[int, Any], None]) -> list[Any]:
    """task(item) for every item on the engine; returns the results in the order of items.

    progress(done, result) is called on this thread as each task finishes. The first task that raises
    cancels the rest, and its exception (the worker's, pickled back) is raised here.
    """
    import distributed

    futures = dask_client.map(task, items, pure=False)
    order = {future.key: i for i, future in enumerate(futures)}
    results: list[Any] = [None] * len(items)
    try:
        for done, future in enumerate(distributed.as_completed(futures), start=1):
            if future.status == "error":
                raise future.exception()
            results[order[future.key]] = future.result()
            progress(done, results[order[future.key]])
    finally:
        dask_client.cancel([future for future in futures if not future.done()])
    return results


class Progress:
    """One log line per PROGRESS_INTERVAL_S (and at the end): tasks done, rows, rows/s, time left."""

    def __init__(self, verb: str, total: int, unit: str = "shards", counted: str = "rows") -> None:
        self.verb, self.total, self.unit, self.counted = verb, total, unit, counted
        self.rows = 0
        self.start = time.perf_counter()
        self._shown = self.start

    def __call__(self, done: int, rows: int) -> None:
        self.rows += rows
        now = time.perf_counter()
        if done < self.total and now - self._shown < PROGRESS_INTERVAL_S:
            return
        self._shown = now
        elapsed = max(now - self.start, 1e-9)
        left = f", ~{elapsed / done * (self.total - done):.0f} s left" if done < self.total else ""
        log.info("%s: %d/%d %s, %s %s, %s %s/s%s", self.verb, done, self.total, self.unit, f"{self.rows:,}",
                 self.counted, f"{self.rows / elapsed:,.0f}", self.counted, left)

    @property
    def seconds(self) -> float:
        return time.perf_counter() - self.start


_cache: dict[Any, Any] = {}
_cache_lock = threading.Lock()
_job_keys: set[Any] = set()  # on the client: the keys of the job's models, to release on the cluster's workers


def cached(key: Any, load: Callable[[], Any]) -> Any:
    """load() once per worker process for key (a model a worker's threads share), then the same object."""
    with _cache_lock:
        if key not in _cache:
            _cache[key] = load()
        return _cache[key]


def uses(*keys: Any) -> None:
    """Tells the client which cached keys its job's tasks load, so that a cluster's workers forget them after."""
    _job_keys.update(keys)


def release(keys: list[Any] | None = None, close: bool = True) -> None:
    """Forgets the models this process's workers loaded (those of `keys`, or all), closing them unless told not
    to (a cluster's worker may still run another job's task on one: it is freed once no task holds it)."""
    with _cache_lock:
        loaded = [_cache.pop(key) for key in (list(_cache) if keys is None else keys) if key in _cache]
    for value in loaded if close else ():
        if hasattr(value, "close"):
            value.close()
