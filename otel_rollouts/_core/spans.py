"""Light span records: what an episode's spans are until the sampler has decided.

A ``SpanRecord`` implements the OpenTelemetry API ``Span`` interface, so it can sit in the
OpenTelemetry context as the current span: other instrumentation (an httpx or OpenAI client
span) sees its real trace and span ids and becomes its child. But it is far cheaper than an SDK
span: no locks, no attribute limits, no processor calls, no serialisation. Only kept episodes are
turned into SDK ``ReadableSpan`` objects, with the same ids, on the export thread.
"""

from __future__ import annotations

import time
import traceback
from collections.abc import Mapping
from typing import TYPE_CHECKING, Any

from opentelemetry import trace
from opentelemetry.trace import SpanContext, TraceFlags
from opentelemetry.trace.status import Status, StatusCode

from otel_rollouts import conventions as c
from otel_rollouts._core.content import call_user, exception_text, text, type_name

if TYPE_CHECKING:
    from opentelemetry.sdk.trace import ReadableSpan

_SAMPLED = TraceFlags(TraceFlags.SAMPLED)

# Episode record states
OPEN = 0  # root not ended or reward pending: undecided
OFFERED = 1  # handed to the sampler, undecided
KEPT = 2
DROPPED = 3


class SpanRecord(trace.Span):
    """One span of an episode, recorded cheaply."""

    __slots__ = (
        "name",
        "span_id",
        "parent_id",
        "kind",
        "start_ns",
        "end_ns",
        "attributes",
        "events",
        "links",
        "status_code",
        "status_message",
        "episode",
        "_context",
    )

    def __init__(
        self,
        episode: EpisodeRecord,
        name: str,
        span_id: int,
        parent_id: int | None,
        kind: str,
        attributes: dict[str, Any] | None = None,
        start_ns: int | None = None,
    ) -> None:
        self.episode = episode
        self.name = name
        self.span_id = span_id
        self.parent_id = parent_id
        self.kind = kind
        self.start_ns = start_ns if start_ns is not None else time.time_ns()
        self.end_ns: int | None = None
        self.attributes: dict[str, Any] = attributes if attributes is not None else {}
        self.events: list[tuple[str, dict[str, Any], int]] | None = None
        self.links: list[trace.Link] | None = None
        self.status_code = StatusCode.UNSET
        self.status_message: str | None = None
        self._context: SpanContext | None = None

    # --- the OpenTelemetry API Span interface ------------------------------------------------
    def get_span_context(self) -> SpanContext:
        ctx = self._context
        if ctx is None:
            ctx = self._context = SpanContext(
                self.episode.trace_id, self.span_id, is_remote=False, trace_flags=_SAMPLED
            )
        return ctx

    def is_recording(self) -> bool:
        return self.end_ns is None

    def set_attribute(self, key: str, value: Any) -> None:
        self.attributes[key] = value

    def set_attributes(self, attributes: Mapping[str, Any]) -> None:
        self.attributes.update(attributes)

    def add_event(self, name: str, attributes=None, timestamp: int | None = None) -> None:
        if self.events is None:
            self.events = []
        self.events.append((name, dict(attributes or {}), timestamp or time.time_ns()))

    def add_link(self, context: SpanContext, attributes=None) -> None:
        if self.links is None:
            self.links = []
        self.links.append(trace.Link(context, attributes))

    def update_name(self, name: str) -> None:
        self.name = name

    def set_status(self, status, description: str | None = None) -> None:
        if isinstance(status, Status):
            code, description = status.status_code, status.description
        else:
            code = status
        if self.status_code is StatusCode.OK:
            return  # OK is final, as in the SDK
        self.status_code = code
        if description is not None:
            self.status_message = description

    def record_exception(self, exception, attributes=None, timestamp=None, escaped=False) -> None:
        attrs = exception_attributes(exception)
        if attributes:
            attrs.update(attributes)
        self.add_event(c.EVENT_EXCEPTION, attrs, timestamp)

    def end(self, end_time: int | None = None) -> None:
        if self.end_ns is not None:
            return
        self.end_ns = end_time if end_time is not None else time.time_ns()
        episode = self.episode  # the sink is told when the root or the reward span ends
        if episode.state >= KEPT:  # already decided: a late span of a kept episode still goes out
            episode.sink.late_span(episode, self)
        elif self is episode.root or self is episode.reward_span:
            episode.sink.part_ended(episode)

    # --- helpers -----------------------------------------------------------------------------
    def fail(self, exception: BaseException | None = None, message: str | None = None) -> None:
        """Mark this span as an error, recording the exception when there is one."""
        if exception is not None:
            self.record_exception(exception)
            message = message or exception_text(exception)
        self.status_code = StatusCode.ERROR
        self.status_message = message


def exception_attributes(exception: BaseException) -> dict[str, str]:
    """The ``exception`` event's attributes, whatever the exception's ``__str__`` does."""
    return {
        c.EXCEPTION_TYPE: type_name(exception),
        c.EXCEPTION_MESSAGE: text(exception),
        c.EXCEPTION_STACKTRACE: _stacktrace(exception),
    }


def _stacktrace(exception: BaseException) -> str:
    """The formatted traceback; a message that cannot be printed is replaced, not raised."""
    lines, exc = call_user(
        traceback.format_exception, type(exception), exception, exception.__traceback__
    )
    if exc is None:
        return "".join(lines)
    frames, _ = call_user(traceback.format_tb, exception.__traceback__)
    return "".join(frames or ()) + exception_text(exception) + "\n"


class EpisodeRecord:
    """All that is held of one episode until the sampler decides: its spans, nothing rendered."""

    __slots__ = (
        "trace_id",
        "step",
        "split",
        "spans",
        "foreign",
        "root",
        "reward_span",
        "state",
        "seq",
        "next_turn",
        "sink",
        "dropped_spans",
        "max_spans",
        "handle",
        "capture_content",
        "__weakref__",
    )

    def __init__(self, trace_id: int, step: int, split: str, sink, max_spans: int) -> None:
        self.trace_id = trace_id
        self.step = step
        self.split = split
        self.spans: list[SpanRecord] = []
        self.foreign: list[ReadableSpan] = []
        self.root: SpanRecord | None = None
        self.reward_span: SpanRecord | None = None
        self.state = OPEN
        self.seq = 0
        self.capture_content = True  # the run's content rule, fixed when the episode began
        self.next_turn = 0
        self.sink = sink  # the pipeline: told when the root or the reward span ends
        self.dropped_spans = 0
        self.max_spans = max_spans
        self.handle: Any = None  # the user-facing Episode object

    def add(self, span: SpanRecord) -> SpanRecord:
        if len(self.spans) + len(self.foreign) >= self.max_spans:
            self.dropped_spans += 1
        else:
            self.spans.append(span)
        return span

    def release(self, *, keep_root: bool = False) -> None:
        """Let go of what the episode held once it is decided: its spans (rendered, or dropped)
        and the user's handle. Its spans point back at it, and the user's ``Episode`` handle and
        this record point at each other: without this every episode would be a reference cycle
        that only Python's cyclic GC frees, which cost a dropped episode more than recording it
        did. ``keep_root``: a kept episode keeps its root and reward span, which a late reward
        still updates (a cycle of three objects, not of the whole tree)."""
        self.spans = []
        self.foreign = []
        self.handle = None
        if not keep_root:
            self.root = None
            self.reward_span = None

    @property
    def complete(self) -> bool:
        root = self.root
        return (
            root is not None
            and root.end_ns is not None
            and (self.reward_span is None or self.reward_span.end_ns is not None)
            and self.has_reward
        )

    @property
    def has_reward(self) -> bool:
        return self.reward_span is not None

    def attribute(self, key: str) -> Any:
        root = self.root
        return None if root is None else root.attributes.get(key)
