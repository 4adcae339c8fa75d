"""What a ``@traced(kind="generation")`` function returned, read as a model response.

A generation function commonly returns the inference client's own response: an OpenAI-style
chat completion (``choices[0].message``, ``finish_reason``, ``usage.prompt_tokens``), a
Responses-API or Anthropic-style object (``usage.input_tokens``, ``output_text``), or the same as
a dict (``response.json()``). Its text, tool calls, finish reason, model and token usage are
read from either shape, attribute or key, without importing any client library. A value that is
none of these is left to the caller (recorded as the span's output as it is).

Only the fields named here are read, each through ``call_user``: a property of a user's object
may raise anything, and that must not reach the traced function.
"""

from __future__ import annotations

from collections.abc import Mapping

from otel_rollouts._core.content import call_user

__all__ = ["Response", "read_response"]

_MISSING = object()


class Response:
    """The parts of a model response a generation span records; None where absent."""

    __slots__ = ("message", "finish_reason", "input_tokens", "output_tokens", "model")

    def __init__(self) -> None:
        self.message: dict[str, object] | None = None
        self.finish_reason: object = None
        self.input_tokens: object = None
        self.output_tokens: object = None
        self.model: object = None


def _get(value: object, key: str) -> object:
    """``value[key]`` for a mapping, ``value.key`` otherwise; ``_MISSING`` when absent or when
    reading it raised."""
    if value is None or isinstance(value, (str, bytes, int, float, bool)):
        return _MISSING
    if isinstance(value, Mapping):
        got, exc = call_user(value.get, key, _MISSING)
    else:
        got, exc = call_user(getattr, value, key, _MISSING)
    return _MISSING if exc is not None else got


def _first(value: object, *keys: str) -> object:
    for key in keys:
        got = _get(value, key)
        if got is not _MISSING and got is not None:
            return got
    return None


def _tool_call(call: object) -> dict[str, object]:
    function = _get(call, "function")
    if function is _MISSING or function is None:  # a flat {"id", "name", "arguments"}
        function = call
    return {
        "id": _first(call, "id"),
        "type": "function",
        "function": {"name": _first(function, "name"), "arguments": _first(function, "arguments")},
    }


def _message(message: object) -> dict[str, object] | None:
    content = _get(message, "content")
    calls = _get(message, "tool_calls")
    if content is _MISSING and calls is _MISSING:
        return None
    out: dict[str, object] = {"role": _first(message, "role") or "assistant",
                           "content": "" if content is _MISSING or content is None else content}
    if isinstance(calls, (list, tuple)) and calls:
        out["tool_calls"] = [_tool_call(call) for call in calls]
    return out


def read_response(value: object) -> Response | None:
    """The response parts of ``value``, or None when it has none of them (no choices, usage,
    message or output text): a plain return value, recorded as it is."""
    if value is None or isinstance(value, (str, bytes, int, float, bool, list, tuple)):
        return None
    out = Response()
    found = False
    choices = _get(value, "choices")
    if isinstance(choices, (list, tuple)) and choices:
        choice = choices[0]
        message = _get(choice, "message")
        if message is not _MISSING and message is not None:
            out.message = _message(message)
        out.finish_reason = _first(choice, "finish_reason")
        found = True
    elif (text := _get(value, "output_text")) is not _MISSING and isinstance(text, str):
        out.message = {"role": "assistant", "content": text}
        out.finish_reason = _first(value, "stop_reason")
        found = True
    elif isinstance(value, Mapping) and "content" in value:  # a message dict, maybe with usage
        out.message = _message(value)
    usage = _get(value, "usage")
    if usage is not _MISSING and usage is not None:
        out.input_tokens = _first(usage, "prompt_tokens", "input_tokens")
        out.output_tokens = _first(usage, "completion_tokens", "output_tokens")
        found = True
    if found:
        model = _first(value, "model")
        out.model = model if isinstance(model, str) and model else None
        return out
    return None
