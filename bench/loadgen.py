"""A load-generator process: `python -m bench.loadgen SPEC_JSON` prints one JSON line of results.

The server under test is measured from separate processes so that clients never hold its GIL. To
cost as little CPU as possible, the request is serialized once by the parent and sent as raw bytes
(gRPC with no serializer; REST as a prepared JSON body); responses are checked for success only.
Every thread is one client with its own connection, sending its next request as soon as the last
one is answered. Every process reports ready, then all start at the wall-clock time the parent
sends; requests are counted in the window after warm-up. Latencies are those of the requests sent and
answered in the window; with "late_answers" in the spec, of every request sent in it, however late its
answer (a stall past the window's end then shows in the percentiles, not only as lost queries/s). With
"duration_s" null the parent ends the window: a second line on stdin gives its end time.
"""

from __future__ import annotations

import json
import math
import sys
import threading
import time

PREDICT_METHOD = "/tensorflow.serving.PredictionService/Predict"


def _grpc_client(spec: dict):
    import grpc

    channel = grpc.insecure_channel(spec["address"])
    grpc.channel_ready_future(channel).result(timeout=30)
    call = channel.unary_unary(PREDICT_METHOD)  # no (de)serializers: bytes in, bytes out
    body = open(spec["request_file"], "rb").read()

    def send() -> bool:
        call(body, timeout=30)  # a failed call raises grpc.RpcError
        return True

    return send


def _rest_client(spec: dict):
    import http.client

    host, _, port = spec["address"].rpartition(":")
    connection = http.client.HTTPConnection(host, int(port), timeout=30)
    body = open(spec["request_file"], "rb").read()
    headers = {"Content-Type": "application/json"}

    def send() -> bool:
        connection.request("POST", spec["path"], body=body, headers=headers)
        response = connection.getresponse()
        response.read()
        return response.status == 200

    return send


def _client_loop(send, start: float, measure_from: float, end: list[float], out: dict,
                 late_answers: bool = False) -> None:
    """end: a list holding the window's end time, read before every request (the parent may set it later)."""
    latencies, completed, errors = [], 0, 0
    while time.time() < start:
        time.sleep(0.001)
    while True:
        begun = time.time()
        if begun >= end[0]:
            break
        try:
            ok = send()
        except Exception:  # noqa: BLE001 - a failed request is counted, the client goes on
            ok = False
        finished = time.time()
        if not ok:
            errors += 1
        elif measure_from <= finished <= end[0]:
            completed += 1
            if begun >= measure_from:
                latencies.append(finished - begun)
        elif late_answers and measure_from <= begun:  # sent in the window, answered after it
            latencies.append(finished - begun)
    out["latencies"] = latencies
    out["completed"] = completed
    out["errors"] = errors


def main(spec: dict) -> dict:
    make = _grpc_client if spec["protocol"] == "grpc" else _rest_client
    senders = [make(spec) for _ in range(spec["threads"])]
    for send in senders:  # connect and warm each connection before the clock starts
        send()
    print("ready", flush=True)
    start = float(sys.stdin.readline())  # the parent sends one start time once every process is ready
    measure_from = start + spec["warmup_s"]
    end = [math.inf if spec["duration_s"] is None else measure_from + spec["duration_s"]]
    if spec["duration_s"] is None:  # the parent sends the end time when it ends the window
        threading.Thread(target=lambda: end.__setitem__(0, float(sys.stdin.readline())), daemon=True).start()
    outs = [{} for _ in senders]
    late = bool(spec.get("late_answers"))
    threads = [threading.Thread(target=_client_loop, args=(send, start, measure_from, end, out, late))
               for send, out in zip(senders, outs)]
    for thread in threads:
        thread.start()
    for thread in threads:
        thread.join()
    return {"latencies": [x for out in outs for x in out["latencies"]],
            "completed": sum(out["completed"] for out in outs), "errors": sum(out["errors"] for out in outs)}


if __name__ == "__main__":
    print(json.dumps(main(json.loads(sys.argv[1]))), flush=True)
