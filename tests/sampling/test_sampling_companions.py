"""Companions (``rl.companions.id``: a game's players, a preference chunk) are kept together:
when the tail sampler keeps one, the others of its (step, split) are kept too, within an extra
budget of the cap per step; the per-episode path (streaming and at the step's close), a policy
offered batches whole (``groups``) and the batch path's candidates."""

from __future__ import annotations

import pytest
from adapter_fixtures import configure_memory

import otel_rollouts as otr
from otel_rollouts import conventions as c
from otel_rollouts.sampling import TailSampler
from otel_rollouts.sampling.batch import RowBatch, rows


def record(step, name, reward, companions=None, group=None):
    with otr.episode(step=step, episode_id=name, group_id=group) as ep:
        if companions is not None:
            ep.set_attribute(c.RL_COMPANIONS_ID, companions)
        ep.reward(reward)


def kept(exporter):
    return sorted(s.attributes[c.RL_EPISODE_ID] for s in exporter.get_finished_spans()
                  if s.parent is None)


@pytest.mark.parametrize("policy", ["top_bottom", "uniform", "first", "groups", "errors+top_bottom"])
def test_a_kept_player_brings_its_game(otr_shutdown, policy):
    mem = configure_memory(cap=1, policy=policy)
    # game g1: the best (9) and a poor player (0); game g2 in the middle; a loner
    record(0, "g1.p0", 9.0, "g1", group="a")
    record(0, "g2.p0", 5.0, "g2", group="b")
    record(0, "g2.p1", 4.0, "g2", group="b")
    record(0, "g1.p1", 0.0, "g1", group="a")
    record(0, "solo", 1.0, group="c")
    otr.end_step(0)
    otr.flush()
    names = kept(mem)
    games = {n.split(".")[0] for n in names if n != "solo"}
    for game in games:  # whatever the policy chose, a game it touched is whole
        assert {f"{game}.p0", f"{game}.p1"} <= set(names), names
    assert len(names) <= 2  # the cap's choice plus its companion
    if policy in ("top_bottom", "first", "errors+top_bottom"):
        assert names == ["g1.p0", "g1.p1"]  # the best reward / the first episode is g1's


def test_without_companions_the_cap_holds_as_before(otr_shutdown):
    mem = configure_memory(cap=1, policy="top_bottom")
    for i, r in enumerate([3.0, 9.0, 1.0]):
        record(0, f"e{i}", r)
    otr.end_step(0)
    otr.flush()
    assert kept(mem) == ["e1"]


def test_companions_past_the_extra_budget_are_dropped_and_counted(otr_shutdown):
    """A game of five players under cap 2: at most 2 more than the cap's choice."""
    mem = configure_memory(cap=2, policy="top_bottom")
    for p in range(5):
        record(0, f"g.p{p}", float(p), "g")
    otr.end_step(0)
    otr.flush()
    assert len(kept(mem)) == 4
    step = otr.stats()["steps"]["0/train"]
    assert step["kept"] == 4 and step["dropped.sampled_out"] == 1


class _Batch:
    """Rows of one batch, with a companions column (what record_batch hands the sampler)."""

    def __init__(self, rewards, companions):
        self.batch = RowBatch(0, "train", len(rewards),
                              {c.RL_REWARD: rewards, c.RL_COMPANIONS_ID: companions},
                              trace_id_of=lambda i: i + 1)


@pytest.mark.parametrize("policy", ["top_bottom", "uniform", "first"])
def test_batch_candidates_include_companions(policy):
    """A batch path bucket offers only its candidates: a companion row outside them must still
    be offered (it can follow a kept one), and is kept with it at the close."""
    sampler = TailSampler(1, policy)
    bucket = sampler.bucket((0, "train"), stream=False)
    rewards = [0.5, 9.0, 0.2, 0.1, 0.3, 0.0]
    companions = [None, "g", None, None, None, "g"]  # row 5: the game's worst player
    batch = _Batch(rewards, companions).batch
    chosen = bucket.candidates(batch)
    assert 5 in list(chosen) and 1 in list(chosen)
    counter = iter(range(1, 100))
    held = []
    for row in rows(batch, list(chosen), counter):
        released, keep_now = bucket.offer(row)
        held.extend(keep_now)
    decided = bucket.with_companions(bucket.decide())
    indices = sorted(r.index for r in decided + held)
    if policy == "first":
        assert indices == [0]  # the first row, no companions
    else:
        assert indices == [1, 5] if policy == "top_bottom" else len(indices) in (1, 2)


def test_groups_offered_whole_keep_companions_across_groups():
    sampler = TailSampler(2, "groups")
    bucket = sampler.bucket((0, "train"), stream=False)
    # two GRPO groups of 2; the players of game "g" sit in different groups
    batch = RowBatch(0, "train", 4, {c.RL_REWARD: [0.0, 1.0, 0.5, 0.5],
                                     c.RL_GROUP_ID: ["a", "a", "b", "b"],
                                     c.RL_COMPANIONS_ID: ["g", None, None, "g"]},
                     trace_id_of=lambda i: i + 1)
    counter = iter(range(1, 100))
    released, held = bucket.offer_batch(batch, lambda i: rows(batch, [i], counter)[0])
    decided = bucket.with_companions(bucket.decide())
    assert sorted(r.index for r in decided) == [0, 1, 3]  # group a (spread 1), and 3 with 0


@pytest.mark.parametrize("policy", ["top_bottom", "uniform"])
def test_a_companion_let_go_early_still_follows_one_kept_later(configured, policy):
    """Under cap 1, several games' players are let go before the last player of the first game
    arrives and is chosen: its partner, parked since the start, comes back with it (parking
    was once bounded by the cap: the first game's partner was let go for good)."""
    mem = configured(1, policy)
    # rewards rise, so each new one displaces the held best; the games' second players come last
    for i, reward in enumerate([1.0, 2.0, 3.0, 4.0]):
        record(0, f"g{i}.p0", reward, f"g{i}")
    for i, reward in enumerate([1.5, 2.5, 3.5, 9.0]):
        record(0, f"g{i}.p1", reward, f"g{i}")
    otr.end_step(0)
    otr.flush()
    names = kept(mem)
    games = {n.split(".")[0] for n in names}
    assert games and all({f"{g}.p0", f"{g}.p1"} <= set(names) for g in games), names
    if policy == "top_bottom":
        assert names == ["g3.p0", "g3.p1"]
