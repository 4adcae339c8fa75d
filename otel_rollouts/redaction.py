"""Redaction of secrets in captured content, before anything leaves the process.

Where it runs: at **materialisation**, on the export thread, for kept episodes only. That is
the first point where recorded content is turned into text, and it comes before every way out of
the process: the exporters, the OTLP request, and the on-disk spool. Recording stays cheap
(the training thread never runs a regular expression) and a dropped episode, which is most of
them, costs nothing here. Every string attribute of every exported span is redacted: messages,
tool arguments and results, inputs/outputs of ``@otr.traced``, metadata, exception messages and
span status descriptions, and the string attributes of spans made by other OpenTelemetry
instrumentation inside an episode.

What is found by default (``DEFAULT_PATTERNS``): PEM private keys; ``Bearer``/``Basic``
credentials; well-known API key shapes (OpenAI/Anthropic ``sk-``, Hugging Face ``hf_``, GitHub
``ghp_``…, AWS ``AKIA``…, Google ``AIza``…, Slack ``xox?-``, JWTs); the value after
``password``/``secret``/``api_key``/``token``-like keys (``key=value``, ``key: value`` and JSON
``"key": "value"``); and the password in ``scheme://user:password@host`` URLs.

Redaction is pattern-based and therefore best effort: a secret in no recognisable shape is not
found. Add ``patterns`` (regular expressions: the whole match, or its group named ``secret``,
is replaced) and/or a ``callback(text) -> text`` for your own, or turn content capture off
(``capture_content=False``), which records no prompt, completion, argument or result at all.
"""

from __future__ import annotations

import re
from collections.abc import Callable, Iterable
from re import Pattern

__all__ = ["DEFAULT_PATTERNS", "REPLACEMENT", "Redactor"]

REPLACEMENT = "[REDACTED]"

_KEY_WORDS = (
    r"password|passwd|passphrase|pwd|secret|client[_-]?secret|api[_-]?key|apikey|"
    r"access[_-]?key|secret[_-]?key|private[_-]?key|access[_-]?token|auth[_-]?token|"
    r"refresh[_-]?token|api[_-]?token|bot[_-]?token|session[_-]?token"
)

DEFAULT_PATTERNS: tuple[str, ...] = (
    # PEM private keys (RSA, EC, OPENSSH, ENCRYPTED …), whole block
    r"-----BEGIN [A-Z0-9 ]*PRIVATE KEY-----[\s\S]*?(?:-----END [A-Z0-9 ]*PRIVATE KEY-----|\Z)",
    # Authorization credentials
    r"(?i)\bbearer\s+(?P<secret>[A-Za-z0-9\-._~+/]{16,}=*)",
    r"(?i)\bauthorization\b[\"']?\s*[:=]\s*[\"']?(?:basic\s+|bearer\s+)?(?P<secret>[^\s\"',;]{6,})",
    # well-known key shapes
    r"\bsk-(?:ant-|proj-|live-|test-)?[A-Za-z0-9_\-]{16,}",
    r"\bhf_[A-Za-z0-9]{20,}",
    r"\bgh[pousr]_[A-Za-z0-9]{20,}",
    r"\bgithub_pat_[A-Za-z0-9_]{20,}",
    r"\b(?:AKIA|ASIA)[0-9A-Z]{16}\b",
    r"\bAIza[0-9A-Za-z\-_]{35}",
    r"\bxox[abposr]-[A-Za-z0-9\-]{10,}",
    r"\beyJ[A-Za-z0-9_\-]{8,}\.[A-Za-z0-9_\-]{8,}\.[A-Za-z0-9_\-]{8,}",
    # key = value, key: value, "key": "value" (the key is kept, the value replaced)
    # (also inside JSON text that was itself JSON-encoded: quotes escaped as \")
    r"(?i)\b(?:" + _KEY_WORDS + r")\b(?:\\*[\"'])?\s*[:=]\s*(?:\\*[\"'])?(?P<secret>[^\s\"'\\,;}\]]{3,})",
    # passwords in URLs
    r"(?i)\b[a-z][a-z0-9+.\-]*://[^\s/:@]+:(?P<secret>[^\s/@]+)@",
)

# A literal every default pattern needs (checked by tests/test_security.py): text without any of
# them (compared lower-cased) cannot match a default pattern, so the patterns run only on text
# that has one. Substring tests run at C speed; a regular expression alternation would not.
_TRIGGERS = (
    "begin", "bearer", "authorization", "sk-", "hf_", "ghp_", "gho_", "ghu_", "ghs_", "ghr_",
    "github_pat_", "akia", "asia", "aiza", "xox", "eyj", "passw", "passphrase", "pwd", "secret",
    "apikey", "api_key", "api-key", "accesskey", "access_key", "access-key", "privatekey",
    "private_key", "private-key", "token", "://",
)


def might_hold_secret(text: str) -> bool:
    """False only when no default pattern can match ``text``."""
    lowered = text.lower()
    return any(literal in lowered for literal in _TRIGGERS)


class Redactor:
    """Replaces secrets in text. Callable: ``Redactor()(text) -> text``.

    ``patterns``: extra regular expressions (strings or compiled); ``defaults``: also use
    ``DEFAULT_PATTERNS``; ``callback``: a final ``text -> text`` function of the user's (if it
    raises, the text is replaced entirely: failing closed, never open).
    """

    def __init__(
        self,
        patterns: Iterable[str | Pattern[str]] = (),
        *,
        defaults: bool = True,
        callback: Callable[[str], str] | None = None,
        replacement: str = REPLACEMENT,
    ) -> None:
        self.defaults = [re.compile(p) for p in DEFAULT_PATTERNS] if defaults else []
        self.extra = [p if isinstance(p, re.Pattern) else re.compile(p) for p in patterns]
        self.patterns = [*self.defaults, *self.extra]
        self.callback = callback
        self.replacement = replacement

    def _replace(self, match: re.Match[str]) -> str:
        if "secret" in match.re.groupindex and match.group("secret") is not None:
            start, end = match.span("secret")
            whole = match.group(0)
            offset = match.start(0)
            return whole[: start - offset] + self.replacement + whole[end - offset :]
        return self.replacement

    def __call__(self, text: str) -> str:
        # most text holds none of the default patterns' literal parts: one scan rules them out
        if self.defaults and might_hold_secret(text):
            for pattern in self.defaults:
                text = pattern.sub(self._replace, text)
        for pattern in self.extra:
            text = pattern.sub(self._replace, text)
        if self.callback is not None:
            try:
                result = self.callback(text)
                text = result if isinstance(result, str) else self.replacement
            except Exception:  # noqa: BLE001 - a broken callback must not let the text through
                text = self.replacement
        return text


def make_redactor(
    redact: bool | Callable[[str], str] | Redactor | None,
    patterns: Iterable[str | Pattern[str]] = (),
) -> Redactor | None:
    """configure()'s ``redact``/``redact_patterns`` → a Redactor (None when turned off)."""
    if isinstance(redact, Redactor):
        return redact
    if redact is False:
        return Redactor(patterns, defaults=False) if patterns else None
    if callable(redact):
        return Redactor(patterns, callback=redact)
    return Redactor(patterns)
