"""Figure 8: one trained model served under four precisions, side by side in one run.

The guide's MLP (784 -> 1024 -> 1024 -> 10) is trained once under mixed_float16 on scikit-learn's digits enlarged
to MNIST's 28x28 (a real validation accuracy), then exported four times with export.serving_policy float32,
trained (mixed_float16: float32 variables cast to float16 on every call), float16 and bfloat16 (the weights
stored in that dtype). Each export passes the parity gate. Then, per policy:

  variables      the bytes of the version's variables/ directory, and the ratio to float32's
  quality        every validation row through the Runner: accuracy, its delta to float32 in points, the largest
                 |probability - float32's|, and NaN/Inf answers at the training rows' input limits
  in-process     Runner.predict rows/s at batch 64 and at batch 1, each policy in a process of its own with the
                 servers' TensorFlow threads (a float16 model turns grappler's remapper off for its whole process:
                 serving/servable/float16_cpu.py); the processes take turns, R rounds in rotating order, each
                 measurement the fastest of three short windows; rows/s is the median over the rounds and the
                 speed-up the median of each round's ratio to float32
  server         one `python -m serving` per policy (one version, batching as figure 4): resident memory once it
                 is ready (warmup done), and gRPC queries/s of 32 single-row clients, R rounds in rotating order,
                 with the server's CPU time per query (user + system, /proc): on a shared machine queries/s
                 moves with other processes' load, the CPU a query costs much less

`--quick` measures in-process speed in the bench process itself (one TensorFlow start less per policy).
"""

from __future__ import annotations

import dataclasses
import json
import subprocess
import sys
from pathlib import Path

from bench import timing
from bench.machine import cpu_seconds, rss_mib
from bench.server_processes import running_servers
from bench.serving_throughput import BATCHING, SERVER_THREADS, load, write_batching_parameters
from bench.workloads import Sizes, serving_precision_overrides

TITLE = "Serving precision: one trained model served as float32, mixed_float16, float16 and bfloat16 weights"
TARGET = ("bfloat16 weights: variables <= 0.52x float32's, in-process rows/s >= 1.6x at batch 64 and >= 1.2x at batch "
          "1, gRPC qps at 32 clients >= float32's, server RSS below float32's by >= 40% of float32's variables; every "
          "policy: validation accuracy within 0.5 pt of float32, 0 NaN/Inf at the input limits")
COLUMNS = ["serving_policy", "weights", "variables_mib", "variables_ratio", "server_rss_mib", "rss_saved_mib",
           "rows_s_batch64", "speedup_batch64", "rows_s_batch1", "speedup_batch1", "grpc_qps_32", "qps_ratio",
           "server_cpu_ms_per_query",
           "val_accuracy", "accuracy_delta_pt", "max_abs_diff", "nonfinite_at_limits", "target", "target_met"]
SETTINGS = ("float32", "trained", "float16", "bfloat16")  # export.serving_policy, float32 first: the yardstick
BATCHES = (64, 1)
CLIENTS = 32


@dataclasses.dataclass(frozen=True)
class Served:
    setting: str  # export.serving_policy
    policy: str  # what the graph computes under
    weights: str  # the variables' dtype
    version_dir: Path
    model_name: str


def run(sizes: Sizes, work_dir: Path, in_process: bool = False) -> dict:
    import numpy as np

    exported, datasets = _train_and_export(sizes, work_dir)
    quality = _quality(exported, datasets)
    rows_npy = work_dir / "serving-precision-rows.npy"  # the in-process requests: validation rows
    val_x, _ = datasets.validation_rows()
    np.save(rows_npy, np.resize(val_x, (max(BATCHES), *val_x.shape[1:])).astype(np.float32))
    speed = (_speed_inline if in_process else _speed_in_processes)(exported, rows_npy, sizes)
    servers = _servers(exported, datasets, sizes, work_dir)
    rows = _rows(exported, quality, speed, servers)
    return {"rows": rows, "notes": _notes(),
            "setup": {"model": "784 -> " + " -> ".join(map(str, sizes.guide_hidden)) + " -> 10, trained under "
                               "mixed_float16 on digits enlarged to 28x28",
                      "validation_rows": datasets.val_examples, "rounds": sizes.serving_precision_rounds,
                      "qps_rounds": sizes.serving_precision_qps_rounds, "load_seconds": sizes.load_seconds,
                      "server_threads": SERVER_THREADS, "batching_parameters": BATCHING, "clients": CLIENTS,
                      "exports": {s.setting: str(s.version_dir) for s in exported}}}


def _train_and_export(sizes: Sizes, work_dir: Path):
    """Trains the model once and exports it under each setting, each as its own model (one version apiece)."""
    import keras

    from bench.exported_model import DEFAULT_CONFIG
    from pipeline.config import load_config
    from pipeline.export import export
    from pipeline.train import train
    from serving.servable import saved_model

    data_path = write_digits_28(work_dir / "digits28.npz")
    overrides = serving_precision_overrides(sizes, work_dir, data_path)
    try:
        timing.progress("serving precision: training the guide's MLP once (mixed_float16, digits at 28x28)")
        run_result = train(load_config(DEFAULT_CONFIG, overrides), fresh=True)
        exported = []
        for setting in SETTINGS:
            cfg = load_config(DEFAULT_CONFIG, [*overrides, f"export.serving_policy={setting}",
                                               f"export.model_name=bench_serving_{setting}"])
            timing.progress(f"serving precision: exporting with export.serving_policy {setting}")
            version_dir = export(cfg)
            policy = saved_model.serving_policy(saved_model.read_pipeline_json(version_dir))
            exported.append(Served(setting, policy["name"], policy["variable_dtype"], version_dir,
                                   cfg.export.model_name))
    finally:
        keras.config.set_dtype_policy("float32")
    return exported, run_result.datasets


def write_digits_28(path: Path) -> Path:
    """scikit-learn's 1,797 digits as a Keras-format npz of 28x28 uint8 images: each 8x8 pixel (0-16) a 3x3 block
    scaled to 0-255, padded by 2 on each side, as MNIST's digits sit in their frame. Embedded data, no download."""
    import numpy as np
    from sklearn.datasets import load_digits

    digits = load_digits()
    images = np.kron(digits.images, np.ones((3, 3))) * (255 / 16)
    images = np.pad(images, ((0, 0), (2, 2), (2, 2))).round().astype(np.uint8)
    np.savez(path, x_train=images, y_train=digits.target.astype(np.uint8))
    return path


def _quality(exported: list[Served], datasets) -> dict[str, dict]:
    """Every validation row and the input-limit rows through each export's Runner, in this process."""
    import numpy as np

    from pipeline.diagnose.probes import edge_rows
    from serving.servable.runner import Runner

    limits, _ = edge_rows(datasets.statistics, datasets.spec.input_shape)
    val_x, val_y = datasets.validation_rows()
    answers, found = {}, {}
    for served in exported:
        runner = Runner.load(served.version_dir)
        try:
            answers[served.setting] = runner.predict({"features": val_x})["probabilities"]
            at_limits = runner.predict({"features": limits})
        finally:
            runner.close()
        finite = np.ones(len(limits), bool)
        for values in at_limits.values():
            finite &= np.isfinite(values.reshape(len(limits), -1)).all(axis=1)
        found[served.setting] = {"accuracy": float(np.mean(answers[served.setting].argmax(-1) == val_y)),
                                 "nonfinite_at_limits": int(np.sum(~finite))}
    for setting, probabilities in answers.items():
        found[setting]["max_abs_diff"] = float(np.max(np.abs(probabilities.astype(np.float64) - answers["float32"])))
    return found


def _speed_in_processes(exported: list[Served], rows_npy: Path, sizes: Sizes) -> dict[str, dict]:
    """One worker process per policy, loaded side by side; they take turns, in rotating order each round."""
    workers = {s.setting: subprocess.Popen([sys.executable, "-m", "bench.serving_precision", str(s.version_dir),
                                            str(rows_npy), *SERVER_THREADS],
                                           stdin=subprocess.PIPE, stdout=subprocess.PIPE, text=True)
               for s in exported}
    try:
        for setting, worker in workers.items():
            if worker.stdout.readline().strip() != "ready":
                raise RuntimeError(f"in-process worker for {setting} did not start (exit {worker.wait()})")

        def measure(setting: str, batch: int) -> float:
            workers[setting].stdin.write(f"{batch} {sizes.serving_precision_budget_s}\n")
            workers[setting].stdin.flush()
            return json.loads(workers[setting].stdout.readline())["seconds_per_call"]

        return _rounds(list(workers), sizes.serving_precision_rounds, measure)
    finally:
        for worker in workers.values():
            worker.stdin.close()
            worker.wait(timeout=60)


def _speed_inline(exported: list[Served], rows_npy: Path, sizes: Sizes) -> dict[str, dict]:
    """--quick: every policy's Runner in this process."""
    import numpy as np

    from serving.servable.runner import Runner

    rows = np.load(rows_npy)
    runners = {s.setting: Runner.load(s.version_dir) for s in exported}
    try:
        return _rounds(list(runners), sizes.serving_precision_rounds,
                       lambda setting, batch: _seconds_per_call(runners[setting], rows[:batch],
                                                                sizes.serving_precision_budget_s))
    finally:
        for runner in runners.values():
            runner.close()


def _rounds(settings: list[str], rounds: int, measure) -> dict[str, dict]:
    """{setting: {batch: {"rows_s": median rows/s, "speedup": median of each round's ratio to float32}}}."""
    seconds = {setting: {batch: [] for batch in BATCHES} for setting in settings}
    for round_number in range(rounds):
        shift = round_number % len(settings)
        for batch in BATCHES:  # the policies seconds apart, none always first: they share the machine's moods
            for setting in settings[shift:] + settings[:shift]:
                seconds[setting][batch].append(measure(setting, batch))
        timing.progress(f"serving precision: in-process round {round_number + 1}/{rounds}: " + ", ".join(
            f"{s} {64 / seconds[s][64][-1]:,.0f}/{1 / seconds[s][1][-1]:,.0f} rows/s" for s in settings))
    return {setting: {batch: {"rows_s": batch / timing.median(times),
                              "speedup": timing.median([f / t for f, t in zip(seconds["float32"][batch], times)])}
                      for batch, times in by_batch.items()} for setting, by_batch in seconds.items()}


def _seconds_per_call(runner, rows, budget_s: float, windows: int = 3) -> float:
    """The fastest of `windows` back-to-back windows sharing budget_s: the one other processes on this shared
    machine disturbed least (timeit's rule); the rounds' median then smooths what remains."""
    inputs = {"features": rows}
    calls = timing.calls_for(lambda: runner.predict(inputs), budget_s / windows)
    return min(timing.seconds_per_call(lambda: runner.predict(inputs), calls) for _ in range(windows))


def _servers(exported: list[Served], datasets, sizes: Sizes, work_dir: Path) -> dict[str, dict]:
    """One server per policy: resident memory once ready, then gRPC qps of 32 clients in rotating rounds."""
    from serving.client.grpc_client import predict_request

    batching_file = write_batching_parameters(work_dir, BATCHING)
    setups = [(["--model_name", s.model_name, "--model_base_path", str(s.version_dir.parent),
                "--file_system_poll_wait_seconds", "0", *SERVER_THREADS, "--enable_batching",
                "--batching_parameters_file", str(batching_file)], work_dir / f"server-{s.setting}.log", False)
              for s in exported]
    requests = {}
    for s in exported:
        requests[s.setting] = work_dir / f"request-{s.setting}.pb"
        requests[s.setting].write_bytes(predict_request(s.model_name, {"features": datasets.validation_rows(1)[0]}).SerializeToString())
    with running_servers(setups) as servers:
        by_setting = dict(zip([s.setting for s in exported], servers))
        found = {setting: {"rss_mib": rss_mib(server.process.pid)} for setting, server in by_setting.items()}
        timing.progress("serving precision: server RSS after load " + ", ".join(
            f"{setting} {info['rss_mib']} MiB" for setting, info in found.items()))
        qps, cpu_ms = {setting: [] for setting in by_setting}, {setting: [] for setting in by_setting}
        for round_number in range(sizes.serving_precision_qps_rounds):
            shift = round_number % len(exported)
            for setting in list(by_setting)[shift:] + list(by_setting)[:shift]:
                pid = by_setting[setting].process.pid
                before = cpu_seconds(pid)
                measured = load("grpc", by_setting[setting].grpc_address, requests[setting], CLIENTS, sizes, "")
                if measured["errors"]:
                    raise RuntimeError(f"{setting}: {measured['errors']} failed requests at {CLIENTS} clients")
                qps[setting].append(measured["qps"])
                # The clients run through warm-up and window alike: the server's CPU over both, per query.
                answered = measured["qps"] * (sizes.warmup_seconds + sizes.load_seconds)
                cpu_ms[setting].append((cpu_seconds(pid) - before) / answered * 1e3)
            timing.progress(f"serving precision: gRPC round {round_number + 1}: " + ", ".join(
                f"{s} {q[-1]:,.0f} qps ({cpu_ms[s][-1]:.2f} ms CPU/query)" for s, q in qps.items()))
    for setting, values in qps.items():
        found[setting].update(qps=timing.median(values), cpu_ms=timing.median(cpu_ms[setting]),
                              qps_ratio=timing.median([v / f for v, f in zip(values, qps["float32"])]))
    return found


def _rows(exported: list[Served], quality: dict, speed: dict, servers: dict) -> list[dict]:
    variables = {s.setting: sum(f.stat().st_size for f in (s.version_dir / "variables").iterdir()) for s in exported}
    rows = []
    for s in exported:
        rows.append({
            "serving_policy": f"{s.policy} (trained)" if s.setting == "trained" else s.policy, "weights": s.weights,
            "variables_mib": variables[s.setting] / 2**20, "variables_ratio": variables[s.setting] / variables["float32"],
            "server_rss_mib": servers[s.setting]["rss_mib"],
            "rss_saved_mib": servers["float32"]["rss_mib"] - servers[s.setting]["rss_mib"],
            "rows_s_batch64": speed[s.setting][64]["rows_s"], "speedup_batch64": speed[s.setting][64]["speedup"],
            "rows_s_batch1": speed[s.setting][1]["rows_s"], "speedup_batch1": speed[s.setting][1]["speedup"],
            "grpc_qps_32": servers[s.setting]["qps"], "qps_ratio": servers[s.setting]["qps_ratio"],
            "server_cpu_ms_per_query": servers[s.setting]["cpu_ms"],
            "val_accuracy": quality[s.setting]["accuracy"],
            "accuracy_delta_pt": (quality[s.setting]["accuracy"] - quality["float32"]["accuracy"]) * 100,
            "max_abs_diff": quality[s.setting]["max_abs_diff"],
            "nonfinite_at_limits": quality[s.setting]["nonfinite_at_limits"]})
    _judge(rows, variables["float32"] / 2**20)
    return rows


def _judge(rows: list[dict], float32_variables_mib: float) -> None:
    """Fills target and target_met: accuracy and input limits on every row, the speed and size targets on bfloat16."""
    for row in rows:
        checks = {f"accuracy within 0.5 pt ({row['accuracy_delta_pt']:+.2f})": abs(row["accuracy_delta_pt"]) <= 0.5,
                  f"0 NaN/Inf at the input limits ({row['nonfinite_at_limits']})": row["nonfinite_at_limits"] == 0}
        if row["weights"] == "bfloat16":
            saved_needed = 0.4 * float32_variables_mib
            checks.update({
                f"variables <= 0.52x ({row['variables_ratio']:.2f}x)": row["variables_ratio"] <= 0.52,
                f">= 1.6x batch 64 ({row['speedup_batch64']:.2f}x)": row["speedup_batch64"] >= 1.6,
                f">= 1.2x batch 1 ({row['speedup_batch1']:.2f}x)": row["speedup_batch1"] >= 1.2,
                f"qps >= float32's ({row['qps_ratio']:.2f}x)": row["qps_ratio"] >= 1.0,
                f"RSS >= {saved_needed:.1f} MiB below float32's ({row['rss_saved_mib']:.1f})":
                    row["rss_saved_mib"] is not None and row["rss_saved_mib"] >= saved_needed})
        row["target"] = ", ".join(checks)
        row["target_met"] = all(checks.values())


def _notes() -> list[str]:
    import tensorflow as tf

    gpus = tf.config.list_physical_devices("GPU")
    device = (f"on the GPU ({len(gpus)} visible): float16 weights are what Tensor Cores compute" if gpus else
              "on this CPU only: no GPU was available to this run (no device machine was lent to the task that "
              "measured it), so the float16 row shows float16 on a CPU, not on the Tensor-Core GPU it is meant for")
    return [f"Measured {device}.",
            "mixed_float16 (trained) is what `make demo` serves (`export.serving_policy: trained`); float16 and "
            "bfloat16 are `export.serving_policy: float16`/`bfloat16` of the same trained weights."]


def _worker(version_dir: str, rows_npy: str, intra: int, inter: int) -> None:
    """A measuring process: loads one version, prints "ready", then answers each "BATCH BUDGET" line on stdin
    with {"seconds_per_call": ...}."""
    import numpy as np
    import tensorflow as tf

    tf.config.threading.set_intra_op_parallelism_threads(intra)
    tf.config.threading.set_inter_op_parallelism_threads(inter)
    from serving.servable.runner import Runner

    runner = Runner.load(version_dir)
    rows = np.load(rows_npy)
    for batch in BATCHES:  # traces and warms every shape before the first timed call
        _seconds_per_call(runner, rows[:batch], 0.05)
    print("ready", flush=True)
    for line in sys.stdin:
        batch, budget = line.split()
        print(json.dumps({"seconds_per_call": _seconds_per_call(runner, rows[:int(batch)], float(budget))}), flush=True)
    runner.close()


def plot(figure: dict, ax) -> None:
    import numpy as np

    rows = figure["rows"]
    measures = [("variables_ratio", "variables"), ("speedup_batch64", "rows/s b64"), ("speedup_batch1", "rows/s b1"),
                ("qps_ratio", "gRPC qps")]
    positions = np.arange(len(measures))
    width = 0.8 / len(rows)
    for i, row in enumerate(rows):
        ax.bar(positions + (i - (len(rows) - 1) / 2) * width, [row[key] or 0 for key, _ in measures], width,
               label=row["serving_policy"].replace(" (trained)", "*"))
    ax.axhline(1.0, color="black", linewidth=0.8)
    ax.set_xticks(positions, [label for _, label in measures], fontsize=7)
    ax.set_ylabel("ratio to float32")
    ax.set_title("7. serving precision (* = trained policy)", fontsize=9)
    ax.legend(fontsize=6)


if __name__ == "__main__":  # python -m bench.serving_precision VERSION_DIR ROWS_NPY [server thread flags]
    import argparse

    parser = argparse.ArgumentParser()
    parser.add_argument("version_dir")
    parser.add_argument("rows_npy")
    parser.add_argument("--tensorflow_intra_op_parallelism", type=int, default=0)
    parser.add_argument("--tensorflow_inter_op_parallelism", type=int, default=0)
    arguments = parser.parse_args()
    _worker(arguments.version_dir, arguments.rows_npy, arguments.tensorflow_intra_op_parallelism,
            arguments.tensorflow_inter_op_parallelism)
