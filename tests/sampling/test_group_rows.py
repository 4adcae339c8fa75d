"""Group health that means what it says (issue 52, item 2), through the real pipeline.

A truncated member is scored, not lost: it is counted in ``rl.group.truncated``, never in
``rl.group.lost``, and never makes a group degenerate. A group both all-equal and short of
members says both (``rl.group.degenerate`` = ``all_equal,lost_members``; ``rl.group.all_equal`` and
``rl.group.lost`` on the root; each in the step's scalars; under both words on the ``rl.groups``
counter). Every group a step saw, kept or not, reaches the exporters that take a step's groups
(``GroupsSink.log_groups``) as ``GroupRow``s, after the step's ``log_metrics``, in the training
process's metrics thread and across the renderer process alike; what such an exporter raises
(even ``SystemExit``) is counted and stops nothing."""

from __future__ import annotations

import json
from collections.abc import Sequence
from pathlib import Path

import pytest
from opentelemetry.sdk.metrics.export import InMemoryMetricReader
from opentelemetry.sdk.trace import ReadableSpan
from opentelemetry.sdk.trace.export import SpanExporter, SpanExportResult
from opentelemetry.sdk.trace.export.in_memory_span_exporter import InMemorySpanExporter

import otel_rollouts as otr
from otel_rollouts import conventions as c
from otel_rollouts._core.health import GroupRow
from otel_rollouts.exporters.extras import GroupsSink, MetricsSink
from otel_rollouts.sampling.batch import RowBatch
from otel_rollouts.sampling.health import MAX_ROWS, StepGroups


class GroupsFile(SpanExporter, MetricsSink, GroupsSink):
    """An exporter that writes what its extras are handed, one JSON line per call, to a file (so
    that a copy of it in the renderer process is read back the same way). It pickles: a path."""

    def __init__(self, path: str, *, fail: int | None = None) -> None:
        self.path = path
        self.fail = fail  # a step whose log_groups raises SystemExit

    def export(self, spans: Sequence[ReadableSpan]) -> SpanExportResult:
        return SpanExportResult.SUCCESS

    def shutdown(self) -> None:
        pass

    def _write(self, line: dict) -> None:
        with open(self.path, "a", encoding="utf-8") as fh:
            fh.write(json.dumps(line) + "\n")

    def log_metrics(self, step: int, values: dict[str, float]) -> None:
        self._write({"call": "metrics", "step": step, "values": values})

    def log_groups(self, step: int, split: str, rows: Sequence[GroupRow]) -> None:
        if step == self.fail:
            raise SystemExit(3)
        self._write({"call": "groups", "step": step, "split": split,
                     "types": sorted({type(r).__name__ for r in rows}), "rows": [list(r) for r in rows]})


def _calls(path: Path) -> list[dict]:
    return [json.loads(line) for line in path.read_text().splitlines()] if path.exists() else []


def _roots(exporter: InMemorySpanExporter) -> dict[tuple[str, int], dict]:
    return {(s.attributes[c.RL_GROUP_ID], s.attributes[c.RL_SAMPLE_INDEX]): dict(s.attributes)
            for s in exporter.get_finished_spans() if s.parent is None}


# group -> (reward, status) of each member; group_size=4
STEP = {
    "g0": [(0.0, "ok"), (0.5, "ok"), (1.0, "ok"), (0.25, "ok")],  # healthy
    "g1": [(1.0, "ok"), (1.0, "ok"), (1.0, "ok")],  # all equal AND one of four missing
    "g2": [(0.0, "truncated"), (0.5, "ok"), (1.0, "truncated"), (0.75, "ok")],  # truncated, healthy
    "g3": [(0.0, "error"), (0.5, "ok"), (1.0, "ok"), (0.2, "filtered")],  # lost two members
    "g4": [(0.0, "truncated")] * 4,  # all cut short, all 0: all equal, nothing lost
}


def _record(step: int) -> None:
    for gid, members in STEP.items():
        for i, (reward, status) in enumerate(members):
            with otr.episode(step=step, group_id=gid, sample_index=i) as ep:
                ep.prompt(f"question {gid}")
                if status != "ok":
                    ep.finish(status=status)
                ep.reward(reward)
    otr.end_step(step)


def test_truncation_is_counted_apart_and_all_equal_and_lost_both_show(tmp_path: Path) -> None:
    """Every member kept: each root says its group's health; the step's scalars and the
    ``rl.groups`` counter say the same."""
    memory, reader, sink = InMemorySpanExporter(), InMemoryMetricReader(), tmp_path / "sink.jsonl"
    otr.configure(exporters=[memory, GroupsFile(str(sink))], metric_readers=[reader],
                  sampler=otr.TailSampler(100, "top_bottom", group_size=4, step_lag=None))
    try:
        _record(0)
        assert otr.flush(30)
        roots = _roots(memory)
        data = reader.get_metrics_data()
    finally:
        otr.shutdown(timeout=10)
    assert len(roots) == 19

    def health(gid: str) -> set[tuple]:
        return {(r[c.RL_GROUP_SIZE], r[c.RL_GROUP_ALL_EQUAL], r[c.RL_GROUP_LOST], r[c.RL_GROUP_TRUNCATED],
                 r.get(c.RL_GROUP_DEGENERATE)) for (g, _), r in roots.items() if g == gid}

    assert health("g0") == {(4, False, 0, 0, None)}
    # truncated members are scored: not lost, the group not degenerate
    assert health("g2") == {(4, False, 0, 2, None)}
    assert {r[c.RL_GROUP_REWARD_SPREAD] for (g, _), r in roots.items() if g == "g2"} == {1.0}
    # all equal and one member missing: both, a filter on either word finds it
    assert health("g1") == {(3, True, 1, 0, c.DEGENERATE_ALL_EQUAL_LOST)}
    assert c.DEGENERATE_ALL_EQUAL in c.DEGENERATE_ALL_EQUAL_LOST and c.DEGENERATE_LOST in c.DEGENERATE_ALL_EQUAL_LOST
    assert health("g3") == {(4, False, 2, 0, c.DEGENERATE_LOST)}
    assert health("g4") == {(4, True, 0, 4, c.DEGENERATE_ALL_EQUAL)}

    (values,) = [call["values"] for call in _calls(sink) if call["call"] == "metrics"]
    scalars = {k.removeprefix("rollouts/"): v for k, v in values.items() if "group" in k}
    assert scalars == {"groups": 5, "groups_all_equal": 2, "groups_lost": 2, "group_members_lost": 3,
                       "groups_degenerate": 3, "groups_truncated": 2, "group_members_truncated": 6}

    points = [p for rm in data.resource_metrics for sm in rm.scope_metrics for m in sm.metrics
              if m.name == c.METRIC_GROUPS for p in m.data.data_points]
    by_kind = {p.attributes[c.RL_GROUP_DEGENERATE]: p.value for p in points}
    assert by_kind == {c.DEGENERATE_NONE: 2, c.DEGENERATE_ALL_EQUAL: 1, c.DEGENERATE_LOST: 1,
                       c.DEGENERATE_ALL_EQUAL_LOST: 1}
    # each group once; every all-equal group and every lost one found by a `contains` filter
    assert sum(by_kind.values()) == 5
    assert sum(v for k, v in by_kind.items() if c.DEGENERATE_ALL_EQUAL in k) == scalars["groups_all_equal"]
    assert sum(v for k, v in by_kind.items() if c.DEGENERATE_LOST in k) == scalars["groups_lost"]


@pytest.mark.parametrize("render", ["thread", "process"])
def test_every_group_seen_reaches_the_groups_sink_after_the_steps_scalars(tmp_path: Path, render: str) -> None:
    """DegenerateGroups(1) keeps one whole group (g1, the first degenerate): every group of the
    step still reaches ``log_groups``, with its health and how many of its members were kept;
    a step whose ``log_groups`` raises SystemExit is counted and the next step's still arrive."""
    sink = tmp_path / "sink.jsonl"
    otr.configure(exporters=[GroupsFile(str(sink), fail=1)], render=render,
                  sampler=otr.TailSampler(8, otr.DegenerateGroups(groups=1), group_size=4, step_lag=None))
    try:
        for step in range(3):
            _record(step)
        assert otr.flush(30)
        stats = otr.stats()
    finally:
        otr.shutdown(timeout=10)
    calls = _calls(sink)
    # per step: its scalars, then its groups (step 1's groups raised: not written)
    assert [(call["call"], call["step"]) for call in calls] == [
        ("metrics", 0), ("groups", 0), ("metrics", 1), ("metrics", 2), ("groups", 2)]
    assert stats["totals"]["errors.log_groups.GroupsFile"] == 1
    for call in (calls[1], calls[4]):
        assert call["split"] == "train" and call["types"] == ["GroupRow"]
        rows = [GroupRow(*row) for row in call["rows"]]
        # degenerate first (by group id), then the rest; every group, kept or not
        assert rows == [
            GroupRow("g1", 3, 4, 0.0, True, 0, 1, 3),  # all equal and lost: kept whole
            GroupRow("g3", 4, 4, 1.0, False, 0, 2, 0),
            GroupRow("g4", 4, 4, 0.0, True, 4, 0, 0),
            GroupRow("g0", 4, 4, 1.0, False, 0, 0, 0),
            GroupRow("g2", 4, 4, 1.0, False, 2, 0, 0),  # truncated, not degenerate
        ]
        assert [r.degenerate for r in rows] == [True, True, True, False, False]
    kept = {call["step"]: call["values"]["rollouts/episodes_kept"] for call in calls if call["call"] == "metrics"}
    assert kept == {0: 3, 1: 3, 2: 3}


def test_degenerate_groups_does_not_take_truncation_for_loss() -> None:
    """A group whose truncated members scored apart is healthy: DegenerateGroups leaves it, and
    keeps the one that lost a member (error) and the one all cut short to the same score."""
    memory = InMemorySpanExporter()
    otr.configure(exporters=[memory], sampler=otr.TailSampler(100, otr.DegenerateGroups(groups=5), step_lag=None))
    try:
        for gid, members in STEP.items():
            if gid == "g1":
                continue
            for i, (reward, status) in enumerate(members):
                with otr.episode(step=0, group_id=gid, sample_index=i) as ep:
                    if status != "ok":
                        ep.finish(status=status)
                    ep.reward(reward)
        otr.end_step(0)
        assert otr.flush(30)
        roots = _roots(memory)
    finally:
        otr.shutdown(timeout=10)
    assert {g for g, _ in roots} == {"g3", "g4"}
    assert {r[c.RL_KEEP_REASON] for r in roots.values()} == {c.REASON_DEGENERATE_GROUP}


def test_degenerate_groups_on_a_batch_follows_the_same_rule() -> None:
    """The batched path (``record_batch``: the policy's runs of rows) keeps the same groups."""
    rows = [(gid, reward, status) for gid, members in STEP.items() if gid != "g1" for reward, status in members]
    memory = InMemorySpanExporter()
    otr.configure(exporters=[memory], sampler=otr.TailSampler(100, otr.DegenerateGroups(groups=5), step_lag=None))
    try:
        otr.record_batch(len(rows), step=0, group_ids=[r[0] for r in rows], rewards=[r[1] for r in rows],
                         statuses=[r[2] for r in rows])
        otr.end_step(0)
        assert otr.flush(30)
        kept = [s for s in memory.get_finished_spans() if s.parent is None]
    finally:
        otr.shutdown(timeout=10)
    assert sorted(s.attributes[c.RL_GROUP_ID] for s in kept) == ["g3"] * 4 + ["g4"] * 4
    assert {s.attributes[c.RL_GROUP_TRUNCATED] for s in kept if s.attributes[c.RL_GROUP_ID] == "g4"} == {4}
    assert {s.attributes[c.RL_GROUP_LOST] for s in kept if s.attributes[c.RL_GROUP_ID] == "g3"} == {2}


class _Row:
    def __init__(self, columns: dict, i: int) -> None:
        self.columns, self.i = columns, i

    def attribute(self, name: str) -> object:
        column = self.columns.get(name)
        return None if column is None else column[self.i]


@pytest.mark.parametrize("path", ["episodes", "batch"])
def test_rows_are_bounded_degenerate_first_then_by_id(path: str) -> None:
    """300 groups: ``MAX_ROWS`` rows, the degenerate ones first, then by id (numbers by value),
    the rest counted; the kept count is what ``keep`` was told. Episode by episode and as one
    batch (the vectorised summary) alike."""
    n_groups, size = 300, 2
    gids = [g for g in range(n_groups) for _ in range(size)]
    rewards = [1.0 if g % 50 == 7 else float(k) for g in range(n_groups) for k in range(size)]
    statuses = ["truncated" if g % 3 == 0 and k == 0 else "ok" for g in range(n_groups) for k in range(size)]
    columns = {c.RL_GROUP_ID: gids, c.RL_REWARD: rewards, c.RL_STATUS: statuses}
    groups = StepGroups(size)
    if path == "batch":
        groups.add_batch(RowBatch(0, "train", len(gids), columns, lambda i: i + 1))
    else:
        for i in range(len(gids)):
            groups.add(_Row(columns, i))
    assert groups.keep(107) is not None and groups.keep(107) is not None and groups.keep(3) is not None
    assert groups.keep("nope") is None
    health = groups.summary()
    equal = [g for g in range(n_groups) if g % 50 == 7]
    assert (health.groups, health.all_equal, health.lost, health.degenerate) == (300, len(equal), 0, len(equal))
    assert (health.truncated, health.truncated_members) == (100, 100)
    assert len(health.rows) == MAX_ROWS and health.rows_left_out == 300 - MAX_ROWS
    expect = [*equal, *(g for g in range(n_groups) if g not in equal)][:MAX_ROWS]
    assert [r.group for r in health.rows] == [str(g) for g in expect]
    by_id = {r.group: r for r in health.rows}
    assert by_id["107"] == GroupRow("107", 2, 2, 0.0, True, 0, 0, 2)
    assert by_id["3"] == GroupRow("3", 2, 2, 1.0, False, 1, 0, 1)
    assert by_id["4"].kept == 0 and by_id["4"].truncated == 0


def test_group_rows_are_redacted_like_names_and_unlisted_counted(tmp_path: Path) -> None:
    """A group id is the user's text: it leaves redacted (the run's redaction patterns), and a
    step with more groups than the rows' bound says how many were not listed."""
    sink = tmp_path / "sink.jsonl"
    otr.configure(exporters=[GroupsFile(str(sink))], sampler=otr.TailSampler(4, "top_bottom", step_lag=None),
                  redact_patterns=[r"hush-[a-z0-9]+"])
    try:
        n = MAX_ROWS + 3
        otr.record_batch(n, step=0, group_ids=["a-hush-secret1" if i == 0 else f"p{i:04d}" for i in range(n)],
                         rewards=[i / n for i in range(n)])
        otr.end_step(0)
        assert otr.flush(30)
    finally:
        otr.shutdown(timeout=10)
    calls = _calls(sink)
    (values,) = [call["values"] for call in calls if call["call"] == "metrics"]
    (rows,) = [call["rows"] for call in calls if call["call"] == "groups"]
    assert values["rollouts/groups"] == n and values["rollouts/groups_unlisted"] == 3
    assert len(rows) == MAX_ROWS
    assert rows[0][0].startswith("a-") and not any("secret1" in row[0] for row in rows)
    # kept: the two lowest rewards (listed first) and the two highest (past the bound: unlisted)
    assert [row[7] for row in rows[:3]] == [1, 1, 0] and sum(row[7] for row in rows) == 2


def test_a_streaming_policy_counts_its_kept_members_in_the_rows(tmp_path: Path) -> None:
    """``first`` alone keeps each episode as it comes (before its group is known): the rows
    still say how many of each group were kept."""
    sink = tmp_path / "sink.jsonl"
    otr.configure(exporters=[GroupsFile(str(sink))], sampler=otr.TailSampler(6, "first", step_lag=None))
    try:
        _record(0)
        assert otr.flush(30)
    finally:
        otr.shutdown(timeout=10)
    (rows,) = [call["rows"] for call in _calls(sink) if call["call"] == "groups"]
    assert {row[0]: row[7] for row in rows} == {"g0": 4, "g1": 2, "g2": 0, "g3": 0, "g4": 0}
