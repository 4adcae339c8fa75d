"""The delivery ledger: every kept episode ends delivered (confirmed stored) or dropped under a
named reason, once, per exporter and per step, whatever the exporters and collectors do.

Real parts: the OpenTelemetry SDK's own OTLP exporters (HTTP and gRPC) talking to real
receivers on loopback (``otlp_sink.py``, a subprocess that can be told how to answer; a gRPC
server implementing the OTLP trace service), and hostile in-process exporters for what only
Python can do (raise ``SystemExit``, hang in ``export``).
"""

from __future__ import annotations

import gc
import http.server
import os
import threading
import time
import tracemalloc
from collections import Counter
from collections.abc import Callable, Iterator, Sequence
from concurrent import futures

import pytest
from disk_faults import mount_tmpfs, umount
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st
from opentelemetry.exporter.otlp.proto.http.trace_exporter import OTLPSpanExporter
from opentelemetry.sdk.trace import ReadableSpan
from opentelemetry.sdk.trace.export import SpanExporter, SpanExportResult
from opentelemetry.sdk.trace.export.in_memory_span_exporter import InMemorySpanExporter
from otlp_sink import OtlpSink
from otr_helpers import traces
from profiles import examples
from suite_paths import with_test_paths

import otel_rollouts as otr
from otel_rollouts import conventions as c

_LOST = "lost"  # the prefix of what delivery lost, per reason and exporter

# --- helpers -----------------------------------------------------------------------------------


def _episodes(step: int, n: int, *, turns: int = 1, text: str = "hello") -> None:
    for i in range(n):
        with otr.episode(step=step, group_id=f"g{i % 2}", sample_index=i) as ep:
            ep.prompt([{"role": "user", "content": f"question {step}/{i}"}])
            for t in range(turns):
                with ep.turn() as turn:
                    turn.record_generation(f"{t} {text}", model="m")  # a text of its own
            ep.reward(float(i))


def _books(name: str) -> dict[str, dict[str, int]]:
    """Per step: what the ledger entered for exporter ``name`` and how each episode ended."""
    out: dict[str, dict[str, int]] = {}
    for step, counts in otr.stats()["steps"].items():
        entered = counts.get(f"ledger.entered.{name}", 0)
        if not entered:
            continue
        suffix = "." + name
        delivered = counts.get(f"delivered.{name}", 0)
        dropped = sum(v for k, v in counts.items() if k.startswith(_LOST + ".") and k.endswith(suffix))
        left = counts.get(f"undelivered_at_exit.{name}", 0)
        out[step] = {"kept": counts.get("kept", 0), "entered": entered, "delivered": delivered,
                     "dropped": dropped, "left": left}
    return out


def _assert_balanced(name: str) -> dict[str, int]:
    """After shutdown: per step, kept = entered = delivered + dropped (+ left in a spool_dir)."""
    totals = Counter()
    books = _books(name)
    assert books, f"nothing entered the ledger for {name}"
    for step, b in books.items():
        assert b["kept"] == b["entered"] == b["delivered"] + b["dropped"] + b["left"], (name, step, b)
        totals.update(b)
    assert otr.stats()["delivery"][name]["pending"] == 0
    return dict(totals)


def _sink_roots(sink: OtlpSink) -> Counter:
    return Counter(s["trace_id"] for s in sink.roots())


class Hostile(SpanExporter):
    """An exporter that does, per call, what its schedule says (then stores): ``ok``, ``failure``
    (returns FAILURE), ``raise`` (RuntimeError), ``exit`` (SystemExit), ``interrupt``
    (KeyboardInterrupt), ``hang`` (blocks until ``release``)."""

    def __init__(self, schedule: Sequence[str] = ()) -> None:
        self.schedule = list(schedule)
        self.stored = InMemorySpanExporter()
        self.calls = 0
        self.release = threading.Event()
        self.hanging = threading.Event()

    def export(self, spans: Sequence[ReadableSpan]) -> SpanExportResult:
        self.calls += 1
        action = self.schedule.pop(0) if self.schedule else "ok"
        if action == "failure":
            return SpanExportResult.FAILURE
        if action == "raise":
            raise RuntimeError("exporter bug")
        if action == "exit":
            raise SystemExit(3)
        if action == "interrupt":
            raise KeyboardInterrupt
        if action == "hang":
            self.hanging.set()
            self.release.wait(60)
        return self.stored.export(spans)

    def roots(self) -> Counter:
        return Counter(format(s.context.trace_id, "032x") for s in self.stored.get_finished_spans()
                       if (s.attributes or {}).get(c.RL_SPAN_KIND) == c.KIND_EPISODE)

    def shutdown(self) -> None:  # a hung call stays hung: shutdown does not rescue it
        return None


@pytest.fixture
def sink(tmp_path) -> Iterator[OtlpSink]:
    with OtlpSink(tmp_path / "sink") as s:
        yield s


# --- refused requests --------------------------------------------------------------------------


@pytest.mark.parametrize("status", [413, 400])
def test_refused_requests_in_a_row_never_stop_later_delivery(otr_shutdown, sink, status):
    """Two (and more) requests in a row refused for good: what can be split is split and sent,
    the rest dropped under ``refused``; the 30 later episodes all arrive while the collector is up
    (on the previous main, 0 of 30 did)."""
    sink.control(script=[status] * 6)
    otr.configure(exporters=[OTLPSpanExporter(endpoint=sink.endpoint, timeout=5)],
                  sampler=otr.TailSampler(100, "first"), handle_signals=False)
    _episodes(0, 2)
    otr.end_step(0)
    assert otr.flush(timeout=30)
    for step in range(1, 4):
        _episodes(step, 10)
        otr.end_step(step)
    assert otr.flush(timeout=30)
    received = _sink_roots(sink)
    assert otr.shutdown(timeout=30)
    books = _assert_balanced("OTLPSpanExporter")
    totals = otr.stats()["totals"]
    assert books["delivered"] == len(received) >= 30  # every later episode arrived...
    assert max(received.values()) == 1  # ...once
    assert books["dropped"] == totals.get("lost.refused.OTLPSpanExporter", 0)
    assert totals["export.refused.OTLPSpanExporter"] >= 2
    assert sink.state()["script"] == []  # every scripted refusal was met


def _grpc_server(service: object) -> tuple[object, int]:
    import grpc
    from opentelemetry.proto.collector.trace.v1 import trace_service_pb2_grpc

    server = grpc.server(futures.ThreadPoolExecutor(max_workers=2))
    trace_service_pb2_grpc.add_TraceServiceServicer_to_server(service, server)
    port = server.add_insecure_port("127.0.0.1:0")
    server.start()
    return server, port


def test_a_grpc_ok_whose_partial_success_rejects_every_span_is_not_delivered(otr_shutdown):
    """gRPC OK with ``partial_success.rejected_spans``: the first request's episode is dropped
    (``rejected``), the next stored and delivered."""
    from opentelemetry.exporter.otlp.proto.grpc.trace_exporter import (
        OTLPSpanExporter as GrpcExporter,
    )
    from opentelemetry.proto.collector.trace.v1 import trace_service_pb2, trace_service_pb2_grpc

    answers = ["reject_all"]

    class Service(trace_service_pb2_grpc.TraceServiceServicer):
        def Export(self, request, context):  # noqa: N802 - the service's own name
            response = trace_service_pb2.ExportTraceServiceResponse()
            if answers and answers.pop(0) == "reject_all":
                response.partial_success.rejected_spans = sum(
                    len(ss.spans) for rs in request.resource_spans for ss in rs.scope_spans)
                response.partial_success.error_message = "scripted rejection"
            return response

    server, port = _grpc_server(Service())
    try:
        otr.configure(exporters=[GrpcExporter(endpoint=f"127.0.0.1:{port}", insecure=True, timeout=5)],
                      sampler=otr.TailSampler(100, "first"), handle_signals=False)
        _episodes(0, 1)
        otr.end_step(0)
        assert otr.flush(timeout=30)
        _episodes(1, 1)
        otr.end_step(1)
        assert otr.shutdown(timeout=30)
    finally:
        server.stop(None)  # type: ignore[attr-defined]
    books = _books("OTLPSpanExporter")
    assert books["0/train"]["delivered"] == 0 and books["0/train"]["dropped"] == 1
    assert books["1/train"]["delivered"] == 1
    assert otr.stats()["totals"]["lost.rejected.OTLPSpanExporter"] == 1
    _assert_balanced("OTLPSpanExporter")


def test_a_grpc_invalid_argument_is_split_and_never_stops_delivery(otr_shutdown):
    grpc = pytest.importorskip("grpc")
    from opentelemetry.exporter.otlp.proto.grpc.trace_exporter import (
        OTLPSpanExporter as GrpcExporter,
    )
    from opentelemetry.proto.collector.trace.v1 import trace_service_pb2, trace_service_pb2_grpc

    stored: list[bytes] = []
    refusals = [4]  # the first four requests are refused

    class Service(trace_service_pb2_grpc.TraceServiceServicer):
        def Export(self, request, context):  # noqa: N802 - the service's own name
            if refusals[0] > 0:
                refusals[0] -= 1
                context.abort(grpc.StatusCode.INVALID_ARGUMENT, "scripted refusal")
            for rs in request.resource_spans:
                for ss in rs.scope_spans:
                    stored.extend(span.trace_id for span in ss.spans
                                  if any(kv.key == c.RL_SPAN_KIND and kv.value.string_value == c.KIND_EPISODE
                                         for kv in span.attributes))
            return trace_service_pb2.ExportTraceServiceResponse()

    server, port = _grpc_server(Service())
    try:
        otr.configure(exporters=[GrpcExporter(endpoint=f"127.0.0.1:{port}", insecure=True, timeout=5)],
                      sampler=otr.TailSampler(100, "first"), handle_signals=False)
        _episodes(0, 2)
        otr.end_step(0)
        assert otr.flush(timeout=30)
        _episodes(1, 20)
        otr.end_step(1)
        assert otr.flush(timeout=30)
        assert otr.shutdown(timeout=30)
    finally:
        server.stop(None)  # type: ignore[attr-defined]
    books = _assert_balanced("OTLPSpanExporter")
    assert refusals[0] == 0
    assert books["delivered"] == len(set(stored)) >= 20
    assert otr.stats()["totals"]["export.refused.OTLPSpanExporter"] >= 2


# --- partial success ----------------------------------------------------------------------------


@pytest.mark.parametrize(("answer", "reason"), [("reject_all", "rejected"), ("reject_half", "partially_rejected")])
def test_a_partial_success_is_not_counted_delivered(otr_shutdown, sink, answer, reason):
    """A 200 whose ``partial_success`` rejects spans: those episodes are dropped under a reason,
    never counted delivered (they were, on the previous main)."""
    sink.control(script=[answer] * 3)  # each episode goes out in a request of its own:
    otr.configure(exporters=[OTLPSpanExporter(endpoint=sink.endpoint, timeout=5)],
                  sampler=otr.TailSampler(100, "first"), handle_signals=False)
    for _ in range(3):  # (episodes waiting together for the sender go in one request)
        _episodes(0, 1)
        otr.flush(timeout=30)  # False: what was rejected is not delivered
    otr.end_step(0)
    _episodes(1, 2)
    otr.end_step(1)
    assert otr.shutdown(timeout=30)
    books = _books("OTLPSpanExporter")
    assert books["0/train"]["delivered"] == 0 and books["0/train"]["dropped"] == 3
    assert otr.stats()["totals"][f"lost.{reason}.OTLPSpanExporter"] == 3
    assert books["1/train"]["delivered"] == 2  # the next request went through: stored, counted
    _assert_balanced("OTLPSpanExporter")


class _AnsweringCollector:
    """A real OTLP/HTTP endpoint on loopback (``http.server`` in a thread) that takes every
    request and answers 200 with the body ``answer(spans in the request)`` and ``content_type``:
    a collector, or a proxy in front of one, whose answer is not what OTLP says it must be."""

    def __init__(self, answer, content_type: str = "application/x-protobuf") -> None:
        from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer

        from opentelemetry.proto.collector.trace.v1.trace_service_pb2 import (
            ExportTraceServiceRequest,
        )

        owner = self
        self.requests = 0

        class Handler(BaseHTTPRequestHandler):
            def do_POST(self) -> None:  # noqa: N802 - http.server's name
                data = self.rfile.read(int(self.headers.get("Content-Length") or 0))
                request = ExportTraceServiceRequest.FromString(data)
                spans = sum(len(ss.spans) for rs in request.resource_spans for ss in rs.scope_spans)
                owner.requests += 1
                body = answer(spans)
                self.send_response(200)
                self.send_header("Content-Type", content_type)
                self.send_header("Content-Length", str(len(body)))
                self.end_headers()
                self.wfile.write(body)

            def log_message(self, *args: object) -> None:
                return None

        self.server = ThreadingHTTPServer(("127.0.0.1", 0), Handler)
        self.endpoint = f"http://127.0.0.1:{self.server.server_address[1]}/v1/traces"
        self.thread = threading.Thread(target=self.server.serve_forever, daemon=True)
        self.thread.start()

    def close(self) -> None:
        self.server.shutdown()
        self.server.server_close()
        self.thread.join(10)


def _rejecting_all(spans: int) -> bytes:
    from opentelemetry.proto.collector.trace.v1.trace_service_pb2 import ExportTraceServiceResponse

    response = ExportTraceServiceResponse()
    response.partial_success.rejected_spans = spans
    response.partial_success.error_message = "every span rejected"
    return response.SerializeToString()


@pytest.mark.parametrize(("answer", "content_type", "reason"), [
    # what the red team sent: a partial_success rejecting every span, then junk bytes
    (lambda n: _rejecting_all(n) + b"junk after the response", "application/x-protobuf", "unconfirmed"),
    (lambda n: b"<html><body>OK</body></html>", "text/html", "unconfirmed"),  # a proxy's page
    (lambda n: b'{"partialSuccess": {"rejectedSpans": "%d"}}' % n, "application/json", "rejected"),
], ids=["partial-success-then-junk", "html-page", "json-partial-success"])
def test_a_2xx_answer_that_confirms_nothing_is_never_counted_delivered(otr_shutdown, answer, content_type,
                                                                        reason):
    """A 200 whose body is no readable OTLP response (a ``partial_success`` rejecting every span
    followed by junk bytes; a proxy's HTML page) says nothing of what was stored: every episode
    is dropped under ``unconfirmed``, none delivered (on the previous main the body was taken as
    "nothing rejected": 12 counted delivered, 0 stored). An answer in OTLP/JSON is read as such."""
    collector = _AnsweringCollector(answer, content_type)
    try:
        otr.configure(exporters=[OTLPSpanExporter(endpoint=collector.endpoint, timeout=5)],
                      sampler=otr.TailSampler(100, "first"), handle_signals=False)
        _episodes(0, 12)
        otr.end_step(0)
        assert otr.shutdown(timeout=30)
    finally:
        collector.close()
    assert collector.requests >= 1
    totals = otr.stats()["totals"]
    assert totals.get("delivered.OTLPSpanExporter", 0) == 0, totals
    assert totals.get(f"{_LOST}.{reason}.OTLPSpanExporter", 0) == 12, totals
    books = _assert_balanced("OTLPSpanExporter")
    assert books["kept"] == books["dropped"] == 12


# --- exit ----------------------------------------------------------------------------------------


def test_an_episode_inside_a_hung_export_at_shutdown_is_counted_lost_once(configured):
    """The exporter hangs in ``export`` past the exit deadline: its episodes are lost under
    ``undelivered_at_exit`` (they were counted neither delivered nor dropped); when the call
    returns after all, nothing is counted a second time."""
    hung = Hostile(["hang"])
    configured(100, "first", also=[hung], handle_signals=False)
    _episodes(0, 4)
    otr.end_step(0)
    assert hung.hanging.wait(30)
    # flush waits for the healthy exporter (first) to be idle, then gives up on the hung one
    assert otr.flush(timeout=2) is False
    pending = otr.stats()["delivery"]
    assert pending["Hostile"]["pending"] == 4 and pending["Hostile"]["pending_steps"] == {"0/train": 4}
    assert pending["InMemorySpanExporter"]["pending"] == 0
    assert otr.shutdown(timeout=1.0) is False  # it could not deliver everything in time
    totals = otr.stats()["totals"]
    assert totals["lost.undelivered_at_exit.Hostile"] == 4, totals
    books = _assert_balanced("Hostile")
    assert books["delivered"] == 0
    _assert_balanced("InMemorySpanExporter")
    hung.release.set()  # the call returns now, and stores its episodes: too late to count
    for thread in threading.enumerate():
        if thread.name == "otel-rollouts-send-Hostile":
            thread.join(30)
            assert not thread.is_alive()
    assert 1 <= len(hung.roots()) <= 4  # (those that waited together went in one call)
    assert otr.stats()["totals"].get("delivered.Hostile", 0) == 0


def test_shutdown_against_a_fast_failing_exporter_backs_off(otr_shutdown):
    """At shutdown an exporter that fails at once is retried a few times with backoff, not in
    a busy loop (70k attempts and 6.4 s of CPU before)."""
    failing = Hostile(["failure"] * 10_000_000)
    otr.configure(exporters=[failing], sampler=otr.TailSampler(100, "first"), handle_signals=False)
    _episodes(0, 3)
    otr.end_step(0)
    cpu = time.process_time()
    otr.shutdown(timeout=3.0)
    cpu = time.process_time() - cpu
    assert failing.calls < 40, failing.calls
    assert cpu < 2.0, cpu
    assert otr.stats()["totals"]["lost.undelivered_at_exit.Hostile"] == 3
    _assert_balanced("Hostile")


def test_reconfigure_is_bounded_by_the_previous_runs_exit_timeout(otr_shutdown):
    failing = Hostile(["failure"] * 10_000_000)
    otr.configure(exporters=[failing], sampler=otr.TailSampler(100, "first"), handle_signals=False,
                  exit_timeout=1.0)
    _episodes(0, 3)
    otr.end_step(0)
    start = time.monotonic()
    otr.configure(exporters=[InMemorySpanExporter()], handle_signals=False)
    assert time.monotonic() - start < 4.0
    assert failing.calls < 20


# --- one meaning per count ----------------------------------------------------------------------


def test_with_a_full_render_queue_every_count_has_one_meaning_and_the_totals_add_up(configured):
    """The sampler's books and delivery's are apart: per step ``seen = kept + dropped.<reason>``
    (the sampler's reasons only), and per exporter ``kept = ledger.entered = delivered +
    lost.<reason> (+ pending)``. The render thread is held (a deferred prompt that blocks, as a
    slow decode would) behind a queue of 8, so most kept episodes are lost for ``queue_full``.
    On the previous main those were also counted ``dropped.queue_full.<exporter>`` in their step
    (and ``dropped.queue_full``, ``dropped.queue_full.episodes`` in the totals) beside the sampler's
    ``dropped.sampled_out``: kept + dropped came to more than the episodes seen (the red team's
    3,200 kept + 97,263 dropped of 100,000)."""
    from otel_rollouts._core.content import Deferred

    slow = Hostile()
    memory = configured(4, "first", also=[slow], handle_signals=False, max_queue=8)
    gate, rendering = threading.Event(), threading.Event()

    def blocked() -> list:
        rendering.set()
        gate.wait(60)
        return [{"role": "user", "content": "hello"}]

    try:
        for step in range(10):
            for i in range(50):
                with otr.episode(step=step, sample_index=i) as ep:
                    ep.prompt(Deferred(blocked) if step == i == 0 else f"question {step}/{i}")
                    ep.reward(float(i))
                if step == i == 0:  # kept ("first") and taken by the render thread, which waits
                    assert rendering.wait(30)
            otr.end_step(step)
    finally:
        gate.set()
    assert otr.shutdown(timeout=30)
    stats = otr.stats()
    names = ("InMemorySpanExporter", "Hostile")
    for label, counts in stats["steps"].items():
        sampler_dropped = sum(v for k, v in counts.items() if k.startswith("dropped."))
        assert counts["started"] == counts["seen"] == counts["kept"] + sampler_dropped == 50, (label, counts)
        assert counts["kept"] == 4 and counts["dropped.sampled_out"] == 46, (label, counts)
        for name in names:
            lost = sum(v for k, v in counts.items() if k.startswith("lost.") and k.endswith("." + name))
            assert counts["kept"] == counts[f"ledger.entered.{name}"] == (
                counts.get(f"delivered.{name}", 0) + lost), (label, name, counts)
    totals = stats["totals"]
    assert totals["started"] == totals["seen"] == 500
    assert totals["seen"] == totals["kept"] + sum(v for k, v in totals.items() if k.startswith("dropped."))
    for name in names:
        books = _assert_balanced(name)
        # one in rendering, 8 queued: the other 31 kept were lost to the full queue, counted once
        assert books["kept"] == 40 and books["delivered"] == 9, books
        assert totals[f"lost.queue_full.{name}"] == books["dropped"] == 31, totals
        assert stats["delivery"][name]["dropped"] == 31 and stats["delivery"][name]["pending"] == 0
    assert len(traces(memory)) == 9 and len(slow.roots()) == 9


# --- memory --------------------------------------------------------------------------------------


def test_kept_episodes_waiting_for_a_slow_exporter_are_bounded_in_bytes(otr_shutdown):
    """~1 MB episodes (30 tool results of 16,000 characters beyond Latin-1: 2 bytes a character
    in memory) behind an exporter that holds its first call. Under tracemalloc the render thread
    is slow too, so both bounds work: the kept records waiting to be rendered
    (``max_queue_bytes``) and the rendered batches waiting for the exporter
    (``max_pending_bytes``), 8 MiB each here; the rest goes to the spool or is dropped, counted.
    Measured with tracemalloc (it held all 40 MB before)."""
    slow = Hostile(["hang"])
    otr.configure(exporters=[slow], sampler=otr.TailSampler(100, "first"), handle_signals=False,
                  max_pending_bytes=8 * 1024 * 1024, max_queue_bytes=8 * 1024 * 1024)
    gc.collect()
    tracemalloc.start()
    try:
        base = tracemalloc.get_traced_memory()[0]
        for step in range(40):
            with otr.episode(step=step) as ep:
                with ep.turn() as turn:
                    for i in range(30):  # a new text each: nothing shared between episodes
                        turn.tool_call("fetch", arguments={"i": i}).result(f"{step}/{i} " + "€" * 16_000)
                ep.reward(1.0)
            otr.end_step(step)
            if step == 0:
                assert slow.hanging.wait(30)
        held = tracemalloc.get_traced_memory()[0] - base
    finally:
        tracemalloc.stop()
        slow.release.set()
    assert otr.shutdown(timeout=120)
    assert held < 24 * 1024 * 1024, f"{held / 2**20:.1f} MiB held for 40 x 1 MB episodes (2 x 8 MiB bounds)"
    books = _assert_balanced("Hostile")
    assert books["delivered"] >= 1 and books["delivered"] + books["dropped"] == 40


def _hold_the_render_thread() -> threading.Event:
    """A kept episode whose deferred prompt blocks the render thread until the returned event is
    set: what is kept meanwhile waits in the render queue."""
    from otel_rollouts._core.content import Deferred

    gate, rendering = threading.Event(), threading.Event()

    def blocked() -> list:
        rendering.set()
        gate.wait(60)
        return [{"role": "user", "content": "hello"}]

    with otr.episode(step=0) as first:
        first.prompt(Deferred(blocked))
        first.reward(1.0)
    assert rendering.wait(30)
    return gate


def _held_by(record: Callable[[], None], gate: threading.Event) -> int:
    """Bytes still allocated (tracemalloc) after ``record`` ran with the render thread held; the
    render thread let go after, and the step ended."""
    gc.collect()
    tracemalloc.start()
    try:
        base = tracemalloc.get_traced_memory()[0]
        record()
        held = tracemalloc.get_traced_memory()[0] - base
    finally:
        tracemalloc.stop()
        gate.set()
    otr.end_step(0)
    return held


def test_kept_episodes_waiting_for_a_blocked_render_thread_are_bounded_in_bytes(configured):
    """The render thread held (a deferred prompt that blocks): 40 kept episodes of ~1 MB each
    (distinct texts beyond Latin-1) are offered to the render queue; what it holds stays near
    ``max_queue_bytes`` (8 MiB here), measured with tracemalloc, the rest is dropped under
    ``queue_full``, counted, and the books balance (it held all 40, 1,024 items being the only
    bound)."""
    configured(100, "first", handle_signals=False, max_queue_bytes=8 * 1024 * 1024)
    gate = _hold_the_render_thread()

    def keep_40() -> None:
        for i in range(40):
            with otr.episode(step=0, sample_index=i) as ep:
                ep.prompt(f"{i} " + "€" * 500_000)  # ~1 MB in memory, a new text each time
                ep.reward(float(i))

    held = _held_by(keep_40, gate)
    assert otr.shutdown(timeout=60)
    assert held < 16 * 1024 * 1024, f"{held / 2**20:.1f} MiB held for 40 x 1 MB episodes"
    dropped = otr.stats()["totals"]["lost.queue_full.InMemorySpanExporter"]
    assert 25 <= dropped < 40
    books = _assert_balanced("InMemorySpanExporter")
    assert books["delivered"] == 41 - dropped


def test_a_conversation_held_by_many_generations_is_counted_once_against_the_queue_bound(configured):
    """A kept episode's generations share the conversation's copies (and its texts): the render
    queue's byte bound counts what is held, once. 24 kept episodes, each a ~0.5 MB text in a
    conversation taken by 8 traced generations, wait for a blocked render thread under an 8 MiB
    bound: about 16 fit (counted once per generation, about one would), what is held stays
    near the bound (tracemalloc), and the books balance."""
    configured(100, "first", handle_signals=False, max_queue_bytes=8 * 1024 * 1024)
    gate = _hold_the_render_thread()

    @otr.traced(kind="generation", model="policy")
    def generate(messages: list) -> str:
        return f"answer {len(messages)}"

    def keep_24() -> None:
        for i in range(24):
            with otr.episode(step=0, sample_index=i) as ep:
                messages = [{"role": "user", "content": f"{i} " + "€" * 250_000}]  # ~0.5 MB, new each time
                ep.prompt(messages)
                for _ in range(8):
                    messages.append({"role": "assistant", "content": generate(messages)})
                ep.reward(float(i))

    held = _held_by(keep_24, gate)
    assert otr.shutdown(timeout=60)
    assert held < 16 * 1024 * 1024, f"{held / 2**20:.1f} MiB held for 24 x 0.5 MB episodes"
    dropped = otr.stats()["totals"].get("lost.queue_full.InMemorySpanExporter", 0)
    assert 24 - dropped >= 10, f"only {24 - dropped} of 24 queued: a shared conversation counted per span"
    books = _assert_balanced("InMemorySpanExporter")
    assert books["delivered"] == 25 - dropped


# --- the property: random faults at every exporter boundary --------------------------------------

HTTP_FAULTS = ["ok", "ok", 413, 400, 503, "reject_all", "reject_half", "hang"]
PY_FAULTS = ["ok", "ok", "failure", "raise", "exit", "interrupt", "hang"]


@pytest.fixture(scope="module")
def shared_sink(tmp_path_factory) -> Iterator[OtlpSink]:
    with OtlpSink(tmp_path_factory.mktemp("ledger-sink")) as s:
        yield s


class _Annotations(http.server.BaseHTTPRequestHandler):
    """A Phoenix annotation endpoint that misbehaves as the example says (``mode`` on the
    server): ``ok``, ``error`` (500), ``redirect`` (307 to another origin, which records what
    it is sent), ``drip`` (its answer one byte every 0.3 s), ``silent`` (never answers)."""

    protocol_version = "HTTP/1.1"

    def log_message(self, format: str, *args: object) -> None:  # noqa: A002 - the stdlib's name
        pass

    def do_GET(self) -> None:  # noqa: N802 - the stdlib's name
        self._answer(b"20.26.1")

    def do_POST(self) -> None:  # noqa: N802
        self.rfile.read(int(self.headers.get("Content-Length") or 0))
        self._answer(b'{"data": []}')

    def _answer(self, body: bytes) -> None:
        server = self.server
        mode = getattr(server, "mode", "ok")
        server.requests.append((self.command, self.path, dict(self.headers)))  # type: ignore[attr-defined]
        if mode == "silent":
            server.release.wait(10)  # type: ignore[attr-defined]
            return
        if mode == "redirect":
            self.send_response(307)
            self.send_header("Location", f"{server.elsewhere}{self.path}")  # type: ignore[attr-defined]
            self.send_header("Content-Length", "0")
            self.end_headers()
            return
        status = 500 if mode == "error" else 200
        self.send_response(status)
        self.send_header("Content-Type", "text/plain")
        self.send_header("Content-Length", str(len(body)))
        self.end_headers()
        if mode == "drip":
            for byte in body:
                if server.release.wait(0.3):  # type: ignore[attr-defined]
                    return
                self.wfile.write(bytes([byte]))
                self.wfile.flush()
        else:
            self.wfile.write(body)


@pytest.fixture(scope="module")
def annotations() -> Iterator[http.server.ThreadingHTTPServer]:
    """A hostile annotation endpoint and, for its redirects, another origin that records what
    reaches it."""
    servers = [http.server.ThreadingHTTPServer(("127.0.0.1", 0), _Annotations) for _ in range(2)]
    for server in servers:
        server.daemon_threads = True
        server.requests = []  # type: ignore[attr-defined]
        server.release = threading.Event()  # type: ignore[attr-defined]
        threading.Thread(target=server.serve_forever, daemon=True).start()
    servers[0].elsewhere = f"http://localhost:{servers[1].server_address[1]}"  # type: ignore[attr-defined]
    try:
        yield servers[0]
    finally:
        for server in servers:
            server.release.set()  # type: ignore[attr-defined]
            server.shutdown()
            server.server_close()


def _server_spans(gateway: otr.SpanGateway, roots: list[tuple[int, int]]) -> None:
    """What an inference server would send the gateway: one span under each episode's root."""
    from opentelemetry.trace import SpanContext, TraceFlags

    spans = [ReadableSpan(name="server", context=SpanContext(tid, 0x5000 + i, False, TraceFlags(1)),
                          parent=SpanContext(tid, root, True, TraceFlags(1)), start_time=1, end_time=2)
             for i, (tid, root) in enumerate(roots)]
    exporter = OTLPSpanExporter(endpoint=f"{gateway.http_endpoint}/v1/traces", timeout=2)
    exporter.export(spans)  # a gateway killed meanwhile refuses: that is the fault
    exporter.shutdown()


@settings(max_examples=examples(36), deadline=None,
          suppress_health_check=[HealthCheck.function_scoped_fixture, HealthCheck.too_slow])
@given(
    http=st.lists(st.sampled_from(HTTP_FAULTS), max_size=8),
    python=st.lists(st.sampled_from(PY_FAULTS), max_size=8),
    steps=st.lists(st.integers(1, 6), min_size=1, max_size=3),
    cap=st.integers(1, 4),
    gateway=st.sampled_from(["off", "on", "killed"]),
    poster=st.sampled_from(["ok", "error", "redirect", "drip", "silent"]),
)
def test_the_ledger_balances_under_any_fault_schedule(shared_sink, annotations, http, python, steps, cap,
                                                       gateway, poster):
    """Whatever the collector answers (413, 400, 503, partial success, a hang past the client's
    timeout), whatever the in-process exporter does (FAILURE, raise, SystemExit,
    KeyboardInterrupt, hang past shutdown), whatever the span gateway does (server spans joining
    the episodes; its process killed mid-run) and the Phoenix annotation endpoint answers (500,
    a redirect to another origin, one byte at a time, nothing): per exporter and per step,
    kept = delivered + dropped; every episode counted delivered is stored; none is received
    twice except through a counted retry; no server span of a dropped episode downstream."""
    shared_sink.control(script=list(http), hang_s=1.5)
    annotations.mode = poster  # type: ignore[attr-defined]
    hostile = Hostile(python)
    witness = InMemorySpanExporter()  # what the sampler kept, whatever the faults
    traces: set[str] = set()
    before = _sink_roots(shared_sink)
    spans_before = len(shared_sink.spans())  # (ids repeat across examples: hypothesis seeds random)
    os.environ[c.ENV_PHOENIX_ANNOTATIONS] = f"http://127.0.0.1:{annotations.server_address[1]}"
    try:
        otr.configure(
            exporters=[OTLPSpanExporter(endpoint=shared_sink.endpoint, timeout=1), hostile, witness],
            sampler=otr.TailSampler(cap, "top_bottom"), handle_signals=False, exit_timeout=2.0,
            gateway=None if gateway == "off" else otr.GatewayOptions(http_port=0, grpc_port=None, hold_s=1.0),
        )
        running = otr.gateway()
        for step, n in enumerate(steps):
            roots: list[tuple[int, int]] = []
            for i in range(n):
                with otr.episode(step=step, group_id=f"g{i % 2}", sample_index=i) as ep:
                    roots.append((int(ep.trace_id, 16), ep.root.span_id))
                    traces.add(ep.trace_id)
                    ep.prompt([{"role": "user", "content": f"question {step}/{i}"}])
                    with ep.turn() as turn:
                        turn.record_generation("hello", model="m")
                    ep.reward(float(i))
            if running is not None:
                _server_spans(running, roots)
                if gateway == "killed" and step == 0 and running.pid:
                    os.kill(running.pid, 9)
            otr.end_step(step)
        otr.shutdown(timeout=2.0)
    finally:
        os.environ.pop(c.ENV_PHOENIX_ANNOTATIONS, None)
        hostile.release.set()
        otr.shutdown(timeout=1.0)
    stats = otr.stats()
    for name in ("OTLPSpanExporter", "Hostile"):
        books = _assert_balanced(name)
        assert books["kept"] == sum(min(cap, n) for n in steps)
    received = _sink_roots(shared_sink) - before
    totals = stats["totals"]
    delivered_otlp = totals.get("delivered.OTLPSpanExporter", 0)
    assert len(received) >= delivered_otlp  # what was counted delivered is there...
    duplicates = sum(n - 1 for n in received.values())
    # ...and a second copy only through a retry that was counted as a failed request
    assert duplicates <= totals.get("export.failed_episodes.OTLPSpanExporter", 0)
    assert len(hostile.roots()) >= totals.get("delivered.Hostile", 0)
    # a server span of a dropped episode never reaches the collector
    kept = {f"{s.context.trace_id:032x}" for s in witness.get_finished_spans() if s.name == "episode"}
    assert len(kept) == sum(min(cap, n) for n in steps)
    received_spans = shared_sink.spans()[spans_before:]
    assert not [s for s in received_spans if s["name"] == "server" and s["trace_id"] in traces - kept]
    # no annotation request ever followed a redirect with the exporter's credentials
    assert not [r for r in annotations.requests if r[1].startswith("http")]  # type: ignore[attr-defined]
    shared_sink.control(script=[])


@pytest.mark.slow
def test_the_ledger_balances_with_trackio_under_a_locked_database_and_a_full_disk(tmp_path):
    """The same property against Trackio's real SQLite storage, with another process holding the
    database's lock and the filesystem full (a 16 MB tmpfs, filled), for a step or past shutdown.
    Run in a child process: Trackio reads TRACKIO_DIR at import."""
    import subprocess
    import sys
    from pathlib import Path

    here = Path(__file__).resolve().parents[1]
    small = tmp_path / "trackio"
    if not mount_tmpfs(small, "size=16m"):
        if os.environ.get("CI"):
            pytest.fail("CI runs as root: mounting a small tmpfs must work")
        pytest.skip("needs root to mount a small tmpfs")
    try:
        env = with_test_paths({**os.environ, "TRACKIO_DIR": str(small)})
        done = subprocess.run(
            [sys.executable, str(here / "ledger_trackio_property.py"), str(examples(18))],
            capture_output=True, text=True, env=env, timeout=600, cwd=tmp_path)
    finally:
        umount(small)
    assert done.returncode == 0, done.stdout[-3000:] + done.stderr[-6000:]
    assert "examples: " in done.stdout
    assert int(done.stdout.rsplit("examples: ", 1)[1].split()[0]) >= 6
