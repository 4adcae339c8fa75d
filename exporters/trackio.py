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
"""

from __future__ import annotations

import errno
import json
import logging
import math
import os
import sqlite3
import threading
from collections import defaultdict
from collections.abc import Mapping, Sequence
from datetime import datetime, timezone
from pathlib import Path
from typing import Any, NamedTuple

from opentelemetry.sdk.trace import ReadableSpan
from opentelemetry.sdk.trace.export import SpanExporter, SpanExportResult

from otel_rollouts import conventions as c
from otel_rollouts._core.messages import as_text, attach_tool_call, to_openai
from otel_rollouts._core.redaction import Redactor
from otel_rollouts._core.values import fits_int64
from otel_rollouts.exporters._tree import (
    by_trace,
    duration_ms,
    hex_id,
    is_error,
    kind_of,
    ordered,
    parse,
    root_of,
)

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


def _persist_failures(run: Any) -> list[str]:
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
TABLE_COLUMNS = ("reward", "advantage", "status", "question", "answer", "turns", "input tokens",
                 "output tokens", "trace id", "group", "sample", "episode")
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


def episode_messages(spans: Sequence[ReadableSpan]) -> list[dict[str, Any]]:
    """The conversation of one episode: prompt, assistant turns with tool calls, tool results."""
    messages: list[dict[str, Any]] = []
    last_assistant: dict[str, Any] | None = None
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


def _result_text(result: Any) -> str:
    """A tool result as text, the same in the conversation and on the tool's span (``as_text``:
    ``604800.0`` stays ``604800.0``; a sequence attribute reads as JSON)."""
    return as_text(list(result) if isinstance(result, tuple) else result)


def _as_list(value: Any) -> list[dict[str, Any]]:
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
) -> dict[str, Any]:
    """The trace metadata: the OpenTelemetry trace id, the root's ``rl.*`` values, ``status``
    (= ``rl.status``, what the list shows), the trace link, and the failed spans."""
    attrs = root.attributes or {}
    metadata: dict[str, Any] = {META_TRACE_ID: hex_id(root.context.trace_id, 32)}
    for key, value in attrs.items():
        if key.startswith("rl.") and key != c.RL_SPAN_KIND:
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


def episode_spans(spans: Sequence[ReadableSpan]) -> list[dict[str, Any]]:
    """The execution tree: one Trackio span dict per span, depth-first in start order."""
    out = []
    status = episode_status(spans)
    label = status_label(status, failed_spans(spans))
    for _, span in ordered(spans):
        attrs = span.attributes or {}
        kind = kind_of(span)
        item: dict[str, Any] = {
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


def span_metadata(attrs: Mapping[str, Any], item: Mapping[str, Any]) -> dict[str, Any]:
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


def _put_messages(item: dict[str, Any], key: str, messages: Any, fallback: Any) -> None:
    """A span's messages in OpenAI's shape (what Trackio renders), else its plain value."""
    if messages is not None:
        item[key] = _as_list(parse(messages))
    else:
        _put(item, key, fallback)


def _put(item: dict[str, Any], key: str, value: Any) -> None:
    if value is not None:
        item[key] = parse(value)


def table_row(spans: Sequence[ReadableSpan], trace_url: str | None) -> dict[str, Any]:
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
    values = (
        _number(attrs.get(c.RL_REWARD)), _number(attrs.get(c.RL_ADVANTAGE)), attrs.get(c.RL_STATUS),
        preview(attrs.get(c.INPUT_VALUE)), preview(attrs.get(c.OUTPUT_VALUE)),
        turns, TABLE_ABSENT if input_tokens is None else input_tokens,
        TABLE_ABSENT if output_tokens is None else output_tokens,
        hex_id(root.context.trace_id, 32) if root is not None else None,
        None if attrs.get(c.RL_GROUP_ID) is None else as_text(attrs.get(c.RL_GROUP_ID)),
        attrs.get(c.RL_SAMPLE_INDEX), attrs.get(c.RL_EPISODE_ID),
    )
    row = dict(zip(TABLE_COLUMNS, values, strict=True))
    if trace_url is not None:
        row[TABLE_LINK] = trace_url
    return row


def preview(value: Any, limit: int = PREVIEW_CHARS) -> str:
    """A value as one line of at most ``limit`` characters, cut with ``…``; ``—`` when empty."""
    # only the start is read: a long prompt costs no more than a short one
    text = " ".join(as_text(value)[: limit * 4].split()) if value is not None else ""
    if not text:
        return TABLE_ABSENT
    return text if len(text) <= limit else text[: limit - 1].rstrip() + "\u2026"


def _add_count(total: int | None, value: Any) -> int | None:
    """``total`` plus a recorded token count; None stays None until some count is recorded."""
    if isinstance(value, int) and not isinstance(value, bool) and value >= 0:
        return value if total is None else total + value
    return total


def _number(value: Any) -> float | int | None:
    return value if isinstance(value, (int, float)) and not isinstance(value, bool) else None


def _unstorable(messages: Any, metadata: Any, spans: Any) -> str | None:
    """Why Trackio could not store a trace with these parts, or None.

    Checked with Trackio's own serializer (``trackio.utils.serialize_values`` then ``orjson``):
    orjson refuses what ``json`` accepts, an int beyond 64 bits first of all, and Trackio then
    skips the *whole key* of the log, every episode of the step with it. Its storage is UTF-8.
    """
    try:
        import orjson
        from trackio import utils as trackio_utils

        serialize: Any = trackio_utils.serialize_values  # untyped in Trackio
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
    trace: Any  # trackio.Trace
    row: dict[str, Any]
    started: str | None  # the episode's start, as Trackio stamps rows (its request time)


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
        if isinstance(trace_id, str):
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
            if isinstance(trace_id, str) and trace_id in times:
                updates.append((times[trace_id], row_id))
        with conn:
            conn.executemany("UPDATE traces SET timestamp = ? WHERE id = ?", updates)
        return len(updates)
    finally:
        conn.close()


def _worst_first(row: Mapping[str, Any]) -> tuple[bool, float, float]:
    """Lowest reward first (then lowest advantage); episodes without a reward last."""
    reward, advantage = row.get(TABLE_COLUMNS[0]), row.get(TABLE_COLUMNS[1])
    return (reward is None, reward if reward is not None else 0.0, advantage if advantage is not None else 0.0)


class TrackioExporter(SpanExporter):
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
    """

    def __init__(
        self,
        project: str,
        run: str | None = None,
        space_id: str | None = None,
        trace_key: str = "rollouts",
        *,
        trace_ui_url: str | None = None,
        config: dict[str, Any] | None = None,
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
        self._rows: dict[tuple[int, str], dict[str, dict[str, Any]]] = defaultdict(dict)
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

            kwargs: dict[str, Any] = {
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
        """The link to this trace in a trace UI, or None when no UI is configured.

        A base URL is taken as Jaeger's UI (``{base}/trace/{trace_id}``); a value containing
        ``{trace_id}`` is a template for any other UI, e.g. Phoenix's
        ``http://localhost:6006/redirects/traces/{trace_id}``. The id is 32 lowercase hex digits.
        """
        if not self.trace_ui_url:
            return None
        if "{trace_id}" in self.trace_ui_url:
            return self.trace_ui_url.replace("{trace_id}", hex_id(trace_id, 32))
        return f"{self.trace_ui_url}/trace/{hex_id(trace_id, 32)}"

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
        for trace_id, group in by_trace(spans).items():
            root = root_of(group)
            if root is None:
                self.skipped_fragments += len(group)
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
            except Exception as exc:  # noqa: BLE001 - one episode's odd value never loses the others
                problem, trace = f"{type(exc).__name__}: {str(exc)[:120]}", None
            if problem is not None or trace is None:
                # Trackio would skip the whole step's traces with a warning of its own: leave this
                # one out, and say so (counted lost, never delivered)
                unstorable.append(trace_id)
                if not self._warned_unstorable:
                    self._warned_unstorable = True
                    logger.warning("otel_rollouts: TrackioExporter: trace %s cannot be stored by Trackio (%s); "
                                   "counted lost in otr.stats()", hex_id(trace_id, 32), problem)
                continue
            episodes.append(_Episode(trace_id, step, key, trace, row, iso_utc(root.start_time)))
        result = self._write(episodes)
        if result is SpanExportResult.SUCCESS and unstorable:
            self._not_stored_add(NOT_STORED_UNSTORABLE, unstorable)
        return result

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
            by_step: dict[tuple[int, str], list[Any]] = defaultdict(list)
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
                    self._rows[(episode.step, f"{episode.key}/{TABLE_SUFFIX}")][hex_id(episode.trace_id, 32)] = \
                        episode.row
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

    def _confirmable(self, run: Any) -> bool:
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

    def _confirm(self, run: Any, episodes: list[_Episode], since: str) -> SpanExportResult | list[_Episode]:
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

    def _stamp_request_times(self, run: Any, stored: list[_Episode], since: str) -> None:
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

    def _write_now(self, run: Any) -> None:
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
        """Log the collected step tables (those of steps before ``before``; all when None).

        A table is a view of traces already logged: failing to log one never fails an export
        (which would be retried); it is logged once and its rows are dropped.
        """
        import trackio

        for step, key in sorted(self._rows):
            if before is not None and step >= before:
                continue
            rows = sorted(self._rows.pop((step, key)).values(), key=_worst_first)
            columns = list(rows[0])
            try:
                table = trackio.Table(columns=columns, data=[[row.get(col) for col in columns] for row in rows])
                self._trackio_run().log({key: table}, step=step)
            except Exception as exc:  # noqa: BLE001 - a view: never fail the export for it
                self.table_failures += 1
                if self.table_failures == 1:
                    logger.warning("otel_rollouts: TrackioExporter could not log the step %d table: %r",
                                   step, exc)
                continue
            self.tables_logged += 1

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
            if self._rows:
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
