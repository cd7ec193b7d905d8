"""`python -m pipeline score MODEL_DIR --input PATTERN --output DIR`: batch predictions for files of rows.

What TFX's BulkInferrer does, on the project's own inference path: every input shard (csv, npz, tfrecord;
pipeline/score/shards.py) is one task on the engine (pipeline/score/engine.py); a worker loads the version once
(serving.servable.runner.Runner, under the version's recorded policy, as the server loads it), runs the
rows through it in batches of --batch_size and writes the shard's predictions as one Parquet file
(pipeline/score/predictions.py). A version trained on an image folder also scores images (a folder, image
files, tfrecords of `image/encoded`; pipeline/score/images.py): their bytes go to its predict_images signature
through the same Runner. Rows that cannot be read, or that the model refuses, are counted by kind and written
aside, never fatal. The output directory is staged beside DIR and renamed into place only when every shard is
written (pipeline/artifacts.py), so a job that dies leaves the previous DIR (or none), never half of one.

    DIR/predictions/part-00000.parquet ...   one per input shard, in the order of the sorted input files
    DIR/bad_rows/part-00000.jsonl ...        the shard's unreadable rows (row, kind, message, raw), if any
    DIR/summary.json                         model, inputs, rows, bad rows by kind, throughput, engine
"""

from __future__ import annotations

import dataclasses
import json
import logging
import math
import time
from collections import Counter
from pathlib import Path
from typing import Any

import numpy as np

from pipeline import artifacts
from pipeline.score import engine
from pipeline.errors import DataError
from pipeline.score import images, predictions, shards, tasks

log = logging.getLogger(__name__)

SUMMARY_FILE = "summary.json"
PREDICTIONS_DIR = "predictions"
BAD_ROWS_DIR = "bad_rows"
CHUNK_ROWS = 8192  # rows run through the model between two writes of a shard's predictions (a Parquet row group)


@dataclasses.dataclass(frozen=True)
class ShardJob:
    """One task: score one input file into one predictions part (and a bad-rows part if it has any)."""

    version_dir: str
    layout: shards.Layout
    input: shards.Input
    part: str  # "part-00003"
    output_dir: str  # the staging directory
    batch_size: int
    label_names: tuple[str, ...] = ()


@dataclasses.dataclass(frozen=True)
class ShardResult:
    input_path: str
    rows: int  # rows read, bad ones included
    scored: int
    bad: dict[str, int]
    seconds: float


def score(model_dir: str | Path, inputs: list[str], output: str | Path, *, batch_size: int = 256,
          keep: tuple[str, ...] = (), overwrite: bool = False,
          options: engine.EngineOptions = engine.EngineOptions()) -> dict[str, Any]:
    """Scores every row of the input files with the version at model_dir; returns the summary (summary.json).

    Raises:
        DataError: no file matches, an unknown format, a shard whose columns or shape do not fit the model,
            an output that exists without overwrite (nothing is written).
        RunnerError: the version does not load (e.g. its graph contradicts its recorded policy).
    """
    started = time.perf_counter()
    output = Path(output)
    if output.exists() and not overwrite:
        raise DataError(f"--output: {output} already exists; pass --overwrite to replace it (it is replaced only "
                        "once the new predictions are complete)")
    items = tasks.expand(inputs)
    runner = load(model_dir)
    layout = layout_for(runner, keep)
    items = [tasks.check_head(item, layout) for item in items]
    label_names = tuple((runner.metadata or {}).get("label_names") or ()) \
        if (runner.metadata or {}).get("task") == "classification" else ()
    with artifacts.atomic_dir(output, replace=overwrite) as staging:
        (staging / PREDICTIONS_DIR).mkdir()
        jobs = [ShardJob(str(runner.path), layout, item, f"part-{i:05d}", str(staging), batch_size, label_names)
                for i, item in enumerate(items)]
        engine.uses(("runner", str(runner.path)))
        with engine.client(options) as dask_client:
            if not options.cluster:  # this process is the worker: it loads the version once, not twice
                engine.cached(("runner", str(runner.path)), lambda: runner)
            progress = engine.Progress("score", len(jobs))
            log.info("score: %d shards with %s (policy %s) on the %s", len(jobs), runner.path, runner.policy,
                     options.describe())
            results = engine.run(dask_client, score_shard, jobs, progress=lambda done, r: progress(done, r.rows))
        summary = _summary(runner, jobs, results, progress.seconds, time.perf_counter() - started, options)
        artifacts.write_json_atomic(staging / SUMMARY_FILE, summary)
    if options.cluster:
        runner.close()
    return summary


def layout_for(runner: Any, keep: tuple[str, ...] = ()) -> shards.Layout:
    """The row layout of a version: its serving_default's one float32 input, and pipeline.json's data config."""
    import tensorflow as tf

    signature = runner.signature("")
    if len(signature.inputs) != 1:
        raise DataError(f"{runner.path}: score feeds one input, but {signature.name} takes "
                        f"{', '.join(sorted(signature.inputs))}")
    [(name, spec)] = signature.inputs.items()
    if spec.dtype != tf.float32.as_datatype_enum or not spec.dims or spec.dims[0] != -1 or -1 in spec.dims[1:]:
        raise DataError(f"{runner.path}: score feeds float32 rows of a known shape, but {signature.name}'s input "
                        f"{name!r} is {tf.as_dtype(spec.dtype).name} {list(spec.dims or [])}")
    data = ((runner.metadata or {}).get("config") or {}).get("data") or {}
    columns = tuple(data["feature_columns"]) if data.get("source") == "csv" and data.get("feature_columns") else None
    feature_spec = None
    if data.get("source") == "tfrecord" and data.get("feature_spec"):
        feature_spec = tuple((feature, math.prod(info.get("shape") or [1])) for feature, info in data["feature_spec"].items())
    return shards.Layout(name, tuple(spec.dims[1:]), columns=columns, label=data.get("label"), keep=tuple(keep),
                         feature_spec=feature_spec, images=_image_limits(runner))


def _image_limits(runner: Any) -> tuple[int, int] | None:
    """predict_images' (min_image_side, max_image_pixels) as pipeline.json records them; None when the version
    takes no images (pipeline.json has no predict_images signature, or the SavedModel lacks it)."""
    from pipeline.export.signatures import IMAGES_INPUT, IMAGES_SIGNATURE

    recorded = ((runner.metadata or {}).get("signatures") or {}).get(IMAGES_SIGNATURE) or {}
    limits = (recorded.get("inputs") or {}).get(IMAGES_INPUT) or {}
    if IMAGES_SIGNATURE not in runner.signatures or "max_image_pixels" not in limits:
        return None
    return int(limits["min_image_side"]), int(limits["max_image_pixels"])


def load(model_dir: str | Path) -> Any:
    """The version as the server loads it: Runner.load, then its warmup requests replayed (so the first shard
    does not pay for the first calls)."""
    from serving.servable.runner import Runner
    from serving.servable.warmup import run_warmup

    runner = Runner.load(model_dir)
    run_warmup(runner, runner.path)
    return runner


def score_shard(job: ShardJob) -> ShardResult:
    """The task: one input through the version, into predictions/<part>.parquet (runs on a worker)."""
    start = time.perf_counter()
    runner = engine.cached(("runner", job.version_dir), lambda: load(job.version_dir))
    path = Path(job.output_dir) / PREDICTIONS_DIR / f"{job.part}.parquet"
    with predictions.Writer(path) as writer:
        score_input = _score_images if job.input.format in shards.IMAGE_FORMATS else _score_rows
        scored, bad = score_input(runner, job, writer)
    if bad:
        _write_bad_rows(Path(job.output_dir) / BAD_ROWS_DIR / f"{job.part}.jsonl", job.input.path,
                        sorted(bad, key=lambda b: (b.source or job.input.path, b.row)))
    return ShardResult(job.input.path, scored + len(bad), scored, dict(Counter(b.kind for b in bad)),
                       time.perf_counter() - start)


def _score_rows(runner: Any, job: ShardJob, writer: predictions.Writer) -> tuple[int, list[shards.BadRow]]:
    """A file of rows (csv, npz, tfrecord) through serving_default; returns (rows scored, bad rows)."""
    rows = shards.read(job.input.path, job.layout)
    bad, scored = list(rows.bad), 0
    # A chunk's predictions are written (on the writer's thread) while the next chunk runs through the model.
    for start in range(0, max(len(rows.x), 1), CHUNK_ROWS):
        chunk = _slice(rows, start, start + CHUNK_ROWS)
        outputs, refused = _predict(runner, job.layout, job.layout.input_name, chunk.x, job.batch_size)
        if refused:
            bad += [shards.BadRow(int(chunk.rows[i]), "model_rejected", message) for i, message in refused.items()]
            kept = np.ones(len(chunk.rows), bool)
            kept[list(refused)] = False
            chunk = _slice(chunk, kept)
            outputs = {name: values[kept] for name, values in outputs.items()}
        writer.put(predictions.table, job.input.path, chunk.rows, job.layout.keep, chunk.kept, outputs,
                   job.label_names)
        scored += len(chunk.rows)
    return scored, bad


def _score_images(runner: Any, job: ShardJob, writer: predictions.Writer) -> tuple[int, list[shards.BadRow]]:
    """Image files or a tfrecord of images through predict_images, a batch of bytes at a time; returns (rows
    scored, bad rows). A row the model refuses is a bad row of the kind its header check names."""
    from pipeline.export.signatures import IMAGES_INPUT, IMAGES_SIGNATURE

    batches = images.file_batches(job.input.files, job.batch_size) if job.input.format == "images" \
        else images.record_batches(job.input.path, job.batch_size)
    bad, scored, pending = [], 0, []

    def flush() -> None:  # one Parquet row group of up to CHUNK_ROWS rows
        sources = [source for part in pending for source in part[0]]
        rows = np.concatenate([part[1] for part in pending])
        outputs = {name: np.concatenate([part[2][name] for part in pending]) for name in pending[0][2]}
        writer.put(predictions.table, sources, rows, job.layout.keep, {}, outputs, job.label_names)
        pending.clear()

    for batch in batches:
        outputs, refused = _predict(runner, job.layout, IMAGES_INPUT, batch.values, job.batch_size, IMAGES_SIGNATURE)
        bad += batch.bad
        kept = np.ones(len(batch.values), bool)
        if refused:
            order = sorted(refused)
            kinds = images.refusal_kinds(batch.values[order], *job.layout.images)
            bad += [shards.BadRow(int(batch.rows[i]), kind, refused[i], images.raw(batch.values[i]), batch.sources[i])
                    for i, kind in zip(order, kinds)]
            kept[order] = False
        pending.append(([s for s, k in zip(batch.sources, kept) if k], batch.rows[kept],
                        {name: values[kept] for name, values in outputs.items()}))
        scored += int(kept.sum())
        if sum(len(part[1]) for part in pending) >= CHUNK_ROWS:
            flush()
    if pending:
        flush()
    return scored, bad


def _slice(rows: shards.Rows, start: int | np.ndarray, stop: int | None = None) -> shards.Rows:
    """Rows start:stop (or where a boolean mask is True), with their kept columns; no bad rows."""
    index = slice(start, stop) if stop is not None else start
    kept = {name: list(np.asarray(values, object)[index]) for name, values in rows.kept.items()}
    return shards.Rows(rows.x[index], rows.rows[index], [], kept)


def _predict(runner: Any, layout: shards.Layout, input_name: str, values: np.ndarray, batch_size: int,
             signature_name: str = "") -> tuple[dict[str, np.ndarray], dict[int, str]]:
    """The rows' outputs in batches, and {row: the model's message} for the rows it refuses (their outputs zero).

    A batch the model refuses (predict_images refuses a whole batch for one bad image) is split in halves and
    run again, down to single rows, so k bad rows among n cost about 2k log2(n/k) extra calls, not n."""
    done: list[tuple[int, dict[str, np.ndarray]]] = []
    refused: dict[int, str] = {}
    for start in range(0, len(values), batch_size):
        _run_split(runner, signature_name, input_name, values, start, min(start + batch_size, len(values)), done,
                   refused)
    template = done[0][1] if done else _no_rows(runner, layout)
    outputs = {name: np.zeros((len(values), *array.shape[1:]), array.dtype) for name, array in template.items()}
    for start, part in done:
        for name, array in part.items():
            outputs[name][start:start + len(array)] = array
    return outputs, refused


def _run_split(runner: Any, signature_name: str, input_name: str, values: np.ndarray, start: int, stop: int,
               done: list, refused: dict[int, str]) -> None:
    from serving.errors import InputError

    try:
        done.append((start, runner.predict({input_name: values[start:stop]}, signature_name)))
    except InputError as error:
        if stop - start == 1:
            refused[start] = str(error)
            return
        middle = (start + stop) // 2
        _run_split(runner, signature_name, input_name, values, start, middle, done, refused)
        _run_split(runner, signature_name, input_name, values, middle, stop, done, refused)


def _no_rows(runner: Any, layout: shards.Layout) -> dict[str, np.ndarray]:
    """serving_default's outputs for no rows (predict_images answers the same outputs): an empty part's columns."""
    answer = runner.predict({layout.input_name: np.zeros((1, *layout.shape), np.float32)})
    return {name: array[:0] for name, array in answer.items()}


def _write_bad_rows(path: Path, source: str, bad: list[shards.BadRow]) -> None:
    path.parent.mkdir(exist_ok=True)
    with open(path, "w") as f:
        for row in bad:
            fields = dataclasses.asdict(row)
            f.write(json.dumps({"source": fields.pop("source") or source, **fields}) + "\n")


def _summary(runner: Any, jobs: list[ShardJob], results: list[ShardResult], scoring_s: float,
             total_s: float, options: engine.EngineOptions) -> dict[str, Any]:
    rows = sum(r.rows for r in results)
    scored = sum(r.scored for r in results)
    bad = Counter()
    for result in results:
        bad.update(result.bad)
    return {
        "format": 1,
        "model": {"name": runner.model_name, "version": runner.version, "path": str(runner.path),
                  "policy": runner.policy},
        "engine": options.describe(),
        "batch_size": jobs[0].batch_size if jobs else None,
        "rows": rows, "scored": scored, "bad_rows": sum(bad.values()), "bad_rows_by_kind": dict(sorted(bad.items())),
        "seconds": {"scoring": round(scoring_s, 3), "total": round(total_s, 3)},
        "rows_per_second": round(rows / scoring_s, 1) if scoring_s > 0 else None,
        "shards": [{"input": r.input_path, **({"image_files": len(job.input.files)} if job.input.files else {}),
                    "predictions": f"{PREDICTIONS_DIR}/{job.part}.parquet", "rows": r.rows, "scored": r.scored,
                    "bad_rows": dict(sorted(r.bad.items())), "seconds": round(r.seconds, 3)}
                   for job, r in zip(jobs, results)],
    }


def print_summary(summary: dict[str, Any], output: str | Path) -> None:
    """The summary in a few lines, for the terminal."""
    bad = ", ".join(f"{kind} {count:,}" for kind, count in summary["bad_rows_by_kind"].items())
    model = summary["model"]
    print(f"scored {summary['scored']:,} of {summary['rows']:,} rows from {len(summary['shards'])} shards with "
          f"{model['name']} version {model['version']} ({model['policy']}) on the {summary['engine']}")
    print(f"{summary['rows_per_second']:,.0f} rows/s ({summary['seconds']['scoring']:.2f} s scoring, "
          f"{summary['seconds']['total']:.2f} s in all); bad rows: {summary['bad_rows']:,}" + (f" ({bad})" if bad else ""))
    print(f"predictions: {Path(output) / PREDICTIONS_DIR}/" + (f", bad rows: {Path(output) / BAD_ROWS_DIR}/"
                                                                if summary["bad_rows"] else "")
          + f", summary: {Path(output) / SUMMARY_FILE}")
