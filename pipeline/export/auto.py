"""export.serving_policy auto where the CPU's flags do not decide (precision.measurement_decides): each candidate
serving graph (precision.SERVING_CANDIDATES) is held to the parity gate's precision and input-limits rules and timed
on the validation rows at the batch sizes the server sees; precision.pick_measured takes the fastest that passes
(docs/precision.md#auto).

The candidates are the trained weights rebuilt under each policy (Rebuilds), built and run once: the gate that
follows judges the chosen one from the same model and outputs.
"""

from __future__ import annotations

import dataclasses
import itertools
from typing import Any, Callable

import keras
import numpy as np
import tensorflow as tf

from pipeline import data, models, precision
from pipeline.config import Config
from pipeline.export import parity

# Timing, per batch size and for all candidates together: one warm-up call each, then interleaved rounds while the
# budget lasts, the median call. At most about a second per candidate in all, plus the slowest calls' rounds.
BUDGET_S = 1.0
MIN_ROUNDS, MAX_ROUNDS = 3, 200
DISTINCT_BATCHES = 8  # validation batches cycled through at each size, so no one batch decides


@dataclasses.dataclass(frozen=True)
class Rebuilt:
    """One policy's serving model, its graph, and its outputs on the gate's golden and validation rows."""

    model: keras.Model
    function: Callable[[Any], dict]  # models.graph_function: what its SavedModel computes
    golden: dict[str, np.ndarray]
    validation: dict[str, np.ndarray]


class Rebuilds:
    """The trained weights rebuilt under each policy the export asks for, as serving models; each built once."""

    def __init__(self, model: keras.Model, run_cfg: Config, datasets: data.Datasets, golden: parity.GoldenBatch,
                 validation: parity.GoldenBatch) -> None:
        self.model, self.run_cfg, self.datasets = model, run_cfg, datasets
        self.golden, self.validation = golden, validation
        self._built: dict[str, Rebuilt] = {}

    def __getitem__(self, policy: str) -> Rebuilt:
        if policy not in self._built:
            cfg, spec = self.run_cfg, self.datasets.spec
            with precision.policy_scope(policy):
                served = models.serving_model(
                    models.rebuild(self.model, cfg.model, spec, self.datasets.statistics,
                                   cfg.precision.float32_layers, cfg.precision.float16_layers), spec)
            function = models.graph_function(served, self.golden.x.shape[1:])
            # Golden and validation rows in separate calls: a graph's rounding may depend on the batch's size.
            self._built[policy] = Rebuilt(served, function, _outputs(function, self.golden.x),
                                          _outputs(function, self.validation.x))
        return self._built[policy]


def batch_sizes(golden_rows: int) -> tuple[int, ...]:
    """Batch 1 and the golden batch's size (export.parity_rows), the largest batch the gate sends the live server.

    Neither the export nor the serving config names the server's largest batch (serving.batch_size is a client's
    rows per call; max_batch_size is a flag file of python -m serving), so the gate's largest batch stands in."""
    return tuple(sorted({1, golden_rows}))


def measure(rebuilds: Rebuilds, candidates: tuple[str, ...], cfg: Config, trained_policy: str) -> precision.Measured:
    """Each candidate's parity verdict and rows/s at each of batch_sizes(), on the validation rows."""
    refused = {policy: why for policy in candidates if (why := _refusal(rebuilds, policy, cfg, trained_policy))}
    rows = max(rebuilds.golden.x, rebuilds.validation.x, key=len)
    sizes = batch_sizes(len(rebuilds.golden.x))
    rates: dict[str, dict[int, float]] = {policy: {} for policy in candidates}
    for size in sizes:
        starts = range(0, len(rows) - size + 1, size)[:DISTINCT_BATCHES]  # golden rows <= rows: at least one
        batches = [tf.constant(rows[start:start + size]) for start in starts]
        calls = {policy: _caller(rebuilds[policy].function, batches) for policy in candidates}
        seconds = precision.median_seconds(calls, warmup=1, min_rounds=MIN_ROUNDS, max_rounds=MAX_ROUNDS,
                                       budget_s=BUDGET_S)
        for policy in candidates:
            rates[policy][size] = precision.measured_rate(seconds[policy], size)
    method = (f"each candidate's serving graph on the validation rows at batch {' and '.join(map(str, sizes))} "
              f"(batch {sizes[-1]}: export.parity_rows, the gate's largest batch; the configs name no server batch "
              f"limit): 1 warm-up call, then the median call of {MIN_ROUNDS} to {MAX_ROUNDS} interleaved rounds "
              f"within {BUDGET_S:g} s per batch size")
    return precision.Measured("rows/s", rates, method, gated=True, refused=refused)


def _refusal(rebuilds: Rebuilds, policy: str, cfg: Config, trained_policy: str) -> str | None:
    """Why the parity gate would refuse serving this candidate (its precision rule against float32, finite outputs
    at the input limits), or None."""
    spec, candidate, float32 = rebuilds.datasets.spec, rebuilds[policy], rebuilds["float32"]
    gate = parity.Gate(rebuilds.golden, trained_policy=trained_policy, serving_policy=policy,
                       parity_tolerance=cfg.export.parity_tolerance, validation=rebuilds.validation)
    gate.add("float32", float32.golden, "float32", validation_outputs=float32.validation)
    if policy != "float32":  # float32 is the yardstick itself
        gate.add("serving", candidate.golden, policy, validation_outputs=candidate.validation)
        gate.precision("serving", precision.tolerance(policy, cfg.export.tolerances))

    def signature(**inputs):  # how the probe calls a SavedModel's signature
        return candidate.function(inputs[spec.input_name])

    gate.probe_input_limits(policy, parity.probe_input_limits(signature, spec.input_name, rebuilds.datasets.statistics,
                                                              spec.input_shape, per_column=spec.image_shape is None,
                                                              ids=spec.categorical))
    return "; ".join(gate.failures()) or None


def _caller(function: Callable[[Any], dict], batches: list) -> Callable[[], None]:
    """One call per round on the next batch, its outputs read back so that the call has finished."""
    cycle = itertools.cycle(batches)

    def call() -> None:
        for tensor in function(next(cycle)).values():
            tensor.numpy()

    return call


def _outputs(function: Callable[[Any], dict], x: np.ndarray) -> dict[str, np.ndarray]:
    return {name: keras.ops.convert_to_numpy(tensor) for name, tensor in function(tf.constant(x)).items()}
