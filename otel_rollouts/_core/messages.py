"""Message shapes: OpenAI-style messages (what the training side records) to and from the
GenAI conventions' *parts* shape, tool calls, finish reasons, readable text, and an episode's
evaluations (reward, components, advantage, status) in OpenInference's flattened form.

Shared by the delivery side's per-span views (``delivery.views``), the exporters (Trackio's
conversation, the dataset rows) and Phoenix's annotations. Pure functions of recorded values.
"""

from __future__ import annotations

import json
import math
from collections.abc import Mapping, Sequence
from typing import Any

from otel_rollouts import conventions as c
from otel_rollouts._core.content import jsonable, text, to_json

Message = dict[str, object]


# --- OpenAI-style messages <-> the GenAI parts shape ------------------------------------------
def arguments_of(value: object) -> Any:
    """Tool-call arguments as an object when they are JSON text (the parts shape holds objects)."""
    if isinstance(value, str):
        try:
            return json.loads(value)
        except ValueError:
            return value
    return value


def arguments_text(value: object) -> str:
    """Tool-call arguments as OpenAI's JSON text (``json.dumps``' default spacing, as the
    Python frameworks write them)."""
    if isinstance(value, str):
        return value
    return json.dumps(jsonable(value if value is not None else {}), ensure_ascii=False)


def content_text(content: object) -> str | None:
    """The text of a message's content (a string, or the text items of a list of parts)."""
    if content is None:
        return None
    if isinstance(content, str):
        return content
    if isinstance(content, list):
        texts = []
        for item in content:
            if isinstance(item, str):
                texts.append(item)
            elif isinstance(item, Mapping):
                value = item.get("text", item.get("content"))
                if isinstance(value, str):
                    texts.append(value)
        return "\n".join(texts)
    return as_text(content)


# One way to print a value everywhere: text stays text, anything else is compact JSON (so a tool
# result of 604800.0 reads ``604800.0`` in every viewer, not ``604800`` here and ``604800.0`` there).
as_text = to_json


def attach_tool_call(calls: list[object], call_id: object, name: object, arguments: object) -> None:
    """Make the tool span ``call_id`` one of an assistant message's OpenAI-style ``calls``.

    A call already there with that id is left alone; a call without an id and with the same
    function name (frameworks record calls without ids) is this one and gets the id; otherwise
    the call is added. Appending in the second case would show the same call twice.
    """
    for tc in calls:
        if isinstance(tc, dict) and tc.get("id") == call_id:
            return
    for tc in calls:
        if isinstance(tc, dict) and not tc.get("id"):
            function = tc.get("function")
            if isinstance(function, dict) and function.get("name") == name:
                tc["id"] = call_id
                return
    calls.append({"id": call_id, "type": "function", "function": {"name": name, "arguments": arguments}})


def tool_calls_of(message: Mapping[str, Any]) -> list[dict[str, object]]:
    """A message's tool calls as ``{"id", "name", "arguments"}`` (OpenAI's nesting undone)."""
    out = []
    for call in message.get("tool_calls") or ():
        if not isinstance(call, Mapping):
            continue
        nested = call.get("function")
        function: Mapping[str, object] = nested if isinstance(nested, Mapping) else {}
        name = function.get("name", call.get("name"))
        arguments = function.get("arguments", call.get("arguments"))
        out.append({"id": call.get("id"), "name": None if name is None else text(name), "arguments": arguments})
    return out


def to_parts(message: object) -> Message:
    """One OpenAI-style message in the GenAI parts shape (a message already in it stays)."""
    if not isinstance(message, Mapping):
        return {"role": "user", "parts": [{"type": c.PART_TEXT, "content": as_text(message)}]}
    if isinstance(message.get("parts"), list):
        return dict(message)
    role = text(message.get("role") or "user")
    content = message.get("content")
    parts: list[dict[str, object]] = []
    if role == "tool":
        parts.append({"type": c.PART_TOOL_CALL_RESPONSE, "id": message.get("tool_call_id"),
                      "response": content})
    else:
        if isinstance(content, list):
            for item in content:
                if isinstance(item, Mapping) and item.get("type") not in (None, "text"):
                    parts.append(dict(item))  # an image, audio...: the spec's generic part
                else:
                    part_text = content_text([item])
                    if part_text:
                        parts.append({"type": c.PART_TEXT, "content": part_text})
        elif content is not None and content != "":
            parts.append({"type": c.PART_TEXT, "content": as_text(content)})
        for call in tool_calls_of(message):
            parts.append({"type": c.PART_TOOL_CALL, "id": call["id"], "name": call["name"],
                          "arguments": arguments_of(call["arguments"])})
    out: Message = {"role": role, "parts": parts}
    if message.get("name"):
        out["name"] = text(message["name"])
    return out


def to_openai(message: object) -> Message:
    """One message in the parts shape back in OpenAI's shape (what Trackio shows)."""
    if not isinstance(message, Mapping) or not isinstance(message.get("parts"), list):
        return dict(message) if isinstance(message, Mapping) else {"role": "user", "content": as_text(message)}
    role = message.get("role") or "user"
    texts: list[str] = []
    calls: list[dict[str, object]] = []
    out: Message = {"role": role}
    for part in message["parts"]:
        if not isinstance(part, Mapping):
            continue
        kind = part.get("type")
        if kind == c.PART_TEXT:
            texts.append(as_text(part.get("content", "")))
        elif kind == c.PART_TOOL_CALL:
            arguments = part.get("arguments")
            calls.append({"id": part.get("id"), "type": "function",
                          "function": {"name": part.get("name"), "arguments": arguments_text(arguments)}})
        elif kind == c.PART_TOOL_CALL_RESPONSE:
            out["tool_call_id"] = part.get("id")
            response = part.get("response")
            texts.append("" if response is None else as_text(response))
    out["content"] = "\n".join(texts)
    if calls:
        out["tool_calls"] = calls
    if message.get("name"):
        out["name"] = message["name"]
    return out


def finish_reason(value: object) -> str | None:
    """The GenAI spec's finish reason for what a framework wrote (unknown values stay)."""
    if value is None:
        return None
    reason = text(value)
    return c.FINISH_REASON_OF.get(reason.lower(), reason)


def messages_of(value: object) -> list[Message]:
    """A recorded message list (a list, one message, or text) as a list of dicts."""
    if value is None:
        return []
    if isinstance(value, str):
        try:
            value = json.loads(value) if value[:1] in "[{" else value
        except ValueError:
            pass
        if isinstance(value, str):
            return [{"role": "user", "content": value}]
    if isinstance(value, Mapping):
        return [dict(value)]
    if isinstance(value, (list, tuple)):
        return [dict(m) if isinstance(m, Mapping) else {"role": "user", "content": as_text(m)} for m in value]
    return [{"role": "user", "content": as_text(value)}]


def text_of(message: Mapping[str, object] | None) -> str | None:
    """What a person reads of a message: its text, else its tool calls."""
    if message is None:
        return None
    if isinstance(message.get("parts"), list):
        message = to_openai(message)
    body = content_text(message.get("content"))
    if body:
        return body
    calls = tool_calls_of(message)
    if calls:
        return "\n".join(f"{call['name']}({as_text(arguments_of(call['arguments']) or {})})" for call in calls)
    return body


def last_of(messages: Sequence[Message], role: str) -> Message | None:
    for message in reversed(messages):
        if message.get("role") == role:
            return message
    return None


def _score_name(key: str) -> str:
    """The evaluation name of a score attribute: ``reward``, ``advantage``, a component's own
    name (``rl.reward.component.correct`` -> ``correct``), or ``reward.component.<name>`` for a
    component whose name is one of the others (a component named ``status`` must not pass for the status) or one
    Phoenix reserves (``note``: its annotation API refuses the whole request)."""
    if key == c.RL_REWARD:
        return c.EVALUATION_REWARD
    if key == c.RL_ADVANTAGE:
        return c.EVALUATION_ADVANTAGE
    name = key.removeprefix(c.RL_REWARD_COMPONENT_PREFIX)
    return key.removeprefix(c.RL_PREFIX) if name in _RESERVED_NAMES or not name else name


_PHOENIX_NOTE = "note"  # Phoenix's span notes; POST /v1/span_annotations refuses the name (400)
_RESERVED_NAMES = frozenset({c.EVALUATION_REWARD, c.EVALUATION_ADVANTAGE, c.EVALUATION_STATUS, _PHOENIX_NOTE})


def is_score(key: str, value: object) -> bool:
    return ((key == c.RL_REWARD or key == c.RL_ADVANTAGE or key.startswith(c.RL_REWARD_COMPONENT_PREFIX))
            and isinstance(value, (int, float)) and not isinstance(value, bool) and math.isfinite(value))


def scores_of(attrs: Mapping[str, object]) -> dict[str, int | float]:
    """An episode's scores by evaluation name: the reward, each component (in recording order),
    the advantage. Finite numbers only (JSON and Phoenix take no NaN)."""
    found = {key: value for key, value in attrs.items()
             if is_score(key, value) and isinstance(value, (int, float))}  # is_score checked it already
    ordered = ([c.RL_REWARD] if c.RL_REWARD in found else []) + [
        key for key in found if key.startswith(c.RL_REWARD_COMPONENT_PREFIX)
    ] + ([c.RL_ADVANTAGE] if c.RL_ADVANTAGE in found else [])
    return {_score_name(key): found[key] for key in ordered}


def score_text(name: str, value: float) -> str:
    """``reward = 0.8``: a score named, with its value, for a person to read."""
    return f"{name} = {as_text(value)}"


def episode_evaluations(attrs: Mapping[str, object]) -> list[dict[str, object]]:
    """The evaluations of an episode from its root's attributes: one per score (``name``,
    ``score``) and the status as a label (``name`` ``status``, ``label`` ok / truncated /
    error / filtered), each judged by code."""
    out: list[dict[str, object]] = [
        {c.OI_EVALUATION_NAME: name, c.OI_EVALUATION_SCORE: value,
         c.OI_EVALUATION_ANNOTATOR_KIND: c.OI_ANNOTATOR_CODE}
        for name, value in scores_of(attrs).items()
    ]
    status = attrs.get(c.RL_STATUS)
    if isinstance(status, str) and status:
        out.append({c.OI_EVALUATION_NAME: c.EVALUATION_STATUS, c.OI_EVALUATION_LABEL: status,
                    c.OI_EVALUATION_ANNOTATOR_KIND: c.OI_ANNOTATOR_CODE})
    return out


def flat_evaluations(evaluations: Sequence[Mapping[str, object]]) -> dict[str, object]:
    """Evaluations as OpenInference's flattened span attributes (``evaluations.<i>.evaluation.
    <field>``, indices from 0, missing fields omitted)."""
    out: dict[str, object] = {}
    for i, evaluation in enumerate(evaluations):
        for field, value in evaluation.items():
            if value is not None:
                out[c.oi_evaluation_key(i, field)] = value
    return out


_EVALUATION_FIELDS = (c.OI_EVALUATION_NAME, c.OI_EVALUATION_SCORE, c.OI_EVALUATION_LABEL,
                      c.OI_EVALUATION_EXPLANATION, c.OI_EVALUATION_ANNOTATOR_KIND,
                      c.OI_EVALUATION_IDENTIFIER, c.OI_EVALUATION_METADATA)


def read_evaluations(attributes: Mapping[str, object]) -> list[dict[str, object]]:
    """The flattened evaluations of a span's attributes back as objects, by index; one without a
    name or a result (score, label or explanation) is left out, as the spec asks."""
    found: dict[int, dict[str, object]] = {}
    prefix = c.OI_EVALUATIONS + "."
    middle = "." + c.OI_EVALUATION + "."
    for key, value in attributes.items():
        if not key.startswith(prefix):
            continue
        index, sep, field = key[len(prefix):].partition(middle)
        if sep and index.isdigit() and field in _EVALUATION_FIELDS:
            found.setdefault(int(index), {})[field] = value
    return [e for _, e in sorted(found.items())
            if isinstance(e.get(c.OI_EVALUATION_NAME), str) and any(
                e.get(f) is not None for f in (c.OI_EVALUATION_SCORE, c.OI_EVALUATION_LABEL,
                                               c.OI_EVALUATION_EXPLANATION))]


def session_id(attrs: Mapping[str, object]) -> str | None:
    """The episode's ``session.id``: ``<run id>/<split>/<step>/<group id>``, one GRPO group of one
    step of one run (Phoenix's session ids are global: a bare group id that repeats every step,
    or in another run, would put all of them in one session). None without a group."""
    group = attrs.get(c.RL_GROUP_ID)
    if group is None:
        return None
    parts = (attrs.get(c.RL_RUN_ID), attrs.get(c.RL_SPLIT), attrs.get(c.RL_STEP), group)
    return "/".join("" if part is None else text(part) for part in parts)
