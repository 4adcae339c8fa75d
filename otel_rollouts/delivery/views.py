"""The per-span views of a kept episode: what viewers read, rendered on the delivery side.

Computed at materialisation (``delivery.materialize``), for kept episodes only, on the export
thread: the training thread records OpenAI-style messages, tool arguments and results, numbers;
this module derives, per span, the GenAI semantic conventions' message JSON in the *parts* shape
(``gen_ai.input.messages``, ``gen_ai.output.messages`` with ``finish_reason``,
``gen_ai.system_instructions``), ``gen_ai.evaluation.result`` events for every score, and
OpenInference's ``input.value`` / ``output.value``, flattened ``llm.*messages_of``, token counts,
``session.id``, ``metadata`` and ``tag.tags``, so that Phoenix, Arize and Trackio show each
episode's question and answer and render LLM spans as chat. The message shapes themselves
(``to_parts``, ``to_openai``, evaluations) are ``_core.messages``: the recording side and the
exporters use them too.

A generation recorded without its input messages gets the conversation up to it (the prompt,
earlier turns, tool results and feedback), rebuilt here from the episode's own spans: nothing is
copied on the training thread. Each such generation gets a window onto one conversation
(``SoFar``), read at render only as far as the limits show it, so a long episode renders in
linear time. With ``capture_content=False`` no content attribute appears.
"""

from __future__ import annotations

import copy
import json
from collections.abc import Callable, Iterable, Iterator, Mapping, Sequence
from functools import partial
from typing import Any

from otel_rollouts import conventions as c
from otel_rollouts._core.content import cut, removed_chars, text, text_cut_marker
from otel_rollouts._core.messages import (
    Message,
    arguments_of,
    arguments_text,
    as_text,
    attach_tool_call,
    content_text,
    episode_evaluations,
    finish_reason,
    flat_evaluations,
    is_score,
    last_of,
    messages_of,
    score_text,
    scores_of,
    session_id,
    text_of,
    to_openai,
    to_parts,
    tool_calls_of,
)

__all__ = ["EpisodeViews", "Expand", "SoFar", "SpanView", "error_type", "settle"]


def _flatten(prefix: str, messages: Iterable[Message]) -> dict[str, object]:
    """OpenInference's flattened ``<prefix>.N.message.*`` attributes of OpenAI-style messages."""
    out: dict[str, object] = {}
    for i, message in enumerate(messages):
        _flatten_one(out, prefix, i, message)
    return out


def _flatten_one(out: dict[str, object], prefix: str, i: int, message: Message) -> None:
    """The flattened attributes of message ``i`` (see ``_flatten``), added to ``out``."""
    if isinstance(message.get("parts"), list):
        message = to_openai(message)
    out[c.oi_message_key(prefix, i, c.OI_MESSAGE_ROLE)] = text(message.get("role") or "user")
    body = content_text(message.get("content"))
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

    def whole(self, encode: Callable[[object], str]) -> str:
        """The view's whole JSON text (``encode``: the renderer's JSON for a list)."""
        if self.broken:
            return encode(self.parts())
        return "[" + ",".join(self._piece(i)[0] for i in range(self.n)) + "]"

    def text(self, limit: int, encode: Callable[[object], str]) -> tuple[str, bool]:
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

    def flattened(self) -> Iterator[tuple[str, object]]:
        """OpenInference's ``llm.input_messages.N.*`` of the view, message by message (the
        renderer stops reading once the episode's budget is spent)."""
        for i in range(self.n):
            out: dict[str, object] = {}
            _flatten_one(out, c.OI_LLM_INPUT_MESSAGES, i, self.message(i))
            yield from out.items()


def _io(out: dict[str, object], key: str, mime_key: str, value: object) -> None:
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
        self.main: dict[str, object] = {}
        self.derived: dict[str, object] = {}
        self.events: list[tuple[str, dict[str, str | float]]] = []


class _Walk:
    """One walk over an episode's spans in recording order: the conversation so far (prompt,
    generations, tool results, feedback), each turn's first input and output, and the spans
    whose views can only be completed at the end (turns, rewards, the root)."""

    def __init__(self, capture_content: bool) -> None:
        self.capture_content = capture_content
        self.out: dict[int, SpanView] = {}
        self.conversation: list[Message] = []
        self.so_far_of = _Conversation(self.conversation)
        self.turn_io: dict[int, tuple[Message | None, Message | None]] = {}
        self.last_assistant: Message | None = None
        self.prompt_messages: list[Message] = []
        self.root_id: int | None = None
        self.root_attrs: Mapping[str, object] = {}
        self.reward_ids: list[int] = []
        # each reward span's attributes: its evaluation events go on it only when the root does
        # not carry the scores (a reward recorded after its episode was rendered comes alone)
        self.reward_attrs: dict[int, Mapping[str, object]] = {}

    def prompt(self, view: SpanView, attrs: Mapping[str, object]) -> None:
        main, derived = view.main, view.derived
        messages = messages_of(attrs.get(c.GEN_AI_INPUT_MESSAGES))
        if messages:
            self.prompt_messages = messages
            self.conversation.extend(dict(m) for m in messages)
            main[c.GEN_AI_INPUT_MESSAGES] = [to_parts(m) for m in messages]
            _io(derived, c.INPUT_VALUE, c.INPUT_MIME_TYPE, [to_openai(m) for m in messages])
            _io(derived, c.OUTPUT_VALUE, c.OUTPUT_MIME_TYPE, text_of(last_of(messages, "user")))
        instructions = attrs.get(c.GEN_AI_SYSTEM_INSTRUCTIONS)
        if instructions is not None:
            main[c.GEN_AI_SYSTEM_INSTRUCTIONS] = _instructions(instructions)

    def generation(self, view: SpanView, parent_id: int | None, attrs: Mapping[str, object]) -> None:
        main, derived = view.main, view.derived
        conversation = self.conversation
        recorded = attrs.get(c.GEN_AI_INPUT_MESSAGES)
        inputs = messages_of(recorded) if recorded is not None else []
        # the conversation so far, not copied: a window onto its first n messages, read at
        # render only as far as the limits let it show (see SoFar)
        so_far = self.so_far_of.window() if recorded is None and conversation else None
        outputs = messages_of(attrs.get(c.GEN_AI_OUTPUT_MESSAGES))
        reasons = attrs.get(c.GEN_AI_RESPONSE_FINISH_REASONS)
        reason = finish_reason(reasons[0]) if isinstance(reasons, (list, tuple)) and reasons else None
        if reason is not None:
            main[c.GEN_AI_RESPONSE_FINISH_REASONS] = [reason]
        if inputs:
            main[c.GEN_AI_INPUT_MESSAGES] = [to_parts(m) for m in inputs]
            derived.update(_flatten(c.OI_LLM_INPUT_MESSAGES, inputs))
            _io(derived, c.INPUT_VALUE, c.INPUT_MIME_TYPE, text_of(inputs[-1]))
        elif so_far is not None:
            inputs = [dict(conversation[-1])]  # the last one, as a copy of it read now
            derived[c.GEN_AI_INPUT_MESSAGES] = so_far
            derived[_LATER_FLAT_INPUT] = Expand(so_far.flattened)
            _io(derived, c.INPUT_VALUE, c.INPUT_MIME_TYPE, text_of(inputs[-1]))
        if outputs:
            self._outputs(main, derived, outputs)
            if reason is None:  # the spec's finish reasons on the span (not in the messages)
                main[c.GEN_AI_RESPONSE_FINISH_REASONS] = _Later(lambda: [_implied_finish(m) for m in outputs])
        _usage(main, attrs)
        mismatch = _mismatch_metadata(attrs)
        if mismatch:
            derived[c.OI_METADATA] = as_text(mismatch)
        if parent_id is not None and parent_id not in self.turn_io:
            self.turn_io[parent_id] = (inputs[-1] if inputs else None,
                                       self.last_assistant if outputs else None)

    def _outputs(self, main: dict[str, object], derived: dict[str, object], outputs: list[Message]) -> None:
        for message in outputs:
            message.setdefault("role", "assistant")
        self.conversation.extend(outputs)  # the same dicts: tool calls found later join them
        last = self.last_assistant = outputs[-1]
        self.so_far_of.last_assistant(len(self.conversation) - 1)
        # (closures over this call's own locals: computed after the walk, when tool calls found
        # later joined the messages). No finish_reason inside the messages: the GenAI conventions
        # deprecated it for gen_ai.response.finish_reasons (semantic-conventions-genai #363)
        main[c.GEN_AI_OUTPUT_MESSAGES] = _Later(lambda: [to_parts(m) for m in outputs])
        derived[_LATER_FLAT] = _Later(lambda: _flatten(c.OI_LLM_OUTPUT_MESSAGES, outputs))
        derived[c.OUTPUT_VALUE] = _Later(partial(_text_or_none, last))
        derived[c.OUTPUT_MIME_TYPE] = c.MIME_TEXT

    def tool(self, span_id: int, view: SpanView, attrs: Mapping[str, object], error: str | None) -> None:
        name = attrs.get(c.GEN_AI_TOOL_NAME)
        call_id = attrs.get(c.GEN_AI_TOOL_CALL_ID) or f"{span_id:016x}"
        arguments = attrs.get(c.GEN_AI_TOOL_CALL_ARGUMENTS)
        result = attrs.get(c.GEN_AI_TOOL_CALL_RESULT)
        if name:
            view.main[c.OI_TOOL_NAME] = name
        _io(view.derived, c.INPUT_VALUE, c.INPUT_MIME_TYPE, arguments_of(arguments))
        _io(view.derived, c.OUTPUT_VALUE, c.OUTPUT_MIME_TYPE, result)
        last = self.last_assistant
        if last is not None and (arguments is not None or result is not None or name):
            self.so_far_of.changing()  # windows that show it keep it as it is now
            calls = last.setdefault("tool_calls", [])
            if isinstance(calls, list):
                attach_tool_call(calls, call_id, name, arguments if arguments is not None else {})
        if not self.capture_content:
            error = None  # no view is built from a failure's message
        if result is not None or error is not None:
            # what the policy saw next: the result, or that the call failed
            content = as_text(result) if result is not None else f"error: {error}"
            self.conversation.append({"role": "tool", "tool_call_id": call_id, "name": name,
                                      "content": content})

    def reward(self, span_id: int, view: SpanView, attrs: Mapping[str, object]) -> None:
        found = scores_of(attrs)
        if found:
            _io(view.main, c.OUTPUT_VALUE, c.OUTPUT_MIME_TYPE, found)
            self.reward_attrs[span_id] = attrs
        self.reward_ids.append(span_id)

    def feedback(self, view: SpanView, attrs: Mapping[str, object]) -> None:
        messages = messages_of(attrs.get(c.GEN_AI_INPUT_MESSAGES))
        if messages:
            self.conversation.extend(dict(m) for m in messages)
            view.main[c.GEN_AI_INPUT_MESSAGES] = [to_parts(m) for m in messages]
            _io(view.derived, c.INPUT_VALUE, c.INPUT_MIME_TYPE, text_of(messages[-1]))

    def finish(self) -> dict[int, SpanView]:
        """The views completed once every span was walked: each turn's first input and output,
        each reward's answer, the root's question and answer."""
        out = self.out
        question = text_of(last_of(self.prompt_messages, "user")) if self.prompt_messages else None
        answer = text_of(last_of(self.conversation, "assistant"))
        for turn_id, (asked, said) in self.turn_io.items():
            derived = out.setdefault(turn_id, SpanView()).derived
            _io(derived, c.INPUT_VALUE, c.INPUT_MIME_TYPE, text_of(asked))
            derived[c.OUTPUT_VALUE] = _Later(partial(_text_or_none, said))
            derived[c.OUTPUT_MIME_TYPE] = c.MIME_TEXT
        for reward_id in self.reward_ids:
            _io(out[reward_id].derived, c.INPUT_VALUE, c.INPUT_MIME_TYPE, answer)
        # the evaluation events on the span evaluated, the episode's root (the GenAI spec: "SHOULD
        # be parented to the GenAI operation span being evaluated"), from the scores it carries;
        # on the reward span only when the root is not rendered with it or carries none
        on_root: list[tuple[str, dict[str, str | float]]] = []
        if self.root_id is not None:
            on_root = evaluation_events(episode_evaluations(self.root_attrs))
            out[self.root_id].events.extend(on_root)
        if not any(c.GEN_AI_EVALUATION_SCORE_VALUE in attrs for _, attrs in on_root):
            for reward_id, attrs in self.reward_attrs.items():
                out[reward_id].events.extend(evaluation_events(episode_evaluations(attrs)))
        if self.root_id is not None:
            # the root's question and answer are what a trace list shows: rendered first
            main = out[self.root_id].main
            _io(main, c.INPUT_VALUE, c.INPUT_MIME_TYPE, question)
            _io(main, c.OUTPUT_VALUE, c.OUTPUT_MIME_TYPE, answer)
        return out


def _text_or_none(message: Message | None) -> str | None:
    return text_of(message) or None


def evaluation_events(evaluations: Sequence[Mapping[str, object]]) -> list[tuple[str, dict[str, str | float]]]:
    """``gen_ai.evaluation.result`` events of ``evaluations`` (``episode_evaluations``' shape):
    a score's value, a label's label, and an explanation naming the score and its value (a
    viewer listing only an event's text still reads which score it is)."""
    out: list[tuple[str, dict[str, str | float]]] = []
    for evaluation in evaluations:
        name = str(evaluation.get(c.OI_EVALUATION_NAME))
        attrs: dict[str, str | float] = {c.GEN_AI_EVALUATION_NAME: name}
        score, label = evaluation.get(c.OI_EVALUATION_SCORE), evaluation.get(c.OI_EVALUATION_LABEL)
        if isinstance(score, (int, float)):
            attrs[c.GEN_AI_EVALUATION_SCORE_VALUE] = float(score)
            attrs[c.GEN_AI_EVALUATION_EXPLANATION] = score_text(name, float(score))
        if isinstance(label, str):
            attrs[c.GEN_AI_EVALUATION_SCORE_LABEL] = label
            attrs[c.GEN_AI_EVALUATION_EXPLANATION] = f"{name} = {label}"
        out.append((c.EVENT_GEN_AI_EVALUATION_RESULT, attrs))
    return out


def _usage(main: dict[str, object], attrs: Mapping[str, object]) -> None:
    """A generation's model, provider and token counts in OpenInference's names."""
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


_WORST_COLUMNS = (c.RL_MISMATCH_WORST_TOKEN, c.RL_MISMATCH_WORST_POSITION, c.RL_MISMATCH_WORST_ROLLOUT,
                  c.RL_MISMATCH_WORST_TRAINER)
_TOKEN_WIDTH = 24  # characters of a token's text shown (quoted, cut with an ellipsis)
# the table's key in a generation's metadata: mismatch.worst (rl.mismatch.worst.*, as the root's metadata names)
_WORST = c.RL_MISMATCH_WORST_TOKEN.rpartition(".")[0].removeprefix(c.RL_PREFIX)


def _mismatch_metadata(attrs: Mapping[str, object]) -> dict[str, object] | None:
    """A generation's worst tokens (``worst_tokens_table``) as OpenInference ``metadata``:
    Phoenix shows a span's metadata on its Info tab, under the messages, as indented JSON in a
    monospaced font, where the table reads at a glance; the four ``rl.mismatch.worst.*`` arrays
    are rows apart among sixty attributes. The table only: the root's metadata holds the
    episode's statistics under their own names (``metadata['mismatch.kl'] > 0.1`` finds
    episodes, not their generations). None without a table."""
    table = worst_tokens_table(attrs)
    return {_WORST: table} if table else None


def worst_tokens_table(attrs: Mapping[str, object]) -> list[str] | None:
    """A generation's worst tokens (the ``rl.mismatch.worst.*`` parallel arrays) as a small
    table, one line per token, worst first, each line saying what its numbers are:
    ``' Lima' at 3: Δ -3.498 (rollout -0.401, trainer -3.899)`` (the token quoted so that its
    spaces show, its position, Δ = trainer − rollout logprob, both logprobs).

    Lines that read alone, not aligned columns under a header: Phoenix shows a list in an
    attribute table one row per element in a proportional font (runs of spaces collapse), and
    a text's line breaks as ``\\n`` in JSON. None when the arrays are absent, of unequal
    lengths, or hold something else than what ``_core.logprobs`` writes."""
    columns: list[Sequence[object]] = []
    for key in _WORST_COLUMNS:
        column = attrs.get(key)
        if not isinstance(column, (list, tuple)):
            return None
        columns.append(column)
    tokens, positions, rollout, trainer = columns
    if not tokens or not len(tokens) == len(positions) == len(rollout) == len(trainer):
        return None
    lines = []
    for token, position, engine, policy in zip(tokens, positions, rollout, trainer, strict=True):
        if not (isinstance(position, int) and isinstance(engine, (int, float)) and isinstance(policy, (int, float))):
            return None
        shown = text(token)
        if len(shown) > _TOKEN_WIDTH:
            shown = shown[:_TOKEN_WIDTH - 1] + "…"
        shown = shown.replace("\n", "\\n")
        lines.append(f"'{shown}' at {position}: Δ {policy - engine:+.3f} (rollout {engine:.3f}, trainer {policy:.3f})")
    return lines


def _instructions(value: object) -> list[Mapping[str, object]]:
    """``gen_ai.system_instructions`` as parts, from text, parts or anything else."""
    if isinstance(value, str):
        return [{"type": c.PART_TEXT, "content": value}]
    if isinstance(value, (list, tuple)):
        return [part if isinstance(part, Mapping) and "type" in part
                else {"type": c.PART_TEXT, "content": as_text(part)} for part in value]
    return [{"type": c.PART_TEXT, "content": as_text(value)}]


class EpisodeViews:
    """Walks an episode's spans in recording order, keeping the conversation so far."""

    def __init__(self, agent_name: str | None, capture_content: bool = True) -> None:
        self.agent_name = agent_name
        self.capture_content = capture_content  # off: no view is built from a failure's message

    def views(
        self, spans: Sequence[tuple[int, int | None, str, Mapping[str, object], str | None]]
    ) -> dict[int, SpanView]:
        """``spans``: (span id, parent id, kind, recorded attributes, error message or None for
        a span that did not fail) in recording order."""
        walk = _Walk(self.capture_content)
        for span_id, parent_id, kind, attrs, error in spans:
            view = walk.out[span_id] = SpanView()
            if kind == c.KIND_EPISODE:
                walk.root_id = span_id
                walk.root_attrs = attrs
            elif kind == c.KIND_PROMPT:
                walk.prompt(view, attrs)
            elif kind == c.KIND_GENERATION:
                walk.generation(view, parent_id, attrs)
            elif kind == c.KIND_TOOL:
                walk.tool(span_id, view, attrs, error)
            elif kind == c.KIND_REWARD:
                walk.reward(span_id, view, attrs)
            elif attrs.get(c.RL_FEEDBACK_ROLE) is not None:
                walk.feedback(view, attrs)
            else:
                for key in (c.GEN_AI_INPUT_MESSAGES, c.GEN_AI_OUTPUT_MESSAGES):
                    if attrs.get(key) is not None:
                        view.main[key] = [to_parts(m) for m in messages_of(attrs[key])]
        return walk.finish()

    def root(self, attrs: Mapping[str, object]) -> dict[str, object]:
        """The episode root's labels: agent name, session (one group of one step of one run),
        metadata (with each reward component), tags, and the episode's evaluations: reward,
        each component, advantage (scores) and status (a label), in OpenInference's flattened
        ``evaluations.<i>.evaluation.*`` form (what Phoenix's annotations are posted from)."""
        extra: dict[str, object] = {}
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


class _Later:
    """A view that can only be computed once the whole episode was walked (tool calls found
    after a generation join its output message)."""

    __slots__ = ("fn",)

    def __init__(self, fn: Callable[[], Any]) -> None:  # a value, or (_LATER_FLAT) attribute pairs
        self.fn = fn


_LATER_FLAT = "\x00flat"  # a _Later that yields several attributes (never written as a key)
_LATER_FLAT_INPUT = "\x00flat-input"  # Expand: attributes read at render, while the budget lasts


class Expand:
    """Several attributes computed at render, read one by one, only while the episode's budget
    lasts (every one is text: once the budget is spent, none would be written)."""

    __slots__ = ("items",)

    def __init__(self, items: Callable[[], Iterator[tuple[str, object]]]) -> None:
        self.items = items


def settle(extra: dict[str, object]) -> dict[str, object]:
    """Compute the deferred views of one span's extra attributes (after the walk)."""
    out: dict[str, object] = {}
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


def error_type(events: Iterable[tuple[str, Mapping[str, object], int]] | None) -> str:
    """``error.type`` of a failed span: its exception's type, else the spec's ``_OTHER``."""
    for name, attributes, _ in events or ():
        if name == c.EVENT_EXCEPTION and attributes.get(c.EXCEPTION_TYPE):
            return text(attributes[c.EXCEPTION_TYPE])
    return c.ERROR_TYPE_OTHER


def _metadata_keys(attrs: Mapping[str, object]) -> list[str]:
    """The root attributes its ``metadata`` JSON holds: the fixed ones, then each reward
    component (so that ``metadata['reward.component.correct'] < 0.5`` filters in Phoenix)."""
    keys = [key for key in _METADATA_KEYS if attrs.get(key) is not None]
    keys += [key for key, value in attrs.items() if key.startswith(c.RL_REWARD_COMPONENT_PREFIX) and is_score(key, value)]
    return keys


def _metadata_name(key: str) -> str:
    return key.removeprefix(c.RL_PREFIX)


def _implied_finish(message: Mapping[str, object]) -> str:
    """An output message's finish reason when none was recorded: ``tool_call`` for a message
    that ends in tool calls (the spec's value for a model that stopped to call a tool), else
    ``stop``."""
    return c.FINISH_TOOL_CALL if tool_calls_of(message) else c.FINISH_STOP


_METADATA_KEYS = (c.RL_STEP, c.RL_SPLIT, c.RL_EPISODE_ID, c.RL_GROUP_ID, c.RL_SAMPLE_INDEX, c.RL_STATUS,
                  c.RL_REWARD, c.RL_ADVANTAGE, c.RL_FINISH_REASON, c.RL_POLICY_VERSION,
                  # what a researcher filters a step by in Phoenix: why kept, how slow, where the
                  # time went, how its group fared, which watched prompt
                  c.RL_KEEP_REASON, c.RL_DURATION_SECONDS, *(c.stage_seconds(s) for s in c.STAGES),
                  c.RL_GROUP_DEGENERATE, c.RL_GROUP_REWARD_SPREAD, c.RL_GROUP_ALL_EQUAL, c.RL_GROUP_LOST,
                  c.RL_GROUP_TRUNCATED, c.RL_DATASET_INDEX,
                  c.RL_WATCH_KEY,
                  # how far the rollout policy was from the trained one
                  c.RL_MISMATCH_KL, c.RL_MISMATCH_ABS_MAX, c.RL_MISMATCH_RATIO_MIN, c.RL_MISMATCH_RATIO_MAX,
                  c.RL_MISMATCH_OUTSIDE)
_TAG_KEYS = (c.RL_STEP, c.RL_SPLIT, c.RL_STATUS, c.RL_KEEP_REASON)


def _count(value: object) -> int | None:
    return value if isinstance(value, int) and not isinstance(value, bool) else None
