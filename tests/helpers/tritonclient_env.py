"""The venv Triton's clients run in for the v2 tests: `.venv-tritonclient/` beside the project's `.venv`, made once
(~40 s from the package registry) and reused. tritonclient pins protobuf < 7 and ml-dtypes <= 0.5.4, so it
cannot share the project's venv (docs/testing.md).

`python tests/helpers/tritonclient_env.py` makes it and prints its Python.
"""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path

REPO_ROOT = Path(__file__).resolve().parents[2]
VENV = REPO_ROOT / ".venv-tritonclient"
REQUIREMENT = "tritonclient[http,grpc]==2.73.0"


def python() -> Path:
    """The venv's Python, made (venv + tritonclient) if it is not there yet.

    Raises:
        RuntimeError: the venv could not be made (the message ends with pip's last lines).
    """
    executable = VENV / "bin" / "python"
    if executable.exists() and subprocess.run([executable, "-c", "import tritonclient.http, tritonclient.grpc"],
                                              capture_output=True).returncode == 0:
        return executable
    steps = ([getattr(sys, "_base_executable", sys.executable), "-m", "venv", "--clear", str(VENV)],
             [str(executable), "-m", "pip", "install", "--quiet", REQUIREMENT])
    for step in steps:
        done = subprocess.run(step, capture_output=True, text=True)
        if done.returncode != 0:
            raise RuntimeError(f"{' '.join(step)} failed: {(done.stderr or done.stdout)[-2000:]}")
    return executable


if __name__ == "__main__":
    print(python())
