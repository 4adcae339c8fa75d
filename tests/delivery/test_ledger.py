"""The delivery ledger: every kept episode ends delivered (confirmed stored) or dropped under a
named reason, once, per exporter and per step, whatever the exporters and collectors do.

Real parts: the OpenTelemetry SDK's own OTLP exporters (HTTP and gRPC) talking to real
receivers on loopback (``otlp_sink.py``, a subprocess that can be told how to answer; a gRPC
server implementing the OTLP trace service), and hostile in-process exporters for what only
Python can do (raise ``SystemExit``, hang in ``export``).
"""

from __future__ import annotations

import gc
import os
import threading
import time
import tracemalloc
from collections import Counter
from collections.abc import Iterator, Sequence
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
from profiles import examples
from suite_paths import with_test_paths

import otel_rollouts as otr
from otel_rollouts import conventions as c

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
        dropped = sum(v for k, v in counts.items() if k.startswith("dropped.") and k.endswith(suffix))
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
    assert books["dropped"] == totals.get("dropped.refused.OTLPSpanExporter", 0)
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
    assert otr.stats()["totals"]["dropped.rejected.OTLPSpanExporter"] == 1
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
    assert otr.stats()["totals"][f"dropped.{reason}.OTLPSpanExporter"] == 3
    assert books["1/train"]["delivered"] == 2  # the next request went through: stored, counted
    _assert_balanced("OTLPSpanExporter")


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
    assert totals["dropped.undelivered_at_exit.Hostile"] == 4, totals
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
    assert otr.stats()["totals"]["dropped.undelivered_at_exit.Hostile"] == 3
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


def test_kept_episodes_waiting_for_a_blocked_render_thread_are_bounded_in_bytes(configured):
    """The render thread held (a deferred prompt that blocks): 40 kept episodes of ~1 MB each
    (distinct texts beyond Latin-1) are offered to the render queue; what it holds stays near
    ``max_queue_bytes`` (8 MiB here), measured with tracemalloc, the rest is dropped under
    ``queue_full``, counted, and the books balance (it held all 40, 1,024 items being the only
    bound)."""
    from otel_rollouts._core.content import Deferred

    configured(100, "first", handle_signals=False, max_queue_bytes=8 * 1024 * 1024)
    gate, rendering = threading.Event(), threading.Event()

    def blocked() -> list:
        rendering.set()
        gate.wait(60)
        return [{"role": "user", "content": "hello"}]

    with otr.episode(step=0) as first:
        first.prompt(Deferred(blocked))
        first.reward(1.0)
    assert rendering.wait(30)
    gc.collect()
    tracemalloc.start()
    try:
        base = tracemalloc.get_traced_memory()[0]
        for i in range(40):
            with otr.episode(step=0, sample_index=i) as ep:
                ep.prompt(f"{i} " + "€" * 500_000)  # ~1 MB in memory, a new text each time
                ep.reward(float(i))
        held = tracemalloc.get_traced_memory()[0] - base
    finally:
        tracemalloc.stop()
        gate.set()
    otr.end_step(0)
    assert otr.shutdown(timeout=60)
    assert held < 16 * 1024 * 1024, f"{held / 2**20:.1f} MiB held for 40 x 1 MB episodes"
    dropped = otr.stats()["totals"]["dropped.queue_full.InMemorySpanExporter"]
    assert 25 <= dropped < 40
    books = _assert_balanced("InMemorySpanExporter")
    assert books["delivered"] == 41 - dropped


# --- the property: random faults at every exporter boundary --------------------------------------

HTTP_FAULTS = ["ok", "ok", 413, 400, 503, "reject_all", "reject_half", "hang"]
PY_FAULTS = ["ok", "ok", "failure", "raise", "exit", "interrupt", "hang"]


@pytest.fixture(scope="module")
def shared_sink(tmp_path_factory) -> Iterator[OtlpSink]:
    with OtlpSink(tmp_path_factory.mktemp("ledger-sink")) as s:
        yield s


@settings(max_examples=examples(36), deadline=None,
          suppress_health_check=[HealthCheck.function_scoped_fixture, HealthCheck.too_slow])
@given(
    http=st.lists(st.sampled_from(HTTP_FAULTS), max_size=8),
    python=st.lists(st.sampled_from(PY_FAULTS), max_size=8),
    steps=st.lists(st.integers(1, 6), min_size=1, max_size=3),
    cap=st.integers(1, 4),
)
def test_the_ledger_balances_under_any_fault_schedule(shared_sink, http, python, steps, cap):
    """Whatever the collector answers (413, 400, 503, partial success, a hang past the client's
    timeout) and whatever the in-process exporter does (FAILURE, raise, SystemExit,
    KeyboardInterrupt, hang past shutdown): per exporter and per step, kept = delivered + dropped;
    every episode counted delivered is stored; none is received twice except through a counted
    retry."""
    shared_sink.control(script=list(http), hang_s=1.5)
    hostile = Hostile(python)
    before = _sink_roots(shared_sink)
    try:
        otr.configure(
            exporters=[OTLPSpanExporter(endpoint=shared_sink.endpoint, timeout=1), hostile],
            sampler=otr.TailSampler(cap, "top_bottom"), handle_signals=False, exit_timeout=2.0,
        )
        for step, n in enumerate(steps):
            _episodes(step, n)
            otr.end_step(step)
        otr.shutdown(timeout=2.0)
    finally:
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
