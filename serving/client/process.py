"""`python -m serving` as a child process: started, waited for, stopped. Used by `make demo`, the bench and the tests.

stdout and stderr go to files, never pipes: TensorFlow logs a lot, and a pipe nobody drains would
eventually block the server. The server is ready when its stdout says so, as tensorflow_model_server's
does ("Running gRPC ModelServer at HOST:PORT ...", and "Exporting HTTP/REST API at:HOST:PORT ..." with
a REST port).
"""

from __future__ import annotations

import contextlib
import dataclasses
import os
import re
import signal
import subprocess
import sys
import time
from pathlib import Path
from typing import Iterator, Mapping

GRPC_READY = re.compile(r"^Running gRPC ModelServer at (\S+:\d+) \.\.\.$", re.MULTILINE)
REST_READY = re.compile(r"^Exporting HTTP/REST API at:(\S+:\d+) \.\.\.$", re.MULTILINE)


class ServerStartError(RuntimeError):
    """The server exited or stayed silent instead of announcing its port."""


@dataclasses.dataclass
class ServerProcess:
    process: subprocess.Popen
    stdout_path: Path
    stderr_path: Path  # the server's log
    address: str = ""  # gRPC host:port, once ready
    rest_address: str | None = None
    ready_line: str = ""

    def wait_until_ready(self, timeout_s: float = 120.0, rest: bool = False) -> "ServerProcess":
        """Blocks until the server announced its gRPC (and, if rest, REST) address.

        Raises:
            ServerStartError: it exited first (with the tail of its log) or timed out.
        """
        deadline = time.monotonic() + timeout_s
        while time.monotonic() < deadline:
            text = self.stdout_path.read_text(errors="replace")
            grpc_match, rest_match = GRPC_READY.search(text), REST_READY.search(text)
            if grpc_match and (rest_match or not rest):
                self.address, self.ready_line = grpc_match[1], grpc_match[0]
                self.rest_address = rest_match[1] if rest_match else None
                return self
            if self.process.poll() is not None:
                raise ServerStartError(f"model server exited with code {self.process.returncode}: "
                                       f"{' | '.join(self.stderr_tail(5).splitlines())} (log: {self.stderr_path})")
            time.sleep(0.1)
        raise ServerStartError(f"model server not ready after {timeout_s:.0f} s (log: {self.stderr_path})")

    def stop(self, timeout_s: float = 30.0) -> int:
        """SIGTERM (in-flight requests finish), then wait; kills it if it does not exit in time. Returns the exit code."""
        if self.process.poll() is None:
            self.process.send_signal(signal.SIGTERM)
            try:
                self.process.wait(timeout_s)
            except subprocess.TimeoutExpired:
                self.process.kill()
                self.process.wait()
        return self.process.returncode

    def stderr_tail(self, lines: int = 20) -> str:
        return "\n".join(self.stderr_path.read_text(errors="replace").splitlines()[-lines:])


def launch(flags: list[str], log_path: str | Path, *, module: str = "serving", cwd: str | Path | None = None,
           environment: Mapping[str, str] | None = None) -> ServerProcess:
    """Starts `python -m MODULE FLAGS` without waiting; its log goes to log_path, its stdout beside it.
    environment: variables set for the server on top of this process's (a process-wide switch such as
    TF_ONEDNN_ASSUME_FROZEN_WEIGHTS, docs/serving.md#frozen-weights)."""
    log_path = Path(log_path)
    log_path.parent.mkdir(parents=True, exist_ok=True)
    stdout_path = log_path.with_name(log_path.name + ".stdout")
    with open(stdout_path, "w") as out, open(log_path, "w") as err:
        process = subprocess.Popen([sys.executable, "-m", module, *flags], stdout=out, stderr=err, cwd=cwd,
                                   env={**os.environ, **environment} if environment else None)
    return ServerProcess(process, stdout_path, log_path)


@contextlib.contextmanager
def running_server(flags: list[str], log_path: str | Path, *, rest: bool = False,
                   timeout_s: float = 120.0) -> Iterator[ServerProcess]:
    """A server for the length of the block: started, ready (or ServerStartError), stopped with SIGTERM."""
    server = launch(flags, log_path)
    try:
        yield server.wait_until_ready(timeout_s, rest=rest)
    finally:
        server.stop()
