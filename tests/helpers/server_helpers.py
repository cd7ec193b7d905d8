"""What the server tests share: waiting on a condition, and the server on a thread of the test process.

Registered by tests/serving/conftest.py as the module `server_helpers` (tests/ is not a package).
"""

from __future__ import annotations

import contextlib
import dataclasses
import time
from typing import Any, Callable, Iterator

from serving.app import Core, ServerThread
from serving.flags import Options


def wait_for(condition: Callable[[], Any], timeout_s: float = 30.0, interval_s: float = 0.02) -> Any:
    """Polls condition until it returns something true, which is returned; fails the test after timeout_s."""
    deadline = time.monotonic() + timeout_s
    while True:
        result = condition()
        if result:
            return result
        assert time.monotonic() < deadline, f"timed out after {timeout_s:g} s waiting for {condition}"
        time.sleep(interval_s)


@contextlib.contextmanager
def serving(manager: Any, *, grace_s: float = 0.0, **options: Any) -> Iterator[ServerThread]:
    """The server (gRPC, and REST with rest_api_port=-1) for a test's own ModelManager, on 127.0.0.1 free ports.

    options: Options fields (grpc_max_threads=2, enable_signature_method_name_check=True, ...); Core fields
    (batcher, metrics, request_log, reload_policy, ssl_config) go to the Core.
    """
    core_fields = {field.name for field in dataclasses.fields(Core)}
    core = Core(manager, **{key: value for key, value in options.items() if key in core_fields})
    flags = {"port": 0, "grpc_max_threads": 4, **{key: value for key, value in options.items()
                                                   if key not in core_fields}}
    server = ServerThread(Options(**flags), core)
    try:
        yield server
    finally:
        server.stop(grace_s)
