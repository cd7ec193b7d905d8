"""What the server tests share: waiting on a condition, and the server on a thread of the test process.

Test files `from server_helpers import ...` (tests/helpers/ is on sys.path: tests/conftest.py).
"""

from __future__ import annotations

import contextlib
import dataclasses
import time
from pathlib import Path
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


def logged_models_config(folder: Path, model_name: str, base_path: Path) -> Path:
    """folder/models.config (--model_config_file): model_name served from base_path, every request logged to
    folder/requests-<model_name>-*.tfrecord (TF Serving's LoggingConfig, sampling rate 1)."""
    config = folder / "models.config"
    config.write_text(f'model_config_list {{ config {{ name: "{model_name}" base_path: "{base_path}" model_platform: '
                      f'"tensorflow" logging_config {{ log_collector_config {{ type: "tfrecord" filename_prefix: '
                      f'"{folder}/requests" }} sampling_config {{ sampling_rate: 1.0 }} }} }} }}')
    return config
