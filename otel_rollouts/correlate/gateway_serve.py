"""The gateway process's OTLP receivers: OTLP/HTTP served by uvicorn, OTLP/gRPC by grpcio.

Both are maintained servers, configured for a neighbour that misbehaves:

* **HTTP** (uvicorn, h11): at most ``max_connections`` connections are served at once (uvicorn
  answers 503 beyond); a connection must deliver a complete request head within
  ``header_timeout_s`` of opening (or of its previous response), and the body within
  ``body_timeout_s`` of the head, else it is closed (slow-loris), counted; idle keep-alive
  connections close after 5 s; heads over 16 KiB are refused by h11; a ``Content-Length`` that is
  not a non-negative number is refused by h11 (400); a body over ``max_request_bytes``, declared or
  sent, is answered 413; a request that is not OTLP, 400; an unknown path, 404; a method other than
  POST, 405.
* **gRPC** (grpcio): a fixed pool of ``grpc_workers`` threads, at most ``max_connections``
  concurrent calls (grpcio answers RESOURCE_EXHAUSTED beyond), messages up to
  ``max_request_bytes``.

Parsing (protobuf, or OTLP/JSON through the project's one codec) runs on a small fixed pool of
threads, never on the event loop: a large request never stalls the other connections. A request
that cannot be parsed (deep nesting included: ``RecursionError``) is refused and counted
``errors.gateway_decode``; nothing is printed.
"""

from __future__ import annotations

import asyncio
import logging
import threading
import zlib
from collections.abc import Awaitable, Callable
from concurrent import futures
from dataclasses import dataclass
from typing import Any

from google.protobuf import json_format
from google.protobuf.message import DecodeError, Message
from opentelemetry.proto.collector.logs.v1.logs_service_pb2 import (
    ExportLogsServiceRequest,
    ExportLogsServiceResponse,
)
from opentelemetry.proto.collector.trace.v1.trace_service_pb2 import (
    ExportTraceServiceRequest,
    ExportTraceServiceResponse,
)

from otel_rollouts._core.content import exception_text
from otel_rollouts.exporters.otlp_json import decode_message

__all__ = ["Limits", "Receivers"]

logger = logging.getLogger("otel_rollouts")

_JSON = "application/json"
_PROTOBUF = "application/x-protobuf"
TRACES, LOGS = "traces", "logs"
_PATHS = {"/v1/traces": TRACES, "/v1/logs": LOGS}

# What the receivers hand on: (kind, parsed request) -> spans or records refused (partial success)
Handler = Callable[[str, Any], int]
Count = Callable[[str], None]


@dataclass(frozen=True)
class Limits:
    """What one neighbour may cost the gateway (see the module)."""

    max_request_bytes: int = 16 * 1024 * 1024
    max_connections: int = 1024
    header_timeout_s: float = 5.0
    body_timeout_s: float = 10.0
    grpc_workers: int = 2
    parse_workers: int = 2


class _Refused(Exception):
    def __init__(self, status: int, message: str) -> None:
        super().__init__(message)
        self.status = status


def parse(kind: str, body: bytes, content_type: str, encoding: str, limit: int) -> Message:
    """An OTLP request from an HTTP body; ``_Refused`` (400/413/415) naming what is wrong."""
    body = _inflate(body, encoding, limit)
    message: Any = ExportTraceServiceRequest() if kind == TRACES else ExportLogsServiceRequest()
    try:
        if content_type == _JSON:
            return decode_message(body, message, ignore_unknown_fields=True)
        if content_type not in (_PROTOBUF, ""):
            raise _Refused(415, f"unsupported Content-Type {content_type!r}")
        message.ParseFromString(body)
        return message
    except _Refused:
        raise
    except (ValueError, DecodeError, json_format.ParseError, RecursionError, UnicodeDecodeError) as exc:
        raise _Refused(400, f"not an OTLP {kind} request: {exception_text(exc)}"[:500]) from None


def _inflate(body: bytes, encoding: str, limit: int) -> bytes:
    if encoding in ("", "identity"):
        return body
    if encoding not in ("gzip", "deflate"):
        raise _Refused(415, f"unsupported Content-Encoding {encoding!r}")
    try:
        inflater = zlib.decompressobj(wbits=31 if encoding == "gzip" else 15)
        out = inflater.decompress(body, limit + 1)
    except zlib.error as exc:
        raise _Refused(400, f"bad {encoding} body: {exc}") from None
    if len(out) > limit or inflater.unconsumed_tail:
        raise _Refused(413, f"request larger than {limit} bytes once decompressed")
    return out


class Receivers:
    """The HTTP and gRPC servers of one gateway process; ``handle`` places what they receive."""

    def __init__(self, limits: Limits, handle: Handler, count: Count) -> None:
        self.limits = limits
        self.handle = handle
        self.count = count
        self._parse_pool = futures.ThreadPoolExecutor(limits.parse_workers, thread_name_prefix="gateway-parse")
        self._uvicorn: Any = None
        self._http_thread: threading.Thread | None = None
        self._grpc: Any = None
        self._grpc_pool: futures.ThreadPoolExecutor | None = None
        self.http_port: int | None = None
        self.grpc_port: int | None = None

    # --- HTTP -------------------------------------------------------------------------------------
    def start_http(self, host: str, port: int, ready_timeout: float = 10.0) -> int:
        """Serve OTLP/HTTP on ``host:port`` (0: a free port); the port bound. OSError if it cannot."""
        import socket

        import uvicorn

        family = socket.AF_INET6 if ":" in host else socket.AF_INET
        sock = socket.socket(family, socket.SOCK_STREAM)
        sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
        try:
            sock.bind((host, port))
        except OSError:
            sock.close()
            raise
        sock.listen(128)
        sock.setblocking(False)
        self.http_port = sock.getsockname()[1]
        config = uvicorn.Config(
            self._app, interface="asgi3", lifespan="off", access_log=False, log_level="critical", log_config=None,
            http=_deadline_protocol(self.limits, self.count), limit_concurrency=self.limits.max_connections,
            timeout_keep_alive=5, server_header=False, date_header=False, backlog=128,
            h11_max_incomplete_event_size=16 * 1024,
        )
        server = self._uvicorn = uvicorn.Server(config)
        started = threading.Event()

        def run() -> None:
            async def serve() -> None:
                task = asyncio.ensure_future(server.serve(sockets=[sock]))
                while not server.started and not task.done():
                    await asyncio.sleep(0.01)
                started.set()
                await task

            try:
                asyncio.run(serve())
            except BaseException:  # noqa: BLE001 - the server stops; counted, the process goes on
                self.count("errors.gateway_http")
            finally:
                started.set()

        self._http_thread = threading.Thread(target=run, name="gateway-http", daemon=True)
        self._http_thread.start()
        started.wait(ready_timeout)
        return self.http_port

    async def _app(self, scope: dict[str, Any], receive: Callable[[], Awaitable[dict[str, Any]]],
                   send: Callable[[dict[str, Any]], Awaitable[None]]) -> None:
        if scope["type"] != "http":
            return
        kind = _PATHS.get(scope["path"].rstrip("/"))
        headers = {k.decode("latin-1").lower(): v.decode("latin-1") for k, v in scope["headers"]}
        content_type = headers.get("content-type", "").split(";")[0].strip().lower()
        try:
            if scope["method"] != "POST":
                raise _Refused(405, "only POST is served")
            if kind is None:
                raise _Refused(404, "not found: the paths are /v1/traces and /v1/logs")
            limit = self.limits.max_request_bytes
            declared = headers.get("content-length")
            if declared is not None and int(declared) > limit:  # h11 checked it is a number
                raise _Refused(413, f"request larger than {limit} bytes")
            try:
                body = await asyncio.wait_for(_read_body(receive, limit), self.limits.body_timeout_s)
            except asyncio.TimeoutError:
                self.count("errors.gateway_slow_body")
                raise _Refused(408, f"the body took longer than {self.limits.body_timeout_s:g} s") from None
            loop = asyncio.get_running_loop()
            rejected = await loop.run_in_executor(
                self._parse_pool, self._receive, kind, body, content_type, headers.get("content-encoding", "").lower())
        except _Refused as exc:
            if exc.status not in (404, 405):
                self.count("errors.gateway_decode")
            await _reply(send, exc.status, str(exc).encode(), "text/plain", close=exc.status in (408, 413))
            return
        response: Any = ExportTraceServiceResponse() if kind == TRACES else ExportLogsServiceResponse()
        if rejected:
            partial = response.partial_success
            if kind == TRACES:
                partial.rejected_spans = rejected
            else:
                partial.rejected_log_records = rejected
            partial.error_message = "the gateway's bound on held bytes is full"
        if content_type == _JSON:
            await _reply(send, 200, json_format.MessageToJson(response).encode(), _JSON)
        else:
            await _reply(send, 200, response.SerializeToString(), _PROTOBUF)

    def _receive(self, kind: str, body: bytes, content_type: str, encoding: str) -> int:
        message = parse(kind, body, content_type, encoding, self.limits.max_request_bytes)
        return self.handle(kind, message)

    # --- gRPC -------------------------------------------------------------------------------------
    def start_grpc(self, host: str, port: int) -> int:
        """Serve OTLP/gRPC on ``host:port`` (0: a free port); the port bound. OSError if it cannot."""
        import grpc  # type: ignore[import-untyped]
        from opentelemetry.proto.collector.logs.v1 import logs_service_pb2_grpc
        from opentelemetry.proto.collector.trace.v1 import trace_service_pb2_grpc

        receivers = self

        def export(kind: str, response: type) -> Callable[[Any, Any, Any], Any]:
            def method(_servicer: Any, request: Any, context: Any) -> Any:
                try:
                    rejected = receivers.handle(kind, request)
                except Exception as exc:  # noqa: BLE001 - refused, as a collector refuses it
                    receivers.count("errors.gateway_decode")
                    context.abort(grpc.StatusCode.INVALID_ARGUMENT, exception_text(exc)[:500])
                reply = response()
                if rejected:
                    if kind == TRACES:
                        reply.partial_success.rejected_spans = rejected
                    else:
                        reply.partial_success.rejected_log_records = rejected
                    reply.partial_success.error_message = "the gateway's bound on held bytes is full"
                return reply

            return method

        class Traces(trace_service_pb2_grpc.TraceServiceServicer):  # type: ignore[misc]
            Export = export(TRACES, ExportTraceServiceResponse)

        class Logs(logs_service_pb2_grpc.LogsServiceServicer):  # type: ignore[misc]
            Export = export(LOGS, ExportLogsServiceResponse)

        limits = self.limits
        self._grpc_pool = futures.ThreadPoolExecutor(limits.grpc_workers, thread_name_prefix="gateway-grpc")
        server = grpc.server(self._grpc_pool, maximum_concurrent_rpcs=limits.max_connections,
                             options=[("grpc.max_receive_message_length", limits.max_request_bytes),
                                      ("grpc.so_reuseport", 0)])
        trace_service_pb2_grpc.add_TraceServiceServicer_to_server(Traces(), server)
        logs_service_pb2_grpc.add_LogsServiceServicer_to_server(Logs(), server)
        bound = server.add_insecure_port(f"[{host}]:{port}" if ":" in host else f"{host}:{port}")
        if not bound:
            raise OSError(f"cannot bind {host}:{port}")
        server.start()
        self._grpc = server
        self.grpc_port = bound
        return bound

    # --- stop -------------------------------------------------------------------------------------
    def stop(self, timeout: float = 2.0) -> None:
        """Stop both servers (requests in flight get ``timeout``)."""
        if self._grpc is not None:
            try:
                self._grpc.stop(grace=min(timeout, 1.0)).wait(timeout)
            except Exception:  # noqa: BLE001
                pass
        if self._uvicorn is not None:
            self._uvicorn.should_exit = True
        if self._http_thread is not None:
            self._http_thread.join(timeout)
        if self._grpc_pool is not None:
            self._grpc_pool.shutdown(wait=False)
        self._parse_pool.shutdown(wait=False)


async def _read_body(receive: Callable[[], Awaitable[dict[str, Any]]], limit: int) -> bytes:
    chunks: list[bytes] = []
    size = 0
    while True:
        message = await receive()
        if message["type"] == "http.disconnect":
            raise _Refused(400, "the client went away")
        chunk = message.get("body", b"")
        size += len(chunk)
        if size > limit:
            raise _Refused(413, f"request larger than {limit} bytes")
        chunks.append(chunk)
        if not message.get("more_body", False):
            return b"".join(chunks)


async def _reply(send: Callable[[dict[str, Any]], Awaitable[None]], status: int, body: bytes,
                 content_type: str, *, close: bool = False) -> None:
    headers = [(b"content-type", content_type.encode()), (b"content-length", str(len(body)).encode())]
    if close:
        headers.append((b"connection", b"close"))
    await send({"type": "http.response.start", "status": status, "headers": headers})
    await send({"type": "http.response.body", "body": body})


def _deadline_protocol(limits: Limits, count: Count) -> type:
    """uvicorn's h11 protocol, closing a connection that has not sent a whole request head within
    ``header_timeout_s`` of opening or of its last response (uvicorn has no such timeout: its
    keep-alive timer restarts at every byte, so a client sending one byte at a time, or nothing,
    would hold its connection for ever)."""
    from uvicorn.protocols.http.h11_impl import H11Protocol

    class DeadlineProtocol(H11Protocol):  # type: ignore[misc]
        _head_timer: asyncio.TimerHandle | None = None

        def connection_made(self, transport: Any) -> None:
            super().connection_made(transport)
            self._arm()

        def on_response_complete(self) -> None:
            super().on_response_complete()
            self._arm()

        def connection_lost(self, exc: Exception | None) -> None:
            if self._head_timer is not None:
                self._head_timer.cancel()
            super().connection_lost(exc)

        def _arm(self) -> None:
            if self._head_timer is not None:
                self._head_timer.cancel()
            self._head_timer = self.loop.call_later(limits.header_timeout_s, self._expire)

        def _expire(self) -> None:
            cycle = self.cycle
            if cycle is not None and not cycle.response_complete:
                return  # a request is being served: the body deadline is the app's
            if not self.transport.is_closing():
                count("errors.gateway_slow_head")
                self.transport.close()

    return DeadlineProtocol
