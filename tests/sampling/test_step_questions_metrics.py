"""Issue 32, the metrics side: where a step's time went (duration and per-stage p50/p95/max),
what it saw, kept and dropped by status, why it kept what it kept, and its groups' health.

Real parts: the OpenTelemetry SDK's ``InMemoryMetricReader``, real ``otr.configure`` runs, the
step scalars read back from a real Trackio project, and the library's own span records (built
with explicit times where a test needs exact numbers, which the episode API cannot give).
"""

from __future__ import annotations

import sys
import tracemalloc
import uuid
from collections.abc import Iterator

import numpy as np
import pytest
from opentelemetry.sdk.metrics import MeterProvider
from opentelemetry.sdk.metrics.export import InMemoryMetricReader

import otel_rollouts as otr
from otel_rollouts import conventions as c
from otel_rollouts._core.health import StepHealth
from otel_rollouts._core.spans import (
    STAGE_GENERATION,
    STAGE_TOOL,
    EpisodeRecord,
    SpanRecord,
    stage_ended,
)
from otel_rollouts._core.stages import stage_totals
from otel_rollouts.correlate import metrics as metrics_module
from otel_rollouts.correlate.metrics import RolloutMetrics

MS = 1_000_000  # ns


# --- helpers ---------------------------------------------------------------------------------
def _record(root_ms: tuple[float, float | None], spans: list[tuple[str, float, float | None]],
            *, timed: bool = True, attrs: dict | None = None, step: int = 0) -> EpisodeRecord:
    """An episode record whose spans have the given times (ms): ``(kind, start, end)``, end
    None for a span still open."""
    record = EpisodeRecord(uuid.uuid4().int, step, "train", None, 1000)
    record.timed = timed
    root = SpanRecord(record, "episode", 1, None, c.KIND_EPISODE, dict(attrs or {}),
                      start_ns=int(root_ms[0] * MS))
    root.end_ns = None if root_ms[1] is None else int(root_ms[1] * MS)
    record.root = record.add(root)
    for i, (kind, start, end) in enumerate(spans):
        span = SpanRecord(record, kind, i + 2, 1, kind, start_ns=int(start * MS))
        span.end_ns = None if end is None else int(end * MS)
        record.add(span)
    return record


class _Sink:
    """A scalar sink with the exporters' ``log_metrics(step, values)`` interface."""

    def __init__(self) -> None:
        self.logged: dict[int, dict[str, float]] = {}

    def log_metrics(self, step: int, values: dict[str, float]) -> None:
        self.logged.setdefault(step, {}).update(values)


def _points(reader: InMemoryMetricReader) -> dict[str, list]:
    data = reader.get_metrics_data()
    out: dict[str, list] = {}
    if data is None:
        return out
    for rm in data.resource_metrics:
        for scope in rm.scope_metrics:
            for metric in scope.metrics:
                out.setdefault(metric.name, []).extend(metric.data.data_points)
    return out


def _total(points: list, **attrs) -> float:
    return sum(p.value for p in points if all(p.attributes.get(k) == v for k, v in attrs.items()))


def _trackio_steps(project: str, run: str) -> dict[int, dict[str, float]]:
    from trackio.sqlite_storage import SQLiteStorage

    by_step: dict[int, dict[str, float]] = {}
    for row in SQLiteStorage.get_logs(project, run):
        by_step.setdefault(row["step"], {}).update(
            {k: v for k, v in row.items() if k.startswith("rollouts/")})
    return by_step


@pytest.fixture
def direct() -> Iterator[tuple[RolloutMetrics, InMemoryMetricReader, _Sink]]:
    """A RolloutMetrics on a real MeterProvider, told directly (as the pipeline tells it)."""
    reader = InMemoryMetricReader()
    provider = MeterProvider(metric_readers=[reader], shutdown_on_exit=False)
    sink = _Sink()
    metrics = RolloutMetrics(provider, scalar_sinks=[sink])
    yield metrics, reader, sink
    metrics.shutdown(10)


# --- stage totals --------------------------------------------------------------------------
def test_stage_totals_are_unions_of_ended_spans_clipped_to_the_root_and_waiting_is_the_rest():
    record = _record((0, 1000), [
        (c.KIND_TURN, 0, 900),           # not a stage
        (c.KIND_GENERATION, 100, 300),   # two concurrent generations: 100..400 is 300 ms
        (c.KIND_GENERATION, 200, 400),
        (c.KIND_TOOL, 350, 500),         # overlaps a generation: counted in tool, once in union
        (c.KIND_TOOL, 400, 450),         # nested in the tool above
        (c.KIND_TOOL, 600, None),        # still open: not counted
        (c.KIND_REWARD, 950, 1200),      # ends after the root: clipped at 1000
    ])
    totals = stage_totals(record)
    assert totals[c.STAGE_GENERATION] == pytest.approx(0.3)
    assert totals[c.STAGE_TOOL] == pytest.approx(0.15)
    assert totals[c.STAGE_REWARD] == pytest.approx(0.05)
    # covered: 100..500 and 950..1000 = 450 ms of 1000
    assert totals[c.STAGE_WAITING] == pytest.approx(0.55)
    assert c.STAGE_ENVIRONMENT not in totals  # no span kind, not measured: absent, never 0
    assert record.stages is totals  # cached: the metrics and the root attributes agree

    # spans made out of the order they started (a framework's explicit times): the same totals
    shuffled = _record((0, 1000), [
        (c.KIND_REWARD, 950, 1200), (c.KIND_TOOL, 400, 450), (c.KIND_GENERATION, 200, 400),
        (c.KIND_TOOL, 350, 500), (c.KIND_GENERATION, 100, 300), (c.KIND_TOOL, 600, None)])
    assert stage_totals(shuffled) == pytest.approx(totals)
    one_kind_shuffled = _record((0, 1000), [(c.KIND_GENERATION, 500, 600),
                                            (c.KIND_GENERATION, 0, 100)])
    assert stage_totals(one_kind_shuffled) == pytest.approx(
        {c.STAGE_GENERATION: 0.2, c.STAGE_WAITING: 0.8})


def test_measured_stage_attributes_win_and_untimed_records_say_only_what_was_measured():
    measured = {c.stage_seconds(c.STAGE_GENERATION): 2.0,
                c.stage_seconds(c.STAGE_ENVIRONMENT): 0.25}
    timed = _record((0, 3000), [(c.KIND_GENERATION, 0, 100), (c.KIND_TOOL, 100, 600)],
                    attrs=measured)
    totals = stage_totals(timed)
    assert totals[c.STAGE_GENERATION] == 2.0  # the framework's number, not the spans' 0.1
    assert totals[c.STAGE_ENVIRONMENT] == 0.25
    assert totals[c.STAGE_TOOL] == pytest.approx(0.5)
    assert totals[c.STAGE_WAITING] == pytest.approx(3.0 - 0.5 - 2.25)
    assert c.STAGE_REWARD not in totals

    # recorded after the fact (an adapter): its spans' times are when it was recorded
    untimed = _record((0, 3000), [(c.KIND_GENERATION, 0, 100), (c.KIND_TOOL, 100, 600)],
                      timed=False, attrs={c.stage_seconds(c.STAGE_TOOL): 1.5})
    assert stage_totals(untimed) == {c.STAGE_TOOL: 1.5}
    assert untimed.duration() is None
    # never negative; bad measures ignored
    crowded = _record((0, 100), [(c.KIND_GENERATION, 0, 100)],
                      attrs={c.stage_seconds(c.STAGE_TOOL): 5.0,
                             c.stage_seconds(c.STAGE_REWARD): -1.0})
    assert stage_totals(crowded) == {c.STAGE_TOOL: 5.0, c.STAGE_GENERATION: pytest.approx(0.1),
                                     c.STAGE_WAITING: 0.0}
    # an episode still running has no waiting yet, and nothing is cached
    running = _record((0, None), [(c.KIND_GENERATION, 0, 100)])
    assert stage_totals(running) == {}
    assert running.stages is None


# --- duration and stage percentiles ------------------------------------------------------------
def test_duration_and_stage_percentiles_per_step_in_trackio_and_the_stage_histogram():
    from otel_rollouts.exporters import TrackioExporter

    project = f"stepq-{uuid.uuid4().hex[:8]}"
    exporter = TrackioExporter(project)
    reader = InMemoryMetricReader()
    otr.configure(exporters=[exporter], sampler=otr.TailSampler(4, "first"),
                  metric_readers=[reader], handle_signals=False)
    try:
        for i in range(1, 101):  # the framework measured these: exact numbers
            with otr.episode(step=0) as ep:
                ep.set_attribute(c.RL_DURATION_SECONDS, float(i))
                ep.set_attribute(c.stage_seconds(c.STAGE_TOOL), i / 10)
                ep.reward(0.5)
        with otr.episode(step=0, framework="verl") as ep:  # after the fact, no measure
            ep.reward(0.5)
        for _ in range(3):  # real timed episodes of step 1
            with otr.episode(step=1) as ep, ep.turn() as turn:
                turn.record_generation("hi", model="policy")
                with turn.tool_call("calc") as call:
                    call.result(1)
                ep.reward(1.0)
        otr.end_step(0)
        otr.end_step(1)
        assert otr.flush(60)
        points = _points(reader)
    finally:
        otr.shutdown()
    steps = _trackio_steps(project, exporter.run)
    expected = np.arange(1, 101, dtype=float)
    s0 = steps[0]
    assert s0["rollouts/episode_duration_s_p50"] == pytest.approx(np.percentile(expected, 50))
    assert s0["rollouts/episode_duration_s_p95"] == pytest.approx(np.percentile(expected, 95))
    assert s0["rollouts/episode_duration_s_max"] == 100.0
    assert s0["rollouts/stage/tool_s_p95"] == pytest.approx(np.percentile(expected / 10, 95))
    assert s0["rollouts/stage/tool_s_max"] == pytest.approx(10.0)
    assert s0["rollouts/episodes_unmeasured"] == 1  # the adapter's episode: not 0 s
    assert s0["rollouts/episode_duration_s_mean"] == pytest.approx(50.5)  # measured only
    # the real episodes: every stage they had, relations not exact values
    s1 = steps[1]
    assert s1["rollouts/episodes_unmeasured"] == 0
    for stage in (c.STAGE_GENERATION, c.STAGE_TOOL, c.STAGE_REWARD, c.STAGE_WAITING):
        assert 0 <= s1[f"rollouts/stage/{stage}_s_max"] <= s1["rollouts/episode_duration_s_max"]
    assert "rollouts/stage/environment_s_max" not in s1

    stage_points = points[c.METRIC_STAGE_DURATION]
    tool = [p for p in stage_points if p.attributes.get(c.RL_STAGE_NAME) == c.STAGE_TOOL]
    assert sum(p.count for p in tool) == 103
    assert sum(p.sum for p in tool) == pytest.approx(expected.sum() / 10, rel=1e-3)
    assert {p.attributes[c.RL_SPLIT] for p in stage_points} == {"train"}
    (duration,) = points[c.METRIC_EPISODE_DURATION]
    assert duration.count == 103  # 100 measured + 3 timed; the adapter's one is not 0 s


# --- seen / kept / dropped by status, kept by reason -------------------------------------------
def test_a_step_that_dropped_all_its_errors_says_so():
    from otel_rollouts.exporters import TrackioExporter

    project = f"stepq-{uuid.uuid4().hex[:8]}"
    exporter = TrackioExporter(project)
    reader = InMemoryMetricReader()
    # "first" with a cap of 1: the ok episode that finished first is kept, the errors are not
    otr.configure(exporters=[exporter], sampler=otr.TailSampler(1, "first"),
                  metric_readers=[reader], handle_signals=False)
    try:
        with otr.episode(step=0) as ep:
            ep.reward(1.0)
        for _ in range(3):
            with otr.episode(step=0) as ep:
                ep.reward(0.0)
                ep.finish(status=c.STATUS_ERROR)
        with otr.episode(step=0) as ep:
            ep.reward(0.0)
            ep.finish(status=c.STATUS_TRUNCATED)
        otr.end_step(0)
        assert otr.flush(60)
        points = _points(reader)
    finally:
        otr.shutdown()
    s0 = _trackio_steps(project, exporter.run)[0]
    assert s0["rollouts/episodes_seen/error"] == 3
    assert s0["rollouts/episodes_kept/error"] == 0
    assert s0["rollouts/episodes_dropped/error"] == 3
    assert s0["rollouts/errors_unkept"] == 3
    assert (s0["rollouts/episodes_seen/ok"], s0["rollouts/episodes_kept/ok"]) == (1, 1)
    assert s0["rollouts/episodes_dropped/truncated"] == 1
    assert "rollouts/episodes_seen/filtered" not in s0  # a status the step never saw
    assert s0["rollouts/episodes_kept_by/first"] == 1
    status = {c.RL_STATUS: c.STATUS_ERROR}
    assert _total(points[c.METRIC_EPISODES_SEEN], **status) == 3
    assert _total(points.get(c.METRIC_EPISODES_KEPT, []), **status) == 0
    assert _total(points[c.METRIC_EPISODES_DROPPED], **status) == 3


def test_batch_rows_dropped_are_counted_by_status_and_measured_columns():
    from otel_rollouts.exporters import TrackioExporter

    project = f"stepq-{uuid.uuid4().hex[:8]}"
    exporter = TrackioExporter(project)
    reader = InMemoryMetricReader()
    otr.configure(exporters=[exporter], sampler=otr.TailSampler(2, "top_bottom"),
                  metric_readers=[reader], handle_signals=False)
    n = 1000
    statuses = [c.STATUS_ERROR if i % 10 == 0 else (c.STATUS_TRUNCATED if i % 10 == 1 else None)
                for i in range(n)]
    try:
        summary = otr.record_batch(n, step=0, rewards=np.linspace(0, 1, n), statuses=statuses)
        otr.end_step(0)
        assert otr.flush(60)
        points = _points(reader)
    finally:
        otr.shutdown()
    assert summary is not None
    s0 = _trackio_steps(project, exporter.run)[0]
    assert s0["rollouts/episodes_seen/error"] == 100
    assert s0["rollouts/episodes_seen/truncated"] == 100
    assert s0["rollouts/episodes_seen/ok"] == 800
    kept = sum(v for k, v in s0.items() if k.startswith("rollouts/episodes_kept/"))
    assert kept == s0["rollouts/episodes_kept"] == 2
    for status in (c.STATUS_OK, c.STATUS_ERROR, c.STATUS_TRUNCATED):
        assert (s0[f"rollouts/episodes_kept/{status}"] + s0[f"rollouts/episodes_dropped/{status}"]
                == s0[f"rollouts/episodes_seen/{status}"])
    assert s0["rollouts/errors_unkept"] == 100 - s0["rollouts/episodes_kept/error"]
    assert s0["rollouts/episodes_unmeasured"] == n  # a batch has no times: none is 0 s
    assert _total(points[c.METRIC_EPISODES_SEEN], **{c.RL_STATUS: c.STATUS_ERROR}) == 100
    assert _total(points[c.METRIC_EPISODES_DROPPED], **{c.RL_STATUS: c.STATUS_OK}) \
        == 800 - s0["rollouts/episodes_kept/ok"]


def test_batch_duration_and_stage_columns_are_measured_vectorised(direct):
    from otel_rollouts.sampling.batch import RowBatch

    metrics, reader, sink = direct
    n = 5000
    durations = [float(i) for i in range(n)]
    durations[7] = None  # one row without a measure
    batch = RowBatch(3, "train", n, {
        c.RL_STATUS: [c.STATUS_ERROR] * 10 + [c.STATUS_OK] * (n - 10),
        c.RL_DURATION_SECONDS: durations,
        c.stage_seconds(c.STAGE_GENERATION): [0.5] * n,
    }, lambda i: i + 1)
    metrics.dropped_rows(batch, range(n), "sampled_out")
    metrics.step_closed((3, "train"))
    assert metrics.flush(30)
    s3 = sink.logged[3]
    assert s3["rollouts/episodes_unmeasured"] == 1
    assert s3["rollouts/episode_duration_s_max"] == n - 1
    # more rows than the reservoir holds: the median of a uniform sample, roughly
    assert abs(s3["rollouts/episode_duration_s_p50"] - n / 2) < n * 0.1
    assert s3["rollouts/stage/generation_s_p95"] == 0.5
    assert (s3["rollouts/episodes_dropped/error"], s3["rollouts/errors_unkept"]) == (10, 10)
    points = _points(reader)
    assert sum(p.count for p in points[c.METRIC_STAGE_DURATION]) == n


def test_kept_by_reason_and_group_health(direct):
    metrics, reader, sink = direct
    reasons = [c.REASON_TOP, c.REASON_TOP, c.REASON_BOTTOM, c.REASON_ERROR, c.REASON_WATCH]
    for reason in reasons:
        record = _record((0, 10), [])
        record.reason = reason
        metrics.decided(record, None)
    metrics.decided(_record((0, 10), []), "sampled_out")
    # 10 groups: 3 all-equal (one of them also lost members), 2 more lost members
    health = StepHealth(groups=10, all_equal=3, lost=3, lost_members=4, degenerate=5, truncated=2,
                        truncated_members=3)
    metrics.step_closed((0, "train"), health)
    metrics.step_closed((1, "train"))  # one argument still works (no health told)
    assert metrics.flush(30)
    s0 = sink.logged[0]
    assert s0["rollouts/episodes_kept_by/top"] == 2
    assert s0["rollouts/episodes_kept_by/bottom"] == 1
    assert s0["rollouts/episodes_kept_by/watch"] == 1
    assert sum(v for k, v in s0.items() if "/episodes_kept_by/" in k) == s0["rollouts/episodes_kept"]
    assert (s0["rollouts/groups"], s0["rollouts/groups_all_equal"], s0["rollouts/groups_lost"],
            s0["rollouts/group_members_lost"], s0["rollouts/groups_degenerate"]) == (10, 3, 3, 4, 5)
    assert (s0["rollouts/groups_truncated"], s0["rollouts/group_members_truncated"]) == (2, 3)
    groups = _points(reader)[c.METRIC_GROUPS]
    by_kind = {p.attributes[c.RL_GROUP_DEGENERATE]: p.value for p in groups}
    # each group once; the one both all-equal and lost under both words, found by either
    assert by_kind == {c.DEGENERATE_NONE: 5, c.DEGENERATE_LOST: 2, c.DEGENERATE_ALL_EQUAL: 2,
                       c.DEGENERATE_ALL_EQUAL_LOST: 1}
    assert sum(v for k, v in by_kind.items() if c.DEGENERATE_ALL_EQUAL in k) == health.all_equal
    assert sum(v for k, v in by_kind.items() if c.DEGENERATE_LOST in k) == health.lost
    assert sum(by_kind.values()) == health.groups


# --- bounds ---------------------------------------------------------------------------------
@pytest.mark.parametrize("times", ["spans", "running_sums"])
def test_a_100k_episode_step_stays_within_the_reservoir_bound(times):
    """``spans``: stage times from a pass over the spans; ``running_sums``: added up as the
    stage spans ended, as an episode recorded live has them (a dropped one waits in the inbox as
    read, at most ``_PENDING`` of them, before they enter the reservoirs together)."""
    # no meter provider: what is measured is this module's own per-step memory
    sink = _Sink()
    metrics = RolloutMetrics(None, scalar_sinks=[sink])
    rng = np.random.default_rng(7)
    durations = rng.uniform(0, 10, 100_000)
    record = _record((0, 1), [(c.KIND_GENERATION, 0, 1), (c.KIND_TOOL, 1, 2)])
    if times == "running_sums":
        stage_ended(record, STAGE_GENERATION, 0, MS)
        stage_ended(record, STAGE_TOOL, MS, 2 * MS)
    root = record.root
    assert root is not None
    # what may wait to enter the reservoirs: a pending column per series (4 here) of float64, or
    # the inbox of dropped episodes as read (a 12-tuple each, with at most seven ints of its own)
    pending = metrics_module._PENDING * (
        sys.getsizeof((0,) * 12) + 7 * sys.getsizeof(2 ** 62) if times == "running_sums" else 4 * 8)

    def decide(values: np.ndarray) -> None:
        for d in values.tolist():
            root.end_ns = int(d * 1e9)
            record.stages = None
            metrics.decided(record, "sampled_out")

    decide(durations[:80_000])  # every series past its reservoir: what it holds from now on
    tracemalloc.start()
    try:
        before = tracemalloc.get_traced_memory()[0]
        decide(durations[80_000:])
        grew = tracemalloc.get_traced_memory()[0] - before
    finally:
        tracemalloc.stop()
    with metrics._lock:
        metrics._fold()  # what the step's close does first: the inbox into the step
    (step,) = metrics._steps.values()
    step.settle()  # what the step's summary does first: every value waiting into its series
    series = [step.duration, *step.stages.values()]
    assert len(series) == 4  # duration, generation, tool, waiting
    assert all(len(s.values) == metrics_module._RESERVOIR and s.count == 100_000 for s in series)
    # the bound: 4 series x 1024 float64 = 32 KiB, whatever the number of episodes
    assert sum(len(s.values) * s.values.itemsize for s in series) <= 4 * 8 * 1024
    assert grew < 4096 + pending, grew  # 20k more episodes: flat
    metrics.step_closed((0, "train"))
    assert metrics.flush(30)
    metrics.shutdown(10)
    s0 = sink.logged[0]
    assert s0["rollouts/episode_duration_s_max"] == pytest.approx(durations.max())  # exact
    assert s0["rollouts/episode_duration_s_p50"] == pytest.approx(np.median(durations), abs=0.5)
    assert s0["rollouts/episode_duration_s_p95"] == pytest.approx(
        np.percentile(durations, 95), abs=0.3)
    assert metrics._samples == 0  # a closed step gives its slots back


def test_all_open_steps_together_hold_at_most_the_global_sample_bound(direct, monkeypatch):
    metrics, _, sink = direct
    monkeypatch.setattr(metrics_module, "_MAX_SAMPLES", 3000)
    for step in range(5):  # 5 open steps x 2000 episodes x 2 series (duration, waiting)
        for i in range(2000):
            metrics.decided(_record((0, 1 + i), [], step=step), "sampled_out")
    assert metrics._samples <= 3000
    assert sum(s.stored for s in metrics._steps.values()) == metrics._samples
    for step in range(5):
        metrics.step_closed((step, "train"))
    assert metrics.flush(30)
    assert metrics._samples == 0
    # a step past the bound still says its count and exact max
    assert all(sink.logged[s]["rollouts/episode_duration_s_max"] == 2.0 for s in range(5))


def test_decided_episodes_read_into_the_inbox_sum_up_as_a_pass_over_their_spans_does():
    """An episode recorded live carries its stage sums (added as its stage spans ended): kept or
    dropped, it waits in the inbox as read, added into its step and series later. The step's
    summary is the one the pass over the spans makes (the same records without the running
    sums): counts, kept by status and by reason, rewards, times."""
    shapes = [[(c.KIND_GENERATION, 1, 4), (c.KIND_TOOL, 4, 6), (c.KIND_REWARD, 7, 8)],
              [(c.KIND_GENERATION, 0, 9)], [(c.KIND_REWARD, 2, 3)], [(c.KIND_TOOL, 1, 2), (c.KIND_TOOL, 3, 5)]]
    index = {c.KIND_GENERATION: 0, c.KIND_TOOL: 1, c.KIND_REWARD: 2}
    sinks = {}
    for times in ("running_sums", "spans"):
        sink = sinks[times] = _Sink()
        metrics = RolloutMetrics(None, scalar_sinks=[sink])
        rng = np.random.default_rng(3)  # the same episodes for both
        for i in range(3 * metrics_module._PENDING + 7):  # some rows folded on the way, the rest at the close
            spans = shapes[i % len(shapes)]
            end = 10 + float(rng.uniform(0, 20))
            record = _record((0, end), spans, attrs={c.RL_REWARD: float(i % 5), c.RL_STATUS: c.STATUS_OK})
            if times == "running_sums":
                for kind, start, stop in spans:
                    stage_ended(record, index[kind], int(start * MS), int(stop * MS))
            if i % 7 == 3:  # some kept, by a reason or by none given (counted kept, no reason)
                record.reason = (None, c.REASON_POLICY, "top")[i % 3]
                metrics.decided(record, None)
            else:
                metrics.decided(record, "sampled_out")
        if times == "running_sums":
            assert metrics._inbox, "the dropped episodes wait in the inbox, as read"
        metrics.step_closed((0, "train"))
        assert metrics.flush(30)
        metrics.shutdown(10)
    fast, slow = sinks["running_sums"].logged[0], sinks["spans"].logged[0]
    assert fast.keys() == slow.keys()
    assert any(k.startswith("rollouts/stage/waiting") for k in fast)
    assert fast["rollouts/episodes_kept"] == sum(i % 7 == 3 for i in range(3 * metrics_module._PENDING + 7))
    assert fast["rollouts/episodes_kept_by/top"] and fast["rollouts/episodes_kept_by/policy"]
    for key, value in slow.items():
        assert fast[key] == pytest.approx(value, rel=1e-9, abs=1e-12), key
