"""The server under attack, as a hostile client on 127.0.0.1 would try it (docs/operations.md's threat model): each
attack is answered with a status a client can act on, while a well-behaved client keeps being answered, and the
server neither dies nor keeps the memory the attack cost.

The bounds on time are loose on purpose (a loaded 2-core CI machine is slow): each attack used to cost seconds to
minutes, or the whole server; the tests check it now costs a bounded fraction of that. The latency figures
(a well-behaved client's p99 during each attack) are measured by hand with the same attacks; see the closing
numbers in bench/README.md.
"""

from __future__ import annotations

import asyncio
import collections
import json
import resource
import signal
import socket
import struct
import threading
import time
import urllib.error
import urllib.request
from pathlib import Path

import grpc
import numpy as np
import psutil
import pytest
from grpc_health.v1 import health_pb2, health_pb2_grpc
from tensorflow.core.framework import types_pb2
from tensorflow_serving.apis import get_model_metadata_pb2, predict_pb2, prediction_service_pb2_grpc

from server_helpers import wait_for
from serving import limits
from serving.errors import MAX_MESSAGE_CHARS
from serving.servable import tensors

pytestmark = [pytest.mark.timeout(300), pytest.mark.subprocess]
PREDICT = "/tensorflow.serving.PredictionService/Predict"


@pytest.fixture(scope="module")
def server(copy_testdata, start_server, tmp_path_factory):
    root = tmp_path_factory.mktemp("attacks")
    base = copy_testdata("saved_model_half_plus_two_cpu", root / "half_plus_two")
    monitoring = root / "monitoring.config"
    monitoring.write_text('prometheus_config { enable: true, path: "/monitoring/prometheus/metrics" }\n')
    server = start_server("--model_name=half_plus_two", f"--model_base_path={base}", "--rest_api_port=-1",
                          "--enable_batching", f"--monitoring_config_file={monitoring}", log_dir=root)
    assert answered(server.address)  # the first requests' one-off costs (sessions, batch threads) come before RSS is read
    yield server
    assert server.stop() == 0, server.stderr_tail()
    log = server.stderr_path.read_text(errors="replace")
    assert "Traceback" not in log, log[log.index("Traceback") - 300:][:3000]


def predict_request(rows: int = 1) -> predict_pb2.PredictRequest:
    request = predict_pb2.PredictRequest()
    request.model_spec.name = "half_plus_two"
    request.inputs["x"].ParseFromString(tensors.serialize_tensor_proto(np.ones((rows, 1), np.float32)))
    return request


def answered(address: str) -> bool:
    """A well-behaved client is answered (a fresh connection, a one-row Predict)."""
    with grpc.insecure_channel(address) as channel:
        response = prediction_service_pb2_grpc.PredictionServiceStub(channel).Predict(predict_request(), timeout=30)
    return list(response.outputs["y"].float_val) == [2.5]


def rss_mb(server) -> float:
    return psutil.Process(server.process.pid).memory_info().rss / 2**20


def peak_rss_mb(server) -> float:
    """The server's peak RSS so far (VmHWM), which catches an allocation freed again before RSS is read."""
    status = Path(f"/proc/{server.process.pid}/status").read_text()
    return int(next(line.split()[1] for line in status.splitlines() if line.startswith("VmHWM:"))) / 1024


def raw_call(channel: grpc.Channel, method: str = PREDICT):
    return channel.unary_unary(method)  # bytes in, bytes out: the server parses whatever is sent


def test_a_gzip_bomb_is_refused_before_it_is_inflated_and_its_memory_given_back(server):
    """Issue 22 #2: a Predict of a few hundred KB that gzip inflates past the receive limit was inflated before
    any check (4 of 1 GiB aborted the server); now gRPC stops at the receive limit. Issue 31 #4: four 1 GiB-in-1
    MB bombs at once left RSS 67 MB higher for good (glibc kept what gRPC freed); now it is given back."""
    request = predict_request()
    # 256 MiB, nearly four times the receive limit gRPC inflates up to (limits.MAX_RECEIVE_MESSAGE_BYTES): the
    # server inflates and gives back what it did for 1 GiB; the client's gzip of 1 GiB took seconds a call.
    request.inputs["x"].tensor_content = bytes(2**28)
    payload = request.SerializeToString()
    assert len(payload) > 3 * limits.MAX_RECEIVE_MESSAGE_BYTES
    start_mb, outcomes = rss_mb(server), []

    def attack() -> None:
        with grpc.insecure_channel(server.address, compression=grpc.Compression.Gzip,
                                   options=[("grpc.max_send_message_length", -1)]) as channel:
            try:
                raw_call(channel)(payload, timeout=120)
                outcomes.append("OK")
            except grpc.RpcError as error:
                outcomes.append((error.code(), error.details()))

    threads = [threading.Thread(target=attack) for _ in range(4)]
    for thread in threads:
        thread.start()
    for thread in threads:
        thread.join(240)
    assert outcomes == [(grpc.StatusCode.RESOURCE_EXHAUSTED, "Decompressed message larger than max")] * 4
    assert answered(server.address)
    rss = [rss_mb(server)]
    try:
        wait_for(lambda: rss.append(rss_mb(server)) or rss[-1] - start_mb < 20, timeout_s=30)
    except AssertionError:
        raise AssertionError(f"RSS {start_mb:.0f} MB before, {[round(x) for x in rss[::100]]} after") from None


def test_undecodable_messages_are_invalid_argument_with_one_log_line(server):
    """Issue 22 #10: bytes that do not parse as the RPC's message were UNKNOWN with a traceback each."""
    log_before = server.stderr_path.read_text(errors="replace").count("Failed to parse the request")
    with grpc.insecure_channel(server.address) as channel:
        for garbage in (b"\xff" * 10, b"\x0a\xff\xff\xff\xff\x0f", b"\x12\x05abc"):
            for _ in range(20):
                with pytest.raises(grpc.RpcError) as error:
                    raw_call(channel)(garbage, timeout=10)
                assert error.value.code() == grpc.StatusCode.INVALID_ARGUMENT
                assert error.value.details().startswith("Failed to parse the request")
    log = server.stderr_path.read_text(errors="replace")
    assert log.count("Failed to parse the request") - log_before <= 1 and "Traceback" not in log


def test_80000_dims_are_refused_without_blocking_anyone(server):
    """Issue 22 #4: a Predict declaring 80,000 dims (960 KB) held the event loop 20 s while they were multiplied."""
    request = predict_request()
    request.inputs["x"].tensor_shape.ClearField("dim")
    for _ in range(80_000):
        request.inputs["x"].tensor_shape.dim.add(size=2)
    start = time.monotonic()
    with grpc.insecure_channel(server.address, options=[("grpc.max_send_message_length", -1)]) as channel:
        with pytest.raises(grpc.RpcError) as error:
            prediction_service_pb2_grpc.PredictionServiceStub(channel).Predict(request, timeout=60)
    assert error.value.code() == grpc.StatusCode.INVALID_ARGUMENT
    assert "80000 dimensions; at most 64 are allowed" in error.value.details()
    assert time.monotonic() - start < 10 and answered(server.address)


@pytest.mark.parametrize("shape", [[2**63 - 1, 0], [2**40, 2**40, 0]])
def test_a_shape_too_large_for_any_array_is_invalid_argument(server, shape):
    """Issue 22 #11: shape [2^63-1, 0] was INTERNAL (numpy's "array is too big")."""
    request = predict_request()
    request.inputs["x"].Clear()
    request.inputs["x"].dtype = types_pb2.DT_FLOAT
    for size in shape:
        request.inputs["x"].tensor_shape.dim.add(size=size)
    with grpc.insecure_channel(server.address) as channel:
        with pytest.raises(grpc.RpcError) as error:
            prediction_service_pb2_grpc.PredictionServiceStub(channel).Predict(request, timeout=10)
    assert error.value.code() == grpc.StatusCode.INVALID_ARGUMENT and "too large for any array" in error.value.details()


def test_client_strings_in_errors_are_cut_short(server):
    """Issue 22 #14: a 16 KB model name or a 256 KB output_filter came back whole, and gRPC turned the oversized
    status into RESOURCE_EXHAUSTED."""
    with grpc.insecure_channel(server.address) as channel:
        stub = prediction_service_pb2_grpc.PredictionServiceStub(channel)
        request = predict_request()
        request.model_spec.name = "m" * 16_384
        with pytest.raises(grpc.RpcError) as error:
            stub.Predict(request, timeout=10)
        assert error.value.code() == grpc.StatusCode.NOT_FOUND and len(error.value.details()) < 200
        request = predict_request()
        request.output_filter.extend([f"{'o' * 1000}{i}" for i in range(256)])
        with pytest.raises(grpc.RpcError) as error:
            stub.Predict(request, timeout=10)
        assert error.value.code() == grpc.StatusCode.INVALID_ARGUMENT
        assert len(error.value.details()) <= MAX_MESSAGE_CHARS
        metadata = get_model_metadata_pb2.GetModelMetadataRequest(metadata_field=["f" * 100_000])
        metadata.model_spec.name = "half_plus_two"
        with pytest.raises(grpc.RpcError) as error:
            stub.GetModelMetadata(metadata, timeout=10)
        assert error.value.code() == grpc.StatusCode.INVALID_ARGUMENT and len(error.value.details()) < 300


def test_health_watch_streams_hold_no_thread(server):
    """Issue 22 #3: 8 Health/Watch calls took all 8 worker threads for good (grpc_health's thread servicer);
    with the asyncio one, 32 open Watch streams leave every RPC answered, and cancelling them frees them."""
    with grpc.insecure_channel(server.address) as channel:
        health = health_pb2_grpc.HealthStub(channel)
        watches = [health.Watch(health_pb2.HealthCheckRequest(service=name), timeout=60)
                   for name in ["", "half_plus_two", "nope"] * 11]
        assert [next(watch).status for watch in watches[:3]] == [
            health_pb2.HealthCheckResponse.SERVING, health_pb2.HealthCheckResponse.SERVING,
            health_pb2.HealthCheckResponse.SERVICE_UNKNOWN]
        stub = prediction_service_pb2_grpc.PredictionServiceStub(channel)
        metadata = get_model_metadata_pb2.GetModelMetadataRequest(metadata_field=["signature_def"])
        metadata.model_spec.name = "half_plus_two"
        assert stub.GetModelMetadata(metadata, timeout=10).model_spec.version.value == 123
        assert list(stub.Predict(predict_request(), timeout=10).outputs["y"].float_val) == [2.5]
        for watch in watches:
            watch.cancel()
    assert answered(server.address)


def test_idle_connections_beyond_the_cap_are_closed_and_the_server_keeps_serving(copy_testdata, start_server,
                                                                                 tmp_path):
    """Issue 22 #5: 1,100 idle HTTP/2 connections took every descriptor and both ports stopped accepting. Now the
    gRPC port takes at most a quarter of ulimit -n (here 1024: 256 connections) and closes the rest at once;
    open connections and the REST port keep being answered, and idle connections are closed after
    grpc.max_connection_idle_ms (60 s by default, 2 s here), after which new clients connect again."""
    base = copy_testdata("saved_model_half_plus_two_cpu", tmp_path / "half_plus_two")
    soft, hard = resource.getrlimit(resource.RLIMIT_NOFILE)
    resource.setrlimit(resource.RLIMIT_NOFILE, (1024, hard))  # the server inherits it
    try:
        server = start_server("--model_name=half_plus_two", f"--model_base_path={base}", "--rest_api_port=-1",
                              "--grpc_channel_arguments=grpc.max_connection_idle_ms=2000", log_dir=tmp_path)
    finally:
        resource.setrlimit(resource.RLIMIT_NOFILE, (soft, hard))
    host, port = server.address.rsplit(":", 1)
    preface = b"PRI * HTTP/2.0\r\n\r\nSM\r\n\r\n" + b"\x00\x00\x00\x04\x00\x00\x00\x00\x00"  # and an empty SETTINGS
    sockets = []
    try:
        with grpc.insecure_channel(server.address) as channel:
            stub = prediction_service_pb2_grpc.PredictionServiceStub(channel)
            stub.Predict(predict_request(), timeout=10)  # a client connected before the flood
            for _ in range(1100):
                sock = socket.create_connection((host, int(port)), timeout=10)
                sock.sendall(preface)
                sockets.append(sock)
            wait_for(lambda: psutil.Process(server.process.pid).num_fds() < 400, timeout_s=30)
            assert list(stub.Predict(predict_request(), timeout=10).outputs["y"].float_val) == [2.5]
        with urllib.request.urlopen(f"http://{server.rest_address}/v1/models/half_plus_two", timeout=10) as reply:
            assert reply.status == 200

        def connects() -> bool:
            try:
                return answered(server.address)
            except grpc.RpcError:
                return False

        wait_for(connects, timeout_s=60)  # the flood's idle connections were closed
    finally:
        for sock in sockets:
            sock.close()
        assert server.stop() == 0


def _hpack_literal(name: bytes, value: bytes) -> bytes:
    """An HPACK "literal header field without indexing, new name" (RFC 7541 6.2.2), lengths under 127."""
    return b"\x00" + bytes([len(name)]) + name + bytes([len(value)]) + value


def _headers_frame(stream_id: int, authority: bytes, *extra: tuple[bytes, bytes], end_stream: bool = False) -> bytes:
    block = b"".join(_hpack_literal(name, value) for name, value in (
        (b":method", b"POST"), (b":scheme", b"http"), (b":path", PREDICT.encode()), (b":authority", authority),
        (b"content-type", b"application/grpc"), (b"te", b"trailers"), *extra))
    flags = 0x04 | (0x01 if end_stream else 0)  # END_HEADERS (and END_STREAM: a call without a message)
    return struct.pack(">I", len(block))[1:] + b"\x01" + bytes([flags]) + struct.pack(">I", stream_id) + block


def _rst_stream_frame(stream_id: int) -> bytes:
    return b"\x00\x00\x04\x03\x00" + struct.pack(">I", stream_id) + struct.pack(">I", 8)  # CANCEL


@pytest.mark.parametrize("reset", [False, True], ids=["held open", "rapid reset"])
def test_header_only_streams_on_one_connection_are_bounded(server, reset):
    """Issue 22 #6: 150,000 header-only streams on one connection kept +2.2 GB; now a connection holds at most
    MAX_CONCURRENT_STREAMS open calls, and streams opened and reset at once leave nothing behind."""
    host, port = server.address.rsplit(":", 1)
    start_mb = rss_mb(server)
    with socket.create_connection((host, int(port)), timeout=30) as sock:
        sock.sendall(b"PRI * HTTP/2.0\r\n\r\nSM\r\n\r\n" + b"\x00\x00\x00\x04\x00\x00\x00\x00\x00")
        for batch in range(30):
            frames = b"".join(_headers_frame(stream_id, server.address.encode())
                              + (_rst_stream_frame(stream_id) if reset else b"")
                              for stream_id in range(1 + 2000 * batch, 1 + 2000 * (batch + 1), 2))
            try:
                sock.sendall(frames)
            except OSError:  # the server may close a connection that breaks the rules
                break
        assert answered(server.address)
    wait_for(lambda: rss_mb(server) - start_mb < 100, timeout_s=30)


def grpc_requests_counted(server) -> collections.Counter:
    """tensorflow_serving_request_count_total of the gRPC API's Predict calls, by status."""
    with urllib.request.urlopen(f"http://{server.rest_address}/monitoring/prometheus/metrics", timeout=30) as answer:
        text = answer.read().decode()
    counted: collections.Counter = collections.Counter()
    for line in text.splitlines():
        if line.startswith("tensorflow_serving_request_count_total{") and 'api="grpc"' in line and 'rpc="Predict"' in line:
            counted[line.split('status="')[1].split('"')[0]] += int(float(line.rsplit(" ", 1)[1]))
    return counted


def test_calls_that_expire_or_are_cancelled_before_their_message_arrives_are_counted(server):
    """Issue 31 #6: calls whose deadline passed while they waited for the server (6,067 of them) were absent
    from request_count_total. Streams that send headers only, and then expire (grpc-timeout 300 ms), are
    cancelled (RST_STREAM) or end without a message, are each counted by their status."""
    host, port = server.address.rsplit(":", 1)
    before = grpc_requests_counted(server)
    authority = server.address.encode()
    expiring = b"".join(_headers_frame(stream_id, authority, (b"grpc-timeout", b"300m")) for stream_id in range(1, 40, 2))
    cancelled = b"".join(_headers_frame(stream_id, authority) for stream_id in range(41, 80, 2))
    empty = b"".join(_headers_frame(stream_id, authority, end_stream=True) for stream_id in range(81, 100, 2))
    with socket.create_connection((host, int(port)), timeout=30) as sock:
        sock.sendall(b"PRI * HTTP/2.0\r\n\r\nSM\r\n\r\n" + b"\x00\x00\x00\x04\x00\x00\x00\x00\x00" + expiring + cancelled
                     + empty)
        time.sleep(0.5)
        sock.sendall(b"".join(_rst_stream_frame(stream_id) for stream_id in range(41, 80, 2)))

        def counted() -> dict:
            now = grpc_requests_counted(server)
            return {status: now[status] - before[status] for status in now if now[status] != before[status]}

        wait_for(lambda: sum(counted().values()) >= 50, timeout_s=30)
    assert counted() == {"DEADLINE_EXCEEDED": 20, "CANCELLED": 20, "INVALID_ARGUMENT": 10}


def calls_at_once(address: str, calls: int) -> collections.Counter:
    """One asyncio client opening `calls` one-row Predicts at once on one channel: their outcomes, with details."""
    payload = predict_request().SerializeToString()

    async def burst() -> collections.Counter:
        codes: collections.Counter = collections.Counter()
        async with grpc.aio.insecure_channel(address) as channel:
            call = channel.unary_unary(PREDICT)

            async def one() -> None:
                try:  # a deadline no loaded 2-core CI machine reaches (at 60 s, 159 of 3,000 once passed it)
                    await call(payload, timeout=240)
                    codes["OK"] += 1
                except grpc.aio.AioRpcError as error:
                    codes[f"{error.code().name}: {error.details()}"] += 1

            await asyncio.gather(*(one() for _ in range(calls)))
        return codes

    return asyncio.run(burst())


def test_a_burst_of_calls_on_one_channel_is_answered_not_refused(server):
    """Issue 31 #2: 500 calls opened at once on one channel (any asyncio client does it) were 3,527 of 6,064
    UNAVAILABLE "Stream removed": gRPC refused streams beyond 100 that it had not yet freed. Now the calls
    beyond the per-connection limit wait in the client for a stream, as HTTP/2 means them to."""
    assert calls_at_once(server.address, 500) == {"OK": 500}


def test_overload_is_answered_unavailable_or_resource_exhausted_never_cancelled(server):
    """Issue 22 #7: 5,000 one-row calls at once were partly CANCELLED by gRPC core's own shedding."""
    codes = calls_at_once(server.address, 3000)
    assert codes["OK"] > 0 and {outcome.split(":")[0] for outcome in codes} <= {"OK", "UNAVAILABLE",
                                                                                "RESOURCE_EXHAUSTED"}, codes
    assert answered(server.address)


def test_requests_beyond_the_in_flight_bounds_are_resource_exhausted(start_server, tmp_path, write_gate_model):
    """Issue 22 #8: pending requests were unbounded (3,000 of 256 KB: +2.5 GB); now one beyond
    --max_inflight_requests or --max_inflight_request_bytes is refused at once, gRPC and REST alike."""
    write_gate_model(tmp_path / "gate" / "1")
    server = start_server("--model_name=gate", f"--model_base_path={tmp_path / 'gate'}", "--rest_api_port=-1",
                          "--max_inflight_requests=1", "--enable_model_warmup=false", log_dir=tmp_path)
    held = predict_pb2.PredictRequest(model_spec={"name": "gate"})
    held.inputs["dir"].ParseFromString(tensors.serialize_tensor_proto(np.array(str(tmp_path).encode(), object)))
    try:
        with grpc.insecure_channel(server.address) as channel:
            stub = prediction_service_pb2_grpc.PredictionServiceStub(channel)
            in_flight = stub.Predict.future(held, timeout=60)
            wait_for(lambda: (tmp_path / "started").exists())
            with pytest.raises(grpc.RpcError) as refused:
                stub.Predict(held, timeout=10)
            assert refused.value.code() == grpc.StatusCode.RESOURCE_EXHAUSTED
            assert "--max_inflight_requests" in refused.value.details()
            with pytest.raises(urllib.error.HTTPError) as rest:
                urllib.request.urlopen(f"http://{server.rest_address}/v1/models/gate", timeout=10)
            assert rest.value.code == 429
            # Issue 31 #3: a REST body beyond the bounds is refused from its Content-Length, before it is read
            # (3,000 pending 286 KB bodies, each read before it was refused: +943 MB peak RSS; see the test below).
            host, port = server.rest_address.rsplit(":", 1)
            with socket.create_connection((host, int(port)), timeout=10) as sock:
                sock.sendall(b"POST /v1/models/gate:predict HTTP/1.1\r\nHost: x\r\nContent-Type: application/json\r\n"
                             b"Content-Length: 50000000\r\n\r\n")  # and not one byte of the body
                assert sock.recv(4096).startswith(b"HTTP/1.1 429 ")
            (tmp_path / "release").touch()
            assert in_flight.result(30).outputs["polls"]
            assert stub.Predict(held, timeout=30).outputs["polls"]  # free again
    finally:
        (tmp_path / "release").touch()
        assert server.stop() == 0


def test_pending_rest_bodies_hold_little_more_than_the_in_flight_byte_cap(start_server, tmp_path, write_gate_model):
    """Issue 31 #3: 3,000 pending 286 KB REST bodies against the 256 MiB cap peaked at +943 MB of RSS (3.7x): each
    body was read whole before it was refused, asyncio read up to 256 KiB of every connection at once, and a
    parsed body was kept beside its tensors until answered; now +348-357 MB while they arrive, +380-431 MB when all
    are answered at once (1.3x, 1.4-1.6x). Here at a third of the scale, where the 766 refused connections' own
    costs weigh more: 2.2x the cap (3.6x before the body was freed once parsed and reads cut to 16 KiB)."""
    aiohttp = pytest.importorskip("aiohttp")
    write_gate_model(tmp_path / "gate" / "1", payload=True)
    cap = 64 * 2**20
    server = start_server("--model_name=gate", f"--model_base_path={tmp_path / 'gate'}", "--rest_api_port=-1",
                          f"--max_inflight_request_bytes={cap}", "--enable_model_warmup=false", log_dir=tmp_path)
    body = json.dumps({"inputs": {"dir": str(tmp_path), "x": [1.2345678] * 26000}}).encode()
    url = f"http://{server.rest_address}/v1/models/gate:predict"
    outcomes: collections.Counter = collections.Counter()

    async def attack() -> float:
        async with aiohttp.ClientSession(connector=aiohttp.TCPConnector(limit=0),
                                         timeout=aiohttp.ClientTimeout(total=240)) as session:
            async def one():
                try:
                    async with session.post(url, data=body) as response:
                        await response.read()
                        outcomes[response.status] += 1
                except aiohttp.ClientError:
                    outcomes["connection closed"] += 1  # refused before its body was sent: closed at once

            warm = tmp_path / "warm"  # a first call's one-off costs (threads, the function) come before RSS is read
            (warm / "release").parent.mkdir()
            (warm / "release").touch()
            for _ in range(8):
                async with session.post(url, data=body.replace(str(tmp_path).encode(), str(warm).encode())) as response:
                    assert response.status == 200, await response.text()
            before = rss_mb(server)
            requests = [asyncio.ensure_future(one()) for _ in range(1000)]
            settled, deadline = -1, time.monotonic() + 120
            while time.monotonic() < deadline and sum(outcomes.values()) != settled:  # until refusals stop coming
                settled = sum(outcomes.values())
                await asyncio.sleep(2)
            growth = peak_rss_mb(server) - before
            (tmp_path / "release").touch()
            await asyncio.gather(*requests)
            return growth

    try:
        growth = asyncio.run(attack())
    finally:
        (tmp_path / "release").touch()
        assert server.stop() == 0
    admitted = cap // len(body)
    assert outcomes[200] >= admitted * 0.9 and outcomes[429] > 0 and sum(outcomes.values()) == 1000, outcomes
    assert growth <= 2.75 * cap / 2**20, f"peak RSS grew {growth:.0f} MB with {cap / 2**20:.0f} MiB in flight"


def test_a_rest_body_of_a_million_rows_is_refused_before_it_is_parsed(server):
    """Issue 22 #12: a 64 MiB body of one-element rows froze every client 11 s (+2.1 GB) while it was parsed."""
    body = b'{"instances": [' + b",".join([b"[1.0]"] * 2_000_000) + b"]}"
    start_mb, start = rss_mb(server), time.monotonic()
    request = urllib.request.Request(f"http://{server.rest_address}/v1/models/half_plus_two:predict", data=body,
                                     method="POST")
    with pytest.raises(urllib.error.HTTPError) as error:
        urllib.request.urlopen(request, timeout=60)
    assert error.value.code == 400 and b"at most 1048576 are allowed" in error.value.read()
    assert time.monotonic() - start < 20 and answered(server.address)
    wait_for(lambda: rss_mb(server) - start_mb < 100, timeout_s=30)


def test_a_rest_body_of_quote_backslash_pairs_is_answered_at_once(server):
    """Issue 22 #1: 64 KiB of '"\\' pairs froze every client 13 s (quadratic backtracking in the JSON pre-check);
    1 MiB would have taken about an hour."""
    body = b'{"a": "' + b'"\\' * 2**19
    start = time.monotonic()
    request = urllib.request.Request(f"http://{server.rest_address}/v1/models/x:predict", data=body, method="POST")
    with pytest.raises(urllib.error.HTTPError) as error:
        urllib.request.urlopen(request, timeout=60)
    assert error.value.code == 400 and time.monotonic() - start < 10 and answered(server.address)


def test_sigterm_under_load_answers_every_request_that_arrived_before_it(copy_testdata, start_server, tmp_path):
    """Issue 22 #15: with 48 closed-loop clients, 37-47 requests sent just before SIGTERM were refused
    UNAVAILABLE, then ~46 CANCELLED. Now every request sent before the signal is answered OK; later ones get
    UNAVAILABLE (gRPC) or 503 (REST) once refusing begins; the process exits 0 within the grace period.

    The 44 gRPC clients are tasks on one event loop, not threads: with 48 threads a thread that had stamped its
    `sent` could wait for the GIL longer than the server's admit grace (limits.DRAIN_ADMIT_S) before its call
    left (CI once saw 11 such calls refused), so `sent` would not be when the call was sent."""
    base = copy_testdata("saved_model_half_plus_two_cpu", tmp_path / "half_plus_two")
    server = start_server("--model_name=half_plus_two", f"--model_base_path={base}", "--rest_api_port=-1",
                          "--enable_batching", "--grace_period_s=30", log_dir=tmp_path)
    payload, records, stop = predict_request(64).SerializeToString(), [], threading.Event()

    async def grpc_client(call) -> None:  # noqa: ANN001 - a grpc.aio multicallable
        while not stop.is_set():
            sent = time.time()
            try:
                await call(payload, timeout=30)
                records.append((sent, "OK"))
            except grpc.RpcError as error:
                records.append((sent, error.code().name))
                await asyncio.sleep(0.05)

    async def grpc_clients() -> None:
        async with grpc.aio.insecure_channel(server.address) as channel:
            call = channel.unary_unary(PREDICT)
            await asyncio.gather(*(grpc_client(call) for _ in range(44)))

    def rest_client() -> None:
        url = f"http://{server.rest_address}/v1/models/half_plus_two:predict"
        while not stop.is_set():
            sent = time.time()
            try:
                with urllib.request.urlopen(urllib.request.Request(url, data=b'{"instances": [[1.0]]}'),
                                            timeout=30) as reply:
                    records.append((sent, f"REST {reply.status}"))
            except urllib.error.HTTPError as error:
                records.append((sent, f"REST {error.code}"))
                stop.wait(0.05)
            except OSError:  # refused: the port has closed
                records.append((sent, "REST closed"))
                stop.wait(0.05)

    threads = [threading.Thread(target=asyncio.run, args=(grpc_clients(),))] + \
        [threading.Thread(target=rest_client) for _ in range(4)]
    for thread in threads:
        thread.start()
    wait_for(lambda: len(records) > 500, timeout_s=60)
    signalled = time.time()
    server.process.send_signal(signal.SIGTERM)
    code = server.process.wait(60)
    stopped = time.time()
    stop.set()
    for thread in threads:
        thread.join(60)
    before = collections.Counter(outcome for sent, outcome in records if sent < signalled)
    after = collections.Counter(outcome for sent, outcome in records if sent >= signalled)
    assert code == 0 and stopped - signalled < 30
    assert set(before) <= {"OK", "REST 200"}, before
    assert after["UNAVAILABLE"] > 0 and after["REST 503"] + after["REST closed"] > 0, after
    assert "REST 500" not in after and "INTERNAL" not in after and "UNKNOWN" not in after, after


def test_hostile_images_are_refused_while_a_good_client_is_answered(image_export, start_server, tmp_path):
    """Issue 28: decompression bombs (1.6 Gpixel in 1 KB), random bytes, truncated JPEGs, PNG chunks claiming
    2 GiB and base64 of base64, from 4 clients with batching on: each refused INVALID_ARGUMENT, the good client
    answered throughout, no traceback (the module's fixture checks the other server's log; this one is checked
    here), and the server's memory neither peaks nor stays up."""
    import base64

    from pipeline.data.image_probes import png_declaring
    from pipeline.export.signatures import IMAGES_INPUT, IMAGES_SIGNATURE
    from serving.client import grpc_client

    def png(width: int, height: int, extra: bytes = b"") -> bytes:
        return png_declaring(width, height, rows=1, chunks=extra)

    photo = (Path(__import__("sklearn").__file__).parent / "datasets" / "images" / "china.jpg").read_bytes()
    rng = np.random.default_rng(0)
    hostile = ([png(40_000, 40_000)] * 20 + [rng.bytes(int(n)) for n in rng.integers(1, 4096, 200)]
               + [photo[:n] for n in (2_000, 10_000, 30_000)] * 10
               + [png(16, 16, struct.pack(">I", 0x7FFFFFF0) + b"tEXt" + b"x" * 64)] * 20
               + [base64.b64encode(base64.b64encode(photo))] * 10)
    server = start_server(f"--model_name={image_export.model_name}", f"--model_base_path={image_export.base_path}",
                          "--enable_batching", log_dir=tmp_path)
    good = np.array(image_export.files[:4], dtype=object)

    def predict(images: np.ndarray, channel: grpc.Channel):
        request = grpc_client.predict_request(image_export.model_name, {IMAGES_INPUT: images}, IMAGES_SIGNATURE)
        return prediction_service_pb2_grpc.PredictionServiceStub(channel).Predict(request, timeout=60)

    try:
        with grpc.insecure_channel(server.address) as channel:
            expected = tensors.to_ndarray(predict(good, channel).outputs["probabilities"], "probabilities")
        start_mb, start_peak_mb, codes, answers = rss_mb(server), peak_rss_mb(server), collections.Counter(), []
        stop = threading.Event()

        def attack(part: list[bytes]) -> None:
            with grpc.insecure_channel(server.address) as channel:
                for contents in part:
                    try:
                        predict(np.array([image_export.files[0], contents], dtype=object), channel)
                        codes["OK"] += 1
                    except grpc.RpcError as error:
                        codes[error.code().name] += 1

        def good_client() -> None:
            with grpc.insecure_channel(server.address) as channel:
                while not stop.is_set():
                    answers.append(tensors.to_ndarray(predict(good, channel).outputs["probabilities"], "probabilities"))

        watcher = threading.Thread(target=good_client)
        watcher.start()
        attackers = [threading.Thread(target=attack, args=(hostile[i::4],)) for i in range(4)]
        for thread in attackers:
            thread.start()
        for thread in attackers:
            thread.join(240)
        stop.set()
        watcher.join(60)
        assert codes == {"INVALID_ARGUMENT": len(hostile)}, codes
        # Within float32 rounding: a good request merged with others runs at another batch size (docs/testing.md).
        assert answers and all(np.allclose(answer, expected, rtol=1e-5, atol=1e-7) for answer in answers)
        assert rss_mb(server) - start_mb < 100, (start_mb, rss_mb(server))
        # The peak too: a PNG chunk claiming 2 GiB was allocated by TensorFlow's decoder, then freed (figure 10).
        assert peak_rss_mb(server) - start_peak_mb < 100, (start_peak_mb, peak_rss_mb(server))
    finally:
        assert server.stop() == 0, server.stderr_tail()
    log = server.stderr_path.read_text(errors="replace")
    assert "Traceback" not in log, log[log.index("Traceback") - 300:][:3000]


def _v2_hostile_bodies() -> list[tuple[str, bytes, dict[str, str], str]]:
    """(what, body, headers, what the 400 says): Open Inference Protocol requests that declare more than they send."""
    def binary(inputs: list[dict], blob: bytes, length: int | None = None) -> tuple[bytes, dict[str, str]]:
        header = json.dumps({"inputs": inputs}).encode()
        return header + blob, {"Inference-Header-Content-Length": str(len(header) if length is None else length)}

    x = {"name": "x", "datatype": "FP32"}
    cases = [("a 2 GiB shape in JSON", json.dumps({"inputs": [{**x, "shape": [2**29, 1], "data": [1.0]}]}).encode(), {},
              "the server allows at most"),
             ("2**62 elements", json.dumps({"inputs": [{**x, "shape": [2**31, 2**31], "data": []}]}).encode(), {},
              "the server allows at most"),
             ("80,000 dims", json.dumps({"inputs": [{**x, "shape": [1] * 80_000, "data": [1.0]}]}).encode(), {},
              "'shape' must be a list of at most 64")]
    for what, inputs, blob, length, message in [
            ("a binary size past the body", [{**x, "shape": [2**28], "parameters": {"binary_data_size": 2**30}}],
             bytes(16), None, "goes past the 16 bytes of binary data"),
            ("a 2 GiB binary shape", [{**x, "shape": [2**29, 1], "parameters": {"binary_data_size": 4}}], bytes(4),
             None, "the server allows at most"),
            ("a header length past the body", [{**x, "shape": [1], "parameters": {"binary_data_size": 4}}], bytes(4),
             2**40, "is not a length within the body"),
            ("a shape bigger than its bytes", [{**x, "shape": [2**20], "parameters": {"binary_data_size": 8}}],
             bytes(8), None, "takes 4194304 bytes, but 8 were sent")]:
        body, headers = binary(inputs, blob, length)
        cases.append((what, body, headers, message))
    return cases


def test_hostile_v2_requests_are_refused_at_once_without_memory_or_tracebacks(server):
    """Issue 44: the Open Inference Protocol's declared sizes (shapes, binary_data_size, the JSON header's length)
    are checked against the limit and the body before anything is allocated: each hostile request is a 400 in
    well under a second, peak RSS hardly moves, and a well-behaved client is answered throughout."""
    from serving.v2 import proto

    start_peak = peak_rss_mb(server)
    url = f"http://{server.rest_address}/v2/models/half_plus_two/infer"
    for what, body, headers, message in _v2_hostile_bodies():
        start = time.monotonic()
        request = urllib.request.Request(url, data=body, headers=headers, method="POST")
        with pytest.raises(urllib.error.HTTPError) as error:
            urllib.request.urlopen(request, timeout=30)
        answer = error.value.read().decode()
        assert error.value.code == 400 and message in answer, (what, answer)
        assert time.monotonic() - start < 2, what
    infer = proto.ModelInferRequest(model_name="half_plus_two")
    infer.inputs.add(name="x", datatype="FP32", shape=[2**40])
    infer.raw_input_contents.append(bytes(4))
    with grpc.insecure_channel(server.address) as channel:
        call = channel.unary_unary("/inference.GRPCInferenceService/ModelInfer",
                                   request_serializer=proto.ModelInferRequest.SerializeToString,
                                   response_deserializer=proto.ModelInferResponse.FromString)
        with pytest.raises(grpc.RpcError) as refused:
            call(infer, timeout=30)
        assert refused.value.code() == grpc.StatusCode.INVALID_ARGUMENT
        assert "the server allows at most" in refused.value.details()
        infer.inputs[0].shape[:] = [2]
        infer.raw_input_contents[0] = np.array([1.0, 3.0], np.float32).tobytes()
        answer = call(infer, timeout=30)
    assert np.frombuffer(answer.raw_output_contents[0], np.float32).tolist() == [2.5, 3.5]
    assert peak_rss_mb(server) - start_peak < 50 and answered(server.address)
