"""Model warmup: replay a version's recorded requests before it becomes AVAILABLE, as TF Serving does.

TF Serving's format and limits (servables/tensorflow/saved_model_warmup_util.cc, saved_model_warmup.cc):
the file is `<version>/assets.extra/tf_serving_warmup_requests`, a TFRecord file of serialized
`tensorflow.serving.PredictionLog`; at most 1000 records; each is replayed num_request_iterations
times (default 1); predict, classify, regress and multi_inference logs are replayed; a record with
no log at all is skipped; session_run (and predict_streamed) logs are UNIMPLEMENTED. Any failure
fails the load of that version. No file means no warmup.

Requests are prepared and answered by serving/servable/inference.py, as the server prepares and answers
them, with the model calls run on the loading thread (inference.run_inline) rather than batched, so a
warmup request that would fail over gRPC fails here too.
"""

from __future__ import annotations

import logging
import os
from pathlib import Path
from typing import Iterator

import grpc
import tensorflow as tf
from google.protobuf.message import DecodeError
from tensorflow_serving.apis import prediction_log_pb2

from serving.servable.runner import Runner
from serving.servable import inference
from serving.errors import status_for

log = logging.getLogger(__name__)

WARMUP_FILE = Path("assets.extra") / "tf_serving_warmup_requests"
MAX_RECORDS = 1000  # WarmupConsts::kMaxNumRecords
# PredictionLog field -> the serving/servable/inference.py function that prepares its request.
_PREPARERS = {"predict_log": inference.prepare_predict, "classify_log": inference.prepare_classify,
              "regress_log": inference.prepare_regress, "multi_inference_log": inference.prepare_multi_inference}


class WarmupError(Exception):
    """Warmup failed, so the version must not load; `code` is the gRPC status GetModelStatus reports."""

    def __init__(self, message: str, code: grpc.StatusCode = grpc.StatusCode.INVALID_ARGUMENT):
        super().__init__(message)
        self.code = code


def run_warmup(runner: Runner, version_dir: str | os.PathLike, *, num_request_iterations: int = 1) -> int:
    """Replays the version's warmup requests on runner; returns how many records were replayed (0: no file).
    A language model's decode protocol is run once as well (serving/generation/decoder.py warm_decode_protocol),
    file or not: it is the server's own call, which no recorded request makes.

    Raises:
        WarmupError: the file is not a TFRecord file of PredictionLogs, holds more than 1000 records,
            or a request failed (the message names the record and keeps the request's own error).
    """
    from serving.generation.decoder import warm_decode_protocol  # generation builds on the runner, not the reverse

    try:
        if warm_decode_protocol(runner):
            log.info("warmup: model %s version %s ran its decode protocol once", runner.model_name, runner.version)
    except Exception as error:  # noqa: BLE001 - any failure fails the load, with its status
        code, message = status_for(error)
        raise WarmupError(f"warmup of the decode protocol: {message}", code) from error
    path = Path(version_dir) / WARMUP_FILE
    if not path.is_file():
        log.info("No warmup data file found at %s", path)
        return 0
    iterations = max(num_request_iterations, 1)
    count = 0
    for count, record in enumerate(_records(path), start=1):
        if count > MAX_RECORDS:
            raise WarmupError(f"Number of warmup records exceeds the maximum ({MAX_RECORDS}) at {path}")
        prediction_log = prediction_log_pb2.PredictionLog()
        try:
            prediction_log.ParseFromString(record)
        except DecodeError:
            raise WarmupError(f"Failed to parse warmup record {count} from {path}") from None
        kind = prediction_log.WhichOneof("log_type")
        try:
            for _ in range(iterations):
                _replay(runner, prediction_log, kind)
        except WarmupError:
            raise
        except Exception as error:  # noqa: BLE001 - any failure fails the load, with its status
            code, message = status_for(error)
            raise WarmupError(f"warmup record {count} ({kind}) of {path}: {message}", code) from error
        log.info("warmup: model %s version %s replayed record %d (%s) x%d", runner.model_name, runner.version,
                 count, kind or "empty", iterations)
    log.info("Finished reading warmup data for model at %s. Number of warmup records read: %d.", path, count)
    return count


def _records(path: Path) -> Iterator[bytes]:
    """The raw records of a TFRecord file; a file in another format is DATA_LOSS, as in TF Serving."""
    try:
        for record in tf.data.TFRecordDataset(str(path)).as_numpy_iterator():
            yield record
    except tf.errors.DataLossError as error:
        lines = (error.message or "").strip().splitlines()
        message = lines[0] if lines else "corrupted record"
        raise WarmupError(f"{message} in {path}. Please verify your warmup data is in TFRecord format.",
                          grpc.StatusCode.DATA_LOSS) from None


def _replay(runner: Runner, prediction_log: prediction_log_pb2.PredictionLog, kind: str | None) -> None:
    """Runs one logged request on runner and discards the response."""
    if kind is None:
        return  # TF Serving skips a record without a request
    if kind not in _PREPARERS:
        raise WarmupError(f"Unsupported log_type for warmup: {kind}", grpc.StatusCode.UNIMPLEMENTED)
    request = getattr(prediction_log, kind).request
    inference.run_inline(runner, _PREPARERS[kind](runner, request))
