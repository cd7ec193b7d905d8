"""Figure 4: gRPC (and REST) Predict with single-example requests from concurrent clients.

Two `python -m serving` subprocesses (started together, measured one after the other) serve the
bench model, one with batching off and one with BATCHING below; load-generator processes
(bench.loadgen) run 1..64 clients for a fixed window after a warm-up. The yardstick is the same
model in-process: Runner.predict at a large batch is the most rows/s this machine can compute (the
physical limit), and Runner.predict of one row is the least latency a request can have. A second
yardstick is the transport ceiling: the same load against a Python gRPC server whose Predict does
nothing (bench.echo_server).
"""

from __future__ import annotations

import json
import subprocess
import sys
import time
from pathlib import Path

from bench import timing
from bench.exported_model import exported_model
from bench.server_processes import running_servers
from bench.workloads import Sizes

TITLE = "Serving: single-example Predict requests from concurrent clients"
TARGET = ("batching on: >= 4x unbatched qps at 32 clients and >= 50% of the in-process limit; "
          "p50 at 1 client <= in-process batch-1 latency + 1 ms")
COLUMNS = ["protocol", "batching", "clients", "qps", "p50_ms", "p90_ms", "p99_ms", "share_of_limit",
           "speedup_vs_unbatched", "errors", "target", "target_met"]
# TF Serving's advice for throughput on CPU: batch threads = cores; a batch up to the largest client
# count; no timeout, so a batch closes as soon as a batch thread is free (no added latency at low load).
BATCHING = {"max_batch_size": 64, "batch_timeout_micros": 0, "max_enqueued_batches": 64}
MAX_LOADGEN_PROCESSES = 4


def run(sizes: Sizes, work_dir: Path) -> dict:
    import os

    model = exported_model(sizes, work_dir)
    limit = in_process_limit(model, sizes.limit_batch)
    timing.progress(f"serving: in-process limit {limit['examples_per_second']:.0f} examples/s at batch "
                    f"{sizes.limit_batch}, batch-1 latency {limit['batch1_ms']:.3f} ms")
    grpc_request, rest_request = _write_requests(model, work_dir)
    batching = {**BATCHING, "num_batch_threads": os.cpu_count() or 1}
    batching_file = work_dir / "batching_parameters.txt"
    batching_file.write_text("".join(f"{key} {{ value: {value} }}\n" for key, value in batching.items()))
    flags = ["--model_name", model.model_name, "--model_base_path", str(model.base_path),
             "--file_system_poll_wait_seconds", "0"]
    modes = {"off": [], "on": ["--enable_batching", "--batching_parameters_file", str(batching_file)]}
    rows = []
    with running_servers([(flags + extra, work_dir / f"server-batching-{mode}.log", True)
                          for mode, extra in modes.items()]) as servers:
        for mode, server in zip(modes, servers):
            rows += _measure_server(server, mode, model, sizes, limit, grpc_request, rest_request)
    rows += _measure_transport_ceiling(work_dir, sizes, limit, grpc_request)
    _judge(rows, limit)
    return {"rows": rows, "in_process": limit, "batching_parameters": batching,
            "setup": {"model": str(model.base_path), "policy": model.policy, "window_s": sizes.load_seconds,
                      "warmup_s": sizes.warmup_seconds, "loadgen_processes_max": MAX_LOADGEN_PROCESSES}}


def _measure_server(server, mode: str, model, sizes: Sizes, limit: dict, grpc_request: Path,
                    rest_request: Path) -> list[dict]:
    rows = []
    for protocol, clients_list, address, request in (
            ("grpc", sizes.grpc_clients, server.grpc_address, grpc_request),
            ("rest", sizes.rest_clients, server.rest_address, rest_request)):
        for clients in clients_list:
            measured = _load(protocol, address, request, clients, sizes, f"/v1/models/{model.model_name}:predict")
            rows.append({"protocol": protocol, "batching": mode, "clients": clients, **measured,
                         "share_of_limit": measured["qps"] / limit["examples_per_second"]})
            timing.progress(f"serving: {protocol} batching {mode}, {clients} clients: "
                            f"{measured['qps']:.0f} qps, p50 {measured['p50_ms']:.2f} ms")
    return rows


def _measure_transport_ceiling(work_dir: Path, sizes: Sizes, limit: dict, grpc_request: Path) -> list[dict]:
    """The same load against bench.echo_server, at the fewest and the most clients."""
    rows = []
    with running_servers([([], work_dir / "echo-server.log", False)], module="bench.echo_server") as (echo,):
        for clients in (sizes.grpc_clients[0], sizes.grpc_clients[-1]):
            measured = _load("grpc", echo.grpc_address, grpc_request, clients, sizes, "")
            rows.append({"protocol": "grpc no-op server", "batching": "off", "clients": clients, **measured,
                         "share_of_limit": measured["qps"] / limit["examples_per_second"]})
            timing.progress(f"serving: no-op gRPC server (transport ceiling), {clients} clients: "
                            f"{measured['qps']:.0f} qps, p50 {measured['p50_ms']:.2f} ms")
    return rows


def in_process_limit(model, batch: int) -> dict:
    """Runner.predict in this process: rows/s at a large batch and the latency of one row."""
    import numpy as np

    from serving.runner import Runner

    runner = Runner.load(model.base_path)
    try:
        big = {model.input_name: np.resize(model.rows, (batch, *model.rows.shape[1:])).astype(np.float32)}
        one = {model.input_name: model.rows[:1]}
        runner.predict(big), runner.predict(one)
        calls = timing.calls_for(lambda: runner.predict(big), 0.3)
        per_batch = timing.median([timing.seconds_per_call(lambda: runner.predict(big), calls) for _ in range(3)])
        calls = timing.calls_for(lambda: runner.predict(one), 0.3)
        per_row = timing.median([timing.seconds_per_call(lambda: runner.predict(one), calls) for _ in range(3)])
    finally:
        runner.close()
    return {"batch": batch, "examples_per_second": batch / per_batch, "batch1_ms": per_row * 1e3}


def _write_requests(model, work_dir: Path) -> tuple[Path, Path]:
    """One single-row PredictRequest (built by serving.client), serialized once: as protobuf bytes and
    as a REST JSON body."""
    from serving.client import predict_request

    row = model.rows[:1]
    request = predict_request(model.model_name, {model.input_name: row})
    grpc_path, rest_path = work_dir / "request.pb", work_dir / "request.json"
    grpc_path.write_bytes(request.SerializeToString())
    rest_path.write_text(json.dumps({"instances": row.tolist()}))
    return grpc_path, rest_path


def _load(protocol: str, address: str, request: Path, clients: int, sizes: Sizes, rest_path: str) -> dict:
    """Runs `clients` clients in up to MAX_LOADGEN_PROCESSES processes; qps and latency percentiles."""
    processes = min(clients, MAX_LOADGEN_PROCESSES)
    threads = [clients // processes + (i < clients % processes) for i in range(processes)]
    workers = []
    for count in threads:
        spec = {"protocol": protocol, "address": address, "request_file": str(request), "threads": count,
                "warmup_s": sizes.warmup_seconds, "duration_s": sizes.load_seconds, "path": rest_path}
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
    return {"qps": completed / sizes.load_seconds,
            "p50_ms": timing.percentile(latencies, 0.50) * 1e3, "p90_ms": timing.percentile(latencies, 0.90) * 1e3,
            "p99_ms": timing.percentile(latencies, 0.99) * 1e3,
            "errors": sum(result["errors"] for result in results)}


def _judge(rows: list[dict], limit: dict) -> None:
    """Fills speedup_vs_unbatched, target and target_met (None where no target applies)."""
    unbatched = {(r["protocol"], r["clients"]): r["qps"] for r in rows if r["batching"] == "off"}
    for row in rows:
        if row["protocol"] not in ("grpc", "rest"):  # the no-op server: a yardstick, not the product
            row.update(speedup_vs_unbatched=None, target="(transport ceiling)", target_met=None)
            continue
        row["speedup_vs_unbatched"] = (row["qps"] / unbatched[row["protocol"], row["clients"]]
                                       if row["batching"] == "on" and unbatched.get((row["protocol"], row["clients"]))
                                       else None)
        row["target"], row["target_met"] = None, None
        if row["clients"] == 1:
            bound = limit["batch1_ms"] + 1.0
            row["target"] = f"p50 <= {bound:.2f} ms"
            row["target_met"] = row["p50_ms"] <= bound
        elif row["clients"] == 32 and row["batching"] == "on":
            row["target"] = ">= 4x unbatched, >= 50% of limit"
            row["target_met"] = bool(row["speedup_vs_unbatched"] and row["speedup_vs_unbatched"] >= 4
                                     and row["share_of_limit"] >= 0.5)


def plot(figure: dict, ax) -> None:
    for (protocol, mode), style in {("grpc", "off"): "o--", ("grpc", "on"): "o-", ("rest", "off"): "s--",
                                    ("rest", "on"): "s-", ("grpc no-op server", "off"): "k^:"}.items():
        rows = [r for r in figure["rows"] if r["protocol"] == protocol and r["batching"] == mode]
        if rows:
            label = protocol if protocol.endswith("server") else f"{protocol}, batching {mode}"
            ax.plot([r["clients"] for r in rows], [r["qps"] for r in rows], style, label=label)
    ax.axhline(figure["in_process"]["examples_per_second"], color="red", linestyle=":", linewidth=0.8,
               label="in-process limit")
    ax.set_xscale("log", base=2)
    ax.set_yscale("log")
    ax.set_xlabel("concurrent clients")
    ax.set_ylabel("queries/s")
    ax.set_title("4. serving throughput", fontsize=9)
    ax.legend(fontsize=6)
