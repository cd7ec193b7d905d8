"""The audit's report: its text, report.json, the plot and the reproducers (pipeline/audit/run.py lists the files)."""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

import numpy as np

from pipeline.audit import replay

REPORT_FILE = "report.json"
PLOT_FILE = "audit.png"
REPRODUCERS_FILE = "reproducers.tfrecord"
REPRODUCERS_JSON = "reproducers.json"


def write(directory: Path, found: dict[str, Any], rows: dict[tuple[int, str], replay.OutputRows],
          reproducers: list[replay.Candidate]) -> None:
    """report.json, audit.png and the reproducers into the (staging) directory."""
    import tensorflow as tf

    found["files"] = {"report": REPORT_FILE, "plot": PLOT_FILE if rows else None,
                      "reproducers": REPRODUCERS_FILE if reproducers else None}
    if rows:
        plot(found, rows, directory / PLOT_FILE)
    if reproducers:
        with tf.io.TFRecordWriter(str(directory / REPRODUCERS_FILE)) as writer:
            for raw in dict.fromkeys(c.raw for c in reproducers):  # a request once, even with many rows beyond
                writer.write(raw)
        shown = [{"log": c.path, "record": c.record, "row": c.row, "version": c.version, "output": c.output,
                  "abs_diff": c.abs_diff, "served": c.served, "reference": c.reference,
                  **({} if c.step is None else {"step": c.step})} for c in reproducers]
        (directory / REPRODUCERS_JSON).write_text(json.dumps(shown, indent=1) + "\n")
    (directory / REPORT_FILE).write_text(json.dumps(found, indent=2, default=str) + "\n")


def text(found: dict[str, Any]) -> str:
    """The report as verify prints its: one line per check, PASS or FAIL, then the verdict. A language model's
    rows are prompts and its compared rows the generated steps (pipeline/audit/lm.py)."""
    lm = found.get("task") == "language_model"
    requests, rows, compared = ("logged generate calls", "prompts", "generated steps") if lm else (
        "logged requests", "rows", "rows")
    lines = [f"audit {found['base_path']} ({found['model']}): {found['requests']:,} {requests}, {found['rows']:,} "
             f"{rows}, from {len(found['log_files'])} log file(s), against {found['reference']}"]
    for version, info in found["versions"].items():
        lines.append(f"version {version} (served {info['served_policy']}), {info['rows']:,} {compared}; tolerance: "
                     f"max rel diff <= {info['tolerance']:g} ({info['tolerance_source']})")
        for name, o in sorted(info["outputs"].items()):
            status = "PASS" if o["max_rel_diff"] <= info["tolerance"] else "FAIL"
            lines.append(f"  {status}  {name:13} max abs diff {o['max_abs_diff']:.3g}, mean abs diff "
                         f"{o['mean_abs_diff']:.3g}, max rel diff {o['max_rel_diff']:.3g}, mean rel diff "
                         f"{o['mean_rel_diff']:.3g}, {compared} beyond the tolerance {o['rows_beyond_tolerance']:,}")
        if info["argmax_agreement"] is not None:
            status = "PASS" if info["argmax_agreement"] >= info["min_argmax_agreement"] else "FAIL"
            what = "next-token argmax agreement (same prefix)" if lm else "argmax agreement"
            lines.append(f"  {status}  {what} {info['argmax_agreement']:.4f} (at least "
                         f"{info['min_argmax_agreement']:g}, {info['min_argmax_agreement_source']})")
        replayed = info.get("replay")
        if replayed is not None and not info["outputs"]:
            lines.append("  FAIL  no generated step of this version could be replayed (see not replayed)")
        if replayed is not None:
            lines.append(f"  {'FAIL' if replayed['tokens_beyond_tolerance'] else 'PASS'}  replay        "
                         f"{replayed['tokens_beyond_tolerance']:,} of {replayed['greedy_tokens']:,} greedy tokens "
                         "logged are not the served model's own choice" + _worst_replay(replayed["worst"]))
        gate = info.get("parity_json") or {}
        if gate.get("max_abs_diff_per_output") and found["against"] == "float32":
            shown = ", ".join(f"{name} {value:.3g}" for name, value in sorted(gate["max_abs_diff_per_output"].items()))
            lines.append(f"        the export's parity gate vs float32 on its {gate['rows']} "
                         f"{'validation windows' if lm else 'golden rows'}: max abs diff {shown}")
    if found["skipped"]:
        lines.append("not replayed: " + ", ".join(f"{reason} {count:,}" for reason, count in sorted(found["skipped"].items())))
    failed = [v for v, info in found["versions"].items() if not info["ok"]]
    if not found["versions"]:
        lines.append("FAILED: no logged request could be replayed")
    elif failed:
        lines.append(f"FAILED: version {', '.join(failed)} beyond the tolerance")
    else:
        lines.append("OK: every logged answer within the tolerance")
    files = found.get("files") or {}
    where = Path(found.get("output", ""))
    lines.append(f"report: {where / files.get('report', REPORT_FILE)}"
                 + (f", plot: {where / files['plot']}" if files.get("plot") else "")
                 + (f", reproducers: {where / files['reproducers']}" if files.get("reproducers") else ""))
    return "\n".join(lines)


def _worst_replay(worst: dict[str, Any] | None) -> str:
    if not worst:
        return ""
    return (f" (worst: {worst['log']} record {worst['record']} row {worst['row']} step {worst['step']}: logged token "
            f"{worst['logged_token']}, the served model's argmax {worst['served_argmax']})")


def plot(found: dict[str, Any], rows: dict[tuple[int, str], replay.OutputRows], path: Path) -> None:
    """One panel per version and output: how many rows differ by how much (relative), the tolerance marked."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    keys = sorted(rows)
    fig, axes = plt.subplots(len(keys), 1, figsize=(7, 2.6 * len(keys)), squeeze=False)
    for ax, (version, name) in zip(axes[:, 0], keys):
        info = found["versions"][str(version)]
        figures = info["outputs"][name]
        relative = np.concatenate(rows[(version, name)].abs_diff) / figures["scale"]
        tiny = 1e-9
        finite = np.clip(relative[np.isfinite(relative)], tiny, None)
        top = max(0, int(np.ceil(np.log10(finite.max())))) if finite.size else 0  # a perturbed model goes past 1
        ax.hist(finite, bins=np.logspace(np.log10(tiny), top, 46 + 5 * top), color="tab:blue")
        ax.axvline(info["tolerance"], color="tab:red", linestyle="--", label=f"tolerance {info['tolerance']:g}")
        ax.set_xscale("log")
        ax.set_yscale("log")
        ax.set_xlabel(f"|served - {found['against']}| / max |{found['against']}|, per row (identical rows at 1e-9)")
        ax.set_ylabel("rows")
        ax.set_title(f"version {version} ({info['served_policy']}), {name}: max rel diff {figures['max_rel_diff']:.3g}, "
                     f"{figures['rows_beyond_tolerance']} rows beyond", fontsize=9)
        ax.legend(fontsize=8)
    fig.tight_layout()
    fig.savefig(path, dpi=90, format="png")
    plt.close(fig)
