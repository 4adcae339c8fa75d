"""Role markers learned from a tokenizer's chat template, to split decoded text into messages.

The template is rendered once with sentinel contents; the text around the sentinels gives each
role's prefix (``<|im_start|>user\\n``) and the end-of-message suffix (``<|im_end|>\\n``). No
template-specific code: ChatML, Llama 3 and similar templates all work the same way. A template
that cannot be rendered simply yields no markers (then a prompt is one user message).
"""

from __future__ import annotations

import re
from dataclasses import dataclass, field

__all__ = ["RoleMarkers", "learn_markers"]

_S = {"system": "QZXSYSTEMSENTINEL", "user": "QZXUSERSENTINEL", "assistant": "QZXASSISTANTSENTINEL",
      "user2": "QZXUSERTWOSENTINEL"}


@dataclass
class RoleMarkers:
    """Prefixes by role, end-of-message suffixes, and a regex finding any prefix."""

    prefixes: dict[str, str] = field(default_factory=dict)
    suffixes: tuple[str, ...] = ()
    strip: tuple[str, ...] = ()  # strings removed at the edges of a message (e.g. the BOS)
    _pattern: re.Pattern | None = None

    def __post_init__(self) -> None:
        if self.prefixes:
            alternatives = [re.escape(p) for p in sorted(self.prefixes.values(), key=len, reverse=True)]
            # any other role the template renders the same way (tool, ipython, environment...):
            # the user prefix with the role name in place of "user"
            user = self.prefixes.get("user", "")
            if user.count("user") == 1:
                head, tail = user.split("user")
                if head.strip():  # a real marker around the name, not a bare word
                    alternatives.append(re.escape(head) + r"(?P<role>[A-Za-z_][A-Za-z0-9_-]{0,31})" + re.escape(tail))
            self._pattern = re.compile("|".join(alternatives))
        self._role_of = {p: r for r, p in self.prefixes.items()}

    def clean(self, text: str) -> str:
        """Remove end-of-message suffixes and edge markers at both ends of ``text``."""
        changed = True
        while changed:
            changed = False
            for s in self.suffixes + self.strip:
                if s and text.endswith(s):
                    text, changed = text[: -len(s)], True
                if s and text.startswith(s):
                    text, changed = text[len(s) :], True
        return text

    def split(self, text: str) -> list[tuple[str | None, str]]:
        """``[(role, content)]`` in order; text before any marker has role None."""
        if self._pattern is None:
            return [(None, self.clean(text))]
        out: list[tuple[str | None, str]] = []
        pos = 0
        role: str | None = None
        for match in self._pattern.finditer(text):
            out.append((role, self.clean(text[pos : match.start()])))
            role = self._role_of.get(match.group(0)) or match.group("role")
            pos = match.end()
        out.append((role, self.clean(text[pos:])))
        return [(r, t) for r, t in out if r is not None or t.strip()]

    def messages(self, text: str, default_role: str = "user") -> list[dict[str, str]]:
        """Messages of a templated text; an empty trailing generation prompt is left out."""
        parts = self.split(text)
        out = [{"role": role or default_role, "content": content} for role, content in parts]
        if out and out[-1]["role"] == "assistant" and not out[-1]["content"].strip():
            out.pop()
        return out


def _render(tokenizer: object, roles: list[str]) -> str | None:
    messages = [{"role": "user" if r == "user2" else r, "content": _S[r]} for r in roles]
    apply_chat_template = getattr(tokenizer, "apply_chat_template", None)
    if not callable(apply_chat_template):
        return None
    try:
        text = apply_chat_template(messages, tokenize=False, add_generation_prompt=False)
    except Exception:  # noqa: BLE001 - any template error: no markers from this layout
        return None
    if not isinstance(text, str) or any(_S[r] not in text for r in roles):
        return None
    return text


def _common_prefix(a: str, b: str) -> str:
    n = 0
    for x, y in zip(a, b, strict=False):
        if x != y:
            break
        n += 1
    return a[:n]


def learn_markers(tokenizer: object) -> RoleMarkers:
    """Markers of ``tokenizer``'s chat template (empty markers when it has none or it fails)."""
    if not getattr(tokenizer, "chat_template", None):
        return RoleMarkers()
    bos = getattr(tokenizer, "bos_token", None)
    strip = (bos,) if isinstance(bos, str) and bos else ()
    for roles in (["system", "user", "assistant", "user2"], ["user", "assistant", "user2"]):
        text = _render(tokenizer, roles)
        if text is None:
            continue
        ends = {r: text.index(_S[r]) + len(_S[r]) for r in roles}
        starts = {r: text.index(_S[r]) for r in roles}
        suffix = text[ends["user2"] :]  # the template's end of a user message
        gap_ua = text[ends["user"] : starts["assistant"]]  # user suffix + assistant prefix
        gap_au = text[ends["assistant"] : starts["user2"]]  # assistant suffix + user prefix
        if not suffix:
            suffix = _common_prefix(gap_ua, gap_au)
        if not gap_ua.startswith(suffix):
            continue
        prefix_assistant = gap_ua[len(suffix) :]
        user_gap = text[ends["system"] : starts["user"]] if "system" in roles else None
        if user_gap is not None and user_gap.startswith(suffix):
            prefix_user = user_gap[len(suffix) :]
        else:
            prefix_user = _longest_tail_in(gap_au, text[: starts["user"]])
        if not prefix_user or not prefix_assistant:
            continue
        prefixes = {"user": prefix_user, "assistant": prefix_assistant}
        system_prefix = prefix_user.replace("user", "system")
        if system_prefix != prefix_user and system_prefix in text[: starts.get("system", starts["user"])]:
            prefixes["system"] = system_prefix
        suffixes = tuple(dict.fromkeys(s for s in (suffix, suffix.strip()) if s))
        return RoleMarkers(prefixes, suffixes, strip)
    return RoleMarkers()


def _longest_tail_in(gap: str, head: str) -> str:
    """The longest tail of ``gap`` that ``head`` ends with (the user prefix, seen twice)."""
    for i in range(len(gap)):
        if head.endswith(gap[i:]):
            return gap[i:]
    return ""
