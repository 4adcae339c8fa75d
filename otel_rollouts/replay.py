"""Replay an OTLP/JSON-lines file into any exporter: ``otel-rollouts replay FILE --to ...``.

A run on a machine with no collector writes kept episodes with ``OtlpJsonFileExporter``; later,
the file (and its rotated backups, oldest first) is read back and sent on:

* ``--to trackio``: a Trackio project (``--project``, ``--run``), the same traces as a direct
  export would have logged;
* ``--to otlp``: the stock OTLP exporter configured from ``OTEL_EXPORTER_OTLP_*`` (protocol from
  ``OTEL_EXPORTER_OTLP_(TRACES_)PROTOCOL``, default grpc);
* ``--to console``: an indented tree per episode.

Each line becomes SDK ``ReadableSpan`` objects with the ids, parents, names, kinds, times,
attributes, events, links, status, resource and instrumentation scope of the original spans, so
every ``SpanExporter`` accepts them. (Dropped-attribute/event counts are not carried over: the
SDK's ``ReadableSpan`` takes none.)
"""

from __future__ import annotations

import argparse
import logging
import os
import sys
from collections.abc import Iterable, Iterator, Sequence
from dataclasses import dataclass, field
from typing import Any

from opentelemetry.proto.collector.trace.v1.trace_service_pb2 import ExportTraceServiceRequest
from opentelemetry.proto.common.v1.common_pb2 import AnyValue, KeyValue
from opentelemetry.proto.trace.v1.trace_pb2 import Span as PbSpan
from opentelemetry.proto.trace.v1.trace_pb2 import SpanFlags
from opentelemetry.sdk.resources import Resource
from opentelemetry.sdk.trace import Event, ReadableSpan
from opentelemetry.sdk.trace.export import SpanExporter, SpanExportResult
from opentelemetry.sdk.util.instrumentation import InstrumentationScope
from opentelemetry.trace import Link, SpanContext, SpanKind, TraceFlags, TraceState
from opentelemetry.trace.status import Status, StatusCode

__all__ = ["ReplayResult", "main", "replay", "spans_from_request", "spans_from_file"]

logger = logging.getLogger("otel_rollouts")

_KIND = {
    PbSpan.SpanKind.SPAN_KIND_INTERNAL: SpanKind.INTERNAL,
    PbSpan.SpanKind.SPAN_KIND_SERVER: SpanKind.SERVER,
    PbSpan.SpanKind.SPAN_KIND_CLIENT: SpanKind.CLIENT,
    PbSpan.SpanKind.SPAN_KIND_PRODUCER: SpanKind.PRODUCER,
    PbSpan.SpanKind.SPAN_KIND_CONSUMER: SpanKind.CONSUMER,
}
_SAMPLED = TraceFlags(TraceFlags.SAMPLED)
TARGETS = ("trackio", "otlp", "console")


# --- proto -> SDK spans ------------------------------------------------------------------------
def _value(value: AnyValue) -> Any:
    which = value.WhichOneof("value")
    if which is None:
        return None
    if which == "array_value":
        return tuple(_value(v) for v in value.array_value.values)
    if which == "kvlist_value":
        return {kv.key: _value(kv.value) for kv in value.kvlist_value.values}
    return getattr(value, which)


def _attributes(pairs: Iterable[KeyValue]) -> dict[str, Any]:
    return {kv.key: _value(kv.value) for kv in pairs}


def _int_id(raw: bytes) -> int:
    return int.from_bytes(raw, "big") if raw else 0


def _is_remote(flags: int) -> bool:
    return bool(flags & SpanFlags.SPAN_FLAGS_CONTEXT_IS_REMOTE_MASK)


def _trace_flags(flags: int) -> TraceFlags:
    # The low 8 bits carry the W3C trace flags when the sender set them; the SDK's encoder
    # does not, and only sampled spans are exported, so "sampled" is the default.
    low = flags & SpanFlags.SPAN_FLAGS_TRACE_FLAGS_MASK
    return TraceFlags(low) if low else _SAMPLED


def _span(pb: PbSpan, resource: Resource, scope: InstrumentationScope) -> ReadableSpan:
    trace_id = _int_id(pb.trace_id)
    trace_state = TraceState.from_header([pb.trace_state]) if pb.trace_state else TraceState()
    context = SpanContext(
        trace_id, _int_id(pb.span_id), is_remote=False, trace_flags=_trace_flags(pb.flags),
        trace_state=trace_state,
    )
    parent = None
    if pb.parent_span_id:
        parent = SpanContext(
            trace_id, _int_id(pb.parent_span_id), is_remote=_is_remote(pb.flags), trace_flags=_SAMPLED
        )
    code = StatusCode(pb.status.code) if pb.status.code in (0, 1, 2) else StatusCode.UNSET
    status = Status(code, pb.status.message or None) if code is StatusCode.ERROR else Status(code)
    events = tuple(
        Event(e.name, _attributes(e.attributes), timestamp=e.time_unix_nano) for e in pb.events
    )
    links = tuple(
        Link(
            SpanContext(
                _int_id(link.trace_id), _int_id(link.span_id), is_remote=_is_remote(link.flags),
                trace_flags=_trace_flags(link.flags),
            ),
            _attributes(link.attributes),
        )
        for link in pb.links
    )
    return ReadableSpan(
        name=pb.name,
        context=context,
        parent=parent,
        resource=resource,
        attributes=_attributes(pb.attributes),
        events=events,
        links=links,
        kind=_KIND.get(pb.kind, SpanKind.INTERNAL),
        status=status,
        start_time=pb.start_time_unix_nano,
        end_time=pb.end_time_unix_nano,
        instrumentation_scope=scope,
    )


def spans_from_request(request: ExportTraceServiceRequest) -> list[ReadableSpan]:
    """The SDK spans of one OTLP trace request, with their resource and scope."""
    spans: list[ReadableSpan] = []
    for resource_spans in request.resource_spans:
        resource = Resource(
            _attributes(resource_spans.resource.attributes), resource_spans.schema_url or None
        )
        for scope_spans in resource_spans.scope_spans:
            pb_scope = scope_spans.scope
            scope = InstrumentationScope(
                pb_scope.name,
                pb_scope.version or None,
                scope_spans.schema_url or None,
                _attributes(pb_scope.attributes) or None,
            )
            spans.extend(_span(pb, resource, scope) for pb in scope_spans.spans)
    return spans


def spans_from_file(
    path: str | os.PathLike[str], errors: list[str] | None = None, *, with_backups: bool = True
) -> Iterator[list[ReadableSpan]]:
    """The spans of each line of ``path`` (rotated backups first when ``with_backups``)."""
    from otel_rollouts.exporters.otlp_json import read_requests, rotated_paths

    paths = rotated_paths(path) if with_backups else [path]
    if not paths:
        raise FileNotFoundError(f"no such file: {path}")
    for one in paths:
        for request in read_requests(one, errors):
            yield spans_from_request(request)


# --- sending -----------------------------------------------------------------------------------
@dataclass
class ReplayResult:
    """What a replay read and sent."""

    lines: int = 0
    spans: int = 0
    traces: int = 0
    failed_batches: int = 0
    errors: list[str] = field(default_factory=list)

    @property
    def ok(self) -> bool:
        return self.failed_batches == 0 and not self.errors


def replay(
    path: str | os.PathLike[str],
    exporter: SpanExporter,
    *,
    batch_lines: int = 64,
    with_backups: bool = True,
    shutdown: bool = True,
) -> ReplayResult:
    """Send every trace of an OTLP/JSON-lines file (and its backups) to ``exporter``.

    Lines are sent in batches of ``batch_lines``; rotated backups (``path.N``) go first unless
    ``with_backups=False``; unreadable lines are skipped and listed in the
    result's ``errors``. The exporter is flushed, and shut down unless ``shutdown=False``.
    """
    result = ReplayResult()
    trace_ids: set[int] = set()
    batch: list[ReadableSpan] = []
    pending = 0

    def send() -> None:
        nonlocal batch, pending
        if batch:
            try:
                outcome = exporter.export(batch)
            except Exception as exc:  # noqa: BLE001 - report, keep going
                logger.warning("otel_rollouts: replay: %s failed: %s", type(exporter).__name__, exc)
                outcome = SpanExportResult.FAILURE
            if outcome is not SpanExportResult.SUCCESS:
                result.failed_batches += 1
        batch, pending = [], 0

    try:
        for spans in spans_from_file(path, result.errors, with_backups=with_backups):
            result.lines += 1
            result.spans += len(spans)
            trace_ids.update(s.context.trace_id for s in spans)
            batch.extend(spans)
            pending += 1
            if pending >= batch_lines:
                send()
        send()
    finally:
        exporter.force_flush()
        if shutdown:
            exporter.shutdown()
    result.traces = len(trace_ids)
    return result


def make_exporter(to: str, project: str | None = None, run: str | None = None) -> SpanExporter:
    """The exporter for ``--to`` (``trackio``, ``otlp`` or ``console``)."""
    if to == "trackio":
        from otel_rollouts import conventions as c
        from otel_rollouts.exporters import TrackioExporter

        return TrackioExporter(
            project or os.environ.get(c.ENV_TRACKIO_PROJECT) or "otel-rollouts", run=run
        )
    if to == "otlp":
        from otel_rollouts.configuration import otlp_exporter_from_env

        return otlp_exporter_from_env()
    if to == "console":
        from otel_rollouts.exporters import ConsoleExporter

        return ConsoleExporter()
    raise ValueError(f"--to must be one of {', '.join(TARGETS)}, got {to!r}")


# --- command line --------------------------------------------------------------------------------
def add_arguments(parser: argparse.ArgumentParser) -> argparse.ArgumentParser:
    """The ``replay`` arguments (shared by ``otel-rollouts replay`` and ``main``)."""
    parser.add_argument("file", help="OTLP/JSON-lines file written by OtlpJsonFileExporter")
    parser.add_argument("--to", choices=TARGETS, required=True, help="where to send the traces")
    parser.add_argument("--project", help="Trackio project (--to trackio)")
    parser.add_argument("--run", help="Trackio run name (--to trackio)")
    parser.add_argument(
        "--no-backups", action="store_true", help="read FILE only, not its rotated FILE.N backups"
    )
    return parser


def run(args: argparse.Namespace) -> int:
    """Execute a parsed ``replay`` command; the exit status (0 ok, 1 partial, 2 nothing read)."""
    if not os.path.exists(args.file):
        print(f"otel-rollouts replay: no such file: {args.file}", file=sys.stderr)
        return 2
    exporter = make_exporter(args.to, args.project, args.run)
    result = replay(args.file, exporter, with_backups=not args.no_backups)
    for error in result.errors:
        print(f"otel-rollouts replay: {error}", file=sys.stderr)
    print(
        f"replayed {result.traces} traces ({result.spans} spans) from {args.file} to {args.to}"
        + (f"; {result.failed_batches} batches failed" if result.failed_batches else ""),
        file=sys.stderr,
    )
    if result.spans == 0 and result.errors:
        return 2
    return 0 if result.ok else 1


def main(argv: Sequence[str] | None = None) -> int:
    """``python -m otel_rollouts.replay FILE --to trackio|otlp|console``."""
    parser = add_arguments(
        argparse.ArgumentParser(prog="otel-rollouts replay", description=__doc__.split("\n")[0])
    )
    return run(parser.parse_args(argv))


if __name__ == "__main__":
    sys.exit(main())
