"""Figure 4: gRPC (and REST) Predict with single-example requests from concurrent clients.

The model is the mixed-precision guide's MLP (784 -> 1024 -> 1024 -> 10 under mixed_float16), the one
the serving targets were set on. Two `python -m serving` subprocesses (started together, measured one
after the other) serve it, one with batching off and one with BATCHING below; load-generator
processes (bench.loadgen) run 1..64 clients for a fixed window after a warm-up. Yardsticks, measured
in the same run: the same model in-process (Runner.predict at batch limit_batch: the most rows/s
this machine computes; of one row: the least latency a request can have), and the transport ceiling,
the same load against Python gRPC servers whose Predict does nothing (bench.echo_server: the
thread-pool front end and grpc.aio, ours; the ceiling is the faster of the two).
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
import time
from pathlib import Path
from typing import Callable

from bench import timing
from bench.exported_model import exported_model
from bench.server_processes import running_servers
from bench.workloads import Sizes

TITLE = "Serving: single-example Predict requests from concurrent clients (the guide's MLP, mixed_float16)"
TARGET = ("at 32 clients with batching: gRPC >= 80% of the no-op server's qps, >= 4x batching off, REST >= 70% "
          "of gRPC; p50 at 1 client <= in-process batch-1 latency + 0.3 ms (+ batch_timeout with batching)")
COLUMNS = ["protocol", "batching", "clients", "qps", "p50_ms", "p90_ms", "p99_ms", "share_of_limit",
           "speedup_vs_unbatched", "errors", "target", "target_met"]
# TF Serving's batching knobs (serving/batching/parameters.py). No timeout: a batch closes as soon as a
# batch thread is free, so a lone request waits for nothing and batches grow with the load (while one
# batch runs, the next fills). Each batch runs on one core (SERVER_THREADS), and one core in two is left
# to the front end's event loops and the load generator.
BATCHING = {"max_batch_size": 64, "batch_timeout_micros": 0, "max_enqueued_batches": 64,
            "num_batch_threads": max((os.cpu_count() or 1) // 2, 1)}
# docs/operations.md "Threads": one intra-op thread per model call. On a few cores TensorFlow's default
# pool (one thread per core for every call) makes each call slower, not faster, once requests or batches
# run side by side. The servers and the in-process yardstick use the same setting.
SERVER_THREADS = ["--tensorflow_intra_op_parallelism", "1", "--tensorflow_inter_op_parallelism", "1"]
MAX_LOADGEN_PROCESSES = 4
ECHO_SERVERS = {"grpc no-op server (threads)": [], "grpc no-op server (aio)": ["--aio"]}


def run(sizes: Sizes, work_dir: Path) -> dict:
    model = exported_model(sizes, work_dir, kind="guide")
    limit = in_process_limit(model, sizes.limit_batch)
    timing.progress(f"serving: in-process limit {limit['examples_per_second']:.0f} examples/s at batch "
                    f"{sizes.limit_batch}, batch-1 latency {limit['batch1_ms']:.3f} ms")
    grpc_request, rest_request = write_requests(model, work_dir)
    batching_file = write_batching_parameters(work_dir, BATCHING)
    flags = ["--model_name", model.model_name, "--model_base_path", str(model.base_path),
             "--file_system_poll_wait_seconds", "0", *SERVER_THREADS]
    modes = {"off": [], "on": ["--enable_batching", "--batching_parameters_file", str(batching_file)]}
    rows = []
    with running_servers([(flags + extra, work_dir / f"server-batching-{mode}.log", True)
                          for mode, extra in modes.items()]) as servers:
        for mode, server in zip(modes, servers):
            rows += _measure_server(server, mode, model, sizes, limit, grpc_request, rest_request)
    rows += _measure_transport_ceiling(work_dir, sizes, limit, grpc_request)
    _judge(rows, limit, BATCHING["batch_timeout_micros"] / 1e3)
    return {"rows": rows, "in_process": limit, "batching_parameters": BATCHING,
            "setup": {"model": str(model.base_path), "policy": model.policy, "window_s": sizes.load_seconds,
                      "warmup_s": sizes.warmup_seconds, "loadgen_processes_max": MAX_LOADGEN_PROCESSES}}


def write_batching_parameters(work_dir: Path, parameters: dict) -> Path:
    """A --batching_parameters_file (TF Serving's BatchingParameters text proto) with these values."""
    path = work_dir / "batching_parameters.txt"
    path.write_text("".join(f"{key} {{ value: {value} }}\n" for key, value in parameters.items()))
    return path


def _measure_server(server, mode: str, model, sizes: Sizes, limit: dict, grpc_request: Path,
                    rest_request: Path) -> list[dict]:
    rows = []
    for protocol, clients_list, address, request in (
            ("grpc", sizes.grpc_clients, server.grpc_address, grpc_request),
            ("rest", sizes.rest_clients, server.rest_address, rest_request)):
        for clients in clients_list:
            measured = load(protocol, address, request, clients, sizes, f"/v1/models/{model.model_name}:predict")
            rows.append({"protocol": protocol, "batching": mode, "clients": clients, **measured,
                         "share_of_limit": measured["qps"] / limit["examples_per_second"]})
            timing.progress(f"serving: {protocol} batching {mode}, {clients} clients: "
                            f"{measured['qps']:.0f} qps, p50 {measured['p50_ms']:.2f} ms")
    return rows


def _measure_transport_ceiling(work_dir: Path, sizes: Sizes, limit: dict, grpc_request: Path) -> list[dict]:
    """The same load against both bench.echo_server front ends, at the fewest and the most clients."""
    rows = []
    with running_servers([(flags, work_dir / f"echo-server-{i}.log", False) for i, flags in
                          enumerate(ECHO_SERVERS.values())], module="bench.echo_server") as echoes:
        for name, echo in zip(ECHO_SERVERS, echoes):
            for clients in sorted({sizes.grpc_clients[0], 32 if 32 in sizes.grpc_clients else sizes.grpc_clients[-1],
                                   sizes.grpc_clients[-1]}):
                measured = load("grpc", echo.grpc_address, grpc_request, clients, sizes, "")
                rows.append({"protocol": name, "batching": "off", "clients": clients, **measured,
                             "share_of_limit": measured["qps"] / limit["examples_per_second"]})
                timing.progress(f"serving: {name} (transport ceiling), {clients} clients: "
                                f"{measured['qps']:.0f} qps, p50 {measured['p50_ms']:.2f} ms")
    return rows


def in_process_limit(model, batch: int) -> dict:
    """Runner.predict in a fresh process with the servers' TensorFlow threads (SERVER_THREADS): rows/s at
    `batch` and the latency of one row."""
    output = subprocess.run([sys.executable, "-m", "bench.serving_throughput", str(model.base_path), model.input_name,
                             str(batch), *SERVER_THREADS], check=True, capture_output=True, text=True).stdout
    return json.loads(output.splitlines()[-1])


def _measure_in_process(base_path: str, input_name: str, batch: int) -> dict:
    import numpy as np

    from serving.servable.runner import Runner

    runner = Runner.load(base_path)
    try:
        width = runner.signature_defs["serving_default"].inputs[input_name].tensor_shape.dim[1].size
        rows = np.random.default_rng(0).random((batch, width), np.float32)
        big, one = {input_name: rows}, {input_name: rows[:1]}
        runner.predict(big), runner.predict(one)
        calls = timing.calls_for(lambda: runner.predict(big), 0.3)
        per_batch = timing.median([timing.seconds_per_call(lambda: runner.predict(big), calls) for _ in range(3)])
        calls = timing.calls_for(lambda: runner.predict(one), 0.3)
        per_row = timing.median([timing.seconds_per_call(lambda: runner.predict(one), calls) for _ in range(3)])
    finally:
        runner.close()
    return {"batch": batch, "examples_per_second": batch / per_batch, "batch1_ms": per_row * 1e3}


def write_requests(model, work_dir: Path) -> tuple[Path, Path]:
    """One single-row PredictRequest (built by serving.client), serialized once: as protobuf bytes and
    as a REST JSON body."""
    from serving.client.grpc_client import predict_request

    row = model.rows[:1]
    request = predict_request(model.model_name, {model.input_name: row})
    grpc_path, rest_path = work_dir / "request.pb", work_dir / "request.json"
    grpc_path.write_bytes(request.SerializeToString())
    rest_path.write_text(json.dumps({"instances": row.tolist()}))
    return grpc_path, rest_path


def load(protocol: str, address: str, request: Path, clients: int, sizes: Sizes, rest_path: str,
         max_processes: int = MAX_LOADGEN_PROCESSES, late_answers: bool = False,
         until: Callable[[float], float] | None = None) -> dict:
    """Runs `clients` clients in up to max_processes processes; qps and latency percentiles.

    late_answers: latencies of every request sent in the window, also those answered after it (bench/loadgen.py);
    the result then has the slowest, max_ms.
    until: instead of sizes.load_seconds, the window ends when until(the window's start time) returns; it returns
    the end time (figure 10 runs its attack in it). The result then has the window's seconds, window_s.
    """
    processes = min(clients, max_processes)
    threads = [clients // processes + (i < clients % processes) for i in range(processes)]
    workers = []
    for count in threads:
        spec = {"protocol": protocol, "address": address, "request_file": str(request), "threads": count,
                "warmup_s": sizes.warmup_seconds, "duration_s": None if until else sizes.load_seconds,
                "path": rest_path, "late_answers": late_answers}
        workers.append(subprocess.Popen([sys.executable, "-m", "bench.loadgen", json.dumps(spec)],
                                        stdin=subprocess.PIPE, stdout=subprocess.PIPE, text=True))
    try:
        for worker in workers:
            if worker.stdout.readline().strip() != "ready":
                raise RuntimeError(f"load generator for {protocol} at {address} did not start (exit {worker.wait()})")
        start = time.time() + 0.2
        for worker in workers:
            worker.stdin.write(f"{start}\n")
            worker.stdin.flush()
        window = sizes.load_seconds
        if until is not None:
            end = until(start + sizes.warmup_seconds)
            window = end - start - sizes.warmup_seconds
            for worker in workers:
                worker.stdin.write(f"{end}\n")
                worker.stdin.flush()
        results = [json.loads(worker.stdout.readline()) for worker in workers]
    except BaseException:
        for worker in workers:
            worker.kill()
        raise
    finally:
        for worker in workers:
            worker.wait()
    latencies = sorted(x for result in results for x in result["latencies"])
    completed = sum(result["completed"] for result in results)
    return {"qps": completed / window, **({"window_s": window} if until is not None else {}),
            "p50_ms": timing.percentile(latencies, 0.50) * 1e3, "p90_ms": timing.percentile(latencies, 0.90) * 1e3,
            "p99_ms": timing.percentile(latencies, 0.99) * 1e3,
            **({"max_ms": latencies[-1] * 1e3 if latencies else float("nan")} if late_answers else {}),
            "errors": sum(result["errors"] for result in results)}


def _judge(rows: list[dict], limit: dict, batch_timeout_ms: float) -> None:
    """Fills speedup_vs_unbatched, target and target_met (None where no target applies)."""
    def qps(protocol: str, batching: str, clients: int) -> float | None:
        return next((r["qps"] for r in rows if (r["protocol"], r["batching"], r["clients"]) ==
                     (protocol, batching, clients)), None)

    ceiling_32 = max((r["qps"] for r in rows if r["protocol"].startswith("grpc no-op") and r["clients"] == 32),
                     default=None)
    for row in rows:
        row.update(speedup_vs_unbatched=None, target=None, target_met=None)
        if row["protocol"] not in ("grpc", "rest"):  # the no-op servers: yardsticks, not the product
            row["target"] = "(transport ceiling)"
            continue
        unbatched = qps(row["protocol"], "off", row["clients"])
        if row["batching"] == "on" and unbatched:
            row["speedup_vs_unbatched"] = row["qps"] / unbatched
        if row["clients"] == 1:
            bound = limit["batch1_ms"] + 0.3 + (batch_timeout_ms if row["batching"] == "on" else 0.0)
            row["target"] = f"p50 <= {bound:.2f} ms"
            row["target_met"] = row["p50_ms"] <= bound
        elif row["clients"] == 32 and row["batching"] == "on" and row["protocol"] == "grpc":
            ok_speedup = bool(row["speedup_vs_unbatched"] and row["speedup_vs_unbatched"] >= 4)
            ok_ceiling = bool(ceiling_32 and row["qps"] >= 0.8 * ceiling_32)
            row["target"] = (f">= 4x unbatched ({row['speedup_vs_unbatched'] or 0:.1f}x), >= 80% of the no-op "
                             f"server ({row['qps'] / ceiling_32:.0%})" if ceiling_32 else ">= 4x unbatched")
            row["target_met"] = ok_speedup and ok_ceiling
        elif row["clients"] == 32 and row["batching"] == "on" and row["protocol"] == "rest":
            grpc_qps = qps("grpc", "on", 32)
            row["target"] = f">= 70% of gRPC ({row['qps'] / grpc_qps:.0%})" if grpc_qps else ">= 70% of gRPC"
            row["target_met"] = bool(grpc_qps and row["qps"] >= 0.7 * grpc_qps)


def plot(figure: dict, ax) -> None:
    for (protocol, mode), style in {("grpc", "off"): "o--", ("grpc", "on"): "o-", ("rest", "off"): "s--",
                                    ("rest", "on"): "s-", ("grpc no-op server (threads)", "off"): "k^:",
                                    ("grpc no-op server (aio)", "off"): "kv:"}.items():
        rows = [r for r in figure["rows"] if r["protocol"] == protocol and r["batching"] == mode]
        if rows:
            label = protocol if protocol.startswith("grpc no-op") else f"{protocol}, batching {mode}"
            ax.plot([r["clients"] for r in rows], [r["qps"] for r in rows], style, label=label)
    ax.axhline(figure["in_process"]["examples_per_second"], color="red", linestyle=":", linewidth=0.8,
               label="in-process limit")
    qps_axes(ax, "4. serving throughput")


def qps_axes(ax, title: str) -> None:
    """Queries/s against concurrent clients, both on log scales (figure 4 and the peers)."""
    ax.set_xscale("log", base=2)
    ax.set_yscale("log")
    ax.set_xlabel("concurrent clients")
    ax.set_ylabel("queries/s")
    ax.set_title(title, fontsize=9)
    ax.legend(fontsize=6)


if __name__ == "__main__":  # python -m bench.serving_throughput BASE_PATH INPUT BATCH [server thread flags]
    import argparse

    parser = argparse.ArgumentParser()
    for name in ("base_path", "input_name"):
        parser.add_argument(name)
    parser.add_argument("batch", type=int)
    parser.add_argument("--tensorflow_intra_op_parallelism", type=int, default=0)
    parser.add_argument("--tensorflow_inter_op_parallelism", type=int, default=0)
    arguments = parser.parse_args()
    import tensorflow as tf

    if arguments.tensorflow_intra_op_parallelism:
        tf.config.threading.set_intra_op_parallelism_threads(arguments.tensorflow_intra_op_parallelism)
    if arguments.tensorflow_inter_op_parallelism:
        tf.config.threading.set_inter_op_parallelism_threads(arguments.tensorflow_inter_op_parallelism)
    print(json.dumps(_measure_in_process(arguments.base_path, arguments.input_name, arguments.batch)))

