"""How fast each of a few candidate calls runs on this machine: what `auto` measures where the CPU's flags do not
decide (docs/precision.md#auto).

The candidates are timed in interleaved rounds, one call of each per round, so a load that drifts on a shared
machine slows them alike; each figure is a median, so a stray slow call does not decide.
"""

from __future__ import annotations

import statistics
import time
from typing import Any, Callable, Mapping

def median_seconds(calls: Mapping[str, Callable[[], Any]], *, warmup: int, min_rounds: int, max_rounds: int,
                   budget_s: float) -> dict[str, float]:
    """Each call's median wall time in seconds over min_rounds to max_rounds timed rounds, after `warmup` untimed
    calls each (tracing, first-call allocations).

    Rounds go on while budget_s lasts, so a quick model is timed often enough for its median to hold still, and a
    large one stops after min_rounds. Each call must return only once its work is done (e.g. by converting its
    outputs to numpy).
    """
    for call in calls.values():
        for _ in range(warmup):
            call()
    times: dict[str, list[float]] = {name: [] for name in calls}
    started = time.perf_counter()
    for done in range(max_rounds):
        if done >= min_rounds and time.perf_counter() - started > budget_s:
            break
        for name, call in calls.items():
            begin = time.perf_counter()
            call()
            times[name].append(time.perf_counter() - begin)
    return {name: statistics.median(values) for name, values in times.items()}
