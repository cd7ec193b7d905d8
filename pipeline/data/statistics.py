"""Statistics of the training rows, gathered in one streaming pass: what the model's standardisation, the
input-limit probes, the build's checks and the logs need, without holding the rows.

Values are accumulated per flat feature in float64 (Chan, Golub and LeVeque's pairwise update of the mean and
the sum of squared deviations, one batch at a time), whatever the precision policy (docs/data.md#statistics),
once per run rather than once per model build (Normalization.adapt). The pass also keeps a
bounded sample of real training rows, for the checks that run rows through the model at build time
(over_range, nonfinite, columns): the first SAMPLE_ROWS rows and, for each feature, the row that holds its
largest magnitude (the rows most likely to overflow float16).

Recorded in the run directory (data/statistics.json and data/sample.npz) by train, so that a resumed run and
export, verify, audit and diagnose rebuild the model from the same numbers without reading the data again.
"""

from __future__ import annotations

import dataclasses
import json
import math
from pathlib import Path
from typing import Any

import numpy as np

from pipeline import artifacts

SAMPLE_ROWS = 4096
SAMPLE_BYTES = 64 * 2 ** 20  # the sample's rows: at most this much memory (fewer rows for large images)
EXTREME_ROWS_MAX_WIDTH = 2048  # each feature's extreme row for rows up to this wide (tabular); wider rows: none
STATISTICS_FILE, SAMPLE_FILE = "statistics.json", "sample.npz"


@dataclasses.dataclass(frozen=True)
class Statistics:
    """The training rows, summarised. Per-feature arrays are float64 over the flat row ([width])."""

    rows: int  # training rows (bad records excluded)
    validation_rows: int
    value_rows: int  # the rows whose values fed mean .. maximum: every training row, or data.statistics_rows
    mean: np.ndarray
    variance: np.ndarray  # population variance (ddof 0), as numpy's var and Keras' Normalization
    minimum: np.ndarray
    maximum: np.ndarray
    sample_x: np.ndarray  # float32 [n, *row shape]: training rows for the build's checks (module docstring)
    sample_y: np.ndarray
    class_counts: tuple[int, ...] = ()  # classification: training rows per class id
    validation_class_counts: tuple[int, ...] = ()
    target_mean: float = 0.0  # regression: the training targets' mean and standard deviation
    target_std: float = 1.0
    rows_per_file: dict[str, int] = dataclasses.field(default_factory=dict)  # records per file (bad ones included)
    bad_records: tuple[dict, ...] = ()  # {"file", "record", "reason"} of each record skipped (data.max_bad_records)
    longest_sequence: int = 0  # token sequences: the most ids in one row
    seconds: float = 0.0  # the pass's wall time
    fingerprint: str = ""  # the data config and files the numbers were computed from (datasets.fingerprint)

    @property
    def width(self) -> int:
        return len(self.mean)

    @property
    def rows_per_second(self) -> float | None:
        """The pass's rate: a lower bound of the input pipeline's own rate (it also accumulates in numpy)."""
        read = self.rows + self.validation_rows
        return round(read / self.seconds, 1) if self.seconds > 0 and read else None

    def standardization(self, channels: int) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
        """(mean, variance, largest magnitude) per channel of channels-last rows flattened (channel = position %
        channels; channels = width: per feature). A channel pools its positions, which hold value_rows rows each."""
        group = lambda values: values.reshape(-1, channels)  # noqa: E731 - [positions per channel, channels]
        mean = group(self.mean).mean(axis=0)
        second_moment = group(self.variance + self.mean ** 2).mean(axis=0)
        variance = np.maximum(second_moment - mean ** 2, 0.0)
        largest = np.maximum(np.abs(group(self.minimum)), np.abs(group(self.maximum))).max(axis=0)
        return mean, variance, largest

    def largest_magnitude(self) -> float:
        return float(max(np.abs(self.minimum).max(initial=0.0), np.abs(self.maximum).max(initial=0.0)))

    def to_dict(self) -> dict[str, Any]:
        """statistics.json: everything but the sample (sample.npz)."""
        found = {field.name: getattr(self, field.name) for field in dataclasses.fields(self)
                 if field.name not in ("sample_x", "sample_y")}
        for name in ("mean", "variance", "minimum", "maximum"):
            found[name] = found[name].tolist()
        found["class_counts"], found["validation_class_counts"] = list(self.class_counts), list(self.validation_class_counts)
        found["bad_records"] = list(self.bad_records)
        found["rows_per_second"] = self.rows_per_second
        return found


class Accumulator:
    """Adds up batches of training rows (flat float rows, labels) into Statistics, in float64."""

    def __init__(self, row_shape: tuple[int | None, ...], task: str, sample: bool = True) -> None:
        self.growable = row_shape == (None,)  # token ids: as wide as the longest sequence so far
        self.row_shape, self.task = ((0,) if self.growable else row_shape), task
        self.width = math.prod(self.row_shape)
        self.rows = 0
        self.moments = _Moments(np.zeros(self.width))
        self.minimum = np.full(self.width, np.inf)
        self.maximum = np.full(self.width, -np.inf)
        self.class_counts = np.zeros(0, np.int64)
        self.targets = _Moments()
        # sample=False: a part whose rows come after a full sample (a later shard of the pass) keeps none.
        self.sample_limit = max(1, min(SAMPLE_ROWS, SAMPLE_BYTES // (4 * max(self.width, 1)))) if sample else 0
        self.sample_x: list[np.ndarray] = []
        self.sample_y: list[np.ndarray] = []
        self.sampled = 0
        track = self.width <= EXTREME_ROWS_MAX_WIDTH
        self.extreme_value = np.full(self.width, -1.0) if track else None
        self.extreme_x = np.zeros((self.width, self.width), np.float32) if track else None
        self.extreme_y: list[Any] = [None] * self.width if track else []

    def add(self, x: np.ndarray, y: np.ndarray) -> None:
        """x: [n, width] (any float dtype; token ids padded with 0 to any width), y: [n] class ids or targets."""
        n = len(x)
        if not n:
            return
        if self.growable:
            x = self._fit_width(np.asarray(x).reshape(n, -1))
        self.rows += n
        self._count_labels(y)
        if self.sampled < self.sample_limit:
            take = min(n, self.sample_limit - self.sampled)
            self.sample_x.append(np.asarray(x[:take], np.float32))
            self.sample_y.append(np.asarray(y[:take]))
            self.sampled += take
        values = np.asarray(x, np.float64).reshape(n, self.width)
        self.moments.add(values)
        np.minimum(self.minimum, values.min(axis=0), out=self.minimum)
        np.maximum(self.maximum, values.max(axis=0), out=self.maximum)
        if self.extreme_value is not None:
            self._keep_extremes(np.asarray(x).reshape(n, self.width), y)

    def _fit_width(self, x: np.ndarray) -> np.ndarray:
        """Token ids: pads the batch, or widens what was accumulated, so both are as wide as the longest row. The
        rows seen before held padding (0) in the new positions, and the numbers say exactly that."""
        width = x.shape[1]
        if width < self.width:
            return np.pad(x, ((0, 0), (0, self.width - width)))
        if width > self.width:
            extra = width - self.width
            self.moments.mean, self.moments.m2 = np.pad(self.moments.mean, (0, extra)), np.pad(self.moments.m2, (0, extra))
            seen = self.moments.count > 0
            self.minimum = np.pad(self.minimum, (0, extra), constant_values=0.0 if seen else np.inf)
            self.maximum = np.pad(self.maximum, (0, extra), constant_values=0.0 if seen else -np.inf)
            self.sample_x = [np.pad(part, ((0, 0), (0, extra))) for part in self.sample_x]
            self.width, self.row_shape = width, (width,)
            self.sample_limit = max(1, min(SAMPLE_ROWS, SAMPLE_BYTES // (4 * width)))
            self.extreme_value = self.extreme_x = None  # token ids: no extreme rows (ids are never standardised)
            self.extreme_y = []
        return x

    def merge(self, other: "Accumulator") -> None:
        """Adds what other accumulated (the rows after this one's), as if this one had seen them itself."""
        if self.growable and other.width != self.width:
            if other.width > self.width:
                self._fit_width(np.zeros((0, other.width)))
            else:
                other._fit_width(np.zeros((0, self.width)))
        self.rows += other.rows
        self.class_counts = add_counts(self.class_counts, other.class_counts)
        self.targets.merge(other.targets)
        for x, y in zip(other.sample_x, other.sample_y):
            take = min(len(x), self.sample_limit - self.sampled)
            if take <= 0:
                break
            self.sample_x.append(x[:take])
            self.sample_y.append(y[:take])
            self.sampled += take
        if other.moments.count:
            self.moments.merge(other.moments)
            np.minimum(self.minimum, other.minimum, out=self.minimum)
            np.maximum(self.maximum, other.maximum, out=self.maximum)
        if self.extreme_value is not None and other.extreme_value is not None:
            better = np.flatnonzero(other.extreme_value > self.extreme_value)
            self.extreme_value[better] = other.extreme_value[better]
            self.extreme_x[better] = other.extreme_x[better]
            for j in better:
                self.extreme_y[j] = other.extreme_y[j]

    def _count_labels(self, y: np.ndarray) -> None:
        if self.task == "regression":
            self.targets.add(np.asarray(y, np.float64).reshape(-1))
            return
        self.class_counts = add_counts(self.class_counts, np.bincount(np.asarray(y, np.int64).reshape(-1)))

    def _keep_extremes(self, x: np.ndarray, y: np.ndarray) -> None:
        # Per column, in its own dtype; argmax along contiguous rows of the transpose is ~30x faster than down
        # the columns of a [4096, 784] batch.
        magnitude = np.ascontiguousarray(np.abs(x).T)
        rows = magnitude.argmax(axis=1)
        largest = magnitude[np.arange(self.width), rows].astype(np.float64)
        better = np.flatnonzero(largest > self.extreme_value)
        self.extreme_value[better] = largest[better]
        self.extreme_x[better] = x[rows[better]]
        for j in better:
            self.extreme_y[j] = y[rows[j]]

    def result(self, *, validation_rows: int = 0, validation_class_counts: np.ndarray | None = None,
               **recorded: Any) -> Statistics:
        """The statistics; recorded: rows_per_file, bad_records, longest_sequence, seconds, fingerprint."""
        moments, empty = self.moments, self.moments.count == 0
        sample_x, sample_y = self._sample()
        targets = self.targets.mean_and_std()
        return Statistics(
            rows=self.rows, validation_rows=validation_rows, value_rows=moments.count,
            mean=moments.mean.copy(), variance=moments.m2 / max(moments.count, 1),
            minimum=np.zeros(self.width) if empty else self.minimum.copy(),
            maximum=np.zeros(self.width) if empty else self.maximum.copy(),
            sample_x=sample_x, sample_y=sample_y,
            class_counts=tuple(int(c) for c in self.class_counts),
            validation_class_counts=tuple(int(c) for c in (validation_class_counts if validation_class_counts is not None
                                                           else ())),
            target_mean=targets[0], target_std=targets[1], **recorded)

    def _sample(self) -> tuple[np.ndarray, np.ndarray]:
        """The first rows, then each feature's extreme row (each row once), in the rows' own shape."""
        xs = [*self.sample_x]
        ys = [*self.sample_y]
        if self.extreme_value is not None:
            held = np.flatnonzero(self.extreme_value >= 0)
            rows, first = np.unique(self.extreme_x[held], axis=0, return_index=True)
            sampled = {row.tobytes() for part in xs for row in part.reshape(len(part), -1).astype(np.float32)}
            new = [i for i, row in enumerate(rows.astype(np.float32)) if row.tobytes() not in sampled]
            if new:
                xs.append(rows[new].astype(np.float32))
                ys.append(np.asarray([self.extreme_y[held[first[i]]] for i in new]))
        if not xs:
            return np.zeros((0, *self.row_shape), np.float32), np.zeros(0)
        x = np.concatenate([part.reshape(len(part), -1) for part in xs]).astype(np.float32)
        return x.reshape(len(x), *self.row_shape), np.concatenate(ys)


def of_rows(x: np.ndarray, y: np.ndarray | None = None, task: str = "classification", **recorded: Any) -> Statistics:
    """The statistics of rows held in memory (labels default to 0): the same numbers the pass gives; recorded as
    Accumulator.result takes them."""
    y = np.zeros(len(x), np.int64) if y is None else y
    accumulator = Accumulator(tuple(x.shape[1:]), task)
    for start in range(0, len(x), SAMPLE_ROWS):
        accumulator.add(x[start:start + SAMPLE_ROWS], y[start:start + SAMPLE_ROWS])
    return accumulator.result(**recorded)


def add_counts(total: np.ndarray, counts: np.ndarray) -> np.ndarray:
    """Counts per class id added up, the shorter array padded with zeros: class ids appear as the rows come."""
    width = max(len(total), len(counts))
    return np.pad(np.asarray(total, np.int64), (0, width - len(total))) + np.pad(counts, (0, width - len(counts)))


class _Moments:
    """Count, mean and sum of squared deviations (M2) of a stream of values, per feature when they are rows, in
    float64; batches are merged by Chan, Golub and LeVeque's pairwise update, stable for means far from zero."""

    def __init__(self, zero: float | np.ndarray = 0.0) -> None:
        self.count, self.mean, self.m2 = 0, zero, zero

    def add(self, values: np.ndarray) -> None:
        """values: [n] numbers, or [n, width] rows (float64)."""
        if len(values):
            batch = _Moments()
            batch.count, batch.mean = len(values), values.mean(axis=0)
            batch.m2 = ((values - batch.mean) ** 2).sum(axis=0)
            self.merge(batch)

    def merge(self, other: "_Moments") -> None:
        if not other.count:
            return
        total = self.count + other.count
        delta = other.mean - self.mean
        self.mean = self.mean + delta * (other.count / total)
        self.m2 = self.m2 + other.m2 + delta ** 2 * (self.count * other.count / total)
        self.count = total

    def mean_and_std(self) -> tuple[float, float]:
        """(mean, population standard deviation) of numbers; (0, 1) for none or no spread."""
        std = math.sqrt(self.m2 / self.count) if self.count else 1.0
        return float(self.mean), float(std) or 1.0


def save(statistics: Statistics, directory: Path) -> None:
    """statistics.json and sample.npz into directory (the run's data/), each written atomically."""
    directory.mkdir(parents=True, exist_ok=True)
    with artifacts.atomic_file(directory / SAMPLE_FILE) as tmp:
        with open(tmp, "wb") as f:
            np.savez(f, x=statistics.sample_x, y=statistics.sample_y)
    artifacts.write_json_atomic(directory / STATISTICS_FILE, statistics.to_dict())


def load(directory: Path, fingerprint: str) -> Statistics | None:
    """The statistics recorded in directory for this fingerprint; None when there are none, or they were computed
    from other data or settings (or by a version of the pipeline that recorded none)."""
    try:
        found = json.loads((directory / STATISTICS_FILE).read_text())
        if found.get("fingerprint") != fingerprint:
            return None
        with np.load(directory / SAMPLE_FILE) as sample:
            sample_x, sample_y = sample["x"], sample["y"]
    except (OSError, ValueError, KeyError):
        return None
    found.pop("rows_per_second", None)
    for name in ("mean", "variance", "minimum", "maximum"):
        found[name] = np.asarray(found[name], np.float64)
    found["class_counts"] = tuple(found["class_counts"])
    found["validation_class_counts"] = tuple(found["validation_class_counts"])
    found["bad_records"] = tuple(found["bad_records"])
    return Statistics(sample_x=sample_x, sample_y=sample_y, **found)
