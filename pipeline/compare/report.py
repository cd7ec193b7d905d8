"""The precision comparison's table, verdict, Markdown and plots (pipeline/compare/run.py runs the trainings)."""

from __future__ import annotations

from pathlib import Path

from pipeline import artifacts

# The validation metric the verdict is about: accuracy for classifiers, MAE for regression (as compiled), nats per
# byte for a language model (models.compile_settings; lower is better, like MAE).
HEADLINE_METRICS = ("val_accuracy", "val_mae", "val_nats_per_byte")
LANGUAGE_MODEL_METRIC = "val_nats_per_byte"


def headline_metric(metrics: dict | None) -> str | None:
    return next((name for name in HEADLINE_METRICS if metrics and name in metrics), None)


def policy_rows(runs: list, tokens_per_example: int | None = None) -> list[dict]:
    """One row per policy: final validation metrics and their deltas against the first run (float32),
    steady-state throughput and its ratio, peak memory, skipped steps, final loss scale. A language model's row
    adds its baselines (tokens_per_example: the context, so that windows/s become tokens/s)."""
    base = runs[0].metrics or {}
    name = headline_metric(base) or next((headline_metric(run.metrics) for run in runs if run.metrics), None)
    base_speed = _throughput(base)[0]
    rows = []
    for run in runs:
        metrics = run.metrics or {}
        speed, warmup_included = _throughput(metrics)
        device = metrics.get("peak_device_bytes")
        rows.append({
            "policy": run.policy,
            "status": "ok" if run.ok else "failed",
            "error": run.error,
            "run_dir": str(Path(*run.run_dir.parts[-3:])),  # runs/<policy>/<experiment>, inside compare/
            "wall_seconds": run.wall_seconds,
            "metric": name,
            "value": metrics.get(name),
            "delta": _delta(name, metrics.get(name), base.get(name)),
            "delta_unit": "pt" if name == "val_accuracy" else "%",
            "val_loss": metrics.get("val_loss"),
            "val_loss_delta": _delta("val_loss", metrics.get("val_loss"), base.get("val_loss")),
            "examples_per_second": speed,
            "warmup_included": warmup_included,
            "throughput_ratio": round(speed / base_speed, 3) if speed and base_speed else None,
            "peak_memory_bytes": device if device is not None else metrics.get("peak_rss_bytes"),
            "peak_memory_kind": "device" if device is not None else "RSS",
            "skipped_steps": metrics.get("skipped_steps"),
            "final_loss_scale": metrics.get("final_loss_scale"),
            "loss_scale_warnings": (metrics.get("loss_scale_health") or {}).get("warnings", []),
        })
        if name == LANGUAGE_MODEL_METRIC:
            rows[-1]["language_model"] = _language_model_columns(metrics, speed, tokens_per_example)
    return rows


def _language_model_columns(metrics: dict, speed: float | None, tokens_per_example: int | None) -> dict:
    """The baselines on the same validation bytes and the model's nats per byte as a share of each (train/run.py's
    language_model_metrics), and the throughput in tokens: an example is a window of the context's tokens."""
    baselines = metrics.get("baselines") or {}
    return {"unigram_nats_per_byte": baselines.get("unigram_nats_per_byte"),
            "bigram_nats_per_byte": baselines.get("bigram_nats_per_byte"),
            "validation_bytes": baselines.get("validation_bytes"),
            "vs_unigram": metrics.get("val_nats_per_byte_vs_unigram"),
            "vs_bigram": metrics.get("val_nats_per_byte_vs_bigram"),
            "tokens_per_second": round(speed * tokens_per_example, 1) if speed and tokens_per_example else None}


def _throughput(metrics: dict) -> tuple[float | None, bool]:
    """Steady state (epochs after the first); a single-epoch run has only its warm-up-included figure."""
    if metrics.get("steady_examples_per_second"):
        return metrics["steady_examples_per_second"], False
    return metrics.get("train_examples_per_second"), True


def _delta(name: str | None, value: float | None, base: float | None) -> float | None:
    """Accuracy in points; anything else (MAE, loss) in percent of float32's value."""
    if name is None or value is None or base is None:
        return None
    if name == "val_accuracy":
        return round((value - base) * 100, 3)
    return round((value - base) / abs(base) * 100, 3) if base else None


def verdict(run, baseline, rows: list[dict], tolerance: float, device: str) -> str:
    """One line: does this policy match float32 within the tolerance, and how fast is it?"""
    if not baseline.ok:
        return f"float32 training failed ({baseline.error}): nothing to compare {run.policy} with"
    if not run.ok:
        return f"{run.policy} training failed ({run.error}): see the numeric diagnosis"
    row = next(r for r in rows if r["policy"] == run.policy)
    name, delta = row["metric"], row["delta"]
    speed = (f"is {row['throughput_ratio']:.2f}× as fast on this {device}" if row["throughput_ratio"]
             else f"its speed is unknown on this {device}")
    if delta is None:
        return f"{run.policy}: no validation metric to compare; {speed}"
    if name == "val_accuracy":
        if abs(delta) <= tolerance:
            return f"{run.policy} matches float32 within {tolerance:g} pt ({delta:+.2f} pt) and {speed}"
        if delta < 0:
            return f"{run.policy}: accuracy drops {-delta:.1f} pt (tolerance {tolerance:g} pt): see numeric diagnosis"
        return (f"{run.policy} is {delta:.1f} pt more accurate than float32, beyond the {tolerance:g} pt tolerance "
                f"(run-to-run noise? train longer), and {speed}")
    if abs(delta) <= tolerance:
        return f"{run.policy} matches float32's {name} within {tolerance:g}% ({delta:+.2f}%) and {speed}"
    if delta > 0:
        return f"{run.policy}: {name} rises {delta:.1f}% (tolerance {tolerance:g}%): see numeric diagnosis"
    return (f"{run.policy}: {name} is {-delta:.1f}% lower than float32's, beyond the {tolerance:g}% tolerance "
            f"(run-to-run noise? train longer), and {speed}")


def markdown(report: dict) -> str:
    rows, name = report["policies"], report["policies"][0]["metric"] or "metric"
    unit = rows[0]["delta_unit"]
    lines = [f"# Precision comparison: {report['experiment']}", "",
             f"`{report['command']}` on {report['device']}: seed {report['seed']}, {report['epochs']} epochs, "
             "the same data order for every policy, each trained in a process of its own."
             + (f" Note: {report['note']}." if report["note"] else ""), "",
             f"**Verdict:** {report['verdict']}"]
    lines += [f"- {line}" for policy, line in report["verdicts"].items() if policy != report["mixed"]]
    language_model = any("language_model" in r for r in rows)
    lines += ["", *(_language_model_table(rows) if language_model else _table(rows, name, unit))]
    warnings = [f"- {r['policy']}: {w}" for r in rows for w in r["loss_scale_warnings"]]
    if warnings:
        lines += ["", "Loss-scale warnings during training:", *warnings]
    lines += ["", "![loss and metric per epoch](curves.png)", "", "![loss scale and skipped steps](loss_scale.png)",
              "", f"## Numeric diagnosis of the {report['mixed']} run", "", report["diagnosis_text"], "",
              "## Runs", "", "| policy | run directory (in this folder) | wall time |", "|---|---|---:|"]
    lines += [f"| {r['policy']} | `{r['run_dir']}` | {r['wall_seconds']:.0f} s |" for r in rows]
    return "\n".join(lines) + "\n"


def _table(rows: list[dict], name: str, unit: str) -> list[str]:
    lines = [f"| policy | {name} | Δ vs float32 | val_loss | Δ vs float32 | examples/s | × float32 "
             "| peak memory | skipped steps | final loss scale |",
             "|---|---:|---:|---:|---:|---:|---:|---:|---:|---:|"]
    for r in rows:
        if r["status"] != "ok":
            lines.append(f"| {r['policy']} | training failed: {r['error']} |||||||||")
            continue
        lines.append(" | ".join([
            f"| {r['policy']}", _number(r["value"]), _signed(r["delta"], unit), _number(r["val_loss"]),
            _signed(r["val_loss_delta"], "%"), _rate(r["examples_per_second"], r["warmup_included"]),
            _ratio(r["throughput_ratio"]), *_common(r)]) + " |")
    return lines + ["", f"Δ: {'accuracy points' if unit == 'pt' else 'percent of float32'} for {name}, percent for "
                        "val_loss. examples/s: training throughput in the steady state, the median over the epochs "
                        "after the first (which traces and compiles the step); * marks a one-epoch run, warm-up "
                        "included. " + _FOOTNOTE]


def _language_model_table(rows: list[dict]) -> list[str]:
    """A language model's table: nats per byte (lower is better) against float32 and the baselines, tokens/s."""
    lines = ["| policy | val_nats_per_byte | Δ vs float32 | nats/token (val_loss) | × unigram | × bigram | tokens/s "
             "| × float32 | peak memory | skipped steps | final loss scale |",
             "|---|---:|---:|---:|---:|---:|---:|---:|---:|---:|---:|"]
    for r in rows:
        if r["status"] != "ok":
            lines.append(f"| {r['policy']} | training failed: {r['error']} ||||||||||")
            continue
        lm = r["language_model"]
        lines.append(" | ".join([
            f"| {r['policy']}", _number(r["value"]), _signed(r["delta"], "%"), _number(r["val_loss"]),
            _times(lm["vs_unigram"]), _times(lm["vs_bigram"]), _rate(lm["tokens_per_second"], r["warmup_included"]),
            _ratio(r["throughput_ratio"]), *_common(r)]) + " |")
    lm = next(r["language_model"] for r in rows if "language_model" in r)
    baselines = (f"the unigram baseline is {lm['unigram_nats_per_byte']:.4f} and the bigram "
                 f"{lm['bigram_nats_per_byte']:.4f} nats/byte on the same {lm['validation_bytes']:,} validation bytes"
                 if lm["unigram_nats_per_byte"] is not None and lm["bigram_nats_per_byte"] is not None
                 else "no baselines recorded")
    return lines + ["", "Δ: percent of float32's val_nats_per_byte (lower is better). nats/token: the mean of the "
                        "validation batches' losses (with the bytes tokenizer a token is a byte). × unigram, "
                        f"× bigram: val_nats_per_byte as a share of each baseline (0.6: 40% below); {baselines}. "
                        "tokens/s: training windows/s in the steady state (the median over the epochs after the "
                        "first, which traces and compiles the step) times the context; * marks a one-epoch run, "
                        "warm-up included. " + _FOOTNOTE]


_FOOTNOTE = ("Peak memory: the training process's resident memory on a CPU, TensorFlow's peak allocation on a GPU. "
             "Skipped steps: updates dynamic loss scaling skipped for inf/NaN gradients.")


def _common(r: dict) -> list[str]:
    """Peak memory, skipped steps, final loss scale: the columns every table ends with."""
    return [f"{_bytes(r['peak_memory_bytes'])} {r['peak_memory_kind']}", str(r["skipped_steps"]),
            "–" if r["final_loss_scale"] is None else f"{r['final_loss_scale']:g}"]


def _rate(value: float | None, warmup_included: bool) -> str:
    return f"{value:,.0f}{'*' if warmup_included else ''}" if value else "–"


def _ratio(value: float | None) -> str:
    return f"{value:.2f}×" if value else "–"


def _times(value: float | None) -> str:
    return "–" if value is None else f"{value:.2f}×"


def _number(value: float | None) -> str:
    return "–" if value is None else f"{value:.4f}" if abs(value) < 10 else f"{value:.2f}"


def _signed(value: float | None, unit: str) -> str:
    return "–" if value is None else f"{value:+.2f} {unit}"


def _bytes(count: int | None) -> str:
    if count is None:
        return "–"
    return f"{count / 2 ** 30:.2f} GiB" if count >= 2 ** 30 else f"{count / 2 ** 20:.0f} MiB"


def plot_curves(runs: list, path: Path) -> None:
    """Training (dashed) and validation (solid) loss and headline metric per epoch, one colour per policy."""
    plt = _pyplot()
    name = headline_metric(next((run.metrics for run in runs if run.metrics), None)) or "val_loss"
    keys = ["loss", name.removeprefix("val_")] if name != "val_loss" else ["loss"]
    fig, axes = plt.subplots(1, len(keys), figsize=(5.5 * len(keys), 4), squeeze=False, sharex=True)
    for ax, key in zip(axes[0], keys):
        for index, run in enumerate(runs):
            epochs = [h["epoch"] for h in run.history]
            color = f"C{index}"
            ax.plot(epochs, [h.get(key) for h in run.history], "--", color=color, label=f"{run.policy} train")
            ax.plot(epochs, [h.get(f"val_{key}") for h in run.history], "-o", color=color, markersize=3,
                    label=f"{run.policy} validation")
        ax.set_title(key)
        ax.set_xlabel("epoch")
        ax.grid(alpha=0.3)
        ax.legend(fontsize=8)
    _save(fig, path, plt)


def plot_loss_scale(runs: list, path: Path) -> None:
    """The loss scale at each epoch's end (policies with loss scaling) and the skipped steps so far."""
    plt = _pyplot()
    fig, (scale_ax, skip_ax) = plt.subplots(1, 2, figsize=(11, 4), sharex=True)
    scaled = False
    for index, run in enumerate(runs):
        epochs = [h["epoch"] for h in run.history]
        if any("loss_scale" in h for h in run.history):
            scaled = True
            scale_ax.plot(epochs, [h.get("loss_scale") for h in run.history], "-o", color=f"C{index}",
                          label=run.policy)
        skipped, total = [], 0
        for h in run.history:
            total += h.get("skipped_steps", 0)
            skipped.append(total)
        skip_ax.plot(epochs, skipped, "-o", color=f"C{index}", label=run.policy)
    if scaled:
        scale_ax.set_yscale("log", base=2)
        scale_ax.legend(fontsize=8)
    else:
        scale_ax.text(0.5, 0.5, "no policy uses loss scaling", ha="center", va="center", transform=scale_ax.transAxes)
    scale_ax.set_title("loss scale (end of epoch)")
    skip_ax.set_title("skipped steps (cumulative)")
    skip_ax.legend(fontsize=8)
    for ax in (scale_ax, skip_ax):
        ax.set_xlabel("epoch")
        ax.grid(alpha=0.3)
    _save(fig, path, plt)


def _pyplot():
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    return plt


def _save(fig, path: Path, plt) -> None:
    for ax in fig.axes:
        ax.xaxis.get_major_locator().set_params(integer=True)  # epochs
    fig.tight_layout()
    with artifacts.atomic_file(path) as tmp:
        fig.savefig(tmp, dpi=90, format="png")
    plt.close(fig)
