"""float16 on a CPU without TensorFlow's slow fused kernel: one switch for every process that computes float16.

TensorFlow 2.21's grappler remapper fuses MatMul+BiasAdd(+activation) into one oneDNN kernel. In
float16 that kernel runs 200 to 600 times slower than the same ops unfused on a CPU with AVX512_FP16
(a Dense layer's step: 650 ms instead of 1.4 ms; the guide's MLP served at 26 rows/s instead of
~24,000), while float32 and bfloat16 lose nothing measurable without the fusion
(docs/keras3-mixed-precision.md §11). So a process that computes float16 and has no GPU turns the
remapper off once, before it runs its first float16 graph: training under mixed_float16
(pipeline/precision.py) and loading a float16 model (serving/servable/runner.py). Grappler reads the
setting when a function first runs, so it applies to models loaded before it too, if they have not
run yet. TF1 models run in their own Session with its own graph options, which this does not change.
"""

from __future__ import annotations

import logging
import threading

import tensorflow as tf

log = logging.getLogger(__name__)

_lock = threading.Lock()
_done = [False]


def unfuse_float16_on_cpu(why: str) -> bool:
    """Turns grappler's remapper off for this process if no GPU is visible (once; later calls do nothing).
    Returns whether the remapper is off now."""
    with _lock:
        if _done[0]:
            return True
        if tf.config.list_physical_devices("GPU"):
            return False
        tf.config.optimizer.set_experimental_options({"remapping": False})
        _done[0] = True
    log.debug("%s computes in float16 on a CPU: grappler's MatMul+BiasAdd fusion is off for this process "
             "(its fused float16 kernel is hundreds of times slower; docs/keras3-mixed-precision.md §11)", why)
    return True
