"""The tf.data service: training batches made by a dispatcher's workers, each record once per epoch, and a worker
that dies replaced at its address without stopping training."""

import json
import os
import signal
import socket
import subprocess
import sys
import threading
import time

import numpy as np
import pytest
import tensorflow as tf

from data_files import ID_SPEC, REPO, id_shards, load
from pipeline.config import load_config
from pipeline.data import service
from pipeline.train import train


def test_two_service_workers_hand_out_every_training_record_once_per_epoch(tmp_path):
    pattern = id_shards(tmp_path, shards=6, rows_per_shard=40)
    ds = load("data.source=tfrecord", f"data.path={pattern}", ID_SPEC)
    dispatcher = tf.data.experimental.service.DispatchServer(tf.data.experimental.service.DispatcherConfig(port=0))
    address = dispatcher.target.removeprefix("grpc://")
    workers = [tf.data.experimental.service.WorkerServer(tf.data.experimental.service.WorkerConfig(
        dispatcher_address=address, port=0)) for _ in range(2)]
    try:
        for epoch in range(2):
            batches = service.distribute(ds.train_dataset(16, 64, seed=epoch), dispatcher.target, f"ids-epoch-{epoch}")
            seen = [int(i) for x, _ in batches for i in x.numpy()[:, 0]]
            assert sorted(seen) == sorted(ds.train.rows()[0][:, 0].astype(int).tolist())
    finally:
        for worker in workers:
            worker.stop()
        dispatcher.stop()


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def _server(*args: str) -> subprocess.Popen:
    return subprocess.Popen([sys.executable, "-m", "pipeline", "data-service", *args], cwd=REPO,
                            stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL, start_new_session=True)


@pytest.mark.subprocess
@pytest.mark.timeout(300)
def test_a_killed_service_worker_is_replaced_without_stopping_training(tmp_path):
    pattern = id_shards(tmp_path, shards=8, rows_per_shard=250)
    port = _free_port()
    dispatcher = _server("dispatcher", "--port", str(port), "--work_dir", str(tmp_path / "journal"))
    worker_ports = [_free_port() for _ in range(2)]
    servers = [dispatcher] + [_server("worker", "--dispatcher", f"localhost:{port}", "--port", str(p))
                              for p in worker_ports]
    cfg = load_config(REPO / "configs/default.yaml", [
        "data.source=tfrecord", f"data.path={pattern}", ID_SPEC, f"data.service=grpc://localhost:{port}",
        "train.epochs=4", "train.batch_size=64", "model.hidden_units=[16]", f"train.runs_dir={tmp_path / 'runs'}"])
    history = cfg.run_dir / "history.json"
    replaced = threading.Event()

    def kill_one_worker_after_the_first_epoch():
        deadline = time.monotonic() + 240
        while time.monotonic() < deadline and not (history.is_file() and json.loads(history.read_text() or "[]")):
            time.sleep(0.05)
        os.killpg(servers[1].pid, signal.SIGKILL)
        servers[1].wait()
        # Replaced at the same address, as a Kubernetes StatefulSet replaces a pod (docs/data.md#the-tfdata-service).
        servers.append(_server("worker", "--dispatcher", f"localhost:{port}", "--port", str(worker_ports[0])))
        replaced.set()

    killer = threading.Thread(target=kill_one_worker_after_the_first_epoch, daemon=True)
    killer.start()
    try:
        run = train(cfg)
    finally:
        for server in servers:
            if server.poll() is None:
                os.killpg(server.pid, signal.SIGTERM)
                server.wait(timeout=30)
    assert replaced.is_set() and servers[1].returncode == -signal.SIGKILL
    assert len(run.metrics) and run.metrics["epochs"] == 4 and np.isfinite(run.metrics["val_loss"])
    assert len(json.loads(history.read_text())) == 4
