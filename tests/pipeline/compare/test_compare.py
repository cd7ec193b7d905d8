"""compare: one real float32-vs-mixed_float16 comparison on digits (two child trainings), its report and plots;
how the policies are chosen, the verdict's wording, bad input and the atomic publish."""

import json
from pathlib import Path

import pytest

from pipeline import artifacts, cli, precision
from pipeline.compare.run import PolicyRun, choose_policies
from pipeline.config import load_config
from pipeline.compare.report import policy_rows, verdict

PNG = b"\x89PNG\r\n\x1a\n"


@pytest.fixture(scope="module")
def comparison(tiny_config_path, tmp_path_factory):
    """`python -m pipeline compare` on the tiny digits config, 2 epochs, in its own runs directory."""
    runs_dir = tmp_path_factory.mktemp("compare")
    overrides = ["--set", "train.epochs=2", "--set", f"train.runs_dir={runs_dir}"]
    code = cli.main(["compare", str(tiny_config_path), *overrides, "--batches", "1"])
    directory = runs_dir / "tiny_digits" / "compare"
    return code, directory, json.loads((directory / "report.json").read_text())


@pytest.mark.subprocess  # compare trains each policy in a child process
def test_compare_writes_the_report_files_with_sane_values(comparison):
    code, directory, report = comparison
    assert code == 0
    for name in ("report.md", "report.json"):
        assert (directory / name).stat().st_size > 0
    for name in ("curves.png", "loss_scale.png"):
        assert (directory / name).read_bytes()[:8] == PNG
    assert not list(directory.parent.glob(".tmp-*")), "no staging directory left behind"

    float32, mixed = report["policies"]
    assert (float32["policy"], mixed["policy"]) == ("float32", "mixed_float16") == (report["baseline"], report["mixed"])
    assert float32["status"] == mixed["status"] == "ok"
    assert float32["metric"] == "val_accuracy" and float32["delta"] == 0
    assert float32["value"] > 0.5 and mixed["value"] > 0.5  # 10 classes: chance is 0.1
    assert abs(mixed["delta"]) < 5  # same seed, data order and steps: a few points at most
    assert mixed["delta"] == pytest.approx((mixed["value"] - float32["value"]) * 100, abs=1e-3)
    for row in (float32, mixed):
        assert row["examples_per_second"] > 0 and not row["warmup_included"]
        assert row["peak_memory_kind"] == "RSS" and row["peak_memory_bytes"] > 100 * 2 ** 20  # TensorFlow alone
        assert row["skipped_steps"] >= 0
    assert mixed["throughput_ratio"] == pytest.approx(mixed["examples_per_second"] / float32["examples_per_second"],
                                                      rel=1e-2)
    assert float32["final_loss_scale"] is None and mixed["final_loss_scale"] >= 1  # dynamic loss scaling
    assert report["verdict"].startswith("mixed_float16 ")


@pytest.mark.subprocess  # compare trains each policy in a child process
def test_each_policy_ran_in_its_own_process_with_epoch_timings(comparison):
    _, directory, report = comparison
    for row in report["policies"]:
        run_dir = directory / row["run_dir"]
        metrics = json.loads((run_dir / "metrics.json").read_text())
        assert metrics["policy"]["name"] == row["policy"]
        assert metrics["val_accuracy"] == row["value"]
        history = json.loads((run_dir / "history.json").read_text())
        assert [h["epoch"] for h in history] == [1, 2]
        assert all(h["seconds"] > 0 and h["examples_per_second"] > 0 for h in history)
        assert metrics["steady_examples_per_second"] == history[1]["examples_per_second"]  # median of epoch 2 only
        assert not (run_dir / "checkpoints").exists(), "a finished run keeps model.keras, not its checkpoints"
    assert report["history"]["float32"] == json.loads(
        (directory / report["policies"][0]["run_dir"] / "history.json").read_text())


@pytest.mark.subprocess  # compare trains each policy in a child process
def test_the_report_shows_table_verdict_plots_and_the_diagnosis(comparison):
    _, directory, report = comparison
    text = (directory / "report.md").read_text()
    assert f"**Verdict:** {report['verdict']}" in text
    assert "| policy | val_accuracy | Δ vs float32 | val_loss |" in text
    assert "| float32 | " in text and "| mixed_float16 | " in text
    assert "![loss and metric per epoch](curves.png)" in text
    assert "## Numeric diagnosis of the mixed_float16 run" in text and "at risk in float16" in text
    assert report["diagnosis"]["policy"] == "mixed_float16"
    assert report["diagnosis"]["source"] == "compare/runs/mixed_float16/tiny_digits/model.keras"
    assert {g["layer"] for g in report["diagnosis"]["gradients"]} >= {"dense_1", "dense_2"}


def test_policies_follow_the_config_and_the_bfloat16_flag(monkeypatch):
    assert choose_policies(load_config(None), bfloat16=False) == (["float32", "mixed_float16"], "")
    assert choose_policies(load_config(None), bfloat16=True)[0] == ["float32", "mixed_float16", "mixed_bfloat16"]
    policies, note = choose_policies(load_config(None, ["precision.policy=float32"]), bfloat16=False)
    assert policies == ["float32", "mixed_float16"] and "compared with mixed_float16" in note
    bf16 = load_config(None, ["precision.policy=mixed_bfloat16"])
    assert choose_policies(bf16, bfloat16=True)[0] == ["float32", "mixed_bfloat16"]
    # auto: only the hardware query is replaced
    monkeypatch.setattr(precision, "detect_hardware", lambda: precision.Hardware(cpu_flags=frozenset({"avx512_bf16"})))
    policies, note = choose_policies(load_config(None, ["precision.policy=auto"]), bfloat16=False)
    assert policies == ["float32", "mixed_bfloat16"] and "auto times float32 against mixed_bfloat16" in note
    monkeypatch.setattr(precision, "detect_hardware", lambda: precision.Hardware(tpu=True))
    policies, note = choose_policies(load_config(None, ["precision.policy=auto"]), bfloat16=False)
    assert policies == ["float32", "mixed_bfloat16"] and "auto resolves to mixed_bfloat16" in note


def _run(policy: str, accuracy: float | None, speed: float = 1000.0, error: str | None = None) -> PolicyRun:
    metrics = None if accuracy is None else {"val_accuracy": accuracy, "val_loss": 0.5, "skipped_steps": 0,
                                             "steady_examples_per_second": speed, "peak_rss_bytes": 2 ** 30}
    return PolicyRun(policy, Path("/x/runs") / policy / "exp", 0 if metrics else 1, 10.0, error, metrics)


def test_the_verdict_names_a_drop_beyond_the_tolerance_and_a_failed_run():
    base, mixed = _run("float32", 0.950), _run("mixed_float16", 0.909, speed=2400.0)
    rows = policy_rows([base, mixed])
    assert rows[1]["delta"] == pytest.approx(-4.1) and rows[1]["throughput_ratio"] == 2.4
    assert verdict(mixed, base, rows, 1.0, "GPU") == (
        "mixed_float16: accuracy drops 4.1 pt (tolerance 1 pt): see numeric diagnosis")
    close = _run("mixed_float16", 0.947, speed=2400.0)
    assert verdict(close, base, policy_rows([base, close]), 1.0, "GPU") == (
        "mixed_float16 matches float32 within 1 pt (-0.30 pt) and is 2.40× as fast on this GPU")
    failed = _run("mixed_float16", None, error="error: training stopped at step 3 (exit 1)")
    assert verdict(failed, base, policy_rows([base, failed]), 1.0, "CPU").startswith(
        "mixed_float16 training failed (error: training stopped at step 3 (exit 1))")


def test_bad_input_is_exit_2_and_writes_nothing(tiny_config_path, tmp_path, capsys):
    with pytest.raises(SystemExit) as exit_info:
        cli.main(["compare", str(tiny_config_path), "--tolerance", "-1"])
    assert exit_info.value.code == 2 and "expected a number >= 0, got '-1'" in capsys.readouterr().err
    assert cli.main(["compare", str(tiny_config_path), "--set", f"train.runs_dir={tmp_path}",
                     "--set", "train.epochs=0"]) == 2
    assert "train.epochs" in capsys.readouterr().err
    assert not list(tmp_path.iterdir())


def test_publish_replaces_an_earlier_comparison_only_when_the_new_one_is_complete(tmp_path):
    final = tmp_path / "compare"
    final.mkdir()
    (final / "report.md").write_text("old")
    with pytest.raises(RuntimeError), artifacts.atomic_dir(final, replace=True) as staging:
        (staging / "report.md").write_text("half")
        raise RuntimeError("killed midway")
    assert (final / "report.md").read_text() == "old" and sorted(p.name for p in tmp_path.iterdir()) == ["compare"]
    with artifacts.atomic_dir(final, replace=True) as staging:
        (staging / "report.md").write_text("new")
        assert (final / "report.md").read_text() == "old"
    assert (final / "report.md").read_text() == "new" and sorted(p.name for p in tmp_path.iterdir()) == ["compare"]
