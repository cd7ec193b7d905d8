"""diagnose: the dtype audit's findings (with YAML fixes), the float16 range probes of activations and gradients,
their ranking and the merged override."""

import json
from pathlib import Path

import keras
import numpy as np
import yaml
from keras import layers

from pipeline import cli, precision
from pipeline.artifacts import METRICS_FILE
from pipeline.config import load_config
from pipeline.diagnose import diagnose
from pipeline.diagnose.audit import audit_model
from pipeline.diagnose.thresholds import FLOAT16_MAX
from pipeline.diagnose.probes import first_divergence, locate_divergence, probe_gradients, probe_ranges
from pipeline.diagnose.findings import LayerDivergence, LayerGradients, LayerRange
from pipeline.diagnose.risks import gradient_findings, merge_fixes, range_findings, rank_at_risk

REPO_ROOT = Path(__file__).resolve().parents[3]


def _mixed_float16_model(build):
    keras.config.set_dtype_policy("mixed_float16")
    try:
        inputs = keras.Input((4,), name="features", dtype="float32")
        return keras.Model(inputs, build(inputs))
    finally:
        keras.config.set_dtype_policy("float32")


def _by_layer(findings):
    return {(f.layer, f.severity): f for f in findings}


def test_a_float16_softmax_output_is_an_error_with_a_float32_layers_fix():
    model = _mixed_float16_model(lambda x: layers.Dense(3, activation="softmax", name="scores")(
        layers.Dense(8, activation="relu", name="dense_1")(x)))
    layer_dtypes, findings = audit_model(model, load_config(None, ["model.hidden_units=[8]"]))
    assert [(d.name, d.compute_dtype, d.variable_dtype) for d in layer_dtypes] == [
        ("dense_1", "float16", "float32"), ("scores", "float16", "float32")]
    finding = _by_layer(findings)[("scores", "error")]
    assert "model output computed in float16" in finding.problem
    assert yaml.safe_load(finding.fix) == {"precision": {"float32_layers": ["scores"]}}


def test_a_float16_softmax_inside_the_model_and_a_float16_normalization_are_flagged():
    def build(x):
        x = layers.BatchNormalization(name="bn")(layers.Dense(8, name="dense_1")(x))
        x = layers.Activation("softmax", name="attention")(x)
        return layers.Dense(8, dtype="float32", name="out")(x)

    findings = _by_layer(audit_model(_mixed_float16_model(build), load_config(None, ["model.hidden_units=[8]"]))[1])
    assert "softmax computed in float16" in findings[("attention", "error")].problem
    assert yaml.safe_load(findings[("bn", "warning")].fix) == {"precision": {"float32_layers": ["bn"]}}
    assert ("out", "error") not in findings


A100 = precision.Hardware(gpus=(("NVIDIA A100", (8, 0)),))


def test_sizes_that_are_not_multiples_of_8_get_rounded_config_values(monkeypatch):
    monkeypatch.setattr(precision, "detect_hardware", lambda: A100)  # Tensor Cores: the advice applies
    model = _mixed_float16_model(lambda x: layers.Dense(
        3, dtype="float32", name="logits")(layers.Dense(12, activation="relu", name="dense_1")(x)))
    cfg = load_config(None, ["model.hidden_units=[12]", "train.batch_size=100"])
    findings = {f.problem: f for f in audit_model(model, cfg)[1]}
    units = findings["units 12 is not a multiple of 8 (Tensor Cores)"]
    assert units.layer == "dense_1" and yaml.safe_load(units.fix) == {"model": {"hidden_units": [16]}}
    batch = findings["train.batch_size 100 is not a multiple of 8 (Tensor Cores)"]
    assert yaml.safe_load(batch.fix) == {"train": {"batch_size": 104}}
    # 4 input features into dense_1 cannot be fixed in the config: pad the rows or keep it in float32.
    features = findings["4 input features are not a multiple of 8 (Tensor Cores)"]
    assert yaml.safe_load(features.fix) == {"precision": {"float32_layers": ["dense_1"]}}
    assert len(findings) == 3  # the float32 logits are no Tensor Core matter


def test_no_tensor_core_advice_without_a_gpu_that_has_them(monkeypatch):
    # Issue 23: on a CPU, diagnose advised float32_layers for a layer reading 1 feature (Tensor Core alignment).
    model = _mixed_float16_model(lambda x: layers.Dense(
        3, dtype="float32", name="logits")(layers.Dense(12, activation="relu", name="dense_1")(x)))
    cfg = load_config(None, ["model.hidden_units=[12]", "train.batch_size=100"])
    for machine in (precision.Hardware(cpu_flags=frozenset({"avx512_fp16"})),
                    precision.Hardware(gpus=(("Tesla K80", (3, 7)),))):
        monkeypatch.setattr(precision, "detect_hardware", lambda: machine)
        assert audit_model(model, cfg)[1] == []


def test_the_probe_ranks_a_layer_that_overflows_float16_first():
    def build(x):
        x = layers.Dense(8, activation="relu", name="small", kernel_initializer="ones")(x)
        x = layers.Dense(8, name="big", kernel_initializer=keras.initializers.Constant(1e4))(x)  # 4*8*1e4 > 65504
        return layers.Activation("tanh", dtype="float32", name="out")(x)

    model = _mixed_float16_model(build)
    ranges = probe_ranges(model, [np.ones((16, 4), np.float32), np.full((16, 4), 0.5, np.float32)])
    assert [r.layer for r in ranges][:2] == ["big", "small"]
    big = ranges[0]
    assert big.overflow_fraction == 1.0 and big.max_abs > FLOAT16_MAX and big.compute_dtype == "float16"
    assert ranges[1].overflow_fraction == 0.0
    assert np.isinf(keras.ops.convert_to_numpy(model.get_layer("big")(np.ones((1, 8), np.float16)))).all()


def test_diagnose_the_configured_model_before_training(tiny_config_path, tmp_path, monkeypatch):
    monkeypatch.setattr(precision, "detect_hardware", lambda: A100)
    cfg = load_config(tiny_config_path, [f"train.runs_dir={tmp_path}", "model.hidden_units=[30, 16]"])
    diagnosis = diagnose(cfg, probe_batches=2)
    assert "untrained" in diagnosis.source and diagnosis.policy == "mixed_float16"
    assert diagnosis.ok  # warnings only
    assert {(f.layer, f.severity) for f in diagnosis.findings} == {("dense_1", "warning"), ("dense_2", "warning")}
    assert {r.layer for r in diagnosis.ranges} == {"standardize", "dense_1", "dense_2", "logits", "probabilities"}
    assert all(r.overflow_fraction == 0 for r in diagnosis.ranges)


def test_cli_diagnose_reads_the_trained_run(trained_run, tiny_config_path, capsys):
    assert cli.main(["diagnose", str(tiny_config_path), "--json", "--batches", "2"]) == 0  # in-process: fast
    diagnosis = json.loads(capsys.readouterr().out)
    assert diagnosis["source"].endswith("model.keras") and diagnosis["findings"] == []
    assert {d["name"]: d["compute_dtype"] for d in diagnosis["layers"]}["dense_1"] == "float16"


class _Cancel(layers.Layer):
    """(x + 2048) - 2048: exact in float32, but float16's spacing at 2048 is 2, so small values vanish."""

    def call(self, x):
        return (x + 2048.0) - 2048.0


def test_the_divergence_locator_finds_a_precision_sensitive_layer():
    def build(x):
        x = layers.Dense(8, activation="relu", name="dense_1")(x)
        x = _Cancel(name="cancel")(x)
        x = layers.Dense(8, name="dense_2")(x)
        return layers.Activation("linear", dtype="float32", name="out")(x)

    model = _mixed_float16_model(build)
    batch = np.random.default_rng(0).normal(size=(16, 4)).astype(np.float32)
    divergence = locate_divergence(model, batch)
    assert [d.layer for d in divergence] == ["dense_1", "cancel", "dense_2", "out"]
    errors = {d.layer: d.relative_error for d in divergence}
    assert errors["dense_1"] < 1e-2 < errors["cancel"]
    assert first_divergence(divergence) == "cancel"


def test_diagnose_reports_no_divergence_for_the_digits_mlp(tiny_config_path, tmp_path):
    cfg = load_config(tiny_config_path, [f"train.runs_dir={tmp_path}"])
    diagnosis = diagnose(cfg, probe_batches=1)
    assert [d.layer for d in diagnosis.divergence][-1] == "probabilities"
    assert diagnosis.first_divergence is None and "no layer diverges" in diagnosis.text()
    assert diagnosis.to_dict()["divergence"][0]["relative_error"] < 1e-2


def _two_branch_model():
    """'loud' reads the raw rows (~1e3), so its weight gradients times 32768 overflow float16; 'quiet' reads
    them scaled by 1e-10, so its weight gradients flush to zero in float16 unless the loss is scaled."""
    def build(x):
        loud = layers.Dense(8, name="loud")(x)
        quiet = layers.Dense(8, name="quiet")(layers.Rescaling(1e-10, name="shrink")(x))
        logits = layers.Dense(3, dtype="float32", name="logits")(layers.Concatenate(name="join")([loud, quiet]))
        return layers.Activation("softmax", dtype="float32", name="probabilities")(logits)

    keras.utils.set_random_seed(0)
    return _mixed_float16_model(build)


def _batches():
    rng = np.random.default_rng(0)
    return [(rng.uniform(500, 1500, size=(16, 4)).astype(np.float32), rng.integers(0, 3, 16)) for _ in range(2)]


def test_the_gradient_probe_ranks_a_layer_whose_scaled_gradients_overflow_first_with_a_lower_scale():
    model = _two_branch_model()
    gradients = probe_gradients(model, _batches(), "sparse_categorical_crossentropy", loss_scale=32768.0)
    by_layer = {g.layer: g for g in gradients}
    loud, quiet = by_layer["loud"], by_layer["quiet"]
    assert gradients[0].layer == "loud"
    assert loud.overflow_fraction == 0 and loud.scaled_overflow_fraction > 0.1 and loud.max_abs * 32768 > FLOAT16_MAX
    assert quiet.zero_fraction > 0.15 and quiet.scaled_zero_fraction == 0  # the loss scale rescues it
    assert "probabilities" not in by_layer  # Keras' cross-entropy reads the softmax's logits: no gradient through it

    cfg = load_config(None, ["model.hidden_units=[8]"])
    dynamic = precision.apply_policy(cfg.precision)
    at_risk = rank_at_risk([], gradients, cfg, dynamic)
    assert (at_risk[0].layer, at_risk[0].what) == ("loud", "gradients")
    lower = yaml.safe_load(at_risk[0].fix)["precision"]["initial_scale"]
    assert 1 <= lower < 32768 and lower * loud.max_abs < FLOAT16_MAX / 2
    # Dynamic scaling halves the scale by itself, skipping steps on the way: a warning (the run still trains),
    # and the at-risk entry is that finding's, so "no findings" and an at-risk list can never disagree.
    findings = gradient_findings(gradients, cfg, dynamic)
    assert [(f.layer, f.severity) for f in findings] == [("loud", "warning")]
    assert "skips each such step and halves the scale" in findings[0].problem and findings[0].fix == at_risk[0].fix

    static_cfg = load_config(None, ["model.hidden_units=[8]", "precision.loss_scale=32768"])
    static = precision.apply_policy(static_cfg.precision)
    findings = gradient_findings(gradients, static_cfg, static)
    assert [(f.layer, f.severity) for f in findings] == [("loud", "error")]
    assert "static loss scale 32768" in findings[0].problem
    assert yaml.safe_load(merge_fixes([f.fix for f in findings])) == {"precision": {"loss_scale": lower}}


def test_gradients_that_underflow_without_loss_scaling_get_a_higher_scale():
    gradients = probe_gradients(_two_branch_model(), _batches(), "sparse_categorical_crossentropy", loss_scale=1.0)
    cfg = load_config(None, ["model.hidden_units=[8]"])
    findings = gradient_findings(gradients, cfg, precision.apply_policy(cfg.precision))
    quiet = next(f for f in findings if f.layer == "quiet")
    assert quiet.severity == "warning" and "flush to zero in float16 even at loss scale 1" in quiet.problem
    assert yaml.safe_load(quiet.fix)["precision"]["initial_scale"] > 1


def test_diagnose_text_shows_the_gradient_probe_and_the_ranked_list(tiny_config_path, tmp_path):
    cfg = load_config(tiny_config_path, [f"train.runs_dir={tmp_path}"])
    diagnosis = diagnose(cfg, probe_batches=1)
    assert {g.layer for g in diagnosis.gradients} >= {"dense_1", "dense_2", "logits"}
    assert all(g.loss_scale == 32768.0 for g in diagnosis.gradients)  # untrained: the configured initial scale
    assert all(r.layer in {"standardize", "dense_1", "dense_2", "logits"} for r in diagnosis.at_risk)
    text = diagnosis.text()
    assert "float16 gradient probe (unscaled | x loss scale 32768" in text and "at risk in float16" in text
    assert json.loads(json.dumps(diagnosis.to_dict()))["gradients"][0]["values"] > 0


def test_unnormalized_regression_targets_get_a_lower_initial_scale_in_the_override(tmp_path):
    # Diabetes targets are ~150 and model.normalize false leaves them raw: MSE gradients times 32768 overflow.
    cfg = load_config(REPO_ROOT / "configs" / "diabetes_mlp.yaml",
                      [f"train.runs_dir={tmp_path}", "model.normalize=false"])
    diagnosis = diagnose(cfg, probe_batches=1)
    top = diagnosis.at_risk[0]
    assert top.what == "gradients" and "over 65504" in top.problem
    gradients = {g.layer: g for g in diagnosis.gradients}[top.layer]
    assert gradients.overflow_fraction == 0 < gradients.scaled_overflow_fraction
    scale = yaml.safe_load(diagnosis.override)["precision"]["initial_scale"]
    largest = max(g.max_abs for g in diagnosis.gradients if g.compute_dtype == "float16")
    assert scale < 32768 and scale * largest < FLOAT16_MAX
    assert "suggested override (paste into the experiment file):" in diagnosis.text()


def test_a_run_trained_under_auto_is_diagnosed_under_the_policy_it_recorded(tiny_config_path, tmp_path,
                                                                            monkeypatch):
    # Regression: diagnose applied the config alone, so 'auto' re-detected this machine and the model
    # trained under mixed_bfloat16 was diagnosed as float32 (and float16 on a GPU, with its loss scale).
    cfg = load_config(tiny_config_path, ["precision.policy=auto", "experiment=tiny_auto_diagnose",
                                         "train.epochs=1", f"train.runs_dir={tmp_path / 'runs'}"])
    from pipeline.train import train

    # A TPU: its flags decide mixed_bfloat16 (a CPU with avx512_bf16 would time float32 against it, either may win).
    monkeypatch.setattr(precision, "detect_hardware", lambda: precision.Hardware(tpu=True))
    assert train(cfg).policy.name == "mixed_bfloat16"
    assert json.loads((cfg.run_dir / METRICS_FILE).read_text())["policy"]["name"] == "mixed_bfloat16"
    keras.config.set_dtype_policy("float32")

    monkeypatch.setattr(precision, "detect_hardware", lambda: precision.Hardware(cpu_flags=frozenset({"avx2"})))
    diagnosis = diagnose(cfg, probe_batches=1)
    assert diagnosis.source.endswith("model.keras")
    assert diagnosis.policy == "mixed_bfloat16" and "under policy mixed_bfloat16" in diagnosis.text()
    assert {d.compute_dtype for d in diagnosis.layers if d.name.startswith("dense_")} == {"bfloat16"}
    assert all(g.loss_scale == 1.0 for g in diagnosis.gradients)  # bfloat16: no loss scaling
    # The bug's answer: the config alone, on this (pretend) machine, says float32.
    assert precision.apply_policy(cfg.precision).name == "float32"


def _gradients(layer, max_abs, loss_scale, scaled_zero=0.0, scaled_subnormal=0.0, scaled_overflow=0.0):
    return LayerGradients(layer, "float16", 1000, max_abs, loss_scale, 0.0, 0.5, 0.3,
                          scaled_overflow, scaled_subnormal, scaled_zero)


def test_advice_needs_evidence_subnormal_gradients_alone_are_no_finding():
    # Regression (issue #14 point 7): gradients below float16's normal range but not lost (3.6% flushed to zero,
    # under the 5% warning) put three layers "at risk" with initial_scale 16777216 next to "no findings".
    cfg = load_config(None, ["model.hidden_units=[8]"])
    policy = precision.apply_policy(cfg.precision)
    gradients = [_gradients("logits", 3.5e-4, 32768.0, scaled_zero=0.036, scaled_subnormal=0.088),
                 _gradients("dense_1", 1.6e-4, 32768.0, scaled_zero=0.003, scaled_subnormal=0.13)]
    assert gradient_findings(gradients, cfg, policy, trained_steps=460) == []
    assert rank_at_risk([], gradients, cfg, policy, trained_steps=460) == []


def test_underflow_fixes_fit_every_layer_and_after_a_dynamic_run_shorten_the_growth_interval():
    cfg = load_config(None, ["model.hidden_units=[8]"])
    dynamic = precision.apply_policy(cfg.precision)
    quiet = _gradients("quiet", 1e-6, 1024.0, scaled_zero=0.3)
    loud = _gradients("loud", 2.0, 1024.0)  # 2 x 8192 = 16384: the largest scale every layer leaves room for
    untrained = gradient_findings([quiet, loud], cfg, dynamic)
    assert [(f.layer, yaml.safe_load(f.fix)) for f in untrained] == [("quiet", {"precision": {"initial_scale": 8192}})]
    # A trained run's gradients are its last ones: a higher initial scale would be halved again by the early,
    # larger gradients; a shorter growth interval lets the scale double 3 times (1024 -> 8192) by mid-run.
    trained = gradient_findings([quiet, loud], cfg, dynamic, trained_steps=600)
    assert yaml.safe_load(trained[0].fix) == {"precision": {"dynamic_growth_steps": 100}}
    assert [r.fix for r in rank_at_risk([], [quiet, loud], cfg, dynamic, trained_steps=600)] == [trained[0].fix]
    # No higher scale fits the loud layer: keep the quiet one out of float16 instead.
    crowded = gradient_findings([quiet, _gradients("loud", 20.0, 1024.0)], cfg, dynamic)
    assert yaml.safe_load(crowded[0].fix) == {"precision": {"float32_layers": ["quiet"]}}


def test_underflowing_activations_are_a_finding_only_where_the_layer_diverges():
    cfg = load_config(None, ["model.hidden_units=[8]"])
    tiny = LayerRange("tiny", "float16", 100, 1e-3, 0.0, 0.4, 0.1)
    assert range_findings([tiny], cfg) == []
    diverging = [LayerDivergence("tiny", "float16", 0.2)]
    [finding] = range_findings([tiny], cfg, diverging)
    assert finding.severity == "warning" and "departs from float32 by 0.2" in finding.problem
    near = LayerRange("near", "float16", 100, 40000.0, 0.0, 0.0, 0.0)
    assert [f.severity for f in range_findings([near], cfg)] == ["warning"]


def test_errors_are_listed_before_warnings_in_the_text_and_the_json():
    """A user reads the worst first: the float16 normalization (a warning) comes before the float16 softmax
    (an error) in the model, after it in the diagnosis."""
    from pipeline.diagnose.findings import Diagnosis, Finding

    found = [Finding("warning", "bn", "normalization computed in float16", "fix a"),
             Finding("error", "attention", "softmax computed in float16", "fix b"),
             Finding("warning", "dense_1", "size not a multiple of 8", "fix c")]
    diagnosis = Diagnosis(source="model", policy="mixed_float16", layers=[], findings=found, ranges=[])
    assert [f.layer for f in diagnosis.findings] == ["attention", "bn", "dense_1"]
    text = diagnosis.text()
    assert text.index("ERROR  attention") < text.index("WARNING  bn") < text.index("WARNING  dense_1")
    assert [f["layer"] for f in diagnosis.to_dict()["findings"]] == ["attention", "bn", "dense_1"]


def test_diagnose_works_on_a_model_the_build_refuses(transactions, tmp_path, capsys):
    # Issue 23: diagnose exited with the build's own error line on exactly the models users bring to it.
    overrides = transactions.overrides(tmp_path, "build", "precision.float16_layers=[amount_scale]",
                                       "precision.float32_layers=[event_mlp]")
    assert cli.main(["diagnose", str(REPO_ROOT / "configs/default.yaml"), *(f"--set={o}" for o in overrides),
                     "--batches", "1", "--json"]) == 1
    diagnosis = json.loads(capsys.readouterr().out)
    error = next(f for f in diagnosis["findings"] if f["layer"] == "amount_scale")
    assert error["severity"] == "error" and error["problem"] == (
        "under policy mixed_float16, layer 'amount_scale' (Rescaling, computing in float16) is the first to produce "
        "inf (it reads values up to 1.15e+07, beyond float16's maximum 65504)")
    assert yaml.safe_load(error["fix"]) == {"precision": {"float16_layers": []}}
    # The input-limits probe keeps each column in its own range (ids among 0..49) and names the same cause.
    assert diagnosis["skipped"] == [] and diagnosis["edge"]["per_column"] and diagnosis["edge"]["nonfinite"] > 0
    edge = next(f for f in diagnosis["findings"] if "rows at the input limits" in f["problem"])
    assert yaml.safe_load(edge["fix"]) == {"precision": {"float16_layers": []}}
    assert yaml.safe_load(diagnosis["override"])["precision"]["float16_layers"] == []


def test_the_paste_this_override_keeps_the_users_float32_layers(transactions, tmp_path):
    # Amounts x10: the float16 Add reading them overflows; the user already keeps 'norm' in float32.
    cfg = transactions.config(tmp_path, "build", "model.params={scale: 10.0}", "precision.float32_layers=[norm]")
    diagnosis = diagnose(cfg, probe_batches=1)
    event = next(f for f in diagnosis.findings if f.layer == "event" and f.severity == "error")
    assert yaml.safe_load(event.fix) == {"precision": {"float32_layers": ["norm", "event"]}}
    layers_fixed = yaml.safe_load(diagnosis.override)["precision"]["float32_layers"]
    assert layers_fixed[0] == "norm" and "event" in layers_fixed  # added to, never replaced


def test_keep_user_layers_merges_and_takes_the_layer_out_of_float16_layers():
    from pipeline.config import PrecisionConfig
    from pipeline.diagnose.risks import keep_user_layers

    mine = PrecisionConfig(float32_layers=["amount_scale"], float16_layers=["amount_proj", "norm"])
    fix = keep_user_layers("# amount_proj reads 1 feature\nprecision:\n  float32_layers: [amount_proj]", mine)
    assert fix.splitlines()[0] == "# amount_proj reads 1 feature"
    assert yaml.safe_load(fix) == {"precision": {"float32_layers": ["amount_scale", "amount_proj"],
                                                 "float16_layers": ["norm"]}}
    assert keep_user_layers("train:\n  batch_size: 64", mine) == "train:\n  batch_size: 64"
