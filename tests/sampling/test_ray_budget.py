"""One per-step budget across Ray actors (``otr.RayBudget``), on a real local Ray cluster.

Three rollout actors record whole episodes; their union keeps exactly what one process holding
every episode would keep, for top_bottom, uniform and groups. An actor killed mid-step and a
coordinator killed between steps never block the others and never break the cap.
"""

from __future__ import annotations

import random
import uuid

import pytest
import ray
import ray_workloads as w
from otr_helpers import configure_memory

import otel_rollouts as otr

ACTORS = 3
CAP = 8
PER_ACTOR = 12  # three groups of four per actor and step
RolloutActor = ray.remote(w.Rollouts)
KINDS = {
    "plain": RolloutActor,
    "threaded": ray.remote(max_concurrency=4)(w.Rollouts),
    "async": ray.remote(w.AsyncRollouts),
}


def _episodes(step: int, actors: int, seed: int, logprobs: bool = False) -> list[list[dict]]:
    """Each actor's episodes of ``step``: distinct rewards, groups of four recorded on one actor.
    ``logprobs``: with the engine's and the trainer's logprobs (a distinct mismatch), except
    every fifth episode (none: never chosen by the mismatch part)."""
    rng = random.Random(seed * 1000 + step)
    rewards = rng.sample(range(10_000), actors * PER_ACTOR)
    durations = rng.sample(range(10_000), actors * PER_ACTOR)  # distinct: no tie to break
    deltas = random.Random(seed * 1000 + step + 1).sample(range(1, 10_000), actors * PER_ACTOR)
    out: list[list[dict]] = [[] for _ in range(actors)]
    for a in range(actors):
        for i in range(PER_ACTOR):
            out[a].append({
                "id": f"s{step}-a{a}-e{i}", "group": f"s{step}-a{a}-g{i // 4}", "index": i % 4,
                "reward": rewards[a * PER_ACTOR + i] / 100,
                "seconds": durations[a * PER_ACTOR + i] / 1000,
            })
            if logprobs and (a * PER_ACTOR + i) % 5 != 4:
                delta = deltas[a * PER_ACTOR + i] / 10_000
                out[a][-1]["logprobs"] = [-0.25, -1.0, -2.0]
                out[a][-1]["trainer_logprobs"] = [-0.25 + delta, -1.0 - delta, -2.0 + delta / 2]
    return out


def _reference(policy: str, episodes: list[dict], step: int) -> list[str]:
    """What one process holding every episode of the step keeps (no distributed budget; a
    Groups bucket large enough to hold every group, as the merge does)."""
    chosen = otr.Groups(max_held=1000) if policy == "groups" else policy
    exporter = configure_memory(CAP, chosen, sampler_options={"distributed": False},
                                run_id="ray-budget", deterministic_ids=True, handle_signals=False)
    try:
        for e in sorted(episodes, key=lambda e: e["id"]):
            with otr.episode(step=step, group_id=e["group"], sample_index=e["index"], episode_id=e["id"]) as ep:
                ep.set_attribute(otr.conventions.RL_DURATION_SECONDS, e["seconds"])
                w.record_logprobs(ep, e)
                ep.reward(e["reward"])
        otr.end_step(step)
        assert otr.flush(10)
        return sorted(f"{s.context.trace_id:032x}" for s in exporter.get_finished_spans() if s.name == "episode")
    finally:
        otr.shutdown(timeout=10)


def _step(actors: list, step: int, batches: list[list[dict]]) -> list[dict]:
    ray.get([a.run_step.remote(step, batch) for a, batch in zip(actors, batches, strict=True)])
    return ray.get([a.end_step.remote(step) for a in actors], timeout=120)


def _kept(actors: list) -> set[str]:
    return {t for kept in ray.get([a.kept.remote() for a in actors]) for t in kept}


def _late_rewards(actor) -> list[float]:
    return sorted(ray.get(actor.kept_rewards.remote()))


def _coordinator(name: str):
    return ray.get_actor(name, namespace="otel_rollouts")


@pytest.mark.parametrize(("policy", "kind"), [
    ("top_bottom", "plain"), ("uniform", "plain"), ("groups", "plain"),
    ("top_bottom", "threaded"), ("groups", "async"), ("slowest+top_bottom", "plain"),
    ("mismatch+top_bottom", "plain"),
])
def test_three_rollout_actors_keep_exactly_the_global_choice(ray_cluster, policy, kind):
    name = f"budget-{uuid.uuid4().hex[:8]}"
    actors = [KINDS[kind].remote(name, ACTORS, policy, CAP) for _ in range(ACTORS)]
    expected: set[str] = set()
    for step in range(2):
        batches = _episodes(step, ACTORS, seed=7, logprobs="mismatch" in policy)
        _step(actors, step, batches)
        reference = _reference(policy, [e for b in batches for e in b], step)
        assert len(reference) == CAP
        expected |= set(reference)
    kept = _kept(actors)
    assert kept == expected  # the cap held globally, and the policy's choice is the global one
    if "mismatch" in policy:  # the mismatch part chose (by rl.mismatch.kl), not only top_bottom
        reasons = [r for rs in ray.get([a.kept_reasons.remote() for a in actors]) for r in rs]
        assert reasons.count("mismatch") == 2 * (CAP // 2), reasons
    for a in actors:
        ray.kill(a)


def test_an_actor_killed_mid_step_is_left_out_and_not_waited_for_again(ray_cluster):
    name = f"budget-{uuid.uuid4().hex[:8]}"
    actors = [RolloutActor.remote(name, None, "top_bottom", CAP, 6.0) for _ in range(ACTORS)]
    _step(actors, 0, _episodes(0, ACTORS, seed=3))  # every member is known from here on
    before = _kept(actors)
    assert len(before) <= CAP
    # step 1: the third actor dies with its episodes recorded, before end_step
    batches = _episodes(1, ACTORS, seed=3)
    ray.get([a.run_step.remote(1, b) for a, b in zip(actors, batches, strict=True)])
    ray.kill(actors[2])
    ray.get([a.end_step.remote(1) for a in actors[:2]], timeout=60)  # decided at the deadline
    assert ray.get(_coordinator(name).state.remote())["absent"] == 1
    step1 = _kept(actors[:2]) - before
    assert step1 == set(_reference("top_bottom", batches[0] + batches[1], 1))
    # step 2: the dead actor is not waited for; the two survivors share the whole cap
    batches = _episodes(2, 2, seed=3)
    _step(actors[:2], 2, batches)
    step2 = _kept(actors[:2]) - before - step1
    assert step2 == set(_reference("top_bottom", batches[0] + batches[1], 2))


def _until_dead(coordinator) -> None:
    """Return once the killed coordinator refuses calls (synchronised on its state, not on a
    clock: ``ray.kill`` returns before the actor is gone)."""
    while True:
        try:
            ray.get(coordinator.state.remote(), timeout=120)
        except ray.exceptions.RayActorError:
            return


def _until_restarted(coordinator) -> None:
    """Return once Ray restarted the killed coordinator: the instance answering has forgotten
    every step (calls made meanwhile wait for it, or reach the old one before it is gone)."""
    while True:
        try:
            if not ray.get(coordinator.state.remote(), timeout=120)["steps"]:
                return
        except ray.exceptions.RayActorError:  # the call reached the old one as it went
            continue


@pytest.mark.parametrize("restart", [False, True], ids=["killed", "restarted"])
def test_a_dead_coordinator_never_blocks_and_never_breaks_the_cap(ray_cluster, restart):
    # every step waits for its three members, so a decision never depends on a deadline that a
    # loaded machine could miss; the long timeout_s only bounds a wait that never happens here
    name = f"budget-{uuid.uuid4().hex[:8]}"
    actors = [RolloutActor.remote(name, ACTORS, "top_bottom", CAP, 60.0) for _ in range(ACTORS)]
    _step(actors, 0, _episodes(0, ACTORS, seed=5))
    before = _kept(actors)
    coordinator = _coordinator(name)
    ray.kill(coordinator, no_restart=not restart)
    if restart:
        _until_restarted(coordinator)
    else:
        _until_dead(coordinator)
    # each member's own process has met the coordinator as it is now (dead, or restarted)
    seen = ray.get([a.coordinator_state.remote(name) for a in actors], timeout=300)
    if restart:
        assert all(s is not None and s["steps"] == [] for s in seen)
    else:
        assert seen == [None] * ACTORS
    batches = _episodes(1, ACTORS, seed=5)
    totals = _step(actors, 1, batches)  # returns: nobody waits on a dead coordinator
    step1 = _kept(actors) - before
    assert len(step1) <= CAP
    fallbacks = sum(t.get("budget.local_fallback", 0) for t in totals)
    if not restart:  # the handle met a dead actor: each member decided alone, within cap // members
        assert fallbacks == ACTORS
        assert len(step1) == ACTORS * (CAP // ACTORS)
    else:  # the restarted coordinator forgot step 0 and decides step 1 from what comes in: exact
        assert fallbacks == 0
        assert step1 == set(_reference("top_bottom", [e for b in batches for e in b], 1))
    # the next step finds a coordinator (the restarted one, or a new one) and is exact again
    batches = _episodes(2, ACTORS, seed=5)
    _step(actors, 2, batches)
    step2 = _kept(actors) - before - step1
    assert step2 == set(_reference("top_bottom", [e for b in batches for e in b], 2))
    for a in actors:
        ray.kill(a)


def test_a_member_arriving_after_the_deadline_keeps_only_what_the_cap_has_left(ray_cluster):
    name = f"budget-{uuid.uuid4().hex[:8]}"
    # the step's deadline is the first sender's timeout_s (6 s); the late member's own, long one
    # only bounds how long it waits for its answer, which a loaded machine may delay
    actors = [RolloutActor.remote(name, ACTORS, "top_bottom", CAP, t) for t in (6.0, 6.0, 60.0)]
    batches = _episodes(0, ACTORS, seed=11)
    batches[0], batches[1] = batches[0][:2], batches[1][:1]  # on time: 3 episodes, under the cap
    ray.get([a.run_step.remote(0, b) for a, b in zip(actors, batches, strict=True)])
    ray.get([a.end_step.remote(0) for a in actors[:2]], timeout=60)  # decided at the deadline
    on_time = _kept(actors[:2])
    assert len(on_time) == 3
    totals = ray.get(actors[2].end_step.remote(0), timeout=60)  # the late member
    late = _kept(actors[2:])
    assert totals.get("budget.late_steps") == 1, totals
    assert len(late) == CAP - 3  # what the step had left of the cap, not the whole cap
    # and the best of its own by the policy: the same as one process keeping CAP - 3 of them
    rewards = sorted(e["reward"] for e in batches[2])
    assert _late_rewards(actors[2]) == sorted(rewards[:2] + rewards[-3:])
    for a in actors:
        ray.kill(a)
