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

Long text is read only as far as it can be shown (``Redactor.bounded``): a text that the
attribute limit will cut is cut first to its head and tail, each ``REDACT_MARGIN`` characters
longer than what can be kept, then redacted, so that a 1 MB message costs what 16 KB do. A secret
whose match is at most that margin long is redacted wherever it lies, across the cut included; a
PEM private key of any length too (that pattern alone reads the whole text, at C speed). Only
the patterns whose literal parts one scan of the text finds run on it.

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

from otel_rollouts._core.content import removed_chars, reraise_interrupt, text_cut_marker

__all__ = [
    "DEFAULT_PATTERNS",
    "PLACEHOLDER_PREFIX",
    "REPLACEMENT",
    "RedactingLogFilter",
    "Redactor",
    "SdkLogFilter",
    "redact_sdk_logs",
]

REPLACEMENT = "[REDACTED]"
# a secret in a span name, an attribute key or an event name becomes "[REDACTED:<8 hex>]": the
# same secret gives the same placeholder within a process, so the span tree still reads
PLACEHOLDER_PREFIX = "[REDACTED:"
_NAME_CACHE = 4096  # distinct names/keys remembered per Redactor (names repeat on every span)
# Redactor.bounded: how far beyond what a cut keeps the patterns still read (the longest secret
# that is redacted wherever it lies relative to the cut; JWTs and keys are far shorter), and the
# fewest characters worth cutting out
REDACT_MARGIN = 4096
_MIN_CUT = 64

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

# The literals each default pattern needs (in DEFAULT_PATTERNS' order; checked by
# tests/test_security.py and tests/delivery/test_render_bounds.py): text without any of a pattern's
# literals (compared case-folded, see _folded) cannot match that pattern, so a pattern runs only on
# text that holds one of its own. One scan finds them all (_trigger_mask); most text holds none.
_PATTERN_TRIGGERS: tuple[tuple[str, ...], ...] = (
    ("-----begin ",),
    ("bearer",),
    ("authorization",),
    ("sk-",),
    ("hf_",),
    ("ghp_", "gho_", "ghu_", "ghs_", "ghr_"),
    ("github_pat_",),
    ("akia", "asia"),
    ("aiza",),
    ("xox",),
    ("eyj",),
    ("passw", "passphrase", "pwd", "secret", "apikey", "api_key", "api-key", "accesskey", "access_key",
     "access-key", "privatekey", "private_key", "private-key", "token"),
    ("://",),
)
_TRIGGERS = tuple(dict.fromkeys(t for triggers in _PATTERN_TRIGGERS for t in triggers))
# trigger literal -> bit mask of the default patterns that need it
_TRIGGER_BITS: dict[str, int] = {}
for _index, _triggers in enumerate(_PATTERN_TRIGGERS):
    for _literal in _triggers:
        _TRIGGER_BITS[_literal] = _TRIGGER_BITS.get(_literal, 0) | (1 << _index)
_ALL_PATTERNS = (1 << len(_PATTERN_TRIGGERS)) - 1
# the characters that a case-insensitive pattern matches to an ASCII letter of a literal but that
# str.lower() does not turn into it (re's IGNORECASE: 'ſ' ~ 's', 'ı' and 'İ' ~ 'i')
_FOLD = {0x17F: "s", 0x131: "i", 0x130: "i"}


def _folded(text: str) -> str:
    """``text`` lower-cased the way the patterns' IGNORECASE compares the trigger literals."""
    return text.lower() if text.isascii() else text.translate(_FOLD).lower()


def _mask_by_substrings(folded: str) -> int:
    """The trigger mask by one C substring search per literal (the fallback scan)."""
    mask = 0
    for literal, bits in _TRIGGER_BITS.items():
        if literal in folded:
            mask |= bits
    return mask


def _aho_corasick() -> Callable[[str], int] | None:
    """The trigger mask by one pass of pyahocorasick's automaton over the text, or None when the
    package cannot be imported (a platform without its wheel): the substring scan then stands in.

    Measured by ``benchmarks/bench_render.py``: 2.5-3x faster than 31 substring searches on
    text of a few KB, 7x on short strings; a regular expression alternation of the literals is
    10x slower than the substring searches."""
    try:
        import ahocorasick  # type: ignore[import-not-found, import-untyped, unused-ignore]

        automaton = ahocorasick.Automaton()
        for literal, bits in _TRIGGER_BITS.items():
            automaton.add_word(literal, bits)
        automaton.make_automaton()
        iterate = automaton.iter
    except Exception:  # noqa: BLE001 - any failure of an optional accelerator: the fallback works
        return None

    def mask(folded: str) -> int:
        found = 0
        for _end, bits in iterate(folded):
            found |= bits
            if found == _ALL_PATTERNS:
                break
        return found

    return mask


_scan_folded: Callable[[str], int] = _aho_corasick() or _mask_by_substrings


def _trigger_mask(text: str) -> int:
    """Bit ``i`` set: ``text`` holds a literal that ``DEFAULT_PATTERNS[i]`` needs."""
    return _scan_folded(_folded(text))


def might_hold_secret(text: str) -> bool:
    """False only when no default pattern can match ``text``."""
    return _trigger_mask(text) != 0


# PEM private keys (DEFAULT_PATTERNS[0]), the one default pattern that spans lines and has no
# length bound: Redactor.bounded runs it on the whole text, which costs one C-speed search for this
# header where there is none
_PEM_BEGIN = "-----BEGIN "


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

    def _one(self, replace: Callable[[str], str]) -> Callable[[re.Match[str]], str]:
        """What replaces one match: its secret (see ``_secret_span``) by ``replace(secret)``."""
        def one(match: re.Match[str]) -> str:
            start, end = self._secret_span(match)
            whole, offset = match.group(0), match.start(0)
            if match.string.startswith((self.replacement, PLACEHOLDER_PREFIX), start):
                return whole  # redacted already (text redacted twice must read as once)
            return whole[: start - offset] + replace(match.string[start:end]) + whole[end - offset :]

        return one

    def _sub(self, text: str, replace: Callable[[str], str]) -> str:
        return self._scan(text, replace)[0]

    def _scan(self, text: str, replace: Callable[[str], str], track: int | None = None,
              tail: bool = False) -> tuple[str, int]:
        """``text`` with every pattern's secrets replaced, and where position ``track`` of the
        input lies in the output (0 when not tracked).

        A match that straddles ``track`` belongs whole to the head (``tail=False``: the tracked
        position moves to the end of its replacement) or whole to the tail (``tail=True``: to its
        start), so that cutting the output there never splits a replaced secret.
        """
        pos = track
        shift = 0
        moved: int | None = None
        base = self._one(replace)

        def one(match: re.Match[str]) -> str:
            nonlocal shift, moved
            out = base(match)
            if pos is not None and moved is None:
                first, last = match.span(0)
                if last <= pos:
                    shift += len(out) - (last - first)
                elif first < pos:
                    moved = first + shift + (0 if tail else len(out))
            return out

        def run(pattern: Pattern[str], current: str) -> str:
            nonlocal pos, shift, moved
            shift, moved = 0, None
            result = pattern.sub(one, current)
            if pos is not None:
                pos = moved if moved is not None else pos + shift
            return result

        if self.defaults:
            # most text holds none of the default patterns' literal parts: one scan rules them
            # out, and a pattern runs only on text that holds one of its own literals
            mask = _trigger_mask(text)
            if mask:
                for index, pattern in enumerate(self.defaults):
                    if mask >> index & 1:
                        result = run(pattern, text)
                        if result is not text and result != text:
                            text = result
                            mask = _trigger_mask(text)  # what is left to find in the new text
        for pattern in self.extra:
            text = run(pattern, text)
        return text, pos if pos is not None else 0

    def _finish(self, text: str) -> str:
        """The user's callback, last (if it raises, the text is replaced: failing closed)."""
        if self.callback is not None:
            try:
                result = self.callback(text)
                text = result if isinstance(result, str) else self.replacement
            except Exception:  # noqa: BLE001 - a broken callback must not let the text through
                text = self.replacement
        return text

    def _replacement(self, _secret: str) -> str:
        return self.replacement

    def __call__(self, text: str) -> str:
        return self._finish(self._sub(text, self._replacement))

    def bounded(self, text: str, keep: int, margin: int = REDACT_MARGIN) -> str:
        """``text`` redacted, reading only what a cut to ``keep`` characters a side can show.

        For text that the caller then cuts, keeping at most ``keep`` characters of its head and
        as many of its tail: the patterns run on the head and the tail, each ``margin``
        characters longer than what is kept, and the output is the redacted head, a
        ``…[N chars cut]…`` marker (N: the characters of the input left out) and the redacted
        tail. The cost is bounded by ``keep`` and ``margin``, not by the length of ``text``.

        What is promised, against redacting the whole text: every secret whose match is at
        most ``margin`` characters long is redacted wherever it lies, across the cut included;
        a PEM private key block is redacted whatever its length (that one pattern runs on the
        whole text: one C-speed search for its header); a longer secret that crosses where the
        head or the tail is read from is redacted when the part read still has its pattern's
        shape. When redaction shortens the head or the tail below ``keep`` characters, more of
        it is read (twice as much each time, the whole text at last), so that a cut keeps what
        it kept of the whole text. The user's callback sees the cut text.
        """
        replace = self._replacement
        if self.defaults and _PEM_BEGIN in text:  # whole blocks, however long, as before
            text = self.defaults[0].sub(self._one(replace), text)
        n = len(text)
        if keep <= 0 or n <= 2 * (keep + margin) + _MIN_CUT:
            return self(text)
        head_keep = keep
        while True:
            if head_keep + keep + 2 * margin + _MIN_CUT >= n:
                return self(text)
            head, at = self._scan(text[: head_keep + margin], replace, head_keep)
            if at >= keep:
                head = head[:at]
                break
            head_keep *= 2  # redaction shortened the head below what a cut may keep: read more
        tail_keep = keep
        while True:
            if head_keep + tail_keep + 2 * margin + _MIN_CUT >= n:
                return self(text)
            tail, at = self._scan(text[n - tail_keep - margin :], replace, margin, tail=True)
            if len(tail) - at >= keep:
                tail = tail[at:]
                break
            tail_keep *= 2
        marker = text_cut_marker(removed_chars(text, head_keep, n - tail_keep))
        return self._finish(head + marker + tail)

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


# The OpenTelemetry SDK's own log lines (logger names ``opentelemetry.*``) quote what it was
# given: the gRPC exporter prints its endpoint without the scheme (``user:password@host:4317``,
# which DEFAULT_PATTERNS' URL pattern does not see), and a mistyped OTEL_EXPORTER_OTLP_HEADERS
# item is printed whole by ``opentelemetry.util.re``.
SDK_LOGGER = "opentelemetry"
_HEADER_LOGGER = "opentelemetry.util.re"
_USERINFO = re.compile(r"(?<![\w.+\-])(?P<user>[^\s/:@'\"\[\]]+):(?P<secret>[^\s/@'\"]+)@(?=[\w.\-\[])")


def _userinfo_out(text: str) -> str:
    return _USERINFO.sub(lambda m: f"{m.group('user')}:{REPLACEMENT}@", text)


class SdkLogFilter(RedactingLogFilter):
    """``RedactingLogFilter`` for the OpenTelemetry SDK's loggers: the run's redactor, plus the
    password of a scheme-less ``user:password@host`` (how the gRPC exporter prints its
    endpoint), and the header text of ``opentelemetry.util.re``'s warnings left out whole (a
    header in OTEL_EXPORTER_OTLP_HEADERS is a credential whatever its shape)."""

    def __init__(self, redactor: Callable[[str], str]) -> None:
        super().__init__(lambda text: _userinfo_out(redactor(text)))

    def filter(self, record: logging.LogRecord) -> bool:
        if record.name == _HEADER_LOGGER and record.args:
            try:
                record.args = tuple(REPLACEMENT for _ in record.args) if isinstance(record.args, tuple) else None
            except Exception:  # noqa: BLE001 - never stop a log record
                record.args = None
        return super().filter(record)


def _sdk_loggers() -> list[logging.Logger]:
    names = [name for name in list(logging.Logger.manager.loggerDict)
             if name == SDK_LOGGER or name.startswith(SDK_LOGGER + ".")]
    return [logging.getLogger(name) for name in dict.fromkeys([SDK_LOGGER, *names])]


def redact_sdk_logs(redactor: Callable[[str], str] | None) -> None:
    """Pass the OpenTelemetry SDK's log records through ``redactor`` (``SdkLogFilter`` on the
    ``opentelemetry`` logger and every ``opentelemetry.*`` logger that exists now: a filter on a
    parent logger does not see its children's records); ``None`` removes ours. Call it when a
    run is installed (after its exporters are built, so that their modules' loggers exist) and
    with ``None`` at shutdown. A logger first created later (a module imported after
    ``configure()``) is covered from the next call. Never raises."""
    try:
        for log in _sdk_loggers():
            for old in [f for f in log.filters if isinstance(f, SdkLogFilter)]:
                log.removeFilter(old)
            if redactor is not None:
                log.addFilter(SdkLogFilter(redactor))
    except Exception:  # noqa: BLE001 - logging set-up must not stop configure() or shutdown()
        pass


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
