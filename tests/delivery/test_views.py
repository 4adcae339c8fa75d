"""The GenAI semantic conventions and OpenInference views written on kept episodes.

Exported spans are read back from the real SDK's in-memory exporter and checked against the
published shapes: GenAI message JSON in the parts shape (``{role, parts: [{type, ...}]}``, output
messages with a ``finish_reason``), the spec's finish-reason values, ``error.type``,
``gen_ai.evaluation.result`` events; OpenInference ``input.value``/``output.value`` on every span
kind, flattened ``llm.*_messages``, ``session.id``, ``metadata``, ``tag.tags``.
"""

from __future__ import annotations

import json
from typing import Any

import pytest
from otr_helpers import configure_memory, root, traces

import otel_rollouts as otr
from otel_rollouts import conventions as c

PART_FIELDS = {  # the spec's required fields per part type (models.ipynb of the semconv)
    c.PART_TEXT: {"content": str},
    c.PART_TOOL_CALL: {"name": str},
    c.PART_TOOL_CALL_RESPONSE: {"response": object},
}
SPEC_FINISH_REASONS = {c.FINISH_STOP, c.FINISH_LENGTH, c.FINISH_CONTENT_FILTER, c.FINISH_TOOL_CALL, c.FINISH_ERROR}
SECRET = "sk-proj-" + "A1b2C3d4E5f6G7h8I9j0" * 2


def check_messages(text: str, *, output: bool = False) -> list[dict[str, Any]]:
    """Parse and validate message JSON against the GenAI conventions' schema; return it."""
    messages = json.loads(text)
    assert isinstance(messages, list) and messages
    for message in messages:
        assert isinstance(message["role"], str) and isinstance(message["parts"], list), message
        for part in message["parts"]:
            for field, kind in PART_FIELDS.get(part["type"], {}).items():
                assert isinstance(part[field], kind), (part, field)
        if output:  # deprecated inside the messages (#363): gen_ai.response.finish_reasons says it
            assert "finish_reason" not in message, message
    return messages


def _episode(*, capture: bool = True, **configure: Any) -> list:
    memory = configure_memory(10, "first", service_name="views-test", capture_content=capture,
                              **configure)
    with otr.episode(step=3, group_id="grp-7", sample_index=1) as ep:
        ep.prompt([{"role": "system", "content": "Be brief."},
                   {"role": "user", "content": f"What is 6*7? my key is {SECRET}"}],
                  system_instructions="Answer with a number.")
        with ep.turn() as turn:
            turn.record_generation("Calling the calculator.", model="pol", input_tokens=12, output_tokens=4,
                                   finish_reason="tool_calls",
                                   tool_calls=[{"id": "c1", "type": "function",
                                                "function": {"name": "calc", "arguments": '{"e": "6*7"}'}}])
            with turn.tool_call("calc", arguments={"e": "6*7"}, call_id="c1") as call:
                call.result(42.0)
            with turn.tool_call("lookup", arguments={"q": "x"}, call_id="c2") as call:
                call.error(TimeoutError("lookup timed out"))
            turn.feedback("The tool says 42.", role="environment")
        with ep.turn() as turn:
            turn.record_generation("The answer is 42.", model="pol", finish_reason="eos", provider="vllm")
        ep.reward(1.0, components={"correct": 1.0}, advantage=0.25)
        ep.finish(reason="stop")
    assert otr.flush(timeout=10)
    (spans,) = traces(memory).values()
    return spans


def _named(spans, name: str) -> list:
    return sorted((s for s in spans if s.name == name), key=lambda s: s.start_time)


def test_messages_follow_the_genai_parts_shape(otr_shutdown):
    spans = _episode()
    (prompt,) = _named(spans, c.SPAN_PROMPT)
    system, user = check_messages(prompt.attributes[c.GEN_AI_INPUT_MESSAGES])
    assert system == {"role": "system", "parts": [{"type": c.PART_TEXT, "content": "Be brief."}]}
    assert json.loads(prompt.attributes[c.GEN_AI_SYSTEM_INSTRUCTIONS]) == [
        {"type": c.PART_TEXT, "content": "Answer with a number."}]
    first, second = _named(spans, "chat pol")
    (out,) = check_messages(first.attributes[c.GEN_AI_OUTPUT_MESSAGES], output=True)
    assert {"type": c.PART_TOOL_CALL, "id": "c1", "name": "calc", "arguments": {"e": "6*7"}} in out["parts"]
    # "tool_calls" in, the spec's value out
    assert tuple(first.attributes[c.GEN_AI_RESPONSE_FINISH_REASONS]) == (c.FINISH_TOOL_CALL,)
    check_messages(second.attributes[c.GEN_AI_OUTPUT_MESSAGES], output=True)
    assert tuple(second.attributes[c.GEN_AI_RESPONSE_FINISH_REASONS]) == (c.FINISH_STOP,)  # "eos"
    assert set(first.attributes[c.GEN_AI_RESPONSE_FINISH_REASONS]) <= set(SPEC_FINISH_REASONS)
    assert second.attributes[c.GEN_AI_PROVIDER_NAME] == "vllm" and second.attributes[c.OI_LLM_PROVIDER] == "vllm"


def test_a_generation_without_recorded_input_gets_the_conversation_so_far(otr_shutdown):
    spans = _episode()
    first, second = _named(spans, "chat pol")
    assert [m["role"] for m in check_messages(first.attributes[c.GEN_AI_INPUT_MESSAGES])] == ["system", "user"]
    history = check_messages(second.attributes[c.GEN_AI_INPUT_MESSAGES])
    assert [m["role"] for m in history] == ["system", "user", "assistant", "tool", "tool", "environment"]
    assert history[3]["parts"] == [{"type": c.PART_TOOL_CALL_RESPONSE, "id": "c1", "response": "42.0"}]
    # a failed call is part of what the policy saw next
    assert history[4]["parts"] == [{"type": c.PART_TOOL_CALL_RESPONSE, "id": "c2",
                                    "response": "error: TimeoutError: lookup timed out"}]
    # OpenInference's flattened view of the same, for Phoenix's chat rendering
    attrs = second.attributes
    key = c.oi_message_key
    assert attrs[key(c.OI_LLM_INPUT_MESSAGES, 3, c.OI_MESSAGE_ROLE)] == "tool"
    assert attrs[key(c.OI_LLM_INPUT_MESSAGES, 3, c.OI_MESSAGE_CONTENT)] == "42.0"
    assert attrs[key(c.OI_LLM_INPUT_MESSAGES, 3, c.OI_MESSAGE_TOOL_CALL_ID)] == "c1"
    assert attrs[c.oi_tool_call_key(c.OI_LLM_INPUT_MESSAGES, 2, 0, c.OI_TOOL_CALL_FUNCTION_NAME)] == "calc"
    assert attrs[key(c.OI_LLM_OUTPUT_MESSAGES, 0, c.OI_MESSAGE_CONTENT)] == "The answer is 42."
    assert attrs[c.OI_LLM_MODEL_NAME] == "pol"


def test_the_conversation_is_not_copied_on_the_training_thread(configured):
    configured(10, "first")
    with otr.episode(step=0) as ep:
        ep.prompt("q")
        with ep.turn() as turn:
            turn.record_generation("a")
        recorded = {s.kind: s.attributes for s in ep._record.spans}
        assert c.GEN_AI_INPUT_MESSAGES not in recorded[c.KIND_GENERATION]  # built only if kept


def test_every_span_kind_has_input_and_output_for_viewers(otr_shutdown):
    spans = _episode()
    episode = root(spans)
    assert episode.attributes[c.INPUT_VALUE].startswith("What is 6*7?")
    assert episode.attributes[c.OUTPUT_VALUE] == "The answer is 42."
    assert episode.attributes[c.INPUT_MIME_TYPE] == c.MIME_TEXT
    by_kind = {s.attributes[c.RL_SPAN_KIND]: s for s in spans}
    for kind in (c.KIND_PROMPT, c.KIND_TURN, c.KIND_GENERATION, c.KIND_TOOL, c.KIND_REWARD, c.KIND_SPAN):
        attrs = by_kind[kind].attributes
        assert attrs.get(c.INPUT_VALUE) or attrs.get(c.OUTPUT_VALUE), (kind, dict(attrs))
    (calc,) = _named(spans, c.tool_span_name("calc"))
    assert json.loads(calc.attributes[c.INPUT_VALUE]) == {"e": "6*7"}
    assert calc.attributes[c.INPUT_MIME_TYPE] == c.MIME_JSON
    assert calc.attributes[c.OUTPUT_VALUE] == "42.0" and calc.attributes[c.OI_TOOL_NAME] == "calc"


def test_root_labels_group_session_metadata_tags_and_agent_name(otr_shutdown):
    attrs = root(_episode()).attributes
    assert attrs[c.GEN_AI_AGENT_NAME] == "views-test"  # default: the service name
    # one Phoenix session per run, split, step and group (group ids repeat across steps and runs)
    assert attrs[c.OI_SESSION_ID] == f"{attrs[c.RL_RUN_ID]}/train/3/grp-7"
    # and why the sampler kept it: a tag Phoenix filters by
    assert set(attrs[c.OI_TAG_TAGS]) == {"step:3", "split:train", "status:ok",
                                         f"trace.keep_reason:{attrs[c.RL_KEEP_REASON]}"}
    metadata = json.loads(attrs[c.OI_METADATA])
    assert metadata["reward.score"] == 1.0 and metadata["advantage"] == 0.25 and metadata["status"] == "ok"
    otr.shutdown()
    assert root(_episode(agent_name="math-agent")).attributes[c.GEN_AI_AGENT_NAME] == "math-agent"


def test_scores_are_evaluation_result_events_and_failures_have_an_error_type(otr_shutdown):
    spans = _episode()
    (reward,) = _named(spans, c.SPAN_REWARD)
    # on the span evaluated, the episode's root (the spec: parented to the evaluated operation)
    events = [e.attributes for e in root(spans).events if e.name == c.EVENT_GEN_AI_EVALUATION_RESULT]
    results = {e[c.GEN_AI_EVALUATION_NAME]: e.get(c.GEN_AI_EVALUATION_SCORE_VALUE, e.get(c.GEN_AI_EVALUATION_SCORE_LABEL))
               for e in events}
    assert results == {c.EVALUATION_REWARD: 1.0, "correct": 1.0, c.EVALUATION_ADVANTAGE: 0.25,
                       c.EVALUATION_STATUS: c.STATUS_OK}
    assert not [e for e in reward.events if e.name == c.EVENT_GEN_AI_EVALUATION_RESULT]  # once, not twice
    assert reward.attributes[c.RL_REWARD] == 1.0  # the rl.* contract stays
    (lookup,) = _named(spans, c.tool_span_name("lookup"))
    assert lookup.attributes[c.ERROR_TYPE] == "TimeoutError"
    assert c.ERROR_TYPE not in root(spans).attributes  # the episode itself ended ok


@pytest.mark.parametrize("key", [c.INPUT_VALUE, c.OUTPUT_VALUE, c.GEN_AI_INPUT_MESSAGES, c.GEN_AI_OUTPUT_MESSAGES,
                                 c.GEN_AI_SYSTEM_INSTRUCTIONS])
def test_content_off_leaves_no_content_view_anywhere(otr_shutdown, key):
    spans = _episode(capture=False)
    for span in spans:
        attrs = span.attributes
        if span.attributes.get(c.RL_SPAN_KIND) == c.KIND_REWARD and key == c.OUTPUT_VALUE:
            assert set(json.loads(attrs[key])) == {"reward", "correct", "advantage"}  # numbers only
            continue
        assert key not in attrs, (span.name, key)
        assert not any(k.startswith((c.OI_LLM_INPUT_MESSAGES, c.OI_LLM_OUTPUT_MESSAGES)) for k in attrs)
    reason = root(spans).attributes[c.RL_KEEP_REASON]
    assert set(root(spans).attributes[c.OI_TAG_TAGS]) == {"step:3", "split:train", "status:ok",
                                                           f"trace.keep_reason:{reason}"}


def test_redaction_covers_every_view(otr_shutdown):
    spans = _episode()
    for span in spans:
        for key, value in span.attributes.items():
            texts = value if isinstance(value, tuple) else (value,)
            assert not any(isinstance(t, str) and SECRET in t for t in texts), (span.name, key)
    assert "[REDACTED" in root(spans).attributes[c.INPUT_VALUE]
