"""The node's span gateway, a process of its own: ``python -m otel_rollouts.correlate.gateway_node``.

Started by the first recording process of a node that configures a gateway on given ports (the
ports are the gateway's identity: a second process asking for the same ones joins it), it:

* serves OTLP/HTTP and OTLP/gRPC on loopback (``gateway_serve``: maintained servers, bounded);
* places what arrives (``gateway_store.Store``: bytes, bounded, per trace);
* listens on a Unix socket (``delivery.gateway_channel``) for its clients: the recording processes
  say which traces are episodes and what was decided; their renderers pull the spans of kept
  episodes;
* exports itself what belongs to no episode, what a kept episode's renderer did not take (late
  spans), the log records of kept episodes and of no episode, with exporters rebuilt from the
  first client's recipes (the OTLP ones: a Trackio file or a user's own object stays with the
  process that renders episodes);
* sends each client the counts of what it did with that client's episodes (the node's own counts,
  of what belongs to no episode, go to the oldest client);
* exits when its last client has been gone for ``linger_s`` (after letting go of what it holds by
  the rules), or when its listening socket is taken from it.

Its configuration arrives on stdin as one pickle from the process that started it (a process of
the same user: nothing from the network is ever unpickled); it answers one JSON line on stdout:
the ports bound, or why not.
"""

from __future__ import annotations

import fcntl
import json
import logging
import os
import pickle
import queue
import signal
import sys
import threading
import time
from multiprocessing.connection import Connection, Listener
from pathlib import Path
from typing import Any

from opentelemetry.proto.collector.logs.v1.logs_service_pb2 import ExportLogsServiceRequest
from opentelemetry.proto.collector.trace.v1.trace_service_pb2 import ExportTraceServiceRequest

from otel_rollouts._core.codec import logs_from_request, spans_from_request
from otel_rollouts._core.stats import Stats
from otel_rollouts.correlate.gateway_logs import LogOutlet, default_log_exporter
from otel_rollouts.correlate.gateway_serve import LOGS, TRACES, Limits, Receivers
from otel_rollouts.correlate.gateway_store import FULL_LOGS, FULL_SPANS, Outcome, Store
from otel_rollouts.delivery import gateway_channel as ch

logger = logging.getLogger("otel_rollouts")

_TICK_S = 0.25
_FIRST_CLIENT_S = 30.0  # how long a new gateway waits for its first client
_FLUSH_S = 5.0  # the most a client's flush waits for the gateway's exporters
_MARK = "mark"
_MAX_EXPORT_BYTES = 32 * 1024 * 1024  # encoded requests waiting for the exporters


class _Client:
    def __init__(self, conn: Connection, name: str) -> None:
        self.conn = conn
        self.name = name
        self.role = "recorder"
        self.lock = threading.Lock()
        self.counts: dict[str, int] = {}
        self.since = time.monotonic()

    def send(self, frame: bytes) -> bool:
        try:
            with self.lock:
                self.conn.send_bytes(frame)
            return True
        except (OSError, ValueError):
            return False


class Node:
    """One running gateway process (see the module)."""

    def __init__(self, config: dict[str, Any]) -> None:
        self.config = config
        self.address: str = config["address"]
        self.linger_s: float = config.get("linger_s", 5.0)
        self.store = Store(max_held_bytes=config["max_held_bytes"], hold_s=config["hold_s"],
                           unknown=config["unknown"])
        self.lock = threading.Lock()  # the store's
        self.stats = Stats()  # the exporters' own counters (a LogOutlet's)
        self.clients: dict[str, _Client] = {}
        self.clients_lock = threading.Lock()
        self._counter = 0
        self._last_client_at = time.monotonic()
        self._stop = threading.Event()
        self._exports: queue.Queue[tuple[str, Any] | None] = queue.Queue()
        self._export_bytes = 0
        self._export_lock = threading.Lock()
        self._node_counts: dict[str, int] = {}
        self.span_exporters: list[Any] = []
        for recipe in config.get("span_recipes") or ():
            try:
                self.span_exporters.append(recipe.build())
            except Exception:  # noqa: BLE001 - an exporter that cannot be made here: counted
                self._count("errors.gateway_exporter")
        log_exporter = None
        recipe = config.get("log_recipe")
        try:
            log_exporter = recipe.build() if recipe is not None else default_log_exporter()
        except Exception:  # noqa: BLE001
            self._count("errors.gateway_exporter")
        self.logs = LogOutlet(log_exporter, self.stats)
        self.receivers = Receivers(Limits(**config.get("limits", {})), self.receive, self._count)
        self.listener: Listener | None = None

    # --- start ---------------------------------------------------------------------------------------
    def start(self) -> dict[str, Any]:
        """Bind the ports, then the control socket; what was bound (or why not).

        Under the node's lock for this address (``<address>.lock``, an exclusive ``flock``,
        released when this returns): two processes that start a gateway for the same ports at
        once bind one after the other. Without it each could win one of the two ports, both
        serve, and the later control socket replace the earlier one: the node's clients split
        between two gateways."""
        fd = os.open(self.address + ".lock", os.O_RDWR | os.O_CREAT, 0o600)
        try:
            fcntl.flock(fd, fcntl.LOCK_EX)  # (the lock file stays: removing it would race)
            return self._start()
        finally:
            os.close(fd)  # releases the lock

    def _start(self) -> dict[str, Any]:
        host = self.config["host"]
        answer: dict[str, Any] = {"pid": os.getpid(), "http_port": None, "grpc_port": None, "errors": []}
        if self.config.get("http_port") is not None:
            try:
                answer["http_port"] = self.receivers.start_http(host, self.config["http_port"])
            except OSError as exc:
                answer["errors"].append(f"HTTP {host}:{self.config['http_port']}: {exc}")
        if self.config.get("grpc_port") is not None:
            try:
                answer["grpc_port"] = self.receivers.start_grpc(host, self.config["grpc_port"])
            except Exception as exc:  # noqa: BLE001 - grpc raises RuntimeError on a busy port
                answer["errors"].append(f"gRPC {host}:{self.config['grpc_port']}: {exc}")
        if answer["http_port"] is None and answer["grpc_port"] is None:
            return answer  # nothing to serve: another gateway (or another program) has the ports
        self.ports = answer
        key = os.urandom(32)
        key_path = Path(self.address + ".key")
        try:
            Path(self.address).unlink(missing_ok=True)  # a dead gateway's: these ports were free
            fd = os.open(key_path, os.O_WRONLY | os.O_CREAT | os.O_TRUNC, 0o600)
            with os.fdopen(fd, "wb") as out:
                out.write(key)
            self.listener = Listener(self.address, family="AF_UNIX", authkey=key)
        except OSError as exc:
            answer["errors"].append(f"control socket {self.address}: {exc}")
            self.receivers.stop(0.5)
            answer["http_port"] = answer["grpc_port"] = None
            return answer
        for target, name in ((self._accept_loop, "accept"), (self._export_loop, "export"),
                             (self._tick_loop, "ticker")):
            threading.Thread(target=target, name=f"gateway-{name}", daemon=True).start()
        return answer

    # --- what the servers receive --------------------------------------------------------------------
    def receive(self, kind: str, message: Any) -> int:
        """Place one parsed OTLP request; the number refused for want of room (partial success)."""
        with self.lock:
            if kind == TRACES:
                outcome = self.store.add_spans(message)
            else:
                outcome = self.store.add_logs(message)
        self._apply(outcome)
        full = (FULL_SPANS, FULL_LOGS)
        return sum(n for name, n in outcome.counts.items() if name in full) + sum(
            n for counts in outcome.owners.values() for name, n in counts.items() if name in full)

    def _apply(self, outcome: Outcome) -> None:
        for data in outcome.spans:
            self._export(TRACES, data)
        for data in outcome.logs:
            self._export(LOGS, data)
        for name, n in outcome.counts.items():
            self._count(name, n)
        if outcome.owners:
            with self.clients_lock:
                for owner, counts in outcome.owners.items():
                    client = self.clients.get(owner)
                    target = client.counts if client is not None else self._node_counts
                    for name, n in counts.items():
                        target[name] = target.get(name, 0) + n

    def _count(self, name: str, n: int = 1) -> None:
        with self.clients_lock:
            self._node_counts[name] = self._node_counts.get(name, 0) + n

    # --- exporting -------------------------------------------------------------------------------------
    def _export(self, kind: str, data: bytes) -> None:
        with self._export_lock:
            if self._export_bytes + len(data) > _MAX_EXPORT_BYTES:
                self._count("dropped.gateway_export_queue_full")
                return
            self._export_bytes += len(data)
        self._exports.put((kind, data))

    def _export_loop(self) -> None:
        while True:
            item = self._exports.get()
            if item is None:
                return
            kind, data = item
            if kind == _MARK:
                data.set()
                continue
            with self._export_lock:
                self._export_bytes -= len(data)
            try:
                if kind == TRACES:
                    spans = spans_from_request(ExportTraceServiceRequest.FromString(data))
                    if not self.span_exporters:
                        self._count("dropped.gateway_no_exporter.spans", len(spans))
                    for exporter in self.span_exporters:
                        result = exporter.export(spans)
                        ok = getattr(result, "name", "") == "SUCCESS"
                        self._count("gateway.exported.spans" if ok else "errors.gateway_export.spans", len(spans))
                else:
                    records = [record for _, record, _ in logs_from_request(ExportLogsServiceRequest.FromString(data))]
                    self.logs.send(records)
            except Exception:  # noqa: BLE001 - an exporter that raises: counted, the next goes out
                self._count("errors.gateway_export")

    def flush(self, timeout: float) -> bool:
        """What was queued for the exporters is exported, and the log processor flushed."""
        deadline = time.monotonic() + timeout
        done = threading.Event()
        self._exports.put((_MARK, done))
        ok = done.wait(timeout)
        ok = self.logs.flush(int(max(deadline - time.monotonic(), 0.0) * 1000)) and ok
        for exporter in self.span_exporters:
            try:
                ok = bool(exporter.force_flush(int(max(deadline - time.monotonic(), 0.0) * 1000))) and ok
            except Exception:  # noqa: BLE001
                ok = False
        return ok

    # --- clients ---------------------------------------------------------------------------------------
    def _accept_loop(self) -> None:
        listener = self.listener
        assert listener is not None
        while not self._stop.is_set():
            try:
                conn = listener.accept()
            except Exception:  # noqa: BLE001 - a client that failed the key: ignored
                if self._stop.is_set():
                    return
                continue
            with self.clients_lock:
                self._counter += 1
                client = _Client(conn, f"c{self._counter}")
                self.clients[client.name] = client
            threading.Thread(target=self._serve_client, args=(client,), name=f"gateway-{client.name}",
                             daemon=True).start()

    def _serve_client(self, client: _Client) -> None:
        try:
            while True:
                try:
                    frame = client.conn.recv_bytes()
                except (EOFError, OSError, TypeError, ValueError):  # (closed meanwhile: TypeError)
                    return
                if not self._frame(client, frame[:1], memoryview(frame)[1:]):
                    return
        finally:
            self._gone(client)

    def _frame(self, client: _Client, kind: bytes, payload: memoryview) -> bool:
        name = client.name
        if kind == ch.HELLO:
            try:
                client.role = str(json.loads(bytes(payload)).get("role", "recorder"))
            except ValueError:
                pass
            welcome = {"pid": os.getpid(), "http_port": self.ports["http_port"],
                       "grpc_port": self.ports["grpc_port"]}
            client.send(ch.WELCOME + json.dumps(welcome).encode())
        elif kind == ch.OPENED:
            with self.lock:
                self.store.opened(name, ch.unpack_ids(payload))
        elif kind == ch.OUTSIDE:
            with self.lock:
                outcome = self.store.outside(ch.unpack_ids(payload))
            self._apply(outcome)
        elif kind in (ch.KEPT, ch.DROPPED):
            ids = ch.unpack_ids(payload)
            with self.lock:
                outcome = self.store.decided(name, [(t, kind == ch.KEPT) for t in ids])
            self._apply(outcome)
        elif kind == ch.PULL:
            number = bytes(payload[:8])
            with self.lock:
                data, outcome = self.store.pull(name, ch.unpack_ids(payload[8:]))
            self._apply(outcome)
            client.send(ch.PULLED + number + data)
        elif kind == ch.FLUSH:
            self.flush(_FLUSH_S)
            self._send_counts(client)
            client.send(ch.FLUSHED + bytes(payload[:8]))
        elif kind == ch.BYE:
            return False
        return True

    def _gone(self, client: _Client) -> None:
        with self.clients_lock:
            self.clients.pop(client.name, None)
            if not self.clients:
                self._last_client_at = time.monotonic()
                if self.linger_s <= 0:
                    self._stop.set()  # a gateway of one process: it goes with it
        with self.lock:
            outcome = self.store.owner_gone(client.name)
        self._apply(outcome)
        try:
            client.conn.close()
        except OSError:
            pass

    def _send_counts(self, client: _Client) -> None:
        with self.clients_lock:
            counts, client.counts = client.counts, {}
            oldest = min((c for c in self.clients.values() if c.role == "recorder"),
                         key=lambda c: c.since, default=None)
            if oldest is client and self._node_counts:
                for key, n in self._node_counts.items():
                    counts[key] = counts.get(key, 0) + n
                self._node_counts = {}
        if counts:
            client.send(ch.COUNTS + json.dumps(counts).encode())

    # --- time ------------------------------------------------------------------------------------------
    def _tick_loop(self) -> None:
        while not self._stop.wait(_TICK_S):
            try:
                with self.lock:
                    outcome = self.store.expire()
                self._apply(outcome)
                with self.clients_lock:
                    clients = list(self.clients.values())
                    # no client for linger_s since the last one left; or none ever, a while
                    # after starting (the process that started it went before connecting)
                    linger = self.linger_s if self._counter else max(self.linger_s, _FIRST_CLIENT_S)
                    idle = not clients and time.monotonic() - self._last_client_at > linger
                for client in clients:
                    self._send_counts(client)
                if idle or not os.path.exists(self.address):
                    self._stop.set()
            except Exception:  # noqa: BLE001 - the gateway never dies of one bad item
                self._count("errors.gateway")

    def run(self) -> None:
        """Serve until the last client has gone (see the module), then let go and exit."""
        self._stop.wait()
        self.receivers.stop(1.0)
        with self.lock:
            outcome = self.store.expire(final=True)
        self._apply(outcome)
        self.flush(_FLUSH_S)
        self._exports.put(None)
        self.logs.shutdown()
        for exporter in self.span_exporters:
            try:
                exporter.shutdown()
            except Exception:  # noqa: BLE001
                pass
        if self.listener is not None:
            try:
                self.listener.close()  # (removes the socket file)
            except OSError:
                pass
            Path(self.address + ".key").unlink(missing_ok=True)
        if self.config.get("private"):  # an address no other process uses: its lock file too
            Path(self.address + ".lock").unlink(missing_ok=True)


_NICE = 10  # below the trainer: on a busy node the training loop gets the CPU, the gateway waits


def main() -> None:
    signal.signal(signal.SIGINT, signal.SIG_IGN)  # a Ctrl-C in the terminal is the trainer's
    try:
        os.nice(_NICE)
    except OSError:
        pass
    config = pickle.load(sys.stdin.buffer)
    node = Node(config)
    answer = node.start()
    sys.stdout.write(json.dumps(answer) + "\n")
    sys.stdout.flush()
    sys.stdout.close()
    if node.listener is None:
        if config.get("private"):
            Path(node.address + ".lock").unlink(missing_ok=True)
        sys.exit(3)
    node.run()


if __name__ == "__main__":
    main()
