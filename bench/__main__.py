"""`python -m bench [--quick] [--only FIGURE ...] [--output DIR]`: runs the figures, writes the results.

Writes <output>/<date>-<host>.json, .md and .png (default output bench/results/, whose newest full
run also refreshes the "Latest results" section of bench/README.md). Progress goes to stderr; the
paths of the written files to stdout. Exit code 1 if a figure failed (the others are still written).
"""

from __future__ import annotations

import argparse
import contextlib
import os
import shutil
import sys
import tempfile
import time
import traceback
from pathlib import Path

FIGURES = ("training", "precision", "inference", "serving", "memory")
DEFAULT_OUTPUT = Path(__file__).resolve().parent / "results"


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m bench", description=__doc__.splitlines()[0])
    parser.add_argument("--quick", action="store_true", help="smoke run: tiny sizes, seconds per figure")
    parser.add_argument("--only", nargs="+", choices=FIGURES, metavar="FIGURE",
                        help=f"run only these figures ({', '.join(FIGURES)}); default: all")
    parser.add_argument("--output", type=Path, default=DEFAULT_OUTPUT,
                        help="directory for the result files (default bench/results/)")
    args = parser.parse_args(argv)
    os.environ.setdefault("TF_CPP_MIN_LOG_LEVEL", "2")  # before TensorFlow loads, here and in every subprocess
    command = "python -m bench " + " ".join(argv if argv is not None else sys.argv[1:])
    results, failed, paths = run_bench(args.quick, args.only or FIGURES, args.output.resolve(), command.strip())
    for kind, path in paths.items():
        print(f"{kind}: {path}")
    return 1 if failed else 0


def run_bench(quick: bool, figures: tuple[str, ...], output: Path, command: str) -> tuple[dict, list[str], dict]:
    """Runs the figures in order in a scratch directory; returns (results, failed figures, written paths)."""
    import logging

    from bench import inference, memory, precision, result_files, serving_throughput, timing, training
    from bench.machine import machine_info
    from bench.workloads import FULL, QUICK

    logging.basicConfig(level=logging.WARNING, stream=sys.stderr)
    # Figure name (what --only takes) -> the module that measures and plots it.
    modules = {"training": training, "precision": precision, "inference": inference, "serving": serving_throughput,
               "memory": memory}
    sizes = QUICK if quick else FULL
    started = time.perf_counter()
    results = {"schema_version": result_files.SCHEMA_VERSION, "created": result_files.now_utc(), "quick": quick,
               "command": command, "machine": machine_info(), "sizes": vars(sizes), "figures": {}}
    timing.progress(f"{command}: {', '.join(figures)} on {results['machine']['cpu_model']} "
                    f"({results['machine']['cpu_cores']} cores), auto policy {results['machine']['auto_policy']}")
    work_dir = Path(tempfile.mkdtemp(prefix="bench-"))
    failed = []
    for name in (name for name in FIGURES if name in figures):
        module, begun = modules[name], time.perf_counter()
        figure = {"title": module.TITLE, "target": module.TARGET, "columns": module.COLUMNS}
        try:
            with contextlib.redirect_stdout(sys.stderr):  # Keras progress lines are progress, not results
                figure.update(_run_figure(name, module, sizes, work_dir, results))
            figure["target_met"] = result_files.target_met(figure["rows"])
        except Exception as error:  # noqa: BLE001 - one broken figure must not lose the others' numbers
            traceback.print_exc()
            failed.append(name)
            figure.update({"rows": [], "target_met": None, "error": f"{type(error).__name__}: {error}"})
        figure["seconds"] = time.perf_counter() - begun
        results["figures"][name] = figure
        timing.progress(f"{name}: done in {figure['seconds']:.0f} s"
                        f"{' (FAILED, kept ' + str(work_dir) + ')' if name in failed else ''}")
    results["total_seconds"] = time.perf_counter() - started
    paths = result_files.write_results(results, output, modules)
    if output == DEFAULT_OUTPUT and not quick and not failed and set(figures) == set(FIGURES):
        result_files.update_readme(results, paths)
    if not failed:
        shutil.rmtree(work_dir, ignore_errors=True)
    return results, failed, paths


def _run_figure(name: str, module, sizes, work_dir: Path, results: dict) -> dict:
    if name == "precision":
        return module.run(sizes, results["machine"]["auto_policy"], in_process=results["quick"])
    if name == "memory":
        precision_rows = results["figures"].get("precision", {}).get("rows")
        return module.run(sizes, work_dir, precision_rows)
    return module.run(sizes, work_dir)


if __name__ == "__main__":
    sys.exit(main())
