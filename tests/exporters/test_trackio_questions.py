"""What Trackio answers of a step (issue 32), read back from Trackio's own SQLite storage: the
per-step table's reason, time, per-stage and group-health columns, the ``slowest`` table, a
watched prompt's history table, and the episodes still running (``show_pending``).

Episodes are built with the real OpenTelemetry SDK and handed to a real ``TrackioExporter``; the
root attributes the delivery layer writes (``rl.trace.keep_reason``, ``rl.duration.seconds``,
``rl.stage.*.seconds``, ``rl.group.*``, ``rl.watch.key``, ``rl.pending.snapshot*``) are set on them here,
as ``delivery/materialize.py`` sets them on kept roots. (Also used by
``test_trackio_questions_browser.py``, in a child process: keep it importable.)
"""

from __future__ import annotations

import time
import uuid
from collections.abc import Mapping, Sequence
from typing import Any

from opentelemetry import trace as trace_api
from opentelemetry.sdk.trace import ReadableSpan, TracerProvider
from opentelemetry.sdk.trace.export import SimpleSpanProcessor
from opentelemetry.sdk.trace.export.in_memory_span_exporter import InMemorySpanExporter
from opentelemetry.trace import Status, StatusCode
from otr_helpers import trackio_rows
from test_trackio_exporter import trackio_tables

from otel_rollouts import conventions as c
from otel_rollouts.exporters import TrackioExporter
from otel_rollouts.exporters import _trackio_rows as row_builders
from otel_rollouts.exporters import trackio as trackio_exporter

S = 1_000_000_000  # ns per second
QUESTION = "What is the capital of Australia?"
HANG_TOOL = "execute_tool fetch_page"


class Builder:
    """Episodes as real SDK spans (times given, so durations are exact without waiting)."""

    def __init__(self) -> None:
        self.memory = InMemorySpanExporter()
        self.provider = TracerProvider()
        self.provider.add_span_processor(SimpleSpanProcessor(self.memory))
        self.tracer = self.provider.get_tracer("otr-test-questions")
        self.t0 = time.time_ns() - 3600 * S

    def start(self, step: int, *, question: str = QUESTION, attrs: Mapping[str, Any] | None = None,
              at: float = 0.0) -> Any:
        """An episode's root span, open (its attributes: step, question, and ``attrs``)."""
        root = self.tracer.start_span("episode", context=trace_api.set_span_in_context(trace_api.INVALID_SPAN),
                                      start_time=self.t0 + int(at * S))
        root.set_attributes({c.RL_SPAN_KIND: c.KIND_EPISODE, c.RL_STEP: step, c.INPUT_VALUE: question,
                             **(attrs or {})})
        return root

    def child(self, root: Any, name: str, kind: str, start: float, end: float | None,
              attrs: Mapping[str, Any] | None = None, error: str | None = None) -> Any:
        """A span under ``root`` from ``start`` to ``end`` seconds (left open when None)."""
        span = self.tracer.start_span(name, context=trace_api.set_span_in_context(root),
                                      start_time=self.t0 + int(start * S))
        span.set_attributes({c.RL_SPAN_KIND: kind, **(attrs or {})})
        if error is not None:
            span.set_status(Status(StatusCode.ERROR, error))
        if end is not None:
            span.end(end_time=self.t0 + int(end * S))
        return span

    def episode(self, step: int, *, reward: float, answer: str, status: str = c.STATUS_OK,
                seconds: float = 2.0, stages: Mapping[str, float] | None = None,
                attrs: Mapping[str, Any] | None = None, question: str = QUESTION,
                at: float = 0.0, timed: bool = True) -> list[ReadableSpan]:
        """A finished episode: a generation then a tool call, rewarded; ``stages`` and the
        delivery's other root attributes in ``attrs`` (``rl.duration.seconds`` unless not
        ``timed``: an episode recorded after the fact); its spans (root last)."""
        extra: dict[str, Any] = {c.RL_REWARD: reward, c.RL_STATUS: status, c.OUTPUT_VALUE: answer,
                                 **({c.RL_DURATION_SECONDS: seconds} if timed else {}), **(attrs or {})}
        for stage, value in (stages or {}).items():
            extra[c.stage_seconds(stage)] = value
        root = self.start(step, question=question, attrs=extra, at=at)
        self.child(root, "chat pol", c.KIND_GENERATION, at, at + seconds / 2)
        self.child(root, "execute_tool search", c.KIND_TOOL, at + seconds / 2, at + seconds,
                   {c.GEN_AI_TOOL_NAME: "search"})
        root.end(end_time=self.t0 + int((at + seconds) * S))
        return self.spans_of(root)

    def spans_of(self, root: Any) -> list[ReadableSpan]:
        trace_id = root.get_span_context().trace_id
        return [s for s in self.memory.get_finished_spans() if s.context.trace_id == trace_id]


def snapshot(spans: Sequence[Any], now_s: float, t0: int, extra: Mapping[str, Any]) -> list[ReadableSpan]:
    """What the delivery layer hands ``show_pending``: each span as it is now, open ones ending
    "now" (``now_s``), the root with the ``rl.pending.snapshot*`` attributes in ``extra``."""
    out = []
    for span in spans:
        attrs = dict(span.attributes or {})
        if span.parent is None:
            attrs.update(extra)
        end = span.end_time if span.end_time is not None else t0 + int(now_s * S)
        out.append(ReadableSpan(name=span.name, context=span.get_span_context(), parent=span.parent,
                                resource=span.resource, attributes=attrs, events=span.events, links=span.links,
                                kind=span.kind, status=span.status, start_time=span.start_time, end_time=end,
                                instrumentation_scope=span.instrumentation_scope))
    return out


def pending_attrs(span_name: str, span_seconds: float, episode_seconds: float) -> dict[str, Any]:
    return {c.RL_PENDING_SNAPSHOT: True, c.RL_PENDING_SPAN_NAME: span_name, c.RL_PENDING_SPAN_SECONDS: span_seconds,
            c.RL_PENDING_SECONDS: episode_seconds}


def group_attrs(size: int, *, expected: int | None = None, spread: float = 0.5, all_equal: bool = False,
                lost: int = 0, degenerate: str | None = None) -> dict[str, Any]:
    """The ``rl.group.*`` attributes the delivery layer writes on a kept member's root."""
    out: dict[str, Any] = {c.RL_GROUP_SIZE: size, c.RL_GROUP_REWARD_SPREAD: spread,
                           c.RL_GROUP_ALL_EQUAL: all_equal, c.RL_GROUP_LOST: lost}
    if expected is not None:
        out[c.RL_GROUP_EXPECTED_SIZE] = expected
    if degenerate is not None:
        out[c.RL_GROUP_DEGENERATE] = degenerate
    return out


STRAGGLER = {c.STAGE_GENERATION: 3.0, c.STAGE_TOOL: 41.0, c.STAGE_ENVIRONMENT: 1.5, c.STAGE_REWARD: 0.5}


def fill_step(builder: Builder, step: int = 0) -> dict[str, list[ReadableSpan]]:
    """A step as the delivery layer hands it over: a straggler kept as ``slowest`` (its time in a
    tool), a member of an all-equal group kept as ``degenerate_group``, an error, and an episode
    recorded after the fact (no duration, no stages, no group)."""
    return {
        "straggler": builder.episode(step, reward=0.6, answer="Canberra.", seconds=46.0, stages=STRAGGLER,
                                     attrs={c.RL_KEEP_REASON: c.REASON_SLOWEST, **group_attrs(8, spread=0.6)}),
        "degenerate": builder.episode(step, reward=1.0, answer="Canberra!", seconds=4.0,
                                      stages={c.STAGE_GENERATION: 3.0, c.STAGE_TOOL: 1.0},
                                      attrs={c.RL_KEEP_REASON: c.REASON_DEGENERATE_GROUP,
                                             **group_attrs(8, spread=0.0, all_equal=True,
                                                           degenerate=c.DEGENERATE_ALL_EQUAL)}),
        "crashed": builder.episode(step, reward=0.0, answer="Sydney?", status=c.STATUS_ERROR, seconds=9.5,
                                   stages={c.STAGE_GENERATION: 2.0, c.STAGE_ENVIRONMENT: 7.5},
                                   attrs={c.RL_KEEP_REASON: c.REASON_ERROR,
                                          **group_attrs(6, expected=8, lost=2, spread=0.4,
                                                        degenerate=c.DEGENERATE_LOST)}),
        "untimed": builder.episode(step, reward=0.3, answer="Melbourne", seconds=1.0, timed=False,
                                   attrs={c.RL_KEEP_REASON: c.REASON_BOTTOM}),
    }


def _project(name: str) -> str:
    return f"otr-test-{name}-{uuid.uuid4().hex[:6]}"


def _trace_id(spans: Sequence[ReadableSpan]) -> str:
    return f"{spans[0].context.trace_id:032x}"


# --- 1. the per-step table and the slowest table -------------------------------------------------
def test_step_table_says_why_kept_how_long_where_and_the_groups_health():
    project = _project("questions-table")
    exporter = TrackioExporter(project, run="r")
    episodes = fill_step(Builder())
    assert exporter.export([s for spans in episodes.values() for s in spans]).name == "SUCCESS"
    exporter.force_flush()
    ((step, rows),) = trackio_tables(project)
    assert step == 0
    assert list(rows[0]) == ["reward", "reward parts", "advantage", "status", "failed tools", "question", "answer",
                             "turns", "input tokens", "output tokens", "kept because", "group health", "seconds",
                             "most time in", "gen s", "tool s", "env s", "reward s", "wait s", "trace id", "group",
                             "sample", "episode"]
    by_id = {r["trace id"]: r for r in rows}
    shown = {name: by_id[_trace_id(spans)] for name, spans in episodes.items()}
    assert [r["trace id"] for r in rows] == [_trace_id(episodes[n]) for n in
                                              ("crashed", "untimed", "straggler", "degenerate")]  # worst first
    straggler = shown["straggler"]
    assert (straggler["kept because"], straggler["seconds"]) == ("slowest", 46.0)
    assert [straggler[col] for col in ("gen s", "tool s", "env s", "reward s", "wait s")] == [3.0, 41.0, 1.5, 0.5, "—"]
    assert straggler["group health"] == "ok 8"
    assert shown["degenerate"]["group health"] == "all equal \u00d78"
    assert shown["degenerate"]["kept because"] == "degenerate_group"
    assert shown["crashed"]["group health"] == "lost 2/8" and shown["crashed"]["kept because"] == "error"
    untimed = shown["untimed"]  # nothing measured it: absent, never 0
    assert [untimed[col] for col in ("seconds", "gen s", "tool s", "env s", "reward s", "wait s",
                                     "group health")] == ["—"] * 7


def test_slowest_table_lists_the_steps_timed_episodes_slowest_first_with_where_the_time_went():
    project = _project("questions-slowest")
    exporter = TrackioExporter(project, run="r")
    builder = Builder()
    episodes = fill_step(builder)
    exporter.export([s for spans in episodes.values() for s in spans])
    exporter.export(builder.episode(1, reward=0.5, answer="x", timed=False))  # a step nobody timed: none
    exporter.force_flush()
    assert [step for step, _ in trackio_tables(project)] == [0, 1]
    ((step, rows),) = trackio_tables(project, "rollouts/slowest")
    assert step == 0
    assert [r["trace id"] for r in rows] == [_trace_id(episodes[n]) for n in ("straggler", "crashed", "degenerate")]
    assert list(rows[0])[:3] == ["seconds", "most time in", "gen s"]
    # the stage, its share, and for a stage made of spans its longest span (environment has none)
    assert [(r["seconds"], r["most time in"].split(": ")[0]) for r in rows] == [
        (46.0, "tool 41 s (89%)"), (9.5, "environment 7.5 s (79%)"), (4.0, "generation 3 s (75%)")]
    assert rows[0]["most time in"].split(": ")[1].startswith("execute_tool search ")
    assert ": " not in rows[1]["most time in"] and rows[2]["most time in"].split(": ")[1].startswith("chat pol ")
    assert [r["kept because"] for r in rows] == ["slowest", "error", "degenerate_group"]


def test_group_health_cells():
    health = row_builders.group_health
    assert health(group_attrs(8)) == "ok 8"
    assert health(group_attrs(6, expected=8)) == "ok 6/8"
    assert health(group_attrs(8, all_equal=True, spread=0.0)) == "all equal \u00d78"
    assert health(group_attrs(8, expected=8, lost=2)) == "lost 2/8"
    assert health(group_attrs(5, lost=1)) == "lost 1/5"
    assert health(group_attrs(6, expected=8, lost=2, all_equal=True)) == "all equal \u00d76, lost 2/8"
    assert health({}) == health({c.RL_GROUP_SIZE: True}) == "\u2014"


# --- 2. a watched prompt's history ---------------------------------------------------------------
WATCHED = "idx/17"  # a "/" would nest the Trackio key


def test_a_watched_prompts_table_grows_with_each_step_oldest_first():
    project = _project("questions-watch")
    exporter = TrackioExporter(project, run="r")
    builder = Builder()
    answers = ["Sydney", "Canberra, I think", "Canberra."]
    ids = []
    for step, answer in enumerate(answers):
        spans = builder.episode(step, reward=step / 2, answer=answer,
                                attrs={c.RL_WATCH_KEY: WATCHED, c.RL_KEEP_REASON: c.REASON_WATCH})
        other = builder.episode(step, reward=0.9, answer="unwatched")
        exporter.export(spans + other)
        ids.append(_trace_id(spans))
    exporter.force_flush()
    tables = trackio_tables(project, "rollouts/watch/idx_17")
    assert [step for step, _ in tables] == [0, 1, 2]
    for step, rows in tables:  # each step's table: the whole history so far
        assert [(r["step"], r["answer"], r["reward"], r["trace id"]) for r in rows] == [
            (s, answers[s], s / 2, ids[s]) for s in range(step + 1)]
    assert list(tables[-1][1][0]) == ["step", "reward", "status", "question", "answer", "trace id"]


def test_an_episode_not_stored_never_enters_the_history():
    project = _project("questions-watch-unstored")
    exporter = TrackioExporter(project, run="r")
    builder = Builder()
    stored = builder.episode(0, reward=1.0, answer="stored", attrs={c.RL_WATCH_KEY: "w"})
    # a value Trackio cannot store (an int beyond 64 bits): the episode is not stored
    unstorable = builder.episode(0, reward=0.0, answer="unstorable", attrs={c.RL_WATCH_KEY: "w"})
    root = next(s for s in unstorable if s.parent is None)
    attrs = {**(root.attributes or {}), c.RL_STEP: 2**70}
    unstorable = [s for s in unstorable if s.parent is not None] + [ReadableSpan(
        name=root.name, context=root.context, parent=None, attributes=attrs, start_time=root.start_time,
        end_time=root.end_time, resource=root.resource)]
    exporter.export(stored + unstorable)
    exporter.force_flush()
    assert list(exporter.take_not_stored()) == ["unstorable"]
    ((_, rows),) = trackio_tables(project, "rollouts/watch/w")
    assert [r["answer"] for r in rows] == ["stored"]


def test_watch_history_is_bounded(monkeypatch):
    monkeypatch.setattr(trackio_exporter, "WATCH_MAX_ROWS", 3)
    monkeypatch.setattr(trackio_exporter, "WATCH_MAX_KEYS", 2)
    project = _project("questions-watch-bounds")
    exporter = TrackioExporter(project, run="r")
    builder = Builder()
    for step in range(5):
        exporter.export(builder.episode(step, reward=0.1 * step, answer=f"answer {step}",
                                        attrs={c.RL_WATCH_KEY: "a"}))
    exporter.force_flush()
    last_step, rows = trackio_tables(project, "rollouts/watch/a")[-1]
    assert last_step == 4 and [r["step"] for r in rows] == [2, 3, 4]  # the oldest dropped first
    for key in ("b", "c"):  # a third key: "a", updated longest ago, is forgotten
        exporter.export(builder.episode(5, reward=0.5, answer=key, attrs={c.RL_WATCH_KEY: key}))
    exporter.export(builder.episode(6, reward=0.5, answer="a again", attrs={c.RL_WATCH_KEY: "a"}))
    exporter.force_flush()
    assert [r["answer"] for r in trackio_tables(project, "rollouts/watch/a")[-1][1]] == ["a again"]
    assert len(exporter._watch) == 2


def test_watch_keys_become_safe_trackio_keys():
    key = row_builders.watch_key
    assert key("idx/17") == "idx_17" and key(17) == "17" and key("sha256:ab12") == "sha256_ab12"
    assert key(None) is None and key("///") is None and len(key("x" * 500) or "") == 64


# --- 3. episodes still running -------------------------------------------------------------------
def _running_rows(project: str) -> list[dict[str, Any]]:
    return [r for r in trackio_rows(project) if r["key"] == "rollouts/running"]


def test_a_running_episode_is_shown_then_replaced_by_the_finished_one():
    project = _project("questions-running")
    exporter = TrackioExporter(project, run="r")
    builder = Builder()
    root = builder.start(3, attrs={c.RL_EPISODE_ID: "ep-hang"})
    builder.child(root, "chat pol", c.KIND_GENERATION, 0.0, 2.0)
    tool = builder.child(root, HANG_TOOL, c.KIND_TOOL, 2.0, None)
    live = [*builder.spans_of(root), root, tool]

    exporter.show_pending(snapshot(live, 30.0, builder.t0, pending_attrs(HANG_TOOL, 28.0, 30.0)), [])
    (shown,) = _running_rows(project)
    assert shown["step"] == 3 and shown["metadata"]["status"] == f"running {HANG_TOOL} 28.0s"
    assert shown["metadata"]["trace_id"] == f"{root.get_span_context().trace_id:032x}"
    status = {s["name"]: s["status"] for s in shown["spans"]}
    # the span it is stuck in reads as a hang (red), the spans above it as running
    assert status == {"episode": "running", "chat pol": "success", HANG_TOOL: "error"}
    (stuck,) = [s for s in shown["spans"] if s["name"] == HANG_TOOL]
    assert stuck["error"] == "hung: open for 28.0s, no end yet"
    ((step, table),) = trackio_tables(project, "rollouts/running/table")
    assert step == 3 and table == [{"episode": "ep-hang", "open for": "30.0s",
                                    "stuck in": f"{HANG_TOOL} (28.0s)", "trace id": shown["metadata"]["trace_id"]}]

    # a newer snapshot replaces the older one: one row, the longer wait
    exporter.show_pending(snapshot(live, 130.0, builder.t0, pending_attrs(HANG_TOOL, 128.0, 130.0)), [])
    (shown,) = _running_rows(project)
    assert shown["metadata"]["status"] == f"running {HANG_TOOL} 128s"

    # it ends and is kept: the finished episode replaces the snapshot
    tool.end(end_time=builder.t0 + 140 * S)
    root.set_attributes({c.RL_REWARD: 0.0, c.RL_STATUS: c.STATUS_OK, c.RL_KEEP_REASON: c.REASON_SLOWEST,
                         c.RL_DURATION_SECONDS: 141.0})
    root.end(end_time=builder.t0 + 141 * S)
    assert exporter.export(builder.spans_of(root)).name == "SUCCESS"
    assert exporter.exported == 1 and exporter.take_not_stored() == {}
    assert _running_rows(project) == []
    (kept,) = trackio_rows(project)
    assert kept["key"] == "rollouts" and kept["metadata"]["status"] == "ok"
    assert trackio_tables(project, "rollouts/running/table")[-1] == (
        3, [{"episode": "\u2014", "open for": "\u2014", "stuck in": "nothing running", "trace id": "\u2014"}])
    assert exporter.pending_failures == 0


def test_an_episode_that_ended_unkept_is_no_longer_shown_running():
    project = _project("questions-running-ended")
    exporter = TrackioExporter(project, run="r")
    builder = Builder()
    roots = []
    for name in ("a", "b"):
        root = builder.start(1, attrs={c.RL_EPISODE_ID: name})
        roots.append((root, builder.child(root, "environment step", c.KIND_SPAN, 1.0, None)))
    snapshots = [s for root, open_span in roots
                 for s in snapshot([root, open_span], 50.0, builder.t0, pending_attrs("environment step", 49.0, 50.0))]
    exporter.show_pending(snapshots, [])
    assert len(_running_rows(project)) == 2
    exporter.show_pending([], [roots[0][0].get_span_context().trace_id])  # "a" ended, dropped
    (left,) = _running_rows(project)
    assert left["metadata"][c.RL_EPISODE_ID] == "b"
    assert [r["episode"] for r in trackio_tables(project, "rollouts/running/table")[-1][1]] == ["b"]
    assert exporter.exported == 0  # a view: never an episode delivered


def test_show_pending_never_raises():
    exporter = TrackioExporter(_project("questions-running-bad"), run="r")
    exporter.show_pending([object()], [])  # type: ignore[list-item]
    assert exporter.pending_failures == 1
