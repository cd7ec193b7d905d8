"""oneDNN's frozen-weights switch, on in `python -m serving` only (docs/serving.md#frozen-weights).

TF_ONEDNN_ASSUME_FROZEN_WEIGHTS=1 (TensorFlow's own variable, read once per process) tells oneDNN that a fused
MatMul's variable weight never changes, so it packs the weight for its kernels once and keeps the packed copy
instead of reordering it on every call: decode of the 85 M language model runs 1.19-1.23x faster with it
(docs/large-models.md#decode). A process that assigns a weight after its first use would compute with the stale
packed copy, so the switch belongs to processes that never train: the server, started as `python -m serving`.
It is set only there, before TensorFlow loads and only when TensorFlow has not loaded yet (a test calling the
server's main() in-process, beside training, gets nothing), and never where the user set the variable
themselves (0 turns it off). Training refuses to start under it (pipeline/train/run.py), and the export checks
the decode path under it in a process of its own (pipeline/export/frozen_check.py), so what the server computes
was checked at export.
"""

from __future__ import annotations

import os
import sys

VARIABLE = "TF_ONEDNN_ASSUME_FROZEN_WEIGHTS"


def assume_frozen_weights(environ: os._Environ | dict = os.environ, modules: dict = sys.modules) -> bool:
    """Sets the variable to 1 unless the user set it or TensorFlow already loaded; returns whether it is on."""
    if VARIABLE not in environ and "tensorflow" not in modules:
        environ[VARIABLE] = "1"
    return is_on(environ)


def is_on(environ: os._Environ | dict = os.environ) -> bool:
    """Whether oneDNN treats weights as frozen in a process started with this environment (TensorFlow takes any
    of its true spellings: tensorflow/core/util/env_var.cc ReadBoolFromEnvVar)."""
    return environ.get(VARIABLE, "").strip().lower() in ("1", "true")


def describe(environ: os._Environ | dict = os.environ) -> str:
    """The start-up log's line."""
    if is_on(environ):
        return (f"oneDNN keeps weights pre-packed ({VARIABLE}=1: a serving process never changes a weight; "
                f"{VARIABLE}=0 turns it off)")
    return f"oneDNN repacks weights on every call ({VARIABLE} is {environ.get(VARIABLE, 'unset')!r})"
