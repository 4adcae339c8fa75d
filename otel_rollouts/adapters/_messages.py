"""Chat messages from the frameworks, recorded as turns, tool calls and feedback.

Used by the adapters whose frameworks keep OpenAI-style conversations (Tinker cookbook traces,
TRL conversational completions): one assistant message becomes a turn's generation, its
``tool_calls`` become ``execute_tool`` spans whose results are the matching ``tool`` messages,
and whatever else the environment said back becomes the turn's feedback.

Token ids are decoded lazily (``decoded``): only episodes the sampler keeps pay for it.
"""

from __future__ import annotations

import json
from collections.abc import Iterable, Mapping, Sequence
from typing import TYPE_CHECKING, Protocol, TypeVar

from otel_rollouts.adapters.kit import Deferred, field, to_list

if TYPE_CHECKING:
    from otel_rollouts import Episode, ToolCall

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

Message = dict[str, object]
"""An OpenAI-style message as the frameworks keep it (``role``, ``content``, ``tool_calls``...)."""
M = TypeVar("M", bound=Mapping[str, object])


class TurnLike(Protocol):
    """What ``record_assistant`` records on: an ``otr.Turn``, or a wrapper of one that adds
    keywords to its generations (the Tinker adapter's sampled logprobs)."""

    def record_generation(self, content: object = None, *, model: str | None = None,
                          messages: object = None, provider: str | None = None,
                          **output: object) -> object: ...

    def tool_call(self, name: str, arguments: object = None, call_id: str | None = None) -> ToolCall: ...

    def feedback(self, content: object, role: str = "environment") -> None: ...


class _Decoder(Protocol):
    """A tokenizer, as ``decoded`` uses it."""

    def decode(self, ids: list[int], skip_special_tokens: bool = False) -> object: ...


def conversation(value: object) -> list[Message]:
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
        out: list[Message] = []
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


def _role(message: Mapping[str, object]) -> str:
    return str(message.get("role") or "")


def leading_prompt(messages: list[M]) -> list[M]:
    """The messages before the first assistant message: the episode's initial prompt.

    Cutting there also undoes an environment that logged its live history list instead of a
    snapshot (the list grew after it was logged): the prompt is still the initial one.
    """
    for i, m in enumerate(messages):
        if _role(m) == "assistant":
            return messages[:i]
    return messages


def feedback_after(messages: Sequence[M], turn: int) -> Sequence[M]:
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


def _tool_calls(message: Mapping[str, object]) -> list[tuple[str, object, str | None]]:
    """(name, arguments, call id) of each tool call in an assistant message."""
    out: list[tuple[str, object, str | None]] = []
    calls = message.get("tool_calls") or []
    if not isinstance(calls, Iterable):
        raise TypeError(f"tool_calls is not a list: {type(calls).__name__}")
    for call in calls:
        if not isinstance(call, Mapping):
            continue
        nested = call.get("function")
        function: Mapping[str, object] = nested if isinstance(nested, Mapping) else {}
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
    turn: TurnLike,
    message: Mapping[str, object] | None,
    feedback: Sequence[Mapping[str, object]] = (),
    *,
    model: str | None = None,
    finish_reason: str | None = None,
    input_tokens: int | None = None,
    output_tokens: int | None = None,
    input_messages: object = None,
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
    if not isinstance(unparsed, Iterable):
        raise TypeError(f"unparsed_tool_calls is not a list: {type(unparsed).__name__}")
    for item in unparsed:
        error = field(item, "error") if not isinstance(item, str) else item
        errors.append(str(error or item))
    return errors


def _take_result(rest: list[Mapping[str, object]], call_id: str | None, name: str, n: int
                 ) -> Mapping[str, object] | None:
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


def record_completion(ep: Episode, messages: list[Message], *, model: str | None = None,
                      finish_reason: str | None = None) -> int:
    """Record a conversational completion (assistant turns, tool results, other messages) as
    turns of ``ep``; returns the number of turns. A completion with no assistant message is one
    turn whose generation is the text of the completion."""
    turns: list[tuple[Message, list[Message]]] = []
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
def token_ids(value: object) -> list[int] | None:
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


def token_count(value: object) -> int | None:
    """How many tokens ``value`` holds (``length`` of a ``ModelInput``, ``len`` otherwise)."""
    if value is None:
        return None
    length = getattr(value, "length", None)
    if isinstance(length, int):
        return length
    ids = token_ids(value)
    return None if ids is None else len(ids)


def decoded(tokenizer: _Decoder | None, ids: list[int] | None) -> Deferred | None:
    """The text of ``ids``, decoded only if the episode is kept (on the export thread)."""
    if tokenizer is None or ids is None:
        return None
    ids = list(ids)
    return Deferred(lambda: tokenizer.decode(ids, skip_special_tokens=False))
