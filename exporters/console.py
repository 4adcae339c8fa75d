"""Kept episodes as indented trees on a terminal."""

from __future__ import annotations

import sys
import threading
from collections.abc import Sequence
from typing import IO

from opentelemetry.sdk.trace import ReadableSpan
from opentelemetry.sdk.trace.export import SpanExporter, SpanExportResult

from otel_rollouts import conventions as c
from otel_rollouts.exporters._tree import by_trace, duration_ms, hex_id, is_error, kind_of, ordered

_SHOWN = (
    c.RL_STEP,
    c.RL_SPLIT,
    c.RL_GROUP_ID,
    c.RL_REWARD,
    c.RL_ADVANTAGE,
    c.RL_STATUS,
    c.RL_FINISH_REASON,
    c.RL_TURN_INDEX,
    c.GEN_AI_USAGE_INPUT_TOKENS,
    c.GEN_AI_USAGE_OUTPUT_TOKENS,
)


def _label(span: ReadableSpan) -> str:
    attrs = span.attributes or {}
    parts = [span.name]
    for key in _SHOWN:
        if key in attrs:
            value = attrs[key]
            parts.append(f"{key.split('.', 1)[1]}={value:g}" if isinstance(value, float) else f"{key.split('.', 1)[1]}={value}")
    for key, value in attrs.items():
        if key.startswith(c.RL_REWARD_COMPONENT_PREFIX) and isinstance(value, (int, float)):
            parts.append(f"{key[len(c.RL_REWARD_COMPONENT_PREFIX):]}={value:g}")
    parts.append(f"({duration_ms(span):.1f} ms)")
    if is_error(span):
        parts.append(f"ERROR: {span.status.description}")
    return "  ".join(parts)


def _is_last(items: list[tuple[int, ReadableSpan]], i: int) -> bool:
    depth = items[i][0]
    for other, _ in items[i + 1 :]:
        if other <= depth:
            return other < depth
    return True


def render(spans: Sequence[ReadableSpan]) -> str:
    """One block of text per trace: a header line with the trace id, then the tree."""
    blocks = []
    for trace_id, group in by_trace(spans).items():
        lines = [f"trace {hex_id(trace_id, 32)}"]
        items = ordered(group)
        for i, (depth, span) in enumerate(items):
            lines.append(f"{'   ' * depth}{'└─' if _is_last(items, i) else '├─'} {_label(span)}")
        blocks.append("\n".join(lines))
    return "\n".join(blocks)


class ConsoleExporter(SpanExporter):
    """Prints each exported episode as an indented tree (``episode → prompt / turn → …``)."""

    def __init__(self, stream: IO[str] | None = None) -> None:
        self._stream = stream
        self._lock = threading.Lock()

    def export(self, spans: Sequence[ReadableSpan]) -> SpanExportResult:
        text = render(spans)
        with self._lock:
            stream: IO[str] = self._stream or sys.stdout
            stream.write(text + "\n")
            stream.flush()
        return SpanExportResult.SUCCESS

    def force_flush(self, timeout_millis: int = 30000) -> bool:
        return True

    def shutdown(self) -> None:
        return None


__all__ = ["ConsoleExporter", "render", "kind_of"]
