"""The kit's command lines, run here: the image's ENTRYPOINT + CMD, and KServe's argv for our runtime, each against
a real exported model. Only what cannot hold outside a container changes: `python` is this interpreter (run
in the kit's src/, the source the image installs), the ports are free ones on 127.0.0.1, and KServe's
/mnt/models is where its storage initializer would have put the model."""

from __future__ import annotations

import json
import re
import subprocess
import sys
import urllib.request
from pathlib import Path

import grpc
import numpy as np
import pytest
from grpc_health.v1 import health_pb2, health_pb2_grpc
from manifest_checks import load_resources

from pipeline.deploy import servers
from serving.client.process import ServerProcess, ServerStartError

pytestmark = pytest.mark.subprocess


def _here(argv: list[str], replacements: dict[str, str] | None = None) -> list[str]:
    """The container's argv on this machine (see the module docstring)."""
    local = {"--host": "127.0.0.1", "--port": "0", "--rest_api_port": "-1"}  # -1: ours picks a free REST port
    result = [sys.executable if argv[0] == "python" else argv[0]]
    for arg in argv[1:]:
        for old, new in (replacements or {}).items():
            arg = arg.replace(old, new)
        flag = arg.split("=", 1)[0]
        result.append(f"{flag}={local[flag]}" if flag in local and "=" in arg else arg)
    return result


def _start(argv: list[str], cwd: Path, log_dir: Path) -> ServerProcess:
    log_dir.mkdir(parents=True, exist_ok=True)
    stdout, stderr = log_dir / "server.stdout", log_dir / "server.stderr"
    with open(stdout, "w") as out, open(stderr, "w") as err:
        process = subprocess.Popen(argv, stdout=out, stderr=err, cwd=cwd)
    server = ServerProcess(process, stdout, stderr)
    try:
        return server.wait_until_ready(180, rest=True)
    except ServerStartError as error:
        server.stop()
        pytest.fail(f"the kit's argv did not serve: {error}\nargv: {argv[1:]}")


def _get(url: str) -> tuple[int, bytes]:
    with urllib.request.urlopen(url, timeout=30) as response:
        return response.status, response.read()


def _check_serves(server: ServerProcess, model_name: str, exported_model) -> None:
    """What the pods' probes ask, then a real prediction that matches the trained model."""
    rest = f"http://{server.rest_address}"
    status, body = _get(f"{rest}/v1/models/{model_name}")  # the liveness probe's URL
    assert status == 200 and json.loads(body)["model_version_status"][0]["state"] == "AVAILABLE"
    with grpc.insecure_channel(server.address) as channel:  # the readiness probe: grpc.health.v1, service ""
        health = health_pb2_grpc.HealthStub(channel).Check(health_pb2.HealthCheckRequest(service=""), timeout=10)
        assert health.status == health_pb2.HealthCheckResponse.SERVING
    rows = exported_model.val_x[:8]
    request = urllib.request.Request(f"{rest}/v1/models/{model_name}:predict", method="POST",
                                     data=json.dumps({"instances": rows.tolist()}).encode())
    with urllib.request.urlopen(request, timeout=30) as response:
        predictions = json.loads(response.read())["predictions"]
    probabilities = np.array([p["probabilities"] for p in predictions], np.float32)
    np.testing.assert_allclose(probabilities, exported_model.keras_probabilities[:8], rtol=1e-6, atol=1e-7)


def test_the_images_entrypoint_serves_the_exported_models(kit, exported_model, tmp_path):
    text = (kit / "Containerfile").read_text()
    argv = [*json.loads(re.search(r"^ENTRYPOINT (.*)$", text, re.MULTILINE)[1]),
            *json.loads(re.search(r"^CMD (.*)$", text, re.MULTILINE)[1])]
    assert argv[:3] == list(servers.SERVING_COMMAND)
    server = _start(_here(argv), cwd=kit / "src", log_dir=tmp_path)
    try:
        for model_name in ("tiny_digits", "tiny_digits_b"):
            _check_serves(server, model_name, exported_model)
        status, metrics = _get(f"http://{server.rest_address}{servers.METRICS_PATH}")  # the pods' scrape annotation
        assert status == 200 and b"tensorflow_serving_request_count_total" in metrics
    finally:
        assert server.stop() == 0  # drained and exited cleanly on SIGTERM, as a pod's server is stopped


def test_kserves_argv_for_our_runtime_serves_the_exported_model(kit, exported_model, tmp_path):
    """KServe's TF Serving arguments include --rest_api_timeout_in_ms=60000 (kserve-tensorflow-serving.yaml)."""
    [runtime] = load_resources(kit / "kserve/mixed-precision-serving/servingruntime.yaml")
    [isvc] = load_resources(kit / "kserve/mixed-precision-serving/inferenceservice-tiny-digits.yaml")
    [container] = runtime["spec"]["containers"]
    # KServe appends the InferenceService's args to the runtime's and fills {{.Name}} with its name.
    argv = [*container["command"], *container["args"], *isvc["spec"]["predictor"]["model"]["args"]]
    server = _start(_here(argv, {"{{.Name}}": isvc["metadata"]["name"],
                                 servers.KSERVE_MODEL_DIR: str(exported_model.base_path)}),
                    cwd=kit / "src", log_dir=tmp_path)
    try:
        _check_serves(server, exported_model.model_name, exported_model)
    finally:
        assert server.stop() == 0
