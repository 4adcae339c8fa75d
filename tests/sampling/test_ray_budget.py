"""One per-step budget across Ray actors (``otr.RayBudget``), on a real local Ray cluster.

Three rollout actors record whole episodes; their union keeps exactly what one process holding
every episode would keep, for top_bottom, uniform and groups. An actor killed mid-step and a
coordinator killed between steps never block the others and never break the cap.
"""

from __future__ import annotations

import random
import time
import uuid

import pytest
import ray
import ray_workloads as w
from docs_blocks import page_blocks
from otr_helpers import configure_memory, reference_rewards

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
    on_time_totals = ray.get([a.end_step.remote(0) for a in actors[:2]], timeout=60)  # decided at the deadline
    # by the coordinator, not alone: a member that gave up waiting (its clock counted the
    # coordinator's start) keeps its own within cap // members, which looks the same here
    assert all("budget.local_fallback" not in t for t in on_time_totals), on_time_totals
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


# --- without members=N: a run's first step waits for the members that start after the first ------
STAGGERED_TIMEOUT_S = 30.0  # every actor of the test starts and sends its step 0 well within it


def _reference_rewards(policy: str, episodes: list[dict], step: int) -> list[float]:
    """The rewards one process holding every episode of the step keeps (see ``_reference``)."""
    chosen = otr.Groups(max_held=1000) if policy == "groups" else policy
    return reference_rewards(chosen, episodes, step, CAP)


def _spread_group(batches: list[list[dict]]) -> list[float]:
    """One group with a sample on every actor, the widest reward spread of the step (so
    ``groups`` keeps it first); its rewards."""
    rewards = [-10.0 * (a + 1) if a % 2 == 0 else 500.0 + a for a in range(len(batches))]
    for a, batch in enumerate(batches):
        batch[0].update(group="s0-spread", index=a, reward=rewards[a])
    return sorted(rewards)


def _coordinator_when_holding(name: str, run_id: str, members: int):
    """The coordinator, looked up as the docs say (``ray.get_actor`` in namespace
    ``otel_rollouts``), once it holds step 0 of ``run_id`` from ``members`` members: polls a
    state it reaches, never a clock."""
    while True:
        try:
            coordinator = ray.get_actor(name, namespace="otel_rollouts")
            if ray.get(coordinator.state.remote(run_id), timeout=120)["members"] >= members:
                return coordinator
        except ValueError:  # not made yet: the first member's end_step makes it
            pass
        time.sleep(0.05)


def test_without_members_the_first_step_waits_for_actors_that_start_seconds_apart(ray_cluster):
    """``RayBudget()`` with neither ``members`` nor a name (the job's default coordinator): three
    rollout actors per run start one after the other, each once the one before it has sent its
    step 0 to the coordinator (seconds apart: a worker process each). The first step is still
    the global choice: top_bottom exactly, and a group spread over the three actors kept whole."""
    tag = uuid.uuid4().hex[:8]
    runs = {"top_bottom": f"first-step-tb-{tag}", "groups": f"first-step-groups-{tag}"}
    batches = {policy: _episodes(0, ACTORS, seed=17 + n) for n, policy in enumerate(runs)}
    spread = _spread_group(batches["groups"])
    # the documented name of the job's default coordinator, the same in the driver and the actors
    name = f"otel_rollouts-budget-{ray.get_runtime_context().get_job_id()}"
    assert otr.RayBudget().actor_name() == name and otr.RayBudget.namespace == "otel_rollouts"
    actors: dict[str, list] = {policy: [] for policy in runs}
    ends = []
    for k in range(ACTORS):
        for policy, run_id in runs.items():
            actor = RolloutActor.options(num_cpus=0).remote(None, None, policy, CAP, STAGGERED_TIMEOUT_S, run_id)
            actor.run_step.remote(0, batches[policy][k])
            ends.append(actor.end_step.remote(0))  # in order after run_step (one caller)
            actors[policy].append(actor)
        for run_id in runs.values():  # the next actors start after this one's summaries arrived
            coordinator = _coordinator_when_holding(name, run_id, k + 1)
    totals = ray.get(ends, timeout=300)
    kept = {policy: sorted(r for rs in ray.get([a.kept_rewards.remote() for a in actors[policy]]) for r in rs)
            for policy in runs}
    assert set(spread) <= set(kept["groups"])  # the group spread over the actors is kept whole
    for policy, run_id in runs.items():
        assert len(kept[policy]) == CAP if policy == "top_bottom" else len(kept[policy]) <= CAP  # groups: whole
        assert kept[policy] == _reference_rewards(policy, [e for b in batches[policy] for e in b], 0), policy
        assert ray.get(coordinator.state.remote(run_id))["members"] == ACTORS
    # the docs' lookup of the job's default coordinator, run as written
    (lookup,) = [b for b in page_blocks("ray-and-multi-node.md", "python") if b.marker == "run-by"]
    for run_id in runs.values():
        scope = {"otr": otr, "ray": ray, "run_id": run_id}
        exec(compile(lookup.code, str(lookup), "exec"), scope)
        assert scope["coordinator"]._actor_id == coordinator._actor_id
        assert scope["state"]["members"] == ACTORS and scope["state"]["steps"] == [0]
    # every member was in the decision: none late, none alone
    assert all("budget.late_steps" not in t and "budget.local_fallback" not in t for t in totals), totals
    for policy_actors in actors.values():
        for a in policy_actors:
            ray.kill(a)


def test_a_coordinator_slow_to_start_is_waited_for_apart_from_the_step(ray_cluster):
    """The coordinator's start (a worker process; here made to take 10 s, as on a loaded machine)
    does not count against the members' wait for the step's answer: members on time are decided
    together by the coordinator, never alone (``budget.local_fallback``) while it starts. Before,
    a member's ``timeout_s + 5 s`` ran from its call, start included, so members gave up, kept
    their own within ``cap // members`` and left their summaries to a decision they never saw
    (what made the late-member test above fail under load)."""
    name = f"budget-{uuid.uuid4().hex[:8]}"
    coordinator = ray.remote(w.SlowStartingCoordinator).options(
        name=name, namespace="otel_rollouts", lifetime="detached", num_cpus=0).remote(10.0)
    actors = [RolloutActor.options(num_cpus=0).remote(name, 2, "top_bottom", CAP, 2.0) for _ in range(2)]
    batches = _episodes(0, 2, seed=23)
    totals = _step(actors, 0, batches)
    assert all("budget.local_fallback" not in t for t in totals), totals
    assert _kept(actors) == set(_reference("top_bottom", batches[0] + batches[1], 0))
    for a in [*actors, coordinator]:
        ray.kill(a)
