"""A global per-step budget across ranks: real processes, torch.distributed with gloo on CPU.

Each rank is a separate Python process (this file run as a script) joined with
``init_process_group("gloo", init_method="tcp://127.0.0.1:<free port>")``; each records its own
episodes into its own InMemorySpanExporter and writes what it recorded and what it exported to
a JSON file. The test checks the union over ranks: at most the cap per step, and exactly the
policy's global choice (global top/bottom by reward, global uniform sample, composition).
"""

from __future__ import annotations

import json
import os
import socket
import subprocess
import sys
import time
from pathlib import Path

import pytest

PER_RANK = 12


def _reward(rank: int, step: int, i: int) -> float:
    # distinct rewards across ranks, interleaved so that the global top/bottom mixes ranks
    return float(((i * 3 + rank) * 7919 + step * 31) % 1000)


def _logprobs(rank: int, i: int) -> tuple[list[float], list[float]] | None:
    """Sample ``i``'s engine and trainer logprobs on ``rank``: a Δ distinct across ranks (every
    fifth sample has none)."""
    if i % 5 == 4:
        return None
    delta = (float((i * 7 + rank * 3) % 37) + rank / 10 + 1) / 64
    rollout = [-0.5, -1.0, -1.5, -2.0]
    return rollout, [r + delta * (1 if k % 2 else -1) for k, r in enumerate(rollout)]


def _kl(rollout: list[float], trainer: list[float]) -> float:
    return 0.5 * sum((t - r) ** 2 for r, t in zip(rollout, trainer, strict=True)) / len(rollout)


def worker(rank: int, world: int, port: int, out: str) -> None:
    import torch.distributed as dist
    from opentelemetry.sdk.trace.export.in_memory_span_exporter import InMemorySpanExporter

    import otel_rollouts as otr
    from otel_rollouts import conventions as c

    dist.init_process_group("gloo", init_method=f"tcp://127.0.0.1:{port}", rank=rank,
                            world_size=world)
    result: dict = {"rank": rank, "phases": {}}

    def phase(name, sampler, steps, end_steps=True, status_of=lambda i: None, seconds_of=lambda i: None,
              logprobs_of=lambda i: None):
        exporter = InMemorySpanExporter()
        otr.configure(exporters=[exporter], sampler=sampler, run_id=f"job-{name}")
        recorded = []
        for step in steps:
            for i in range(PER_RANK):
                reward = _reward(rank, step, i)
                with otr.episode(step=step, group_id=f"r{rank}-g{i // 4}") as ep:
                    ep.prompt("p")
                    if status_of(i):
                        ep.finish(status=status_of(i))
                    if seconds_of(i) is not None:  # a framework's measure of the episode's time
                        ep.set_attribute(c.RL_DURATION_SECONDS, seconds_of(i))
                    if logprobs_of(i) is not None:  # the engine's and the trainer's logprobs
                        with ep.turn() as turn:
                            turn.record_generation("a", logprobs=logprobs_of(i)[0],
                                                   trainer_logprobs=logprobs_of(i)[1])
                    ep.reward(reward)
                recorded.append({"trace_id": int(ep.trace_id, 16), "step": step, "reward": reward,
                                 "status": status_of(i) or "ok", "seconds": seconds_of(i),
                                 "kl": None if logprobs_of(i) is None else _kl(*logprobs_of(i))})
            if end_steps:
                otr.end_step(step)
        otr.flush()
        kept = [
            {"trace_id": s.context.trace_id, "step": s.attributes[c.RL_STEP],
             "reason": s.attributes.get(c.RL_KEEP_REASON)}
            for s in exporter.get_finished_spans()
            if s.parent is None
        ]
        result["phases"][name] = {"recorded": recorded, "kept": kept,
                                  "stats": otr.stats()["steps"]}
        otr.shutdown()

    phase("top_bottom", otr.TailSampler(6, "top_bottom", step_lag=None), steps=[0, 1])
    phase("uniform", otr.TailSampler(5, "uniform", step_lag=None), steps=[0])

    # the same rewards offered as columns, two batches per step (otr.record_batch)
    exporter = InMemorySpanExporter()
    otr.configure(exporters=[exporter], sampler=otr.TailSampler(6, "top_bottom", step_lag=None))
    for step in (0, 1):
        rewards = [_reward(rank, step, i) for i in range(PER_RANK)]
        half = PER_RANK // 2
        otr.record_batch(half, step=step, rewards=rewards[:half])
        otr.record_batch(PER_RANK - half, step=step, rewards=rewards[half:])
        otr.end_step(step)
    otr.flush()
    result["phases"]["batch"] = {"recorded": [], "stats": otr.stats()["steps"], "kept": [
        {"trace_id": s.context.trace_id, "step": s.attributes[c.RL_STEP], "reward": s.attributes[c.RL_REWARD]}
        for s in exporter.get_finished_spans() if s.parent is None
    ]}
    otr.shutdown()
    phase(
        "compose",
        otr.TailSampler(
            7, otr.Compose(otr.Errors(2), otr.TopBottom(top=2, bottom=2), otr.Uniform()),
            step_lag=None,
        ),
        steps=[0],
        status_of=lambda i: "error" if i in (5, 9) else None,
    )
    phase("first", otr.TailSampler(4, "first", step_lag=None), steps=[0])
    # the stragglers of the whole job, by each episode's measured seconds (distinct across ranks)
    phase("slowest", otr.TailSampler(4, "slowest", step_lag=None), steps=[0],
          seconds_of=lambda i: float((i * 7 + rank * 3) % 37) + rank / 10)
    phase("no_end_step", otr.TailSampler(8, "top_bottom", step_lag=None), steps=[0], end_steps=False)
    # the largest train–inference mismatch of the whole job, by rl.mismatch.kl (distinct across
    # ranks; every fifth episode without logprobs, never chosen), alone and composed
    phase("mismatch_kl", otr.TailSampler(4, "mismatch", step_lag=None), steps=[0],
          logprobs_of=lambda i: _logprobs(rank, i))
    phase("mismatch_compose", otr.TailSampler(6, "errors+mismatch+top_bottom", step_lag=None), steps=[0],
          status_of=lambda i: "error" if i == 5 + rank else None, logprobs_of=lambda i: _logprobs(rank, i))
    # the same logprobs offered as columns ([B, R] arrays, one batch per step: otr.record_batch)
    exporter = InMemorySpanExporter()
    otr.configure(exporters=[exporter], sampler=otr.TailSampler(4, "mismatch", step_lag=None))
    pairs = [_logprobs(rank, i) for i in range(PER_RANK)]
    nan = [[float("nan")] * 4, [float("nan")] * 4]
    otr.record_batch(PER_RANK, step=0, rewards=[_reward(rank, 0, i) for i in range(PER_RANK)],
                     sample_indices=list(range(PER_RANK)),
                     logprobs=[(p or nan)[0] for p in pairs], trainer_logprobs=[(p or nan)[1] for p in pairs])
    otr.end_step(0)
    otr.flush()
    result["phases"]["mismatch_batch"] = {
        "recorded": [{"kl": None if p is None else _kl(*p)} for p in pairs], "stats": otr.stats()["steps"],
        "kept": [{"trace_id": s.context.trace_id, "kl": s.attributes.get(c.RL_MISMATCH_KL),
                  "reason": s.attributes.get(c.RL_KEEP_REASON)}
                 for s in exporter.get_finished_spans() if s.parent is None]}
    otr.shutdown()

    # ranks out of step: rank r closes step r. The collective finds the mismatch on every rank;
    # each decides locally within its share, and the error is reported, not raised
    exporter = InMemorySpanExporter()
    otr.configure(exporters=[exporter], sampler=otr.TailSampler(6, "top_bottom", step_lag=None))
    for step in (0, 1):
        for i in range(PER_RANK):
            with otr.episode(step=step) as ep:
                ep.reward(float(i))
    otr.end_step(rank % 2)
    errors = otr.stats()["totals"].get("errors.library", 0)
    otr.flush()
    roots = [s for s in exporter.get_finished_spans() if s.parent is None]
    result["mismatch"] = {"errors": errors, "kept": len(roots)}
    otr.shutdown()
    dist.destroy_process_group()
    Path(out).write_text(json.dumps(result))


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def _run_ranks(tmp_path: Path, world: int) -> list[dict]:
    pytest.importorskip("torch")
    port = _free_port()
    env = {**os.environ, "PYTHONPATH": os.pathsep.join(sys.path)}
    procs = []
    for rank in range(world):
        out = tmp_path / f"rank{rank}.json"
        procs.append((subprocess.Popen(
            [sys.executable, __file__, str(rank), str(world), str(port), str(out)],
            env=env, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True,
        ), out))
    deadline = time.monotonic() + 240
    results = []
    for proc, out in procs:
        try:
            output, _ = proc.communicate(timeout=max(deadline - time.monotonic(), 1))
        except subprocess.TimeoutExpired:
            for p, _ in procs:
                p.kill()
            raise
        assert proc.returncode == 0, output[-3000:]
        results.append(json.loads(out.read_text()))
    return results


@pytest.fixture(scope="module")
def three_ranks(tmp_path_factory) -> list[dict]:
    return _run_ranks(tmp_path_factory.mktemp("ranks"), 3)


def _union(results, name):
    recorded = [e for r in results for e in r["phases"][name]["recorded"]]
    kept = [e for r in results for e in r["phases"][name]["kept"]]
    return recorded, kept


def test_global_top_bottom_across_ranks(three_ranks):
    recorded, kept = _union(three_ranks, "top_bottom")
    reward_of = {e["trace_id"]: e["reward"] for e in recorded}
    for step in (0, 1):
        mine = [k["trace_id"] for k in kept if k["step"] == step]
        assert len(mine) == len(set(mine)) == 6  # the cap for the whole job, not per rank
        rewards = sorted(e["reward"] for e in recorded if e["step"] == step)
        assert sorted(reward_of[t] for t in mine) == sorted(rewards[:3] + rewards[-3:])
        # the choice mixes ranks: more than one rank exported
        ranks = {r["rank"] for r in three_ranks for k in r["phases"]["top_bottom"]["kept"]
                 if k["step"] == step}
        assert len(ranks) > 1


def test_batches_on_every_rank_merge_into_the_same_global_choice(three_ranks):
    recorded, _ = _union(three_ranks, "top_bottom")  # the same rewards, one episode at a time
    _, kept = _union(three_ranks, "batch")
    for step in (0, 1):
        rewards = sorted(e["reward"] for e in recorded if e["step"] == step)
        got = sorted(k["reward"] for k in kept if k["step"] == step)
        assert got == sorted(rewards[:3] + rewards[-3:])
    seen = sum(r["phases"]["batch"]["stats"]["0/train"]["seen"] for r in three_ranks)
    assert seen == 3 * PER_RANK


def test_global_uniform_sample_is_the_union_choice(three_ranks):
    from otel_rollouts.sampling.policy import _stable_hash

    recorded, kept = _union(three_ranks, "uniform")
    expected = sorted(recorded, key=lambda e: _stable_hash(0, e["trace_id"]))[:5]
    assert sorted(k["trace_id"] for k in kept) == sorted(e["trace_id"] for e in expected)


def test_global_composition_errors_top_bottom_rest(three_ranks):
    recorded, kept = _union(three_ranks, "compose")
    ids = {k["trace_id"] for k in kept}
    assert len(ids) == len(kept) == 7
    by_id = {e["trace_id"]: e for e in recorded}
    errors = [t for t in ids if by_id[t]["status"] == "error"]
    # 6 errors in the job (2 per rank): the Errors(2) part keeps exactly 2 of them; the one
    # uniform slot ranks by a hash of random trace ids and may pick one of the other 4 errors
    assert 2 <= len(errors) <= 3
    rest = sorted((e for e in recorded if e["trace_id"] not in errors), key=lambda e: e["reward"])
    assert {rest[0]["trace_id"], rest[1]["trace_id"], rest[-1]["trace_id"], rest[-2]["trace_id"]} <= ids


def test_global_slowest_across_ranks_says_why(three_ranks):
    recorded, kept = _union(three_ranks, "slowest")
    slowest = sorted(recorded, key=lambda e: e["seconds"], reverse=True)[:4]
    assert {e["trace_id"] for e in kept} == {e["trace_id"] for e in slowest}
    assert {e["reason"] for e in kept} == {"slowest"}


def test_global_mismatch_across_ranks_is_the_single_process_choice(three_ranks):
    """Global top-4 by rl.mismatch.kl across 3 ranks: what one process holding every episode
    keeps; an episode without logprobs is never chosen."""
    recorded, kept = _union(three_ranks, "mismatch_kl")
    scored = [e for e in recorded if e["kl"] is not None]
    assert len(scored) < len(recorded)  # some without logprobs
    top = sorted(scored, key=lambda e: e["kl"], reverse=True)[:4]
    assert {e["trace_id"] for e in kept} == {e["trace_id"] for e in top}
    assert {e["reason"] for e in kept} == {"mismatch"}
    # record_batch on every rank: the same global choice, with the statistic on the kept roots
    recorded, kept = _union(three_ranks, "mismatch_batch")
    top_kl = sorted((e["kl"] for e in recorded if e["kl"] is not None), reverse=True)[:4]
    assert sorted((e["kl"] for e in kept), reverse=True) == pytest.approx(top_kl, rel=1e-6)
    assert {e["reason"] for e in kept} == {"mismatch"}


def test_global_mismatch_composed_with_errors_and_top_bottom(three_ranks):
    recorded, kept = _union(three_ranks, "mismatch_compose")
    assert len(kept) == 6
    by_id = {e["trace_id"]: e for e in recorded}
    reasons = {e["trace_id"]: e["reason"] for e in kept}
    errors = {e["trace_id"] for e in recorded if e["status"] == "error"}  # one per rank
    taken = {t for t, r in reasons.items() if r == "error"}
    assert taken <= errors and len(taken) == 2  # equal shares of 2: the errors take theirs
    # the mismatch part: the largest KL of what the errors part left
    rest = sorted((e for e in recorded if e["trace_id"] not in taken and e["kl"] is not None),
                  key=lambda e: e["kl"], reverse=True)
    chosen = {t for t, r in reasons.items() if r == "mismatch"}
    assert chosen == {e["trace_id"] for e in rest[: len(chosen)]} and len(chosen) >= 2
    assert all(by_id[t]["kl"] is not None for t in chosen)


def test_first_is_held_and_agreed_not_streamed_per_rank(three_ranks):
    _, kept = _union(three_ranks, "first")
    assert len(kept) == 4


def test_steps_closed_without_end_step_keep_a_share_per_rank(three_ranks):
    for r in three_ranks:
        assert len(r["phases"]["no_end_step"]["kept"]) <= 8 // 3
    _, kept = _union(three_ranks, "no_end_step")
    assert len(kept) <= 8


def test_ranks_out_of_step_fall_back_to_a_share_and_report(three_ranks):
    for r in three_ranks:
        assert r["mismatch"]["errors"] >= 1
        assert r["mismatch"]["kept"] <= 2 * (6 // 3)  # two steps, each within the rank's share


def test_two_ranks(tmp_path):
    results = _run_ranks(tmp_path, 2)
    recorded, kept = _union(results, "top_bottom")
    for step in (0, 1):
        rewards = sorted(e["reward"] for e in recorded if e["step"] == step)
        reward_of = {e["trace_id"]: e["reward"] for e in recorded}
        got = sorted(reward_of[k["trace_id"]] for k in kept if k["step"] == step)
        assert got == sorted(rewards[:3] + rewards[-3:])


def test_single_process_never_imports_torch(tmp_path):
    code = (
        "import sys, otel_rollouts as otr\n"
        "from opentelemetry.sdk.trace.export.in_memory_span_exporter import InMemorySpanExporter\n"
        "e = InMemorySpanExporter()\n"
        "otr.configure(exporters=[e], sampler=otr.TailSampler(2, 'top_bottom'))\n"
        "for i in range(5):\n"
        "    with otr.episode(step=0) as ep:\n"
        "        ep.reward(float(i))\n"
        "otr.end_step(0); otr.flush()\n"
        "assert len({s.context.trace_id for s in e.get_finished_spans()}) == 2\n"
        "assert 'torch' not in sys.modules, 'torch was imported'\n"
        "print('ok')\n"
    )
    env = {**os.environ, "PYTHONPATH": os.pathsep.join(sys.path)}
    proc = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, env=env,
                          timeout=120)
    assert proc.returncode == 0 and proc.stdout.strip().endswith("ok"), proc.stderr[-2000:]


if __name__ == "__main__":
    worker(int(sys.argv[1]), int(sys.argv[2]), int(sys.argv[3]), sys.argv[4])
