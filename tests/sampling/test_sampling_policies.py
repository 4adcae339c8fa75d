"""Sampling policies on their own: the cap, ties, duplicates, release-at-once, compositions.

A bucket only needs records with ``attribute(name)`` and ``trace_id`` (the protocol the
distributed budget also feeds), so these tests drive the policies with plain records; the
end-to-end tests in test_sampling.py run the same policies through the real pipeline.
"""

from __future__ import annotations

import math
from random import Random

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st
from profiles import examples

import otel_rollouts as otr
from otel_rollouts import conventions as c
from otel_rollouts.sampling import make_policy


class Rec:
    def __init__(self, i: int, reward=None, status: str = "ok", group=None, **extra):
        self.trace_id = 1000 + i
        self.i = i
        self.attrs = {c.RL_REWARD: reward, c.RL_STATUS: status, c.RL_GROUP_ID: group, **extra}

    def attribute(self, key):
        return self.attrs.get(key)

    def __repr__(self) -> str:
        return f"Rec({self.i}, {self.attrs[c.RL_REWARD]})"


def run(policy, records, cap, stream=False):
    """Offer every record; check the bucket's bookkeeping; return (kept, released, peak held)."""
    bucket = make_policy(policy).bucket(cap, (0, "train"), stream=stream)
    released, kept_now, peak = [], [], 0
    for r in records:
        out, now = bucket.offer(r)
        released += out
        kept_now += now
        peak = max(peak, len(bucket.held()))
    held = bucket.held()
    chosen = bucket.decide()
    kept = kept_now + chosen
    ids = [id(r) for r in kept]
    assert len(ids) == len(set(ids)), "an episode was chosen twice"
    assert len(kept) <= cap, "over the cap"
    released_ids = {id(r) for r in released}
    assert len(released_ids) == len(released), "an episode was released twice"
    assert not released_ids & set(ids), "a released episode was kept"
    assert not released_ids & {id(r) for r in held}, "a released episode is still held"
    everyone = released_ids | {id(r) for r in held} | {id(r) for r in kept_now}
    assert everyone == {id(r) for r in records}, "an episode was neither held nor released"
    return kept, released, peak


def rewards(kept):
    return sorted(r.attrs[c.RL_REWARD] for r in kept)


def test_first_streams_the_first_cap_and_releases_the_rest_at_once():
    records = [Rec(i, reward=i) for i in range(10)]
    bucket = otr.First().bucket(3, (0, "train"), stream=True)
    decisions = [bucket.offer(r) for r in records]
    assert [d[1] for d in decisions[:3]] == [[records[0]], [records[1]], [records[2]]]
    assert all(d == ([r], []) for d, r in zip(decisions[3:], records[3:], strict=True))
    kept, _, peak = run("first", records, 3)  # held until the step closes (compositions, ranks)
    assert [r.i for r in kept] == [0, 1, 2] and peak == 3


def test_top_bottom_keeps_best_and_worst_with_ties_to_the_earlier():
    records = [Rec(i, reward=r) for i, r in enumerate([5, 1, 9, 9, 3, 0, 0, 7, 9, 2])]
    kept, released, peak = run(otr.TopBottom(top=2, bottom=2), records, 4)
    assert sorted(r.i for r in kept) == [2, 3, 5, 6]  # 9,9 (first two nines), 0,0
    assert peak <= 4
    # the default split: half each side, the extra one to the top
    kept, _, _ = run("top_bottom", records, 5)
    assert rewards(kept) == [0, 0, 9, 9, 9]


def test_top_bottom_with_equal_scores_still_fills_the_cap():
    records = [Rec(i, reward=1.0) for i in range(10)]
    kept, _, peak = run("top_bottom", records, 4)
    assert sorted(r.i for r in kept) == [0, 1, 8, 9]  # best: the earliest; worst: the latest
    assert peak <= 4
    kept, _, _ = run(otr.TopBottom(top=1, bottom=3), [Rec(i, reward=0.5) for i in range(6)], 4)
    assert len(kept) == 4


def test_top_bottom_few_episodes_keeps_each_once():
    records = [Rec(i, reward=1.0) for i in range(3)]
    kept, released, _ = run("top_bottom", records, 8)
    assert sorted(r.i for r in kept) == [0, 1, 2] and released == []


def test_top_bottom_by_another_attribute_and_unscored_fill_only_free_room():
    records = [Rec(i, reward=0.0, **{c.RL_ADVANTAGE: float(i)}) for i in range(6)]
    records += [Rec(10 + i, reward=None) for i in range(3)]
    kept, _, _ = run(otr.TopBottom(score=c.RL_ADVANTAGE, top=1, bottom=1), records, 2)
    assert sorted(r.i for r in kept) == [0, 5]
    # unscored or NaN ones only fill what scored ones leave, and are let go once they cannot
    few = [Rec(0, reward=1.0), Rec(1, reward=math.nan), Rec(2, reward="high"), Rec(3, reward=True)]
    kept, _, _ = run("top_bottom", few, 3)
    assert [r.i for r in kept][0] == 0 and len(kept) == 3
    many = [Rec(100 + i) for i in range(5)] + [Rec(i, reward=float(i)) for i in range(6)]
    kept, released, _ = run("top_bottom", many, 4)
    assert rewards(kept) == [0.0, 1.0, 4.0, 5.0]
    assert {r.i for r in released} >= {100, 101, 102, 103, 104}


def test_uniform_is_seeded_reproducible_and_close_to_uniform():
    records = [Rec(i) for i in range(40)]
    a, _, peak = run(otr.Uniform(seed=1), records, 5)
    b, _, _ = run(otr.Uniform(seed=1), list(reversed(records)), 5)
    assert {r.i for r in a} == {r.i for r in b}  # depends on the episodes, not arrival order
    assert peak <= 5
    counts = [0] * 40
    for seed in range(400):
        kept, _, _ = run(otr.Uniform(seed=seed), records, 5)
        for r in kept:
            counts[r.i] += 1
    expected = 400 * 5 / 40  # 50 each
    chi2 = sum((n - expected) ** 2 / expected for n in counts)
    assert chi2 < 80, counts  # 39 dof: p < 1e-4 above ~80


def test_errors_first_then_truncated_first_come():
    statuses = ["ok", "truncated", "error", "ok", "error", "truncated", "error"]
    records = [Rec(i, status=s) for i, s in enumerate(statuses)]
    kept, released, peak = run(otr.Errors(), records, 4)
    assert [r.i for r in kept] == [2, 4, 6, 1]
    assert {r.i for r in released} == {0, 3, 5} and peak <= 4
    # the name means: failures first, the rest of the cap uniform
    kept, _, _ = run("errors", records, 5)
    assert {2, 4, 6, 1, 5} == {r.i for r in kept}
    kept, _, _ = run("errors", [Rec(i) for i in range(9)], 5)
    assert len(kept) == 5


def test_groups_kept_or_dropped_whole_by_reward_spread():
    records = []
    spreads = {"flat": [1, 1, 1, 1], "wide": [0, 1, 0, 1], "mid": [0.2, 0.5, 0.4, 0.3], "w2": [0, 1, 1, 0]}
    i = 0
    for gid, rs in spreads.items():
        for r in rs:
            records.append(Rec(i, reward=r, group=gid))
            i += 1
    kept, released, peak = run("groups", records, 9)
    groups = {}
    for r in kept:
        groups.setdefault(r.attrs[c.RL_GROUP_ID], []).append(r)
    assert set(groups) == {"wide", "w2"} and all(len(m) == 4 for m in groups.values())
    assert peak <= 18  # 2 x cap
    # interleaved arrival: still whole groups
    order = sorted(records, key=lambda r: (r.i % 4, r.i))
    kept, _, _ = run("groups", order, 8)
    assert {r.attrs[c.RL_GROUP_ID] for r in kept} == {"wide", "w2"} and len(kept) == 8


def test_groups_memory_rule_bounds_what_is_held():
    # 200 groups of 4 arriving one after another: held never goes over 2 x cap
    records = [Rec(i, reward=float((i // 4) % 7 == 3) * (i % 2), group=f"g{i // 4}") for i in range(800)]
    kept, _, peak = run(otr.Groups(), records, 8)
    assert peak <= 16
    assert {r.attrs[c.RL_GROUP_ID] for r in kept} == {"g3", "g10"}  # the first groups with spread
    # a group larger than the cap can never be kept whole: dropped whole
    big = [Rec(i, reward=float(i), group="big") for i in range(6)] + [Rec(9, reward=0.0, group="x")]
    kept, _, _ = run("groups", big, 4)
    assert [r.i for r in kept] == [9]


def test_compose_sub_budgets_errors_top_bottom_rest_uniform():
    records = [Rec(i, reward=float(i), status="error" if i in (3, 50, 77) else "ok") for i in range(100)]
    policy = otr.Compose(otr.Errors(2), otr.TopBottom(top=4, bottom=4), otr.Uniform())
    kept, _, peak = run(policy, records, 16)
    ids = [r.i for r in kept]
    assert ids[:2] == [3, 50]  # 2 errors, first come
    assert sorted(ids[2:6]) == [96, 97, 98, 99]  # top 4 of the rest
    assert sorted(ids[6:10]) == [0, 1, 2, 4]  # bottom 4 of the rest (3 was taken as an error)
    assert len(ids) == 16 and len(set(ids[10:]) & set(ids[:10])) == 0
    assert peak <= 3 * 2 * 16


def test_compose_never_over_the_cap_and_fills_from_later_parts():
    records = [Rec(i, reward=float(i % 5)) for i in range(30)]
    # budgets past the cap are cut
    kept, _, _ = run(otr.Compose(otr.TopBottom(top=4, bottom=4), otr.First(5)), records, 6)
    assert len(kept) == 6
    # no errors at all: their share goes to the part without a budget
    kept, _, _ = run(otr.Compose(otr.Errors(2), otr.Uniform()), records, 6)
    assert len(kept) == 6
    # the same episodes are candidates of several parts: each is kept once
    kept, _, _ = run(otr.Compose(otr.First(3), otr.First(3), otr.TopBottom()), records, 9)
    assert [r.i for r in kept[:6]] == [0, 1, 2, 3, 4, 5] and len(kept) == 9
    assert isinstance(make_policy("errors+top_bottom"), otr.Compose)


def test_named_composition_errors_take_at_most_their_share_and_pass_the_rest_on():
    # cap 3, two parts: shares 1 (errors) and 2 (top_bottom); most episodes failed
    records = [Rec(i, reward=float(i), status="error" if 5 <= i < 25 else "ok") for i in range(30)]
    for policy in ("errors+top_bottom", otr.TailSampler(3, "errors+top_bottom").policy):
        kept, _, _ = run(policy, records, 3)
        assert [r.i for r in kept] == [5, 29, 0]  # the first error, then the best and the worst
    # no errors in the step: the errors' share passes on, top_bottom fills the whole cap
    calm = [Rec(i, reward=float(i)) for i in range(30)]
    kept, _, _ = run("errors+top_bottom", calm, 3)
    assert [r.i for r in kept] == [29, 28, 0]
    # a few errors: each is kept (within the share), the rest of the cap goes on
    kept, _, _ = run("errors+top_bottom", records[:6] + calm[6:], 8)  # one error (5)
    assert [r.i for r in kept] == [5, 29, 28, 27, 26, 0, 1, 2]
    # at cap 8 errors get at most 4, explicit objects keep their explicit budgets, and the plain
    # name "errors" still means failures first (all the cap they can fill), the rest uniform
    kept, _, _ = run("errors+top_bottom", records, 8)
    assert [r.i for r in kept] == [5, 6, 7, 8, 29, 28, 0, 1]
    kept, _, _ = run(otr.Compose(otr.Errors(), otr.TopBottom()), records, 3)
    assert [r.i for r in kept] == [5, 6, 7]
    kept, _, _ = run("errors", records, 3)
    assert [r.i for r in kept] == [5, 6, 7]


def test_named_three_part_composition_splits_the_cap_as_documented():
    policy = make_policy("errors+top_bottom+uniform")
    records = [Rec(i, reward=float(i), status="error" if 10 <= i < 30 else "ok") for i in range(40)]
    kept, _, peak = run(policy, records, 8)
    ids = [r.i for r in kept]
    assert ids[:2] == [10, 11]  # errors: their share, 2
    assert ids[2:5] == [39, 38, 0]  # top_bottom: its share, 3 (2 best, 1 worst)
    uniform = otr.Uniform().bucket(3, (0, "train"))
    for r in records:
        if r.i not in ids[:5]:
            uniform.offer(r)
    assert ids[5:] == [r.i for r in uniform.decide()]  # uniform: its share, 3, of the rest
    assert peak <= 3 * 2 * 8
    assert policy.shares(8) == [2, 3, 3] and policy.shares(7) == [2, 2, 3]
    assert policy.shares(2) == [0, 1, 1] and sum(policy.shares(100)) == 100
    assert repr(policy).endswith("equal_shares=True)")
    # no errors: their 2 pass on to top_bottom (5), uniform still gets its 3
    kept, _, _ = run(policy, [Rec(i, reward=float(i)) for i in range(40)], 8)
    assert [r.i for r in kept][:5] == [39, 38, 37, 0, 1] and len(kept) == 8
    # an explicit Compose with equal shares is the same policy as the name
    same = otr.Compose(otr.Errors(), otr.TopBottom(), otr.Uniform(), equal_shares=True)
    assert [r.i for r in run(same, records, 7)[0]] == [r.i for r in run(policy, records, 7)[0]]


def _reference(parts, records, cap):
    """What a named composition keeps, part by part: each part, alone, over what the earlier parts
    left, with room for its equal share plus whatever the earlier parts left of theirs."""
    n = len(parts)
    shares = [(cap + i) // n for i in range(n)]
    assert sum(shares) == cap and max(shares) - min(shares) <= 1
    taken: list = []
    picks = []
    for k, part in enumerate(parts):
        room = sum(shares[: k + 1]) - len(taken)
        rest = [r for r in records if r not in taken]
        bucket = part.bucket(room, (0, "train"))
        for r in rest:
            bucket.offer(r)
        chosen = bucket.decide() if room > 0 else []
        picks.append(chosen)
        taken += chosen
    return picks, shares


@settings(max_examples=examples(180), deadline=None)
@given(
    statuses=st.lists(st.sampled_from(["ok", "ok", "error", "truncated"]), max_size=40),
    cap=st.integers(0, 13),
    name=st.sampled_from(["errors+top_bottom", "errors+uniform", "errors+top_bottom+uniform",
                          "errors+first+top_bottom", "first+uniform"]),
    seed=st.integers(0, 5),
)
def test_named_compositions_follow_their_shares_never_over_the_cap(statuses, cap, name, seed):
    rewards = list(range(len(statuses)))
    Random(seed).shuffle(rewards)  # distinct rewards: top/bottom is a total order
    records = [Rec(i, reward=float(rewards[i]), status=s) for i, s in enumerate(statuses)]
    policy = make_policy(name, seed)
    kept, _, _ = run(policy, records, cap)  # run() checks the cap, duplicates and release
    picks, shares = _reference(policy.parts, records, cap)
    at = 0
    for part, chosen, share in zip(policy.parts, picks, shares, strict=True):
        got = kept[at : at + len(chosen)]
        assert {id(r) for r in got} == {id(r) for r in chosen}, (name, part)
        if isinstance(part, otr.Errors):
            assert len(got) <= share  # errors never take more than their share
        at += len(chosen)
    assert at == len(kept) == min(cap, len(records))  # what one part leaves, the next fills


@settings(max_examples=examples(360), deadline=None)
@given(
    values=st.lists(
        st.one_of(st.none(), st.just(math.nan), st.integers(-3, 3).map(float)), max_size=60
    ),
    statuses=st.lists(st.sampled_from(["ok", "error", "truncated"]), min_size=60, max_size=60),
    cap=st.integers(0, 12),
    name=st.sampled_from(
        ["first", "uniform", "top_bottom", "errors", "groups", "errors+top_bottom+uniform",
         "first+first+uniform", "groups+top_bottom"]
    ),
)
def test_every_policy_respects_cap_uniqueness_and_release(values, statuses, cap, name):
    records = [Rec(i, reward=v, status=statuses[i], group=f"g{i % 5}") for i, v in enumerate(values)]
    kept, _, peak = run(name, records, cap)  # run() checks cap, duplicates and release
    assert peak <= 4 * max(cap, 1) * 3
    if name == "top_bottom" and cap:
        scored = sorted(v for v in values if v is not None and not math.isnan(v))
        top, bottom = cap - cap // 2, cap // 2
        k = [r.attrs[c.RL_REWARD] for r in kept]
        if len(scored) >= cap:
            assert sorted(k) == sorted(scored[:bottom] + scored[len(scored) - top :])


def test_tail_sampler_accepts_names_and_objects_and_refuses_bad_input():
    assert isinstance(otr.TailSampler(4, "groups").policy, otr.Groups)
    assert isinstance(otr.TailSampler(4, "errors").policy, otr.Compose)
    composed = otr.Compose(otr.Errors(2), "top_bottom", otr.Uniform())
    assert otr.TailSampler(4, composed).policy is composed
    with pytest.raises(ValueError, match="unknown sampling policy"):
        otr.TailSampler(4, "best")
    with pytest.raises(ValueError, match="max_traces_per_step"):
        otr.TailSampler(-1)
    with pytest.raises(ValueError, match="step_lag"):
        otr.TailSampler(4, step_lag=0)
    with pytest.raises(ValueError, match="Errors"):
        otr.Errors(-2)
    with pytest.raises(ValueError, match="rule"):
        otr.Groups(rule="best")


# --- extension point: a custom policy is any object with bucket() and needs() ---------------------
class HighestTraceIds:
    """A custom policy written as a plain class (no base class): the ``cap`` episodes with the
    highest trace ids, decided when the step closes."""

    def __init__(self, budget=None):
        self.budget = budget
        self.buckets = 0

    def needs(self) -> set[str]:
        return set()

    def bucket(self, cap, key, *, stream=False, margin=0):
        self.buckets += 1
        return _HighestBucket(cap + margin)


class _HighestBucket:
    def __init__(self, capacity):
        self.capacity = capacity
        self.records = []

    def offer(self, record):
        self.records.append(record)
        self.records.sort(key=lambda r: r.trace_id, reverse=True)
        released = self.records[self.capacity:]
        del self.records[self.capacity:]
        return released, []

    def decide(self, limit=None, exclude=None):
        exclude = exclude or set()
        fresh = [r for r in self.records if id(r) not in exclude]
        return fresh[: self.capacity if limit is None else limit]

    def held(self):
        return list(self.records)


def test_a_plain_class_satisfies_the_policy_protocol_alone_and_composed():
    from otel_rollouts.sampling import Bucket, Policy

    custom = HighestTraceIds()
    assert isinstance(custom, Policy) and isinstance(custom.bucket(1, (0, "train")), Bucket)
    assert not isinstance("first", Policy)
    for builtin in (otr.First(), otr.Uniform(), otr.TopBottom(), otr.Errors(), otr.Groups(),
                    otr.Compose(otr.Errors(), otr.Uniform())):
        assert isinstance(builtin, Policy)
        assert isinstance(builtin.bucket(2, (0, "train")), Bucket)
    assert make_policy(custom) is custom and otr.TailSampler(3, custom).policy is custom

    records = [Rec(i, reward=float(i)) for i in range(10)]
    kept, released, peak = run(custom, records, 3)
    assert sorted(r.i for r in kept) == [7, 8, 9] and peak <= 3
    # composed: 2 errors first, then the custom policy's budget of 2, then uniform fills the cap
    statuses = ["error" if i in (0, 1, 2) else "ok" for i in range(10)]
    records = [Rec(i, reward=float(i), status=s) for i, s in enumerate(statuses)]
    kept, _, _ = run(otr.Compose(otr.Errors(2), HighestTraceIds(budget=2), otr.Uniform()),
                     records, 6)
    ids = sorted(r.i for r in kept)
    assert len(ids) == 6 and len(set(ids)) == 6
    assert sum(1 for i in ids if i in (0, 1, 2)) >= 2 and {8, 9} <= set(ids)


def test_a_custom_policy_drives_the_real_pipeline(configured):

    custom = HighestTraceIds()
    exporter = configured(2, custom, sampler_options={"step_lag": None})
    tids = []
    for i in range(5):
        with otr.episode(step=0) as ep:
            ep.prompt(f"question {i}")
            ep.reward(float(i))
        tids.append(int(ep.trace_id, 16))
    assert otr.flush()
    kept = {s.context.trace_id for s in exporter.get_finished_spans()}
    assert kept == set(sorted(tids)[-2:]) and custom.buckets == 1
