"""Limits: gRPC channel arguments, the REST body limit, model names and version directories that cannot escape."""

from __future__ import annotations

import subprocess
import sys
import urllib.error
import urllib.request

import grpc
import numpy as np
import pytest
import tensorflow as tf
from tensorflow_serving.apis import predict_pb2, prediction_service_pb2_grpc

from serving import limits
from serving.limits import Admission, check_model_name, grpc_server_options, parse_channel_arguments
from serving.servable.saved_model import is_inside

pytestmark = pytest.mark.timeout(180)
LIMIT = 4096
ELEMENTS = 8  # --max_request_elements of the limited server


def test_channel_arguments_parse_ints_and_strings_and_replace_the_servers_bounds():
    given = parse_channel_arguments("grpc.max_receive_message_length=1048576, grpc.primary_user_agent=x=y")
    assert given == [("grpc.max_receive_message_length", 1048576), ("grpc.primary_user_agent", "x=y")]
    assert parse_channel_arguments("") == []
    with pytest.raises(ValueError, match="expected key=value, got 'nonsense'"):
        parse_channel_arguments("nonsense")
    options = dict(grpc_server_options(given, reuse_port=False))
    assert options["grpc.max_receive_message_length"] == 1048576 and options["grpc.primary_user_agent"] == "x=y"
    assert options["grpc.max_send_message_length"] == -1 and options["grpc.so_reuseport"] == 0
    defaults = dict(grpc_server_options(None, reuse_port=True))
    assert defaults["grpc.max_receive_message_length"] == limits.MAX_RECEIVE_MESSAGE_BYTES
    assert defaults["grpc.max_concurrent_streams"] == limits.MAX_CONCURRENT_STREAMS
    assert defaults["grpc.max_allowed_incoming_connections"] == limits.default_max_connections()
    assert defaults["grpc.so_reuseport"] == 1


def test_admission_bounds_requests_and_bytes_in_flight_but_takes_one_of_any_size_alone():
    admission = Admission(max_requests=2, max_bytes=100)
    assert admission.admit(1000) is None  # alone: any size
    assert "busy: 1 requests (1000 bytes) in flight" in admission.admit(1)
    admission.release(1000)
    assert admission.admit(60) is None and admission.admit(40) is None
    assert "--max_inflight_requests" in admission.admit(0)  # two in flight
    admission.release(40)
    assert admission.admit(41) is not None and admission.admit(40) is None
    assert (admission.requests, admission.bytes) == (2, 100)


@pytest.mark.parametrize("name", ["a/b", "..", "x..y", "a\0b", "", "a\\b"])
def test_model_names_that_could_escape_are_refused(name):
    with pytest.raises(ValueError, match="not allowed"):
        check_model_name(name)


def test_ordinary_model_names_pass():
    for name in ("half_plus_two", "mnist-v2", "model.1"):
        check_model_name(name)


def test_version_dir_symlink_outside_base_path_is_refused(tmp_path):
    base = tmp_path / "model"
    (base / "1").mkdir(parents=True)
    outside = tmp_path / "elsewhere"
    outside.mkdir()
    (base / "2").symlink_to(outside, target_is_directory=True)
    (base / "3").symlink_to(base / "1", target_is_directory=True)  # inside: fine
    (base / "4").symlink_to("../model/../elsewhere", target_is_directory=True)
    assert is_inside(base, base / "1") and is_inside(base, base / "3")
    assert not is_inside(base, base / "2") and not is_inside(base, base / "4")


def test_bad_model_name_flag_exits_2(tmp_path):
    result = subprocess.run([sys.executable, "-m", "serving", "--model_name=../x", f"--model_base_path={tmp_path}"],
                            capture_output=True, text=True, timeout=60)
    assert result.returncode == 2 and "--model_name" in result.stderr and "not allowed" in result.stderr


def test_bad_model_name_in_config_exits_1(tmp_path, capsys):
    """The entry point in this process (TensorFlow loaded already): test_app.py's run_server tests show a real
    process's exit status and stderr for a config refused at start-up."""
    from serving.__main__ import main

    config = tmp_path / "models.config"
    config.write_text(f'model_config_list {{ config {{ name: "a/b" base_path: "{tmp_path}" '
                      'model_platform: "tensorflow" } }')
    code = main(["--port=0", f"--model_config_file={config}"])
    assert code == 1 and "'a/b' is not allowed" in capsys.readouterr().err


@pytest.fixture(scope="module")
def limited(tmp_path_factory, start_server, copy_testdata):
    root = tmp_path_factory.mktemp("limits")
    base_path = copy_testdata("saved_model_half_plus_two_cpu", root / "half_plus_two")
    server = start_server("--model_name=half_plus_two", f"--model_base_path={base_path}", "--rest_api_port=-1",
                          f"--grpc_channel_arguments=grpc.max_receive_message_length={LIMIT}",
                          f"--rest_api_max_body_bytes={LIMIT}", f"--max_request_elements={ELEMENTS}", log_dir=root)
    yield server, f"http://{server.rest_address}"
    server.stop()


def predict(address, rows):
    request = predict_pb2.PredictRequest()
    request.model_spec.name = "half_plus_two"
    request.inputs["x"].CopyFrom(tf.make_tensor_proto(np.ones((rows, 1), np.float32)))
    with grpc.insecure_channel(address) as channel:
        return prediction_service_pb2_grpc.PredictionServiceStub(channel).Predict(request, timeout=30)


def test_grpc_request_over_the_limit_is_resource_exhausted_and_server_keeps_serving(limited):
    server, _ = limited
    with pytest.raises(grpc.RpcError) as error:
        predict(server.address, rows=LIMIT)  # 16 KB of float32
    assert error.value.code() == grpc.StatusCode.RESOURCE_EXHAUSTED
    assert tf.make_ndarray(predict(server.address, rows=2).outputs["y"]).tolist() == [[2.5], [2.5]]


def test_rest_body_over_the_limit_is_413_and_server_keeps_serving(limited):
    _, url = limited
    big = ('{"instances": [' + ", ".join(["[1.0]"] * LIMIT) + "]}").encode()
    with pytest.raises(urllib.error.HTTPError) as error:
        urllib.request.urlopen(urllib.request.Request(f"{url}/v1/models/half_plus_two:predict", data=big), timeout=30)
    assert error.value.code == 413 and "--rest_api_max_body_bytes" in error.value.read().decode()
    request = urllib.request.Request(f"{url}/v1/models/half_plus_two:predict", data=b'{"instances": [[1.0]]}')
    with urllib.request.urlopen(request, timeout=30) as response:
        assert response.status == 200 and b"2.5" in response.read()


def test_a_version_symlinked_from_outside_the_base_path_is_not_listed(tmp_path):
    from tensorflow_serving.config import model_server_config_pb2

    from serving.manager.model_config import version_dirs

    base, outside = tmp_path / "base", tmp_path / "elsewhere"
    (base / "1").mkdir(parents=True)
    (outside / "2").mkdir(parents=True)
    (base / "2").symlink_to(outside / "2")
    (base / "3").symlink_to(base / "1")  # a link that stays inside is fine
    model = model_server_config_pb2.ModelConfig(name="m", base_path=str(base), model_platform="tensorflow")
    assert sorted(version_dirs(model)) == [1, 3]


def test_request_over_max_request_elements_is_invalid_argument_naming_the_input(limited):
    server, url = limited
    with pytest.raises(grpc.RpcError) as error:
        predict(server.address, rows=ELEMENTS + 1)
    assert error.value.code() == grpc.StatusCode.INVALID_ARGUMENT
    assert error.value.details() == (f"input 'x' declares {ELEMENTS + 1} elements, which brings the request to "
                                     f"{ELEMENTS + 1}; the server allows at most {ELEMENTS} per request "
                                     "(--max_request_elements)")
    body = ('{"instances": [' + ", ".join(["[1.0]"] * (ELEMENTS + 1)) + "]}").encode()
    with pytest.raises(urllib.error.HTTPError) as http_error:
        urllib.request.urlopen(urllib.request.Request(f"{url}/v1/models/half_plus_two:predict", data=body), timeout=30)
    assert http_error.value.code == 400 and "--max_request_elements" in http_error.value.read().decode()
    assert len(predict(server.address, rows=ELEMENTS).outputs["y"].float_val) == ELEMENTS


@pytest.mark.subprocess
@pytest.mark.parametrize("flag, message", [
    ("--max_request_elements=-1", "expected 0 (no limit) or a positive number, got -1"),
    ("--rest_api_max_connections=0", "expected a positive number, got 0"),
    ("--rest_api_idle_timeout_s=0", "expected a positive number of seconds, got 0"),
    ("--rest_api_read_timeout_s=inf", "expected a positive number of seconds, got inf"),
])
def test_bad_limit_flags_exit_2(tmp_path, flag, message):
    result = subprocess.run([sys.executable, "-m", "serving", "--model_name=m", f"--model_base_path={tmp_path}", flag],
                            capture_output=True, text=True, timeout=60)
    assert result.returncode == 2 and flag.split("=")[0] in result.stderr and message in result.stderr


def test_request_limit_setting_and_defaults():
    assert limits.max_request_elements() == limits.DEFAULT_MAX_REQUEST_ELEMENTS == 16 * 2**20
    with pytest.raises(ValueError, match="expected 0 \\(no limit\\) or a positive number of elements, got -1"):
        limits.set_max_request_elements(-1)
    assert limits.max_request_elements() == limits.DEFAULT_MAX_REQUEST_ELEMENTS
    assert 16 <= limits.default_max_connections()
