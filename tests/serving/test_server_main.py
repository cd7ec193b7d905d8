"""`python -m serving`: flags, start-up refusals (one line, non-zero exit, never listening), and a
--model_config_file server that follows its config file and base paths until SIGTERM."""

from __future__ import annotations

import os
import shutil
import subprocess
import sys
import time
from pathlib import Path

import grpc
import numpy as np
import pytest
import tensorflow as tf
from tensorflow_serving.apis import predict_pb2, prediction_service_pb2_grpc

from serving.__main__ import main

REPO_ROOT = Path(__file__).resolve().parents[2]


def run_server(*flags: str) -> subprocess.CompletedProcess:
    return subprocess.run([sys.executable, "-m", "serving", "--port", "0", *flags], cwd=REPO_ROOT,
                          capture_output=True, text=True, timeout=120)


def test_model_flags_are_required_together():
    result = run_server("--model_name", "m")
    assert result.returncode == 2
    assert "--model_name and --model_base_path are required together" in result.stderr
    assert result.stdout == ""


@pytest.mark.parametrize("flags, message", [
    (["--model_config_file=/c", "--model_name=m"], "use either --model_config_file or --model_name/--model_base_path"),
    (["--model_config_file=/c", "--allow_version_labels_for_unavailable_models=maybe"], "expected true or false"),
    (["--model_config_file=/c", "--file_system_poll_wait_seconds=-1"], "expected 0 or more seconds"),
    (["--model_config_file=/c", "--tensorflow_intra_op_parallelism=-1"], "expected 0 (TensorFlow decides)"),
])
def test_bad_flags_exit_2(flags, message):
    result = run_server(*flags)
    assert result.returncode == 2 and message in result.stderr and result.stdout == ""


def test_base_path_without_versions_exits_1_with_one_line(tmp_path):
    result = run_server("--model_name", "m", f"--model_base_path={tmp_path}")
    assert result.returncode == 1
    assert result.stdout == ""  # never announced a port
    assert result.stderr.strip().splitlines()[-1] == (
        f"error: {tmp_path}: no numeric version directories (expected e.g. {tmp_path}/1/saved_model.pb)")


def test_unparsable_config_file_exits_1_with_tf_servings_message(tfserving_testdata):
    path = tfserving_testdata / "bad_model_config.txt"
    result = run_server(f"--model_config_file={path}")
    assert (result.returncode, result.stdout) == (1, "")
    assert result.stderr.strip().splitlines()[-1].startswith(f"error: Invalid protobuf file: '{path}'")


def test_invalid_config_exits_1_with_tf_servings_message(tmp_path):
    path = tmp_path / "models.config"
    path.write_text('model_config_list { config { name: "a" base_path: "/m/a" model_platform: "tensorflow" } '
                    'config { name: "a" base_path: "/m/b" model_platform: "tensorflow" } }')
    result = run_server(f"--model_config_file={path}")
    assert (result.returncode, result.stdout) == (1, "")
    assert result.stderr.strip().splitlines()[-1] == "error: Illegal to list model a multiple times in config list"


def test_a_model_that_cannot_load_stops_start_up(tmp_path, copy_testdata, capsys):
    """As TF Serving: start-up waits for each model's latest version and fails if one ends in error."""
    bad = copy_testdata("bad_half_plus_two", tmp_path / "bad")
    assert main(["--port=0", "--model_name=bad", f"--model_base_path={bad}"]) == 1  # in-process: TF is loaded
    captured = capsys.readouterr()
    assert captured.out == ""
    assert captured.err.strip().splitlines()[-1].startswith(
        "error: 1 model(s) did not become available: {name: bad version: 123} due to error: NOT_FOUND: ")


@pytest.mark.timeout(180)
def test_config_file_server_follows_its_file_and_base_paths_then_stops_on_sigterm(
        tfserving_testdata, copy_testdata, start_server, tmp_path):
    hp2 = copy_testdata("saved_model_half_plus_two_cpu", tmp_path / "half_plus_two")
    hp3 = copy_testdata("saved_model_half_plus_three", tmp_path / "half_plus_three")
    template = (tfserving_testdata / "good_model_config.txt").read_text()
    config = tmp_path / "models.config"
    config.write_text(template.replace("${TEST_HALF_PLUS_TWO_DIR}", str(hp2))
                      .replace("${TEST_HALF_PLUS_THREE_DIR}", str(hp3)))
    server = start_server(f"--model_config_file={config}", "--model_config_file_poll_wait_seconds=0.2",
                          "--file_system_poll_wait_seconds=0.2", log_dir=tmp_path)
    try:
        with grpc.insecure_channel(server.address) as channel:
            stub = prediction_service_pb2_grpc.PredictionServiceStub(channel)
            assert predict(stub, "half_plus_two") == (123, 3.0)
            assert predict(stub, "half_plus_three") == (123, 4.0)
            # A new version directory, published atomically, is picked up by file-system polling.
            shutil.copytree(hp3 / "00000123", hp2 / ".tmp-124")
            os.rename(hp2 / ".tmp-124", hp2 / "124")
            wait_for(lambda: predict(stub, "half_plus_two") == (124, 4.0))
            # The config file drops half_plus_three: config polling unloads it.
            (tmp_path / "next.config").write_text('model_config_list { config { name: "half_plus_two" '
                                                  f'base_path: "{hp2}" model_platform: "tensorflow" }} }}')
            os.replace(tmp_path / "next.config", config)
            wait_for(lambda: predict(stub, "half_plus_three") == grpc.StatusCode.NOT_FOUND)
        started = time.monotonic()
        assert server.stop() == 0, server.stderr_tail()
        assert time.monotonic() - started < 15  # the polling threads do not hold the process
        assert server.stdout_path.read_text().splitlines() == [server.ready_line]  # nothing after the ready line
    finally:
        server.stop()


def predict(stub, model: str) -> tuple[int, float] | grpc.StatusCode:
    request = predict_pb2.PredictRequest(model_spec={"name": model})
    request.inputs["x"].CopyFrom(tf.make_tensor_proto(np.array([[2.0]], np.float32)))
    try:
        response = stub.Predict(request, timeout=10)
    except grpc.RpcError as error:
        return error.code()
    return response.model_spec.version.value, response.outputs["y"].float_val[0]


def wait_for(condition, timeout_s: float = 30.0) -> None:
    deadline = time.monotonic() + timeout_s
    while not condition():
        assert time.monotonic() < deadline, "timed out"
        time.sleep(0.1)
