"""`python -m bench --quick --only pretrained`: figure 14 at smoke sizes (a 2-block GPT-2 of width 32): the import's
parity with the committed GPT2LMHeadModel logits holds at this size too, the tokenizer and the fine-tuning rows are
written whole."""

from __future__ import annotations

import pytest

import quick_bench

FIGURES = quick_bench.GROUPS[3]
pytestmark = [pytest.mark.subprocess, pytest.mark.timeout(600)]


@pytest.fixture(scope="module")
def quick_run(tmp_path_factory) -> quick_bench.QuickRun:
    return quick_bench.run(tmp_path_factory, FIGURES)


def test_quick_bench_writes_the_figure(quick_run):
    quick_bench.assert_every_figure_written(quick_run)


def test_the_import_matches_hugging_faces_logits_and_fine_tuning_is_recorded(quick_run):
    figure = quick_run.results["figures"]["pretrained"]
    parity, *rest = figure["rows"]
    assert parity["unit"] == "logit" and parity["value"] <= 1e-4  # the same bound at every size
    assert any(row["unit"] == "MB/s" and row["value"] > 0 for row in rest)
    assert len(figure["setup"]["val_losses"]) == 2 and figure["setup"]["parameters"] == 44_192
