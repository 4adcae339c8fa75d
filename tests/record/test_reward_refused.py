"""A reward that is no number fails its episode, not only its reward span (issue 53).

Before: a NaN reward was flagged on the reward span alone; the root said ``rl.status=ok`` and the
group of three equal rewards and one NaN read all-equal with nothing lost. Now the root is
``error`` (its status and ``rl.invalid`` name the field), the group counts the member lost, and the
batch path's status column (what the sampler reads) says the same as the episode path's root.
"""

from __future__ import annotations

import math

from opentelemetry.trace import StatusCode

import otel_rollouts as otr
from otel_rollouts import conventions as c


def _roots(memory) -> dict[int, object]:
    return {s.attributes[c.RL_SAMPLE_INDEX]: s for s in memory.get_finished_spans() if s.parent is None}


def test_a_nan_reward_fails_the_episode_and_its_group_counts_it_lost(configured) -> None:
    memory = configured(100, "top_bottom", sampler_options={"group_size": 4, "step_lag": None})
    for i, reward in enumerate([1.0, 1.0, 1.0, math.nan]):
        with otr.episode(step=0, group_id="g", sample_index=i) as ep:
            ep.prompt("question")
            ep.reward(reward)
    otr.end_step(0)
    assert otr.flush(30)
    roots = _roots(memory)
    nan = roots[3]
    assert nan.attributes[c.RL_STATUS] == c.STATUS_ERROR
    assert nan.status.status_code is StatusCode.ERROR
    assert "reward: not finite: nan" in nan.attributes[c.RL_INVALID_FIELDS]
    assert "reward" in (nan.status.description or "")
    assert c.RL_REWARD not in nan.attributes
    (reward_span,) = [s for s in memory.get_finished_spans() if s.name == c.SPAN_REWARD
                      and s.context.trace_id == nan.context.trace_id]
    assert "reward: not finite: nan" in reward_span.attributes[c.RL_INVALID_FIELDS]
    for i in range(3):
        assert roots[i].attributes[c.RL_STATUS] == c.STATUS_OK
        assert c.RL_INVALID_FIELDS not in roots[i].attributes
    # the group: three equal rewards and a lost member, said as both
    assert {r.attributes[c.RL_GROUP_LOST] for r in roots.values()} == {1}
    assert {r.attributes[c.RL_GROUP_DEGENERATE] for r in roots.values()} == {c.DEGENERATE_ALL_EQUAL_LOST}


def test_ok_after_a_refused_reward_keeps_the_error_and_a_status_of_the_users_stays(configured) -> None:
    memory = configured(100, "first")
    with otr.episode(step=0, group_id="g", sample_index=0) as ep:
        ep.reward(float("inf"))
        ep.finish(status="ok")  # an adapter's default status, after the reward: not an all-clear
    with otr.episode(step=0, group_id="g", sample_index=1) as ep:
        ep.finish(reason="length", status="truncated")
        ep.reward("n/a")
    with otr.episode(step=0, group_id="g", sample_index=2) as ep:
        ep.reward(0.5, components={"format": math.nan})  # a component alone: the reward stands
    otr.end_step(0)
    assert otr.flush(30)
    roots = _roots(memory)
    assert roots[0].attributes[c.RL_STATUS] == c.STATUS_ERROR
    assert roots[1].attributes[c.RL_STATUS] == c.STATUS_TRUNCATED
    assert "reward: not a number: str 'n/a'" in roots[1].attributes[c.RL_INVALID_FIELDS]
    assert roots[2].attributes[c.RL_STATUS] == c.STATUS_OK
    assert roots[2].attributes[c.RL_REWARD] == 0.5


def test_the_batch_path_fails_a_refused_reward_as_the_episode_path_does(configured) -> None:
    memory = configured(100, "top_bottom", sampler_options={"group_size": 4, "step_lag": None})
    summary = otr.record_batch(
        4, step=0, rewards=[0.0, math.nan, 1.0, 1.0], group_ids=["g", "g", "g", "g"],
        statuses=["ok", None, "ok", "truncated"],
        record=lambda i, ep: ep.prompt(f"question {i}"),
    )
    otr.end_step(0)
    assert otr.flush(30)
    assert summary.recorded == 4
    roots = _roots(memory)
    statuses = {i: r.attributes[c.RL_STATUS] for i, r in roots.items()}
    assert statuses == {0: c.STATUS_OK, 1: c.STATUS_ERROR, 2: c.STATUS_OK, 3: c.STATUS_TRUNCATED}
    assert "reward: not finite: nan" in roots[1].attributes[c.RL_INVALID_FIELDS]
    assert {r.attributes[c.RL_GROUP_LOST] for r in roots.values()} == {1}
