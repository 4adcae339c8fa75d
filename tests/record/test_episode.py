"""The episode API produces one trace per episode with the contract's span names and attributes."""

from __future__ import annotations

import json
import math

import numpy as np
import pytest
import torch
from opentelemetry.trace.status import StatusCode
from otr_helpers import root, traces, tree

import otel_rollouts as otr
from otel_rollouts import conventions as c


def _episode(step=0, reward=1.0, group="g0", sample=0, tool_error=False):
    with otr.episode(step=step, split="train", group_id=group, sample_index=sample, policy_version=3,
                     metadata={"temperature": 0.7, "tags": ["a", "b"]}) as ep:
        ep.prompt([{"role": "system", "content": "sys"}, {"role": "user", "content": "2+2?"}])
        with ep.turn() as turn:
            turn.record_generation("calling calc", model="pol-1", input_tokens=11, output_tokens=3,
                                   finish_reason="tool_calls")
            with turn.tool_call("calculator", arguments={"expr": "2+2"}, call_id="c1") as call:
                if tool_error:
                    call.error("division by zero")
                else:
                    call.result(4)
        with ep.turn() as turn:
            turn.record_generation("4", model="pol-1")
        ep.reward(reward, components={"math": 1.0, "format": 0.2}, advantage=0.5)
        ep.finish(reason="stop")
    return ep


def test_span_tree_names_parents_and_attributes(memory):
    ep = _episode()
    otr.flush()
    (spans,) = traces(memory).values()
    assert tree(spans) == [
        (0, "episode"),
        (1, "prompt"),
        (1, "turn"),
        (2, "chat pol-1"),
        (2, "execute_tool calculator"),
        (1, "turn"),
        (2, "chat pol-1"),
        (1, "reward"),
    ]
    r = root(spans)
    a = r.attributes
    assert f"{r.context.trace_id:032x}" == ep.trace_id
    assert a[c.GEN_AI_OPERATION_NAME] == c.OP_INVOKE_AGENT
    assert a[c.OPENINFERENCE_SPAN_KIND] == "AGENT"
    assert a[c.RL_STEP] == 0 and a[c.RL_SPLIT] == "train" and a[c.RL_GROUP_ID] == "g0"
    assert a[c.RL_SAMPLE_INDEX] == 0 and a[c.RL_POLICY_VERSION] == 3
    assert a[c.RL_EPISODE_ID] == ep.episode_id == a[c.GEN_AI_CONVERSATION_ID]
    assert isinstance(a[c.RL_REWARD], float) and a[c.RL_REWARD] == 1.0
    assert a[c.RL_REWARD_COMPONENT_PREFIX + "math"] == 1.0 and a[c.RL_ADVANTAGE] == 0.5
    assert a[c.RL_STATUS] == "ok" and a[c.RL_FINISH_REASON] == "stop"
    assert a[c.RL_METADATA_PREFIX + "temperature"] == 0.7
    by_name = {s.name: s for s in spans}
    turns = [s for s in spans if s.name == "turn"]
    assert [t.attributes[c.RL_TURN_INDEX] for t in sorted(turns, key=lambda s: s.start_time)] == [0, 1]
    chat = [s for s in spans if s.name == "chat pol-1"][0]
    assert chat.attributes[c.GEN_AI_OPERATION_NAME] == c.OP_CHAT
    assert chat.attributes[c.OPENINFERENCE_SPAN_KIND] == "LLM"
    assert chat.attributes[c.GEN_AI_REQUEST_MODEL] == "pol-1"
    assert chat.attributes[c.GEN_AI_USAGE_INPUT_TOKENS] == 11
    assert tuple(chat.attributes[c.GEN_AI_RESPONSE_FINISH_REASONS]) == (c.FINISH_TOOL_CALL,)  # the spec's value
    assert '"calling calc"' in chat.attributes[c.GEN_AI_OUTPUT_MESSAGES]
    tool = by_name["execute_tool calculator"]
    assert tool.attributes[c.GEN_AI_TOOL_NAME] == "calculator"
    assert tool.attributes[c.GEN_AI_TOOL_CALL_ID] == "c1"
    assert tool.attributes[c.GEN_AI_TOOL_CALL_ARGUMENTS] == '{"expr":"2+2"}'
    assert tool.attributes[c.GEN_AI_TOOL_CALL_RESULT] == 4
    assert tool.attributes[c.OPENINFERENCE_SPAN_KIND] == "TOOL"
    assert by_name["reward"].attributes[c.OPENINFERENCE_SPAN_KIND] == "EVALUATOR"
    assert "2+2?" in by_name["prompt"].attributes[c.GEN_AI_INPUT_MESSAGES]
    # every child ends inside the episode's time window, except what the API allows after it
    for s in spans:
        assert s.start_time >= r.start_time


def test_tool_error_marks_only_the_tool_span(memory):
    _episode(tool_error=True)
    otr.flush()
    (spans,) = traces(memory).values()
    tool = [s for s in spans if s.name.startswith("execute_tool")][0]
    assert tool.status.status_code is StatusCode.ERROR
    assert tool.status.description == "division by zero"
    assert root(spans).status.status_code is not StatusCode.ERROR


def test_reward_after_the_episode_block_joins_its_trace(memory):
    with otr.episode(step=1, group_id="g") as ep:
        ep.prompt("hi")
    # the advantage is known only once the group is scored
    ep.reward(0.25, advantage=-1.5)
    otr.end_step(1)
    otr.flush()
    (spans,) = traces(memory).values()
    reward = [s for s in spans if s.name == "reward"][0]
    r = root(spans)
    assert reward.parent.span_id == r.context.span_id
    assert reward.end_time >= r.end_time
    assert r.attributes[c.RL_ADVANTAGE] == -1.5 and reward.attributes[c.RL_REWARD] == 0.25


def test_one_trace_per_episode_and_current_episode(memory):
    seen = []
    for i in range(3):
        assert otr.current_episode() is None
        with otr.episode(step=0, sample_index=i) as ep:
            assert otr.current_episode() is ep
            with ep.turn():
                assert otr.current_episode() is ep
            seen.append(ep.trace_id)
            ep.reward(i)
    otr.flush()
    assert len(set(seen)) == 3
    assert {f"{t:032x}" for t in traces(memory)} == set(seen)


def test_exception_in_episode_is_recorded_and_reraised(memory):
    err = RuntimeError("env crashed")
    with pytest.raises(RuntimeError) as info:
        with otr.episode(step=0) as ep:
            with ep.turn():
                raise err
    assert info.value is err
    otr.flush()
    (spans,) = traces(memory).values()
    r = root(spans)
    assert r.status.status_code is StatusCode.ERROR
    assert r.attributes[c.RL_STATUS] == "error"
    turn = [s for s in spans if s.name == "turn"][0]
    assert turn.status.status_code is StatusCode.ERROR
    assert any(e.name == "exception" and e.attributes[c.EXCEPTION_TYPE] == "RuntimeError" for e in turn.events)


async def test_async_episode(memory):
    async with otr.episode(step=0) as ep:
        async with ep.turn() as turn:
            turn.record_generation("ok", model="m")
        ep.reward(1)
    otr.flush()
    (spans,) = traces(memory).values()
    assert [n for _, n in tree(spans)] == ["episode", "turn", "chat m", "reward"]


def test_generation_and_tool_call_context_managers(memory):
    with otr.episode(step=0) as ep:
        with ep.turn() as turn:
            with turn.generation("m", messages=[{"role": "user", "content": "q"}]) as gen:
                gen.output("a", tool_calls=[{"id": "x", "type": "function",
                                             "function": {"name": "f", "arguments": "{}"}}])
            call = turn.tool_call("f", arguments={}, call_id="x")
            call.result({"ok": True})  # ends the call without a with block
        ep.reward(0)
    otr.flush()
    (spans,) = traces(memory).values()
    names = [n for _, n in tree(spans)]
    assert names == ["episode", "turn", "chat m", "execute_tool f", "reward"]
    gen_span = [s for s in spans if s.name == "chat m"][0]
    (output,) = json.loads(gen_span.attributes[c.GEN_AI_OUTPUT_MESSAGES])  # the GenAI parts shape
    assert output["parts"] == [{"type": c.PART_TEXT, "content": "a"},
                               {"type": c.PART_TOOL_CALL, "id": "x", "name": "f", "arguments": {}}]
    (asked,) = json.loads(gen_span.attributes[c.GEN_AI_INPUT_MESSAGES])
    assert asked == {"role": "user", "parts": [{"type": c.PART_TEXT, "content": "q"}]}


def test_numbers_are_numbers_from_numpy_torch_and_strings(memory):
    with otr.episode(step=np.int64(2), sample_index=torch.tensor(3), policy_version=np.int32(1)) as ep:
        ep.reward(torch.tensor(0.5), components={"a": np.float32(0.25), "b": "0.75"},
                  advantage=np.float64(-0.1))
    otr.flush()
    (spans,) = traces(memory).values()
    a = root(spans).attributes
    assert a[c.RL_STEP] == 2 and type(a[c.RL_STEP]) is int
    assert a[c.RL_SAMPLE_INDEX] == 3 and type(a[c.RL_SAMPLE_INDEX]) is int
    assert type(a[c.RL_REWARD]) is float and a[c.RL_REWARD] == 0.5
    assert a[c.RL_REWARD_COMPONENT_PREFIX + "a"] == 0.25 and a[c.RL_REWARD_COMPONENT_PREFIX + "b"] == 0.75
    assert math.isclose(a[c.RL_ADVANTAGE], -0.1)


def test_bad_values_are_flagged_not_raised(memory):
    class Weird:
        def __repr__(self):
            return "<weird>"

    cyclic: dict = {}
    cyclic["self"] = cyclic
    with otr.episode(step="three", sample_index=1.5, metadata={"obj": Weird(), "cyc": cyclic}) as ep:
        ep.prompt(None)
        with ep.turn() as turn:
            turn.record_generation("x" * 200_000, model="m", output_tokens="many")
            with turn.tool_call("t", arguments={"bin": b"\xff\x00", "obj": Weird()}) as call:
                call.result(object())
        ep.reward(float("nan"), components={"ok": 1.0, "bad": "n/a"}, advantage=float("inf"))
        ep.finish(status="exploded")
    otr.flush()
    (spans,) = traces(memory).values()
    r = root(spans)
    invalid = list(r.attributes[c.RL_INVALID_FIELDS])
    assert any(m.startswith("step: not an integer") for m in invalid)
    assert any(m.startswith("sample_index: not an integer") for m in invalid)
    assert any(m.startswith("status: expected one of") for m in invalid)
    reward = [s for s in spans if s.name == "reward"][0]
    rinv = list(reward.attributes[c.RL_INVALID_FIELDS])
    assert "reward: not finite: nan" in rinv and "advantage: not finite: inf" in rinv
    assert any(m.startswith("reward.bad: not a number") for m in rinv)
    assert c.RL_REWARD not in r.attributes and r.attributes[c.RL_REWARD_COMPONENT_PREFIX + "ok"] == 1.0
    chat = [s for s in spans if s.name == "chat m"][0]
    text = chat.attributes[c.GEN_AI_OUTPUT_MESSAGES]
    assert len(text) < 20_000 and "chars cut" in text and c.GEN_AI_OUTPUT_MESSAGES in chat.attributes[c.RL_TRUNCATED_FIELDS]
    assert "<cycle>" in r.attributes[c.RL_METADATA_PREFIX + "cyc"]
    tool = [s for s in spans if s.name == "execute_tool t"][0]
    assert "<weird>" in tool.attributes[c.GEN_AI_TOOL_CALL_ARGUMENTS]
    assert otr.stats()["totals"]["invalid_values"] >= 6


def test_strict_mode_raises_naming_the_field(otr_shutdown):
    from opentelemetry.sdk.trace.export.in_memory_span_exporter import InMemorySpanExporter

    otr.configure(exporters=[InMemorySpanExporter()], strict=True)
    with otr.episode(step=0) as ep:
        with pytest.raises(otr.InvalidValue, match="reward: not finite"):
            ep.reward(float("nan"))


def test_capture_content_off_keeps_structure_drops_text(otr_shutdown, monkeypatch):
    from opentelemetry.sdk.trace.export.in_memory_span_exporter import InMemorySpanExporter

    monkeypatch.setenv(c.ENV_CAPTURE_CONTENT, "false")
    exporter = InMemorySpanExporter()
    otr.configure(exporters=[exporter])
    _episode()
    otr.flush()
    (spans,) = traces(exporter).values()
    assert len(spans) == 8
    for s in spans:
        for key in (c.GEN_AI_INPUT_MESSAGES, c.GEN_AI_OUTPUT_MESSAGES, c.GEN_AI_TOOL_CALL_ARGUMENTS,
                    c.GEN_AI_TOOL_CALL_RESULT):
            assert key not in s.attributes
        assert "2+2" not in repr(dict(s.attributes))
    assert root(spans).attributes[c.RL_REWARD] == 1.0
