"""The OpenTelemetry SDK's own log records (loggers ``opentelemetry.*``) pass through our
redaction: a gRPC endpoint's ``user:password`` and a mistyped OTEL_EXPORTER_OTLP_HEADERS item
were printed as they are (issue 28). Real OTLP exporters, a closed local port."""

from __future__ import annotations

import logging
import socket

import pytest
from opentelemetry.exporter.otlp.proto.grpc.trace_exporter import OTLPSpanExporter
from opentelemetry.sdk.trace import TracerProvider
from opentelemetry.sdk.trace.export import SimpleSpanProcessor
from opentelemetry.sdk.trace.export.in_memory_span_exporter import InMemorySpanExporter

from otel_rollouts._core.redaction import make_redactor

PASSWORD = "hunter2hunter2"
HEADER_TOKEN = "tok3n-value-not-url-encoded"


def _closed_port() -> int:
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        return sock.getsockname()[1]


def _one_span():
    memory = InMemorySpanExporter()
    provider = TracerProvider()
    provider.add_span_processor(SimpleSpanProcessor(memory))
    provider.get_tracer("t").start_span("s").end()
    provider.shutdown()
    return memory.get_finished_spans()


def _sdk_text(caplog: pytest.LogCaptureFixture) -> str:
    return "\n".join(r.getMessage() for r in caplog.records if r.name.startswith("opentelemetry"))


@pytest.fixture
def sdk_redaction():
    from otel_rollouts._core.redaction import redact_sdk_logs

    # the exporter module's loggers exist (imported above) before the filter goes on, as they
    # do at configure(), which builds the exporters first
    redact_sdk_logs(make_redactor(True))
    yield redact_sdk_logs
    redact_sdk_logs(None)


def test_a_grpc_endpoints_password_is_redacted_in_the_sdks_log(sdk_redaction, caplog):
    caplog.set_level(logging.DEBUG, logger="opentelemetry")
    exporter = OTLPSpanExporter(endpoint=f"http://trainer:{PASSWORD}@127.0.0.1:{_closed_port()}",
                                insecure=True, timeout=0.5)
    try:
        exporter.export(_one_span())
    finally:
        exporter.shutdown()
    text = _sdk_text(caplog)
    assert "127.0.0.1" in text  # the SDK did log the failed export
    assert PASSWORD not in text


def test_a_mistyped_header_is_not_printed_by_the_sdk(sdk_redaction, caplog, monkeypatch):
    caplog.set_level(logging.DEBUG, logger="opentelemetry")
    monkeypatch.setenv("OTEL_EXPORTER_OTLP_HEADERS", f"x-api=ok,{HEADER_TOKEN}")
    OTLPSpanExporter(endpoint=f"127.0.0.1:{_closed_port()}", insecure=True).shutdown()
    text = _sdk_text(caplog)
    assert "Header format invalid" in text  # the SDK did warn
    assert HEADER_TOKEN not in text


def test_removing_the_filter_leaves_the_sdk_loggers_as_they_were(caplog):
    from otel_rollouts._core.redaction import SdkLogFilter, redact_sdk_logs

    redact_sdk_logs(make_redactor(True))
    redact_sdk_logs(None)
    for name in list(logging.Logger.manager.loggerDict):
        if name.startswith("opentelemetry"):
            assert not any(isinstance(f, SdkLogFilter) for f in logging.getLogger(name).filters)


def test_configure_installs_the_sdk_log_redaction_and_shutdown_removes_it(otr_shutdown, caplog):
    import otel_rollouts as otr
    from otel_rollouts._core.redaction import SdkLogFilter

    exporter = OTLPSpanExporter(endpoint=f"http://trainer:{PASSWORD}@127.0.0.1:{_closed_port()}",
                                insecure=True, timeout=0.5)
    otr.configure(exporters=[exporter, InMemorySpanExporter()], handle_signals=False)
    grpc_logger = logging.getLogger("opentelemetry.exporter.otlp.proto.grpc.exporter")
    assert any(isinstance(f, SdkLogFilter) for f in grpc_logger.filters)
    otr.shutdown(5.0)
    assert not any(isinstance(f, SdkLogFilter) for f in grpc_logger.filters)
