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


def broken_root(spans: Sequence[ReadableSpan]) -> str | None:
    """Why the spans of one trace that ``root_of`` finds no root in are a broken trace (spans from
    elsewhere: a replayed file, another SDK), or None when they are a fragment of a trace whose
    root was exported apart (late spans: every parent chain leaves these spans).

    Broken: an episode span that has a parent (itself, or one in a cycle: no root at all), spans
    whose parents form a cycle, or a span without a parent that is not marked an episode root.
    The record path makes none of these; a viewer cannot show them as an episode."""
    by_id = {s.context.span_id: s for s in spans}
    for span in spans:
        parent = span.parent
        if parent is not None and parent.span_id == span.context.span_id:
            return f"span {hex_id(span.context.span_id)} ({span.name!r}) is its own parent"
    for span in spans:
        chain: list[int] = []
        current: ReadableSpan | None = span
        while current is not None and current.parent is not None:
            sid = current.context.span_id
            if sid in chain:
                cycle = chain[chain.index(sid):]
                return "spans " + ", ".join(hex_id(i) for i in cycle) + " form a parent cycle"
            chain.append(sid)
            current = by_id.get(current.parent.span_id)
    for span in spans:
        if kind_of(span) == c.KIND_EPISODE and span.parent is not None:
            return (f"the episode span {hex_id(span.context.span_id)} ({span.name!r}) has a parent "
                    f"({hex_id(span.parent.span_id)}) that is not in the trace")
    for span in spans:
        if span.parent is None:
            return (f"span {hex_id(span.context.span_id)} ({span.name!r}) has no parent but is not "
                    f"marked an episode root ({c.RL_SPAN_KIND}={c.KIND_EPISODE} missing)")
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
