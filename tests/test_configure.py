"""configure(): resource from arguments and env, defaults, idempotence, exporter containment."""

from __future__ import annotations

import threading
import time

from opentelemetry.sdk.trace.export import SpanExporter, SpanExportResult
from opentelemetry.sdk.trace.export.in_memory_span_exporter import InMemorySpanExporter

import otel_rollouts as otr
from otel_rollouts import conventions as c
from otel_rollouts.exporters import TrackioExporter


def _one_episode():
    with otr.episode(step=0) as ep:
        ep.reward(1)


def test_resource_from_arguments_and_env(otr_shutdown, monkeypatch):
    monkeypatch.setenv("OTEL_RESOURCE_ATTRIBUTES", "deployment.environment=test,team=rl")
    exporter = InMemorySpanExporter()
    otr.configure(service_name="grpo-run", exporters=[exporter], resource_attributes={"rank": 0})
    _one_episode()
    otr.flush()
    res = exporter.get_finished_spans()[0].resource.attributes
    assert res[c.SERVICE_NAME] == "grpo-run"
    assert res["deployment.environment"] == "test" and res["team"] == "rl" and res["rank"] == 0
    assert res[c.RL_RUN_ID]


def test_service_name_from_env(otr_shutdown, monkeypatch):
    monkeypatch.setenv("OTEL_SERVICE_NAME", "from-env")
    exporter = InMemorySpanExporter()
    otr.configure(exporters=[exporter])
    _one_episode()
    otr.flush()
    assert exporter.get_finished_spans()[0].resource.attributes[c.SERVICE_NAME] == "from-env"


def test_reconfigure_does_not_leak_threads(otr_shutdown):
    def ours() -> int:
        # the library names every thread it starts "otel-rollouts-…"; other libraries' pools
        # (tokenizers, Ray, an earlier test's stragglers) come and go on their own schedule
        return sum(1 for t in threading.enumerate() if t.name.startswith("otel-rollouts"))

    def names() -> list[str]:
        return sorted(t.name for t in threading.enumerate() if t.name.startswith("otel-rollouts"))

    otr.configure(exporters=[InMemorySpanExporter()])
    baseline, before = ours(), names()
    assert baseline > 0
    exporters = []
    for _ in range(10):
        exporter = InMemorySpanExporter()
        exporters.append(exporter)
        otr.configure(exporters=[exporter])
        _one_episode()
    # a replaced run's threads end once its shutdown has let go of them: on a loaded machine a
    # moment after configure() returned (a leak never ends: the deadline catches it)
    deadline = time.monotonic() + 10
    while ours() > baseline and time.monotonic() < deadline:
        time.sleep(0.02)
    assert ours() <= baseline, (before, names())
    otr.flush()
    # each configuration delivered its own episode before being replaced
    assert all(len(e.get_finished_spans()) == 2 for e in exporters)


def test_default_exporters_trackio_plus_otlp_when_env_set(monkeypatch):
    from opentelemetry.exporter.otlp.proto.grpc.trace_exporter import OTLPSpanExporter as Grpc
    from opentelemetry.exporter.otlp.proto.http.trace_exporter import OTLPSpanExporter as Http

    from otel_rollouts.delivery.defaults import default_exporters

    monkeypatch.delenv(c.ENV_OTLP_ENDPOINT, raising=False)
    monkeypatch.delenv(c.ENV_OTLP_TRACES_ENDPOINT, raising=False)
    only = default_exporters("p")
    assert [type(e) for e in only] == [TrackioExporter] and only[0].project == "p"
    monkeypatch.setenv(c.ENV_OTLP_ENDPOINT, "http://127.0.0.1:4317")
    assert [type(e) for e in default_exporters("p")] == [TrackioExporter, Grpc]
    monkeypatch.setenv(c.ENV_OTLP_PROTOCOL, "http/protobuf")
    assert [type(e) for e in default_exporters("p")] == [TrackioExporter, Http]


class Raising(SpanExporter):
    def __init__(self):
        self.calls = 0

    def export(self, spans):
        self.calls += 1
        raise RuntimeError("exporter bug")

    def shutdown(self):
        raise RuntimeError("shutdown bug")

    def force_flush(self, timeout_millis=30000):
        raise RuntimeError("flush bug")


class Failing(SpanExporter):
    def export(self, spans):
        return SpanExportResult.FAILURE

    def shutdown(self):
        pass


def test_an_exporter_that_raises_never_reaches_user_code(otr_shutdown, caplog):
    bad, failing, good = Raising(), Failing(), InMemorySpanExporter()
    otr.configure(exporters=[bad, failing, good])
    for _ in range(3):
        _one_episode()
    # the failing exporters' batches are spooled and retried in the background: flush says so
    assert otr.flush(timeout=5) is False
    assert bad.calls >= 1
    assert len(good.get_finished_spans()) == 6  # the others still receive
    stats = otr.stats()
    delivery = stats["delivery"]
    assert delivery["InMemorySpanExporter"]["delivered"] == 3
    for name in ("Raising", "Failing"):  # nothing kept is lost: it waits, counted, for a retry
        assert delivery[name]["delivered"] == 0 and delivery[name]["failures"] >= 1
        assert delivery[name]["pending"] + delivery[name]["spooled"] >= 3
    # logged once per exporter and error kind, not once per attempt
    assert sum("exporter Raising: export raised" in r.getMessage() for r in caplog.records) == 1
    otr.shutdown(timeout=0.5)  # two of them never store: not the fixture's 10 s of retries


def test_export_runs_off_the_training_thread(otr_shutdown):
    threads = set()

    class Recording(InMemorySpanExporter):
        def export(self, spans):
            threads.add(threading.current_thread().name)
            return super().export(spans)

    otr.configure(exporters=[Recording()])
    _one_episode()
    otr.flush()
    assert threads and threading.current_thread().name not in threads


def test_unconfigured_library_records_nothing_and_does_not_raise():
    otr.shutdown()
    with otr.episode(step=0) as ep:
        ep.prompt("x")
        with ep.turn() as t:
            t.record_generation("y")
        ep.reward(1)
    assert ep.trace_id is None and not ep.recording


def test_a_replaced_run_ends_its_step_metrics_thread(otr_shutdown):
    """A run whose exporter takes step summaries (Trackio's ``log_metrics``) sends them from
    its own thread: replacing the run ends that thread, after the last summary was sent."""
    class Scalars(InMemorySpanExporter):
        def __init__(self) -> None:
            super().__init__()
            self.steps: list[int] = []

        def log_metrics(self, step: int, values: dict) -> None:
            self.steps.append(step)

        def export(self, spans):
            super().export(spans)
            return SpanExportResult.SUCCESS

    def metrics_threads() -> int:
        return sum(1 for t in threading.enumerate() if t.name == "otel-rollouts-metrics")

    before = metrics_threads()
    exporters = []
    for _ in range(5):
        exporter = Scalars()
        exporters.append(exporter)
        otr.configure(exporters=[exporter], handle_signals=False)
        _one_episode()
        otr.end_step(0)
    otr.shutdown()
    assert metrics_threads() == before  # was one more thread per run, forever
    assert all(e.steps == [0] for e in exporters)  # each run's summary was sent before its thread ended
