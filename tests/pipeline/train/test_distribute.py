"""Scale-out: MirroredStrategy in-process, and a real two-worker MultiWorkerMirroredStrategy run on
localhost whose workers end with identical weights and whose chief's run exports and serves."""

import json
import os
import re
import socket
import subprocess
import sys
from pathlib import Path

import pytest

from pipeline import data
from pipeline.train import checkpoints
from pipeline.config import load_config
from pipeline.export import export
from serving.servable.runner import Runner
from pipeline.train import train

REPO_ROOT = Path(__file__).resolve().parents[3]


@pytest.mark.parametrize("loop", ["fit", "custom"])
def test_mirrored_strategy_trains_like_the_default_one(loop, trained_run, tiny_config_path, tmp_path):
    cfg = load_config(tiny_config_path, [f"train.runs_dir={tmp_path}", "train.epochs=1", f"train.loop={loop}",
                                         "train.distribution.strategy=mirrored"])
    run = train(cfg)  # on a machine without GPUs, one replica on the CPU
    first_epoch = checkpoints.read_state(checkpoints.latest_checkpoint(trained_run.run_dir)).history[0]
    mirrored = run.metrics
    assert mirrored["val_accuracy"] == pytest.approx(first_epoch["val_accuracy"], abs=1e-6)
    assert mirrored["val_loss"] == pytest.approx(first_epoch["val_loss"], rel=1e-5)


def _free_ports(n: int) -> list[int]:
    sockets = [socket.socket() for _ in range(n)]
    for s in sockets:
        s.bind(("127.0.0.1", 0))
    ports = [s.getsockname()[1] for s in sockets]
    for s in sockets:
        s.close()
    return ports


def _digits_shards(directory: Path, shards: int) -> list[str]:
    """scikit-learn's digits as TFRecord shards of equal size, for a streamed source."""
    import numpy as np
    import tensorflow as tf
    from sklearn.datasets import load_digits

    digits = load_digits()
    for shard, rows in enumerate(np.array_split(np.arange(len(digits.data)), shards)):
        with tf.io.TFRecordWriter(str(directory / f"digits-{shard:05d}.tfrecord")) as writer:
            for i in rows:
                writer.write(tf.train.Example(features=tf.train.Features(feature={
                    "pixels": tf.train.Feature(float_list=tf.train.FloatList(value=digits.data[i])),
                    "label": tf.train.Feature(int64_list=tf.train.Int64List(value=[digits.target[i]]))}))
                    .SerializeToString())
    return ["data.source=tfrecord", f"data.path={directory}/digits-*.tfrecord",
            "data.feature_spec={pixels: {shape: [64]}}"]


@pytest.mark.subprocess  # two worker processes, then a model server
@pytest.mark.parametrize("source", ["in memory", "tfrecord shards"])
def test_two_workers_train_identical_weights_and_the_chief_exports_and_serves(tiny_config_path, tmp_path, source):
    # Shards: each worker reads whole files of its own (pipeline/data/shards.py; tests/pipeline/data/test_shards.py
    # checks which records each worker's pipeline reads).
    streamed = _digits_shards(tmp_path, shards=8) if source == "tfrecord shards" else []
    overrides = [f"train.runs_dir={tmp_path / 'runs'}", f"export.base_path={tmp_path / 'models'}", "train.epochs=2",
                 "train.loop=custom", "train.distribution.strategy=multi_worker", *streamed]
    cluster = {"worker": [f"127.0.0.1:{port}" for port in _free_ports(2)]}
    workers = []
    for index in range(2):
        env = {**os.environ, "TF_CONFIG": json.dumps({"cluster": cluster, "task": {"type": "worker", "index": index}})}
        log = (tmp_path / f"worker{index}.log").open("w")
        workers.append(subprocess.Popen(
            [sys.executable, "-m", "pipeline", "train", str(tiny_config_path), *(f"--set={o}" for o in overrides)],
            cwd=REPO_ROOT, env=env, stdout=log, stderr=subprocess.STDOUT))
    try:
        codes = [worker.wait(timeout=240) for worker in workers]
    finally:
        for worker in workers:
            worker.kill()
    logs = [(tmp_path / f"worker{index}.log").read_text() for index in range(2)]
    assert codes == [0, 0], "\n\n".join(log[-3000:] for log in logs)
    hashes = [re.search(r"weights sha1 (\w+) → (\S+)", log).groups() for log in logs]
    assert hashes[0][0] == hashes[1][0], "the workers' weights differ"

    cfg = load_config(tiny_config_path, overrides)
    metrics = json.loads((cfg.run_dir / "metrics.json").read_text())  # only the chief writes the run directory
    assert metrics["weights_sha1"] == hashes[0][0] and metrics["val_accuracy"] > 0.5
    assert hashes[1][1] != str(cfg.run_dir) and not Path(hashes[1][1]).exists(), "worker 1 wrote to a removed temp dir"
    assert "worker 1 of 2 (chief: no)" in logs[1] and "worker 0 of 2 (chief: yes)" in logs[0]

    version_dir = export(cfg)
    datasets = data.load_datasets(cfg.data, cfg.seed)
    val_x, val_y = datasets.validation_rows()
    served = Runner.load(version_dir).predict({cfg.data.input_name: val_x})
    accuracy = float((served["probabilities"].argmax(1) == val_y).mean())
    assert accuracy == pytest.approx(metrics["val_accuracy"], abs=1e-6)
