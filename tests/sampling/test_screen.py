"""The streaming reject (``sampling.screen``): an episode the screen rejects is one its bucket
would have let go at once without changing anything, and the pipeline's counts are the same
whether an episode went through the screen or the bucket, read before or after the step closed.
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
from otel_rollouts.sampling.compose import default_policy
from otel_rollouts.sampling.screen import screen_of
from otel_rollouts.sampling.tail import TailSampler


class Rec:
    def __init__(self, i: int, reward: object, status: str, companions: object = None) -> None:
        self.trace_id = 1000 + i
        self.attrs = {c.RL_REWARD: reward, c.RL_STATUS: status, c.RL_COMPANIONS_ID: companions}
        self.reason = None

    def attribute(self, key: str) -> object:
        return self.attrs.get(key)


def _score(value: object) -> float:
    if isinstance(value, bool) or not isinstance(value, (int, float)):
        return math.nan
    return float(value)


REWARDS = st.one_of(st.floats(allow_nan=True, allow_infinity=True, width=32), st.integers(-3, 3),
                    st.none(), st.sampled_from([0.0, 1.0, 0.5]))
STATUSES = st.sampled_from([c.STATUS_OK, c.STATUS_OK, c.STATUS_ERROR, c.STATUS_TRUNCATED, c.STATUS_FILTERED])


@settings(max_examples=examples(200), deadline=None)
@given(cap=st.integers(0, 9), policy=st.sampled_from(["default", "top_bottom", "errors_only", "tb_errors"]),
       episodes=st.lists(st.tuples(REWARDS, STATUSES, st.booleans()), max_size=60))
def test_a_rejected_episode_is_one_the_bucket_lets_go_unchanged(cap, policy, episodes) -> None:
    made = {"default": lambda: default_policy(cap), "top_bottom": lambda: make_policy("top_bottom"),
            "errors_only": lambda: otr.Errors(), "tb_errors": lambda: otr.Compose(otr.TopBottom(), otr.Errors(2))}
    bucket = TailSampler(cap, made[policy]()).bucket((0, "train"))
    screen = screen_of(bucket)
    assert screen is not None
    for i, (reward, status, companions) in enumerate(episodes):
        record = Rec(i, reward, status, f"p{i % 3}" if companions else None)
        rejected = (record.attribute(c.RL_COMPANIONS_ID) is None
                    and screen.rejects(_score(record.attribute(screen.score)), status))
        before = sorted(id(r) for r in bucket.held())
        released, keep_now = bucket.offer(record)
        if rejected:
            assert released == [record] and keep_now == []
            assert sorted(id(r) for r in bucket.held()) == before


def test_custom_and_other_policies_get_no_screen() -> None:
    for policy in ("uniform", "first", "groups", "errors+slowest+top_bottom"):
        assert screen_of(TailSampler(8, policy).bucket((0, "train"))) is None

    class Mine(otr.TopBottom):  # a subclass of a built-in whose bucket offers otherwise
        def bucket(self, cap, key, *, stream=False, margin=0):
            inner = super().bucket(cap, key, stream=stream, margin=margin)
            return type("Sub", (type(inner),), {})(self, cap, cap, cap, margin)

    assert screen_of(TailSampler(8, Mine()).bucket((0, "train"))) is None
    assert screen_of(TailSampler(8, otr.TopBottom()).bucket((0, "train"))) is not None


@pytest.mark.parametrize("cap", [0, 4, 32])
def test_counts_read_mid_step_and_after_the_close_are_exact(otr_shutdown, cap) -> None:
    otr.configure(exporters=[], sampler=otr.TailSampler(cap, step_lag=None))
    rng = Random(cap)
    n = 300
    for i in range(n):
        with otr.episode(step=0, group_id=f"g{i // 6}") as ep:
            if i % 50 == 7:
                ep.finish(status=c.STATUS_ERROR)
            ep.reward(rng.choice([0.0, 1.0, rng.random()]))
    mid = otr.stats()["steps"]["0/train"]
    assert mid["started"] == mid["seen"] == n
    held = n - mid.get("dropped.sampled_out", 0) - mid.get("kept", 0)
    assert 0 <= held <= 3 * cap  # the bucket holds what it may still choose: bounded by the cap
    assert otr.stats()["totals"]["seen"] == n
    otr.end_step(0)
    after = otr.stats()["steps"]["0/train"]
    assert after["seen"] == n
    assert after.get("kept", 0) + after.get("dropped.sampled_out", 0) == n
    assert after.get("kept", 0) == min(cap, n)
    assert after.get("dropped.sampled_out", 0) >= mid.get("dropped.sampled_out", 0)
