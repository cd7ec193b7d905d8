"""`python -m bench.echo_server --port 0 [--aio]`: a gRPC PredictionService whose Predict does nothing.

Figure 4's transport ceiling: the same load generator against a Python gRPC server that answers an
empty PredictResponse at once shows how many queries/s gRPC in Python allows on this machine
before any model, proto decoding or batching is involved. Two front ends, as the model server could
have: the thread-pool server (grpc.server, 8 threads like the old model server's default on 2
cores) and grpc.aio, the model server's front end. Prints the model server's ready line.
"""

from __future__ import annotations

import argparse
import asyncio
import signal
import threading
from concurrent import futures

import grpc

EMPTY_RESPONSE = b""  # a PredictResponse with no fields


def _handler(predict) -> grpc.GenericRpcHandler:  # noqa: ANN001
    return grpc.method_handlers_generic_handler(
        "tensorflow.serving.PredictionService", {"Predict": grpc.unary_unary_rpc_method_handler(predict)})


def serve_threads(port: int, max_threads: int) -> None:
    server = grpc.server(futures.ThreadPoolExecutor(max_workers=max_threads))
    server.add_generic_rpc_handlers((_handler(lambda request, context: EMPTY_RESPONSE),))
    port = server.add_insecure_port(f"127.0.0.1:{port}")
    server.start()
    stop = threading.Event()
    signal.signal(signal.SIGTERM, lambda *_: stop.set())
    print(f"Running gRPC ModelServer at 127.0.0.1:{port} ...", flush=True)
    stop.wait()
    server.stop(0)


async def serve_aio(port: int) -> None:
    async def predict(request, context):  # noqa: ANN001
        return EMPTY_RESPONSE

    server = grpc.aio.server()
    server.add_generic_rpc_handlers((_handler(predict),))
    port = server.add_insecure_port(f"127.0.0.1:{port}")
    await server.start()
    stop = asyncio.Event()
    asyncio.get_running_loop().add_signal_handler(signal.SIGTERM, stop.set)
    print(f"Running gRPC ModelServer at 127.0.0.1:{port} ...", flush=True)
    await stop.wait()
    await server.stop(0)


def main() -> None:
    parser = argparse.ArgumentParser(prog="python -m bench.echo_server")
    parser.add_argument("--port", type=int, default=0)
    parser.add_argument("--aio", action="store_true", help="grpc.aio (the model server's front end)")
    parser.add_argument("--max_threads", type=int, default=8, help="thread-pool server's threads")
    args = parser.parse_args()
    if args.aio:
        asyncio.run(serve_aio(args.port))
    else:
        serve_threads(args.port, args.max_threads)


if __name__ == "__main__":
    main()
