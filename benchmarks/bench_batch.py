"""Offering a step's samples to the tail sampler: ``otr.record_batch`` versus one ``otr.episode``
per sample, for each built-in policy.

One script, one run: for every policy, the same step of samples (rewards, GRPO group ids of 8,
statuses with a few errors, measured durations and dataset indices, a watchlist of two
prompts, a prompt and a generation recorded for the samples the sampler may keep) is recorded
both ways, the two variants alternated over rounds so that a noisy shared
machine drifts on both alike. Reported: training-thread CPU per step (the thread that records
and calls ``otr.end_step``; the export thread's work on the kept episodes is left to
``otr.flush`` and not counted), the median over rounds and the per-round ratio range.

    python benchmarks/bench_batch.py                        # 4,096 samples, cap 32, 5 rounds
    python benchmarks/bench_batch.py --samples 1024 --rounds 3 --policies groups,top_bottom
"""

from __future__ import annotations

import argparse
import gc
import statistics
import time
from typing import Any

from opentelemetry.sdk.trace.export.in_memory_span_exporter import InMemorySpanExporter

import otel_rollouts as otr
from otel_rollouts import conventions as c

POLICIES = ["top_bottom", "first", "uniform", "errors", "groups", "errors+top_bottom", "default",
            "errors+slowest+top_bottom+degenerate_groups"]
WATCH = [3, 17]  # dataset indices followed across steps (kept outside the cap)
GROUP = 8


PLAIN = False  # --plain: no durations, no dataset indices, no watchlist (the previous release's setup)


def columns(n: int, step: int) -> dict[str, list[Any]]:
    """A step's columns: rewards spread within each group of 8, ~2% errors."""
    return {
        "rewards": [float(((i * 7919 + step) % 101) / 100.0) for i in range(n)],
        "group_ids": [f"s{step}-g{i // GROUP}" for i in range(n)],
        "statuses": ["error" if (i * 31 + step) % 53 == 0 else "ok" for i in range(n)],
        # what a framework measured (the slowest part ranks by it) and the watchlist's key
        "durations": [1.0 + ((i * 613 + step) % 997) / 100.0 for i in range(n)],
        "dataset_indices": [i // GROUP for i in range(n)],
    } if not PLAIN else {
        "rewards": [float(((i * 7919 + step) % 101) / 100.0) for i in range(n)],
        "group_ids": [f"s{step}-g{i // GROUP}" for i in range(n)],
        "statuses": ["error" if (i * 31 + step) % 53 == 0 else "ok" for i in range(n)],
    }


def record(i: int, ep: Any) -> None:
    ep.prompt(f"prompt {i // GROUP}")
    with ep.turn() as turn:
        turn.record_generation(f"completion {i}", model="policy", output_tokens=250)


def per_episode(n: int, step: int, cols: dict[str, list[Any]]) -> None:
    rewards, groups, statuses = cols["rewards"], cols["group_ids"], cols["statuses"]
    durations, indices = cols.get("durations"), cols.get("dataset_indices")
    for i in range(n):
        with otr.episode(step=step, group_id=groups[i], sample_index=i % GROUP,
                         dataset_index=None if indices is None else indices[i]) as ep:
            if durations is not None:
                ep.set_attribute(c.RL_DURATION_SECONDS, durations[i])
            record(i, ep)
            ep.finish(status=statuses[i])
            ep.reward(rewards[i])


def batched(n: int, step: int, cols: dict[str, list[Any]]) -> None:
    otr.record_batch(n, step=step, sample_indices=[i % GROUP for i in range(n)], record=record, **cols)


def one_step(policy: str, variant: str, n: int, cap: int, step: int) -> tuple[float, int]:
    """Training-thread CPU seconds of one step, and how many episodes it kept."""
    exporter = InMemorySpanExporter()
    otr.configure(exporters=[exporter], run_id="bench",
                  sampler=otr.TailSampler(cap, policy, step_lag=None, watch=None if PLAIN else WATCH,
                                          group_size=GROUP))
    try:
        cols = columns(n, step)
        run = batched if variant == "batch" else per_episode
        run(min(n, 256), step - 1, columns(min(n, 256), step - 1))  # warm-up step
        otr.end_step(step - 1)
        otr.flush()
        gc.collect()
        t0 = time.thread_time()
        run(n, step, cols)
        otr.end_step(step)
        spent = time.thread_time() - t0
        otr.flush()
        kept = sum(1 for s in exporter.get_finished_spans()
                   if s.parent is None and s.attributes.get("rl.step") == step)
        return spent, kept
    finally:
        otr.shutdown()


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--samples", type=int, default=4096)
    parser.add_argument("--cap", type=int, default=32)
    parser.add_argument("--rounds", type=int, default=5)
    parser.add_argument("--policies", default=",".join(POLICIES))
    parser.add_argument("--plain", action="store_true",
                        help="no durations, dataset indices or watchlist (the previous release's workload)")
    args = parser.parse_args()
    global PLAIN
    PLAIN = args.plain
    policies = [p for p in args.policies.split(",") if p]
    print(f"{args.samples} samples per step, cap {args.cap}, {args.rounds} rounds alternated; "
          "training-thread CPU per step")
    print(f"{'policy':<20} {'per-episode ms':>15} {'record_batch ms':>16} {'ratio (min-max)':>22}  kept")
    for policy in policies:
        times: dict[str, list[float]] = {"episode": [], "batch": []}
        ratios: list[float] = []
        kept: dict[str, int] = {}
        for r in range(args.rounds):
            order = ["episode", "batch"] if r % 2 == 0 else ["batch", "episode"]
            got: dict[str, float] = {}
            for variant in order:
                got[variant], kept[variant] = one_step(policy, variant, args.samples, args.cap, 10 + r)
                times[variant].append(got[variant])
            ratios.append(got["episode"] / max(got["batch"], 1e-9))
        ep_ms = statistics.median(times["episode"]) * 1e3
        b_ms = statistics.median(times["batch"]) * 1e3
        ratio = f"{statistics.median(ratios):.1f}x ({min(ratios):.1f}-{max(ratios):.1f})"
        same = "" if kept["episode"] == kept["batch"] else f"  (per-episode kept {kept['episode']})"
        print(f"{policy:<20} {ep_ms:>15.1f} {b_ms:>16.2f} {ratio:>22}  {kept['batch']}{same}")


if __name__ == "__main__":
    main()
