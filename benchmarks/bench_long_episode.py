"""What rendering a long kept episode costs, per span, as the episode grows.

Agentic RL runs episodes of hundreds of turns. Each turn here is a turn span with a generation
recorded *without* its input messages (so the view gives it the conversation so far: the prompt,
every earlier answer and tool result) and a tool call with ~300 characters of arguments and
result; plus the episode's root, prompt and reward. Episodes of about 250, 500, 1,000 and 2,000
spans are recorded through the public API (``otr.configure`` with an in-memory exporter, a sampler
that keeps every episode, default redaction and limits), and the real render of each kept episode
is timed where it happens: ``Materializer.episode`` on the export thread, its thread CPU
(``time.thread_time``) around the call.

Printed per size: render CPU per episode, µs per span (median over ``--rounds`` episodes of that
size, min-max beside it), and the growth of µs/span against the smallest size (1.00 everywhere
is linear; a quadratic render doubles it with each doubling of the episode).

Sanity checks (exit status 1 when one fails): every recorded span is rendered (the render returns
at least as many spans as the episode recorded); the last generation carries its own output
messages; generations carry their conversation so far (``gen_ai.input.messages``), the last of
them ending with the tool result before it. A render that does nothing cannot pass for a fast one.
With the default episode budget (1,048,576 characters) the views are written in span order while
the budget lasts: the conversation views of the first generations (each up to the attribute limit,
plus OpenInference's flattened copy of every message) spend it, so the later generations of a long
episode carry their own content but no conversation view, before this change as after it. The
column ``views`` says how many generations got theirs.

    python benchmarks/bench_long_episode.py
    python benchmarks/bench_long_episode.py --rounds 5 --sizes 250 1000
"""

from __future__ import annotations

import argparse
import json
import statistics
import sys
import time
from typing import Any

from opentelemetry.sdk.trace.export.in_memory_span_exporter import InMemorySpanExporter

import otel_rollouts as otr
from otel_rollouts import conventions as c
from otel_rollouts.delivery.materialize import Materializer

SPANS_PER_TURN = 3  # the turn, its generation, its tool call
FIXED_SPANS = 3  # the root, the prompt, the reward

_WORDS = ("the", "policy", "reads", "a", "tool", "result", "and", "writes", "next", "step", "of",
          "its", "plan", "search", "returns", "rows", "for", "query", "answer", "checks")


def _prose(n_chars: int, seed: int) -> str:
    out, size, i = [], 0, seed
    while size < n_chars:
        word = _WORDS[i * 7 % len(_WORDS)]
        out.append(word)
        size += len(word) + 1
        i += 1
    return " ".join(out)[:n_chars]


class Renders:
    """Times each real ``Materializer.episode`` call (thread CPU) and keeps what the checks need."""

    def __init__(self) -> None:
        # (cpu s, recorded spans, rendered spans, (generations with a view, the last view, the
        # last generation's output messages))
        self.seen: list[tuple[float, int, int, Any]] = []
        self.original = Materializer.episode

    def __enter__(self) -> Renders:
        original = self.original
        seen = self.seen

        def timed(materializer: Materializer, record: Any) -> Any:
            recorded = len(record.spans)
            start = time.thread_time()
            spans = original(materializer, record)
            elapsed = time.thread_time() - start
            generations = [s.attributes or {} for s in spans
                           if (s.attributes or {}).get(c.RL_SPAN_KIND) == c.KIND_GENERATION]
            inputs = [g[c.GEN_AI_INPUT_MESSAGES] for g in generations if c.GEN_AI_INPUT_MESSAGES in g]
            outputs = generations[-1].get(c.GEN_AI_OUTPUT_MESSAGES) if generations else None
            seen.append((elapsed, recorded, len(spans), (len(inputs), inputs[-1] if inputs else None, outputs)))
            return spans

        Materializer.episode = timed  # type: ignore[method-assign]
        return self

    def __exit__(self, *exc: object) -> None:
        Materializer.episode = self.original  # type: ignore[method-assign]


def run_episode(turns: int, index: int) -> None:
    """One episode of ``turns`` turns, recorded through the public API (kept by the sampler)."""
    prompt = [{"role": "system", "content": "You are an agent. " + _prose(400, 1)},
              {"role": "user", "content": f"Task {index}: " + _prose(600, 2)}]
    with otr.episode(step=0, group_id=f"g{index}", sample_index=0) as ep:
        ep.prompt(prompt)
        for k in range(turns):
            with ep.turn() as turn:
                turn.record_generation(f"Turn {k}: " + _prose(300, k), model="policy", output_tokens=80)
                with turn.tool_call("search", arguments={"query": _prose(80, k + 3), "page": k}) as call:
                    call.result(f"result {k}: " + _prose(200, k + 5))
        ep.reward(1.0)


def _size_of(recorded: int, sizes: list[int]) -> int | None:
    """The requested size whose episode records ``recorded`` spans."""
    for n in sizes:
        if (n - FIXED_SPANS) // SPANS_PER_TURN * SPANS_PER_TURN + FIXED_SPANS == recorded:
            return n
    return None


def measure(sizes: list[int], rounds: int) -> dict[int, list[tuple[float, int, int, Any]]]:
    """Renders of ``rounds`` episodes of each size, the sizes alternating within each round
    (grouped by the spans each render received: a render may finish after the flush that waited
    for it gave up, and then lands among the next size's)."""
    out: dict[int, list[tuple[float, int, int, Any]]] = {n: [] for n in sizes}
    exporter = InMemorySpanExporter()
    otr.configure(exporters=[exporter], sampler=otr.TailSampler(1_000_000, "first", step_lag=None),
                  run_id="bench-long-episode", max_spans_per_episode=max(sizes) + 64)
    try:
        with Renders() as renders:
            run_episode(4, -1)  # warm: imports, caches
            otr.flush()
            for r in range(rounds):
                for n in sizes:
                    run_episode((n - FIXED_SPANS) // SPANS_PER_TURN, r)
                    otr.flush()
                    exporter.clear()
            deadline = time.monotonic() + 600
            while len(renders.seen) < 1 + rounds * len(sizes) and time.monotonic() < deadline:
                otr.flush()
            for seen in renders.seen:
                size = _size_of(seen[1], sizes)
                if size is not None:
                    out[size].append(seen)
    finally:
        otr.shutdown()
    return out


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--rounds", type=int, default=3)
    parser.add_argument("--sizes", type=int, nargs="+", default=[250, 500, 1000, 2000])
    args = parser.parse_args()
    results = measure(args.sizes, args.rounds)
    failed = False
    print(f"{'spans':>6} {'render CPU':>12} {'µs/span':>9} {'min-max':>15} {'growth':>7} {'views':>6}")
    base: float | None = None
    for n, seen in results.items():
        if len(seen) != args.rounds:
            print(f"FAIL: {len(seen)} renders of the {n}-span episode, {args.rounds} expected")
            failed = True
            continue
        per_span = [cpu / recorded * 1e6 for cpu, recorded, _, _ in seen]
        median = statistics.median(per_span)
        base = base if base is not None else median
        total = statistics.median(cpu for cpu, _, _, _ in seen)
        print(f"{seen[0][1]:>6} {total * 1e3:>9.1f} ms {median:>9.1f} {min(per_span):>7.1f}-{max(per_span):<7.1f}"
              f" {median / base:>7.2f} {seen[0][3][0]:>6}")
        for _, recorded, rendered, (views, last, outputs) in seen:
            if rendered < recorded:
                print(f"FAIL: {rendered} spans rendered of {recorded} recorded")
                failed = True
            if not isinstance(outputs, str) or not outputs:
                print("FAIL: the last generation has no output messages")
                failed = True
            if not views or not isinstance(last, str):
                print("FAIL: no generation has its conversation so far")
                failed = True
                continue
            try:
                ends_with_tool = json.loads(last)[-1].get("role") == "tool"
            except ValueError:  # cut to the limit: the tail is still there, as text
                ends_with_tool = '"role":"tool"' in last[last.rfind('{"role"'):]
            if not ends_with_tool:
                print("FAIL: a generation's conversation so far does not end with the tool result before it")
                failed = True
    print(f"\n{args.rounds} episodes per size, alternated; thread CPU of the export thread per "
          f"Materializer.episode call; growth: µs/span over the smallest size's (1.00 = linear). "
          f"Target: 1,000 spans <= 100 µs/span.")
    return 1 if failed else 0


if __name__ == "__main__":
    sys.exit(main())
