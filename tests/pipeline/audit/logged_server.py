"""A real server (serving/app.py, in this process) that logs every request it answers: request logs for audit tests."""

from __future__ import annotations

import contextlib
from pathlib import Path
from typing import Iterator

import grpc
import numpy as np
from tensorflow_serving.apis import prediction_service_pb2_grpc

from serving.app import Core, ServerThread
from serving.client import grpc_client
from serving.flags import Options
from serving.manager.model_config import single_model_config
from serving.manager.model_manager import ModelManager
from serving.request_log import RequestLog


@contextlib.contextmanager
def logged_server(base_path: Path, model_name: str, log_dir: Path) -> Iterator[str]:
    """Serves base_path (its latest version) with logging_config sampling rate 1 into log_dir/requests-*.tfrecord;
    yields the gRPC address; the log is complete once the block exits."""
    config = single_model_config(model_name, base_path)
    logging_config = config.model_config_list.config[0].logging_config
    logging_config.log_collector_config.type = "tfrecord"
    logging_config.log_collector_config.filename_prefix = str(log_dir / "requests")
    logging_config.sampling_config.sampling_rate = 1.0
    manager = ModelManager(file_system_poll_wait_seconds=0)
    manager.reload_config(config)
    core = Core(manager, request_log=RequestLog(seed=0))
    try:
        with ServerThread(Options(port=0, grpc_max_threads=2), core) as server:
            yield server.grpc_address
    finally:
        core.close()


def send(address: str, model_name: str, input_name: str, x: np.ndarray, batch: int, classify_rows: int = 0) -> None:
    """x as Predict requests of `batch` rows, then its first classify_rows rows as one Classify request."""
    with grpc.insecure_channel(address) as channel:
        stub = prediction_service_pb2_grpc.PredictionServiceStub(channel)
        for start in range(0, len(x), batch):
            stub.Predict(grpc_client.predict_request(model_name, {input_name: x[start:start + batch]}), timeout=60)
        if classify_rows:
            examples = grpc_client.float_examples(x[:classify_rows], input_name)
            stub.Classify(grpc_client.classify_request(model_name, examples, "classification", None), timeout=60)
