"""Figure 2: float32 vs mixed_float16 vs mixed_bfloat16, training and inference, guide MLP, CNN and transformer.

Keras's dtype policy is process-global and peak memory is per process, so each policy and model runs in
a subprocess of its own (`python -m bench.precision POLICY MODEL SIZES_JSON`), which builds the model
through the pipeline (precision.apply_policy, models.build_model, the pipeline's optimizer and
loss scaling) on synthetic rows (the transformer: the pointer task's token ids) and prints one JSON
line. Training: steady-state examples/s of
model.fit. Inference: examples/s of predict_on_batch on the same weights, which is what serving
them under that policy (export.serving_policy) would compute in.
"""

from __future__ import annotations

import dataclasses
import json
import subprocess
import sys
import time

from bench import timing
from bench.machine import MEASURED
from bench.workloads import Sizes, precision_overrides

TITLE = "Precision speed-ups: training and inference examples/s per policy"
TARGET = None  # a measurement, not a goal: on a GPU the guide claims up to 3x for mixed_float16
COLUMNS = ["model", "policy", "auto", "train_examples_per_second", "train_speedup", "infer_examples_per_second",
           "infer_speedup", "peak_rss_mib", "peak_device_mib"]
POLICIES = ("float32", "mixed_float16", "mixed_bfloat16")
MODELS = ("mlp", "cnn", "transformer")


def run(sizes: Sizes, auto_policy: str, in_process: bool = False) -> dict:
    """in_process (--quick): every policy in this process, one after the other, saving a TensorFlow
    start per policy; peak RSS is then this process's running peak, not each policy's own."""
    if in_process:
        timing.progress("precision: all policies in this process (--quick)")
        measured = _measure_policies(POLICIES, MODELS, sizes)
    else:
        measured = {policy: {} for policy in POLICIES}
        for policy in POLICIES:
            for model in MODELS:
                timing.progress(f"precision: {policy} {model} (subprocess)")
                measured[policy].update(_run_worker(policy, model, sizes)[policy])
    for policy in POLICIES:
        for model in MODELS:
            timing.progress(f"precision: {policy} {model}: train {measured[policy][model]['train']:.0f}, "
                            f"inference {measured[policy][model]['infer']:.0f} examples/s")
    rows = []
    for model in MODELS:
        base = measured["float32"][model]
        picked = auto_policy
        if auto_policy == MEASURED:  # what auto's own timing would keep: the candidate that trained fastest here
            from pipeline.precision import TRAIN_CANDIDATES

            picked = max(TRAIN_CANDIDATES, key=lambda policy: measured[policy][model]["train"])
        for policy in POLICIES:
            m = measured[policy][model]
            rows.append({"model": model, "policy": policy, "auto": policy == picked,
                         "train_examples_per_second": m["train"], "train_speedup": m["train"] / base["train"],
                         "infer_examples_per_second": m["infer"], "infer_speedup": m["infer"] / base["infer"],
                         "peak_rss_mib": m["peak_rss_mib"],
                         "peak_device_mib": m["peak_device_mib"]})
    layers, width, heads, mlp_units, length = sizes.transformer_sizes
    return {"rows": rows, "setup": {"mlp": f"784 -> {' -> '.join(map(str, sizes.mlp_hidden))} -> 10",
                                    "cnn": f"32x32x3, conv {list(sizes.cnn_filters)}, "
                                           f"dense {list(sizes.cnn_hidden)} -> 10",
                                    "transformer": f"pointer task, {length} tokens, {layers} blocks of width {width}, "
                                                   f"{heads} heads, MLP {mlp_units} -> 10",
                                    "train_batch": sizes.precision_batch, "predict_batch": sizes.predict_batch,
                                    "steps_per_epoch": sizes.precision_steps, "epochs": sizes.precision_epochs}}


def _run_worker(policy: str, model: str, sizes: Sizes) -> dict:
    result = subprocess.run([sys.executable, "-m", "bench.precision", policy, model,
                             json.dumps(dataclasses.asdict(sizes))], capture_output=True, text=True)
    lines = [line for line in result.stdout.splitlines() if line.startswith("{")]
    if result.returncode != 0 or not lines:
        tail = " | ".join(result.stderr.strip().splitlines()[-5:])
        raise RuntimeError(f"precision worker for {policy} {model} failed (exit {result.returncode}): {tail}")
    return json.loads(lines[-1])


def _measure(model_kind: str, policy_name: str, sizes: Sizes) -> dict:
    """Training and inference examples/s of one model under the (already applied) policy."""
    import keras
    import numpy as np

    from pipeline import data, precision
    from pipeline.config import load_config
    from pipeline.train import build_compiled_model

    cfg = load_config(None, precision_overrides(sizes, model_kind, policy_name))
    policy = precision.apply_policy(cfg.precision)
    keras.utils.set_random_seed(cfg.seed)
    datasets = data.load_datasets(cfg.data, seed=cfg.seed)
    model = build_compiled_model(cfg, datasets, policy)
    batches = datasets.train_dataset(sizes.precision_batch, 1024, cfg.seed).repeat()
    timer = timing.epoch_timer()
    model.fit(batches, epochs=sizes.precision_epochs, steps_per_epoch=sizes.precision_steps, callbacks=[timer],
              shuffle=False, verbose=0)
    train = timing.steady_examples_per_second(timer.epoch_seconds(), sizes.precision_batch * sizes.precision_steps)
    val_x, _ = datasets.validation_rows()
    x = np.resize(val_x, (sizes.predict_batch, *val_x.shape[1:]))
    model.predict_on_batch(x)  # traces
    calls = timing.calls_for(lambda: model.predict_on_batch(x), sizes.predict_budget_s / 3)
    infer = sizes.predict_batch / timing.median([timing.seconds_per_call(lambda: model.predict_on_batch(x), calls)
                                                 for _ in range(3)])
    return {"train": train, "infer": infer, "peak_device_mib": _peak_device_mib()}


def _peak_device_mib() -> float | None:
    import tensorflow as tf

    if not tf.config.list_physical_devices("GPU"):
        return None
    peak = tf.config.experimental.get_memory_info("GPU:0")["peak"] / 2**20
    tf.config.experimental.reset_memory_stats("GPU:0")
    return round(peak, 1)


def _measure_policies(policies: tuple[str, ...], models: tuple[str, ...], sizes: Sizes) -> dict:
    """{policy: {model: {train, infer, peak_device_mib, peak_rss_mib, seconds}}}: the process's peak RSS after
    each model (its own only when the process ran nothing else); leaves the global policy at float32."""
    import keras

    from bench.machine import peak_rss_mib

    results = {}
    try:
        for policy in policies:
            results[policy] = {}
            for model in models:
                started = time.perf_counter()
                results[policy][model] = {**_measure(model, policy, sizes), "peak_rss_mib": peak_rss_mib(),
                                          "seconds": time.perf_counter() - started}
    finally:
        keras.config.set_dtype_policy("float32")
    return results


def _worker(policy: str, model: str, sizes_json: str) -> None:
    """The subprocess: prints _measure_policies((policy,), (model,)) as one JSON line."""
    sizes = Sizes(**{k: tuple(v) if isinstance(v, list) else v for k, v in json.loads(sizes_json).items()})
    print(json.dumps(_measure_policies((policy,), (model,), sizes)), flush=True)


def plot(figure: dict, ax) -> None:
    import numpy as np

    rows = figure["rows"]
    labels = [f"{r['model']}\n{r['policy'].replace('mixed_', 'm_')}{' *' if r['auto'] else ''}" for r in rows]
    positions = np.arange(len(rows))
    ax.bar(positions - 0.2, [r["train_speedup"] for r in rows], 0.4, label="training")
    ax.bar(positions + 0.2, [r["infer_speedup"] for r in rows], 0.4, label="inference")
    ax.axhline(1.0, color="black", linewidth=0.8)
    ax.set_xticks(positions, labels, fontsize=7)
    ax.set_ylabel("speed-up vs float32")
    ax.set_title("2. precision speed-ups (* = policy auto)", fontsize=9)
    ax.legend(fontsize=7)


if __name__ == "__main__":
    _worker(sys.argv[1], sys.argv[2], sys.argv[3])
