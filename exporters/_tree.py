"""Reading exported spans back as episode trees (shared by the exporters)."""

from __future__ import annotations

import json
from collections import defaultdict
from collections.abc import Iterable, Sequence
from datetime import datetime, timezone

from opentelemetry.sdk.trace import ReadableSpan

from otel_rollouts import conventions as c


def by_trace(spans: Iterable[ReadableSpan]) -> dict[int, list[ReadableSpan]]:
    groups: dict[int, list[ReadableSpan]] = defaultdict(list)
    for span in spans:
        groups[span.context.trace_id].append(span)
    return dict(groups)


def kind_of(span: ReadableSpan) -> str:
    attrs = span.attributes or {}
    kind = attrs.get(c.RL_SPAN_KIND)
    if isinstance(kind, str):
        return kind
    op = attrs.get(c.GEN_AI_OPERATION_NAME)
    if op == c.OP_CHAT:
        return c.KIND_GENERATION
    if op == c.OP_EXECUTE_TOOL:
        return c.KIND_TOOL
    if op == c.OP_INVOKE_AGENT:
        return c.KIND_EPISODE
    return c.KIND_SPAN


def root_of(spans: Sequence[ReadableSpan]) -> ReadableSpan | None:
    """The episode root of a trace's spans (None when only late fragments are here)."""
    for span in spans:
        if span.parent is None and kind_of(span) == c.KIND_EPISODE:
            return span
    return None


def ordered(spans: Sequence[ReadableSpan]) -> list[tuple[int, ReadableSpan]]:
    """Depth-first (depth, span) in start-time order; orphans hang under the root level."""
    ids = {s.context.span_id for s in spans}
    children: dict[int | None, list[ReadableSpan]] = defaultdict(list)
    for span in spans:
        parent = span.parent.span_id if span.parent is not None else None
        children[parent if parent in ids else None].append(span)
    for group in children.values():
        group.sort(key=lambda s: (s.start_time or 0, s.end_time or 0))
    out: list[tuple[int, ReadableSpan]] = []
    seen: set[int] = set()

    def walk(parent: int | None, depth: int) -> None:
        for span in children.get(parent, ()):
            sid = span.context.span_id
            if sid in seen:
                continue
            seen.add(sid)
            out.append((depth, span))
            walk(sid, depth + 1)

    walk(None, 0)
    return out


def parse(value: object) -> object:
    """Attribute text that holds JSON becomes the value again; anything else stays."""
    if isinstance(value, str) and value[:1] in ("[", "{"):
        try:
            return json.loads(value)
        except ValueError:
            return value
    if isinstance(value, tuple):
        return list(value)
    return value


def iso(ns: int | None) -> str | None:
    if ns is None:
        return None
    return datetime.fromtimestamp(ns / 1e9, tz=timezone.utc).isoformat()


def hex_id(value: int, width: int = 16) -> str:
    return f"{value:0{width}x}"


def trace_link(ui_url: str | None, trace_id: int) -> str | None:
    """The link to a trace in a trace UI (None without one): a base URL is taken as Jaeger's UI
    (``{base}/trace/{trace_id}``); a value containing ``{trace_id}`` is a template for any other
    UI, e.g. Phoenix's ``http://localhost:6006/redirects/traces/{trace_id}``. The id is 32
    lowercase hex digits."""
    if not ui_url:
        return None
    if "{trace_id}" in ui_url:
        return ui_url.replace("{trace_id}", hex_id(trace_id, 32))
    return f"{ui_url.rstrip('/')}/trace/{hex_id(trace_id, 32)}"


def duration_ms(span: ReadableSpan) -> float:
    if span.start_time is None or span.end_time is None:
        return 0.0
    return (span.end_time - span.start_time) / 1e6


def is_error(span: ReadableSpan) -> bool:
    from opentelemetry.trace.status import StatusCode

    return span.status is not None and span.status.status_code is StatusCode.ERROR
