"""Figure 6: several `python -m serving` processes sharing one port (--reuse_port), 1, 2, 4, ... of them.

One process runs its Python (event loops, proto parsing, request checks) on one core at a time; the
documented way to use a bigger machine is several processes on the same port, each with its own
batcher and a share of the cores for TensorFlow (docs/operations.md "Several processes on one
port"). Each step starts N processes on one free port (batching as figure 4, intra-op threads =
cores / N) and runs 32 single-row gRPC clients per process, each client on its own connection, which
the kernel spreads over the processes. The yardstick is the same load against one process, in the
same run. The target (>= 0.7 N times one process) is judged only where the machine has 4 N cores or
more: with fewer, the processes and the load generator share cores and the ratio says nothing.
"""

from __future__ import annotations

import os
from pathlib import Path

from bench import timing
from bench.exported_model import exported_model
from bench.server_processes import free_port, running_servers
from bench.serving_throughput import BATCHING, load, write_batching_parameters, write_requests
from bench.workloads import Sizes

TITLE = "Scale-out: N server processes on one port (--reuse_port), 32 gRPC clients per process"
TARGET = ">= 0.7 x N times one process's queries/s (judged on machines with >= 4 N cores)"
COLUMNS = ["processes", "clients", "qps", "p50_ms", "p99_ms", "errors", "scaling", "target", "target_met"]
CLIENTS_PER_PROCESS = 32


def run(sizes: Sizes, work_dir: Path) -> dict:
    model = exported_model(sizes, work_dir, kind="guide")
    grpc_request, _ = write_requests(model, work_dir)
    batching_file = write_batching_parameters(work_dir, BATCHING)
    cores = os.cpu_count() or 1
    rows = []
    for processes in sizes.scaling_processes:
        port = free_port()
        flags = ["--model_name", model.model_name, "--model_base_path", str(model.base_path),
                 "--file_system_poll_wait_seconds", "0", "--enable_batching",
                 "--batching_parameters_file", str(batching_file), "--reuse_port", "--port", str(port),
                 "--tensorflow_intra_op_parallelism", str(max(cores // processes, 1))]
        with running_servers([(flags, work_dir / f"scaling-{processes}-{i}.log", False)
                              for i in range(processes)]):
            clients = CLIENTS_PER_PROCESS * processes
            measured = load("grpc", f"127.0.0.1:{port}", grpc_request, clients, sizes, "",
                            max_processes=2 * processes + 2)
        rows.append({"processes": processes, "clients": clients, **measured})
        timing.progress(f"scaling: {processes} process(es), {clients} clients: {measured['qps']:.0f} qps, "
                        f"p50 {measured['p50_ms']:.2f} ms")
    _judge(rows, cores)
    return {"rows": rows, "batching_parameters": BATCHING, "cores": cores}


def _judge(rows: list[dict], cores: int) -> None:
    one = next((row["qps"] for row in rows if row["processes"] == 1), None)
    for row in rows:
        n = row["processes"]
        row["scaling"] = row["qps"] / one if one else None
        row["target"], row["target_met"] = None, None
        if n > 1:
            row["target"] = f">= {0.7 * n:.1f}x one process" + ("" if cores >= 4 * n else
                                                                  f" (not judged: {cores} cores < {4 * n})")
            if cores >= 4 * n and row["scaling"] is not None:
                row["target_met"] = row["scaling"] >= 0.7 * n


def plot(figure: dict, ax) -> None:
    rows = figure["rows"]
    if not rows:
        return
    ax.plot([r["processes"] for r in rows], [r["qps"] for r in rows], "o-", label="measured")
    one = rows[0]["qps"] if rows[0]["processes"] == 1 else None
    if one:
        ax.plot([r["processes"] for r in rows], [0.7 * r["processes"] * one for r in rows], "k:",
                label="target 0.7 N x one")
    ax.set_xlabel("server processes on one port")
    ax.set_ylabel("queries/s")
    ax.set_title(f"6. scale-out ({figure.get('cores', '?')} cores)", fontsize=9)
    ax.legend(fontsize=6)
