"""`python -m serving`: flags, start-up refusals (one line, non-zero exit, never listening: a bad config,
a model that cannot load, a taken port), TensorFlow's start-up log lines, and a --model_config_file
server that follows its config file and base paths until SIGTERM."""

from __future__ import annotations

import os
import re
import shutil
import socket
import subprocess
import sys
import time
from pathlib import Path

import grpc
import numpy as np
import pytest
import tensorflow as tf
from tensorflow_serving.apis import predict_pb2, prediction_service_pb2_grpc

from serving import tf_log
from serving.__main__ import main

REPO_ROOT = Path(__file__).resolve().parents[2]


def run_server(*flags: str) -> subprocess.CompletedProcess:
    return subprocess.run([sys.executable, "-m", "serving", "--port", "0", *flags], cwd=REPO_ROOT,
                          capture_output=True, text=True, timeout=120)


def run_main(capsys, *flags: str) -> subprocess.CompletedProcess:
    """The same entry point in this process, where TensorFlow is already loaded: a child process costs ~3.5 s of
    TensorFlow import. Each behaviour a real process shows (its whole stderr, no TensorFlow start-up lines; the
    exit status of `python -m serving`) keeps a run_server or subprocess test of its own."""
    try:
        code = main(["--port", "0", *flags])
    except SystemExit as exit_info:  # argparse's refusals
        code = exit_info.code
    captured = capsys.readouterr()
    return subprocess.CompletedProcess(["main", *flags], code, captured.out, captured.err)


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
    (["--model_config_file=/c", "--batching_parameters_file=/b"],  # TF Serving's server.cc refuses to start too
     "--batching_parameters_file is set without setting --enable_batching to true"),
    (["--model_config_file=/c", "--model_config_reload_roots=/models"],
     "--model_config_reload_roots needs --allow_network_model_config_reload"),
    (["--model_config_file=/c", "--allow_network_model_config_reload", "--model_config_reload_roots=models"],
     "expected comma-separated absolute directories, got 'models'"),
    (["--model_config_file=/c", "--max_num_load_retries=-1"], "expected 0 (no retry) or a positive number, got -1"),
    (["--model_config_file=/c", "--port=70000"], "argument --port: expected 0 to 65535 (0: pick a free port), got 70000"),
    (["--model_config_file=/c", "--port=-5"], "argument --port: expected 0 to 65535 (0: pick a free port), got -5"),
    (["--model_config_file=/c", "--rest_api_port=70000"], "argument --rest_api_port: expected -1 to 65535"),
    (["--model_config_file=/c", "--file_system_poll_wait_seconds=nan"],
     "argument --file_system_poll_wait_seconds: expected 0 or more seconds, got nan"),
    (["--model_config_file=/c", "--grace_period_s=-1"], "argument --grace_period_s: expected 0 or more seconds, got -1"),
    (["--model_config_file=/c", "--rest_api_read_timeout_s=inf"], "expected a positive number of seconds, got inf"),
    (["--model_config_file=/c", "--grpc_max_threads=0"], "argument --grpc_max_threads: expected a positive number"),
])
def test_bad_flags_exit_2_with_one_line(flags, message):
    """Checked before anything loads (serving/flags.py): one line naming the flag, no usage block first."""
    result = run_server(*flags)
    assert result.returncode == 2 and message in result.stderr and result.stdout == ""
    assert len(result.stderr.splitlines()) == 1, result.stderr


def test_base_path_without_versions_exits_1_with_one_line(tmp_path):
    result = run_server("--model_name", "m", f"--model_base_path={tmp_path}")
    assert result.returncode == 1
    assert result.stdout == ""  # never announced a port
    assert result.stderr.strip().splitlines()[-1] == (
        f"error: {tmp_path}: no numeric version directories (expected e.g. {tmp_path}/1/saved_model.pb)")


def test_unparsable_config_file_exits_1_with_tf_servings_message(tfserving_testdata, capsys):
    path = tfserving_testdata / "bad_model_config.txt"
    result = run_main(capsys, f"--model_config_file={path}")
    assert (result.returncode, result.stdout) == (1, "")
    assert result.stderr.strip().splitlines()[-1].startswith(
        f"error: Invalid protobuf file: '{path}': Error parsing text-format tensorflow.serving.ModelServerConfig: ")


def test_invalid_config_exits_1_with_tf_servings_message(tmp_path, capsys):
    path = tmp_path / "models.config"
    path.write_text('model_config_list { config { name: "a" base_path: "/m/a" model_platform: "tensorflow" } '
                    'config { name: "a" base_path: "/m/b" model_platform: "tensorflow" } }')
    result = run_main(capsys, f"--model_config_file={path}")
    assert (result.returncode, result.stdout) == (1, "")
    assert result.stderr.strip().splitlines()[-1] == "error: Illegal to list model a multiple times in config list"


def test_a_model_that_cannot_load_stops_start_up(tmp_path, copy_testdata, capsys):
    """As TF Serving: start-up waits for each model's latest version and fails if one ends in error."""
    bad = copy_testdata("bad_half_plus_two", tmp_path / "bad")
    assert main(["--port=0", "--model_name=bad", f"--model_base_path={bad}",  # in-process: TF is loaded
                 "--max_num_load_retries=0"]) == 1  # TF Serving's default, 5 retries a minute apart, takes 5 min
    captured = capsys.readouterr()
    assert captured.out == ""
    assert captured.err.strip().splitlines()[-1].startswith(
        "error: 1 model(s) did not become available: {name: bad version: 123} due to error: NOT_FOUND: ")


@pytest.mark.parametrize("share", [False, True], ids=["plain", "so_reuseport"])
def test_a_taken_port_stops_start_up_with_one_line_before_loading(tmp_path, share, capsys):
    """The first server may have asked for a shared port (--reuse_port): a second one without it still fails.
    The plain case is a real process (its whole stderr is the one line); the shared one the same entry point here."""
    (tmp_path / "m" / "1").mkdir(parents=True)  # never loaded: the port is checked first
    with socket.socket() as taken:
        if share:
            taken.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEPORT, 1)
        taken.bind(("127.0.0.1", 0))
        taken.listen()
        port = taken.getsockname()[1]
        flags = [f"--port={port}", "--model_name=m", f"--model_base_path={tmp_path / 'm'}"]
        result = (run_main(capsys, *flags) if share else
                  subprocess.run([sys.executable, "-m", "serving", *flags], cwd=REPO_ROOT, capture_output=True,
                                 text=True, timeout=120))
    assert (result.returncode, result.stdout) == (1, "")
    assert result.stderr.splitlines() == [f"error: cannot listen on 127.0.0.1:{port}: the port is taken (another "
                                          "server?); --reuse_port shares it on purpose"]


@pytest.mark.parametrize("host, words", [("no-such-host.invalid", "unknown host 'no-such-host.invalid' ("),
                                         ("192.0.2.1", "192.0.2.1 is no address of this machine")])
def test_a_host_it_cannot_listen_on_stops_start_up_with_one_line_before_loading(tmp_path, host, words, capsys):
    """Issue 31 row 8: an unknown host (or another machine's address) printed the model's load lines first. The
    unknown host is a real process (its whole stderr is the one line); the other address the same entry point here."""
    (tmp_path / "m" / "1").mkdir(parents=True)  # never loaded: the address is checked first
    flags = [f"--host={host}", "--model_name=m", f"--model_base_path={tmp_path / 'm'}"]
    result = (run_main(capsys, *flags) if host == "192.0.2.1" else run_server(*flags))
    assert (result.returncode, result.stdout) == (1, "")
    [line] = result.stderr.splitlines()
    assert line.startswith(f"error: cannot listen on {host}:0: {words}"), line


@pytest.mark.subprocess
def test_tensorflow_start_up_lines_are_left_out_unless_asked_for():
    """absl prints TensorFlow's INFO lines while it loads, whatever TF_CPP_MIN_LOG_LEVEL says; python -m
    serving filters them, and TF_CPP_MIN_LOG_LEVEL=0 (any value the user sets) lets them through. Without an
    NVIDIA device, the GPU build's "failed call to cuInit" ERROR line is left out too, and so is oneDNN's float16
    line on a CPU without its float16 instructions (issue 31 #7: no ERROR line on a healthy start, on any CPU)."""
    info = re.compile(r"^I\d{4} ", re.MULTILINE)
    script = ("from serving import tf_log; tf_log.quiet_tensorflow('1'); import sys, tensorflow as tf; "  # as main()
              "tf.config.list_physical_devices(); tf.function(lambda x: tf.nn.relu(tf.matmul(x, x)))"
              "(tf.ones((2, 2), tf.float16)); print('note', tf_log.float16_note() is not None, file=sys.stderr); "
              "print('ok', file=sys.stderr)")
    env = {key: value for key, value in os.environ.items() if key != "TF_CPP_MIN_LOG_LEVEL"}
    shown = subprocess.run([sys.executable, "-c", script], cwd=REPO_ROOT, capture_output=True, text=True,
                           timeout=120, env={**env, "TF_CPP_MIN_LOG_LEVEL": "0"})
    assert shown.returncode == 0 and shown.stderr.splitlines()[-1] == "ok", shown.stderr
    if not info.search(shown.stderr):
        pytest.skip("TensorFlow printed no INFO line while loading on this machine")
    quiet = subprocess.run([sys.executable, "-c", script], cwd=REPO_ROOT, capture_output=True, text=True,
                           timeout=120, env=env)
    assert quiet.returncode == 0 and quiet.stderr.splitlines()[-1] == "ok"
    assert not info.search(quiet.stderr) and "absl::InitializeLog" not in quiet.stderr, quiet.stderr
    assert not re.search(r"^E\d{4} ", quiet.stderr, re.MULTILINE), quiet.stderr
    assert f"note {tf_log._onednn_lacks_float16()}" in quiet.stderr.splitlines()
    if not os.path.exists("/dev/nvidiactl"):
        assert "cuInit" not in quiet.stderr, quiet.stderr


@pytest.mark.subprocess
def test_thread_pools_and_devices_can_still_be_set_after_the_quieted_import():
    """On a CPU without float16 instructions the quieted import runs a float16 graph (its oneDNN line then falls
    inside the filter); an eager op there fixed TensorFlow's thread pools for the process, and every server with
    --tensorflow_intra_op_parallelism exited "cannot be modified after initialization" (an AMD EPYC with AVX2
    only). The probe is forced here, so this holds on every CPU."""
    script = ("from serving import tf_log; tf_log._onednn_lacks_float16 = lambda: True; tf_log.quiet_tensorflow('1'); "
              "import sys, tensorflow as tf; tf.config.threading.set_intra_op_parallelism_threads(1); "
              "tf.config.threading.set_inter_op_parallelism_threads(1); tf.config.set_visible_devices([], 'GPU'); "
              "print('ok', tf_log.float16_note() is not None, file=sys.stderr)")
    env = {key: value for key, value in os.environ.items() if key != "TF_CPP_MIN_LOG_LEVEL"}
    run = subprocess.run([sys.executable, "-c", script], cwd=REPO_ROOT, capture_output=True, text=True, timeout=120,
                         env=env)
    assert run.returncode == 0 and run.stderr.splitlines()[-1] == "ok True", run.stderr


def test_onednn_float16_line_is_hidden_only_where_the_cpu_lacks_float16(monkeypatch):
    """Which CPUs get oneDNN's float16 line hidden (and said at INFO instead): oneDNN on, an x86 CPU with none
    of AVX512_FP16, AMX_FP16, AVX_NE_CONVERT (the AMD EPYC of issue 31); the line itself, at any level."""
    amd = {"avx2", "avx512f", "avx512bw", "avx512_bf16", "avx512_vnni"}
    monkeypatch.delenv("TF_ENABLE_ONEDNN_OPTS", raising=False)
    for flags, lacks in ((amd, True), (amd | {"avx512_fp16"}, False), (amd | {"amx_fp16"}, False), (set(), False)):
        monkeypatch.setattr(tf_log, "cpu_info", lambda flags=flags: ("", frozenset(flags)))
        assert tf_log._onednn_lacks_float16() is lacks, flags
    monkeypatch.setattr(tf_log, "cpu_info", lambda: ("", frozenset(amd)))
    monkeypatch.setenv("TF_ENABLE_ONEDNN_OPTS", "0")  # Eigen's kernels everywhere: oneDNN says nothing
    assert not tf_log._onednn_lacks_float16()
    line = (b"E0000 00:00:1795465277.088969    5657 util.cc:131] oneDNN supports DT_HALF only on platforms with "
            b"AVX-512. Falling back to the default Eigen-based implementation if present.\n")
    assert tf_log._hidden(line, b"I", no_gpu=True, no_float16=True)
    assert not tf_log._hidden(line, b"I", no_gpu=True, no_float16=False)
    assert not tf_log._hidden(b"E0000 00:00:1.0    1 x.cc:1] another error\n", b"I", no_gpu=True, no_float16=True)


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
        assert re.match(r"\d\d:\d\d:\d\d serving", server.stderr_path.read_text())  # our lines first, not TF's
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


# Every flag of tensorflow_model_server: tensorflow/serving 9d981c5 (identical at 2.20.0),
# tensorflow_serving/model_servers/main.cc.
TF_SERVING_MAIN_FLAGS = (
    "port", "grpc_socket_path", "rest_api_port", "rest_api_num_threads", "rest_api_timeout_in_ms",
    "rest_api_enable_cors_support", "enable_batching", "allow_version_labels_for_unavailable_models",
    "batching_parameters_file", "enable_per_model_batching_parameters", "model_config_file",
    "model_config_file_poll_wait_seconds", "model_name", "model_base_path", "num_load_threads",
    "num_unload_threads", "max_num_load_retries", "load_retry_interval_micros", "file_system_poll_wait_seconds",
    "flush_filesystem_caches", "tensorflow_session_parallelism", "tensorflow_session_config_file",
    "tensorflow_intra_op_parallelism", "tensorflow_inter_op_parallelism", "use_alts_credentials", "ssl_config_file",
    "platform_config_file", "per_process_gpu_memory_fraction", "saved_model_tags", "grpc_channel_arguments",
    "grpc_max_threads", "enable_model_warmup", "num_request_iterations_for_warmup", "version",
    "monitoring_config_file", "remove_unused_fields_from_bundle_metagraph", "prefer_tflite_model", "num_tflite_pools",
    "num_tflite_interpreters_per_pool", "enable_signature_method_name_check", "xla_cpu_compilation_enabled",
    "xla_gpu_compilation_enabled", "enable_profiler", "thread_pool_factory_config_file", "mixed_precision",
    "skip_initialize_tpu", "enable_grpc_healthcheck_service", "enable_serialization_as_tensor_content",
)


def test_every_tensorflow_model_server_flag_is_known():
    """Scripts and orchestrators (KServe, Seldon) written for tensorflow_model_server never meet 'unrecognized
    arguments': each of its 48 flags is implemented, or accepted at TF Serving's default and refused, with the
    reason, at any other value (serving/flags.py TF_SERVING_ONLY)."""
    import dataclasses

    from serving import flags

    ours = {field.name for field in dataclasses.fields(flags.Options)} | set(flags.TF_SERVING_ONLY)
    assert len(TF_SERVING_MAIN_FLAGS) == 48 and not set(TF_SERVING_MAIN_FLAGS) - ours
    assert not set(flags.TF_SERVING_ONLY) - set(TF_SERVING_MAIN_FLAGS)
    base = ["--model_name=m", "--model_base_path=/x"]
    defaults = [f"--{name}={default}" for name, (default, _) in flags.TF_SERVING_ONLY.items()]
    assert flags.parse(base + defaults).model_name == "m"  # every one at its default: accepted


@pytest.mark.parametrize("flag, message", [
    ("--num_load_threads=4", "--num_load_threads=4: versions load one at a time (tensorflow_model_server's default, "
                             "0, is accepted)"),
    ("--mixed_precision=bfloat16", "--mixed_precision=bfloat16: no graph rewrite at load"),
    ("--grpc_socket_path=/tmp/socket", "no UNIX-socket gRPC endpoint; use --port"),
    ("--saved_model_tags=serve,gpu", "this server loads the MetaGraph tagged 'serve'"),
])
def test_tensorflow_model_server_flags_it_does_not_implement_are_refused_with_the_reason(flag, message):
    result = run_server("--model_name=m", "--model_base_path=/x", flag)
    assert result.returncode == 2 and message in result.stderr and len(result.stderr.splitlines()) == 1


def test_version_prints_the_versions(capsys):
    result = run_main(capsys, "--version")
    assert result.returncode == 0 and result.stdout.startswith("python -m serving (mixed-precision-pipeline ")
    assert "TensorFlow 2." in result.stdout
