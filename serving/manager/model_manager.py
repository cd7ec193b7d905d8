"""Which Runner answers a request, and which versions are loaded: TF Serving's model manager.

The manager serves the models of a ModelServerConfig. For each model it loads the version
directories the model's version policy selects (model_config.py) and keeps that true as things change:

- reload_config(config): the new model list replaces the old one (start-up, HandleReloadConfigRequest,
  --model_config_file polling); it returns once the models new to the config are AVAILABLE.
- poll_file_system(): new version directories are loaded and versions the policy no longer selects
  are unloaded; a background thread runs it every --file_system_poll_wait_seconds.

Loads and unloads follow TF Serving's AvailabilityPreservingPolicy (core/availability_preserving_policy.cc):
a version that leaves the policy is unloaded only once a version the policy selects is AVAILABLE (or
the policy selects none), so a model never stops answering during a swap. Each version goes
START -> LOADING -> AVAILABLE -> UNLOADING -> END, as GetModelStatus reports it; warmup
(serving/servable/warmup.py) runs before AVAILABLE. A load that fails (warmup included) is tried again
max_num_load_retries times, load_retry_interval_s apart (TF Serving's --max_num_load_retries and
--load_retry_interval_micros), so a version copied in non-atomically loads once its copy is complete;
the version stays LOADING meanwhile. Then it ends in END with its error status and, as in TF Serving,
is not tried again while the policy keeps selecting it. Directories under a base path that are not
versions are ignored, with one warning each.

Requests: resolve(model_spec) -> (version, Runner), TF Serving's Latest/Specific/label lookup and
wording. A Runner resolved inside request_scope() (the gRPC server wraps every RPC in one) stays
open until the scope ends: unloading removes the version at once, but runner.close() waits for the
requests that hold it.
"""

from __future__ import annotations

import collections
import contextlib
import contextvars
import dataclasses
import logging
import os
import threading
import time
from pathlib import Path
from typing import Callable, Iterator

import grpc
import tensorflow as tf
from tensorflow_serving.apis import get_model_status_pb2, model_pb2
from tensorflow_serving.config import model_server_config_pb2

from serving.servable.runner import Runner, RunnerError
from serving.manager import model_config
from serving.servable import warmup
from serving.errors import InvalidArgument, NotFound, ServingError, code_name, first_line, short, status_for
from serving.manager.model_config import ModelConfigError

log = logging.getLogger(__name__)

_State = get_model_status_pb2.ModelVersionStatus
START, LOADING, AVAILABLE, UNLOADING, END = _State.START, _State.LOADING, _State.AVAILABLE, _State.UNLOADING, _State.END
_MAX_EVENTS = 10000  # load/unload events kept for events(); listeners read them long before that many pile up


@dataclasses.dataclass(frozen=True)
class VersionStatus:
    """One version as GetModelStatus reports it: state, and the error that ended it (error_code 0: OK)."""

    version: int
    state: int  # get_model_status_pb2.ModelVersionStatus.State
    error_code: int = 0  # google.rpc.Code / tensorflow.error.Code value
    error_message: str = ""


@dataclasses.dataclass(frozen=True)
class ModelEvent:
    """A version that loaded, failed to load or finished unloading; seconds is the load's duration (warmup included)."""

    model_name: str
    version: int
    event: str  # "load", "load_failed" or "unload"
    seconds: float = 0.0


@dataclasses.dataclass
class _Version:
    version: int
    path: Path
    state: int = START
    error_code: int = 0
    error_message: str = ""
    runner: Runner | None = None
    in_flight: int = 0  # request scopes holding runner


@dataclasses.dataclass
class _Model:
    config: model_server_config_pb2.ModelConfig
    configured: bool = True  # False once a reload drops it: its versions unload, their states stay listed
    versions: dict[int, _Version] = dataclasses.field(default_factory=dict)
    aspired: set[int] = dataclasses.field(default_factory=set)  # what the policy selected at the last poll
    problem: str = ""  # why the policy selects nothing (no base path, no versions), for errors and the log
    odd_names: set[str] = dataclasses.field(default_factory=set)  # non-version directories already warned about

    @property
    def name(self) -> str:
        return self.config.name


class ModelManager:
    """The configured models and their versions; thread-safe, and cheap to resolve while loads run.

    Args:
        file_system_poll_wait_seconds: seconds between file-system polls once start_polling() is called;
            0 means no polling after start-up (TF Serving's default is 1).
        allow_version_labels_for_unavailable_models: TF Serving's flag: a label that is new (or keeps
            its version) may point at a version that is not AVAILABLE yet.
        enable_model_warmup: replay assets.extra/tf_serving_warmup_requests before AVAILABLE.
        num_request_iterations_for_warmup: times each warmup record is replayed (at least 1).
        max_num_load_retries: times a failed load is tried again (TF Serving's flag; python -m serving
            defaults it to TF Serving's 5, this class to 0, so that in-process callers fail fast).
        load_retry_interval_s: seconds between those tries (TF Serving: 60; 0 or less: no wait).
    """

    def __init__(self, *, file_system_poll_wait_seconds: float = 1.0,
                 allow_version_labels_for_unavailable_models: bool = False,
                 enable_model_warmup: bool = True, num_request_iterations_for_warmup: int = 1,
                 max_num_load_retries: int = 0, load_retry_interval_s: float = 60.0) -> None:
        self._poll_wait_s = file_system_poll_wait_seconds
        self._load_retries = max(max_num_load_retries, 0)
        self._retry_interval_s = max(load_retry_interval_s, 0.0)
        self._allow_unavailable_labels = allow_version_labels_for_unavailable_models
        self._warmup = enable_model_warmup
        self._warmup_iterations = max(num_request_iterations_for_warmup, 1)
        self._models: dict[str, _Model] = {}
        self._labels: dict[str, dict[str, int]] = {}
        self._config: model_server_config_pb2.ModelServerConfig | None = None
        self._lock = threading.Lock()  # guards the maps and version states; never held while loading
        self._reconfiguring = threading.Lock()  # one reload or poll at a time; held while loading
        # The versions the current request holds: per thread and per asyncio task alike (a ContextVar).
        self._held: contextvars.ContextVar[list[_Version] | None] = contextvars.ContextVar("held", default=None)
        self._listeners: list[Callable[[ModelManager], None]] = []
        self._stop = threading.Event()
        self._threads: list[threading.Thread] = []
        self._events: collections.deque[tuple[int, ModelEvent]] = collections.deque(maxlen=_MAX_EVENTS)
        self._event_count = 0

    def resolve(self, model_spec: model_pb2.ModelSpec) -> tuple[int, Runner]:
        """The (version, Runner) a request's model_spec names; the latest AVAILABLE version when none is given.

        Raises:
            InvalidArgument: no model name, or a version_label the config does not define.
            NotFound: no such model, or the version (or the label's version) is not AVAILABLE.
        """
        name = model_spec.name
        if not name:
            raise InvalidArgument("ModelSpec has no name specified.")
        choice = model_spec.WhichOneof("version_choice")
        with self._lock:
            version = None
            if choice == "version":
                version = model_spec.version.value
            elif choice == "version_label":
                version = self._labels.get(name, {}).get(model_spec.version_label)
                if version is None:
                    raise InvalidArgument(f"Unrecognized servable version label: {short(model_spec.version_label)}")
            record = self._available(name, version)
            if record is None:
                wanted = f"Latest({short(name)})" if version is None else f"Specific({short(name)}, {version})"
                raise NotFound(f"Servable not found for request: {wanted}")
            held = self._held.get()
            if held is not None:
                record.in_flight += 1
                held.append(record)
            return record.version, record.runner

    @contextlib.contextmanager
    def request_scope(self) -> Iterator[None]:
        """Runners resolved in this block (on this thread, or in this asyncio task) stay open until it ends,
        even if unloaded meanwhile."""
        held: list[_Version] = []
        token = self._held.set(held)
        try:
            yield
        finally:
            self._held.reset(token)
            if held:
                self._release(held)

    @property
    def model_names(self) -> list[str]:
        """The models of the current config."""
        with self._lock:
            return sorted(name for name, model in self._models.items() if model.configured)

    def versions(self, model_name: str) -> dict[int, Runner]:
        """The AVAILABLE versions of a model; empty if there are none or the model is unknown."""
        with self._lock:
            model = self._models.get(model_name)
            return {v: r.runner for v, r in model.versions.items() if r.state == AVAILABLE} if model else {}

    def version_states(self, model_name: str) -> dict[int, VersionStatus]:
        """Every version the manager has seen of a model, unloaded and failed ones included (state END)."""
        with self._lock:
            model = self._models.get(model_name)
            records = list(model.versions.values()) if model else []
            return {r.version: VersionStatus(r.version, r.state, r.error_code, r.error_message) for r in records}

    def add_listener(self, callback: Callable[["ModelManager"], None]) -> None:
        """Calls callback(manager) after versions become AVAILABLE or END and after each reload."""
        self._listeners.append(callback)

    def remove_listener(self, callback: Callable[["ModelManager"], None]) -> None:
        """Stops calling a listener (a server that stopped); one that is not listening is ignored."""
        if callback in self._listeners:
            self._listeners.remove(callback)

    def events(self, since: int = 0) -> tuple[int, list[ModelEvent]]:
        """(The next event number, the load/unload events numbered since and later; the last 10000 are kept).

        A listener keeps the number it got and passes it next time, so it sees each event once, the
        ones from before it subscribed included (events(0)).
        """
        with self._lock:
            return self._event_count, [event for number, event in self._events if number >= since]

    def model_configs(self) -> dict[str, model_server_config_pb2.ModelConfig]:
        """The ModelConfig of every configured model, by name (copies: changing them changes nothing)."""
        with self._lock:
            configs = {name: model.config for name, model in self._models.items() if model.configured}
        copies = {}
        for name, config in configs.items():
            copies[name] = model_server_config_pb2.ModelConfig()
            copies[name].CopyFrom(config)
        return copies

    def reload_config(self, config: model_server_config_pb2.ModelServerConfig) -> None:
        """Makes config's model list the served one: adds, removes and re-polices models, loading what it selects.

        Returns once every model new to the config is AVAILABLE (its latest selected version). An
        invalid config changes nothing; an empty one (no model_config_list) is ignored, as in TF Serving.

        Raises:
            ModelConfigError: INVALID_ARGUMENT for a config TF Serving refuses, FAILED_PRECONDITION for a
                version label on a version that is not AVAILABLE, UNKNOWN when a new model did not
                become available (the config is applied all the same; the message says why).
        """
        if config.WhichOneof("config") is None:
            log.info("Taking no action for empty config.")
            return
        with self._reconfiguring:
            model_config.validate_model_config(config, self._config)
            labels = self._check_labels(config)
            with self._lock:
                new_names = self._apply(config, labels)
            for model in list(self._models.values()):
                self._poll_model(model)
            failures = [reason for name in new_names if (reason := self._unavailable(self._models[name]))]
        self._notify()
        if failures:
            raise ModelConfigError(f"{len(failures)} model(s) did not become available: {', '.join(failures)}",
                                   grpc.StatusCode.UNKNOWN)

    def poll_file_system(self) -> None:
        """Loads new version directories and unloads versions the policies no longer select, once."""
        with self._reconfiguring:
            for model in list(self._models.values()):
                if self._stop.is_set():
                    return
                try:
                    self._poll_model(model)
                except Exception:  # noqa: BLE001 - one model's trouble must not stop the others' polling
                    log.exception("polling model %s failed", model.name)

    def start_polling(self) -> None:
        """Polls the file system every file_system_poll_wait_seconds in a daemon thread (none if 0)."""
        if self._poll_wait_s > 0:
            self._start_thread("file-system-poll", self.poll_file_system, self._poll_wait_s)

    def watch_config_file(self, path: str | os.PathLike, poll_wait_seconds: float) -> None:
        """Re-reads a --model_config_file every poll_wait_seconds and reloads it when it changed.

        A file that no longer parses, or a config that is refused, is logged and the current one stays.
        """
        def reload_if_changed() -> None:
            try:
                config = model_config.read_model_config(path)
                if config != self._config:
                    log.info("model config file %s changed; reloading", path)
                    self.reload_config(config)
            except ModelConfigError as error:
                log.error("reloading --model_config_file %s failed: %s", path, error)

        self._start_thread("model-config-poll", reload_if_changed, poll_wait_seconds)

    def stop(self, timeout_s: float = 30.0) -> None:
        """Stops the polling threads (a load in progress finishes first); loaded versions keep serving."""
        self._stop.set()
        for thread in self._threads:
            thread.join(timeout_s)

    def _available(self, name: str, version: int | None) -> _Version | None:
        """The AVAILABLE record for (name, version), or the highest AVAILABLE one; caller holds _lock."""
        model = self._models.get(name)
        if model is None:
            return None
        if version is not None:
            record = model.versions.get(version)
            return record if record and record.state == AVAILABLE else None
        available = [v for v, r in model.versions.items() if r.state == AVAILABLE]
        return model.versions[max(available)] if available else None

    def _check_labels(self, config: model_server_config_pb2.ModelServerConfig) -> dict[str, dict[str, int]]:
        """The new label map, or FAILED_PRECONDITION as server_core.cc's UpdateModelVersionLabelMap words it."""
        labels: dict[str, dict[str, int]] = {}
        with self._lock:
            for model_config_ in config.model_config_list.config:
                name = model_config_.name
                model = self._models.get(name)
                for label, version in sorted(model_config_.version_labels.items()):
                    allowed = False
                    if self._allow_unavailable_labels:  # a new label, or one that keeps its version
                        allowed = self._labels.get(name, {}).get(label, version) == version
                    record = model.versions.get(version) if model else None
                    if not allowed and (record is None or record.state != AVAILABLE):
                        raise ModelConfigError(f"Request to assign label to version {version} of model {name}, "
                                               "which is not currently available for inference",
                                               grpc.StatusCode.FAILED_PRECONDITION)
                    labels.setdefault(name, {})[label] = version
        return labels

    def _apply(self, config: model_server_config_pb2.ModelServerConfig,
               labels: dict[str, dict[str, int]]) -> list[str]:
        """Installs a checked config; returns the names of models new to it. Caller holds _lock."""
        previous = {name for name, model in self._models.items() if model.configured}
        for model in self._models.values():
            model.configured = False
        new_names = []
        for entry in config.model_config_list.config:
            copy = model_server_config_pb2.ModelConfig()
            copy.CopyFrom(entry)
            model = self._models.get(entry.name)
            if entry.name not in previous:
                new_names.append(entry.name)
            if model is None:
                self._models[entry.name] = _Model(copy)
            else:
                model.config, model.configured = copy, True
            log.info("model %s: base path %s, version policy %s", entry.name, entry.base_path,
                     model_config.describe_policy(entry))
        self._labels = labels
        self._config = model_server_config_pb2.ModelServerConfig()
        self._config.CopyFrom(config)
        return new_names

    def _poll_model(self, model: _Model) -> None:
        """Loads the versions model's policy selects that are not loaded, then unloads the ones it dropped."""
        on_disk: dict[int, Path] = {}
        if model.configured:
            try:
                on_disk = model_config.version_dirs(model.config)
            except ModelConfigError as error:  # TF Serving changes nothing for a base path it cannot read
                self._note_problem(model, str(error))
                return
            self._note_odd_names(model)
        aspired = model_config.aspired_versions(model.config, on_disk) if model.configured else {}
        if model.configured:
            self._note_problem(model, "" if aspired else model_config.no_versions_message(model.config, on_disk))
        to_load = [v for v in sorted(aspired, reverse=True) if self._needs_load(model, v)]  # newest first
        with self._lock:
            for version in to_load:
                model.versions[version] = _Version(version, aspired[version])
        for version in to_load:
            self._load(model, model.versions[version])
        model.aspired = set(aspired)
        self._unload_unaspired(model)

    def _needs_load(self, model: _Model, version: int) -> bool:
        record = model.versions.get(version)
        if record is None:
            return True
        if record.state != END:
            return False
        return not (record.error_code and version in model.aspired)  # its retries are spent

    def _load(self, model: _Model, record: _Version) -> None:
        """LOADING -> (warmup) -> AVAILABLE, or END with the error status once the retries are spent.

        As TF Serving's LoaderHarness::Load (core/loader_harness.cc, util/retrier.cc): up to
        max_num_load_retries more tries, load_retry_interval_s apart, stopped early when the policy no
        longer selects the version (BasicManager::CancelLoadServableRetry) or the manager stops.
        """
        with self._lock:
            record.state = LOADING
        attempts = self._load_retries + 1
        for attempt in range(1, attempts + 1):
            if attempt > 1:
                if self._stop.wait(self._retry_interval_s) or not self._still_aspired(model, record.version):
                    break
                log.info("retrying load of model %s version %d (retry %d of %d)", model.name, record.version,
                         attempt - 1, self._load_retries)
            else:
                log.info("loading model %s version %d from %s", model.name, record.version, record.path)
            started = time.monotonic()
            try:
                runner = self._load_runner(model, record)
            except Exception as error:  # noqa: BLE001 - any failure is this version's status, never the server's
                code, message = load_status(error)
                seconds = time.monotonic() - started
                retry = f"; retrying in {self._retry_interval_s:g} s" if attempt < attempts else ""
                log.error("model %s version %d failed to load: %s: %s%s", model.name, record.version,
                          code_name(code), message, retry)
                continue
            with self._lock:
                record.state, record.runner = AVAILABLE, runner
                self._add_event(ModelEvent(model.name, record.version, "load", time.monotonic() - started))
            log.info("model %s version %d is AVAILABLE", model.name, record.version)
            self._notify()
            return
        with self._lock:
            record.state, record.error_code, record.error_message = END, code, message
            self._add_event(ModelEvent(model.name, record.version, "load_failed", seconds))
        self._notify()

    def _load_runner(self, model: _Model, record: _Version) -> Runner:
        """One try: the Runner of a version, warmed up."""
        runner = Runner.load(record.path, model_name=model.name)
        if self._warmup:
            try:
                warmup.run_warmup(runner, record.path, num_request_iterations=self._warmup_iterations)
            except Exception:
                _close(runner)
                raise
        return runner

    def _still_aspired(self, model: _Model, version: int) -> bool:
        """Whether the policy still selects a version, by a fresh look at the base path (before a retry)."""
        if not model.configured:
            return False
        try:
            return version in model_config.aspired_versions(model.config, model_config.version_dirs(model.config))
        except ModelConfigError:
            return False

    def _unload_unaspired(self, model: _Model) -> None:
        """AvailabilityPreservingPolicy: unload what the policy dropped, but never the last version serving."""
        with self._lock:
            available = {v: r for v, r in model.versions.items() if r.state == AVAILABLE}
        dropped = sorted(v for v in available if v not in model.aspired)
        if model.aspired and not any(v in available for v in model.aspired):
            dropped = dropped[:-1]  # keep the newest serving until a selected version is AVAILABLE
        for version in dropped:
            self._unload(model, available[version])

    def _unload(self, model: _Model, record: _Version) -> None:
        """AVAILABLE -> UNLOADING at once (no new requests); -> END once the requests holding it finish."""
        with self._lock:
            record.state = UNLOADING
            runner = self._take_idle_runner(record)
        log.info("unloading model %s version %d", model.name, record.version)
        if runner is not None:
            self._finish_unload(model.name, record, runner)
        else:
            self._notify()  # listeners (health, batch queues) see UNLOADING now, not at END

    def _release(self, held: list[_Version]) -> None:
        """Ends a request scope: finishes unloads that were waiting for it."""
        idle = []
        with self._lock:
            for record in held:
                record.in_flight -= 1
                runner = self._take_idle_runner(record)
                if runner is not None:
                    idle.append((record, runner))
        for record, runner in idle:
            self._finish_unload(runner.model_name, record, runner)

    def _take_idle_runner(self, record: _Version) -> Runner | None:
        """The runner of an UNLOADING version that no request holds, exactly once; caller holds _lock."""
        if record.state != UNLOADING or record.in_flight or record.runner is None:
            return None
        runner, record.runner = record.runner, None
        return runner

    def _finish_unload(self, model_name: str, record: _Version, runner: Runner) -> None:
        _close(runner)
        with self._lock:
            record.state = END
            self._add_event(ModelEvent(model_name, record.version, "unload"))
        log.info("model %s version %d unloaded", model_name, record.version)
        self._notify()

    def _unavailable(self, model: _Model) -> str | None:
        """Why a model's latest selected version is not AVAILABLE, in TF Serving's words; None if it is."""
        if not model.aspired:
            return f"{{name: {model.name}}} due to error: {model.problem}"
        latest = max(model.aspired)
        with self._lock:
            record = model.versions[latest]
            if record.state == AVAILABLE:
                return None
            error = f"{code_name(record.error_code)}: {record.error_message}"
        return f"{{name: {model.name} version: {latest}}} due to error: {error}"

    def _add_event(self, event: ModelEvent) -> None:
        """Numbers and keeps one event; caller holds _lock."""
        self._events.append((self._event_count, event))
        self._event_count += 1

    def _note_odd_names(self, model: _Model) -> None:
        """One warning per directory under the base path that is not a version (not one per poll)."""
        odd = set(model_config.odd_version_names(model.config))
        for name in sorted(odd - model.odd_names):
            log.warning("model %s: ignoring directory %r under its base path: a version's name is plain decimal "
                        "digits that fit in int64", model.name, name)
        model.odd_names = odd

    def _note_problem(self, model: _Model, problem: str) -> None:
        if problem and problem != model.problem:
            log.warning("model %s: %s", model.name, problem)
        model.problem = problem

    def _notify(self) -> None:
        for callback in list(self._listeners):
            try:
                callback(self)
            except Exception:  # noqa: BLE001 - a listener must not break loading
                log.exception("model manager listener failed")

    def _start_thread(self, name: str, function: Callable[[], None], interval_s: float) -> None:
        def loop() -> None:
            while not self._stop.wait(interval_s):
                try:
                    function()
                except Exception:  # noqa: BLE001 - keep polling
                    log.exception("%s failed", name)

        thread = threading.Thread(target=loop, name=name, daemon=True)  # never keeps the process alive
        thread.start()
        self._threads.append(thread)


def load_status(error: Exception) -> tuple[int, str]:
    """The (status code, one-line message) GetModelStatus reports for a version that failed to load."""
    cause = error.__cause__
    if isinstance(error, warmup.WarmupError):
        code = error.code
    elif isinstance(error, FileNotFoundError):
        code = grpc.StatusCode.NOT_FOUND
    elif isinstance(error, (ServingError, tf.errors.OpError)):
        code = status_for(error)[0]
    elif isinstance(error, RunnerError) and isinstance(cause, tf.errors.OpError):
        code = status_for(cause)[0]  # a LoadError wrapping TF's own status
    elif isinstance(error, RunnerError):
        code = grpc.StatusCode.FAILED_PRECONDITION
    else:
        code = grpc.StatusCode.UNKNOWN
    return code.value[0], first_line(str(error), type(error).__name__)


def _close(runner: Runner) -> None:
    """runner.close() where the Runner has one: it waits for its running predict() calls, then frees the model."""
    close = getattr(runner, "close", None)
    if callable(close):
        try:
            close()
        except Exception:  # noqa: BLE001 - unloading must finish
            log.exception("closing model %s version %s failed", runner.model_name, runner.version)
