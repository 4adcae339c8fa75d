"""OtlpJsonFileExporter and ``otel-rollouts replay``: OTLP/JSON lines out, the same spans back in."""

from __future__ import annotations

import json
import os
import stat
import subprocess
import sys
import threading
from pathlib import Path

import pytest
from opentelemetry.sdk.resources import Resource
from opentelemetry.sdk.trace import ReadableSpan, TracerProvider
from opentelemetry.sdk.trace.export import SimpleSpanProcessor, SpanExportResult
from opentelemetry.sdk.trace.export.in_memory_span_exporter import InMemorySpanExporter
from opentelemetry.trace import SpanKind
from otr_scenario import (
    SPANS_PER_EPISODE,
    TOOL_ERROR,
    kept_by_top_bottom,
    record_step,
    run_python,
    trackio_traces,
)

import otel_rollouts as otr
from otel_rollouts import conventions as c
from otel_rollouts.delivery.replay import replay, spans_from_file
from otel_rollouts.exporters import OtlpJsonFileExporter
from otel_rollouts.exporters.otlp_json import decode_line, read_requests, rotated_paths

REWARDS = [0.4, 0.9, 0.1, 0.6]


@pytest.fixture
def recorded_file(tmp_path: Path):
    """A step of 4 episodes (2 kept) written to a file and to memory; yields both views."""
    path = tmp_path / "rollouts.jsonl"
    memory = InMemorySpanExporter()
    otr.configure(
        service_name="otlp-json-test",
        exporters=[OtlpJsonFileExporter(path), memory],
        sampler=otr.TailSampler(2, "top_bottom"),
        resource_attributes={"openinference.project.name": "json-test"},
    )
    try:
        recorded = record_step(3, REWARDS)
        assert otr.flush(30)
        spans = list(memory.get_finished_spans())
    finally:
        otr.shutdown()
    yield path, recorded, spans


def _key(span: ReadableSpan):
    return (span.context.trace_id, span.context.span_id)


def test_lines_are_otlp_json_one_kept_episode_each(recorded_file) -> None:
    path, recorded, _ = recorded_file
    kept, dropped = kept_by_top_bottom(recorded)
    raw = path.read_bytes()
    assert raw.endswith(b"\n")
    lines = [json.loads(line) for line in raw.decode().splitlines()]
    assert len(lines) == 2

    trace_ids = set()
    for request in lines:
        (resource_spans,) = request["resourceSpans"]
        resource = {kv["key"]: kv["value"] for kv in resource_spans["resource"]["attributes"]}
        assert resource["service.name"] == {"stringValue": "otlp-json-test"}
        assert resource["openinference.project.name"] == {"stringValue": "json-test"}
        (scope_spans,) = resource_spans["scopeSpans"]
        assert scope_spans["scope"]["name"] == "otel_rollouts"
        spans = scope_spans["spans"]
        assert len(spans) == SPANS_PER_EPISODE
        for span in spans:
            # OTLP/JSON: ids are lowercase hex (not protobuf's base64), enums are integers
            assert len(span["traceId"]) == 32 and int(span["traceId"], 16)
            assert span["traceId"] == span["traceId"].lower()
            assert len(span["spanId"]) == 16 and int(span["spanId"], 16)
            # enums are integers: SPAN_KIND_CLIENT (3) for a generation, else INTERNAL (1)
            assert span["kind"] == (3 if span["name"].startswith(c.SPAN_CHAT) else 1)
            assert span["startTimeUnixNano"].isdigit()  # int64 as a JSON string
            trace_ids.add(span["traceId"])
        by_name = {s["name"]: s for s in spans}
        root = by_name["episode"]
        assert "parentSpanId" not in root
        assert {s["parentSpanId"] for s in spans if s is not root} <= {s["spanId"] for s in spans}
        attrs = {kv["key"]: kv["value"] for kv in root["attributes"]}
        assert set(attrs["rl.reward.score"]) == {"doubleValue"}
        assert attrs["rl.step"] == {"intValue": "3"}
        failed = by_name["execute_tool search"]
        assert failed["status"]["code"] == 2  # STATUS_CODE_ERROR
        assert TOOL_ERROR in failed["status"]["message"]
        assert [e["name"] for e in failed["events"]] == ["exception"]
    assert trace_ids == {r.trace_id for r in kept}
    assert not trace_ids & {r.trace_id for r in dropped}


def test_file_is_private(recorded_file) -> None:
    path, _, _ = recorded_file
    assert stat.S_IMODE(path.stat().st_mode) == 0o600


def test_replayed_spans_equal_the_exported_ones(recorded_file) -> None:
    path, _, direct = recorded_file
    replayed = [s for spans in spans_from_file(path) for s in spans]
    assert len(replayed) == len(direct) == 2 * SPANS_PER_EPISODE
    by_id = {_key(s): s for s in replayed}
    for original in direct:
        copy = by_id[_key(original)]
        assert copy.name == original.name
        expected_kind = SpanKind.CLIENT if original.name.startswith(c.SPAN_CHAT) else SpanKind.INTERNAL
        assert copy.kind is original.kind is expected_kind
        assert (copy.parent.span_id if copy.parent else None) == (
            original.parent.span_id if original.parent else None
        )
        assert (copy.start_time, copy.end_time) == (original.start_time, original.end_time)
        assert dict(copy.attributes) == {
            k: tuple(v) if isinstance(v, list) else v for k, v in original.attributes.items()
        }
        assert copy.status.status_code is original.status.status_code
        assert copy.status.description == original.status.description
        assert [(e.name, e.timestamp, dict(e.attributes)) for e in copy.events] == [
            (e.name, e.timestamp, dict(e.attributes)) for e in original.events
        ]
        assert dict(copy.resource.attributes) == dict(original.resource.attributes)
        assert copy.instrumentation_scope.name == original.instrumentation_scope.name
        assert copy.instrumentation_scope.version == original.instrumentation_scope.version
    # numbers stay numbers of the same type
    root = next(s for s in replayed if s.name == "episode")
    assert type(root.attributes["rl.reward.score"]) is float
    assert type(root.attributes["rl.step"]) is int


def test_decode_accepts_protobufs_own_base64_ids(recorded_file) -> None:
    """A line written by plain ``MessageToJson`` (base64 ids) still decodes to the same ids."""
    from google.protobuf import json_format

    path, _, _ = recorded_file
    first = path.read_text().splitlines()[0]
    request = decode_line(first)
    base64_line = json_format.MessageToJson(request, indent=None)
    assert json.loads(base64_line)["resourceSpans"][0]["scopeSpans"][0]["spans"][0]["traceId"] != (
        json.loads(first)["resourceSpans"][0]["scopeSpans"][0]["spans"][0]["traceId"]
    )
    assert decode_line(base64_line) == request


def _tracer(exporter):
    provider = TracerProvider(resource=Resource.create({"service.name": "otlp-json-unit"}))
    provider.add_span_processor(SimpleSpanProcessor(exporter))
    return provider, provider.get_tracer("tests.otlp_json")


def test_rotation_by_size_keeps_newest_lines(tmp_path: Path) -> None:
    path = tmp_path / "spans.jsonl"
    exporter = OtlpJsonFileExporter(path, max_bytes=4000, backups=2)
    provider, tracer = _tracer(exporter)
    names = [f"span-{i:03d}-" + "x" * 200 for i in range(60)]
    for name in names:
        tracer.start_span(name).end()
    provider.shutdown()

    files = rotated_paths(path)
    assert [p.name for p in files] == ["spans.jsonl.2", "spans.jsonl.1", "spans.jsonl"]
    assert not (tmp_path / "spans.jsonl.3").exists()
    assert exporter.rotations >= 3
    for file in files:
        assert 0 < file.stat().st_size <= 4000
        assert stat.S_IMODE(file.stat().st_mode) == 0o600
    read_back = [s.name for spans in spans_from_file(path) for s in spans]
    # the oldest lines were rotated away; what is left is the newest run of lines, in order
    assert read_back == names[-len(read_back):]
    assert 10 < len(read_back) < len(names)


def test_threads_append_whole_lines(tmp_path: Path) -> None:
    path = tmp_path / "threads.jsonl"
    exporter = OtlpJsonFileExporter(path, max_bytes=50_000, backups=1000)
    provider, tracer = _tracer(exporter)

    def work(worker: int) -> None:
        for i in range(40):
            tracer.start_span(f"w{worker}-{i}", attributes={"payload": "y" * (50 + 37 * i)}).end()

    threads = [threading.Thread(target=work, args=(w,)) for w in range(6)]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    provider.shutdown()

    errors: list[str] = []
    names = [s.name for spans in spans_from_file(path, errors) for s in spans]
    assert errors == []
    assert sorted(names) == sorted(f"w{w}-{i}" for w in range(6) for i in range(40))
    assert exporter.lines_written == 240


def test_reader_skips_a_line_being_written_and_reports_bad_lines(tmp_path: Path) -> None:
    path = tmp_path / "partial.jsonl"
    exporter = OtlpJsonFileExporter(path)
    provider, tracer = _tracer(exporter)
    tracer.start_span("first").end()
    with open(path, "ab") as handle:
        handle.write(b'{"resourceSpans": "not a list"}\n')
    tracer.start_span("second").end()
    provider.shutdown()
    with open(path, "ab") as handle:
        handle.write(b'{"resourceSpans":[{"scopeSpans":[{"spans":[{"name":"half')  # in progress

    errors: list[str] = []
    names = [s.name for spans in spans_from_file(path, errors) for s in spans]
    assert names == ["first", "second"]
    assert len(errors) == 2
    assert errors[0].startswith(f"{path}:2: not an OTLP/JSON trace request")
    assert "incomplete last line" in errors[1]
    with pytest.raises(ValueError, match=":2: not an OTLP/JSON"):
        list(read_requests(path))


def test_write_failure_is_a_failed_export_not_an_exception(tmp_path: Path) -> None:
    blocker = tmp_path / "not-a-dir"
    blocker.write_text("")
    exporter = OtlpJsonFileExporter(blocker / "spans.jsonl")
    memory = InMemorySpanExporter()
    provider, tracer = _tracer(memory)
    tracer.start_span("one").end()
    provider.shutdown()
    assert exporter.export(memory.get_finished_spans()) is SpanExportResult.FAILURE
    exporter.shutdown()
    assert exporter.export(memory.get_finished_spans()) is SpanExportResult.FAILURE


def test_replay_into_an_exporter_counts_what_it_sent(recorded_file) -> None:
    path, recorded, _ = recorded_file
    memory = InMemorySpanExporter()
    result = replay(path, memory, shutdown=False)
    assert (result.lines, result.traces, result.spans, result.ok) == (2, 2, 2 * SPANS_PER_EPISODE, True)
    kept, _ = kept_by_top_bottom(recorded)
    assert {f"{s.context.trace_id:032x}" for s in memory.get_finished_spans()} == {
        r.trace_id for r in kept
    }


def test_replay_cli_to_console(recorded_file) -> None:
    path, recorded, _ = recorded_file
    done = subprocess.run(
        [sys.executable, "-m", "otel_rollouts.cli", "replay", str(path), "--to", "console"],
        capture_output=True, text=True, timeout=60,
    )
    assert done.returncode == 0, done.stderr
    kept, dropped = kept_by_top_bottom(recorded)
    for r in kept:
        assert f"trace {r.trace_id}" in done.stdout
    for r in dropped:
        assert r.trace_id not in done.stdout
    assert "execute_tool search" in done.stdout
    assert "replayed 2 traces (18 spans)" in done.stderr


def test_replay_cli_missing_file_is_a_clear_error(tmp_path: Path) -> None:
    done = subprocess.run(
        [sys.executable, "-m", "otel_rollouts.cli", "replay", str(tmp_path / "nope.jsonl"),
         "--to", "console"],
        capture_output=True, text=True, timeout=60,
    )
    assert done.returncode == 2
    assert "no such file" in done.stderr


_DIRECT_AND_FILE = """
import otel_rollouts as otr
from otel_rollouts.exporters import OtlpJsonFileExporter, TrackioExporter
from otr_scenario import record_step
otr.configure(exporters=[TrackioExporter({project!r}, run="direct"), OtlpJsonFileExporter({path!r})],
              sampler=otr.TailSampler(2, "top_bottom"))
record_step(0, [0.2, 0.8, 0.5])
record_step(1, [0.7, 0.3, 0.6])
assert otr.shutdown(60)
"""


def test_file_replayed_into_trackio_matches_direct_export(tmp_path: Path) -> None:
    trackio_dir, path, project = tmp_path / "trackio", tmp_path / "run.jsonl", "replay-trackio"
    run_python(_DIRECT_AND_FILE.format(project=project, path=str(path)), trackio_dir)
    env = {k: v for k, v in os.environ.items() if not k.startswith("OTEL_")}
    env["TRACKIO_DIR"] = str(trackio_dir)
    done = subprocess.run(
        [sys.executable, "-m", "otel_rollouts.cli", "replay", str(path), "--to", "trackio",
         "--project", project, "--run", "replayed"],
        capture_output=True, text=True, timeout=120, env=env,
    )
    assert done.returncode == 0, done.stderr

    traces = trackio_traces(trackio_dir, project)
    direct = [t for t in traces if t["run_name"] == "direct"]
    replayed = [t for t in traces if t["run_name"] == "replayed"]
    assert len(direct) == 4  # 2 kept per step, 2 steps
    assert sorted(t["step"] for t in replayed) == sorted(t["step"] for t in direct) == [0, 0, 1, 1]

    def by_trace_id(items):
        return {t["metadata"]["trace_id"]: t for t in items}

    direct_by_id, replayed_by_id = by_trace_id(direct), by_trace_id(replayed)
    assert replayed_by_id.keys() == direct_by_id.keys()
    for trace_id, original in direct_by_id.items():
        copy = replayed_by_id[trace_id]
        assert copy["step"] == original["step"] and copy["key"] == original["key"]
        assert copy["spans"] == original["spans"]  # same tree: ids, parents, names, times, status
        assert copy["messages"] == original["messages"]
        assert copy["metadata"] == original["metadata"]
        names = [s["name"] for s in copy["spans"]]
        # the failed search call is marked in Trackio's tree (its name, the one text a row shows)
        assert names[0] == "episode" and any(n.startswith("execute_tool search") for n in names)


def test_links_kinds_remote_parents_and_trace_state_survive(tmp_path: Path) -> None:
    """Foreign OTel spans (e.g. an HTTP client span under an episode) round-trip too."""
    from opentelemetry import trace
    from opentelemetry.trace import Link, SpanContext, TraceFlags, TraceState

    path = tmp_path / "foreign.jsonl"
    memory = InMemorySpanExporter()
    provider, tracer = _tracer(memory)
    remote = SpanContext(0xABC, 0xDEF, is_remote=True, trace_flags=TraceFlags(1),
                         trace_state=TraceState([("vendor", "v1")]))
    linked = SpanContext(0x1234, 0x5678, is_remote=False, trace_flags=TraceFlags(1))
    with tracer.start_as_current_span(
        "POST /v1/chat/completions", context=trace.set_span_in_context(trace.NonRecordingSpan(remote)),
        kind=SpanKind.CLIENT, links=[Link(linked, {"link.reason": "retry-of"})],
        attributes={"http.status_code": 200, "tags": ["a", "b"], "ratio": 0.5, "ok": True},
    ):
        pass
    provider.shutdown()
    exporter = OtlpJsonFileExporter(path)
    assert exporter.export(memory.get_finished_spans()) is SpanExportResult.SUCCESS
    exporter.shutdown()

    line = json.loads(path.read_text())
    pb_span = line["resourceSpans"][0]["scopeSpans"][0]["spans"][0]
    assert pb_span["parentSpanId"] == f"{0xDEF:016x}"
    assert pb_span["links"][0]["traceId"] == f"{0x1234:032x}"  # link ids are hex too
    assert pb_span["links"][0]["spanId"] == f"{0x5678:016x}"
    assert pb_span["kind"] == 3  # SPAN_KIND_CLIENT

    (original,) = memory.get_finished_spans()
    ((copy,),) = list(spans_from_file(path))
    assert copy.kind is SpanKind.CLIENT
    assert copy.context.trace_id == original.context.trace_id == 0xABC
    assert copy.parent.span_id == 0xDEF and copy.parent.is_remote
    assert copy.context.trace_state.get("vendor") == "v1"
    assert [(lk.context.trace_id, lk.context.span_id, dict(lk.attributes)) for lk in copy.links] == [
        (0x1234, 0x5678, {"link.reason": "retry-of"})
    ]
    assert dict(copy.attributes) == {"http.status_code": 200, "tags": ("a", "b"), "ratio": 0.5,
                                     "ok": True}
