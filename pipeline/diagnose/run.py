"""`python -m pipeline diagnose CONFIG [--json] [--batches N]`: where the model's precision can hurt.

The recipe: the dtype audit of layers (audit.py) and of the sensitive ops in their calls (ops.py), the constants
check (constants.py), the range and gradient probes,
the divergence locator and the input-limits probe (probes.py), their findings, the ranked at-risk list and the
merged override (risks.py), all in one Diagnosis (findings.py). A probe that cannot run on the model (a
subclassed or multi-input model, a layer Keras cannot recreate) costs one line in Diagnosis.skipped; the rest
of the report still comes out.
Exit codes: 0 no error finding (warnings and skipped probes allowed), 1 an error finding, or a model that
cannot be built or loaded (one line); 2 a bad config or data.
"""

from __future__ import annotations

import dataclasses
import json
import logging

import keras
import numpy as np

from pipeline import data, models, precision
from pipeline.models import nonfinite
from pipeline.artifacts import DATA_DIR, METRICS_FILE, MODEL_FILE
from pipeline.config import Config
from pipeline.diagnose.audit import audit_model
from pipeline.diagnose.constants import constant_findings
from pipeline.diagnose.findings import Diagnosis, Finding
from pipeline.diagnose.graph import ProbeError, probed_layers, producer
from pipeline.diagnose.ops import audit_ops
from pipeline.diagnose.probes import (edge_rows, first_divergence, float32_twin, locate_divergence, nonfinite_rows,
                                      probe_gradients, probe_ranges, token_rows)
from pipeline.diagnose.risks import gradient_findings, keep_user_layers, merge_fixes, range_findings, rank_at_risk
from pipeline.diagnose.thresholds import FAR_BEYOND

log = logging.getLogger(__name__)


def diagnose(cfg: Config, probe_batches: int = 4) -> Diagnosis:
    """Audits the run's trained model (runs/<experiment>/model.keras) or, before training, the model
    built under the config's policy; then probes it on a few validation and training batches and on rows at
    the input limits. A trained model is diagnosed under the policy it trained under (what `auto` chose then)."""
    policy = precision.restore_trained_policy(cfg.precision, cfg.run_dir)
    datasets = data.load_datasets(cfg.data, seed=cfg.seed, recorded=cfg.run_dir / DATA_DIR)
    trained = cfg.run_dir / MODEL_FILE
    if trained.is_file():
        model = models.load_trained_model(trained, cfg.model, cfg.precision.float32_layers, cfg.precision.float16_layers)
        source = str(trained)
    else:
        # checks=False: a model whose outputs are inf/NaN is refused by the build, and is what diagnose is for;
        # seeded as train seeds it, so that it starts from the weights training would.
        keras.utils.set_random_seed(cfg.seed)
        model = models.build_model(cfg.model, datasets.spec, datasets.statistics, cfg.precision.float32_layers,
                                  cfg.precision.float16_layers, checks=False)
        source = f"{cfg.experiment} (built, untrained: no {trained})"
    dtypes, findings = audit_model(model, cfg)
    probes = _Probes()
    loss = models.compile_settings(datasets.spec)[0]
    operations, op_findings = probes.run("op audit", audit_ops, model, loss, datasets.sample_x[:1],
                                         datasets.sample_y[:1]) or ([], [])
    judged = {f.layer for f in findings}  # a layer the layer audit already judges needs no second finding
    findings += [f for f in op_findings if f.layer not in judged]
    constants = constant_findings(model)
    findings += constants
    twin = probes.run("float32 twin", _float32_twin, model, cfg, datasets)
    size = cfg.train.batch_size
    val_x, _ = datasets.validation_rows(size * probe_batches)
    batches = [val_x[i:i + size] for i in range(0, len(val_x), size)][:probe_batches]
    ranges = probes.with_twin("range probe", twin, probe_ranges, model, batches, twin) if batches else []
    train_x, train_y = datasets.sample_x, datasets.sample_y
    train_batches = [(train_x[i:i + size], train_y[i:i + size]) for i in range(0, len(train_x), size)][:probe_batches]
    scale = _loss_scale(cfg, policy)
    gradients = probes.with_twin("gradient probe", twin, probe_gradients, model, train_batches, loss, scale,
                                 twin) if train_batches else []
    divergence = probes.with_twin("divergence locator", twin, locate_divergence, model, batches[0], twin) \
        if batches else []
    steps = _trained_steps(cfg) if trained.is_file() else None
    findings += range_findings(ranges or [], cfg, divergence or [])
    findings += gradient_findings(gradients or [], cfg, policy, steps)
    edge, edge_finding = probes.run("input-limits probe", _edge_probe, model, twin, datasets,
                                    constants, cfg) or (None, None)
    findings += [edge_finding] if edge_finding else []
    nonfinite_finding = probes.run("non-finite probe", _nonfinite_probe, model, batches, datasets.sample_x, cfg, policy)
    findings += [nonfinite_finding] if nonfinite_finding else []
    at_risk = rank_at_risk(ranges or [], gradients or [], cfg, policy, divergence or [], steps)
    # A fix is pasted into the experiment file: it keeps the user's own float32_layers (issue 23).
    findings = [dataclasses.replace(f, fix=keep_user_layers(f.fix, cfg.precision)) for f in findings]
    at_risk = [dataclasses.replace(r, fix=keep_user_layers(r.fix, cfg.precision)) for r in at_risk]
    return Diagnosis(source=source, policy=policy.name, layers=dtypes, operations=operations, findings=findings,
                     ranges=ranges or [],
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
        return models.rebuild(model, cfg.model, datasets.spec, datasets.statistics, cfg.precision.float32_layers,
                                  cfg.precision.float16_layers)


def _edge_probe(model, twin, datasets: data.Datasets, constants: list[Finding],
                cfg: Config) -> tuple[dict, Finding | None]:
    """Rows at the input limits (each column's own for tabular rows: probes.edge_rows; a language model's: each
    token id over the longest context, probes.token_rows), then rows past them (FAR_BEYOND training ranges; ids
    outside the vocabulary), through the model as it computes, and a finding for the first set with a NaN or inf
    output (or that the model cannot take), with the fix of the constant that causes it, else of the first float16
    layer that overflows on those rows (in the float32 twin, else the first whose output is inf/NaN)."""
    if datasets.spec.task == "language_model":
        sets = [(*token_rows(datasets.spec.num_outputs, datasets.spec.input_shape[0], beyond), beyond)
                for beyond in (False, True)]
    else:
        per_column = datasets.spec.image_shape is None
        sets = [(*edge_rows(datasets.statistics, datasets.spec.input_shape, beyond, per_column=per_column,
                            ids=datasets.spec.categorical), beyond) for beyond in (0.0, FAR_BEYOND)]
    result, finding = _edge_set(model, twin, datasets, constants, cfg, *sets[0])
    result["far"], far_finding = _edge_set(model, twin, datasets, constants, cfg, *sets[1])
    return result, finding or far_finding


def _edge_set(model, twin, datasets: data.Datasets, constants: list[Finding], cfg: Config,
              rows: np.ndarray, labels: list[str], beyond: float) -> tuple[dict, Finding | None]:
    limits, per_column = datasets.statistics, datasets.spec.image_shape is None
    tokens = datasets.spec.task == "language_model"
    if tokens:
        where = ("at the input limits (each token id over the whole context)" if not beyond else
                 "of ids outside the vocabulary (inputs no tokenizer makes)")
    else:
        where = ("at the input limits" if not beyond else
                 f"{beyond:g} training ranges beyond the input limits (inputs no client should send)")
    result = {"rows": len(rows), "low": float(rows.min()), "high": float(rows.max()), "nonfinite": 0,
              "example": None, "per_column": per_column}
    if tokens:
        ids = ", ".join(str(i) for i in sorted(set(rows[:, 0].tolist())))
        result["what"] = (f", each token id 0..{int(rows.max())} repeated over the longest context ({rows.shape[1]})"
                          if not beyond else f", ids outside the vocabulary ({ids}) over the longest context")
    try:
        bad = nonfinite_rows(model, rows)
    except Exception as error:  # noqa: BLE001 - rows the model cannot take: the finding itself
        result["error"] = f"{type(error).__name__}: {str(error).strip().splitlines()[0][:300] if str(error) else ''}"
        return result, Finding("warning" if beyond else "error", producer(model.outputs[0]) or model.name,
                               f"the model fails on the {len(rows)} rows {where}: {result['error']}",
                               "# make the model take every value within the training rows' limits")
    result.update(nonfinite=len(bad), example=labels[bad[0]] if bad else None)
    if not bad:
        return result, None
    output = producer(model.outputs[0]) or model.name
    within = (f"the vocabulary: ids 0..{datasets.spec.num_outputs - 1}" if tokens else
              "each column within its own training min and max" if per_column else
              f"training rows: min {float(limits.minimum.min()):g}, max {float(limits.maximum.max()):g}")
    problem = f"{len(bad)} of {len(rows)} rows {where} give NaN or inf outputs, e.g. {labels[bad[0]]} ({within})"
    if constants:
        fix = constants[0].fix
    else:
        over = {r.layer for r in (probe_ranges(model, [rows[bad]], twin) if twin else [])
                if r.compute_dtype == "float16" and r.overflow_fraction > 0}
        overflowing = [name for name in probed_layers(model) if name in over]  # in graph order
        found = None if overflowing else nonfinite.first_nonfinite(model, rows[bad])
        fix = (f"precision:\n  float32_layers: [{overflowing[0]}]" if overflowing else
               _nonfinite_fix(found, cfg) if found else
               "# no float16 layer overflows in the float32 twin on these rows: find the op with\n"
               "precision:\n  check_numerics: true")
    return result, Finding("warning" if beyond else "error", output, problem, fix)  # far: no client should send them


def _nonfinite_probe(model, batches, train_x, cfg: Config, policy: precision.PolicyInfo) -> Finding | None:
    """The model as it computes on the validation batches and the training rows most likely to overflow: an error
    naming the first layer whose output is inf or NaN, under which policy, with the fix."""
    rows = np.concatenate([nonfinite.probe_rows(train_x), *batches]) if batches else nonfinite.probe_rows(train_x)
    found = nonfinite.first_nonfinite(model, rows)
    if found is None:
        return None
    line = nonfinite.describe(found, policy.name, cfg.precision.float32_layers, cfg.precision.float16_layers)
    problem, _, _ = line.partition("; fix: ")
    return Finding("error", found.layer, problem, _nonfinite_fix(found, cfg))


def _nonfinite_fix(found: nonfinite.NonFinite, cfg: Config) -> str:
    p = cfg.precision
    if found.layer in p.float16_layers:
        return f"precision:\n  float16_layers: [{', '.join(nonfinite.merged_float16_layers(p.float16_layers, found.layer))}]"
    if found.is_layer and found.compute_dtype in ("float16", "bfloat16") and found.layer not in p.float32_layers:
        return f"precision:\n  float32_layers: [{found.layer}]"
    return "# " + nonfinite.fix_text(found, p.float32_layers, p.float16_layers) + "\nprecision:\n  check_numerics: true"


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
