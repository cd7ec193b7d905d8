"""How the bench measures: repeats, medians, an epoch timer shared by both sides, progress on stderr."""

from __future__ import annotations

import statistics
import sys
import time
from typing import Callable

_STARTED = time.monotonic()


def progress(message: str) -> None:
    """One line on stderr: the bench is long work and a silent terminal looks hung."""
    elapsed = time.monotonic() - _STARTED
    print(f"[bench {int(elapsed // 60):02d}:{int(elapsed % 60):02d}] {message}", file=sys.stderr, flush=True)


def median(values: list[float]) -> float:
    return float(statistics.median(values))


def seconds_per_call(function: Callable[[], object], calls: int) -> float:
    """Mean seconds of one call over `calls` back-to-back calls (the caller warms up first)."""
    start = time.perf_counter()
    for _ in range(calls):
        function()
    return (time.perf_counter() - start) / calls


def calls_for(function: Callable[[], object], budget_s: float, most: int = 10_000) -> int:
    """How many calls fit in budget_s, from one timed call: keeps fast and slow cases to similar wall time."""
    start = time.perf_counter()
    function()
    one = max(time.perf_counter() - start, 1e-6)
    return max(1, min(most, int(budget_s / one)))


def percentile(sorted_values: list[float], share: float) -> float:
    """Nearest-rank percentile of an already sorted list (share 0.5 = median)."""
    if not sorted_values:
        return float("nan")
    index = min(len(sorted_values) - 1, max(0, round(share * len(sorted_values) + 0.5) - 1))
    return float(sorted_values[index])


def epoch_timer():
    """A Keras callback recording the wall time of each epoch, the same instrument for every side.

    An epoch runs from its on_epoch_begin to the next one (or to on_train_end), so it includes the
    epoch's validation and whatever other callbacks do at its end (checkpoints, history files).
    """
    import keras

    class EpochTimer(keras.callbacks.Callback):
        def __init__(self) -> None:
            super().__init__()
            self.starts: list[float] = []
            self.ended: float | None = None

        def on_epoch_begin(self, epoch, logs=None):
            self.starts.append(time.perf_counter())

        def on_train_end(self, logs=None):
            self.ended = time.perf_counter()

        def epoch_seconds(self) -> list[float]:
            marks = self.starts + ([self.ended] if self.ended is not None else [])
            return [later - earlier for earlier, later in zip(marks, marks[1:])]

    return EpochTimer()


def steady_examples_per_second(epoch_seconds: list[float], examples_per_epoch: int) -> float:
    """Median examples/s over the epochs after the first (the first traces and warms the graph)."""
    steady = epoch_seconds[1:] or epoch_seconds
    return examples_per_epoch / median(steady)
