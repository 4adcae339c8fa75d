"""Light span records: what an episode's spans are until the sampler has decided.

A ``SpanRecord`` implements the OpenTelemetry API ``Span`` interface, so it can sit in the
OpenTelemetry context as the current span: other instrumentation (an httpx or OpenAI client
span) sees its real trace and span ids and becomes its child. But it is far cheaper than an SDK
span: no locks, no attribute limits, no processor calls, no serialisation. Only kept episodes are
turned into SDK ``ReadableSpan`` objects, with the same ids, on the export thread.
"""

from __future__ import annotations

import hashlib
import time
import traceback
from collections.abc import Callable, Mapping, Sequence
from contextvars import Token
from typing import TYPE_CHECKING, Any

from opentelemetry import context as otel_context
from opentelemetry import trace
from opentelemetry.context import Context
from opentelemetry.trace import SpanContext, TraceFlags
from opentelemetry.trace.status import Status, StatusCode

from otel_rollouts import conventions as c
from otel_rollouts._core.content import call_user, exception_text, text, type_name

if TYPE_CHECKING:
    from opentelemetry.sdk.trace import ReadableSpan

    from otel_rollouts._core.codec import PendingSpan

_SAMPLED = TraceFlags(TraceFlags.SAMPLED)

# --- the OpenTelemetry context, read and set in one step ---------------------------------------
# An episode's ``with`` blocks make their span the current one, as other instrumentation reads it
# (``trace.get_current_span()``). Through the API that is four Python calls per attach, detach or
# read (the API function, the runtime context's method, then the ContextVar); with the default
# runtime context (a ContextVar, ``ContextVarsRuntimeContext``) the same ContextVar is set and
# read directly: the very same effect, one C call. Another runtime context (chosen with
# ``OTEL_PYTHON_CONTEXT``) goes through the API as before.
# the context key the current span is kept under (private to the API): found once through the
# public API, as with the baggage key in record/episode.py
SPAN_KEY = next(iter(trace.set_span_in_context(trace.INVALID_SPAN, Context())))
_runtime_context = getattr(otel_context, "_RUNTIME_CONTEXT", None)
_var = getattr(_runtime_context, "_current_context", None)
if _var is not None and type(_runtime_context).__name__ == "ContextVarsRuntimeContext":
    current_context: Callable[[], Context] = _var.get
    attach_context: Callable[[Context], Token[Context]] = _var.set
    reset_context: Callable[[Any], Any] = _var.reset
else:  # pragma: no cover - another runtime context: the API
    current_context = otel_context.get_current
    attach_context = otel_context.attach
    reset_context = otel_context.detach


def detach_context(token: object) -> None:
    """The context before a ``with`` block, back (a token from another context is let be)."""
    if token is not None:
        try:
            reset_context(token)
        except Exception:  # noqa: BLE001 - a context mismatch must not break user code
            pass


def current_span() -> Any:
    """``trace.get_current_span()`` in one step (None, not INVALID_SPAN, when there is none)."""
    return current_context().get(SPAN_KEY)


def with_span(span: object, ctx: Context, key: str | None = None, value: object = None) -> Context:
    """``ctx`` with ``span`` as its current span (and ``key`` set to ``value`` when given): what
    ``trace.set_span_in_context`` makes, one dict copy for both keys."""
    values = dict(ctx)
    values[SPAN_KEY] = span
    if key is not None:
        values[key] = value
    return Context(values)

# Budgets for attribute names other instrumentation or the user chose (metadata keys, reward
# components, set_attribute): without them one episode could carry 100k attributes or a 2 MB
# key, a root span larger than any OTLP request, past every value budget.
MAX_KEY_CHARS = 256  # an attribute key longer than this is cut (a hash keeps cut keys apart)
MAX_ATTRIBUTES = 1024  # attributes per span (OTEL_SPAN_ATTRIBUTE_COUNT_LIMIT, when configured)
ATTRIBUTE_RESERVE = 64  # of those, kept for the library's own attributes (added at render too)
_MAX_INVALID = 32  # rl.invalid notes per span: the flags themselves stay bounded
# the library's own attribute names (conventions): never counted against the user's share
_OWN_KEYS = frozenset(v for k, v in vars(c).items() if k.isupper() and isinstance(v, str))
# those of them the sampling path reads back from a root as it decides (see own_value)
_READ_BACK = frozenset((c.RL_REWARD, c.RL_STATUS, c.RL_GROUP_ID, c.RL_GROUP_EXPECTED_SIZE,
                        c.RL_COMPANIONS_ID, c.RL_PROMPT_HASH, c.RL_DATASET_INDEX, c.RL_TIMED_OUT,
                        c.RL_DURATION_SECONDS))
_PLAIN = frozenset((str, int, float, bool, type(None)))  # values plain already (see plain)
_READABLE = _PLAIN | {list, tuple, dict}  # values the sampling path reads safely (see own_value)

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
        "held",
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
        # where this span goes out: True, in its episode's tree (rendered with the episode, never
        # as a late span: a span is exported exactly once); False, cut by the span limit (never
        # exported, counted); None, not part of the tree (made after the episode was decided, or
        # by hand): a late span of a kept episode
        self.held: bool | None = None
        self._context: SpanContext | None = None

    # --- the OpenTelemetry API Span interface ------------------------------------------------
    def get_span_context(self) -> SpanContext:
        ctx = self._context
        if ctx is None:
            episode = self.episode
            if episode is None:  # a handle that records nothing (see record/episode.py)
                return trace.INVALID_SPAN_CONTEXT
            ctx = self._context = SpanContext(
                episode.trace_id, self.span_id, is_remote=False, trace_flags=_SAMPLED
            )
        return ctx

    def is_recording(self) -> bool:
        return self.end_ns is None

    def set_attribute(self, key: str, value: object) -> None:
        # a user's call (a handle's, the OpenTelemetry API's on the current span): no user code
        # runs here (keys and values made text guarded, numbers plain), nothing raises
        if self.episode is None:
            return  # a handle that records nothing (disabled, unconfigured): a no-op
        if type(key) is str and key in _OWN_KEYS:  # the library's own: bounded by design
            self.attributes[key] = own_value(self, key, value)
        else:
            put_attribute(self, key, value, "attributes")

    def set_attributes(self, attributes: Mapping[str, object]) -> None:
        for key, value in attributes.items():
            self.set_attribute(key, value)

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
        state = episode.state
        if state >= KEPT:  # already decided: a late span of a kept episode still goes out
            if self.held is None or state != KEPT:
                episode.sink.late_span(episode, self)
            # held: it is in the kept tree, which goes out (or went out) once, with it in it
            return
        if self is episode.root or self is episode.reward_span:
            episode.sink.part_ended(episode)

    # --- helpers -----------------------------------------------------------------------------
    def fail(self, exception: BaseException | None = None, message: str | None = None) -> None:
        """Mark this span as an error, recording the exception when there is one."""
        if exception is not None:
            self.record_exception(exception)
            message = message or exception_text(exception)
        self.status_code = StatusCode.ERROR
        self.status_message = message


def put_attribute(span: SpanRecord, key: object, value: object, field: str) -> bool:
    """Set a user-named attribute on ``span`` within the key and count budgets.

    A key longer than ``MAX_KEY_CHARS`` is cut (its head and a hash of the whole: two cut keys
    stay apart); once the span holds its share of attributes (its episode's limit less
    ``ATTRIBUTE_RESERVE`` for the library's own), a new key is left out. Either is flagged once
    per span in ``rl.invalid`` naming ``field`` and the key, and counted in ``otr.stats()``
    (``cut.attribute_keys``, ``dropped.attributes``). Returns whether the value was set."""
    key = bounded_key(span, key, field)
    if not has_room(span, key, field):
        return False
    span.attributes[key] = own_value(span, key, value) if key in _OWN_KEYS else plain(value)
    return True


def plain(value: object) -> object:
    """``value``, a subclass of ``str``, ``int`` or ``float`` made the builtin value it holds
    without running its code: what the library reads from an attribute (a reward, a status, a
    group id, a policy's score) is then a plain value, whose ``__float__``, ``__hash__`` or
    ``__eq__`` a user's subclass cannot make raise (anything, ``SystemExit`` included) inside
    the sampler. Any other value is returned as it is (rendered, guarded, only if kept)."""
    if type(value) in _PLAIN:
        return value
    if isinstance(value, str):
        return str.__str__(value)  # (the base slots: an exact copy, no user code)
    if isinstance(value, float):
        return float.__float__(value)
    if isinstance(value, int):
        return int.__int__(value)
    return value


def own_value(span: SpanRecord, key: str, value: object) -> object:
    """A value set under one of the library's own names (``set_attribute``): ``plain``. Under a
    name the sampling path reads back (``_READ_BACK``: compared, hashed, summed), an object that
    is neither a string, a number, a bool nor a list, tuple or dict is recorded as its (guarded)
    text and flagged in ``rl.invalid``; under the others (content) it stays, rendered if kept."""
    value = plain(value)
    if type(value) in _READABLE or key not in _READ_BACK:
        return value
    _note(span, f"attributes: {key} set to a {type_name(value)}, not a string, number, bool or list: "
          "recorded as its text", "invalid.attribute_values", f"attributes: {key} set to ")
    return text(value)


def bounded_key(span: SpanRecord, key: object, field: str, *, prefix: str = "") -> str:
    """``key`` as text, cut (flagged, counted) when ``prefix + key`` is over ``MAX_KEY_CHARS``:
    its head and a hash of the whole, so that two cut keys stay apart."""
    if type(key) is not str:
        key = text(key)
    most = MAX_KEY_CHARS - len(prefix)
    if len(key) > most:
        digest = hashlib.blake2b(key.encode("utf-8", "replace"), digest_size=8).hexdigest()
        _note(span, f"{field}: key {key[:48]!r}... is {len(prefix) + len(key)} chars, over "
              f"{MAX_KEY_CHARS}: cut", "cut.attribute_keys", f"{field}: key ")
        key = key[: max(most - 17, 0)] + "~" + digest
    return key


def has_room(span: SpanRecord, key: str, field: str, *, left_out: int = 1) -> bool:
    """Whether ``span`` may take the new attribute ``key`` (its share of the limit not used up);
    if not, ``left_out`` attributes (this one and those the caller will not try) are counted
    and the cut flagged once."""
    attrs = span.attributes
    if key in attrs:
        return True
    if len(attrs) < max(span.episode.max_attributes - ATTRIBUTE_RESERVE, 0):
        return True
    left_out_attributes(span, key, field, left_out)
    return False


def left_out_attributes(span: SpanRecord, key: str, field: str, n: int) -> None:
    """``n`` attributes of ``field``, from ``key`` on, left out of ``span`` (over its share of
    the attribute limit): counted, and flagged once in ``rl.invalid``."""
    _note(span, f"{field}: over {span.episode.max_attributes} attributes on span {span.name[:64]!r}; "
          f"{key[:48]!r} and later ones left out", "dropped.attributes", f"{field}: over ", n)


def _note(span: SpanRecord, message: str, counter: str, kind: str, n: int = 1) -> None:
    """Count ``n`` cuts in ``otr.stats()``; flag it in ``rl.invalid`` the first time per kind
    and span (a span with 100k cut keys carries one note, not 100k)."""
    stats = getattr(span.episode.sink, "stats", None)
    if stats is not None:
        stats.add(counter, n)
    invalid = span.attributes.get(c.RL_INVALID_FIELDS)
    if invalid is None:
        span.attributes[c.RL_INVALID_FIELDS] = [message]
        return
    if not isinstance(invalid, list):  # set by hand to a tuple or a text: a list from now on
        invalid = span.attributes[c.RL_INVALID_FIELDS] = (
            list(invalid) if isinstance(invalid, tuple) else [invalid])
    if len(invalid) < _MAX_INVALID and not any(
        isinstance(m, str) and m.startswith(kind) for m in invalid
    ):
        invalid.append(message)


# stage kinds by their index in EpisodeRecord.timing (generation 0, tool 1, reward 2)
STAGE_GENERATION = 0
STAGE_TOOL = 1
STAGE_REWARD = 2


def stage_ended(episode: EpisodeRecord, stage: int, start: int, end: int) -> None:
    """A span of stage ``stage`` (``STAGE_*``) ran from ``start`` to ``end``: added to the
    episode's running sums (``EpisodeRecord.timing``), which ``stages.stage_totals`` reads in
    O(1). Called where a stage span ends (a generation's or a tool call's exit, a reward), never
    for other spans: no lookup on every span end. A span that starts before the latest end of
    its stage, or of any stage (overlapping, nested, out of order), marks the sums inexact: the
    exact union over the spans is computed instead."""
    timing = episode.timing
    if timing is None:
        timing = episode.timing = [0, 0, 0, -1, -1, -1, -1, 0]
    if start < timing[3 + stage] or start < timing[6]:
        timing[7] = 1
    timing[stage] += end - start
    if end > timing[3 + stage]:
        timing[3 + stage] = end
    if end > timing[6]:
        timing[6] = end


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
        "logs",
        "held_bytes",
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
        "max_attributes",
        "timed",
        "reason",
        "notes",
        "stages",
        "timing",
        "mismatch",
        "identity",
        "conversation",
        "__weakref__",
    )

    def __init__(self, trace_id: int, step: int, split: str, sink, max_spans: int) -> None:
        self.trace_id = trace_id
        self.step = step
        self.split = split
        self.spans: list[SpanRecord] = []
        self.foreign: list[ReadableSpan | PendingSpan] = []  # other instrumentation's, other processes'
        # log records of this episode held until it is decided: (where they go if kept, records, bytes)
        self.logs: list[tuple[Any, Sequence[object], int]] | None = None
        self.held_bytes = 0  # of the above and of other processes' spans (the pipeline's bound)
        self.root: SpanRecord | None = None
        self.reward_span: SpanRecord | None = None
        self.state = OPEN
        self.seq = 0
        self.capture_content = True  # the run's content rule, fixed when the episode began
        self.next_turn = 0
        self.sink = sink  # the pipeline: told when the root or the reward span ends
        self.dropped_spans = 0
        self.max_spans = max_spans
        self.max_attributes = MAX_ATTRIBUTES  # per span; user-named keys get all but a reserve
        self.handle: Any = None  # the user-facing Episode object
        # whether its root's times are the episode's own (recorded while it ran), so that its
        # duration is measured; False for an episode recorded after the fact (an adapter, a batch)
        self.timed = True
        self.reason: str | None = None  # why the sampler kept it (rl.trace.keep_reason)
        # root attributes the sampler adds when it keeps it: its group's health (rl.group.*), the
        # watch key it matched
        self.notes: dict[str, object] | None = None
        self.stages: dict[str, float] | None = None  # seconds per stage, once computed
        # ns per stage kind as its spans ended (stage_ended): [generation, tool, reward sums,
        # their latest ends, the latest end of all, 1 if any overlapped or came out of order];
        # None until a stage span ends
        self.timing: list[int] | None = None
        # the sums of train–inference mismatch over its generations (_core.logprobs.Totals)
        self.mismatch: Any = None
        # its identity as its baggage carries it ({BAGGAGE_KEYS key: text}), fixed when it
        # began (record/episode.py); None until then
        self.identity: dict[str, str] | None = None
        # the last message list a generation recorded (record/episode.py Conversation): the next
        # call with the same conversation copies only the messages it added
        self.conversation: Any = None

    def add(self, span: SpanRecord) -> SpanRecord:
        """Put ``span`` in this episode's tree, or count it cut by the span limit. A span made
        after the episode was decided is not put in the tree: it goes out as a late span (kept
        episodes) when it ends, once."""
        if self.state >= KEPT:
            return span
        if len(self.spans) + len(self.foreign) >= self.max_spans:
            self.dropped_spans += 1
            span.held = False
        else:
            self.spans.append(span)
            span.held = True
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
        self.logs = None
        self.handle = None
        self.conversation = None
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
        if root is None:
            return None
        value = root.attributes.get(key)
        if value is None and key == c.RL_DURATION_SECONDS:
            return self.duration()
        return value

    def duration(self) -> float | None:
        """The episode's measured wall time in seconds: ``rl.duration.seconds`` when set (a
        framework's measure), else its root's duration when the root is the episode's own time
        (``timed``) and has ended; None when nothing measured it (never 0 for unknown)."""
        root = self.root
        if root is None:
            return None
        value = root.attributes.get(c.RL_DURATION_SECONDS)
        if isinstance(value, (int, float)) and not isinstance(value, bool):
            return float(value)
        if not self.timed or root.end_ns is None:
            return None
        return max(root.end_ns - root.start_ns, 0) / 1e9
