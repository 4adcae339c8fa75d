"""Kept episodes as Trackio traces: one ``trackio.Trace`` per episode, logged at its step.

Trackio's dashboard shows each trace's conversation (OpenAI-style messages, tool calls and tool
results) and its execution tree (the spans). The embedded default writes to a local SQLite file
under ``TRACKIO_DIR``: nothing to start.

What Trackio 0.43's Traces page derives from a trace (``frontend/src/lib/traceUtils.js``,
``pages/Traces.svelte``), and what this exporter writes so that it reads true:

* STATUS of a row is ``error`` as soon as *any* span has status ``error``/``failed`` or a
  non-empty ``error``; otherwise the trace metadata's ``status``. An episode's ``rl.status`` is the
  truth, so ``metadata.status`` is ``rl.status``, and a span that failed inside an episode that did
  not fail (a tool error the policy recovered from, a truncated episode) gets the status
  ``"error (episode ok)"`` (``… truncated)``...) with its message as its output: it shows on its
  span, but is not aggregated into the episode. In an ``error`` episode failed spans keep
  ``error`` + ``error``. The trace metadata's ``span_errors`` lists every failed span.
* TRACE ID shows the first 7 characters of Trackio's own *log id* (then ``:index``), a random id
  that Trackio's public API does not let us choose: Trackio's trace id is
  ``<run id>:<log id>:<key>:<index>``. The metadata's ``trace_id`` (the OpenTelemetry trace id)
  is what the search box (and ``trackio list traces --search``) finds an episode by.
* REQUEST is the first user message, its preview the first assistant message: for a multi-turn
  episode that is the first turn's reply (Trackio has no other field for it). The ``episode``
  span, selected when a row is expanded, shows the question and the final answer.
* a ``trackio.Table`` per step and split (``rollouts/table``, ``eval/rollouts/table``) lists the
  step's kept episodes, lowest reward first: Trackio 0.43 renders tables on its Media & Tables
  page without sorting, so the rows come sorted.
"""

from __future__ import annotations

import json
import logging
import threading
from collections import defaultdict
from collections.abc import Mapping, Sequence
from typing import Any

from opentelemetry.sdk.trace import ReadableSpan
from opentelemetry.sdk.trace.export import SpanExporter, SpanExportResult

from otel_rollouts import conventions as c
from otel_rollouts._core.messages import as_text, attach_tool_call, to_openai
from otel_rollouts._core.redaction import Redactor
from otel_rollouts.exporters._tree import (
    by_trace,
    duration_ms,
    hex_id,
    is_error,
    iso,
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
TABLE_SUFFIX = "table"
TABLE_COLUMNS = ("reward", "advantage", "status", "turns", "input tokens", "output tokens", "trace id",
                 "group", "sample", "episode")
TABLE_LINK = "link"


def episode_status(spans: Sequence[ReadableSpan]) -> str | None:
    """The episode's ``rl.status`` (None for a trace that has no episode root with one)."""
    root = root_of(spans)
    status = (root.attributes or {}).get(c.RL_STATUS) if root is not None else None
    return status if isinstance(status, str) and status else None


def span_status(span: ReadableSpan, status: str | None) -> str:
    """A span's status for Trackio, given its episode's ``rl.status``.

    Trackio turns a whole trace red when any span says ``error``: only a failure in an episode
    that failed (or one without an ``rl.status``) may say so; elsewhere it says which it is.
    """
    if not is_error(span):
        if kind_of(span) == c.KIND_EPISODE and status not in (None, c.STATUS_OK, c.STATUS_ERROR):
            return status  # the episode span reads what the list reads: "truncated", "filtered"
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
        metadata[META_STATUS] = status
    if trace_url:
        metadata[META_TRACE_URL] = trace_url
    failed = [f"{span.name}: {error_text(span)}" for _, span in ordered(spans) if is_error(span)]
    if failed:
        metadata[META_SPAN_ERRORS] = failed
    return metadata


def episode_spans(spans: Sequence[ReadableSpan]) -> list[dict[str, Any]]:
    out = []
    status = episode_status(spans)
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
        item["start_time"] = iso(span.start_time)
        item["end_time"] = iso(span.end_time)
        item["duration_ms"] = duration_ms(span)
        item["status"] = span_status(span, status)
        if item["status"] == TRACKIO_ERROR:
            item["error"] = error_text(span)
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
        metadata = {k: parse(v) for k, v in attrs.items() if k not in _CONTENT_KEYS}
        if metadata:
            item["metadata"] = metadata
        out.append(item)
    return out


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
    """One kept episode as a row of its step's table (every column present, in order)."""
    root = root_of(spans)
    attrs = (root.attributes or {}) if root is not None else {}
    turns = input_tokens = output_tokens = 0
    for span in spans:
        kind = kind_of(span)
        span_attrs = span.attributes or {}
        if kind == c.KIND_TURN:
            turns += 1
        elif kind == c.KIND_GENERATION:
            input_tokens += _count(span_attrs.get(c.GEN_AI_USAGE_INPUT_TOKENS))
            output_tokens += _count(span_attrs.get(c.GEN_AI_USAGE_OUTPUT_TOKENS))
    values = (
        _number(attrs.get(c.RL_REWARD)), _number(attrs.get(c.RL_ADVANTAGE)), attrs.get(c.RL_STATUS),
        turns, input_tokens, output_tokens,
        hex_id(root.context.trace_id, 32) if root is not None else None,
        None if attrs.get(c.RL_GROUP_ID) is None else as_text(attrs.get(c.RL_GROUP_ID)),
        attrs.get(c.RL_SAMPLE_INDEX), attrs.get(c.RL_EPISODE_ID),
    )
    row = dict(zip(TABLE_COLUMNS, values, strict=True))
    if trace_url is not None:
        row[TABLE_LINK] = trace_url
    return row


def _count(value: Any) -> int:
    return value if isinstance(value, int) and not isinstance(value, bool) else 0


def _number(value: Any) -> float | int | None:
    return value if isinstance(value, (int, float)) and not isinstance(value, bool) else None


def _unstorable(messages: Any, metadata: Any, spans: Any) -> str | None:
    """Why Trackio could not store a trace with these parts (its storage is UTF-8 JSON), or None."""
    try:
        json.dumps([messages, metadata, spans], ensure_ascii=False, default=str).encode("utf-8")
    except (TypeError, ValueError, UnicodeEncodeError, RecursionError) as exc:
        return f"{type(exc).__name__}: {str(exc)[:120]}"
    return None


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
    turns it off) has one row per kept episode: reward, advantage, status, turns, input and output
    tokens, group, sample, episode id, trace id (and ``link`` with a trace UI), lowest reward
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
        self._run: Any = None  # trackio's Run, made on the first export (import is slow)
        self._lock = threading.Lock()
        # (step, table key) -> trace id -> row: an episode exported again before its step's table is
        # logged (a retried export) is one row
        self._rows: dict[tuple[int, str], dict[str, dict[str, Any]]] = defaultdict(dict)
        self.exported = 0
        self.skipped_fragments = 0
        self.tables_logged = 0
        self.table_failures = 0
        self._not_stored: dict[str, int] = {}
        self._warned_unstorable = False

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
        import trackio

        episodes: list[tuple[int, str, str, Any, dict[str, Any]]] = []  # step, key, trace id, trace, row
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
            messages, metadata, tree = episode_messages(group), episode_metadata(root, url, group), episode_spans(group)
            problem = _unstorable(messages, metadata, tree)
            if problem is not None:
                # Trackio would skip the whole step's traces with a warning of its own: leave this
                # one out, and say so (counted lost, never delivered)
                self._not_stored["unstorable"] = self._not_stored.get("unstorable", 0) + 1
                if not self._warned_unstorable:
                    self._warned_unstorable = True
                    logger.warning("otel_rollouts: TrackioExporter: trace %s cannot be stored by Trackio (%s); "
                                   "counted lost in otr.stats()", hex_id(trace_id, 32), problem)
                continue
            trace = trackio.Trace(messages=messages, metadata=metadata, spans=tree)
            episodes.append((step, key, hex_id(trace_id, 32), trace, table_row(group, url)))
        if not episodes:
            return SpanExportResult.SUCCESS
        by_step: dict[tuple[int, str], list[Any]] = defaultdict(list)
        for step, key, _, trace, _ in episodes:
            by_step[(step, key)].append(trace)
        with self._lock:
            run = self._trackio_run()
            # one log per (step, key): Trackio's trace ids are "<run id>:<log id>:<key>:<index>"
            for (step, key), traces in sorted(by_step.items()):
                run.log({key: traces}, step=step)
                self.exported += len(traces)
            if self.table:
                for step, key, hex_trace_id, _, row in episodes:
                    self._rows[(step, f"{key}/{TABLE_SUFFIX}")][hex_trace_id] = row
            # the steps before the latest one here are over: their tables can be logged
            self._log_tables(before=max(e[0] for e in episodes))
        return SpanExportResult.SUCCESS

    def take_not_stored(self) -> dict[str, int]:
        """Episodes of the last exports that were not stored, by reason (then forgotten)."""
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
        if not values:
            return
        with self._lock:
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
                run.finish()
                # Trackio writes on its own thread and only *warns* when a write fails (read-only
                # or full directory, locked database): turn that into an error the delivery
                # layer counts and logs once, instead of a silent loss
                failed = _persist_failures(run)
                if failed:
                    raise OSError(f"trackio could not persist run {run.name!r} ({', '.join(failed)})")
