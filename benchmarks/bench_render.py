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

    python benchmarks/bench_render.py
    python benchmarks/bench_render.py --rounds 15
"""

from __future__ import annotations

import argparse
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
        return self._clean_text(text)


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


def record(user_message: str | None) -> tuple[Materializer, Any]:
    """One kept episode of the overhead benchmark's tree, as the export thread receives it."""
    captured: list[tuple[Materializer, Any]] = []
    original = Materializer.episode

    def capture(self: Materializer, rec: Any) -> Any:
        captured.append((self, rec))
        return original(self, rec)

    Materializer.episode = capture  # type: ignore[method-assign]
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
    return captured[0]


def cpu(fn: Callable[[], Any]) -> float:
    start = time.thread_time()
    fn()
    return time.thread_time() - start


def measure(rec: Any, variants: dict[str, Callable[[Any], Any]], rounds: int, repeat: int) -> dict[str, float]:
    """Median thread CPU seconds per render of each variant, the variants alternating."""
    times: dict[str, list[float]] = {name: [] for name in variants}
    for render in variants.values():
        render(rec)  # warm: caches, imports
    for _ in range(rounds):
        for name, render in variants.items():
            times[name].append(cpu(lambda render=render: [render(rec) for _ in range(repeat)]) / repeat)
    return {name: statistics.median(ts) for name, ts in times.items()}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--rounds", type=int, default=9)
    args = parser.parse_args()
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
    cases = [
        ("normal episode", None, 40),
        ("1 MB message, prose without trigger literals", _prose(1_000_000, False), 1),
        ("1 MB message, prose with trigger literals", _prose(1_000_000, True), 1),
    ]
    for label, message, repeat in cases:
        now, rec = record(message)
        before = BeforeMaterializer(now)
        variants: dict[str, Callable[[Any], Any]] = {"before": before.episode, "now": now.episode}
        if automaton:
            variants["now, substring scan"] = with_substrings(now.episode)
        # the same spans either way (cut markers aside): the comparison is of equal work
        assert len(before.episode(rec)) == len(now.episode(rec))
        result = measure(rec, variants, args.rounds, repeat)
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


if __name__ == "__main__":
    main()
