"""Kept episode records become OpenTelemetry SDK ``ReadableSpan`` objects (export thread only)."""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

from opentelemetry.sdk.resources import Resource
from opentelemetry.sdk.trace import Event, ReadableSpan
from opentelemetry.sdk.util.instrumentation import InstrumentationScope
from opentelemetry.trace import SpanContext, SpanKind, TraceFlags
from opentelemetry.trace.status import Status, StatusCode

from otel_rollouts import conventions as c
from otel_rollouts._content import Deferred, cut, jsonable, to_json
from otel_rollouts._recording import EpisodeRecord, SpanRecord

_SAMPLED = TraceFlags(TraceFlags.SAMPLED)
_PRIMITIVES = (str, bool, int, float)


class Materializer:
    """Renders records with the run's resource, scope and content limits."""

    def __init__(
        self,
        resource: Resource,
        scope: InstrumentationScope,
        max_attribute_chars: int = 16_384,
        redact: Callable[[str], str] | None = None,
    ) -> None:
        self.resource = resource
        self.scope = scope
        self.max_attribute_chars = max_attribute_chars
        self.redact = redact

    def episode(self, record: EpisodeRecord) -> list[ReadableSpan]:
        spans = [self.span(record.trace_id, s) for s in _expanded(record.spans)]
        spans.extend(record.foreign)
        return spans

    def span(self, trace_id: int, s: SpanRecord) -> ReadableSpan:
        attributes, truncated = self._attributes(s.attributes)
        if truncated:
            attributes[c.RL_TRUNCATED_FIELDS] = truncated
        events = ()
        if s.events:
            events = tuple(
                Event(name, self._attributes(attrs)[0], timestamp=ts) for name, attrs, ts in s.events
            )
        status = Status(s.status_code, s.status_message if s.status_code is StatusCode.ERROR else None)
        parent = (
            SpanContext(trace_id, s.parent_id, is_remote=False, trace_flags=_SAMPLED)
            if s.parent_id is not None
            else None
        )
        return ReadableSpan(
            name=s.name,
            context=SpanContext(trace_id, s.span_id, is_remote=False, trace_flags=_SAMPLED),
            parent=parent,
            resource=self.resource,
            attributes=attributes,
            events=events,
            links=tuple(s.links or ()),
            kind=SpanKind.INTERNAL,
            status=status,
            start_time=s.start_ns,
            end_time=s.end_ns if s.end_ns is not None else s.start_ns,
            instrumentation_scope=self.scope,
        )

    def _attributes(self, raw: dict[str, Any]) -> tuple[dict[str, Any], list[str]]:
        out: dict[str, Any] = {}
        truncated: list[str] = []
        limit = self.max_attribute_chars
        for key, value in raw.items():
            if isinstance(value, Deferred):  # resolved here: text stays text, None is left out
                value = jsonable(value)
            if value is None:
                continue
            if isinstance(value, (bool, int, float)):
                out[key] = value
                continue
            if isinstance(value, (list, tuple)) and value and _homogeneous(value):
                out[key] = list(value) if not isinstance(value[0], str) else [
                    self._text(v, limit)[0] for v in value
                ]
                continue
            text = value if isinstance(value, str) else to_json(value)
            text, was_cut = self._text(text, limit)
            out[key] = text
            if was_cut:
                truncated.append(key)
        return out, truncated

    def _text(self, text: str, limit: int) -> tuple[str, bool]:
        if self.redact is not None:
            text = self.redact(text)
        return cut(text, limit)


def _expanded(spans):
    """The records, each one that has ``expand()`` replaced by the spans it stands for.

    For spans known only once the episode is kept (e.g. tool calls parsed from token ids that
    are decoded only for kept episodes: see ``decode``).
    """
    for s in spans:
        expand = getattr(s, "expand", None)
        if expand is None:
            yield s
        else:
            yield from expand()


def _homogeneous(values) -> bool:
    first = type(values[0])
    if first not in _PRIMITIVES:
        return False
    return all(type(v) is first for v in values)
