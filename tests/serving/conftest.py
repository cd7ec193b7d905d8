"""Helpers for serving tests: start `python -m serving` as a subprocess (serving/client/process.py), and TF Serving's
test data: built by tests/helpers/tfserving_models.py, and TF Serving's own copy as well where a checkout has one.

Handed out as fixtures: `start_server`, `tfserving_testdata`, `every_tfserving_testdata`, `copy_testdata`.
"""

from __future__ import annotations

import functools
import os
import shutil
from pathlib import Path

import pytest

import tfserving_models  # tests/helpers/
from serving.client.process import ServerProcess, ServerStartError, launch

REPO_ROOT = Path(__file__).resolve().parents[2]
# TF Serving's own test data (Apache-2.0), beside the repository as ../shared/ (as CI clones) or where
# TFSERVING_TESTDATA says. Optional: the tests run on the built copy; test_tfserving_models.py checks the
# built copy against this one where it is present, so the rest need not run twice.
SHARED_TESTDATA = Path(os.environ.get("TFSERVING_TESTDATA", REPO_ROOT.parent / "shared" / "tfserving-testdata"))
TESTDATA_SOURCES = ("built", "shared") if SHARED_TESTDATA.is_dir() else ("built",)




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


def _read_only(root: Path) -> Path:
    for path in [*root.rglob("*"), root]:
        path.chmod(path.stat().st_mode & ~0o222)
    return root


@pytest.fixture(scope="session")
def built_testdata(tmp_path_factory) -> Path:
    """TF Serving's test data, built once per session (a few seconds); read-only, as TF Serving's copy is."""
    return _read_only(tfserving_models.build(tmp_path_factory.mktemp("tfserving-testdata")))


@pytest.fixture(scope="session")
def tfserving_testdata(built_testdata) -> Path:
    """The TF Serving test data directory the tests serve: the built one (same signatures and values as TF
    Serving's own, which test_tfserving_models.py checks), so a plain clone tests exactly what CI tests."""
    return built_testdata


@pytest.fixture(scope="session", params=TESTDATA_SOURCES)
def every_tfserving_testdata(request) -> Path:
    """Each source of the test data: the built copy, then TF Serving's own where present (`[built]`, `[shared]`)."""
    return SHARED_TESTDATA if request.param == "shared" else request.getfixturevalue("built_testdata")


def _copy_testdata(source: Path, name: str, destination: Path) -> Path:
    """A writable copy of one fixture (the originals stay untouched)."""
    original = source / name
    if not original.is_dir():
        pytest.fail(f"TF Serving test data incomplete: no {original} (compare with tests/helpers/tfserving_models.py)")
    shutil.copytree(original, destination, copy_function=shutil.copyfile)
    for path in [destination, *destination.rglob("*")]:  # the originals are read-only
        path.chmod(path.stat().st_mode | 0o200)
    return destination


@pytest.fixture(scope="session")
def copy_testdata(tfserving_testdata):
    """copy_testdata(name, destination) -> a writable copy of a TF Serving fixture from this source."""
    return functools.partial(_copy_testdata, tfserving_testdata)
