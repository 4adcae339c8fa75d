"""Log records stamped with the episode's ids, and exported over the SDK's log pipeline."""

from __future__ import annotations

import logging
from collections.abc import Iterator

import pytest
from opentelemetry import context as otel_context
from opentelemetry import trace
from opentelemetry.sdk._logs.export import InMemoryLogRecordExporter
from opentelemetry.sdk.trace.export.in_memory_span_exporter import InMemorySpanExporter
from otr_helpers import configure_memory

import otel_rollouts as otr
from otel_rollouts import conventions as c
from otel_rollouts._core import runtime as _runtime


class _Collect(logging.Handler):
    """Keeps the records it is given (a real logging handler)."""

    def __init__(self) -> None:
        super().__init__()
        self.records: list[logging.LogRecord] = []

    def emit(self, record: logging.LogRecord) -> None:
        self.records.append(record)


@pytest.fixture
def configured() -> Iterator[InMemorySpanExporter]:
    exporter = configure_memory(8, "first", handle_signals=False)
    yield exporter
    otr.uninstrument_logging()
    otr.shutdown()


@pytest.fixture
def app_logger() -> Iterator[tuple[logging.Logger, _Collect]]:
    logger = logging.getLogger("otr-test-app")
    logger.setLevel(logging.INFO)
    logger.propagate = False
    handler = _Collect()
    logger.addHandler(handler)
    yield logger, handler
    logger.removeHandler(handler)


def _ids() -> tuple[str, str]:
    ctx = trace.get_current_span().get_span_context()
    return f"{ctx.trace_id:032x}", f"{ctx.span_id:016x}"


def test_records_inside_an_episode_carry_its_ids(configured, app_logger):
    logger, handler = app_logger
    otr.instrument_logging()
    logger.info("before")
    with otr.episode(step=4, episode_id="ep-4") as ep:
        with ep.turn():
            logger.info("inside")
            trace_id, span_id = _ids()
        ep.reward(1.0)
    before, inside = handler.records
    assert (inside.trace_id, inside.span_id) == (trace_id, span_id)
    assert inside.trace_id == ep.trace_id
    assert (inside.rl_step, inside.rl_episode_id) == (4, "ep-4")
    assert (before.trace_id, before.span_id, before.rl_step, before.rl_episode_id) == ("", "", None, None)
    # usable in a format string, inside and outside
    fmt = logging.Formatter("%(trace_id)s %(rl_step)s %(message)s")
    assert fmt.format(inside) == f"{trace_id} 4 inside"
    assert fmt.format(before) == " None before"


def test_uninstrument_stops_stamping(configured, app_logger):
    logger, handler = app_logger
    otr.instrument_logging()
    otr.uninstrument_logging()
    with otr.episode(step=0) as ep:
        logger.info("inside")
        ep.reward(0.0)
    assert not hasattr(handler.records[0], "trace_id")


def test_a_logger_filter_instead_of_the_global_factory(configured, app_logger):
    logger, handler = app_logger
    otr.instrument_logging(logger)
    other = logging.getLogger("otr-test-other")
    other.propagate = False
    other_handler = _Collect()
    other.addHandler(other_handler)
    try:
        with otr.episode(step=1) as ep:
            logger.warning("mine")
            other.warning("not mine")
            ep.reward(0.0)
    finally:
        other.removeHandler(other_handler)
    assert handler.records[0].trace_id == ep.trace_id
    assert not hasattr(other_handler.records[0], "trace_id")


def test_server_side_records_take_step_and_episode_from_baggage(configured, app_logger):
    logger, handler = app_logger
    otr.instrument_logging()
    with otr.episode(step=7, episode_id="e7") as ep:
        headers = otr.inject_headers()
        ep.reward(1.0)
    token = otel_context.attach(otr.extract_context(headers))  # as a server would
    try:
        logger.info("served")
    finally:
        otel_context.detach(token)
    record = handler.records[0]
    assert record.trace_id == ep.trace_id
    assert (record.rl_step, record.rl_episode_id) == (7, "e7")


def test_records_exported_over_the_sdk_log_pipeline_with_the_run_resource(configured, app_logger):
    logger, _ = app_logger
    exporter = InMemoryLogRecordExporter()
    integration = otr.instrument_logging(logger, exporter=exporter)
    with otr.episode(step=2, episode_id="e2") as ep:
        with ep.turn() as turn, turn.generation("policy"):
            logger.error("generation failed: %s", "timeout")
            trace_id, span_id = _ids()
        ep.reward(0.0)
    assert integration.flush()
    (exported,) = [r for r in exporter.get_finished_logs() if r.log_record.event_name is None]  # not the events
    log = exported.log_record
    assert (f"{log.trace_id:032x}", f"{log.span_id:016x}") == (trace_id, span_id)
    assert log.body == "generation failed: timeout"
    assert log.severity_text == "ERROR"
    assert log.attributes[c.RL_STEP] == 2 and log.attributes[c.RL_EPISODE_ID] == "e2"
    assert exported.resource.attributes == _runtime.installed().provider.resource.attributes
    assert exported.resource.attributes[c.RL_RUN_ID] == _runtime.installed().run_id


def _log_in_worker(message: str) -> dict:
    """In a worker process: log one record and return the fields it was stamped with."""
    logger = logging.getLogger("otr-test-worker")
    logger.propagate = False
    handler = _Collect()
    logger.addHandler(handler)
    logger.warning(message)
    record = handler.records[-1]
    return {k: getattr(record, k, "missing") for k in ("trace_id", "span_id", "rl_step", "rl_episode_id")}


def test_records_in_a_worker_process_carry_the_parent_episode(configured):
    import multiprocessing

    ctx = multiprocessing.get_context("spawn")
    with ctx.Pool(1, initializer=otr.instrument_logging) as pool:
        with otr.episode(step=3, episode_id="w3") as ep:
            with ep.turn():
                trace_id, span_id = _ids()
                fields = otr.adopt(pool.apply(otr.with_context(_log_in_worker), ("from worker",)))
            ep.reward(1.0)
    assert fields == {"trace_id": trace_id, "span_id": span_id, "rl_step": 3, "rl_episode_id": "w3"}


def test_a_kept_episodes_evaluations_go_out_as_log_based_events(configured, app_logger):
    # the GenAI conventions' carrier for gen_ai.evaluation.result now that span events are
    # deprecated: one log record per score (and the status), parented to the evaluated root
    logger, _ = app_logger
    exporter = InMemoryLogRecordExporter()
    integration = otr.instrument_logging(logger, exporter=exporter)
    with otr.episode(step=5, episode_id="kept") as ep:
        ep.reward(0.75, components={"correct": 1.0}, advantage=0.25)
    otr.end_step(5)
    assert otr.flush() and integration.flush()
    (root,) = [s for s in configured.get_finished_spans() if s.parent is None]
    events = [r for r in exporter.get_finished_logs() if r.log_record.event_name == c.EVENT_GEN_AI_EVALUATION_RESULT]
    by_name = {dict(r.log_record.attributes)[c.GEN_AI_EVALUATION_NAME]: r for r in events}
    assert set(by_name) == {c.EVALUATION_REWARD, "correct", c.EVALUATION_ADVANTAGE, c.EVALUATION_STATUS}
    assert dict(by_name[c.EVALUATION_REWARD].log_record.attributes)[c.GEN_AI_EVALUATION_SCORE_VALUE] == 0.75
    assert dict(by_name[c.EVALUATION_STATUS].log_record.attributes)[c.GEN_AI_EVALUATION_SCORE_LABEL] == c.STATUS_OK
    for r in events:
        assert (r.log_record.trace_id, r.log_record.span_id) == (root.context.trace_id, root.context.span_id)
        assert r.resource.attributes[c.RL_RUN_ID] == _runtime.installed().run_id
    # the same events as span events on the root: one carrier for each kind of backend
    span_events = {e.attributes[c.GEN_AI_EVALUATION_NAME] for e in root.events
                   if e.name == c.EVENT_GEN_AI_EVALUATION_RESULT}
    assert span_events == set(by_name)
