"""A directory built once per test run, by whichever test process asks first.

`make test` runs two pytest-xdist processes, and a session fixture is made once per process: the tiny trained
and exported models many test files read were built twice, ~25 s each on 2 cores. Built here, under the run's
own temporary directory (the parent of each process's), the second process waits for the first and reads it.
What it holds is read-only for the tests, as the fixtures' docstrings say.
"""

from __future__ import annotations

import fcntl
import os
import shutil
from pathlib import Path
from typing import Callable


def built_once(tmp_path_factory, name: str, build: Callable[[Path], None]) -> Path:
    """<the run's temporary directory>/<name>, filled by build(directory) unless a process of this run did."""
    base = tmp_path_factory.getbasetemp()
    if os.environ.get("PYTEST_XDIST_WORKER"):
        base = base.parent  # pytest-of-<user>/pytest-<n>/: the run's, shared by its popen-gw0, popen-gw1, ...
    directory, done = base / name, base / f"{name}.built"
    with open(base / f"{name}.lock", "w") as lock:
        fcntl.flock(lock, fcntl.LOCK_EX)  # released when the file closes, also if the process dies
        if not done.exists():
            shutil.rmtree(directory, ignore_errors=True)  # what a process that failed mid-build left
            directory.mkdir()
            build(directory)
            done.touch()
    return directory
