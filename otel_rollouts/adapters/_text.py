"""Text as a person reads it: chat-template markup and end-of-turn tokens taken out, a rendered
prompt split back into its messages, tool calls found in assistant text.

Frameworks hand the adapters text decoded from token ids (SkyRL observations, Tinker's rendered
prompts, verl's tool turns). Nothing here lists known strings: the markers come from the
tokenizer's own chat template (``_chat_roles.learn_markers``, rendered once with sentinels) and
its own special tokens (``all_special_tokens`` and added tokens flagged special), so a template
nobody listed is cleaned the same way. Without a tokenizer the text is kept as it is.
"""

from __future__ import annotations

from typing import Any

from otel_rollouts.adapters.kit import (
    ParsedMessage,
    RoleMarkers,
    parse_tool_calls,
    tokenizer_knowledge,
)

__all__ = ["assistant_message", "clean", "messages_of", "unspecial"]


def _knowledge(tokenizer: object) -> tuple[RoleMarkers, tuple[str, ...], str | None]:
    if tokenizer is None:
        return RoleMarkers(), (), None
    return tokenizer_knowledge(tokenizer)


def unspecial(text: str, tokenizer: object) -> str:
    """``text`` without the tokenizer's special tokens (EOS, end-of-turn, role markers)."""
    _, special, _ = _knowledge(tokenizer)
    for s in special:
        if s in text:
            text = text.replace(s, "")
    return text


def clean(text: object, tokenizer: object, role: str = "assistant") -> str:
    """One message's text: its role prefix, end-of-message suffix and special tokens removed."""
    if not isinstance(text, str):
        return "" if text is None else str(text)
    markers, _, eos = _knowledge(tokenizer)
    prefix = markers.prefixes.get(role)
    if prefix and text.startswith(prefix):
        text = text[len(prefix) :]
    text = markers.clean(text)
    if eos and text.endswith(eos):
        text = text[: -len(eos)]
    return unspecial(text, tokenizer)


def messages_of(text: object, tokenizer: object, default_role: str = "user") -> list[dict[str, str]]:
    """The messages of a text rendered with the tokenizer's chat template (one message of
    ``default_role`` when it holds no role marker); the empty generation prompt at the end of an
    observation (``<|im_start|>assistant\\n``) is left out, every content is cleaned."""
    if not isinstance(text, str):
        text = "" if text is None else str(text)
    markers, _, _ = _knowledge(tokenizer)
    out = []
    for m in markers.messages(text, default_role=default_role):
        content = unspecial(m["content"], tokenizer)
        out.append({"role": m["role"], "content": content})
    while out and out[-1]["role"] == "assistant" and not out[-1]["content"].strip():
        out.pop()
    return [m for m in out if m["content"].strip() or m["role"] != default_role]


def assistant_message(text: object, tokenizer: object, call_id_prefix: str = "call_"
                      ) -> tuple[dict[str, Any], list[str]]:
    """An OpenAI-style assistant message from generated text (markup removed, Hermes/Qwen
    ``<tool_call>`` blocks or a JSON tool call turned into ``tool_calls``), and parse problems.

    The message's values stay ``Any`` for the callers that read its ``tool_calls`` list
    (``ParsedMessage.tool_calls``) back out of it."""
    parsed: ParsedMessage = parse_tool_calls(clean(text, tokenizer, "assistant"), call_id_prefix)
    message: dict[str, object] = {"role": "assistant", "content": parsed.content}
    if parsed.tool_calls:
        message["tool_calls"] = parsed.tool_calls
    return message, list(parsed.errors)
