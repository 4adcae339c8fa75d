"""Capture off (``capture_content=False``) drops every free text at render time, whatever
recorded it: ``ToolCall.error`` texts, status descriptions set through the OpenTelemetry API,
exception messages, and other instrumentation's spans (issue 28)."""

from __future__ import annotations

import json
from pathlib import Path

from opentelemetry import trace
from opentelemetry.sdk.trace.export.in_memory_span_exporter import InMemorySpanExporter
from opentelemetry.trace.status import Status, StatusCode

import otel_rollouts as otr
from otel_rollouts.exporters import OtlpJsonFileExporter

SECRET = "the-answer-is-forty-two"


def _everything(spans) -> str:
    """Every text a rendered span carries: name, attributes, events, status."""
    parts = []
    for span in spans:
        parts.append(span.name)
        parts.append(json.dumps(dict(span.attributes or {}), default=str))
        for event in span.events:
            parts.append(event.name)
            parts.append(json.dumps(dict(event.attributes or {}), default=str))
        parts.append(span.status.description or "")
    return "\n".join(parts)


def _run(tmp_path: Path, record) -> tuple[str, str]:
    memory = InMemorySpanExporter()
    path = tmp_path / "spans.jsonl"
    rollouts = otr.configure(exporters=[memory, OtlpJsonFileExporter(path)], capture_content=False,
                             sampler=otr.TailSampler(100, "first"), handle_signals=False)
    try:
        with otr.episode(step=0) as ep:
            record(ep, rollouts)
            ep.reward(1.0)
        otr.end_step(0)
        assert otr.flush(10.0)
    finally:
        otr.shutdown(10.0)
    spans = memory.get_finished_spans()
    assert spans
    return _everything(spans), path.read_text()


def test_a_tool_call_error_text_is_dropped(tmp_path, otr_shutdown):
    def record(ep, _):
        with ep.turn() as turn:
            call = turn.tool_call("search", {"q": "x"})
            call.error(f"tool said {SECRET}")

    rendered, on_disk = _run(tmp_path, record)
    assert SECRET not in rendered and SECRET not in on_disk


def test_a_status_description_set_through_the_api_is_dropped(tmp_path, otr_shutdown):
    def record(ep, _):
        with ep.turn():
            trace.get_current_span().set_status(Status(StatusCode.ERROR, f"failed on {SECRET}"))

    rendered, on_disk = _run(tmp_path, record)
    assert SECRET not in rendered and SECRET not in on_disk


def test_other_instrumentations_status_and_exception_are_dropped(tmp_path, otr_shutdown):
    def record(ep, rollouts):
        tracer = rollouts.tracer_provider().get_tracer("other.instrumentation")
        with tracer.start_as_current_span("http call") as span:
            span.record_exception(RuntimeError(f"upstream {SECRET}"))
            span.set_status(Status(StatusCode.ERROR, f"upstream said {SECRET}"))
        with tracer.start_as_current_span("db call") as span:  # a description, no exception
            span.set_status(Status(StatusCode.ERROR, f"row {SECRET} not found"))
        with ep.turn():  # ours: an exception recorded through the API, a description beside it
            span = trace.get_current_span()
            span.record_exception(ValueError(f"bad {SECRET}"))
            span.set_status(Status(StatusCode.ERROR, f"bad {SECRET}"))

    rendered, on_disk = _run(tmp_path, record)
    assert SECRET not in rendered and SECRET not in on_disk
    assert "RuntimeError" in rendered and "ValueError" in rendered  # the types stay
