"""Figure 5: peak resident memory of the model server with one and with three loaded versions, and
peak device memory per policy (from figure 2's subprocesses) when there is a GPU.

Every loaded version answers the same requests (single rows and a batch of 64) before VmHWM is
read, so the peak includes serving, not only loading.
"""

from __future__ import annotations

from pathlib import Path

from bench import timing
from bench.exported_model import exported_model
from bench.server_processes import running_server
from bench.workloads import Sizes

TITLE = "Memory: model server peak RSS by loaded versions; device memory per policy"
TARGET = None
COLUMNS = ["what", "versions", "peak_rss_mib", "ratio_to_one_version", "peak_device_mib"]
REQUESTS = 50


def run(sizes: Sizes, work_dir: Path, precision_rows: list[dict] | None) -> dict:
    """One server: started with version 1 only, then its config file is changed to all three versions
    (--model_config_file_poll_wait_seconds reloads it). Peak RSS only grows, so the second reading is
    the peak with three versions loaded and serving."""
    model = exported_model(sizes, work_dir, versions=3)
    config_file = work_dir / "memory.config"
    _write_config(config_file, model, "specific { versions: 1 }")
    peaks = {}
    with running_server(["--model_config_file", str(config_file), "--model_config_file_poll_wait_seconds", "0.5",
                         "--file_system_poll_wait_seconds", "0"], work_dir / "server-memory.log") as server:
        for versions in (1, 3):
            if versions == 3:
                _write_config(config_file, model, "all {}")
                for version in (1, 2, 3):  # the server loads the new versions one by one, newest first
                    _wait_for_version(server.grpc_address, model, version)
            _exercise(server.grpc_address, model, versions)
            peaks[versions] = server.peak_rss_mib()
            timing.progress(f"memory: {versions} version(s) loaded: server peak RSS {peaks[versions]} MiB")
    rows = [{"what": "server peak RSS", "versions": v, "peak_rss_mib": peak,
             "ratio_to_one_version": peak / peaks[1] if peak and peaks[1] else None, "peak_device_mib": None}
            for v, peak in peaks.items()]
    for row in precision_rows or []:
        rows.append({"what": f"training+inference, {row['model']} {row['policy']}", "versions": None,
                     "peak_rss_mib": row["peak_rss_mib"], "ratio_to_one_version": None,
                     "peak_device_mib": row["peak_device_mib"] if row["peak_device_mib"] is not None else "n/a (CPU)"})
    return {"rows": rows, "setup": {"requests_per_version": REQUESTS,
                                    "note": "per-policy RSS is the precision subprocess of that model and policy"}}


def _write_config(path: Path, model, version_policy: str) -> None:
    from pipeline import artifacts

    artifacts.write_text_atomic(path, f"model_config_list {{ config {{ name: '{model.model_name}' "
                                      f"base_path: '{model.base_path}' model_platform: 'tensorflow' "
                                      f"model_version_policy {{ {version_policy} }} }} }}\n")


def _wait_for_version(address: str, model, version: int, timeout_s: float = 120.0) -> None:
    import time

    import grpc

    from serving.client.grpc_client import predict_rows

    deadline = time.monotonic() + timeout_s
    while True:
        try:
            predict_rows(address, model.model_name, model.input_name, model.rows[:1], batch_size=1, version=version)
            return
        except grpc.RpcError:
            if time.monotonic() > deadline:
                raise RuntimeError(f"version {version} did not become available within {timeout_s:.0f} s") from None
            time.sleep(0.2)


def _exercise(address: str, model, versions: int) -> None:
    """Single-row and batch-64 Predict calls to every loaded version."""
    import numpy as np

    from serving.client.grpc_client import predict_rows

    batch = np.resize(model.rows, (64, *model.rows.shape[1:])).astype(np.float32)
    for version in range(1, versions + 1):
        predict_rows(address, model.model_name, model.input_name, model.rows[:REQUESTS], batch_size=1, version=version)
        predict_rows(address, model.model_name, model.input_name, batch, batch_size=64, version=version)


def plot(figure: dict, ax) -> None:
    rows = [r for r in figure["rows"] if r["versions"] is not None]
    ax.bar([f"{r['versions']} version(s)" for r in rows], [r["peak_rss_mib"] or 0 for r in rows], color="#2ca02c")
    ax.set_ylabel("server peak RSS (MiB)")
    ax.set_title("5. server memory", fontsize=9)
