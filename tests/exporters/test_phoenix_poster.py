"""The Phoenix annotation poster against hostile annotation endpoints, on real sockets.

Each endpoint is a tiny threaded socket server written here (``Hostile``): one that answers one
byte every 0.5 s (a read timeout never fires: each byte resets it), one that accepts and never
answers, one that redirects to a second listener on another port, which records whatever reaches
it. The spans go to a real OTLP/HTTP receiver (``otlp_sink.py``). What is checked: every kept
episode is delivered (stored in the receiver, counted delivered) within a time that does not
depend on the annotation endpoint; each request is cut at its total deadline; no redirect is
followed, so no credentials leave for another origin; and every annotation ends in exactly one
outcome (posted + lost == annotations made).
"""

from __future__ import annotations

import socket
import threading
import time
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any

import pytest
from opentelemetry.exporter.otlp.proto.http.trace_exporter import OTLPSpanExporter
from opentelemetry.sdk.trace.export.in_memory_span_exporter import InMemorySpanExporter
from otlp_sink import OtlpSink
from otr_helpers import self_signed_certificate as _certificate
from otr_helpers import wait_for as _wait

import otel_rollouts as otr
from otel_rollouts import conventions as c
from otel_rollouts.delivery.phoenix import PhoenixAnnotations, annotations_of

NAME = "OTLPSpanExporter"
# annotations of each episode recorded here: reward, correct, format, advantage, status (its
# evaluations) and the columns step, stage and kept
PER_EPISODE = 8
SECRET = "Bearer poster-s3cret"


class Hostile:
    """An HTTP endpoint on 127.0.0.1 that misbehaves on purpose, one thread per connection.

    ``mode``: ``trickle`` (reads the request, then answers one byte every 0.5 s, for ever),
    ``silent`` (reads the request, never answers, holds the connection open), ``redirect``
    (answers ``code`` with ``Location: to``), ``record`` (answers 200 with ``answer``). Every
    request read is kept in ``requests`` (method, path, headers in lower case, body)."""

    def __init__(self, mode: str, *, code: int = 302, to: str = "", answer: bytes = b'{"data": []}') -> None:
        self.mode, self.code, self.to, self.answer = mode, code, to, answer
        self.requests: list[dict[str, Any]] = []
        self.accepted = 0
        self.sent = 0  # bytes trickled
        self._lock = threading.Lock()
        self._stop = threading.Event()
        self._threads: list[threading.Thread] = []
        self._conns: list[socket.socket] = []
        self.listener = socket.create_server(("127.0.0.1", 0))
        self.port = self.listener.getsockname()[1]
        self.url = f"http://127.0.0.1:{self.port}"
        self._start(self._accept)

    def _start(self, target: Callable[..., None], *args: Any) -> None:
        thread = threading.Thread(target=target, args=args, daemon=True)
        self._threads.append(thread)
        thread.start()

    def _accept(self) -> None:
        while not self._stop.is_set():
            try:
                conn, _ = self.listener.accept()
            except OSError:  # the listener was closed
                return
            with self._lock:
                self.accepted += 1
                self._conns.append(conn)
            self._start(self._serve, conn)

    def _read(self, conn: socket.socket) -> dict[str, Any] | None:
        conn.settimeout(10)
        data = b""
        while b"\r\n\r\n" not in data:
            chunk = conn.recv(65536)
            if not chunk:
                return None
            data += chunk
        head, _, body = data.partition(b"\r\n\r\n")
        lines = head.decode("latin-1").split("\r\n")
        method, path, _ = lines[0].split(" ", 2)
        headers = {k.strip().lower(): v.strip() for k, _, v in (line.partition(":") for line in lines[1:])}
        while len(body) < int(headers.get("content-length", 0)):
            chunk = conn.recv(65536)
            if not chunk:
                break
            body += chunk
        return {"method": method, "path": path, "headers": headers, "body": body}

    def _serve(self, conn: socket.socket) -> None:
        try:
            request = self._read(conn)
            if request is None:
                return
            with self._lock:
                self.requests.append(request)
            if self.mode == "trickle":
                answer = b"HTTP/1.1 200 OK\r\nContent-Type: text/plain\r\nX-Pad: " + b"a" * 100_000
                for byte in answer:
                    conn.sendall(bytes([byte]))
                    with self._lock:
                        self.sent += 1
                    if self._stop.wait(0.5):  # the pace of the trickle, not a synchronisation
                        return
            elif self.mode == "silent":
                self._stop.wait()
            elif self.mode == "redirect":
                conn.sendall(f"HTTP/1.1 {self.code} Moved\r\nLocation: {self.to}\r\nContent-Length: 0\r\n"
                             f"Connection: close\r\n\r\n".encode())
            else:
                conn.sendall(b"HTTP/1.1 200 OK\r\nContent-Type: application/json\r\nContent-Length: "
                             + str(len(self.answer)).encode() + b"\r\nConnection: close\r\n\r\n" + self.answer)
        except OSError:  # the client cut the connection (its deadline), or close()
            return
        finally:
            conn.close()

    def close(self) -> None:
        self._stop.set()
        try:
            self.listener.shutdown(socket.SHUT_RDWR)  # wakes the accept() (close() alone does not)
        except OSError:
            pass
        self.listener.close()
        with self._lock:
            conns = list(self._conns)
        for conn in conns:
            try:
                conn.shutdown(socket.SHUT_RDWR)
            except OSError:
                pass
        for thread in self._threads:
            thread.join(5)

    def __enter__(self) -> Hostile:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()


@pytest.fixture
def sink(tmp_path: Path) -> Iterator[OtlpSink]:
    with OtlpSink(tmp_path / "sink") as running:
        yield running


def _total(name: str) -> int:
    return otr.stats()["totals"].get(f"{name}.{NAME}", 0)


def _configure(exporter: OTLPSpanExporter) -> None:
    otr.configure(service_name="phoenix-poster", exporters=[exporter], sampler=otr.TailSampler(100, "first"),
                  run_id="poster")


def _step(step: int, episodes: int) -> None:
    for i in range(episodes):
        with otr.episode(step=step, group_id="g", sample_index=i) as ep:
            ep.prompt([{"role": "user", "content": f"q{step}.{i}"}])
            ep.reward(0.5, components={"correct": 1.0, "format": 0.0}, advantage=0.1)
            ep.finish(status="ok")
    otr.end_step(step)


def _delivered(sink: OtlpSink, episodes: int) -> bool:
    return _total("delivered") == episodes and len(sink.roots()) == episodes


def _balance(episodes: int) -> dict[str, int]:
    """Every annotation made ended once: posted or lost (and lost is the sum of its reasons)."""
    totals = otr.stats()["totals"]
    lost = {k.split(".")[2]: v for k, v in totals.items()
            if k.startswith("annotations.lost.") and k.count(".") == 3 and k.endswith("." + NAME)}
    assert _total("annotations.posted") + _total("annotations.lost") == PER_EPISODE * episodes, totals
    assert sum(lost.values()) == _total("annotations.lost"), totals
    return lost


def test_a_trickling_endpoint_is_cut_at_the_total_deadline_and_never_delays_delivery(sink: OtlpSink,
                                                                                     otr_shutdown) -> None:
    with Hostile("trickle") as hostile:
        exporter = OTLPSpanExporter(endpoint=sink.endpoint, timeout=5)
        layer = PhoenixAnnotations.attach(exporter, hostile.url)
        assert layer is not None
        layer.post_timeout = 1.0
        _configure(exporter)
        started = time.monotonic()
        _step(0, 8)
        # delivery does not wait for the annotation request (which would trickle for ever)
        _wait(lambda: _delivered(sink, 8), 5.0, "8 episodes stored and counted delivered")
        print(f"delivered in {time.monotonic() - started:.2f} s")
        _wait(lambda: _total("annotations.failures") == 1, 5.0, "the trickled request failed")
        # cut at its 1 s deadline, though a byte came every 0.5 s (a read timeout would never fire)
        assert hostile.sent >= 2 and layer.last_post_s is not None and 1.0 <= layer.last_post_s < 1.8
        assert _total("annotations.failures.timeout") == 1 and len(hostile.requests) == 1
        print(f"request cut after {layer.last_post_s:.2f} s, {hostile.sent} bytes trickled")
        _step(1, 2)  # during the pause after the failure: lost, not queued
        _wait(lambda: _delivered(sink, 10), 5.0, "10 episodes stored and counted delivered")
        assert otr.flush(10)
        assert otr.shutdown(10)
    lost = _balance(10)
    # the first request (a batch: one episode) timed out; the rest came during the pause after it
    assert set(lost) == {"timeout", "paused"} and lost["timeout"] >= PER_EPISODE and lost["paused"] >= 2 * PER_EPISODE
    assert _total("annotations.posted") == 0 and not [k for k in otr.stats()["totals"] if k.startswith("dropped.")]


@pytest.mark.parametrize("code", [302, 307])
def test_a_redirect_is_not_followed_and_no_credentials_reach_another_origin(sink: OtlpSink, otr_shutdown,
                                                                            code: int) -> None:
    with Hostile("record") as target:
        with Hostile("redirect", code=code, to=f"{target.url}/v1/span_annotations") as hostile:
            exporter = OTLPSpanExporter(endpoint=sink.endpoint, timeout=5, headers={"authorization": SECRET})
            layer = PhoenixAnnotations.attach(exporter, hostile.url)
            assert layer is not None and layer.headers == {"authorization": SECRET}  # its own host
            _configure(exporter)
            _step(0, 4)
            assert otr.flush(10)
            assert otr.shutdown(10)
        # the origin it pointed to got nothing at all; the endpoint given got the credentials, once
        assert [(r["method"], r["headers"].get("authorization")) for r in target.requests] == []
        assert [(r["method"], r["headers"].get("authorization")) for r in hostile.requests] == [("POST", SECRET)]
    assert _delivered(sink, 4)
    lost = _balance(4)
    # the first request (a batch: one episode) was redirected; the rest came during the pause after it
    assert set(lost) <= {"redirect", "paused"} and lost["redirect"] >= PER_EPISODE
    assert _total("annotations.posted") == 0
    assert _total("annotations.failures.redirect") == _total("annotations.failures") == 1


def test_an_endpoint_that_never_answers_holds_no_delivery_and_shutdown_cuts_it(sink: OtlpSink,
                                                                               otr_shutdown) -> None:
    with Hostile("silent") as hostile:
        exporter = OTLPSpanExporter(endpoint=sink.endpoint, timeout=5)
        layer = PhoenixAnnotations.attach(exporter, hostile.url)
        assert layer is not None
        layer.post_timeout = 60.0  # longer than the test: only shutdown ends the request
        layer.max_queued_annotations = 2 * PER_EPISODE
        _configure(exporter)
        for step in range(5):
            _step(step, 2)
        _wait(lambda: _delivered(sink, 10), 5.0, "10 episodes stored and counted delivered")
        _wait(lambda: hostile.requests, 5.0, "the annotation request under way")
        assert hostile.accepted == 1  # one request at a time, still unanswered
        started = time.monotonic()
        assert otr.shutdown(4)
        took = time.monotonic() - started
        print(f"shutdown(4) took {took:.2f} s")
        assert took < 4.5  # the poster's share of it, then the request cut
    lost = _balance(10)
    # one request was under way (what was queued when the poster took it: 2 episodes at most), and
    # 2 episodes' annotations queued behind it; the others did not fit the queue
    assert set(lost) <= {"queue_full", "shutdown"} and PER_EPISODE <= lost["shutdown"] <= 4 * PER_EPISODE
    assert _total("annotations.failures") == 0 and _total("annotations.posted") == 0


def test_a_steps_many_batches_are_posted_together_and_none_lost(sink: OtlpSink, otr_shutdown) -> None:
    """One batch per kept episode: the poster sends what queued meanwhile in one request, so a
    step's annotations neither wait a request each nor overflow the queue (Phoenix taking 0.2 s
    a request here: one request per episode would take 20 s)."""
    sink.control(phoenix_version="20.26.1", annotations_delay=0.2)
    exporter = OTLPSpanExporter(endpoint=sink.endpoint, timeout=5)
    assert PhoenixAnnotations.attach(exporter, "auto") is not None
    _configure(exporter)
    _step(0, 100)
    assert otr.flush(30)
    assert _delivered(sink, 100) and _total("annotations.posted") == 100 * PER_EPISODE
    assert _balance(100) == {}
    state = sink.state()
    print(f"{state['requests']} span requests, {state['annotation_requests']} annotation requests")
    assert state["annotation_requests"] < 100 / 4  # not one request per kept episode
    assert len({(a["span_id"], a["name"]) for a in sink.annotations()}) == 100 * PER_EPISODE


def _episode_spans() -> list[Any]:
    memory = InMemorySpanExporter()
    otr.configure(service_name="phoenix-poster", exporters=[memory], sampler=otr.TailSampler(100, "first"))
    _step(0, 1)
    otr.shutdown(10)
    spans = list(memory.get_finished_spans())
    assert len(annotations_of(spans)) == PER_EPISODE
    return spans


def test_detection_waits_on_no_export_and_is_cut_at_its_total_deadline(otr_shutdown) -> None:
    spans = _episode_spans()
    with Hostile("trickle") as hostile:
        layer = PhoenixAnnotations(hostile.url, detect=True, detect_timeout=1.0)
        exporting = threading.Thread(target=layer.exported, args=(spans,), daemon=True)
        started = time.monotonic()
        exporting.start()
        exporting.join(5)
        assert not exporting.is_alive(), "the export waited on the version request"
        assert time.monotonic() - started < 0.5
        _wait(lambda: layer.stats.total("annotations.lost.phoenix"), 5.0, "the batch's annotations lost")
        assert hostile.sent >= 2 and [r["path"] for r in hostile.requests] == ["/arize_phoenix_version"]
        assert layer.stats.total("annotations.lost.detect.phoenix") == PER_EPISODE
        assert layer.phoenix is None and layer._tries == 1  # no answer: asked again with the next batch
        layer.close()


def test_a_redirected_version_request_is_not_followed(otr_shutdown) -> None:
    spans = _episode_spans()
    with Hostile("record", answer=b"20.26.1") as target:
        with Hostile("redirect", code=302, to=f"{target.url}/arize_phoenix_version") as hostile:
            layer = PhoenixAnnotations(hostile.url, detect=True, headers={"authorization": SECRET})
            layer.exported(spans)
            _wait(lambda: layer.phoenix is not None, 5.0, "the version request answered")
            # neither followed nor sent credentials
            assert [(r["method"], r["headers"].get("authorization")) for r in target.requests] == []
            assert [r["path"] for r in hostile.requests] == ["/arize_phoenix_version"]
            assert layer.phoenix is False  # the answer was a redirect, not Phoenix's version
            layer.close()
    assert layer.stats.snapshot()["totals"] == {}  # not a Phoenix: no annotation was made


def test_over_tls_annotations_trust_the_exporters_ca_and_a_silent_handshake_is_cut(tmp_path: Path, monkeypatch,
                                                                                  otr_shutdown) -> None:
    cert, key = _certificate(tmp_path)
    monkeypatch.setenv(c.ENV_OTLP_TRACES_CERTIFICATE, cert)
    for name in ("REQUESTS_CA_BUNDLE", "CURL_CA_BUNDLE"):  # requests lets them override the exporter's CA
        monkeypatch.delenv(name, raising=False)
    with OtlpSink(tmp_path / "sink", certfile=cert, keyfile=key) as tls_sink:
        tls_sink.control(phoenix_version="20.26.1")
        exporter = OTLPSpanExporter(endpoint=tls_sink.endpoint, timeout=5, certificate_file=cert)
        layer = PhoenixAnnotations.attach(exporter, "auto")
        assert layer is not None and layer.base.startswith("https://")
        _configure(exporter)
        _step(0, 3)
        assert otr.flush(10)
        assert len(tls_sink.annotations()) == 3 * PER_EPISODE and _total("annotations.posted") == 3 * PER_EPISODE
        assert otr.shutdown(10)
    spans = _episode_spans()
    with Hostile("silent") as hostile:  # takes the connection, never answers the TLS handshake
        layer = PhoenixAnnotations(f"https://127.0.0.1:{hostile.port}", detect=False, post_timeout=1.0)
        layer.exported(spans)
        _wait(lambda: layer.stats.total("annotations.lost.timeout.phoenix"), 5.0, "the handshake cut")
        assert layer.stats.total("annotations.failures.timeout.phoenix") == 1
        assert layer.last_post_s is not None and 1.0 <= layer.last_post_s < 1.8
        layer.close()
