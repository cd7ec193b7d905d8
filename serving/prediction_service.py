"""tensorflow.serving.PredictionService: Predict, Classify, Regress, MultiInference, GetModelMetadata.

A thin servicer of coroutines, called on the server's event loop by both front ends (gRPC's grpc.aio
and REST's aiohttp call these same methods): resolve the model, prepare the request
(serving/servable/inference.py), await its model calls, build the response, and let errors.py turn
any failure into a status. Blocking work never runs on the loop: model calls are awaited on the
batcher (--enable_batching) or the front end's worker pool, and a request of more than INLINE_BYTES
is prepared and answered on that pool too, so a large request never stalls the others. Status codes
and wording follow TF Serving (prediction_service_impl.cc and the files serving/servable/inference.py
cites; get_model_metadata_impl.cc for GetModelMetadata).
"""

from __future__ import annotations

import asyncio
import concurrent.futures
import contextvars
import copy
import functools
import logging
from typing import Any, Callable

import grpc
from tensorflow_serving.apis import (classification_pb2, get_model_metadata_pb2, inference_pb2, model_pb2,
                                     predict_pb2, prediction_service_pb2_grpc, regression_pb2)

from serving.batching.scheduler import Batcher
from serving.errors import InvalidArgument, handles_errors, require_model_spec, short
from serving.flags import Options
from serving.generation import predict as stepped
from serving.generation.decoder import Decoder
from serving.generation.service import Generations
from serving.manager.model_manager import ModelManager
from serving.monitoring import Metrics
from serving.numerics import NumericsGuard
from serving.request_log import RequestLog
from serving.servable import inference
from serving.servable.runner import ModelCall, Runner

log = logging.getLogger(__name__)

SIGNATURE_DEF_FIELD = "signature_def"
# A request larger than this on the wire (a gRPC message, a REST body) is prepared and answered on the worker
# pool rather than on the event loop: 64 KiB of float32 values decode in well under a millisecond.
INLINE_BYTES = 65_536
# The size of the request being served, as its front end received it (set by serving/server.py's
# deserializer and serving/rest/routes.py); 0 when unknown (a direct call), which counts as small.
request_bytes: contextvars.ContextVar[int] = contextvars.ContextVar("request_bytes", default=0)


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

Prepare = Callable[..., inference.PreparedRequest]


async def off_loop(executor: concurrent.futures.Executor | None, function: Callable[..., Any], *args: Any) -> Any:
    """function(*args) on executor (None: the loop's default), in the caller's context: a Runner resolved there
    joins the caller's request scope (ModelManager.request_scope is a ContextVar)."""
    context = contextvars.copy_context()
    return await asyncio.get_running_loop().run_in_executor(executor, functools.partial(context.run, function, *args))


class PredictionService(prediction_service_pb2_grpc.PredictionServiceServicer):
    """Answers PredictionService RPCs from the models the manager resolves.

    Args:
        manager: the loaded models (only resolve(model_spec) -> (version, Runner) is used).
        options: the flags the servicer follows: --enable_signature_method_name_check (refuse
            Classify/Regress on signatures whose method_name is not classify/regress),
            --enable_serialization_as_tensor_content (Predict outputs as tensor_content bytes) and
            --refuse_nonfinite_outputs (serving/numerics.py).
        batcher: merges concurrent model calls into shared runs (--enable_batching); None runs each
            call on its own.
        metrics: counts requests, latency and non-finite outputs (--monitoring_config_file); None: off.
        api: the label requests get in metrics ("grpc" or "rest").
        request_log: samples successful requests of models with a logging_config to their files.
        executor: the front end's worker pool: unbatched model calls, large requests' preparing and
            answering; None: the event loop's default executor.
        generations: the language models' decode loops: Predict on a `generate` signature is answered by them
            (serving/generation/predict.py); None: by the whole-graph call.
    """

    def __init__(self, manager: ModelManager, options: Options = Options(), *, batcher: Batcher | None = None,
                 metrics: Metrics | None = None, api: str = "grpc", request_log: RequestLog | None = None,
                 executor: concurrent.futures.Executor | None = None,
                 generations: Generations | None = None) -> None:
        self._manager = manager
        self._generations = generations
        self.executor = executor
        self._request_log = request_log
        self._metrics, self._api = metrics, api
        self._check_method_name = options.enable_signature_method_name_check
        self._tensor_content = options.enable_serialization_as_tensor_content
        self._batcher = batcher
        self._numerics = NumericsGuard(metrics, refuse=options.refuse_nonfinite_outputs)

    def answering_in_tensor_content(self) -> "PredictionService":
        """This servicer (the same batcher, metrics, request log and pool), its Predict outputs written as
        tensor_content: the Open Inference Protocol sends them on as raw bytes (serving/v2/)."""
        twin = copy.copy(self)
        twin._tensor_content = True
        return twin

    @_served
    async def Predict(self, request: predict_pb2.PredictRequest, context: Any) -> predict_pb2.PredictResponse:
        """Runs one signature; the response echoes the resolved model_spec and keeps each output's dtype."""
        _, runner = self._manager.resolve(require_model_spec(request))
        return await self._infer(functools.partial(inference.prepare_predict, tensor_content=self._tensor_content),
                                 runner, request, context)

    @_served
    async def Classify(self, request: classification_pb2.ClassificationRequest,
                       context: Any) -> classification_pb2.ClassificationResponse:
        """Classes and/or scores for each tf.Example in request.input."""
        _, runner = self._manager.resolve(require_model_spec(request))
        return await self._infer(inference.prepare_classify, runner, request)

    @_served
    async def Regress(self, request: regression_pb2.RegressionRequest,
                      context: Any) -> regression_pb2.RegressionResponse:
        """One value for each tf.Example in request.input."""
        _, runner = self._manager.resolve(require_model_spec(request))
        return await self._infer(inference.prepare_regress, runner, request)

    @_served
    async def MultiInference(self, request: inference_pb2.MultiInferenceRequest,
                             context: Any) -> inference_pb2.MultiInferenceResponse:
        """Several Classify/Regress tasks over the same examples; the first task's model_spec picks the model."""
        # As multi_inference_helper.cc: the model (and version) comes from tasks[0]; inference checks the rest.
        model_spec = request.tasks[0].model_spec if request.tasks else model_pb2.ModelSpec()
        _, runner = self._manager.resolve(model_spec)
        return await self._infer(inference.prepare_multi_inference, runner, request)

    @_served
    async def GetModelMetadata(self, request: get_model_metadata_pb2.GetModelMetadataRequest,
                               context: Any) -> get_model_metadata_pb2.GetModelMetadataResponse:
        """The model's SignatureDefMap, as read from saved_model.pb, under metadata["signature_def"]."""
        model_spec = require_model_spec(request)
        if not request.metadata_field:
            raise InvalidArgument("GetModelMetadataRequest must specify at least one metadata_field")
        for field in request.metadata_field:
            if field != SIGNATURE_DEF_FIELD:
                raise InvalidArgument(f"Metadata field {short(field)} is not supported; the only supported field is "
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

    async def _infer(self, prepare: Prepare, runner: Runner, request: Any, context: Any = None) -> Any:
        """TF Serving's PreProcess -> Run -> PostProcess (predict_util.cc), on the loop for a small request,
        with the preparing and answering of a large one on the worker pool; the model calls are awaited."""
        prepare = functools.partial(prepare, runner, request,
                                    enable_signature_method_name_check=self._check_method_name)
        inline = request_bytes.get() <= INLINE_BYTES
        prepared = prepare() if inline else await off_loop(self.executor, prepare)
        outputs = [await self._run(runner, call, context) for call in prepared.model_calls]
        return prepared.respond(outputs) if inline else await off_loop(self.executor, prepared.respond, outputs)

    async def _run(self, runner: Runner, call: ModelCall, context: Any = None) -> dict:
        """The one place a model call runs: a language model's generate by its decode loop, else merged into a
        batch, or alone on the worker pool."""
        decoder, pad = self._decoder(runner, call)
        if decoder is not None:
            outputs = await stepped.generate(decoder, call, pad, stepped.remaining(context), stepped.client_of(context))
        elif self._batcher is not None:
            outputs = await self._batcher.run(runner, call, self.executor)
        else:
            outputs = await off_loop(self.executor, runner.run, call)
        self._numerics.check(runner.model_name, str(runner.version), outputs)
        return outputs

    def _decoder(self, runner: Runner, call: ModelCall) -> tuple[Decoder | None, int]:
        """The decode loop that answers this call and the PAD id its ids are padded with, or (None, 0)."""
        if (self._generations is None or call.signature.name != stepped.GENERATE
                or self._generations.protocol(runner) is None or not stepped.steppable(call)):
            return None, 0
        pad = stepped.pad_id(runner.metadata)
        return (None, 0) if pad is None else (self._generations.decoder(runner), pad)

    def _log(self, rpc: str, request: Any, response: Any) -> None:
        try:
            self._request_log.log(rpc, request, response)
        except Exception:  # noqa: BLE001 - the request log must never fail a request that succeeded
            log.exception("request log: %s could not be logged", rpc)

    def count_unanswered(self, rpc: str, request: Any, code: grpc.StatusCode, seconds: float) -> None:
        """Counts a call the front end answered before this servicer saw it (refused at admission or while
        draining, not parsed, or expired or cancelled before its message arrived; request None if unread)."""
        self._observe(rpc, request, None, code, seconds)

    def _observe(self, rpc: str, request: Any, response: Any, code: grpc.StatusCode, seconds: float) -> None:
        if self._metrics is None:
            return
        spec = (request.tasks[0].model_spec if rpc == "MultiInference" and getattr(request, "tasks", None)
                else getattr(request, "model_spec", model_pb2.ModelSpec()))
        answered = getattr(response, "model_spec", None)
        version = (str(answered.version.value) if answered is not None and answered.HasField("version")
                   else str(spec.version.value) if spec.HasField("version") else "")
        self._metrics.observe_request(model_name=spec.name, version=version, signature_name=spec.signature_name,
                                      api=self._api, rpc=rpc, status=code.name, seconds=seconds)
