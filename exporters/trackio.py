"""Kept episodes as Trackio traces: one ``trackio.Trace`` per episode, logged at its step.

Trackio's dashboard shows each trace's conversation (OpenAI-style messages, tool calls and tool
results) and its execution tree (the spans). The embedded default writes to a local SQLite file
under ``TRACKIO_DIR``: nothing to start.
"""

from __future__ import annotations

import logging
import threading
from collections import defaultdict
from collections.abc import Sequence
from typing import Any

from opentelemetry.sdk.trace import ReadableSpan
from opentelemetry.sdk.trace.export import SpanExporter, SpanExportResult

from otel_rollouts import conventions as c
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
_TRACKIO_KIND = {c.KIND_GENERATION: "generation", c.KIND_TOOL: "tool"}


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
            call_id = attrs.get(c.GEN_AI_TOOL_CALL_ID) or hex_id(span.context.span_id)
            name = attrs.get(c.GEN_AI_TOOL_NAME) or span.name
            if last_assistant is not None:
                calls = last_assistant.setdefault("tool_calls", [])
                if not any(isinstance(tc, dict) and tc.get("id") == call_id for tc in calls):
                    arguments = attrs.get(c.GEN_AI_TOOL_CALL_ARGUMENTS)
                    calls.append(
                        {
                            "id": call_id,
                            "type": "function",
                            "function": {"name": name, "arguments": arguments if isinstance(arguments, str) else "{}"},
                        }
                    )
            if is_error(span):
                content = f"error: {span.status.description or 'tool failed'}"
            else:
                result = attrs.get(c.GEN_AI_TOOL_CALL_RESULT)
                content = "" if result is None else str(result)
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


def _as_list(value: Any) -> list[dict[str, Any]]:
    if isinstance(value, list):
        return [m if isinstance(m, dict) else {"role": "user", "content": str(m)} for m in value]
    if isinstance(value, dict):
        return [value]
    if isinstance(value, str) and value:
        return [{"role": "user", "content": value}]
    return []


def episode_metadata(root: ReadableSpan, trace_url: str | None) -> dict[str, Any]:
    attrs = root.attributes or {}
    metadata: dict[str, Any] = {"trace_id": hex_id(root.context.trace_id, 32)}
    for key, value in attrs.items():
        if key.startswith("rl.") and key != c.RL_SPAN_KIND:
            metadata[key] = parse(value)
    status = attrs.get(c.RL_STATUS)
    if status:
        metadata["status"] = status
    if trace_url:
        metadata["trace_url"] = trace_url
    return metadata


def episode_spans(spans: Sequence[ReadableSpan]) -> list[dict[str, Any]]:
    out = []
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
        item["status"] = "error" if is_error(span) else "success"
        if is_error(span):
            item["error"] = span.status.description or "error"
        if kind == c.KIND_GENERATION:
            _put(item, "input", attrs.get(c.GEN_AI_INPUT_MESSAGES) or attrs.get(c.INPUT_VALUE))
            _put(item, "output", attrs.get(c.GEN_AI_OUTPUT_MESSAGES) or attrs.get(c.OUTPUT_VALUE))
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
            _put(item, "output", attrs.get(c.GEN_AI_TOOL_CALL_RESULT))
        elif kind == c.KIND_REWARD:
            item["output"] = {k: v for k, v in attrs.items() if k.startswith(c.RL_REWARD) or k == c.RL_ADVANTAGE}
        else:
            _put(item, "input", attrs.get(c.GEN_AI_INPUT_MESSAGES) or attrs.get(c.INPUT_VALUE))
            _put(item, "output", attrs.get(c.GEN_AI_OUTPUT_MESSAGES) or attrs.get(c.OUTPUT_VALUE))
        metadata = {k: parse(v) for k, v in attrs.items() if k not in _CONTENT_KEYS}
        if metadata:
            item["metadata"] = metadata
        out.append(item)
    return out


def _put(item: dict[str, Any], key: str, value: Any) -> None:
    if value is not None:
        item[key] = parse(value)


class TrackioExporter(SpanExporter):
    """Writes each kept episode as a ``trackio.Trace`` at ``step=rl.step``.

    ``project``/``run``/``space_id`` are Trackio's (a ``space_id`` syncs to a Hugging Face
    Space). Train episodes go under ``trace_key``; other splits under ``"{split}/{trace_key}"``.
    ``trace_ui_url`` (or env ``OTEL_ROLLOUTS_TRACE_UI_URL``), e.g. a Jaeger base URL, adds a
    ``trace_url`` link to each trace's metadata; a value with ``{trace_id}`` is a URL template
    (Phoenix: ``http://localhost:6006/redirects/traces/{trace_id}``).
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
    ) -> None:
        import os

        self.project = project
        self.run_name = run
        self.space_id = space_id
        self.trace_key = trace_key
        self.trace_ui_url = (trace_ui_url or os.environ.get(c.ENV_TRACE_UI_URL) or "").rstrip("/") or None
        self.config = config
        self._run = None
        self._lock = threading.Lock()
        self.exported = 0
        self.skipped_fragments = 0

    def _trackio_run(self):
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

    def export(self, spans: Sequence[ReadableSpan]) -> SpanExportResult:
        import trackio

        by_step: dict[tuple[int, str], list[Any]] = defaultdict(list)
        for trace_id, group in by_trace(spans).items():
            root = root_of(group)
            if root is None:
                self.skipped_fragments += len(group)
                continue
            attrs = root.attributes or {}
            step = attrs.get(c.RL_STEP)
            step = step if isinstance(step, int) else 0
            split = str(attrs.get(c.RL_SPLIT) or "train")
            key = self.trace_key if split == "train" else f"{split}/{self.trace_key}"
            by_step[(step, key)].append(
                trackio.Trace(
                    messages=episode_messages(group),
                    metadata=episode_metadata(root, self.trace_url(trace_id)),
                    spans=episode_spans(group),
                )
            )
        if not by_step:
            return SpanExportResult.SUCCESS
        with self._lock:
            run = self._trackio_run()
            for (step, key), traces in sorted(by_step.items()):
                run.log({key: traces}, step=step)
                self.exported += len(traces)
        return SpanExportResult.SUCCESS

    def log_metrics(self, step: int, values: dict[str, float]) -> None:
        """Log a training step's rollout numbers as Trackio scalars at ``step`` (the same step
        as its traces). Handed down by the pipeline's metrics when the step closes."""
        if not values:
            return
        with self._lock:
            self._trackio_run().log(dict(values), step=int(step))

    def force_flush(self, timeout_millis: int = 30000) -> bool:
        """Make everything logged so far durable (Trackio writes on ``finish``).

        The run is finished and transparently resumed by name on the next export.
        """
        self._finish()
        return True

    def shutdown(self) -> None:
        self._finish()

    def _finish(self) -> None:
        with self._lock:
            if self._run is not None:
                run, self._run = self._run, None
                self.run_name = run.name
                run.finish()
                # Trackio writes on its own thread and only *warns* when a write fails (read-only
                # or full directory, locked database): turn that into an error the delivery
                # layer counts and logs once, instead of a silent loss
                failed = sorted(
                    key
                    for key in getattr(run, "_warned_failures", ())
                    if key.startswith(_PERSIST_FAILURES)
                )
                if failed:
                    raise OSError(f"trackio could not persist run {run.name!r} ({', '.join(failed)})")
