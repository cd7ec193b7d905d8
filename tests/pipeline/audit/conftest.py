"""Request logs for the audit tests, written by the real server (serving/app.py, in this process) answering real
requests with logging_config sampling every one."""

from __future__ import annotations

import contextlib
from pathlib import Path
from typing import Iterator

import grpc
import numpy as np
import pytest
from tensorflow_serving.apis import prediction_service_pb2_grpc

from serving.app import Core, ServerThread
from serving.client import grpc_client
from serving.flags import Options
from serving.manager.model_config import single_model_config
from serving.manager.model_manager import ModelManager
from serving.request_log import RequestLog


@contextlib.contextmanager
def logged_server(base_path: Path, model_name: str, log_dir: Path) -> Iterator[str]:
    """Serves base_path's latest version, logging every request to log_dir/requests-*.tfrecord; yields the gRPC
    address. The log is complete once the block exits."""
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


@pytest.fixture(scope="session")
def served_log(exported_model, tmp_path_factory) -> Path:
    """The log of the served tiny digits model (mixed_float16): the parity gate's golden rows as one Predict
    request, every validation row again in requests of 16, and 32 rows as a Classify request."""
    log_dir = tmp_path_factory.mktemp("request-log")
    with logged_server(exported_model.base_path, exported_model.model_name, log_dir) as address:
        send(address, exported_model.model_name, exported_model.input_name, exported_model.val_x[:256], 256)
        send(address, exported_model.model_name, exported_model.input_name, exported_model.val_x, 16, classify_rows=32)
    [path] = log_dir.glob("requests-*.tfrecord")
    return path


@pytest.fixture(scope="session")
def log_server():
    """logged_server(base_path, model_name, log_dir) and send(...), for tests that serve a model of their own."""
    return logged_server, send
