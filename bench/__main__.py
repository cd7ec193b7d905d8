"""`python -m bench [--quick] [--only FIGURE ...] [--output DIR]`: runs the figures, writes the results.

Writes <output>/<date>-<host>.json, .md and .png (default output bench/results/, whose newest full
run also refreshes the "Latest results" section of bench/README.md). --quick is a smoke run: its
files go to build/bench-quick/ (git-ignored), never to bench/results/, are labelled as smoke
figures and judge no target. Progress goes to stderr; the paths of the written files to stdout.
Exit code 1 if a figure failed (the others are still written), 2 for bad flags.
"""

from __future__ import annotations

import argparse
import contextlib
import shutil
import sys
import tempfile
import time
import traceback
from pathlib import Path

from serving import tf_log

FIGURES = ("training", "precision", "inference", "serving", "memory", "scaling", "batch", "serving_precision",
           "input_pipeline", "image_requests", "generation", "streaming", "large_model", "pretrained")
# Run only when asked (--peers, or --only peers): it installs MLflow and BentoML into build/peers-venv.
OPTIONAL_FIGURES = ("peers",)
DEFAULT_OUTPUT = Path(__file__).resolve().parent / "results"
# build/ is git-ignored (.gitignore): a smoke run leaves nothing for `git status` to show.
QUICK_OUTPUT = Path(__file__).resolve().parent.parent / "build" / "bench-quick"


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m bench", description=__doc__.splitlines()[0])
    parser.add_argument("--quick", action="store_true", help="smoke run: tiny sizes, seconds per figure")
    parser.add_argument("--only", nargs="+", choices=FIGURES + OPTIONAL_FIGURES, metavar="FIGURE",
                        help=f"run only these figures ({', '.join(FIGURES + OPTIONAL_FIGURES)}); default: all "
                             "but the optional ones")
    parser.add_argument("--peers", action="store_true",
                        help="also run the optional peers figure (MLflow and BentoML serving the same model; "
                             "installs them into build/peers-venv)")
    parser.add_argument("--output", type=Path,
                        help="directory for the result files (default bench/results/; with --quick build/bench-quick/)")
    args = parser.parse_args(argv)
    output = output_dir(args.quick, args.output)
    if args.quick and output.is_relative_to(DEFAULT_OUTPUT):
        parser.error(f"--output {args.output}: bench/results/ holds measurements; a --quick smoke run "
                     "writes elsewhere (default build/bench-quick/)")
    tf_log.quiet_tensorflow("2")  # before TensorFlow loads, here and in every subprocess
    command = "python -m bench " + " ".join(argv if argv is not None else sys.argv[1:])
    figures = tuple(args.only) if args.only else FIGURES + (OPTIONAL_FIGURES if args.peers else ())
    results, failed, paths = run_bench(args.quick, figures, output, command.strip())
    for kind, path in paths.items():
        print(f"{kind}: {path}")
    return 1 if failed else 0


def output_dir(quick: bool, output: Path | None) -> Path:
    """The directory a run writes to: --output if given, else bench/results/ (full) or build/bench-quick/ (smoke)."""
    if output is not None:
        return output.resolve()
    return QUICK_OUTPUT if quick else DEFAULT_OUTPUT


def figure_modules() -> dict:
    """Figure name (what --only takes) -> the module that measures and plots it."""
    from bench import (batch_scoring, generation, image_requests, inference, input_pipeline, large_model, memory, peers,
                       precision, pretrained, scaling, serving_precision, serving_throughput, streaming, training)

    return {"training": training, "precision": precision, "inference": inference, "serving": serving_throughput,
            "memory": memory, "scaling": scaling, "batch": batch_scoring, "serving_precision": serving_precision,
            "input_pipeline": input_pipeline, "image_requests": image_requests, "generation": generation,
            "streaming": streaming, "large_model": large_model, "pretrained": pretrained, "peers": peers}


def run_bench(quick: bool, figures: tuple[str, ...], output: Path, command: str) -> tuple[dict, list[str], dict]:
    """Runs the figures in order in a scratch directory; returns (results, failed figures, written paths)."""
    import logging

    from bench import result_files, timing
    from bench.machine import machine_info
    from bench.workloads import FULL, QUICK

    logging.basicConfig(level=logging.WARNING, stream=sys.stderr)
    modules = figure_modules()
    sizes = QUICK if quick else FULL
    started = time.perf_counter()
    results = {"schema_version": result_files.SCHEMA_VERSION, "created": result_files.now_utc(), "quick": quick,
               "command": command, "machine": machine_info(), "sizes": vars(sizes), "figures": {}}
    timing.progress(f"{command}: {', '.join(figures)} on {results['machine']['cpu_model']} "
                    f"({results['machine']['cpu_cores']} cores), auto policy {results['machine']['auto_policy']}"
                    f"{'; ' + result_files.SMOKE_NOTE + ', writing ' + str(output) if quick else ''}")
    work_dir = Path(tempfile.mkdtemp(prefix="bench-"))
    failed = []
    for name in (name for name in FIGURES + OPTIONAL_FIGURES if name in figures):
        module, begun = modules[name], time.perf_counter()
        # Its number in the catalogue, as its plot's title has it, also when --only runs a few.
        figure = {"number": (FIGURES + OPTIONAL_FIGURES).index(name) + 1, "title": module.TITLE,
                  "target": module.TARGET, "columns": module.COLUMNS}
        try:
            with contextlib.redirect_stdout(sys.stderr):  # Keras progress lines are progress, not results
                figure.update(_run_figure(name, module, sizes, work_dir, results))
            result_files.judge(figure, quick)
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
    if output == DEFAULT_OUTPUT and not quick and not failed and set(FIGURES) <= set(figures):
        result_files.update_readme(results, paths)
    if not failed:
        shutil.rmtree(work_dir, ignore_errors=True)
    return results, failed, paths


def _run_figure(name: str, module, sizes, work_dir: Path, results: dict) -> dict:
    if name == "precision":
        return module.run(sizes, results["machine"]["auto_policy"], in_process=results["quick"])
    if name in ("serving_precision", "input_pipeline"):
        return module.run(sizes, work_dir, in_process=results["quick"])
    if name == "memory":
        precision_rows = results["figures"].get("precision", {}).get("rows")
        return module.run(sizes, work_dir, precision_rows)
    return module.run(sizes, work_dir)


if __name__ == "__main__":
    sys.exit(main())
