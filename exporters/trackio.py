"""Kept episodes as Trackio traces: one ``trackio.Trace`` per episode, logged at its step.

Trackio's dashboard shows each trace's conversation (OpenAI-style messages, tool calls and tool
results) and its execution tree (the spans). The embedded default writes to a local SQLite file
under ``TRACKIO_DIR``: nothing to start.

What Trackio 0.43's Traces page derives from a trace (``frontend/src/lib/traceUtils.js``,
``pages/Traces.svelte``), and what this exporter writes so that it reads true:

* STATUS of a row is ``error`` as soon as *any* span has status ``error``/``failed`` or a
  non-empty ``error`` (``traceSummary``); otherwise the trace metadata's ``status``. Only the
  exact text ``error`` gets a red pill, every other one is green; a span gets the tree's red dot
  exactly when it would make the row ``error``. So ``metadata.status`` starts with the episode's
  ``rl.status`` and carries the marks colour cannot (``status_label``): ``truncated ✂``,
  ``ok ⚠ 1 failed`` for an episode that did not fail but had a span fail (a tool error the
  policy recovered from). Such a span gets the status ``"error (episode ok)"`` with its message
  as its output, and ``⚠`` after its name in the tree, instead of the dot. In an ``error``
  episode failed spans keep ``error`` + ``error`` (red dot, red pill). The trace metadata's
  ``span_errors`` lists every failed span.
* REQUEST TIME is the time Trackio wrote the row, one for a whole write: the exporter sets each
  stored row's to its episode's start (local SQLite storage only), so the list orders a step's
  episodes as they ran.
* TRACE ID shows the first 7 characters of Trackio's own *log id* (then ``:index``), a random id
  that Trackio's public API does not let us choose: Trackio's trace id is
  ``<run id>:<log id>:<key>:<index>``. The metadata's ``trace_id`` (the OpenTelemetry trace id)
  is what the search box (and ``trackio list traces --search``) finds an episode by.
* REQUEST is the first user message, its preview the first assistant message: for a multi-turn
  episode that is the first turn's reply (Trackio has no other field for it). The ``episode``
  span, selected when a row is expanded, shows the question and the final answer.
* a span's *Metadata* is its attributes once each: without what the panel already shows (input,
  output, model, usage, the reward span's scores) and without the OpenInference views written for
  Phoenix (``openinference.*``, ``llm.*``, ``session.id``, ``metadata``, ``tag.tags``, mime types).
* a ``trackio.Table`` per step and split (``rollouts/table``, ``eval/rollouts/table``) lists the
  step's kept episodes, lowest reward first, with a short question and answer: Trackio 0.43
  renders tables on its Media & Tables page as plain text without sorting, so the rows come
  sorted, and a token count no generation recorded reads ``—``.
* a ``rollouts/mismatch`` table per step (train–inference mismatch) lists the worst tokens of the
  step's kept episodes, one row per token, largest |Δ| first across the step; a token's text is
  shown with its whitespace visible (``␣the``, ``\\n``): a cell would show a space as nothing.
"""

from __future__ import annotations

import errno
import json
import logging
import math
import os
import re
import sqlite3
import threading
from collections import OrderedDict, defaultdict, deque
from collections.abc import Callable, Mapping, Sequence
from datetime import datetime, timezone
from pathlib import Path
from typing import TYPE_CHECKING, Any, NamedTuple, cast

from opentelemetry.sdk.trace import ReadableSpan
from opentelemetry.sdk.trace.export import SpanExporter, SpanExportResult

if TYPE_CHECKING:
    from trackio.run import Run

from otel_rollouts import conventions as c
from otel_rollouts._core.messages import as_text, attach_tool_call, to_openai
from otel_rollouts._core.redaction import Redactor
from otel_rollouts._core.values import fits_int64
from otel_rollouts.exporters._tree import (
    broken_root,
    by_trace,
    duration_ms,
    hex_id,
    is_error,
    kind_of,
    ordered,
    parse,
    root_of,
    trace_link,
)
from otel_rollouts.exporters.extras import MetricsSink, NotStoredReporter, PendingViewer

logger = logging.getLogger("otel_rollouts")

_CONTENT_KEYS = {
    c.GEN_AI_INPUT_MESSAGES,
    c.GEN_AI_OUTPUT_MESSAGES,
    c.GEN_AI_TOOL_CALL_ARGUMENTS,
    c.GEN_AI_TOOL_CALL_RESULT,
    c.INPUT_VALUE,
    c.OUTPUT_VALUE,
}
# Trackio's warning keys for data it could not persist (trackio.run.Run._warn_once)
_PERSIST_FAILURES = ("write-", "persist-", "local-sender", "remote-sender", "flush-local-buffer", "finish-pending")


def _persist_failures(run: object) -> list[str]:
    """The keys of the writes a finished Trackio run reported as failed (sorted).

    The one place this package reads a private field of Trackio: ``Run._warned_failures``, the
    set of keys ``Run._warn_once`` adds before it warns. Trackio has no public way to learn that
    a write failed: its writer thread only calls ``warnings.warn`` (process-wide, filtered and
    de-duplicated by the warnings registry, and not safely capturable from another thread). The
    field exists in the lower bound CI installs (``trackio==0.43.0``, the latest release when this
    was written); should a later release drop it, this returns ``[]`` (failures go back to being
    Trackio's warnings only) and the trackio-failure tests say so.
    """
    return sorted(key for key in getattr(run, "_warned_failures", ()) if key.startswith(_PERSIST_FAILURES))
_UNSAFE_KEY = re.compile(r"[^A-Za-z0-9_.-]+")
_TRACKIO_KIND = {c.KIND_GENERATION: "generation", c.KIND_TOOL: "tool"}
# Trackio's own vocabulary (keys of its trace metadata and span dicts, its span statuses)
TRACKIO_SUCCESS = "success"
TRACKIO_ERROR = "error"  # any span with it (or "failed", or an `error`) makes the whole trace "error"
META_TRACE_ID = "trace_id"
META_TRACE_URL = "trace_url"
META_STATUS = "status"  # the list's status when no span is an error
META_SPAN_ERRORS = "span_errors"
# the marks a status or a span name carries where Trackio 0.43 has no colour for it
MARK_FAILED = "\u26a0"  # ⚠: a span failed in an episode that did not
MARK_TRUNCATED = "\u2702"  # ✂: the episode was cut short
TABLE_SUFFIX = "table"
# the step table's columns: the first eight as before (what a person reads first: the outcome and
# the conversation), then why the sampler kept the episode, its group's health, and its time
COLUMN_REASON = "kept because"
COLUMN_SECONDS = "seconds"
COLUMN_GROUP_HEALTH = "group health"
# one column per stage of c.STAGES (rl.stage.<stage>.seconds), in that order
STAGE_COLUMNS = {c.STAGE_GENERATION: "gen s", c.STAGE_TOOL: "tool s", c.STAGE_ENVIRONMENT: "env s",
                 c.STAGE_REWARD: "reward s", c.STAGE_WAITING: "wait s"}
TABLE_COLUMNS = ("reward", "advantage", "status", "question", "answer", "turns", "input tokens",
                 "output tokens", COLUMN_REASON, COLUMN_GROUP_HEALTH, COLUMN_SECONDS, *STAGE_COLUMNS.values(),
                 "trace id", "group", "sample", "episode")
# the step's kept episodes again, slowest first: which rollouts held the step back, and where
# their time went (``most time in``: the stage with the most seconds, and its share)
SLOWEST_SUFFIX = "slowest"
COLUMN_MOST_TIME = "most time in"
SLOWEST_COLUMNS = (COLUMN_SECONDS, COLUMN_MOST_TIME, *STAGE_COLUMNS.values(), COLUMN_REASON, "status", "reward",
                   COLUMN_GROUP_HEALTH, "trace id", "question", "episode")
# a watched prompt's history (rl.watch.key): one row per kept episode of it, oldest step first
WATCH_SUFFIX = "watch"
WATCH_COLUMNS = ("step", "reward", "status", "answer", "trace id")
WATCH_MAX_KEYS = 64  # watch keys followed at once: the one updated longest ago is forgotten first
WATCH_MAX_ROWS = 200  # rows per watch key: the oldest is dropped first
WATCH_KEY_CHARS = 64  # a watch key in a Trackio key: at most this many characters of [A-Za-z0-9_.-]
# episodes still running (show_pending): their snapshots, and a table of what runs now
RUNNING_SUFFIX = "running"
RUNNING_COLUMNS = ("episode", "open for", "stuck in", "trace id")
RUNNING_MARK = "running"  # a snapshot's status, and its open spans' (no glyph: fonts lack ⏳)
RUNNING_NONE = "nothing running"  # the one row of a running table when every episode ended
RUNNING_MAX = 256  # episodes shown running at once (beyond: the earliest shown is forgotten, its row kept)
# train–inference mismatch: the episode's statistics as step-table columns (only in a step where a
# kept episode has them), and a table of the step's worst tokens, largest |Δ| first
MISMATCH_COLUMNS = {c.RL_MISMATCH_KL: "mismatch kl", c.RL_MISMATCH_ABS_MAX: "max |\u0394|",
                    c.RL_MISMATCH_OUTSIDE: "tokens outside band"}
MISMATCH_SUFFIX = "mismatch"
COLUMN_TOKEN = "token"
COLUMN_DELTA = "\u0394 (trainer\u2212rollout)"  # Δ = trainer logprob − rollout logprob
MISMATCH_TOKEN_COLUMNS = (COLUMN_DELTA, "ratio", COLUMN_TOKEN, "rollout logprob", "trainer logprob", "position",
                          "generation", COLUMN_REASON, "sample", "trace id")
MISMATCH_PER_GENERATION = 8  # a generation's worst tokens shown (its span carries up to top_tokens)
MISMATCH_MAX_ROWS = 64  # rows of a step's mismatch table (a page shows every step's)
TOKEN_CHARS = 40  # a token's shown text, "…" included
_VISIBLE = {" ": "\u2423", "\n": "\\n", "\t": "\\t", "\r": "\\r", "\\": "\\\\"}  # ␣ for a space
TABLE_LINK = "link"
TABLE_ABSENT = "\u2014"  # —: what the table shows for a value nobody recorded (never 0)
PREVIEW_CHARS = 80  # the table's question and answer previews, "…" included
# attributes a span's Trackio metadata leaves out: views of other attributes written for other
# viewers (Phoenix's OpenInference keys, GenAI's operation name, the root's session/metadata/tags)
_VIEW_KEYS = frozenset({
    c.OPENINFERENCE_SPAN_KIND, c.GEN_AI_OPERATION_NAME, c.INPUT_MIME_TYPE, c.OUTPUT_MIME_TYPE,
    c.OI_LLM_MODEL_NAME, c.OI_LLM_PROVIDER, c.OI_LLM_TOKEN_COUNT_PROMPT, c.OI_LLM_TOKEN_COUNT_COMPLETION,
    c.OI_LLM_TOKEN_COUNT_TOTAL, c.OI_TOOL_NAME, c.OI_SESSION_ID, c.OI_METADATA, c.OI_TAG_TAGS,
})
_VIEW_PREFIXES = (c.OPENINFERENCE_PREFIX, f"{c.OI_LLM_INPUT_MESSAGES}.", f"{c.OI_LLM_OUTPUT_MESSAGES}.",
                   f"{c.OI_EVALUATIONS}.")


def episode_status(spans: Sequence[ReadableSpan]) -> str | None:
    """The episode's ``rl.status`` (None for a trace that has no episode root with one)."""
    root = root_of(spans)
    status = (root.attributes or {}).get(c.RL_STATUS) if root is not None else None
    return status if isinstance(status, str) and status else None


def failed_spans(spans: Sequence[ReadableSpan]) -> int:
    """How many of an episode's spans failed."""
    return sum(1 for span in spans if is_error(span))


def status_label(status: str | None, failed: int = 0) -> str | None:
    """What the trace list's STATUS shows for an episode: its ``rl.status``, then the marks
    Trackio 0.43 has no colour for (it colours only ``error``, red; every other text is green):
    ``✂`` for a truncated episode, ``⚠ N failed`` when N spans failed in an episode that did not.
    ``ok`` and ``filtered`` without a failed span read as they are."""
    if status is None:
        return None
    label = status
    if status == c.STATUS_TRUNCATED:
        label = f"{label} {MARK_TRUNCATED}"
    if failed and status != c.STATUS_ERROR:
        label = f"{label} {MARK_FAILED} {failed} failed"
    return label


def span_status(span: ReadableSpan, status: str | None, label: str | None = None) -> str:
    """A span's status for Trackio, given its episode's ``rl.status`` (and the list's label).

    Trackio turns a whole trace red when any span says ``error``: only a failure in an episode
    that failed (or one without an ``rl.status``) may say so; elsewhere it says which it is.
    The episode span reads what the list reads, except ``success`` for a plain ``ok``.
    """
    if not is_error(span):
        if kind_of(span) == c.KIND_EPISODE and label not in (None, c.STATUS_OK) and status != c.STATUS_ERROR:
            return label  # "truncated ✂", "ok ⚠ 1 failed", "filtered"
        return TRACKIO_SUCCESS
    if status is None or status == c.STATUS_ERROR:
        return TRACKIO_ERROR
    return f"{TRACKIO_ERROR} (episode {status})"


def error_text(span: ReadableSpan) -> str:
    """What a failed span says: its status description (``Type: message``), else ``error``."""
    return span.status.description or TRACKIO_ERROR


def episode_messages(spans: Sequence[ReadableSpan]) -> list[dict[str, object]]:
    """The conversation of one episode: prompt, assistant turns with tool calls, tool results."""
    messages: list[dict[str, object]] = []
    last_assistant: dict[str, Any] | None = None  # its tool_calls: a list (attach_tool_call's)
    for _, span in ordered(spans):
        attrs = span.attributes or {}
        kind = kind_of(span)
        if kind == c.KIND_PROMPT:
            messages.extend(_as_list(parse(attrs.get(c.GEN_AI_INPUT_MESSAGES))))
        elif kind == c.KIND_GENERATION:
            for message in _as_list(parse(attrs.get(c.GEN_AI_OUTPUT_MESSAGES))):
                message = dict(message)
                message.setdefault("role", "assistant")
                messages.append(message)
                last_assistant = message
        elif kind == c.KIND_TOOL:
            call_id = str(attrs.get(c.GEN_AI_TOOL_CALL_ID) or hex_id(span.context.span_id))
            name = attrs.get(c.GEN_AI_TOOL_NAME) or span.name
            if last_assistant is not None:
                calls = last_assistant.setdefault("tool_calls", [])
                arguments = attrs.get(c.GEN_AI_TOOL_CALL_ARGUMENTS)
                attach_tool_call(calls, call_id, name, arguments if isinstance(arguments, str) else "{}")
            if is_error(span):
                content = f"error: {span.status.description or 'tool failed'}"
            else:
                result = attrs.get(c.GEN_AI_TOOL_CALL_RESULT)
                content = "" if result is None else _result_text(result)
            messages.append({"role": "tool", "tool_call_id": call_id, "name": name, "content": content})
        elif attrs.get(c.RL_FEEDBACK_ROLE) is not None:
            for message in _as_list(parse(attrs.get(c.GEN_AI_INPUT_MESSAGES))):
                message = dict(message)
                role = message.get("role") or "environment"
                if role not in ("user", "tool", "system", "assistant"):
                    message["role"] = "user"
                    message["name"] = role
                messages.append(message)
    return messages


def _result_text(result: object) -> str:
    """A tool result as text, the same in the conversation and on the tool's span (``as_text``:
    ``604800.0`` stays ``604800.0``; a sequence attribute reads as JSON)."""
    return as_text(list(result) if isinstance(result, tuple) else result)


def _as_list(value: object) -> list[dict[str, object]]:
    """Messages as Trackio shows them (OpenAI's shape), from the GenAI parts shape we export."""
    if isinstance(value, list):
        return [to_openai(m) if isinstance(m, dict) else {"role": "user", "content": as_text(m)} for m in value]
    if isinstance(value, dict):
        return [to_openai(value)]
    if isinstance(value, str) and value:
        return [{"role": "user", "content": value}]
    return []


def episode_metadata(
    root: ReadableSpan, trace_url: str | None, spans: Sequence[ReadableSpan] = ()
) -> dict[str, object]:
    """The trace metadata: the OpenTelemetry trace id, the root's ``rl.*`` values, ``status``
    (= ``rl.status``, what the list shows), the trace link, and the failed spans."""
    attrs = root.attributes or {}
    metadata: dict[str, object] = {META_TRACE_ID: hex_id(root.context.trace_id, 32)}
    for key, value in attrs.items():
        if key.startswith(c.RL_PREFIX) and key != c.RL_SPAN_KIND:
            metadata[key] = parse(value)
    status = attrs.get(c.RL_STATUS)
    if status:
        metadata[META_STATUS] = status_label(status, failed_spans(spans)) if isinstance(status, str) else status
    if trace_url:
        metadata[META_TRACE_URL] = trace_url
    failed = [f"{span.name}: {error_text(span)}" for _, span in ordered(spans) if is_error(span)]
    if failed:
        metadata[META_SPAN_ERRORS] = failed
    return metadata


def episode_spans(spans: Sequence[ReadableSpan]) -> list[dict[str, object]]:
    """The execution tree: one Trackio span dict per span, depth-first in start order."""
    out = []
    status = episode_status(spans)
    label = status_label(status, failed_spans(spans))
    for _, span in ordered(spans):
        attrs = span.attributes or {}
        kind = kind_of(span)
        item: dict[str, object] = {
            "id": hex_id(span.context.span_id),
            "name": span.name,
            "kind": _TRACKIO_KIND.get(kind, "span"),
        }
        if span.parent is not None:
            item["parent_id"] = hex_id(span.parent.span_id)
        item["start_time"] = iso_utc(span.start_time)
        item["end_time"] = iso_utc(span.end_time)
        item["duration_ms"] = duration_ms(span)
        item["status"] = span_status(span, status, label)
        if item["status"] == TRACKIO_ERROR:
            item["error"] = error_text(span)
        elif is_error(span):
            # Trackio's red dot would turn the whole row "error": the tree marks it by its name
            item["name"] = f"{span.name} {MARK_FAILED}"
        if kind == c.KIND_GENERATION:
            _put_messages(item, "input", attrs.get(c.GEN_AI_INPUT_MESSAGES), attrs.get(c.INPUT_VALUE))
            _put_messages(item, "output", attrs.get(c.GEN_AI_OUTPUT_MESSAGES), attrs.get(c.OUTPUT_VALUE))
            if attrs.get(c.GEN_AI_REQUEST_MODEL):
                item["model"] = attrs[c.GEN_AI_REQUEST_MODEL]
            usage = {}
            if attrs.get(c.GEN_AI_USAGE_INPUT_TOKENS) is not None:
                usage["input_tokens"] = attrs[c.GEN_AI_USAGE_INPUT_TOKENS]
            if attrs.get(c.GEN_AI_USAGE_OUTPUT_TOKENS) is not None:
                usage["output_tokens"] = attrs[c.GEN_AI_USAGE_OUTPUT_TOKENS]
            if usage:
                item["usage"] = usage
        elif kind == c.KIND_TOOL:
            _put(item, "input", attrs.get(c.GEN_AI_TOOL_CALL_ARGUMENTS))
            result = attrs.get(c.GEN_AI_TOOL_CALL_RESULT)
            if result is not None:
                item["output"] = _result_text(result)
        elif kind == c.KIND_REWARD:
            _put(item, "input", attrs.get(c.INPUT_VALUE))
            item["output"] = {k: v for k, v in attrs.items() if k.startswith(c.RL_REWARD) or k == c.RL_ADVANTAGE}
        else:
            _put_messages(item, "input", attrs.get(c.GEN_AI_INPUT_MESSAGES), attrs.get(c.INPUT_VALUE))
            _put_messages(item, "output", attrs.get(c.GEN_AI_OUTPUT_MESSAGES), attrs.get(c.OUTPUT_VALUE))
        if is_error(span) and item["status"] != TRACKIO_ERROR and "output" not in item:
            # Trackio shows `error` only as the trace's failure: the message is the span's output
            item["output"] = f"{TRACKIO_ERROR}: {error_text(span)}"
        metadata = span_metadata(attrs, item)
        if metadata:
            item["metadata"] = metadata
        out.append(item)
    return out


def span_metadata(attrs: Mapping[str, object], item: Mapping[str, object]) -> dict[str, object]:
    """A span's attributes for its *Metadata* box, each value once: without its content (the
    panel's Input/Output), what the panel shows already (kind, model, token counts, the reward
    span's scores), and the views written for other viewers (``_VIEW_KEYS``, ``_VIEW_PREFIXES``,
    and ``gen_ai.conversation.id``, the episode id again)."""
    shown = set(_CONTENT_KEYS) | _VIEW_KEYS
    if "model" in item:
        shown.add(c.GEN_AI_REQUEST_MODEL)
    if "usage" in item:
        shown.update((c.GEN_AI_USAGE_INPUT_TOKENS, c.GEN_AI_USAGE_OUTPUT_TOKENS))
    output = item.get("output")
    if isinstance(output, dict):
        shown.update(key for key in output if key in attrs)
    if attrs.get(c.GEN_AI_CONVERSATION_ID) == attrs.get(c.RL_EPISODE_ID):
        shown.add(c.GEN_AI_CONVERSATION_ID)
    if attrs.get(c.RL_SPAN_KIND) == item.get("kind"):  # "generation", "tool": the panel's kind
        shown.add(c.RL_SPAN_KIND)
    return {key: parse(value) for key, value in attrs.items()
            if key not in shown and not key.startswith(_VIEW_PREFIXES)}


def _put_messages(item: dict[str, object], key: str, messages: object, fallback: object) -> None:
    """A span's messages in OpenAI's shape (what Trackio renders), else its plain value."""
    if messages is not None:
        item[key] = _as_list(parse(messages))
    else:
        _put(item, key, fallback)


def _put(item: dict[str, object], key: str, value: object) -> None:
    if value is not None:
        item[key] = parse(value)


def table_row(spans: Sequence[ReadableSpan], trace_url: str | None) -> dict[str, object]:
    """One kept episode as a row of its step's table (every column present, in order).

    The question and the answer are the episode span's input and output, cut to
    ``PREVIEW_CHARS``. A token count is the sum of those the generations recorded, and ``—``
    when none did: Trackio prints a table cell as text (``None`` as an empty cell), so absent
    reads as absent, never as 0."""
    root = root_of(spans)
    attrs = (root.attributes or {}) if root is not None else {}
    turns = 0
    input_tokens: int | None = None
    output_tokens: int | None = None
    for span in spans:
        span_attrs = span.attributes or {}
        if kind_of(span) == c.KIND_TURN:
            turns += 1
        input_tokens = _add_count(input_tokens, span_attrs.get(c.GEN_AI_USAGE_INPUT_TOKENS))
        output_tokens = _add_count(output_tokens, span_attrs.get(c.GEN_AI_USAGE_OUTPUT_TOKENS))
    reason = attrs.get(c.RL_KEEP_REASON)
    values = (
        _readable(attrs.get(c.RL_REWARD)), _readable(attrs.get(c.RL_ADVANTAGE)), attrs.get(c.RL_STATUS),
        preview(attrs.get(c.INPUT_VALUE)), preview(attrs.get(c.OUTPUT_VALUE)),
        turns, TABLE_ABSENT if input_tokens is None else input_tokens,
        TABLE_ABSENT if output_tokens is None else output_tokens,
        reason if isinstance(reason, str) and reason else TABLE_ABSENT, group_health(attrs),
        _seconds(attrs.get(c.RL_DURATION_SECONDS)),
        *(_seconds(attrs.get(c.stage_seconds(stage))) for stage in STAGE_COLUMNS),
        hex_id(root.context.trace_id, 32) if root is not None else None,
        None if attrs.get(c.RL_GROUP_ID) is None else as_text(attrs.get(c.RL_GROUP_ID)),
        attrs.get(c.RL_SAMPLE_INDEX), attrs.get(c.RL_EPISODE_ID),
    )
    row: dict[str, object] = dict(zip(TABLE_COLUMNS, values, strict=True))
    if any(attrs.get(key) is not None for key in MISMATCH_COLUMNS):  # train–inference mismatch measured
        row.update((column, _stat(attrs.get(key))) for key, column in MISMATCH_COLUMNS.items())
    if trace_url is not None:
        row[TABLE_LINK] = trace_url
    return row


def step_rows(rows: Sequence[Mapping[str, object]]) -> list[dict[str, object]]:
    """A step table's rows with the same columns, in order: when some episode of the step has
    train–inference mismatch statistics, every row gets their columns (``MISMATCH_COLUMNS``,
    right after ``kept because``, in sight beside it; ``—`` where an episode has none);
    otherwise the rows as they are."""
    if not any(column in row for row in rows for column in MISMATCH_COLUMNS.values()):
        return [dict(row) for row in rows]
    at = TABLE_COLUMNS.index(COLUMN_REASON) + 1
    columns = (*TABLE_COLUMNS[:at], *MISMATCH_COLUMNS.values(), *TABLE_COLUMNS[at:])
    out = []
    for row in rows:
        item = {column: row.get(column, TABLE_ABSENT) for column in columns}
        if TABLE_LINK in row:
            item[TABLE_LINK] = row[TABLE_LINK]
        out.append(item)
    return out


def _stat(value: object) -> float | int | str:
    """A mismatch statistic as a table shows it (4 significant digits), ``—`` when absent."""
    number = _readable(value, 4)
    return TABLE_ABSENT if number is None else number


def token_text(value: object) -> str:
    """A token as a table cell shows it: whitespace visible (a space as ``␣``, a newline as
    ``\\n``, other control or invisible characters escaped as Python writes them), at most
    ``TOKEN_CHARS`` characters; ``''`` for an empty token."""
    text = value if isinstance(value, str) else as_text(value)
    if not text:
        return "''"
    shown = "".join(_VISIBLE.get(ch) or (ch if ch.isprintable() else repr(ch)[1:-1]) for ch in text[:TOKEN_CHARS + 1])
    return shown if len(shown) <= TOKEN_CHARS else shown[: TOKEN_CHARS - 1] + "\u2026"


class TokenRow(NamedTuple):
    """One of a kept episode's worst tokens, as its step's mismatch table lists it."""

    order: tuple[float, str, int, int]  # (−|Δ|, trace id, generation, rank): the table's order
    row: dict[str, object]


def mismatch_rows(spans: Sequence[ReadableSpan], trace_url: str | None) -> list[TokenRow]:
    """The worst tokens of a kept episode's generations (``rl.mismatch.worst.*``, at most
    ``MISMATCH_PER_GENERATION`` of each) as rows of its step's mismatch table: Δ (trainer −
    rollout logprob), the ratio exp(Δ), the token, both logprobs, its position in the generation,
    the generation (``turn 2``; ``turn 2.1`` for a turn's second; ``generation 0`` outside a
    turn), why the episode was kept, its sample and trace id (``link`` with a trace UI). Empty
    without them."""
    root = root_of(spans)
    attrs = (root.attributes or {}) if root is not None else {}
    trace_id = hex_id(root.context.trace_id, 32) if root is not None else ""
    reason = attrs.get(c.RL_KEEP_REASON)
    turns = {span.context.span_id: span.attributes.get(c.RL_TURN_INDEX) for span in spans
             if kind_of(span) == c.KIND_TURN and span.attributes}
    per_turn: dict[Any, int] = defaultdict(int)
    generations = []
    for _, span in ordered(spans):
        if kind_of(span) != c.KIND_GENERATION:
            continue
        turn = turns.get(span.parent.span_id) if span.parent is not None else None
        generations.append((span, turn, per_turn[turn]))
        per_turn[turn] += 1
    out: list[TokenRow] = []
    for ordinal, (span, turn, within) in enumerate(generations):
        span_attrs = span.attributes or {}
        if turn is None:
            label = f"generation {ordinal}"
        else:
            label = f"turn {as_text(turn)}" if per_turn[turn] == 1 else f"turn {as_text(turn)}.{within}"
        worst = [span_attrs.get(key) for key in (c.RL_MISMATCH_WORST_POSITION, c.RL_MISMATCH_WORST_TOKEN,
                                                   c.RL_MISMATCH_WORST_ROLLOUT, c.RL_MISMATCH_WORST_TRAINER)]
        if not all(isinstance(values, Sequence) and not isinstance(values, str) for values in worst):
            continue
        shown = 0
        for rank, (position, token, rollout, trainer) in enumerate(zip(*worst, strict=False)):
            if shown >= MISMATCH_PER_GENERATION:
                break
            rollout, trainer = _number(rollout), _number(trainer)
            if rollout is None or trainer is None or not math.isfinite(delta := float(trainer) - float(rollout)):
                continue
            shown += 1
            values = (_readable(delta, 4), _ratio(delta), token_text(token), _readable(rollout, 4),
                      _readable(trainer, 4), position, label,
                      reason if isinstance(reason, str) and reason else TABLE_ABSENT,
                      attrs.get(c.RL_SAMPLE_INDEX), trace_id)
            row = dict(zip(MISMATCH_TOKEN_COLUMNS, values, strict=True))
            if trace_url is not None:
                row[TABLE_LINK] = trace_url
            out.append(TokenRow((-abs(delta), trace_id, ordinal, rank), row))
    return out


def worst_tokens(tokens: Sequence[TokenRow]) -> list[dict[str, object]]:
    """A step's mismatch table: its kept episodes' worst tokens, largest |Δ| first across the
    step, at most ``MISMATCH_MAX_ROWS``."""
    return [token.row for token in sorted(tokens, key=lambda token: token.order)[:MISMATCH_MAX_ROWS]]


def _ratio(delta: float) -> float | str:
    """The importance ratio exp(Δ), 4 significant digits (``inf`` beyond a float)."""
    try:
        ratio = math.exp(delta)
    except OverflowError:
        return "inf"
    return float(f"{ratio:.4g}")


def _seconds(value: object) -> float | str:
    """Seconds as a table shows them (rounded to what a person reads: 3 decimals under 10 s,
    2 above), or ``—`` when nothing measured them (never 0)."""
    number = _number(value)
    if number is None or not math.isfinite(number) or number < 0:
        return TABLE_ABSENT
    return round(float(number), 3 if number < 10 else 2)


def group_health(attrs: Mapping[str, object]) -> str:
    """An episode's GRPO group in one cell, from the ``rl.group.*`` attributes on its root:
    ``all equal ×8`` (every member the same reward: zero advantage, no learning signal),
    ``lost 2/8`` (members lost of those expected, or of those seen when the expected size is
    unknown), both joined by ``, ``, else ``ok 8`` (``ok 6/8`` when fewer were seen than
    expected); ``—`` for an episode without a group's health."""
    size = attrs.get(c.RL_GROUP_SIZE)
    if not isinstance(size, int) or isinstance(size, bool):
        return TABLE_ABSENT
    expected = attrs.get(c.RL_GROUP_EXPECTED_SIZE)
    expected = expected if isinstance(expected, int) and not isinstance(expected, bool) and expected > 0 else None
    lost = attrs.get(c.RL_GROUP_LOST)
    lost = lost if isinstance(lost, int) and not isinstance(lost, bool) and lost > 0 else 0
    parts = []
    if attrs.get(c.RL_GROUP_ALL_EQUAL) is True:
        parts.append(f"all equal \u00d7{size}")
    if lost:
        parts.append(f"lost {lost}/{expected or size}")
    if not parts:
        degenerate = attrs.get(c.RL_GROUP_DEGENERATE)
        if isinstance(degenerate, str) and degenerate:
            return degenerate.replace("_", " ")  # a reason this version has no words for
        return f"ok {size}" if expected is None or expected == size else f"ok {size}/{expected}"
    return ", ".join(parts)


def most_time_in(row: Mapping[str, object]) -> str:
    """The stage a table row's episode spent the most seconds in, with its share of the
    episode's duration (``tool 41.2 s (83%)``); ``—`` when no stage was measured."""
    stages = [(value, stage) for stage, column in STAGE_COLUMNS.items()
              if isinstance(value := row.get(column), (int, float))]
    if not stages:
        return TABLE_ABSENT
    value, stage = max(stages)
    total = row.get(COLUMN_SECONDS)
    share = f" ({100 * value / total:.0f}%)" if isinstance(total, (int, float)) and total > 0 else ""
    return f"{stage} {value:g} s{share}"


def slowest_rows(rows: Sequence[Mapping[str, object]]) -> list[dict[str, object]]:
    """A step table's rows with a measured duration, slowest first, as ``SLOWEST_COLUMNS`` (the
    ``link`` kept when there is one); empty when no episode of the step was timed."""
    timed = [row for row in rows if isinstance(row.get(COLUMN_SECONDS), (int, float))]
    timed.sort(key=lambda row: -cast(float, row[COLUMN_SECONDS]))  # a number: checked above
    out = []
    for row in timed:
        item = {column: most_time_in(row) if column == COLUMN_MOST_TIME else row.get(column)
                for column in SLOWEST_COLUMNS}
        if TABLE_LINK in row:
            item[TABLE_LINK] = row[TABLE_LINK]
        out.append(item)
    return out


def watch_key(value: object) -> str | None:
    """A watch key (``rl.watch.key``) as part of a Trackio key: ``[A-Za-z0-9_.-]`` only (every
    other run of characters becomes ``_``: a ``/`` would nest it), at most ``WATCH_KEY_CHARS``;
    None for a root without one."""
    if value is None or isinstance(value, bool):
        return None
    text = _UNSAFE_KEY.sub("_", as_text(value)).strip("_")[:WATCH_KEY_CHARS]
    return text or None


def watch_row(step: int, attrs: Mapping[str, object], trace_id: int) -> dict[str, object]:
    """One row of a watched prompt's history: step, reward, status, the answer's head, trace id."""
    return dict(zip(WATCH_COLUMNS, (step, _readable(attrs.get(c.RL_REWARD)), attrs.get(c.RL_STATUS),
                                    preview(attrs.get(c.OUTPUT_VALUE)), hex_id(trace_id, 32)), strict=True))


def _fmt_seconds(value: object) -> str:
    """Seconds in a running episode's status and table (``45.2s``, ``312s``), ``?`` unknown."""
    number = _number(value)
    if number is None or not math.isfinite(number):
        return "?"
    return f"{number:.1f}s" if number < 100 else f"{number:.0f}s"


def running_label(attrs: Mapping[str, object]) -> str:
    """A snapshot's status in the trace list: ``running <span it is stuck in> <its seconds>s``."""
    span = attrs.get(c.RL_PENDING_SPAN_NAME)
    where = f" {as_text(span)}" if span else ""
    return f"{RUNNING_MARK}{where} {_fmt_seconds(attrs.get(c.RL_PENDING_SPAN_SECONDS))}"


def running_row(attrs: Mapping[str, object], trace_id: int) -> dict[str, object]:
    """One row of the running table: episode id, how long it has been open, the span it is stuck
    in and for how long, the trace id."""
    span = attrs.get(c.RL_PENDING_SPAN_NAME)
    stuck = f"{as_text(span)} ({_fmt_seconds(attrs.get(c.RL_PENDING_SPAN_SECONDS))})" if span else TABLE_ABSENT
    episode = attrs.get(c.RL_EPISODE_ID)
    return dict(zip(RUNNING_COLUMNS, (as_text(episode) if episode is not None else TABLE_ABSENT,
                                      _fmt_seconds(attrs.get(c.RL_PENDING_SECONDS)), stuck,
                                      hex_id(trace_id, 32)), strict=True))


def running_spans(spans: Sequence[ReadableSpan], tree: list[dict[str, object]]) -> None:
    """Mark a snapshot's open spans in its Trackio tree (``tree``, from ``episode_spans``) as
    ``running``: the root, the span it is stuck in (the latest started one of that name among
    those still open: their end is the snapshot's "now") and the spans between them."""
    root = root_of(spans)
    if root is None:
        return
    attrs = root.attributes or {}
    now = root.end_time or 0
    by_id = {span.context.span_id: span for span in spans}
    open_ids = {root.context.span_id}
    stuck_name = attrs.get(c.RL_PENDING_SPAN_NAME)
    candidates = [span for span in spans if span.name == stuck_name and (span.end_time or 0) >= now - 1_000_000]
    if candidates:
        span: ReadableSpan | None = max(candidates, key=lambda s: s.start_time or 0)
        while span is not None and span.context.span_id not in open_ids:
            open_ids.add(span.context.span_id)
            span = by_id.get(span.parent.span_id) if span.parent is not None else None
    marked = {hex_id(span_id) for span_id in open_ids}
    for item in tree:
        if item.get("id") in marked and item.get("status") != TRACKIO_ERROR:
            item["status"] = RUNNING_MARK


def preview(value: object, limit: int = PREVIEW_CHARS) -> str:
    """A value as one line of at most ``limit`` characters, cut with ``…``; ``—`` when empty."""
    # only the start is read: a long prompt costs no more than a short one
    text = " ".join(as_text(value)[: limit * 4].split()) if value is not None else ""
    if not text:
        return TABLE_ABSENT
    return text if len(text) <= limit else text[: limit - 1].rstrip() + "\u2026"


def _add_count(total: int | None, value: object) -> int | None:
    """``total`` plus a recorded token count; None stays None until some count is recorded."""
    if isinstance(value, int) and not isinstance(value, bool) and value >= 0:
        return value if total is None else total + value
    return total


def _number(value: object) -> float | int | None:
    return value if isinstance(value, (int, float)) and not isinstance(value, bool) else None


def _readable(value: object, digits: int = 6) -> float | int | None:
    """A score as a table shows it: 6 significant digits (``1.136``, not the float sum's
    ``1.1360000000000001``; ``digits`` others); the exact value stays on the span."""
    number = _number(value)
    if isinstance(number, float) and math.isfinite(number):
        return float(f"{number:.{digits}g}")
    return number


def _unstorable(messages: object, metadata: object, spans: object) -> str | None:
    """Why Trackio could not store a trace with these parts, or None.

    Checked with Trackio's own serializer (``trackio.utils.serialize_values`` then ``orjson``):
    orjson refuses what ``json`` accepts, an int beyond 64 bits first of all, and Trackio then
    skips the *whole key* of the log, every episode of the step with it. Its storage is UTF-8.
    """
    try:
        import orjson
        from trackio import utils as trackio_utils

        serialize: Callable[[object], object] = trackio_utils.serialize_values  # untyped in Trackio
        orjson.dumps(serialize([messages, metadata, spans]))
    except ImportError:  # a Trackio without them: the standard library's check
        pass
    except Exception as exc:  # noqa: BLE001 - orjson's JSONEncodeError and whatever a value raises
        return f"{type(exc).__name__}: {str(exc)[:120]}"
    else:
        return None  # orjson is the stricter: what it encodes, json does too
    try:
        json.dumps([messages, metadata, spans], ensure_ascii=False, default=str).encode("utf-8")
    except (TypeError, ValueError, UnicodeEncodeError, RecursionError) as exc:
        return f"{type(exc).__name__}: {str(exc)[:120]}"
    return None


# Why an episode the exporter took was not stored (the reasons of ``take_not_stored``)
NOT_STORED_UNSTORABLE = "unstorable"  # a value Trackio cannot store (see ``_unstorable``)
NOT_STORED_DIR_UNUSABLE = "trackio_dir_unusable"  # TRACKIO_DIR (or a parent) is a file: never writable
NOT_STORED_READ_ONLY = "trackio_read_only"  # TRACKIO_DIR or the database cannot be written
NOT_STORED_WRITE_FAILED = "trackio_write_failed"  # the write left it out, for no reason we could name
NOT_STORED_NO_ROOT = "no_episode_root"  # a broken tree: no span is its episode root (see ``broken_root``)
_BROKEN_LOGGED = 20  # broken traces named one by one in the log, the rest counted
# (a locked database and a full disk are transient: the export fails and is retried instead)
# what makes trackio.init log to a remote server instead of the local database
_TRACKIO_REMOTE_ENV = ("TRACKIO_SPACE_ID", "TRACKIO_SERVER_URL")
_PROBE_TIMEOUT_S = 0.25  # how long the lock probe waits on SQLite's lock (a write takes milliseconds)
_PROCESS_LOCK_WAIT_S = 1.0  # and on Trackio's per-project process lock


class _WriteProblem(NamedTuple):
    """Why a Trackio write cannot (or did not) happen: a ``reason`` for ``take_not_stored``, and
    whether retrying the export later makes sense (``transient``: a lock, a full disk)."""

    reason: str
    transient: bool
    detail: str


class _Episode(NamedTuple):
    """One episode of an export, ready for Trackio."""

    trace_id: int
    step: int
    key: str
    trace: object  # trackio.Trace
    row: dict[str, object]
    started: str | None  # the episode's start, as Trackio stamps rows (its request time)
    watch: tuple[str, dict[str, object]] | None = None  # (its watch table's key, its history row)
    mismatch: tuple[TokenRow, ...] = ()  # its worst tokens (train–inference mismatch)


class _Running(NamedTuple):
    """An episode shown running (``show_pending``): where its snapshot is, and its table row."""

    step: int
    key: str  # the running traces' key (``rollouts/running``)
    row: dict[str, object]
    row_ids: tuple[str, ...]  # the Trackio rows of its snapshot (local storage only)


def _first_existing(path: Path) -> Path:
    """``path`` or its nearest ancestor that exists."""
    while not path.exists() and path.parent != path:
        path = path.parent
    return path


def _probe_process_lock(lock_path: Path) -> bool:
    """Whether Trackio's per-project process lock (an ``flock`` on ``<project>.lock``) can be
    taken within ``_PROCESS_LOCK_WAIT_S``: another process holding it for longer makes every
    Trackio write wait 10 s and then fail. Released at once."""
    try:
        import fcntl
    except ImportError:  # Windows: Trackio uses msvcrt there; not probed
        return True
    try:
        fd = os.open(lock_path, os.O_RDONLY | getattr(os, "O_NOFOLLOW", 0) | getattr(os, "O_CLOEXEC", 0))
    except OSError:
        return True  # no lock file yet (or unreadable): nothing to wait for, the write tells
    try:
        waiter = threading.Event()
        deadline = _PROCESS_LOCK_WAIT_S
        while True:
            try:
                fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
            except OSError:
                if deadline <= 0:
                    return False
                waiter.wait(0.05)  # polling another process's lock: nothing to wait on
                deadline -= 0.05
                continue
            fcntl.flock(fd, fcntl.LOCK_UN)
            return True
    finally:
        os.close(fd)


def _classify(exc: BaseException) -> _WriteProblem:
    """A failed write's ``_WriteProblem`` from its exception."""
    detail = f"{type(exc).__name__}: {str(exc)[:160]}"
    text = str(exc).lower()
    code = getattr(exc, "errno", None)
    if code == errno.ENOSPC or "disk is full" in text or "no space" in text:
        return _WriteProblem(NOT_STORED_WRITE_FAILED, True, f"disk full ({detail})")
    if "locked" in text or "busy" in text:
        return _WriteProblem(NOT_STORED_WRITE_FAILED, True, f"database locked ({detail})")
    if code in (errno.ENOTDIR, errno.EEXIST):
        return _WriteProblem(NOT_STORED_DIR_UNUSABLE, False, detail)
    if code in (errno.EACCES, errno.EPERM, errno.EROFS) or "readonly" in text or "read-only" in text:
        return _WriteProblem(NOT_STORED_READ_ONLY, False, detail)
    return _WriteProblem(NOT_STORED_WRITE_FAILED, False, detail)


def diagnose(db_path: Path, lock_path: Path | None = None) -> _WriteProblem | None:
    """Why a write to Trackio's database at ``db_path`` cannot succeed now, or None when nothing
    is seen to stop it. Cheap enough to run before every write, and again after a write that
    stored less than it was given, to name why:

    * ``TRACKIO_DIR`` (or a parent) is a file: never writable, not transient;
    * another process holds Trackio's process lock or an exclusive SQLite lock: transient;
    * the filesystem has no space left: transient (space may be freed; the export is retried);
    * the directory or the database is read-only: not transient.
    """
    directory = db_path.parent
    existing = _first_existing(directory)
    if not existing.is_dir():
        return _WriteProblem(NOT_STORED_DIR_UNUSABLE, False, f"TRACKIO_DIR {str(directory)!r} is not a directory "
                             f"({str(existing)!r} is a file)")
    if existing == directory and not os.access(directory, os.W_OK | os.X_OK):
        return _WriteProblem(NOT_STORED_READ_ONLY, False, f"TRACKIO_DIR {str(directory)!r} is not writable")
    try:
        stat = os.statvfs(existing)
        if stat.f_bavail == 0 and os.geteuid() != 0 or stat.f_bfree == 0:
            return _WriteProblem(NOT_STORED_WRITE_FAILED, True, f"no space left under {str(existing)!r}")
    except (OSError, AttributeError):
        pass
    if lock_path is not None and not _probe_process_lock(lock_path):
        return _WriteProblem(NOT_STORED_WRITE_FAILED, True, f"another process holds {str(lock_path)!r}")
    if not db_path.exists():
        return None  # Trackio creates it
    try:
        conn = sqlite3.connect(str(db_path), timeout=_PROBE_TIMEOUT_S, isolation_level=None)
        try:
            conn.execute("BEGIN IMMEDIATE")  # the lock a write takes first; released at once
            conn.execute("ROLLBACK")
        finally:
            conn.close()
    except sqlite3.Error as exc:
        return _classify(exc)
    return None


def stored_trace_ids(db_path: Path, run_name: str, since: str) -> set[str]:
    """The OpenTelemetry trace ids (32 hex digits, from each trace's metadata) of the traces
    Trackio stored for ``run_name`` at or after ``since`` (an ISO timestamp in UTC, the format
    Trackio stamps rows with): what a write really stored. Read-only; raises ``sqlite3.Error``
    when the database cannot be read."""
    if not db_path.exists():
        return set()
    conn = sqlite3.connect(f"{db_path.resolve().as_uri()}?mode=ro", uri=True, timeout=5.0)
    try:
        rows = conn.execute(
            "SELECT metadata FROM traces WHERE run_name = ? AND timestamp >= ?", (run_name, since)
        ).fetchall()
    except sqlite3.OperationalError as exc:
        if "no such table" in str(exc):
            return set()
        raise
    finally:
        conn.close()
    found: set[str] = set()
    for (metadata,) in rows:
        try:
            value = json.loads(metadata)
        except (TypeError, ValueError):
            continue
        trace_id = value.get(META_TRACE_ID) if isinstance(value, dict) else None
        if isinstance(trace_id, str) and not _is_snapshot(value):  # a snapshot is no stored episode
            found.add(trace_id)
    return found


def iso_utc(ns: int | None) -> str | None:
    """A span time (ns since the epoch) in the format Trackio stamps rows with (ISO 8601, UTC,
    always with microseconds, cut, not rounded): rows compare as text, so the format must be the
    same; a span's start and its trace's request time read alike."""
    if ns is None:
        return None
    seconds, rest = divmod(int(ns), 1_000_000_000)
    moment = datetime.fromtimestamp(seconds, tz=timezone.utc).replace(microsecond=rest // 1000)
    return moment.isoformat(timespec="microseconds")


def stamp_request_times(db_path: Path, run_id: str | None, run_name: str, since: str,
                        times: Mapping[str, str]) -> int:
    """Set the ``timestamp`` (the Traces list's request time) of the run's rows written at or
    after ``since`` to ``times[their metadata's trace_id]``; returns how many were set. The run
    is found by Trackio's run id where it has one: Trackio indexes (run_id, timestamp), so only
    this write's rows are read, however large the project grew."""
    if not db_path.exists():
        return 0
    conn = sqlite3.connect(str(db_path), timeout=5.0)
    try:
        if run_id:
            query = "SELECT id, metadata FROM traces WHERE run_id = ? AND timestamp >= ?"
            rows = conn.execute(query, (run_id, since)).fetchall()
        else:
            query = "SELECT id, metadata FROM traces WHERE run_name = ? AND timestamp >= ?"
            rows = conn.execute(query, (run_name, since)).fetchall()
        updates = []
        for row_id, metadata in rows:
            try:
                value = json.loads(metadata)
            except (TypeError, ValueError):
                continue
            trace_id = value.get(META_TRACE_ID) if isinstance(value, dict) else None
            if isinstance(trace_id, str) and trace_id in times and not _is_snapshot(value):
                updates.append((times[trace_id], row_id))
        with conn:
            conn.executemany("UPDATE traces SET timestamp = ? WHERE id = ?", updates)
        return len(updates)
    finally:
        conn.close()


def _read_rows(db_path: Path, run_id: object, run_name: str, since: str) -> list[tuple[str, str, Any]]:
    """(row id, key, decoded metadata) of the run's trace rows written at or after ``since``
    (by Trackio's run id where there is one: an indexed read of that write's rows only)."""
    if not db_path.exists():
        return []
    conn = sqlite3.connect(f"{db_path.resolve().as_uri()}?mode=ro", uri=True, timeout=5.0)
    try:
        if isinstance(run_id, str) and run_id:
            rows = conn.execute("SELECT id, key, metadata FROM traces WHERE run_id = ? AND timestamp >= ?",
                                (run_id, since)).fetchall()
        else:
            rows = conn.execute("SELECT id, key, metadata FROM traces WHERE run_name = ? AND timestamp >= ?",
                                (run_name, since)).fetchall()
    finally:
        conn.close()
    out = []
    for row_id, key, metadata in rows:
        try:
            out.append((row_id, key, json.loads(metadata)))
        except (TypeError, ValueError):
            continue
    return out


def delete_trace_rows(db_path: Path, row_ids: Sequence[str]) -> int:
    """Delete Trackio trace rows by their ids (a running episode's snapshot, once it ended);
    returns how many were deleted."""
    if not row_ids or not db_path.exists():
        return 0
    conn = sqlite3.connect(str(db_path), timeout=5.0)
    try:
        with conn:
            cursor = conn.executemany("DELETE FROM traces WHERE id = ?", [(row_id,) for row_id in row_ids])
        return cursor.rowcount
    finally:
        conn.close()


def _is_snapshot(metadata: object) -> bool:
    """Whether a stored trace's metadata is a running episode's snapshot (``show_pending``)."""
    return isinstance(metadata, dict) and metadata.get(c.RL_PENDING_SNAPSHOT) is True


def _worst_first(row: Mapping[str, Any]) -> tuple[bool, float, float]:
    """Lowest reward first (then lowest advantage); episodes without a reward last."""
    reward, advantage = row.get(TABLE_COLUMNS[0]), row.get(TABLE_COLUMNS[1])
    return (reward is None, reward if reward is not None else 0.0, advantage if advantage is not None else 0.0)


class TrackioExporter(SpanExporter, MetricsSink, NotStoredReporter, PendingViewer):
    """Writes each kept episode as a ``trackio.Trace`` at ``step=rl.step``, and per step a table.

    ``project``/``run``/``space_id`` are Trackio's (a ``space_id`` syncs to a Hugging Face
    Space). Train episodes go under ``trace_key``; other splits under ``"{split}/{trace_key}"``.
    ``trace_ui_url`` (or env ``OTEL_ROLLOUTS_TRACE_UI_URL``), e.g. a Jaeger base URL, adds a
    ``trace_url`` link to each trace's metadata; a value with ``{trace_id}`` is a URL template
    (Phoenix: ``http://localhost:6006/redirects/traces/{trace_id}``).

    The step table (``"{trace_key}/table"``, ``"{split}/{trace_key}/table"``; ``table=False``
    turns it off) has one row per kept episode: reward, advantage, status, question and answer
    (one short line each), turns, input and output tokens (``—`` when no generation recorded
    any), trace id, group, sample, episode id (and ``link`` with a trace UI), lowest reward
    first. A step's episodes reach the exporter one export at a time, so its rows are collected
    and the table is logged once the step is over: when an episode of a later step arrives, or at
    ``force_flush``/``shutdown`` (``otr.flush()``, ``otr.shutdown()``). An episode that arrives
    after its step's table was logged goes into another table at that step.

    With train–inference mismatch measured (``rl.mismatch.*``), the step table gains ``mismatch
    kl``, ``max |Δ|`` and ``tokens outside band``, and a ``"{trace_key}/mismatch"`` table lists
    the step's worst tokens (``mismatch_rows``), largest |Δ| first.
    """

    def __init__(
        self,
        project: str,
        run: str | None = None,
        space_id: str | None = None,
        trace_key: str = "rollouts",
        *,
        trace_ui_url: str | None = None,
        config: dict[str, object] | None = None,
        table: bool = True,
        redact: Redactor | bool = True,
    ) -> None:
        import os

        self.project = project
        self.run_name = run
        self.space_id = space_id
        self.trace_key = trace_key
        self.trace_ui_url = (trace_ui_url or os.environ.get(c.ENV_TRACE_UI_URL) or "").rstrip("/") or None
        # the run's config is stored by Trackio as given: it is redacted like span content
        # (``redact``: a Redactor, True for the default patterns, False for none)
        redactor = Redactor() if redact is True else redact or None
        self.config = redactor.mapping(config) if redactor is not None and config is not None else config
        self.table = table
        self._run: Any = None  # trackio's Run, made on the first export
        self._lock = threading.Lock()
        # (step, table key) -> trace id -> row: an episode exported again before its step's table is
        # logged (a retried export) is one row
        self._rows: dict[tuple[int, str], dict[str, dict[str, object]]] = defaultdict(dict)
        # (step, table key) -> trace id -> its worst tokens: the step's mismatch table, logged with it
        self._tokens: dict[tuple[int, str], dict[str, tuple[TokenRow, ...]]] = defaultdict(dict)
        self.exported = 0
        self.skipped_fragments = 0
        self.tables_logged = 0
        self.table_failures = 0
        self.metrics_skipped = 0  # steps whose scalars could not be written (log_metrics)
        self.request_time_failures = 0  # writes whose rows kept Trackio's time (_stamp_request_times)
        self._not_stored: dict[str, list[int]] = {}  # reason -> trace ids (take_not_stored)
        self._not_stored_lock = threading.Lock()
        self._warned_unstorable = False
        self._warned_problems: set[str] = set()
        self.broken_traces = 0  # traces refused for a broken tree (``broken_root``)
        # watched prompts: table key -> its history rows (bounded), and (step, key) tables due
        self._watch: OrderedDict[str, deque[dict[str, Any]]] = OrderedDict()
        self._watch_due: set[tuple[int, str]] = set()
        # episodes shown running (show_pending), earliest shown first
        self._running: OrderedDict[int, _Running] = OrderedDict()
        self.pending_failures = 0  # show_pending calls (or replacements) that failed or were skipped
        self._import_lock = threading.Lock()
        self._imported = False
        try:
            # here, on the thread that makes the exporter (configure), before any thread of ours
            # exists: the sender and metrics threads then find Trackio imported (0.5 s, once)
            self._import_trackio()
        except Exception:  # noqa: BLE001 - the first export imports it again and reports why
            pass

    def _import_trackio(self) -> None:
        """Import Trackio and the modules of it used here, once, one thread at a time. This
        exporter's sender thread and the metrics thread (``log_metrics``) both reach for it
        first: two threads importing Trackio's circular modules at once gave one of them a
        half-initialised module (``cannot import name 'SQLiteStorage' from partially initialized
        module``), a failed export."""
        if self._imported:
            return
        with self._import_lock:
            if not self._imported:
                import trackio  # noqa: F401
                import trackio.sqlite_storage  # noqa: F401
                import trackio.utils  # noqa: F401

                self._imported = True

    def _trackio_run(self) -> Any:
        if self._run is None:
            import trackio

            kwargs: dict[str, Any] = {  # trackio.init's keywords, of several types
                "project": self.project,
                "name": self.run_name,
                "space_id": self.space_id,
                "config": self.config,
                "embed": False,
                "auto_log_cpu": False,
                "auto_log_gpu": False,
            }
            if self.run_name is not None:
                kwargs["resume"] = "allow"
            self._run = trackio.init(**kwargs)
        return self._run

    @property
    def run(self) -> str | None:
        """The Trackio run name (known after the first export)."""
        return getattr(self._run, "name", self.run_name)

    def trace_url(self, trace_id: int) -> str | None:
        """The link to this trace in a trace UI, or None when no UI is configured
        (``_tree.trace_link``)."""
        return trace_link(self.trace_ui_url, trace_id)

    def table_key(self, split: str) -> str:
        """The key a split's step tables are logged under (``rollouts/table``, ``eval/rollouts/table``)."""
        key = self.trace_key if split == "train" else f"{split}/{self.trace_key}"
        return f"{key}/{TABLE_SUFFIX}"

    def export(self, spans: Sequence[ReadableSpan]) -> SpanExportResult:
        """Write each episode (trace) of ``spans`` to Trackio, and confirm what got stored.

        Trackio's ``run.log`` only queues: its writer thread writes a batch every half second and
        merely *warns* when the write fails (a locked database, a full disk, ``TRACKIO_DIR`` a
        file), dropping the batch. So, with Trackio's local SQLite storage, the export waits for
        the write and reads back which of its episodes were stored:

        * ``SUCCESS``: every episode was stored, except those ``take_not_stored()`` returns by
          reason (a value Trackio cannot store, a directory that can never be written...);
        * ``FAILURE``: nothing was stored and retrying later makes sense (a lock another process
          holds, a full disk): nothing is half-written, so a retry sends no episode twice.

        A Space (or a Trackio in its JSONL mode) cannot be read back from here: its failures are
        those Trackio reports when the run is finished (``force_flush``).
        """
        self._import_trackio()
        import trackio

        episodes: list[_Episode] = []
        unstorable: list[int] = []  # reported only when the export succeeds (a retry finds them again)
        broken: list[int] = []  # the same, for traces whose tree has no episode root
        for trace_id, group in by_trace(spans).items():
            root = root_of(group)
            if root is None:
                problem = broken_root(group)
                if problem is None:  # late spans of an episode exported before: nothing to store
                    self.skipped_fragments += len(group)
                else:
                    broken.append(trace_id)
                    self._log_broken(trace_id, problem)
                continue
            attrs = root.attributes or {}
            step = attrs.get(c.RL_STEP)
            step = step if isinstance(step, int) and not isinstance(step, bool) else 0
            split = str(attrs.get(c.RL_SPLIT) or "train")
            key = self.trace_key if split == "train" else f"{split}/{self.trace_key}"
            url = self.trace_url(trace_id)
            try:
                messages, metadata = episode_messages(group), episode_metadata(root, url, group)
                tree = episode_spans(group)
                problem = _unstorable(messages, metadata, tree)
                if problem is None and not fits_int64(step):
                    problem = f"step {step} is beyond 64-bit integer range"
                trace = None if problem is not None else trackio.Trace(messages=messages, metadata=metadata,
                                                                       spans=tree)
                row = table_row(group, url)
                tokens = tuple(mismatch_rows(group, url))
                watched = watch_key(attrs.get(c.RL_WATCH_KEY))
                watch = None if watched is None else (
                    f"{key}/{WATCH_SUFFIX}/{watched}", watch_row(step, attrs, trace_id))
            except Exception as exc:  # noqa: BLE001 - one episode's odd value never loses the others
                problem, trace, watch, tokens = f"{type(exc).__name__}: {str(exc)[:120]}", None, None, ()
            if problem is not None or trace is None:
                # Trackio would skip the whole step's traces with a warning of its own: leave this
                # one out, and say so (counted lost, never delivered)
                unstorable.append(trace_id)
                if not self._warned_unstorable:
                    self._warned_unstorable = True
                    logger.warning("otel_rollouts: TrackioExporter: trace %s cannot be stored by Trackio (%s); "
                                   "counted lost in otr.stats()", hex_id(trace_id, 32), problem)
                continue
            episodes.append(_Episode(trace_id, step, key, trace, row, iso_utc(root.start_time), watch, tokens))
        result = self._write(episodes)
        if result is SpanExportResult.SUCCESS and unstorable:
            self._not_stored_add(NOT_STORED_UNSTORABLE, unstorable)
        if result is SpanExportResult.SUCCESS and broken:
            self._not_stored_add(NOT_STORED_NO_ROOT, broken)
        return result

    def _log_broken(self, trace_id: int, problem: str) -> None:
        """Name a trace refused for its broken tree (the first ``_BROKEN_LOGGED`` one by one: a
        replayed file of thousands of them says so without a line each)."""
        self.broken_traces += 1
        if self.broken_traces <= _BROKEN_LOGGED:
            logger.warning("otel_rollouts: TrackioExporter: trace %s not stored: %s, so it has no episode "
                           "root (counted %s)", hex_id(trace_id, 32), problem, NOT_STORED_NO_ROOT)
        elif self.broken_traces == _BROKEN_LOGGED + 1:
            logger.warning("otel_rollouts: TrackioExporter: more traces without an episode root; the "
                           "rest are counted (%s), not named", NOT_STORED_NO_ROOT)

    def _write(self, episodes: list[_Episode]) -> SpanExportResult:
        """Log ``episodes`` to Trackio and confirm them (see ``export``)."""
        if not episodes:
            return SpanExportResult.SUCCESS
        with self._lock:
            problem = self._cannot_write()
            if problem is not None:
                return self._not_written(problem, episodes)
            run = self._trackio_run()
            confirm = self._confirmable(run)
            since = datetime.now(timezone.utc).isoformat()
            by_step: dict[tuple[int, str], list[object]] = defaultdict(list)
            for episode in episodes:
                by_step[(episode.step, episode.key)].append(episode.trace)
            # one log per (step, key): Trackio's trace ids are "<run id>:<log id>:<key>:<index>"
            for (step, key), traces in sorted(by_step.items()):
                run.log({key: traces}, step=step)
            stored = episodes
            if confirm:
                outcome = self._confirm(run, episodes, since)
                if isinstance(outcome, SpanExportResult):
                    return outcome
                stored = outcome
                self._stamp_request_times(run, stored, since)
            self.exported += len(stored)
            if self.table:
                for episode in stored:
                    table = (episode.step, f"{episode.key}/{TABLE_SUFFIX}")
                    self._rows[table][hex_id(episode.trace_id, 32)] = episode.row
                    if episode.mismatch:
                        self._tokens[table][hex_id(episode.trace_id, 32)] = episode.mismatch
                    if episode.watch is not None:
                        self._watch_add(episode.step, *episode.watch)
            self._replace_running(run, [e.trace_id for e in stored])
            if stored:
                # the steps before the latest one here are over: their tables can be logged
                self._log_tables(before=max(e.step for e in stored))
        return SpanExportResult.SUCCESS

    def _cannot_write(self) -> _WriteProblem | None:
        """Why a write to the local database cannot succeed now (``diagnose``), checked before
        anything is handed to Trackio, whose writer (and ``trackio.init`` itself) waits 30 s on a
        locked database and then drops the batch; None when it can, or when Trackio logs to a
        Space or a server (nothing local to check)."""
        if self._run is not None:
            local = self._confirmable(self._run)
        else:
            local = self.space_id is None and not any(os.environ.get(name) for name in _TRACKIO_REMOTE_ENV)
        return diagnose(self._db_path(), self._lock_path()) if local else None

    def _confirmable(self, run: Run) -> bool:
        """Whether this run's writes can be read back here: Trackio's local SQLite storage."""
        return bool(getattr(run, "_is_local", self.space_id is None)) and getattr(
            run, "_storage_mode", "sqlite") == "sqlite"

    def _db_path(self) -> Path:
        """The project's SQLite file, as Trackio names it (under ``TRACKIO_DIR``)."""
        self._import_trackio()
        from trackio.sqlite_storage import SQLiteStorage

        return Path(SQLiteStorage.get_project_db_path(self.project))

    def _lock_path(self) -> Path | None:
        """Trackio's per-project process lock file (None when this Trackio has none we know)."""
        try:
            from trackio.utils import canonical_project_name

            return self._db_path().parent / f"{canonical_project_name(self.project)}.lock"
        except ImportError:
            return None

    def _confirm(self, run: Run, episodes: list[_Episode], since: str) -> SpanExportResult | list[_Episode]:
        """Wait for Trackio's write of ``episodes`` and read back which were stored.

        Returns the stored episodes (the others are added to ``take_not_stored`` under the reason
        the diagnosis names), or ``FAILURE`` when none was stored and the cause is transient.
        """
        self._write_now(run)
        try:
            found = stored_trace_ids(self._db_path(), run.name, since)
        except sqlite3.Error as exc:
            # what was written cannot be read: the write met the same fault (a lock taken since)
            return self._not_written(_classify(exc), episodes)
        stored = [e for e in episodes if hex_id(e.trace_id, 32) in found]
        if len(stored) == len(episodes):
            return stored
        missing = [e for e in episodes if hex_id(e.trace_id, 32) not in found]
        problem = diagnose(self._db_path(), self._lock_path()) or _WriteProblem(
            NOT_STORED_WRITE_FAILED, False, f"Trackio did not store it ({', '.join(_persist_failures(run)) or 'no warning'})")
        if not stored:
            return self._not_written(problem, episodes)
        # part of the write went through: a retry would send the stored ones twice
        self._not_written(problem._replace(transient=False), missing)
        return stored

    def _stamp_request_times(self, run: Run, stored: list[_Episode], since: str) -> None:
        """Give each stored episode's row its episode's start as its request time.

        Trackio stamps every row of a write with the time of the write (``bulk_log``; neither
        ``trackio.log`` nor ``Trace`` takes a time), so a step's episodes would share one and the
        Traces list would order them at random. A view: failing never fails the export."""
        times = {hex_id(e.trace_id, 32): e.started for e in stored if e.started is not None}
        if not times:
            return
        try:
            run_id = getattr(run, "id", None)
            run_id = run_id if isinstance(run_id, str) else None
            client_lock = getattr(run, "_client_lock", None)
            if client_lock is not None:
                with client_lock:  # never while this run's writer thread writes
                    stamp_request_times(self._db_path(), run_id, run.name, since, times)
            else:
                stamp_request_times(self._db_path(), run_id, run.name, since, times)
        except Exception as exc:  # noqa: BLE001 - a view: never fail (and so resend) a stored export
            self.request_time_failures += 1
            if self.request_time_failures == 1:
                logger.warning("otel_rollouts: TrackioExporter could not set the episodes' request times "
                               "(%s: %s); they keep the time of their write", type(exc).__name__, exc)

    def _write_now(self, run: Any) -> None:  # Any: Run.finish is untyped in Trackio
        """Make Trackio write what ``run.log`` queued, now, on this thread: what its writer thread
        does every half second (under the same lock, so never concurrently with it). A Trackio
        without these internals is finished instead (``join``s its writer) and resumed by name on
        the next export."""
        client_lock = getattr(run, "_client_lock", None)
        flush = getattr(run, "_flush_queues_inline", None)
        if client_lock is not None and callable(flush):
            with client_lock:
                flush()
            return
        self._run = None
        self.run_name = run.name
        run.finish()

    def _not_written(self, problem: _WriteProblem, episodes: list[_Episode]) -> SpanExportResult:
        """``episodes`` were not stored for ``problem``: ``FAILURE`` when it is transient (the
        export is retried), else counted under its reason in ``take_not_stored`` (``SUCCESS``)."""
        first = problem.reason not in self._warned_problems
        self._warned_problems.add(problem.reason)
        if problem.transient:
            if first:
                logger.warning("otel_rollouts: TrackioExporter: Trackio cannot write now (%s); the export "
                               "fails and is retried", problem.detail)
            return SpanExportResult.FAILURE
        if first:
            logger.warning("otel_rollouts: TrackioExporter: %d episode(s) not stored by Trackio (%s: %s); "
                           "counted lost in otr.stats()", len(episodes), problem.reason, problem.detail)
        self._not_stored_add(problem.reason, [e.trace_id for e in episodes])
        return SpanExportResult.SUCCESS

    def _not_stored_add(self, reason: str, trace_ids: list[int]) -> None:
        with self._not_stored_lock:
            self._not_stored.setdefault(reason, []).extend(trace_ids)

    def take_not_stored(self) -> dict[str, list[int]]:
        """The episodes of the last exports that were not stored: reason -> their OpenTelemetry
        trace ids (then forgotten). Called by the delivery layer right after an export returned
        ``SUCCESS``: those episodes are dropped under ``reason``, the batch's others delivered."""
        with self._not_stored_lock:
            out, self._not_stored = self._not_stored, {}
        return out

    def _log_tables(self, before: int | None = None) -> None:
        """Log the collected step tables (those of steps before ``before``; all when None): for
        each, its ``slowest`` table when an episode of it was timed, and the watched prompts'
        history tables due at those steps.

        A table is a view of traces already logged: failing to log one never fails an export
        (which would be retried); it is logged once and its rows are dropped.
        """
        for step, key in sorted(self._rows):
            if before is not None and step >= before:
                continue
            rows = sorted(self._rows.pop((step, key)).values(), key=_worst_first)
            self._log_table(key, step, step_rows(rows))
            slowest = slowest_rows(rows)
            if slowest:
                self._log_table(f"{key[: -len(TABLE_SUFFIX)]}{SLOWEST_SUFFIX}", step, slowest)
            tokens = self._tokens.pop((step, key), None)
            if tokens:
                self._log_table(f"{key[: -len(TABLE_SUFFIX)]}{MISMATCH_SUFFIX}", step,
                                worst_tokens([token for rows_of in tokens.values() for token in rows_of]))
        for step, key in sorted(self._watch_due):
            if before is not None and step >= before:
                continue
            self._watch_due.discard((step, key))
            history = self._watch.get(key)
            watched = sorted((row for row in history or () if row["step"] <= step), key=lambda row: row["step"])
            if watched:
                self._log_table(key, step, watched)

    def _log_table(self, key: str, step: int, rows: Sequence[Mapping[str, object]]) -> bool:
        """Log one ``trackio.Table`` of ``rows`` (dicts, the first one's keys as the columns) at
        ``step``; a failure is counted (``table_failures``) and said once, never raised."""
        import trackio

        columns = list(rows[0])
        try:
            table = trackio.Table(columns=columns, data=[[row.get(col) for col in columns] for row in rows])
            self._trackio_run().log({key: table}, step=step)
        except Exception as exc:  # noqa: BLE001 - a view: never fail the export for it
            self.table_failures += 1
            if self.table_failures == 1:
                logger.warning("otel_rollouts: TrackioExporter could not log the step %d table %s: %r",
                               step, key, exc)
            return False
        self.tables_logged += 1
        return True

    def _watch_add(self, step: int, key: str, row: dict[str, object]) -> None:
        """Add a stored episode of a watched prompt to its history (``key``: its table's key), to
        be logged with its step's tables. Bounded: ``WATCH_MAX_ROWS`` rows per key (the oldest
        dropped first) and ``WATCH_MAX_KEYS`` keys (the one updated longest ago forgotten)."""
        history = self._watch.get(key)
        if history is None:
            history = self._watch[key] = deque(maxlen=WATCH_MAX_ROWS)
            while len(self._watch) > WATCH_MAX_KEYS:
                forgotten, _ = self._watch.popitem(last=False)
                self._watch_due = {due for due in self._watch_due if due[1] != forgotten}
        self._watch.move_to_end(key)
        if any(old["trace id"] == row["trace id"] for old in history):
            return  # the same episode exported again (a retried export)
        history.append(row)
        self._watch_due.add((step, key))

    def show_pending(self, snapshots: Sequence[ReadableSpan], ended: Sequence[int]) -> None:
        """Show which episodes are still running, and stop showing those that ended.

        ``snapshots``: the spans of snapshots of episodes still running (their roots carry
        ``rl.pending.snapshot``, the span they are stuck in and for how long; open spans end "now");
        ``ended``: OpenTelemetry trace ids of episodes shown running before that have ended
        (kept, dropped or given up). Called by the delivery thread, never the training thread.

        Each snapshot becomes a ``trackio.Trace`` under ``rollouts/running`` (``<split>/...``
        for other splits) at its step, its status ``running <span> <seconds>s``, its open spans
        ``running`` in the tree; a newer snapshot of the same episode replaces the older one.
        With Trackio's local storage an episode that ended (or whose finished episode was
        exported) has its snapshot's row deleted: only what runs reads as running. Then a
        ``rollouts/running/table`` is logged at the step: what runs now (episode, open for, stuck
        in, trace id), or one ``nothing running`` row. Best effort: a view, never counted as an
        episode delivered or lost; a failure is counted (``pending_failures``) and said once.
        """
        try:
            self._import_trackio()
            with self._lock:
                self._show_pending(snapshots, ended)
        except Exception as exc:  # noqa: BLE001 - a view of episodes still running: never raise
            self.pending_failures += 1
            if self.pending_failures == 1:
                logger.warning("otel_rollouts: TrackioExporter could not show the running episodes: %s: %s",
                               type(exc).__name__, exc)

    def _show_pending(self, snapshots: Sequence[ReadableSpan], ended: Sequence[int]) -> None:
        import trackio

        problem = self._cannot_write()
        if problem is not None:
            self.pending_failures += 1
            return
        shown: dict[int, tuple[int, str, Any, dict[str, object]]] = {}
        for trace_id, group in by_trace(snapshots).items():
            root = root_of(group)
            if root is None:
                continue
            attrs = root.attributes or {}
            step = attrs.get(c.RL_STEP)
            step = step if isinstance(step, int) and not isinstance(step, bool) and fits_int64(step) else 0
            split = str(attrs.get(c.RL_SPLIT) or "train")
            key = f"{self.trace_key if split == 'train' else f'{split}/{self.trace_key}'}/{RUNNING_SUFFIX}"
            metadata = episode_metadata(root, self.trace_url(trace_id), group)
            metadata[META_STATUS] = running_label(attrs)
            tree = episode_spans(group)
            running_spans(group, tree)
            messages = episode_messages(group)
            if _unstorable(messages, metadata, tree) is not None:
                continue
            shown[trace_id] = (step, key, trackio.Trace(messages=messages, metadata=metadata, spans=tree),
                               running_row(attrs, trace_id))
        run = self._trackio_run()
        local = self._confirmable(run)
        since = datetime.now(timezone.utc).isoformat()
        by_key: dict[tuple[int, str], list[object]] = defaultdict(list)
        for step, key, trace, _ in shown.values():
            by_key[(step, key)].append(trace)
        for (step, key), traces in sorted(by_key.items()):
            run.log({key: traces}, step=step)
        new_rows: dict[str, list[str]] = {}
        if local and shown:
            self._write_now(run)
            new_rows = self._pending_rows(run, since, {key for _, key, _, _ in shown.values()})
        stale: list[str] = []
        touched: dict[str, int] = {}
        for trace_id, (step, key, _, row) in shown.items():
            old = self._running.pop(trace_id, None)
            if old is not None:
                stale.extend(old.row_ids)
            self._running[trace_id] = _Running(step, key, row, tuple(new_rows.get(hex_id(trace_id, 32), ())))
            touched[key] = max(touched.get(key, step), step)
        while len(self._running) > RUNNING_MAX:
            self._running.popitem(last=False)
        stale.extend(self._end_running(ended, touched))
        if local and stale:
            self._delete_rows(run, stale)
        self._log_running_tables(touched)
        if local and touched:
            self._write_now(run)  # a view of now: on the dashboard at once, not at the next write

    def _end_running(self, trace_ids: Sequence[int], touched: dict[str, int]) -> list[str]:
        """Forget the episodes of ``trace_ids`` shown running; their snapshots' row ids (to
        delete). ``touched`` gains each running key whose table changed, at its latest step."""
        stale: list[str] = []
        for trace_id in trace_ids:
            old = self._running.pop(trace_id, None)
            if old is not None:
                stale.extend(old.row_ids)
                touched[old.key] = max(touched.get(old.key, old.step), old.step)
        return stale

    def _replace_running(self, run: Run, trace_ids: Sequence[int]) -> None:
        """Episodes just stored that were shown running: their finished episode replaces the
        snapshot (deleted; a fresh running table is logged). Never fails the export."""
        if not self._running or not any(t in self._running for t in trace_ids):
            return
        try:
            touched: dict[str, int] = {}
            stale = self._end_running(trace_ids, touched)
            if stale and self._confirmable(run):
                self._delete_rows(run, stale)
            self._log_running_tables(touched)
            if self._confirmable(run):
                self._write_now(run)
        except Exception as exc:  # noqa: BLE001 - a view: the export stored its episodes
            self.pending_failures += 1
            if self.pending_failures == 1:
                logger.warning("otel_rollouts: TrackioExporter could not replace a running episode: %s: %s",
                               type(exc).__name__, exc)

    def _log_running_tables(self, touched: Mapping[str, int]) -> None:
        """For each running key in ``touched`` (key -> step), the table of what runs now."""
        if not self.table:
            return
        for key, step in sorted(touched.items()):
            running = [r for r in self._running.values() if r.key == key]
            rows = [r.row for r in sorted(running, key=lambda r: r.step)]
            if not rows:
                rows = [dict(zip(RUNNING_COLUMNS, (TABLE_ABSENT, TABLE_ABSENT, RUNNING_NONE, TABLE_ABSENT),
                                 strict=True))]
            else:
                step = max(r.step for r in running)
            self._log_table(f"{key}/{TABLE_SUFFIX}", step, rows)

    def _pending_rows(self, run: Run, since: str, keys: set[str]) -> dict[str, list[str]]:
        """OpenTelemetry trace id -> the Trackio row ids of the snapshots written since ``since``
        under ``keys`` (read back from the local database)."""
        found: dict[str, list[str]] = defaultdict(list)
        for row_id, key, metadata in _read_rows(self._db_path(), getattr(run, "id", None), run.name, since):
            if key in keys and isinstance(metadata, dict) and metadata.get(c.RL_PENDING_SNAPSHOT) is True:
                trace_id = metadata.get(META_TRACE_ID)
                if isinstance(trace_id, str):
                    found[trace_id].append(row_id)
        return found

    def _delete_rows(self, run: Run, row_ids: Sequence[str]) -> None:
        """Delete Trackio rows of snapshots no longer running (and their session files, best
        effort), under the run's client lock: never while its writer thread writes."""
        client_lock = getattr(run, "_client_lock", None)
        if client_lock is not None:
            with client_lock:
                delete_trace_rows(self._db_path(), row_ids)
        else:
            delete_trace_rows(self._db_path(), row_ids)
        try:
            from trackio import agent_sessions
            from trackio.utils import project_trace_sessions_dir

            directory = project_trace_sessions_dir(self.project) / agent_sessions.safe_id(run.name or "run")
            for row_id in row_ids:
                (directory / agent_sessions.trace_session_filename(row_id)).unlink(missing_ok=True)
        except Exception:  # noqa: BLE001, S110 - Trackio's rendering artifact; its database is what it reads
            pass

    def log_metrics(self, step: int, values: dict[str, float]) -> None:
        """Log a training step's rollout numbers as Trackio scalars at ``step`` (the same step
        as its traces). Handed down by the pipeline's metrics when the step closes."""
        self._import_trackio()
        # a value nobody recorded is no point on its plot, never a 0 (None, NaN: left out)
        values = {key: value for key, value in values.items()
                  if isinstance(value, (int, float)) and not isinstance(value, bool) and math.isfinite(value)}
        if not values or not fits_int64(int(step)):
            return  # a step Trackio's storage cannot hold would lose the whole batch of its write
        with self._lock:
            problem = self._cannot_write()
            if problem is not None:  # scalars are a view of the step: skipped, said once
                self.metrics_skipped += 1
                if self.metrics_skipped == 1:
                    logger.warning("otel_rollouts: TrackioExporter: step %d scalars not logged (%s)",
                                   step, problem.detail)
                return
            self._trackio_run().log(dict(values), step=int(step))

    def force_flush(self, timeout_millis: int = 30000) -> bool:
        """Make everything logged so far durable (Trackio writes on ``finish``), step tables
        still collecting included.

        The run is finished and transparently resumed by name on the next export.
        """
        self._finish()
        return True

    def shutdown(self) -> None:
        self._finish()

    def _finish(self) -> None:
        with self._lock:
            if self._rows or self._watch_due:
                self._log_tables()
            if self._run is not None:
                run, self._run = self._run, None
                self.run_name = run.name
                confirmed = self._confirmable(run)
                run.finish()
                # Trackio writes on its own thread and only *warns* when a write fails (read-only
                # or full directory, locked database). Episodes written to local storage were
                # confirmed by their export (what is left here are step tables and scalars, views
                # of them); elsewhere (a Space) turn the warning into an error the delivery layer
                # counts and logs once, instead of a silent loss
                failed = _persist_failures(run)
                if failed and not confirmed:
                    raise OSError(f"trackio could not persist run {run.name!r} ({', '.join(failed)})")
                if failed and "finish" not in self._warned_problems:
                    self._warned_problems.add("finish")
                    logger.warning("otel_rollouts: TrackioExporter: Trackio could not write everything of run "
                                   "%r (%s); stored episodes are not affected", run.name, ", ".join(failed))
