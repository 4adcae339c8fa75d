"""The global budget's exchange at end_step: Ray actors (``otr.RayBudget``) and torch.distributed
gloo ranks, side by side, at 2, 4 and 8 members; then the arithmetic for 1,000 members.

Each member records ``--episodes`` episodes per step with ``otr.record_batch`` (rewards, group
ids of 8) under ``TailSampler(cap, policy)`` with the distributed budget, then calls
``otr.end_step``. Measured per member per step, around the exchange itself (the summaries built,
sent, merged and answered): the bytes of the pickled summaries a member sends, and the wall time
of the exchange (it includes waiting for the slowest member: members call end_step together).
The coordinator's merge is timed on its own, in this process, on 2 to 1,000 copies of a real
member's summaries (distinct trace ids), which is the central cost at 1,000 members.

    python benchmarks/bench_budget.py                           # 4,096 episodes, cap 32, 4 steps
    python benchmarks/bench_budget.py --members 2,4 --transports ray

Ray runs on a local cluster on loopback (RAY_ENABLE_WINDOWS_OR_OSX_CLUSTER=0); gloo on
127.0.0.1. Every member is a process on this machine: with more members than cores, the wall
times include the machine's own contention (stated in the output).
"""

from __future__ import annotations

import argparse
import os
import pickle
import secrets
import socket
import statistics
import tempfile
import time
from typing import Any

os.environ.setdefault("RAY_ENABLE_WINDOWS_OR_OSX_CLUSTER", "0")

GROUP = 8


def columns(n: int, step: int, member: int) -> dict[str, Any]:
    return {
        "rewards": [float(((i * 7919 + step * 31 + member * 104_729) % 10_007) / 10_007) for i in range(n)],
        "group_ids": [f"s{step}-m{member}-g{i // GROUP}" for i in range(n)],
        "sample_indices": [i % GROUP for i in range(n)],
    }


def timed_exchange(samples: list[dict[str, float]]) -> None:
    """Wrap the budget's ``choose`` (both transports) so that each call records its bytes and
    wall time."""
    from otel_rollouts.sampling import distributed

    original = distributed.Member.choose

    def choose(self: Any, policy: Any, cap: int, candidates: Any, *, step: int) -> Any:
        start = time.perf_counter()
        payload = distributed.summaries(policy, candidates)
        size = len(pickle.dumps((step, payload)))
        out = original(self, policy, cap, candidates, step=step)
        samples.append({"bytes": size, "seconds": time.perf_counter() - start,
                        "rows": sum(len(v) for v in payload.values())})
        return out

    distributed.Member.choose = choose  # type: ignore[method-assign]


def run_member(member: int, episodes: int, steps: int, cap: int, policy: str, distributed: Any) -> list[dict[str, float]]:
    """One member's steps; returns the exchange samples (the first step is a warm-up)."""
    from opentelemetry.sdk.trace.export.in_memory_span_exporter import InMemorySpanExporter

    import otel_rollouts as otr

    samples: list[dict[str, float]] = []
    timed_exchange(samples)
    otr.configure(exporters=[InMemorySpanExporter()], sampler=otr.TailSampler(cap, policy, step_lag=None,
                  distributed=distributed), run_id="bench-budget", handle_signals=False)
    try:
        for step in range(steps + 1):
            otr.record_batch(episodes, step=step, **columns(episodes, step, member))
            otr.end_step(step)
            otr.flush()
    finally:
        otr.shutdown()
    return samples[1:]


# --- Ray -------------------------------------------------------------------------------------------
class RayMemberActor:
    def run(self, member: int, episodes: int, steps: int, cap: int, policy: str, name: str, members: int) -> Any:
        import otel_rollouts as otr

        return run_member(member, episodes, steps, cap, policy, otr.RayBudget(name, members=members, timeout_s=60))


def bench_ray(members: int, args: argparse.Namespace) -> list[dict[str, float]]:
    import ray

    actor = ray.remote(num_cpus=0)(RayMemberActor)
    actors = [actor.remote() for _ in range(members)]
    name = f"bench-{secrets.token_hex(4)}"
    runs = [a.run.remote(m, args.episodes, args.steps, args.cap, args.policy, name, members) for m, a in enumerate(actors)]
    out = [s for samples in ray.get(runs) for s in samples]
    for a in actors:
        ray.kill(a)
    return out


# --- torch.distributed ------------------------------------------------------------------------------
def _gloo_member(rank: int, world: int, port: int, args: argparse.Namespace, path: str) -> None:
    import torch.distributed as dist

    dist.init_process_group("gloo", init_method=f"tcp://127.0.0.1:{port}", rank=rank, world_size=world)
    try:
        samples = run_member(rank, args.episodes, args.steps, args.cap, args.policy, "auto")
        with open(f"{path}.{rank}", "wb") as f:
            pickle.dump(samples, f)
    finally:
        dist.destroy_process_group()


def bench_gloo(members: int, args: argparse.Namespace) -> list[dict[str, float]]:
    import torch.multiprocessing as mp

    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    with tempfile.TemporaryDirectory() as tmp:
        path = os.path.join(tmp, "samples")
        mp.spawn(_gloo_member, args=(members, port, args, path), nprocs=members, join=True)
        out: list[dict[str, float]] = []
        for rank in range(members):
            with open(f"{path}.{rank}", "rb") as f:
                out.extend(pickle.load(f))
    return out


# --- the coordinator's merge at scale ------------------------------------------------------------------
def merge_cost(args: argparse.Namespace, counts: list[int]) -> dict[int, float]:
    """Seconds of ``merge_all`` over ``n`` members' summaries (copies of one real member's)."""
    from opentelemetry.sdk.trace.export.in_memory_span_exporter import InMemorySpanExporter

    import otel_rollouts as otr
    from otel_rollouts._core import runtime as _runtime
    from otel_rollouts.sampling import distributed

    otr.configure(exporters=[InMemorySpanExporter()], sampler=otr.TailSampler(args.cap, args.policy, step_lag=None,
                  distributed=False), run_id="bench-budget", handle_signals=False)
    try:
        otr.record_batch(args.episodes, step=0, **columns(args.episodes, 0, 0))
        # the candidates a member holds at end_step: its open step's bucket
        pipeline = _runtime.installed().sampling_pipeline  # type: ignore[union-attr]
        held = {key: s.bucket.held() for key, s in pipeline._steps.items()}
        policy = pipeline.sampler.policy
        payload = distributed.summaries(policy, held)
    finally:
        otr.shutdown()
    out: dict[int, float] = {}
    for n in counts:
        payloads = [
            {key: [(tid ^ (m << 64), end, seq, attrs) for tid, end, seq, attrs in rows] for key, rows in payload.items()}
            for m in range(n)
        ]
        start = time.perf_counter()
        distributed.merge_all(policy, args.cap, payloads)
        out[n] = time.perf_counter() - start
    return out


def summary(samples: list[dict[str, float]]) -> str:
    sizes = [s["bytes"] for s in samples]
    times = [s["seconds"] * 1e3 for s in samples]
    rows = statistics.median(s["rows"] for s in samples)
    return (f"{statistics.median(sizes) / 1024:>8.1f} KiB {rows:>6.0f} rows {statistics.median(times):>9.1f} ms"
            f" ({min(times):.1f}-{max(times):.1f})")


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--members", default="2,4,8")
    parser.add_argument("--transports", default="ray,gloo")
    parser.add_argument("--episodes", type=int, default=4096)
    parser.add_argument("--cap", type=int, default=32)
    parser.add_argument("--steps", type=int, default=4)
    parser.add_argument("--policy", default="top_bottom")
    args = parser.parse_args()
    counts = [int(n) for n in args.members.split(",") if n]
    transports = [t for t in args.transports.split(",") if t]
    print(f"{args.episodes} episodes per member per step, cap {args.cap}, policy {args.policy}, "
          f"{args.steps} steps after a warm-up; {os.cpu_count()} cores")
    print("per member per step: summaries sent, candidates in them, exchange wall time median (min-max)")
    if "ray" in transports:
        import ray

        os.environ.setdefault("RAY_AUTH_TOKEN", secrets.token_hex(32))
        here = os.path.dirname(os.path.abspath(__file__))
        ray.init(address="local", include_dashboard=False, log_to_driver=False,
                 runtime_env={"env_vars": {"PYTHONPATH": here}})
        try:
            for n in counts:
                print(f"ray  {n:>3} actors  {summary(bench_ray(n, args))}", flush=True)
        finally:
            ray.shutdown()
    if "gloo" in transports:
        for n in counts:
            print(f"gloo {n:>3} ranks   {summary(bench_gloo(n, args))}", flush=True)
    cost = merge_cost(args, [2, 8, 100, 1000])
    print("coordinator merge (one process, summaries of one real member copied):")
    for n, seconds in cost.items():
        print(f"  {n:>5} members: {seconds * 1e3:9.1f} ms")


if __name__ == "__main__":
    main()
