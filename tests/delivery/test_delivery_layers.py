"""Each delivery layer alone, in front of real exporters (the in-memory one, the OTLP/JSON file
exporter, the stock OTLP/HTTP exporter against a real receiver process) and of an exporter that
fails on purpose."""

from __future__ import annotations

import gc
import threading
import time
import weakref
from collections.abc import Sequence

from opentelemetry.sdk.resources import Resource
from opentelemetry.sdk.trace import ReadableSpan
from opentelemetry.sdk.trace.export import SpanExporter, SpanExportResult
from opentelemetry.sdk.trace.export.in_memory_span_exporter import InMemorySpanExporter
from opentelemetry.trace import SpanContext, TraceFlags

import otel_rollouts as otr
from otel_rollouts import conventions as c
from otel_rollouts._core.codec import count_episodes, decode, encode
from otel_rollouts._core.stats import Stats
from otel_rollouts.delivery.layers import request_limit
from otel_rollouts.delivery.replay import spans_from_file
from otel_rollouts.exporters import OtlpJsonFileExporter

_SAMPLED = TraceFlags(TraceFlags.SAMPLED)


def _episode(trace_id: int, spans: int = 3, text_bytes: int = 100) -> list[ReadableSpan]:
    """One episode's spans: a root and ``spans - 1`` children, each with ``text_bytes`` of text."""
    root = SpanContext(trace_id, trace_id * 64, is_remote=False, trace_flags=_SAMPLED)
    out = [ReadableSpan(
        name=c.SPAN_EPISODE, context=root, resource=Resource({}),
        attributes={c.RL_SPAN_KIND: c.KIND_EPISODE, c.INPUT_VALUE: "x" * text_bytes},
        start_time=1, end_time=2,
    )]
    for i in range(1, spans):
        context = SpanContext(trace_id, trace_id * 64 + i, is_remote=False, trace_flags=_SAMPLED)
        out.append(ReadableSpan(
            name=c.SPAN_TURN, context=context, parent=root, resource=Resource({}),
            attributes={c.RL_SPAN_KIND: c.KIND_TURN, c.INPUT_VALUE: "y" * text_bytes},
            start_time=1, end_time=2,
        ))
    return out


def _batch(episodes: int, start: int = 1, **kwargs: int) -> list[ReadableSpan]:
    return [s for i in range(start, start + episodes) for s in _episode(0xABC000 + i, **kwargs)]


class Failing(SpanExporter):
    """Fails its first ``failures`` calls (FAILURE, or raising ``exc``), then stores."""

    def __init__(self, failures: int, exc: BaseException | None = None) -> None:
        self.failures = failures
        self.exc = exc
        self.calls = 0
        self.stored: list[ReadableSpan] = []
        self.lock = threading.Lock()

    def export(self, spans: Sequence[ReadableSpan]) -> SpanExportResult:
        with self.lock:
            self.calls += 1
            if self.calls <= self.failures:
                if self.exc is not None:
                    raise self.exc
                return SpanExportResult.FAILURE
            self.stored.extend(spans)
            return SpanExportResult.SUCCESS

    def shutdown(self) -> None:
        return None


class Blocking(SpanExporter):
    """Never returns until released: a hung receiver."""

    def __init__(self) -> None:
        self.release = threading.Event()
        self.entered = threading.Event()

    def export(self, spans: Sequence[ReadableSpan]) -> SpanExportResult:
        self.entered.set()
        self.release.wait(30)
        return SpanExportResult.SUCCESS

    def shutdown(self) -> None:
        self.release.set()


def test_the_codec_round_trips_spans_and_counts_episodes():
    batch = _batch(4)
    back = decode(encode(batch))
    assert [(s.context.trace_id, s.context.span_id, s.name) for s in back] == [
        (s.context.trace_id, s.context.span_id, s.name) for s in batch
    ]
    assert back[1].parent.span_id == batch[1].parent.span_id
    assert back[0].attributes == batch[0].attributes
    assert count_episodes(back) == count_episodes(batch) == 4


def test_counting_layer_counts_exactly_what_the_exporter_stored():
    inner = Failing(failures=1)
    counting = otr.CountingExporter(inner)
    assert counting.export(_batch(3)) is SpanExportResult.FAILURE
    assert counting.export(_batch(5, start=10)) is SpanExportResult.SUCCESS
    assert counting.counts.total("delivered") == 5
    assert counting.counts.total("export.failures") == 1
    assert counting.counts.total("export.failed_episodes") == 3  # what a retry may duplicate
    assert count_episodes(inner.stored) == 5


def test_counting_layer_turns_an_exporter_raising_system_exit_into_a_failure():
    counting = otr.CountingExporter(Failing(failures=1, exc=SystemExit(3)))
    assert counting.export(_batch(2)) is SpanExportResult.FAILURE
    assert counting.counts.stats.total(f"errors.export.{counting.counts.name}") == 1
    assert counting.export(_batch(2)) is SpanExportResult.SUCCESS


class NotStoring(InMemorySpanExporter):
    """Takes every batch and says one episode of each was not stored (as Trackio can)."""

    def take_not_stored(self) -> dict[str, int]:
        return {"trackio_skipped": 1}


def test_counting_layer_honours_take_not_stored():
    counting = otr.CountingExporter(NotStoring())
    counting.export(_batch(3))
    assert counting.counts.total("delivered") == 2
    assert counting.counts.stats.total("lost.trackio_skipped.NotStoring") == 1
    assert counting.counts.dropped_episodes() == 1


class Recording(SpanExporter):
    """Passes each request on to ``inner`` and notes its encoded size."""

    def __init__(self, inner: SpanExporter) -> None:
        self.inner = inner
        self.sizes: list[int] = []

    def export(self, spans: Sequence[ReadableSpan]) -> SpanExportResult:
        self.sizes.append(len(encode(spans)))
        return self.inner.export(spans)

    def shutdown(self) -> None:
        self.inner.shutdown()


def test_splitting_layer_keeps_every_span_exactly_once_under_the_limit(tmp_path):
    path = tmp_path / "out.jsonl"
    recording = Recording(OtlpJsonFileExporter(str(path)))
    limit = 6_000
    splitting = otr.SplittingExporter(recording, limit, otr.DeliveryCounts(Stats(), "file"))
    batch = _batch(12, text_bytes=400)
    assert len(encode(batch)) > 2 * limit
    assert splitting.export(batch) is SpanExportResult.SUCCESS
    recording.shutdown()
    assert len(recording.sizes) > 2 and max(recording.sizes) <= limit
    assert splitting.counts.total("export.split_requests") == len(recording.sizes) - 1
    written = [s.context.span_id for part in spans_from_file(path) for s in part]
    assert sorted(written) == sorted(s.context.span_id for s in batch)  # each span once


def test_splitting_layer_drops_a_span_larger_than_the_limit_counted():
    memory = InMemorySpanExporter()
    counts = otr.DeliveryCounts(Stats(), "memory")
    splitting = otr.SplittingExporter(memory, 2_000, counts)
    batch = _batch(1, text_bytes=5_000) + _batch(2, start=5, text_bytes=10)
    splitting.export(batch)
    assert counts.stats.total("lost.oversize.memory") == 1
    assert count_episodes(memory.get_finished_spans()) == 2


def test_splitting_layer_reports_only_the_failed_parts():
    inner = Failing(failures=1)
    splitting = otr.SplittingExporter(inner, 3_000)
    batch = _batch(6, text_bytes=300)
    failed = splitting.export_parts(batch)
    assert failed and sum(len(p) for p in failed) < len(batch)
    stored = {s.context.span_id for s in inner.stored}
    assert stored.isdisjoint(s.context.span_id for part in failed for s in part)
    assert len(stored) + sum(len(p) for p in failed) == len(batch)


def test_request_limit_applies_to_stock_otlp_exporters_only():
    from opentelemetry.exporter.otlp.proto.http.trace_exporter import OTLPSpanExporter

    assert request_limit(InMemorySpanExporter(), 1_000) is None
    assert request_limit(OTLPSpanExporter(endpoint="http://127.0.0.1:9/v1/traces"), 1_000) == 1_000
    assert request_limit(OTLPSpanExporter(endpoint="http://127.0.0.1:9/v1/traces"), None) is None


def test_sender_never_blocks_the_caller_and_is_bounded_in_memory(tmp_path):
    blocking = Blocking()
    sender = otr.SpoolingSender(blocking, max_pending=4, max_pending_bytes=200_000,
                                spool_dir=tmp_path / "spool")
    try:
        sender.export(_batch(1))
        assert blocking.entered.wait(10)
        for i in range(50):  # the exporter hangs: every call still returns at once
            assert sender.export(_batch(2, start=100 + 2 * i, text_bytes=2_000)) is SpanExportResult.SUCCESS
        assert sender.pending_bytes <= 200_000
        assert sender.counts.total("spooled") > 0  # the oldest went to disk, counted
        # nothing lost: what waits in memory or on disk is every episode not yet sent
        assert sender.pending_episodes() == 101  # 100 waiting + 1 in the hung export call
    finally:
        blocking.release.set()
        sender.shutdown()


def test_sender_with_a_spool_survives_a_failing_exporter_and_delivers_later(tmp_path):
    inner = otr.CountingExporter(Failing(failures=4))
    sender = otr.SpoolingSender(inner, inner.counts, spool_dir=tmp_path / "spool")
    try:
        for i in range(5):
            sender.export(_batch(2, start=10 * i + 1))
        # the first attempts fail; the batches wait on disk and go out once the exporter is back
        assert sender.wait_idle(time.monotonic() + 60, through_outage=True)
        stored = inner.exporter.stored
        assert count_episodes(stored) == 10
        assert len({s.context.span_id for s in stored}) == len(stored)  # none twice
        assert inner.counts.total("delivered") == 10
        assert inner.counts.total("spooled") > 0
    finally:
        sender.shutdown()


class FailsOnceWhenReleased(Failing):
    """Its first call waits until released, then fails; later calls store."""

    def __init__(self) -> None:
        super().__init__(failures=1)
        self.entered = threading.Event()
        self.release = threading.Event()

    def export(self, spans: Sequence[ReadableSpan]) -> SpanExportResult:
        if self.calls == 0:
            self.entered.set()
            self.release.wait(30)
        return super().export(spans)


def test_a_batch_spilled_to_disk_while_the_caller_makes_room_is_spooled_once(tmp_path, monkeypatch):
    """After a failure the sender moves the memory buffer to disk while the render thread keeps
    offering: both once wrote the same batch (the render thread making room took it while the
    sender was writing it), which was then delivered twice with no failure to account for it."""
    from otel_rollouts.delivery import spool as spool_module

    pushing, go = threading.Event(), threading.Event()
    pushes = {"sender": 0}
    original = spool_module.Spool.push

    def push(self, data, episodes, *rest):
        if threading.current_thread().name.startswith("otel-rollouts-send"):
            pushes["sender"] += 1
            if pushes["sender"] == 2:  # the failed batch went first; now the buffer's head
                pushing.set()
                go.wait(30)
        return original(self, data, episodes, *rest)

    monkeypatch.setattr(spool_module.Spool, "push", push)
    inner = otr.CountingExporter(FailsOnceWhenReleased())
    sender = otr.SpoolingSender(inner, inner.counts, max_pending=2, spool_dir=tmp_path / "spool")
    try:
        sender.export(_batch(1, start=1))  # A: the sender takes it; the exporter holds it
        assert inner.exporter.entered.wait(10)
        sender.export(_batch(1, start=2))  # B and C wait in memory, which is now full
        sender.export(_batch(1, start=3))
        inner.exporter.release.set()  # A fails: to disk, then the buffer after it
        assert pushing.wait(10)  # the sender is writing the buffer's head to disk
        sender.export(_batch(1, start=4))  # D: the buffer is full, room is made
        go.set()
        assert sender.wait_idle(time.monotonic() + 60, through_outage=True)
        roots = [s.context.trace_id for s in inner.exporter.stored if s.parent is None]
        assert sorted(roots) == [0xABC000 + i for i in range(1, 5)]  # each once, in order
        assert inner.counts.total("delivered") == 4
    finally:
        go.set()
        sender.shutdown()


def test_sender_without_a_spool_counts_what_a_failing_exporter_loses():
    inner = otr.CountingExporter(Failing(failures=10**6))
    sender = otr.SpoolingSender(inner)  # counts where the layer below counts
    assert sender.counts is inner.counts
    try:
        sender.export(_batch(3))
        assert sender.wait_idle(time.monotonic() + 30, through_outage=True)
        assert inner.counts.stats.total("lost.spool_unavailable.Failing") == 3
        assert sender.counts.dropped_episodes() == 3 and sender.pending_episodes() == 0
    finally:
        sender.shutdown()


def test_the_whole_stack_in_front_of_the_stock_otlp_exporter_reaches_a_real_receiver(tmp_path):
    from opentelemetry.exporter.otlp.proto.http.trace_exporter import OTLPSpanExporter
    from otlp_sink import OtlpSink

    with OtlpSink(tmp_path / "sink") as sink:
        otlp = OTLPSpanExporter(endpoint=sink.endpoint, timeout=5)
        counts = otr.DeliveryCounts(Stats(), "otlp")
        stack = otr.SpoolingSender(
            otr.SplittingExporter(otr.CountingExporter(otlp, counts), request_limit(otlp, 8_000), counts),
            counts,
            spool_dir=tmp_path / "spool",
        )
        batch = _batch(10, text_bytes=600)
        stack.export(batch)
        assert stack.force_flush(30_000)
        stack.shutdown()
        received = sink.spans()
    assert sorted(s["span_id"] for s in received) == sorted(f"{s.context.span_id:016x}" for s in batch)
    assert counts.total("delivered") == 10 and counts.total("export.split_requests") >= 1


class Weakly(SpanExporter):
    """Stores a weak reference to each span it is given: what it received stays countable
    without the exporter itself keeping it alive."""

    def __init__(self) -> None:
        self.received: list[weakref.ref[ReadableSpan]] = []

    def export(self, spans: Sequence[ReadableSpan]) -> SpanExportResult:
        self.received.extend(weakref.ref(s) for s in spans)
        return SpanExportResult.SUCCESS


def test_a_flush_that_returned_leaves_no_delivered_span_held(configured):
    """Once delivered, an episode's spans are let go: a sender that kept its last batch until
    the next one held up to a request's bytes outside every bound (2026-11: the memory test saw
    its 64 spans come and go with the sender thread's timing)."""
    weak = Weakly()
    memory = configured(8, "top_bottom", also=[weak], sampler_options={"step_lag": None})
    for i in range(8):
        with otr.episode(step=0) as ep:
            ep.prompt(f"p{i}")
            ep.reward(float(i))
    otr.end_step(0)
    assert otr.flush()
    memory.clear()
    gc.collect()
    assert len(weak.received) >= 16  # 8 episodes, a root and a prompt span each
    assert [ref() for ref in weak.received if ref() is not None] == []
