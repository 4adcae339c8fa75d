"""The one OTLP codec: SDK spans to an ``ExportTraceServiceRequest`` and back.

Used wherever spans cross a boundary as bytes: the spool (disk), worker processes (a task's
spans come back with its result), and replay of OTLP/JSON files. Ids are validated on the way
in (a damaged or hostile file must name the bad field, not crash later).
"""

from __future__ import annotations

from collections.abc import Callable, Iterable, Sequence
from typing import Any

from opentelemetry import trace
from opentelemetry._logs import LogRecord, SeverityNumber
from opentelemetry.proto.collector.logs.v1.logs_service_pb2 import ExportLogsServiceRequest
from opentelemetry.proto.collector.trace.v1.trace_service_pb2 import ExportTraceServiceRequest
from opentelemetry.proto.common.v1.common_pb2 import AnyValue, KeyValue
from opentelemetry.proto.trace.v1.trace_pb2 import Span as PbSpan
from opentelemetry.proto.trace.v1.trace_pb2 import SpanFlags
from opentelemetry.sdk._logs import ReadWriteLogRecord
from opentelemetry.sdk.resources import Resource
from opentelemetry.sdk.trace import Event, ReadableSpan
from opentelemetry.sdk.util.instrumentation import InstrumentationScope
from opentelemetry.trace import Link, SpanContext, SpanKind, TraceFlags, TraceState
from opentelemetry.trace.status import Status, StatusCode

from otel_rollouts import conventions as c

__all__ = [
    "PendingSpan", "count_episodes", "decode", "encode", "logs_from_request", "pending_from_request",
    "spans_from_request", "with_resource",
]

_KIND = {
    PbSpan.SpanKind.SPAN_KIND_INTERNAL: SpanKind.INTERNAL,
    PbSpan.SpanKind.SPAN_KIND_SERVER: SpanKind.SERVER,
    PbSpan.SpanKind.SPAN_KIND_CLIENT: SpanKind.CLIENT,
    PbSpan.SpanKind.SPAN_KIND_PRODUCER: SpanKind.PRODUCER,
    PbSpan.SpanKind.SPAN_KIND_CONSUMER: SpanKind.CONSUMER,
}
_SAMPLED = TraceFlags(TraceFlags.SAMPLED)
TARGETS = ("trackio", "otlp", "console")
_SAMPLED = TraceFlags(TraceFlags.SAMPLED)


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


def _int_id(raw: bytes, what: str = "span_id", size: int = 8, required: bool = True) -> int:
    """An id of exactly ``size`` bytes, not all zero (``ValueError`` naming the field otherwise)."""
    if not raw and not required:
        return 0
    if len(raw) != size:
        raise ValueError(f"{what} must be {size} bytes, got {len(raw)}")
    value = int.from_bytes(raw, "big")
    if value == 0:
        raise ValueError(f"{what} is all zero (invalid)")
    return value


def _is_remote(flags: int) -> bool:
    return bool(flags & SpanFlags.SPAN_FLAGS_CONTEXT_IS_REMOTE_MASK)


def _trace_flags(flags: int) -> TraceFlags:
    # The low 8 bits carry the W3C trace flags when the sender set them; the SDK's encoder
    # does not, and only sampled spans are exported, so "sampled" is the default.
    low = flags & SpanFlags.SPAN_FLAGS_TRACE_FLAGS_MASK
    return TraceFlags(low) if low else _SAMPLED


def _span(pb: PbSpan, resource: Resource, scope: InstrumentationScope) -> ReadableSpan:
    trace_id = _int_id(pb.trace_id, "trace_id", 16)
    trace_state = TraceState.from_header([pb.trace_state]) if pb.trace_state else TraceState()
    context = SpanContext(
        trace_id, _int_id(pb.span_id), is_remote=False, trace_flags=_trace_flags(pb.flags),
        trace_state=trace_state,
    )
    parent = None
    if pb.parent_span_id:
        parent = SpanContext(
            trace_id, _int_id(pb.parent_span_id, "parent_span_id"), is_remote=_is_remote(pb.flags), trace_flags=_SAMPLED
        )
    code = StatusCode(pb.status.code) if pb.status.code in (0, 1, 2) else StatusCode.UNSET
    status = Status(code, pb.status.message or None) if code is StatusCode.ERROR else Status(code)
    events = tuple(
        Event(e.name, _attributes(e.attributes), timestamp=e.time_unix_nano) for e in pb.events
    )
    links = tuple(
        Link(
            SpanContext(
                _int_id(link.trace_id, "link trace_id", 16), _int_id(link.span_id, "link span_id"), is_remote=_is_remote(link.flags),
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


class PendingSpan:
    """A span received as OTLP (the span gateway), kept as its protobuf bytes until it is needed:
    decoded only when its episode is kept (most episodes are dropped). Ids are read and checked
    on arrival; ``size`` is what it holds."""

    __slots__ = ("data", "origin", "trace_id", "span_id", "parent_span_id")

    def __init__(self, pb: PbSpan, origin: tuple[Resource, InstrumentationScope]) -> None:
        self.trace_id = _int_id(pb.trace_id, "trace_id", 16)
        self.span_id = _int_id(pb.span_id)
        self.parent_span_id = _int_id(pb.parent_span_id, "parent_span_id", required=False)
        self.data = pb.SerializeToString()
        self.origin = origin

    @property
    def size(self) -> int:
        return len(self.data) + 120  # the object and its references

    def decode(self) -> ReadableSpan:
        return _span(PbSpan.FromString(self.data), *self.origin)


def pending_from_request(request: ExportTraceServiceRequest,
                         select: Callable[[PbSpan], bool] | None = None) -> list[PendingSpan]:
    """The spans of one OTLP trace request as ``PendingSpan``s (ids checked, nothing else
    decoded); with ``select``, only those it accepts. Raises ``ValueError`` naming a bad id."""
    spans: list[PendingSpan] = []
    for resource_spans in request.resource_spans:
        resource = Resource(_attributes(resource_spans.resource.attributes), resource_spans.schema_url or None)
        for scope_spans in resource_spans.scope_spans:
            pb_scope = scope_spans.scope
            origin = (resource, InstrumentationScope(pb_scope.name, pb_scope.version or None,
                                                     scope_spans.schema_url or None,
                                                     _attributes(pb_scope.attributes) or None))
            spans.extend(PendingSpan(pb, origin) for pb in scope_spans.spans if select is None or select(pb))
    return spans


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


def logs_from_request(request: ExportLogsServiceRequest,
                      resource: Resource | None = None) -> list[tuple[int, ReadWriteLogRecord, int]]:
    """``(trace id or 0, SDK record, bytes on the wire)`` for every record of one OTLP logs
    request, with its own resource and scope (``resource``: stamped with that one instead)."""
    out: list[tuple[int, ReadWriteLogRecord, int]] = []
    for resource_logs in request.resource_logs:
        own = resource or Resource(_attributes(resource_logs.resource.attributes), resource_logs.schema_url or None)
        for scope_logs in resource_logs.scope_logs:
            pb_scope = scope_logs.scope
            scope = InstrumentationScope(pb_scope.name, pb_scope.version or None,
                                         scope_logs.schema_url or None, _attributes(pb_scope.attributes) or None)
            for pb in scope_logs.log_records:
                trace_id = int.from_bytes(pb.trace_id, "big") if len(pb.trace_id) == 16 else 0
                span_id = int.from_bytes(pb.span_id, "big") if len(pb.span_id) == 8 else 0
                context = None
                if trace_id and span_id:
                    parent = SpanContext(trace_id, span_id, is_remote=True, trace_flags=TraceFlags(pb.flags & 0xFF))
                    context = trace.set_span_in_context(trace.NonRecordingSpan(parent))
                record = LogRecord(
                    timestamp=pb.time_unix_nano or None,
                    observed_timestamp=pb.observed_time_unix_nano or None,
                    context=context,
                    severity_text=pb.severity_text or None,
                    severity_number=_severity(pb.severity_number),
                    body=_value(pb.body) if pb.HasField("body") else None,
                    attributes=_attributes(pb.attributes),
                    event_name=pb.event_name or None,
                )
                out.append((trace_id, ReadWriteLogRecord(record, own, scope), pb.ByteSize()))
    return out


def _severity(number: int) -> SeverityNumber | None:
    try:
        return SeverityNumber(number) if number else None
    except ValueError:
        return None


def encode(spans: Sequence[ReadableSpan]) -> bytes:
    """The OTLP protobuf encoding of ``spans`` (one ``ExportTraceServiceRequest``)."""
    from opentelemetry.exporter.otlp.proto.common.trace_encoder import encode_spans

    return encode_spans(spans).SerializeToString()


def decode(data: bytes) -> list[ReadableSpan]:
    """SDK spans (same ids, attributes, resource, scope) from an encoded request."""
    request = ExportTraceServiceRequest()
    request.ParseFromString(data)
    return spans_from_request(request)


def with_resource(spans: Iterable[ReadableSpan], resource: Resource) -> list[ReadableSpan]:
    """The same spans stamped with ``resource`` (spans made in a worker process belong to the
    run that adopts them)."""
    return [
        ReadableSpan(
            name=s.name, context=s.context, parent=s.parent, resource=resource,
            attributes=s.attributes, events=s.events, links=s.links, kind=s.kind,
            status=s.status, start_time=s.start_time, end_time=s.end_time,
            instrumentation_scope=s.instrumentation_scope,
        )
        for s in spans
    ]


def count_episodes(spans: Sequence[ReadableSpan]) -> int:
    """Episode roots in a batch: a batch is delivered, counted and dropped by its roots."""
    n = 0
    for span in spans:
        attrs = span.attributes
        if attrs and attrs.get(c.RL_SPAN_KIND) == c.KIND_EPISODE:
            n += 1
    return n
