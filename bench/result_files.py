"""Writes a bench run: <date>-<host>.json (everything), .md (the tables) and .png (one plot per figure),
and refreshes the "Latest results" section of bench/README.md between its marker comments.

A --quick run's files say on every table and plot that they come from a smoke run, and judge no
target: at smoke sizes a ratio like the training overhead is noise (+966% has been seen).
"""

from __future__ import annotations

import datetime
import json
import math
import re
from pathlib import Path

from pipeline import artifacts

SCHEMA_VERSION = 1
README = Path(__file__).with_name("README.md")
BEGIN, END = "<!-- bench:latest-results:begin -->", "<!-- bench:latest-results:end -->"
SMOKE_NOTE = "smoke run: sizes too small to judge the targets"
NOT_JUDGED = "not judged (smoke run)"


def result_stem(results: dict) -> str:
    day = results["created"][:10]
    host = re.sub(r"[^A-Za-z0-9_.-]", "_", results["machine"]["hostname"])
    return f"{day}-{host}{'-quick' if results['quick'] else ''}"


def write_results(results: dict, output_dir: Path, modules: dict) -> dict[str, Path]:
    """Writes the three files atomically; returns their paths by kind."""
    output_dir.mkdir(parents=True, exist_ok=True)
    stem = output_dir / result_stem(results)
    paths = {"json": stem.with_suffix(".json"), "md": stem.with_suffix(".md"), "png": stem.with_suffix(".png")}
    # Not write_json_atomic: it sorts keys, and the file should read in figure order.
    artifacts.write_text_atomic(paths["json"], json.dumps(_finite(results), indent=1) + "\n")
    artifacts.write_text_atomic(paths["md"], markdown(results, paths["png"].name))
    write_plot(results, modules, paths["png"])
    return paths


def judge(figure: dict, quick: bool) -> None:
    """Sets the figure's target_met from its rows'; a smoke run judges nothing (every target_met None)."""
    if quick:
        for row in figure["rows"]:
            if "target_met" in row:
                row["target_met"] = None
    figure["target_met"] = None if quick else target_met(figure["rows"])


def markdown(results: dict, plot_name: str | None = None) -> str:
    """The tables of one run, headed by the machine they were measured on."""
    machine, quick = results["machine"], results["quick"]
    gpus = ", ".join(g["name"] for g in machine["gpus"]) or "none"
    lines = [f"# Smoke run {result_stem(results)} (not a measurement)" if quick
             else f"# Bench results {result_stem(results)}", ""]
    if quick:
        lines += [f"**{SMOKE_NOTE.capitalize()}.** `--quick` runs tiny models, data and durations to check that "
                  "the bench code works: its numbers are not measurements and no target is judged. `make bench` "
                  "measures.", ""]
    lines += [f"{'Ran' if quick else 'Measured'} {results['created']} on **{machine['hostname']}**: "
              f"{machine['cpu_model']}, {machine['cpu_cores']} cores, "
              f"flags {', '.join(machine['cpu_flags']) or 'none'}; GPU: {gpus}; "
              f"TensorFlow {machine['tensorflow']}, Python {machine['python']}; load average at start "
              f"{', '.join(f'{x:.2f}' for x in machine['load_average'] or [])}. "
              f"Policy `auto` picks **{machine['auto_policy']}** here ({machine['auto_policy_reason']}).",
              "", f"`{results['command']}` took {results['total_seconds']:.0f} s"
              f"{' (--quick: smoke sizes)' if quick else ''}.", "",
              summary_table(results), ""]
    if plot_name:
        lines += [f"![bench plots]({plot_name})", ""]
    for name, figure in results["figures"].items():
        lines += [f"## {figure['number']}. {figure['title']}{' (smoke run)' if quick else ''}", ""]
        if figure.get("target"):
            lines += [f"Target: {figure['target']}.{' **Not judged**: smoke run, sizes too small.' if quick else ''}",
                      ""]
        if figure.get("error"):
            lines += [f"**Failed:** {figure['error']}", ""]
            continue
        lines += [_table(figure["columns"], figure["rows"]), ""]
        lines += [f"- {note}" for note in figure.get("notes", [])] + ([""] if figure.get("notes") else [])
        lines += [f"({figure['seconds']:.0f} s)", ""]
    return "\n".join(lines)


def summary_table(results: dict) -> str:
    rows = []
    for name, figure in results["figures"].items():
        rows.append({"figure": f"{figure['number']}. {name}", "target": figure.get("target") or "(measurement)",
                     "target_met": "failed" if figure.get("error") else
                     NOT_JUDGED if results["quick"] and figure.get("target") else figure.get("target_met"),
                     "seconds": figure.get("seconds")})
    return _table(["figure", "target", "target_met", "seconds"], rows)


def target_met(rows: list[dict]) -> bool | None:
    """True if every row with a target meets it, False if one does not, None if no row has one."""
    judged = [row["target_met"] for row in rows if row.get("target_met") is not None]
    return all(judged) if judged else None


def update_readme(results: dict, paths: dict[str, Path], readme: Path = README) -> bool:
    """Rewrites the section between the markers; False if the README has no markers."""
    text = readme.read_text()
    if BEGIN not in text or END not in text:
        return False
    relative = {kind: path.relative_to(readme.parent) if path.is_relative_to(readme.parent) else path
                for kind, path in paths.items()}
    body = markdown(results, str(relative["png"])).split("\n", 2)[2]  # without the file's own title
    section = f"{BEGIN}\nFrom [{relative['md']}]({relative['md']}) (raw numbers: [{relative['json'].name}]" \
              f"({relative['json']})).\n\n{body.strip()}\n{END}"
    artifacts.write_text_atomic(readme, text[:text.index(BEGIN)] + section + text[text.index(END) + len(END):])
    return True


def write_plot(results: dict, modules: dict, path: Path) -> None:
    import matplotlib.pyplot as plt

    fig = draw_plot(results, modules)
    # A title in the PNG's metadata too (ASCII: tEXt chunks are Latin-1), for a file seen without its .md.
    title = f"bench {result_stem(results)}{' (' + SMOKE_NOTE + ')' if results['quick'] else ''}"
    tmp = path.with_name(f"{artifacts.TMP_PREFIX}{path.name}")
    try:
        fig.savefig(tmp, dpi=110, format="png", metadata={"Title": title})
        tmp.replace(path)
    finally:
        plt.close(fig)
        tmp.unlink(missing_ok=True)


def draw_plot(results: dict, modules: dict):
    """One matplotlib figure, one panel per figure; a smoke run's panels are stamped "SMOKE RUN"."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    figures = [(name, figure) for name, figure in results["figures"].items() if figure.get("rows")]
    columns = min(max(len(figures), 1), 3)
    rows = -(-max(len(figures), 1) // columns)
    fig, axes = plt.subplots(rows, columns, figsize=(4.6 * columns, 3.8 * rows), squeeze=False)
    for ax, (name, figure) in zip(axes.flat, figures):
        modules[name].plot(figure, ax)
        ax.tick_params(labelsize=7)
        if results["quick"]:
            ax.text(0.5, 0.5, "SMOKE RUN", transform=ax.transAxes, ha="center", va="center", rotation=25,
                    fontsize=26, color="red", alpha=0.25)
    for ax in list(axes.flat)[len(figures):]:
        ax.set_visible(False)
    title = (f"bench {result_stem(results)}: {results['machine']['cpu_model']}, "
             f"{results['machine']['cpu_cores']} cores")
    if results["quick"]:
        title = f"{SMOKE_NOTE} (python -m bench --quick), not a measurement\n{title}"
    fig.suptitle(title, fontsize=9, color="red" if results["quick"] else "black")
    fig.tight_layout()
    return fig


def grouped_bars(ax, rows: list[dict], *series: tuple[str, list[float]]) -> None:
    """One bar per series beside each other for every row (its policy on the axis), each series (legend label,
    values): figures 11 and 13's panels."""
    positions = range(len(rows))
    width = 0.8 / len(series)
    for i, (label, values) in enumerate(series):  # colours: matplotlib's cycle, blue and orange first
        offset = (i - (len(series) - 1) / 2) * width
        ax.bar([p + offset for p in positions], values, width=width, label=label)
    ax.set_xticks(list(positions), [row["policy"] for row in rows])


def _table(columns: list[str], rows: list[dict]) -> str:
    lines = ["| " + " | ".join(columns) + " |", "|" + "---|" * len(columns)]
    for row in rows:
        cells = (_cell(row.get(column), bold_no=column == "target_met") for column in columns)
        lines.append("| " + " | ".join(cells) + " |")
    return "\n".join(lines)


def _cell(value, bold_no: bool = False) -> str:
    if value is None:
        return "–"
    if isinstance(value, bool):
        return "yes" if value else ("**no**" if bold_no else "no")
    if isinstance(value, float):
        if not math.isfinite(value):
            return "n/a"
        if abs(value) >= 100:
            return f"{value:,.0f}"
        return f"{value:.3g}" if abs(value) < 10 else f"{value:.1f}"
    return str(value)


def _finite(value):
    """JSON has no NaN/inf: they become null."""
    if isinstance(value, float) and not math.isfinite(value):
        return None
    if isinstance(value, dict):
        return {key: _finite(item) for key, item in value.items()}
    if isinstance(value, (list, tuple)):
        return [_finite(item) for item in value]
    return value


def now_utc() -> str:
    return datetime.datetime.now(datetime.timezone.utc).isoformat(timespec="seconds")
