"""`python -m pipeline compare CONFIG`: trains the config under float32 and under its mixed policy and reports.

Each policy trains in a process of its own (`python -m pipeline train`), because the Keras policy is
process-global and so that each policy's peak memory is its own; the seed, data order and steps are
the config's, so only the policy differs. The children's progress is streamed, prefixed with their policy.
The mixed run is then diagnosed (pipeline/diagnose/), and runs/<experiment>/compare/ is published
in one rename, replacing an earlier comparison only once the new one is complete:

    report.md, report.json   the table (validation metrics and deltas against float32, steady-state
                             throughput and its ratio, peak memory, skipped steps, final loss scale; a
                             language model's in its own terms: nats per byte and per token, the unigram
                             and bigram baselines, tokens/s), the verdict and the numeric diagnosis of
                             the mixed run
    curves.png               training and validation loss and metric per epoch, every policy on shared axes
    loss_scale.png           loss scale and skipped steps per epoch
    runs/<policy>/<experiment>/   each policy's run directory (history.json, metrics.json, model.keras, logs/)

Exit codes: 0 every policy trained and the report is written; 1 a policy's training failed (the report
is written and says which and why) or the comparison itself failed (nothing is written); 2 a bad config,
override or flag (nothing is written).
"""

from __future__ import annotations

import dataclasses
import logging
import os
import re
import shutil
import subprocess
import sys
import time
from collections import deque
from pathlib import Path

from pipeline import artifacts
from pipeline.compare.report import markdown, plot_curves, plot_loss_scale, policy_rows, verdict
from pipeline.artifacts import CHECKPOINTS_DIR, COMPARE_DIR, HISTORY_FILE, METRICS_FILE
from pipeline.config import Config, load_config

log = logging.getLogger(__name__)

BASELINE = "float32"
DEFAULT_TOLERANCE = 1.0  # accuracy points (classification) or percent of float32's metric (regression)
# A language model's: percent of float32's val_nats_per_byte, issue 29's target for mixed_float16 and mixed_bfloat16.
LANGUAGE_MODEL_TOLERANCE = 2.0
# TensorFlow's start-up lines, printed before logging is configured and impossible to silence (docs/keras3-mixed-precision.md §8).
_NOISE = re.compile(r"^(I0000|E0000|W0000|WARNING: All log|To enable|\S+\.cc:\d+\])")
_ERROR_TAIL = 30


@dataclasses.dataclass
class PolicyRun:
    """One policy's training: its run directory and what the child left there."""

    policy: str
    run_dir: Path
    returncode: int
    wall_seconds: float
    error: str | None = None
    metrics: dict | None = None
    history: list[dict] = dataclasses.field(default_factory=list)

    @property
    def ok(self) -> bool:
        return self.returncode == 0 and self.metrics is not None


def compare(config_path: str, overrides: list[str], cfg: Config, bfloat16: bool = False,
            tolerance: float | None = None, probe_batches: int = 4) -> int:
    """Trains every policy, diagnoses the mixed run, writes <run_dir>/compare/; returns the exit code.
    tolerance: the verdict's (None: default_tolerance)."""
    default = default_tolerance(cfg)
    tolerance = default if tolerance is None else tolerance
    policies, note = choose_policies(cfg, bfloat16)
    if note:
        log.info("compare: %s", note)
    final = cfg.run_dir / COMPARE_DIR
    with artifacts.atomic_dir(final, replace=True) as staging:  # an earlier comparison is swapped out at the end
        child_overrides = {policy: _overrides(cfg, overrides, policy, staging) for policy in policies}
        configs = {policy: load_config(config_path, child_overrides[policy]) for policy in policies}  # fail early
        log.info("compare %s: %s, one process each (seed %d, %s) → %s", cfg.experiment,
                 " vs ".join(policies), cfg.seed, f"{cfg.train.max_steps} steps" if cfg.train.max_steps
                 else f"{cfg.train.epochs} epochs", final)
        runs = [train_policy(config_path, child_overrides[p], configs[p]) for p in policies]
        diagnosis = _diagnose(configs[policies[1]], runs[1], probe_batches)
        if not isinstance(diagnosis, str):
            diagnosis.source = diagnosis.source.replace(f"{staging}/", f"{COMPARE_DIR}/")
        flags = (["--bfloat16"] if bfloat16 else []) + ([f"--tolerance {tolerance:g}"] if tolerance != default else [])
        report = build_report(cfg, config_path, overrides, runs, diagnosis, tolerance, note, _device(), flags)
        write_report(staging, report, runs)
    for line in report["verdicts"].values():
        log.info("verdict: %s", line)
    print(final / "report.md")
    return 0 if all(run.ok for run in runs) else 1


def default_tolerance(cfg: Config) -> float:
    """The verdict's tolerance when --tolerance is not given: 2% of float32's nats per byte for a language model,
    else 1 (accuracy points, or percent of float32's MAE)."""
    return LANGUAGE_MODEL_TOLERANCE if cfg.model.kind == "causal_lm" else DEFAULT_TOLERANCE


def choose_policies(cfg: Config, bfloat16: bool) -> tuple[list[str], str]:
    """[float32, the mixed policy (, mixed_bfloat16)] and a note on how the mixed one was chosen."""
    from pipeline import precision  # lazy, like diagnose below: this process stays free of TensorFlow

    mixed, notes = cfg.precision.policy, []
    if mixed == "auto":
        hardware = precision.detect_hardware()
        mixed, reason = precision.choose_policy(hardware)
        if precision.measurement_decides(hardware):  # training times these two and picks the faster
            notes.append(f"precision.policy auto times float32 against {mixed} on this machine ({reason}) and trains "
                         "under the faster")
        else:
            notes.append(f"precision.policy auto resolves to {mixed} on this machine ({reason})")
    if mixed == BASELINE:
        mixed = "mixed_float16"
        notes.append("the config trains in float32, so it is compared with mixed_float16")
    policies = [BASELINE, mixed] + (["mixed_bfloat16"] if bfloat16 and mixed != "mixed_bfloat16" else [])
    return policies, "; ".join(notes)


def _overrides(cfg: Config, overrides: list[str], policy: str, staging: Path) -> list[str]:
    extra = [f"precision.policy={policy}", f"train.runs_dir={staging / 'runs' / policy}", "train.keep_checkpoints=1"]
    if policy != "mixed_float16" and not isinstance(cfg.precision.loss_scale, str):
        extra.append("precision.loss_scale=dynamic")  # a static scale is for float16 only (means none elsewhere)
    return [*overrides, *extra]


def train_policy(config_path: str, overrides: list[str], cfg: Config) -> PolicyRun:
    """Trains one policy in a child process, streaming its output with the policy as prefix."""
    policy = cfg.precision.policy
    argv = [sys.executable, "-m", "pipeline", "train", str(config_path),
            *(f"--set={override}" for override in overrides)]
    started, tail = time.perf_counter(), deque(maxlen=_ERROR_TAIL)
    with subprocess.Popen(argv, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True, bufsize=1,
                          env={**os.environ, "PYTHONUNBUFFERED": "1"}) as child:
        for line in child.stdout:
            line = line.rstrip()
            if line and not _NOISE.match(line):
                tail.append(line)
                print(f"[{policy}] {line}", flush=True)
    run = PolicyRun(policy, cfg.run_dir, child.returncode, round(time.perf_counter() - started, 1))
    metrics, history = cfg.run_dir / METRICS_FILE, cfg.run_dir / HISTORY_FILE
    if history.is_file():
        run.history = artifacts.read_json(history)
    if run.returncode == 0 and metrics.is_file():
        run.metrics = artifacts.read_json(metrics)
        shutil.rmtree(cfg.run_dir / CHECKPOINTS_DIR, ignore_errors=True)  # finished: model.keras is the result
    else:
        errors = [line for line in tail if line.startswith("error:") or "Error" in line.split(":")[0]]
        run.error = (errors[-1] if errors else (tail[-1] if tail else "no output")) + f" (exit {run.returncode})"
        log.error("compare: %s training failed: %s", policy, run.error)
    return run


def _diagnose(cfg: Config, run: PolicyRun, probe_batches: int):
    """The numeric diagnosis of the mixed run's model (the untrained one if its training failed)."""
    # Lazy: TensorFlow is imported here, after the children have trained, so this parent process stays
    # small and quick to start while they run (each policy's memory figure is its own child's).
    from pipeline.diagnose import diagnose

    try:
        return diagnose(cfg, probe_batches=probe_batches)
    except Exception as error:  # the report is still worth writing; it says why the diagnosis is missing
        log.exception("compare: the diagnosis of %s failed", run.policy)
        return f"{type(error).__name__}: {error}"


def _device() -> str:
    from pipeline import precision  # lazy: see _diagnose

    hardware = precision.detect_hardware()
    if hardware.gpus:
        return f"GPU ({hardware.gpus[0][0]})"
    return "TPU" if hardware.tpu else f"CPU ({os.cpu_count()} cores)"


def build_report(cfg: Config, config_path: str, overrides: list[str], runs: list[PolicyRun], diagnosis,
                 tolerance: float, note: str, device: str, flags: list[str] = ()) -> dict:
    """Everything report.md shows, as JSON."""
    baseline = runs[0]
    rows = policy_rows(runs, cfg.data.sequence_length if cfg.model.kind == "causal_lm" else None)
    verdicts = {run.policy: verdict(run, baseline, rows, tolerance, device) for run in runs[1:]}
    return {
        "experiment": cfg.experiment,
        "config": str(config_path),
        "overrides": list(overrides),
        "command": " ".join(["python -m pipeline compare", str(config_path), *flags,
                             *(f"--set {override}" for override in overrides)]),
        "device": device,
        "note": note,
        "tolerance": tolerance,
        "baseline": baseline.policy,
        "mixed": runs[1].policy,
        "seed": cfg.seed,
        "epochs": next((run.metrics["epochs"] for run in runs if run.ok), cfg.train.epochs),  # max_steps decides
        "policies": rows,
        "verdicts": verdicts,
        "verdict": verdicts[runs[1].policy],
        "history": {run.policy: run.history for run in runs},
        "diagnosis": diagnosis if isinstance(diagnosis, str) or diagnosis is None else diagnosis.to_dict(),
        "diagnosis_text": _diagnosis_markdown(diagnosis, runs[1].policy),
    }


def _diagnosis_markdown(diagnosis, policy: str) -> str:
    if isinstance(diagnosis, str):
        return f"The diagnosis failed: {diagnosis}"
    errors = sum(f.severity == "error" for f in diagnosis.findings)
    warnings = len(diagnosis.findings) - errors
    lines = [f"Model: `{diagnosis.source}` under {policy}. {errors} error(s), {warnings} warning(s); "
             + (f"first layer diverging from float32: `{diagnosis.first_divergence}`."
                if diagnosis.first_divergence else "no layer diverges from float32 beyond the tolerance."), ""]
    if diagnosis.operations:
        reduced = [o for o in diagnosis.operations if o.dtype in ("float16", "bfloat16")]
        total = len(diagnosis.operations)
        lines[0] += (f" The numerically sensitive ops (softmax, attention products, normalisation, output, loss): "
                     f"{total - len(reduced)} of {total} (layer, op) pairs in float32"
                     + (f"; in a reduced dtype: {', '.join(f'`{o.layer}` {o.op}' for o in reduced)}." if reduced
                        else "."))
    lines += [f"- **{f.severity}** `{f.layer}`: {f.problem}" for f in diagnosis.findings]
    lines += ["", "```", *diagnosis.at_risk_lines(), "```"]
    if diagnosis.override:
        lines += ["", "Suggested override (paste into the experiment file):", "", "```yaml", diagnosis.override, "```"]
    return "\n".join(lines)


def write_report(directory: Path, report: dict, runs: list[PolicyRun]) -> None:
    plot_curves(runs, directory / "curves.png")
    plot_loss_scale(runs, directory / "loss_scale.png")
    artifacts.write_json_atomic(directory / "report.json", report)
    artifacts.write_text_atomic(directory / "report.md", markdown(report))
