"""Redaction of secrets in everything that leaves the process.

Where it runs: at **materialisation**, on the export thread, for kept episodes only. That is
the first point where recorded content is turned into text, and it comes before every way out of
the process: the exporters, the OTLP request, and the on-disk spool. Recording stays cheap
(the training thread never runs a regular expression) and a dropped episode, which is most of
them, costs nothing here. Every exported span is covered, ours and those of other
OpenTelemetry instrumentation inside an episode: attribute values (messages, tool arguments and
results, ``@otr.traced`` inputs/outputs, metadata, exception messages and stack traces) and
status descriptions lose the secret to ``[REDACTED]``; span names, attribute keys and event
names lose it to a stable placeholder ``[REDACTED:<8 hex>]`` (``Redactor.name``), so the tree
still reads and two redacted names stay two. Outside the spans: the resource, the library's own
log lines (``RedactingLogFilter``), log records exported by ``otr.instrument_logging`` and the
``config`` given to Trackio.

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

import hashlib
import hmac
import logging
import os
import re
import traceback
from collections.abc import Callable, Iterable, Mapping
from re import Pattern
from typing import Any

from otel_rollouts._core.content import reraise_interrupt

__all__ = ["DEFAULT_PATTERNS", "PLACEHOLDER_PREFIX", "REPLACEMENT", "RedactingLogFilter", "Redactor"]

REPLACEMENT = "[REDACTED]"
# a secret in a span name, an attribute key or an event name becomes "[REDACTED:<8 hex>]": the
# same secret gives the same placeholder within a process, so the span tree still reads
PLACEHOLDER_PREFIX = "[REDACTED:"
_NAME_CACHE = 4096  # distinct names/keys remembered per Redactor (names repeat on every span)

_KEY_WORDS = (
    r"password|passwd|passphrase|pwd|secret|client[_-]?secret|api[_-]?key|apikey|"
    r"access[_-]?key|secret[_-]?key|private[_-]?key|access[_-]?token|auth[_-]?token|"
    r"refresh[_-]?token|api[_-]?token|bot[_-]?token|session[_-]?token"
)

# a key (of an attribute, a config, a log record) that names a secret: its whole value is one
SECRET_KEY = (
    r"(?i)(?:^|[^a-z0-9])(?:password|passwd|passphrase|pwd|secret|api[_-]?key|apikey|access[_-]?key|"
    r"private[_-]?key|token|credentials?|authorization|cookie|set[_-]cookie)$"
)
_SECRET_KEY = re.compile(SECRET_KEY)

DEFAULT_PATTERNS: tuple[str, ...] = (
    # PEM private keys (RSA, EC, OPENSSH, ENCRYPTED …), whole block
    r"-----BEGIN [A-Z0-9 ]*PRIVATE KEY-----[\s\S]*?(?:-----END [A-Z0-9 ]*PRIVATE KEY-----|\Z)",
    # Authorization credentials
    r"(?i)\bbearer\s+(?P<secret>[A-Za-z0-9\-._~+/]{16,}=*)",
    # (also inside JSON text that was itself JSON-encoded: quotes escaped as \")
    r"(?i)\bauthorization\b(?:\\*[\"'])?\s*[:=]\s*(?:\\*[\"'])?(?:basic\s+|bearer\s+)?(?P<secret>[^\s\"'\\,;]{6,})",
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
        # the placeholder of a secret is keyed by a random key that never leaves the process:
        # stable within it, unlinkable across runs, and no dictionary attack on a short secret
        self._key = os.urandom(16)
        self._names: dict[str, str] = {}
        self._secret_keys: dict[str, bool] = {}

    def _secret_span(self, match: re.Match[str]) -> tuple[int, int]:
        """Where the secret of a match lies: its group named ``secret``, else all of it."""
        if "secret" in match.re.groupindex and match.group("secret") is not None:
            return match.span("secret")
        return match.span(0)

    def _sub(self, text: str, replace: Callable[[str], str]) -> str:
        def one(match: re.Match[str]) -> str:
            start, end = self._secret_span(match)
            whole, offset = match.group(0), match.start(0)
            if match.string.startswith((self.replacement, PLACEHOLDER_PREFIX), start):
                return whole  # redacted already (text redacted twice must read as once)
            return whole[: start - offset] + replace(match.string[start:end]) + whole[end - offset :]

        # most text holds none of the default patterns' literal parts: one scan rules them out
        if self.defaults and might_hold_secret(text):
            for pattern in self.defaults:
                text = pattern.sub(one, text)
        for pattern in self.extra:
            text = pattern.sub(one, text)
        return text

    def __call__(self, text: str) -> str:
        text = self._sub(text, lambda _secret: self.replacement)
        if self.callback is not None:
            try:
                result = self.callback(text)
                text = result if isinstance(result, str) else self.replacement
            except Exception:  # noqa: BLE001 - a broken callback must not let the text through
                text = self.replacement
        return text

    def placeholder(self, secret: str) -> str:
        """``[REDACTED:<8 hex>]``, the same for the same ``secret`` within this Redactor."""
        digest = hmac.new(self._key, secret.encode("utf-8", "surrogatepass"), hashlib.blake2s).hexdigest()
        return f"{PLACEHOLDER_PREFIX}{digest[:8]}]"

    def name(self, text: str) -> str:
        """A span name, attribute key or event name with each secret replaced by its placeholder.

        A name has to stay a distinct name (two redacted tool names must not merge into one, a
        redacted key must not overwrite another), hence a placeholder per secret rather than
        one replacement for all. The user's callback sees the name too; if it raises, the whole
        name becomes one placeholder.
        """
        known = self._names.get(text)
        if known is not None:
            return known
        clean = self._sub(text, self.placeholder)
        if self.callback is not None:
            try:
                result = self.callback(clean)
                clean = result if isinstance(result, str) else self.placeholder(text)
            except Exception:  # noqa: BLE001 - failing closed, as for values
                clean = self.placeholder(text)
        if len(self._names) >= _NAME_CACHE:
            self._names.clear()
        self._names[text] = clean
        return clean

    def secret_key(self, key: str) -> bool:
        """Whether ``key`` names a secret (``api_key``, ``db.password``, ``...authorization``):
        its value is replaced whole, whatever its shape (with the default patterns on)."""
        if not self.defaults:
            return False
        known = self._secret_keys.get(key)
        if known is None:
            if len(self._secret_keys) >= _NAME_CACHE:
                self._secret_keys.clear()
            known = self._secret_keys[key] = _SECRET_KEY.search(key) is not None
        return known

    def mapping(self, value: Any) -> Any:
        """A copy of a JSON-like value (a run's config, log attributes) with keys redacted as
        names, text as text, and the value of a key that names a secret replaced whole."""
        if isinstance(value, str):
            return self(value)
        if isinstance(value, Mapping):
            out = {}
            for k, v in value.items():
                secret = isinstance(k, str) and self.secret_key(k) and isinstance(v, (str, int, float)) \
                    and not isinstance(v, bool)
                out[self.name(k) if isinstance(k, str) else k] = self.replacement if secret else self.mapping(v)
            return out
        if isinstance(value, (list, tuple)):
            return [self.mapping(v) for v in value]
        return value


class RedactingLogFilter(logging.Filter):
    """Redacts a log record's message and traceback text in place (never rejects a record).

    On the library's own logger: its warnings may quote a refused value or an exception's
    message, and handlers (a console, an OTLP log exporter) must see only the redacted text.
    """

    def __init__(self, redactor: Callable[[str], str]) -> None:
        super().__init__()
        self.redactor = redactor

    def filter(self, record: logging.LogRecord) -> bool:
        try:
            message = self.redactor(record.getMessage())
            trace = None
            if record.exc_info and record.exc_info[1] is not None:
                trace = self.redactor("".join(traceback.format_exception(*record.exc_info)).rstrip("\n"))
            elif record.exc_text:
                trace = self.redactor(record.exc_text)
        except BaseException as exc:  # noqa: BLE001 - a message that cannot be redacted is not let through
            reraise_interrupt(exc)
            message, trace = f"{record.name}: a log message that could not be redacted was left out", None
        record.msg, record.args = message, None
        # the formatter prints exc_text as it is and formats exc_info only when exc_text is empty
        record.exc_info, record.exc_text = None, trace
        return True


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
