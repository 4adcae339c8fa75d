"""The local channel between a recording process (or its renderer) and the node's span gateway.

The gateway is a process of its own (``correlate.gateway_node``): it owns the sockets that face
the network and holds other processes' spans as bytes. A recording process tells it, over a Unix
socket in a directory only its user can enter (and a key only its user can read), which traces are
episodes and what was decided about them; its renderer *pulls* the held spans of each kept
episode, already parsed, checked and re-encoded by the gateway, so that they join the episode's
own tree. The gateway sends back the counts of what it did for this process's episodes, which
``otr.stats()`` shows.

Frames (``multiprocessing.connection``'s length-prefixed messages, never pickles): a one-byte type,
then its payload. Trace ids travel as 16 bytes each.

=====  =========================  ===============================================================
type   from                       payload
=====  =========================  ===============================================================
``H``  client                     JSON hello: pid, run id, role
``W``  gateway                    JSON welcome: its pid and ports
``O``  client                     trace ids of episodes that began
``X``  client                     trace ids of requests made outside any episode
``K``  client                     trace ids decided kept
``D``  client                     trace ids decided dropped
``P``  client                     request id (8 bytes), trace ids: pull their held spans
``R``  gateway                    request id, an encoded ``ExportTraceServiceRequest`` (or empty)
``F``  client                     request id: flush (answered once every count is sent)
``f``  gateway                    request id
``S``  gateway                    JSON counts for ``otr.stats()``
``B``  client                     goodbye
=====  =========================  ===============================================================

The training thread only appends to a bounded deque (``opened``, ``decided``, ``outside``); a
writer thread sends, a reader thread receives. Nothing here blocks the training thread, and a
gateway that is gone costs it nothing: what cannot be sent is counted.
"""

from __future__ import annotations

import json
import os
import stat
import struct
import tempfile
import threading
import time
from collections import deque
from collections.abc import Callable, Iterable
from multiprocessing.connection import Client, Connection
from pathlib import Path
from typing import Any

from opentelemetry.proto.collector.trace.v1.trace_service_pb2 import ExportTraceServiceRequest

from otel_rollouts._core.codec import PendingSpan, pending_from_request
from otel_rollouts._core.stats import Stats

__all__ = [
    "Channel",
    "gateway_dir",
    "pack_ids",
    "unpack_ids",
]

HELLO, WELCOME, OPENED, OUTSIDE, KEPT, DROPPED = b"H", b"W", b"O", b"X", b"K", b"D"
PULL, PULLED, FLUSH, FLUSHED, COUNTS, BYE = b"P", b"R", b"F", b"f", b"S", b"B"
_ID = struct.Struct(">QQ")  # a trace id: two unsigned 64-bit halves, big-endian
_REQ = struct.Struct(">Q")  # a request number
MAX_OUTBOX = 1_000_000  # trace ids waiting to be sent (16 MB at most)
MAX_IDS_PER_FRAME = 16_384
# after a pull went unanswered, the renderer waits at most this long on the next ones for a
# while: a gateway that is gone or starved never holds every kept episode up for the full timeout
_SLOW_PULL_S = 1.0
_CONNECT_RETRY_S = 0.05  # between attempts to reach a gateway (one starting takes ~0.7 s)
_CONNECT_PAUSE_MAX_S = 2.0
_SLOW_FOR_S = 5.0


def pack_ids(trace_ids: Iterable[int]) -> bytes:
    return b"".join(_ID.pack(t >> 64, t & 0xFFFF_FFFF_FFFF_FFFF) for t in trace_ids)


def unpack_ids(data: bytes | memoryview) -> list[int]:
    return [(hi << 64) | lo for hi, lo in _ID.iter_unpack(data[: len(data) - len(data) % 16])]


def gateway_dir() -> Path:
    """The directory of this user's gateway sockets and keys (created 0700): only this user's
    processes can reach a gateway."""
    base = os.environ.get("XDG_RUNTIME_DIR") or tempfile.gettempdir()
    path = Path(base) / f"otel-rollouts-{os.getuid()}"
    path.mkdir(mode=0o700, exist_ok=True)
    info = os.lstat(path)
    if info.st_uid != os.getuid() or not stat.S_ISDIR(info.st_mode):
        raise PermissionError(f"{path} is not a directory of this user's: no gateway socket is made there")
    if info.st_mode & 0o077:
        os.chmod(path, 0o700)
    return path


def read_key(address: str) -> bytes | None:
    try:
        return Path(address + ".key").read_bytes()
    except OSError:
        return None


class Channel:
    """One connection to the node's gateway (see the module). ``role``: ``recorder`` (tells
    episodes and decisions) or ``renderer`` (pulls only). Connects lazily and again after the
    gateway went away; ``on_counts`` receives the counts the gateway sends."""

    def __init__(self, address: str, stats: Stats, *, role: str = "recorder", run_id: str | None = None,
                 on_counts: Callable[[dict[str, int]], None] | None = None) -> None:
        self.address = address
        self.stats = stats
        self.role = role
        self.run_id = run_id
        self.on_counts = on_counts or self._add_counts
        self.welcome: dict[str, Any] | None = None
        self._welcomed = threading.Event()
        self._conn: Connection | None = None
        self._send_lock = threading.Lock()
        self._connect_lock = threading.Lock()
        self._outbox: deque[tuple[bytes, int]] = deque()
        self._wake = threading.Event()
        self._stop = threading.Event()
        self._next_request = 0
        self._replies: dict[int, tuple[threading.Event, list[bytes]]] = {}
        self._writer: threading.Thread | None = None
        self._reader: threading.Thread | None = None
        self._retry_at = 0.0
        self._pause = 0.0  # between attempts to connect, growing while the gateway stays away
        self._ever = False  # connected once (a gateway lost later is not waited for)
        # its socket is there but nobody answers: a gateway that died, not one starting
        self._refused = False
        self._slow_until = 0.0  # a pull went unanswered: the next ones wait _SLOW_PULL_S at most

    # --- the training thread: append only -----------------------------------------------------
    def opened(self, trace_id: int) -> None:
        self._put(OPENED, trace_id)

    def outside(self, trace_id: int) -> None:
        self._put(OUTSIDE, trace_id)

    def decided(self, trace_id: int, kept: bool) -> None:
        self._put(KEPT if kept else DROPPED, trace_id)

    def _put(self, kind: bytes, trace_id: int) -> None:
        if len(self._outbox) >= MAX_OUTBOX:
            self.stats.add("dropped.gateway_channel_full")
            return
        self._outbox.append((kind, trace_id))
        if len(self._outbox) == 1:
            self._wake.set()

    # --- life ------------------------------------------------------------------------------------
    def start(self) -> Channel:
        if self._writer is None:
            self._writer = threading.Thread(target=self._write_loop, name="otel-rollouts-gateway-channel", daemon=True)
            self._writer.start()
        return self

    def wait_welcome(self, timeout: float) -> dict[str, Any] | None:
        """The gateway's welcome (its pid and ports), waiting up to ``timeout`` for it."""
        self.start()
        self._wake.set()
        self._welcomed.wait(timeout)
        return self.welcome

    def flush(self, timeout: float) -> bool:
        """Send what waits, then wait until the gateway has sent every count for it."""
        deadline = time.monotonic() + timeout
        self._send_outbox()
        reply = self._request(FLUSH, b"", deadline)
        return reply is not None

    def close(self, timeout: float) -> bool:
        """Flush, say goodbye (the gateway lets go what it held for this process's undecided
        episodes) and close."""
        ok = self.flush(timeout)
        self._stop.set()
        self._wake.set()
        conn = self._conn
        if conn is not None:
            try:
                with self._send_lock:
                    conn.send_bytes(BYE)
            except (OSError, ValueError):
                pass
            try:
                conn.close()
            except OSError:
                pass
        self._conn = None
        for thread in (self._writer, self._reader):
            if thread is not None and thread is not threading.current_thread():
                thread.join(max(0.1, min(1.0, timeout)))
        return ok

    # --- the renderer: pull ----------------------------------------------------------------------
    def pull(self, trace_ids: list[int], timeout: float) -> bytes:
        """The held spans of these kept episodes, as an encoded ``ExportTraceServiceRequest``
        (empty: none, or no answer within ``timeout``, counted ``errors.gateway_pull``)."""
        now = time.monotonic()
        if now < self._slow_until:  # it did not answer lately: ask, but do not wait long
            timeout = min(timeout, _SLOW_PULL_S)
        reply = self._request(PULL, pack_ids(trace_ids), now + timeout)
        if reply is None:
            self.stats.add("errors.gateway_pull")
            self._slow_until = time.monotonic() + _SLOW_FOR_S
            return b""
        self._slow_until = 0.0
        return reply

    def puller(self, timeout: float) -> Callable[[int], list[PendingSpan]]:
        """What a renderer calls for a kept episode: the server spans the gateway held for it
        (parsed, checked and re-encoded there; read here as ``PendingSpan``s, decoded only as
        the episode is rendered)."""

        def pull(trace_id: int) -> list[PendingSpan]:
            data = self.pull([trace_id], timeout)
            if not data:
                return []
            return pending_from_request(ExportTraceServiceRequest.FromString(data))

        return pull

    # --- inside ----------------------------------------------------------------------------------
    def _request(self, kind: bytes, payload: bytes, deadline: float) -> bytes | None:
        conn = self._connected()
        # never connected yet: a gateway starting, worth waiting for (one that went away, or
        # whose socket refuses, is not)
        while conn is None and not self._ever and not self._refused and not self._stop.is_set():
            if self._stop.wait(min(_CONNECT_RETRY_S, max(deadline - time.monotonic(), 0.0))) or \
                    time.monotonic() >= deadline:
                return None
            conn = self._connected(retry=True)
        if conn is None:
            return None
        with self._send_lock:
            self._next_request += 1
            number = self._next_request
            waiter: tuple[threading.Event, list[bytes]] = (threading.Event(), [])
            self._replies[number] = waiter
            try:
                conn.send_bytes(kind + _REQ.pack(number) + payload)
            except (OSError, ValueError):
                self._replies.pop(number, None)
                self._lost(conn)
                return None
        waiter[0].wait(max(0.0, deadline - time.monotonic()))
        self._replies.pop(number, None)
        return waiter[1][0] if waiter[1] else None

    def _connected(self, *, retry: bool = False) -> Connection | None:
        """The connection, made now if there is none (``retry``: even within the pause after a
        failed attempt)."""
        conn = self._conn
        if conn is not None or self._stop.is_set():
            return conn
        with self._connect_lock:
            if self._conn is not None:
                return self._conn
            if time.monotonic() < self._retry_at and not retry:
                return None
            key = read_key(self.address)
            try:
                if key is None:
                    raise OSError("no gateway key")
                conn = Client(self.address, family="AF_UNIX", authkey=key)
                hello = {"pid": os.getpid(), "run_id": self.run_id, "role": self.role}
                conn.send_bytes(HELLO + json.dumps(hello).encode())
            except Exception as exc:  # noqa: BLE001 - no gateway (yet): tried again shortly
                self._refused = isinstance(exc, ConnectionRefusedError)
                # the pause doubles while the gateway stays away (2 s at most): one that died
                # costs a few attempts a second, not twenty
                self._pause = min(self._pause * 2, _CONNECT_PAUSE_MAX_S) if self._pause else _CONNECT_RETRY_S
                self._retry_at = time.monotonic() + self._pause
                return None
            self._pause = 0.0
            self._ever = True
            self._conn = conn
            self._reader = threading.Thread(target=self._read_loop, args=(conn,),
                                            name="otel-rollouts-gateway-reader", daemon=True)
            self._reader.start()
            return conn

    def _lost(self, conn: Connection) -> None:
        """The gateway went away: whoever waits for an answer is told at once (no answer)."""
        if self._conn is conn:
            self._conn = None
            self.stats.add("errors.gateway_channel")
            try:
                conn.close()
            except OSError:
                pass
        for event, _ in list(self._replies.values()):
            event.set()

    def _write_loop(self) -> None:
        while not self._stop.is_set():
            self._wake.wait(0.05)
            self._wake.clear()
            try:
                self._send_outbox()
            except Exception:  # noqa: BLE001 - the channel never dies of one bad frame
                self.stats.add("errors.gateway_channel")

    def _send_outbox(self) -> None:
        outbox = self._outbox
        if not outbox and self._conn is not None:
            return
        conn = self._connected()
        if conn is None:
            return
        while outbox:
            kind, first = outbox.popleft()
            ids = [first]
            while outbox and outbox[0][0] == kind and len(ids) < MAX_IDS_PER_FRAME:
                ids.append(outbox.popleft()[1])
            try:
                with self._send_lock:
                    conn.send_bytes(kind + pack_ids(ids))
            except (OSError, ValueError):
                self.stats.add("dropped.gateway_channel_lost", len(ids))
                self._lost(conn)
                return

    def _read_loop(self, conn: Connection) -> None:
        while True:
            try:
                frame = conn.recv_bytes()
            except (EOFError, OSError, TypeError, ValueError):  # (closed by another thread: TypeError)
                self._lost(conn)
                return
            kind, payload = frame[:1], frame[1:]
            try:
                if kind in (PULLED, FLUSHED):
                    (number,) = _REQ.unpack_from(payload)
                    waiter = self._replies.get(number)
                    if waiter is not None:
                        waiter[1].append(bytes(payload[_REQ.size:]))
                        waiter[0].set()
                elif kind == COUNTS:
                    self.on_counts(json.loads(payload))
                elif kind == WELCOME:
                    self.welcome = json.loads(payload)
                    self._welcomed.set()
            except Exception:  # noqa: BLE001 - a frame we cannot read: counted, the next one is read
                self.stats.add("errors.gateway_channel")

    def _add_counts(self, counts: dict[str, int]) -> None:
        for name, n in counts.items():
            if isinstance(name, str) and isinstance(n, int):
                self.stats.add(name, n)
