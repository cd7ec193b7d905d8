"""`python -m bench.echo_server --port 0`: a gRPC PredictionService whose Predict does nothing.

Figure 4's transport ceiling: the same load generator against a Python gRPC server that answers an
empty PredictResponse at once shows how many queries/s gRPC in Python allows on this machine
before any model, proto decoding or batching is involved. Prints the model server's ready line.
"""

from __future__ import annotations

import argparse
import signal
import threading
from concurrent import futures

import grpc

EMPTY_RESPONSE = b""  # a PredictResponse with no fields


def main() -> None:
    parser = argparse.ArgumentParser(prog="python -m bench.echo_server")
    parser.add_argument("--port", type=int, default=0)
    parser.add_argument("--max_threads", type=int, default=8, help="the model server's default on 2 cores")
    args = parser.parse_args()
    handler = grpc.method_handlers_generic_handler(
        "tensorflow.serving.PredictionService",
        {"Predict": grpc.unary_unary_rpc_method_handler(lambda request, context: EMPTY_RESPONSE)})
    server = grpc.server(futures.ThreadPoolExecutor(max_workers=args.max_threads))
    server.add_generic_rpc_handlers((handler,))
    port = server.add_insecure_port(f"127.0.0.1:{args.port}")
    server.start()
    stop = threading.Event()
    signal.signal(signal.SIGTERM, lambda *_: stop.set())
    print(f"Running gRPC ModelServer at 127.0.0.1:{port} ...", flush=True)
    stop.wait()
    server.stop(0)


if __name__ == "__main__":
    main()
