"""Tool calls and chat roles recovered from decoded text (pure parsing, no tokenizer needed)."""

from __future__ import annotations

import json

from tokenizer_fixture import build_tokenizer

from otel_rollouts.decode.chat_roles import learn_markers
from otel_rollouts.decode.toolcalls import parse_tool_calls, tool_responses


def _call(name, args, call_id):
    return {"id": call_id, "type": "function", "function": {"name": name, "arguments": json.dumps(args)}}


def test_hermes_blocks_several_calls_and_text_around():
    text = ('Checking both.\n<tool_call>\n{"name": "weather", "arguments": {"city": "Paris"}}\n</tool_call>\n'
            '<tool_call>{"name": "weather", "arguments": {"city": "東京"}}</tool_call>')
    parsed = parse_tool_calls(text, "c")
    assert parsed.content == "Checking both."
    assert parsed.tool_calls == [
        {"id": "c0", "type": "function", "function": {"name": "weather", "arguments": '{"city": "Paris"}'}},
        {"id": "c1", "type": "function", "function": {"name": "weather", "arguments": '{"city": "東京"}'}},
    ]
    assert parsed.errors == []


def test_hermes_unparseable_and_unclosed_calls_stay_as_text():
    bad = "<tool_call>{not json}</tool_call>"
    parsed = parse_tool_calls("Hm. " + bad)
    assert parsed.content == "Hm. " + bad and parsed.tool_calls == []
    assert parsed.errors[0].startswith("invalid JSON in <tool_call>")
    nameless = parse_tool_calls('<tool_call>{"arguments": {}}</tool_call>')
    assert nameless.tool_calls == [] and nameless.errors == ["tool call without a name"]
    cut = parse_tool_calls('Let me.<tool_call>{"name": "calc", "argu')
    assert cut.tool_calls == [] and cut.errors == ["unclosed <tool_call>"]
    assert cut.content == 'Let me.<tool_call>{"name": "calc", "argu'


def test_openai_style_json_shapes():
    single = parse_tool_calls('{"name": "calc", "arguments": {"x": 1}}', "k")
    assert single.tool_calls == [_call("calc", {"x": 1}, "k0")] and single.content == ""
    wrapped = parse_tool_calls(json.dumps({"content": "ok", "tool_calls": [
        {"id": "abc", "type": "function", "function": {"name": "f", "arguments": '{"a": 2}'}}]}))
    assert wrapped.content == "ok"
    assert wrapped.tool_calls == [{"id": "abc", "type": "function", "function": {"name": "f", "arguments": '{"a": 2}'}}]
    listed = parse_tool_calls('```json\n[{"name": "a", "parameters": {}}, {"function": {"name": "b"}}]\n```', "k")
    assert [t["function"]["name"] for t in listed.tool_calls] == ["a", "b"]
    assert [t["function"]["arguments"] for t in listed.tool_calls] == ["{}", "{}"]


def test_plain_json_answers_are_not_tool_calls_and_broken_calls_are_flagged():
    answer = parse_tool_calls('{"answer": 4}')
    assert answer.tool_calls == [] and answer.errors == [] and answer.content == '{"answer": 4}'
    broken = parse_tool_calls('{"name": "calc", "arguments": {"x": 1}')
    assert broken.tool_calls == [] and broken.errors[0].startswith("invalid JSON tool call")
    prose = parse_tool_calls("The answer is 4.")
    assert prose.content == "The answer is 4." and prose.tool_calls == [] and prose.errors == []


def test_tool_responses():
    assert tool_responses("<tool_response>\n1\n</tool_response>\n<tool_response>two</tool_response>") == ["1", "two"]
    assert tool_responses("no tags") == []


def test_role_markers_learned_from_the_chat_template():
    tok = build_tokenizer()
    markers = learn_markers(tok)
    assert markers.prefixes == {"system": "<|im_start|>system\n", "user": "<|im_start|>user\n",
                                "assistant": "<|im_start|>assistant\n"}
    messages = [{"role": "system", "content": "S"}, {"role": "user", "content": "U 日本"},
                {"role": "assistant", "content": "A"}, {"role": "user", "content": "U2"}]
    text = tok.apply_chat_template(messages, tokenize=False, add_generation_prompt=True)
    assert markers.messages(text) == messages
    tok.chat_template = None
    assert learn_markers(tok).messages("plain text") == [{"role": "user", "content": "plain text"}]
    tok.chat_template = "{{ raise_exception('no') }}"
    assert learn_markers(tok).prefixes == {}
