"""Figure 3: Runner.predict vs a direct call of the SavedModel's serving_default signature.

The same exported version is loaded twice: by serving.servable.runner.Runner (input checks, the one
inference path of the server and `pipeline predict`) and by tf.saved_model.load. The direct side
does the least a caller must: convert the rows to a tensor, call the signature, and read each
output back as numpy (Runner returns numpy). Sides alternate within each repeat, and which goes
first alternates between repeats; the ratio is the median over repeats.
"""

from __future__ import annotations

from pathlib import Path

from bench import timing
from bench.exported_model import exported_model
from bench.workloads import Sizes

TITLE = "Inference path overhead: Runner.predict vs the bare SavedModel signature"
TARGET = "runner costs <= 5% at batch >= 8"
COLUMNS = ["batch", "signature_ms", "runner_ms", "overhead_pct", "runner_examples_per_second", "target_met"]


def run(sizes: Sizes, work_dir: Path) -> dict:
    import numpy as np
    import tensorflow as tf

    from serving.servable import saved_model
    from serving.servable.runner import Runner

    model = exported_model(sizes, work_dir)
    version_dir = saved_model.latest_version_dir(model.base_path)
    runner = Runner.load(version_dir)
    signature = tf.saved_model.load(str(version_dir)).signatures["serving_default"]
    name = model.input_name

    rows = []
    for batch in sizes.inference_batches:
        x = np.resize(model.rows, (batch, *model.rows.shape[1:])).astype(np.float32)

        def direct():
            return {key: value.numpy() for key, value in signature(**{name: tf.convert_to_tensor(x)}).items()}

        def through_runner():
            return runner.predict({name: x})

        np.testing.assert_allclose(direct()["probabilities"], through_runner()["probabilities"], atol=1e-6)
        calls = timing.calls_for(direct, sizes.inference_budget_s)
        samples = {"signature": [], "runner": []}
        for repeat in range(sizes.inference_repeats):
            sides = [("signature", direct), ("runner", through_runner)]
            for side, function in sides if repeat % 2 == 0 else sides[::-1]:  # neither side always goes first
                samples[side].append(timing.seconds_per_call(function, calls))
        ratios = [r / s for r, s in zip(samples["runner"], samples["signature"])]
        overhead = (timing.median(ratios) - 1) * 100
        runner_s = timing.median(samples["runner"])
        rows.append({"batch": batch, "signature_ms": timing.median(samples["signature"]) * 1e3,
                     "runner_ms": runner_s * 1e3, "overhead_pct": overhead,
                     "runner_examples_per_second": batch / runner_s,
                     "target_met": overhead <= 5.0 if batch >= 8 else None})
        timing.progress(f"inference: batch {batch}: runner {runner_s * 1e3:.3f} ms, overhead {overhead:+.1f}%")
    runner.close()
    return {"rows": rows, "setup": {"model": str(version_dir), "policy": model.policy,
                                    "repeats": sizes.inference_repeats}}


def plot(figure: dict, ax) -> None:
    rows = figure["rows"]
    ax.bar([str(r["batch"]) for r in rows], [r["overhead_pct"] for r in rows], color="#1f77b4")
    ax.axhline(5.0, color="red", linestyle="--", linewidth=0.8, label="target 5%")
    ax.axhline(0.0, color="black", linewidth=0.8)
    ax.set_xlabel("batch size")
    ax.set_ylabel("runner overhead (%)")
    ax.set_title("3. inference path overhead", fontsize=9)
    ax.legend(fontsize=7)
