"""Readable text from templated, decoded text, learned from the tokenizer itself: role markers
from its chat template, special tokens from its vocabulary. A template nobody listed (a made-up
one below, with markers no code in the library names) must come out as clean as ChatML."""

from __future__ import annotations

import pytest
from tokenizer_fixture import build_tokenizer

from otel_rollouts.adapters._text import assistant_message, clean, messages_of

# A template in no known family: [[BEGIN role]] ... [[DONE]], and its own end-of-text token.
ODD_TEMPLATE = (
    "{%- for message in messages -%}"
    "{{ '[[BEGIN ' + message.role + ']]\\n' + message.content + '[[DONE]]\\n' }}"
    "{%- endfor -%}"
    "{%- if add_generation_prompt -%}{{ '[[BEGIN assistant]]\\n' }}{%- endif -%}"
)


@pytest.fixture(scope="module")
def chatml():
    return build_tokenizer()


@pytest.fixture(scope="module")
def odd():
    tokenizer = build_tokenizer()
    tokenizer.add_special_tokens({"additional_special_tokens": ["<|im_start|>", "[[DONE]]", "<eot>"]})
    tokenizer.eos_token = "<eot>"
    tokenizer.chat_template = ODD_TEMPLATE
    return tokenizer


def test_an_observation_keeps_its_real_role_and_loses_the_generation_prompt(chatml, odd):
    for tokenizer in (chatml, odd):
        rendered = tokenizer.apply_chat_template(
            [{"role": "user", "content": "Try again: 17 * 23?"}], tokenize=False, add_generation_prompt=True
        )
        assert messages_of("\n" + rendered, tokenizer, default_role="environment") == [
            {"role": "user", "content": "Try again: 17 * 23?"}
        ]


def test_a_rendered_prompt_is_split_into_its_messages(chatml, odd):
    conversation = [
        {"role": "system", "content": "You are a helpful assistant."},
        {"role": "user", "content": "What is 2 + 2?"},
        {"role": "assistant", "content": "4"},
        {"role": "user", "content": "And 17 * 23?"},
    ]
    for tokenizer in (chatml, odd):
        rendered = tokenizer.apply_chat_template(conversation, tokenize=False, add_generation_prompt=True)
        assert messages_of(rendered, tokenizer) == conversation


def test_a_role_the_template_renders_like_user_is_recognised(odd):
    rendered = "[[BEGIN ipython]]\n{\"result\": 391}[[DONE]]\n"
    assert messages_of(rendered, odd, default_role="tool") == [{"role": "ipython", "content": '{"result": 391}'}]


def test_generated_text_loses_end_of_turn_and_eos_and_keeps_tool_calls(chatml, odd):
    for tokenizer, end in ((chatml, "<|im_end|>"), (odd, "[[DONE]]<eot>")):
        message, errors = assistant_message(
            'Let me compute. <tool_call>{"name": "calculator", "arguments": {"expression": "17 * 23"}}</tool_call>'
            + end,
            tokenizer,
        )
        assert errors == []
        assert message["content"] == "Let me compute."
        assert [call["function"]["name"] for call in message["tool_calls"]] == ["calculator"]
        assert clean("The answer is 391." + end, tokenizer) == "The answer is 391."


def test_without_a_tokenizer_text_is_kept_as_it_is():
    assert clean("x<|im_end|>", None) == "x<|im_end|>"
    assert messages_of("plain question", None) == [{"role": "user", "content": "plain question"}]
