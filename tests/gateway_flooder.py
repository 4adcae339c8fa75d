"""A misbehaving neighbour of the span gateway, run as its own process by the flood test.

    python tests/gateway_flooder.py PORT SECONDS IDLE_CONNECTIONS [REQUESTS_PER_SECOND]

For SECONDS it keeps IDLE_CONNECTIONS connections open that never send a request (opening a new
one whenever the gateway closes one), and on one more connection posts OTLP/HTTP requests of 64
spans each (REQUESTS_PER_SECOND, default 50: 3,200 spans a second, enough to fill a gateway's
byte bound within seconds without taking a whole core of a shared test machine), every span of a trace no recording process knows
(so the gateway holds them), one request in eight malformed. It prints one JSON line at the end:
requests answered by status, connections the gateway closed. SIGTERM ends it early, with the same
line (the test stops it with SIGSTOP between its flooded blocks and counts the flooding time itself).
"""

from __future__ import annotations

import http.client
import json
import os
import selectors
import signal
import socket
import sys
import time

from opentelemetry.proto.collector.trace.v1.trace_service_pb2 import ExportTraceServiceRequest


def _request(n: int) -> bytes:
    request = ExportTraceServiceRequest()
    scope = request.resource_spans.add().scope_spans.add()
    for i in range(64):
        span = scope.spans.add()
        span.trace_id = (n * 64 + i + 1).to_bytes(16, "big")
        span.span_id = (i + 1).to_bytes(8, "big")
        span.parent_span_id = (1000 + i).to_bytes(8, "big")
        span.name = "flood"
        span.attributes.add(key="pad", value={"string_value": "x" * 200})
    return request.SerializeToString()


def main() -> None:
    port, seconds, idle = int(sys.argv[1]), float(sys.argv[2]), int(sys.argv[3])
    interval = 1.0 / float(sys.argv[4]) if len(sys.argv) > 4 else 0.02
    os.nice(10)  # the neighbour's own CPU is not what the test measures
    selector = selectors.DefaultSelector()
    closed = 0

    def open_one() -> None:
        sock = socket.create_connection(("127.0.0.1", port), timeout=5)
        sock.setblocking(False)
        selector.register(sock, selectors.EVENT_READ)

    for _ in range(idle):
        open_one()
    statuses: dict[str, int] = {}
    conn = http.client.HTTPConnection("127.0.0.1", port, timeout=10)
    deadline = time.monotonic() + seconds
    n = 0
    next_at = time.monotonic()
    ended: list[int] = []
    signal.signal(signal.SIGTERM, lambda signum, frame: ended.append(signum))
    while time.monotonic() < deadline and not ended:
        for key, _ in selector.select(timeout=max(next_at - time.monotonic(), 0.0)):
            sock = key.fileobj
            assert isinstance(sock, socket.socket)
            try:
                data = sock.recv(4096)
            except OSError:
                data = b""
            if not data:  # the gateway closed it: keep IDLE_CONNECTIONS open
                selector.unregister(sock)
                sock.close()
                closed += 1
                open_one()
        if time.monotonic() < next_at:
            continue
        next_at = max(next_at + interval, time.monotonic() - interval)  # no burst after a stop
        n += 1
        body = b"\x00garbage" if n % 8 == 0 else _request(n)
        try:
            conn.request("POST", "/v1/traces", body, {"Content-Type": "application/x-protobuf"})
            response = conn.getresponse()
            response.read()
            statuses[str(response.status)] = statuses.get(str(response.status), 0) + 1
        except (OSError, http.client.HTTPException) as exc:
            statuses[type(exc).__name__] = statuses.get(type(exc).__name__, 0) + 1
            conn.close()
            conn = http.client.HTTPConnection("127.0.0.1", port, timeout=10)
    print(json.dumps({"statuses": statuses, "closed_by_gateway": closed, "requests": n}), flush=True)


if __name__ == "__main__":
    main()
