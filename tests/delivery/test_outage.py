"""Collector outages, slow receivers and full queues, injected for real.

Receivers are real processes on loopback: Arize Phoenix (``receivers.PhoenixReceiver``) for the
kill/restart test, and ``otlp_sink.OtlpSink`` (a stdlib OTLP/HTTP server in its own process,
starts in a fraction of a second, can be told to answer slowly or with 503) for the rest. The
exporter is always the stock ``OTLPSpanExporter``. An ``InMemorySpanExporter`` configured next
to it is the ground truth of what was kept.
"""

from __future__ import annotations

import logging
import stat
import threading
import time
import uuid

import pytest
from opentelemetry.exporter.otlp.proto.http.trace_exporter import OTLPSpanExporter
from opentelemetry.sdk.trace.export.in_memory_span_exporter import InMemorySpanExporter
from otlp_sink import OtlpSink
from otr_helpers import wait_for as _wait

import otel_rollouts as otr
from otel_rollouts import conventions as c
from otel_rollouts._core.content import Deferred


def _episodes(step: int, n: int, text: str = "hello") -> None:
    for i in range(n):
        with otr.episode(step=step, group_id=f"g{i % 4}", sample_index=i) as ep:
            ep.prompt([{"role": "user", "content": f"{text} {step}/{i}"}])
            with ep.turn() as turn:
                turn.record_generation(f"answer {i}", model="policy", output_tokens=3)
            ep.reward(float(i))
    otr.end_step(step)


def _kept_ids(memory: InMemorySpanExporter) -> list[str]:
    """Trace ids of kept episodes, in the order they were exported."""
    return [
        f"{s.context.trace_id:032x}"
        for s in memory.get_finished_spans()
        if (s.attributes or {}).get(c.RL_SPAN_KIND) == c.KIND_EPISODE
    ]


def _received(sink) -> set[str]:
    """Trace ids of the episode roots the receiver got (each at least once)."""
    return {r["trace_id"] for r in sink.roots()}


def _delivery(name: str = "OTLPSpanExporter") -> dict[str, int]:
    return otr.stats()["delivery"][name]


@pytest.fixture
def sink(tmp_path):
    s = OtlpSink(tmp_path / "sink")
    yield s
    s.kill()


def test_receiver_down_at_start_spools_then_delivers_every_kept_episode(sink, tmp_path, otr_shutdown):
    memory = InMemorySpanExporter()
    spool = tmp_path / "spool"
    otr.configure(
        exporters=[OTLPSpanExporter(endpoint=sink.endpoint, timeout=1), memory],
        sampler=otr.TailSampler(4, "top_bottom"),
        spool_dir=spool,
    )
    for step in range(3):
        _episodes(step, 10)
    assert otr.flush(timeout=10) is False  # the OTLP side could not deliver: flush says so
    kept = _kept_ids(memory)
    assert len(kept) == 12
    _wait(lambda: _delivery()["pending"] == 12, what="all kept episodes spooled")
    report = _delivery()
    assert report["delivered"] == 0 and report["spooled"] == 12 and report["dropped"] == 0
    files = list(spool.rglob("*.otlp"))
    assert files, "nothing on disk"
    for f in files:
        assert stat.S_IMODE(f.stat().st_mode) == 0o600
    assert stat.S_IMODE(files[0].parent.stat().st_mode) == 0o700

    sink.start()  # the collector comes up: the spool drains with no call from the user
    # delivery is at least once (a request that timed out after the receiver stored it is sent
    # again): compare sets of trace ids, never counts of what arrived
    _wait(lambda: _received(sink) >= set(kept), timeout=60, what="delivery after the receiver started")
    assert _received(sink) == set(kept)
    assert _delivery()["delivered"] >= 12
    assert _delivery()["pending"] == 0
    assert not list(spool.rglob("*.otlp"))
    totals = otr.stats()["totals"]
    assert totals["kept"] == 12


def test_spool_cap_drops_the_oldest_first_and_counts_them(sink, tmp_path, otr_shutdown, caplog):
    memory = InMemorySpanExporter()
    otr.configure(
        exporters=[OTLPSpanExporter(endpoint=sink.endpoint, timeout=1), memory],
        sampler=otr.TailSampler(1000, "first"),
        spool_dir=tmp_path / "spool",
        spool_max_bytes=12_000,  # room for a few episodes only
    )
    caplog.set_level(logging.WARNING, logger="otel_rollouts")
    _episodes(0, 40, text="x" * 200)
    otr.flush(timeout=5)
    kept = _kept_ids(memory)
    assert len(kept) == 40 and len(set(kept)) == 40
    _wait(lambda: _delivery()["pending"] + _delivery()["dropped"] >= 40, what="all spooled or dropped")
    assert 0 < _delivery()["dropped"] < 40
    warnings = [r for r in caplog.records if "spool_full" in r.getMessage()]
    assert len(warnings) == 1  # once per interval, not once per drop

    sink.start()
    # delivery is at-least-once: a request that timed out after the sink took it is sent again,
    # so the sink may hold duplicates. Wait until nothing is left to send (each kept episode
    # delivered or dropped), then compare sets of trace ids, never raw counts of received spans.
    _wait(
        lambda: (d := _delivery())["pending"] == 0 and d["delivered"] + d["dropped"] >= 40,
        what="delivery of what the spool kept",
    )
    report = _delivery()
    dropped = report["dropped"]
    assert 0 < dropped < 40
    assert otr.stats()["totals"]["lost.spool_full.OTLPSpanExporter"] == dropped  # every drop is a spool_full one
    assert report["delivered"] >= 40 - dropped
    received = {r["trace_id"] for r in sink.roots()}
    assert received <= set(kept)  # nothing but kept episodes arrives
    assert len(received) == 40 - dropped  # each kept episode arrived (at least once) or was dropped
    # oldest first out: what survived is the newest episodes, and only those
    assert received == set(kept[dropped:])


def test_a_receiver_answering_503_is_not_counted_as_delivered(sink, tmp_path, otr_shutdown):
    sink.start(status=503)  # accepts the connection, then refuses: an overloaded Phoenix does this
    exporter = OTLPSpanExporter(endpoint=sink.endpoint, timeout=1)
    memory = InMemorySpanExporter()
    otr.configure(
        exporters=[exporter, memory], sampler=otr.TailSampler(3, "first"), spool_dir=tmp_path / "spool"
    )
    _episodes(0, 5)
    otr.flush(timeout=5)
    assert exporter.force_flush() is True  # the stock exporter's word is no proof of delivery...
    _wait(lambda: sink.state()["refused"] >= 1, what="a refused request")
    assert _delivery()["delivered"] == 0  # ...ours counts only what was accepted
    assert otr.stats()["totals"]["export.failures.OTLPSpanExporter"] >= 1
    sink.control(status=None)
    _wait(lambda: _received(sink) >= set(_kept_ids(memory)), what="delivery once the receiver accepts")
    assert _received(sink) == set(_kept_ids(memory))
    assert _delivery()["delivered"] >= 3


def test_batches_left_by_a_process_that_died_during_an_outage_are_sent_by_the_next(sink, tmp_path):
    spool = tmp_path / "spool"
    memory = InMemorySpanExporter()
    otr.configure(
        exporters=[OTLPSpanExporter(endpoint=sink.endpoint, timeout=0.5), memory],
        sampler=otr.TailSampler(2, "first"),
        spool_dir=spool,
    )
    _episodes(0, 4)
    kept = _kept_ids_after_flush(memory)
    started = time.monotonic()
    otr.shutdown(timeout=3)
    assert time.monotonic() - started < 10  # never hangs with the receiver down
    assert len(list(spool.rglob("*.otlp"))) >= 1

    sink.start()
    try:
        otr.configure(
            exporters=[OTLPSpanExporter(endpoint=sink.endpoint, timeout=2)],
            sampler=otr.TailSampler(2, "first"),
            spool_dir=spool,
        )
        _wait(lambda: _received(sink) >= set(kept), what="leftovers delivered")
        assert _received(sink) == set(kept) and len(kept) == 2
    finally:
        otr.shutdown(timeout=5)


def _kept_ids_after_flush(memory):
    otr.flush(timeout=3)
    return _kept_ids(memory)


def test_slow_receiver_never_blocks_training_and_everything_arrives(sink, tmp_path, otr_shutdown):
    sink.start(delay=2.0)  # every request takes 2 s
    memory = InMemorySpanExporter()
    otr.configure(
        exporters=[OTLPSpanExporter(endpoint=sink.endpoint, timeout=10), memory],
        sampler=otr.TailSampler(1000, "first"),
        spool_dir=tmp_path / "spool",
    )
    training = threading.current_thread()
    calls = []
    original = OTLPSpanExporter.export

    def spy(self, spans):
        calls.append(threading.current_thread())
        return original(self, spans)

    OTLPSpanExporter.export = spy
    try:
        _episodes(0, 30)
        otr.flush(timeout=1)
        # the loop finished while the receiver had taken at most a few of the 30 requests
        assert sink.state()["accepted"] < 10
        assert otr.stats()["totals"].get("lost.queue_full.OTLPSpanExporter", 0) == 0
        sink.control(delay=0)
        _wait(lambda: _delivery()["delivered"] >= 30, what="delivery through a slow receiver")
    finally:
        OTLPSpanExporter.export = original
    assert calls and training not in calls  # export never ran on the training thread
    assert _received(sink) == set(_kept_ids(memory))


def test_full_queue_drops_are_counted_and_warned_once_per_interval(tmp_path, configured, caplog):
    release = threading.Event()
    memory = configured(1000, "first", max_queue=2)
    caplog.set_level(logging.WARNING, logger="otel_rollouts")
    # the export thread is stuck materialising a value (a slow decode): the queue fills up
    with otr.episode(step=0) as ep:
        ep.prompt(Deferred(lambda: release.wait(30) and "decoded"))
        ep.reward(1.0)
    for i in range(20):
        with otr.episode(step=0) as ep:
            ep.reward(float(i))
    otr.end_step(0)
    dropped = otr.stats()["totals"]["lost.queue_full.InMemorySpanExporter"]
    assert dropped >= 15
    assert sum("export queue full" in r.getMessage() for r in caplog.records) == 1
    release.set()
    otr.flush(timeout=10)
    roots = [s for s in memory.get_finished_spans() if s.name == "episode"]
    assert len(roots) == 21 - dropped  # everything not counted as dropped arrived


def test_collector_killed_mid_run_and_restarted_phoenix(phoenix, tmp_path, otr_shutdown):
    """The session's Phoenix is stopped mid-run and started again (same ports, same database):
    the one test that kills it, so it brings it back whatever happens."""
    project = f"otr-outage-{uuid.uuid4().hex[:8]}"
    try:
        memory = InMemorySpanExporter()
        otr.configure(
            exporters=[OTLPSpanExporter(endpoint=phoenix.http_endpoint, timeout=1), memory],
            sampler=otr.TailSampler(3, "top_bottom"),
            resource_attributes={c.OPENINFERENCE_PROJECT_NAME: project},
            spool_dir=tmp_path / "spool",
        )
        _episodes(0, 6)
        _wait(lambda: _delivery()["delivered"] >= 3, what="step 0 delivered while Phoenix is up")
        phoenix.stop()  # the collector dies mid-run
        for step in (1, 2):
            _episodes(step, 6)
        otr.flush(timeout=3)
        _wait(lambda: _delivery()["spooled"] == 6, what="steps 1-2 spooled during the outage")
        delivered_before = _delivery()["delivered"]
        phoenix.start()  # same ports, same database
        _wait(lambda: _delivery()["delivered"] >= delivered_before + 6, timeout=90, what="delivery after the restart")
        kept = set(_kept_ids(memory))
        assert len(kept) == 9
        spans_per_episode = len(memory.get_finished_spans()) // 9
        found = phoenix.wait_for_spans(project, 9 * spans_per_episode, timeout=90)
        assert {s["context"]["trace_id"] for s in found} == kept
        assert otr.stats()["delivery"]["OTLPSpanExporter"]["dropped"] == 0
    finally:
        if not phoenix.is_running():
            phoenix.start()


def test_spool_directory_that_cannot_be_created_drops_counted_not_raised(sink, tmp_path, otr_shutdown):
    blocker = tmp_path / "not-a-directory"
    blocker.write_text("a file where the spool directory should go")
    otr.configure(
        exporters=[OTLPSpanExporter(endpoint=sink.endpoint, timeout=0.5)],
        sampler=otr.TailSampler(2, "first"),
        spool_dir=blocker / "spool",
    )
    _episodes(0, 3)
    otr.flush(timeout=3)
    _wait(lambda: _delivery()["dropped"] == 2, what="drops counted")
    assert otr.stats()["totals"]["lost.spool_unavailable.OTLPSpanExporter"] == 2


class _Receiver(InMemorySpanExporter):
    """An exporter standing for a receiver that can be down, still warming up once it is back
    (its first request fails), or refusing one episode forever (``poison``: a trace id)."""

    def __init__(self) -> None:
        super().__init__()
        self.down = False
        self.warming_up = False
        self.poison: int | None = None

    def export(self, spans):
        from opentelemetry.sdk.trace.export import SpanExportResult

        if self.down or any(s.context.trace_id == self.poison for s in spans):
            return SpanExportResult.FAILURE
        if self.warming_up:
            self.warming_up = False
            return SpanExportResult.FAILURE
        return super().export(spans)


def _failures(name: str = "_Receiver") -> int:
    return otr.stats()["totals"].get(f"export.failures.{name}", 0)


def test_a_receiver_failing_its_first_request_after_an_outage_loses_nothing(tmp_path, otr_shutdown):
    receiver = _Receiver()
    receiver.down = True
    otr.configure(exporters=[receiver], sampler=otr.TailSampler(3, "first"), spool_dir=tmp_path / "spool")
    for step in range(3):
        _episodes(step, 3)  # a batch per step, all spooled
    _wait(lambda: _failures() >= 3, what="three failed attempts during the outage")
    receiver.down, receiver.warming_up = False, True  # back, but its first request fails
    assert otr.shutdown(timeout=30)
    roots = {s.context.trace_id for s in receiver.get_finished_spans() if s.name == c.SPAN_EPISODE}
    assert len(roots) == 9  # the batch that met the warming-up receiver was retried, not dropped
    assert otr.stats()["delivery"]["_Receiver"]["dropped"] == 0


def test_a_batch_the_receiver_always_refuses_is_dropped_counted_and_does_not_stall_the_rest(
    tmp_path, otr_shutdown
):
    receiver = _Receiver()
    otr.configure(exporters=[receiver], sampler=otr.TailSampler(3, "first"), spool_dir=tmp_path / "spool")
    with otr.episode(step=0) as ep:
        receiver.poison = int(ep.trace_id, 16)
        ep.reward(1.0)
    otr.end_step(0)
    for step in range(1, 4):
        _episodes(step, 3)
    assert otr.shutdown(timeout=30)
    roots = {s.context.trace_id for s in receiver.get_finished_spans() if s.name == c.SPAN_EPISODE}
    assert len(roots) == 9 and receiver.poison not in roots
    assert otr.stats()["totals"]["lost.rejected._Receiver"] == 1
