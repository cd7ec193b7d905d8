"""`python -m pipeline serve CONFIG`: runs `python -m serving` with the flags that serve the experiment's export."""

from __future__ import annotations

import os
import sys

from pipeline.config import Config


def serving_flags(cfg: Config, port: int | None = None) -> list[str]:
    """tensorflow_model_server-style flags that serve this experiment's exported model."""
    return [f"--host={cfg.serving.host}", f"--port={cfg.serving.port if port is None else port}",
            f"--model_name={cfg.export.model_name}", f"--model_base_path={cfg.model_base_path.resolve()}"]


def serve(cfg: Config) -> None:
    """Replaces this process with the model server (so signals and the exit code are the server's)."""
    os.execv(sys.executable, [sys.executable, "-m", "serving", *serving_flags(cfg)])
