"""Figure 7: `pipeline score` on the local batch engine vs the Runner called in a plain loop.

The same exported version, the same rows (validation rows tiled to batch_rows, written as batch_shards npz
shards), the same batch size. The plain side is the least a caller does: the rows already in memory,
Runner.predict on each slice of 256, nothing written. The engine side is the whole job as a user runs it
(pipeline/score/run.py): each shard read from disk, scored on the engine's worker threads, its Parquet
part written, the output published; its rows/s is over the scoring phase (the shards running), and the
start-up (loading the version, checking every shard's head, starting the in-process cluster) is reported
apart. Both sides run once before the repeats (warm). Sides alternate within each repeat, and which goes first alternates between repeats; the ratio is
the median over repeats.
"""

from __future__ import annotations

import tempfile
import time
from pathlib import Path

from bench import timing
from bench.exported_model import exported_model
from bench.workloads import Sizes

TITLE = "Batch scoring: pipeline score on the local engine vs a plain Runner loop"
TARGET = "score >= 80% of the plain loop's rows/s at the same batch size"
COLUMNS = ["rows", "shards", "batch", "plain_rows_per_second", "score_rows_per_second", "ratio_pct", "startup_s",
           "target_met"]
BATCH = 256


def run(sizes: Sizes, work_dir: Path) -> dict:
    import numpy as np

    from pipeline.score import score
    from serving.servable import saved_model
    from serving.servable.runner import Runner

    model = exported_model(sizes, work_dir)
    version_dir = saved_model.latest_version_dir(model.base_path)
    x = np.resize(model.rows, (sizes.batch_rows, *model.rows.shape[1:])).astype(np.float32)
    shard_dir = Path(tempfile.mkdtemp(prefix="shards-", dir=work_dir))
    for i, part in enumerate(np.array_split(x, sizes.batch_shards)):
        np.savez(shard_dir / f"rows-{i:05d}.npz", **{model.input_name: part})
    runner = Runner.load(version_dir)
    runner.predict({model.input_name: x[:BATCH]})

    def plain() -> float:
        start = time.perf_counter()
        for i in range(0, len(x), BATCH):
            runner.predict({model.input_name: x[i:i + BATCH]})
        return len(x) / (time.perf_counter() - start)

    def engine() -> tuple[float, float]:
        summary = score(version_dir, [str(shard_dir / "*.npz")], work_dir / "scored", batch_size=BATCH, overwrite=True)
        assert summary["scored"] == len(x)
        return summary["rows_per_second"], summary["seconds"]["total"] - summary["seconds"]["scoring"]

    engine()  # warm, as the plain side is: a process's first job also imports and starts what later ones reuse
    samples: dict[str, list] = {"plain": [], "score": [], "startup": []}
    for repeat in range(sizes.batch_repeats):
        for side in ("plain", "score") if repeat % 2 == 0 else ("score", "plain"):
            if side == "plain":
                samples["plain"].append(plain())
            else:
                rows_per_second, startup = engine()
                samples["score"].append(rows_per_second)
                samples["startup"].append(startup)
        timing.progress(f"batch: repeat {repeat + 1}: plain {samples['plain'][-1]:,.0f} rows/s, "
                        f"score {samples['score'][-1]:,.0f} rows/s")
    runner.close()
    ratio = timing.median([s / p for s, p in zip(samples["score"], samples["plain"])]) * 100
    row = {"rows": len(x), "shards": sizes.batch_shards, "batch": BATCH,
           "plain_rows_per_second": timing.median(samples["plain"]),
           "score_rows_per_second": timing.median(samples["score"]), "ratio_pct": ratio,
           "startup_s": timing.median(samples["startup"]), "target_met": ratio >= 80.0}
    return {"rows": [row], "setup": {"model": str(version_dir), "policy": model.policy, "repeats": sizes.batch_repeats,
                                     "samples": samples, "engine": "local Dask engine, 2 threads"}}


def plot(figure: dict, ax) -> None:
    [row] = figure["rows"]
    ax.bar(["plain Runner loop", "pipeline score"], [row["plain_rows_per_second"], row["score_rows_per_second"]],
           color=["#7f7f7f", "#1f77b4"])
    ax.axhline(0.8 * row["plain_rows_per_second"], color="red", linestyle="--", linewidth=0.8, label="target 80%")
    ax.set_ylabel(f"rows/s, batch {row['batch']}")
    ax.set_title(f"7. batch scoring, {row['rows']:,} rows: {row['ratio_pct']:.0f}%", fontsize=9)
    ax.legend(fontsize=7)
