"""The questions researchers ask of a step, answered by the sampler: why each episode was kept
(rl.trace.keep_reason), the stragglers (slowest), degenerate groups, a watchlist, and errors that
are never lost for want of a rule. Per episode, batched and across ranks (the merge)."""

from __future__ import annotations

import time

import pytest
from opentelemetry.sdk.trace.export.in_memory_span_exporter import InMemorySpanExporter
from otr_helpers import configure_memory

import otel_rollouts as otr
from otel_rollouts import conventions as c
from otel_rollouts.sampling import distributed
from otel_rollouts.sampling.batch import RowBatch
from otel_rollouts.sampling.health import StepGroups


def _roots(exporter: InMemorySpanExporter) -> list:
    return [s for s in exporter.get_finished_spans() if s.parent is None]


def _run(sampler: otr.TailSampler, episodes: list[dict], step: int = 0) -> list:
    """Record ``episodes`` (dicts of fields) at ``step`` and return the kept roots."""
    exporter = InMemorySpanExporter()
    otr.configure(exporters=[exporter], sampler=sampler)
    try:
        for e in episodes:
            with otr.episode(step=step, group_id=e.get("group"), dataset_index=e.get("index")) as ep:
                ep.prompt(e.get("prompt", f"question {e.get('index')}"))
                if "seconds" in e:  # a framework's own measure (what adapters set)
                    ep.set_attribute(c.RL_DURATION_SECONDS, e["seconds"])
                if e.get("status"):
                    ep.finish(status=e["status"])
                ep.reward(e["reward"])
        otr.end_step(step)
        otr.flush()
        return _roots(exporter)
    finally:
        otr.shutdown(timeout=10)


def _by_reason(roots: list) -> dict[str, list]:
    out: dict[str, list] = {}
    for r in roots:
        out.setdefault(r.attributes[c.RL_KEEP_REASON], []).append(r)
    return out


def test_default_policy_keeps_the_crash_tied_with_truncated_ones():
    """The new user's run: a crash scored 0.0, tied with three truncated episodes. The default
    policy keeps the crash, and says why."""
    episodes = [{"reward": 0.0, "status": "truncated"} for _ in range(3)]
    episodes.insert(1, {"reward": 0.0, "status": "error"})
    episodes += [{"reward": 0.5 + i / 100} for i in range(20)]
    roots = _run(otr.TailSampler(4), episodes)
    reasons = {(r.attributes[c.RL_STATUS], r.attributes[c.RL_KEEP_REASON]) for r in roots}
    assert ("error", "error") in reasons
    assert len(roots) == 4
    # errors stay within their share (a quarter of the cap): the rest is top and bottom
    assert sum(1 for r in roots if r.attributes[c.RL_KEEP_REASON] in ("error", "truncated")) == 1
    assert {"top", "bottom"} <= {r.attributes[c.RL_KEEP_REASON] for r in roots}


def test_every_kept_root_says_why():
    episodes = []
    for g in range(6):
        for k in range(4):
            reward = 1.0 if g == 2 else k / 4  # group 2: all equal, zero advantage
            e = {"group": f"g{g}", "index": g * 4 + k, "reward": reward, "seconds": 1.0 + g + k / 10}
            episodes.append(e)
    episodes[13]["status"] = "error"  # group 3 loses a member
    episodes[21]["seconds"] = 99.0  # the straggler
    sampler = otr.TailSampler(16, policy="errors+slowest+top_bottom+degenerate_groups")
    roots = _run(sampler, episodes)
    why = _by_reason(roots)
    assert [r.attributes[c.RL_DATASET_INDEX] for r in why["error"]] == [13]
    slowest = sorted(r.attributes[c.RL_DURATION_SECONDS] for r in why["slowest"])
    # equal shares of 4: the one error leaves three places of its share to the slowest
    assert slowest[-1] == 99.0 and len(slowest) == 7
    assert slowest == sorted(e["seconds"] for e in episodes if e.get("status") != "error")[-7:]
    assert {r.attributes[c.RL_REWARD] for r in why["top"]} == {1.0}
    assert all(r.attributes[c.RL_REWARD] == 0.0 for r in why["bottom"])
    # a degenerate group is kept whole: the members earlier parts took, and the rest for it
    degenerate = {r.attributes[c.RL_GROUP_ID] for r in why["degenerate_group"]}
    assert degenerate
    for gid in degenerate:
        assert sum(1 for r in roots if r.attributes[c.RL_GROUP_ID] == gid) == 4
    assert len(roots) <= 16
    # the degenerate group's members say how it fared, whoever kept them
    g2 = [r for r in roots if r.attributes[c.RL_GROUP_ID] == "g2"]
    assert g2 and all(r.attributes[c.RL_GROUP_ALL_EQUAL] is True for r in g2)
    assert all(r.attributes[c.RL_GROUP_DEGENERATE] == c.DEGENERATE_ALL_EQUAL for r in g2)
    assert all(r.attributes[c.RL_GROUP_REWARD_SPREAD] == 0.0 and r.attributes[c.RL_GROUP_SIZE] == 4
               for r in g2)
    g3 = [r for r in roots if r.attributes[c.RL_GROUP_ID] == "g3"]
    assert g3 and all(r.attributes[c.RL_GROUP_DEGENERATE] == c.DEGENERATE_LOST
                      and r.attributes[c.RL_GROUP_LOST] == 1 for r in g3)
    healthy = [r for r in roots if r.attributes[c.RL_GROUP_ID] not in ("g2", "g3")]
    assert healthy and all(c.RL_GROUP_DEGENERATE not in r.attributes for r in healthy)


def test_degenerate_groups_keeps_whole_groups_and_no_healthy_one():
    episodes = []
    for g in range(5):
        for k in range(4):
            episodes.append({"group": f"g{g}", "reward": 0.0 if g in (1, 3) else k / 4})
    roots = _run(otr.TailSampler(12, policy=otr.DegenerateGroups(groups=1)), episodes)
    assert {r.attributes[c.RL_GROUP_ID] for r in roots} == {"g1"}
    assert len(roots) == 4
    assert {r.attributes[c.RL_KEEP_REASON] for r in roots} == {c.REASON_DEGENERATE_GROUP}


def test_lost_members_from_the_expected_group_size():
    episodes = [{"group": "g0", "reward": k / 3} for k in range(3)]  # one of four never came
    roots = _run(otr.TailSampler(8, policy="top_bottom", group_size=4), episodes)
    assert len(roots) == 3
    for r in roots:
        assert r.attributes[c.RL_GROUP_LOST] == 1
        assert r.attributes[c.RL_GROUP_EXPECTED_SIZE] == 4
        assert r.attributes[c.RL_GROUP_DEGENERATE] == c.DEGENERATE_LOST


def test_slowest_ranks_measured_time_and_never_unmeasured():
    """Live episodes are timed by their root; the two slowest are the ones that ran longest."""
    exporter = configure_memory(2, "slowest")
    try:
        for i in range(6):
            with otr.episode(step=0, dataset_index=i) as ep:
                with ep.turn().tool_call("search", arguments={"q": i}) as call:
                    if i in (1, 4):  # the slow tool calls: a workload, not a synchronisation
                        time.sleep(0.03)
                    call.result("ok")
                ep.reward(0.0)
        # an adapter's episode, recorded after the fact without the framework's timings
        with otr.episode(step=0, dataset_index=99, framework="someframework") as ep:
            ep.reward(0.0)
        otr.end_step(0)
        otr.flush()
        roots = _roots(exporter)
    finally:
        otr.shutdown(timeout=10)
    assert sorted(r.attributes[c.RL_DATASET_INDEX] for r in roots) == [1, 4]
    for r in roots:
        assert r.attributes[c.RL_KEEP_REASON] == "slowest"
        assert r.attributes[c.RL_DURATION_SECONDS] >= 0.03
        # where the time went: the tool stage, on the root, so a table can sort by it
        assert r.attributes[c.stage_seconds(c.STAGE_TOOL)] >= 0.03


def test_slowest_without_any_measure_keeps_nothing_and_writes_no_zero():
    exporter = configure_memory(4, "slowest+first")
    try:
        for i in range(3):
            with otr.episode(step=0, dataset_index=i, framework="someframework") as ep:
                ep.reward(1.0)
        otr.end_step(0)
        otr.flush()
        roots = _roots(exporter)
    finally:
        otr.shutdown(timeout=10)
    assert {r.attributes[c.RL_KEEP_REASON] for r in roots} == {"first"}
    for r in roots:
        assert c.RL_DURATION_SECONDS not in r.attributes
        assert not any(k.startswith(c.RL_STAGE_PREFIX) for k in r.attributes)


def test_watchlist_keeps_every_episode_of_a_watched_prompt_outside_the_cap():
    episodes = [{"index": i % 10, "reward": 0.5, "prompt": f"prompt {i % 10}"} for i in range(40)]
    sampler = otr.TailSampler(2, policy="first", watch=[3, otr.prompt_hash("prompt 7")], watch_per_step=6)
    roots = _run(sampler, episodes)
    watched = [r for r in roots if r.attributes[c.RL_KEEP_REASON] == "watch"]
    # index 3 and prompt 7 appear 4 times each: 8 watched, cut at watch_per_step
    assert len(watched) == 6
    keys = {r.attributes[c.RL_WATCH_KEY] for r in watched}
    assert keys == {"3", otr.prompt_hash("prompt 7")}
    assert all(r.attributes[c.RL_DATASET_INDEX] in (3, 7) for r in watched)
    assert all(r.attributes[c.RL_PROMPT_HASH] == otr.prompt_hash(f"prompt {r.attributes[c.RL_DATASET_INDEX]}")
               for r in watched)
    # the cap is untouched: two more by the policy, first come, none of them watched ones
    others = [r for r in roots if r.attributes[c.RL_KEEP_REASON] != "watch"]
    assert len(others) == 2 and {r.attributes[c.RL_DATASET_INDEX] for r in others} == {0, 1}


def test_watch_list_is_checked():
    with pytest.raises(ValueError, match=r"watch\[1\]"):
        otr.TailSampler(watch=[1, 2.5])
    with pytest.raises(ValueError, match="watch_per_step"):
        otr.TailSampler(watch=[1], watch_per_step=-1)
    assert otr.prompt_hash("hi") == otr.prompt_hash([{"role": "user", "content": "hi"}])

    class Hostile:
        def __str__(self):
            raise SystemExit("no")

        __repr__ = __str__

    for hostile in (Hostile(), [Hostile()], {"role": "user", "content": Hostile()}):
        digest = otr.prompt_hash(hostile)  # never raises, the same key each time
        assert isinstance(digest, str) and len(digest) == 16 and digest == otr.prompt_hash(hostile)


class _Labelled:
    """A custom policy: keeps the first ``cap`` with its own label."""

    label = "mine"

    def bucket(self, cap, key, *, stream=False, margin=0):
        return otr.First().bucket(cap, key, margin=1)

    def needs(self):
        return set()


class _Unlabelled(_Labelled):
    label = None  # type: ignore[assignment]


@pytest.mark.parametrize(("policy", "reason"), [(_Labelled(), "first"), (_Unlabelled(), "first")])
def test_custom_policy_reasons(policy, reason):
    # a custom policy built on a built-in bucket gets the bucket's reason
    roots = _run(otr.TailSampler(2, policy=policy), [{"reward": 1.0} for _ in range(4)])
    assert {r.attributes[c.RL_KEEP_REASON] for r in roots} == {reason}


def test_custom_bucket_without_reasons_gets_the_policy_label():
    class Bucket:
        def __init__(self):
            self.held_ = []

        def offer(self, record):
            self.held_.append(record)
            return [], []

        def decide(self, limit=None, exclude=None):
            return self.held_[:1]

        def held(self):
            return list(self.held_)

    class Mine:
        label = "by-hand"

        def bucket(self, cap, key, *, stream=False, margin=0):
            return Bucket()

        def needs(self):
            return set()

    roots = _run(otr.TailSampler(2, policy=Mine()), [{"reward": 1.0} for _ in range(3)])
    assert [r.attributes[c.RL_KEEP_REASON] for r in roots] == ["by-hand"]


def test_late_episode_says_late():
    exporter = configure_memory(4, "top_bottom")
    try:
        with otr.episode(step=0) as ep:
            ep.reward(1.0)
        otr.end_step(0)
        with otr.episode(step=0) as ep:  # after its step closed
            ep.reward(0.0)
        otr.flush()
        reasons = sorted(r.attributes[c.RL_KEEP_REASON] for r in _roots(exporter))
    finally:
        otr.shutdown(timeout=10)
    assert reasons == ["late", "top"]


def _batch_and_episodes(n: int, step: int) -> tuple[dict, list[dict]]:
    rewards = [((i * 37) % 11) / 10 if (i // 8) % 5 != 2 else 1.0 for i in range(n)]
    groups = [f"g{i // 8}" for i in range(n)]
    statuses = ["error" if i % 29 == 5 else "ok" for i in range(n)]
    seconds = [1.0 + ((i * 13) % 17) / 10 for i in range(n)]
    indices = [i % 50 for i in range(n)]
    cols = dict(rewards=rewards, group_ids=groups, statuses=statuses, durations=seconds,
                dataset_indices=indices)
    episodes = [dict(reward=rewards[i], group=groups[i], status=statuses[i], seconds=seconds[i],
                     index=indices[i]) for i in range(n)]
    return cols, episodes


@pytest.mark.parametrize("policy", ["errors+slowest+top_bottom", "errors+top_bottom+degenerate_groups",
                                    "default", "first", "top_bottom"])
def test_batched_path_keeps_the_same_episodes_for_the_same_reasons(policy):
    cols, episodes = _batch_and_episodes(200, step=3)

    def sampler():
        return otr.TailSampler(12, policy=policy, watch=[7, 30], watch_per_step=4, group_size=8)

    one_by_one = _run(sampler(), episodes, step=3)
    exporter = InMemorySpanExporter()
    otr.configure(exporters=[exporter], sampler=sampler())
    try:
        summary = otr.record_batch(200, step=3, **cols, record=lambda i, ep: ep.prompt(f"question {i % 50}"))
        otr.end_step(3)
        otr.flush()
        batched = _roots(exporter)
        stats = otr.stats()["steps"]["3/train"]
    finally:
        otr.shutdown(timeout=10)
    assert summary.recorded < 200  # not every row became an episode

    def seen(roots):
        return sorted((r.attributes[c.RL_DATASET_INDEX], r.attributes[c.RL_REWARD],
                       r.attributes[c.RL_KEEP_REASON], r.attributes.get(c.RL_GROUP_DEGENERATE),
                       r.attributes.get(c.RL_GROUP_LOST), r.attributes.get(c.RL_DURATION_SECONDS))
                      for r in roots)

    assert seen(batched) == seen(one_by_one)
    assert sum(1 for r in batched if r.attributes[c.RL_KEEP_REASON] == "watch") == 4
    assert stats["seen"] == 200 and stats["kept"] == len(batched)


@pytest.mark.parametrize("layout", ["adjacent", "interleaved"])
def test_group_health_on_batches_equals_one_by_one(layout):
    """A step as one batch of adjacent groups (the arrays, vectorised) or with a group split
    over runs and odd ids (merged per group): the same health as episode by episode."""
    n = 300
    if layout == "adjacent":
        gids = [f"g{i // 6}" for i in range(n)]
    else:
        gids = [f"g{i // 6}" if i % 50 else ("tuple", i // 6) for i in range(n)]
    rewards = [1.0 if (i // 6) % 4 == 0 else (i % 6) / 5 for i in range(n)]
    statuses = ["filtered" if i % 41 == 0 else "ok" for i in range(n)]
    columns = {c.RL_GROUP_ID: gids, c.RL_REWARD: rewards, c.RL_STATUS: statuses}
    batch = RowBatch(0, "train", n, columns, lambda i: i + 1)

    class Row:
        def __init__(self, i):
            self.i = i

        def attribute(self, name):
            column = columns.get(name)
            return None if column is None else column[self.i]

    together, apart = StepGroups(6), StepGroups(6)
    together.add_batch(batch)
    for i in range(n):
        apart.add(Row(i))
    assert together.summary() == apart.summary()
    assert together.summary().all_equal > 0 and together.summary().lost > 0
    for gid in set(gids):
        assert together.attributes(gid) == apart.attributes(gid)


def test_distributed_merge_carries_the_reasons():
    policy = otr.Compose(otr.Errors(1), otr.Slowest(1), otr.TopBottom(), equal_shares=True)
    payloads = []
    for rank in range(2):
        rows = []
        for i in range(6):
            attrs = {c.RL_REWARD: float(i + rank), c.RL_STATUS: "error" if (rank, i) == (1, 2) else "ok",
                     c.RL_DURATION_SECONDS: 50.0 if (rank, i) == (0, 4) else 1.0}
            rows.append((rank * 100 + i + 1, i, i, attrs))
        payloads.append({(0, "train"): rows})
    merged = distributed.merge_all(policy, 6, payloads)[(0, "train")]
    reasons = {(rank, index): why for rank, kept in enumerate(merged) for index, why in kept}
    assert reasons[(1, 2)] == "error"
    assert reasons[(0, 4)] == "slowest"
    assert set(reasons.values()) <= {"error", "slowest", "top", "bottom"}
    assert len(reasons) == 6


def test_stage_sums_kept_as_spans_end_equal_the_exact_unions():
    """The running sums SpanRecord.end keeps (the cheap path) give what the exact union of the
    spans gives, for sequential spans; overlapping ones take the exact path."""
    from otel_rollouts._core.stages import stage_totals

    exporter = InMemorySpanExporter()
    otr.configure(exporters=[exporter], sampler=otr.TailSampler(0))
    records = []
    try:
        for parallel in (False, True):
            with otr.episode(step=0) as ep:
                ep.prompt("q")
                for k in range(3):
                    with ep.turn() as turn:
                        turn.record_generation("a", model="m")
                        with turn.tool_call("search") as outer:
                            if parallel:  # a nested call of the same kind: overlapping intervals
                                with turn.tool_call("inner") as inner:
                                    inner.result(k)
                            outer.result(k)
                ep.reward(1.0)
                records.append((ep._record, list(ep._record.spans), ep._record.root))
    finally:
        otr.shutdown(timeout=10)
    for record, spans, root in records:
        record.spans, record.root, record.stages = spans, root, None
        fast = stage_totals(record)
        assert record.timing is not None
        record.timing, record.stages = None, None  # the exact path, from the spans
        exact = stage_totals(record)
        assert fast.keys() == exact.keys() == {c.STAGE_GENERATION, c.STAGE_TOOL, c.STAGE_REWARD, c.STAGE_WAITING}
        for stage in exact:
            assert fast[stage] == pytest.approx(exact[stage], abs=1e-9)


def test_a_watched_episode_gets_the_advantage_and_group_health_recorded_after_its_block(tmp_path):
    """The Quickstart's shape: ``ep.reward(...)`` inside the block, the advantage after it (once
    the group is scored). A watched episode waits for its step's close like the others, so what
    comes after its block reaches it: in the exporters (Trackio's stored metadata included)."""
    from otr_helpers import trackio_rows

    from otel_rollouts.exporters import TrackioExporter

    project = f"otr-watch-late-{tmp_path.name}"
    memory = InMemorySpanExporter()
    otr.configure(exporters=[memory, TrackioExporter(project)], handle_signals=False,
                  sampler=otr.TailSampler(2, policy="top_bottom", watch=[0], group_size=4))
    try:
        for step in range(2):
            for group, prompt in enumerate(["2+2?", "3*7?"]):
                for sample in range(4):
                    with otr.episode(step=step, group_id=f"p{group}", sample_index=sample,
                                     dataset_index=group) as ep:
                        ep.prompt([{"role": "user", "content": prompt}])
                        score = 1.0 if sample % 2 == 0 else 0.0
                        ep.reward(score, components={"math": score})
                    ep.reward(score, advantage=score - 0.5)  # the whole group is scored now
            otr.end_step(step)
        assert otr.flush(30)
        stats = otr.stats()
    finally:
        otr.shutdown(timeout=10)
    watched = [r for r in _roots(memory) if r.attributes[c.RL_KEEP_REASON] == "watch"]
    assert len(watched) == 8  # group p0 (dataset index 0), 4 per step, outside the cap of 2
    for root in watched:
        assert root.attributes[c.RL_ADVANTAGE] == root.attributes[c.RL_REWARD] - 0.5
        assert root.attributes[c.RL_GROUP_SIZE] == 4
        assert root.attributes[c.RL_GROUP_REWARD_SPREAD] == 1.0
    # nothing of them came apart as a late fragment: one reward span each, the advantage on it
    rewards = [s for s in memory.get_finished_spans() if s.name == c.SPAN_REWARD
               and s.context.trace_id in {r.context.trace_id for r in watched}]
    assert len(rewards) == 8 and all(c.RL_ADVANTAGE in s.attributes for s in rewards)
    stored = [row["metadata"] for row in trackio_rows(project)
              if row["metadata"].get(c.RL_KEEP_REASON) == "watch"]
    assert len(stored) == 8
    assert all(m[c.RL_ADVANTAGE] in (-0.5, 0.5) and m[c.RL_GROUP_SIZE] == 4 for m in stored)
    for step in range(2):
        counts = stats["steps"][f"{step}/train"]
        assert counts["kept.watch"] == 4 and counts["kept"] == 4 + 2  # the watched, and the cap


@pytest.mark.parametrize("policy, n", [(otr.Slowest(3), 3), (otr.Mismatch(2), 2), (otr.Slowest(20), 8)])
def test_a_parts_n_holds_when_it_is_the_whole_policy(policy, n):
    """``TailSampler(8, Slowest(3))`` keeps the 3 slowest, not 8 (the part's own ``n`` is what
    its user asked for); an ``n`` over the cap is cut to the cap. The kept ones are the right
    ones: the largest durations, or the largest mismatch KL."""
    stat = c.MISMATCH_STATS["kl"]
    exporter = InMemorySpanExporter()
    otr.configure(exporters=[exporter], sampler=otr.TailSampler(8, policy))
    try:
        for i in range(12):
            with otr.episode(step=0, dataset_index=i) as ep:
                ep.set_attribute(c.RL_DURATION_SECONDS, float(i))
                ep.set_attribute(stat, i / 100)
                ep.reward(0.5)
        otr.end_step(0)
        otr.flush()
        roots = _roots(exporter)
    finally:
        otr.shutdown()
    kept = sorted(root.attributes[c.RL_DATASET_INDEX] for root in roots)
    assert kept == list(range(12 - n, 12)), kept
    assert {root.attributes[c.RL_KEEP_REASON] for root in roots} == {policy.label}
