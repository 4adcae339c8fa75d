"""The standard OTLP environment honoured: ``OTEL_TRACES_EXPORTER`` picks configure()'s default
exporters, and ``OTEL_EXPORTER_OTLP_(SIGNAL_)PROTOCOL=http/json`` posts OTLP/JSON (hex ids,
``Content-Type: application/json``) to a real OTLP/HTTP receiver, for spans, logs and metrics."""

from __future__ import annotations

import json
import logging
import os
import re
from pathlib import Path

import pytest
from otlp_sink import OtlpSink

import otel_rollouts as otr
from otel_rollouts import conventions as c
from otel_rollouts._core.env import HTTP_JSON, otlp_protocol
from otel_rollouts._core.settings import check_environment
from otel_rollouts.delivery.defaults import default_exporters
from otel_rollouts.exporters import ConsoleExporter, TrackioExporter
from otel_rollouts.exporters.otlp_json import decode_message

_HEX32 = re.compile(r"[0-9a-f]{32}")
_HEX16 = re.compile(r"[0-9a-f]{16}")


@pytest.fixture(autouse=True)
def clean_env(monkeypatch):
    """No OTLP or exporter variable from the machine running the tests."""
    for name in list(os.environ):
        if name.startswith("OTEL_EXPORTER_OTLP_") or name in (
                c.ENV_TRACES_EXPORTER, c.ENV_METRICS_EXPORTER, c.ENV_LOGS_EXPORTER):
            monkeypatch.delenv(name)


@pytest.fixture
def sink(tmp_path):
    with OtlpSink(tmp_path / "sink") as running:
        yield running


def _types(exporters):
    try:
        return [type(e) for e in exporters]
    finally:
        for exporter in exporters:
            exporter.shutdown()


def _warnings(caplog, variable):
    return [r.getMessage() for r in caplog.records
            if r.levelno >= logging.WARNING and variable in r.getMessage()]


# --- OTEL_TRACES_EXPORTER --------------------------------------------------------------------
def test_the_exporters_named_are_exactly_the_default_exporters(monkeypatch):
    from opentelemetry.exporter.otlp.proto.grpc.trace_exporter import OTLPSpanExporter as Grpc
    from opentelemetry.exporter.otlp.proto.http.trace_exporter import OTLPSpanExporter as Http

    monkeypatch.setenv(c.ENV_OTLP_ENDPOINT, "http://127.0.0.1:4318")
    cases = {
        "otlp": [Grpc],  # a collector only: no local Trackio database written beside it
        "trackio,otlp": [TrackioExporter, Grpc],
        " Console ": [ConsoleExporter],  # our episode tree, not the SDK's JSON dump
        "otlp_proto_http": [Http],
        "otlp_proto_grpc,otlp_proto_grpc": [Grpc],  # repeats built once
        "none": [],
    }
    for value, expected in cases.items():
        monkeypatch.setenv(c.ENV_TRACES_EXPORTER, value)
        assert _types(default_exporters("p")) == expected, value
    monkeypatch.setenv(c.ENV_OTLP_TRACES_PROTOCOL, "http/protobuf")
    monkeypatch.setenv(c.ENV_TRACES_EXPORTER, "otlp")
    assert _types(default_exporters("p")) == [Http]


def test_otlp_named_without_an_endpoint_uses_the_sdk_default_endpoint(monkeypatch):
    # the specification: ``otlp`` alone means the default endpoint (localhost:4317/4318)
    monkeypatch.setenv(c.ENV_TRACES_EXPORTER, "otlp")
    monkeypatch.setenv(c.ENV_OTLP_PROTOCOL, "http/protobuf")
    (exporter,) = default_exporters("p")
    try:
        assert exporter._endpoint == "http://localhost:4318/v1/traces"
    finally:
        exporter.shutdown()


@pytest.mark.parametrize("value, reason", [
    ("otlp,zipkinn", "nor installed ('zipkinn')"),
    ("none,otlp", "none together with other exporters"),
    (" , ", "names no exporter"),
])
def test_an_invalid_list_is_refused_by_name_and_the_defaults_are_used(monkeypatch, caplog, value, reason):
    caplog.set_level(logging.WARNING)
    monkeypatch.setenv(c.ENV_TRACES_EXPORTER, value)
    check_environment()  # what configure() runs first
    (warned,) = _warnings(caplog, c.ENV_TRACES_EXPORTER)
    assert repr(value) in warned and reason in warned and "the default exporters" in warned
    assert c.ENV_TRACES_EXPORTER not in os.environ  # removed: no later reader (the SDK) raises on it
    assert _types(default_exporters("p")) == [TrackioExporter]
    assert len(_warnings(caplog, c.ENV_TRACES_EXPORTER)) == 1


def test_an_invalid_list_read_without_check_environment_still_warns_once(monkeypatch, caplog):
    caplog.set_level(logging.WARNING)
    monkeypatch.setenv(c.ENV_TRACES_EXPORTER, "jaeger-thrift")
    assert _types(default_exporters("p")) == [TrackioExporter]
    assert _types(default_exporters("p")) == [TrackioExporter]
    (warned,) = _warnings(caplog, c.ENV_TRACES_EXPORTER)
    assert "'jaeger-thrift'" in warned


def test_none_exports_nothing_but_episodes_are_still_sampled_and_counted(otr_shutdown, monkeypatch):
    monkeypatch.setenv(c.ENV_TRACES_EXPORTER, "none")
    project = "otr-env-none"
    otr.configure(sampler=otr.TailSampler(1, "top_bottom"), trackio_project=project)
    for reward in range(4):
        with otr.episode(step=0) as ep:
            ep.reward(reward)
    with otr.episode(step=1) as ep:
        ep.reward(0)
    otr.flush()
    stats = otr.stats()
    assert stats["steps"]["0/train"]["seen"] == 4
    assert stats["steps"]["0/train"]["kept"] == 1
    assert stats["steps"]["0/train"]["dropped.sampled_out"] == 3
    assert stats["delivery"] == {}  # no exporter at all
    assert not (Path(os.environ["TRACKIO_DIR"]) / f"{project}.db").exists()


def _install_distribution(root: Path, modules: dict[str, str], exporters: dict[str, str]) -> None:
    """A real installed distribution under ``root`` (put on sys.path by the caller): its modules,
    and a dist-info whose entry_points.txt declares ``exporters`` (name -> "module:attr") in the
    SDK's traces exporter group, where importlib.metadata finds them as it finds any package."""
    from otel_rollouts._core.settings import TRACES_EXPORTER_GROUP

    for module, source in modules.items():
        (root / f"{module}.py").write_text(source)
    info = root / "otr_hostile_exporters-0.1.dist-info"
    info.mkdir()
    (info / "METADATA").write_text("Metadata-Version: 2.1\nName: otr-hostile-exporters\nVersion: 0.1\n")
    lines = [f"[{TRACES_EXPORTER_GROUP}]"] + [f"{name} = {target}" for name, target in exporters.items()]
    (info / "entry_points.txt").write_text("\n".join(lines) + "\n")


def test_an_entry_point_that_exits_or_raises_is_left_out_named_and_counted(
        otr_shutdown, monkeypatch, caplog, tmp_path):
    # third-party exporters named by OTEL_TRACES_EXPORTER: one whose module calls sys.exit() on
    # import, one whose factory raises SystemExit, one that builds a non-exporter; configure()
    # goes on with the one that works, and the run records into it
    _install_distribution(tmp_path, {
        "otr_ep_exits_on_import": "import sys\nsys.exit(3)\n",
        "otr_ep_factories": (
            "from opentelemetry.sdk.trace.export.in_memory_span_exporter import InMemorySpanExporter\n"
            "EXPORTER = InMemorySpanExporter()\n"
            "def exits():\n    raise SystemExit('factory says no')\n"
            "def not_an_exporter():\n    return object()\n"
            "def memory():\n    return EXPORTER\n"),
    }, {
        "otr-exits-on-import": "otr_ep_exits_on_import:make",
        "otr-exits-in-factory": "otr_ep_factories:exits",
        "otr-not-an-exporter": "otr_ep_factories:not_an_exporter",
        "otr-memory": "otr_ep_factories:memory",
    })
    monkeypatch.syspath_prepend(str(tmp_path))
    caplog.set_level(logging.WARNING)
    monkeypatch.setenv(c.ENV_TRACES_EXPORTER,
                       "otr-exits-on-import,otr-exits-in-factory,otr-not-an-exporter,otr-memory")
    run = otr.configure(sampler=otr.TailSampler(1000, "first"))  # SystemExit here ended the program
    import otr_ep_factories

    with otr.episode(step=0) as ep:
        ep.reward(1.0)
    otr.flush()
    assert {s.name for s in otr_ep_factories.EXPORTER.get_finished_spans()} >= {"episode"}
    warned = "\n".join(_warnings(caplog, c.ENV_TRACES_EXPORTER))
    assert "entry point otr-exits-on-import = otr_ep_exits_on_import:make" in warned
    assert "raised SystemExit: 3" in warned
    assert "entry point otr-exits-in-factory = otr_ep_factories:exits" in warned
    assert "raised SystemExit: factory says no" in warned
    assert "built a object, not a span exporter" in warned
    totals = run.stats()["totals"]
    assert {name: totals.get(f"errors.build_exporter.{name}") for name in (
        "otr-exits-on-import", "otr-exits-in-factory", "otr-not-an-exporter", "otr-memory")} == {
        "otr-exits-on-import": 1, "otr-exits-in-factory": 1, "otr-not-an-exporter": 1, "otr-memory": None}


def test_ctrl_c_while_an_entry_point_loads_stops_the_main_thread_only(monkeypatch, tmp_path):
    # the policy for user code everywhere (content.reraise_interrupt): Ctrl-C on the main thread
    # still stops the program; on another thread a KeyboardInterrupt is only a failure, left out
    import threading

    _install_distribution(tmp_path, {
        "otr_ep_interrupt": "def make():\n    raise KeyboardInterrupt\n",
    }, {"otr-interrupt": "otr_ep_interrupt:make"})
    monkeypatch.syspath_prepend(str(tmp_path))
    monkeypatch.setenv(c.ENV_TRACES_EXPORTER, "otr-interrupt")
    built: list[object] = []
    worker = threading.Thread(target=lambda: built.append(default_exporters("p")))
    worker.start()
    worker.join(timeout=30)
    assert built == [[]]
    if threading.current_thread() is threading.main_thread():
        with pytest.raises(KeyboardInterrupt):
            default_exporters("p")


# --- OTEL_EXPORTER_OTLP_PROTOCOL=http/json --------------------------------------------------
def test_spans_are_posted_as_otlp_json_with_hex_ids(otr_shutdown, monkeypatch, sink):
    from opentelemetry.proto.collector.trace.v1.trace_service_pb2 import ExportTraceServiceRequest

    monkeypatch.setenv(c.ENV_TRACES_EXPORTER, "otlp")
    monkeypatch.setenv(c.ENV_OTLP_PROTOCOL, "http/json")
    monkeypatch.setenv(c.ENV_OTLP_TRACES_ENDPOINT, sink.endpoint)
    monkeypatch.setenv("OTEL_EXPORTER_OTLP_TRACES_COMPRESSION", "gzip")
    monkeypatch.setenv("OTEL_EXPORTER_OTLP_TRACES_HEADERS", "authorization=Bearer%20t0ken")
    otr.configure(sampler=otr.TailSampler(1000, "first"), run_id="json-run")

    @otr.traced(kind="generation")
    def generate(prompt: str) -> str:
        return prompt.upper()

    with otr.episode(step=3) as ep:
        generate("hello")
        ep.reward(1.0)
    otr.flush()

    (request,) = sink.wait_for_json("/v1/traces")
    assert request["content_type"] == "application/json"
    assert request["content_encoding"] == "gzip"
    assert sink.state()["authorization"] == ["Bearer t0ken"]
    assert sink.spans() == []  # nothing was sent as protobuf
    parsed = decode_message(request["body"], ExportTraceServiceRequest())
    raw = json.loads(request["body"])
    raw_spans = [s for rs in raw["resourceSpans"] for ss in rs["scopeSpans"] for s in ss["spans"]]
    spans = [s for rs in parsed.resource_spans for ss in rs.scope_spans for s in ss.spans]
    assert len(raw_spans) == len(spans) >= 2
    for text, span in zip(raw_spans, spans, strict=True):
        # OTLP/JSON: ids in lowercase hex (protobuf's own mapping would write base64)
        assert _HEX32.fullmatch(text["traceId"]) and text["traceId"] == span.trace_id.hex()
        assert _HEX16.fullmatch(text["spanId"]) and text["spanId"] == span.span_id.hex()
        assert isinstance(text["kind"], int)  # enums as integers
        assert text.get("parentSpanId", "") == span.parent_span_id.hex()
    root = next(s for s in spans if not s.parent_span_id)
    assert any(s.parent_span_id == root.span_id for s in spans)  # the tree, joined by hex ids
    assert {s.trace_id for s in spans} == {root.trace_id}
    attributes = {kv.key: kv.value for kv in parsed.resource_spans[0].resource.attributes}
    assert attributes[c.RL_RUN_ID].string_value == "json-run"


def test_log_records_are_posted_as_otlp_json_with_hex_ids(monkeypatch, sink):
    from opentelemetry._logs import LogRecord, SeverityNumber
    from opentelemetry.proto.collector.logs.v1.logs_service_pb2 import ExportLogsServiceRequest
    from opentelemetry.sdk._logs import LoggerProvider
    from opentelemetry.sdk._logs.export import SimpleLogRecordProcessor
    from opentelemetry.sdk.trace import TracerProvider

    from otel_rollouts.delivery.defaults import otlp_log_exporter

    monkeypatch.setenv(c.ENV_OTLP_LOGS_PROTOCOL, "http/json")
    monkeypatch.setenv("OTEL_EXPORTER_OTLP_LOGS_ENDPOINT", sink.logs_endpoint)
    provider = LoggerProvider(shutdown_on_exit=False)
    provider.add_log_record_processor(SimpleLogRecordProcessor(otlp_log_exporter()))
    try:
        with TracerProvider().get_tracer("t").start_as_current_span("step") as span:
            provider.get_logger("t").emit(LogRecord(body="reward model slow", severity_text="WARNING",
                                                    severity_number=SeverityNumber.WARN))
        provider.force_flush()
    finally:
        provider.shutdown()
    (request,) = sink.wait_for_json("/v1/logs")
    assert request["content_type"] == "application/json"
    assert sink.logs() == []  # not protobuf
    parsed = decode_message(request["body"], ExportLogsServiceRequest())
    (record,) = [r for rl in parsed.resource_logs for sl in rl.scope_logs for r in sl.log_records]
    assert record.body.string_value == "reward model slow"
    assert record.trace_id == span.get_span_context().trace_id.to_bytes(16, "big")
    assert f'"traceId":"{span.get_span_context().trace_id:032x}"' in request["body"]
    assert f'"spanId":"{span.get_span_context().span_id:016x}"' in request["body"]


def test_metrics_are_posted_as_otlp_json(monkeypatch, sink):
    from opentelemetry.proto.collector.metrics.v1.metrics_service_pb2 import (
        ExportMetricsServiceRequest,
    )
    from opentelemetry.sdk.resources import Resource

    from otel_rollouts.correlate.metrics import meter_provider

    monkeypatch.setenv(c.ENV_METRICS_EXPORTER, "otlp")
    monkeypatch.setenv(c.ENV_OTLP_METRICS_PROTOCOL, "http/json")
    monkeypatch.setenv("OTEL_EXPORTER_OTLP_METRICS_ENDPOINT", f"http://127.0.0.1:{sink.port}/v1/metrics")
    provider = meter_provider(Resource.create({"service.name": "json-metrics"}), None)
    assert provider is not None
    try:
        provider.get_meter("t").create_counter("rl.test.count").add(3)
        assert provider.force_flush()
    finally:
        provider.shutdown()
    request = sink.wait_for_json("/v1/metrics")[0]
    assert request["content_type"] == "application/json"
    parsed = decode_message(request["body"], ExportMetricsServiceRequest())
    metrics = {m.name: m for rm in parsed.resource_metrics for sm in rm.scope_metrics for m in sm.metrics}
    assert metrics["rl.test.count"].sum.data_points[0].as_int == 3


def test_an_unknown_protocol_is_refused_by_name_and_the_general_one_applies(monkeypatch, caplog):
    caplog.set_level(logging.WARNING)
    monkeypatch.setenv(c.ENV_OTLP_PROTOCOL, "http/json")
    monkeypatch.setenv(c.ENV_OTLP_TRACES_PROTOCOL, "http/xml")
    # before the check, too: never guessed from an "http" prefix
    assert otlp_protocol(c.ENV_OTLP_TRACES_PROTOCOL) == HTTP_JSON
    check_environment()
    (warned,) = _warnings(caplog, c.ENV_OTLP_TRACES_PROTOCOL)
    assert "'http/xml'" in warned
    assert otlp_protocol(c.ENV_OTLP_TRACES_PROTOCOL) == HTTP_JSON


def test_a_sink_killed_mid_write_restarts_without_a_torn_line(tmp_path):
    """The test receiver itself (tests/otlp_sink.py), as the outage and soak tests use it: killed
    while writing a request it never answered, it restarts with every answered record readable
    (the torn one cut off), and what it receives next reads back whole. Once, under load, a torn
    record joined the next one into one unreadable line and failed the soak test."""
    from opentelemetry.exporter.otlp.proto.http.trace_exporter import OTLPSpanExporter
    from opentelemetry.sdk.trace import TracerProvider
    from opentelemetry.sdk.trace.export import SimpleSpanProcessor

    sink = OtlpSink(tmp_path / "sink").start()
    provider = TracerProvider()
    provider.add_span_processor(SimpleSpanProcessor(OTLPSpanExporter(endpoint=sink.endpoint, timeout=10)))
    try:
        def send(name: str) -> None:  # exported, and answered, before it returns
            provider.get_tracer("t").start_span(name).end()

        send("answered")
        sink.kill()
        with open(sink.out, "a", encoding="utf-8") as fh:  # what a kill inside a write leaves
            fh.write('{"trace_id": "0123", "name": "torn mid-wr')
        sink.start()
        send("after the restart")
        assert [s["name"] for s in sink.spans()] == ["answered", "after the restart"]
    finally:
        provider.shutdown()
        sink.kill()
