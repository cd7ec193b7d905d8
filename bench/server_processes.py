"""Starts `python -m serving` subprocesses for the bench (via serving/client/process.py) and reads their peak
memory by pid."""

from __future__ import annotations

import contextlib
import signal
import socket
from pathlib import Path
from typing import Iterator

from bench.machine import peak_rss_mib
from serving.client.process import ServerProcess, launch


class RunningServer:
    """A started server process as the bench uses it: its addresses, its log and its peak RSS."""

    def __init__(self, server: ServerProcess):
        self.process, self.log_path = server.process, server.stderr_path
        self.grpc_address, self.rest_address = server.address, server.rest_address

    def peak_rss_mib(self) -> float | None:
        return peak_rss_mib(self.process.pid)


@contextlib.contextmanager
def running_servers(setups: list[tuple[list[str], Path, bool]], timeout_s: float = 180.0,
                    module: str = "serving", environments: list[dict[str, str]] | None = None,
                    ) -> Iterator[list[RunningServer]]:
    """`python -m serving --port 0 FLAGS [--rest_api_port -1]` for each (flags, log_path, rest), started
    together (TensorFlow's import dominates start-up), stopped with SIGTERM when the block ends.
    module: another server that prints the same ready line (bench.echo_server); environments: variables set for
    each server, in the order of setups (none by default)."""
    started: list[tuple[ServerProcess, bool]] = []
    try:
        for (flags, log_path, rest), environment in zip(setups, environments or [None] * len(setups), strict=True):
            command = ["--port", "0", *flags, *(["--rest_api_port", "-1"] if rest else [])]
            started.append((launch(command, log_path, module=module, environment=environment), rest))
        yield [RunningServer(server.wait_until_ready(timeout_s, rest=rest)) for server, rest in started]
    finally:
        for server, _ in started:  # all drain side by side, then each is waited for
            if server.process.poll() is None:
                server.process.send_signal(signal.SIGTERM)
        for server, _ in started:
            server.stop()


@contextlib.contextmanager
def running_server(flags: list[str], log_path: Path, rest: bool = False) -> Iterator[RunningServer]:
    with running_servers([(flags, log_path, rest)]) as servers:
        yield servers[0]


def free_port() -> int:
    """A 127.0.0.1 port free now, for servers that must be told their port (peers, processes sharing one)."""
    with socket.socket() as probe:
        probe.bind(("127.0.0.1", 0))
        return probe.getsockname()[1]

