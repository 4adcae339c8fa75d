"""What viewers read: an episode's records seen through the GenAI and OpenInference conventions.

Computed at materialisation, for kept episodes only, on the export thread: the training thread
records OpenAI-style messages, tool arguments and results, numbers; this module derives, per span,

* the GenAI semantic conventions' message JSON in the *parts* shape (``gen_ai.input.messages``,
  ``gen_ai.output.messages`` with ``finish_reason``, ``gen_ai.system_instructions``), tool-call
  request and response parts, the spec's finish-reason values, ``error.type``,
  ``gen_ai.agent.name`` on the root and ``gen_ai.evaluation.result`` events for every score;
* OpenInference's ``input.value`` / ``output.value`` (+ mime types) on every span kind, flattened
  ``llm.input_messages.N.message.*`` / ``llm.output_messages.N.message.*`` with tool calls,
  ``llm.model_name``, token counts, ``session.id`` (the GRPO group), ``metadata`` and ``tag.tags``,
  so that Phoenix and Arize show each episode's question and answer and render LLM spans as chat.

A generation recorded without its input messages gets the conversation up to it (the prompt,
earlier turns, tool results and feedback), rebuilt here from the episode's own spans: nothing is
copied on the training thread. Each such generation gets a window onto one conversation (``SoFar``),
read at render only as far as the limits show it, so a long episode renders in linear time. Everything here is derived from captured content, so with
``capture_content=False`` no content attribute appears (only numbers, statuses, names).
"""

from __future__ import annotations

import copy
import json
import math
from collections.abc import Callable, Iterable, Iterator, Mapping, Sequence
from typing import Any

from otel_rollouts import conventions as c
from otel_rollouts._core.content import cut, jsonable, removed_chars, text, text_cut_marker, to_json

Message = dict[str, Any]


# --- OpenAI-style messages <-> the GenAI parts shape ------------------------------------------
def _arguments(value: Any) -> Any:
    """Tool-call arguments as an object when they are JSON text (the parts shape holds objects)."""
    if isinstance(value, str):
        try:
            return json.loads(value)
        except ValueError:
            return value
    return value


def arguments_text(value: Any) -> str:
    """Tool-call arguments as OpenAI's JSON text (``json.dumps``' default spacing, as the
    Python frameworks write them)."""
    if isinstance(value, str):
        return value
    return json.dumps(jsonable(value if value is not None else {}), ensure_ascii=False)


def _content_text(content: Any) -> str | None:
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


def attach_tool_call(calls: list[Any], call_id: str, name: Any, arguments: Any) -> None:
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


def tool_calls_of(message: Mapping[str, Any]) -> list[dict[str, Any]]:
    """A message's tool calls as ``{"id", "name", "arguments"}`` (OpenAI's nesting undone)."""
    out = []
    for call in message.get("tool_calls") or ():
        if not isinstance(call, Mapping):
            continue
        nested = call.get("function")
        function: Mapping[str, Any] = nested if isinstance(nested, Mapping) else {}
        name = function.get("name", call.get("name"))
        arguments = function.get("arguments", call.get("arguments"))
        out.append({"id": call.get("id"), "name": None if name is None else text(name), "arguments": arguments})
    return out


def to_parts(message: Any) -> Message:
    """One OpenAI-style message in the GenAI parts shape (a message already in it stays)."""
    if not isinstance(message, Mapping):
        return {"role": "user", "parts": [{"type": c.PART_TEXT, "content": as_text(message)}]}
    if isinstance(message.get("parts"), list):
        return dict(message)
    role = text(message.get("role") or "user")
    content = message.get("content")
    parts: list[dict[str, Any]] = []
    if role == "tool":
        parts.append({"type": c.PART_TOOL_CALL_RESPONSE, "id": message.get("tool_call_id"),
                      "response": content})
    else:
        if isinstance(content, list):
            for item in content:
                if isinstance(item, Mapping) and item.get("type") not in (None, "text"):
                    parts.append(dict(item))  # an image, audio...: the spec's generic part
                else:
                    part_text = _content_text([item])
                    if part_text:
                        parts.append({"type": c.PART_TEXT, "content": part_text})
        elif content is not None and content != "":
            parts.append({"type": c.PART_TEXT, "content": as_text(content)})
        for call in tool_calls_of(message):
            parts.append({"type": c.PART_TOOL_CALL, "id": call["id"], "name": call["name"],
                          "arguments": _arguments(call["arguments"])})
    out: Message = {"role": role, "parts": parts}
    if message.get("name"):
        out["name"] = text(message["name"])
    return out


def to_openai(message: Any) -> Message:
    """One message in the parts shape back in OpenAI's shape (what Trackio shows)."""
    if not isinstance(message, Mapping) or not isinstance(message.get("parts"), list):
        return dict(message) if isinstance(message, Mapping) else {"role": "user", "content": as_text(message)}
    role = message.get("role") or "user"
    texts: list[str] = []
    calls: list[dict[str, Any]] = []
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


def finish_reason(value: Any) -> str | None:
    """The GenAI spec's finish reason for what a framework wrote (unknown values stay)."""
    if value is None:
        return None
    reason = text(value)
    return c.FINISH_REASON_OF.get(reason.lower(), reason)


def _messages(value: Any) -> list[Message]:
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


def _text_of(message: Mapping[str, Any] | None) -> str | None:
    """What a person reads of a message: its text, else its tool calls."""
    if message is None:
        return None
    if isinstance(message.get("parts"), list):
        message = to_openai(message)
    body = _content_text(message.get("content"))
    if body:
        return body
    calls = tool_calls_of(message)
    if calls:
        return "\n".join(f"{call['name']}({as_text(_arguments(call['arguments']) or {})})" for call in calls)
    return body


def _last(messages: Sequence[Message], role: str) -> Message | None:
    for message in reversed(messages):
        if message.get("role") == role:
            return message
    return None


def _flatten(prefix: str, messages: Iterable[Message]) -> dict[str, Any]:
    """OpenInference's flattened ``<prefix>.N.message.*`` attributes of OpenAI-style messages."""
    out: dict[str, Any] = {}
    for i, message in enumerate(messages):
        _flatten_one(out, prefix, i, message)
    return out


def _flatten_one(out: dict[str, Any], prefix: str, i: int, message: Message) -> None:
    """The flattened attributes of message ``i`` (see ``_flatten``), added to ``out``."""
    if isinstance(message.get("parts"), list):
        message = to_openai(message)
    out[c.oi_message_key(prefix, i, c.OI_MESSAGE_ROLE)] = text(message.get("role") or "user")
    body = _content_text(message.get("content"))
    if body:
        out[c.oi_message_key(prefix, i, c.OI_MESSAGE_CONTENT)] = body
    if message.get("name"):
        out[c.oi_message_key(prefix, i, c.OI_MESSAGE_NAME)] = text(message["name"])
    if message.get("tool_call_id"):
        out[c.oi_message_key(prefix, i, c.OI_MESSAGE_TOOL_CALL_ID)] = text(message["tool_call_id"])
    for j, call in enumerate(tool_calls_of(message)):
        if call["id"] is not None:
            out[c.oi_tool_call_key(prefix, i, j, c.OI_TOOL_CALL_ID)] = text(call["id"])
        if call["name"] is not None:
            out[c.oi_tool_call_key(prefix, i, j, c.OI_TOOL_CALL_FUNCTION_NAME)] = call["name"]
        out[c.oi_tool_call_key(prefix, i, j, c.OI_TOOL_CALL_FUNCTION_ARGUMENTS)] = arguments_text(call["arguments"])


# --- the conversation so far, read only as far as the limits show it ---------------------------
def _piece(message: Message) -> tuple[str, int] | None:
    """A message's JSON text in the parts shape, as ``json.dumps`` writes it inside the list the
    view is (compact, non-ASCII kept), and the extra characters its cut markers stand for
    (``content.removed_chars``); None when it is no plain JSON (the whole list then takes the
    guarded conversion, as before)."""
    try:
        piece = json.dumps(to_parts(message), ensure_ascii=False, separators=(",", ":"), allow_nan=False)
    except (TypeError, ValueError, RecursionError):
        return None
    return piece, removed_chars(piece, 0, len(piece)) - len(piece)


class _Conversation:
    """The conversation so far of one walk, and windows onto it (``SoFar``).

    Each message is encoded once, when it joins (and again when a tool call joins the last
    assistant message); the running totals give each window its length without a copy. A window
    shows the conversation as it was when the generation was walked: before the last assistant
    message changes, the windows that include it keep a copy of it as it is (``pinned``).
    """

    __slots__ = ("messages", "pieces", "total", "extra", "broken", "assistant", "stale", "open")

    def __init__(self, messages: list[Message]) -> None:
        self.messages = messages
        self.pieces: list[tuple[str, int] | None] = []
        self.total = 0  # characters of the pieces so far (brackets and commas not counted)
        self.extra = 0  # what their cut markers stand for beyond their own length
        self.broken: set[int] = set()  # messages that are no plain JSON
        self.assistant: int | None = None  # the index of the message tool calls join
        self.stale = False  # that message changed since it was encoded
        self.open: list[SoFar] = []  # windows showing that message as it is now

    def _set(self, i: int, piece: tuple[str, int] | None) -> None:
        old = self.pieces[i] if i < len(self.pieces) else None
        if old is not None:
            self.total -= len(old[0])
            self.extra -= old[1]
        if i < len(self.pieces):
            self.pieces[i] = piece
        else:
            self.pieces.append(piece)
        self.broken.discard(i)
        if piece is None:
            self.broken.add(i)
        else:
            self.total += len(piece[0])
            self.extra += piece[1]

    def last_assistant(self, i: int) -> None:
        """Message ``i`` is now the one later tool calls join; the one before changes no more."""
        self.assistant, self.open = i, []

    def changing(self) -> None:
        """The last assistant message is about to change: windows showing it keep it as it is."""
        i = self.assistant
        if i is None:
            return
        if self.open and i < len(self.pieces):
            frozen = copy.deepcopy(self.messages[i])
            piece = self.pieces[i]
            for window in self.open:
                window.pinned[i] = (frozen, piece)
        self.open = []
        self.stale = True

    def window(self) -> SoFar:
        """A window onto the conversation as it is now (every message so far)."""
        messages = self.messages
        if self.stale and self.assistant is not None and self.assistant < len(self.pieces):
            self._set(self.assistant, _piece(messages[self.assistant]))
        self.stale = False
        for i in range(len(self.pieces), len(messages)):
            self._set(i, _piece(messages[i]))
        n = len(messages)
        window = SoFar(self, n, self.total, self.extra, bool(self.broken) and min(self.broken) < n)
        if self.assistant is not None and self.assistant < n:
            self.open.append(window)
        return window


class SoFar:
    """The conversation up to a generation recorded without its input messages: the view
    ``gen_ai.input.messages`` (a JSON list in the parts shape) and the flattened
    ``llm.input_messages.N.*``, computed at render, and only as far as they are shown.

    ``text(limit)`` is ``content.cut`` of the whole list's JSON text, built from the messages
    at its two ends that the cut keeps (the lengths and markers of the others are known), so a
    generation costs what its limit shows, not what the conversation weighs: rebuilding the
    whole conversation for every generation made long episodes render in quadratic time.
    """

    __slots__ = ("conversation", "n", "total", "extra", "broken", "pinned")

    def __init__(self, conversation: _Conversation, n: int, total: int, extra: int, broken: bool) -> None:
        self.conversation = conversation
        self.n = n
        self.total = total
        self.extra = extra
        self.broken = broken
        self.pinned: dict[int, tuple[Message, tuple[str, int] | None]] = {}

    def message(self, i: int) -> Message:
        pinned = self.pinned.get(i)
        return pinned[0] if pinned is not None else self.conversation.messages[i]

    def parts(self) -> list[Message]:
        """The whole view as the parts-shape messages (what the JSON text encodes)."""
        return [to_parts(self.message(i)) for i in range(self.n)]

    def _piece(self, i: int) -> tuple[str, int]:
        pinned = self.pinned.get(i)
        piece = pinned[1] if pinned is not None else self.conversation.pieces[i]
        assert piece is not None  # a window with a message that is no plain JSON is broken
        return piece

    def whole(self, encode: Callable[[Any], str]) -> str:
        """The view's whole JSON text (``encode``: the renderer's JSON for a list)."""
        if self.broken:
            return encode(self.parts())
        return "[" + ",".join(self._piece(i)[0] for i in range(self.n)) + "]"

    def text(self, limit: int, encode: Callable[[Any], str]) -> tuple[str, bool]:
        """``content.cut(self.whole(encode), limit)``, reading only the messages it keeps."""
        n = self.n
        length = 2 + self.total + n - 1
        if self.broken or limit <= 0 or length <= limit:
            return cut(self.whole(encode), limit)
        keep = max(limit - 40, 2)
        start = keep // 2  # the head kept: text[:start]
        end = length - (keep - start)  # the tail kept: text[end:]
        head: list[str] = []
        extra = 0  # the markers of the messages read, in the part cut out
        skip = 0  # what the markers of the messages read stand for in all (the totals count it)
        offset, i = 1, 0
        while i < n and offset < start:  # messages that begin in the head
            piece, its_extra = self._piece(i)
            head.append(piece)
            skip += its_extra
            if offset + len(piece) > start:
                local = start - offset
                extra += removed_chars(piece, local, min(len(piece), end - offset)) - (min(len(piece), end - offset) - local)
            offset += len(piece) + 1
            i += 1
        tail: list[str] = []
        stop = length - 1  # where the message read next ends (before "]" or ",")
        j = n - 1
        while j >= i and stop > end:  # messages that end in the tail
            piece, its_extra = self._piece(j)
            tail.append(piece)
            skip += its_extra
            begin = stop - len(piece)
            if begin < end:
                local = max(start - begin, 0)
                extra += removed_chars(piece, local, end - begin) - (end - begin - local)
            stop = begin - 1
            j -= 1
        if j < i and (stop > end or offset < start) or (i > j + 1):
            return cut(self.whole(encode), limit)  # the ends meet: short enough to build whole
        head_text = "[" + "".join(p + "," for p in head)
        tail_text = "".join("," + p for p in reversed(tail)) + "]"
        removed = (end - start) + (self.extra - skip) + extra
        return f"{head_text[:start]}{text_cut_marker(removed)}{tail_text[len(tail_text) - (length - end):]}", True

    def flattened(self) -> Iterator[tuple[str, Any]]:
        """OpenInference's ``llm.input_messages.N.*`` of the view, message by message (the
        renderer stops reading once the episode's budget is spent)."""
        for i in range(self.n):
            out: dict[str, Any] = {}
            _flatten_one(out, c.OI_LLM_INPUT_MESSAGES, i, self.message(i))
            yield from out.items()


def _io(out: dict[str, Any], key: str, mime_key: str, value: Any) -> None:
    if value is None or value == "":
        return
    if isinstance(value, str):
        out[key], out[mime_key] = value, c.MIME_TEXT
    else:
        out[key], out[mime_key] = as_text(value), c.MIME_JSON


# --- per-span views of one episode ------------------------------------------------------------
class SpanView:
    """What one span gets at materialisation, in two priorities.

    ``main``: the recorded content in the conventions' shape (messages in the parts shape,
    finish reasons, small labels): rendered first, under the episode's text budget like any
    recorded content. ``derived``: views of content recorded elsewhere (``input.value`` /
    ``output.value``, OpenInference's flattened messages, a generation's conversation so far):
    rendered after every span's own content, only with what is left of the budget, so that
    views never crowd out what was recorded. ``events``: ``(name, attributes)`` to add.
    """

    __slots__ = ("main", "derived", "events")

    def __init__(self) -> None:
        self.main: dict[str, Any] = {}
        self.derived: dict[str, Any] = {}
        self.events: list[tuple[str, dict[str, Any]]] = []


class EpisodeViews:
    """Walks an episode's spans in recording order, keeping the conversation so far."""

    def __init__(self, agent_name: str | None, capture_content: bool = True) -> None:
        self.agent_name = agent_name
        self.capture_content = capture_content  # off: no view is built from a failure's message

    def views(
        self, spans: Sequence[tuple[int, int | None, str, Mapping[str, Any], str | None]]
    ) -> dict[int, SpanView]:
        """``spans``: (span id, parent id, kind, recorded attributes, error message or None for
        a span that did not fail) in recording order."""
        out: dict[int, SpanView] = {}
        conversation: list[Message] = []
        turn_io: dict[int, tuple[Message | None, Message | None]] = {}
        last_assistant: Message | None = None
        prompt: list[Message] = []
        root_id: int | None = None
        reward_ids: list[int] = []
        so_far_of = _Conversation(conversation)
        for span_id, parent_id, kind, attrs, error in spans:
            view = out[span_id] = SpanView()
            main, derived = view.main, view.derived
            if kind == c.KIND_EPISODE:
                root_id = span_id
            elif kind == c.KIND_PROMPT:
                messages = _messages(attrs.get(c.GEN_AI_INPUT_MESSAGES))
                if messages:
                    prompt = messages
                    conversation.extend(dict(m) for m in messages)
                    main[c.GEN_AI_INPUT_MESSAGES] = [to_parts(m) for m in messages]
                    _io(derived, c.INPUT_VALUE, c.INPUT_MIME_TYPE, [to_openai(m) for m in messages])
                    _io(derived, c.OUTPUT_VALUE, c.OUTPUT_MIME_TYPE, _text_of(_last(messages, "user")))
                instructions = attrs.get(c.GEN_AI_SYSTEM_INSTRUCTIONS)
                if instructions is not None:
                    main[c.GEN_AI_SYSTEM_INSTRUCTIONS] = self._instructions(instructions)
            elif kind == c.KIND_GENERATION:
                recorded = attrs.get(c.GEN_AI_INPUT_MESSAGES)
                inputs = _messages(recorded) if recorded is not None else []
                # the conversation so far, not copied: a window onto its first n messages, read
                # at render only as far as the limits let it show (see SoFar)
                so_far = so_far_of.window() if recorded is None and conversation else None
                outputs = _messages(attrs.get(c.GEN_AI_OUTPUT_MESSAGES))
                reasons = attrs.get(c.GEN_AI_RESPONSE_FINISH_REASONS)
                reason = finish_reason(reasons[0]) if isinstance(reasons, (list, tuple)) and reasons else None
                if reason is not None:
                    main[c.GEN_AI_RESPONSE_FINISH_REASONS] = [reason]
                if inputs:
                    parts = [to_parts(m) for m in inputs]
                    main[c.GEN_AI_INPUT_MESSAGES] = parts
                    derived.update(_flatten(c.OI_LLM_INPUT_MESSAGES, inputs))
                    _io(derived, c.INPUT_VALUE, c.INPUT_MIME_TYPE, _text_of(inputs[-1]))
                elif so_far is not None:
                    inputs = [dict(conversation[-1])]  # the last one, as a copy of it read now
                    derived[c.GEN_AI_INPUT_MESSAGES] = so_far
                    derived[_LATER_FLAT_INPUT] = Expand(so_far.flattened)
                    _io(derived, c.INPUT_VALUE, c.INPUT_MIME_TYPE, _text_of(inputs[-1]))
                if outputs:
                    for message in outputs:
                        message.setdefault("role", "assistant")
                    conversation.extend(outputs)  # the same dicts: tool calls found later join them
                    last_assistant = outputs[-1]
                    so_far_of.last_assistant(len(conversation) - 1)
                    main[c.GEN_AI_OUTPUT_MESSAGES] = _Later(lambda o=outputs, r=reason: [
                        {**to_parts(m), "finish_reason": r or _implied_finish(m)} for m in o
                    ])
                    derived[_LATER_FLAT] = _Later(lambda o=outputs: _flatten(c.OI_LLM_OUTPUT_MESSAGES, o))
                    derived[c.OUTPUT_VALUE] = _Later(lambda m=last_assistant: _text_of(m) or None)
                    derived[c.OUTPUT_MIME_TYPE] = c.MIME_TEXT
                model = attrs.get(c.GEN_AI_REQUEST_MODEL)
                if model:
                    main[c.OI_LLM_MODEL_NAME] = model
                if attrs.get(c.GEN_AI_PROVIDER_NAME):
                    main[c.OI_LLM_PROVIDER] = attrs[c.GEN_AI_PROVIDER_NAME]
                prompt_tokens = _count(attrs.get(c.GEN_AI_USAGE_INPUT_TOKENS))
                completion_tokens = _count(attrs.get(c.GEN_AI_USAGE_OUTPUT_TOKENS))
                if prompt_tokens is not None:
                    main[c.OI_LLM_TOKEN_COUNT_PROMPT] = prompt_tokens
                if completion_tokens is not None:
                    main[c.OI_LLM_TOKEN_COUNT_COMPLETION] = completion_tokens
                if prompt_tokens is not None or completion_tokens is not None:
                    main[c.OI_LLM_TOKEN_COUNT_TOTAL] = (prompt_tokens or 0) + (completion_tokens or 0)
                if parent_id is not None and parent_id not in turn_io:
                    turn_io[parent_id] = (inputs[-1] if inputs else None, last_assistant if outputs else None)
            elif kind == c.KIND_TOOL:
                name = attrs.get(c.GEN_AI_TOOL_NAME)
                call_id = attrs.get(c.GEN_AI_TOOL_CALL_ID) or f"{span_id:016x}"
                arguments = attrs.get(c.GEN_AI_TOOL_CALL_ARGUMENTS)
                result = attrs.get(c.GEN_AI_TOOL_CALL_RESULT)
                if name:
                    main[c.OI_TOOL_NAME] = name
                _io(derived, c.INPUT_VALUE, c.INPUT_MIME_TYPE, _arguments(arguments))
                _io(derived, c.OUTPUT_VALUE, c.OUTPUT_MIME_TYPE, result)
                if last_assistant is not None and (arguments is not None or result is not None or name):
                    so_far_of.changing()  # windows that show it keep it as it is now
                    calls = last_assistant.setdefault("tool_calls", [])
                    if isinstance(calls, list):
                        attach_tool_call(calls, call_id, name, arguments if arguments is not None else {})
                if not self.capture_content:
                    error = None
                if result is not None or error is not None:
                    # what the policy saw next: the result, or that the call failed
                    content = as_text(result) if result is not None else f"error: {error}"
                    conversation.append({"role": "tool", "tool_call_id": call_id, "name": name,
                                         "content": content})
            elif kind == c.KIND_REWARD:
                scores = _scores(attrs)
                for name, value in scores.items():
                    # the spec's event; its explanation names the score and its value, so that a
                    # viewer listing only an event's text reads which score this is
                    view.events.append((c.EVENT_GEN_AI_EVALUATION_RESULT, {
                        c.GEN_AI_EVALUATION_NAME: name,
                        c.GEN_AI_EVALUATION_SCORE_VALUE: float(value),
                        c.GEN_AI_EVALUATION_EXPLANATION: _score_text(name, float(value)),
                    }))
                if scores:
                    _io(main, c.OUTPUT_VALUE, c.OUTPUT_MIME_TYPE, scores)
                reward_ids.append(span_id)
            elif attrs.get(c.RL_FEEDBACK_ROLE) is not None:
                messages = _messages(attrs.get(c.GEN_AI_INPUT_MESSAGES))
                if messages:
                    conversation.extend(dict(m) for m in messages)
                    main[c.GEN_AI_INPUT_MESSAGES] = [to_parts(m) for m in messages]
                    _io(derived, c.INPUT_VALUE, c.INPUT_MIME_TYPE, _text_of(messages[-1]))
            else:
                for key in (c.GEN_AI_INPUT_MESSAGES, c.GEN_AI_OUTPUT_MESSAGES):
                    if attrs.get(key) is not None:
                        main[key] = [to_parts(m) for m in _messages(attrs[key])]
        question = _text_of(_last(prompt, "user")) if prompt else None
        answer = _text_of(_last(conversation, "assistant"))
        for turn_id, (asked, said) in turn_io.items():
            derived = out.setdefault(turn_id, SpanView()).derived
            _io(derived, c.INPUT_VALUE, c.INPUT_MIME_TYPE, _text_of(asked))
            derived[c.OUTPUT_VALUE] = _Later(lambda m=said: _text_of(m) or None)
            derived[c.OUTPUT_MIME_TYPE] = c.MIME_TEXT
        for reward_id in reward_ids:
            _io(out[reward_id].derived, c.INPUT_VALUE, c.INPUT_MIME_TYPE, answer)
        if root_id is not None:
            # the root's question and answer are what a trace list shows: rendered first
            main = out[root_id].main
            _io(main, c.INPUT_VALUE, c.INPUT_MIME_TYPE, question)
            _io(main, c.OUTPUT_VALUE, c.OUTPUT_MIME_TYPE, answer)
        return out

    def root(self, attrs: Mapping[str, Any]) -> dict[str, Any]:
        """The episode root's labels: agent name, session (one group of one step of one run),
        metadata (with each reward component), tags, and the episode's evaluations: reward,
        each component, advantage (scores) and status (a label), in OpenInference's flattened
        ``evaluations.<i>.evaluation.*`` form (what Phoenix's annotations are posted from)."""
        extra: dict[str, Any] = {}
        if self.agent_name and not attrs.get(c.GEN_AI_AGENT_NAME):
            extra[c.GEN_AI_AGENT_NAME] = self.agent_name
        session = session_id(attrs)
        if session is not None:
            extra[c.OI_SESSION_ID] = session
        metadata = {_metadata_name(key): attrs[key] for key in _metadata_keys(attrs)}
        if metadata:
            extra[c.OI_METADATA] = as_text(metadata)
        tags = [f"{key.removeprefix('rl.')}:{attrs[key]}" for key in _TAG_KEYS if attrs.get(key) is not None]
        if tags:
            extra[c.OI_TAG_TAGS] = tags
        extra.update(flat_evaluations(episode_evaluations(attrs)))
        return extra

    @staticmethod
    def _input_messages(messages: Sequence[Message]) -> dict[str, Any]:
        return {c.GEN_AI_INPUT_MESSAGES: [to_parts(m) for m in messages]}

    @staticmethod
    def _instructions(value: Any) -> list[Mapping[str, Any]]:
        if isinstance(value, str):
            return [{"type": c.PART_TEXT, "content": value}]
        if isinstance(value, (list, tuple)):
            return [part if isinstance(part, Mapping) and "type" in part
                    else {"type": c.PART_TEXT, "content": as_text(part)} for part in value]
        return [{"type": c.PART_TEXT, "content": as_text(value)}]


class _Later:
    """A view that can only be computed once the whole episode was walked (tool calls found
    after a generation join its output message)."""

    __slots__ = ("fn",)

    def __init__(self, fn) -> None:
        self.fn = fn


_LATER_FLAT = "\x00flat"  # a _Later that yields several attributes (never written as a key)
_LATER_FLAT_INPUT = "\x00flat-input"  # Expand: attributes read at render, while the budget lasts


class Expand:
    """Several attributes computed at render, read one by one, only while the episode's budget
    lasts (every one is text: once the budget is spent, none would be written)."""

    __slots__ = ("items",)

    def __init__(self, items: Callable[[], Iterator[tuple[str, Any]]]) -> None:
        self.items = items


def settle(extra: dict[str, Any]) -> dict[str, Any]:
    """Compute the deferred views of one span's extra attributes (after the walk)."""
    out: dict[str, Any] = {}
    for key, value in extra.items():
        if isinstance(value, _Later):
            value = value.fn()
            if key == _LATER_FLAT:
                out.update(value or {})
                continue
        if value is not None:
            out[key] = value
    for value_key, mime_key in ((c.INPUT_VALUE, c.INPUT_MIME_TYPE), (c.OUTPUT_VALUE, c.OUTPUT_MIME_TYPE)):
        if value_key not in out and value_key in extra:
            out.pop(mime_key, None)
    return out


def error_type(events: Iterable[tuple[str, Mapping[str, Any], int]]) -> str:
    """``error.type`` of a failed span: its exception's type, else the spec's ``_OTHER``."""
    for name, attributes, _ in events or ():
        if name == c.EVENT_EXCEPTION and attributes.get(c.EXCEPTION_TYPE):
            return text(attributes[c.EXCEPTION_TYPE])
    return c.ERROR_TYPE_OTHER


def _score_name(key: str) -> str:
    """The evaluation name of a score attribute: ``reward``, ``advantage``, a component's own
    name (``rl.reward.correct`` -> ``correct``), or ``reward.<name>`` for a component whose name
    is one of the others (a component named ``status`` must not pass for the status) or one
    Phoenix reserves (``note``: its annotation API refuses the whole request)."""
    if key == c.RL_REWARD:
        return c.EVALUATION_REWARD
    if key == c.RL_ADVANTAGE:
        return c.EVALUATION_ADVANTAGE
    name = key.removeprefix(c.RL_REWARD_PREFIX)
    return key.removeprefix(c.RL_PREFIX) if name in _RESERVED_NAMES or not name else name


_PHOENIX_NOTE = "note"  # Phoenix's span notes; POST /v1/span_annotations refuses the name (400)
_RESERVED_NAMES = frozenset({c.EVALUATION_REWARD, c.EVALUATION_ADVANTAGE, c.EVALUATION_STATUS, _PHOENIX_NOTE})


def _is_score(key: str, value: Any) -> bool:
    return ((key == c.RL_REWARD or key == c.RL_ADVANTAGE or key.startswith(c.RL_REWARD_PREFIX))
            and isinstance(value, (int, float)) and not isinstance(value, bool) and math.isfinite(value))


def _scores(attrs: Mapping[str, Any]) -> dict[str, int | float]:
    """An episode's scores by evaluation name: the reward, each component (in recording order),
    the advantage. Finite numbers only (JSON and Phoenix take no NaN)."""
    found = {key: value for key, value in attrs.items() if _is_score(key, value)}
    ordered = ([c.RL_REWARD] if c.RL_REWARD in found else []) + [
        key for key in found if key.startswith(c.RL_REWARD_PREFIX)
    ] + ([c.RL_ADVANTAGE] if c.RL_ADVANTAGE in found else [])
    return {_score_name(key): found[key] for key in ordered}


def _score_text(name: str, value: float) -> str:
    """``reward = 0.8``: a score named, with its value, for a person to read."""
    return f"{name} = {as_text(value)}"


def episode_evaluations(attrs: Mapping[str, Any]) -> list[dict[str, Any]]:
    """The evaluations of an episode from its root's attributes: one per score (``name``,
    ``score``) and the status as a label (``name`` ``status``, ``label`` ok / truncated /
    error / filtered), each judged by code."""
    out: list[dict[str, Any]] = [
        {c.OI_EVALUATION_NAME: name, c.OI_EVALUATION_SCORE: value,
         c.OI_EVALUATION_ANNOTATOR_KIND: c.OI_ANNOTATOR_CODE}
        for name, value in _scores(attrs).items()
    ]
    status = attrs.get(c.RL_STATUS)
    if isinstance(status, str) and status:
        out.append({c.OI_EVALUATION_NAME: c.EVALUATION_STATUS, c.OI_EVALUATION_LABEL: status,
                    c.OI_EVALUATION_ANNOTATOR_KIND: c.OI_ANNOTATOR_CODE})
    return out


def flat_evaluations(evaluations: Sequence[Mapping[str, Any]]) -> dict[str, Any]:
    """Evaluations as OpenInference's flattened span attributes (``evaluations.<i>.evaluation.
    <field>``, indices from 0, missing fields omitted)."""
    out: dict[str, Any] = {}
    for i, evaluation in enumerate(evaluations):
        for field, value in evaluation.items():
            if value is not None:
                out[c.oi_evaluation_key(i, field)] = value
    return out


_EVALUATION_FIELDS = (c.OI_EVALUATION_NAME, c.OI_EVALUATION_SCORE, c.OI_EVALUATION_LABEL,
                      c.OI_EVALUATION_EXPLANATION, c.OI_EVALUATION_ANNOTATOR_KIND,
                      c.OI_EVALUATION_IDENTIFIER, c.OI_EVALUATION_METADATA)


def read_evaluations(attributes: Mapping[str, Any]) -> list[dict[str, Any]]:
    """The flattened evaluations of a span's attributes back as objects, by index; one without a
    name or a result (score, label or explanation) is left out, as the spec asks."""
    found: dict[int, dict[str, Any]] = {}
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


def session_id(attrs: Mapping[str, Any]) -> str | None:
    """The episode's ``session.id``: ``<run id>/<split>/<step>/<group id>``, one GRPO group of one
    step of one run (Phoenix's session ids are global: a bare group id that repeats every step,
    or in another run, would put all of them in one session). None without a group."""
    group = attrs.get(c.RL_GROUP_ID)
    if group is None:
        return None
    parts = (attrs.get(c.RL_RUN_ID), attrs.get(c.RL_SPLIT), attrs.get(c.RL_STEP), group)
    return "/".join("" if part is None else text(part) for part in parts)


def _metadata_keys(attrs: Mapping[str, Any]) -> list[str]:
    """The root attributes its ``metadata`` JSON holds: the fixed ones, then each reward
    component (so that ``metadata['reward.correct'] < 0.5`` filters in Phoenix)."""
    keys = [key for key in _METADATA_KEYS if attrs.get(key) is not None]
    keys += [key for key, value in attrs.items() if key.startswith(c.RL_REWARD_PREFIX) and _is_score(key, value)]
    return keys


def _metadata_name(key: str) -> str:
    return key.removeprefix(c.RL_PREFIX)


def _implied_finish(message: Mapping[str, Any]) -> str:
    """An output message's finish reason when none was recorded: ``tool_call`` for a message
    that ends in tool calls (the spec's value for a model that stopped to call a tool), else
    ``stop``."""
    return c.FINISH_TOOL_CALL if tool_calls_of(message) else c.FINISH_STOP


def _count(value: Any) -> int | None:
    return value if isinstance(value, int) and not isinstance(value, bool) else None


_METADATA_KEYS = (c.RL_STEP, c.RL_SPLIT, c.RL_EPISODE_ID, c.RL_GROUP_ID, c.RL_SAMPLE_INDEX, c.RL_STATUS,
                  c.RL_REWARD, c.RL_ADVANTAGE, c.RL_FINISH_REASON, c.RL_POLICY_VERSION,
                  # what a researcher filters a step by in Phoenix: why kept, how slow, where the
                  # time went, how its group fared, which watched prompt
                  c.RL_SAMPLING_REASON, c.RL_DURATION_SECONDS, *(c.stage_seconds(s) for s in c.STAGES),
                  c.RL_GROUP_DEGENERATE, c.RL_GROUP_REWARD_SPREAD, c.RL_GROUP_LOST, c.RL_DATASET_INDEX,
                  c.RL_WATCH_KEY,
                  # how far the rollout policy was from the trained one
                  c.RL_MISMATCH_KL, c.RL_MISMATCH_ABS_MAX, c.RL_MISMATCH_RATIO_MIN, c.RL_MISMATCH_RATIO_MAX,
                  c.RL_MISMATCH_OUTSIDE)
_TAG_KEYS = (c.RL_STEP, c.RL_SPLIT, c.RL_STATUS, c.RL_SAMPLING_REASON)
