"""Prometheus metrics (`--monitoring_config_file`): requests, latency, batches and their queue delay,
model load/unload events and load latency, the loaded versions' weights (bytes by dtype, with their
serving policy), dropped request-log records, non-finite outputs.

The file is TF Serving's MonitoringConfig text proto (monitoring_config.proto):
`prometheus_config { enable: true, path: "/monitoring/prometheus/metrics" }`; the metrics are served
on the REST port at that path, as TF Serving's http_server.cc does. All metrics live in one
CollectorRegistry per server, never prometheus_client's global one.

Label values come only from what the server serves, so clients cannot grow the registry: a request
naming a model, version or signature the model manager has not loaded is counted with that label set
to OTHER ("__other__"); an empty value (nothing named) stays empty.

tensorflow_serving_nonfinite_outputs counts NaN and Inf values in the outputs models return, per model,
version and output name (serving/numerics.py checks every answer).
"""

from __future__ import annotations

import dataclasses
import logging
import os
import threading
from typing import Any, Callable, Sequence

from prometheus_client import CollectorRegistry, Counter, Gauge, Histogram, generate_latest

from serving import text_proto

log = logging.getLogger(__name__)

DEFAULT_PATH = "/monitoring/prometheus/metrics"
OTHER = "__other__"  # the label value for a model, version or signature name the server does not serve
_LATENCY_BUCKETS = (0.001, 0.0025, 0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1.0, 2.5, 5.0, 10.0, 30.0)
_LOAD_BUCKETS = (0.1, 0.25, 0.5, 1.0, 2.5, 5.0, 10.0, 30.0, 60.0, 120.0, 300.0, 600.0)
_RATE_BUCKETS = (1, 5, 10, 25, 50, 100, 250, 500, 1000, 2500, 5000)  # tokens per second
_BATCH_BUCKETS = (1, 2, 4, 8, 16, 32, 64, 128, 256, 512, 1024)


class MonitoringConfigError(ValueError):
    """A --monitoring_config_file that cannot be read or parsed."""


# TF Serving's MonitoringConfig message (monitoring_config.proto, which the pip package lacks).
MonitoringConfigProto = text_proto.message_class(
    "serving/monitoring_config.proto", "tensorflow.serving.MonitoringConfig",
    {"PrometheusConfig": [("enable", 1, "bool"), ("path", 2, "string")],
     "MonitoringConfig": [("prometheus_config", 1, ".tensorflow.serving.PrometheusConfig")]})


@dataclasses.dataclass(frozen=True)
class MonitoringConfig:
    enable: bool = False
    path: str = DEFAULT_PATH


def read_monitoring_config(path: str | os.PathLike) -> MonitoringConfig:
    """Reads a --monitoring_config_file; an empty path keeps the default "/monitoring/prometheus/metrics"."""
    proto = text_proto.read_text_proto(path, MonitoringConfigProto, MonitoringConfigError,
                                       what="--monitoring_config_file")
    prometheus = proto.prometheus_config
    metrics_path = prometheus.path or DEFAULT_PATH
    if not metrics_path.startswith("/"):
        raise MonitoringConfigError(f"{path}: prometheus_config.path must start with '/', got {metrics_path!r}")
    return MonitoringConfig(enable=prometheus.enable, path=metrics_path)


class Metrics:
    """The server's metrics, in their own registry; every method is thread-safe."""

    def __init__(self, path: str = DEFAULT_PATH) -> None:
        self.path = path
        self.registry = CollectorRegistry(auto_describe=True)
        labels = ["model_name", "version", "signature_name", "api", "rpc", "status"]
        self.requests = Counter("tensorflow_serving_request_count", "Requests answered", labels,
                                registry=self.registry)
        self.latency = Histogram("tensorflow_serving_request_latency_seconds", "Time to answer a request",
                                 labels, buckets=_LATENCY_BUCKETS, registry=self.registry)
        self.nonfinite = Counter("tensorflow_serving_nonfinite_outputs", "NaN or Inf values in model outputs",
                                 ["model_name", "version", "output"], registry=self.registry)
        self.batch_size = Histogram("tensorflow_serving_batch_size", "Rows in each merged batch (before padding)",
                                    buckets=_BATCH_BUCKETS, registry=self.registry)
        self.batch_requests = Histogram("tensorflow_serving_batch_requests", "Requests merged into each batch",
                                        buckets=_BATCH_BUCKETS, registry=self.registry)
        self.batch_queue_delay = Histogram("tensorflow_serving_batch_queue_delay_seconds",
                                           "Time a request waits in a batch queue before its batch runs",
                                           buckets=_LATENCY_BUCKETS, registry=self.registry)
        self.model_events = Counter("tensorflow_serving_model_events",
                                    "Versions loaded (AVAILABLE), failing to load, or unloaded",
                                    ["model_name", "version", "event"], registry=self.registry)
        self.load_latency = Histogram("tensorflow_serving_model_load_latency_seconds",
                                      "Time to load a version, warmup included (successful loads)", ["model_name"],
                                      buckets=_LOAD_BUCKETS, registry=self.registry)
        self.weights = Gauge("tensorflow_serving_model_weights_bytes",
                             "Bytes of each AVAILABLE version's stored weights by dtype, with the policy it serves under",
                             ["model_name", "version", "policy", "dtype"], registry=self.registry)
        self._weights_labels: set[tuple[str, str, str, str]] = set()
        self.request_log_dropped = Counter("tensorflow_serving_request_log_dropped",
                                           "Sampled requests not logged because the log writer fell behind",
                                           ["model_name"], registry=self.registry)
        generation = ["model_name", "version"]
        self.generated_tokens = Counter("tensorflow_serving_generation_tokens", "Tokens generated for completions",
                                        generation, registry=self.registry)
        self.time_to_first_token = Histogram("tensorflow_serving_generation_time_to_first_token_seconds",
                                             "From a completion's arrival to its first token", generation,
                                             buckets=_LATENCY_BUCKETS, registry=self.registry)
        self.tokens_per_second = Histogram("tensorflow_serving_generation_tokens_per_second",
                                           "Each completion's tokens over its time from first token to last",
                                           generation, buckets=_RATE_BUCKETS, registry=self.registry)
        self.finished = Counter("tensorflow_serving_generation_finished",
                                "Completions' prompts by how they ended: stop, length, cancelled (the client left), "
                                "deadline_exceeded, internal", generation + ["reason"], registry=self.registry)
        self.decode_rows = Histogram("tensorflow_serving_generation_decode_rows", "Rows in each decode step",
                                     buckets=_BATCH_BUCKETS, registry=self.registry)
        self.decode_step_latency = Histogram("tensorflow_serving_generation_decode_step_seconds",
                                             "Time of each prefill and decode step", ["kind"],
                                             buckets=_LATENCY_BUCKETS, registry=self.registry)
        # {model name: (versions, signature names)} the manager has loaded; replaced whole, read without a lock.
        self._served: dict[str, tuple[frozenset[str], frozenset[str]]] = {}

    def observe_request(self, *, model_name: str, version: str, signature_name: str, api: str, rpc: str,
                        status: str, seconds: float) -> None:
        """Counts and times one answered request; names the server does not serve are labelled OTHER."""
        served = self._served
        versions, signatures = served.get(model_name, ((), ()))
        labels = dict(model_name=_served_value(model_name, served), version=_served_value(version, versions),
                      signature_name=_served_value(signature_name, signatures), api=api, rpc=rpc, status=status)
        self.requests.labels(**labels).inc()
        self.latency.labels(**labels).observe(seconds)

    def observe_generation(self, model_name: str, version: str, tokens: int, first_token_s: float,
                           seconds: float) -> None:
        """One answered completion (model and version are served ones: the request resolved them)."""
        self.generated_tokens.labels(model_name, version).inc(tokens)
        self.time_to_first_token.labels(model_name, version).observe(first_token_s)
        if tokens > 1 and seconds > first_token_s:
            self.tokens_per_second.labels(model_name, version).observe((tokens - 1) / (seconds - first_token_s))

    def observe_finish(self, model_name: str, version: str, reason: str) -> None:
        self.finished.labels(model_name, version, reason).inc()

    def observe_decode_step(self, kind: str, rows: int, seconds: float) -> None:
        """A decode loop's prefill or step (serving/generation/decoder.py)."""
        if kind != "prefill":
            self.decode_rows.observe(rows)
        self.decode_step_latency.labels(kind).observe(seconds)

    def observe_batch(self, requests: int, rows: int, queue_delays_s: Sequence[float] = ()) -> None:
        self.batch_requests.observe(requests)
        self.batch_size.observe(rows)
        for seconds in queue_delays_s:
            self.batch_queue_delay.observe(seconds)

    def follow_models(self, manager: Any) -> Callable[[Any], None]:
        """Counts the manager's load, load_failed and unload events, and times loads (ModelManager.events);
        keeps the model, version and signature names that request labels may take.

        Events from before this call count too, so the models loaded at start-up are in the metrics.
        """
        lock = threading.Lock()
        cursor = [0]

        def update(manager: Any) -> None:
            with lock:
                self._served = _served_names(manager, self._served)
                cursor[0], events = manager.events(cursor[0])
                for event in events:
                    self.model_events.labels(model_name=event.model_name, version=str(event.version),
                                             event=event.event).inc()
                    if event.event == "load":
                        self.load_latency.labels(model_name=event.model_name).observe(event.seconds)
                self._update_weights(manager)

        manager.add_listener(update)
        update(manager)
        return update

    def _update_weights(self, manager: Any) -> None:
        """One weights series per AVAILABLE version and dtype; an unloaded version's series go."""
        current = {}
        for name in manager.model_names:
            for version, runner in manager.versions(name).items():
                for dtype, size in runner.weights.items():
                    current[(name, str(version), runner.policy, dtype)] = size
        for labels in self._weights_labels - set(current):
            self.weights.remove(*labels)
        for labels, size in current.items():
            self.weights.labels(*labels).set(size)
        self._weights_labels = set(current)

    def exposition(self) -> bytes:
        """The registry in Prometheus' text format."""
        return generate_latest(self.registry)


def _served_value(value: str, served: Any) -> str:
    """value if it is empty or served, else OTHER."""
    return value if not value or value in served else OTHER


def _served_names(manager: Any, known: dict[str, tuple[frozenset[str], frozenset[str]]]
                  ) -> dict[str, tuple[frozenset[str], frozenset[str]]]:
    """known, plus the manager's models with every version it has seen and their signature names.

    Names are only added, never dropped: a series, once made, stays in the registry anyway, and what
    the operator's config and version directories name is bounded.
    """
    served = dict(known)
    for name in manager.model_names:
        versions, signatures = served.get(name, (frozenset(), frozenset()))
        runners = manager.versions(name).values()
        served[name] = (versions | {str(version) for version in manager.version_states(name)},
                        signatures | {signature for runner in runners for signature in runner.signature_defs})
    return served
