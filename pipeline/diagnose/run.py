"""`python -m pipeline diagnose CONFIG [--json] [--batches N]`: where the model's precision can hurt.

Audit (no training needed): every layer's policy, compute and variable dtype, and findings, each with
the fix as YAML to paste into the experiment file:
  error    a model output, or a softmax/sigmoid (the layer the loss reads), computing in float16 or
           bfloat16: probabilities lose precision or overflow, and serving would return float16.
  warning  a normalization layer computing in float16 (means and variances need float32's range).
  warning  under float16 compute, Dense units / Conv filters / input features or the batch size
           not a multiple of 8: Tensor Cores need multiples of 8 (NVIDIA's mixed-precision guide).
Range probe (on real validation batches, the model cloned to float32 with the same weights, so
values are seen before float16 would clip them): per layer the share of activations that overflow
float16 (|x| > 65504), that would be subnormal (|x| < 6.1e-5) or flush to zero (|x| < 6e-8, zeros
not counted), and the largest magnitude; layers ranked most at risk first. Any overflow is an error.
Gradient probe (a few real training batches, the float32 twin, the compiled loss): per layer the gradients
of the loss with respect to its output and its weights, which float16 layers compute in float16, as they
are (unscaled) and multiplied by the loss scale (the run's final scale, else the configured initial or
static one), with the same float16 shares. Unscaled overflow is an error (no loss scale helps); overflow
after a static scale is an error (a static scale does not skip the step); more than
GRADIENT_ZERO_WARNING of the scaled gradients flushing to zero is a warning (raise the loss scale).
At risk: activations and gradients of the float16 layers merged into one ranked list, each with its fix;
the fixes of every finding and of every overflowing entry merged into one YAML override to paste.
Divergence locator (one validation batch through the model as configured and through its float32 twin, same
weights): per layer in graph order the relative error ||mixed - float32|| / ||float32||, and the first layer
where it exceeds DIVERGENCE_TOLERANCE, which is where reduced precision first changes the numbers.
The exit code is 1 when there is an error, else 0.
"""

from __future__ import annotations

import dataclasses
import json
import math

import keras
import numpy as np
import tensorflow as tf
import yaml
from keras import layers

from pipeline import data, models, precision
from pipeline.artifacts import METRICS_FILE, MODEL_FILE
from pipeline.config import Config


FLOAT16_MAX = 65504.0
FLOAT16_MIN_NORMAL = 6.1e-5  # 2**-14
FLOAT16_MIN_SUBNORMAL = 6e-8  # 2**-24: smaller magnitudes round to zero
REDUCED = ("float16", "bfloat16")
NORMALIZATION = (layers.BatchNormalization, layers.LayerNormalization, layers.GroupNormalization,
                 layers.Normalization, layers.UnitNormalization)
PROBABILITY_ACTIVATIONS = ("softmax", "log_softmax", "sigmoid")
# Flushing a few tiny gradients to zero is harmless; a sizeable share means updates that never happen.
GRADIENT_ZERO_WARNING = 0.05
AT_RISK_SHOWN = 10
AT_RISK_UNDERFLOW = 0.01
# The highest loss scale a fix suggests: well past any scale dynamic scaling reaches on a healthy run.
MAX_SUGGESTED_SCALE = 2 ** 24
# float16 keeps ~3 significant digits (2**-11 relative); rounding through a few layers stays well under 1%.
DIVERGENCE_TOLERANCE = 1e-2


@dataclasses.dataclass
class LayerDtypes:
    name: str
    kind: str
    policy: str
    compute_dtype: str
    variable_dtype: str


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
    divergence: list[LayerDivergence] = dataclasses.field(default_factory=list)  # in graph order
    first_divergence: str | None = None  # the first layer whose relative error exceeds DIVERGENCE_TOLERANCE
    gradients: list[LayerGradients] = dataclasses.field(default_factory=list)  # most at risk first
    at_risk: list[AtRisk] = dataclasses.field(default_factory=list)  # float16 layers, most at risk first
    override: str = ""  # every finding's fix merged into one YAML block

    @property
    def ok(self) -> bool:
        return not any(finding.severity == "error" for finding in self.findings)

    def to_dict(self) -> dict:
        return {"ok": self.ok, **dataclasses.asdict(self)}

    def text(self) -> str:
        lines = [f"diagnose {self.source} under policy {self.policy}", "",
                 f"{'layer':24} {'kind':20} {'policy':16} {'compute':9} variables"]
        lines += [f"{d.name:24} {d.kind:20} {d.policy:16} {d.compute_dtype:9} {d.variable_dtype}" for d in self.layers]
        lines.append("")
        if not self.findings:
            lines.append("no findings")
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
    findings += _range_findings(ranges, cfg)
    size = cfg.train.batch_size
    train_batches = [(datasets.train_x[i:i + size], datasets.train_y[i:i + size])
                     for i in range(0, len(datasets.train_x), size)][:probe_batches]
    scale = _loss_scale(cfg, policy)
    gradients = probe_gradients(model, train_batches, models.compile_settings(datasets.spec)[0],
                                scale, twin) if train_batches else []
    findings += _gradient_findings(gradients, cfg, policy)
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


def audit_model(model: keras.Model, cfg: Config) -> tuple[list[LayerDtypes], list[Finding]]:
    """Every layer's dtypes, and the findings of the dtype audit (module docstring)."""
    dtypes, findings = [], []
    outputs = {_producer(t) for t in keras.tree.flatten(model.outputs)}
    for layer in _layers(model):
        if isinstance(layer, keras.layers.InputLayer):  # its policy is the global one, not its tensor's dtype
            continue
        dtypes.append(LayerDtypes(layer.name, type(layer).__name__, layer.dtype_policy.name, layer.compute_dtype,
                                  layer.variable_dtype))
        findings += _dtype_findings(layer, layer.name in outputs)
        findings += _tensor_core_findings(layer, cfg)
    findings += _batch_size_findings(model, cfg)
    return dtypes, findings


def _dtype_findings(layer, is_output: bool) -> list[Finding]:
    if layer.compute_dtype not in REDUCED:
        return []
    fix = f"precision:\n  float32_layers: [{layer.name}]"
    activation = _activation_name(layer)
    if is_output:
        return [Finding("error", layer.name, f"model output computed in {layer.compute_dtype} (serving returns it as "
                                             f"{layer.compute_dtype}; the loss reads rounded values)", fix)]
    if isinstance(layer, layers.Softmax) or activation in PROBABILITY_ACTIVATIONS:
        return [Finding("error", layer.name, f"{activation or 'softmax'} computed in {layer.compute_dtype}: "
                                             "exp() overflows float16 and small probabilities underflow", fix)]
    if isinstance(layer, NORMALIZATION):
        return [Finding("warning", layer.name, f"{type(layer).__name__} computes in {layer.compute_dtype}; "
                                               "means and variances need float32's range and precision", fix)]
    return []


def _tensor_core_findings(layer, cfg: Config) -> list[Finding]:
    """Units/filters and input features of float16 Dense/Conv layers that are not multiples of 8."""
    if layer.compute_dtype != "float16" or not isinstance(layer, (layers.Dense, layers.Conv1D, layers.Conv2D,
                                                                   layers.Conv3D)):
        return []
    findings = []
    width = layer.units if isinstance(layer, layers.Dense) else layer.filters
    what = "units" if isinstance(layer, layers.Dense) else "filters"
    if width % 8 and layer.name not in ("logits", "head"):  # the head's width is the task's, not a choice
        findings.append(Finding("warning", layer.name, f"{what} {width} is not a multiple of 8 (Tensor Cores)",
                                _size_fix(layer.name, cfg)))
    kernel = getattr(layer, "kernel", None)
    features = int(kernel.shape[-2]) if kernel is not None else None
    if features and features % 8:
        findings.append(Finding("warning", layer.name, f"{features} input features are not a multiple of 8 "
                                                       "(Tensor Cores)",
                                _features_fix(layer.name, features, cfg)))
    return findings


def _size_fix(name: str, cfg: Config) -> str:
    m = cfg.model
    if name.startswith("dense_") and m.hidden_units:
        return f"model:\n  hidden_units: {_rounded(m.hidden_units)}"
    if name.startswith("conv_") and m.kind == "cnn":
        return f"model:\n  filters: {_rounded(m.filters)}"
    return f"# {name}: round its size up to a multiple of 8 in the model's builder (model.params)"


def _features_fix(name: str, features: int, cfg: Config) -> str:
    m = cfg.model
    index = int(name.split("_")[-1]) if name.startswith("dense_") and name.split("_")[-1].isdigit() else 0
    if index > 1 and m.hidden_units:  # fed by the previous hidden layer
        return f"model:\n  hidden_units: {_rounded(m.hidden_units)}"
    if name.startswith("conv_") and index > 1 and m.kind == "cnn":
        return f"model:\n  filters: {_rounded(m.filters)}"
    padded = -(-features // 8) * 8
    return (f"# {name} reads {features} features from the data: pad each row to {padded} "
            f"(e.g. {padded - features} zero columns), or keep this layer in float32:\n"
            f"precision:\n  float32_layers: [{name}]")


def _batch_size_findings(model: keras.Model, cfg: Config) -> list[Finding]:
    if cfg.train.batch_size % 8 == 0 or not any(layer.compute_dtype == "float16" for layer in _layers(model)):
        return []
    return [Finding("warning", "(batch)", f"train.batch_size {cfg.train.batch_size} is not a multiple of 8 "
                                          "(Tensor Cores)",
                    f"train:\n  batch_size: {-(-cfg.train.batch_size // 8) * 8}")]


def probe_ranges(model: keras.Model, batches: list[np.ndarray], twin: keras.Model | None = None) -> list[LayerRange]:
    """Per-layer activation statistics against float16's range, most at risk first."""
    probed = _probed_layers(model)
    twin = twin or float32_twin(model)
    taps = keras.Model(twin.inputs, [twin.get_layer(layer.name).output for layer in probed])
    stats = {layer.name: [] for layer in probed}
    for batch in batches:
        values = taps([batch], training=False)
        for layer, value in zip(probed, values):
            stats[layer.name].append(np.abs(keras.ops.convert_to_numpy(value).astype(np.float64)).ravel())
    ranges = []
    for layer in probed:
        magnitudes = np.concatenate(stats[layer.name])
        ranges.append(LayerRange(layer.name, layer.compute_dtype, len(magnitudes), _max(magnitudes),
                                 *_float16_fractions(magnitudes)))
    # Layers that compute in float16 first: a float32 layer's range is shown but is at no risk.
    return sorted(ranges, key=lambda r: (r.compute_dtype == "float16", *r.risk), reverse=True)


def probe_gradients(model: keras.Model, batches: list[tuple[np.ndarray, np.ndarray]], loss: str,
                    loss_scale: float, twin: keras.Model | None = None) -> list[LayerGradients]:
    """Per-layer gradient statistics against float16's range, unscaled and times loss_scale, most at risk first.

    Computed in the float32 twin (values before float16 clips them) with the compiled loss averaged over
    the batch, as a train step does; a layer's gradients are those of the loss with respect to its output
    and its trainable weights."""
    probed = _probed_layers(model)
    twin = twin or float32_twin(model)
    names = [layer.name for layer in probed]
    head = _producer(keras.tree.flatten(twin.outputs)[0])
    # The model's output is read from its probed layer, so that the head's own gradient is recorded too.
    taps = keras.Model(twin.inputs, [twin.get_layer(name).output for name in names]
                       + ([] if head in names else [keras.tree.flatten(twin.outputs)[0]]))
    loss_fn = keras.losses.get(loss)
    stats = {layer.name: [] for layer in probed}
    for x, y in batches:
        x = tf.convert_to_tensor(x, tf.float32)
        with tf.GradientTape() as tape:
            tape.watch(x)  # so the ops before the first layer with weights are recorded too
            outputs = taps([x], training=False)
            prediction = outputs[names.index(head)] if head in names else outputs.pop()
            value = keras.ops.mean(loss_fn(y, prediction))
        weights = [twin.get_layer(layer.name).trainable_variables for layer in probed]
        output_grads, weight_grads = tape.gradient(value, [outputs, weights])
        for layer, output_grad, grads in zip(probed, output_grads, weight_grads):
            parts = [g for g in (output_grad, *grads) if g is not None]
            stats[layer.name] += [np.abs(keras.ops.convert_to_numpy(g).astype(np.float64)).ravel() for g in parts]
    result = []
    for layer in probed:
        if not stats[layer.name]:  # no gradient flows through it, e.g. a softmax whose loss reads its logits
            continue
        magnitudes = np.concatenate(stats[layer.name])
        result.append(LayerGradients(layer.name, layer.compute_dtype, len(magnitudes), _max(magnitudes), loss_scale,
                                     *_float16_fractions(magnitudes), *_float16_fractions(magnitudes * loss_scale)))
    return sorted(result, key=lambda g: (g.compute_dtype == "float16", *_gradient_risk(g)), reverse=True)


def _gradient_risk(g: LayerGradients) -> tuple[float, float, float, float]:
    underflow = g.scaled_zero_fraction + g.scaled_subnormal_fraction  # as float16 computes them
    return (g.overflow_fraction, g.scaled_overflow_fraction,
            min(g.max_abs * g.loss_scale / FLOAT16_MAX, 1.0), underflow)


def _float16_fractions(magnitudes: np.ndarray) -> tuple[float, float, float]:
    """Shares that overflow float16 (inf and NaN included), would be subnormal, or flush to zero (zeros not counted)."""
    n = max(len(magnitudes), 1)
    return (float(np.sum(~(magnitudes <= FLOAT16_MAX)) / n),
            float(np.sum((magnitudes >= FLOAT16_MIN_SUBNORMAL) & (magnitudes < FLOAT16_MIN_NORMAL)) / n),
            float(np.sum((magnitudes > 0) & (magnitudes < FLOAT16_MIN_SUBNORMAL)) / n))


def _max(magnitudes: np.ndarray) -> float:
    return float(np.max(magnitudes)) if len(magnitudes) else 0.0


def locate_divergence(model: keras.Model, batch: np.ndarray, twin: keras.Model | None = None) -> list[LayerDivergence]:
    """Per layer, in graph order, how far the model's output departs from its float32 twin's on one batch."""
    probed = _probed_layers(model)
    twin = twin or float32_twin(model)
    mixed = keras.Model(model.inputs, [layer.output for layer in probed])([batch], training=False)
    exact = keras.Model(twin.inputs, [twin.get_layer(layer.name).output for layer in probed])([batch], training=False)
    result = []
    for layer, low, high in zip(probed, mixed, exact):
        low = keras.ops.convert_to_numpy(low).astype(np.float64)
        high = keras.ops.convert_to_numpy(high).astype(np.float64)
        if not np.all(np.isfinite(low)):
            error = math.inf
        else:
            error = float(np.linalg.norm(low - high) / max(np.linalg.norm(high), np.finfo(np.float32).tiny))
        result.append(LayerDivergence(layer.name, layer.compute_dtype, error))
    return result


def first_divergence(divergence: list[LayerDivergence], tolerance: float = DIVERGENCE_TOLERANCE) -> str | None:
    return next((d.layer for d in divergence if not d.relative_error <= tolerance), None)


def float32_twin(model: keras.Model) -> keras.Model:
    """The same graph and weights, every layer computing in float32, so activations are measured before
    float16 clips them (mixed policies keep float32 variables, so the weights carry over exactly)."""
    def clone_function(layer):
        return layer.__class__.from_config({**layer.get_config(), "dtype": "float32"})

    twin = keras.models.clone_model(model, clone_function=clone_function)
    models.copy_weights(model, twin)
    return twin


def _probed_layers(model: keras.Model) -> list:
    """The layers a probe taps: every non-input layer with a single output tensor."""
    return [layer for layer in _layers(model) if not isinstance(layer, keras.layers.InputLayer)
            and len(keras.tree.flatten(layer.output)) == 1]


def _range_findings(ranges: list[LayerRange], cfg: Config) -> list[Finding]:
    return [Finding("error", r.layer, f"{r.overflow_fraction:.2%} of its activations exceed float16's maximum 65504 "
                                      f"(max |x| {r.max_abs:.4g}); in float16 they become inf",
                    f"precision:\n  float32_layers: [{r.layer}]")
            for r in ranges if r.overflow_fraction > 0 and r.compute_dtype == "float16"
            and r.layer not in cfg.precision.float32_layers]


def _gradient_findings(gradients: list[LayerGradients], cfg: Config, policy: precision.PolicyInfo) -> list[Finding]:
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
        risk = _gradient_risk(g)
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


def _one_line(fix: str) -> str:
    """A YAML fix as one flow-style line, e.g. {precision: {float32_layers: [logits]}}; comments dropped."""
    body = "\n".join(line for line in fix.split("\n# or")[0].splitlines() if not line.startswith("#"))
    return yaml.safe_dump(yaml.safe_load(body), default_flow_style=True, width=1000).strip()


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


def _layers(model: keras.Model):
    return [layer for layer in model.layers if not isinstance(layer, keras.Model)] + [
        inner for layer in model.layers if isinstance(layer, keras.Model) for inner in _layers(layer)]


def _producer(tensor) -> str | None:
    history = getattr(tensor, "_keras_history", None)
    return history.operation.name if history else None


def _activation_name(layer) -> str | None:
    activation = getattr(layer, "activation", None)
    return getattr(activation, "__name__", None) if activation is not None else None


def _rounded(sizes: list[int]) -> list[int]:
    return [-(-size // 8) * 8 for size in sizes]


def print_diagnosis(diagnosis: Diagnosis, as_json: bool = False) -> int:
    """Prints the diagnosis (text or JSON); returns 1 if it found an error, else 0."""
    print(json.dumps(diagnosis.to_dict(), indent=2) if as_json else diagnosis.text())
    return 0 if diagnosis.ok else 1
