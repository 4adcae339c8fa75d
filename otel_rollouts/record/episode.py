"""The episode API: one RL episode recorded as one trace.

    with otr.episode(step=3, split="train", group_id="p17", sample_index=2) as ep:
        ep.prompt(messages)
        with ep.turn() as turn:
            turn.record_generation("Let me compute.", model="policy", output_tokens=5)
            with turn.tool_call("calculator", arguments={"x": 2}, call_id="c1") as call:
                call.result(4)
        ep.reward(1.0, components={"math": 1.0}, advantage=0.5)
        ep.finish(reason="stop")

Spans are recorded cheaply (see ``_recording``); the tail sampler decides later which episodes
are rendered and exported. Bad values are refused with a message naming the field and recorded
under ``rl.invalid`` on the span; user code never sees an exception unless strict mode is on.
"""

from __future__ import annotations

import hashlib
import json
import time
from collections.abc import Callable, Mapping, Sequence
from contextvars import Token
from operator import is_ as _is
from random import getrandbits as _getrandbits
from types import TracebackType
from typing import Any, ClassVar, TypeVar

from opentelemetry import baggage
from opentelemetry import context as otel_context
from opentelemetry.context import Context
from opentelemetry.trace.status import StatusCode

from otel_rollouts import conventions as c
from otel_rollouts._core import runtime as _runtime
from otel_rollouts._core.content import (
    DEFAULT_MAX_NODES,
    Deferred,
    flat_dict,
    jsonable,
    reraise_interrupt,
    snapshot,
    text,
)
from otel_rollouts._core.guard import contained, failed, guarded, report
from otel_rollouts._core.logprobs import TokenView, Totals, read_tokens, totals_of
from otel_rollouts._core.spans import (
    ATTRIBUTE_RESERVE,
    DROPPED,
    KEPT,
    MAX_KEY_CHARS,
    OFFERED,
    OPEN,
    SPAN_KEY,
    STAGE_GENERATION,
    STAGE_REWARD,
    STAGE_TOOL,
    EpisodeRecord,
    SpanRecord,
    attach_context,
    bounded_key,
    current_context,
    current_span,
    detach_context,
    has_room,
    put_attribute,
    reset_context,
    stage_ended,
    with_span,
)
from otel_rollouts._core.values import fits_int64, refused, storable_number, to_float, to_int

__all__ = ["Episode", "Turn", "ToolCall", "Generation", "episode", "current_episode", "current_generation"]

# the context key under which an entered ToolCall / Generation names itself: a @traced function of
# the same kind called directly inside its ``with`` block records into its span (see CallHandle)
OPEN_CALL = otel_context.create_key("otel_rollouts.open_call")
_S = TypeVar("_S", bound=SpanRecord)


# --- helpers shared with @traced ---------------------------------------------------------------
def flag(span: SpanRecord, message: str) -> None:
    """Record a refused value on the span (rl.invalid) and report it."""
    invalid = span.attributes.get(c.RL_INVALID_FIELDS)
    if invalid is None:
        span.attributes[c.RL_INVALID_FIELDS] = [message]
    else:
        invalid.append(message)
    report(message)


def as_messages(messages: object, role: str = "user",
                record: EpisodeRecord | None = None) -> list[dict[str, object]] | Deferred:
    """OpenAI-style message list from a list of messages, one message, or plain text.

    ``record``: the episode a generation's input is recorded for. A conversation grows from
    call to call (the same message dicts, a few appended); the messages it began with were
    copied at an earlier call already. Those copies are shared, not made again, where the list
    is shown to start with the very same message objects, unchanged (``_recorded_prefix``):
    each call copies only the messages it adds."""
    if record is not None and type(messages) is list and role == "user":
        return _conversation(record, messages)
    if messages is None:
        return []
    if isinstance(messages, Deferred):  # a message list known only if the episode is kept
        return messages
    if isinstance(messages, str):
        return [{"role": role, "content": messages}]
    if isinstance(messages, (list, tuple)):
        out = []
        for m in snapshot(messages):  # one copy of the whole list: shared parts copied once
            if isinstance(m, dict):
                out.append(m)
            else:
                out.append({"role": role, "content": m if isinstance(m, str) else text(m)})
        return out
    if isinstance(messages, Mapping):
        return [_message(snapshot(messages), role)]
    return [{"role": role, "content": text(messages)}]


class Conversation:
    """The last message list recorded in an episode (``EpisodeRecord.conversation``): the
    user's message objects as given (``originals``) and the copies recorded for them
    (``copies``, what ``as_messages`` made), with the items and entries copied (``nodes``)."""

    __slots__ = ("originals", "copies", "nodes")

    def __init__(self, originals: list[object], copies: list[dict[str, object]], nodes: int) -> None:
        self.originals = originals
        self.copies = copies
        self.nodes = nodes


def _conversation(record: EpisodeRecord, messages: list[object]) -> list[dict[str, object]] | Deferred:
    """``as_messages(messages)`` sharing what the episode recorded of the same conversation."""
    held = record.conversation
    start = len(held.originals) if held is not None and _recorded_prefix(held, messages) else 0
    # the messages added since: copied here when each is a plain dict of plain values (the
    # common case, one C copy each), else by as_messages' full path
    added: list[dict[str, object]] | None = []
    nodes = len(messages) - start + (held.nodes if start and held is not None else 0)
    for i in range(start, len(messages)):
        m = messages[i]
        if type(m) is not dict:
            added = None
            break
        copied = flat_dict(m)
        if copied is None:  # nested parts (content as a list of parts...): the full walk
            copied = snapshot(m)
            if type(copied) is not dict:
                added = None
                break
        nodes += len(copied)
        if nodes > DEFAULT_MAX_NODES:  # past snapshot's node budget: cut by the full path
            added = None
            break
        added.append(copied)  # type: ignore[union-attr]
    if added is None:
        # something else than message dicts: the full copy, shared no further
        record.conversation = None
        return as_messages(messages)
    copies = held.copies + added if start and held is not None else added
    record.conversation = Conversation(list(messages), copies, nodes)
    return list(copies)


def _recorded_prefix(held: Conversation, messages: list[object]) -> bool:
    """Whether ``messages`` starts with the very message dicts ``held`` recorded (identity)
    and each is unchanged since (its copy equal to it: a dict comparison in C, the same string
    objects equal at once). A value replaced by an equal one of another type (1 by 1.0) counts
    as unchanged; a comparison that raises (a user ``__eq__`` of a value), as changed."""
    originals = held.originals
    n = len(originals)
    if len(messages) < n or not all(map(_is, messages, originals)):
        return False
    try:
        return held.copies == messages[:n]
    except BaseException as exc:  # noqa: BLE001 - a user __eq__: changed
        reraise_interrupt(exc)
        return False


def prompt_hash(prompt: object) -> str | None:
    """A short stable key of a prompt (16 hex digits), the same in every process and run: what
    ``TailSampler(watch=[...])`` matches against the prompt an episode recorded with
    ``ep.prompt(prompt)``. Plain text and a one-message list ``[{"role": "user", "content":
    text}]`` hash alike. Never raises: a part whose ``str`` raises hashes as its placeholder
    (``<Type: str raised ...>``), the same each time. None for a prompt known only later (a
    deferred message list)."""
    try:
        messages = as_messages(prompt)
        if isinstance(messages, Deferred):
            return None
        canonical = json.dumps(jsonable(messages), sort_keys=True, ensure_ascii=False, separators=(",", ":"))
    except Exception:  # noqa: BLE001 - never an error for a prompt (jsonable contains user code)
        return None
    return hashlib.blake2b(canonical.encode("utf-8", "replace"), digest_size=8).hexdigest()


def _message(copied: object, role: str) -> dict[str, object]:
    """A snapshot of a message mapping (a placeholder text if the mapping could not be read)."""
    return copied if isinstance(copied, dict) else {"role": role, "content": copied}


def child_span(record: EpisodeRecord, name: str, kind: str, parent: SpanRecord | None = None,
               attributes: dict[str, object] | None = None,
               cls: type[_S] = SpanRecord) -> _S:  # type: ignore[assignment]
    """A new span of ``record`` under ``parent`` (default: the current span of this episode),
    an instance of ``cls`` (a handle class that is a span: its own fields are the caller's to
    set)."""
    if parent is None:
        current = current_context().get(SPAN_KEY)  # current_span, in place
        parent = (
            current
            if isinstance(current, SpanRecord) and current.episode is record
            else record.root
        )
    # SpanRecord.__init__ inlined (one call less per span, the most frequent call of all); the
    # kind's own attributes (rl.span.kind...) are added when the span is rendered
    span = _new_span(cls)
    span.episode = record
    span.name = name
    span.span_id = _getrandbits(64) or _runtime.new_id64()
    span.parent_id = parent.span_id if parent else None
    span.kind = kind
    span.start_ns = _time_ns()
    span.end_ns = None
    span.attributes = attributes if attributes is not None else {}
    span.events = span.links = span.status_message = span._context = None
    span.status_code = _UNSET
    if record.state >= KEPT:  # EpisodeRecord.add, inlined
        span.held = None  # made after the decision: a late span (sent once, when it ends)
    elif len(record.spans) + len(record.foreign) < record.max_spans:
        record.spans.append(span)
        span.held = True
    else:
        record.dropped_spans += 1
        span.held = False
    return span


_new_span = object.__new__
_time_ns = time.time_ns
_UNSET = StatusCode.UNSET


# the context key OpenTelemetry keeps the baggage under (private to its API): found once, through
# the public API, so that an episode's keys are set with one context copy, not one per key
_BAGGAGE = next(iter(baggage.set_baggage("k", "v", Context())))


class EpisodeBaggage(dict[str, object]):
    """The baggage of an episode's context: the entries it came with, the episode's identity
    set over them, and the episode it was made for (``episode``).

    The mark is how a context says "my baggage carries this episode's identity" without a
    comparison per span: OpenTelemetry never changes a baggage in place (``set_baggage``,
    ``remove_baggage``, ``clear`` each make a plain ``dict`` copy), so baggage the user changed
    inside the episode has lost the mark, and is checked again before the next span of the
    episode is made current or a request leaves (``with_identity``)."""

    __slots__ = ("episode",)
    episode: EpisodeRecord


def span_context(span: object, ctx: Context | None = None) -> Context:
    """``ctx`` (default: the current context) with ``span`` as its current span and, for a span
    of an episode, the episode's identity in its baggage (see ``with_identity``): any propagator
    (ours, or a stock instrumentation's) sends it with each request made while it is current."""
    if ctx is None:
        ctx = current_context()
    if isinstance(span, SpanRecord) and getattr(ctx.get(_BAGGAGE), "episode", None) is not span.episode:
        # (the episode's own context, and those made from it: as it is)
        values = _identity_values(span, ctx)
        if values is not None:  # the identity and the current span in one copy
            values[SPAN_KEY] = span
            return Context(values)
    return with_span(span, ctx)


def with_identity(span: object, ctx: Context) -> Context:
    """``ctx`` whose W3C baggage carries the identity of ``span``'s episode
    (``conventions.BAGGAGE_KEYS``, each when known); ``ctx`` itself for a span of no episode.

    Computed once per episode: the context made for the episode (and every context derived
    from it: its turns, calls, tasks) carries baggage marked with the episode
    (``EpisodeBaggage``), and is returned as it is; only a context whose baggage is not (the
    episode being entered, a span entered in another thread, a worker's context carried from
    another process, baggage the user changed inside the episode) is looked at, and gets the
    keys set. Inside its episode the episode's identity wins: each key the episode knows is
    set to its value, over whatever the baggage held (another episode's, an upstream one's, or
    an ``rl.episode.id`` the user set with ``opentelemetry.baggage`` inside the episode: the
    user's value is replaced, in what is sent and in the context the episode's spans run
    under, and comes back when the user's own context is current again, after the episode).
    A key the episode does not know is removed when the baggage names another episode, kept
    when it names this one (a worker's context, carried with keys this side may not know). The
    rest of the baggage (entries the user set under other keys) stays. An episode's identity
    is fixed when it starts (``otr.set_step`` applies to later episodes).
    """
    if not isinstance(span, SpanRecord) or getattr(ctx.get(_BAGGAGE), "episode", None) is span.episode:
        return ctx
    values = _identity_values(span, ctx)
    return ctx if values is None else Context(values)


def _identity_values(span: SpanRecord, ctx: Context) -> dict[str, object] | None:
    """The entries of ``with_identity``'s new context (None: ``ctx`` as it is): ``ctx``'s
    entries, and baggage made of its baggage's entries with the episode's identity over them
    (``EpisodeRecord.identity``: text, made once when the episode began)."""
    record = span.episode
    identity = record.identity
    if identity is None:  # an episode not begun by Episode (none today): from its root
        root = record.root
        if root is None:
            return None
        identity = record.identity = identity_of(root.attributes)
    values = dict(ctx)
    values[_BAGGAGE] = episode_baggage(record, identity, values.get(_BAGGAGE))
    return values


def episode_baggage(record: EpisodeRecord, identity: dict[str, str], current: object) -> EpisodeBaggage:
    """The baggage of ``record``'s contexts: ``current``'s entries with the episode's identity
    set over them (its own identity wins); a key the episode does not know is removed when
    ``current`` names another episode, kept when it names this one."""
    if isinstance(current, dict) and current:
        entries = EpisodeBaggage(current)
        if entries.get(c.RL_EPISODE_ID) != identity.get(c.RL_EPISODE_ID):
            for key in c.BAGGAGE_KEYS:  # another episode's, not this one's
                if key not in identity:
                    entries.pop(key, None)
        entries.update(identity)
    else:
        entries = EpisodeBaggage(identity)
    entries.episode = record
    return entries


def identity_of(attributes: Mapping[str, object]) -> dict[str, str]:
    """The episode identity (``conventions.BAGGAGE_KEYS`` that are known) of a root's attributes,
    as text."""
    return {key: str(value) for key in c.BAGGAGE_KEYS if (value := attributes.get(key)) is not None}


def leave_context(token: Token[Context] | None) -> None:
    """The context before a ``with`` block, back (a token from another context is let be)."""
    detach_context(token)


def _number(span: SpanRecord, value: object, field: str) -> float | None:
    number, problem = to_float(value, field)
    if problem is not None:
        flag(span, problem)
    return number


def _reward_refused(root: SpanRecord, problem: str) -> None:
    """A reward that is no number (NaN, infinite, text) fails the episode, not only its reward
    span: an ``ok`` episode becomes ``error`` (its group counts it lost, never all-equal with the
    rest) and the root's ``rl.invalid`` names the field, as the reward span's does (reported once,
    by the span's flag). A status the user set apart from ``ok`` (truncated, filtered) stays."""
    attrs = root.attributes
    invalid = attrs.get(c.RL_INVALID_FIELDS)
    if isinstance(invalid, list):
        invalid.append(problem)
    else:
        attrs[c.RL_INVALID_FIELDS] = [problem]
    if attrs.get(c.RL_STATUS, c.STATUS_OK) == c.STATUS_OK:
        attrs[c.RL_STATUS] = c.STATUS_ERROR
        if root.status_code is not StatusCode.ERROR:
            root.fail(message=problem)


def _put(span: SpanRecord, key: str, value: object) -> None:
    """``put_attribute(span, key, value, "components")``, its common case (a short key, room
    left) checked in place."""
    attrs = span.attributes
    if len(key) <= MAX_KEY_CHARS and (
            key in attrs or len(attrs) < span.episode.max_attributes - ATTRIBUTE_RESERVE):
        attrs[key] = value
    else:
        put_attribute(span, key, value, "components")


def flag_episode(ep: object, problem: str) -> bool:
    """Record a refused value on an episode's root (``rl.invalid``) and report it, for code that
    holds only the episode handle (the adapters). False when ``ep`` records nothing (a blank
    handle, or not an episode)."""
    record = ep._record if isinstance(ep, Episode) else None
    if record is None or record.root is None:
        return False
    flag(record.root, problem)
    return True


def record_generations_mismatch(
    ep: Episode, bounds: Sequence[tuple[int, int]], rollout: Any, trainer: Any, tokens: Any = None,
    mask: Any = None, decode: Any = None,
) -> str | None:
    """Each generation's own train–inference mismatch, for an episode whose response
    concatenates several generations: ``bounds`` are each generation's ``[start, end)`` in the
    concatenated per-token arrays (``rollout``, ``trainer``, ``mask``: 1-D numpy arrays of one
    length; ``tokens``: ids or texts), in the order the generation spans were recorded. Each
    generation span gets the statistics and worst tokens of its own tokens (positions within it);
    the root's statistics are the caller's (``record_batch``: the sample's, on the root only once
    a generation has its own). One generation recorded for the whole response keeps it all.
    Returns why nothing was split (the runs do not match the generation spans), else None."""
    record = ep._record
    if record is None or record.root is None:
        return None
    spans = [s for s in record.spans if s.kind == c.KIND_GENERATION]
    size = len(rollout)
    if len(spans) == 1 and len(bounds) != 1:
        return None  # one generation recorded the whole response: the sample's statistics are its own
    problem = None
    if len(spans) != len(bounds) or any(not 0 <= lo <= hi <= size for lo, hi in bounds):
        problem = f"{len(bounds)} token runs for {len(spans)} generations: mismatch statistics on the root only"
    else:
        for span, (lo, hi) in zip(spans, bounds, strict=True):
            # private copies: the worst tokens are rendered at export, the arrays may be reused
            record_logprobs(span, rollout[lo:hi].copy(), trainer[lo:hi].copy(),
                            None if tokens is None else tokens[lo:hi],
                            None if mask is None else mask[lo:hi].copy(), decode)
    if record.mismatch is None:
        # no generation had a compared token: record_batch still sets the root, not a span
        record.mismatch = Totals()
    return problem


def record_logprobs(span: SpanRecord, logprobs: object, trainer_logprobs: object, tokens: Any = None,
                    mask: object = None, decode: Any = None) -> None:
    """A generation's train–inference mismatch: its statistics on ``span`` and added to its
    episode's root; its worst tokens as Deferred attributes (computed only if kept). A value that
    is not per-token numbers (a 1-D sequence: a 2-D one is refused, not flattened), or lengths
    that disagree, is flagged on the span naming the field (and the shape)."""
    arrays = []
    for field_name, value in (("logprobs", logprobs), ("trainer_logprobs", trainer_logprobs)):
        array, problem = read_tokens(value, field_name)
        if problem is not None:  # what is not one number per token is flagged, never raised
            flag(span, problem)
            return
        arrays.append(array)
    rollout, trainer = arrays
    if rollout is None or trainer is None:
        return
    if len(rollout) != len(trainer):
        flag(span, f"trainer_logprobs: {len(trainer)} values for {len(rollout)} logprobs (no mismatch recorded)")
        return
    counted = None
    if mask is not None:
        counted, problem = read_tokens(mask, "mask")
        if problem is not None:
            flag(span, problem)
            return
        counted = None if counted is None else counted != 0
        if counted is not None and len(counted) != len(rollout):
            flag(span, f"mask: {len(counted)} values for {len(rollout)} logprobs (no mismatch recorded)")
            return
    options = _runtime.current().mismatch
    totals = totals_of(rollout, trainer, counted, options)
    if totals.n <= 0:
        return
    record = span.episode
    span.attributes.update(totals.attributes(options))
    if options.top_tokens and record.capture_content:
        view = TokenView(rollout, trainer, counted, options.top_tokens, tokens, decode)
        span.attributes.update(view.attributes())
    if record.mismatch is None:
        record.mismatch = Totals()
    record.mismatch.add(totals)
    if record.root is not None:
        record.root.attributes.update(record.mismatch.attributes(options))


def record_usage(span: SpanRecord, input_tokens: object, output_tokens: object) -> None:
    """``gen_ai.usage.input_tokens`` / ``output_tokens`` on a generation span; None leaves a
    count absent (unknown), a value that is not a count is refused and flagged."""
    for value, key, field in ((input_tokens, c.GEN_AI_USAGE_INPUT_TOKENS, "input_tokens"),
                              (output_tokens, c.GEN_AI_USAGE_OUTPUT_TOKENS, "output_tokens")):
        if value is None:
            continue
        if type(value) is int and 0 <= value < _INT64:  # the common case, checked in place
            span.attributes[key] = value
            continue
        count = _integer(span, value, field)
        if count is not None and count < 0:
            flag(span, f"{field}: negative ({count})")
        elif count is not None:
            span.attributes[key] = count


_INT64 = 1 << 63  # a count below this is stored as it is


def _integer(span: SpanRecord, value: object, field: str) -> int | None:
    number, problem = to_int(value, field)
    if problem is not None:
        flag(span, problem)
    return number


# --- handles ---------------------------------------------------------------------------------------
_H = TypeVar("_H", bound="BlockSpan")


class BlockSpan(SpanRecord):
    """A span that is its own user handle: a (async) ``with`` block makes it the current span
    and ends it at the block's end. One object per span, not a handle wrapping a span record.

    Used without ``with``, the span ends when its result is recorded. A handle that records
    nothing (disabled, unconfigured, or after a contained error: ``blank_handle``) has no
    episode (``episode is None``, already ended): every method is a no-op."""

    __slots__ = ("_token", "_entered")
    _token: Token[Context] | None  # the context before the ``with`` block
    _entered: bool  # used as a ``with`` block (or owned by a traced call): the block ends it
    # its index in EpisodeRecord.timing (STAGE_GENERATION, STAGE_TOOL) for a stage span, whose
    # end adds its duration to the episode's stage sums; -1: a span of no stage (a turn)
    stage: ClassVar[int] = -1
    opens_call: ClassVar[bool] = False  # a traced call inside may record into it (CallHandle)

    def __enter__(self: _H) -> _H:
        self._entered = True
        record = self.episode
        if record is not None:
            ctx = current_context()
            if getattr(ctx.get(_BAGGAGE), "episode", None) is not record:
                ctx = with_identity(self, ctx)
            values = dict(ctx)  # with_span, in place
            values[SPAN_KEY] = self
            if self.opens_call:
                values[OPEN_CALL] = self
            self._token = attach_context(Context(values))
        return self

    def __exit__(self, exc_type: type[BaseException] | None, exc: BaseException | None,
                 tb: TracebackType | None) -> None:
        # never raises: the user's exception, if any, must leave this block as it came in
        try:
            token = self._token
            if token is not None:
                self._token = None
                try:
                    reset_context(token)  # detach_context, in place
                except Exception:  # noqa: BLE001 - a token of another context is let be
                    pass
            record = self.episode
            if record is None:
                return
            if exc is not None and self.status_code is not StatusCode.ERROR:
                self.fail(exc)
            if self.end_ns is None:
                if record.state >= KEPT:
                    self.end()
                    return
                # SpanRecord.end in place: a span neither root nor reward
                end = self.end_ns = _time_ns()
                if self.stage >= 0:  # where this stage ends: the episode's running sums
                    stage_ended(record, self.stage, self.start_ns, end)
        except Exception as err:  # noqa: BLE001 - containment is the point
            # (a SystemExit or KeyboardInterrupt here comes from a signal handler: it goes on)
            contained(f"{type(self).__name__}.__exit__", err)

    async def __aenter__(self: _H) -> _H:
        return self.__enter__()

    async def __aexit__(self, exc_type: type[BaseException] | None, exc: BaseException | None,
                        tb: TracebackType | None) -> None:
        self.__exit__(exc_type, exc, tb)


class CallHandle(BlockSpan):
    """A tool call or a generation, the two spans a ``@traced`` function may duplicate, and the
    two stage spans of an episode's time (their exit adds their duration to the episode's
    running stage sums: ``stage_ended``).

    People write ``with turn.tool_call("calculator", ...) as call: call.result(calculator(x))``
    with ``calculator`` itself ``@otr.traced(kind="tool")``. Two spans for one call would show
    two tool calls in every viewer and count its failure twice. So the first ``@traced`` call of
    the same kind (and, for a tool, the same name) made directly inside the ``with`` block (this
    span current) records into this span: its arguments where none were given, its result or
    output, its failure, its token usage. Any other call inside is a span of its own.
    """

    __slots__ = ("merged", "merged_error")
    merged: bool  # a traced call recorded into this span already
    merged_error: BaseException | None  # the exception it recorded, if any
    opens_call = True

    def end(self, end_time: int | None = None) -> None:
        """End the span (``SpanRecord.end``), its duration added to its episode's stage sums."""
        if self.end_ns is not None:
            return
        record = self.episode
        if record.state < KEPT:
            end = self.end_ns = end_time if end_time is not None else _time_ns()
            stage_ended(record, self.stage, self.start_ns, end)
        else:
            SpanRecord.end(self, end_time)

    def take(self, kind: str, tool: str | None) -> SpanRecord | None:
        """This span, for the traced call of ``kind`` (a tool named ``tool``) that starts now,
        if that call is the first directly inside this block; else None."""
        if (self.episode is None or self.merged or self.end_ns is not None or self.kind != kind
                or current_span() is not self):
            return None
        if kind == c.KIND_TOOL and self.attributes.get(c.GEN_AI_TOOL_NAME) != tool:
            return None
        self.merged = True
        taken: SpanRecord = self
        return taken


class ToolCall(CallHandle):
    """One tool call inside a turn: ``execute_tool {name}``."""

    __slots__ = ()
    stage = STAGE_TOOL

    def result(self, value: object) -> None:
        """Record the tool's result (ends the call unless used as a ``with`` block)."""
        try:
            record = self.episode
            if record is None:
                return
            if record.capture_content:
                self.attributes[c.GEN_AI_TOOL_CALL_RESULT] = snapshot(value)
            if not self._entered:
                self.end()
        except Exception as exc:  # noqa: BLE001 - containment (guarded, inline: a per-span call)
            failed("ToolCall.result", exc)

    @guarded
    def error(self, error: BaseException | str) -> None:
        """Mark the call as failed with an exception or a message (nothing is raised)."""
        if self.episode is None:
            return
        if error is self.merged_error and self.status_code is StatusCode.ERROR:
            pass  # the traced function it came from recorded it on this span already
        elif isinstance(error, BaseException):
            self.fail(error)
        else:
            self.fail(message=text(error))
        if not self._entered:
            self.end()


class Generation(CallHandle):
    """One model generation inside a turn: ``chat {model}``."""

    __slots__ = ()
    stage = STAGE_GENERATION

    @guarded
    def usage(self, input_tokens: int | None = None, output_tokens: int | None = None) -> None:
        """Record the generation's token usage (``gen_ai.usage.*``); the span is not ended.
        A count not given stays absent: viewers show it as unknown, not as 0."""
        if self.episode is None:
            return
        record_usage(self, input_tokens, output_tokens)

    def output(
        self,
        content: object = None,
        *,
        tool_calls: list[dict[str, Any]] | None = None,  # list is invariant: any dict a user built
        finish_reason: str | None = None,
        input_tokens: int | None = None,
        output_tokens: int | None = None,
        model: str | None = None,
        logprobs: object = None,
        trainer_logprobs: object = None,
        tokens: object = None,
        mask: object = None,
    ) -> None:
        """Record what the policy generated (and end the span unless inside ``with``).

        ``logprobs``: the inference engine's logprob of each generated token; ``trainer_logprobs``:
        the trainer's for the same tokens, when known (a 1-D tensor, array or list each, read in
        place, not copied). With both, the generation and its episode get the train–inference
        mismatch statistics (``rl.mismatch.*``); ``tokens`` (the tokens' texts or ids) and the
        worst tokens are rendered only if the episode is kept. ``mask``: 1 for the tokens that
        count (default all)."""
        try:
            record = self.episode
            if record is None:
                return
            attributes = self.attributes
            if logprobs is not None and trainer_logprobs is not None:
                record_logprobs(self, logprobs, trainer_logprobs, tokens, mask)
            if model:
                attributes[c.GEN_AI_REQUEST_MODEL] = text(model)
                self.name = c.chat_span_name(text(model))
            if record.capture_content:
                message: Deferred | dict[str, object]
                if type(content) is str:  # the common case, first
                    message = {"role": "assistant", "content": content}
                elif isinstance(content, Deferred):  # the whole message, rendered only if kept
                    message = content
                elif isinstance(content, Mapping):
                    message = _message(snapshot(content), "assistant")
                    message.setdefault("role", "assistant")
                else:
                    message = {"role": "assistant", "content": "" if content is None else content}
                    if not isinstance(message["content"], (str, list)):
                        message["content"] = text(message["content"])
                if tool_calls and isinstance(message, dict):
                    message["tool_calls"] = snapshot(tool_calls)
                attributes[c.GEN_AI_OUTPUT_MESSAGES] = [message]
            if finish_reason is not None:
                attributes[c.GEN_AI_RESPONSE_FINISH_REASONS] = [text(finish_reason)]
            if input_tokens is not None or output_tokens is not None:
                record_usage(self, input_tokens, output_tokens)
            if not self._entered:
                self.end()
        except Exception as exc:  # noqa: BLE001 - containment (guarded, inline: a per-span call)
            failed("Generation.output", exc)


# span names of the GenAI conventions, built in place for a name that is text (c.chat_span_name,
# c.tool_span_name say what they are)
_CHAT_PREFIX = c.chat_span_name("x")[:-1]
_TOOL_PREFIX = c.tool_span_name("x")[:-1]
# the keywords of Generation.output that record_generation records itself (with a text answer)
_PLAIN_OUTPUT = frozenset(("finish_reason", "input_tokens", "output_tokens"))


class Turn(BlockSpan):
    """One policy step: a generation, the tool calls it made, and the feedback it got."""

    __slots__ = ("index",)
    index: int  # the turn's index in its episode (from 0; -1 for a handle that records nothing)

    def generation(self, model: str | None = None, *, messages: object = None,
                   provider: str | None = None) -> Generation:
        """Start a generation span (use as ``with``; call ``.output(...)`` inside).

        ``messages``: what the policy was given; when left out, viewers are shown the
        conversation up to this generation (the prompt, earlier turns, tool results), rebuilt
        from the episode's spans only if it is kept. ``provider``: ``gen_ai.provider.name``
        (e.g. ``"vllm"``, ``"openai"``) when known.
        """
        try:
            record = self.episode
            if record is None:
                return blank_handle(Generation)
            return self._generation(record, model, messages, provider)
        except Exception as exc:  # noqa: BLE001 - containment (guarded, inline: a per-span call)
            failed("Turn.generation", exc)
            return blank_handle(Generation)

    def _generation(self, record: EpisodeRecord, model: str | None, messages: object,
                    provider: str | None) -> Generation:
        """A generation span of this turn, started (its handle fields set), not guarded: the
        body of ``generation`` and the start of ``record_generation``."""
        attrs: dict[str, object] = {}
        if model:
            attrs[c.GEN_AI_REQUEST_MODEL] = model if type(model) is str else text(model)
        if provider:
            attrs[c.GEN_AI_PROVIDER_NAME] = text(provider)
        if messages is not None and record.capture_content:
            attrs[c.GEN_AI_INPUT_MESSAGES] = as_messages(messages, "user", record)
        name = _CHAT_PREFIX + model if type(model) is str and model else c.chat_span_name(model)
        span = child_span(record, name, c.KIND_GENERATION, self, attrs, Generation)
        span._token = span.merged_error = None
        span._entered = span.merged = False
        return span

    def record_generation(self, content: object = None, *, model: str | None = None,
                          messages: object = None, provider: str | None = None, **output: object) -> Generation:
        """Record a finished generation in one call (same keywords as ``Generation.output``)."""
        try:
            record = self.episode
            if record is None:
                return blank_handle(Generation)
            # generation() and output() guarded once as a whole: a plain text answer (the
            # common case) is recorded here, anything else by output()
            gen = self._generation(record, model, messages, provider)
            attrs = gen.attributes
            if type(content) is str and (not output or output.keys() <= _PLAIN_OUTPUT):
                if record.capture_content:
                    attrs[c.GEN_AI_OUTPUT_MESSAGES] = [{"role": "assistant", "content": content}]
                if output:
                    finish_reason = output.get("finish_reason")
                    if finish_reason is not None:
                        attrs[c.GEN_AI_RESPONSE_FINISH_REASONS] = [text(finish_reason)]
                    input_tokens, output_tokens = output.get("input_tokens"), output.get("output_tokens")
                    if input_tokens is None and type(output_tokens) is int and 0 <= output_tokens < _INT64:
                        attrs[c.GEN_AI_USAGE_OUTPUT_TOKENS] = output_tokens  # record_usage, in place
                    else:
                        record_usage(gen, input_tokens, output_tokens)
                gen.end()
            else:
                gen.output(content, **output)  # type: ignore[arg-type]
            return gen
        except Exception as exc:  # noqa: BLE001 - containment (guarded, inline: a per-span call)
            failed("Turn.record_generation", exc)
            return blank_handle(Generation)

    def tool_call(self, name: str, arguments: object = None, call_id: str | None = None) -> ToolCall:
        """Start a tool call span; end it with ``with`` or with ``.result()`` / ``.error()``."""
        try:
            record = self.episode
            if record is None:
                return blank_handle(ToolCall)
            tool = name if type(name) is str else text(name)
            attrs: dict[str, object] = {c.GEN_AI_TOOL_NAME: tool}
            if call_id is not None:
                attrs[c.GEN_AI_TOOL_CALL_ID] = text(call_id)
            if arguments is not None and record.capture_content:
                attrs[c.GEN_AI_TOOL_CALL_ARGUMENTS] = snapshot(arguments)
            span_name = _TOOL_PREFIX + tool if tool else c.SPAN_EXECUTE_TOOL  # c.tool_span_name, in place
            span = child_span(record, span_name, c.KIND_TOOL, self, attrs, ToolCall)
            span._token = span.merged_error = None
            span._entered = span.merged = False
            return span
        except Exception as exc:  # noqa: BLE001 - containment (guarded, inline: a per-span call)
            failed("Turn.tool_call", exc)
            return blank_handle(ToolCall)

    @guarded
    def feedback(self, content: object, role: str = "environment") -> None:
        """Record what the environment (or a user) said back after this turn's action."""
        record = self.episode
        if record is None:
            return
        attrs: dict[str, object] = {c.RL_FEEDBACK_ROLE: text(role)}
        if record.capture_content:
            attrs[c.GEN_AI_INPUT_MESSAGES] = [{"role": text(role), "content": snapshot(content)}]
        span: SpanRecord = child_span(record, c.SPAN_FEEDBACK, c.KIND_SPAN, self, attrs)
        span.end()


def blank_handle(cls: type[_H]) -> _H:
    """A handle of ``cls`` that records nothing (not recording: disabled, unconfigured, or
    after a contained error): no episode, already ended, so every method is a no-op and it is
    never made the current span."""
    handle = _new_span(cls)
    handle.episode = None  # type: ignore[assignment]  # the one span with no episode
    handle.name = handle.kind = ""
    handle.span_id = handle.start_ns = handle.end_ns = 0
    handle.parent_id = None
    handle.attributes = {}
    handle.events = handle.links = handle.status_message = handle._context = None
    handle.status_code = _UNSET
    handle.held = None
    handle._token = None
    handle._entered = False
    if isinstance(handle, CallHandle):
        handle.merged = False
        handle.merged_error = None
    elif isinstance(handle, Turn):
        handle.index = -1
    return handle


def stage_call(record: EpisodeRecord, name: str, kind: str, parent: SpanRecord | None,
               attributes: dict[str, object]) -> SpanRecord:
    """``child_span`` for a ``@traced`` call: a generation or a tool call is a ``Generation`` /
    ``ToolCall`` (its end adds its stage time; ``current_generation()`` returns it as it is),
    owned by the traced call, which ends it (``_entered``); any other kind a plain record."""
    cls = _STAGE_CLASSES.get(kind)
    if cls is None:
        return child_span(record, name, kind, parent, attributes)
    span = child_span(record, name, kind, parent, attributes, cls)
    span._token = span.merged_error = None
    span.merged = False
    span._entered = True
    return span


_STAGE_CLASSES: dict[str, type[CallHandle]] = {c.KIND_GENERATION: Generation, c.KIND_TOOL: ToolCall}


def new_episode_id(step: int) -> str:
    """An episode id when none is given: the step and 64 random bits (``Episode`` makes the
    same, in place, from the bits it draws for its trace)."""
    return f"{step}-{_getrandbits(64):016x}"


_MASK64 = (1 << 64) - 1


def status_value(status: object) -> str | None:
    """The ``rl.status`` that ``Episode.finish(status=...)`` records (None: none, ``ok`` at the
    end): a known status as it is, ``"failed"`` as ``error``, anything else refused."""
    if not isinstance(status, str):
        return None
    if status in c.STATUSES:
        return status
    return c.STATUS_ERROR if status == "failed" else None


def repeated_note(episode_id: str, step: int, occurrence: int) -> str:
    """The ``rl.invalid`` note of an episode whose id an earlier episode of its step had
    (``deterministic_ids``): it keeps its ``rl.episode.id`` and gets its own trace id."""
    return (f"episode_id: {text(episode_id)[:64]!r} repeated in step {step}; occurrence "
            f"{occurrence}, traced under its own trace id")


def claim_trace_id(rt: _runtime.Runtime, trace_id: int, key: tuple[int, str],
                   derive: Callable[[int], int]) -> tuple[int, int]:
    """``trace_id`` for a new episode of ``key``, or ``derive(n)`` when an episode had it
    already (``Pipeline.claim_trace_id``); (trace id, occurrence: 0 for the first)."""
    claim = getattr(rt.pipeline, "claim_trace_id", None)  # a sink without it: ids as they are
    if claim is None:
        return trace_id, 0
    claimed: tuple[int, int] = claim(trace_id, key, derive)
    return claimed


def trace_id_int(run_id: str, step: int, episode_id: str) -> int:
    """A deterministic 128-bit trace id for (run, step, episode id): find a trace from data."""
    digest = hashlib.blake2b(f"{run_id}\x1f{step}\x1f{episode_id}".encode(), digest_size=16)
    return int.from_bytes(digest.digest(), "big") or 1


def trace_id_for(run_id: str, step: int, episode_id: str) -> str:
    """The trace id (32 hex digits, as Jaeger, Phoenix and Trackio's metadata show it) of the
    episode ``episode_id`` of ``step`` in run ``run_id``, recorded with
    ``configure(deterministic_ids=True, run_id=run_id)``: find a kept trace from training data.
    (An episode id repeated within a step gets another id, flagged on its root.)"""
    return f"{trace_id_int(run_id, step, text(episode_id)):032x}"


class Episode:
    """One RL episode: a trace rooted at an ``episode`` span. Use as a (async) ``with`` block.

    The reward may be recorded after the block closed (e.g. the advantage is known only when the
    whole group is scored): it still joins this episode's trace, and the episode waits for it
    until its step closes.
    """

    # slotted: one object per episode handle, no instance dict beside it
    __slots__ = ("_request", "_runtime", "_record", "_token", "_bound", "episode_id", "step", "split",
                 "__weakref__")

    def __init__(
        self,
        step: int | None = None,
        split: str = "train",
        *,
        group_id: object = None,
        sample_index: int | None = None,
        policy_version: int | None = None,
        episode_id: str | None = None,
        dataset_name: str | None = None,
        dataset_index: object = None,
        framework: str | None = None,
        metadata: Mapping[str, object] | None = None,
        name: str = c.SPAN_EPISODE,
        runtime: _runtime.Runtime | None = None,
    ) -> None:
        # what it was asked to record, kept until it starts (a tuple: one object, no __init__)
        self._request: tuple[object, ...] | None = (
            step, split, group_id, sample_index, policy_version, episode_id,
            dataset_name, dataset_index, framework, metadata, name)
        self._runtime = runtime  # None: the installed instance, when the episode starts
        self._record: EpisodeRecord | None = None
        self._token: Token[Context] | None = None  # the context before the ``with`` block
        # an instance given explicitly is bound to the context inside the ``with`` block, so the
        # entry points called there (record_batch, @traced, adapters, reports) use it too
        self._bound: Token[_runtime.Runtime | None] | None = None
        self.episode_id: str | None = episode_id
        self.step: int | None = None
        self.split: str = split

    # --- lifecycle -----------------------------------------------------------------------------
    def start(self) -> Episode:
        """Start recording (``with`` does this); returns self."""
        try:
            if self._record is not None:
                return self
            rt = self._runtime if self._runtime is not None else _runtime.current()
            if not rt.enabled or rt.pipeline is None:
                return self
            record = self._begin(rt, None)
            rt.pipeline.started(record)
            return self
        except Exception as exc:  # noqa: BLE001 - containment (guarded, inline: a per-span call)
            failed("Episode.start", exc)
            return self

    def begin_offered(self, rt: _runtime.Runtime, trace_id: int) -> EpisodeRecord | None:
        """Record this episode for a batch row the sampler was already offered (its trace id
        chosen with the batch): the pipeline is not told it started, and its root and reward
        ending offer nothing. The batch attaches the record to its row."""
        if self._record is not None or not rt.enabled or rt.pipeline is None:
            return None
        record = self._begin(rt, trace_id)
        record.state = OFFERED
        return record

    def _begin(self, rt: _runtime.Runtime, trace_id: int | None) -> EpisodeRecord:
        request = self._request
        if request is None:  # begun already (its request let go): callers check _record first
            raise RuntimeError("episode already begun")
        (step, split, group_id, sample_index, policy_version, episode_id, dataset_name, dataset_index,
         framework, metadata, name) = request
        problems: list[str] = []
        # an adapter (framework) or a batch row (trace id given) records after the fact: its
        # root's times are when it was recorded, not how long it ran
        timed = trace_id is None and framework is None
        if step is None:
            step_value = rt.current_step
        else:
            parsed, problem = ((step, None) if type(step) is int and -_INT64 <= step < _INT64
                               else to_int(step, "step"))
            step_value = rt.current_step if parsed is None else parsed
            if problem is not None:
                problems.append(problem)
                step_value = rt.current_step
            elif step_value < 0:
                problems.append(f"step: negative ({step_value})")
        split = split if type(split) is str else text(split) if split is not None else "train"
        # the episode's ids from one getrandbits: 128 bits of trace id, 64 of root span id, 64 of
        # episode id (a zero id, one chance in 2**64, is drawn again)
        bits = _getrandbits(256)
        step_text = str(step_value)
        episode_id = f"{step_text}-{bits & _MASK64:016x}" if episode_id is None else text(episode_id)
        if trace_id is None:
            if rt.deterministic_ids:
                # a repeated id gets its own trace id, counted and flagged: two episodes under
                # one trace id are one trace to every backend (one of them lost, uncounted)
                trace_id, occurrence = claim_trace_id(
                    rt, trace_id_int(rt.run_id, step_value, episode_id), (step_value, split),
                    lambda n: trace_id_int(rt.run_id, step_value, f"{episode_id}#{n}"),
                )
                if occurrence:
                    problems.append(repeated_note(episode_id, step_value, occurrence))
            else:
                trace_id = bits >> 128 or _runtime.new_id128()
        record = EpisodeRecord(trace_id, step_value, split, rt.pipeline, rt.max_spans_per_episode)
        record.handle = self
        record.capture_content = rt.capture_content
        record.timed = timed
        record.max_attributes = rt.max_attributes_per_span
        attrs: dict[str, object] = {
            c.RL_STEP: step_value,
            c.RL_SPLIT: split,
            c.RL_EPISODE_ID: episode_id,
            c.GEN_AI_CONVERSATION_ID: episode_id,
        }
        if rt.run_id:
            attrs[c.RL_RUN_ID] = rt.run_id
        # the root span: SpanRecord.__init__ and EpisodeRecord.add in place (the first span of
        # its episode: always within the span limit)
        root = _new_span(SpanRecord)
        root.episode = record
        root.name = name if type(name) is str else text(name)
        root.span_id = (bits >> 64) & _MASK64 or _runtime.new_id64()
        root.parent_id = None
        root.kind = c.KIND_EPISODE
        root.start_ns = _time_ns()
        root.end_ns = None
        root.attributes = attrs
        root.events = root.links = root.status_message = root._context = None
        root.status_code = _UNSET
        root.held = True
        record.root = root
        record.spans.append(root)
        # the identity the episode's baggage carries (BAGGAGE_KEYS), as text once, here, from
        # the values just made text: every context of the episode carries this one dict's entries
        run_id = rt.run_id
        identity = {c.RL_RUN_ID: run_id if type(run_id) is str else str(run_id)} if run_id else {}
        identity[c.RL_STEP] = step_text
        identity[c.RL_EPISODE_ID] = episode_id
        if group_id is not None:
            attrs[c.RL_GROUP_ID] = identity[c.RL_GROUP_ID] = group_id if type(group_id) is str else text(group_id)
        record.identity = identity
        if sample_index is not None:
            attrs[c.RL_SAMPLE_INDEX] = (sample_index if type(sample_index) is int and 0 <= sample_index < _INT64
                                        else _integer(root, sample_index, "sample_index"))
        if policy_version is not None:
            attrs[c.RL_POLICY_VERSION] = _integer(root, policy_version, "policy_version")
        if dataset_name is not None:
            attrs[c.RL_DATASET_NAME] = text(dataset_name)
        if dataset_index is not None:
            # an index beyond 64 bits is kept exact as text (no backend stores such an integer)
            attrs[c.RL_DATASET_INDEX] = (
                dataset_index if isinstance(dataset_index, str)
                or (isinstance(dataset_index, int) and fits_int64(dataset_index)) else text(dataset_index))
        if framework is not None:
            attrs[c.RL_SYSTEM_NAME] = text(framework)
        if metadata:
            self._metadata(root, metadata)
        for problem in problems:
            flag(root, problem)
        self._record = record
        self.episode_id, self.step, self.split = episode_id, step_value, split
        # what was asked is recorded now: the user's objects (a metadata mapping of any size)
        # are not held any longer, while the episode waits for its decision
        self._request = None
        return record

    def _metadata(self, root: SpanRecord, metadata: object) -> None:
        if not isinstance(metadata, Mapping):
            flag(root, f"metadata: expected a mapping, got {type(metadata).__name__}")
            return
        capture = root.episode.capture_content
        total = len(metadata)
        # within the root span's budgets: keys cut to MAX_KEY_CHARS, no more than the span's
        # share of the attribute limit (the rest counted and flagged once in rl.invalid)
        for i, (key, value) in enumerate(metadata.items()):
            name = c.RL_METADATA_PREFIX + bounded_key(root, key, "metadata", prefix=c.RL_METADATA_PREFIX)
            if not has_room(root, name, "metadata", left_out=total - i):
                break
            if isinstance(value, (bool, int, float)) or value is None:
                if isinstance(value, int) and not isinstance(value, bool):
                    # an int beyond 64 bits: converted (and said so), never lost downstream
                    value, problem = storable_number(value, name)
                    if problem is not None:
                        flag(root, problem)
                root.attributes[name] = value
            elif isinstance(value, str) or capture:
                root.attributes[name] = snapshot(value)

    def __enter__(self) -> Episode:
        if self._runtime is not None:
            self._bound = _runtime.slot().bound.set(self._runtime)
            self.start()
        elif self._record is None:  # start(), in place for the installed instance
            try:
                rt = _runtime.current()
                pipeline = rt.pipeline
                if rt.enabled and pipeline is not None:
                    pipeline.started(self._begin(rt, None))
            except Exception as exc:  # noqa: BLE001 - containment (as in start)
                failed("Episode.start", exc)
        record = self._record
        if record is not None and record.root is not None:
            # span_context in place: the root current and the episode's identity in the
            # baggage, in the root's one context copy
            identity = record.identity
            values = dict(current_context())
            values[SPAN_KEY] = record.root
            values[_BAGGAGE] = episode_baggage(
                record, identity if identity is not None else identity_of(record.root.attributes),
                values.get(_BAGGAGE))
            self._token = attach_context(Context(values))
        return self

    def __exit__(self, exc_type: type[BaseException] | None, exc: BaseException | None,
                 tb: TracebackType | None) -> None:
        # never raises: the user's exception, if any, must leave this block as it came in
        try:
            token, self._token = self._token, None
            if token is not None:
                try:
                    reset_context(token)  # detach_context, in place
                except Exception:  # noqa: BLE001 - a token of another context is let be
                    pass
            self._close(exc)
            bound, self._bound = self._bound, None
            if bound is not None:
                try:
                    _runtime.slot().bound.reset(bound)
                except Exception:  # noqa: BLE001 - a token of another context is let be
                    pass
        except Exception as err:  # noqa: BLE001 - containment is the point
            # (a SystemExit or KeyboardInterrupt here comes from a signal handler: it goes on)
            contained("Episode.__exit__", err)

    async def __aenter__(self) -> Episode:
        return self.__enter__()

    async def __aexit__(self, exc_type: type[BaseException] | None, exc: BaseException | None,
                        tb: TracebackType | None) -> None:
        self.__exit__(exc_type, exc, tb)

    def _close(self, exc: BaseException | None) -> None:
        # not guarded itself: its callers, __exit__ and end(), are
        record = self._record
        if record is None or record.root is None or record.root.end_ns is not None:
            return
        root = record.root
        attrs = root.attributes
        if exc is None:
            pass  # (the common case, first: no isinstance)
        elif isinstance(exc, (SystemExit, KeyboardInterrupt, GeneratorExit)):
            # the process is exiting (sys.exit, Ctrl-C, SIGINT) or the episode was abandoned:
            # it did not fail, it was cut short
            attrs[c.RL_STATUS] = c.STATUS_TRUNCATED
            attrs.setdefault(c.RL_FINISH_REASON, type(exc).__name__)
        else:
            root.fail(exc)
            attrs[c.RL_STATUS] = c.STATUS_ERROR
        attrs.setdefault(c.RL_STATUS, c.STATUS_OK)
        if record.state == OPEN:  # SpanRecord.end in place: the root's end offers the episode
            root.end_ns = _time_ns()
            record.sink.part_ended(record)
        else:
            root.end()

    @guarded
    def end(self, status: str | None = None) -> None:
        """End the episode span without a ``with`` block (idempotent)."""
        if status is not None:
            self.finish(status=status)
        self._close(None)

    # --- recording -----------------------------------------------------------------------------
    @property
    def trace_id(self) -> str | None:
        """This episode's trace id as 32 hex digits (None when not recording)."""
        return None if self._record is None else f"{self._record.trace_id:032x}"

    @property
    def recording(self) -> bool:
        return self._record is not None

    @property
    def root(self) -> SpanRecord | None:
        """The episode's root span record (None when not recording): for the library's own
        decorators, which annotate it."""
        return None if self._record is None else self._record.root

    @property
    def reward_span(self) -> SpanRecord | None:
        """The episode's reward span once ``reward()`` recorded one (None before, or when not
        recording): for adapters that add what the reward was judged against (opponents,
        verdicts, a teacher's score) and links to the episodes it was compared with."""
        return None if self._record is None else self._record.reward_span

    def prompt(self, messages: object, *, system_instructions: object = None) -> None:
        """Record the initial messages (a list of OpenAI-style messages or plain text).

        ``system_instructions``: instructions given to the model apart from the chat history
        (``gen_ai.system_instructions``); a system message inside ``messages`` stays there, as
        the GenAI conventions ask.
        """
        try:
            record = self._record
            if record is None:
                return
            attrs: dict[str, object] = {}
            if record.capture_content:
                attrs[c.GEN_AI_INPUT_MESSAGES] = as_messages(messages, "user", record)
                if system_instructions is not None:
                    attrs[c.GEN_AI_SYSTEM_INSTRUCTIONS] = snapshot(system_instructions)
            span: SpanRecord = child_span(record, c.SPAN_PROMPT, c.KIND_PROMPT, record.root, attrs)
            if record.state < KEPT:  # SpanRecord.end of a span of no stage, in place
                span.end_ns = span.start_ns
            else:
                span.end(span.start_ns)
            root = record.root
            if root is not None and getattr(record.sink, "watch_hashes", False):
                digest = prompt_hash(messages)  # only a run watching prompts by hash pays for it
                if digest is not None:
                    root.attributes[c.RL_PROMPT_HASH] = digest
        except Exception as exc:  # noqa: BLE001 - containment (guarded, inline: a per-span call)
            failed("Episode.prompt", exc)

    def turn(self) -> Turn:
        """Start the next turn (its index auto-increments from 0)."""
        try:
            record = self._record
            if record is None:
                return blank_handle(Turn)
            index = record.next_turn
            record.next_turn = index + 1
            turn = child_span(record, c.SPAN_TURN, c.KIND_TURN, None, {c.RL_TURN_INDEX: index}, Turn)
            turn._token = None
            turn._entered = False
            turn.index = index
            return turn
        except Exception as exc:  # noqa: BLE001 - containment (guarded, inline: a per-span call)
            failed("Episode.turn", exc)
            return blank_handle(Turn)

    def reward(
        self,
        value: object = None,
        *,
        components: Mapping[str, object] | None = None,
        advantage: object = None,
    ) -> None:
        """Record the reward (and its components, and the advantage): numbers, never text."""
        try:
            record = self._record
            if record is None:
                return
            root = record.root
            if root is None or record.state == DROPPED:
                return  # (dropped: the sampler already let this episode go, nothing is exported)
            span = record.reward_span
            if (span is None and record.state == OPEN and type(value) is float and value - value == 0.0
                    and components is None and advantage is None and root.end_ns is None):
                # the common case in place: a first finite float reward inside the episode's
                # block. The reward span is made (child_span's work, with its one attribute),
                # stage time added, its end recorded; the root's end offers the episode.
                span = _new_span(SpanRecord)
                span.episode = record
                span.name = c.SPAN_REWARD
                span.span_id = _getrandbits(64) or _runtime.new_id64()
                span.parent_id = root.span_id
                span.kind = c.KIND_REWARD
                span.start_ns = start = _time_ns()
                span.attributes = {c.RL_REWARD: value}
                span.events = span.links = span.status_message = span._context = None
                span.status_code = _UNSET
                spans = record.spans
                if len(spans) + len(record.foreign) < record.max_spans:
                    spans.append(span)
                    span.held = True
                else:
                    record.dropped_spans += 1
                    span.held = False
                record.reward_span = span
                root.attributes[c.RL_REWARD] = value  # the library's own key: always room
                span.end_ns = end = _time_ns()
                timing = record.timing
                if timing is None:
                    record.timing = [0, 0, end - start, -1, -1, end, end, 0]
                else:
                    stage_ended(record, STAGE_REWARD, start, end)
                return
            if span is None or record.state == KEPT:  # first reward, or a late one after the decision
                span = child_span(record, c.SPAN_REWARD, c.KIND_REWARD, root)
                if record.reward_span is None:
                    record.reward_span = span
            values: dict[str, float] = {}
            if value is not None:
                number, problem = to_float(value, "reward")
                if number is not None:
                    values[c.RL_REWARD] = number
                elif problem is not None:
                    flag(span, problem)
                    _reward_refused(root, problem)
            if components:
                if isinstance(components, Mapping):
                    for key, comp in components.items():
                        number = _number(span, comp, f"reward.{key}")
                        if number is not None:
                            values[c.RL_REWARD_COMPONENT_PREFIX + text(key)] = number
                else:
                    flag(span, f"components: expected a mapping, got {type(components).__name__}")
            if advantage is not None:
                number = _number(span, advantage, "advantage")
                if number is not None:
                    values[c.RL_ADVANTAGE] = number
            for key, number in values.items():  # component names are the user's: bounded
                _put(span, key, number)
                _put(root, key, number)
            if span.end_ns is None:
                end = _time_ns()
                if record.state < KEPT:  # where the reward stage ends
                    stage_ended(record, STAGE_REWARD, span.start_ns, end)
                span.end(end)
            elif record.state < KEPT:
                record.sink.part_ended(record)
        except Exception as exc:  # noqa: BLE001 - containment (guarded, inline: a per-span call)
            failed("Episode.reward", exc)

    @guarded
    def finish(self, reason: str | None = None, status: str | None = None) -> None:
        """Record why the episode ended (``stop``, ``length``…) and its ``rl.status``."""
        record = self._record
        root = record.root if record is not None else None
        if root is None:
            return
        if reason is not None:
            root.attributes[c.RL_FINISH_REASON] = text(reason)
        if status is not None:
            if status not in c.STATUSES:
                flag(root, f"status: expected one of {', '.join(c.STATUSES)}, got {refused(status)}")
                status = c.STATUS_ERROR if status == "failed" else None
            if status == c.STATUS_OK and root.status_code is StatusCode.ERROR:
                status = None  # an error already recorded (a refused reward) is not undone by "ok"
            if status is not None:
                root.attributes[c.RL_STATUS] = status
                if status == c.STATUS_ERROR and root.status_code is not StatusCode.ERROR:
                    root.fail(message=reason or "episode failed")

    @guarded
    def set_attribute(self, key: str, value: object) -> None:
        """Set an extra attribute on the episode root span."""
        root = self.root
        if root is not None:
            put_attribute(root, key, snapshot(value), "attributes")


def episode(
    step: int | None = None,
    split: str = "train",
    *,
    group_id: object = None,
    sample_index: int | None = None,
    policy_version: int | None = None,
    episode_id: str | None = None,
    dataset_name: str | None = None,
    dataset_index: object = None,
    framework: str | None = None,
    metadata: Mapping[str, object] | None = None,
) -> Episode:
    """Record one episode as one trace: ``with otr.episode(step=...) as ep:`` (or ``async with``).

    ``step`` defaults to the current training step (advanced by ``end_step``). The cap of the
    tail sampler holds per (step, split).
    """
    return Episode(
        step,
        split,
        group_id=group_id,
        sample_index=sample_index,
        policy_version=policy_version,
        episode_id=episode_id,
        dataset_name=dataset_name,
        dataset_index=dataset_index,
        framework=framework,
        metadata=metadata,
    )


def current_generation() -> Generation:
    """The generation recording in the current context (inside ``with turn.generation()`` or a
    ``@traced(kind="generation")`` function), to record what only the body knows, e.g.
    ``otr.current_generation().usage(input_tokens=812, output_tokens=64)``. Outside one, a
    handle whose methods do nothing. Its ``output()`` does not end the span."""
    span = current_span()
    if isinstance(span, Generation) and span.end_ns is None and span._entered:
        return span  # the span belongs to its block or function: they end it
    handle = blank_handle(Generation)
    handle._entered = True
    return handle


def current_episode() -> Episode | None:
    """The episode recording in the current context, or None."""
    span = current_span()
    if isinstance(span, SpanRecord):
        handle = span.episode.handle
        return handle if isinstance(handle, Episode) else None
    return None


def now_ns() -> int:
    return time.time_ns()
