"""The per-step cap is exact, per (rl.step, rl.split), and decides on whole episodes."""

from __future__ import annotations

import pytest
from opentelemetry.sdk.trace.export.in_memory_span_exporter import InMemorySpanExporter
from otr_helpers import root, traces, tree

import otel_rollouts as otr
from otel_rollouts import conventions as c


def _run(exporter, policy, cap, steps=3, per_step=20, splits=("train", "eval")):
    otr.configure(exporters=[exporter], sampler=otr.TailSampler(cap, policy))
    rewards = {}
    for step in range(steps):
        for split in splits:
            for i in range(per_step):
                reward = ((i * 7919) % per_step) / per_step  # a permutation of the rewards
                with otr.episode(step=step, split=split, group_id=f"g{i // 4}", sample_index=i) as ep:
                    ep.prompt("p")
                    with ep.turn() as t:
                        t.record_generation("a")
                    ep.reward(reward)
                rewards[ep.trace_id] = reward
        otr.end_step(step)
    otr.flush()
    return rewards


@pytest.mark.parametrize("policy", ["first", "top_bottom", "uniform"])
def test_cap_is_exact_per_step_and_split(otr_shutdown, policy):
    exporter = InMemorySpanExporter()
    _run(exporter, policy, cap=6)
    by_trace = traces(exporter)
    counts: dict = {}
    for spans in by_trace.values():
        r = root(spans)
        key = (r.attributes[c.RL_STEP], r.attributes[c.RL_SPLIT])
        counts[key] = counts.get(key, 0) + 1
        # whole episodes only: every kept trace has its full tree
        assert [n for _, n in tree(spans)] == ["episode", "prompt", "turn", "chat", "reward"]
    assert counts == {(s, sp): 6 for s in range(3) for sp in ("train", "eval")}
    st = otr.stats()["steps"]
    for s in range(3):
        for sp in ("train", "eval"):
            assert st[f"{s}/{sp}"]["seen"] == 20 and st[f"{s}/{sp}"]["kept"] == 6
            assert st[f"{s}/{sp}"]["dropped.sampled_out"] == 14


def test_first_keeps_the_first_finished(otr_shutdown):
    exporter = InMemorySpanExporter()
    _run(exporter, "first", cap=4, steps=1, splits=("train",))
    kept = sorted(root(s).attributes[c.RL_SAMPLE_INDEX] for s in traces(exporter).values())
    assert kept == [0, 1, 2, 3]


def test_top_bottom_keeps_best_and_worst(otr_shutdown):
    exporter = InMemorySpanExporter()
    rewards = _run(exporter, "top_bottom", cap=6, steps=1, splits=("train",))
    kept = sorted(root(s).attributes[c.RL_REWARD] for s in traces(exporter).values())
    ordered = sorted(rewards.values())
    assert kept == sorted(ordered[:3] + ordered[-3:])


def test_fewer_episodes_than_cap_keeps_all_once(otr_shutdown):
    exporter = InMemorySpanExporter()
    _run(exporter, "top_bottom", cap=50, steps=1, per_step=5, splits=("train",))
    assert len(traces(exporter)) == 5
    assert len(exporter.get_finished_spans()) == 25  # no episode twice


def test_nothing_of_a_dropped_episode_is_exported(configured):
    exporter = configured(1, "top_bottom")
    eps = []
    for _ in range(4):
        with otr.episode(step=0) as ep:
            ep.prompt("p")
        eps.append(ep)
    for i, ep in enumerate(eps):  # rewards recorded after every episode block closed
        ep.reward(float(i))
    otr.end_step(0)
    otr.flush()
    (spans,) = traces(exporter).values()
    assert root(spans).attributes[c.RL_REWARD] == 3.0
    assert {s.context.trace_id for s in exporter.get_finished_spans()} == {spans[0].context.trace_id}


def test_errors_then_top_bottom_by_name(configured):
    """In a composition, "errors" takes only the errors; the rest of the cap goes on to top_bottom."""
    exporter = configured(10, "errors+top_bottom")
    for i in range(100):
        with otr.episode(step=0) as ep:
            ep.reward(float(i))
            if i in (40, 50, 60):
                ep.finish(status="error")
    otr.end_step(0)
    otr.flush()
    kept = sorted(root(s).attributes[c.RL_REWARD] for s in traces(exporter).values())
    assert kept == [0.0, 1.0, 2.0, 40.0, 50.0, 60.0, 96.0, 97.0, 98.0, 99.0]
