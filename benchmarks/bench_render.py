"""What rendering a kept episode costs on the export thread: the path before next to the path now.

One script, one process. Episodes are recorded once with otel_rollouts (default secret redaction,
default limits: 16,384 characters per attribute), captured as the records the export thread
receives, then rendered again and again on this thread, the variants alternating; the figure is
the median CPU time of this thread (``time.thread_time``) per ``Materializer.episode`` call.

Episodes:
  normal        benchmarks/bench_overhead.py's tree: prompt + 3 turns + 2 tool calls + reward,
                a ~2 KB prompt, ~1 KB completions
  1 MB message  the same tree with the user message 1 MB long: prose with no literal any secret
                pattern needs, and prose with some (``token``, ``https://``: the patterns run)

Variants:
  before        the path before: every text redacted whole (a pre-scan of 31 substring searches,
                then every default pattern if one was found), each container copied by
                ``jsonable`` again before ``json.dumps``, long text cut only when it is written
                (the attributes are written by today's code, a little faster than before's: the
                previous commit itself measured 780-800 µs for the normal episode where today's
                renders it in 650-690 µs, same machine, alternating runs)
  now           long text cut to what the attribute limit can show (and a margin for the
                redaction) before it is redacted, encoded or copied into the views; one trigger
                scan (pyahocorasick) and only the patterns whose literals it found; ``json.dumps``
                directly
  now, substring scan  the path now with the stdlib fallback scan (pyahocorasick not installed)

Every render is checked (``sanity``): all the episode's spans, the prompt's input messages and
every generation's output messages present; the script exits non-zero otherwise.

    python benchmarks/bench_render.py
    python benchmarks/bench_render.py --rounds 15
    python benchmarks/bench_render.py --quick      # smoke: 2 rounds, few repeats, 2 of the 3 cases
"""

from __future__ import annotations

import argparse
import functools
import json
import os
import statistics
import sys
import time
from collections.abc import Callable
from typing import Any

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))

import bench_overhead as workload  # noqa: E402 - the same episode tree as the overhead benchmark
from opentelemetry.sdk.trace.export.in_memory_span_exporter import InMemorySpanExporter  # noqa: E402

import otel_rollouts as otr  # noqa: E402
from otel_rollouts import conventions as c  # noqa: E402
from otel_rollouts._core import redaction  # noqa: E402
from otel_rollouts._core.content import to_json  # noqa: E402
from otel_rollouts.delivery.materialize import Materializer  # noqa: E402

# --- the path before, as it was (the previous commit's code, kept here to measure against) ------
_OLD_TRIGGERS = (
    "begin", "bearer", "authorization", "sk-", "hf_", "ghp_", "gho_", "ghu_", "ghs_", "ghr_",
    "github_pat_", "akia", "asia", "aiza", "xox", "eyj", "passw", "passphrase", "pwd", "secret",
    "apikey", "api_key", "api-key", "accesskey", "access_key", "access-key", "privatekey",
    "private_key", "private-key", "token", "://",
)


class WholeTextRedactor:
    """The redactor before: one substring search per literal, then every default pattern."""

    def __init__(self, redactor: redaction.Redactor) -> None:
        self.redactor = redactor
        self.name = redactor.name
        self.secret_key = redactor.secret_key

    def __call__(self, text: str) -> str:
        r = self.redactor
        one = r._one(r._replacement)
        lowered = text.lower()
        if any(literal in lowered for literal in _OLD_TRIGGERS):
            for pattern in r.defaults:
                text = pattern.sub(one, text)
        return text


class BeforeMaterializer(Materializer):
    """The materializer before: texts redacted whole, containers copied again before encoding."""

    def __init__(self, now: Materializer) -> None:
        self.__dict__.update(now.__dict__)
        assert isinstance(now.redact, redaction.Redactor)
        self.redact = WholeTextRedactor(now.redact)
        self._keep = None  # no cut before the attributes are written
        self._bounded = None

    def _clean(self, attributes: dict[str, Any]) -> dict[str, Any]:
        out: dict[str, Any] = {}
        for key, value in attributes.items():
            if value is None or isinstance(value, (bool, int, float)):
                out[key] = value
            elif isinstance(value, str):
                if self._secret_key(key):
                    out[key] = redaction.REPLACEMENT
                elif c.is_label(key) and self.redact_name is not None:
                    out[key] = self.redact_name(value)
                else:
                    out[key] = self._clean_text(value)
            else:
                value = self._walk(value)
                text = to_json(value)  # jsonable's copy, then json.dumps
                clean = self._clean_text(text)
                if clean is None or clean == text:
                    out[key] = value
                else:
                    try:
                        out[key] = json.loads(clean)
                    except ValueError:
                        out[key] = clean
        return out

    def _clean_whole(self, text: str | None) -> str | None:
        """Every text redacted whole (once per distinct text in an episode). Written out, not
        delegated to ``_clean_text``: today's ``_clean_text`` itself hands short texts here."""
        if text is None or self.redact is None:
            return text
        cache = self._redacted
        clean = cache.get(text) if cache is not None else None
        if clean is None:
            clean = self.redact(text)
            if cache is not None:
                cache[text] = clean
        return clean


# --- the episodes ------------------------------------------------------------------------------
def _prose(n_chars: int, with_triggers: bool) -> str:
    """Prose of ``n_chars`` characters; with_triggers: now and then a word or a link that a
    secret pattern needs (no secret), so that the patterns run where the scan finds them."""
    words = list(workload._WORDS)
    if with_triggers:
        words += ["tokens", "see https://example.org/notes for the details"]
    out: list[str] = []
    size, i = 0, 0
    while size < n_chars:
        word = words[i * 7 % len(words)]
        out.append(word)
        size += len(word) + 1
        i += 1
    return " ".join(out)[:n_chars]


# What ``EpisodeRecord.release`` lets go of once the export thread rendered an episode: held
# aside when the episode is captured, and put back, so that every render here renders it whole
# (without this, each measured render rendered an emptied record: a few µs of nothing).
_HELD = ("spans", "foreign", "logs", "root", "reward_span")
EXPECTED_SPANS = 11  # the overhead benchmark's tree: episode, prompt, 3 turns, 3 generations, 2 tools, reward


def record(user_message: str | None) -> tuple[Materializer, Any]:
    """One kept episode of the overhead benchmark's tree, as the export thread receives it, whole."""
    captured: list[tuple[Materializer, Any, dict[str, Any]]] = []
    original = Materializer.episode

    def capture(self: Materializer, rec: Any) -> Any:
        held = {name: getattr(rec, name) for name in _HELD if hasattr(rec, name)}
        captured.append((self, rec, {k: list(v) if isinstance(v, list) else v for k, v in held.items()}))
        return original(self, rec)

    Materializer.episode = capture  # type: ignore[method-assign, assignment]
    try:
        otr.configure(exporters=[InMemorySpanExporter()], sampler=otr.TailSampler(10, "first", step_lag=None),
                      run_id="bench-render")
        prompt, completions, args, result, reward = workload.sample(1)
        if user_message is not None:
            prompt = [prompt[0], {"role": "user", "content": user_message}]
        with otr.episode(step=0, group_id="g0", sample_index=0) as ep:
            ep.prompt(prompt)
            for k in range(3):
                with ep.turn() as turn:
                    turn.record_generation(completions[k], model="policy", output_tokens=250)
                    if k < 2:
                        with turn.tool_call("search", arguments=args) as call:
                            call.result(result)
            ep.reward(reward)
        otr.end_step(0)
        otr.flush()
    finally:
        Materializer.episode = original  # type: ignore[method-assign]
        otr.shutdown()
    if not captured:
        raise SystemExit("bench_render: no kept episode reached Materializer.episode in this process "
                         "(rendering moved elsewhere?): nothing to measure")
    materializer, rec, held = captured[0]
    for name, value in held.items():  # released after its render: made whole again
        setattr(rec, name, value)
    return materializer, rec


def sanity(spans: list[Any], label: str, expected: int = EXPECTED_SPANS) -> list[str]:
    """What a render must produce for the figures to mean anything: every span of the episode,
    and the content on them (the prompt's input messages, each generation's output messages).
    Returns the problems found (empty: the render is real)."""
    problems: list[str] = []
    if len(spans) < expected:
        problems.append(f"{label}: rendered {len(spans)} spans, expected {expected}")
    generations = [s for s in spans if (s.attributes or {}).get(c.RL_SPAN_KIND) == c.KIND_GENERATION]
    if not generations:
        problems.append(f"{label}: no generation span rendered")
    for s in generations:
        if not (s.attributes or {}).get(c.GEN_AI_OUTPUT_MESSAGES):
            problems.append(f"{label}: generation {s.name!r} carries no {c.GEN_AI_OUTPUT_MESSAGES}")
            break
    prompts = [s for s in spans if (s.attributes or {}).get(c.RL_SPAN_KIND) == c.KIND_PROMPT]
    if not prompts or not (prompts[0].attributes or {}).get(c.GEN_AI_INPUT_MESSAGES):
        problems.append(f"{label}: no prompt span with {c.GEN_AI_INPUT_MESSAGES}")
    return problems


def cpu(fn: Callable[[], Any]) -> float:
    start = time.thread_time()
    fn()
    return time.thread_time() - start


def _repeat(render: Callable[[Any], Any], rec: Any, repeat: int) -> None:
    for _ in range(repeat):
        render(rec)


def measure(rec: Any, variants: dict[str, Callable[[Any], Any]], rounds: int, repeat: int) -> dict[str, float]:
    """Median thread CPU seconds per render of each variant, the variants alternating."""
    times: dict[str, list[float]] = {name: [] for name in variants}
    for render in variants.values():
        render(rec)  # warm: caches, imports
    for _ in range(rounds):
        for name, render in variants.items():
            times[name].append(cpu(functools.partial(_repeat, render, rec, repeat)) / repeat)
    return {name: statistics.median(ts) for name, ts in times.items()}


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--rounds", type=int, default=9)
    parser.add_argument("--quick", action="store_true",
                        help="smoke run: 2 rounds, few repeats, no 1 MB message with triggers (the checks, not the figures)")
    args = parser.parse_args()
    if args.quick:
        args.rounds = 2
    scanner = redaction._scan_folded
    automaton = scanner is not redaction._mask_by_substrings

    def with_substrings(render: Callable[[Any], Any]) -> Callable[[Any], Any]:
        def run(rec: Any) -> Any:
            redaction._scan_folded = redaction._mask_by_substrings
            try:
                return render(rec)
            finally:
                redaction._scan_folded = scanner
        return run

    print(f"trigger scan now: {'pyahocorasick' if automaton else 'substring searches (pyahocorasick not installed)'}")
    rows = []
    problems: list[str] = []
    cases = [
        ("normal episode", None, 4 if args.quick else 40),
        ("1 MB message, prose without trigger literals", _prose(1_000_000, False), 1),
        ("1 MB message, prose with trigger literals", _prose(1_000_000, True), 1),
    ]
    if args.quick:  # the path before takes ~1 s per render of the last case
        cases = cases[:2]
    for label, message, repeat in cases:
        now, rec = record(message)
        before = BeforeMaterializer(now)
        variants: dict[str, Callable[[Any], Any]] = {"before": before.episode, "now": now.episode}
        if automaton:
            variants["now, substring scan"] = with_substrings(now.episode)
        # every variant renders the whole episode, with its content (checked before and after
        # the timed renders: a render that emptied the record would measure nothing after it)
        for name, render in variants.items():
            problems += sanity(render(rec), f"{label}, {name}")
        # the same spans either way (cut markers aside): the comparison is of equal work
        if len(before.episode(rec)) != len(now.episode(rec)):
            problems.append(f"{label}: before and now render different numbers of spans")
        result = measure(rec, variants, args.rounds, repeat)
        for name, render in variants.items():
            problems += sanity(render(rec), f"{label}, {name}, after the timed renders")
        rows.append((label, result))
    print()
    print(f"{'episode':<48} {'variant':<22} {'render CPU':>12} {'x before':>9}")
    for label, result in rows:
        for name, seconds in result.items():
            figure = f"{seconds * 1e3:.2f} ms" if seconds >= 1e-3 else f"{seconds * 1e6:.0f} µs"
            print(f"{label:<48} {name:<22} {figure:>12} {seconds / result['before']:>9.2f}")
    print()
    print(f"target: a 1 MB message kept in <= 25 ms of render CPU; {args.rounds} rounds, medians, "
          f"thread CPU of the rendering thread")
    if problems:
        for p in problems:
            print(f"CHECK FAILED: {p}")
        return 1
    print(f"checked: every render of every case and variant produced all {EXPECTED_SPANS} spans, "
          f"the prompt's {c.GEN_AI_INPUT_MESSAGES} and every generation's {c.GEN_AI_OUTPUT_MESSAGES}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
