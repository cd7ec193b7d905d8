"""`python -m bench --quick`: the bench code runs end to end and writes its JSON, Markdown and PNG.

Asserts the shape and sanity of what is written (every figure, every column, finite numbers),
never a speed: the quick sizes are smoke sizes on a shared machine. And that a smoke run reads as
one: it writes to an ignored directory, never bench/results/ or bench/README.md, labels every
table and plot "smoke run" and judges no target.
"""

from __future__ import annotations

import json
import math
import shutil
import subprocess

import pytest

from bench import __main__ as bench_main
from bench import result_files

FIGURES = bench_main.FIGURES
ROOT = bench_main.DEFAULT_OUTPUT.parent.parent


def _tracked_bench_outputs() -> dict:
    """What a full run writes into the checkout: bench/results/'s files and bench/README.md, by content."""
    files = [result_files.README, *sorted(bench_main.DEFAULT_OUTPUT.iterdir())]
    return {path.name: path.read_bytes() for path in files if path.is_file()}


@pytest.fixture(scope="module")
def quick_run(tmp_path_factory):
    output = tmp_path_factory.mktemp("bench-results")
    before = _tracked_bench_outputs()
    code = bench_main.main(["--quick", "--output", str(output)])
    assert _tracked_bench_outputs() == before, "a smoke run must not touch bench/results/ or bench/README.md"
    return code, output


def _numbers(value):
    if isinstance(value, bool) or value is None or isinstance(value, str):
        return
    if isinstance(value, (int, float)):
        yield value
    elif isinstance(value, dict):
        for item in value.values():
            yield from _numbers(item)
    elif isinstance(value, list):
        for item in value:
            yield from _numbers(item)


@pytest.mark.subprocess  # the quick bench starts model servers and training workers
def test_quick_bench_writes_every_figure(quick_run):
    code, output = quick_run
    assert code == 0
    (json_path,) = output.glob("*.json")
    results = json.loads(json_path.read_text())
    assert results["schema_version"] == result_files.SCHEMA_VERSION and results["quick"] is True
    assert {"hostname", "cpu_model", "cpu_cores", "cpu_flags", "tensorflow", "auto_policy"} <= set(results["machine"])
    assert list(results["figures"]) == list(FIGURES)
    for name, figure in results["figures"].items():
        assert "error" not in figure, f"{name}: {figure.get('error')}"
        assert figure["rows"], name
        assert figure["seconds"] > 0
        assert figure["target_met"] is None, f"{name}: a smoke run judges no target"
        assert all(row.get("target_met") is None for row in figure["rows"]), name
        for row in figure["rows"]:
            assert set(figure["columns"]) <= set(row), f"{name}: {row}"
        assert all(math.isfinite(x) for x in _numbers(figure["rows"])), name


@pytest.mark.subprocess  # the quick bench starts model servers and training workers
def test_quick_bench_values_are_sane(quick_run):
    _, output = quick_run
    figures = json.loads(next(output.glob("*.json")).read_text())["figures"]
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
    precisions = {r["serving_policy"]: r for r in figures["serving_precision"]["rows"]}
    assert list(precisions) == ["float32", "mixed_float16 (trained)", "float16", "bfloat16"]
    assert [r["weights"] for r in precisions.values()] == ["float32", "float32", "float16", "bfloat16"]
    for row in precisions.values():  # every export passed its gate and answers finite probabilities
        assert row["nonfinite_at_limits"] == 0 and 0 < row["val_accuracy"] <= 1 and row["grpc_qps_32"] > 0
        assert row["rows_s_batch64"] > 0 and row["rows_s_batch1"] > 0 and row["server_rss_mib"] > 0
        assert row["server_cpu_ms_per_query"] > 0
    assert precisions["float32"]["variables_ratio"] == 1 and precisions["float32"]["max_abs_diff"] == 0
    assert precisions["bfloat16"]["variables_ratio"] < 0.6 and precisions["float16"]["variables_ratio"] < 0.6
    assert "no GPU was available" in figures["serving_precision"]["notes"][0] or "on the GPU" in \
        figures["serving_precision"]["notes"][0]
    images = figures["image_requests"]
    sizes = [r for r in images["rows"] if r["measure"].startswith("request bytes")]
    assert len(sizes) == 2 and all(0 < r["value"] < r["yardstick"] for r in sizes)
    assert images["throughput"]["images"]["qps"] > 0 and images["throughput"]["pixels"]["qps"] > 0
    assert images["attack"]["alive"] and images["attack"]["answers"]
    for kind, count in images["setup"]["hostile_bodies"].items():  # every hostile body was sent and answered
        assert images["attack"]["kinds"][kind]["sent"] == count * images["setup"]["attack_rounds"], kind
    generation = {row["policy"]: row for row in figures["generation"]["rows"]}
    assert list(generation) == ["float32", "mixed_bfloat16"]
    assert all(row["cached_tokens_per_second"] > 0 and row["recompute_tokens_per_second"] > 0 for row in generation.values())
    assert generation["mixed_bfloat16"]["cache_mib"] == generation["float32"]["cache_mib"] / 2  # bfloat16: half the bytes
    large = {row["policy"]: row for row in figures["large_model"]["rows"]}
    assert [(row["policy"], row["serving"]) for row in large.values()] == [("float32", "float32"),
                                                                          ("mixed_bfloat16", "bfloat16")]
    for row in large.values():  # trained, exported, served and streamed: every measure came back
        assert row["train_steps_per_second"] > 0 and row["export_seconds"] > 0 and row["first_token_ms"] > 0
        assert row["decode_tokens_per_second_b1"] > 0 and row["decode_tokens_per_second_b8"] > 0
        assert 0 < row["roofline_share_b1"] and row["estimated_peak_mib"] > 0
        assert row["train_peak_rss_mib"] > 0 and row["export_peak_rss_mib"] > 0 and row["server_rss_mib"] > 0
    assert 0.45 < large["mixed_bfloat16"]["variables_mib"] / large["float32"]["variables_mib"] < 0.55
    assert figures["large_model"]["bandwidth_gb_s"] > 0
    streaming = {row["policy"]: row for row in figures["streaming"]["rows"]}
    assert list(streaming) == ["float32", "mixed_bfloat16"]
    for row in streaming.values():  # served over SSE: every measure came back
        assert row["ttft_ms"] > 0 and row["stream_tokens_per_second"] > 0 and row["concurrent_seconds"] > 0


@pytest.mark.subprocess  # the quick bench starts model servers and training workers
def test_quick_bench_writes_markdown_and_png(quick_run):
    _, output = quick_run
    results = json.loads(next(output.glob("*.json")).read_text())
    text = next(output.glob("*.md")).read_text()
    assert results["machine"]["hostname"] in text
    for figure in results["figures"].values():
        assert figure["title"] in text
    png = next(output.glob("*.png")).read_bytes()
    assert png.startswith(b"\x89PNG\r\n\x1a\n") and len(png) > 10_000
    assert result_files.SMOKE_NOTE.encode() in png  # the PNG's Title metadata


@pytest.mark.subprocess  # the quick bench starts model servers and training workers
def test_quick_bench_markdown_is_labelled_smoke_and_judges_nothing(quick_run):
    _, output = quick_run
    results = json.loads(next(output.glob("*.json")).read_text())
    text = next(output.glob("*.md")).read_text()
    assert text.startswith("# Smoke run ") and result_files.SMOKE_NOTE in text.lower()
    for number, figure in enumerate(results["figures"].values(), start=1):
        assert f"## {number}. {figure['title']} (smoke run)" in text
        if figure["target"]:
            assert f"Target: {figure['target']}. **Not judged**: smoke run" in text
            assert f"| {figure['target']} | {result_files.NOT_JUDGED} |" in text  # the summary table
    assert "**no**" not in text  # a missed target's mark; the JSON test checks every target_met is null
    results["quick"] = False  # the same numbers as a full run would be written: no smoke label
    assert "smoke" not in result_files.markdown(results).lower()


@pytest.mark.subprocess  # the quick bench starts model servers and training workers
def test_quick_bench_plot_is_labelled_smoke_and_judges_nothing(quick_run):
    import matplotlib.pyplot as plt

    _, output = quick_run
    results = json.loads(next(output.glob("*.json")).read_text())
    fig = result_files.draw_plot(results, bench_main.figure_modules())
    try:
        assert fig.get_suptitle().startswith(result_files.SMOKE_NOTE)
        panels = [ax for ax in fig.axes if ax.get_visible()]
        assert len(panels) == len(FIGURES)
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
    _, output = quick_run
    results = json.loads(next(output.glob("*.json")).read_text())
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
