"""Starts `python -m serving` for the bench and keeps its pid, so its peak memory can be read."""

from __future__ import annotations

import contextlib
import re
import signal
import subprocess
import sys
import time
from pathlib import Path
from typing import Iterator

from bench.machine import peak_rss_mib

GRPC_READY = re.compile(r"Running gRPC ModelServer at (\S+) \.\.\.")
REST_READY = re.compile(r"Exporting HTTP/REST API at:(\S+) \.\.\.")


class Server:
    def __init__(self, process: subprocess.Popen, grpc_address: str, rest_address: str | None, log_path: Path):
        self.process, self.log_path = process, log_path
        self.grpc_address, self.rest_address = grpc_address, rest_address

    def peak_rss_mib(self) -> float | None:
        return peak_rss_mib(self.process.pid)


@contextlib.contextmanager
def running_servers(setups: list[tuple[list[str], Path, bool]], timeout_s: float = 180.0,
                    module: str = "serving") -> Iterator[list[Server]]:
    """`python -m serving --port 0 FLAGS [--rest_api_port -1]` for each (flags, log_path, rest), started
    together (TensorFlow's import dominates start-up), stopped with SIGTERM when the block ends.
    module: another server that prints the same ready line (bench.echo_server)."""
    started: list[tuple[subprocess.Popen, Path, Path, bool]] = []
    try:
        for flags, log_path, rest in setups:
            log_path.parent.mkdir(parents=True, exist_ok=True)
            stdout_path = log_path.with_suffix(".stdout")
            command = [sys.executable, "-m", module, "--port", "0", *flags,
                       *(["--rest_api_port", "-1"] if rest else [])]
            with open(stdout_path, "w") as out, open(log_path, "w") as err:
                started.append((subprocess.Popen(command, stdout=out, stderr=err), stdout_path, log_path, rest))
        servers = []
        for process, stdout_path, log_path, rest in started:
            grpc_address, rest_address = _wait_until_ready(process, stdout_path, log_path, rest, timeout_s)
            servers.append(Server(process, grpc_address, rest_address, log_path))
        yield servers
    finally:
        for process, *_ in started:
            process.send_signal(signal.SIGTERM)
        for process, *_ in started:
            try:
                process.wait(timeout=30)
            except subprocess.TimeoutExpired:
                process.kill()
                process.wait()


@contextlib.contextmanager
def running_server(flags: list[str], log_path: Path, rest: bool = False) -> Iterator[Server]:
    with running_servers([(flags, log_path, rest)]) as servers:
        yield servers[0]


def _wait_until_ready(process: subprocess.Popen, stdout_path: Path, log_path: Path, rest: bool,
                      timeout_s: float) -> tuple[str, str | None]:
    deadline = time.monotonic() + timeout_s
    while time.monotonic() < deadline:
        text = stdout_path.read_text()
        grpc_match, rest_match = GRPC_READY.search(text), REST_READY.search(text)
        if grpc_match and (rest_match or not rest):
            return grpc_match.group(1), rest_match.group(1) if rest_match else None
        if process.poll() is not None:
            tail = " | ".join(log_path.read_text().strip().splitlines()[-5:])
            raise RuntimeError(f"model server exited with code {process.returncode}: {tail} (log: {log_path})")
        time.sleep(0.2)
    raise RuntimeError(f"model server not ready after {timeout_s:.0f} s (log: {log_path})")
