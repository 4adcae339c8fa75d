"""The span gateway: OTLP in from other processes; their spans and logs share their episode's fate.

An inference server (vLLM, SGLang, any OpenTelemetry-instrumented service) exports its spans
itself, long before the tail sampler has decided on the episode that made the request. Pointed
at the gateway instead of a collector, its spans and log records join their episode by trace id:

* the episode is still undecided: they are held with it, and leave with it if it is kept
  (a server span under a generation span also lends it the engine's ``gen_ai.latency.*``
  timings, as ``rl.server.*``);
* the episode was kept: they go out at once (late spans of a kept episode);
* the episode was dropped: they are dropped, counted (``dropped.gateway_spans``,
  ``dropped.episode_logs``): no orphan fragment reaches the collector;
* a span with no parent (a request made outside any episode: a health check) is no episode's:
  it passes through to the exporters;
* a span or record of a trace this process does not know is held up to ``hold_s`` (bounded in
  bytes) in case its episode appears (a worker adopts it), then let go: dropped and counted
  ``dropped.gateway_unknown`` (or exported, with ``unknown="export"``).

Receiving runs on the gateway's own threads (an HTTP server, a gRPC server, a one-second
ticker); the training thread never waits for it.
"""

from __future__ import annotations

import logging
import threading
import time
import zlib
from collections import deque
from collections.abc import Callable, Sequence
from concurrent import futures
from dataclasses import dataclass
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from typing import Any, Literal

from google.protobuf import json_format
from google.protobuf.message import DecodeError
from opentelemetry.proto.collector.logs.v1.logs_service_pb2 import (
    ExportLogsServiceRequest,
    ExportLogsServiceResponse,
)
from opentelemetry.proto.collector.trace.v1.trace_service_pb2 import (
    ExportTraceServiceRequest,
    ExportTraceServiceResponse,
)
from opentelemetry.sdk.trace import ReadableSpan

from otel_rollouts._core.codec import PendingSpan, logs_from_request, pending_from_request
from otel_rollouts._core.content import exception_text
from otel_rollouts._core.stats import Stats
from otel_rollouts.correlate.gateway_logs import LogOutlet
from otel_rollouts.exporters.otlp_json import decode_message
from otel_rollouts.sampling.pipeline import Pipeline

__all__ = ["GatewayOptions", "SpanGateway"]

logger = logging.getLogger("otel_rollouts")

_JSON = "application/json"
_PROTOBUF = "application/x-protobuf"


@dataclass(frozen=True)
class GatewayOptions:
    """Where the gateway listens and how long it holds what it cannot place yet.

    Ports: ``None`` turns that protocol off, ``0`` picks a free port (read it back from
    ``SpanGateway.http_endpoint`` / ``grpc_endpoint``). The defaults are OTLP's own ports, so a
    server exporting to ``localhost`` with no endpoint set reaches the gateway. ``hold_s`` /
    ``max_held_bytes``: how long and how much of what belongs to no known trace is held;
    ``unknown``: what then happens to it. Received log records of kept episodes (and of no
    episode) go to ``log_exporter``, else to the OTLP log exporter the environment names
    (``OTEL_LOGS_EXPORTER=otlp`` or an OTLP endpoint set), else nowhere (counted).
    """

    host: str = "127.0.0.1"
    http_port: int | None = 4318
    grpc_port: int | None = 4317
    hold_s: float = 30.0
    max_held_bytes: int = 16 * 1024 * 1024
    max_request_bytes: int = 16 * 1024 * 1024
    unknown: Literal["drop", "export"] = "drop"
    log_exporter: Any = None  # an SDK log exporter for received records (default: OTLP per env)

    def __post_init__(self) -> None:
        if self.unknown not in ("drop", "export"):
            raise ValueError(f"GatewayOptions.unknown must be 'drop' or 'export', got {self.unknown!r}")
        for name in ("hold_s", "max_held_bytes", "max_request_bytes"):
            if not getattr(self, name) > 0:
                raise ValueError(f"GatewayOptions.{name} must be > 0, got {getattr(self, name)!r}")
        for name in ("http_port", "grpc_port"):
            port = getattr(self, name)
            if port is not None and not (isinstance(port, int) and 0 <= port < 65536):
                raise ValueError(f"GatewayOptions.{name} must be a port number or None, got {port!r}")


class _Held:
    """Spans and log records whose trace is not known (yet): bounded in bytes and in time."""

    def __init__(self, max_bytes: int) -> None:
        self.max_bytes = max_bytes
        self.bytes = 0
        self.items: deque[tuple[float, str, Any, int]] = deque()  # (deadline, kind, item, size)
        self.lock = threading.Lock()

    def add(self, deadline: float, kind: str, item: Any, size: int) -> bool:
        with self.lock:
            if self.bytes + size > self.max_bytes:
                return False
            self.items.append((deadline, kind, item, size))
            self.bytes += size
            return True

    def take(self) -> list[tuple[float, str, Any, int]]:
        with self.lock:
            items, self.items, self.bytes = list(self.items), deque(), 0
            return items


class SpanGateway:
    """The running gateway of one configured run (``otr.gateway()``)."""

    def __init__(self, options: GatewayOptions, pipeline: Pipeline, stats: Stats,
                 outlet: LogOutlet, export: Callable[[Sequence[ReadableSpan | PendingSpan]], None]) -> None:
        self.options = options
        self.pipeline = pipeline
        self.stats = stats
        self.outlet = outlet
        self._export = export
        self._held = _Held(options.max_held_bytes)
        self._stop = threading.Event()
        self._http: ThreadingHTTPServer | None = None
        self._grpc: Any = None
        self._grpc_pool: futures.ThreadPoolExecutor | None = None  # its threads end with stop()
        self._threads: list[threading.Thread] = []
        self.http_port: int | None = None
        self.grpc_port: int | None = None

    # --- where to point a server ---------------------------------------------------------------
    @property
    def http_endpoint(self) -> str | None:
        """``http://host:port`` for ``OTEL_EXPORTER_OTLP_ENDPOINT`` with ``http/protobuf``
        (or ``http/json``): the paths ``/v1/traces`` and ``/v1/logs`` are served."""
        return None if self.http_port is None else f"http://{_host(self.options.host)}:{self.http_port}"

    @property
    def grpc_endpoint(self) -> str | None:
        """``http://host:port`` for a gRPC OTLP exporter (vLLM's ``--otlp-traces-endpoint``)."""
        return None if self.grpc_port is None else f"http://{_host(self.options.host)}:{self.grpc_port}"

    # --- life ----------------------------------------------------------------------------------
    def start(self) -> SpanGateway:
        """Bind and serve; a port that cannot be bound is reported (warning) and left off."""
        o = self.options
        self.pipeline.remember_decisions = True  # what arrives after its episode was decided follows it
        if o.http_port is not None:
            try:
                self._http = _http_server(self, o.host, o.http_port)
                self.http_port = self._http.server_address[1]
                self._thread(self._http.serve_forever, "http")
            except OSError as exc:
                self.stats.add("errors.gateway_bind")
                logger.warning("otel_rollouts: span gateway could not listen on %s:%s (HTTP): %s",
                               o.host, o.http_port, exception_text(exc))
        if o.grpc_port is not None:
            try:
                self._grpc, self.grpc_port = _grpc_server(self, o.host, o.grpc_port)
            except Exception as exc:  # noqa: BLE001 - grpc raises RuntimeError on a busy port
                self.stats.add("errors.gateway_bind")
                logger.warning("otel_rollouts: span gateway could not listen on %s:%s (gRPC): %s",
                               o.host, o.grpc_port, exception_text(exc))
        self._thread(self._tick_loop, "ticker")
        return self

    def _thread(self, target: Callable[[], None], name: str) -> None:
        thread = threading.Thread(target=target, name=f"otel-rollouts-gateway-{name}", daemon=True)
        thread.start()
        self._threads.append(thread)

    def stop(self, timeout: float = 5.0) -> None:
        """Stop receiving, then settle what is held: spans of episodes decided meanwhile follow
        the decision; the rest is let go as the ``unknown`` rule says."""
        self._stop.set()
        if self._grpc is not None:
            try:
                self._grpc.stop(grace=min(timeout, 1.0)).wait(timeout)
            except Exception:  # noqa: BLE001
                pass
        if self._grpc_pool is not None:
            self._grpc_pool.shutdown(wait=False)
        if self._http is not None:
            try:
                self._http.shutdown()
                self._http.server_close()
            except Exception:  # noqa: BLE001
                pass
        for thread in self._threads:
            thread.join(timeout)
        self.settle(final=True)

    def _tick_loop(self) -> None:
        while not self._stop.wait(1.0):
            try:
                self.settle()
            except Exception:  # noqa: BLE001 - the gateway never dies of one bad item
                self.stats.add("errors.gateway")

    # --- the data: spans and logs in ---------------------------------------------------------
    def receive_traces(self, request: ExportTraceServiceRequest) -> None:
        """Place every span of one OTLP request (the receiving thread; never raises)."""
        late = 0
        dropped = self.pipeline.dropped

        def select(pb: Any) -> bool:
            # a span of an episode dropped already is counted, never kept: the common case when
            # the sampler lets go of candidates as a step fills (top_bottom)
            nonlocal late
            if len(pb.trace_id) == 16 and pb.parent_span_id and dropped(int.from_bytes(pb.trace_id, "big")):
                late += 1
                return False
            return True

        try:
            spans = pending_from_request(request, select)
        except Exception as exc:  # noqa: BLE001 - a malformed request is counted, not fatal
            self.stats.add("errors.gateway_decode")
            logger.warning("otel_rollouts: span gateway refused a trace request: %s", exception_text(exc))
            raise ValueError(exception_text(exc)) from None
        self.stats.add("gateway.spans", len(spans) + late)
        if late:
            self.stats.add("dropped.gateway_spans", late)
        roots = [s for s in spans if not s.parent_span_id]
        children = [s for s in spans if s.parent_span_id]
        if roots:
            self._export(roots)  # no episode's: a request made outside any episode
        if children:
            deadline = time.monotonic() + self.options.hold_s
            for span in self.pipeline.join_spans(children):
                if not self._held.add(deadline, "span", span, span.size):
                    self.stats.add("dropped.gateway_full")

    def receive_logs(self, request: ExportLogsServiceRequest) -> None:
        """Place every log record of one OTLP request (the receiving thread; never raises)."""
        try:
            records = logs_from_request(request)
        except Exception as exc:  # noqa: BLE001
            self.stats.add("errors.gateway_decode")
            logger.warning("otel_rollouts: span gateway refused a logs request: %s", exception_text(exc))
            raise ValueError(exception_text(exc)) from None
        self.stats.add("gateway.logs", len(records))
        deadline = time.monotonic() + self.options.hold_s
        for trace_id, record, size in records:
            if not trace_id:
                self.outlet.send([record])  # outside any trace: passes through
            elif not self.pipeline.join_logs(trace_id, [record], self.outlet.send, size):
                if not self._held.add(deadline, "log", (trace_id, record), size):
                    self.stats.add("dropped.gateway_full")

    def settle(self, final: bool = False) -> None:
        """Offer what is held again; let go what waited ``hold_s`` (or everything, ``final``)."""
        items = self._held.take()
        if not items:
            return
        now = time.monotonic()
        for deadline, kind, item, size in items:
            if kind == "span":
                placed = not self.pipeline.join_spans([item])
            else:
                trace_id, record = item
                placed = self.pipeline.join_logs(trace_id, [record], self.outlet.send, size)
            if placed:
                continue
            if final or now >= deadline:
                self._let_go(kind, item)
            elif not self._held.add(deadline, kind, item, size):
                self.stats.add("dropped.gateway_full")

    def _let_go(self, kind: str, item: Any) -> None:
        if self.options.unknown == "export":
            if kind == "span":
                self._export([item])
            else:
                self.outlet.send([item[1]])
            self.stats.add(f"gateway.unknown_exported.{kind}s")
        else:
            self.stats.add(f"dropped.gateway_unknown.{kind}s")



def _host(host: str) -> str:
    return f"[{host}]" if ":" in host else host


# --- OTLP/HTTP -------------------------------------------------------------------------------------
def _http_server(gateway: SpanGateway, host: str, port: int) -> ThreadingHTTPServer:
    limit = gateway.options.max_request_bytes

    class Handler(BaseHTTPRequestHandler):
        protocol_version = "HTTP/1.1"

        def log_message(self, format: str, *args: Any) -> None:  # noqa: A002 - the stdlib's name
            pass

        def do_POST(self) -> None:  # noqa: N802 - the stdlib's name
            path = self.path.split("?", 1)[0].rstrip("/")
            kind = {"/v1/traces": "traces", "/v1/logs": "logs"}.get(path)
            try:
                body = self._body()
            except ValueError as exc:  # too large, or a malformed length or chunk
                gateway.stats.add("errors.gateway_decode")
                self._reply(413 if "larger" in str(exc) else 400, str(exc).encode(), "text/plain")
                self.close_connection = True
                return
            if kind is None:
                self._reply(404, b"not found", "text/plain")
                return
            content_type = (self.headers.get("Content-Type") or _PROTOBUF).split(";")[0].strip().lower()
            try:
                body = _inflate(body, (self.headers.get("Content-Encoding") or "").lower(), limit)
                message = _parse(kind, body, content_type == _JSON)
            except (ValueError, DecodeError, json_format.ParseError, OSError, zlib.error) as exc:
                gateway.stats.add("errors.gateway_decode")
                self._reply(400, exception_text(exc).encode()[:500], "text/plain")
                return
            try:
                if kind == "traces":
                    gateway.receive_traces(message)  # type: ignore[arg-type]
                    response: Any = ExportTraceServiceResponse()
                else:
                    gateway.receive_logs(message)  # type: ignore[arg-type]
                    response = ExportLogsServiceResponse()
            except ValueError as exc:
                self._reply(400, str(exc).encode()[:500], "text/plain")
                return
            if content_type == _JSON:
                self._reply(200, json_format.MessageToJson(response).encode(), _JSON)
            else:
                self._reply(200, response.SerializeToString(), _PROTOBUF)

        def _body(self) -> bytes:
            """The request body (``Content-Length`` or chunked), refused past ``limit`` bytes."""
            if "chunked" in (self.headers.get("Transfer-Encoding") or "").lower():
                chunks: list[bytes] = []
                size = 0
                while True:
                    line = self.rfile.readline(1024)
                    n = int(line.split(b";")[0].strip() or b"0", 16)
                    if n == 0:
                        while self.rfile.readline(1024) not in (b"\r\n", b"\n", b""):
                            pass  # trailers
                        return b"".join(chunks)
                    size += n
                    if size > limit:
                        raise ValueError(f"request larger than {limit} bytes")
                    chunks.append(self.rfile.read(n))
                    self.rfile.readline(8)  # the CRLF after the chunk
            length = int(self.headers.get("Content-Length") or 0)
            if length > limit:
                raise ValueError(f"request larger than {limit} bytes")
            return self.rfile.read(length) if length > 0 else b""

        def _reply(self, code: int, body: bytes, content_type: str) -> None:
            self.send_response(code)
            self.send_header("Content-Type", content_type)
            self.send_header("Content-Length", str(len(body)))
            self.end_headers()
            self.wfile.write(body)

    server = ThreadingHTTPServer((host, port), Handler)
    server.daemon_threads = True
    return server


def _inflate(body: bytes, encoding: str, limit: int) -> bytes:
    """The request body decompressed (gzip or deflate), refused past ``limit`` bytes."""
    if encoding in ("", "identity"):
        return body
    if encoding not in ("gzip", "deflate"):
        raise ValueError(f"unsupported Content-Encoding {encoding!r}")
    inflater = zlib.decompressobj(wbits=31 if encoding == "gzip" else 15)
    out = inflater.decompress(body, limit + 1)
    if len(out) > limit or inflater.unconsumed_tail:
        raise ValueError(f"request larger than {limit} bytes once decompressed")
    return out


def _parse(kind: str, body: bytes, is_json: bool) -> ExportTraceServiceRequest | ExportLogsServiceRequest:
    message: Any = ExportTraceServiceRequest() if kind == "traces" else ExportLogsServiceRequest()
    if is_json:  # OTLP/JSON: hex ids, read by the project's one OTLP/JSON codec
        return decode_message(body, message, ignore_unknown_fields=True)
    message.ParseFromString(body)
    return message


# --- OTLP/gRPC -------------------------------------------------------------------------------------
def _grpc_server(gateway: SpanGateway, host: str, port: int) -> tuple[Any, int]:
    import grpc  # type: ignore[import-untyped]
    from opentelemetry.proto.collector.logs.v1 import logs_service_pb2_grpc
    from opentelemetry.proto.collector.trace.v1 import trace_service_pb2_grpc

    def export(receive: Callable[[Any], None], response: type) -> Callable[[Any, Any, Any], Any]:
        def method(_servicer: Any, request: Any, context: Any) -> Any:
            try:
                receive(request)
            except ValueError as exc:  # malformed: refused, as a collector refuses it
                context.abort(grpc.StatusCode.INVALID_ARGUMENT, str(exc))
            return response()

        return method

    class Traces(trace_service_pb2_grpc.TraceServiceServicer):
        Export = export(gateway.receive_traces, ExportTraceServiceResponse)

    class Logs(logs_service_pb2_grpc.LogsServiceServicer):
        Export = export(gateway.receive_logs, ExportLogsServiceResponse)

    limit = gateway.options.max_request_bytes
    gateway._grpc_pool = futures.ThreadPoolExecutor(max_workers=4, thread_name_prefix="otel-rollouts-gateway-grpc")
    server = grpc.server(gateway._grpc_pool,
                         options=[("grpc.max_receive_message_length", limit), ("grpc.so_reuseport", 0)])
    trace_service_pb2_grpc.add_TraceServiceServicer_to_server(Traces(), server)
    logs_service_pb2_grpc.add_LogsServiceServicer_to_server(Logs(), server)
    bound = server.add_insecure_port(f"{_host(host)}:{port}")
    if not bound:
        raise OSError(f"cannot bind {host}:{port}")
    server.start()
    return server, bound

