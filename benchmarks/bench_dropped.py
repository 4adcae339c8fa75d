"""What a dropped episode costs the training thread, against the no-library floor in the same process.

    python benchmarks/bench_dropped.py                    # the three trees, 40 rounds
    python benchmarks/bench_dropped.py --trees six --rounds 80 --block 8
    python benchmarks/bench_dropped.py --cap 32           # the default sampler's cap (a few kept)

Trees (the same in both arms):
  six      episode, prompt, turn, generation, tool call, reward (6 spans)
  reward   an episode with only its reward (2 spans: the episode and the reward)
  eleven   prompt, 3 turns of a generation, 2 tool calls, reward (11 spans)

Arms, alternated in blocks of ``--block`` episodes inside this one process (the CPU of these
machines switches between two speed modes ~40% apart every 1 to 100 episodes: only arms
interleaved finely see the same mix of modes):
  none     the loop calling a function that does nothing: the loop's own cost, subtracted from
           the two others
  floor    no library: per span one slotted object with a random 64-bit id (``getrandbits``)
           and ``time_ns`` stamps, the episode's trace id; the spans used as ``with`` blocks
           (episode, turn, generation, tool call) attached to and detached from the
           OpenTelemetry context; the episode let go at its end. The least a recorder with this
           API can do.
  otr      otel_rollouts in its default configuration, every feature on (the default policy,
           step stats and the step scalars, group health, stage times, hang watch, baggage,
           redaction), an in-memory exporter that takes the step scalars as Trackio's exporter
           (the default one) does, ``TailSampler(--cap)``: with the default ``--cap 0`` every episode is
           recorded and dropped. Each step ends with ``otr.end_step`` on the training thread,
           timed, and its time shared among the step's otr episodes (step summaries are
           per-episode work done later).

Per round and tree: one step of ``--per-step`` otr episodes, in the order none floor otr otr
floor none (ABBA) repeated block by block; ``gc.collect()`` before each round, outside the
clocks. Clock: ``time.thread_time()`` of the training thread. Figures: per-episode µs (median
over rounds) and the median over rounds of the per-round ratio (otr - none) / (floor - none),
with the quartiles.

Checks (exit 1 when one fails): every otr episode was started, seen and dropped as the step
stats say (with ``--cap 0``); after the timed rounds, the same tree functions run once more
under a keep-all sampler and export exactly the tree's spans; the floor built the tree's spans.
"""

from __future__ import annotations

import argparse
import gc
import os
import random
import statistics
import sys
import time
from collections.abc import Callable
from typing import Any

TREES = {"six": 6, "reward": 2, "eleven": 11}


def floor_span_class() -> type:
    """The floor's span: one slotted object with a random 64-bit id (``getrandbits``) and
    ``time_ns`` stamps, attached to and detached from the OpenTelemetry context as a ``with``
    block (``close`` ends a leaf span). ``bench_loop.py``'s floor builds on it."""
    from opentelemetry import context as otel_context
    from opentelemetry import trace

    getrandbits, time_ns = random.getrandbits, time.time_ns
    attach, detach, in_context = otel_context.attach, otel_context.detach, trace.set_span_in_context

    class S:
        __slots__ = ("name", "trace_id", "span_id", "parent_id", "start", "end", "value", "token")

        def __init__(self, name: str, trace_id: int, parent_id: int | None, value: Any = None) -> None:
            self.name = name
            self.trace_id = trace_id
            self.span_id = getrandbits(64)
            self.parent_id = parent_id
            self.value = value
            self.token: Any = None
            self.start = time_ns()
            self.end = 0

        def close(self) -> S:
            self.end = time_ns()
            return self

        def __enter__(self) -> S:
            self.token = attach(in_context(self))  # type: ignore[arg-type]
            return self

        def __exit__(self, *exc: object) -> None:
            detach(self.token)
            self.end = time_ns()

    return S


def floor_trees() -> tuple[dict[str, Callable[[int, int], int]], list[int]]:
    """The floor's tree functions; each returns the spans it built."""
    getrandbits = random.getrandbits
    built = [0]
    S = floor_span_class()

    def six(i: int, step: int) -> int:
        tid = getrandbits(128)
        with S("episode", tid, None, (step, i // 8, i % 8)) as root:
            spans = [root, S("prompt", tid, root.span_id, PROMPT).close()]
            with S("turn", tid, root.span_id, 0) as turn:
                spans.append(turn)
                with S("generation", tid, turn.span_id, "policy") as gen:
                    gen.value = ANSWER
                spans.append(gen)
                with S("tool", tid, turn.span_id, ARGS) as call:
                    call.value = 2
                spans.append(call)
            spans.append(S("reward", tid, root.span_id, float(i % 7)).close())
        return len(spans)

    def reward(i: int, step: int) -> int:
        tid = getrandbits(128)
        with S("episode", tid, None, (step, i // 8, i % 8)) as root:
            spans = [root, S("reward", tid, root.span_id, float(i % 7)).close()]
        return len(spans)

    def eleven(i: int, step: int) -> int:
        tid = getrandbits(128)
        with S("episode", tid, None, (step, i // 8, i % 8)) as root:
            spans = [root, S("prompt", tid, root.span_id, PROMPT).close()]
            for k in range(3):
                with S("turn", tid, root.span_id, k) as turn:
                    spans.append(turn)
                    with S("generation", tid, turn.span_id, "policy") as gen:
                        gen.value = ANSWER
                    spans.append(gen)
                    if k < 2:
                        with S("tool", tid, turn.span_id, ARGS) as call:
                            call.value = 2
                        spans.append(call)
            spans.append(S("reward", tid, root.span_id, float(i % 7)).close())
        return len(spans)

    return {"six": six, "reward": reward, "eleven": eleven}, built


PROMPT = [{"role": "user", "content": "question"}]
ANSWER = "answer"
ARGS = {"x": 1}


def otr_trees(otr: Any) -> dict[str, Callable[[int, int], None]]:
    episode = otr.episode

    def six(i: int, step: int) -> None:
        with episode(step=step, group_id=f"g{i // 8}", sample_index=i % 8) as ep:
            ep.prompt(PROMPT)
            with ep.turn() as turn:
                with turn.generation("policy") as gen:
                    gen.output(ANSWER)
                with turn.tool_call("calc", ARGS) as call:
                    call.result(2)
            ep.reward(float(i % 7))

    def reward(i: int, step: int) -> None:
        with episode(step=step, group_id=f"g{i // 8}", sample_index=i % 8) as ep:
            ep.reward(float(i % 7))

    def eleven(i: int, step: int) -> None:
        with episode(step=step, group_id=f"g{i // 8}", sample_index=i % 8) as ep:
            ep.prompt(PROMPT)
            for k in range(3):
                with ep.turn() as turn:
                    with turn.generation("policy") as gen:
                        gen.output(ANSWER)
                    if k < 2:
                        with turn.tool_call("calc", ARGS) as call:
                            call.result(2)
            ep.reward(float(i % 7))

    return {"six": six, "reward": reward, "eleven": eleven}


def nothing(i: int, step: int) -> None:
    return None


def block(fn: Callable[[int, int], Any], start: int, n: int, step: int) -> float:
    clock = time.thread_time
    t0 = clock()
    for i in range(start, start + n):
        fn(i, step)
    return clock() - t0


def quartiles(values: list[float]) -> tuple[float, float]:
    if len(values) < 4:
        return min(values), max(values)
    q = statistics.quantiles(values, n=4)
    return q[0], q[2]


def main() -> int:
    parser = argparse.ArgumentParser(description=(__doc__ or "").split("\n")[0])
    parser.add_argument("--trees", default="six,reward,eleven")
    parser.add_argument("--rounds", type=int, default=40)
    parser.add_argument("--per-step", type=int, default=512, help="otr episodes per step (one step per round and tree)")
    parser.add_argument("--block", type=int, default=16, help="episodes per block (ABBA order)")
    parser.add_argument("--cap", type=int, default=0, help="TailSampler cap (0: every episode dropped)")
    parser.add_argument("--warmup", type=int, default=3000)
    args = parser.parse_args()
    trees = [t for t in args.trees.split(",") if t]
    for t in trees:
        if t not in TREES:
            raise SystemExit(f"unknown tree {t} (known: {', '.join(TREES)})")
    if args.per_step % (2 * args.block):
        raise SystemExit("--per-step must be a multiple of 2 x --block")

    from opentelemetry.sdk.trace.export.in_memory_span_exporter import InMemorySpanExporter

    import otel_rollouts as otr

    class ScalarsExporter(InMemorySpanExporter):
        """Takes each closed step's scalars (``log_metrics``), as Trackio's exporter does: the
        library then computes them, as in its default configuration."""

        logged: list[int] = []

        def log_metrics(self, step: int, values: dict[str, float]) -> None:
            self.logged.append(int(values.get("rollouts/episodes_seen", -1)))

    exporter = ScalarsExporter()
    otr.configure(exporters=[exporter], handle_signals=False, sampler=otr.TailSampler(args.cap),
                  run_id="bench-dropped")
    floors, _ = floor_trees()
    otrs = otr_trees(otr)
    problems: list[str] = []

    # warm-up: imports, caches, first calls (step 0, not measured)
    for t in trees:
        for i in range(args.warmup // len(trees)):
            otrs[t](i, 0)
            floors[t](i, 0)
    otr.end_step(0)
    for t in trees:
        built = floors[t](0, 0)
        if built != TREES[t]:
            problems.append(f"floor {t}: built {built} spans, not {TREES[t]}")

    per = {t: {"none": [], "floor": [], "otr": [], "end_step": [], "ratio": []} for t in trees}
    step = 0
    quads = args.per_step // (2 * args.block)
    b = args.block
    started = time.monotonic()
    for r in range(args.rounds):
        order = trees[:] if r % 2 == 0 else trees[::-1]
        for t in order:
            step += 1
            gc.collect()
            fl, ot = floors[t], otrs[t]
            none_s = floor_s = otr_s = 0.0
            i = 0
            for _ in range(quads):
                none_s += block(nothing, i, b, step)
                floor_s += block(fl, i, b, step)
                otr_s += block(ot, i, b, step)
                otr_s += block(ot, i + b, b, step)
                floor_s += block(fl, i + b, b, step)
                none_s += block(nothing, i + b, b, step)
                i += 2 * b
            t0 = time.thread_time()
            otr.end_step(step)
            end_s = time.thread_time() - t0
            n = args.per_step
            none_ep, floor_ep, otr_ep = none_s / n, floor_s / n, (otr_s + end_s) / n
            d = per[t]
            d["none"].append(none_ep)
            d["floor"].append(floor_ep - none_ep)
            d["otr"].append(otr_ep - none_ep)
            d["end_step"].append(end_s / n)
            d["ratio"].append((otr_ep - none_ep) / max(floor_ep - none_ep, 1e-9))
            entry = otr.stats().get("steps", {}).get(f"{step}/train", {})
            if entry.get("started") != n or entry.get("seen") != n:
                problems.append(f"otr {t} step {step}: started {entry.get('started')}, seen {entry.get('seen')}, "
                                f"not {n}")
            elif args.cap == 0 and entry.get("dropped.sampled_out") != n:
                problems.append(f"otr {t} step {step}: dropped {entry.get('dropped.sampled_out')} of {n}")
    wall = time.monotonic() - started
    exporter.clear()
    otr.flush()  # the step scalars were computed for every measured step, every episode seen
    measured = [seen for seen in exporter.logged if seen == args.per_step]
    if len(measured) < args.rounds * len(trees):
        problems.append(f"step scalars logged for {len(measured)} full steps, not {args.rounds * len(trees)}")

    # the tree functions record what they claim: the same calls, everything kept
    otr.shutdown()
    shape = InMemorySpanExporter()
    otr.configure(exporters=[shape], handle_signals=False, sampler=otr.TailSampler(10 ** 6),
                  run_id="bench-dropped-shape")
    for t in trees:
        otrs[t](0, 1)
        otr.end_step(1)
        otr.flush()
        got = len(shape.get_finished_spans())
        shape.clear()
        if got != TREES[t]:
            problems.append(f"otr {t}: exported {got} spans when kept, not {TREES[t]}")
    otr.shutdown()

    print(f"bench_dropped: python {sys.version.split()[0]}, {os.cpu_count()} CPUs, load average "
          f"{' '.join(f'{x:.2f}' for x in os.getloadavg())}; {args.rounds} rounds x {args.per_step} otr "
          f"episodes per tree (+ as many floor and none), blocks of {args.block} in ABBA order; "
          f"TailSampler({args.cap}), default configuration (step scalars taken); training-thread CPU; {wall:.0f} s")
    print(f"{'tree':<8} {'spans':>5} {'floor µs':>9} {'otr µs':>8} {'of it end_step':>14} "
          f"{'otr / floor: median (q1-q3)':>30}")
    for t in trees:
        d = per[t]
        q1, q3 = quartiles(d["ratio"])
        print(f"{t:<8} {TREES[t]:>5} {1e6 * statistics.median(d['floor']):>9.2f} "
              f"{1e6 * statistics.median(d['otr']):>8.2f} {1e6 * statistics.median(d['end_step']):>14.2f} "
              f"{statistics.median(d['ratio']):>20.2f}x ({q1:.2f}-{q3:.2f})")
    if not problems:
        print(f"checked: every otr episode started and seen{' and dropped' if args.cap == 0 else ''} per the "
              f"step stats, the step scalars logged for every step; each tree exports its {', '.join(f'{t} {TREES[t]}' for t in trees)} spans "
              "when kept; the floor built the same trees")
    for p in problems:
        print(f"CHECK FAILED: {p}")
    return 1 if problems else 0


if __name__ == "__main__":
    sys.exit(main())
