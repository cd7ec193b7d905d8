"""Picks the tf.distribute strategy of a run and says which process owns the run directory.

    default       one device (tf.distribute's default strategy: no replication)
    mirrored      MirroredStrategy over all local GPUs; on a machine without GPUs it uses the CPU
    multi_worker  MultiWorkerMirroredStrategy; the cluster comes from TF_CONFIG, one process per machine

Only the chief (task `chief`, or `worker` 0 when the cluster has no chief) writes the run directory.
The other workers run the same steps, checkpoints included (TensorFlow expects every worker to save),
but write into a temporary directory that is removed when training ends.

Keras 3.15 limits, verified on TF 2.21 CPU and enforced by the config:
- Model.fit/evaluate fail under MultiWorkerMirroredStrategy with more than one worker (they reduce the
  first distributed (x, y) batch with a collective that takes single tensors only), so `multi_worker`
  runs need `train.loop: custom`.
- An optimizer with gradient_accumulation_steps all-reduces inside a cond, which tf.distribute refuses
  ("merge_call called while defining a new graph"), so accumulation needs the default strategy.
"""

from __future__ import annotations

import contextlib
import logging
import os
import shutil
import tempfile
from pathlib import Path
from typing import Iterator

import tensorflow as tf

from pipeline.config import DistributionConfig

log = logging.getLogger(__name__)


def make_strategy(config: DistributionConfig) -> tf.distribute.Strategy:
    """The configured strategy. Call it before any other TensorFlow op: MultiWorkerMirroredStrategy
    configures the runtime's collectives and cannot do so once the runtime has started."""
    if config.strategy == "mirrored":
        strategy = tf.distribute.MirroredStrategy()
    elif config.strategy == "multi_worker":
        if not os.environ.get("TF_CONFIG"):
            log.warning("train.distribution.strategy is multi_worker but TF_CONFIG is not set: running as a single worker")
        strategy = tf.distribute.MultiWorkerMirroredStrategy()
    else:
        strategy = tf.distribute.get_strategy()
    return strategy


def describe(strategy: tf.distribute.Strategy) -> str:
    """'MirroredStrategy: 1 replica(s)' or '...; this process is worker 1 of 2 (chief: no)'."""
    if not tf.distribute.has_strategy() and strategy is tf.distribute.get_strategy():
        return "default strategy: 1 replica"
    text = f"{type(strategy).__name__}: {strategy.num_replicas_in_sync} replica(s)"
    task = _task(strategy)
    if task:
        chief = "yes" if is_chief(strategy) else "no"
        text += f"; this process is {task[0]} {task[1]} of {_num_workers(strategy)} (chief: {chief})"
    return text


def is_chief(strategy: tf.distribute.Strategy) -> bool:
    """False only for a multi_worker process that is not the chief (task `chief`, or worker 0 without one)."""
    task = _task(strategy)
    if task is None:
        return True
    task_type, index = task
    return task_type == "chief" or (task_type == "worker" and index == 0
                                    and "chief" not in strategy.cluster_resolver.cluster_spec().as_dict())


@contextlib.contextmanager
def run_directory(run_dir: Path, strategy: tf.distribute.Strategy) -> Iterator[Path]:
    """The directory this process writes: run_dir on the chief, a temporary one elsewhere (removed at the end)."""
    if is_chief(strategy):
        yield run_dir
        return
    scratch = Path(tempfile.mkdtemp(prefix="pipeline-worker-"))
    try:
        yield scratch
    finally:
        shutil.rmtree(scratch, ignore_errors=True)


def workers(strategy: tf.distribute.Strategy) -> int:
    """How many processes train together: 1 unless multi_worker runs in a cluster."""
    return 1 if _task(strategy) is None else _num_workers(strategy)


def all_workers_agree(strategy: tf.distribute.Strategy, value: int) -> bool:
    """True when every replica holds the same value (e.g. the step it resumed from). A collective under
    multi_worker: every worker must call it at the same point."""
    if strategy.num_replicas_in_sync == 1:
        return True
    local = tf.constant([value], tf.int64)
    values = strategy.gather(strategy.run(lambda: tf.identity(local)), axis=0)
    return bool(tf.reduce_all(values == values[0]))


def _task(strategy: tf.distribute.Strategy) -> tuple[str, int] | None:
    resolver = getattr(strategy, "cluster_resolver", None)
    if not isinstance(strategy, tf.distribute.MultiWorkerMirroredStrategy) or resolver is None or not resolver.task_type:
        return None
    return resolver.task_type, int(resolver.task_id or 0)


def _num_workers(strategy: tf.distribute.Strategy) -> int:
    cluster = strategy.cluster_resolver.cluster_spec().as_dict()
    return sum(len(cluster.get(kind, [])) for kind in ("chief", "worker"))
