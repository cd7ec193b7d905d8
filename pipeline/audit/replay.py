"""The audit's two tasks, one per request-log file, run on the batch engine (pipeline/score/engine.py).

scan(path): what the file holds (records, RPC kinds, model names, answering versions), so the driver can refuse
a log of another model and build one reference per version before anything is replayed.

replay(job): each logged request through the reference of the version that answered it, as the server ran it
(serving/servable/inference.py: prepare -> run -> respond), and the reference's response compared with the
logged one, row by row. Predict, Classify and Regress logs are replayed (predict_images and classify_images
requests too: their image bytes go through the reference's own header checks and decode); requests of the same
signature, outputs and row shape are merged into model calls of up to batch_size rows, as the server's batcher
merges them, and a merged call the reference refuses is run again one request at a time, so only the refused
request is left out (counted as not replayed).
"""

from __future__ import annotations

import dataclasses
import heapq
from collections import Counter
from collections.abc import Iterator
from typing import Any

import numpy as np

from pipeline.score import engine
from pipeline.score import shards
from pipeline.errors import DataError

WINDOW = 2048  # records prepared, run and compared at a time: bounds a worker's memory on long logs
WINDOW_BYTES = 64 * 1024 * 1024  # ... or fewer, when they hold this much (requests of images are large)
ARGMAX_OUTPUTS = ("probabilities", "scores")  # a classifier's class scores: argmax agreement is reported on them


@dataclasses.dataclass(frozen=True)
class Scan:
    path: str
    records: int
    kinds: dict[str, int]
    models: dict[str, int]
    versions: dict[int, int]  # 0: a record that names no version


@dataclasses.dataclass(frozen=True)
class ReplayJob:
    path: str
    references: dict[int, str]  # answering version -> the reference's version directory
    batch_size: int
    reproducers: int  # the worst rows per (version, output) to send back whole
    default_version: int | None = None  # for records that name no version (MODEL_DIR was a version directory)
    served: dict[int, str] = dataclasses.field(default_factory=dict)  # a language model's served version directories


@dataclasses.dataclass
class OutputRows:
    """One output of one version, row by row: max |served - reference| and max |reference| of each row."""

    abs_diff: list[np.ndarray] = dataclasses.field(default_factory=list)
    ref_max: list[np.ndarray] = dataclasses.field(default_factory=list)
    sum_abs: float = 0.0
    values: int = 0
    agree: list[np.ndarray] = dataclasses.field(default_factory=list)  # argmax outputs only

    def merge(self, other: "OutputRows") -> None:
        self.abs_diff += other.abs_diff
        self.ref_max += other.ref_max
        self.sum_abs += other.sum_abs
        self.values += other.values
        self.agree += other.agree


@dataclasses.dataclass(frozen=True, order=True)
class Candidate:
    """A row that may be beyond the tolerance: enough to reproduce it (the logged record) and show it."""

    abs_diff: float
    path: str
    record: int
    row: int
    version: int = dataclasses.field(compare=False)
    output: str = dataclasses.field(compare=False)
    served: list = dataclasses.field(compare=False)
    reference: list = dataclasses.field(compare=False)
    raw: bytes = dataclasses.field(compare=False, repr=False)
    step: int | None = dataclasses.field(default=None, compare=False)  # a language model's worst generated step


@dataclasses.dataclass
class ReplayResult:
    path: str
    replayed: int = 0  # records
    rows: int = 0
    skipped: Counter = dataclasses.field(default_factory=Counter)  # records not replayed, by reason
    outputs: dict[tuple[int, str], OutputRows] = dataclasses.field(default_factory=dict)
    candidates: dict[tuple[int, str], list[Candidate]] = dataclasses.field(default_factory=dict)  # min-heaps
    greedy: dict[int, list[np.ndarray]] = dataclasses.field(default_factory=dict)  # a language model's replay gaps


def records(path: str) -> Iterator[bytes]:
    """A request log's records (a file with bytes but no whole record, or a record that fails its checksum, is
    not a request log)."""
    return shards.tfrecords(path, "--log: ")


def parse(path: str, index: int, record: bytes) -> Any:
    from google.protobuf.message import DecodeError
    from tensorflow_serving.apis import prediction_log_pb2

    try:
        return prediction_log_pb2.PredictionLog.FromString(record)
    except DecodeError:
        raise DataError(f"--log: {path} record {index}: not a tensorflow.serving.PredictionLog; pass the server's "
                        "request log (logging_config) or a warmup file") from None


def answered_by(log: Any, kind: str | None) -> tuple[str, int]:
    """The model name and version that answered a logged request (log_metadata; else the response's spec)."""
    spec = log.log_metadata.model_spec
    if not spec.name and kind is not None:
        entry = getattr(log, kind)
        spec = entry.response.results[0].model_spec if kind == "multi_inference_log" and entry.response.results \
            else getattr(entry.response, "model_spec", spec)
    if not spec.name and kind is not None:
        request = getattr(log, kind).request
        spec = request.tasks[0].model_spec if kind == "multi_inference_log" and request.tasks else request.model_spec
    return spec.name, spec.version.value if spec.HasField("version") else 0


def scan(path: str) -> Scan:
    kinds, models, versions = Counter(), Counter(), Counter()
    count = 0
    for count, record in enumerate(records(path), start=1):
        log = parse(path, count - 1, record)
        kind = log.WhichOneof("log_type")
        kinds[kind or "empty"] += 1
        name, version = answered_by(log, kind)
        models[name] += 1
        versions[version] += 1
    return Scan(path, count, dict(kinds), dict(models), dict(versions))


def replay(job: ReplayJob) -> ReplayResult:
    """The task: one log file's requests through their references, compared with the logged responses."""
    from serving.servable.runner import Runner

    references = {version: engine.cached(("runner", path), lambda path=path: Runner.load(path))
                  for version, path in job.references.items()}
    result = ReplayResult(job.path)
    window: list[tuple[int, bytes, Any]] = []
    held = 0
    for index, record in enumerate(records(job.path)):
        window.append((index, record, parse(job.path, index, record)))
        held += len(record)
        if len(window) >= WINDOW or held >= WINDOW_BYTES:
            _replay_window(job, references, window, result)
            window, held = [], 0
    _replay_window(job, references, window, result)
    return result


def _replay_window(job: ReplayJob, references: dict[int, Any], window: list, result: ReplayResult) -> None:
    from serving.servable import inference

    preparers = {"predict_log": inference.prepare_predict, "classify_log": inference.prepare_classify,
                 "regress_log": inference.prepare_regress}
    pending = []  # (index, raw, kind, logged response, version, prepared)
    for index, raw, log in window:
        kind = log.WhichOneof("log_type")
        if kind not in preparers:
            result.skipped[f"{kind or 'empty'} (not replayed)"] += 1
            continue
        version = answered_by(log, kind)[1] or job.default_version
        if version not in references:
            result.skipped[f"version {version} (not audited)"] += 1
            continue
        entry = getattr(log, kind)
        try:
            prepared = preparers[kind](references[version], entry.request, max_request_elements=0) \
                if kind == "predict_log" else preparers[kind](references[version], entry.request)
        except Exception as error:  # noqa: BLE001 - the reference refusing a request the server answered is a finding
            result.skipped[f"refused by the reference: {type(error).__name__}"] += 1
            continue
        pending.append((index, raw, kind, entry.response, version, prepared))
    for (index, raw, kind, logged, version, _), response in zip(pending, _run_merged(references, pending, job.batch_size)):
        if isinstance(response, Exception):
            result.skipped[f"refused by the reference: {type(response).__name__}"] += 1
            continue
        _compare(job, result, index, raw, version, _arrays(kind, logged), _arrays(kind, response))


def _run_merged(references: dict[int, Any], pending: list, batch_size: int) -> list[Any]:
    """Each prepared request's response, its model calls merged with others of the same version, signature,
    outputs and row shape into calls of up to batch_size rows (a larger request runs whole); the error instead
    for a request the reference refuses (a merged call that fails is run again a request at a time)."""
    from serving.errors import InputError

    groups: dict[tuple, list[int]] = {}
    for i, (_, _, _, _, version, prepared) in enumerate(pending):
        [call] = prepared.model_calls
        shapes = tuple((name, array.shape[1:], array.dtype.str) for name, array in sorted(call.inputs.items()))
        groups.setdefault((version, call.signature.name, tuple(call.outputs), shapes), []).append(i)
    outputs: dict[int, Any] = {}
    for (version, *_), members in groups.items():
        runner = references[version]
        for chunk in _chunks(members, [len(next(iter(pending[i][5].model_calls[0].inputs.values()))) for i in members],
                             batch_size):
            try:
                outputs.update(zip(chunk, _run_together(runner, [pending[i][5].model_calls[0] for i in chunk])))
            except InputError:
                for i in chunk:
                    try:
                        outputs[i] = runner.run(pending[i][5].model_calls[0])
                    except InputError as error:
                        outputs[i] = error
    return [outputs[i] if isinstance(outputs[i], Exception) else pending[i][5].respond([outputs[i]])
            for i in range(len(pending))]


def _run_together(runner: Any, calls: list[Any]) -> list[dict[str, np.ndarray]]:
    """Model calls of one signature as one merged call; each call's own rows of the outputs."""
    from serving.servable.signature import ModelCall

    merged = ModelCall(calls[0].signature, {name: np.concatenate([c.inputs[name] for c in calls])
                                            for name in calls[0].inputs}, calls[0].outputs)
    values = runner.run(merged)
    answers, start = [], 0
    for call in calls:
        rows = len(next(iter(call.inputs.values())))
        answers.append({name: array[start:start + rows] for name, array in values.items()})
        start += rows
    return answers


def _chunks(members: list[int], sizes: list[int], batch_size: int) -> Iterator[list[int]]:
    chunk, rows = [], 0
    for member, size in zip(members, sizes):
        if chunk and rows + size > batch_size:
            yield chunk
            chunk, rows = [], 0
        chunk.append(member)
        rows += size
    if chunk:
        yield chunk


def _arrays(kind: str, response: Any) -> dict[str, np.ndarray]:
    """A response's numbers by output name: Predict's tensors, Classify's scores, Regress's values."""
    from serving.servable import tensors

    if kind == "predict_log":
        return {name: tensors.to_ndarray(proto, name) for name, proto in response.outputs.items()}
    if kind == "classify_log":
        return {"scores": np.array([[c.score for c in row.classes] for row in response.result.classifications],
                                   np.float32)}
    return {"outputs": np.array([r.value for r in response.result.regressions], np.float32)}


def _compare(job: ReplayJob, result: ReplayResult, index: int, raw: bytes, version: int,
             served: dict[str, np.ndarray], reference: dict[str, np.ndarray]) -> None:
    names = [name for name in sorted(set(served) & set(reference))
             if served[name].dtype.kind == "f" and served[name].shape == reference[name].shape and served[name].ndim]
    if not names:
        result.skipped["no numeric output to compare"] += 1
        return
    result.replayed += 1
    result.rows += len(served[names[0]])
    for name in names:
        a = served[name].astype(np.float64).reshape(len(served[name]), -1)
        b = reference[name].astype(np.float64).reshape(len(reference[name]), -1)
        rows = result.outputs.setdefault((version, name), OutputRows())
        abs_diff = np.abs(a - b).max(axis=1) if a.shape[1] else np.zeros(len(a))
        rows.abs_diff.append(abs_diff)
        rows.ref_max.append(np.abs(b).max(axis=1) if b.shape[1] else np.zeros(len(b)))
        rows.sum_abs += float(np.abs(a - b).sum())
        rows.values += a.size
        if name in ARGMAX_OUTPUTS and a.shape[1] > 1:
            rows.agree.append(a.argmax(axis=1) == b.argmax(axis=1))
        for row in np.argsort(-abs_diff)[:job.reproducers]:
            keep(result.candidates.setdefault((version, name), []), job.reproducers, Candidate(float(abs_diff[row]), job.path, index, int(row), version, name,
                                                     a[row].tolist(), b[row].tolist(), raw))


def keep(heap: list[Candidate], limit: int, candidate: Candidate) -> None:
    """Keeps the `limit` rows with the largest differences (a min-heap on abs_diff)."""
    if len(heap) < limit:
        heapq.heappush(heap, candidate)
    elif candidate > heap[0]:
        heapq.heapreplace(heap, candidate)
