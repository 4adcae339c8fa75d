"""Budgets are per run (``otr.RayBudget``), on a real local Ray cluster kept on loopback.

Two runs in one Ray job share the coordinator actor but never a step's budget: a second run whose
steps restart at 0 keeps its full cap, whether the runs are told apart by ``run_id`` or, without
one, by the second run's steps going back to an already decided one. A member whose steps find
the budget spent says so in its log (once per interval), not only in a counter.
"""

from __future__ import annotations

import random
import re
import uuid

import pytest
import ray
import ray_workloads as w
from otr_helpers import reference_rewards

ACTORS = 3
CAP = 8
PER_ACTOR = 12
RolloutActor = ray.remote(w.Rollouts)


def _episodes(step: int, actors: int, seed: int) -> list[list[dict]]:
    """Each actor's episodes of ``step``, with distinct rewards."""
    rng = random.Random(seed * 1000 + step)
    rewards = rng.sample(range(10_000), actors * PER_ACTOR)
    return [
        [
            {"id": f"s{step}-a{a}-e{i}", "group": f"s{step}-a{a}-g{i // 4}", "index": i % 4,
             "reward": rewards[a * PER_ACTOR + i] / 100}
            for i in range(PER_ACTOR)
        ]
        for a in range(actors)
    ]


def _reference_rewards(episodes: list[dict], step: int) -> list[float]:
    """The rewards one process holding every episode of the step keeps ("top_bottom")."""
    return reference_rewards("top_bottom", episodes, step, CAP)


def _rewards(actors: list) -> list[float]:
    return sorted(r for kept in ray.get([a.kept_rewards.remote() for a in actors]) for r in kept)


def _run(name: str, run_id: str | None, steps: int, seed: int) -> list[tuple[list[float], list[float]]]:
    """One run of three rollout actors (made for it, shut down after it) sharing budget ``name``:
    per step, the rewards kept and the rewards one process holding all of them keeps."""
    actors = [RolloutActor.remote(name, ACTORS, "top_bottom", CAP, 60.0, run_id) for _ in range(ACTORS)]
    out = []
    try:
        for step in range(steps):
            before = _rewards(actors)
            batches = _episodes(step, ACTORS, seed)
            ray.get([a.run_step.remote(step, b) for a, b in zip(actors, batches, strict=True)])
            totals = ray.get([a.end_step.remote(step) for a in actors], timeout=300)
            assert sum(t.get("budget.local_fallback", 0) for t in totals) == 0
            kept = sorted(set(_rewards(actors)) - set(before))
            out.append((kept, _reference_rewards([e for b in batches for e in b], step)))
        ray.get([a.shutdown.remote() for a in actors], timeout=120)
    finally:
        for a in actors:
            ray.kill(a)
    return out


@pytest.mark.parametrize("named", [True, False], ids=["run_id", "no_run_id"])
def test_a_second_run_restarting_at_step_0_keeps_its_full_cap(ray_cluster, named):
    name = f"budget-{uuid.uuid4().hex[:8]}"  # one coordinator for both runs (as the job default is)
    first = _run(name, "first-run" if named else None, 2, seed=21)
    assert [len(kept) for kept, _ in first] == [CAP, CAP]
    second = _run(name, "second-run" if named else None, 2, seed=22)  # steps 0 and 1 again
    for kept, reference in second:
        assert len(kept) == CAP  # its own budget: not the first run's, already spent
        assert kept == reference  # and the global choice over its own members
    state = ray.get(ray.get_actor(name, namespace="otel_rollouts").state.remote())
    assert state["runs"] == 2 and state["members"] == ACTORS


def test_a_member_finding_the_budget_spent_logs_a_warning_once_per_interval(ray_cluster):
    name = f"budget-{uuid.uuid4().hex[:8]}"
    # members=2 with three actors: a step is decided as soon as two sent it, the third is late
    actors = [RolloutActor.remote(name, 2, "top_bottom", CAP, 60.0) for _ in range(ACTORS)]
    for step in range(3):
        batches = _episodes(step, ACTORS, seed=31)
        ray.get([a.run_step.remote(step, b) for a, b in zip(actors, batches, strict=True)])
        ray.get([a.end_step.remote(step) for a in actors[:2]], timeout=300)  # the whole cap
        totals = ray.get(actors[2].end_step.remote(step), timeout=300)
    assert totals["budget.late_steps"] == 3 and totals["budget.spent"] == 3
    assert ray.get(actors[2].kept.remote()) == []
    warnings = [line for line in ray.get(actors[2].logged.remote()) if line.startswith("WARNING")]
    late = [line for line in warnings if "was decided before this member's summaries arrived" in line]
    assert len(late) == 1, warnings  # once per interval, however many steps
    assert re.search(r"kept 0 of its [1-9]\d* candidates", late[0]) and "run_id" in late[0]
    on_time = [line for line in ray.get(actors[0].logged.remote()) if line.startswith("WARNING")]
    assert on_time == []  # the members on time have nothing to say
    for a in actors:
        ray.kill(a)
