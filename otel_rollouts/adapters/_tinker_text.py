"""Readable messages from Tinker cookbook token ids, whatever tokenizer the cookbook hands out.

Two sources of a conversation's layout, in this order:

* the tokenizer's chat template (a Hugging Face tokenizer): role markers learned once by
  rendering sentinels (``decode.chat_roles``);
* the cookbook renderer, for tokenizers without a template (Inkling models:
  ``get_tokenizer`` returns ``TmlRenderersTokenizerAdapter``, with only ``encode``, ``decode``
  and the EOS): sentinel conversations are rendered with the renderer's public
  ``build_generation_prompt`` and decoded, which gives each role's header (its leading special
  token, then e.g. ``<|content_text|>`` or a tool's name and a content-kind token) and the end
  of a message. When only the tokenizer is given, the renderer is the one the cookbook itself
  recommends for ``tokenizer.name_or_path`` (``model_info.get_recommended_renderer_name``).

Special tokens come from the tokenizer (Hugging Face ``all_special_tokens`` and added tokens
flagged special; a tml-renderers tokenizer's ``special_tokens()``, decoded). The tags the tool
parser reads (``<tool_call>``, ``<tool_response>``...) are kept until tool calls and results are
parsed, even when the tokenizer marks them special; every other special token is removed from
what is shown. Nothing here lists a model's markup.
"""

from __future__ import annotations

import re
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass, field
from typing import Any

from otel_rollouts.adapters.kit import RoleMarkers, parse_tool_calls, tokenizer_info

__all__ = ["Layout"]

# the tags decode.toolcalls parses (Hermes/Qwen tool calls and results): kept until parsed
_TOOL_MARKUP = "<tool_call></tool_call><tool_response></tool_response>"
_S = {"system": "QZXSYSTEMSENTINEL", "user": "QZXUSERSENTINEL", "assistant": "QZXASSISTANTSENTINEL",
      "user2": "QZXUSERTWOSENTINEL", "tool": "QZXTOOLSENTINEL", "name": "qzxtoolnamesentinel"}
_ROLES = ("system", "user", "assistant", "tool")


def special_strings(tokenizer: object) -> tuple[str, ...]:
    """The tokenizer's special tokens as they appear in decoded text, longest first."""
    found: set[str] = set()
    if tokenizer is None:
        return ()
    try:
        found.update(tokenizer_info(tokenizer).special)
    except Exception:  # noqa: BLE001 - a tokenizer without the Hugging Face attributes
        pass
    tml = getattr(tokenizer, "tml_tokenizer", None)
    names = getattr(tml, "special_tokens", None)
    decode = getattr(tokenizer, "decode", None)  # without it, no name could be decoded
    if callable(names) and callable(decode) and tml is not None:  # tml-renderers: names; their decoded form is what a text holds
        try:
            for name in names():
                try:
                    found.add(str(decode([tml.encode_special(name)])))
                except Exception:  # noqa: BLE001 - one token that cannot be decoded
                    continue
        except Exception:  # noqa: BLE001
            pass
    return tuple(sorted((s for s in found if s and s.strip()), key=len, reverse=True))


@dataclass
class _Header:
    role: str
    pattern: re.Pattern[str]


@dataclass
class LearnedLayout:
    """Message headers and ends learned from a renderer's output."""

    headers: list[_Header] = field(default_factory=list)
    ends: tuple[str, ...] = ()
    starts: re.Pattern[str] | None = None

    def messages(self, text: str, default_role: str) -> list[dict[str, str]]:
        out: list[dict[str, str]] = []
        positions: list[tuple[int, int, str, str | None]] = []  # (start, content start, role, name)
        if self.starts is not None:
            for found in self.starts.finditer(text):
                for header in self.headers:
                    match = header.pattern.match(text, found.start())
                    if match:
                        name = match.groupdict().get("name")
                        positions.append((found.start(), match.end(), header.role, name or None))
                        break
        head_end = positions[0][0] if positions else len(text)
        if text[:head_end].strip():
            out.append({"role": default_role, "content": self.clean(text[:head_end])})
        for k, (_, begin, role, name) in enumerate(positions):
            end = positions[k + 1][0] if k + 1 < len(positions) else len(text)
            message = {"role": role, "content": self.clean(text[begin:end])}
            if name:
                message["name"] = name.strip()
            out.append(message)
        return out

    def clean(self, text: str) -> str:
        changed = True
        while changed:
            changed = False
            for end in self.ends:
                if end and text.endswith(end):
                    text, changed = text[: -len(end)], True
        return text


class Layout:
    """How one tokenizer (and renderer) lays out messages; see the module docstring."""

    def __init__(self, tokenizer: object, renderer: object = None) -> None:
        # duck-typed (Hugging Face's or tml-renderers' adapter: decode, name_or_path, eos_token),
        # handed on as the tokenizer of the cookbook's own renderer (get_renderer)
        self.tokenizer: Any = tokenizer
        self.special = special_strings(tokenizer)
        self.kept = tuple(s for s in self.special if s in _TOOL_MARKUP)  # parsed before removal
        self.removed = tuple(s for s in self.special if s not in self.kept)
        self.markers: RoleMarkers = RoleMarkers()
        self.learned: LearnedLayout | None = None
        self.source = "none"
        self.problem: str | None = None
        self.given = renderer
        self.renderer: object = None  # the renderer the layout was learned from, when it was
        try:
            self.markers = tokenizer_info(tokenizer).markers
        except Exception:  # noqa: BLE001 - a tokenizer without a chat template API
            self.markers = RoleMarkers()
        if self.markers.prefixes:
            self.source = "chat template"
            return
        renderer = renderer if renderer is not None else self._recommended_renderer()
        if renderer is not None:
            try:
                self.learned = learn_from_renderer(renderer, self.decode, self.special)
            except Exception as exc:  # noqa: BLE001 - a renderer that cannot render sentinels
                self.problem = f"rendering sentinel messages with {type(renderer).__name__} failed: {exc!r}"
            if self.learned is not None and self.learned.headers:
                self.source = "renderer"
                self.renderer = renderer
                return
            self.learned = None
            self.problem = self.problem or f"{type(renderer).__name__} output has no message headers"

    def _recommended_renderer(self) -> object:
        """The renderer the cookbook recommends for this tokenizer's model, or None."""
        name = getattr(self.tokenizer, "name_or_path", None)
        if not isinstance(name, str) or not name:
            self.problem = "the tokenizer has no chat template and no name_or_path; pass renderer="
            return None
        try:
            from tinker_cookbook import model_info, renderers  # the running cookbook

            return renderers.get_renderer(model_info.get_recommended_renderer_name(name), self.tokenizer)
        except Exception as exc:  # noqa: BLE001 - not a known model, or its renderer is missing
            self.problem = (f"the tokenizer has no chat template and the cookbook's renderer for "
                            f"{name!r} could not be built ({type(exc).__name__}: {exc}); pass renderer=")
            return None

    @property
    def understood(self) -> bool:
        return self.source != "none"

    def decode(self, ids: list[int]) -> str:
        return str(self.tokenizer.decode(list(ids), skip_special_tokens=False))

    def unspecial(self, text: str, keep_tool_tags: bool = False) -> str:
        for s in self.removed if keep_tool_tags else self.special:
            if s in text:
                text = text.replace(s, "")
        return text

    def messages(self, text: object, default_role: str = "user") -> list[dict[str, str]]:
        """The messages of a rendered text, tool tags kept (see ``finish``); the empty generation
        prompt at its end and empty default-role parts are left out."""
        if not isinstance(text, str):
            text = "" if text is None else str(text)
        if self.markers.prefixes:
            parts: list[dict[str, str]] = list(self.markers.messages(text, default_role=default_role))
        elif self.learned is not None:
            parts = self.learned.messages(text, default_role)
        else:
            parts = [{"role": default_role, "content": text}]
        out = [dict(m, content=self.unspecial(str(m["content"]), keep_tool_tags=True)) for m in parts]
        while out and out[-1]["role"] == "assistant" and not out[-1]["content"].strip() \
                and not out[-1].get("name"):
            out.pop()
        return [m for m in out if m["content"].strip() or m["role"] != default_role]

    def finish(self, messages: Sequence[Mapping[str, object]]) -> list[Mapping[str, object]]:
        """Messages with the tool tags removed too (once tool results were taken out)."""
        out: list[Mapping[str, object]] = []
        for m in messages:
            content = m.get("content")
            out.append(dict(m, content=self.unspecial(content)) if isinstance(content, str) else m)
        return out

    def assistant(self, text: str, call_id_prefix: str) -> tuple[dict[str, object], list[str]]:
        """An assistant message from generated text: tool calls parsed before special tokens are
        removed (``<tool_call>`` may be one of them), markup and end-of-turn removed."""
        if self.markers.prefixes:
            prefix = self.markers.prefixes.get("assistant")
            if prefix and text.startswith(prefix):
                text = text[len(prefix):]
            text = self.markers.clean(text)
            eos = getattr(self.tokenizer, "eos_token", None)
            if isinstance(eos, str) and eos and text.endswith(eos):
                text = text[: -len(eos)]
            text = self.unspecial(text, keep_tool_tags=True)
        else:
            parts = self.messages(text, default_role="assistant")
            text = "\n".join(str(m["content"]) for m in parts if m["content"].strip())
        parsed = parse_tool_calls(text, call_id_prefix)
        message: dict[str, object] = {"role": "assistant", "content": self.unspecial(parsed.content).strip()
                                   if not self.markers.prefixes else self.unspecial(parsed.content)}
        if parsed.tool_calls:
            message["tool_calls"] = parsed.tool_calls
        return message, list(parsed.errors)


# --- learning a renderer's layout -----------------------------------------------------------
def learn_from_renderer(renderer: object, decode: Callable[[list[int]], str],
                        special: tuple[str, ...]) -> LearnedLayout | None:
    """Headers and message ends of ``renderer``, from sentinel conversations it renders."""
    if not special:
        return None
    build = getattr(renderer, "build_generation_prompt", None)
    if not callable(build):  # as if it refused every layout (render would return None)
        return None

    def render(messages: list[dict[str, object]]) -> str | None:
        try:
            model_input = build(messages)
            return str(decode(model_input.to_ints()))
        except Exception:  # noqa: BLE001 - a layout this renderer refuses
            return None

    def between(text: str, a: str, b: str) -> str | None:
        if a not in text or b not in text:
            return None
        i, j = text.index(a) + len(a), text.index(b)
        return text[i:j] if i <= j else None

    one = render([{"role": "user", "content": _S["user"]}])
    two = render([{"role": "user", "content": _S["user"]}, {"role": "user", "content": _S["user2"]}])
    if one is None or two is None or _S["user"] not in one:
        return None
    head, tail = one[: one.index(_S["user"])], one[one.index(_S["user"]) + len(_S["user"]):]
    gap = between(two, _S["user"], _S["user2"])
    if gap is None:
        return None
    # gap = end of a user message + header of the next: the header starts with a special token
    # and is what the first message is preceded by; the end is what the last one is followed by
    split = None
    for i in range(len(gap), -1, -1):
        rest = gap[i:]
        if tail.startswith(gap[:i]) and head.endswith(rest) and rest.startswith(special):
            split = i
            break
    if split is None:
        return None
    end_user, header_user = gap[:split], gap[split:]
    generation = tail[len(end_user):]
    headers = {"user": header_user}
    ends = [end_user, generation]
    for role in ("assistant", "system"):  # a user message, this role's, another user message
        text = render([{"role": "user", "content": _S["user"]}, {"role": role, "content": _S[role]},
                       {"role": "user", "content": _S["user2"]}])
        before = between(text or "", _S["user"], _S[role])
        after = between(text or "", _S[role], _S["user2"])
        if before is not None and after is not None and before.startswith(end_user) and after.endswith(header_user):
            headers[role] = before[len(end_user):]
            ends.append(after[: len(after) - len(header_user)])
    tool = _tool_header(renderer, render, ends)
    if tool is not None:
        headers["tool"] = tool
    return _compile(headers, tuple(dict.fromkeys(e for e in ends if e)), special)


def _tool_header(renderer: object, render: Callable[[list[dict[str, object]]], str | None],
                 ends: list[str]) -> str | None:
    """The header of a tool result (with the tool's name where the renderer writes it)."""
    try:
        from tinker_cookbook.renderers.base import ToolCall  # the cookbook's own type

        call: object = ToolCall(function=ToolCall.FunctionBody(name=_S["name"], arguments="{}"), id="call_0")
    except Exception:  # noqa: BLE001 - an older cookbook: a plain mapping
        call = {"type": "function", "id": "call_0", "function": {"name": _S["name"], "arguments": "{}"}}
    messages: list[dict[str, object]] = [{"role": "user", "content": _S["user"]},
                                         {"role": "assistant", "content": "", "tool_calls": [call]}]
    before = render(messages)
    after = render(messages + [{"role": "tool", "content": _S["tool"], "tool_call_id": "call_0",
                                "name": _S["name"]}])
    if before is None or after is None or _S["tool"] not in after:
        return None
    n = 0
    for x, y in zip(before, after, strict=False):
        if x != y:
            break
        n += 1
    added = after[n: after.index(_S["tool"])]
    # the common part may end inside the previous message's end: take the header from its start
    for end in sorted((e for e in ends if e), key=len, reverse=True):
        pos = after.rfind(end, 0, after.index(_S["tool"]))
        if pos >= 0 and pos + len(end) <= n + len(added):
            candidate = after[pos + len(end): after.index(_S["tool"])]
            if candidate:
                return candidate
    return added or None


def _compile(headers: dict[str, str], ends: tuple[str, ...], special: tuple[str, ...]) -> LearnedLayout:
    """Header regexes: the leading special token (and the literal text after it, e.g. ChatML's
    ``user\\n``) identifies the role; a later special token is any special token (the content
    kind: text, thinking, tool call...), with an optional name before it (a tool's name)."""
    token = re.compile("|".join(re.escape(s) for s in special))
    any_special = "(?:" + "|".join(re.escape(s) for s in special) + ")"
    learned: list[_Header] = []
    starts: list[str] = []
    for role in ("tool", "system", "assistant", "user"):
        header = headers.get(role)
        if not header:
            continue
        first = token.match(header)
        if first is None:
            continue
        pieces = [p for p in re.split(f"({token.pattern})", header[first.end():]) if p]
        start = re.escape(first.group(0))
        body = ""
        literal = True  # text right after the leading token, before any other token: the role's
        named = False
        for piece in pieces:
            if token.fullmatch(piece):
                if not named:
                    body += r"(?P<name>[^\n]{0,64}?)"
                    named = True
                body += any_special
                literal = False
            elif _S["name"] in piece:
                continue  # the name group stands before the next token
            elif literal:
                start += re.escape(piece)
            else:
                body += re.escape(piece)
        starts.append(start)
        learned.append(_Header(role, re.compile(start + body, re.DOTALL)))
    learned.sort(key=lambda h: len(h.pattern.pattern), reverse=True)
    pattern = re.compile("|".join(sorted(set(starts), key=len, reverse=True))) if starts else None
    return LearnedLayout(learned, ends, pattern)
