"""The columnar recording path keeps exactly what the per-episode path keeps.

``otr.record_batch`` offers a batch to the tail sampler as columns; only rows the sampler could
still keep become episode records. The property test records the same samples both ways (one
``otr.episode`` per sample, then ``otr.record_batch`` per batch) under every built-in policy, a
composition and a custom policy (no batch offer: rows one by one), with several batches per step,
ties, unscored rows, errors and groups, and compares the kept episodes and the counts.
"""

from __future__ import annotations

import math
import threading
from typing import Any

import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st
from opentelemetry.sdk.trace.export.in_memory_span_exporter import InMemorySpanExporter
from otr_helpers import configure_memory
from profiles import examples

import otel_rollouts as otr
from otel_rollouts import conventions as c
from otel_rollouts.sampling.pipeline import READY_BATCH


class LastWins:
    """A custom policy (no ``candidates``): keeps the last ``cap`` episodes by arrival."""

    name = "last_wins"

    def bucket(self, cap, key, *, stream=False, margin=0):
        return _LastBucket(cap + margin)

    def needs(self):
        return set()


class _LastBucket:
    def __init__(self, capacity):
        self.capacity, self.records = capacity, []

    def offer(self, record):
        self.records.append(record)
        if len(self.records) > self.capacity:
            return [self.records.pop(0)], []
        return [], []

    def decide(self, limit=None, exclude=None):
        out = [r for r in self.records if id(r) not in (exclude or set())]
        return out[: self.capacity if limit is None else limit]

    def held(self):
        return list(self.records)


class ReadsMetadata:
    """A custom policy reading an attribute no batch column has: whole records, as before."""

    name = "reads_metadata"

    def bucket(self, cap, key, *, stream=False, margin=0):
        return _LastBucket(cap + margin)

    def needs(self):
        return {c.RL_METADATA_PREFIX + "difficulty"}


POLICIES: dict[str, Any] = {
    "first": lambda: "first",
    "uniform": lambda: "uniform",
    "top_bottom": lambda: "top_bottom",
    "errors": lambda: "errors",
    "groups": lambda: "groups",
    "groups_uniform": lambda: otr.Groups(rule="uniform", seed=3),
    "errors+top_bottom": lambda: "errors+top_bottom",
    "compose": lambda: otr.Compose(otr.Errors(2), otr.TopBottom(top=2, bottom=2), otr.Uniform()),
    "first_then_uniform": lambda: otr.Compose(otr.First(2), otr.Uniform(seed=7)),
    "advantage": lambda: otr.TopBottom(score=c.RL_ADVANTAGE, top=3, bottom=1),
    "custom": LastWins,
    "custom_reads_metadata": ReadsMetadata,
}

REWARDS = st.one_of(st.sampled_from([0.0, 0.5, 1.0, -1.0]), st.floats(-5, 5), st.just(math.nan))
ROW = st.tuples(
    REWARDS,  # reward (NaN: unscored)
    st.sampled_from([None, None, None, "error", "truncated", "ok", "weird"]),  # status
    st.one_of(st.integers(0, 5), st.none()),  # group (None: a group of one)
    st.one_of(st.none(), st.floats(-2, 2)),  # advantage
)
# most batches have no unscored row (the vectorised choice); some have (rows one by one)
BATCH = st.tuples(st.integers(0, 3), st.lists(ROW, max_size=30)).map(
    lambda t: t[1] if t[0] == 0 else [(0.25 if math.isnan(r[0]) else r[0], *r[1:]) for r in t[1]]
)
STEPS = st.lists(st.lists(BATCH, min_size=1, max_size=3), min_size=1, max_size=2)


def _gid(group: int | None) -> str | None:
    return None if group is None else f"g{group}"


def _run(policy_name: str, cap: int, steps: list, *, batched: bool) -> tuple[list, dict]:
    exporter = configure_memory(cap, POLICIES[policy_name](), sampler_options={"step_lag": None},
                                deterministic_ids=True, run_id="prop")
    try:
        index = 0
        for step, batches in enumerate(steps):
            for rows in batches:
                first = index
                index += len(rows)
                ids = list(range(first, index))
                if batched:
                    otr.record_batch(
                        len(rows), step=step,
                        rewards=[r[0] for r in rows], statuses=[r[1] for r in rows],
                        group_ids=[_gid(r[2]) for r in rows], advantages=[r[3] for r in rows],
                        sample_indices=ids, episode_ids=[f"e{i}" for i in ids],
                        record=lambda i, ep, rows=rows: ep.prompt(f"sample {rows[i]}"),
                    )
                    continue
                for i, (reward, status, group, advantage) in zip(ids, rows, strict=True):
                    with otr.episode(step=step, group_id=_gid(group), sample_index=i, episode_id=f"e{i}") as ep:
                        ep.prompt(f"sample {(reward, status, group, advantage)}")
                        if status is not None:
                            ep.finish(status=status)
                        ep.reward(reward, advantage=advantage)
            otr.end_step(step)
        otr.flush()
        kept = sorted(
            (s.attributes[c.RL_STEP], s.attributes[c.RL_SAMPLE_INDEX], s.attributes.get(c.RL_STATUS),
             s.attributes.get(c.RL_REWARD))
            for s in exporter.get_finished_spans() if s.parent is None
        )
        totals = otr.stats()["totals"]
        return kept, {k: totals.get(k, 0) for k in ("seen", "kept", "dropped.sampled_out", "started")}
    finally:
        otr.shutdown()


@pytest.mark.parametrize("policy_name", sorted(POLICIES))
@settings(max_examples=examples(75), deadline=None, suppress_health_check=[HealthCheck.function_scoped_fixture])
@given(steps=STEPS, cap=st.integers(0, 9))
def test_the_batch_path_keeps_what_the_per_episode_path_keeps(policy_name, steps, cap):
    one_by_one = _run(policy_name, cap, steps, batched=False)
    batched = _run(policy_name, cap, steps, batched=True)
    assert batched == one_by_one


def _batch_config(cap=4, policy="top_bottom"):
    exporter = configure_memory(cap, policy, sampler_options={"step_lag": None})
    return exporter


def _roots(exporter):
    return [s for s in exporter.get_finished_spans() if s.parent is None]


def test_only_candidates_become_records_and_content_is_built_only_for_them(otr_shutdown):
    exporter = _batch_config(cap=4)
    built = []
    summary = otr.record_batch(
        1000, step=0, rewards=[float(i % 97) for i in range(1000)],
        record=lambda i, ep: (built.append(i), ep.prompt(f"p{i}")),
    )
    assert summary.offered == 1000 and summary.recorded == len(built) <= 4
    otr.end_step(0)
    otr.flush()
    kept = sorted(s.attributes[c.RL_REWARD] for s in _roots(exporter))
    assert kept == [0.0, 0.0, 96.0, 96.0]  # top 2 and bottom 2, ties to the earlier / later
    step = otr.stats()["steps"]["0/train"]
    assert step["seen"] == step["started"] == 1000 and step["kept"] == 4
    assert step["dropped.sampled_out"] == 996
    prompts = [s for s in exporter.get_finished_spans() if s.name == c.SPAN_PROMPT]
    assert len(prompts) == 4


def test_groups_take_a_batch_whole_and_make_objects_only_for_held_rows(otr_shutdown, monkeypatch):
    from otel_rollouts.sampling import batch as batch_module

    made = []
    init = batch_module.BatchRow.__init__

    def counting_init(self, *args):
        made.append(args[1])
        init(self, *args)

    monkeypatch.setattr(batch_module.BatchRow, "__init__", counting_init)
    exporter = _batch_config(cap=16, policy="groups")
    # 125 GRPO groups of 8, in order; group g's rewards spread over g % 50 (groups 49, 99: widest)
    rewards = [float((i % 8) * ((i // 8) % 50)) for i in range(1000)]
    built = []
    summary = otr.record_batch(
        1000, step=0, rewards=rewards, group_ids=[f"g{i // 8}" for i in range(1000)],
        record=lambda i, ep: (built.append(i), ep.prompt(f"p{i}")),
    )
    otr.end_step(0)
    otr.flush()
    assert summary.offered == 1000 and summary.recorded == len(built) == len(made) <= 64
    kept_groups = {s.attributes[c.RL_GROUP_ID] for s in _roots(exporter)}
    assert kept_groups == {"g49", "g99"}
    step = otr.stats()["steps"]["0/train"]
    assert step["kept"] == 16 and step["dropped.sampled_out"] == 984


def test_a_failing_record_callback_is_reported_naming_the_sample(otr_shutdown):
    exporter = _batch_config(cap=2, policy="first")

    def record(i, ep):
        if i == 0:
            raise SystemError("boom in user code")
        ep.prompt("fine")

    summary = otr.record_batch(5, step=0, rewards=[1.0] * 5, record=record)
    assert [i for i, _ in summary.failed] == [0] and "sample 0" in summary.failed[0][1]
    otr.end_step(0)
    otr.flush()
    assert len(_roots(exporter)) == 1  # the other kept sample
    assert otr.stats()["totals"]["dropped.batch_record_failed"] == 1


def test_bad_columns_are_noted_and_the_batch_still_recorded(otr_shutdown):
    exporter = _batch_config(cap=8)

    class Hostile:
        def __float__(self):
            raise SystemExit("no")

        def __repr__(self):
            raise RuntimeError("no repr")

    summary = otr.record_batch(3, step=0, rewards=[1.0, Hostile(), 2.0], group_ids=["a"])
    assert any("group_ids: 1 values for 3 samples" in p for p in summary.problems)
    otr.end_step(0)
    otr.flush()
    roots = _roots(exporter)
    assert len(roots) == 3
    flagged = [r for r in roots if r.attributes.get(c.RL_REWARD) is None]
    assert len(flagged) == 1  # the hostile reward: refused, the episode still recorded
    reward_spans = [s for s in exporter.get_finished_spans() if s.name == c.SPAN_REWARD]
    assert any(c.RL_INVALID_FIELDS in s.attributes for s in reward_spans)


def test_a_batch_for_a_closed_step_follows_the_late_rule(otr_shutdown):
    exporter = _batch_config(cap=3)
    otr.record_batch(2, step=0, rewards=[1.0, 2.0])
    otr.end_step(0)
    otr.record_batch(4, step=0, rewards=[5.0, 6.0, 7.0, 8.0])  # late: one more fits the cap
    otr.flush()
    assert sorted(s.attributes[c.RL_REWARD] for s in _roots(exporter)) == [1.0, 2.0, 5.0]
    step = otr.stats()["steps"]["0/train"]
    assert step["late"] == 4 and step["dropped.late"] == 3


def test_a_step_closed_while_rows_are_being_recorded_gets_them(otr_shutdown):
    exporter = _batch_config(cap=2)
    entered, release = threading.Event(), threading.Event()

    def record(i, ep):
        entered.set()
        release.wait(10)
        ep.prompt("slow")

    t = threading.Thread(target=otr.record_batch, args=(6,),
                         kwargs={"step": 0, "rewards": [float(i) for i in range(6)], "record": record})
    t.start()
    assert entered.wait(10)
    otr.end_step(0)  # the sampler decides while the kept rows' episodes are being recorded
    release.set()
    t.join(10)
    otr.flush()
    assert sorted(s.attributes[c.RL_REWARD] for s in _roots(exporter)) == [0.0, 5.0]
    assert otr.stats()["steps"]["0/train"]["kept"] == 2


def test_metrics_count_rows_dropped_without_records(configured):
    from opentelemetry.sdk.metrics.export import InMemoryMetricReader

    reader = InMemoryMetricReader()
    configured(2, "top_bottom", sampler_options={"step_lag": None}, metric_readers=[reader])
    otr.record_batch(50, step=0, rewards=[float(i) for i in range(50)])
    otr.end_step(0)
    otr.flush()
    points: dict[str, float] = {}
    for rm in reader.get_metrics_data().resource_metrics:
        for sm in rm.scope_metrics:
            for m in sm.metrics:
                for p in m.data.data_points:
                    points[m.name] = points.get(m.name, 0) + getattr(p, "value", getattr(p, "count", 0))
    assert points[c.METRIC_EPISODES_SEEN] == 50
    assert points[c.METRIC_EPISODES_DROPPED] == 48
    assert points[c.METRIC_REWARD] == 50  # every reward in the histogram, dropped ones too


class _CountingLock:
    """Wraps a lock and counts how often it is taken."""

    def __init__(self, lock):
        self.lock, self.taken = lock, 0

    def acquire(self, *args, **kwargs):
        self.taken += 1
        return self.lock.acquire(*args, **kwargs)

    def release(self):
        self.lock.release()

    def __enter__(self):
        self.acquire()
        return self

    def __exit__(self, *exc):
        self.release()


def test_episodes_are_offered_many_per_lock_round_trip_and_take_no_stats_lock(otr_shutdown):
    rollouts = otr.configure(exporters=[InMemorySpanExporter()],
                             sampler=otr.TailSampler(2, "top_bottom", step_lag=None))
    pipeline = rollouts.pipeline
    with otr.episode(step=0) as ep:  # the first of its step: the lag rule takes the lock
        ep.reward(0.0)
    pipeline._lock = _CountingLock(pipeline._lock)
    stats_lock = pipeline.stats._lock = _CountingLock(pipeline.stats._lock)
    for i in range(100):
        with otr.episode(step=0) as ep:
            ep.prompt("p")
            with ep.turn() as turn:
                turn.record_generation("x", model="m")
            ep.reward(float(i))
    # complete episodes wait in the ready queue and are offered READY_BATCH at a time: one
    # lock round-trip for 64 of them (the other 36 wait for the next batch or the step's close);
    # the ticker thread (once a second) or a slow machine (the oldest waited a second) may
    # offer them once more each, never once per episode
    assert 100 // READY_BATCH <= pipeline._lock.taken <= 100 // READY_BATCH + 2
    assert stats_lock.taken <= 2  # ~300 step counts, appended without a lock, added up in bulk
    step = otr.stats()["steps"]["0/train"]  # a read offers those waiting: every one is seen
    assert step["seen"] == step["started"] == 101
    assert step["dropped.sampled_out"] == 101 - 2  # the two candidates wait for the close


def test_a_kept_row_has_the_tree_its_record_callback_made(otr_shutdown):
    exporter = _batch_config(cap=2)
    prompts = [f"question {i}" for i in range(40)]

    def record(i, ep):  # the README's example
        ep.prompt(prompts[i])
        with ep.turn() as turn:
            turn.record_generation(f"answer {i}", model="policy")
            with turn.tool_call("calc", arguments={"i": i}) as call:
                call.result(i * 2)

    otr.record_batch(40, step=3, rewards=[float(i) for i in range(40)], group_ids=[f"p{i // 8}" for i in range(40)],
                     finish_reasons=["length" if i == 39 else "stop" for i in range(40)], record=record)
    otr.end_step(3)
    otr.flush()
    spans = exporter.get_finished_spans()
    roots = {s.context.trace_id: s for s in spans if s.parent is None}
    assert sorted(r.attributes[c.RL_SAMPLE_INDEX] for r in roots.values()) == [0, 39]
    for root in roots.values():
        mine = [s for s in spans if s.context.trace_id == root.context.trace_id]
        by_id = {s.context.span_id: s for s in mine}
        names = sorted(s.name for s in mine)
        assert names == sorted([c.SPAN_EPISODE, c.SPAN_PROMPT, c.SPAN_TURN, "chat policy", "execute_tool calc",
                                c.SPAN_REWARD])
        tool = next(s for s in mine if s.name == "execute_tool calc")
        assert by_id[tool.parent.span_id].name == c.SPAN_TURN
        assert root.attributes[c.RL_GROUP_ID] in ("p0", "p4") and root.end_time >= root.start_time
    last = next(r for r in roots.values() if r.attributes[c.RL_SAMPLE_INDEX] == 39)
    assert last.attributes[c.RL_STATUS] == c.STATUS_TRUNCATED and last.attributes[c.RL_FINISH_REASON] == "length"
