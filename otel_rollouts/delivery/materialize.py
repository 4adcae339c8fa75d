"""Kept episode records become OpenTelemetry SDK ``ReadableSpan`` objects (export thread only)."""

from __future__ import annotations

import json
import re
from collections.abc import Callable, Iterable, Iterator, Mapping, Sequence
from typing import Any

from opentelemetry import trace
from opentelemetry.sdk.resources import Resource
from opentelemetry.sdk.trace import Event, ReadableSpan
from opentelemetry.sdk.util.instrumentation import InstrumentationScope
from opentelemetry.trace import SpanContext, SpanKind, TraceFlags
from opentelemetry.trace.status import Status, StatusCode

from otel_rollouts import conventions as c
from otel_rollouts._core import redaction
from otel_rollouts._core.codec import PendingSpan
from otel_rollouts._core.content import Deferred, cut, jsonable, precut, to_json
from otel_rollouts._core.spans import EpisodeRecord, SpanRecord
from otel_rollouts._core.stages import stage_totals
from otel_rollouts.delivery.views import EpisodeViews, Expand, SoFar, SpanView, error_type, settle

_SAMPLED = TraceFlags(TraceFlags.SAMPLED)
_PRIMITIVES = (str, bool, int, float)
_NUMBER_CHARS = 24  # the most characters one number takes in OTLP/JSON (a double's repr)
_SURROGATE = re.compile("[\ud800-\udfff]")
_KEY_CACHE = 8192  # attribute keys remembered clean (names repeat: conventions, flattened views)
_SMALLEST_CUT = 256  # a text cut under the episode's budget still keeps this much (see _text)


def valid_utf8(text: str) -> tuple[str, bool]:
    """``text`` encodable as UTF-8 (a lone surrogate becomes U+FFFD), and whether it changed:
    one such character would make an exporter fail or skip the whole batch."""
    if text.isascii():
        return text, False
    fixed, n = _SURROGATE.subn("\ufffd", text)
    return fixed, n > 0


class Materializer:
    """Renders records with the run's resource, scope and content limits."""

    def __init__(
        self,
        resource: Resource,
        scope: InstrumentationScope,
        max_attribute_chars: int = 16_384,
        redact: Callable[[str], str] | None = None,
        max_episode_chars: int | None = None,
        agent_name: str | None = None,
        capture_content: bool = True,
    ) -> None:
        self.resource = resource
        self.scope = scope
        self.max_attribute_chars = max_attribute_chars
        self.redact = redact
        # names and keys: a stable placeholder per secret (Redactor.name), so the tree still reads
        self.redact_name: Callable[[str], str] | None = getattr(redact, "name", redact)
        self.capture_content = capture_content
        # text budget of one whole episode (all its attributes); None: unlimited
        self.max_episode_chars = max_episode_chars
        self._budget: int | None = None
        self._redacted: dict[str, str] | None = None  # per episode: text -> redacted text
        self._redacted_whole: dict[str, str] | None = None  # the same, for text redacted uncut
        self._keys: dict[str, tuple[str, bool]] = {}  # attribute key -> (as it leaves, replaced?)
        # the most characters any cut below keeps of a text's head and of its tail (None: texts
        # are not cut): a longer text is cut to that before it is redacted, encoded or copied
        # into the views, so that a kept episode costs what its limits allow, not what its
        # content weighs (cut(precut(t)) is cut(t); see content.precut and Redactor.bounded)
        most = max(max_attribute_chars, _SMALLEST_CUT) if max_attribute_chars > 0 else 0
        self._keep: int | None = most // 2 + 1 if most else None
        # a Redactor reads only what the cut keeps (and a margin); another callable sees it all
        self._bounded: Callable[[str, int], str] | None = getattr(redact, "bounded", None)
        # gen_ai.agent.name on each root: configured, else the service name
        self.views = EpisodeViews(agent_name or _service_name(resource), capture_content)

    def describe_run(self, attributes: Mapping[str, str]) -> None:
        """The run's description (``otr.describe_run``) added to the resource of every span
        rendered from now on (redacted as the rest of the resource was)."""
        redact = self.redact
        values = {key: redact(value) if redact is not None else value for key, value in attributes.items()}
        self.resource = self.resource.merge(Resource(values))

    def episode(self, record: EpisodeRecord) -> list[ReadableSpan]:
        # other processes' spans (a server's, through the span gateway) are decoded now that the
        # episode is kept; a server span under a generation lends it the engine's timings
        foreign = [f.decode() if isinstance(f, PendingSpan) else f for f in record.foreign]
        if any(isinstance(f, PendingSpan) for f in record.foreign):
            lend_timings(record.spans, foreign)
        self._budget = self.max_episode_chars
        self._redacted = {}
        self._redacted_whole = {}
        try:
            # redacted once, here: the views are built from clean values, so their texts (which
            # repeat the episode's content several times over) need no second scan
            records = [(s, self._clean(self._content(_resolved(s)))) for s in _expanded(record.spans)]
            views = self.views.views([
                (s.span_id, s.parent_id, s.kind, attrs, self._clean_text(_failure(s))) for s, attrs in records
            ])
            # every span's own content first, then the views, with what is left of the budget
            rendered = [self._main(s, attrs, views.get(s.span_id), redact=False) for s, attrs in records]
            spans = [
                self._build(record.trace_id, s, attributes, truncated, views.get(s.span_id), redact=False)
                for (s, _), (attributes, truncated) in zip(records, rendered, strict=True)
            ]
        finally:
            self._budget = None
            self._redacted = None
            self._redacted_whole = None
        spans.extend(self.foreign(s) for s in foreign)
        return spans

    def foreign(self, span: ReadableSpan | PendingSpan) -> ReadableSpan:
        """A span of other instrumentation, redacted as ours are: its name, attribute keys and
        values, events, links and status. Its attributes keep the content its own
        instrumentation chose to record; its exceptions follow our content rule."""
        if isinstance(span, PendingSpan):
            span = span.decode()
        if self.redact is None and self.capture_content:
            return span
        events = tuple(
            Event(self._name_out(e.name), self._plain(e.attributes, exception=e.name == c.EVENT_EXCEPTION),
                  timestamp=e.timestamp)
            for e in span.events
        )
        links = tuple(trace.Link(link.context, self._plain(link.attributes)) for link in span.links)
        status = span.status
        if status.description:
            events_seen = [(e.name, e.attributes or {}, e.timestamp) for e in span.events]
            status = Status(status.status_code, self._status_text(status.description, events_seen))
        return ReadableSpan(
            name=self._name_out(span.name),
            context=span.context,
            parent=span.parent,
            resource=span.resource,
            attributes=self._plain(span.attributes),
            events=events,
            links=links,
            kind=span.kind,
            status=status,
            start_time=span.start_time,
            end_time=span.end_time,
            instrumentation_scope=span.instrumentation_scope,
        )

    def span(self, trace_id: int, s: SpanRecord) -> ReadableSpan:
        """One span on its own (a late span of a kept episode): no conversation to read."""
        attrs = self._content(_resolved(s))
        view = self.views.views([(s.span_id, s.parent_id, s.kind, attrs, _failure(s))]).get(s.span_id)
        attributes, truncated = self._main(s, attrs, view)
        return self._build(trace_id, s, attributes, truncated, view)

    def _name_out(self, name: str) -> str:
        """A span, event or attribute name as it leaves: valid UTF-8, secrets as placeholders."""
        name = valid_utf8(name)[0] if isinstance(name, str) else str(name)
        return self.redact_name(name) if self.redact_name is not None else name

    def _secret_key(self, key: str) -> bool:
        secret_key = getattr(self.redact, "secret_key", None)
        return secret_key is not None and secret_key(key)

    def _text_out(self, text: str) -> str:
        text = valid_utf8(text)[0]
        if self.redact is None:
            return text
        if self._redacted_whole is not None:
            return self._clean_whole(text) or ""  # during an episode: once per distinct text
        return self.redact(text)

    def _plain(self, attributes: Any, *, exception: bool = False) -> dict[str, Any]:
        """Attributes already in OpenTelemetry's shape (other instrumentation's, events', links'),
        redacted; an exception's keep only its type when content capture is off."""
        out: dict[str, Any] = {}
        for key, value in (attributes or {}).items():
            if exception and not self.capture_content and key not in c.EXCEPTION_LABEL_KEYS:
                continue
            if isinstance(value, str):
                value = redaction.REPLACEMENT if self._secret_key(key) else self._text_out(value)
            elif isinstance(value, (tuple, list)):
                value = tuple(self._text_out(v) if isinstance(v, str) else v for v in value)
            out[self._name_out(key)] = value
        return out

    def _status_text(self, message: str, events: Iterable[tuple[str, Mapping[str, object], int]] | None) -> str:
        """A failure's description: with content capture off, the exception's type stands for
        it, else ``_OTHER``: a description is free text (``ToolCall.error("...")``, the
        OpenTelemetry API's ``set_status``, other instrumentation's) and may quote content.
        Otherwise the redacted message. Every exporter sees this render (the one place)."""
        if not self.capture_content:
            return self._text_out(error_type(events))
        return self._text_out(message)

    def _content(self, attributes: dict[str, Any]) -> dict[str, Any]:
        """With content capture off, the text values that are not labels are left out (their
        keys named in ``rl.content.omitted``): a value given to ``set_attribute`` is content
        like a prompt is. Numbers and booleans stay."""
        if self.capture_content:
            return attributes
        out: dict[str, Any] = {}
        omitted: list[str] = []
        for key, value in attributes.items():
            if value is None or isinstance(value, (bool, int, float)) or c.is_label(key):
                out[key] = value
            elif isinstance(value, (list, tuple)) and value and all(isinstance(v, (bool, int, float)) for v in value):
                out[key] = value
            else:
                omitted.append(self._name_out(key))
        if omitted:
            out[c.RL_OMITTED_FIELDS] = omitted
        return out

    def _clean(self, attributes: dict[str, Any]) -> dict[str, Any]:
        """The recorded values with secrets redacted (when redacting), as values, not text, and
        each text longer than a cut can show cut to what it can (head and tail, see ``_keep``).

        A container is redacted as the JSON text it renders to (patterns such as
        ``"password": "…"`` need the key beside the value) and read back only if that changed
        anything; a redacted text that is no JSON any more stays text.
        """
        if self.redact is None and self._keep is None:
            return attributes
        out: dict[str, Any] = {}
        for key, value in attributes.items():
            if value is None or isinstance(value, (bool, int, float)):
                out[key] = value
            elif isinstance(value, str):
                if self._secret_key(key):
                    out[key] = redaction.REPLACEMENT
                elif c.is_label(key) and self.redact_name is not None:
                    # a label (a tool's or model's name, an id) reads as the span name does
                    out[key] = self.redact_name(value)
                elif _read_as_json(key, value):
                    out[key] = self._clean_whole(value)  # the views parse it: cut, it would not
                else:
                    out[key] = self._clean_text(value)
            else:
                # each text inside on its own first (a secret in JSON text is escaped, and a
                # pattern might not see it there), then the whole as JSON text
                value = self._walk(value)
                if self.redact is None:
                    out[key] = value
                    continue
                text = _json(value)  # JSON-safe already (_resolved): no second copy
                clean = self._clean_whole(text)
                if clean is None or clean == text:
                    out[key] = value
                else:
                    try:
                        out[key] = json.loads(clean)
                    except ValueError:
                        out[key] = clean
        return out

    def _walk(self, value: object, depth: int = 0) -> Any:
        """A JSON-safe value with each text redacted (and cut, see ``_clean_text``), and the value
        of a key naming a secret replaced; keys are redacted whole, never cut."""
        if isinstance(value, str):
            return self._clean_text(value)
        if depth > 64:
            return value
        if isinstance(value, dict):
            return {
                self._clean_whole(k) if isinstance(k, str) else k:
                redaction.REPLACEMENT if isinstance(k, str) and self._secret_key(k) and isinstance(v, (str, int, float))
                and not isinstance(v, bool)
                else self._clean_whole(v) if k == _ARGUMENTS and isinstance(v, str) and _may_be_json(v)
                else self._walk(v, depth + 1)
                for k, v in value.items()
            }
        if isinstance(value, list):
            return [self._walk(v, depth + 1) for v in value]
        return value

    def _clean_text(self, text: str | None) -> str | None:
        """``text`` redacted (once per distinct text in an episode), and cut to what the cuts
        below can show of it when it is longer: a Redactor then reads only that and a margin."""
        if text is None:
            return text
        keep = self._keep
        if self.redact is None:
            return precut(text, keep) if keep is not None else text
        if self._bounded is None or keep is None or len(text) <= 2 * keep:
            # redacted whole either way (a Redactor reads short text whole): one scan, shared
            # with the texts redacted whole (keys, a failure's message)
            return self._clean_whole(text)
        cache = self._redacted
        clean = cache.get(text) if cache is not None else None
        if clean is None:
            clean = self._bounded(text, keep)
            if cache is not None:
                cache[text] = clean
        return clean

    def _clean_whole(self, text: str | None) -> str | None:
        """``text`` redacted as a whole, never cut (keys; the JSON text of a container, which
        has to stay JSON to be read back), once per distinct text in an episode."""
        if text is None or self.redact is None:
            return text
        cache = self._redacted_whole
        if cache is None:
            return self.redact(text)
        clean = cache.get(text)
        if clean is None:
            clean = cache[text] = self.redact(text)
        return clean

    def _main(self, s: SpanRecord, recorded: dict[str, Any], view: SpanView | None, *,
              redact: bool = True) -> tuple[dict[str, Any], list[str]]:
        """The span's own content, in the conventions' shape, under the episode's budget."""
        merged = {**recorded, **settle(view.main)} if view is not None else dict(recorded)
        if s.kind == c.KIND_EPISODE:
            merged.update(sampling_notes(s.episode, merged))  # before the views: in Phoenix's metadata
            merged.update(self.views.root(merged))
            # only kept episodes are rendered: a shared Collector's tail_sampling keys on this
            merged[c.RL_TRACE_KEPT] = True
        if s.status_code is StatusCode.ERROR:
            merged[c.ERROR_TYPE] = error_type(s.events or ())
        return self._attributes(merged, redact=redact)

    def _build(self, trace_id: int, s: SpanRecord, attributes: dict[str, Any], truncated: list[str],
               view: SpanView | None, *, redact: bool = True) -> ReadableSpan:
        if view is not None and view.derived and (self._budget is None or self._budget > 0):
            # views repeat content recorded elsewhere: written while the budget lasts, and not
            # named in rl.content.truncated (what was recorded is there, whole or flagged); they
            # are all texts (or JSON written as text), so with the budget spent none would be
            # written and none is computed
            derived, _ = self._attributes(settle(view.derived), optional=True, redact=redact)
            for key, value in derived.items():
                attributes.setdefault(key, value)
        if truncated:
            attributes[c.RL_TRUNCATED_FIELDS] = truncated
        recorded_events = [
            Event(self._name_out(name), self._event_attributes(name, attrs), timestamp=ts)
            for name, attrs, ts in s.events or ()
        ]
        at = s.end_ns if s.end_ns is not None else s.start_ns
        scores = view.events if view is not None else ()
        events = tuple(recorded_events + [Event(name, attrs, timestamp=at) for name, attrs in scores])
        message = s.status_message if s.status_code is StatusCode.ERROR else None
        if message:
            message = self._status_text(message, s.events)
        parent = (
            SpanContext(trace_id, s.parent_id, is_remote=False, trace_flags=_SAMPLED)
            if s.parent_id is not None
            else None
        )
        name, bad_name = valid_utf8(s.name)
        if bad_name:
            attributes.setdefault(c.RL_REPLACED_FIELDS, []).append("span.name")
        if self.redact_name is not None:
            name = self.redact_name(name)
        status = Status(s.status_code, message)
        return ReadableSpan(
            name=name,
            context=SpanContext(trace_id, s.span_id, is_remote=False, trace_flags=_SAMPLED),
            parent=parent,
            resource=self.resource,
            attributes=attributes,
            events=events,
            links=tuple(s.links or ()),
            # an inference call is a client call to a model server (GenAI conventions)
            kind=SpanKind.CLIENT if s.kind == c.KIND_GENERATION else SpanKind.INTERNAL,
            status=status,
            start_time=s.start_ns,
            end_time=s.end_ns if s.end_ns is not None else s.start_ns,
            instrumentation_scope=self.scope,
        )

    def _event_attributes(self, name: str, attributes: dict[str, Any]) -> dict[str, Any]:
        """A recorded event's attributes: as a span's, with the content rule: text kept only for
        an exception's type when content capture is off."""
        if not self.capture_content:
            keep = c.EXCEPTION_LABEL_KEYS if name == c.EVENT_EXCEPTION else ()
            attributes = {k: v for k, v in attributes.items() if k in keep or not isinstance(v, (str, list, tuple, dict))}
        return self._attributes(attributes)[0]

    def _attributes(self, raw: dict[str, Any], *, optional: bool = False,
                    redact: bool = True) -> tuple[dict[str, Any], list[str]]:
        """Attribute values as OpenTelemetry takes them: text cut and redacted, JSON for the rest.

        ``optional`` (views of content recorded elsewhere): a text that finds the episode's
        budget spent is left out instead of kept as a stub.
        """
        out: dict[str, Any] = {}
        truncated: list[str] = []
        replaced: list[str] = []
        limit = self.max_attribute_chars
        keys = self._keys
        for key, value in self._items(raw, optional):
            if value is None:
                continue
            known = keys.get(key)
            if known is None:
                clean_key, bad_key = (key, False) if key.isascii() else valid_utf8(key)
                if self.redact_name is not None:
                    clean_key = self.redact_name(clean_key)
                if len(keys) >= _KEY_CACHE:
                    keys.clear()
                known = keys[key] = (clean_key, bad_key)
            key, bad_key = known
            if bad_key:
                replaced.append(key)
            kind = type(value)
            if kind is str and not redact and limit > 0:
                # the common case, already clean: a short ASCII text within the budget, as is
                size, budget = len(value), self._budget
                if budget is None:
                    if size <= limit and value.isascii():
                        out[key] = value
                        continue
                elif 0 < size <= limit and size <= budget and value.isascii():
                    out[key] = value
                    self._budget = budget - size
                    continue
            if kind is bool or kind is int or kind is float or isinstance(value, (bool, int, float)):
                out[key] = value
                continue
            if isinstance(value, (list, tuple)) and value and _homogeneous(value):
                items, was_cut, bad = self._list(value, limit, redact)
                out[key] = items
                if was_cut:
                    truncated.append(key)
                if bad:
                    replaced.append(key)
                continue
            if optional and self._budget is not None and self._budget <= 0:
                continue
            if isinstance(value, SoFar) and not redact:
                text, was_cut = self._so_far(value, limit)  # what the cut keeps of it, no more
            else:
                text = value if isinstance(value, str) else _json(value.parts() if isinstance(value, SoFar) else value)
                text, was_cut = self._text(text, limit, redact)
            text, bad = (text, False) if text.isascii() else valid_utf8(text)
            out[key] = text
            if was_cut:
                truncated.append(key)
            if bad:
                replaced.append(key)
        if replaced:
            out[c.RL_REPLACED_FIELDS] = replaced
        return out, truncated

    def _items(self, raw: dict[str, object], optional: bool) -> Iterator[tuple[str, Any]]:
        """``raw``'s items, each ``Expand`` read in place item by item, and only while the
        episode's budget lasts when ``optional`` (its items are texts: none would be written)."""
        for key, value in raw.items():
            if not isinstance(value, Expand):
                yield key, value
                continue
            for item in value.items():
                if optional and self._budget is not None and self._budget <= 0:
                    break
                yield item

    def _so_far(self, view: SoFar, limit: int) -> tuple[str, bool]:
        """``_text`` of a conversation so far's JSON text (clean already), built only as far as
        the cut shows it (see ``SoFar.text``)."""
        budget = self._budget
        if budget is None:
            return view.text(limit, _json)
        limit = max(min(limit, budget), _SMALLEST_CUT) if limit > 0 else max(budget, _SMALLEST_CUT)
        text, was_cut = view.text(limit, _json)
        self._budget = max(budget - len(text), 0)
        return text, was_cut

    def _list(self, values: Any, limit: int, redact: bool) -> tuple[list[Any], bool, bool]:
        """A homogeneous list within ``limit`` characters (and the episode's budget) in all:
        head and tail kept, each text cut and made valid UTF-8."""
        if limit <= 0:
            limit = self._budget if self._budget is not None else 0
        elif self._budget is not None:
            limit = max(min(limit, self._budget), 256)
        if not isinstance(values[0], str):
            # a number renders in at most _NUMBER_CHARS characters of OTLP/JSON
            most = max(limit // _NUMBER_CHARS, 2) if limit > 0 else len(values)
            if len(values) <= most:
                items, was_cut = list(values), False
            else:
                items, was_cut = list(values[: most // 2]) + list(values[len(values) - (most - most // 2) :]), True
            if self._budget is not None:
                self._budget = max(self._budget - len(items) * _NUMBER_CHARS, 0)
            return items, was_cut, False
        head: list[str] = []
        tail: list[str] = []
        bad = was_cut = False
        total, n = 0, len(values)
        half = limit // 2 if limit > 0 else None
        i, j = 0, n - 1
        while i <= j:  # from both ends, alternately, while the halves have room
            for side in (0, 1):
                if i > j:
                    break
                index = i if side == 0 else j
                text, shortened = cut(values[index], limit) if limit > 0 else (values[index], False)
                if half is not None and total + len(text) > 2 * half and (head or tail):
                    i = j + 1  # no room left: the middle is cut
                    break
                if redact:
                    text = self._clean_text(text)
                text, replaced = valid_utf8(text)
                bad = bad or replaced
                was_cut = was_cut or shortened
                total += len(text)
                if side == 0:
                    head.append(text)
                    i += 1
                else:
                    tail.append(text)
                    j -= 1
        items = head + tail[::-1]
        was_cut = was_cut or len(items) < n
        if self._budget is not None:
            self._budget = max(self._budget - total, 0)
        return items, was_cut, bad

    def _text(self, text: str, limit: int, redact: bool = True) -> tuple[str, bool]:
        if redact:
            text = self._clean_text(text) or ""  # a str in, a str out
        budget = self._budget
        if budget is not None:
            # the episode's budget is shared by its texts, in span order; each keeps at least a
            # small head and tail so that a cut text still shows what it was
            limit = max(min(limit, budget), _SMALLEST_CUT) if limit > 0 else max(budget, _SMALLEST_CUT)
            was_cut = len(text) > limit
            if was_cut:
                text = cut(text, limit)[0]
            self._budget = max(budget - len(text), 0)
            return text, was_cut
        return cut(text, limit)

    def pending(self, record: EpisodeRecord) -> list[ReadableSpan]:
        """A pending snapshot (``sampling.hung``: a copy of an episode still running, its open
        spans ended at the snapshot's time) rendered as a kept episode is (views, redaction,
        limits), except that its root does not claim to be kept: no ``rl.trace.kept`` or
        ``rl.trace.keep_reason`` (a Collector's tail sampling keys on them), ``rl.pending.snapshot`` true."""
        spans = self.episode(record)
        root = record.root
        if root is None:
            return spans
        out: list[ReadableSpan] = []
        for span in spans:
            if span.context is None or span.context.span_id != root.span_id:
                out.append(span)
                continue
            attributes = {k: v for k, v in (span.attributes or {}).items()
                          if k not in (c.RL_TRACE_KEPT, c.RL_KEEP_REASON)}
            attributes[c.RL_PENDING_SNAPSHOT] = True
            out.append(ReadableSpan(
                name=span.name, context=span.context, parent=span.parent, resource=span.resource,
                attributes=attributes, events=span.events, links=span.links, kind=span.kind,
                status=span.status, start_time=span.start_time, end_time=span.end_time,
                instrumentation_scope=span.instrumentation_scope,
            ))
        return out


def _json(value: object) -> str:
    """JSON text of a value that is JSON-safe already (``_resolved`` made it so; the views are
    built from such values), with the guarded conversion as the fallback for anything else."""
    try:
        return json.dumps(value, ensure_ascii=False, separators=(",", ":"), allow_nan=False)
    except (TypeError, ValueError, RecursionError):
        return to_json(value)


# Text that the views read as JSON (messages given as JSON text, tool-call arguments given as JSON
# text, also inside a message's tool calls) is redacted whole and never cut early: a cut could
# make it JSON no more (or JSON at last) and change what the views make of it.
_MESSAGES_TEXT = frozenset({c.GEN_AI_INPUT_MESSAGES, c.GEN_AI_OUTPUT_MESSAGES})
_ARGUMENTS = "arguments"
_JSON_LITERALS = frozenset({"true", "false", "null"})


def _may_be_json(text: str) -> bool:
    """Whether ``json.loads(text)`` may succeed (what the views try on tool-call arguments)."""
    stripped = text.lstrip()
    first = stripped[:1]
    if first in ("[", "{", '"', "-") or first.isdigit():
        return True
    return first in ("t", "f", "n") and stripped.rstrip() in _JSON_LITERALS


def _read_as_json(key: str, text: str) -> bool:
    """Whether the views parse this recorded text as JSON (see ``_core.messages.messages_of`` and
    ``_core.messages.arguments_of``)."""
    if key in _MESSAGES_TEXT:
        return text[:1] in ("[", "{")
    return key == c.GEN_AI_TOOL_CALL_ARGUMENTS and _may_be_json(text)


def _failure(s: SpanRecord) -> str | None:
    """A failed span's message (what the policy was told), None for a span that did not fail."""
    if s.status_code is not StatusCode.ERROR:
        return None
    return s.status_message or c.ERROR_TYPE_OTHER


def _resolved(s: SpanRecord) -> dict[str, Any]:
    """The span's kind attributes and its recorded ones, every deferred value computed once
    (decoding runs here, for kept episodes only); containers become their JSON-safe copies."""
    attributes = c.kind_attributes(s.kind)
    for k, v in s.attributes.items():
        attributes[k] = jsonable(v) if isinstance(v, (Deferred, list, tuple, dict)) else v
    return attributes


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


def _service_name(resource: Resource) -> str | None:
    name = (resource.attributes or {}).get(c.SERVICE_NAME)
    return name if isinstance(name, str) and name else None


def _homogeneous(values) -> bool:
    first = type(values[0])
    if first not in _PRIMITIVES:
        return False
    return all(type(v) is first for v in values)


def sampling_notes(record: EpisodeRecord, attributes: Mapping[str, object]) -> dict[str, Any]:
    """What a kept root says beyond what was recorded on it: why the sampler kept it, how long it
    ran and where its time went (unless the framework said so already), its group's health, the
    watch key it matched. Computed here, on the render thread, for kept episodes only."""
    out: dict[str, Any] = {}
    if record.reason:
        out[c.RL_KEEP_REASON] = record.reason
    if c.RL_DURATION_SECONDS not in attributes:
        duration = record.duration()
        if duration is not None:
            out[c.RL_DURATION_SECONDS] = duration
    try:
        stages = record.stages if record.stages is not None else stage_totals(record)
    except Exception:  # noqa: BLE001 - a view of the spans: the episode goes out without it
        stages = {}
    for stage, seconds in stages.items():
        key = c.stage_seconds(stage)
        if key not in attributes:
            out[key] = seconds
    if record.notes:
        out.update(record.notes)
    return out


def lend_timings(ours: Sequence[SpanRecord], theirs: Sequence[ReadableSpan]) -> None:
    """Copy a serving engine's per-request timings (a server span's ``gen_ai.latency.*``, as
    vLLM and SGLang write them) onto the generation span that made the request, as
    ``rl.server.*``: where a researcher reads the generation. The server span sits under the
    generation span, directly or through other spans (the server's route span, an HTTP client
    span); the order the spans arrived in does not matter."""
    mine: dict[int, SpanRecord] | None = None
    by_id: dict[int, ReadableSpan] | None = None
    for span in theirs:
        attributes = span.attributes
        if not attributes or span.parent is None:
            continue
        timings = {key: value for theirs_key, key in c.SERVER_TIMINGS.items()
                   if isinstance(value := attributes.get(theirs_key), (int, float)) and not isinstance(value, bool)}
        if not timings:
            continue
        if mine is None or by_id is None:
            mine = {s.span_id: s for s in ours}
            by_id = {f.context.span_id: f for f in theirs if f.context is not None}
        span_id = span.parent.span_id
        for _ in range(16):
            target = mine.get(span_id)
            if target is not None:
                if target.kind == c.KIND_GENERATION:
                    target.attributes.update(timings)
                break
            above = by_id.get(span_id)
            if above is None or above.parent is None:
                break
            span_id = above.parent.span_id
