"""A kept episode's render cost bounded by the limits, not by the input.

Long text is cut to what the attribute limit can show (its head and tail) before it is redacted,
JSON-encoded and copied into the views; the redaction reads a margin beyond what is kept. These
tests hold that to two things: what a cut keeps is what it kept when the whole text was
redacted first, and no fragment of a secret that the whole-text redaction catches is ever in
what is kept, for every default pattern, at every offset, across the cut included.
"""

from __future__ import annotations

import copy
import json
import random
import re
import string
from typing import Any

import pytest
from hypothesis import HealthCheck, assume, given, settings
from hypothesis import strategies as hst
from profiles import examples

import otel_rollouts as otr
from otel_rollouts import conventions as c
from otel_rollouts._core import redaction
from otel_rollouts._core.content import cut, precut, text_cut_marker
from otel_rollouts._core.redaction import DEFAULT_PATTERNS, REPLACEMENT, Redactor
from otel_rollouts.delivery.materialize import Materializer

_PRINTABLE = hst.characters(codec="utf-8", exclude_categories=("Cc", "Cs"))
_MARKER = re.compile(r"…\[\d+ chars cut\]…")

# small sizes, so that hypothesis places secrets everywhere in a text that is cut
KEEP, MARGIN = 120, 300
LENGTH = 2 * (KEEP + MARGIN) + 1500
LIMIT = 2 * KEEP  # the most a later cut may keep of a text bounded to KEEP a side
# where the text is cut (KEEP), read up to (KEEP + MARGIN), and the same from the end
_ANCHORS = (0, KEEP, KEEP + MARGIN, LENGTH // 2, LENGTH - KEEP - MARGIN, LENGTH - KEEP, LENGTH)


def _uncounted(text: str) -> str:
    """``text`` with the counts of its cut markers left out (a count is "about": the middle of
    a bounded text is never redacted, so it counts the input's characters)."""
    return _MARKER.sub("…[N chars cut]…", text)


def _kept(text: str, limit: int = LIMIT) -> str:
    """What a cut to ``limit`` keeps of ``text``, counts left out."""
    return _uncounted(cut(text, limit)[0])


def _secret_of(pattern: str, text: str) -> tuple[str, str, str]:
    """(before, secret, after): the secret of a text that ``pattern`` matches whole."""
    match = re.fullmatch(pattern, text)
    assert match is not None
    if "secret" in match.re.groupindex and match.group("secret") is not None:
        start, end = match.span("secret")
    else:
        start, end = 0, len(text)
    return text[:start], text[start:end], text[end:]


def _fragments(secret: str, size: int = 8) -> set[str]:
    return {secret[i:i + size] for i in range(max(len(secret) - size + 1, 1))}


def _without_placeholders(text: str) -> str:
    """``text`` with what redaction and cutting write replaced by a separator."""
    return _MARKER.sub("\x00", text).replace(REPLACEMENT, "\x00")


def _planted(filler: str, at: int, planted: str, length: int = LENGTH) -> str:
    base = (filler * (length // len(filler) + 1))[:length]
    return base[:at] + planted + base[at + len(planted):]


@pytest.mark.parametrize("index", range(len(DEFAULT_PATTERNS)))
def test_a_secret_of_every_default_pattern_is_redacted_wherever_it_lies_relative_to_the_cut(index: int) -> None:
    pattern = DEFAULT_PATTERNS[index]
    redactor = Redactor()

    @settings(max_examples=examples(300), deadline=None, suppress_health_check=list(HealthCheck))
    @given(
        hst.from_regex(pattern, fullmatch=True, alphabet=_PRINTABLE),
        hst.sampled_from(_ANCHORS),
        hst.one_of(hst.integers(-60, 10), hst.integers(-MARGIN, 40)),  # mostly across the anchor
        hst.sampled_from([" ", "\n", " \n  "]),
    )
    def check(planted: str, anchor: int, delta: int, filler: str) -> None:
        before, secret, after = _secret_of(pattern, planted)
        assume(len(secret) >= 4 and len(planted) <= MARGIN)
        fragments = _fragments(secret, min(len(secret), 8))
        assume(not any(f in f"{before}\x00{after}\x00{REPLACEMENT}\x00{text_cut_marker(LENGTH)}" for f in fragments))
        at = min(max(anchor + delta, 0), LENGTH - len(planted))
        text = _planted(filler, at, planted)
        whole = redactor(text)
        assume(secret not in whole)  # what the whole-text redaction catches (not a look-alike beside it)
        bounded = redactor.bounded(text, KEEP, MARGIN)
        read = _without_placeholders(bounded)
        assert not any(f in read for f in fragments), (at, planted, bounded)
        assert _kept(bounded) == _kept(whole), (at, planted)

    check()


@settings(max_examples=examples(120), deadline=None, suppress_health_check=list(HealthCheck))
@given(
    hst.integers(8, 4 * MARGIN),  # the block's body, longer than the margin too
    hst.integers(0, LENGTH),
    hst.booleans(),
    hst.randoms(use_true_random=False),
)
def test_a_pem_private_key_of_any_length_is_redacted_across_the_cut(size: int, at: int, closed: bool,
                                                                      rng: random.Random) -> None:
    alphabet = string.ascii_letters + string.digits + "+/"
    body = "\n".join("".join(rng.choice(alphabet) for _ in range(64)) for _ in range(size // 64 + 1))[:size]
    block = f"-----BEGIN RSA PRIVATE KEY-----\n{body}\n" + ("-----END RSA PRIVATE KEY-----" if closed else "")
    length = LENGTH + len(block)
    at = min(at, length - len(block))
    text = _planted(" ", at, block, length)
    redactor = Redactor()
    whole = redactor(text)
    bounded = redactor.bounded(text, KEEP, MARGIN)
    read = _without_placeholders(bounded)
    assert not any(f in read for f in _fragments(body.replace("\n", "")[:size] or body)), (at, size, closed)
    assert not any(line in read for line in body.split("\n") if len(line) >= 8)
    assert "PRIVATE KEY" not in read
    assert _kept(bounded) == _kept(whole)


def test_a_key_longer_than_the_margin_is_redacted_where_its_head_is_read() -> None:
    """The documented case beyond the promise: a secret longer than the margin, crossing where
    the head is read up to, is still redacted when the part read has its pattern's shape."""
    redactor = Redactor()
    key = "sk-" + "A1b2C3d4" * (MARGIN // 4)  # 2 x margin
    for at in (0, KEEP - 50, KEEP - 5, KEEP + MARGIN - 30):
        text = _planted(" ", at, key)
        bounded = redactor.bounded(text, KEEP, MARGIN)
        assert "A1b2C3d4" not in bounded, at
        assert _kept(bounded) == _kept(redactor(text))


def test_redaction_that_shortens_the_head_reads_more_of_it() -> None:
    """Keys that redaction shortens, packed at the head: what a cut keeps stays what it kept."""
    redactor = Redactor()
    keys = " ".join(f"sk-{i:04d}" + "x" * 60 for i in range(40))  # 40 x 67 characters -> 40 x 10
    text = keys + " " + "tail words " * 400
    bounded = redactor.bounded(text, KEEP, MARGIN)
    assert "xxxxxxxx" not in bounded
    assert _kept(bounded) == _kept(redactor(text))
    assert len(bounded) < len(text) // 2  # and it was still cut


def test_the_callback_and_extra_patterns_apply_to_the_bounded_text() -> None:
    redactor = Redactor([r"internal-\d{6}"], callback=lambda t: t.replace("zebra", "[animal]"))
    text = "zebra internal-123456 " + "words " * 1000 + " internal-654321 zebra"
    bounded = redactor.bounded(text, KEEP, MARGIN)
    assert "internal-" not in bounded and "zebra" not in bounded and "[animal]" in bounded
    failing = Redactor(callback=lambda t: 1 / 0)  # type: ignore[arg-type, return-value]
    assert failing.bounded(text, KEEP, MARGIN) == REPLACEMENT  # failing closed, as on whole text


def test_short_text_is_redacted_whole() -> None:
    redactor = Redactor()
    text = "password=hunter22 " * 10
    assert redactor.bounded(text, KEEP, MARGIN) == redactor(text)
    assert redactor.bounded(text, 0, MARGIN) == redactor(text)


# --- the trigger scan ------------------------------------------------------------------------
@pytest.mark.parametrize("index", range(len(DEFAULT_PATTERNS)))
def test_every_default_pattern_needs_one_of_its_own_trigger_literals(index: int) -> None:
    """A pattern runs only on text holding one of its literals: that must never skip a secret."""
    pattern = DEFAULT_PATTERNS[index]

    @settings(max_examples=examples(200), deadline=None, suppress_health_check=list(HealthCheck))
    @given(hst.from_regex(pattern, alphabet=_PRINTABLE))
    def check(text: str) -> None:
        assert redaction._trigger_mask(text) >> index & 1, (pattern, text)

    check()


@pytest.mark.parametrize("text", ["paſsword=hunter22", "ſecret: hunter22", "apı_key=hunter22", "APİKEY=hunter22"])
def test_case_insensitive_look_alikes_of_the_literals_are_still_scanned(text: str) -> None:
    """'ſ' matches 's' and 'ı', 'İ' match 'i' under IGNORECASE, and str.lower() keeps them."""
    assert re.search(DEFAULT_PATTERNS[11], text) is not None
    assert "hunter22" not in Redactor()(text)


@settings(max_examples=examples(300), deadline=None, suppress_health_check=list(HealthCheck))
@given(hst.lists(hst.one_of(hst.sampled_from(redaction._TRIGGERS), hst.text(max_size=12)), max_size=8))
def test_the_automaton_and_the_substring_scan_agree(parts: list[str]) -> None:
    folded = redaction._folded("".join(parts))
    automaton = redaction._aho_corasick()
    if automaton is not None:
        assert automaton(folded) == redaction._mask_by_substrings(folded)


def test_without_the_automaton_the_substring_scan_stands_in(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(redaction, "_scan_folded", redaction._mask_by_substrings)
    assert Redactor()("password=hunter22 and sk-" + "a" * 20) == "password=[REDACTED] and [REDACTED]"


# --- cutting early ---------------------------------------------------------------------------
@settings(max_examples=examples(300), deadline=None, suppress_health_check=list(HealthCheck))
@given(hst.text(alphabet=string.ascii_letters + " .", min_size=0, max_size=3000), hst.integers(1, 400),
       hst.integers(1, 800))
def test_cutting_early_changes_nothing_a_later_cut_keeps(text: str, keep: int, limit: int) -> None:
    assume(limit <= 2 * keep)
    assert cut(precut(text, keep), limit) == cut(text, limit)  # the count included
    as_json = json.dumps([{"content": text}], ensure_ascii=False)
    early = json.dumps([{"content": precut(text, keep)}], ensure_ascii=False)
    assert cut(early, limit) == cut(as_json, limit)


# --- through the materializer ----------------------------------------------------------------
def _words(n_chars: int, seed: int) -> str:
    rng = random.Random(seed)
    words = "the model counted each token then\nchecked the answer against a reference".split(" ")
    out: list[str] = []
    size = 0
    while size < n_chars:
        out.append(rng.choice(words))
        size += len(out[-1]) + 1
    return " ".join(out)


SECRETS = {
    "head": "sk-proj-" + "H" * 40,
    "straddle_head": "ghp_" + "S" * 36,
    "window_edge": "password=" + "W" * 12,
    "straddle_tail": "Bearer " + "T" * 40,
    "tail": "AKIA" + "Q" * 16,
}


def _big_message(keep: int, margin: int) -> str:
    text = _words(1_000_000, 1)
    n = len(text)
    where = {"head": 100, "straddle_head": keep - 20, "window_edge": keep + margin - 8,
             "straddle_tail": n - keep - 20, "tail": n - 200}
    for name, at in where.items():
        text = text[:at] + " " + SECRETS[name] + " " + text[at + len(SECRETS[name]) + 2:]
    return text[:n]


def _render(record: Any, materializer: Materializer, *, early: bool) -> list[Any]:
    keep, bounded = materializer._keep, materializer._bounded
    if not early:  # the path before: every text redacted and encoded whole, cut last
        materializer._keep, materializer._bounded = None, None
    try:
        return materializer.episode(record)
    finally:
        materializer._keep, materializer._bounded = keep, bounded


@pytest.mark.parametrize("json_text", [False, True])
@pytest.mark.parametrize("redact", [True, False])
def test_a_kept_episode_with_a_huge_message_renders_as_before(redact: bool, json_text: bool, configured,
                                                               monkeypatch: pytest.MonkeyPatch) -> None:
    """The same spans as when every text was redacted and encoded whole (cut counts aside), with
    the redactor reading a bounded part of the message. Text the views parse as JSON (tool-call
    arguments, messages given as JSON text) is read whole: a cut could change what they make of it."""
    captured: list[tuple[Materializer, Any]] = []
    original = Materializer.episode

    def capture(self: Materializer, record: Any) -> Any:
        # a copy: delivery lets go of a rendered episode's spans (the copy keeps the list)
        captured.append((self, copy.copy(record)))
        return original(self, record)

    monkeypatch.setattr(Materializer, "episode", capture)
    configured(5, "first", redact=redact)
    keep = (16_384 // 2) + 1
    big = _big_message(keep, redaction.REDACT_MARGIN)
    with otr.episode(step=0) as ep:
        ep.prompt([{"role": "system", "content": "be brief"}, {"role": "user", "content": big}])
        with ep.turn() as turn:
            turn.record_generation("an answer", model="policy")
            with turn.tool_call("search", arguments={"q": big}) as call:
                call.result(big)
            if json_text:  # JSON text that the views parse, cut by a cut inside a string or not
                with turn.tool_call("write", arguments=json.dumps({"path": "notes.txt", "content": big})) as call:
                    call.result("[" + big)
                with turn.tool_call("sum", arguments=json.dumps({"values": list(range(100_000))})) as call:
                    call.result(json.dumps(list(range(100_000))))
        if json_text:
            with ep.turn() as turn:
                turn.record_generation("[" + big + "]", model="policy")
                turn.record_generation(json.dumps([{"role": "assistant", "content": big}]), model="policy")
                numbers = json.dumps({"values": list(range(100_000))})
                turn.record_generation(model="policy", messages=[
                    {"role": "user", "content": big},
                    {"role": "assistant", "content": "", "tool_calls": [
                        {"id": "c1", "type": "function", "function": {"name": "sum", "arguments": numbers}}]},
                ])
        ep.reward(1.0)
    otr.end_step(0)
    assert otr.flush(timeout=30)
    materializer, record = captured[0]
    assert materializer._keep == keep

    scanned: list[int] = []
    scan = Redactor._scan

    def counting(self: Redactor, text: str, *args: Any, **kwargs: Any) -> Any:
        scanned.append(len(text))
        return scan(self, text, *args, **kwargs)

    monkeypatch.setattr(Redactor, "_scan", counting)
    early = _render(record, materializer, early=True)
    read_early = sum(scanned)
    scanned.clear()
    before = _render(record, materializer, early=False)
    assert len(early) == len(before)
    for new, old in zip(early, before, strict=True):
        assert new.name == old.name
        assert set(new.attributes) == set(old.attributes)
        for key, value in old.attributes.items():
            if isinstance(value, str):
                assert _uncounted(new.attributes[key]) == _uncounted(value), key
                if redact:
                    for secret in SECRETS.values():
                        assert secret[-12:] not in new.attributes[key], (key, secret)
            else:
                assert new.attributes[key] == value, key
        assert new.attributes.get(c.RL_TRUNCATED_FIELDS) == old.attributes.get(c.RL_TRUNCATED_FIELDS)
    if redact and not json_text:
        # the redactor read a bounded amount, where the whole-text path read the message many times
        assert read_early < 40 * (keep + redaction.REDACT_MARGIN), read_early
        assert sum(scanned) > 3 * len(big)
