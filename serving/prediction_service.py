"""tensorflow.serving.PredictionService: Predict, Classify, Regress, MultiInference, GetModelMetadata.

A thin servicer: resolve the model, run serving/servable/inference.py on its Runner, and let errors.py turn
any failure into a status. Predict is a coroutine for the event-loop front ends (gRPC's grpc.aio and
REST's aiohttp); the other RPCs are plain functions their front ends run on worker threads. Status codes and wording follow TF Serving (prediction_service_impl.cc and
the files that serving/servable/inference.py cites; get_model_metadata_impl.cc for GetModelMetadata).
"""

from __future__ import annotations

import asyncio
import concurrent.futures
import functools
import logging
from typing import Any

import grpc
from tensorflow_serving.apis import (classification_pb2, get_model_metadata_pb2, inference_pb2, model_pb2,
                                     predict_pb2, prediction_service_pb2_grpc, regression_pb2)

from serving.servable.runner import Runner
from serving.servable import inference
from serving.batching.scheduler import Batcher
from serving.errors import InvalidArgument, handles_errors, require_model_spec
from serving.manager.model_manager import ModelManager
from serving.monitoring import Metrics
from serving.request_log import RequestLog

log = logging.getLogger(__name__)

SIGNATURE_DEF_FIELD = "signature_def"
# A Predict declaring more elements than this is decoded on the worker pool rather than on the event loop
# (64 Ki float32 elements decode in well under a millisecond).
INLINE_ELEMENTS = 65_536


def _accounted(service: "PredictionService", rpc: str, request: Any, response: Any, code: grpc.StatusCode,
               seconds: float) -> None:
    """After every request: counted (with metrics) and, if it succeeded, sampled (with a request log).

    The one place where requests are accounted, for gRPC and REST alike: REST calls these same methods.
    """
    service._observe(rpc, request, response, code, seconds)
    if code == grpc.StatusCode.OK and service._request_log is not None:
        service._log(rpc, request, response)


# A servicer method: any exception becomes a status (errors.handles_errors), and every request is accounted.
_served = handles_errors(on_answer=_accounted)


class PredictionService(prediction_service_pb2_grpc.PredictionServiceServicer):
    """Answers PredictionService RPCs from the models the manager resolves.

    Args:
        manager: the loaded models (only resolve(model_spec) -> (version, Runner) is used).
        enable_signature_method_name_check: TF Serving's flag of the same name (default off): refuse
            Classify/Regress on signatures whose method_name is not classify/regress.
        batcher: merges concurrent requests into shared Runner.predict calls (--enable_batching); None
            runs each request on its own.
        metrics: counts requests, latency and non-finite outputs (--monitoring_config_file); None: off.
        api: the label requests get in metrics ("grpc" or "rest").
        request_log: samples successful requests of models with a logging_config to their files.
        executor: where Predict runs model calls that are not batched (and large requests' decoding);
            None: the event loop's default executor.
    """

    def __init__(self, manager: ModelManager, *, enable_signature_method_name_check: bool = False,
                 batcher: Batcher | None = None, metrics: Metrics | None = None, api: str = "grpc",
                 request_log: RequestLog | None = None, executor: concurrent.futures.Executor | None = None) -> None:
        self._manager = manager
        self._executor = executor
        self._request_log = request_log
        self._metrics, self._api = metrics, api
        self._check_method_name = enable_signature_method_name_check
        self._batcher = batcher

    @_served
    async def Predict(self, request: predict_pb2.PredictRequest,
                      context: grpc.aio.ServicerContext) -> predict_pb2.PredictResponse:
        """Runs one signature; the response echoes the resolved model_spec and keeps each output's dtype.

        A coroutine, called on the front end's event loop: the request is checked and decoded there,
        and the model call is awaited (its batch, or the worker pool), so waiting holds no thread. A
        request declaring more than INLINE_ELEMENTS elements is decoded on the worker pool instead, so a
        large request never stalls the loop.
        """
        _, runner = self._manager.resolve(require_model_spec(request))
        check = self._check_method_name
        loop = asyncio.get_running_loop()
        if inference.declared_elements(request) > INLINE_ELEMENTS:
            return await loop.run_in_executor(self._executor, functools.partial(
                inference.predict, self._serving(runner), request, enable_signature_method_name_check=check))
        prepared = inference.prepare_predict(runner, request, enable_signature_method_name_check=check)
        if self._batcher is not None:
            outputs = await self._batcher.predict_async(runner, prepared.inputs, prepared.signature_name,
                                                        prepared.output_filter, self._executor)
        else:
            outputs = await loop.run_in_executor(self._executor, functools.partial(
                runner.predict, prepared.inputs, signature_name=prepared.signature_name,
                output_filter=prepared.output_filter))
        if self._metrics is not None:
            self._metrics.observe_outputs(runner.model_name, str(runner.version), outputs)
        return inference.predict_response(runner, request, prepared.signature_name, outputs)

    @_served
    def Classify(self, request: classification_pb2.ClassificationRequest,
                 context: grpc.ServicerContext) -> classification_pb2.ClassificationResponse:
        """Classes and/or scores for each tf.Example in request.input."""
        return inference.classify(self._runner(request), request,
                                  enable_signature_method_name_check=self._check_method_name)

    @_served
    def Regress(self, request: regression_pb2.RegressionRequest,
                context: grpc.ServicerContext) -> regression_pb2.RegressionResponse:
        """One value for each tf.Example in request.input."""
        return inference.regress(self._runner(request), request,
                                 enable_signature_method_name_check=self._check_method_name)

    @_served
    def MultiInference(self, request: inference_pb2.MultiInferenceRequest,
                       context: grpc.ServicerContext) -> inference_pb2.MultiInferenceResponse:
        """Several Classify/Regress tasks over the same examples; the first task's model_spec picks the model."""
        # As multi_inference_helper.cc: the model (and version) comes from tasks[0]; inference checks the rest.
        model_spec = request.tasks[0].model_spec if request.tasks else model_pb2.ModelSpec()
        _, runner = self._manager.resolve(model_spec)
        return inference.multi_inference(self._serving(runner), request,
                                         enable_signature_method_name_check=self._check_method_name)

    @_served
    def GetModelMetadata(self, request: get_model_metadata_pb2.GetModelMetadataRequest,
                         context: grpc.ServicerContext) -> get_model_metadata_pb2.GetModelMetadataResponse:
        """The model's SignatureDefMap, as read from saved_model.pb, under metadata["signature_def"]."""
        model_spec = require_model_spec(request)
        if not request.metadata_field:
            raise InvalidArgument("GetModelMetadataRequest must specify at least one metadata_field")
        for field in request.metadata_field:
            if field != SIGNATURE_DEF_FIELD:
                raise InvalidArgument(f"Metadata field {field} is not supported; the only supported field is "
                                      f"'{SIGNATURE_DEF_FIELD}'")
        version, runner = self._manager.resolve(model_spec)
        signature_defs = get_model_metadata_pb2.SignatureDefMap()
        for name, signature in runner.signature_defs.items():
            signature_defs.signature_def[name].CopyFrom(signature)
        response = get_model_metadata_pb2.GetModelMetadataResponse()
        response.model_spec.name = model_spec.name
        response.model_spec.version.value = version
        response.metadata[SIGNATURE_DEF_FIELD].Pack(signature_defs)
        return response

    def _runner(self, request: predict_pb2.PredictRequest | classification_pb2.ClassificationRequest
                | regression_pb2.RegressionRequest) -> Runner:
        """The Runner the request's model_spec names; no model_spec is INVALID_ARGUMENT, as in predict_impl.cc,
        classification_service.cc and regression_service.cc."""
        _, runner = self._manager.resolve(require_model_spec(request))
        return self._serving(runner)

    def _serving(self, runner: Runner) -> Runner:
        """The runner as requests use it: batched (--enable_batching), outputs checked for NaN/Inf (metrics)."""
        if self._batcher:
            runner = self._batcher.wrap(runner)
        if self._metrics:
            runner = self._metrics.guard(runner)
        return runner

    def _log(self, rpc: str, request: Any, response: Any) -> None:
        try:
            self._request_log.log(rpc, request, response)
        except Exception:  # noqa: BLE001 - the request log must never fail a request that succeeded
            log.exception("request log: %s could not be logged", rpc)

    def _observe(self, rpc: str, request: Any, response: Any, code: grpc.StatusCode, seconds: float) -> None:
        if self._metrics is None:
            return
        spec = (request.tasks[0].model_spec if rpc == "MultiInference" and request.tasks
                else getattr(request, "model_spec", model_pb2.ModelSpec()))
        answered = getattr(response, "model_spec", None)
        version = (str(answered.version.value) if answered is not None and answered.HasField("version")
                   else str(spec.version.value) if spec.HasField("version") else "")
        self._metrics.observe_request(model_name=spec.name, version=version, signature_name=spec.signature_name,
                                      api=self._api, rpc=rpc, status=code.name, seconds=seconds)
