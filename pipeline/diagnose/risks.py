"""What the probes' numbers mean: findings, the ranked at-risk list, and every fix merged into one override.

Activations: any overflow of a float16 layer is an error.
Gradients of a float16 layer: unscaled overflow is an error (no loss scale helps); overflow after a static
scale is an error (a static scale does not skip the step); more than GRADIENT_ZERO_WARNING of the scaled
gradients flushing to zero is a warning (raise the loss scale).
At risk: activations and gradients of the float16 layers merged into one ranked list, each with its fix;
the fixes of every finding and of every overflowing entry merged into one YAML override to paste.
"""

from __future__ import annotations

import math

import yaml

from pipeline import precision
from pipeline.config import Config
from pipeline.diagnose.thresholds import AT_RISK_UNDERFLOW, FLOAT16_MAX, GRADIENT_ZERO_WARNING, MAX_SUGGESTED_SCALE
from pipeline.diagnose.findings import AtRisk, Finding, LayerGradients, LayerRange


def range_findings(ranges: list[LayerRange], cfg: Config) -> list[Finding]:
    return [Finding("error", r.layer, f"{r.overflow_fraction:.2%} of its activations exceed float16's maximum 65504 "
                                      f"(max |x| {r.max_abs:.4g}); in float16 they become inf",
                    f"precision:\n  float32_layers: [{r.layer}]")
            for r in ranges if r.overflow_fraction > 0 and r.compute_dtype == "float16"
            and r.layer not in cfg.precision.float32_layers]


def gradient_findings(gradients: list[LayerGradients], cfg: Config, policy: precision.PolicyInfo) -> list[Finding]:
    findings = []
    for g in gradients:
        if g.compute_dtype != "float16" or g.layer in cfg.precision.float32_layers:
            continue
        if g.overflow_fraction > 0:
            findings.append(Finding("error", g.layer, f"{g.overflow_fraction:.2%} of its gradients exceed float16's "
                                                      f"maximum 65504 even unscaled (max |g| {g.max_abs:.4g}); no loss "
                                                      "scale can fix that", _float32_fix(g.layer, cfg)))
        elif g.scaled_overflow_fraction > 0 and policy.loss_scale == "static":
            findings.append(Finding("error", g.layer, f"{g.scaled_overflow_fraction:.2%} of its gradients overflow "
                                                      f"float16 at the static loss scale {g.loss_scale:g}, and a static "
                                                      "scale applies the inf update", _scale_fix(g, policy, cfg)))
        elif g.scaled_zero_fraction > GRADIENT_ZERO_WARNING:
            findings.append(Finding("warning", g.layer, f"{g.scaled_zero_fraction:.2%} of its gradients flush to zero "
                                                        f"in float16 even at loss scale {g.loss_scale:g}",
                                    _scale_fix(g, policy, cfg)))
    return findings


def _float32_fix(layer: str, cfg: Config) -> str:
    fix = f"precision:\n  float32_layers: [{layer}]"
    if not cfg.model.normalize:
        fix += "\n# or rescale the inputs:\nmodel:\n  normalize: true"
    return fix


def _scale_fix(g: LayerGradients, policy: precision.PolicyInfo, cfg: Config) -> str:
    """For gradients that overflow or come close: the largest power-of-two loss scale that keeps this layer's
    largest gradient 2x below 65504 (under dynamic scaling the initial scale Keras adjusts from). For gradients
    that underflow: that scale if it is higher than the current one, else float32 for the layer."""
    if g.overflow_fraction > 0:
        return _float32_fix(g.layer, cfg)
    if policy.loss_scale == "none":
        return "precision:\n  loss_scale: dynamic"
    safe = 2 ** max(0, math.floor(math.log2(FLOAT16_MAX / 2 / g.max_abs))) if g.max_abs > 0 else 1
    suggested = min(safe, MAX_SUGGESTED_SCALE)
    lowering = g.scaled_overflow_fraction > 0 or g.max_abs * g.loss_scale > FLOAT16_MAX / 2
    if not lowering and suggested <= g.loss_scale:  # no higher scale is safe: keep the layer out of float16
        return _float32_fix(g.layer, cfg)
    return f"precision:\n  {'initial_scale' if policy.loss_scale == 'dynamic' else 'loss_scale'}: {suggested}"


def rank_at_risk(ranges: list[LayerRange], gradients: list[LayerGradients], cfg: Config,
                 policy: precision.PolicyInfo) -> list[AtRisk]:
    """The float16 layers whose activations or gradients leave float16's normal range, most at risk first."""
    risks = []
    for r in ranges:
        if r.compute_dtype != "float16" or not _at_risk(r.risk):
            continue
        problem = (f"max |x| {r.max_abs:.4g}; {r.overflow_fraction:.2%} over 65504, "
                   f"{r.subnormal_fraction + r.zero_fraction:.2%} below 6.1e-5")
        risks.append(AtRisk(r.layer, "activations", problem, _float32_fix(r.layer, cfg),
                            (r.overflow_fraction, 0.0, r.risk[1], r.risk[2])))
    for g in gradients:
        risk = g.risk
        if g.compute_dtype != "float16" or not _at_risk((risk[0] + risk[1], risk[2], risk[3])):
            continue
        problem = (f"max |g| {g.max_abs:.4g}; unscaled {g.overflow_fraction:.2%} over 65504, "
                   f"{g.zero_fraction:.2%} to zero; x{g.loss_scale:g}: {g.scaled_overflow_fraction:.2%} over 65504, "
                   f"{g.scaled_zero_fraction:.2%} to zero, {g.scaled_subnormal_fraction:.2%} subnormal")
        risks.append(AtRisk(g.layer, "gradients", problem, _scale_fix(g, policy, cfg), risk))
    return sorted(risks, key=lambda r: r.risk, reverse=True)


def _at_risk(risk: tuple[float, float, float]) -> bool:
    """(overflow share, max / 65504, underflow share): any overflow, within 2x of the maximum, or 1% underflow."""
    overflow, closeness, underflow = risk
    return overflow > 0 or closeness >= 0.5 or underflow >= AT_RISK_UNDERFLOW


def merge_fixes(fixes: list[str]) -> str:
    """YAML fixes as one override: mappings merged, float32_layers lists joined, the lowest loss scale kept,
    comments kept; a fix's '# or ...' alternative is left out."""
    merged, comments = {}, []
    for fix in fixes:
        lines = fix.split("\n# or")[0].splitlines()
        body = "\n".join(line for line in lines if not line.startswith("#"))
        comments += [line for line in lines if line.startswith("#")]
        _merge(merged, yaml.safe_load(body) or {})
    text = yaml.safe_dump(merged, sort_keys=False, default_flow_style=None) if merged else ""
    return "\n".join([*dict.fromkeys(comments), text.rstrip()]).strip()


def _merge(into: dict, new: dict) -> None:
    for key, value in new.items():
        if isinstance(value, dict) and isinstance(into.get(key), dict):
            _merge(into[key], value)
        elif key == "float32_layers" and isinstance(into.get(key), list):
            into[key] = list(dict.fromkeys(into[key] + value))
        elif key in ("initial_scale", "loss_scale") and isinstance(into.get(key), (int, float)):
            into[key] = min(into[key], value)  # overflow (a lower scale) matters more than underflow
        else:
            into[key] = value
