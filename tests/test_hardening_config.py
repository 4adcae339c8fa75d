"""Configuration never crashes training: a bad OTEL_* / OTEL_ROLLOUTS_* value gives one warning
naming the variable and the default used, and nothing raises (issue 28)."""

from __future__ import annotations

import logging
import os
import subprocess
import sys

import pytest
from opentelemetry.sdk.trace import SpanLimits, TracerProvider
from opentelemetry.sdk.trace.export.in_memory_span_exporter import InMemorySpanExporter

import otel_rollouts as otr


def _warnings_about(caplog: pytest.LogCaptureFixture, variable: str) -> list[str]:
    return [r.getMessage() for r in caplog.records
            if r.levelno >= logging.WARNING and variable in r.getMessage()]


def _configure_with(monkeypatch: pytest.MonkeyPatch, variable: str, value: str) -> otr.Rollouts:
    monkeypatch.setenv(variable, value)
    return otr.configure(exporters=[InMemorySpanExporter()], install=False, handle_signals=False)


@pytest.mark.parametrize(("variable", "value"), [
    ("OTEL_SPAN_ATTRIBUTE_VALUE_LENGTH_LIMIT", "abc"),
    ("OTEL_SPAN_ATTRIBUTE_COUNT_LIMIT", "-3"),
    ("OTEL_ATTRIBUTE_COUNT_LIMIT", "-1"),
    ("OTEL_ATTRIBUTE_VALUE_LENGTH_LIMIT", "lots"),
    ("OTEL_SPAN_EVENT_COUNT_LIMIT", "1.5"),
    ("OTEL_LINK_ATTRIBUTE_COUNT_LIMIT", "x"),
])
def test_a_bad_limit_warns_once_and_configure_does_not_raise(monkeypatch, caplog, variable, value):
    caplog.set_level(logging.WARNING)
    rollouts = _configure_with(monkeypatch, variable, value)
    try:
        warned = _warnings_about(caplog, variable)
        assert len(warned) == 1, warned
        assert "instead" in warned[0]  # names the default used
        # what the SDK will read later is valid too: its own readers do not raise
        SpanLimits()
        TracerProvider()
    finally:
        rollouts.shutdown(5.0)


@pytest.mark.parametrize(("variable", "value"), [
    ("OTEL_EXPORTER_OTLP_TIMEOUT", "abc"),
    ("OTEL_EXPORTER_OTLP_TRACES_TIMEOUT", "-2"),
    ("OTEL_EXPORTER_OTLP_COMPRESSION", "zz"),
    ("OTEL_EXPORTER_OTLP_TRACES_COMPRESSION", "brotli"),
    ("OTEL_EXPORTER_OTLP_ENDPOINT", "http://[::1"),
    ("OTEL_EXPORTER_OTLP_HEADERS", "api-key=abc,not a header"),
    ("OTEL_EXPORTER_OTLP_PROTOCOL", "carrier-pigeon"),
])
def test_a_bad_otlp_variable_warns_once_and_the_sdk_exporters_build(monkeypatch, caplog, variable, value):
    from opentelemetry.exporter.otlp.proto.grpc.trace_exporter import OTLPSpanExporter as Grpc
    from opentelemetry.exporter.otlp.proto.http.trace_exporter import OTLPSpanExporter as Http

    caplog.set_level(logging.WARNING)
    rollouts = _configure_with(monkeypatch, variable, value)
    try:
        warned = _warnings_about(caplog, variable)
        assert len(warned) == 1, warned
        assert "instead" in warned[0]
        for exporter in (Grpc(), Http()):  # read the same environment: no ValueError
            exporter.shutdown()
        assert len(_warnings_about(caplog, variable)) == 1  # the SDK did not warn again
    finally:
        rollouts.shutdown(5.0)


def test_a_header_or_endpoint_value_is_not_printed_in_the_warning(monkeypatch, caplog):
    from otel_rollouts._core.settings import check_environment

    caplog.set_level(logging.WARNING)
    monkeypatch.setenv("OTEL_EXPORTER_OTLP_HEADERS", "authorization=Bearer hunter2hunter2,oops")
    check_environment()
    text = "\n".join(r.getMessage() for r in caplog.records)
    assert "OTEL_EXPORTER_OTLP_HEADERS" in text
    assert "hunter2" not in text


@pytest.mark.parametrize(("variable", "value"), [
    ("OTEL_SPAN_ATTRIBUTE_COUNT_LIMIT", "-3"),
    ("OTEL_SPAN_ATTRIBUTE_VALUE_LENGTH_LIMIT", "abc"),
    ("OTEL_ATTRIBUTE_COUNT_LIMIT", "many"),
])
def test_import_never_raises_on_the_environment(variable, value):
    env = dict(os.environ, **{variable: value})
    done = subprocess.run([sys.executable, "-c", "import otel_rollouts"], env=env,
                          capture_output=True, text=True, timeout=120)
    assert done.returncode == 0, done.stderr
    assert done.stderr.count(variable) == 1, done.stderr


def test_a_bad_boolean_option_falls_back_to_its_default(monkeypatch, caplog):
    caplog.set_level(logging.WARNING)
    rollouts = _configure_with(monkeypatch, "OTEL_INSTRUMENTATION_GENAI_CAPTURE_MESSAGE_CONTENT", "maybe")
    try:
        assert rollouts.settings.content.capture_content is True
        assert len(_warnings_about(caplog, "OTEL_INSTRUMENTATION_GENAI_CAPTURE_MESSAGE_CONTENT")) == 1
    finally:
        rollouts.shutdown(5.0)


def test_valid_values_are_kept_and_the_table_is_one_place(monkeypatch):
    from otel_rollouts._core.settings import ENV_TABLE, ENV_VARIABLES, check_environment

    monkeypatch.setenv("OTEL_EXPORTER_OTLP_TIMEOUT", "7.5")
    monkeypatch.setenv("OTEL_SPAN_ATTRIBUTE_COUNT_LIMIT", "64")
    values = check_environment()
    assert values["OTEL_EXPORTER_OTLP_TIMEOUT"] == 7.5
    assert os.environ["OTEL_EXPORTER_OTLP_TIMEOUT"] == "7.5"  # a valid value is never touched
    names = [entry.variable for entry in ENV_VARIABLES]
    assert len(names) == len(set(names))
    assert set(ENV_TABLE) <= set(ENV_VARIABLES)
    assert all(n.startswith("OTEL_") for n in names)


def test_a_misspelled_propagator_does_not_break_the_instrumentations_import():
    # opentelemetry.propagate (what the FastAPI/httpx instrumentations import) raises at import
    env = dict(os.environ, OTEL_PROPAGATORS="tracecontext,bogus")
    done = subprocess.run([sys.executable, "-c", "import otel_rollouts, opentelemetry.propagate"],
                          env=env, capture_output=True, text=True, timeout=120)
    assert done.returncode == 0, done.stderr
    assert done.stderr.count("OTEL_PROPAGATORS") == 1, done.stderr
