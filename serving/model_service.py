"""tensorflow.serving.ModelService: GetModelStatus and HandleReloadConfigRequest.

Codes and wording follow TF Serving's get_model_status_impl.cc and model_service_impl.cc. Status
lists every version the server has seen of a model, newest first, as its ServableStateMonitor does:
unloaded versions and versions that failed to load stay listed in state END, a failed one with its
error_code and error_message. A reload replaces the served model list (ModelManager.reload_config);
a refused config leaves the served models as they were.

Unlike TF Serving, where any client of the port may reload, the operator decides (ReloadPolicy, from
python -m serving's flags; the threat model is in docs/operations.md): a reload over the network is
UNIMPLEMENTED unless allowed, and then each base_path must lie under one of the operator's roots
(PERMISSION_DENIED otherwise, decided before the server looks at the path), a logging_config (where
request logs are written) only ever comes from the operator's own config, and reloads run one at a
time (another one meanwhile is UNAVAILABLE), so they hold at most one thread of the worker pool. A
client's reload is bounded too: at least one model, at most MAX_RELOAD_MODELS, each model directory
under one name, so it can neither unload the server nor load the same model under endless names.
Messages to clients carry no absolute server paths: they would tell a client which paths exist.
"""

from __future__ import annotations

import asyncio
import concurrent.futures
import dataclasses
import logging
import os
import re
import threading
from typing import Any, Sequence

import grpc
from tensorflow_serving.apis import get_model_status_pb2, model_management_pb2, model_service_pb2_grpc
from tensorflow_serving.config import model_server_config_pb2

from serving.errors import (InvalidArgument, NotFound, ServingError, Unavailable, Unimplemented, handles_errors,
                            require_model_spec, short)
from serving.manager.model_config import ModelConfigError, validate_model_config
from serving.manager.model_manager import ModelManager

log = logging.getLogger(__name__)

ALLOW_FLAG = "--allow_network_model_config_reload"
MAX_RELOAD_MODELS = 64  # models one network reload may list
ROOTS_FLAG = "--model_config_reload_roots"
# An absolute path inside a message: a '/' not preceded by a word character (so "tensorflow/serving/classify"
# stays), up to the next blank, quote, bracket or separator.
_ABSOLUTE_PATH = re.compile(r"(?<![\w.~-])/[^\s'\":,;()\[\]{}]+")


def without_paths(message: str) -> str:
    """message with every absolute path replaced by '<path>', for answers to clients."""
    return _ABSOLUTE_PATH.sub("<path>", message)


@dataclasses.dataclass(frozen=True)
class ReloadPolicy:
    """Whether HandleReloadConfigRequest may change the served models, and from which directories."""

    allowed: bool = False  # --allow_network_model_config_reload
    roots: tuple[str, ...] = ()  # --model_config_reload_roots: absolute directories

    def admit(self, config: model_server_config_pb2.ModelServerConfig,
              current: dict[str, model_server_config_pb2.ModelConfig]) -> model_server_config_pb2.ModelServerConfig:
        """The config to apply for a client's request, every logging_config the operator's (current's).

        Raises:
            ServingError: UNIMPLEMENTED if reloads are not allowed, INVALID_ARGUMENT for a config TF Serving
                refuses, PERMISSION_DENIED for a client's logging_config or a base_path outside the roots.
        """
        if not self.allowed:
            raise Unimplemented(f"HandleReloadConfigRequest is disabled on this server; the operator can enable "
                                f"it with {ALLOW_FLAG}")
        admitted = model_server_config_pb2.ModelServerConfig()
        admitted.CopyFrom(config)
        for model in admitted.model_config_list.config:
            operator = current.get(model.name)
            ours = operator.logging_config if operator is not None and operator.HasField("logging_config") else None
            if model.HasField("logging_config") and model.logging_config != ours:
                raise ServingError(f"model {model.name}: logging_config can only come from the operator's model "
                                   "config file; leave it out (the model keeps its current one)",
                                   grpc.StatusCode.PERMISSION_DENIED)
            if ours is not None:
                model.logging_config.CopyFrom(ours)
        previous = model_server_config_pb2.ModelServerConfig()
        previous.model_config_list.config.extend(current.values())
        try:  # TF Serving's own checks first, in ServerCore::ReloadConfig's order: names, absolute paths, a
            validate_model_config(admitted, previous)  # platform change, platforms (no file-system access)
        except ModelConfigError as error:
            raise ServingError(without_paths(str(error)), error.code) from None
        _check_bounds(admitted.model_config_list.config)
        for model in admitted.model_config_list.config:
            if not self._under_roots(model.base_path):
                raise ServingError(f"model {model.name}: base_path is outside the directories this server loads "
                                   f"models from over the network ({ROOTS_FLAG})", grpc.StatusCode.PERMISSION_DENIED)
        return admitted

    def _under_roots(self, base_path: str) -> bool:
        """Whether base_path is a root or lies below one: by name first, so that the server touches no path
        outside the roots, then with symlinks resolved, so that a link cannot lead out of them."""
        if "://" in base_path or not os.path.isabs(base_path):
            return False
        path = os.path.normpath(base_path)
        roots = [root for root in map(os.path.normpath, self.roots) if _inside(root, path)]
        return any(_inside(os.path.realpath(root), os.path.realpath(path)) for root in roots)


def _check_bounds(models: Sequence[model_server_config_pb2.ModelConfig]) -> None:
    """A client's reload keeps at least one model, at most MAX_RELOAD_MODELS, and each model directory under one
    name, so it can neither unload the server nor load the same models again and again under new names.

    Raises:
        ServingError: FAILED_PRECONDITION for an empty list, INVALID_ARGUMENT for the others.
    """
    if not models:
        raise ServingError("a reload over the network must keep at least one model; the operator's model config "
                           "file can serve none", grpc.StatusCode.FAILED_PRECONDITION)
    if len(models) > MAX_RELOAD_MODELS:
        raise InvalidArgument(f"a reload over the network may list at most {MAX_RELOAD_MODELS} models, got "
                              f"{len(models)}")
    served: dict[str, str] = {}
    for model in models:
        path = os.path.normpath(model.base_path)
        if path in served:
            raise InvalidArgument(f"model {short(model.name)}: its base_path is already model {short(served[path])}'s "
                                  "in this config; a reload serves each model directory under one name")
        served[path] = model.name


def _inside(root: str, path: str) -> bool:
    return path == root or path.startswith(root.rstrip(os.sep) + os.sep)


class ModelService(model_service_pb2_grpc.ModelServiceServicer):
    """Coroutines on the server's event loop, as PredictionService's; a reload runs on the worker pool.

    Args:
        manager: the served models.
        reload_policy: whether (and from where) HandleReloadConfigRequest may reload (default: never).
        executor: the front end's worker pool, where a reload waits for its models to load; None: the
            event loop's default executor.
    """

    def __init__(self, manager: ModelManager, reload_policy: ReloadPolicy | None = None,
                 executor: concurrent.futures.Executor | None = None) -> None:
        self._manager = manager
        self._reload_policy = reload_policy or ReloadPolicy()
        self._executor = executor
        self._reloading = threading.Lock()  # held from the request until its reload ends

    @handles_errors
    async def GetModelStatus(self, request: get_model_status_pb2.GetModelStatusRequest,
                             context: Any) -> get_model_status_pb2.GetModelStatusResponse:
        """The requested version, or every version, of one model with its state and status."""
        model_spec = require_model_spec(request)
        name = model_spec.name
        states = self._manager.version_states(name)
        if model_spec.HasField("version"):
            wanted = model_spec.version.value
            if wanted not in states:
                raise NotFound(f"Could not find version {wanted} of model {short(name)}")
            versions = [wanted]
        elif not states:
            raise NotFound(f"Could not find any versions of model {short(name)}")
        else:
            versions = sorted(states, reverse=True)
        response = get_model_status_pb2.GetModelStatusResponse()
        for version in versions:
            state = states[version]
            status = response.model_version_status.add(version=version, state=state.state)
            status.status.error_code = state.error_code  # 0 (OK) with an empty message, as TF Serving sends
            status.status.error_message = without_paths(state.error_message)
        return response

    @handles_errors
    async def HandleReloadConfigRequest(self, request: model_management_pb2.ReloadConfigRequest,
                                        context: Any) -> model_management_pb2.ReloadConfigResponse:
        """Serves request.config's model list from now on; returns once the models it adds are AVAILABLE."""
        if self._reload_policy.allowed and request.config.WhichOneof("config") != "model_config_list":
            raise InvalidArgument("ServerModelConfig type not supported by HandleReloadConfigRequest. "
                                  "Only ModelConfigList is currently supported")
        try:
            config = self._reload_policy.admit(request.config, self._manager.model_configs())
        except ServingError as error:
            log.info("HandleReloadConfigRequest refused: %s", error)  # one line: a client's mistake, or a probe
            raise
        if not self._reloading.acquire(blocking=False):
            raise Unavailable("another HandleReloadConfigRequest is in progress; retry once it has finished")
        names = [model.name for model in config.model_config_list.config]
        log.info("HandleReloadConfigRequest: models %s", ", ".join(names) or "(none)")
        try:
            await asyncio.get_running_loop().run_in_executor(self._executor, self._reload, config)
        except ModelConfigError as error:
            log.error("ReloadConfig failed: %s", error)
            raise ServingError(without_paths(str(error)), error.code) from None
        response = model_management_pb2.ReloadConfigResponse()
        response.status.error_code = 0
        return response

    def _reload(self, config: model_server_config_pb2.ModelServerConfig) -> None:
        """On the worker pool: the reload, then the next may start (even if the client went away meanwhile)."""
        try:
            self._manager.reload_config(config)
        finally:
            self._reloading.release()
