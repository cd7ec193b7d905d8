"""NaN and Inf in what a model answers: counted, logged, and refused when the operator asks.

Every float output of every model call is checked (numpy, no TensorFlow). A NaN or Inf value is counted
(tensorflow_serving_nonfinite_outputs, with --monitoring_config_file) and logged at most once a minute
per model, version and output, so a model that starts emitting NaN (a float16 overflow on inputs
beyond the training range, say) shows up before a client notices. As TF Serving does, the answer goes
out as the model computed it, unless --refuse_nonfinite_outputs is set: then the request is answered
FAILED_PRECONDITION naming the output (REST 400), and the client never reads NaN as an answer.
"""

from __future__ import annotations

import logging
import threading
import time
from typing import Callable

import numpy as np

from serving.errors import FailedPrecondition
from serving.monitoring import Metrics

log = logging.getLogger(__name__)

WARNING_INTERVAL_S = 60.0


class NumericsGuard:
    """Checks model outputs for NaN and Inf; thread-safe."""

    def __init__(self, metrics: Metrics | None = None, *, refuse: bool = False,
                 warning_interval_s: float = WARNING_INTERVAL_S, clock: Callable[[], float] = time.monotonic) -> None:
        self._metrics, self._refuse = metrics, refuse
        self._interval_s, self._clock = warning_interval_s, clock
        self._warned: dict[tuple[str, str, str], float] = {}  # keys: served names only (outputs of loaded models)
        self._lock = threading.Lock()

    def check(self, model_name: str, version: str, outputs: dict[str, np.ndarray]) -> None:
        """Counts and logs non-finite values in float outputs.

        Raises:
            FailedPrecondition: with --refuse_nonfinite_outputs, an output holds NaN or Inf.
        """
        for name, array in outputs.items():
            bad = _nonfinite(np.asarray(array))
            if not bad:
                continue
            if self._metrics is not None:
                self._metrics.nonfinite.labels(model_name=model_name, version=version, output=name).inc(bad)
            self._warn(model_name, version, name, bad, np.size(array))
            if self._refuse:
                raise FailedPrecondition(f"model {model_name} version {version}: output '{name}' holds {bad} NaN or "
                                         f"Inf values of {np.size(array)}; this server refuses such answers "
                                         "(--refuse_nonfinite_outputs)")

    def _warn(self, model_name: str, version: str, output: str, bad: int, total: int) -> None:
        key, now = (model_name, version, output), self._clock()
        with self._lock:
            last = self._warned.get(key)
            if last is not None and now - last < self._interval_s:
                return
            self._warned[key] = now
        log.warning("model %s version %s output '%s': %d of %d values are NaN or Inf (warned at most every %.0f s)",
                    model_name, version, output, bad, total, self._interval_s)


def _nonfinite(array: np.ndarray) -> int:
    """How many NaN or Inf values a float (or complex, or bfloat16) array holds; 0 for other dtypes."""
    if array.dtype.kind not in "fc" and array.dtype.name != "bfloat16":
        return 0
    values = array.astype(np.float32) if array.dtype.name == "bfloat16" else array
    return int(np.size(values) - np.count_nonzero(np.isfinite(values)))
