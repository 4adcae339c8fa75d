"""Chat messages from the frameworks, recorded as turns, tool calls and feedback.

Used by the adapters whose frameworks keep OpenAI-style conversations (Tinker cookbook traces,
TRL conversational completions): one assistant message becomes a turn's generation, its
``tool_calls`` become ``execute_tool`` spans whose results are the matching ``tool`` messages,
and whatever else the environment said back becomes the turn's feedback.

Token ids are decoded lazily (``decoded``): only episodes the sampler keeps pay for it.
"""

from __future__ import annotations

import json
from collections.abc import Mapping, Sequence
from typing import Any

from otel_rollouts.adapters.kit import Deferred, field, to_list

__all__ = [
    "conversation",
    "decoded",
    "feedback_after",
    "leading_prompt",
    "record_assistant",
    "record_completion",
    "token_count",
    "token_ids",
]


def conversation(value: Any) -> list[dict[str, Any]]:
    """Messages of ``value``: a ``{"type": "conversation", "messages": [...]}`` payload, a list of
    messages, one message, or plain text (a user message)."""
    if value is None:
        return []
    if isinstance(value, str):
        return [{"role": "user", "content": value}]
    if isinstance(value, Mapping):
        if "messages" in value and "role" not in value:
            return conversation(value.get("messages"))
        return [dict(value)]
    if isinstance(value, Sequence):
        out = []
        for m in value:
            if isinstance(m, Mapping):
                out.append(dict(m))
            elif m is not None:
                out.append({"role": "user", "content": str(m)})
        return out
    messages = field(value, "messages")
    if messages is not None:
        return conversation(messages)
    return [{"role": "user", "content": str(value)}]


def _role(message: Mapping[str, Any]) -> str:
    return str(message.get("role") or "")


def leading_prompt(messages: list[dict[str, Any]]) -> list[dict[str, Any]]:
    """The messages before the first assistant message: the episode's initial prompt.

    Cutting there also undoes an environment that logged its live history list instead of a
    snapshot (the list grew after it was logged): the prompt is still the initial one.
    """
    for i, m in enumerate(messages):
        if _role(m) == "assistant":
            return messages[:i]
    return messages


def feedback_after(messages: list[dict[str, Any]], turn: int) -> list[dict[str, Any]]:
    """What followed assistant message number ``turn`` in a conversation (tool results, user or
    environment messages), up to the next assistant message.

    A conversation without assistant messages (an environment that shows only its latest
    observation) is feedback as a whole.
    """
    positions = [i for i, m in enumerate(messages) if _role(m) == "assistant"]
    if not positions:
        return [m for m in messages if _role(m) != "system"]
    if turn < len(positions):
        end = positions[turn + 1] if turn + 1 < len(positions) else len(messages)
        return messages[positions[turn] + 1:end]
    return messages[positions[-1] + 1:]


def _tool_calls(message: Mapping[str, Any]) -> list[tuple[str, Any, str | None]]:
    """(name, arguments, call id) of each tool call in an assistant message."""
    out = []
    for call in message.get("tool_calls") or []:
        if not isinstance(call, Mapping):
            continue
        function = call.get("function")
        function = function if isinstance(function, Mapping) else {}
        name = function.get("name") or call.get("name") or "tool"
        arguments = function.get("arguments", call.get("arguments"))
        if isinstance(arguments, str):
            try:
                arguments = json.loads(arguments)
            except ValueError:
                pass
        call_id = call.get("id")
        out.append((str(name), arguments, None if call_id is None else str(call_id)))
    return out


def record_assistant(
    turn: Any,
    message: Mapping[str, Any] | None,
    feedback: Sequence[dict[str, Any]] = (),
    *,
    model: str | None = None,
    finish_reason: str | None = None,
    input_tokens: int | None = None,
    output_tokens: int | None = None,
    input_messages: Any = None,
) -> list[str]:
    """Record one assistant message on ``turn``, its tool calls with their results, and the
    remaining ``feedback``; returns the tool-call parse errors it carried (Tinker's
    ``unparsed_tool_calls``)."""
    message = dict(message or {"role": "assistant", "content": ""})
    message.setdefault("role", "assistant")
    unparsed = message.pop("unparsed_tool_calls", None) or []
    turn.record_generation(
        message,
        model=model,
        messages=input_messages,
        finish_reason=finish_reason,
        input_tokens=input_tokens,
        output_tokens=output_tokens,
    )
    calls = _tool_calls(message)
    rest = list(feedback)
    for n, (name, arguments, call_id) in enumerate(calls):
        result = _take_result(rest, call_id, name, n)
        with turn.tool_call(name, arguments=arguments, call_id=call_id) as call:
            if result is not None:  # a call the rollout ended on has no result: span only
                call.result(result.get("content"))
    for m in rest:
        turn.feedback(m.get("content"), role=_role(m) or "environment")
    errors = []
    for item in unparsed:
        error = field(item, "error") if not isinstance(item, str) else item
        errors.append(str(error or item))
    return errors


def _take_result(rest: list[dict[str, Any]], call_id: str | None, name: str, n: int
                 ) -> dict[str, Any] | None:
    """Remove and return the tool message answering a call: by id, else the first tool message
    with the call's name, else the first unnamed tool message."""
    tools = [i for i, m in enumerate(rest) if _role(m) == "tool"]
    for i in tools:
        if call_id is not None and rest[i].get("tool_call_id") == call_id:
            return rest.pop(i)
    for i in tools:
        if rest[i].get("tool_call_id") is None and rest[i].get("name") == name:
            return rest.pop(i)
    for i in tools:
        if rest[i].get("tool_call_id") is None and rest[i].get("name") is None:
            return rest.pop(i)
    return None


def record_completion(ep: Any, messages: list[dict[str, Any]], *, model: str | None = None,
                      finish_reason: str | None = None) -> int:
    """Record a conversational completion (assistant turns, tool results, other messages) as
    turns of ``ep``; returns the number of turns. A completion with no assistant message is one
    turn whose generation is the text of the completion."""
    turns: list[tuple[dict[str, Any], list[dict[str, Any]]]] = []
    for m in messages:
        if _role(m) == "assistant" or not turns:
            if _role(m) == "assistant":
                turns.append((m, []))
            else:
                turns.append(({"role": "assistant", "content": m.get("content", "")}, []))
        else:
            turns[-1][1].append(m)
    for k, (assistant, feedback) in enumerate(turns):
        with ep.turn() as turn:
            record_assistant(turn, assistant, feedback, model=model,
                             finish_reason=finish_reason if k == len(turns) - 1 else None)
    return len(turns)


# --- tokens --------------------------------------------------------------------------------
def token_ids(value: Any) -> list[int] | None:
    """Token ids of a token container: a list, a tensor, Tinker's ``ModelInput`` (``to_ints``),
    ``TokensWithLogprobs`` (``tokens``). Copied, so later mutation cannot leak in."""
    if value is None:
        return None
    to_ints = getattr(value, "to_ints", None)
    if callable(to_ints):
        try:
            return list(to_ints())
        except Exception:  # noqa: BLE001 - e.g. an image chunk: no ids to show
            return None
    tokens = field(value, "tokens") if not isinstance(value, (list, tuple)) else None
    if tokens is not None:
        return token_ids(tokens)
    ids = to_list(value)
    return list(ids) if ids is not None else None


def token_count(value: Any) -> int | None:
    """How many tokens ``value`` holds (``length`` of a ``ModelInput``, ``len`` otherwise)."""
    if value is None:
        return None
    length = getattr(value, "length", None)
    if isinstance(length, int):
        return length
    ids = token_ids(value)
    return None if ids is None else len(ids)


def decoded(tokenizer: Any, ids: list[int] | None) -> Deferred | None:
    """The text of ``ids``, decoded only if the episode is kept (on the export thread)."""
    if tokenizer is None or ids is None:
        return None
    ids = list(ids)
    return Deferred(lambda: tokenizer.decode(ids, skip_special_tokens=False))
