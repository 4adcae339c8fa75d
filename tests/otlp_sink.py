"""A small real OTLP/HTTP receiver, run as its own process on loopback, for fault injection.

Phoenix (``receivers.py``) is the realistic receiver, but it takes 10-15 s to start and ingests
~150 spans/s here. This one starts in well under a second, and can be told to misbehave:

* ``delay``: sleep that many seconds before answering each request (a slow or hanging receiver);
* ``status``: answer every request with this HTTP status (e.g. 503, what an overloaded Phoenix
  or collector answers) without keeping the spans;
* ``max_body``: refuse requests larger than this many bytes with 413 (a collector's
  message-size limit);
* ``script``: a list of answers, one taken per trace request before the settings above apply:
  ``"ok"``, an HTTP status (``413``, ``400``, ``503``...: nothing kept), ``"reject_all"`` (200
  with a ``partial_success`` rejecting every span, nothing kept), ``"reject_half"`` (the first
  half of the spans kept, the rest rejected in ``partial_success``), ``"hang"`` (answer only
  after ``hang_s`` seconds, keeping the spans: a collector that stored them too late).

Phoenix's annotation API, for the Phoenix annotation layer (``otel_rollouts.delivery.phoenix``):
with ``phoenix_version`` set (e.g. ``"20.26.1"``), ``GET /arize_phoenix_version`` answers it as
plain text and ``POST /v1/span_annotations`` stores each item in ``annotations.jsonl`` beside the
spans, answering ``annotations_status`` (default 200; other codes store nothing) after
``annotations_delay`` seconds; ``annotation_requests`` counts them. Unset (the default), the sink
behaves as before.

Every accepted span is appended to a JSON-lines file, so what was received survives a restart
(``kill()`` then ``start()`` on the same port simulates a collector crash). Also records the
``Authorization`` header of requests and whether they came over TLS.

    python tests/otlp_sink.py --port 4318 --out spans.jsonl [--certfile c.pem --keyfile k.pem]
"""

from __future__ import annotations

import argparse
import json
import os
import signal
import socket
import subprocess
import sys
import time
import urllib.request
from pathlib import Path
from typing import Any


def _append(path: Path | str, text: str) -> None:
    """Append ``text`` to ``path`` in one write(2) on an O_APPEND descriptor (a buffered
    ``fh.write`` of a large batch is several calls). A SIGKILL (the outage tests kill the sink
    mid-run) can still cut one short between pages: ``_drop_torn_tails`` at start-up removes what
    a killed sink left half written, a request it never answered."""
    data = text.encode("utf-8")
    fd = os.open(path, os.O_WRONLY | os.O_APPEND | os.O_CREAT, 0o644)
    try:
        written = os.write(fd, data)
        while written < len(data):  # a short write (a full disk): the rest, still appended
            written += os.write(fd, data[written:])
    finally:
        os.close(fd)

HERE = Path(__file__).resolve().parent


# --- the server (runs in the child process) -------------------------------------------------------
def _value(v: Any) -> Any:
    which = v.WhichOneof("value")
    if which is None:
        return None
    if which == "array_value":
        return [_value(x) for x in v.array_value.values]
    if which == "kvlist_value":
        return {kv.key: _value(kv.value) for kv in v.kvlist_value.values}
    if which == "bytes_value":
        return v.bytes_value.hex()
    return getattr(v, which)


def _drop_torn_tails(out: Path) -> None:
    """Cut each output file back to its last complete line: a sink killed while writing left a
    torn record (of a request it never answered, so the sender sends it again), and the next
    record appended to it would make one unreadable line of two."""
    for path in (out, out.with_name("json_requests.jsonl"), out.with_name("annotations.jsonl"),
                 out.with_name("logs.jsonl")):
        try:
            data = path.read_bytes()
        except FileNotFoundError:
            continue
        if data and not data.endswith(b"\n"):
            with open(path, "r+b") as fh:
                fh.truncate(data.rfind(b"\n") + 1)


def serve(port: int, out: Path, certfile: str | None, keyfile: str | None) -> None:
    _drop_torn_tails(out)
    import threading
    from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer

    from opentelemetry.proto.collector.trace.v1.trace_service_pb2 import (
        ExportTraceServiceRequest,
        ExportTraceServiceResponse,
    )

    state: dict[str, Any] = {"delay": 0.0, "status": None, "max_body": None, "requests": 0,
                             "accepted": 0, "refused": 0, "authorization": [], "sizes": [], "script": [],
                             "hang_s": 5.0, "phoenix_version": None, "annotations_status": 200,
                             "annotations_delay": 0.0, "annotation_requests": 0}
    lock = threading.Lock()

    class Handler(BaseHTTPRequestHandler):
        protocol_version = "HTTP/1.1"

        def log_message(self, *args: Any) -> None:  # quiet
            return

        def _reply(self, code: int, body: bytes, ctype: str = "application/json") -> None:
            self.send_response(code)
            self.send_header("Content-Type", ctype)
            self.send_header("Content-Length", str(len(body)))
            self.end_headers()
            self.wfile.write(body)

        def do_GET(self) -> None:
            with lock:
                version = state["phoenix_version"]
            if version is not None and self.path == "/arize_phoenix_version":
                self._reply(200, str(version).encode(), "text/plain")
                return
            with lock:
                body = json.dumps({k: v for k, v in state.items()}).encode()
            self._reply(200, body)

        def do_POST(self) -> None:
            length = int(self.headers.get("Content-Length") or 0)
            data = self.rfile.read(length)
            if self.path == "/control":
                with lock:
                    state.update(json.loads(data or b"{}"))
                self._reply(200, b"{}")
                return
            if self._json_request(data):
                return
            with lock:
                phoenix = state["phoenix_version"] is not None
            if phoenix and self.path.split("?")[0] == "/v1/span_annotations":
                self._annotations(data)
                return
            with lock:
                state["requests"] += 1
                state["sizes"].append(length)
                auth = self.headers.get("Authorization")
                if auth is not None:
                    state["authorization"].append(auth)
                delay, status, max_body = state["delay"], state["status"], state["max_body"]
                action = state["script"].pop(0) if state["script"] and self.path == "/v1/traces" else None
            if action is not None and action != "ok":
                if isinstance(action, int):
                    with lock:
                        state["refused"] += 1
                    self._reply(action, b"scripted refusal", "text/plain")
                    return
                if action == "hang":
                    time.sleep(state["hang_s"])
                    self._store(data, 0, 0)
                    return
                if action in ("reject_all", "reject_half"):
                    request = ExportTraceServiceRequest()
                    request.ParseFromString(data)
                    total = sum(len(ss.spans) for rs in request.resource_spans for ss in rs.scope_spans)
                    keep = 0 if action == "reject_all" else total // 2
                    self._store(data, keep, total - keep)
                    return
            elif action == "ok":
                self._store(data, None, 0)
                return
            if delay:
                time.sleep(delay)
            if max_body is not None and length > max_body:
                with lock:
                    state["refused"] += 1
                self._reply(413, b"request too large", "text/plain")
                return
            if status:
                with lock:
                    state["refused"] += 1
                self._reply(int(status), b"unavailable", "text/plain")
                return
            if self.path == "/v1/logs":
                self._logs(data)
                return
            self._store(data, None, 0)

        def _store(self, data: bytes, keep: int | None, rejected: int) -> None:
            """Keep the request's first ``keep`` spans (None: all) and answer, saying how many
            were rejected in ``partial_success``."""
            request = ExportTraceServiceRequest()
            request.ParseFromString(data)
            lines = []
            for rs in request.resource_spans:
                resource = {kv.key: _value(kv.value) for kv in rs.resource.attributes}
                for ss in rs.scope_spans:
                    for span in ss.spans:
                        lines.append(json.dumps({
                            "trace_id": span.trace_id.hex(),
                            "span_id": span.span_id.hex(),
                            "parent_id": span.parent_span_id.hex() or None,
                            "name": span.name,
                            "attributes": {kv.key: _value(kv.value) for kv in span.attributes},
                            "events": [{"name": e.name, "attributes": {kv.key: _value(kv.value) for kv in e.attributes}}
                                       for e in span.events],
                            "status": span.status.message,
                            "service": resource.get("service.name"),
                            "resource": resource,
                            "scope": ss.scope.name,
                        }))
            if keep is not None:
                lines = lines[:keep]
            with lock:
                state["accepted"] += 1
                _append(out, "".join(line + "\n" for line in lines))
            response = ExportTraceServiceResponse()
            if rejected:
                response.partial_success.rejected_spans = rejected
                response.partial_success.error_message = "scripted rejection"
            self._reply(200, response.SerializeToString(), "application/x-protobuf")

        def _json_request(self, data: bytes) -> bool:
            """An OTLP/JSON request (``Content-Type: application/json``) to ``/v1/traces``,
            ``/v1/logs`` or ``/v1/metrics``: its body, decompressed, and how it was sent, appended
            to ``json_requests.jsonl`` beside the spans, and answered 200 with an empty JSON
            response (as a collector answers OTLP/JSON). False for any other request."""
            ctype = (self.headers.get("Content-Type") or "").split(";")[0].strip().lower()
            path = self.path.split("?")[0]
            if ctype != "application/json" or path not in ("/v1/traces", "/v1/logs", "/v1/metrics"):
                return False
            encoding = (self.headers.get("Content-Encoding") or "").strip().lower()
            if encoding == "gzip":
                import gzip

                body = gzip.decompress(data)
            elif encoding == "deflate":
                import zlib

                body = zlib.decompress(data)
            else:
                body = data
            with lock:
                state["requests"] += 1
                state["accepted"] += 1
                auth = self.headers.get("Authorization")
                if auth is not None:
                    state["authorization"].append(auth)
                _append(out.with_name("json_requests.jsonl"),
                        json.dumps({"path": path, "content_type": self.headers.get("Content-Type"),
                                    "content_encoding": encoding or None,
                                    "body": body.decode("utf-8")}) + "\n")
            self._reply(200, b"{}")
            return True

        def _annotations(self, data: bytes) -> None:
            """Phoenix's ``POST /v1/span_annotations``: each item kept in ``annotations.jsonl``
            (when ``annotations_status`` is 200), answered as Phoenix does (async: no ids)."""
            with lock:
                state["annotation_requests"] += 1
                status, delay = int(state["annotations_status"]), float(state["annotations_delay"])
            if delay:
                time.sleep(delay)
            if status != 200:
                self._reply(status, b'{"detail": "scripted"}')
                return
            items = json.loads(data or b"{}").get("data", [])
            with lock:
                _append(out.with_name("annotations.jsonl"), "".join(json.dumps(item) + "\n" for item in items))
            self._reply(200, b'{"data": []}')

        def _logs(self, data: bytes) -> None:
            """OTLP/HTTP logs: each record is appended to ``logs.jsonl`` beside the spans."""
            from opentelemetry.proto.collector.logs.v1.logs_service_pb2 import (
                ExportLogsServiceRequest,
                ExportLogsServiceResponse,
            )

            request = ExportLogsServiceRequest()
            request.ParseFromString(data)
            lines = []
            for rl in request.resource_logs:
                resource = {kv.key: _value(kv.value) for kv in rl.resource.attributes}
                for sl in rl.scope_logs:
                    for record in sl.log_records:
                        lines.append(json.dumps({
                            "scope": sl.scope.name,
                            "body": _value(record.body),
                            "severity": record.severity_text,
                            "attributes": {kv.key: _value(kv.value) for kv in record.attributes},
                            "trace_id": record.trace_id.hex(),
                            "event_name": record.event_name,
                            "resource": resource,
                        }))
            with lock:
                state["accepted"] += 1
                _append(out.with_name("logs.jsonl"), "".join(line + "\n" for line in lines))
            self._reply(200, ExportLogsServiceResponse().SerializeToString(), "application/x-protobuf")

    server = ThreadingHTTPServer(("127.0.0.1", port), Handler)
    server.daemon_threads = True
    if certfile:
        import ssl

        context = ssl.SSLContext(ssl.PROTOCOL_TLS_SERVER)
        context.load_cert_chain(certfile, keyfile)
        server.socket = context.wrap_socket(server.socket, server_side=True)
    signal.signal(signal.SIGTERM, lambda *a: os._exit(0))
    server.serve_forever()


# --- the handle the tests use --------------------------------------------------------------------
def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


class OtlpSink:
    """The sink as a subprocess: ``start()``, ``kill()``, ``start()`` again on the same port."""

    def __init__(self, directory: Path, *, certfile: str | None = None, keyfile: str | None = None) -> None:
        self.directory = Path(directory)
        self.directory.mkdir(parents=True, exist_ok=True)
        self.out = self.directory / "received.jsonl"
        self.port = free_port()
        self.certfile, self.keyfile = certfile, keyfile
        self._proc: subprocess.Popen[bytes] | None = None

    @property
    def scheme(self) -> str:
        return "https" if self.certfile else "http"

    @property
    def endpoint(self) -> str:
        return f"{self.scheme}://127.0.0.1:{self.port}/v1/traces"

    @property
    def logs_endpoint(self) -> str:
        return f"{self.scheme}://127.0.0.1:{self.port}/v1/logs"

    def annotations(self) -> list[dict[str, Any]]:
        """The span annotations received in Phoenix mode (``phoenix_version`` set)."""
        path = self.out.with_name("annotations.jsonl")
        if not path.exists():
            return []
        with open(path, encoding="utf-8") as fh:
            return [json.loads(line) for line in fh if line.endswith("\n")]

    def logs(self) -> list[dict[str, Any]]:
        path = self.out.with_name("logs.jsonl")
        if not path.exists():
            return []
        with open(path, encoding="utf-8") as fh:
            return [json.loads(line) for line in fh if line.endswith("\n")]

    def json_requests(self, path: str | None = None) -> list[dict[str, Any]]:
        """The OTLP/JSON requests received (``path``, ``content_type``, ``content_encoding``,
        decompressed ``body`` text), oldest first; only those to ``path`` when given."""
        file = self.out.with_name("json_requests.jsonl")
        if not file.exists():
            return []
        with open(file, encoding="utf-8") as fh:
            found = [json.loads(line) for line in fh if line.endswith("\n")]
        return [r for r in found if path is None or r["path"] == path]

    def wait_for_json(self, path: str, count: int = 1, timeout: float = 30.0) -> list[dict[str, Any]]:
        """Poll until ``count`` OTLP/JSON requests to ``path`` arrived (or ``timeout``)."""
        deadline = time.monotonic() + timeout
        while True:
            found = self.json_requests(path)
            if len(found) >= count or time.monotonic() > deadline:
                return found
            time.sleep(0.05)

    def start(self, **control: Any) -> OtlpSink:
        cmd = [sys.executable, str(Path(__file__).resolve()), "--port", str(self.port), "--out", str(self.out)]
        if self.certfile:
            cmd += ["--certfile", self.certfile, "--keyfile", str(self.keyfile)]
        self._proc = subprocess.Popen(cmd, stdin=subprocess.DEVNULL, stdout=subprocess.DEVNULL,
                                      stderr=open(self.directory / "sink.log", "ab"))
        deadline = time.monotonic() + 30
        while True:
            try:
                with socket.create_connection(("127.0.0.1", self.port), timeout=0.5):
                    break
            except OSError as exc:
                if self._proc.poll() is not None or time.monotonic() > deadline:
                    log = (self.directory / "sink.log").read_text()
                    raise RuntimeError(f"otlp sink did not start: {log}") from exc
                time.sleep(0.02)
        if control:
            self.control(**control)
        return self

    def kill(self) -> None:
        """SIGKILL: the receiver dies mid-run, no goodbye."""
        if self._proc is not None:
            self._proc.kill()
            self._proc.wait(10)
            self._proc = None

    stop = kill

    def _open(self, request: urllib.request.Request | str):
        if self.certfile:
            import ssl

            ctx = ssl.create_default_context(cafile=self.certfile)
            return urllib.request.urlopen(request, timeout=10, context=ctx)
        return urllib.request.urlopen(request, timeout=10)

    def control(self, **settings: Any) -> None:
        req = urllib.request.Request(
            f"{self.scheme}://127.0.0.1:{self.port}/control", data=json.dumps(settings).encode(), method="POST"
        )
        with self._open(req):
            pass

    def state(self) -> dict[str, Any]:
        with self._open(f"{self.scheme}://127.0.0.1:{self.port}/state") as response:
            return json.load(response)

    def spans(self) -> list[dict[str, Any]]:
        if not self.out.exists():
            return []
        with open(self.out, encoding="utf-8") as fh:
            return [json.loads(line) for line in fh if line.endswith("\n")]

    def roots(self) -> list[dict[str, Any]]:
        return [s for s in self.spans() if s["attributes"].get("rl.span.kind") == "episode"]

    def wait_for_roots(self, count: int, timeout: float = 60.0) -> list[dict[str, Any]]:
        deadline = time.monotonic() + timeout
        while True:
            roots = self.roots()
            if len(roots) >= count or time.monotonic() > deadline:
                return roots
            time.sleep(0.05)

    def __enter__(self) -> OtlpSink:
        return self.start()

    def __exit__(self, *exc: object) -> None:
        self.kill()


if __name__ == "__main__":
    parser = argparse.ArgumentParser()
    parser.add_argument("--port", type=int, required=True)
    parser.add_argument("--out", type=Path, required=True)
    parser.add_argument("--certfile")
    parser.add_argument("--keyfile")
    args = parser.parse_args()
    serve(args.port, args.out, args.certfile, args.keyfile)
