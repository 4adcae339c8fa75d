"""A long episode renders in time linear in its spans, and shows what it showed before.

A generation recorded without its input messages gets the conversation so far as a view. It used
to be rebuilt whole for every generation and then cut by the limits (quadratic in the episode's
length); now each generation gets a window onto one append-only conversation, and the JSON text
of the view is built only from the messages that the cut keeps. These tests hold it to the
original algorithm's visible result (rebuilt here the simple way: the whole list encoded, then
``content.cut``), count the messages each generation reads (bounded by the limit, not by the
episode's length), and count the Redactor's scans of each text during one render (one).
"""

from __future__ import annotations

import json
import threading
from collections import Counter
from typing import Any

import pytest
from otr_helpers import traces

import otel_rollouts as otr
from otel_rollouts import conventions as c
from otel_rollouts._core import redaction
from otel_rollouts._core.content import cut, precut
from otel_rollouts._core.messages import attach_tool_call, to_parts
from otel_rollouts.delivery import views as views_module
from otel_rollouts.delivery.materialize import Materializer, _json
from otel_rollouts.delivery.views import EpisodeViews, SoFar

Span = tuple[int, int | None, str, dict[str, Any], str | None]


def _text(i: int, size: int) -> str:
    words = ("plan", "tool", "ünïcode", "result", "x" * 30, "step", "rows", "answer")
    out = " ".join(words[(i * 7 + k) % len(words)] for k in range(size // 6 + 1))
    return f"{i}: {out}"[:size]


def episode_spans(turns: int, *, silent_every: int = 0) -> list[Span]:
    """An episode's span tuples as the views walk them: a prompt, then per turn a generation
    recorded without its input messages and one or two tool calls. ``silent_every``: every so
    many turns the generation records no output, so that its tools join the answer before it
    (which earlier windows already show: the case the windows pin a copy for)."""
    spans: list[Span] = [(1, None, c.KIND_EPISODE, {}, None)]
    prompt = [{"role": "system", "content": "You are an agent."},
              {"role": "user", "content": precut(_text(0, 3000), 200)}]  # holds a cut marker
    spans.append((2, 1, c.KIND_PROMPT, {c.GEN_AI_INPUT_MESSAGES: prompt}, None))
    next_id = 3
    for k in range(turns):
        turn_id = next_id
        spans.append((turn_id, 1, c.KIND_TURN, {}, None))
        attrs: dict[str, Any] = {}
        if not (silent_every and k % silent_every == silent_every - 1):
            attrs[c.GEN_AI_OUTPUT_MESSAGES] = [{"role": "assistant", "content": _text(k, 40 + k % 90)}]
        spans.append((turn_id + 1, turn_id, c.KIND_GENERATION, attrs, None))
        next_id = turn_id + 2
        for t in range(1 + k % 2):
            tool = {c.GEN_AI_TOOL_NAME: "search", c.GEN_AI_TOOL_CALL_ID: f"call-{k}-{t}",
                    c.GEN_AI_TOOL_CALL_ARGUMENTS: {"query": _text(k + t, 25)}}
            error = None
            if (k + t) % 7 == 3:
                error = "timed out"
            else:
                tool[c.GEN_AI_TOOL_CALL_RESULT] = _text(k * 3 + t, 60 + k % 40)
            spans.append((next_id, turn_id, c.KIND_TOOL, tool, error))
            next_id += 1
    return spans


def original_inputs(spans: list[Span]) -> dict[int, list[dict[str, Any]]]:
    """The original algorithm: each generation recorded without inputs gets the whole
    conversation so far, copied and converted to the parts shape when it is walked."""
    conversation: list[dict[str, Any]] = []
    last: dict[str, Any] | None = None
    out: dict[int, list[dict[str, Any]]] = {}
    for span_id, _, kind, attrs, error in spans:
        if kind == c.KIND_PROMPT:
            conversation.extend(dict(m) for m in attrs[c.GEN_AI_INPUT_MESSAGES])
        elif kind == c.KIND_GENERATION:
            if conversation:
                out[span_id] = [to_parts(dict(m)) for m in conversation]
            outputs = [dict(m) for m in attrs.get(c.GEN_AI_OUTPUT_MESSAGES, [])]
            if outputs:
                conversation.extend(outputs)
                last = outputs[-1]
        elif kind == c.KIND_TOOL:
            call_id = attrs[c.GEN_AI_TOOL_CALL_ID]
            if last is not None:
                attach_tool_call(last.setdefault("tool_calls", []), call_id, attrs[c.GEN_AI_TOOL_NAME],
                                 attrs[c.GEN_AI_TOOL_CALL_ARGUMENTS])
            result = attrs.get(c.GEN_AI_TOOL_CALL_RESULT)
            content = result if result is not None else f"error: {error}"
            conversation.append({"role": "tool", "tool_call_id": call_id, "name": attrs[c.GEN_AI_TOOL_NAME],
                                 "content": content})
    return out


def windows(spans: list[Span]) -> dict[int, SoFar]:
    views = EpisodeViews(None).views(spans)
    out = {}
    for span_id, view in views.items():
        so_far = view.derived.get(c.GEN_AI_INPUT_MESSAGES)
        if isinstance(so_far, SoFar):
            out[span_id] = so_far
    return out


@pytest.mark.parametrize("silent_every", [0, 4])
def test_each_generation_shows_what_the_original_showed(silent_every: int) -> None:
    spans = episode_spans(60, silent_every=silent_every)
    expected = original_inputs(spans)
    got = windows(spans)
    assert set(got) == set(expected) and len(got) == 60
    limits = (0, 1, 41, 100, 256, 257, 700, 1_000, 4_096, 16_384, 10**7)
    for span_id, so_far in got.items():
        whole = _json(expected[span_id])
        assert so_far.whole(_json) == whole
        for limit in limits:
            assert so_far.text(limit, _json) == cut(whole, limit), (span_id, limit)
        flat = dict(so_far.flattened())
        assert flat == views_module._flatten(c.OI_LLM_INPUT_MESSAGES, [dict(m) for m in expected[span_id]])


def test_last_generation_shows_the_tail_of_the_conversation_with_the_cut_note() -> None:
    spans = episode_spans(200)
    expected = original_inputs(spans)
    last = max(windows(spans).items())
    text, was_cut = last[1].text(1_000, _json)
    assert was_cut and text == cut(_json(expected[last[0]]), 1_000)[0]
    assert "chars cut]…" in text
    assert text.endswith(_json(expected[last[0]][-1]) + "]")  # the tool result just before it


def test_messages_read_per_generation_do_not_grow_with_the_episode(monkeypatch: pytest.MonkeyPatch) -> None:
    """Each generation reads only the messages at the two ends that its limit shows, and each
    message is encoded once (again only when a tool call joins it)."""
    encoded = Counter[str]()
    piece = views_module._piece

    def counting_piece(message: dict[str, Any]) -> tuple[str, int] | None:
        encoded["messages"] += 1
        return piece(message)

    monkeypatch.setattr(views_module, "_piece", counting_piece)
    reads: list[int] = []
    read = SoFar._piece

    def counting_read(self: SoFar, i: int) -> tuple[str, int]:
        reads[-1] += 1
        return read(self, i)

    monkeypatch.setattr(SoFar, "_piece", counting_read)
    most: dict[int, int] = {}
    for turns in (50, 400):
        encoded.clear()
        spans = episode_spans(turns, silent_every=5)
        tools = sum(1 for s in spans if s[2] == c.KIND_TOOL)
        found = windows(spans)
        conversation = 2 + sum(1 for s in spans if s[2] == c.KIND_GENERATION and s[3]) + tools
        assert encoded["messages"] <= conversation + tools  # once each, once more per joining call
        reads.clear()
        for so_far in found.values():
            reads.append(0)
            so_far.text(1_000, _json)
        most[turns] = max(reads)
    # messages are 40-240 characters: a 1,000-character cut shows a handful at each end
    assert most[400] == most[50] <= 24


def test_each_text_is_redacted_once_per_render(configured, monkeypatch: pytest.MonkeyPatch) -> None:
    """Texts that repeat across spans (the same tool result every turn, the same role names,
    message keys, a failure's message) are scanned once per render, not once per place."""
    counts: Counter[tuple[str, str]] = Counter()
    inside = threading.local()
    scan = redaction.Redactor._scan
    render = Materializer.episode

    def counting_scan(self: redaction.Redactor, text: str, replace: Any, *args: Any, **kwargs: Any) -> Any:
        if getattr(inside, "on", False):
            counts[(text, getattr(replace, "__name__", "?"))] += 1
        return scan(self, text, replace, *args, **kwargs)

    def marked(self: Materializer, record: Any) -> Any:
        inside.on = True
        try:
            return render(self, record)
        finally:
            inside.on = False

    monkeypatch.setattr(redaction.Redactor, "_scan", counting_scan)
    monkeypatch.setattr(Materializer, "episode", marked)
    memory = configured(10, "first", sampler_options={"step_lag": None}, run_id="once")
    secret = "sk-proj-" + "A1b2C3d4E5f6G7h8I9j0" * 2
    with otr.episode(step=0, group_id="g", sample_index=0) as ep:
        ep.prompt([{"role": "user", "content": f"use key {secret} to search"}])
        for k in range(6):
            with ep.turn() as turn:
                turn.record_generation("same answer every turn", model="policy")
                with turn.tool_call("search", arguments={"query": "same query"}, call_id=f"c{k}") as call:
                    if k % 2:
                        call.error("the same failure")
                    else:
                        call.result("the same result")
        ep.reward(1.0)
    otr.end_step(0)
    otr.flush()
    assert counts, "nothing was redacted in the render"
    twice = {key: n for key, n in counts.items() if n > 1}
    assert not twice, twice
    spans = next(iter(traces(memory).values()))
    assert not any(secret in str(s.attributes) for s in spans)


def test_long_episode_renders_every_span_and_the_last_conversation(configured) -> None:
    """Through the public API, with no episode budget: every span rendered, and the last
    generation's conversation so far is the original's cut of the whole conversation."""
    memory = configured(10, "first", sampler_options={"step_lag": None}, run_id="long",
                        max_attribute_chars=2_000, max_episode_chars=None,
                        max_spans_per_episode=1_000)
    turns = 120
    recorded: list[Span] = [(1, None, c.KIND_EPISODE, {}, None)]
    prompt = [{"role": "user", "content": "find the answer"}]
    recorded.append((2, 1, c.KIND_PROMPT, {c.GEN_AI_INPUT_MESSAGES: prompt}, None))
    with otr.episode(step=0, group_id="g", sample_index=0) as ep:
        ep.prompt(prompt)
        for k in range(turns):
            with ep.turn() as turn:
                answer = _text(k, 80)
                turn.record_generation(answer, model="policy")
                recorded.append((10 * k + 3, None, c.KIND_GENERATION,
                                 {c.GEN_AI_OUTPUT_MESSAGES: [{"role": "assistant", "content": answer}]}, None))
                arguments, result = {"query": _text(k, 20)}, _text(k + 1, 90)
                with turn.tool_call("search", arguments=arguments, call_id=f"c{k}") as call:
                    call.result(result)
                recorded.append((10 * k + 4, None, c.KIND_TOOL, {
                    c.GEN_AI_TOOL_NAME: "search", c.GEN_AI_TOOL_CALL_ID: f"c{k}",
                    c.GEN_AI_TOOL_CALL_ARGUMENTS: arguments, c.GEN_AI_TOOL_CALL_RESULT: result}, None))
        ep.reward(1.0)
    otr.end_step(0)
    otr.flush()
    spans = next(iter(traces(memory).values()))
    assert len(spans) == 3 + 3 * turns
    generations = sorted((s for s in spans if s.attributes.get(c.RL_SPAN_KIND) == c.KIND_GENERATION),
                         key=lambda s: s.start_time)
    expected = original_inputs(recorded)
    last = generations[-1].attributes
    assert last[c.GEN_AI_INPUT_MESSAGES] == cut(_json(expected[10 * (turns - 1) + 3]), 2_000)[0]
    assert json.loads(generations[0].attributes[c.GEN_AI_INPUT_MESSAGES]) == [to_parts(prompt[0])]
    n = len(expected[10 * (turns - 1) + 3])
    assert last[c.oi_message_key(c.OI_LLM_INPUT_MESSAGES, n - 1, c.OI_MESSAGE_ROLE)] == "tool"
