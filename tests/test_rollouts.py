"""One ``otr.Rollouts`` per run: configure() returns it, instances side by side, the tracer
provider accessor, OpenTelemetry's own flush and shutdown, settings from arguments and the
environment, a forked child rebuilt from the stored settings."""

from __future__ import annotations

import multiprocessing
import os
import threading
import time
from collections.abc import Sequence

import pytest
from opentelemetry.sdk.trace import ReadableSpan
from opentelemetry.sdk.trace.export import SpanExporter, SpanExportResult
from opentelemetry.sdk.trace.export.in_memory_span_exporter import InMemorySpanExporter

import otel_rollouts as otr
from otel_rollouts import conventions as c
from otel_rollouts._core.settings import ENV_TABLE, env_flag


def _episode(rollouts: otr.Rollouts | None = None, step: int = 0, reward: float = 1.0) -> None:
    with (rollouts.episode(step=step) if rollouts is not None else otr.episode(step=step)) as ep:
        ep.prompt([{"role": "user", "content": "2+2?"}])
        with ep.turn() as turn:
            turn.record_generation("4", model="policy")
        ep.reward(reward)


def _trace_ids(exporter: InMemorySpanExporter) -> set[int]:
    return {s.context.trace_id for s in exporter.get_finished_spans()}


def test_configure_returns_the_installed_instance_and_its_provider(otr_shutdown):
    exporter = InMemorySpanExporter()
    rollouts = otr.configure(exporters=[exporter], handle_signals=False)
    assert isinstance(rollouts, otr.Rollouts)
    assert otr.tracer_provider() is rollouts.tracer_provider() is not None
    _episode()
    rollouts.end_step(0)
    assert rollouts.flush(10.0)
    assert len(_trace_ids(exporter)) == 1
    assert rollouts.stats() == otr.stats()
    assert otr.__version__ and otr.__version__ != ""


def test_two_instances_side_by_side_keep_their_own_episodes_and_counts(otr_shutdown):
    installed_exporter, other_exporter = InMemorySpanExporter(), InMemorySpanExporter()
    installed = otr.configure(exporters=[installed_exporter], handle_signals=False)
    other = otr.configure(exporters=[other_exporter], install=False, handle_signals=False)
    assert otr.tracer_provider() is installed.provider is not other.provider
    for _ in range(3):
        _episode()  # the installed one
    _episode(other, reward=0.5)
    installed.end_step(0)
    other.end_step(0)
    assert installed.flush(10.0) and other.flush(10.0)
    assert len(_trace_ids(installed_exporter)) == 3
    assert len(_trace_ids(other_exporter)) == 1
    assert installed.stats()["totals"]["kept"] == 3 and other.stats()["totals"]["kept"] == 1
    rewards = [s.attributes.get(c.RL_REWARD) for s in other_exporter.get_finished_spans()]
    assert 0.5 in rewards and 1.0 not in rewards
    # shutting the other one down leaves the installed one running
    assert other.shutdown(10.0)
    _episode(step=1)
    otr.end_step(1)
    assert otr.flush(10.0) and len(_trace_ids(installed_exporter)) == 4


def test_provider_force_flush_delivers(otr_shutdown):
    exporter = InMemorySpanExporter()
    rollouts = otr.configure(exporters=[exporter], handle_signals=False)
    _episode()  # its step is still open: only the flush closes it
    assert exporter.get_finished_spans() == ()
    assert rollouts.tracer_provider().force_flush(10_000) is True
    assert len(_trace_ids(exporter)) == 1


class _NeverStores(SpanExporter):
    """An exporter whose receiver is down for good."""

    def __init__(self) -> None:
        self.calls = 0

    def export(self, spans: Sequence[ReadableSpan]) -> SpanExportResult:
        self.calls += 1
        return SpanExportResult.FAILURE

    def shutdown(self) -> None:
        return None


def test_provider_force_flush_reports_a_failing_exporter_within_its_timeout(otr_shutdown, tmp_path):
    exporter = _NeverStores()
    rollouts = otr.configure(exporters=[exporter], handle_signals=False, spool_dir=tmp_path)
    _episode()
    started = time.monotonic()
    assert rollouts.tracer_provider().force_flush(2_000) is False
    assert time.monotonic() - started < 10.0
    assert exporter.calls >= 1
    otr.shutdown(timeout=0.5)  # it never stores: not the fixture's 10 s of retries


def test_provider_shutdown_delivers_and_stops(otr_shutdown):
    exporter = InMemorySpanExporter()
    rollouts = otr.configure(exporters=[exporter], handle_signals=False, install=False)
    _episode(rollouts)
    rollouts.tracer_provider().shutdown()
    assert len(_trace_ids(exporter)) == 1
    assert rollouts.shutdown(5.0) in (True, False)  # a second stop is harmless and never hangs


def test_settings_come_from_arguments_else_the_environment(otr_shutdown, monkeypatch):
    monkeypatch.setenv(c.ENV_SPAN_ATTRIBUTE_VALUE_LENGTH_LIMIT, "300")
    monkeypatch.setenv(c.ENV_CAPTURE_CONTENT, "false")
    monkeypatch.setenv(c.ENV_SPOOL_DIR, "/nonexistent/spool")
    from_env = otr.configure(exporters=[InMemorySpanExporter()], install=False, handle_signals=False)
    assert from_env.settings.content.max_attribute_chars == 300
    assert from_env.settings.content.capture_content is False
    assert str(from_env.settings.delivery.spool_dir) == "/nonexistent/spool"
    from_env.shutdown(5.0)
    given = otr.configure(exporters=[InMemorySpanExporter()], install=False, handle_signals=False,
                          max_attribute_chars=5000, capture_content=True, spool_dir="/tmp/x")
    assert given.settings.content.max_attribute_chars == 5000
    assert given.settings.content.capture_content is True
    assert str(given.settings.delivery.spool_dir) == "/tmp/x"
    given.shutdown(5.0)
    # every table entry names a variable of the conventions and an option that exists
    for entry in ENV_TABLE:
        group, _, name = entry.option.rpartition(".")
        holder = getattr(given.settings, group) if group else given.settings
        assert hasattr(holder, name), entry


def test_the_environment_limit_reaches_the_exported_attribute(otr_shutdown, monkeypatch):
    monkeypatch.setenv(c.ENV_SPAN_ATTRIBUTE_VALUE_LENGTH_LIMIT, "200")
    exporter = InMemorySpanExporter()
    otr.configure(exporters=[exporter], handle_signals=False)
    with otr.episode(step=0) as ep:
        ep.prompt([{"role": "user", "content": "x" * 5000}])
        ep.reward(1.0)
    otr.end_step(0)
    assert otr.flush(10.0)
    prompt = next(s for s in exporter.get_finished_spans() if s.name == c.SPAN_PROMPT)
    assert len(prompt.attributes[c.GEN_AI_INPUT_MESSAGES]) <= 200 + 100  # + the cut marker


@pytest.mark.parametrize(("text", "expected"), [
    ("true", True), (" TRUE ", True), ("1", True), ("on", True), ("yes", True),
    ("false", False), ("0", False), ("Off", False), ("no", False),
    ("", None), ("maybe", None),
])
def test_one_boolean_reading_of_the_environment(text, expected):
    assert env_flag("X", {"X": text}) is expected


def test_a_disabled_sdk_gives_a_disabled_instance(otr_shutdown, monkeypatch):
    monkeypatch.setenv(c.ENV_SDK_DISABLED, "true")
    exporter = InMemorySpanExporter()
    rollouts = otr.configure(exporters=[exporter], handle_signals=False)
    assert not rollouts.enabled and otr.tracer_provider() is None
    _episode()
    assert rollouts.flush(1.0) and exporter.get_finished_spans() == ()


def _child_settings(queue) -> None:
    from otel_rollouts._core import runtime

    _episode()  # the first use in the child rebuilds its own instance
    child = runtime.installed()
    queue.put((
        type(child).__name__,
        child.pid == os.getpid(),
        child.settings.content.max_attribute_chars,
        child.settings.run_id,
        child.settings.delivery.spool_dir,
        child.settings.metric_readers,
    ))
    otr.shutdown(5.0)


@pytest.mark.skipif("fork" not in multiprocessing.get_all_start_methods(), reason="no fork")
def test_a_forked_child_rebuilds_from_the_stored_settings(otr_shutdown, tmp_path):
    exporter = InMemorySpanExporter()
    parent = otr.configure(exporters=[exporter], handle_signals=False, run_id="run-17",
                           max_attribute_chars=777, spool_dir=tmp_path)
    context = multiprocessing.get_context("fork")
    queue = context.Queue()
    process = context.Process(target=_child_settings, args=(queue,))
    process.start()
    name, own_pid, limit, run_id, spool_dir, readers = queue.get(timeout=60)
    process.join(60)
    assert name == "Rollouts" and own_pid
    assert (limit, run_id) == (777, "run-17")
    assert spool_dir is None and readers is None  # the parent's own, not the child's
    assert parent.settings.delivery.spool_dir == tmp_path
    assert otr.tracer_provider() is parent.provider  # the parent's instance is untouched


def test_reconfigure_stops_the_previous_instance_and_its_ticker(otr_shutdown):
    first = otr.configure(exporters=[InMemorySpanExporter()], handle_signals=False)
    tickers = [t for t in threading.enumerate() if t.name == "otel-rollouts-ticker"]
    second = otr.configure(exporters=[InMemorySpanExporter()], handle_signals=False)
    assert not first.enabled and second.enabled
    for ticker in tickers:
        ticker.join(5.0)
        assert not ticker.is_alive()
