"""tensorflow.serving.ModelService: GetModelStatus and HandleReloadConfigRequest.

Codes and wording follow TF Serving's get_model_status_impl.cc and model_service_impl.cc. Status
lists every version the server has seen of a model, newest first, as its ServableStateMonitor does:
unloaded versions and versions that failed to load stay listed in state END, a failed one with its
error_code and error_message. A reload replaces the served model list (ModelManager.reload_config);
a refused config leaves the served models as they were.
"""

from __future__ import annotations

import logging

import grpc
from tensorflow_serving.apis import get_model_status_pb2, model_management_pb2, model_service_pb2_grpc

from serving.errors import InvalidArgument, NotFound, ServingError, handles_errors, require_model_spec
from serving.model_config import ModelConfigError
from serving.model_manager import ModelManager

log = logging.getLogger(__name__)


class ModelService(model_service_pb2_grpc.ModelServiceServicer):
    def __init__(self, manager: ModelManager) -> None:
        self._manager = manager

    @handles_errors
    def GetModelStatus(self, request: get_model_status_pb2.GetModelStatusRequest,
                       context: grpc.ServicerContext) -> get_model_status_pb2.GetModelStatusResponse:
        """The requested version, or every version, of one model with its state and status."""
        model_spec = require_model_spec(request)
        name = model_spec.name
        states = self._manager.version_states(name)
        if model_spec.HasField("version"):
            wanted = model_spec.version.value
            if wanted not in states:
                raise NotFound(f"Could not find version {wanted} of model {name}")
            versions = [wanted]
        elif not states:
            raise NotFound(f"Could not find any versions of model {name}")
        else:
            versions = sorted(states, reverse=True)
        response = get_model_status_pb2.GetModelStatusResponse()
        for version in versions:
            state = states[version]
            status = response.model_version_status.add(version=version, state=state.state)
            status.status.error_code = state.error_code  # 0 (OK) with an empty message, as TF Serving sends
            status.status.error_message = state.error_message
        return response

    @handles_errors
    def HandleReloadConfigRequest(self, request: model_management_pb2.ReloadConfigRequest,
                                  context: grpc.ServicerContext) -> model_management_pb2.ReloadConfigResponse:
        """Serves request.config's model list from now on; returns once the models it adds are AVAILABLE."""
        if request.config.WhichOneof("config") != "model_config_list":
            raise InvalidArgument("ServerModelConfig type not supported by HandleReloadConfigRequest. "
                                  "Only ModelConfigList is currently supported")
        names = [config.name for config in request.config.model_config_list.config]
        log.info("HandleReloadConfigRequest: models %s", ", ".join(names) or "(none)")
        try:
            self._manager.reload_config(request.config)
        except ModelConfigError as error:
            log.error("ReloadConfig failed: %s", error)
            raise ServingError(str(error), error.code) from None
        response = model_management_pb2.ReloadConfigResponse()
        response.status.error_code = 0
        return response
