"""`python -m pipeline diagnose CONFIG [--json] [--batches N]`: where the model's precision can hurt.

The recipe: the dtype audit (audit.py) and the constants check (constants.py), the range and gradient probes,
the divergence locator and the input-limits probe (probes.py), their findings, the ranked at-risk list and the
merged override (risks.py), all in one Diagnosis (findings.py). A probe that cannot run on the model (a
subclassed or multi-input model, a layer Keras cannot recreate) costs one line in Diagnosis.skipped; the rest
of the report still comes out.
Exit codes: 0 no error finding (warnings and skipped probes allowed), 1 an error finding, or a model that
cannot be built or loaded (one line); 2 a bad config or data.
"""

from __future__ import annotations

import json
import logging

from pipeline import data, models, precision
from pipeline.artifacts import METRICS_FILE, MODEL_FILE
from pipeline.config import Config
from pipeline.diagnose.audit import audit_model
from pipeline.diagnose.constants import constant_findings
from pipeline.diagnose.findings import Diagnosis, Finding
from pipeline.diagnose.graph import ProbeError, probed_layers, producer
from pipeline.diagnose.probes import (edge_rows, first_divergence, float32_twin, locate_divergence, nonfinite_rows,
                                      probe_gradients, probe_ranges)
from pipeline.diagnose.risks import gradient_findings, merge_fixes, range_findings, rank_at_risk
from pipeline.diagnose.thresholds import FAR_BEYOND

log = logging.getLogger(__name__)


def diagnose(cfg: Config, probe_batches: int = 4) -> Diagnosis:
    """Audits the run's trained model (runs/<experiment>/model.keras) or, before training, the model
    built under the config's policy; then probes it on a few validation and training batches and on rows at
    the input limits. A trained model is diagnosed under the policy it trained under (what `auto` chose then)."""
    policy = precision.restore_trained_policy(cfg.precision, cfg.run_dir)
    datasets = data.load_datasets(cfg.data, seed=cfg.seed)
    trained = cfg.run_dir / MODEL_FILE
    if trained.is_file():
        model = models.load_trained_model(trained, cfg.model, cfg.precision.float32_layers, cfg.precision.float16_layers)
        source = str(trained)
    else:
        model = models.build_model(cfg.model, datasets.spec, datasets.train_x, cfg.precision.float32_layers,
                                  cfg.precision.float16_layers)
        source = f"{cfg.experiment} (built, untrained: no {trained})"
    dtypes, findings = audit_model(model, cfg)
    constants = constant_findings(model)
    findings += constants
    probes = _Probes()
    twin = probes.run("float32 twin", _float32_twin, model, cfg, datasets)
    batches = [datasets.val_x[i:i + cfg.train.batch_size]
               for i in range(0, len(datasets.val_x), cfg.train.batch_size)][:probe_batches]
    ranges = probes.with_twin("range probe", twin, probe_ranges, model, batches, twin) if batches else []
    size = cfg.train.batch_size
    train_batches = [(datasets.train_x[i:i + size], datasets.train_y[i:i + size])
                     for i in range(0, len(datasets.train_x), size)][:probe_batches]
    scale = _loss_scale(cfg, policy)
    gradients = probes.with_twin("gradient probe", twin, probe_gradients, model, train_batches,
                                 models.compile_settings(datasets.spec)[0], scale, twin) if train_batches else []
    divergence = probes.with_twin("divergence locator", twin, locate_divergence, model, batches[0], twin) \
        if batches else []
    steps = _trained_steps(cfg) if trained.is_file() else None
    findings += range_findings(ranges or [], cfg, divergence or [])
    findings += gradient_findings(gradients or [], cfg, policy, steps)
    edge, edge_finding = probes.run("input-limits probe", _edge_probe, model, twin, datasets.train_x,
                                    constants) or (None, None)
    findings += [edge_finding] if edge_finding else []
    at_risk = rank_at_risk(ranges or [], gradients or [], cfg, policy, divergence or [], steps)
    return Diagnosis(source=source, policy=policy.name, layers=dtypes, findings=findings, ranges=ranges or [],
                     divergence=divergence or [], first_divergence=first_divergence(divergence or []),
                     gradients=gradients or [], at_risk=at_risk, override=merge_fixes([f.fix for f in findings]),
                     edge=edge, skipped=probes.skipped)


class _Probes:
    """Runs each probe; one that cannot run on this model leaves one line in `skipped` and returns None."""

    def __init__(self):
        self.skipped: list[str] = []

    def run(self, name: str, function, *args):
        try:
            return function(*args)
        except Exception as error:  # noqa: BLE001 - a foreign model can make Keras raise anything; one line says what
            log.debug("diagnose: %s failed", name, exc_info=True)
            text = str(error).strip().splitlines()[0] if str(error).strip() else ""
            self.skipped.append(f"{name}: {text if isinstance(error, ProbeError) else f'{type(error).__name__}: {text}'}")
            return None

    def with_twin(self, name: str, twin, function, *args):
        if twin is None:
            self.skipped.append(f"{name}: needs the float32 twin, which could not be built")
            return None
        return self.run(name, function, *args)


def _float32_twin(model, cfg: Config, datasets):
    """The model with every layer in float32: cloned from the layers' configs, or, for layers Keras cannot
    recreate (a subclassed model, a layer without get_config), the config's model rebuilt under float32."""
    try:
        return float32_twin(model)
    except Exception:  # noqa: BLE001 - whatever stops the clone, the rebuild below may still work
        log.debug("diagnose: cloning the float32 twin failed; rebuilding it", exc_info=True)
    with precision.policy_scope("float32"):
        return models.rebuild(model, cfg.model, datasets.spec, datasets.train_x, cfg.precision.float32_layers,
                                  cfg.precision.float16_layers)


def _edge_probe(model, twin, train_x, constants: list[Finding]) -> tuple[dict, Finding | None]:
    """Rows at the input limits, then FAR_BEYOND training ranges past them, through the model as it computes, and a
    finding for the first set with a NaN or inf output, with the fix of the constant that causes it, else of the
    first float16 layer that overflows on those rows."""
    result, finding = _edge_set(model, twin, train_x, constants, 0.0)
    result["far"], far_finding = _edge_set(model, twin, train_x, constants, FAR_BEYOND)
    return result, finding or far_finding


def _edge_set(model, twin, train_x, constants: list[Finding], beyond: float) -> tuple[dict, Finding | None]:
    rows, labels = edge_rows(train_x, beyond)
    bad = nonfinite_rows(model, rows)
    low, high = float(rows.min()), float(rows.max())
    result = {"rows": len(rows), "low": low, "high": high, "nonfinite": len(bad),
              "example": labels[bad[0]] if bad else None}
    if not bad:
        return result, None
    output = producer(model.outputs[0]) or model.name
    where = ("at the input limits" if not beyond else
             f"{beyond:g} training ranges beyond the input limits (inputs no client should send)")
    problem = (f"{len(bad)} of {len(rows)} rows {where} give NaN or inf outputs, e.g. {labels[bad[0]]} "
               f"(training rows: min {float(train_x.min()):g}, max {float(train_x.max()):g})")
    if constants:
        fix = constants[0].fix
    else:
        over = {r.layer for r in (probe_ranges(model, [rows[bad]], twin) if twin else [])
                if r.compute_dtype == "float16" and r.overflow_fraction > 0}
        overflowing = [layer.name for layer in probed_layers(model) if layer.name in over]  # in graph order
        fix = (f"precision:\n  float32_layers: [{overflowing[0]}]" if overflowing else
               "# no float16 layer overflows in the float32 twin on these rows: find the op with\n"
               "precision:\n  check_numerics: true")
    return result, Finding("warning" if beyond else "error", output, problem, fix)  # far: no client should send them


def _loss_scale(cfg: Config, policy: precision.PolicyInfo) -> float:
    """The scale float16 gradients are computed at: the trained run's final one, else the configured one."""
    if policy.loss_scale == "none":
        return 1.0
    recorded = cfg.run_dir / METRICS_FILE
    if policy.loss_scale == "dynamic" and recorded.is_file():
        final = json.loads(recorded.read_text()).get("final_loss_scale")
        if final:
            return float(final)
    return float(policy.initial_scale)


def _trained_steps(cfg: Config) -> int | None:
    recorded = cfg.run_dir / METRICS_FILE
    return json.loads(recorded.read_text()).get("steps") if recorded.is_file() else None
