"""Accounting on the sampling pipeline: every episode seen ends kept or dropped under a named
reason, exactly once, with bounded memory (issue 28).

* an episode that ends without a reward after its step closed is decided at once (late rule);
* a repeated episode id under ``deterministic_ids`` never merges two episodes into one trace;
* the batch path: a ``KeyboardInterrupt`` from the user's per-row callback, a 0-d tensor column,
  a failing callback: every row counted per step;
* a reward recorded after its episode was kept goes out exactly once;
* attribute keys and counts are bounded at record time, flagged in ``rl.invalid`` and counted.

Real OpenTelemetry SDK (``InMemorySpanExporter``), real torch; no sleeps.
"""

from __future__ import annotations

import gc
import threading
import tracemalloc

import pytest
import torch
from otr_helpers import root, traces

import otel_rollouts as otr
from otel_rollouts import conventions as c
from otel_rollouts._core import runtime as _runtime
from otel_rollouts._core.content import Deferred


def _decided(counts: dict[str, int]) -> int:
    """Episodes of a step that ended kept or dropped (under any named reason)."""
    return counts.get("kept", 0) + sum(v for k, v in counts.items() if k.startswith("dropped."))


def _invalid(span) -> list[str]:
    return list(span.attributes.get(c.RL_INVALID_FIELDS) or ())


# --- 1. episodes without a reward after their step closed ----------------------------------------
def _rewardless(step: int, n: int) -> None:
    for _ in range(n):
        with otr.episode(step=step) as ep:
            ep.prompt("p" * 2000)  # no reward: the episode waits for one


def test_a_rewardless_episode_after_its_step_closed_is_decided_at_once_and_memory_is_flat(configured):
    exporter = configured(4, "top_bottom", sampler_options={"step_lag": None},
                          run_id="late-rewardless")
    with otr.episode(step=0) as ep:
        ep.reward(1.0)
    otr.end_step(0)
    _rewardless(0, 200)  # warm-up: caches, interned strings, the stats deque
    gc.collect()
    tracemalloc.start()
    try:
        before = tracemalloc.get_traced_memory()[0]
        _rewardless(0, 2000)
        gc.collect()
        grown = tracemalloc.get_traced_memory()[0] - before
    finally:
        tracemalloc.stop()
    # 2,000 held episodes of a 2 kB prompt would be over 4 MB; decided at once they leave nothing
    # (measured before any flush: a flush closes everything and would hide what is held)
    assert grown < 256 * 1024, grown
    assert _runtime.current().pipeline.open_episodes() == []
    counts = otr.stats()["steps"]["0/train"]
    assert counts["seen"] == 2201, counts
    assert counts["late"] == 2200, counts
    assert _decided(counts) == 2201, counts
    assert counts["kept"] == 4 and counts["dropped.late"] == 2197, counts
    otr.flush()
    assert len(traces(exporter)) == 4


def test_a_rewardless_episode_of_a_step_closed_by_the_lag_rule_is_decided_when_it_ends(configured):
    configured(2, "top_bottom", sampler_options={"step_lag": 1}, run_id="late-lag")
    with otr.episode(step=0) as ep:
        ep.reward(1.0)
    with otr.episode(step=1) as ep:  # step 0 closes (lag 1)
        ep.reward(1.0)
    _rewardless(0, 3)
    counts = otr.stats()["steps"]["0/train"]
    assert counts["seen"] == 4 and _decided(counts) == 4, counts
    assert not [r for r in _runtime.current().pipeline.open_episodes() if r.step == 0]


# --- 2. repeated episode ids with deterministic ids ------------------------------------------------
def test_a_repeated_episode_id_is_never_merged_into_another_episodes_trace(configured):
    exporter = configured(10, "first", deterministic_ids=True, run_id="dup")
    for _ in range(2):  # one after the other
        with otr.episode(step=0, episode_id="same") as ep:
            ep.reward(1.0)
    a = otr.episode(step=1, episode_id="same").start()  # both open at once
    b = otr.episode(step=1, episode_id="same").start()
    a.end()
    b.end()
    a.reward(1.0)
    b.reward(0.5)
    otr.end_step(0)
    otr.end_step(1)
    otr.flush()
    kept = traces(exporter)
    assert len(kept) == 4, {hex(t): [s.name for s in v] for t, v in kept.items()}
    assert all(len([s for s in spans if s.parent is None]) == 1 for spans in kept.values())
    stats = otr.stats()
    for step in ("0/train", "1/train"):
        assert stats["steps"][step]["kept"] == 2
        assert stats["steps"][step]["duplicate_id"] == 1, stats["steps"][step]
    flagged = [root(s) for s in kept.values() if any("episode_id" in m for m in _invalid(root(s)))]
    assert len(flagged) == 2
    assert all(r.attributes[c.RL_EPISODE_ID] == "same" for r in flagged)


def test_repeated_episode_ids_in_a_batch_are_kept_as_distinct_traces(configured):
    exporter = configured(10, "uniform", deterministic_ids=True, run_id="dup-batch")
    otr.record_batch(3, step=0, rewards=[1.0, 2.0, 3.0], episode_ids=["a", "a", "b"])
    otr.end_step(0)
    otr.flush()
    assert len(traces(exporter)) == 3
    counts = otr.stats()["steps"]["0/train"]
    assert counts["kept"] == 3 and counts["duplicate_id"] == 1, counts


# --- 3. the batch path -------------------------------------------------------------------------
@pytest.mark.parametrize("policy", ["first", "top_bottom"])
def test_a_keyboard_interrupt_from_the_record_callback_leaves_every_row_counted(configured, policy):
    exporter = configured(100, policy, run_id="kbi")

    def record(i: int, ep) -> None:
        ep.prompt(f"row {i}")
        if i == 3:
            raise KeyboardInterrupt

    with pytest.raises(KeyboardInterrupt):  # the user's own interrupt goes on to the user
        otr.record_batch(8, step=0, rewards=[float(i) for i in range(8)], record=record)
    otr.end_step(0)
    otr.flush()
    counts = otr.stats()["steps"]["0/train"]
    assert counts["seen"] == 8 and _decided(counts) == 8, counts
    assert counts["kept"] == len(traces(exporter)) == 3, counts
    assert counts["dropped.batch_record_failed"] == 5, counts
    assert _runtime.current().pipeline.open_episodes() == []


def test_a_0d_tensor_column_is_broadcast_and_the_batch_recorded(configured):
    exporter = configured(100, "first", run_id="0d")
    summary = otr.record_batch(4, step=0, rewards=torch.tensor(0.5), advantages=torch.tensor([1.0, 2.0, 3.0, 4.0]))
    otr.flush()
    assert summary.recorded == 4, summary
    assert any("rewards" in p for p in summary.problems), summary.problems
    kept = traces(exporter)
    assert len(kept) == 4
    assert sorted(root(s).attributes[c.RL_REWARD] for s in kept.values()) == [0.5] * 4


def test_a_failed_row_is_counted_per_step(configured):
    configured(100, "first", run_id="failed-row")

    def record(i: int, ep) -> None:
        if i == 1:
            raise ValueError("bad sample")

    summary = otr.record_batch(3, step=5, rewards=[1.0, 2.0, 3.0], record=record)
    otr.flush()
    assert [i for i, _ in summary.failed] == [1]
    counts = otr.stats()["steps"]["5/train"]
    assert counts["dropped.batch_record_failed"] == 1, counts
    assert counts["seen"] == 3 and _decided(counts) == 3, counts


# --- 4. a reward after the episode was kept, before it was exported --------------------------------
def test_a_reward_recorded_after_keep_but_before_export_is_sent_once(configured):
    exporter = configured(10, "first", run_id="reward-once")
    gate, rendering = threading.Event(), threading.Event()

    def blocked() -> list:
        rendering.set()
        gate.wait(30)
        return [{"role": "user", "content": "hello"}]

    with otr.episode(step=0) as first:  # its rendering holds the render thread
        first.prompt(Deferred(blocked))
        first.reward(1.0)
    assert rendering.wait(30)
    with otr.episode(step=0) as ep:  # kept at once (first), queued behind the blocked one
        ep.reward(0.0)
    ep.reward(1.0, advantage=0.5)  # after the decision, before the rendering
    gate.set()
    otr.flush()
    kept = traces(exporter)
    spans = kept[int(ep.trace_id, 16)]
    ids = [s.context.span_id for s in spans]
    assert len(ids) == len(set(ids)), [s.name for s in spans]
    assert len([s for s in spans if s.name == c.SPAN_REWARD]) == 2


# --- 5. attribute keys and counts ----------------------------------------------------------------
def test_metadata_keys_and_counts_are_bounded_and_flagged(configured):
    exporter = configured(10, "first", run_id="keys")
    metadata = {"x" * (2 * 1024 * 1024): 1}  # a 2 MB key
    metadata.update({f"k{i}": i for i in range(20_000)})
    with otr.episode(step=0, metadata=metadata) as ep:
        ep.set_attribute("y" * 100_000, 1)
        ep.reward(1.0, components={"z" * 100_000: 1.0})
    otr.flush()
    spans = traces(exporter)[int(ep.trace_id, 16)]
    for span in spans:
        assert len(span.attributes) <= 1024, (span.name, len(span.attributes))
        assert max(len(k) for k in span.attributes) <= 256, span.name
    top = root(spans)
    flags = _invalid(top)
    assert any(m.startswith("metadata") and "key" in m for m in flags), flags
    assert any(m.startswith("metadata") and "attributes" in m for m in flags), flags
    assert len(flags) < 20, len(flags)
    totals = otr.stats()["totals"]
    assert totals["dropped.attributes"] > 18_000, totals
    assert totals["cut.attribute_keys"] >= 3, totals  # the component on its span and the root


def test_attributes_set_through_the_opentelemetry_api_are_bounded(configured):
    from opentelemetry import trace

    exporter = configured(10, "first", run_id="api-keys")
    with otr.episode(step=0) as ep:
        span = trace.get_current_span()
        span.set_attributes({f"a{i}": i for i in range(5000)})
        span.set_attribute("b" * 10_000, "v")
        ep.reward(1.0)
    otr.flush()
    top = root(traces(exporter)[int(ep.trace_id, 16)])
    assert len(top.attributes) <= 1024
    assert max(len(k) for k in top.attributes) <= 256
    assert any("attributes" in m for m in _invalid(top))


def test_an_episode_with_100k_metadata_keys_and_a_2mb_key_holds_bounded_bytes(configured):
    configured(10, "top_bottom", run_id="keys-bytes")
    gc.collect()
    tracemalloc.start()
    try:
        before = tracemalloc.get_traced_memory()[0]
        metadata = {"k" * (2 * 1024 * 1024): 1}
        metadata.update({f"key-{i:06d}": i for i in range(100_000)})
        ep = otr.episode(step=0, metadata=metadata).start()
        del metadata
        gc.collect()
        held = tracemalloc.get_traced_memory()[0] - before  # what the open episode holds
    finally:
        tracemalloc.stop()
    assert ep.recording
    assert held < 512 * 1024, held  # unbounded: over 10 MB (100k attributes and the 2 MB key)
    ep.end()
