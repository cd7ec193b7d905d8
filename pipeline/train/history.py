"""A run's per-epoch history: which entries are metrics, and history.json/history.png.

One entry per finished epoch, as the run recorder appends it: "epoch", the compiled metrics (loss,
accuracy, ...) and their val_ twins, "loss_scale" (absent without loss scaling), "skipped_steps", and the
timing keys. Checkpoints carry the history too, so a resumed run rewrites these files from there.
"""

from __future__ import annotations

from pathlib import Path

from pipeline import artifacts
from pipeline.artifacts import HISTORY_FILE, HISTORY_PLOT

# Per-epoch entries that are not compiled metrics. The timing keys differ between runs of the same config.
TIMING_KEYS = ("seconds", "examples_per_second", "input_wait")
NON_METRIC_KEYS = ("epoch", "loss_scale", "skipped_steps", *TIMING_KEYS)


def write_history(run_dir: Path, history: list[dict]) -> None:
    """Rewrites history.json and history.png from a history, e.g. a checkpoint's when a run starts or resumes."""
    write_history_json(run_dir, history)
    if history:
        plot_history(history, run_dir / HISTORY_PLOT)


def write_history_json(run_dir: Path, history: list[dict]) -> None:
    """history.json alone, atomically: cheap enough for every epoch, unlike the plot."""
    artifacts.write_json_atomic(run_dir / HISTORY_FILE, history)


def plot_history(history: list[dict], path: Path) -> None:
    """Every training metric (with its validation curve) and the loss scale per epoch, written atomically as a PNG."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    epochs = [h["epoch"] for h in history]
    keys = [k for k in history[-1] if k not in NON_METRIC_KEYS and not k.startswith("val_")]
    keys += ["loss_scale"] if "loss_scale" in history[-1] else []
    fig, axes = plt.subplots(1, len(keys), figsize=(4.5 * len(keys), 3.5), squeeze=False)
    for ax, key in zip(axes[0], keys):
        ax.plot(epochs, [h.get(key) for h in history], marker="o", label="train" if key != "loss_scale" else key)
        if f"val_{key}" in history[-1]:
            ax.plot(epochs, [h.get(f"val_{key}") for h in history], marker="o", label="validation")
        if key == "loss_scale":
            ax.set_yscale("log", base=2)
        ax.set_title(key.replace("_", " "))
        ax.set_xlabel("epoch")
        ax.grid(alpha=0.3)
        ax.legend()
    fig.tight_layout()
    with artifacts.atomic_file(path) as tmp:
        fig.savefig(tmp, dpi=90, format="png")
    plt.close(fig)
