"""Sampled request log: PredictionLog records of real traffic, per model, in TFRecord files.

Turned on per model in the --model_config_file, in TF Serving's shape (model_server_config.proto's
ModelConfig.logging_config, logging_config.proto):

    config {
      name: "digits_mlp" base_path: "/models/digits_mlp" model_platform: "tensorflow"
      logging_config {
        log_collector_config { type: "tfrecord" filename_prefix: "/var/log/serving/requests" }
        sampling_config { sampling_rate: 0.01 }
      }
    }

As TF Serving's RequestLogger (core/request_logger.cc) does, each successful Predict, Classify,
Regress and MultiInference request (gRPC and REST alike) is sampled with probability sampling_rate,
and a sampled one becomes a PredictionLog with the request, the response and log_metadata (the
resolved model_spec, the sampling_config, the SavedModel tags, the time). TF Serving's open-source
server has no log collector to write them; ours, type "tfrecord" (or no type), writes TFRecord files
of serialized PredictionLogs: the format of TF Serving's warmup file, so a log replays as a shadow
test or becomes assets.extra/tf_serving_warmup_requests. One file per model and logging config:
`<filename_prefix>-<model>-<UTC start time>-<pid>.tfrecord`.

Requests never wait for the disk: records go through a bounded queue to one writer thread per file
(at most queue_size records and queue_bytes of requests and responses, so large requests cannot pile
up in memory; one record of any size is taken while nothing waits); when the queue is full the
record is dropped and counted (a warning at most once a minute, and
tensorflow_serving_request_log_dropped with --monitoring_config_file). Files are flushed whenever the
writer catches up, and closed when the server stops or a reload changes the model's logging config.
"""

from __future__ import annotations

import logging
import os
import queue
import random
import threading
import time
from pathlib import Path
from typing import Any, Callable

import tensorflow as tf
from tensorflow_serving.apis import prediction_log_pb2
from tensorflow_serving.config import logging_config_pb2, model_server_config_pb2

from serving.servable.saved_model import SERVING_TAG

log = logging.getLogger(__name__)

DEFAULT_QUEUE_SIZE = 1024
DEFAULT_QUEUE_BYTES = 64 * 1024 * 1024
WARNING_INTERVAL_S = 60.0
# Servicer method -> PredictionLog field; other RPCs (GetModelMetadata) are not logged, as in TF Serving.
_LOG_FIELDS = {"Predict": "predict_log", "Classify": "classify_log", "Regress": "regress_log",
               "MultiInference": "multi_inference_log"}
_STOP = object()


class RequestLog:
    """The server's request loggers, one per model with a logging_config; log() is thread-safe and quick.

    Args:
        queue_size: records waiting for the disk per file before new ones are dropped.
        queue_bytes: request and response bytes waiting for the disk per file before new ones are dropped.
        seed: seeds the samplers (one random.Random per logger), so a run's sampling can be repeated.
        metrics: counts dropped records (serving.monitoring.Metrics); None: only logged.
    """

    def __init__(self, *, queue_size: int = DEFAULT_QUEUE_SIZE, queue_bytes: int = DEFAULT_QUEUE_BYTES,
                 seed: int | None = None, metrics: Any = None) -> None:
        self._queue_size, self._queue_bytes, self._seed, self._metrics = queue_size, queue_bytes, seed, metrics
        self._loggers: dict[str, _ModelLog] = {}  # replaced whole on update, so log() reads it without a lock
        self._lock = threading.Lock()

    def follow_models(self, manager: Any) -> Callable[[Any], None]:
        """Keeps the loggers in step with the manager's model configs (start-up and every reload); returns the
        listener, for manager.remove_listener."""
        def update(manager: Any) -> None:
            self.update(manager.model_configs())

        manager.add_listener(update)
        update(manager)
        return update

    def update(self, configs: dict[str, model_server_config_pb2.ModelConfig]) -> None:
        """One logger per model whose config has a logging_config; a changed config gets a new file.

        Raises:
            OSError: a log file could not be created (the other models are updated all the same).
        """
        with self._lock:
            wanted = {name: config.logging_config for name, config in configs.items()
                      if config.HasField("logging_config")}
            loggers, retired, errors = {}, [], []
            for name, logger in self._loggers.items():
                if name in wanted and wanted[name] == logger.config:
                    loggers[name] = logger
                else:
                    retired.append(logger)
            for name, config in wanted.items():
                if name not in loggers:
                    try:
                        loggers[name] = _ModelLog(name, config, self._queue_size, self._queue_bytes, self._seed,
                                                  self._metrics)
                    except OSError as error:  # the other models' logs still follow the config
                        errors.append(error)
            self._loggers = loggers
        for logger in retired:
            logger.close()
        if errors:
            raise errors[0]

    def log(self, rpc: str, request: Any, response: Any) -> None:
        """Samples one answered request of a logged model into its file (never blocks on the disk)."""
        field = _LOG_FIELDS.get(rpc)
        if field is None or not self._loggers:
            return
        spec = request.tasks[0].model_spec if rpc == "MultiInference" and request.tasks else request.model_spec
        logger = self._loggers.get(spec.name)
        if logger is not None:
            logger.log(field, request, response)

    def paths(self) -> dict[str, Path]:
        """The file each logged model is written to: {model name: path}."""
        return {name: logger.path for name, logger in self._loggers.items()}

    def dropped(self) -> dict[str, int]:
        """Records dropped so far because a writer fell behind: {model name: count}."""
        return {name: logger.dropped for name, logger in self._loggers.items()}

    def close(self) -> None:
        """Writes what is queued, then closes every file; later requests are not logged."""
        with self._lock:
            loggers, self._loggers = list(self._loggers.values()), {}
        for logger in loggers:
            logger.close()


class _ModelLog:
    """One model's sampler, bounded queue, writer thread and TFRecord file."""

    def __init__(self, model_name: str, config: logging_config_pb2.LoggingConfig, queue_size: int,
                 queue_bytes: int, seed: int | None, metrics: Any) -> None:
        self.model_name, self.config, self._metrics = model_name, config, metrics
        self.path = _new_path(config.log_collector_config.filename_prefix, model_name)
        self.dropped = 0
        self._rate = config.sampling_config.sampling_rate
        self._random = random.Random(seed)
        self._lock = threading.Lock()
        self._warned_at: float | None = None
        self._queue: queue.Queue = queue.Queue(maxsize=max(queue_size, 1))  # (record, bytes) pairs
        self._queue_bytes, self._queued_bytes = queue_bytes, 0
        try:
            self._writer = tf.io.TFRecordWriter(str(self.path))
        except tf.errors.OpError as error:
            raise OSError(f"model {model_name}: cannot write the request log {self.path}: {error.message}") from None
        self._thread = threading.Thread(target=self._write, name=f"request-log-{model_name}", daemon=True)
        self._thread.start()
        log.info("model %s: logging %g of requests to %s", model_name, self._rate, self.path)

    def log(self, field: str, request: Any, response: Any) -> None:
        with self._lock:
            if not self._random.random() < self._rate:  # random() < 1.0 always: rate 1 logs every request
                return
            size = request.ByteSize() + response.ByteSize()
            full = self._queued_bytes > 0 and self._queued_bytes + size > self._queue_bytes
            if not full:
                self._queued_bytes += size
        if full:
            self._drop()
            return
        record = prediction_log_pb2.PredictionLog()
        entry = getattr(record, field)
        entry.request.CopyFrom(request)  # copied now: the request and response are the RPC's, not ours
        entry.response.CopyFrom(response)
        metadata = record.log_metadata
        answered = response.results[0].model_spec if field == "multi_inference_log" else response.model_spec
        metadata.model_spec.CopyFrom(answered)
        metadata.sampling_config.CopyFrom(self.config.sampling_config)
        metadata.saved_model_tags.append(SERVING_TAG)
        metadata.timestamp_secs = int(time.time())
        try:
            self._queue.put_nowait((record, size))
        except queue.Full:
            self._written(size)
            self._drop()

    def close(self) -> None:
        self._queue.put(_STOP)  # behind everything queued: the writer writes it all first
        self._thread.join()
        self._writer.close()
        log.info("model %s: request log %s closed (%d dropped)", self.model_name, self.path, self.dropped)

    def _write(self) -> None:
        while True:
            item = self._queue.get()
            if item is _STOP:
                return
            record, size = item
            try:
                self._writer.write(record.SerializeToString())
                if self._queue.empty():  # caught up: make what is written readable
                    self._writer.flush()
            except tf.errors.OpError as error:  # a full disk, say: keep draining, so requests never wait
                self._drop(f"cannot write {self.path}: {error.message}")
            finally:
                self._written(size)

    def _written(self, size: int) -> None:
        with self._lock:
            self._queued_bytes -= size

    def _drop(self, reason: str = "the writer is behind") -> None:
        now = time.monotonic()
        with self._lock:
            self.dropped += 1
            warn = self._warned_at is None or now - self._warned_at >= WARNING_INTERVAL_S
            if warn:
                self._warned_at = now
        if self._metrics is not None:
            self._metrics.request_log_dropped.labels(model_name=self.model_name).inc()
        if warn:
            log.warning("model %s: request log: %s; %d sampled requests dropped so far (warned at most every %.0f s)",
                        self.model_name, reason, self.dropped, WARNING_INTERVAL_S)


def _new_path(prefix: str, model_name: str) -> Path:
    """<prefix>-<model>-<UTC time>-<pid>.tfrecord, with -1, -2... if that file exists (a reload within a second)."""
    stem = f"{prefix}-{model_name}-{time.strftime('%Y%m%dT%H%M%SZ', time.gmtime())}-{os.getpid()}"
    path, n = Path(f"{stem}.tfrecord"), 0
    while path.exists():
        n += 1
        path = Path(f"{stem}-{n}.tfrecord")
    return path.absolute()
