"""The in-process batch engine opens nothing to the network."""

import os

import psutil

from pipeline.score import engine


def _listening() -> set[str]:
    return {c.laddr.ip for c in psutil.Process(os.getpid()).net_connections() if c.status == psutil.CONN_LISTEN}


def test_the_local_engine_listens_on_loopback_only():
    before = _listening()
    with engine.client(engine.EngineOptions(workers=1)) as dask_client:
        assert dask_client.submit(sum, [1, 2]).result() == 3
        opened = _listening() - before
    # Dask's scheduler and worker each start an HTTP server; dashboard_address=None alone bound 0.0.0.0:8787.
    assert opened <= {"127.0.0.1"}, opened
