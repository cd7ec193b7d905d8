"""oneDNN's frozen-weights switch: where a serving process may turn it on, and who refuses it
(docs/serving.md#frozen-weights).

TF_ONEDNN_ASSUME_FROZEN_WEIGHTS=1 (TensorFlow's own variable, read once per process) tells oneDNN that a fused
MatMul's variable weight never changes, so it packs the weight for its kernels once and keeps the packed copy
instead of reordering it on every call. A process that assigns a weight after its first use would compute with the
stale packed copy, so it is for processes that never train: `python -m serving` runs under it when the user starts
it so (it is off by default: the measured gain depends on the CPU, and the packed copies cost memory beside the
variables; docs/large-models.md#decode). Training refuses to start under it (pipeline/train/run.py), and the export
checks every language model's decode path under it in a process of its own (pipeline/export/frozen_check.py), so a
version served with it was checked as it computes. Each MatMul keeps one packed copy, in the layout of its first
call, and reorders the weight on every call that wants another (oneDNN picks the layout by the number of rows),
so where a batch's layout differs from the warm-up's the switch costs speed instead of saving it (measured per CPU
and dtype: docs/serving.md#frozen-weights).
"""

from __future__ import annotations

import os

VARIABLE = "TF_ONEDNN_ASSUME_FROZEN_WEIGHTS"


def is_on(environ: os._Environ | dict = os.environ) -> bool:
    """Whether oneDNN treats weights as frozen in a process started with this environment (TensorFlow takes any
    of its true spellings: tensorflow/core/util/env_var.cc ReadBoolFromEnvVar)."""
    return environ.get(VARIABLE, "").lower() in ("1", "true")


def describe(environ: os._Environ | dict = os.environ) -> str:
    """The server's start-up line."""
    if is_on(environ):
        return (f"oneDNN keeps weights pre-packed ({VARIABLE}=1: a serving process never changes a weight; each "
                "matmul in the layout of its first call: docs/serving.md#frozen-weights)")
    return f"oneDNN reorders weights on every call ({VARIABLE}=1 keeps them pre-packed: docs/serving.md#frozen-weights)"
