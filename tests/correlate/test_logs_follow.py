"""Log records follow their episode (issue 31): kept or dropped with it, what the standard
OpenTelemetry handler keeps (tracebacks, ``extra=`` fields), and worker processes' records
joining the parent's episode with the run's resource, none lost when the pool shuts down.

Real parts only: the SDK's log pipeline, a real OTLP/HTTP receiver process on loopback
(``tests/otlp_sink.py``), real ``ProcessPoolExecutor`` (fork and spawn) and
``multiprocessing.Pool`` workers.
"""

from __future__ import annotations

import concurrent.futures
import functools
import logging
import multiprocessing
import os
import time
from collections.abc import Callable, Iterator
from pathlib import Path

import pytest
from opentelemetry.sdk._logs.export import InMemoryLogRecordExporter
from opentelemetry.sdk.trace.export.in_memory_span_exporter import InMemorySpanExporter
from otlp_sink import OtlpSink
from otr_helpers import configure_memory

import otel_rollouts as otr
from otel_rollouts import conventions as c
from otel_rollouts._core import runtime as _runtime

METHODS = [m for m in ("fork", "spawn") if m in multiprocessing.get_all_start_methods()]
APP = "otr-test-follow"


@pytest.fixture
def configured_logs() -> Iterator[Callable[..., InMemorySpanExporter]]:
    """``otr_helpers.configure_memory`` (a new in-memory exporter, returned); after the test,
    logging is uninstrumented and the SDK shut down."""
    yield configure_memory
    otr.uninstrument_logging()
    otr.shutdown()


@pytest.fixture
def app_logger() -> Iterator[logging.Logger]:
    logger = logging.getLogger(APP)
    logger.setLevel(logging.INFO)
    logger.propagate = False
    yield logger
    logger.setLevel(logging.NOTSET)
    logger.propagate = True


@pytest.fixture
def sink(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> Iterator[OtlpSink]:
    """A real OTLP/HTTP receiver; the standard variables point the log exporter at it (worker
    processes inherit them)."""
    with OtlpSink(tmp_path / "sink") as receiver:
        monkeypatch.setenv("OTEL_EXPORTER_OTLP_LOGS_ENDPOINT", receiver.logs_endpoint)
        monkeypatch.setenv("OTEL_EXPORTER_OTLP_LOGS_PROTOCOL", "http/protobuf")
        monkeypatch.setenv("OTEL_BLRP_SCHEDULE_DELAY", "50")
        yield receiver


def _poll(what, done, timeout: float = 30.0):
    """``what()`` once ``done(value)`` holds, or its last value at the deadline."""
    deadline = time.monotonic() + timeout
    while True:
        value = what()
        if done(value) or time.monotonic() > deadline:
            return value
        time.sleep(0.05)


def _run_attrs() -> dict:
    rt = _runtime.installed()
    assert rt is not None and rt.provider is not None
    return dict(rt.provider.resource.attributes)


# --- 1. what the standard handler keeps ----------------------------------------------------------
def _raise_with_secret() -> None:
    raise ValueError("upstream refused api_key=sk-abcdefghijklmnopqrstuvwx1234")


def test_tracebacks_and_extra_fields_are_kept_and_redacted(configured_logs, app_logger):
    configured_logs(8, "first", handle_signals=False)
    exporter = InMemoryLogRecordExporter()
    integration = otr.instrument_logging(app_logger, exporter=exporter)
    with otr.episode(step=1, episode_id="e1") as ep:
        with ep.turn():
            try:
                _raise_with_secret()
            except ValueError:
                app_logger.exception("reward model failed for %s", "e1")
            app_logger.info("x", extra={"batch": 3, "client_secret": "hunter2"})
        ep.reward(1.0)
    otr.flush()
    assert integration.flush()
    failed, extra = (r.log_record for r in exporter.get_finished_logs() if r.log_record.event_name is None)
    assert f"{failed.trace_id:032x}" == ep.trace_id
    attrs = dict(failed.attributes)
    assert attrs[c.EXCEPTION_TYPE] == "ValueError"
    assert attrs[c.EXCEPTION_MESSAGE].startswith("upstream refused")
    stack = attrs[c.EXCEPTION_STACKTRACE]
    assert "Traceback (most recent call last)" in stack and "_raise_with_secret" in stack
    for text in (attrs[c.EXCEPTION_MESSAGE], stack):  # redacted like span exceptions
        assert "sk-abcdefghijklmnopqrstuvwx1234" not in text and "[REDACTED]" in text
    assert attrs["code.function.name"] == "test_tracebacks_and_extra_fields_are_kept_and_redacted"
    assert failed.body == "reward model failed for e1"
    assert attrs[c.RL_STEP] == 1 and attrs[c.RL_EPISODE_ID] == "e1"
    # our LogRecord stamps leave as the record's trace context, not as attributes
    assert not {c.LOG_TRACE_ID, c.LOG_SPAN_ID, c.LOG_RL_STEP, c.LOG_RL_EPISODE_ID} & set(attrs)
    extras = dict(extra.attributes)
    assert extras["batch"] == 3
    assert extras["client_secret"] == "[REDACTED]"


class _Hostile:
    """A user value whose every conversion raises what no ``except Exception`` catches."""

    def __str__(self) -> str:
        raise SystemExit("str")

    def __repr__(self) -> str:
        raise SystemExit("repr")


def test_hostile_values_are_flagged_not_raised(configured_logs):
    # A logger made here, not by the fixture: pytest (9.2 and newer) attaches its capture handler
    # to every non-propagating logger that exists when a test phase starts, and that handler
    # formats the record itself (the SystemExit would come from pytest's handler, not ours).
    app_logger = logging.getLogger(f"{APP}.hostile")
    app_logger.setLevel(logging.INFO)
    app_logger.propagate = False
    configured_logs(8, "first", handle_signals=False)
    exporter = InMemoryLogRecordExporter()
    integration = otr.instrument_logging(app_logger, exporter=exporter)
    with otr.episode(step=1, episode_id="e1") as ep:
        app_logger.info("value %s", _Hostile())  # SystemExit from the argument's __str__
        app_logger.info("extra", extra={"value": _Hostile()})
        ep.reward(1.0)
    otr.flush()
    assert integration.flush()
    message, extra = (r.log_record for r in exporter.get_finished_logs() if r.log_record.event_name is None)
    assert message.body == "value %s [arguments not formatted: <_Hostile: str raised SystemExit>]"
    assert dict(extra.attributes)["value"] == "<_Hostile: str raised SystemExit>"


def test_content_off_keeps_the_exception_type_only(configured_logs, app_logger):
    configured_logs(8, "first", handle_signals=False, capture_content=False)
    exporter = InMemoryLogRecordExporter()
    integration = otr.instrument_logging(app_logger, exporter=exporter)
    with otr.episode(step=0) as ep:
        try:
            _raise_with_secret()
        except ValueError:
            app_logger.exception("scoring %s failed", "the completion text")
        ep.reward(0.0)
    otr.flush()
    assert integration.flush()
    (log,) = (r.log_record for r in exporter.get_finished_logs() if r.log_record.event_name is None)
    attrs = dict(log.attributes)
    assert attrs[c.EXCEPTION_TYPE] == "ValueError"  # as a span's exception event with content off
    assert c.EXCEPTION_MESSAGE not in attrs and c.EXCEPTION_STACKTRACE not in attrs
    assert log.body == "scoring %s failed"  # the template, not the argument


# --- 2. records are kept or dropped with their episode --------------------------------------------
def test_only_kept_episodes_logs_reach_the_receiver(configured_logs, app_logger, sink):
    spans = configured_logs(2, "first", handle_signals=False)
    integration = otr.instrument_logging(app_logger, otlp=True)
    app_logger.warning("before any episode")
    episodes = []
    for i in range(6):
        with otr.episode(step=0, episode_id=f"ep{i}") as ep:
            with ep.turn():
                app_logger.warning("turn of ep%d", i)
            app_logger.info("scored ep%d", i)
            ep.reward(float(i))
        episodes.append(ep.trace_id)
    app_logger.warning("after the step")
    otr.flush()
    assert integration.flush()
    kept = {f"{s.context.trace_id:032x}" for s in spans.get_finished_spans()}
    assert len(kept) == 2 and kept <= set(episodes)
    def lines() -> list[dict]:  # the app's log lines (not the evaluation events of kept episodes)
        return [log for log in sink.logs() if not log["event_name"]]

    received = _poll(lines, lambda logs: len(logs) >= 6)
    by_trace: dict[str, list[str]] = {}
    for log in received:
        by_trace.setdefault(log["trace_id"], []).append(log["body"])
    outside = by_trace.pop("", [])
    assert sorted(outside) == ["after the step", "before any episode"]
    assert set(by_trace) == kept  # 0 records of the 4 dropped episodes
    assert all(len(bodies) == 2 for bodies in by_trace.values())
    assert otr.stats()["totals"]["dropped.episode_logs"] == 8
    resource = received[0]["resource"]
    assert resource[c.RL_RUN_ID] == _runtime.installed().run_id


# --- 3. worker processes ---------------------------------------------------------------------------
def log_in_task(i: int) -> int:
    """A worker task that logs (module level: picklable)."""
    logging.getLogger(APP + ".worker").warning("worker task %d", i)
    return i


def _worker_setup() -> functools.partial:
    return functools.partial(otr.instrument_logging, otlp=True)


def _pool_records(sink: OtlpSink) -> list[dict]:
    return [r for r in sink.logs() if str(r["body"]).startswith("worker task")]


@pytest.mark.parametrize("method", METHODS)
def test_process_pool_task_logs_join_the_episode_and_survive_shutdown(configured_logs, sink, method):
    configured_logs(1, "first", handle_signals=False, service_name="rl-job")
    integration = otr.instrument_logging(otlp=True)
    ctx = multiprocessing.get_context(method)
    with concurrent.futures.ProcessPoolExecutor(2, mp_context=ctx, initializer=_worker_setup()) as pool:
        with otr.episode(step=0) as kept:
            values = [otr.submit(pool, log_in_task, i).result(timeout=120) for i in range(4)]
            kept.reward(1.0)
        with otr.episode(step=0) as dropped:
            otr.submit(pool, log_in_task, 99).result(timeout=120)
            dropped.reward(0.0)
    # the pool is shut down: its workers are gone
    assert values == [0, 1, 2, 3]
    otr.flush()
    assert integration.flush()
    received = _poll(lambda: _pool_records(sink), lambda r: len(r) >= 4, timeout=10)
    assert sorted(r["body"] for r in received) == [f"worker task {i}" for i in range(4)]
    run = _run_attrs()
    for record in received:
        assert record["trace_id"] == kept.trace_id  # none of the dropped episode's
        assert record["resource"][c.RL_RUN_ID] == run[c.RL_RUN_ID]
        assert record["resource"][c.SERVICE_NAME] == "rl-job"
        assert record["resource"]["process.pid"] == os.getpid()  # re-stamped: part of the run
    assert otr.stats()["totals"]["dropped.episode_logs"] == 1


@pytest.mark.parametrize("method", METHODS)
def test_worker_logs_outside_an_episode_are_flushed_with_the_run_identity(configured_logs, sink, method):
    configured_logs(1, "first", handle_signals=False, service_name="rl-job")
    otr.instrument_logging(otlp=True)
    ctx = multiprocessing.get_context(method)
    with concurrent.futures.ProcessPoolExecutor(2, mp_context=ctx, initializer=_worker_setup()) as pool:
        values = [otr.submit(pool, log_in_task, i).result(timeout=120) for i in range(4)]
    assert values == [0, 1, 2, 3]
    # no wait: each task flushed its records before it returned
    received = _pool_records(sink)
    assert sorted(r["body"] for r in received) == [f"worker task {i}" for i in range(4)]
    run = _run_attrs()
    for record in received:
        assert record["trace_id"] == ""
        assert record["resource"][c.RL_RUN_ID] == run[c.RL_RUN_ID]
        assert record["resource"][c.SERVICE_NAME] == "rl-job"


def test_multiprocessing_pool_task_logs_join_the_episode(configured_logs, sink):
    configured_logs(1, "first", handle_signals=False)
    integration = otr.instrument_logging(otlp=True)
    ctx = multiprocessing.get_context(METHODS[-1])
    pool = ctx.Pool(2, initializer=_worker_setup())
    try:
        with otr.episode(step=0) as ep:
            values = [otr.adopt(r) for r in pool.map(otr.with_context(log_in_task), range(4))]
            ep.reward(1.0)
        pool.close()
    finally:
        pool.join()
    assert values == [0, 1, 2, 3]
    otr.flush()
    assert integration.flush()
    received = _poll(lambda: _pool_records(sink), lambda r: len(r) >= 4, timeout=10)
    assert sorted(r["body"] for r in received) == [f"worker task {i}" for i in range(4)]
    assert {r["trace_id"] for r in received} == {ep.trace_id}
    assert {r["resource"][c.RL_RUN_ID] for r in received} == {_runtime.installed().run_id}


def test_a_task_over_its_log_budget_brings_back_what_fits(configured_logs, monkeypatch):
    from otel_rollouts.correlate import logs

    monkeypatch.setattr(logs, "MAX_TASK_LOG_BYTES", 600)
    configured_logs(1, "first", handle_signals=False)
    exporter = InMemoryLogRecordExporter()
    integration = otr.instrument_logging(exporter=exporter)
    with otr.episode(step=0) as ep:
        # an explicit carrier in this process: recorded as in a worker, then adopted here
        task = otr.with_context(_chatty, otr.context_carrier())
        assert task(20) == 20
        ep.reward(1.0)
    otr.flush()
    assert integration.flush()
    records = [r for r in exporter.get_finished_logs() if str(r.log_record.body).startswith("chatty")]
    assert 0 < len(records) < 20
    assert otr.stats()["totals"]["dropped.worker_logs"] == 20 - len(records)


def _chatty(n: int) -> int:
    for i in range(n):
        logging.getLogger(APP + ".worker").warning("chatty line %d of a long task", i)
    return n


# --- 4. OTEL_EXPORTER_OTLP_LOGS_PROTOCOL=http/json is honoured ------------------------------------
def test_http_json_log_records_are_sent_as_json(configured_logs, app_logger, sink, monkeypatch):
    import json

    monkeypatch.setenv("OTEL_EXPORTER_OTLP_LOGS_PROTOCOL", "http/json")
    configured_logs(1, "first", handle_signals=False)
    integration = otr.instrument_logging(app_logger, otlp=True)
    with otr.episode(step=0) as kept:
        app_logger.warning("kept line")
        kept.reward(1.0)
    with otr.episode(step=0) as dropped:
        app_logger.warning("dropped line")
        dropped.reward(0.0)
    otr.flush()
    assert integration.flush()
    requests = sink.wait_for_json("/v1/logs", 1, timeout=10)
    records = [record for request in requests
               for rl in json.loads(request["body"])["resourceLogs"]
               for sl in rl["scopeLogs"] for record in sl["logRecords"]
               if not record.get("eventName")]  # the app's lines, not the evaluation events
    assert [r["body"]["stringValue"] for r in records] == ["kept line"]
    assert records[0]["traceId"].lower() == kept.trace_id
    assert sink.logs() == []  # nothing went as protobuf


def log_then_fail(i: int) -> None:
    logging.getLogger(APP + ".worker").warning("worker task %d failing", i)
    raise RuntimeError("task failed")


def test_a_failing_worker_task_brings_its_log_records_back(configured_logs, sink):
    configured_logs(1, "first", handle_signals=False)
    integration = otr.instrument_logging(otlp=True)
    ctx = multiprocessing.get_context(METHODS[0])
    with concurrent.futures.ProcessPoolExecutor(1, mp_context=ctx, initializer=_worker_setup()) as pool:
        with otr.episode(step=0) as ep:
            with pytest.raises(RuntimeError):
                otr.submit(pool, log_then_fail, 7).result(timeout=120)
            ep.reward(1.0)
    otr.flush()
    assert integration.flush()
    received = _poll(lambda: _pool_records(sink), lambda r: len(r) >= 1, timeout=10)
    assert [(r["body"], r["trace_id"]) for r in received] == [("worker task 7 failing", ep.trace_id)]
    assert received[0]["resource"][c.RL_RUN_ID] == _runtime.installed().run_id
