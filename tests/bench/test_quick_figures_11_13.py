"""`python -m bench --quick --only generation streaming large_model`: figures 11-13 at smoke sizes
write every row whole (test_bench.py checks the files and their smoke labels on figures 1-7)."""

from __future__ import annotations

import pytest

import quick_bench

FIGURES = quick_bench.GROUPS[2]
# The quick bench starts model servers, training and export processes; its fixture took ~2-3 min alone on a
# 2-vCPU Xeon, so beside the other test process it gets twice the default timeout.
pytestmark = [pytest.mark.subprocess, pytest.mark.timeout(600)]


@pytest.fixture(scope="module")
def quick_run(tmp_path_factory) -> quick_bench.QuickRun:
    return quick_bench.run(tmp_path_factory, FIGURES)


def test_quick_bench_writes_every_figure(quick_run):
    quick_bench.assert_every_figure_written(quick_run)


def test_generation_measures_both_policies_with_half_the_cache_in_bfloat16(quick_run):
    figures = quick_run.results["figures"]
    generation = {row["policy"]: row for row in figures["generation"]["rows"]}
    assert list(generation) == ["float32", "mixed_bfloat16"]
    assert all(row["cached_tokens_per_second"] > 0 and row["recompute_tokens_per_second"] > 0 for row in generation.values())
    assert generation["mixed_bfloat16"]["cache_mib"] == generation["float32"]["cache_mib"] / 2  # bfloat16: half the bytes


def test_streaming_measures_every_policy(quick_run):
    figures = quick_run.results["figures"]
    streaming = {row["policy"]: row for row in figures["streaming"]["rows"]}
    assert list(streaming) == ["float32", "mixed_bfloat16"]
    for row in streaming.values():  # served over SSE: every measure came back
        assert row["ttft_ms"] > 0 and row["stream_tokens_per_second"] > 0 and row["concurrent_seconds"] > 0


def test_large_model_trained_exported_served_and_streamed_per_policy(quick_run):
    figures = quick_run.results["figures"]
    large = {row["policy"]: row for row in figures["large_model"]["rows"]}
    assert [(row["policy"], row["serving"]) for row in large.values()] == [("float32", "float32"),
                                                                          ("mixed_bfloat16", "bfloat16")]
    for row in large.values():  # trained, exported, served and streamed: every measure came back
        assert row["train_steps_per_second"] > 0 and row["export_seconds"] > 0 and row["first_token_ms"] > 0
        assert row["decode_tokens_per_second_b1"] > 0 and row["decode_tokens_per_second_b8"] > 0
        assert 0 < row["roofline_share_b1"] and row["estimated_peak_mib"] > 0
        assert row["train_peak_rss_mib"] > 0 and row["export_peak_rss_mib"] > 0 and row["server_rss_mib"] > 0
        # the second server, under TF_ONEDNN_ASSUME_FROZEN_WEIGHTS=1, streamed too
        assert row["frozen_tokens_per_second_b1"] > 0 and row["frozen_tokens_per_second_b8"] > 0
        assert row["frozen_server_rss_mib"] > 0
    assert 0.45 < large["mixed_bfloat16"]["variables_mib"] / large["float32"]["variables_mib"] < 0.55
    assert figures["large_model"]["bandwidth_gb_s"] > 0
