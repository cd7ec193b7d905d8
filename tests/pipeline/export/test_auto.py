"""export.serving_policy auto on a CPU with native bfloat16 and no accelerator: the float32 and bfloat16 serving
graphs are judged by the parity gate and timed at batch 1 and at the gate's largest batch, and the fastest that
passes is exported, with the rates in pipeline.json.

Which one is faster depends on the CPU running the tests, so these tests assert relations (the pick has the highest
geometric mean among those the gate passes, the reason names the rates), never a winner. The hardware is played by a
Hardware value with avx512_bf16, so the measuring path runs on any CPU."""

import math

import keras
import pytest

from pipeline import precision
from pipeline.config import load_config
from pipeline.export import auto, export
from serving.servable import saved_model
from serving.servable.runner import Runner

EPYC = precision.Hardware(cpu_flags=frozenset({"avx2", "avx512f", "avx512_bf16"}), cpu_model="AMD EPYC (played)")


def _export(tiny_config_path, base, *overrides):
    cfg = load_config(tiny_config_path, [f"export.base_path={base}", "export.serving_policy=auto", *overrides])
    version_dir = export(cfg)
    keras.config.set_dtype_policy("float32")
    return version_dir, saved_model.read_pipeline_json(version_dir)


def _geometric_mean(rates: dict[str, float]) -> float:
    return math.exp(sum(math.log(rate) for rate in rates.values()) / len(rates))


def test_the_exported_policy_is_the_fastest_candidate_by_the_recorded_rates(trained_run, tiny_config_path, tmp_path,
                                                                           monkeypatch):
    monkeypatch.setattr(precision, "detect_hardware", lambda: EPYC)
    version_dir, meta = _export(tiny_config_path, tmp_path)
    serving, measured = meta["serving_policy"], meta["serving_policy"]["measured"]
    rates = measured["rates"]
    assert set(rates) == set(precision.SERVING_CANDIDATES) and measured["unit"] == "rows/s"
    assert all(set(by_size) == {"1", "256"} for by_size in rates.values())  # batch 1 and export.parity_rows
    passed = [name for name in rates if name not in measured["refused"]]
    assert serving["name"] == max(passed, key=lambda name: _geometric_mean(rates[name]))
    assert (serving["requested"], serving["setting"]) == ("auto", "auto")
    ratios = {size: rates["bfloat16"][size] / rates["float32"][size] for size in ("1", "256")}
    assert serving["reason"].startswith(f"measured: bfloat16 {ratios['1']:.2f}x float32 at batch 1 (")
    assert f", {ratios['256']:.2f}x at batch 256 (" in serving["reason"]
    assert serving["reason"].endswith(f"; picked {serving['name']}")
    assert measured["machine"]["cpu"] == "AMD EPYC (played)" and measured["machine"]["flags"] == ["avx512f",
                                                                                                   "avx512_bf16"]
    assert meta["weights"]["dtype"] == serving["variable_dtype"]
    assert meta["policy"] == trained_run.policy.to_dict()  # what it trained under stays on record, as it was
    runner = Runner.load(version_dir)
    try:
        assert runner.policy == serving["name"]
        assert f"(export.serving_policy auto: {serving['reason']})" in runner.describe()  # the server's load line
    finally:
        runner.close()


def test_a_candidate_the_gate_refuses_is_never_exported_however_fast(trained_run, tiny_config_path, tmp_path,
                                                                     monkeypatch):
    monkeypatch.setattr(precision, "detect_hardware", lambda: EPYC)
    _, meta = _export(tiny_config_path, tmp_path, "export.tolerances.bfloat16.max_rel_diff=1e-9",
                      "export.parity_rows=64")
    serving, measured = meta["serving_policy"], meta["serving_policy"]["measured"]
    assert serving["name"] == "float32" and list(measured["refused"]) == ["bfloat16"]
    assert "export.tolerances.bfloat16.max_rel_diff" in measured["refused"]["bfloat16"]
    assert "bfloat16 refused by the parity gate: " in serving["reason"]
    assert all(set(by_size) == {"1", "64"} for by_size in measured["rates"].values())  # the gate's batch sets the size


def test_the_server_sizes_timed_are_batch_1_and_the_gates_largest_batch():
    assert auto.batch_sizes(256) == (1, 256) and auto.batch_sizes(1) == (1,)


@pytest.mark.parametrize("setting", ["bfloat16", "trained"])
def test_other_settings_measure_nothing(trained_run, tiny_config_path, tmp_path, monkeypatch, setting):
    monkeypatch.setattr(precision, "detect_hardware", lambda: EPYC)
    monkeypatch.setattr(auto, "measure", lambda *args: pytest.fail("only auto measures"))
    cfg = load_config(tiny_config_path, [f"export.base_path={tmp_path}", f"export.serving_policy={setting}"])
    meta = saved_model.read_pipeline_json(export(cfg))
    keras.config.set_dtype_policy("float32")
    assert "measured" not in meta["serving_policy"]
