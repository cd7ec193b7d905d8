"""`python -m pipeline diagnose CONFIG [--json] [--batches N]`: where the model's precision can hurt.

The recipe: the dtype audit (audit.py), the range and gradient probes and the divergence locator on the
float32 twin (probes.py), their findings, the ranked at-risk list and the merged override (risks.py),
all in one Diagnosis (report.py).
The exit code is 1 when there is an error, else 0.
"""

from __future__ import annotations

import json

from pipeline import data, models, precision
from pipeline.artifacts import METRICS_FILE, MODEL_FILE
from pipeline.config import Config
from pipeline.diagnose.audit import audit_model
from pipeline.diagnose.probes import first_divergence, float32_twin, locate_divergence, probe_gradients, probe_ranges
from pipeline.diagnose.findings import Diagnosis
from pipeline.diagnose.risks import gradient_findings, merge_fixes, range_findings, rank_at_risk


def diagnose(cfg: Config, probe_batches: int = 4) -> Diagnosis:
    """Audits the run's trained model (runs/<experiment>/model.keras) or, before training, the model
    built under the config's policy; then probes activation ranges on a few validation batches.
    A trained model is diagnosed under the policy it trained under (what `auto` chose then)."""
    policy = precision.restore_trained_policy(cfg.precision, cfg.run_dir)
    datasets = data.load_datasets(cfg.data, seed=cfg.seed)
    trained = cfg.run_dir / MODEL_FILE
    if trained.is_file():
        model, source = models.load_trained_model(trained, cfg.model), str(trained)
    else:
        model = models.build_model(cfg.model, datasets.spec, datasets.train_x, cfg.precision.float32_layers)
        source = f"{cfg.experiment} (built, untrained: no {trained})"
    dtypes, findings = audit_model(model, cfg)
    batches = [datasets.val_x[i:i + cfg.train.batch_size]
               for i in range(0, len(datasets.val_x), cfg.train.batch_size)][:probe_batches]
    twin = float32_twin(model)  # shared by the three probes: building it is the probes' slowest step
    ranges = probe_ranges(model, batches, twin) if batches else []
    findings += range_findings(ranges, cfg)
    size = cfg.train.batch_size
    train_batches = [(datasets.train_x[i:i + size], datasets.train_y[i:i + size])
                     for i in range(0, len(datasets.train_x), size)][:probe_batches]
    scale = _loss_scale(cfg, policy)
    gradients = probe_gradients(model, train_batches, models.compile_settings(datasets.spec)[0],
                                scale, twin) if train_batches else []
    findings += gradient_findings(gradients, cfg, policy)
    divergence = locate_divergence(model, batches[0], twin) if batches else []
    at_risk = rank_at_risk(ranges, gradients, cfg, policy)
    overflowing = [risk.fix for risk in at_risk if risk.risk[0] > 0 or risk.risk[1] > 0]
    return Diagnosis(source=source, policy=policy.name, layers=dtypes, findings=findings, ranges=ranges,
                     divergence=divergence, first_divergence=first_divergence(divergence), gradients=gradients,
                     at_risk=at_risk, override=merge_fixes([f.fix for f in findings] + overflowing))


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
