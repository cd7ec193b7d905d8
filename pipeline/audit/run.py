"""`python -m pipeline audit MODEL_DIR --log PATTERN [--against float32|POLICY]`: live traffic vs float32.

The parity gate checks 256 golden rows at export; the audit checks the rows users sent, under the precision
that was served. The server's request log (serving/request_log.py: sampled PredictionLog TFRecords, each
with the request, the response and the version that answered) is replayed through the reference of each
answering version (pipeline/audit/twin.py: its trained weights rebuilt under --against, float32 by default),
on the batch engine (pipeline/score/engine.py), and every logged answer is compared with the reference's, row by row.

Per version and output: max and mean abs difference, max relative difference (the max abs difference as a
share of the output's largest magnitude in the log, as the parity gate measures it), the rows beyond the
tolerance and, for classifiers, argmax agreement. The tolerance is the export's (parity.json): its
export.parity_tolerance when the reference computes in the served graph's dtype, else export.tolerances of the
policy computing in the coarser dtype (max_rel_diff, min_argmax_agreement). Exit 1 when any version is beyond
it, as verify does.

A language model's log holds generate calls (prompts in, generated ids out): each row is teacher-forced, BOS +
prompt + the generated ids, through the served SavedModel and the reference, and compared at every generated
step (pipeline/audit/lm.py): its logits (max abs / rel diff, as one output `logits` whose rows are the steps),
the served model's argmax against the reference's (argmax agreement, same prefix) and, for greedy calls, whether
the logged token is the served model's own choice (`replay`: none may be beyond the tolerance).

    DIR/report.json             everything above, the log files and what was skipped, parity.json's own figures
    DIR/audit.png               per version and output: rows by relative difference, the tolerance marked
    DIR/reproducers.tfrecord    the logged requests of the worst rows beyond the tolerance: itself a request
                                log (re-audit it) and a warmup file (replay it against a server)
    DIR/reproducers.json        those rows: log file, record, row, served and reference values
    DIR/reference/<model>/<version>/  the reference SavedModels, servable (python -m serving)
"""

from __future__ import annotations

import dataclasses
import json
import logging
from collections import Counter
from pathlib import Path
from typing import Any

import numpy as np

from pipeline import artifacts, precision
from pipeline.score import engine
from pipeline.audit import lm, replay, report, twin
from pipeline.config import ExportConfig, PolicyTolerance
from pipeline.errors import DataError
from pipeline.score.shards import expand_files

log = logging.getLogger(__name__)

REFERENCE_DIR = "reference"


def audit(model_dir: str | Path, logs: list[str], *, against: str = "float32", output: str | Path | None = None,
          tolerance: float | None = None, run_dir: str | Path | None = None, reproducers: int = 20,
          batch_size: int = 256, options: engine.EngineOptions = engine.EngineOptions()) -> dict[str, Any]:
    """Audits the logged answers of the model at model_dir (a base path, or one version) against `against`;
    returns the report (report.json), whose "ok" says whether every version is within the tolerance.

    Raises:
        DataError: no log file, a file that is not a request log, a log of another model, a version that is not
            under model_dir, a version whose training run is not here (nothing is written).
    """
    from serving.servable import saved_model

    model_dir = Path(model_dir)
    base, only = _base_and_version(model_dir)
    files = expand_files(logs, "--log")
    model_name = _model_name(base, only)
    language_model = _task(base, only) == twin.LANGUAGE_MODEL
    output = Path(output or Path("build") / "audit" / f"{model_name}-vs-{against}")
    with engine.client(options) as dask_client:
        scanning = engine.Progress("audit: scanning", len(files), "log files", "requests")
        scans = engine.run(dask_client, replay.scan, files, progress=lambda done, scan: scanning(done, scan.records))
        versions = _versions(scans, model_name, base, only)
        with artifacts.atomic_dir(output, replace=True) as staging:
            references, metadata = {}, {}
            for version in sorted(versions):
                version_dir = saved_model.version_dirs(base)[version]
                destination = staging / REFERENCE_DIR / model_name / str(version)
                log.info("audit: building the %s reference of %s version %d", against, model_name, version)
                metadata[version] = twin.build(version_dir, against, destination, run_dir)
                references[version] = str(destination)
                engine.uses(("lm", str(destination)) if language_model else ("runner", str(destination)))
            served = {version: str(saved_model.version_dirs(base)[version]) for version in references} \
                if language_model else {}
            engine.uses(*(("lm", path) for path in served.values()))
            jobs = [replay.ReplayJob(path, references, batch_size, reproducers, only, served) for path in files]
            progress = engine.Progress("audit", len(jobs), "log files")
            log.info("audit: %d log files (%s requests) on the %s", len(jobs), f"{sum(s.records for s in scans):,}",
                     options.describe())
            task = lm.replay if language_model else replay.replay
            results = engine.run(dask_client, task, jobs, progress=lambda done, r: progress(done, r.rows))
            found = _report(base, model_name, against, files, scans, results, metadata, tolerance, reproducers)
            found["seconds"] = round(progress.seconds, 3)
            report.write(staging, found, _merged_rows(results), _reproducers(found, results))
    found["output"] = str(output)
    return found


def _base_and_version(model_dir: Path) -> tuple[Path, int | None]:
    """(the model's base path, the one version to audit or None for every logged version)."""
    from serving.servable import saved_model

    version = saved_model.parse_version(model_dir.name)
    if version is not None and saved_model.has_saved_model(model_dir):
        return model_dir.parent, version
    return model_dir, None


def _newest(base: Path, only: int | None) -> dict[str, Any]:
    """The pipeline.json of the version audited (or the newest under base)."""
    from serving.servable import saved_model

    versions = saved_model.version_dirs(base)
    return saved_model.read_pipeline_json(versions[only] if only is not None else versions[max(versions)]) or {}


def _model_name(base: Path, only: int | None) -> str:
    return _newest(base, only).get("model_name") or base.name


def _task(base: Path, only: int | None) -> str | None:
    return _newest(base, only).get("task")


def _versions(scans: list[replay.Scan], model_name: str, base: Path, only: int | None) -> set[int]:
    """The versions to build references for; DataError for a log of another model or an unknown version."""
    from serving.servable import saved_model

    for scan in scans:
        others = sorted(name for name in scan.models if name != model_name)
        if others:
            raise DataError(f"--log: {scan.path} holds requests of model {others[0]!r} ({scan.models[others[0]]} "
                            f"records), not {model_name!r} ({base}); audit each model with its own logs")
    if not any(scan.records for scan in scans):
        raise DataError(f"--log: {', '.join(scan.path for scan in scans)}: no logged requests (is sampling_rate 0?)")
    logged = set().union(*(scan.versions for scan in scans))
    if 0 in logged and only is None:
        raise DataError("--log: some records name no answering version; pass the version directory that served "
                        f"them (e.g. {base}/1)")
    if only is not None:
        if only not in logged and 0 not in logged:
            raise DataError(f"--log: no logged request was answered by version {only} (the logs hold version "
                            f"{', '.join(map(str, sorted(logged)))}); pass the model's base path {base} to audit them")
        return {only}
    present = saved_model.list_versions(base)
    missing = sorted(logged - set(present))
    if missing:
        raise DataError(f"--log: version {missing[0]} answered logged requests but is not under {base} (it has "
                        f"{', '.join(map(str, present))}); audit where every logged version lies")
    return logged


def _merged_rows(results: list[replay.ReplayResult]) -> dict[tuple[int, str], replay.OutputRows]:
    merged: dict[tuple[int, str], replay.OutputRows] = {}
    for result in results:
        for key, rows in result.outputs.items():
            merged.setdefault(key, replay.OutputRows()).merge(rows)
    return merged


def _report(base: Path, model_name: str, against: str, files: list[str], scans: list[replay.Scan],
            results: list[replay.ReplayResult], metadata: dict[int, dict], tolerance: float | None,
            reproducers: int) -> dict[str, Any]:
    from serving.servable import saved_model

    merged = _merged_rows(results)
    versions = {}
    for version in sorted(metadata):
        version_dir = saved_model.version_dirs(base)[version]
        served = metadata[version]["reference_of"]["serving_policy"]
        gate = twin.parity_figures(version_dir)
        configured = (((saved_model.read_pipeline_json(version_dir) or {}).get("config") or {}).get("export") or {})
        rule = _tolerance(served, against, gate, configured.get("tolerances"), tolerance)
        outputs = {name: _figures(rows, rule["tolerance"]) for (v, name), rows in merged.items() if v == version}
        agreement = next((o["argmax_agreement"] for o in outputs.values() if o["argmax_agreement"] is not None), None)
        ok = all(o["max_rel_diff"] <= rule["tolerance"] for o in outputs.values()) and (
            agreement is None or agreement >= rule["min_argmax_agreement"])
        if metadata[version].get("task") == twin.LANGUAGE_MODEL:
            rule["replay"] = _replay_figures(results, version, rule["tolerance"])
            ok = ok and not rule["replay"]["tokens_beyond_tolerance"] and bool(outputs)  # a step compared, at least
        versions[version] = {"served_policy": served.get("name"), "rows": max((o["rows"] for o in outputs.values()),
                                                                              default=0),
                             "outputs": outputs, "argmax_agreement": agreement, **rule, "ok": bool(ok),
                             "parity_json": gate}
    skipped = Counter()
    for result in results:
        skipped.update(result.skipped)
    task = next((info.get("task") for info in metadata.values()), None)
    return {"format": 1, "model": model_name, "task": task, "base_path": str(base), "against": against,
            "reference": f"the trained weights rebuilt under {against} ({REFERENCE_DIR}/{model_name}/<version>)",
            "logs": [dataclasses.asdict(scan) for scan in scans], "log_files": files,
            "requests": sum(r.replayed for r in results), "rows": sum(r.rows for r in results),
            "skipped": dict(skipped), "versions": {str(v): info for v, info in versions.items()},
            "ok": all(info["ok"] for info in versions.values()) and bool(versions), "reproducers_kept": reproducers}


def _tolerance(served: dict, against: str, gate: dict | None, configured: dict | None,
               override: float | None) -> dict[str, Any]:
    """The rule a version is held to, the export's own (parity.json, else its config's export.tolerances, else
    precision.TOLERANCES): export.parity_tolerance when the reference computes in the served graph's dtype, else
    the tolerance of the policy computing in the coarser of the two dtypes (a bfloat16 reference is held to
    bfloat16's)."""
    recorded = (gate or {}).get("tolerances") or {}
    served_dtype, against_dtype = served.get("compute_dtype"), precision.describe_policy(against).compute_dtype
    coarsest = next((d for d in ("bfloat16", "float16") if d in (served_dtype, against_dtype)), "float32")
    policy = served.get("name") if served_dtype == coarsest else against
    configured = {name: PolicyTolerance(**values) for name, values in (configured or {}).items()
                  if name == policy and isinstance(values, dict)}
    rule = recorded.get(policy) or precision.tolerance(policy, configured).to_dict()
    key = f"export.tolerances.{policy}"
    if override is not None:
        value, source = override, "--tolerance"
    elif served_dtype == against_dtype:
        value = recorded.get("parity_tolerance", ExportConfig().parity_tolerance)
        source = "export.parity_tolerance (same compute dtype)"
    else:
        value, source = rule["max_rel_diff"], f"{key}.max_rel_diff"
    return {"tolerance": float(value), "tolerance_source": source,
            "min_argmax_agreement": float(rule["min_argmax_agreement"]),
            "min_argmax_agreement_source": f"{key}.min_argmax_agreement"}


def _replay_figures(results: list[replay.ReplayResult], version: int, tolerance: float) -> dict[str, Any]:
    """A language model's greedy tokens: how many the log holds, how many are not the served model's own choice by
    more than the tolerance (pipeline/audit/lm.py), and the worst such row."""
    gaps = [gap for result in results for gap in result.greedy.get(version, [])]
    gaps = np.concatenate(gaps) if gaps else np.zeros(0)
    worst = max((c for result in results for c in result.candidates.get((version, lm.REPLAY), [])), default=None)
    beyond = int(np.sum(~(gaps <= tolerance)))  # a token the model never generates (inf) or NaN counts
    shown = None
    if worst is not None and beyond:
        shown = {"log": worst.path, "record": worst.record, "row": worst.row, "step": worst.step,
                 "logged_token": worst.served[worst.step], "served_argmax": worst.reference[worst.step],
                 "gap": worst.abs_diff}
    return {"greedy_tokens": int(gaps.size), "tokens_beyond_tolerance": beyond,
            "max_gap": float(gaps.max()) if gaps.size else 0.0, "worst": shown}


def _figures(rows: replay.OutputRows, tolerance: float) -> dict[str, Any]:
    abs_diff = np.concatenate(rows.abs_diff) if rows.abs_diff else np.zeros(0)
    scale = max(float(np.concatenate(rows.ref_max).max()) if rows.ref_max else 0.0, float(np.finfo(np.float32).tiny))
    max_abs = float(abs_diff.max()) if len(abs_diff) else 0.0
    agreement = float(np.concatenate(rows.agree).mean()) if rows.agree else None
    return {"rows": int(len(abs_diff)), "max_abs_diff": max_abs, "mean_abs_diff": rows.sum_abs / max(rows.values, 1),
            "scale": scale, "max_rel_diff": max_abs / scale, "mean_rel_diff": rows.sum_abs / max(rows.values, 1) / scale,
            "rows_beyond_tolerance": int(np.sum(abs_diff > tolerance * scale)),  # NaN never counts as within
            "rows_not_finite": int(np.sum(~np.isfinite(abs_diff))), "argmax_agreement": agreement}


def _reproducers(found: dict[str, Any], results: list[replay.ReplayResult]) -> list[replay.Candidate]:
    """The worst rows beyond the tolerance, at most found["reproducers_kept"] of them."""
    scale = {(int(v), name): info["outputs"][name]["scale"] for v, info in found["versions"].items()
             for name in info["outputs"]}  # a language model's replay gaps are relative already: 1
    beyond = []
    for result in results:
        for (version, name), heap in result.candidates.items():
            limit = found["versions"][str(version)]["tolerance"] * scale.get((version, name), 1.0)
            beyond += [c for c in heap if not c.abs_diff <= limit]
    beyond.sort(key=lambda c: -(c.abs_diff / scale.get((c.version, c.output), 1.0)))
    return beyond[:found["reproducers_kept"]]


def print_report(found: dict[str, Any], as_json: bool = False) -> int:
    """Prints the report (text or JSON); returns the exit code: 0 within the tolerance, else 1."""
    print(json.dumps(found, indent=2, default=str) if as_json else report.text(found))
    return 0 if found["ok"] else 1
