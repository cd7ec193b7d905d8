"""A hostile-client process: `python -m bench.hostile_clients SPEC_JSON` prints one JSON line of status counts.

Figure 10's attacker (bench/image_requests.py): it sends serialized PredictRequests, each carrying one hostile
image (a decompression bomb, random bytes, a truncated JPEG, ...), built once by the parent and read from a
pickle file of (kind, bytes) pairs. Like bench/loadgen.py, every thread is one client with its own connection
that sends its next request as soon as the last one is answered. The process reports ready, then starts at the
wall-clock time the parent sends on stdin and sends every request once. Per kind it counts the status codes the
server answered (the gRPC code's name, "OK" for an answer), keeps the first message of each code and the slowest
call.
"""

from __future__ import annotations

import itertools
import json
import pickle
import sys
import threading
import time

from bench.loadgen import PREDICT_METHOD


def _client(address: str):
    import grpc

    channel = grpc.insecure_channel(address)
    grpc.channel_ready_future(channel).result(timeout=30)
    return channel.unary_unary(PREDICT_METHOD)  # no (de)serializers: bytes in, bytes out


def _send(call, body: bytes) -> tuple[str, str]:
    """(status code name, message) of one call; ("OK", "") if the server answered."""
    import grpc

    try:
        call(body, timeout=60)
    except grpc.RpcError as error:
        return error.code().name, (error.details() or "")[:300]
    return "OK", ""


def main(spec: dict) -> dict:
    with open(spec["requests_file"], "rb") as file:
        requests: list[tuple[str, bytes]] = pickle.load(file)
    calls = [_client(spec["address"]) for _ in range(spec["threads"])]
    print("ready", flush=True)
    start = float(sys.stdin.readline())  # the parent's start time
    counter = itertools.count()  # next() on it is atomic under the GIL: each index goes to one thread
    outs: list[list] = [[] for _ in calls]

    def loop(call, out: list) -> None:
        while (index := next(counter)) < len(requests):
            kind, body = requests[index]
            begun = time.perf_counter()
            code, message = _send(call, body)
            out.append((kind, code, message, time.perf_counter() - begun))

    while time.time() < start:
        time.sleep(0.001)
    started = time.perf_counter()
    threads = [threading.Thread(target=loop, args=(call, out)) for call, out in zip(calls, outs)]
    for thread in threads:
        thread.start()
    for thread in threads:
        thread.join()
    return {"seconds": time.perf_counter() - started, "kinds": _summary(x for out in outs for x in out)}


def _summary(sent) -> dict:
    """Per kind: requests sent, count per status code, the first message per code, the slowest call (ms)."""
    kinds: dict[str, dict] = {}
    for kind, code, message, seconds in sent:
        entry = kinds.setdefault(kind, {"sent": 0, "codes": {}, "messages": {}, "slowest_ms": 0.0})
        entry["sent"] += 1
        entry["codes"][code] = entry["codes"].get(code, 0) + 1
        entry["messages"].setdefault(code, message)
        entry["slowest_ms"] = max(entry["slowest_ms"], seconds * 1e3)
    return kinds


if __name__ == "__main__":
    print(json.dumps(main(json.loads(sys.argv[1]))), flush=True)
