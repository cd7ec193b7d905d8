"""Helpers for serving tests: start `python -m serving` as a subprocess (serving/process.py), copy TF Serving's fixtures, small models.

Handed out as a fixture (`start_server`); the TF Serving fixture helpers live in tests/conftest.py.
"""

from __future__ import annotations

from pathlib import Path

import pytest

from serving.process import ServerProcess, ServerStartError, launch

REPO_ROOT = Path(__file__).resolve().parents[2]


def _start_server(*flags: str, log_dir: Path, timeout_s: float = 120.0) -> ServerProcess:
    """Runs `python -m serving --port 0 FLAGS...` and waits for its 'Running gRPC ModelServer at' line
    (and the 'Exporting HTTP/REST API at:' line with --rest_api_port=N, N not 0)."""
    rest = any(flag.startswith("--rest_api_port=") and flag != "--rest_api_port=0" for flag in flags)
    server = launch(["--port", "0", *flags], log_dir / "server.stderr", cwd=REPO_ROOT)
    try:
        return server.wait_until_ready(timeout_s, rest=rest)
    except ServerStartError as error:
        server.stop()
        pytest.fail(f"server did not start ({error}); stderr tail:\n{server.stderr_tail()}")


@pytest.fixture(scope="session")
def start_server():
    """start_server(*flags, log_dir=...) -> ServerProcess; the caller stops it (server.stop())."""
    return _start_server
