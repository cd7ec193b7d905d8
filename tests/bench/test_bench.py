"""`python -m bench --quick`: the bench code runs end to end and writes its JSON, Markdown and PNG.

Asserts the shape and sanity of what is written (every figure, every column, finite numbers),
never a speed: the quick sizes are smoke sizes on a shared machine. And that a smoke run reads as
one: it writes to an ignored directory, never bench/results/ or bench/README.md, labels every
table and plot "smoke run" and judges no target. Figures 1-7 run here, 8-10 and 11-13 in
test_quick_figures_8_10.py and test_quick_figures_11_13.py (tests/helpers/quick_bench.py).
"""

from __future__ import annotations

import shutil
import subprocess

import pytest

import quick_bench
from bench import __main__ as bench_main
from bench import result_files

FIGURES = bench_main.FIGURES
ROOT = bench_main.DEFAULT_OUTPUT.parent.parent


# Figures 1-7 here; 8-10 and 11-13 in their own modules, so the two test processes share the quick bench.
FIRST_FIGURES = quick_bench.GROUPS[0]
# The quick run's fixture took ~2 min alone on a 2-vCPU Xeon: beside the other test process, twice the default.
pytestmark = pytest.mark.timeout(600)


@pytest.fixture(scope="module")
def quick_run(tmp_path_factory) -> quick_bench.QuickRun:
    return quick_bench.run(tmp_path_factory, FIRST_FIGURES)


def test_the_test_modules_quick_groups_run_every_figure_once_in_order():
    assert sum(quick_bench.GROUPS, ()) == FIGURES


@pytest.mark.subprocess  # the quick bench starts model servers and training workers
def test_quick_bench_writes_every_figure(quick_run):
    quick_bench.assert_every_figure_written(quick_run)


@pytest.mark.subprocess  # the quick bench starts model servers and training workers
def test_quick_bench_values_are_sane(quick_run):
    figures = quick_run.results["figures"]
    training = {row["side"]: row for row in figures["training"]["rows"]}
    assert training["bare keras fit"]["examples_per_second"] > 0
    assert training["pipeline train"]["examples_per_second"] > 0
    precision = figures["precision"]["rows"]
    assert {(r["model"], r["policy"]) for r in precision} == {(m, p) for m in ("mlp", "cnn", "transformer")
                                                            for p in ("float32", "mixed_float16", "mixed_bfloat16")}
    for model in ("mlp", "cnn", "transformer"):  # exactly one policy per model is the one `auto` picks
        assert sum(r["auto"] for r in precision if r["model"] == model) == 1
    assert all(r["train_speedup"] > 0 and r["infer_speedup"] > 0 for r in precision)
    assert [r["batch"] for r in figures["inference"]["rows"]] == [1, 8, 64, 512]
    serving = figures["serving"]["rows"]
    assert {r["batching"] for r in serving} == {"off", "on"}
    assert {r["protocol"] for r in serving} == {"grpc", "rest", "grpc no-op server (threads)", "grpc no-op server (aio)"}
    for row in serving:
        assert row["qps"] > 0 and row["errors"] == 0
        assert 0 < row["p50_ms"] <= row["p90_ms"] <= row["p99_ms"]
    scaling = figures["scaling"]["rows"]
    assert [r["processes"] for r in scaling] == [1, 2]
    assert all(r["qps"] > 0 and r["errors"] == 0 for r in scaling)
    assert scaling[1]["scaling"] == pytest.approx(scaling[1]["qps"] / scaling[0]["qps"])
    memory = {r["versions"]: r for r in figures["memory"]["rows"] if r["versions"] is not None}
    assert memory[3]["peak_rss_mib"] >= memory[1]["peak_rss_mib"] > 0


@pytest.mark.subprocess  # the quick bench starts model servers and training workers
def test_quick_bench_writes_markdown_and_png(quick_run):
    results = quick_run.results
    text = next(quick_run.output.glob("*.md")).read_text()
    assert results["machine"]["hostname"] in text
    for figure in results["figures"].values():
        assert figure["title"] in text
    png = next(quick_run.output.glob("*.png")).read_bytes()
    assert png.startswith(b"\x89PNG\r\n\x1a\n") and len(png) > 10_000
    assert result_files.SMOKE_NOTE.encode() in png  # the PNG's Title metadata


@pytest.mark.subprocess  # the quick bench starts model servers and training workers
def test_quick_bench_markdown_is_labelled_smoke_and_judges_nothing(quick_run):
    results = quick_run.results
    text = next(quick_run.output.glob("*.md")).read_text()
    assert text.startswith("# Smoke run ") and result_files.SMOKE_NOTE in text.lower()
    for figure in results["figures"].values():
        assert f"## {figure['number']}. {figure['title']} (smoke run)" in text
        if figure["target"]:
            assert f"Target: {figure['target']}. **Not judged**: smoke run" in text
            assert f"| {figure['target']} | {result_files.NOT_JUDGED} |" in text  # the summary table
    assert "**no**" not in text  # a missed target's mark; the JSON test checks every target_met is null
    results["quick"] = False  # the same numbers as a full run would be written: no smoke label
    assert "smoke" not in result_files.markdown(results).lower()


@pytest.mark.subprocess  # the quick bench starts model servers and training workers
def test_quick_bench_plot_is_labelled_smoke_and_judges_nothing(quick_run):
    import matplotlib.pyplot as plt

    results = quick_run.results
    fig = result_files.draw_plot(results, bench_main.figure_modules())
    try:
        assert fig.get_suptitle().startswith(result_files.SMOKE_NOTE)
        panels = [ax for ax in fig.axes if ax.get_visible()]
        assert len(panels) == len(FIRST_FIGURES)
        for ax in panels:
            assert "SMOKE RUN" in [text.get_text() for text in ax.texts], ax.get_title()
        training, overhead = panels[0].get_title(), results["figures"]["training"]["rows"][1]["overhead_pct"]
        assert training == "1. training overhead: target <= 3% not judged", training  # no smoke-sized verdict
        assert f"{overhead:+.1f}%" not in training
    finally:
        plt.close(fig)


def test_quick_output_defaults_to_an_ignored_directory_outside_bench_results():
    quick, full = bench_main.output_dir(True, None), bench_main.output_dir(False, None)
    assert full == bench_main.DEFAULT_OUTPUT == ROOT / "bench" / "results"
    assert quick == ROOT / "build" / "bench-quick" and not quick.is_relative_to(full)


@pytest.mark.subprocess  # runs git
@pytest.mark.skipif(not shutil.which("git") or not (ROOT / ".git").exists(), reason="not a git checkout")
def test_git_ignores_the_quick_output():
    checked = subprocess.run(["git", "check-ignore", "-q", str(bench_main.QUICK_OUTPUT / "x.json")], cwd=ROOT)
    assert checked.returncode == 0, "build/bench-quick/ must be git-ignored"


@pytest.mark.parametrize("output", ["bench/results", "bench/results/sub"])
def test_quick_run_into_bench_results_is_refused_in_one_line(output, capsys):
    with pytest.raises(SystemExit) as exit_info:
        bench_main.main(["--quick", "--output", str(ROOT / output)])
    assert exit_info.value.code == 2
    assert "bench/results/ holds measurements" in capsys.readouterr().err


def test_judge_records_verdicts_only_for_a_full_run():
    def figure():
        return {"rows": [{"target_met": True}, {"target_met": False}, {"target_met": None}]}

    full, smoke = figure(), figure()
    result_files.judge(full, quick=False)
    result_files.judge(smoke, quick=True)
    assert full["target_met"] is False and [r["target_met"] for r in full["rows"]] == [True, False, None]
    assert smoke["target_met"] is None and all(r["target_met"] is None for r in smoke["rows"])


@pytest.mark.subprocess  # the quick bench starts model servers and training workers
def test_update_readme_rewrites_only_between_the_markers(quick_run, tmp_path):
    results = quick_run.results
    readme = tmp_path / "README.md"
    readme.write_text(f"# Bench\nintro\n{result_files.BEGIN}\nold table\n{result_files.END}\ntail\n")
    paths = {kind: tmp_path / "results" / f"x.{kind}" for kind in ("json", "md", "png")}
    assert result_files.update_readme(results, paths, readme)
    text = readme.read_text()
    assert text.startswith("# Bench\nintro\n") and text.endswith(f"{result_files.END}\ntail\n")
    assert "old table" not in text and "results/x.md" in text and results["figures"]["serving"]["title"] in text
    readme.write_text("no markers\n")
    assert not result_files.update_readme(results, paths, readme)


def test_unknown_figure_is_refused_in_one_line(capsys):
    with pytest.raises(SystemExit) as exit_info:
        bench_main.main(["--only", "trainig"])
    assert exit_info.value.code == 2
    assert "invalid choice: 'trainig'" in capsys.readouterr().err


def test_hostile_images_declare_what_the_figure_says():
    """Figure 10's hostile bodies (no server): the bombs declare >= 1 Gpixel in < 2 KB, read from their headers by
    the export's own check; each kind is there; the JPEG request is >= 10x smaller than its float32 pixels."""
    import numpy as np
    import tensorflow as tf

    from bench import image_requests
    from pipeline.data import encoded_images

    jpeg = image_requests.request_jpeg("china.jpg")
    bodies = image_requests.hostile_bodies(jpeg, random_bodies=9)
    assert {kind for kind, _ in bodies} == set(image_requests.HOSTILE_KINDS)
    bombs = [body for kind, body in bodies if kind == "decompression bomb"]
    _, height, width = encoded_images.image_headers(tf.constant(bombs))
    assert all(len(bomb) < 2048 for bomb in bombs) and np.all(height.numpy() * width.numpy() >= 10 ** 9)
    truncated = [body for kind, body in bodies if kind == "truncated JPEG"]
    assert all(jpeg.startswith(body) and len(body) < len(jpeg) for body in truncated)
    images, floats = image_requests.request_sizes("m", "features", jpeg, image_requests.decode_pixels(jpeg))
    assert floats == image_requests.request_sizes("m", "features", b"", np.zeros((1, 224, 224, 3), np.float32))[1]
    assert 10 * images <= floats


def test_image_load_windows_hold_several_batches_on_a_slow_cpu():
    """Figure 10's window grows with the measured batch time, so a slow CPU still counts whole batches in it (CI
    once measured 0 images/s: the quick 0.25 s window was shorter than one batch of 32 on a 2-core AMD VM)."""
    from bench import image_requests

    slow = {"batch": 32, "images": 100.0, "pixels": 40.0}  # the slower signature sets the window
    assert image_requests.window_seconds(0.25, slow) == pytest.approx(image_requests.WINDOW_BATCHES * 32 / 40.0)
    assert image_requests.window_seconds(4.0, {"batch": 32, "images": 1e4, "pixels": 1e4}) == 4.0
