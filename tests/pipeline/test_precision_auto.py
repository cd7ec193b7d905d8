"""precision.policy auto: the hardware picks the policy, and the run and its export say which and why."""

import json

import keras
import pytest

from pipeline import precision
from pipeline.config import ConfigError, load_config, validate_config
from pipeline.precision import Hardware, apply_policy, build_optimizer, choose_policy

V100 = ("Tesla V100-SXM2-16GB", (7, 0))
T4 = ("Tesla T4", (7, 5))
K80 = ("Tesla K80", (3, 7))


@pytest.mark.parametrize("hardware, policy, reason", [
    (Hardware(gpus=(V100,)), "mixed_float16", "compute capability 7.0"),
    (Hardware(gpus=(T4,), cpu_flags=frozenset({"avx512_bf16"})), "mixed_float16", "Tensor Cores"),  # GPU first
    (Hardware(gpus=(K80,)), "float32", "3.7 (< 7.0"),
    (Hardware(gpus=(("mystery", None),)), "float32", "unknown"),
    (Hardware(tpu=True), "mixed_bfloat16", "TPU"),
    (Hardware(cpu_flags=frozenset({"avx512f", "avx512_bf16"})), "mixed_bfloat16", "avx512_bf16"),
    (Hardware(cpu_flags=frozenset({"amx_bf16", "amx_tile"})), "mixed_bfloat16", "amx_bf16"),
    (Hardware(cpu_flags=frozenset({"avx2", "avx512f"})), "float32", "CPU without native bfloat16"),
    (Hardware(), "float32", "no GPU or TPU"),
])
def test_each_machine_gets_its_policy_and_a_reason(hardware, policy, reason):
    chosen, why = choose_policy(hardware)
    assert chosen == policy
    assert reason in why


def test_auto_applies_the_choice_and_records_it(monkeypatch, caplog):
    monkeypatch.setattr(precision, "detect_hardware", lambda: Hardware(gpus=(T4,)))
    cfg = load_config(None, ["precision.policy=auto"])
    with caplog.at_level("INFO", logger="pipeline.precision"):
        policy = apply_policy(cfg.precision)
    assert keras.config.dtype_policy().name == "mixed_float16"
    assert (policy.requested, policy.loss_scale) == ("auto", "dynamic")  # float16 chosen: dynamic scaling applies
    assert isinstance(build_optimizer(cfg.train, policy), keras.optimizers.LossScaleOptimizer)
    assert policy.to_dict()["reason"] == "NVIDIA GPU Tesla T4 with compute capability 7.5 (Tensor Cores)"
    assert "auto: NVIDIA GPU Tesla T4" in policy.describe()
    assert [r.getMessage() for r in caplog.records] == [
        "precision.policy auto: mixed_float16, because this machine has a NVIDIA GPU Tesla T4 with compute "
        "capability 7.5 (Tensor Cores)"]


def test_auto_on_a_bfloat16_cpu_needs_no_loss_scaling(monkeypatch):
    monkeypatch.setattr(precision, "detect_hardware", lambda: Hardware(cpu_flags=frozenset({"amx_bf16"})))
    policy = apply_policy(load_config(None, ["precision.policy=auto"]).precision)
    assert (policy.name, policy.compute_dtype, policy.loss_scale) == ("mixed_bfloat16", "bfloat16", "none")


def test_a_recorded_choice_wins_over_the_hardware(monkeypatch):
    monkeypatch.setattr(precision, "detect_hardware", lambda: pytest.fail("a recorded run must not re-detect"))
    recorded = {"name": "mixed_bfloat16", "reason": "CPU with native bfloat16 (avx512_bf16)"}
    policy = apply_policy(load_config(None, ["precision.policy=auto"]).precision, recorded=recorded)
    assert (policy.name, policy.requested, policy.reason) == ("mixed_bfloat16", "auto", recorded["reason"])


def test_explicit_policies_record_what_they_always_did():
    info = apply_policy(load_config(None).precision).to_dict()
    assert "requested" not in info and "reason" not in info


@pytest.mark.parametrize("loss_scale", ["none", 128])
def test_auto_allows_only_dynamic_loss_scaling(loss_scale):
    with pytest.raises(ConfigError, match=r"precision\.loss_scale: policy 'auto' needs 'dynamic'") as info:
        validate_config({"precision": {"policy": "auto", "loss_scale": loss_scale}})
    assert len(info.value.problems) == 1


def test_a_bad_policy_names_auto_too():
    with pytest.raises(ConfigError, match=r"precision\.policy: expected one of .* got 'fp16' \('auto' picks"):
        validate_config({"precision": {"policy": "fp16"}})


def test_this_machine_is_detected_from_cpuinfo():
    hardware = precision.detect_hardware()
    assert isinstance(hardware.cpu_flags, frozenset) and "fpu" in hardware.cpu_flags  # any x86 Linux CPU


def test_a_real_tiny_run_with_auto_records_the_choice(tiny_config_path, tmp_path):
    from pipeline.train import train

    hardware = precision.detect_hardware()
    expected, reason = choose_policy(hardware)
    cfg = load_config(tiny_config_path, ["precision.policy=auto", "experiment=tiny_auto", "train.epochs=1",
                                         f"train.runs_dir={tmp_path / 'runs'}"])
    run = train(cfg)
    assert (run.policy.name, run.policy.requested, run.policy.reason) == (expected, "auto", reason)
    if hardware.cpu_flags & {"avx512_bf16", "amx_bf16"} and not hardware.gpus:
        assert expected == "mixed_bfloat16"  # the CI CPU (AVX512_BF16): the fast policy there
    dense = [layer for layer in run.model.layers if isinstance(layer, keras.layers.Dense)]
    assert {layer.compute_dtype for layer in dense} == {keras.DTypePolicy(expected).compute_dtype}
    assert json.loads(json.dumps(run.policy.to_dict()))["requested"] == "auto"  # what export writes to pipeline.json


@pytest.mark.parametrize("hardware, policy, variables, reason", [
    (Hardware(gpus=(T4,), cpu_flags=frozenset({"amx_bf16"})), "float16", "float16", "Tensor Cores"),
    (Hardware(gpus=(K80,)), "float32", "float32", "< 7.0"),
    (Hardware(tpu=True), "bfloat16", "bfloat16", "TPU"),
    (Hardware(cpu_flags=frozenset({"amx_bf16", "avx512_fp16"})), "bfloat16", "bfloat16", "amx_bf16"),
    # This project's Xeon has avx512_fp16 too, yet float16 ran no faster than float32 there (docs/precision.md).
    (Hardware(cpu_flags=frozenset({"avx512f", "avx512_fp16"})), "float32", "float32", "avx512_fp16 does not make"),
    (Hardware(), "float32", "float32", "no GPU or TPU"),
])
def test_serving_policy_auto_picks_half_precision_weights_where_the_hardware_computes_them(hardware, policy, variables,
                                                                                            reason, monkeypatch):
    monkeypatch.setattr(precision, "detect_hardware", lambda: hardware)
    trained = apply_policy(load_config(None).precision)
    chosen = precision.resolve_serving_policy("auto", trained)
    assert (chosen.name, chosen.compute_dtype, chosen.variable_dtype) == (policy, policy, variables)
    assert chosen.requested == "auto" and reason in chosen.reason
    assert precision.resolve_serving_policy("trained", trained) is trained  # the default: what it trained under
