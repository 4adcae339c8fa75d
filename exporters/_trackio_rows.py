"""What an episode looks like in Trackio: the trace (messages, metadata, span tree) and the rows
of the step's tables, built from its OpenTelemetry spans. Pure functions of the spans: no
Trackio call, no file.

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

import json
import math
import re
from collections import defaultdict
from collections.abc import Callable, Mapping, Sequence
from datetime import datetime, timezone
from typing import Any, NamedTuple, cast

from opentelemetry.sdk.trace import ReadableSpan

from otel_rollouts import conventions as c
from otel_rollouts._core.health import GroupRow, health_text
from otel_rollouts._core.messages import as_text, attach_tool_call, scores_of, to_openai
from otel_rollouts.exporters._tree import (
    duration_ms,
    hex_id,
    is_error,
    kind_of,
    ordered,
    parse,
    root_of,
)

_CONTENT_KEYS = {
    c.GEN_AI_INPUT_MESSAGES,
    c.GEN_AI_OUTPUT_MESSAGES,
    c.GEN_AI_TOOL_CALL_ARGUMENTS,
    c.GEN_AI_TOOL_CALL_RESULT,
    c.INPUT_VALUE,
    c.OUTPUT_VALUE,
}
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
COLUMN_PARTS = "reward parts"  # the reward's components, as the reward function named them
COLUMN_FAILED = "failed tools"  # the tool calls that failed, and what each said
COLUMN_MOST_TIME = "most time in"  # the stage with the most seconds, its share, its longest span
# one column per stage of c.STAGES (rl.stage.<stage>.seconds), in that order
STAGE_COLUMNS = {c.STAGE_GENERATION: "gen s", c.STAGE_TOOL: "tool s", c.STAGE_ENVIRONMENT: "env s",
                 c.STAGE_REWARD: "reward s", c.STAGE_WAITING: "wait s"}
# the span kind whose spans make up a stage (environment and waiting have none)
STAGE_KINDS = {c.STAGE_GENERATION: c.KIND_GENERATION, c.STAGE_TOOL: c.KIND_TOOL, c.STAGE_REWARD: c.KIND_REWARD}
TABLE_COLUMNS = ("reward", COLUMN_PARTS, "advantage", "status", COLUMN_FAILED, "question", "answer", "turns",
                 "input tokens", "output tokens", COLUMN_REASON, COLUMN_GROUP_HEALTH, COLUMN_SECONDS,
                 COLUMN_MOST_TIME, *STAGE_COLUMNS.values(), "trace id", "group", "sample", "episode")
# the inference engine's own timings of the episode's generations (``rl.server.*``, summed), shown
# in the slowest table when a kept episode of the step has them
ENGINE_COLUMNS = {c.RL_SERVER_QUEUE_SECONDS: "engine queue s", c.RL_SERVER_TTFT_SECONDS: "ttft s"}
# the step's kept episodes again, slowest first: which rollouts held the step back, and where
# their time went (``most time in``: the stage with the most seconds, and its share)
SLOWEST_SUFFIX = "slowest"
SLOWEST_COLUMNS = (COLUMN_SECONDS, COLUMN_MOST_TIME, *STAGE_COLUMNS.values(), COLUMN_REASON, "status", "reward",
                   COLUMN_FAILED, COLUMN_GROUP_HEALTH, "trace id", "question", "episode")
# a watched prompt's history (rl.watch.key): one row per kept episode of it, oldest step first
WATCH_SUFFIX = "watch"
WATCH_COLUMNS = ("step", "reward", "status", "question", "answer", "trace id")
WATCH_MAX_KEYS = 64  # watch keys followed at once: the one updated longest ago is forgotten first
WATCH_MAX_ROWS = 200  # rows per watch key: the oldest is dropped first
WATCH_KEY_CHARS = 64  # a watch key in a Trackio key: at most this many characters of [A-Za-z0-9_.-]
# episodes still running (show_pending): their snapshots, and a table of what runs now
RUNNING_SUFFIX = "running"
RUNNING_COLUMNS = ("episode", "open for", "stuck in", "trace id")
RUNNING_MARK = "running"  # a snapshot's status, and its open spans' (no glyph: fonts lack ⏳)
HUNG_MARK = "hung"  # what the span a snapshot is stuck in says
RUNNING_NOW = "running_now"  # the scalar of how many episodes run past the hang threshold now
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
                          "generation", COLUMN_REASON, "question", "group", "sample", "trace id")
MISMATCH_PER_GENERATION = 8  # a generation's worst tokens shown (its span carries up to top_tokens)
MISMATCH_MAX_ROWS = 64  # rows of a step's mismatch table (a page shows every step's)
TOKEN_CHARS = 40  # a token's shown text, "…" included
_VISIBLE = {" ": "\u2423", "\n": "\\n", "\t": "\\t", "\r": "\\r", "\\": "\\\\"}  # ␣ for a space
TABLE_LINK = "link"
TABLE_ABSENT = "\u2014"  # —: what the table shows for a value nobody recorded (never 0)
PREVIEW_CHARS = 80  # the table's question and answer previews, "…" included
FAILED_CHARS = 120  # the failed tools' cell
MISMATCH_QUESTION_CHARS = 48  # the question in a mismatch table's row (one per token: kept short)
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
    reads as absent, never as 0. ``reward parts``: the reward's components (``math 0 · format
    0.25``); ``failed tools``: each tool call that failed, with what it said; ``most time in``:
    the stage with the most seconds, its share, and its longest span. The inference engine's
    timings (``ENGINE_COLUMNS``) and the mismatch statistics are added when the episode has them
    (``step_rows``/``slowest_rows`` give every row of a table the same columns)."""
    root = root_of(spans)
    attrs = (root.attributes or {}) if root is not None else {}
    turns = 0
    input_tokens: int | None = None
    output_tokens: int | None = None
    failed: list[str] = []
    longest: dict[str, tuple[float, str]] = {}  # stage -> (seconds, name) of its longest span
    engine: dict[str, float] = {}
    kinds = {kind: stage for stage, kind in STAGE_KINDS.items()}
    for span in spans:
        span_attrs = span.attributes or {}
        kind = kind_of(span)
        if kind == c.KIND_TURN:
            turns += 1
        input_tokens = _add_count(input_tokens, span_attrs.get(c.GEN_AI_USAGE_INPUT_TOKENS))
        output_tokens = _add_count(output_tokens, span_attrs.get(c.GEN_AI_USAGE_OUTPUT_TOKENS))
        if kind == c.KIND_TOOL and is_error(span):
            name = span_attrs.get(c.GEN_AI_TOOL_NAME) or span.name
            failed.append(f"{as_text(name)}: {error_text(span)}")
        stage = kinds.get(kind) if kind is not None else None
        if stage is not None and span.end_time is not None and span.start_time is not None:
            seconds = (span.end_time - span.start_time) / 1e9
            if seconds > longest.get(stage, (-1.0, ""))[0]:
                longest[stage] = (seconds, span.name)
        if kind == c.KIND_GENERATION:
            for key in ENGINE_COLUMNS:
                value = _number(span_attrs.get(key))
                if value is not None and math.isfinite(value) and value >= 0:
                    engine[key] = engine.get(key, 0.0) + value
    reason = attrs.get(c.RL_KEEP_REASON)
    parts = [f"{name} {value:.4g}" for name, value in scores_of(attrs).items()
             if name not in (c.EVALUATION_REWARD, c.EVALUATION_ADVANTAGE)]
    stages = {stage: _seconds(attrs.get(c.stage_seconds(stage))) for stage in STAGE_COLUMNS}
    duration = _seconds(attrs.get(c.RL_DURATION_SECONDS))
    values = (
        _readable(attrs.get(c.RL_REWARD)), " \u00b7 ".join(parts) if parts else TABLE_ABSENT,
        _readable(attrs.get(c.RL_ADVANTAGE)), attrs.get(c.RL_STATUS),
        preview("; ".join(failed), FAILED_CHARS) if failed else TABLE_ABSENT,
        preview(attrs.get(c.INPUT_VALUE)), preview(attrs.get(c.OUTPUT_VALUE)),
        turns, TABLE_ABSENT if input_tokens is None else input_tokens,
        TABLE_ABSENT if output_tokens is None else output_tokens,
        reason if isinstance(reason, str) and reason else TABLE_ABSENT, group_health(attrs),
        duration, most_time_in(stages, duration, longest),
        *stages.values(),
        hex_id(root.context.trace_id, 32) if root is not None else None,
        None if attrs.get(c.RL_GROUP_ID) is None else as_text(attrs.get(c.RL_GROUP_ID)),
        attrs.get(c.RL_SAMPLE_INDEX), attrs.get(c.RL_EPISODE_ID),
    )
    row: dict[str, object] = dict(zip(TABLE_COLUMNS, values, strict=True))
    if any(attrs.get(key) is not None for key in MISMATCH_COLUMNS):  # train–inference mismatch measured
        row.update((column, _stat(attrs.get(key))) for key, column in MISMATCH_COLUMNS.items())
    row.update((ENGINE_COLUMNS[key], _seconds(value)) for key, value in engine.items())
    if trace_url is not None:
        row[TABLE_LINK] = trace_url
    return row


def _same_columns(rows: Sequence[Mapping[str, object]], columns: Sequence[str],
                  optional: Sequence[str], after: str) -> list[dict[str, object]]:
    """``rows`` with the same columns, in order: ``columns``, with those of ``optional`` that some
    row has inserted right after ``after`` (``—`` where a row has none), and ``link`` last when
    the row has one (Trackio takes a table's columns from its first row)."""
    extra = [column for column in optional if any(column in row for row in rows)]
    at = list(columns).index(after) + 1
    ordered = (*columns[:at], *extra, *columns[at:])
    out = []
    for row in rows:
        item = {column: row.get(column, TABLE_ABSENT) for column in ordered}
        if TABLE_LINK in row:
            item[TABLE_LINK] = row[TABLE_LINK]
        out.append(item)
    return out


def step_rows(rows: Sequence[Mapping[str, object]]) -> list[dict[str, object]]:
    """A step table's rows with the same columns, in order: when some episode of the step has
    train–inference mismatch statistics, every row gets their columns (``MISMATCH_COLUMNS``,
    right after ``kept because``, in sight beside it; ``—`` where an episode has none)."""
    return _same_columns(rows, TABLE_COLUMNS, tuple(MISMATCH_COLUMNS.values()), COLUMN_REASON)


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
    question = preview(attrs.get(c.INPUT_VALUE), MISMATCH_QUESTION_CHARS)
    group = TABLE_ABSENT if attrs.get(c.RL_GROUP_ID) is None else as_text(attrs.get(c.RL_GROUP_ID))
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
                      reason if isinstance(reason, str) and reason else TABLE_ABSENT, question, group,
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
    """An episode's GRPO group in one cell (``_core.health.health_text``: ``all equal ×8``,
    ``lost 2/8``, ``ok 8``, ``truncated 1/8``), from the ``rl.group.*`` attributes on its root;
    ``—`` for an episode without a group's health."""
    size = attrs.get(c.RL_GROUP_SIZE)
    if not isinstance(size, int) or isinstance(size, bool):
        return TABLE_ABSENT
    expected = _positive(attrs.get(c.RL_GROUP_EXPECTED_SIZE)) or None
    degenerate = attrs.get(c.RL_GROUP_DEGENERATE)
    return health_text(size, expected, attrs.get(c.RL_GROUP_ALL_EQUAL) is True, _positive(attrs.get(c.RL_GROUP_LOST)),
                       _positive(attrs.get(c.RL_GROUP_TRUNCATED)),
                       degenerate if isinstance(degenerate, str) and degenerate else None)


def _positive(value: object) -> int:
    """A count attribute as a positive int, else 0."""
    return value if isinstance(value, int) and not isinstance(value, bool) and value > 0 else 0


def most_time_in(stages: Mapping[str, object], total: object,
                 longest: Mapping[str, tuple[float, str]]) -> str:
    """The stage an episode spent the most seconds in, with its share of the episode's duration
    and, for a stage made of spans, the longest of them (``tool 41.2 s (83%): execute_tool
    search 40.1 s``); ``—`` when no stage was measured."""
    measured = [(value, stage) for stage, value in stages.items() if isinstance(value, (int, float))]
    if not measured:
        return TABLE_ABSENT
    value, stage = max(measured)
    share = f" ({100 * value / total:.0f}%)" if isinstance(total, (int, float)) and total > 0 else ""
    span = longest.get(stage)
    where = f": {span[1]} {_seconds(span[0])} s" if span is not None else ""
    return f"{stage} {value:g} s{share}{where}"


def slowest_rows(rows: Sequence[Mapping[str, object]]) -> list[dict[str, object]]:
    """A step table's rows with a measured duration, slowest first, as ``SLOWEST_COLUMNS`` (with
    the engine's timings after the stages when some episode has them, the ``link`` kept when
    there is one); empty when no episode of the step was timed."""
    timed = [row for row in rows if isinstance(row.get(COLUMN_SECONDS), (int, float))]
    timed.sort(key=lambda row: -cast(float, row[COLUMN_SECONDS]))  # a number: checked above
    return _same_columns(timed, SLOWEST_COLUMNS, tuple(ENGINE_COLUMNS.values()), STAGE_COLUMNS[c.STAGE_WAITING])


def watch_key(value: object) -> str | None:
    """A watch key (``rl.watch.key``) as part of a Trackio key: ``[A-Za-z0-9_.-]`` only (every
    other run of characters becomes ``_``: a ``/`` would nest it), at most ``WATCH_KEY_CHARS``;
    None for a root without one."""
    if value is None or isinstance(value, bool):
        return None
    text = _UNSAFE_KEY.sub("_", as_text(value)).strip("_")[:WATCH_KEY_CHARS]
    return text or None


def watch_row(step: int, attrs: Mapping[str, object], trace_id: int) -> dict[str, object]:
    """One row of a watched prompt's history: step, reward, status, the question's and the
    answer's heads, trace id."""
    return dict(zip(WATCH_COLUMNS, (step, _readable(attrs.get(c.RL_REWARD)), attrs.get(c.RL_STATUS),
                                    preview(attrs.get(c.INPUT_VALUE)), preview(attrs.get(c.OUTPUT_VALUE)),
                                    hex_id(trace_id, 32)), strict=True))


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
    those still open: their end is the snapshot's "now") and the spans between them. The span it
    is stuck in reads as a hang, not as work going on: status ``error`` with ``hung: open for
    <seconds>, no end yet`` (Trackio has two pill colours, green for any text and red for
    ``error``: a snapshot is sent only past the hang threshold, and green would say all is well)."""
    root = root_of(spans)
    if root is None:
        return
    attrs = root.attributes or {}
    now = root.end_time or 0
    by_id = {span.context.span_id: span for span in spans}
    open_ids = {root.context.span_id}
    stuck_name = attrs.get(c.RL_PENDING_SPAN_NAME)
    candidates = [span for span in spans if span.name == stuck_name and (span.end_time or 0) >= now - 1_000_000]
    stuck_id: str | None = None
    if candidates:
        span: ReadableSpan | None = max(candidates, key=lambda s: s.start_time or 0)
        if span is not None:
            stuck_id = hex_id(span.context.span_id)
        while span is not None and span.context.span_id not in open_ids:
            open_ids.add(span.context.span_id)
            span = by_id.get(span.parent.span_id) if span.parent is not None else None
    marked = {hex_id(span_id) for span_id in open_ids}
    for item in tree:
        if item.get("id") == stuck_id:
            item["status"] = TRACKIO_ERROR
            item["error"] = f"{HUNG_MARK}: open for {_fmt_seconds(attrs.get(c.RL_PENDING_SPAN_SECONDS))}, no end yet"
        elif item.get("id") in marked and item.get("status") != TRACKIO_ERROR:
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


def why_unstorable(messages: object, metadata: object, spans: object) -> str | None:
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


def iso_utc(ns: int | None) -> str | None:
    """A span time (ns since the epoch) in the format Trackio stamps rows with (ISO 8601, UTC,
    always with microseconds, cut, not rounded): rows compare as text, so the format must be the
    same; a span's start and its trace's request time read alike."""
    if ns is None:
        return None
    seconds, rest = divmod(int(ns), 1_000_000_000)
    moment = datetime.fromtimestamp(seconds, tz=timezone.utc).replace(microsecond=rest // 1000)
    return moment.isoformat(timespec="microseconds")

def is_snapshot(metadata: object) -> bool:
    """Whether a stored trace's metadata is a running episode's snapshot (``show_pending``)."""
    return isinstance(metadata, dict) and metadata.get(c.RL_PENDING_SNAPSHOT) is True


def worst_first(row: Mapping[str, Any]) -> tuple[bool, float, float]:
    """Lowest reward first (then lowest advantage); episodes without a reward last."""
    reward, advantage = row.get("reward"), row.get("advantage")
    return (reward is None, reward if reward is not None else 0.0, advantage if advantage is not None else 0.0)


# a closed step's summary (the scalars ``correlate.metrics`` hands to ``log_metrics``: names under
# the split's prefix, ``rollouts/`` for train), as one table: what the plots say, read at a glance
SUMMARY_SUFFIX = "summary"
SUMMARY_COLUMNS = ("episodes", "seen", "kept", "dropped")
_SEEN, _KEPT, _DROPPED, _KEPT_BY = "episodes_seen", "episodes_kept", "episodes_dropped", "episodes_kept_by/"
_GROUP_COUNTS = (("groups", "groups"), ("groups_all_equal", "groups all equal"),
                 ("groups_lost", "groups that lost members"), ("groups_truncated", "groups with a truncated member"))


def summary_prefix(values: Mapping[str, object]) -> str | None:
    """The scalars' prefix (``rollouts/``, ``eval/rollouts/``) when ``values`` is a closed step's
    summary, else None (a lone scalar, e.g. the step's hung episodes)."""
    for key in values:
        if key.endswith(_SEEN):
            return key[: -len(_SEEN)]
    return None


def summary_rows(values: Mapping[str, object], prefix: str) -> list[dict[str, object]]:
    """A closed step in one table: every episode (seen, kept, dropped), then by status, then why
    the kept ones were kept, then its groups (how many seen, degenerate each way); ``—`` where a
    column does not apply."""
    def count(name: str) -> object:
        value = values.get(prefix + name)
        return int(value) if isinstance(value, (int, float)) and not isinstance(value, bool) else TABLE_ABSENT

    rows = [dict(zip(SUMMARY_COLUMNS, ("all", count(_SEEN), count(_KEPT), count(_DROPPED)), strict=True))]
    status_prefix = f"{prefix}{_SEEN}/"
    for key in values:
        if key.startswith(status_prefix):
            status = key[len(status_prefix):]
            rows.append(dict(zip(SUMMARY_COLUMNS, (f"status {status}", count(f"{_SEEN}/{status}"),
                                                   count(f"{_KEPT}/{status}"), count(f"{_DROPPED}/{status}")),
                                 strict=True)))
    reason_prefix = prefix + _KEPT_BY
    for key in values:
        if key.startswith(reason_prefix):
            reason = key[len(reason_prefix):]
            rows.append(dict(zip(SUMMARY_COLUMNS, (f"kept because {reason}", TABLE_ABSENT,
                                                   count(_KEPT_BY + reason), TABLE_ABSENT), strict=True)))
    for name, label in _GROUP_COUNTS:
        if prefix + name in values:
            rows.append(dict(zip(SUMMARY_COLUMNS, (label, count(name), TABLE_ABSENT, TABLE_ABSENT), strict=True)))
    return rows


# every GRPO group a closed step saw (``GroupsSink.log_groups``), degenerate ones first
GROUPS_SUFFIX = "groups"
GROUPS_COLUMNS = ("group", "members", "reward spread", "all equal", "lost", "truncated", "kept", "health")


def groups_rows(rows: Sequence[GroupRow]) -> list[dict[str, object]]:
    """A closed step's groups as table rows: members (``3/4`` when fewer than expected were
    seen), the reward spread (``—`` without rewards), all-equal (``yes``/``no``), members lost and
    truncated (apart: a truncated member was scored), members kept, and the cell the step table
    shows (``group_health``); in the order given (degenerate first)."""
    out: list[dict[str, object]] = []
    for row in rows:
        members = f"{row.size}/{row.expected_size}" if row.expected_size and row.expected_size != row.size \
            else str(row.size)
        spread = TABLE_ABSENT if row.reward_spread is None else _readable(row.reward_spread, 4)
        out.append(dict(zip(GROUPS_COLUMNS, (row.group, members, spread, "yes" if row.all_equal else "no",
                                             row.lost, row.truncated, row.kept,
                                             health_text(row.size, row.expected_size or None, row.all_equal,
                                                         row.lost, row.truncated)),
                            strict=True)))
    return out
