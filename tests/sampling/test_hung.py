"""A rollout that hangs is visible while it hangs (issue 32, point 5).

An episode open past the hang threshold is shown to exporters that have ``show_pending`` as a
pending snapshot (its tree so far, the span it is stuck in and for how long), named ``ended``
once it ends, and counted ``hung`` if it never does. Real SDK, real ``otr.configure`` and its
ticker thread; the exporter is OpenTelemetry's in-memory exporter with ``show_pending`` added.
Episodes hang on a ``threading.Event`` the test holds; waits poll for what can be observed.
"""

from __future__ import annotations

import threading
import time
from collections.abc import Callable, Iterator, Sequence
from typing import Any

import pytest
from opentelemetry import trace
from opentelemetry.sdk.trace import ReadableSpan
from opentelemetry.sdk.trace.export.in_memory_span_exporter import InMemorySpanExporter

import otel_rollouts as otr
from otel_rollouts import conventions as c
from otel_rollouts.sampling.hung import HangOptions, HungWatcher

EXPORT_THREAD = "otel-rollouts-export"
TOOL = "slow_search"


class ShowingExporter(InMemorySpanExporter):
    """OpenTelemetry's in-memory exporter, plus the optional ``show_pending`` of an exporter
    that shows running episodes (as Trackio's does)."""

    def __init__(self) -> None:
        super().__init__()
        self._calls_lock = threading.Lock()
        self.calls: list[tuple[list[ReadableSpan], list[int], str]] = []

    def show_pending(self, spans: Sequence[ReadableSpan], ended: Sequence[int]) -> None:
        with self._calls_lock:
            self.calls.append((list(spans), list(ended), threading.current_thread().name))

    def snapshot_roots(self) -> list[ReadableSpan]:
        with self._calls_lock:
            calls = list(self.calls)
        return [s for spans, _, _ in calls for s in spans
                if s.parent is None and (s.attributes or {}).get(c.RL_PENDING_SNAPSHOT) is True]

    def shown(self, trace_id: int) -> list[ReadableSpan]:
        return [s for s in self.snapshot_roots() if s.context.trace_id == trace_id]

    def ended(self) -> set[int]:
        with self._calls_lock:
            return {t for _, ended, _ in self.calls for t in ended}

    def threads(self) -> set[str]:
        with self._calls_lock:
            return {name for _, _, name in self.calls}


def wait_for(condition: Callable[[], Any], what: str, timeout: float = 30.0) -> Any:
    """Poll ``condition`` until it is truthy (returned), failing after ``timeout`` seconds."""
    deadline = time.monotonic() + timeout
    while True:
        value = condition()
        if value:
            return value
        assert time.monotonic() < deadline, f"timed out waiting for {what}"
        time.sleep(0.02)


class Rollout:
    """One episode run on a thread of its own: a prompt, a turn, a tool call that blocks on
    ``release`` (a tool that hangs), then the reward."""

    def __init__(self, release: threading.Event, *, step: int = 0, sample: int = 0,
                 reward: float | None = None, while_blocked: Callable[[], None] | None = None) -> None:
        self.release = release
        self.step = step
        self.sample = sample
        self.reward = float(sample) if reward is None else reward
        self.while_blocked = while_blocked
        self.trace_id: int | None = None
        self.started = threading.Event()
        self.thread = threading.Thread(target=self._run, name=f"rollout-{step}-{sample}", daemon=True)
        self.thread.start()

    def _run(self) -> None:
        with otr.episode(step=self.step, group_id="g", sample_index=self.sample) as ep:
            self.trace_id = int(ep.trace_id or "0", 16)
            ep.prompt([{"role": "user", "content": "Where is the file?"}])
            with ep.turn() as turn, turn.tool_call(TOOL, arguments={"q": "file"}, call_id="c1") as call:
                self.started.set()
                if self.while_blocked is not None:
                    self.while_blocked()
                self.release.wait(60)
                call.result("found")
            ep.reward(self.reward)
            ep.finish(reason="stop")

    def join(self) -> None:
        self.thread.join(30)
        assert not self.thread.is_alive()


@pytest.fixture
def exporter() -> Iterator[ShowingExporter]:
    exp = ShowingExporter()
    yield exp
    otr.shutdown(timeout=10)


def test_a_hanging_tool_is_shown_pending_then_ended(exporter: ShowingExporter) -> None:
    otr.configure(exporters=[exporter], sampler=otr.TailSampler(10, "first"),
                  hang=otr.HangOptions(after_s=0.3, refresh_s=3600))
    release = threading.Event()
    rollout = Rollout(release)
    rollout.started.wait(10)
    tid = rollout.trace_id
    assert tid
    shown = wait_for(lambda: exporter.shown(tid), "the pending snapshot")
    assert exporter.get_finished_spans() == ()  # a snapshot is not a kept episode: never exported
    snapshot_root = shown[0]
    attrs = snapshot_root.attributes
    assert attrs[c.RL_PENDING_SNAPSHOT] is True
    assert attrs[c.RL_PENDING_SPAN_NAME] == c.tool_span_name(TOOL)
    assert attrs[c.RL_PENDING_SPAN_SECONDS] >= 0.3
    assert attrs[c.RL_PENDING_SECONDS] >= attrs[c.RL_PENDING_SPAN_SECONDS]
    assert c.RL_TRACE_KEPT not in attrs and c.RL_KEEP_REASON not in attrs
    assert c.RL_DURATION_SECONDS not in attrs  # it has not finished: no duration
    # the tree so far: the ended prompt as it is, the open turn and tool ended "now", marked
    spans = next(spans for spans, _, _ in exporter.calls if snapshot_root in spans)
    by_name = {s.name: s for s in spans}
    assert {c.SPAN_EPISODE, c.SPAN_PROMPT, c.SPAN_TURN, c.tool_span_name(TOOL)} <= set(by_name)
    assert c.RL_PENDING_SNAPSHOT not in (by_name[c.SPAN_PROMPT].attributes or {})
    tool = by_name[c.tool_span_name(TOOL)]
    assert tool.attributes[c.RL_PENDING_SNAPSHOT] is True and tool.attributes[c.RL_PENDING_SPAN_SECONDS] >= 0.3
    assert by_name[c.SPAN_TURN].attributes[c.RL_PENDING_SNAPSHOT] is True
    assert all(s.context.trace_id == tid for s in spans)

    release.set()
    rollout.join()
    wait_for(lambda: tid in exporter.ended(), "the ended notice")
    otr.flush()
    kept = [s for s in exporter.get_finished_spans() if s.context.trace_id == tid]
    kept_root = next(s for s in kept if s.parent is None)
    assert kept_root.attributes.get(c.RL_PENDING_SNAPSHOT) is None
    assert kept_root.attributes[c.RL_TRACE_KEPT] is True
    # rendered and shown on the export thread, never on the training thread
    assert exporter.threads() == {EXPORT_THREAD}
    stats = otr.stats()
    assert stats["totals"].get("episodes.hung", 0) == 0  # it ended by itself
    assert stats["totals"]["exported.pending_snapshots"] >= 1
    assert [d["delivered"] for d in stats["delivery"].values()] == [1]  # the snapshot is no delivery


def _kept_samples(exporter: ShowingExporter) -> set[int]:
    return {int(s.attributes[c.RL_SAMPLE_INDEX]) for s in exporter.get_finished_spans()
            if s.parent is None}


def _run_step(exporter: ShowingExporter, hang: Any) -> tuple[set[int], dict[str, int]]:
    otr.configure(exporters=[exporter], sampler=otr.TailSampler(2, "top_bottom"), hang=hang)
    release = threading.Event()
    rollouts = [Rollout(release, sample=i) for i in range(6)]
    for r in rollouts:
        r.started.wait(10)
    if hang is not False:  # snapshots are out while the whole step hangs
        wait_for(lambda: len({s.context.trace_id for s in exporter.snapshot_roots()}) >= 4,
                 "snapshots of the hanging step")
    release.set()
    for r in rollouts:
        r.join()
    otr.end_step(0)
    assert otr.flush()
    step = otr.stats()["steps"]["0/train"]
    otr.shutdown(timeout=10)
    return _kept_samples(exporter), {k: v for k, v in step.items() if k != "hung"}


def test_the_samplers_decisions_are_the_same_with_and_without_the_watcher() -> None:
    with_watcher = ShowingExporter()
    kept_with, step_with = _run_step(with_watcher, otr.HangOptions(after_s=0.2, refresh_s=0.5))
    without = ShowingExporter()
    kept_without, step_without = _run_step(without, False)
    assert with_watcher.snapshot_roots() and not without.calls
    assert kept_with == kept_without == {0, 5}  # bottom and top reward
    assert step_with == step_without
    assert step_with["kept"] == 2 and step_with["seen"] == 6


def test_snapshots_are_bounded_per_step_and_by_the_refresh_interval(exporter: ShowingExporter) -> None:
    otr.configure(exporters=[exporter], sampler=otr.TailSampler(10, "first"),
                  hang=otr.HangOptions(after_s=0.2, refresh_s=3600, max_per_step=2))
    release = threading.Event()
    first = Rollout(release, step=0, sample=0)
    first.started.wait(10)
    wait_for(lambda: exporter.shown(first.trace_id or 0), "the first snapshot")
    more = [Rollout(release, step=0, sample=i) for i in (1, 2, 3)]
    other_step = Rollout(release, step=1, sample=0)
    for r in [*more, other_step]:
        r.started.wait(10)
    # once the step-1 episode (started last) is shown, every step-0 one was overdue too
    wait_for(lambda: exporter.shown(other_step.trace_id or 0), "the step-1 snapshot")
    shown_ids = [s.context.trace_id for s in exporter.snapshot_roots()]
    step0 = {t for t in shown_ids if t in {r.trace_id for r in [first, *more]}}
    assert len(step0) == 2  # max_per_step
    assert shown_ids.count(first.trace_id) == 1  # not re-sent within refresh_s
    release.set()
    for r in [first, *more, other_step]:
        r.join()


def test_a_hanging_episode_is_refreshed_while_it_hangs(exporter: ShowingExporter) -> None:
    otr.configure(exporters=[exporter], sampler=otr.TailSampler(10, "first"),
                  hang=otr.HangOptions(after_s=0.2, refresh_s=0.5))
    release = threading.Event()
    rollout = Rollout(release)
    rollout.started.wait(10)
    shown = wait_for(lambda: len(exporter.shown(rollout.trace_id or 0)) >= 3 and
                     exporter.shown(rollout.trace_id or 0), "three snapshots")
    seconds = [s.attributes[c.RL_PENDING_SECONDS] for s in shown]
    assert seconds == sorted(seconds) and seconds[-1] > seconds[0]
    release.set()
    rollout.join()


class Hostile:
    """A value whose every text conversion raises."""

    def __repr__(self) -> str:
        raise RuntimeError("repr refused")

    def __str__(self) -> str:
        raise RuntimeError("str refused")


def test_a_hostile_value_and_a_changing_span_do_not_break_snapshots(exporter: ShowingExporter) -> None:
    otr.configure(exporters=[exporter], sampler=otr.TailSampler(10, "first"),
                  hang=otr.HangOptions(after_s=0.2, refresh_s=0.1))
    release = threading.Event()

    def churn() -> None:
        # the training thread keeps changing the open span's attributes while snapshots are taken
        span = trace.get_current_span()
        span.set_attribute("tool.handle", Hostile())
        i = 0
        while not release.is_set():
            span.set_attribute(f"progress.{i % 50}", [i, i + 1])
            if i % 50 == 49:
                for k in range(50):
                    span.attributes.pop(f"progress.{k}", None)  # type: ignore[attr-defined]
            i += 1

    rollout = Rollout(release, while_blocked=churn)
    rollout.started.wait(10)
    shown = wait_for(lambda: len(exporter.shown(rollout.trace_id or 0)) >= 3
                     and exporter.shown(rollout.trace_id or 0), "snapshots while the span changes")
    release.set()
    rollout.join()
    assert shown[-1].attributes[c.RL_PENDING_SPAN_NAME] == c.tool_span_name(TOOL)
    tool = next(s for spans, _, _ in exporter.calls for s in spans
                if s.name == c.tool_span_name(TOOL) and "tool.handle" in (s.attributes or {}))
    assert isinstance(tool.attributes["tool.handle"], str)  # rendered as a placeholder
    totals = otr.stats()["totals"]
    for counter in ("errors.hung_watcher", "errors.render_pending", "errors.ticker",
                    "errors.pending_copy"):
        assert totals.get(counter, 0) == 0, counter


class ScalarShowingExporter(ShowingExporter):
    """Also takes the step scalars (``log_metrics``), as Trackio's exporter does."""

    def __init__(self) -> None:
        super().__init__()
        self.scalars: dict[int, dict[str, float]] = {}

    def log_metrics(self, step: int, values: dict[str, float]) -> None:
        with self._calls_lock:
            self.scalars.setdefault(step, {}).update(values)


def test_an_episode_that_never_ends_is_counted_hung_at_shutdown() -> None:
    exporter = ScalarShowingExporter()
    otr.configure(exporters=[exporter], sampler=otr.TailSampler(10, "first"),
                  hang=otr.HangOptions(after_s=0.2, refresh_s=3600))
    release = threading.Event()
    finished = Rollout(release, sample=1)
    hanging = Rollout(threading.Event(), sample=0)  # its tool never returns
    for r in (finished, hanging):
        r.started.wait(10)
    wait_for(lambda: exporter.shown(hanging.trace_id or 0) and exporter.shown(finished.trace_id or 0),
             "both snapshots")
    release.set()
    finished.join()
    wait_for(lambda: finished.trace_id in exporter.ended(), "the finished one's ended notice")
    assert otr.shutdown(timeout=10)
    totals = otr.stats()["totals"]
    assert totals["episodes.hung"] == 1
    assert otr.stats()["steps"]["0/train"]["hung"] == 1
    assert hanging.trace_id in exporter.ended()  # its exporter stops showing it running
    assert exporter.scalars[0]["rollouts/episodes_hung"] == 1  # and the step's scalars say so
    hanging.release.set()
    hanging.join()


def test_an_episode_ended_by_the_episode_timeout_is_counted_hung(exporter: ShowingExporter) -> None:
    otr.configure(exporters=[exporter], sampler=otr.TailSampler(10, "first"),
                  hang=otr.HangOptions(after_s=0.2, refresh_s=3600), episode_timeout_s=2.5)
    release = threading.Event()
    rollout = Rollout(release)
    rollout.started.wait(10)
    wait_for(lambda: exporter.shown(rollout.trace_id or 0), "the snapshot")
    wait_for(lambda: rollout.trace_id in exporter.ended(), "the ended notice after the timeout")
    totals = otr.stats()["totals"]
    assert totals["episodes.timed_out"] == 1 and totals["episodes.hung"] == 1
    release.set()
    rollout.join()


def test_the_automatic_threshold_follows_the_steps_median(exporter: ShowingExporter) -> None:
    """Driven tick by tick with chosen clocks: no ticker (``install=False``), real records."""
    run = otr.configure(exporters=[exporter], sampler=otr.TailSampler(10, "first"), install=False)
    assert run.delivery is not None and run.counters is not None and run.sampling_pipeline is not None
    pipeline = run.sampling_pipeline
    watcher = HungWatcher(HangOptions(factor=3.0, floor_s=1.0, initial_s=100.0, min_finished=3),
                          run.delivery, run.counters)
    pipeline.hung = watcher  # the pipeline tells it each finished episode's duration
    try:
        episodes = [run.episode(step=0, sample_index=i).start() for i in range(4)]
        roots = [ep.root for ep in episodes]
        assert all(r is not None for r in roots)
        hanging = roots[3]
        assert hanging is not None
        t0 = max(r.start_ns for r in roots if r is not None)
        assert watcher.threshold_s((0, "train")) == 100.0  # nothing finished yet: initial_s
        watcher.tick(pipeline.open_episodes(), t0)
        for ep, root in zip(episodes[:3], roots[:3], strict=True):
            assert root is not None
            root.end(root.start_ns + 2_000_000_000)  # each ran 2 s
            ep.end()
        watcher.tick(pipeline.open_episodes(), t0 + 1)
        assert watcher.threshold_s((0, "train")) == pytest.approx(6.0)  # 3 x the median
        watcher.tick(pipeline.open_episodes(), hanging.start_ns + 5_000_000_000)
        watcher.tick(pipeline.open_episodes(), hanging.start_ns + 7_000_000_000)
        shown = wait_for(lambda: exporter.snapshot_roots(), "the snapshot past 3 x the median")
        assert len(shown) == 1 and shown[0].context.trace_id == int(episodes[3].trace_id or "0", 16)
        assert shown[0].attributes[c.RL_PENDING_SECONDS] == pytest.approx(7.0)
        # a later step of the same split starts from this median; another split does not
        assert watcher.threshold_s((1, "train")) == pytest.approx(6.0)
        assert watcher.threshold_s((1, "eval")) == 100.0
        episodes[3].end()
    finally:
        run.shutdown(timeout=10)


def test_hang_options_are_checked() -> None:
    assert HangOptions.of(None) == HangOptions() and HangOptions.of(True) == HangOptions()
    assert HangOptions.of(False) is None
    assert HangOptions.of(45) == HangOptions(after_s=45.0)
    for bad in (dict(after_s=0), dict(max_per_step=0), dict(refresh_s=-1), dict(factor=True)):
        with pytest.raises(ValueError):
            HangOptions(**bad)  # type: ignore[arg-type]
