"""Figure 9: the streamed input pipeline (TFRecord shards) against the in-memory one, on the same rows.

MNIST-shaped rows (scikit-learn's digits resized to 28x28, 784 float32 values, with per-row noise) are written
once as TFRecord shards and as an npz file. Each training run is a process of its own, so its peak RSS is its
own: the 1x rows streamed against 10x the rows (the same shards copied ten times) give the memory and
time-to-first-step ratios; the default MLP and the CNN, each streamed and in memory on the same training and
validation rows, give the steps/s ratio and the accuracy difference (same seed, same steps); the input pipeline
alone, read for an epoch, gives its own rate, which should be at least twice the rate the model consumes rows.
"""

from __future__ import annotations

import json
import shutil
import subprocess
import sys
import time
from pathlib import Path

import numpy as np

from bench import timing
from bench.workloads import Sizes

TITLE = "Input pipeline: rows streamed from TFRecord shards vs held in memory"
TARGET = ("10x data: peak RSS <= 1.15x, first step <= 1.5x and < 15 s; streamed steps/s >= 0.9x in memory; "
          "input alone >= 2x the model; accuracy within 0.5 pt")
COLUMNS = ["measure", "value", "yardstick", "ratio", "target", "target_met"]
SHARDS = 8
SPEC = "data.feature_spec={pixels: {shape: [784]}}"


def run(sizes: Sizes, work_dir: Path, in_process: bool = False) -> dict:
    """in_process: each training in this process (--quick: seconds, not measurements; peak RSS is then this
    process's)."""
    data = work_dir / "input_pipeline"
    files = _write_rows(data, sizes.input_rows, sizes.input_scale, cnn_rows=sizes.input_cnn_rows)
    runs = {}
    for name, overrides in _runs(files, sizes, work_dir).items():
        timing.progress(f"input_pipeline: {name}")
        runs[name] = (train_and_time(overrides, time.time()) if in_process else
                      _train_in_process_of_its_own(overrides))
        timing.progress(f"input_pipeline: {name}: {runs[name]['examples_per_second'] or 0:.0f} examples/s, peak "
                        f"{runs[name]['peak_rss_mib']:.0f} MiB, first step after {runs[name]['first_step_s']:.1f} s")
    alone = _input_rows_per_second(files["streamed"], sizes)
    rows = _rows(runs, alone, sizes)
    return {"rows": rows, "runs": runs, "input_rows_per_second": alone,
            "setup": {"rows": sizes.input_rows, "scale": sizes.input_scale, "cnn_rows": sizes.input_cnn_rows,
                      "shards": SHARDS, "bytes_1x": files["bytes_1x"], "epochs": sizes.input_epochs,
                      "batch_size": sizes.input_batch}}


def _rows(runs: dict, alone: float, sizes: Sizes) -> list[dict]:
    one = runs["streamed 1x (1 epoch)"]
    found = []
    for name, how in ((f"streamed {sizes.input_scale}x (1 epoch)", "every row's statistics"),
                      (f"streamed {sizes.input_scale}x, statistics of a declared sample (1 epoch)",
                       f"data.statistics_rows {sizes.input_rows:,}")):
        ten = runs[name]
        rss, first = ten["peak_rss_mib"] / one["peak_rss_mib"], ten["first_step_s"] / one["first_step_s"]
        found += [
            {"measure": f"peak RSS, {sizes.input_scale}x rows, {how} (MiB)", "value": ten["peak_rss_mib"],
             "yardstick": one["peak_rss_mib"], "ratio": rss, "target": "<= 1.15", "target_met": rss <= 1.15},
            {"measure": f"time to first step, {sizes.input_scale}x rows, {how} (s)", "value": ten["first_step_s"],
             "yardstick": one["first_step_s"], "ratio": first, "target": "<= 1.5, < 15 s",
             "target_met": first <= 1.5 and ten["first_step_s"] < 15 and one["first_step_s"] < 15},
        ]
    for model in ("mlp", "cnn"):
        streamed, memory = runs[f"{model} streamed"], runs[f"{model} in memory"]
        ratio = (streamed["examples_per_second"] or 0) / (memory["examples_per_second"] or 1)
        drop = (memory["val_accuracy"] - streamed["val_accuracy"]) * 100
        found += [
            {"measure": f"{model}: training examples/s, streamed", "value": streamed["examples_per_second"],
             "yardstick": memory["examples_per_second"], "ratio": ratio, "target": ">= 0.9", "target_met": ratio >= 0.9},
            {"measure": f"{model}: val accuracy, streamed (pt below in memory)", "value": streamed["val_accuracy"],
             "yardstick": memory["val_accuracy"], "ratio": drop, "target": "|drop| <= 0.5 pt",
             "target_met": abs(drop) <= 0.5},
        ]
    model_rate = runs["mlp streamed"]["examples_per_second"] or 1
    found.append({"measure": "input pipeline alone (rows/s) vs the MLP's training rate", "value": alone,
                  "yardstick": model_rate, "ratio": alone / model_rate, "target": ">= 2", "target_met": alone / model_rate >= 2})
    return found


def _runs(files: dict, sizes: Sizes, work_dir: Path) -> dict[str, list[str]]:
    """Each run's config overrides; the sides of each comparison run one after the other."""
    common = ["precision.policy=mixed_float16", f"train.batch_size={sizes.input_batch}", "data.image_shape=null",
              f"train.runs_dir={work_dir / 'input_runs'}", "train.checkpoint_every_steps=0"]
    streamed = ["data.source=tfrecord", SPEC]
    memory = ["data.source=npz"]
    mlp = [f"model.hidden_units=[{', '.join(map(str, sizes.input_hidden))}]"]
    # The CNN in float32: this CPU's float16 convolutions take minutes per epoch, and the figure is about the input.
    cnn = ["precision.policy=float32", "model.kind=cnn", "data.image_shape=[28, 28, 1]", f"model.filters=[{', '.join(map(str, sizes.cnn_filters))}]",
           f"model.hidden_units=[{', '.join(map(str, sizes.cnn_hidden))}]"]
    epochs = f"train.epochs={sizes.input_epochs}"
    return {
        "streamed 1x (1 epoch)": common + streamed + mlp + ["experiment=bench_input_1x", "train.epochs=1",
                                                           f"data.path={files['streamed']}", f"data.validation_path={files['val_tfrecord']}"],
        f"streamed {sizes.input_scale}x (1 epoch)": common + streamed + mlp + [
            f"experiment=bench_input_{sizes.input_scale}x", "train.epochs=1", f"data.path={files['streamed_scaled']}",
            f"data.validation_path={files['val_tfrecord']}"],
        f"streamed {sizes.input_scale}x, statistics of a declared sample (1 epoch)": common + streamed + mlp + [
            f"experiment=bench_input_{sizes.input_scale}x_sample", "train.epochs=1",
            f"data.path={files['streamed_scaled']}", f"data.validation_path={files['val_tfrecord']}",
            f"data.statistics_rows={sizes.input_rows}", "data.num_classes=10"],
        "mlp in memory": common + memory + mlp + ["experiment=bench_input_mlp_memory", epochs,
                                                  f"data.path={files['npz']}", f"data.validation_path={files['val_npz']}"],
        "mlp streamed": common + streamed + mlp + ["experiment=bench_input_mlp_streamed", epochs,
                                                   f"data.path={files['streamed']}", f"data.validation_path={files['val_tfrecord']}"],
        "cnn in memory": common + memory + cnn + ["experiment=bench_input_cnn_memory", epochs,
                                                  f"data.path={files['cnn_npz']}", f"data.validation_path={files['val_npz']}"],
        "cnn streamed": common + streamed + cnn + ["experiment=bench_input_cnn_streamed", epochs,
                                                   f"data.path={files['cnn_streamed']}", f"data.validation_path={files['val_tfrecord']}"],
    }


def _train_in_process_of_its_own(overrides: list[str]) -> dict:
    """train_and_time in a child process: its peak RSS is its own, its first step counted from its start."""
    started = time.time()
    child = subprocess.run([sys.executable, "-c", "import json, sys; from bench.input_pipeline import train_and_time; "
                            "print(json.dumps(train_and_time(json.loads(sys.argv[1]), float(sys.argv[2]))))",
                            json.dumps(overrides), str(started)], capture_output=True, text=True, check=False)
    if child.returncode != 0:
        raise RuntimeError(f"training failed ({' '.join(overrides)}): {child.stderr.strip().splitlines()[-1:]}")
    return json.loads(child.stdout.strip().splitlines()[-1])


def train_and_time(overrides: list[str], started: float) -> dict:
    """train(cfg): its metrics, peak RSS and the seconds from `started` to the end of its first step, taken by the
    run recorder itself."""
    from serving import tf_log

    tf_log.quiet_tensorflow("2")
    from pipeline.config import load_config
    from pipeline.train import recorder, train

    first: list[float] = []
    original = recorder.RunRecorder.on_train_batch_end

    def on_train_batch_end(self, batch, logs=None):
        if not first:
            first.append(time.time())
        return original(self, batch, logs)

    recorder.RunRecorder.on_train_batch_end = on_train_batch_end
    try:
        metrics = train(load_config(None, overrides), fresh=True).metrics
    finally:
        recorder.RunRecorder.on_train_batch_end = original
    return {"examples_per_second": metrics["steady_examples_per_second"] or metrics["train_examples_per_second"],
            "val_accuracy": metrics["val_accuracy"], "peak_rss_mib": metrics["peak_rss_bytes"] / 2 ** 20,
            "first_step_s": first[0] - started, "train_examples": metrics["train_examples"]}


def _input_rows_per_second(pattern: str, sizes: Sizes) -> float:
    """One epoch of the streamed training pipeline on its own: rows/s decoded, shuffled and batched."""
    from pipeline.config import load_config
    from pipeline.data import load_datasets

    cfg = load_config(None, ["data.source=tfrecord", SPEC, f"data.path={pattern}"])
    datasets = load_datasets(cfg.data, seed=cfg.seed)
    rates = []
    for repeat in range(3):
        started, rows = time.perf_counter(), 0
        for _, y in datasets.train_dataset(sizes.input_batch, cfg.data.shuffle_buffer, seed=repeat):
            rows += len(y)
        rates.append(rows / (time.perf_counter() - started))
    return timing.median(rates)


def _write_rows(folder: Path, rows: int, scale: int, cnn_rows: int) -> dict:
    """The same MNIST-shaped rows as TFRecord shards and npz files (training, validation, the CNN's subset),
    and the shards copied `scale` times."""
    import tensorflow as tf

    folder.mkdir(parents=True, exist_ok=True)
    x, y = _mnist_shaped(rows + rows // 6)
    train_x, train_y, val_x, val_y = x[:rows], y[:rows], x[rows:], y[rows:]
    np.savez(folder / "train.npz", x_train=train_x, y_train=train_y)
    np.savez(folder / "cnn.npz", x_train=train_x[:cnn_rows], y_train=train_y[:cnn_rows])
    np.savez(folder / "val.npz", x_train=val_x, y_train=val_y)
    for name, (part_x, part_y, shards) in {"train": (train_x, train_y, SHARDS), "cnn": (train_x[:cnn_rows],
                                           train_y[:cnn_rows], SHARDS // 2), "val": (val_x, val_y, 1)}.items():
        for shard, index in enumerate(np.array_split(np.arange(len(part_x)), shards)):
            with tf.io.TFRecordWriter(str(folder / f"{name}-{shard:05d}.tfrecord")) as writer:
                for i in index:
                    writer.write(tf.train.Example(features=tf.train.Features(feature={
                        "pixels": tf.train.Feature(float_list=tf.train.FloatList(value=part_x[i])),
                        "label": tf.train.Feature(int64_list=tf.train.Int64List(value=[int(part_y[i])]))})
                    ).SerializeToString())
    scaled = folder / "scaled"
    scaled.mkdir(exist_ok=True)
    for copy in range(scale):
        for shard in range(SHARDS):
            shutil.copyfile(folder / f"train-{shard:05d}.tfrecord", scaled / f"train-{copy:03d}-{shard:05d}.tfrecord")
    return {"streamed": str(folder / "train-*.tfrecord"), "streamed_scaled": str(scaled / "train-*.tfrecord"),
            "cnn_streamed": str(folder / "cnn-*.tfrecord"), "val_tfrecord": str(folder / "val-*.tfrecord"),
            "npz": str(folder / "train.npz"), "cnn_npz": str(folder / "cnn.npz"), "val_npz": str(folder / "val.npz"),
            "bytes_1x": sum(p.stat().st_size for p in folder.glob("train-*.tfrecord"))}


def _mnist_shaped(n: int) -> tuple[np.ndarray, np.ndarray]:
    """n rows of 784 float32 pixel values 0..255: the digits resized to 28x28, each with its own noise."""
    import tensorflow as tf
    from sklearn.datasets import load_digits

    digits = load_digits()
    large = tf.image.resize(digits.images[..., None] * (255 / 16), [28, 28]).numpy().reshape(len(digits.images), 784)
    rng = np.random.default_rng(0)
    pick = rng.integers(0, len(large), n)
    x = np.clip(large[pick] + rng.normal(0, 16, (n, 784)), 0, 255).astype(np.float32)
    return x, digits.target[pick].astype(np.int64)


def plot(figure: dict, ax) -> None:
    rows = [row for row in figure["rows"] if row["ratio"] is not None and "accuracy" not in row["measure"]]
    ax.barh([row["measure"] for row in rows], [row["ratio"] for row in rows],
            color=["tab:green" if row["target_met"] else "tab:red" for row in rows])
    ax.set_xlabel("ratio to the yardstick")
    ax.set_title("input pipeline")
