"""The tf.data service: input pipelines run on separate machines, the trainers read finished batches from them.

`python -m pipeline data-service dispatcher` starts the dispatcher (with a work directory it journals its state
to, so a restarted dispatcher resumes: fault-tolerant mode); `python -m pipeline data-service worker` starts a
worker that registers with it. With data.service set, training sends its input pipeline (shards.py: graph ops
only) to the dispatcher as one job per epoch, and the workers read and decode the shards. The dispatcher hands
out the shards dynamically (ShardingPolicy.DYNAMIC): each record is read once per epoch across all workers, and a
worker that dies is replaced by any worker that registers, without stopping training; the shards it held in
flight are not read again in that epoch (TensorFlow's at-most-once visitation; docs/data.md#the-tfdata-service).
"""

from __future__ import annotations

import logging
import signal
import threading

log = logging.getLogger(__name__)

DISPATCHER_PORT, WORKER_PORT = 5050, 5051
# A worker silent for this long is removed and its tasks end; TensorFlow's default is 5 minutes, during which the
# trainers wait on a worker that is gone.
WORKER_TIMEOUT_S = 10.0


def distribute(batches, address: str, job_name: str):
    """batches (a tf.data.Dataset), produced by the service's workers: every consumer of job_name shares one pass
    over the shards."""
    import tensorflow as tf

    return batches.apply(tf.data.experimental.service.distribute(
        processing_mode=tf.data.experimental.service.ShardingPolicy.DYNAMIC, service=_grpc(address),
        job_name=job_name))


def run_dispatcher(port: int, work_dir: str | None, worker_timeout_s: float = WORKER_TIMEOUT_S) -> None:
    """Serves as the dispatcher until SIGTERM or SIGINT."""
    import tensorflow as tf

    config = tf.data.experimental.service.DispatcherConfig(port=port, work_dir=work_dir,
                                                           fault_tolerant_mode=work_dir is not None,
                                                           worker_timeout_ms=int(worker_timeout_s * 1000))
    server = tf.data.experimental.service.DispatchServer(config)
    log.info("tf.data service dispatcher on port %d (%s); workers: python -m pipeline data-service worker "
             "--dispatcher HOST:%d", port, f"journal in {work_dir}" if work_dir else "no journal: not fault-tolerant",
             port)
    _serve_until_stopped(server)


def run_worker(port: int, dispatcher: str, worker_address: str | None) -> None:
    """Serves as a worker of the dispatcher until SIGTERM or SIGINT."""
    import tensorflow as tf

    config = tf.data.experimental.service.WorkerConfig(
        dispatcher_address=dispatcher.removeprefix("grpc://"), port=port,
        worker_address=worker_address or f"localhost:{port}")
    server = tf.data.experimental.service.WorkerServer(config)
    log.info("tf.data service worker on port %d, registered with %s as %s", port, dispatcher,
             worker_address or f"localhost:{port}")
    _serve_until_stopped(server)


def _serve_until_stopped(server) -> None:
    stopped = threading.Event()
    for signum in (signal.SIGTERM, signal.SIGINT):
        signal.signal(signum, lambda *_: stopped.set())
    stopped.wait()
    server.stop()
    log.info("tf.data service server stopped")


def _grpc(address: str) -> str:
    return address if address.startswith("grpc://") else f"grpc://{address}"
