"""precision.policy auto: the hardware picks the policy, and the run and its export say which and why."""

import json
import time

import keras
import pytest

from pipeline import precision
from serving.cpu_info import cpu_info
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
    cfg = load_config(tiny_config_path, ["precision.policy=auto", "experiment=tiny_auto", "train.epochs=1",
                                         f"train.runs_dir={tmp_path / 'runs'}"])
    run = train(cfg)
    if precision.measurement_decides(hardware):  # the CI CPUs (AVX512_BF16): timed, so the faster one, either
        rates = {name: by_size[str(cfg.train.batch_size)] for name, by_size in run.policy.measured["rates"].items()}
        expected = max(rates, key=rates.get)
        assert run.policy.reason.startswith("measured: ") and run.policy.reason.endswith(f"picked {expected}")
    else:
        expected, reason = choose_policy(hardware)
        assert run.policy.reason == reason and run.policy.measured is None
    assert (run.policy.name, run.policy.requested) == (expected, "auto")
    dense = [layer for layer in run.model.layers if isinstance(layer, keras.layers.Dense)]
    assert {layer.compute_dtype for layer in dense} == {keras.DTypePolicy(expected).compute_dtype}
    assert json.loads(json.dumps(run.policy.to_dict()))["requested"] == "auto"  # what export writes to pipeline.json


@pytest.mark.parametrize("hardware, measured", [
    (Hardware(cpu_flags=frozenset({"avx512f", "avx512_bf16"})), True),  # the AMD EPYC: bfloat16 pays or not by shape
    (Hardware(cpu_flags=frozenset({"amx_bf16", "avx512_fp16"})), True),
    (Hardware(gpus=(T4,), cpu_flags=frozenset({"avx512_bf16"})), False),  # Tensor Cores decide
    (Hardware(tpu=True, cpu_flags=frozenset({"amx_bf16"})), False),
    (Hardware(cpu_flags=frozenset({"avx2", "avx512_fp16"})), False),  # no native bfloat16: float32
    (Hardware(), False),
])
def test_only_a_cpu_with_native_bfloat16_and_no_accelerator_is_measured(hardware, measured):
    assert precision.measurement_decides(hardware) is measured


def _measured(rates, refused=None, unit="rows/s"):
    return precision.Measured(unit, rates, "timed in a test", gated=refused is not None, refused=refused or {})


def test_a_measurement_picks_the_best_geometric_mean_and_its_reason_names_every_rate():
    # bfloat16 wins at batch 256 but loses more at batch 1: each size's ratio counts alike (0.5 x 1.5 < 1).
    found = _measured({"float32": {1: 2000.0, 256: 40000.0}, "bfloat16": {1: 1000.0, 256: 60000.0}}, refused={})
    name, reason = precision.pick_measured(found)
    assert name == "float32" and found.score("float32") > found.score("bfloat16")
    assert reason == ("measured: bfloat16 0.50x float32 at batch 1 (1,000 vs 2,000 rows/s), 1.50x at batch 256 "
                      "(60,000 vs 40,000 rows/s), geometric mean 0.87x; picked float32")


def test_a_candidate_the_gate_refuses_is_not_picked_however_fast():
    found = _measured({"float32": {1: 10.0}, "bfloat16": {1: 99.0}}, refused={"bfloat16": "max rel diff 0.2 > 0.15"})
    name, reason = precision.pick_measured(found)
    assert name == "float32" and "bfloat16 refused by the parity gate: max rel diff 0.2 > 0.15" in reason
    everyone = _measured({"float32": {1: 10.0}, "bfloat16": {1: 99.0}}, refused={"float32": "x", "bfloat16": "y"})
    assert precision.pick_measured(everyone)[0] == "bfloat16"  # then the gate itself fails the export, as always
    assert "no candidate passes the parity gate" in precision.pick_measured(everyone)[1]
    tie = _measured({"float32": {1: 5.0}, "mixed_bfloat16": {1: 5.0}}, unit="steps/s")
    assert precision.pick_measured(tie)[0] == "float32" and tie.rule() == "the highest rate; float32 on a tie"


def test_auto_measures_where_the_flags_do_not_decide_and_records_what_it_measured(monkeypatch):
    epyc = Hardware(cpu_flags=frozenset({"avx512f", "avx512_bf16", "avx2"}), cpu_model="AMD EPYC 9R14")
    monkeypatch.setattr(precision, "detect_hardware", lambda: epyc)
    asked = []

    def measure(candidates):
        asked.append(candidates)
        return _measured({"float32": {64: 120.0}, "mixed_bfloat16": {64: 150.0}}, unit="steps/s")

    policy = apply_policy(load_config(None, ["precision.policy=auto"]).precision, measure=measure)
    assert asked == [precision.TRAIN_CANDIDATES]
    assert (policy.name, keras.config.dtype_policy().name, policy.loss_scale) == ("mixed_bfloat16",) * 2 + ("none",)
    assert policy.reason == ("measured: mixed_bfloat16 1.25x float32 at batch 64 (150 vs 120 steps/s); "
                             "picked mixed_bfloat16")
    recorded = json.loads(json.dumps(policy.to_dict()))
    assert recorded["measured"]["rates"] == {"float32": {"64": 120.0}, "mixed_bfloat16": {"64": 150.0}}
    assert recorded["measured"]["machine"]["cpu"] == "AMD EPYC 9R14"
    assert recorded["measured"]["machine"]["flags"] == ["avx512f", "avx512_bf16"]  # the ones speed depends on
    # Export and verify restore it from the record: nothing is measured again, the record travels on.
    monkeypatch.setattr(precision, "detect_hardware", lambda: pytest.fail("a recorded run must not re-detect"))
    restored = apply_policy(load_config(None, ["precision.policy=auto"]).precision, recorded=recorded,
                            measure=lambda candidates: pytest.fail("a recorded run must not re-measure"))
    assert restored.to_dict() == recorded


def test_where_the_flags_decide_nothing_is_measured(monkeypatch):
    monkeypatch.setattr(precision, "detect_hardware", lambda: Hardware(gpus=(T4,), cpu_flags=frozenset({"amx_bf16"})))

    def fail(candidates):
        pytest.fail("flags that decide must not be second-guessed")

    policy = apply_policy(load_config(None, ["precision.policy=auto"]).precision, measure=fail)
    assert policy.name == "mixed_float16" and "measured" not in policy.to_dict()
    assert precision.resolve_serving_policy("auto", policy, measure=fail).name == "float16"


def test_the_cpu_model_and_flags_are_read_from_cpuinfo(tmp_path):
    cpuinfo = tmp_path / "cpuinfo"
    cpuinfo.write_text("processor\t: 0\nmodel name\t: AMD EPYC 9R14\nflags\t\t: fpu avx512_bf16\n\n"
                       "processor\t: 1\nmodel name\t: AMD EPYC 9R14\nflags\t\t: fpu avx512_bf16\n")
    assert cpu_info(cpuinfo) == ("AMD EPYC 9R14", frozenset({"fpu", "avx512_bf16"}))
    assert cpu_info(tmp_path / "missing") == ("", frozenset())


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


# precision.median_seconds: warm-up calls untimed, candidates interleaved round by round, the budget bounds
# slow calls.

def test_warmup_is_untimed_and_every_candidate_runs_once_per_round():
    order = []

    def call(name, seconds):
        def run():
            order.append(name)
            time.sleep(seconds)
        return run

    first = {"slow": True}

    def warming():  # slow only on its first call, which the warm-up takes
        order.append("warming")
        time.sleep(0.2 if first.pop("slow", False) else 0.001)

    seconds = precision.median_seconds({"quick": call("quick", 0.001), "warming": warming}, warmup=1, min_rounds=5,
                                   max_rounds=5, budget_s=10)
    assert order == ["quick", "warming"] + ["quick", "warming"] * 5
    assert seconds["warming"] < 0.1 and set(seconds) == {"quick", "warming"}


def test_the_budget_stops_slow_calls_after_the_minimum_rounds_and_quick_ones_at_the_maximum():
    slow, quick = [], []
    seconds = precision.median_seconds({"slow": lambda: (slow.append(1), time.sleep(0.05))}, warmup=0, min_rounds=3,
                                   max_rounds=100, budget_s=0.01)
    assert len(slow) == 3 and seconds["slow"] >= 0.05
    precision.median_seconds({"quick": lambda: quick.append(1)}, warmup=0, min_rounds=3, max_rounds=20, budget_s=10)
    assert len(quick) == 20
