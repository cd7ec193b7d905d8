"""What the probes' numbers mean: findings, the ranked at-risk list, and every fix merged into one override.

Advice follows from evidence only, so "no findings" means an empty at-risk list and no override:
Activations of a float16 layer: any overflow is an error; a largest value within 2x of 65504 is a warning;
underflow (>= AT_RISK_UNDERFLOW of the values below 6.1e-5) is a warning only where the divergence locator
shows the layer departing from float32 beyond its tolerance.
Gradients of a float16 layer: unscaled overflow is an error (no loss scale helps); overflow after a static
scale is an error (a static scale applies the inf update); overflow after a dynamic scale is a warning (each
such step is skipped and halves the scale: start lower); more than GRADIENT_ZERO_WARNING of the scaled
gradients flushing to zero is a warning, whose fix is a scale that every float16 layer's largest gradient
leaves room for (the loss scale is one number for the whole model), or float32 for the layer when none does.
For a trained run under dynamic scaling the gradients are the end of training's, so that fix is a shorter
dynamic_growth_steps (the scale can grow as gradients shrink), not a higher initial_scale (which the larger
early gradients would halve again: issue #14, 7 skipped steps and nothing changed).
At risk: the float16 layers with such a finding, ranked, each with the finding's fix.
"""

from __future__ import annotations

import math
import re

import yaml

from pipeline import precision
from pipeline.config import Config, PrecisionConfig
from pipeline.diagnose.thresholds import (AT_RISK_UNDERFLOW, DIVERGENCE_TOLERANCE, FLOAT16_MAX, GRADIENT_ZERO_WARNING,
                                          MAX_SUGGESTED_SCALE)
from pipeline.diagnose.findings import AtRisk, Finding, LayerDivergence, LayerGradients, LayerRange


def layer_name(tap: str) -> str:
    """The layer (or full path) a probe row names, for a float32_layers fix: a later call's row names its layer
    ('token_embedding (call 2)': graph.taps)."""
    return tap.split(" (call ")[0]


def range_findings(ranges: list[LayerRange], cfg: Config,
                   divergence: list[LayerDivergence] = ()) -> list[Finding]:
    diverging = {d.layer: d.relative_error for d in divergence if not d.relative_error <= DIVERGENCE_TOLERANCE}
    findings = []
    for r in ranges:
        if r.compute_dtype != "float16" or r.layer in cfg.precision.float32_layers:
            continue
        fix = f"precision:\n  float32_layers: [{layer_name(r.layer)}]"
        underflow = r.subnormal_fraction + r.zero_fraction
        if r.overflow_fraction > 0:
            findings.append(Finding("error", r.layer, f"{r.overflow_fraction:.2%} of its activations exceed float16's "
                                                      f"maximum 65504 (max |x| {r.max_abs:.4g}); in float16 they become inf",
                                    fix))
        elif r.max_abs >= FLOAT16_MAX / 2:
            findings.append(Finding("warning", r.layer, f"its largest activation {r.max_abs:.4g} is within 2x of float16's "
                                                        "maximum 65504: slightly larger inputs overflow", fix))
        elif underflow >= AT_RISK_UNDERFLOW and r.layer in diverging:
            findings.append(Finding("warning", r.layer, f"{underflow:.2%} of its activations are below float16's "
                                                        f"smallest normal 6.1e-5 and it departs from float32 by "
                                                        f"{diverging[r.layer]:.3g} (relative)", fix))
    return findings


def gradient_findings(gradients: list[LayerGradients], cfg: Config, policy: precision.PolicyInfo,
                      trained_steps: int | None = None) -> list[Finding]:
    """trained_steps: the run's step count when the gradients are a trained run's, else None (an untrained model)."""
    findings = []
    safe = safe_loss_scale(gradients)
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
                                                      "scale applies the inf update", _scale_fix(g, safe, policy, cfg)))
        elif g.scaled_overflow_fraction > 0:
            findings.append(Finding("warning", g.layer, f"{g.scaled_overflow_fraction:.2%} of its gradients overflow "
                                                        f"float16 at the loss scale {g.loss_scale:g}: dynamic scaling "
                                                        "skips each such step and halves the scale",
                                    _scale_fix(g, safe, policy, cfg)))
        elif g.scaled_zero_fraction > GRADIENT_ZERO_WARNING:
            findings.append(Finding("warning", g.layer, f"{g.scaled_zero_fraction:.2%} of its gradients flush to zero "
                                                        f"in float16 even at loss scale {g.loss_scale:g}",
                                    _scale_fix(g, safe, policy, cfg, trained_steps)))
    return findings


def safe_loss_scale(gradients: list[LayerGradients]) -> int:
    """The largest power-of-two loss scale that keeps every float16 layer's largest gradient 2x below 65504
    (at most MAX_SUGGESTED_SCALE); 1 when even that does not fit."""
    largest = max((g.max_abs for g in gradients if g.compute_dtype == "float16" and math.isfinite(g.max_abs)),
                  default=0.0)
    if largest <= 0:
        return MAX_SUGGESTED_SCALE
    return int(min(2 ** max(0, math.floor(math.log2(FLOAT16_MAX / 2 / largest))), MAX_SUGGESTED_SCALE))


def _float32_fix(layer: str, cfg: Config) -> str:
    fix = f"precision:\n  float32_layers: [{layer_name(layer)}]"
    if not cfg.model.normalize:
        fix += "\n# or rescale the inputs:\nmodel:\n  normalize: true"
    return fix


def _scale_fix(g: LayerGradients, safe: int, policy: precision.PolicyInfo, cfg: Config,
               trained_steps: int | None = None) -> str:
    """Overflow: the safe scale (under dynamic scaling the initial scale Keras adjusts from). Underflow: the safe
    scale when it is at least twice the current one, else float32 for the layer (no scale serves every layer);
    after a dynamic-scaling run, a dynamic_growth_steps that lets the scale double up to it by mid-run."""
    if g.overflow_fraction > 0:
        return _float32_fix(g.layer, cfg)
    if policy.loss_scale == "none":
        return "precision:\n  loss_scale: dynamic"
    key = "initial_scale" if policy.loss_scale == "dynamic" else "loss_scale"
    if g.scaled_overflow_fraction > 0:
        return f"precision:\n  {key}: {min(safe, _lower_power_of_two(g.loss_scale))}"
    if safe < 2 * g.loss_scale:
        return _float32_fix(g.layer, cfg)
    if policy.loss_scale == "dynamic" and trained_steps:
        doublings = max(1, math.floor(math.log2(safe / g.loss_scale)))
        growth = max(1, trained_steps // (2 * doublings))
        if growth >= (policy.dynamic_growth_steps or 0):
            return _float32_fix(g.layer, cfg)
        return f"precision:\n  dynamic_growth_steps: {growth}"
    return f"precision:\n  {key}: {safe}"


def _lower_power_of_two(scale: float) -> int:
    return int(2 ** max(0, math.ceil(math.log2(scale)) - 1))


def rank_at_risk(ranges: list[LayerRange], gradients: list[LayerGradients], cfg: Config,
                 policy: precision.PolicyInfo, divergence: list[LayerDivergence] = (),
                 trained_steps: int | None = None) -> list[AtRisk]:
    """The float16 layers whose activations or gradients have a finding (range_findings, gradient_findings),
    most at risk first, each with the finding's fix."""
    fixes = {("activations", f.layer): f.fix for f in range_findings(ranges, cfg, divergence)}
    fixes |= {("gradients", f.layer): f.fix for f in gradient_findings(gradients, cfg, policy, trained_steps)}
    risks = []
    for r in ranges:
        if ("activations", r.layer) in fixes:
            problem = (f"max |x| {r.max_abs:.4g}; {r.overflow_fraction:.2%} over 65504, "
                       f"{r.subnormal_fraction + r.zero_fraction:.2%} below 6.1e-5")
            risks.append(AtRisk(r.layer, "activations", problem, fixes[("activations", r.layer)],
                                (r.overflow_fraction, 0.0, r.risk[1], r.risk[2])))
    for g in gradients:
        if ("gradients", g.layer) in fixes:
            problem = (f"max |g| {g.max_abs:.4g}; unscaled {g.overflow_fraction:.2%} over 65504, "
                       f"{g.zero_fraction:.2%} to zero; x{g.loss_scale:g}: {g.scaled_overflow_fraction:.2%} over 65504, "
                       f"{g.scaled_zero_fraction:.2%} to zero, {g.scaled_subnormal_fraction:.2%} subnormal")
            risks.append(AtRisk(g.layer, "gradients", problem, fixes[("gradients", g.layer)], g.risk))
    return sorted(risks, key=lambda r: r.risk, reverse=True)


_FLOAT32_LAYERS = re.compile(r"^(\s*)float32_layers: \[(.*)\]$", re.MULTILINE)


def keep_user_layers(fix: str, config: PrecisionConfig) -> str:
    """A fix's float32_layers with the user's own precision.float32_layers in front, and the layers it adds taken out
    of float16_layers: pasted into the experiment file, the fix adds to what the user chose and never undoes it."""
    def merged(match: re.Match) -> str:
        indent, added = match.group(1), [name.strip() for name in match.group(2).split(",") if name.strip()]
        line = f"{indent}float32_layers: [{', '.join(dict.fromkeys([*config.float32_layers, *added]))}]"
        if set(added) & set(config.float16_layers):
            kept = [name for name in config.float16_layers if name not in added]
            line += f"\n{indent}float16_layers: [{', '.join(kept)}]"
        return line

    return _FLOAT32_LAYERS.sub(merged, fix)


def merge_fixes(fixes: list[str]) -> str:
    """YAML fixes as one override: mappings merged, float32_layers lists joined, the lowest loss scale (and growth
    steps) kept,
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
        elif key in ("initial_scale", "loss_scale", "dynamic_growth_steps") and isinstance(into.get(key), (int, float)):
            into[key] = min(into[key], value)  # overflow (a lower scale) matters more than underflow
        else:
            into[key] = value
