"""`python -m bench --quick --only ...` for the bench's test modules, one group of figures per module.

The whole quick bench took 7 min 27 s alone on a 2-vCPU Xeon (2026-12-03), past a test's 300 s: split into
groups, each module runs its own and the two test processes share them (docs/testing.md).
"""

from __future__ import annotations

import dataclasses
import json
import math
from pathlib import Path

from bench import __main__ as bench_main
from bench import result_files

# Contiguous, in the catalogue's order; about 2-3 min each alone. test_bench.py checks they cover FIGURES.
GROUPS = (("training", "precision", "inference", "serving", "memory", "scaling", "batch"),
          ("serving_precision", "input_pipeline", "image_requests"),
          ("generation", "streaming", "large_model"),
          ("pretrained",))


@dataclasses.dataclass(frozen=True)
class QuickRun:
    code: int  # python -m bench's exit code
    output: Path  # where it wrote its .json, .md and .png
    figures: tuple[str, ...]

    @property
    def results(self) -> dict:
        return json.loads(next(self.output.glob("*.json")).read_text())


def tracked_bench_outputs() -> dict:
    """What a full run writes into the checkout: bench/results/'s files and bench/README.md, by content."""
    files = [result_files.README, *sorted(bench_main.DEFAULT_OUTPUT.iterdir())]
    return {path.name: path.read_bytes() for path in files if path.is_file()}


def run(tmp_path_factory, figures: tuple[str, ...]) -> QuickRun:
    """The quick bench of these figures, in a fresh directory; asserts it left bench/results/ and bench/README.md
    as they were."""
    output = tmp_path_factory.mktemp("bench-results")
    before = tracked_bench_outputs()
    code = bench_main.main(["--quick", "--only", *figures, "--output", str(output)])
    assert tracked_bench_outputs() == before, "a smoke run must not touch bench/results/ or bench/README.md"
    return QuickRun(code, output, figures)


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


def assert_every_figure_written(quick: QuickRun) -> None:
    """Exit 0; the machine recorded; each figure asked for, in order, with rows holding its columns, finite numbers,
    its catalogue number and no verdict (a smoke run judges no target)."""
    assert quick.code == 0
    results = quick.results
    assert results["schema_version"] == result_files.SCHEMA_VERSION and results["quick"] is True
    assert {"hostname", "cpu_model", "cpu_cores", "cpu_flags", "tensorflow", "auto_policy"} <= set(results["machine"])
    assert tuple(results["figures"]) == quick.figures
    for name, figure in results["figures"].items():
        assert "error" not in figure, f"{name}: {figure.get('error')}"
        assert figure["number"] == bench_main.FIGURES.index(name) + 1
        assert figure["rows"], name
        assert figure["seconds"] > 0
        assert figure["target_met"] is None, f"{name}: a smoke run judges no target"
        assert all(row.get("target_met") is None for row in figure["rows"]), name
        for row in figure["rows"]:
            assert set(figure["columns"]) <= set(row), f"{name}: {row}"
        assert all(math.isfinite(x) for x in _numbers(figure["rows"])), name
