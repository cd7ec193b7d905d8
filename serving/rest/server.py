"""The REST port (--rest_api_port): an aiohttp server on the server's event loop, and the limits that bound
hostile or careless clients (serving/limits.py).

Requests go to serving/rest/routes.py (TF Serving's routes, answered by the gRPC servicers), /v2 to serving/v2/rest.py
(the Open Inference Protocol) and /openai/v1 to serving/rest/openai.py. A
connection that has not sent a complete request head within the idle timeout is closed, a body that
does not arrive within the read timeout gets 408, a body over --rest_api_max_body_bytes gets 413,
connections beyond the cap get 503 and are closed at once, and a JSON body nested deeper than
MAX_JSON_DEPTH or with a number longer than MAX_JSON_NUMBER_CHARS is refused before it is parsed
(serving/rest/json_codec.py). Every client mistake is a 4xx with one line, and malformed HTTP is logged
without a traceback. As in TF Serving, the port is plain HTTP, --ssl_config_file or not; Prometheus
metrics (--monitoring_config_file) are served here.
"""

from __future__ import annotations

import asyncio
import contextlib
import json
import logging
import sys
import time
from typing import Any

import grpc
from aiohttp import web
from aiohttp.http_exceptions import HttpProcessingError
from prometheus_client import CONTENT_TYPE_LATEST

from serving.flags import Options
from serving.limits import DRAIN_ADMIT_S, SHUTTING_DOWN, default_max_connections, drain_s
from serving.monitoring import Metrics
from serving.rest import json_codec
from serving.rest.openai import PREFIX as OPENAI_PREFIX
from serving.rest.openai import OpenAIApi
from serving.rest.routes import RestApi
from serving.v2.rest import PREFIX as V2_PREFIX
from serving.v2.rest import V2Api

log = logging.getLogger(__name__)

# What aiohttp buffers of a connection's body before the handler reads it (it stops reading the socket at twice
# this): aiohttp's 64 KiB let 3,000 connections waiting for admission hold 128 KiB each (issue 31 #3).
READ_BUFFER_BYTES = 16 * 1024


class _ClientErrorLog(logging.LoggerAdapter):
    """aiohttp's connection logger: a client's malformed HTTP (a bad request line or header) is one line
    at debug level, never a traceback; anything else keeps aiohttp's traceback."""

    def exception(self, msg: Any, *args: Any, exc_info: Any = True, **kwargs: Any) -> None:
        error = exc_info if isinstance(exc_info, BaseException) else sys.exc_info()[1]
        if isinstance(error, (HttpProcessingError, ConnectionError)):
            self.debug(f"{msg}: %s", *args, error)
        else:
            super().exception(msg, *args, exc_info=exc_info, **kwargs)


class _Refusal(asyncio.Protocol):
    """A connection answered 503 and closed at once, so its descriptor is free again before the client has sent
    anything: one over --rest_api_max_connections (retry later), or one accepted as the port closes."""

    TOO_MANY = "Too many connections to the REST API (--rest_api_max_connections); retry later"

    def __init__(self, error: str = TOO_MANY) -> None:
        body = json.dumps({"error": error}).encode()
        self._response = (b"HTTP/1.1 503 Service Unavailable\r\nContent-Type: application/json\r\n"
                          b"Connection: close\r\nContent-Length: %d\r\n\r\n" % len(body)) + body

    def connection_made(self, transport: asyncio.BaseTransport) -> None:
        transport.write(self._response)
        transport.close()


class _Counted(asyncio.BufferedProtocol):
    """aiohttp's protocol for one connection, counted from the moment it is accepted (asyncio accepts up
    to 100 connections per event-loop turn, before aiohttp sees any of them) until it is closed.

    Bytes are received into the server's one buffer of READ_BUFFER_BYTES (asyncio's BufferedProtocol; every
    connection is read on the event loop's thread, and each read is handed on before the next) and copied out:
    asyncio otherwise reads up to 256 KiB per call before aiohttp can pause the connection, so 3,000 clients
    sending bodies at once held up to that much each, refused or not (peak RSS +510 MB with 256 MiB in
    flight; +348-357 MB reading 16 KiB at a time, issue 31 #3)."""

    def __init__(self, inner: asyncio.Protocol, server: "RestServer") -> None:
        self._inner, self._server = inner, server
        server.open_connections += 1

    def connection_made(self, transport: asyncio.BaseTransport) -> None:
        self._inner.connection_made(transport)

    def get_buffer(self, sizehint: int) -> memoryview:
        return self._server.receive_buffer

    def buffer_updated(self, nbytes: int) -> None:
        self._inner.data_received(bytes(self._server.receive_buffer[:nbytes]))

    def eof_received(self) -> bool | None:
        return self._inner.eof_received()

    def pause_writing(self) -> None:
        self._inner.pause_writing()

    def resume_writing(self) -> None:
        self._inner.resume_writing()

    def connection_lost(self, exc: Exception | None) -> None:
        self._server.open_connections -= 1
        self._inner.connection_lost(exc)


class RestServer:
    """The HTTP port, on the running event loop; use `await RestServer.start(api, options, metrics)`."""

    def __init__(self, api: RestApi, options: Options, metrics: Metrics | None,
                 completions: OpenAIApi | None = None, v2: V2Api | None = None) -> None:
        self._api, self._options, self._metrics, self._completions = api, options, metrics, completions
        self._v2 = v2
        self._max_connections = options.rest_api_max_connections or default_max_connections()
        self._runner: web.AppRunner | None = None
        self._listener: asyncio.AbstractServer | None = None
        self._refused_warning_at = 0.0
        self.open_connections = 0  # changed on the event loop's thread only
        self.receive_buffer = memoryview(bytearray(READ_BUFFER_BYTES))  # what every connection reads into (_Counted)
        self.running = 0  # requests being answered
        self.refuse_from = float("inf")  # draining: requests arriving from then on get 503
        self._closing = False  # the port is closing: connections are refused (503)
        self.port = 0

    @classmethod
    async def start(cls, api: RestApi, options: Options, metrics: Metrics | None = None,
                    completions: OpenAIApi | None = None, v2: V2Api | None = None) -> "RestServer":
        """Listens on options.host:options.rest_api_port (-1 picks a free port); reuse_port lets other
        processes listen on it too (SO_REUSEPORT, --reuse_port).

        Raises:
            RuntimeError: the address could not be bound.
        """
        server = cls(api, options, metrics, completions, v2)
        app = web.Application()  # the body limit is _read's: it reads bodies itself
        app.router.add_route("*", "/{path:.*}", server._handle)
        # aiohttp closes a connection still waiting for a complete request head keepalive_timeout
        # after it opened or after its last answer; lingering (reading an unread body before closing)
        # is bounded by the read timeout.
        server._runner = web.AppRunner(app, access_log=None, keepalive_timeout=options.rest_api_idle_timeout_s,
                                       lingering_time=min(10.0, options.rest_api_read_timeout_s),
                                       read_bufsize=READ_BUFFER_BYTES,
                                       shutdown_timeout=max(drain_s(options.grace_period_s) - DRAIN_ADMIT_S, 0.0),
                                       logger=_ClientErrorLog(logging.getLogger("aiohttp.server"), {}))
        await server._runner.setup()
        try:
            server._listener = await asyncio.get_running_loop().create_server(
                server._connection, options.host, max(options.rest_api_port, 0), reuse_port=options.reuse_port or None)
        except OSError as error:
            await server._runner.cleanup()
            raise RuntimeError(f"cannot listen on {options.host}:{options.rest_api_port} for the REST API: "
                               f"{error.strerror}") from None
        server.port = server._listener.sockets[0].getsockname()[1]  # the port actually bound (port -1)
        return server

    def begin_drain(self, refuse_from: float) -> None:
        """Requests arriving from time.monotonic() refuse_from on are answered 503 and their connections closed."""
        self.refuse_from = refuse_from
        if self._v2 is not None:
            self._v2.service.draining = True  # /v2/health/ready says 503 from now on

    async def stop(self, deadline: float) -> None:
        """Once refusing has begun and the requests being answered are done (or the time.monotonic() deadline
        passed), stops listening, closes idle connections and lets what still runs finish, up to the deadline;
        then the port is closed."""
        while (self.running or time.monotonic() < self.refuse_from) and time.monotonic() < deadline:
            await asyncio.sleep(0.02)
        self._closing = True  # connections asyncio accepted but has not handed over yet are refused (503)
        if self._listener is not None:
            self._listener.close()  # no new connections
        if self._runner is not None:
            await self._clean_up(deadline)

    async def _clean_up(self, deadline: float) -> None:
        """aiohttp's cleanup: idle connections close, running requests finish. It closes idle connections once
        (Server.pre_shutdown); a connection accepted just before, whose handler had not started yet, then waits
        for a request it ignores, for the whole shutdown_timeout (under load, 1 SIGTERM in 8 took 29 s of a 30 s
        grace period to close this port). So they are closed again every 50 ms until cleanup is done, and at the
        deadline whatever is left is closed and the cleanup given up."""
        server = self._runner.server
        cleanup = asyncio.ensure_future(self._runner.cleanup())
        while not cleanup.done() and time.monotonic() < deadline:
            await asyncio.wait({cleanup}, timeout=min(0.05, max(deadline - time.monotonic(), 0.0)))
            if server is not None and not cleanup.done():
                server.pre_shutdown()
        if not cleanup.done():
            left = server.connections if server is not None else []
            log.warning("REST API: %d connections still busy at the end of the grace period: closed", len(left))
            for connection in left:
                connection.force_close()
            cleanup.cancel()
        with contextlib.suppress(asyncio.CancelledError):
            await cleanup

    def _connection(self) -> asyncio.Protocol:
        """The protocol for a new connection: aiohttp's; a 503 refusal past the connection cap, or once the port
        closes."""
        server = self._runner.server
        if self._closing:
            return _Refusal(SHUTTING_DOWN)
        if server is not None and self.open_connections < self._max_connections:
            return _Counted(server(), self)
        now = time.monotonic()
        if now - self._refused_warning_at > 60:
            self._refused_warning_at = now
            log.warning("REST API: %d connections open; refusing more with 503 (--rest_api_max_connections)",
                        self._max_connections)
        return _Refusal()

    async def _handle(self, request: web.Request) -> web.Response:
        if time.monotonic() >= self.refuse_from:  # draining: retry elsewhere, as gRPC's UNAVAILABLE says
            response = web.Response(status=503, body=json_codec.dumps({"error": SHUTTING_DOWN}),
                                    content_type="application/json")
            response.force_close()
            return response
        if self._metrics is not None and request.method == "GET" and request.path == self._metrics.path:
            return web.Response(body=self._metrics.exposition(), headers={"Content-Type": CONTENT_TYPE_LATEST})
        self.running += 1
        try:
            return await self._answer(request)
        finally:
            self.running -= 1

    async def _answer(self, request: web.Request) -> web.Response:
        """Admits the request (limits.Admission), reads its body, answers. One with a Content-Length is admitted
        before its body is read, so a refused body is never read and the bodies held stay within
        --max_inflight_request_bytes (3,000 pending 286 KB requests: +943 MB peak RSS when every body was read
        first, issue 31 #3); a chunked one is admitted once read."""
        admitted = request.content_length  # bytes taken into the bounds, released once answered; None: not yet
        if admitted is not None and (refused := self._refused(request, admitted)):
            return refused
        try:
            body = await self._read(request)
            if isinstance(body, web.Response):
                return body
            if admitted is None:
                if refused := self._refused(request, len(body)):
                    return refused
                admitted = len(body)
            if self._completions is not None and request.path.startswith(OPENAI_PREFIX + "/"):
                return await self._completions.handle(request, body)  # OpenAI's completions (streamed or not)
            if self._v2 is not None and (request.path == V2_PREFIX or request.path.startswith(V2_PREFIX + "/")):
                return await self._v2.handle(request, body)  # the Open Inference Protocol (serving/v2/rest.py)
            status, payload = await self._api.handle(request.method, request.path, body, request.remote or "")
        finally:
            if admitted is not None:
                self._api.release(admitted)
        return web.Response(status=status, body=json_codec.dumps(payload), content_type="application/json")

    @staticmethod
    async def _read_declared(request: web.Request, size: int) -> bytearray:
        """A body of a declared length, read into one buffer of that size: growing one chunk by chunk reallocates
        it many times over, and with hundreds arriving at once the copies add up (issue 31 #3)."""
        body, filled = bytearray(size), 0
        view = memoryview(body)
        try:
            while filled < size and (chunk := await request.content.readany()):
                view[filled:filled + len(chunk)] = chunk  # aiohttp hands over no more than Content-Length bytes
                filled += len(chunk)
        finally:
            view.release()
        del body[filled:]  # a body cut short
        return body

    def _refused(self, request: web.Request, size: int) -> web.Response | None:
        """The 429 answer if a request of `size` bytes is beyond the in-flight bounds, else None (admitted)."""
        refused = self._api.admit(request.method, request.path, size)
        if refused is None:
            return None
        response = web.Response(status=refused[0], body=json_codec.dumps(refused[1]), content_type="application/json")
        response.force_close()  # its body may be left unread
        return response

    async def _read(self, request: web.Request) -> bytearray | web.Response:
        """The request's body, or the answer for one over the size limit (413) or too slow to arrive (408).

        Read into a buffer of its own (not aiohttp's request.read(), which keeps a copy on the request for as
        long as it is answered), so RestApi.handle can free it once parsed (issue 31 #3)."""
        read_timeout_s, limit = self._options.rest_api_read_timeout_s, self._options.rest_api_max_body_bytes
        try:
            async with asyncio.timeout(read_timeout_s):
                if request.content_length is not None and request.content_length <= limit:
                    return await self._read_declared(request, request.content_length)
                body = bytearray()
                while chunk := await request.content.readany():
                    body += chunk
                    if len(body) > limit:
                        raise web.HTTPRequestEntityTooLarge(max_size=limit, actual_size=len(body))
                return body
        except web.HTTPRequestEntityTooLarge:
            message = (f"Request body is larger than the limit of {self._options.rest_api_max_body_bytes} bytes "
                       "(--rest_api_max_body_bytes)")
            self._api.observe_failure(request.method, request.path, grpc.StatusCode.RESOURCE_EXHAUSTED, 0.0)
            return web.Response(status=413, text=json.dumps({"error": message}), content_type="application/json")
        except TimeoutError:
            message = f"Request body did not arrive within {read_timeout_s:g} s (--rest_api_read_timeout_s)"
            self._api.observe_failure(request.method, request.path, grpc.StatusCode.DEADLINE_EXCEEDED, 0.0)
            response = web.Response(status=408, text=json.dumps({"error": message}), content_type="application/json")
            response.force_close()
            return response
