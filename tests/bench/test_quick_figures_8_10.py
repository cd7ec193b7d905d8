"""`python -m bench --quick --only serving_precision input_pipeline image_requests`: figures 8-10 at smoke sizes
write every row whole (test_bench.py checks the files and their smoke labels on figures 1-7)."""

from __future__ import annotations

import pytest

import quick_bench

FIGURES = quick_bench.GROUPS[1]
# The quick bench starts model servers, training and export processes; its fixture took ~2-3 min alone on a
# 2-vCPU Xeon, so beside the other test process it gets twice the default timeout.
pytestmark = [pytest.mark.subprocess, pytest.mark.timeout(600)]


@pytest.fixture(scope="module")
def quick_run(tmp_path_factory) -> quick_bench.QuickRun:
    return quick_bench.run(tmp_path_factory, FIGURES)


def test_quick_bench_writes_every_figure(quick_run):
    quick_bench.assert_every_figure_written(quick_run)


def test_serving_precision_rows_passed_their_gates_and_answer(quick_run):
    figures = quick_run.results["figures"]
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


def test_image_requests_sent_every_hostile_body_and_the_server_lived(quick_run):
    images = quick_run.results["figures"]["image_requests"]
    sizes = [r for r in images["rows"] if r["measure"].startswith("request bytes")]
    assert len(sizes) == 2 and all(0 < r["value"] < r["yardstick"] for r in sizes)
    assert images["throughput"]["images"]["qps"] > 0 and images["throughput"]["pixels"]["qps"] > 0
    assert images["attack"]["alive"] and images["attack"]["answers"]
    for kind, count in images["setup"]["hostile_bodies"].items():  # every hostile body was sent and answered
        assert images["attack"]["kinds"][kind]["sent"] == count * images["setup"]["attack_rounds"], kind
