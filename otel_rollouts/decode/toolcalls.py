"""Tool calls found in decoded assistant text, in the two formats policies are trained on.

* Hermes / Qwen: ``<tool_call>{"name": ..., "arguments": {...}}</tool_call>`` blocks inside the
  text (several per message allowed);
* OpenAI-style JSON: the whole message is a JSON object (or list) shaped like a tool call:
  ``{"name", "arguments"|"parameters"}``, ``{"function": {...}}`` or ``{"tool_calls": [...]}``.

A call that cannot be parsed is never an exception: its text stays in the content and a reason is
returned, which the caller records under ``rl.tool.parse_error``.
"""

from __future__ import annotations

import json
import re
from dataclasses import dataclass, field
from typing import Any

__all__ = ["HERMES_OPEN", "ParsedMessage", "parse_tool_calls", "strip_tool_responses", "tool_responses"]

_HERMES = re.compile(r"<tool_call>(.*?)</tool_call>", re.DOTALL)
_HERMES_OPEN = "<tool_call>"
HERMES_OPEN = _HERMES_OPEN  # the tag that opens a Hermes/Qwen tool call
_RESPONSE = re.compile(r"<tool_response>(.*?)</tool_response>", re.DOTALL)
_FENCE = re.compile(r"^```(?:json)?\s*(.*?)\s*```$", re.DOTALL)


@dataclass
class ParsedMessage:
    """An assistant message: text content, OpenAI-style ``tool_calls``, and parse problems."""

    content: str
    tool_calls: list[dict[str, Any]] = field(default_factory=list)
    errors: list[str] = field(default_factory=list)


def _call(obj: object, call_id: str) -> dict[str, object] | None:
    """One OpenAI-style tool call from a parsed JSON object, or None when it is not one."""
    if not isinstance(obj, dict):
        return None
    function = obj.get("function")
    if isinstance(function, dict):
        call_id = str(obj.get("id") or call_id)
        obj = function
    name = obj.get("name")
    if not isinstance(name, str) or not name:
        return None
    if "arguments" in obj:
        args = obj["arguments"]
    elif "parameters" in obj:
        args = obj["parameters"]
    else:
        args = {}
    if not isinstance(args, str):
        args = json.dumps(args, ensure_ascii=False)
    return {"id": str(obj.get("id") or call_id), "type": "function", "function": {"name": name, "arguments": args}}


def _hermes(text: str, prefix: str) -> ParsedMessage:
    calls: list[dict[str, object]] = []
    errors: list[str] = []
    kept: list[str] = []
    last = 0
    for match in _HERMES.finditer(text):
        body = match.group(1).strip()
        problem = None
        try:
            call = _call(json.loads(body), f"{prefix}{len(calls)}")
            if call is None:
                problem = "tool call without a name"
        except ValueError as exc:
            call, problem = None, f"invalid JSON in <tool_call>: {exc}"
        kept.append(text[last : match.start()])
        if call is None:
            errors.append(problem or "unparseable tool call")
            kept.append(match.group(0))  # unparseable: stays as text
        else:
            calls.append(call)
        last = match.end()
    rest = text[last:]
    if _HERMES_OPEN in rest:
        errors.append("unclosed <tool_call>")
    kept.append(rest)
    content = "".join(kept)
    return ParsedMessage(content.strip() if calls else content, calls, errors)


def _openai_json(text: str, prefix: str) -> ParsedMessage | None:
    body = text.strip()
    fenced = _FENCE.match(body)
    if fenced:
        body = fenced.group(1)
    if not body or body[0] not in "{[":
        return None
    looks_like_call = '"name"' in body or '"tool_calls"' in body or '"function"' in body
    try:
        obj = json.loads(body)
    except ValueError as exc:
        if looks_like_call:
            return ParsedMessage(text, [], [f"invalid JSON tool call: {exc}"])
        return None
    content = ""
    if isinstance(obj, dict) and isinstance(obj.get("tool_calls"), list):
        items = obj["tool_calls"]
        content = obj["content"] if isinstance(obj.get("content"), str) else ""
    elif isinstance(obj, list):
        items = obj
    else:
        items = [obj]
    calls = [_call(item, f"{prefix}{i}") for i, item in enumerate(items)]
    if not calls or any(call is None for call in calls):
        if looks_like_call and calls and any(call is not None for call in calls):
            return ParsedMessage(text, [], ["JSON tool call list with entries that are not tool calls"])
        return None  # plain JSON output, not a tool call
    return ParsedMessage(content, [call for call in calls if call is not None], [])


def parse_tool_calls(text: str, call_id_prefix: str = "call_") -> ParsedMessage:
    """Split assistant ``text`` into content and tool calls (ids default to prefix + index)."""
    if _HERMES_OPEN in text:
        return _hermes(text, call_id_prefix)
    parsed = _openai_json(text, call_id_prefix)
    return parsed if parsed is not None else ParsedMessage(text)


def tool_responses(text: str) -> list[str]:
    """The ``<tool_response>`` blocks of a feedback text (Hermes/Qwen templates), stripped."""
    return [m.group(1).strip() for m in _RESPONSE.finditer(text)]


def strip_tool_responses(text: str) -> str:
    """``text`` without its ``<tool_response>`` blocks (what else the environment said)."""
    return _RESPONSE.sub("", text).strip()
