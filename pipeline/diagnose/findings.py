"""The diagnosis and its rows (layer dtypes, findings, ranges, gradients, risks, divergence) as text or JSON.

print_diagnosis prints it; the exit code is 1 when a finding is an error, else 0 (skipped probes, each listed
in one line, do not change it).
"""

from __future__ import annotations

import dataclasses
import json

import yaml

from pipeline.diagnose.thresholds import AT_RISK_SHOWN, DIVERGENCE_TOLERANCE, FLOAT16_MAX


@dataclasses.dataclass
class LayerDtypes:
    name: str
    kind: str
    policy: str
    compute_dtype: str
    variable_dtype: str


@dataclasses.dataclass
class OpDtypes:
    layer: str  # the full path of the layer whose call holds the ops, or '(loss)'
    op: str  # the op type, or 'loss value'
    count: int  # ops of this type there computing in this dtype
    dtype: str


@dataclasses.dataclass
class Finding:
    severity: str  # "error" or "warning"
    layer: str
    problem: str
    fix: str  # YAML to paste into the experiment file (or a comment when no config key covers it)


@dataclasses.dataclass
class LayerRange:
    layer: str
    compute_dtype: str
    values: int
    max_abs: float
    overflow_fraction: float  # |x| > 65504: inf in float16
    subnormal_fraction: float  # 6e-8 <= |x| < 6.1e-5: precision lost in float16
    zero_fraction: float  # 0 < |x| < 6e-8: becomes 0 in float16

    @property
    def risk(self) -> tuple[float, float, float]:
        """Overflow first, then closeness to float16's maximum, then the share lost to underflow."""
        underflow = self.subnormal_fraction + self.zero_fraction
        return (self.overflow_fraction, min(self.max_abs / FLOAT16_MAX, 1.0), underflow)


@dataclasses.dataclass
class LayerGradients:
    layer: str
    compute_dtype: str
    values: int
    max_abs: float  # unscaled
    loss_scale: float  # what the scaled_* fractions were measured at (1 without loss scaling)
    overflow_fraction: float  # unscaled, as LayerRange
    subnormal_fraction: float
    zero_fraction: float
    scaled_overflow_fraction: float  # multiplied by loss_scale, as float16 computes them
    scaled_subnormal_fraction: float
    scaled_zero_fraction: float

    @property
    def risk(self) -> tuple[float, float, float, float]:
        """Unscaled overflow, scaled overflow, closeness of the scaled maximum to 65504, scaled underflow."""
        underflow = self.scaled_zero_fraction + self.scaled_subnormal_fraction  # as float16 computes them
        return (self.overflow_fraction, self.scaled_overflow_fraction,
                min(self.max_abs * self.loss_scale / FLOAT16_MAX, 1.0), underflow)


@dataclasses.dataclass
class AtRisk:
    layer: str
    what: str  # "activations" or "gradients"
    problem: str
    fix: str  # YAML to paste
    risk: tuple[float, ...]  # overflow, scaled overflow, closeness to 65504, underflow: larger is worse


@dataclasses.dataclass
class LayerDivergence:
    layer: str
    compute_dtype: str
    relative_error: float  # ||mixed - float32|| / ||float32|| on one batch; inf when the mixed output is not finite


@dataclasses.dataclass
class Diagnosis:
    source: str
    policy: str
    layers: list[LayerDtypes]
    findings: list[Finding]
    ranges: list[LayerRange]  # most at risk first
    operations: list[OpDtypes] = dataclasses.field(default_factory=list)  # the sensitive ops (ops.py), graph order
    divergence: list[LayerDivergence] = dataclasses.field(default_factory=list)  # in graph order
    first_divergence: str | None = None  # the first layer whose relative error exceeds DIVERGENCE_TOLERANCE
    gradients: list[LayerGradients] = dataclasses.field(default_factory=list)  # most at risk first
    at_risk: list[AtRisk] = dataclasses.field(default_factory=list)  # float16 layers, most at risk first
    override: str = ""  # every finding's fix merged into one YAML block
    edge: dict | None = None  # the input-limits probe: rows, low, high, nonfinite, example, far (the same, far beyond)
    skipped: list[str] = dataclasses.field(default_factory=list)  # "<probe>: <why it could not run>", one per probe

    def __post_init__(self) -> None:
        """Errors before warnings (each kind in the order found), so the text and the JSON lead with the worst."""
        self.findings = sorted(self.findings, key=lambda finding: finding.severity != "error")

    @property
    def ok(self) -> bool:
        return not any(finding.severity == "error" for finding in self.findings)

    def to_dict(self) -> dict:
        return {"ok": self.ok, **dataclasses.asdict(self)}

    def text(self) -> str:
        lines = [f"diagnose {self.source} under policy {self.policy}", "",
                 f"{'layer':24} {'kind':20} {'policy':16} {'compute':9} variables"]
        lines += [f"{d.name:24} {d.kind:20} {d.policy:16} {d.compute_dtype:9} {d.variable_dtype}" for d in self.layers]
        if self.operations:
            lines += ["", "numerically sensitive ops (traced forward pass and loss):",
                      f"{'layer':24} {'op':36} {'count':>5} dtype"]
            lines += [f"{o.layer:24} {o.op:36} {o.count:5} {o.dtype}" for o in self.operations]
        lines.append("")
        if not self.findings:
            lines.append("no findings" if not self.skipped else "no findings from the checks that ran")
        lines += [f"SKIPPED  {line}" for line in self.skipped]
        for finding in self.findings:
            lines.append(f"{finding.severity.upper()}  {finding.layer}: {finding.problem}")
            lines += ["    fix:"] + [f"      {line}" for line in finding.fix.splitlines()]
        if self.ranges:
            lines += ["", "float16 range probe (most at risk first; values seen in float32):",
                      f"{'layer':24} {'compute':9} {'max |x|':>11} {'> 65504':>9} {'subnormal':>10} {'-> zero':>9}"]
            lines += [f"{r.layer:24} {r.compute_dtype:9} {r.max_abs:11.4g} {r.overflow_fraction:9.2%} "
                      f"{r.subnormal_fraction:10.2%} {r.zero_fraction:9.2%}" for r in self.ranges]
        if self.gradients:
            scale = self.gradients[0].loss_scale
            lines += ["", f"float16 gradient probe (unscaled | x loss scale {scale:g}; most at risk first):",
                      f"{'layer':24} {'compute':9} {'max |g|':>11} {'> 65504':>9} {'subnormal':>10} {'-> zero':>9} |"
                      f" {'> 65504':>9} {'subnormal':>10} {'-> zero':>9}"]
            lines += [f"{g.layer:24} {g.compute_dtype:9} {g.max_abs:11.4g} {g.overflow_fraction:9.2%} "
                      f"{g.subnormal_fraction:10.2%} {g.zero_fraction:9.2%} | {g.scaled_overflow_fraction:9.2%} "
                      f"{g.scaled_subnormal_fraction:10.2%} {g.scaled_zero_fraction:9.2%}" for g in self.gradients]
        if self.edge:
            e = self.edge
            outcome = (f"{e['nonfinite']} give NaN or inf outputs, e.g. {e['example']}" if e["nonfinite"]
                       else "every output finite")
            limits = ("its own training min or max" if e.get("per_column") else
                      f"{e['low']:g} or {e['high']:g} (the training rows' min and max)")
            what = e.get("what") or f" with each feature at {limits}"  # what: a language model's rows of ids
            lines += ["", f"input limits probe: {e['rows']} rows{what}: {outcome}"]
            far = e.get("far")
            if far:
                outcome = (f"{far['nonfinite']} give NaN or inf outputs, e.g. {far['example']}" if far["nonfinite"]
                           else "every output finite")
                what = far.get("what") or (f" with each feature at {far['low']:g} or {far['high']:g} "
                                           "(100 training ranges beyond)")
                lines += [f"far inputs probe: {far['rows']} rows{what}: {outcome}"]
        lines += ["", *self.at_risk_lines()]
        if self.override:
            lines += ["", "suggested override (paste into the experiment file):"]
            lines += [f"  {line}" for line in self.override.splitlines()]
        if self.divergence:
            lines += ["", "divergence from float32 (one batch, same weights; "
                          f"tolerance {DIVERGENCE_TOLERANCE:g} relative):",
                      f"{'layer':24} {'compute':9} {'rel. error':>11}"]
            lines += [f"{d.layer:24} {d.compute_dtype:9} {d.relative_error:11.3g}"
                      f"{'  <- first beyond tolerance' if d.layer == self.first_divergence else ''}"
                      for d in self.divergence]
            lines.append(f"first divergence: {self.first_divergence}" if self.first_divergence
                         else "no layer diverges beyond the tolerance")
        return "\n".join(lines)

    def at_risk_lines(self, limit: int = AT_RISK_SHOWN) -> list[str]:
        """The ranked at-risk list, one line per layer and kind, with its fix on one line."""
        if not self.at_risk:
            return ["at risk in float16: none"]
        lines = ["at risk in float16 (most first):"]
        for rank, risk in enumerate(self.at_risk[:limit], 1):
            fix = _one_line(risk.fix)
            lines.append(f"{rank:2}. {risk.layer} ({risk.what}): {risk.problem}  fix: {fix}")
        if len(self.at_risk) > limit:
            lines.append(f"    ... and {len(self.at_risk) - limit} more (--json lists all)")
        return lines


def _one_line(fix: str) -> str:
    """A YAML fix as one flow-style line, e.g. {precision: {float32_layers: [logits]}}; comments dropped."""
    body = "\n".join(line for line in fix.split("\n# or")[0].splitlines() if not line.startswith("#"))
    return yaml.safe_dump(yaml.safe_load(body), default_flow_style=True, width=1000).strip()


def print_diagnosis(diagnosis: Diagnosis, as_json: bool = False) -> int:
    """Prints the diagnosis (text or JSON); returns 1 if it found an error, else 0."""
    print(json.dumps(diagnosis.to_dict(), indent=2) if as_json else diagnosis.text())
    return 0 if diagnosis.ok else 1
