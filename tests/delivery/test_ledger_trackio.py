"""Trackio's writes are confirmed, never assumed: an episode the TrackioExporter took is either
stored in Trackio's real SQLite storage, or reported not stored (``take_not_stored()``: reason ->
OpenTelemetry trace ids), or the export fails so that it is retried. Values Trackio cannot store
(integers beyond 64 bits) are converted or flagged in ``rl.invalid`` on the record path, and the
exporter isolates any that still reach it, so one episode never loses its step.

Every fault is real: another process holding an exclusive SQLite lock on the project's database,
a full filesystem (a small tmpfs, root only), ``TRACKIO_DIR`` a file. Trackio reads
``TRACKIO_DIR`` at import, so the scenarios that change it run in a child process.
"""

from __future__ import annotations

import json
import os
import sqlite3
import subprocess
import sys
import textwrap
import uuid
from pathlib import Path
from typing import Any

import pytest
from disk_faults import fill, locked, mount_tmpfs, umount
from opentelemetry.sdk.trace import ReadableSpan
from opentelemetry.sdk.trace.export import SpanExportResult

import otel_rollouts as otr
from otel_rollouts import conventions as c
from otel_rollouts.exporters import TrackioExporter

REPO = Path(__file__).resolve().parents[2]


def _project() -> str:
    return f"ledger-{uuid.uuid4().hex[:10]}"


def _db(project: str) -> Path:
    return Path(os.environ["TRACKIO_DIR"]) / f"{project}.db"


def _stored_ids(project: str) -> list[str]:
    """The OpenTelemetry trace ids (hex) of every trace Trackio stored for ``project``."""
    if not _db(project).exists():
        return []
    db = sqlite3.connect(_db(project))
    try:
        rows = db.execute("SELECT metadata FROM traces").fetchall()
    finally:
        db.close()
    return sorted(json.loads(r[0])["trace_id"] for r in rows)


def _record(memory: Any, names: list[str], step: int = 0, end: int | None = None,
            **kwargs: Any) -> dict[str, list[ReadableSpan]]:
    """Record one episode per name at ``step`` (into ``memory``), then end step ``end`` (default
    ``step``): episode id -> its spans."""
    for name in names:
        with otr.episode(step=step, episode_id=name, **kwargs) as ep:
            ep.prompt("question")
            ep.reward(1.0)
    otr.end_step(step if end is None else end)
    assert otr.flush(timeout=10)
    spans = memory.get_finished_spans()
    memory.clear()
    by_episode: dict[str, list[ReadableSpan]] = {}
    trace_of = {s.context.trace_id: (s.attributes or {}).get(c.RL_EPISODE_ID) for s in spans if s.parent is None}
    for span in spans:
        by_episode.setdefault(trace_of[span.context.trace_id], []).append(span)
    return by_episode


def _hex(spans: list[ReadableSpan]) -> str:
    return f"{spans[0].context.trace_id:032x}"


def _root(spans: list[ReadableSpan]) -> ReadableSpan:
    return next(s for s in spans if s.parent is None)


# --- a lock another process holds -----------------------------------------------------------------
def test_a_database_another_process_locks_fails_the_export_and_nothing_is_reported_stored(memory):
    project = _project()
    exporter = TrackioExporter(project, run="r", table=False)
    episodes = _record(memory, ["before", "during"])
    try:
        assert exporter.export(episodes["before"]) is SpanExportResult.SUCCESS
        assert exporter.take_not_stored() == {}
        assert _stored_ids(project) == [_hex(episodes["before"])]
        with locked(_db(project)):
            # transient: the export fails (the delivery layer retries it), nothing half-written
            assert exporter.export(episodes["during"]) is SpanExportResult.FAILURE
            assert exporter.take_not_stored() == {}
        assert _stored_ids(project) == [_hex(episodes["before"])]
        # the lock is gone: the retry stores it, once
        assert exporter.export(episodes["during"]) is SpanExportResult.SUCCESS
        assert exporter.take_not_stored() == {}
        assert _stored_ids(project) == sorted([_hex(episodes["before"]), _hex(episodes["during"])])
    finally:
        exporter.shutdown()


# --- faults of the directory (a child process: Trackio reads TRACKIO_DIR at import) ------------
CHILD = textwrap.dedent(
    """
    import json, sys
    import otel_rollouts as otr
    from opentelemetry.sdk.trace.export.in_memory_span_exporter import InMemorySpanExporter
    from otel_rollouts.exporters import TrackioExporter

    memory = InMemorySpanExporter()
    otr.configure(exporters=[memory], sampler=otr.TailSampler(100, "first"), spool_dir=sys.argv[1])
    for step in range(2):
        for i in range(3):
            with otr.episode(step=step, sample_index=i) as ep:
                ep.prompt("question")
                ep.reward(float(i))
        otr.end_step(step)
    otr.flush(timeout=10)
    spans = memory.get_finished_spans()
    exporter = TrackioExporter("proj", run="r")
    out = {"results": [], "not_stored": {}, "trace_ids": sorted({s.context.trace_id for s in spans})}
    step_of = {s.context.trace_id: s.attributes.get(sys.argv[2]) for s in spans if s.parent is None}
    for step in range(2):
        batch = [s for s in spans if step_of[s.context.trace_id] == step]
        out["results"].append(exporter.export(batch).name)
        for reason, ids in exporter.take_not_stored().items():
            out["not_stored"].setdefault(reason, []).extend(ids)
    try:
        exporter.shutdown()
        out["shutdown"] = "ok"
    except Exception as exc:
        out["shutdown"] = repr(exc)
    otr.shutdown(timeout=3)
    print(json.dumps(out), flush=True)
    """
)


def _child(tmp_path: Path, trackio_dir: Path) -> dict[str, Any]:
    script = tmp_path / "child.py"
    script.write_text(CHILD)
    env = dict(os.environ)
    env["PYTHONPATH"] = os.pathsep.join(filter(None, [str(REPO), env.get("PYTHONPATH")]))
    env["TRACKIO_DIR"] = str(trackio_dir)
    done = subprocess.run([sys.executable, str(script), str(tmp_path / "spool"), c.RL_STEP],
                          capture_output=True, text=True, env=env, timeout=180)
    assert done.returncode == 0, done.stderr
    return json.loads([line for line in done.stdout.splitlines() if line.startswith("{")][-1])


def test_a_trackio_dir_that_is_a_file_drops_every_episode_under_a_named_reason(tmp_path):
    trackio_dir = tmp_path / "not-a-directory"
    trackio_dir.write_text("a file, not a directory")
    out = _child(tmp_path, trackio_dir)
    # not transient (retrying cannot help): taken, and every episode reported not stored by id
    assert out["results"] == ["SUCCESS", "SUCCESS"]
    assert {reason: sorted(ids) for reason, ids in out["not_stored"].items()} == {
        "trackio_dir_unusable": out["trace_ids"]}
    assert len(out["trace_ids"]) == 6


def test_a_full_disk_fails_the_export_and_nothing_is_reported_stored(tmp_path):
    trackio_dir = tmp_path / "full"
    if not mount_tmpfs(trackio_dir, "size=256k"):
        pytest.skip("needs root to mount a small tmpfs")
    try:
        fill(trackio_dir)
        out = _child(tmp_path, trackio_dir)
    finally:
        umount(trackio_dir)
    # transient (space may be freed): failed exports, retried by the delivery layer; none stored
    assert out["results"] == ["FAILURE", "FAILURE"]
    assert out["not_stored"] == {}


# --- integers beyond 64 bits -----------------------------------------------------------------------
def test_integers_beyond_64_bits_are_converted_or_flagged_and_the_episodes_are_stored(memory):
    project = _project()
    with otr.episode(step=0, episode_id="plain") as ep:
        ep.prompt("question")
        ep.reward(1.0)
    episodes = _record(memory, ["big-metadata"], step=0, metadata={"big": 10**30, "huge": -(10**400)})
    episodes |= _record(memory, ["big-step"], step=2**64, end=1)
    big, huge = c.RL_METADATA_PREFIX + "big", c.RL_METADATA_PREFIX + "huge"

    attrs = _root(episodes["big-metadata"]).attributes
    assert attrs[big] == 1e30 and isinstance(attrs[big], float)
    assert attrs[huge] == str(-(10**400))
    invalid = attrs[c.RL_INVALID_FIELDS]
    assert any(entry.startswith(f"{big}: beyond 64-bit") for entry in invalid), invalid
    assert any(entry.startswith(f"{huge}: beyond 64-bit") for entry in invalid), invalid

    attrs = _root(episodes["big-step"]).attributes
    assert attrs[c.RL_STEP] == 1  # refused: the current step (end_step(0) advanced it)
    assert any(entry.startswith("step: beyond 64-bit") for entry in attrs[c.RL_INVALID_FIELDS])

    exporter = TrackioExporter(project, run="r", table=False)
    try:
        spans = [span for group in episodes.values() for span in group]
        assert exporter.export(spans) is SpanExportResult.SUCCESS
        assert exporter.take_not_stored() == {}
    finally:
        exporter.shutdown()
    assert _stored_ids(project) == sorted(_hex(group) for group in episodes.values())


def _with(spans: list[ReadableSpan], **attributes: Any) -> list[ReadableSpan]:
    """``spans`` with ``attributes`` set on the root, the way spans from elsewhere (a replayed
    file, another SDK) reach an exporter without the record path's clean-up."""
    out = []
    for s in spans:
        attrs = dict(s.attributes or {})
        if s.parent is None:
            attrs.update(attributes)
        out.append(ReadableSpan(
            name=s.name, context=s.context, parent=s.parent, resource=s.resource, attributes=attrs,
            events=s.events, links=s.links, kind=s.kind, status=s.status, start_time=s.start_time,
            end_time=s.end_time, instrumentation_scope=s.instrumentation_scope,
        ))
    return out


def test_a_value_trackio_cannot_store_loses_only_its_own_episode_counted_by_trace_id(memory):
    project = _project()
    episodes = _record(memory, ["good", "big-int", "big-step", "also-good"], step=0)
    poisoned = {
        "good": episodes["good"],
        "big-int": _with(episodes["big-int"], **{c.RL_METADATA_PREFIX + "big": 10**30}),
        "big-step": _with(episodes["big-step"], **{c.RL_STEP: 2**64}),
        "also-good": episodes["also-good"],
    }
    exporter = TrackioExporter(project, run="r", table=False)
    try:
        assert exporter.export([s for group in poisoned.values() for s in group]) is SpanExportResult.SUCCESS
        not_stored = exporter.take_not_stored()
        assert exporter.take_not_stored() == {}  # taken once
    finally:
        exporter.shutdown()
    bad = sorted(poisoned[name][0].context.trace_id for name in ("big-int", "big-step"))
    assert {reason: sorted(ids) for reason, ids in not_stored.items()} == {"unstorable": bad}
    # the step's other episodes are stored
    assert _stored_ids(project) == sorted([_hex(episodes["good"]), _hex(episodes["also-good"])])


# --- replay --to trackio ---------------------------------------------------------------------------
def test_replay_to_trackio_counts_traces_trackio_did_not_store_and_exits_non_zero(memory, tmp_path):
    from otel_rollouts.exporters import OtlpJsonFileExporter

    episodes = _record(memory, ["a", "b", "c"], step=0)
    path = tmp_path / "rollouts.jsonl"
    writer = OtlpJsonFileExporter(str(path))
    assert writer.export([s for group in episodes.values() for s in group]) is SpanExportResult.SUCCESS
    writer.shutdown()
    trackio_dir = tmp_path / "a-file"
    trackio_dir.write_text("not a directory")
    env = dict(os.environ)
    env["PYTHONPATH"] = os.pathsep.join(filter(None, [str(REPO), env.get("PYTHONPATH")]))
    env["TRACKIO_DIR"] = str(trackio_dir)
    done = subprocess.run(
        [sys.executable, "-m", "otel_rollouts.delivery.replay", str(path), "--to", "trackio", "--project", "p"],
        capture_output=True, text=True, env=env, timeout=180,
    )
    assert done.returncode == 1, done.stderr
    assert "0 traces" in done.stderr and "3 traces" in done.stderr, done.stderr
    assert "trackio_dir_unusable" in done.stderr, done.stderr


def test_replay_to_trackio_counts_a_trace_trackio_skipped_as_not_delivered(tmp_path, capsys, otr_shutdown):
    from otel_rollouts.delivery.replay import main
    from otel_rollouts.exporters import OtlpJsonFileExporter

    path = tmp_path / "rollouts.jsonl"
    otr.configure(exporters=[OtlpJsonFileExporter(str(path))], sampler=otr.TailSampler(100, "first"))
    ids = {}
    # a nested integer beyond 64 bits travels as JSON text in the file: Trackio cannot store it
    for name, metadata in (("a", None), ("nested-big", {"nested": {"n": 10**30}}), ("c", None)):
        with otr.episode(step=0, episode_id=name, metadata=metadata) as ep:
            ep.prompt("question")
            ep.reward(1.0)
            ids[name] = ep.trace_id
    otr.end_step(0)
    assert otr.shutdown(timeout=10)
    project = _project()
    capsys.readouterr()
    assert main([str(path), "--to", "trackio", "--project", project]) == 1
    err = capsys.readouterr().err
    assert "2 traces" in err and "1 traces" in err and "not stored: unstorable" in err, err
    assert _stored_ids(project) == sorted([ids["a"], ids["c"]])


def _broken(line: dict[str, Any], trace: str, how: str) -> None:
    """Break trace ``trace`` (hex id) of an OTLP/JSON request in place: its root made its own
    parent, its root and prompt made each other's parent, or its root stripped of its kind."""
    spans = [s for rs in line["resourceSpans"] for ss in rs["scopeSpans"] for s in ss["spans"]
             if s["traceId"] == trace]
    if not spans:
        return
    root = next(s for s in spans if not s.get("parentSpanId"))
    prompt = next(s for s in spans if s["name"] == "prompt")
    if how == "own-parent":
        root["parentSpanId"] = root["spanId"]
    elif how == "cycle":
        root["parentSpanId"] = prompt["spanId"]
    else:  # no kind: nothing marks it as the episode root
        kinds = (c.RL_SPAN_KIND, c.GEN_AI_OPERATION_NAME)
        root["attributes"] = [a for a in root["attributes"] if a["key"] not in kinds]


@pytest.mark.parametrize(("how", "problem"), [
    ("own-parent", "is its own parent"),
    ("cycle", "form a parent cycle"),
    ("no-kind", "has no parent but is not marked an episode root"),
])
def test_replay_to_trackio_refuses_a_trace_without_an_episode_root_and_says_which(
        tmp_path, capsys, caplog, otr_shutdown, how, problem):
    """A replayed trace whose root is its own parent, whose root and prompt are each other's
    parent, or whose root lacks its kind attributes has no episode root: Trackio stores nothing
    of it. It is refused, named with its problem, counted not stored, and the exit status is 1
    (on the previous main: "2 traces delivered", exit 0, and Trackio held 1)."""
    from otel_rollouts.delivery.replay import main
    from otel_rollouts.exporters import OtlpJsonFileExporter

    path = tmp_path / "rollouts.jsonl"
    otr.configure(exporters=[OtlpJsonFileExporter(str(path))], sampler=otr.TailSampler(100, "first"),
                  handle_signals=False)
    ids = {}
    for name in ("good", "broken"):
        with otr.episode(step=0, episode_id=name) as ep:
            ep.prompt("question")
            ep.reward(1.0)
            ids[name] = ep.trace_id
    otr.end_step(0)
    assert otr.shutdown(timeout=10)
    lines = [json.loads(line) for line in path.read_text().splitlines()]
    for line in lines:
        _broken(line, ids["broken"], how)
    path.write_text("".join(json.dumps(line) + "\n" for line in lines))
    project = _project()
    capsys.readouterr()
    with caplog.at_level("WARNING", logger="otel_rollouts"):
        assert main([str(path), "--to", "trackio", "--project", project]) == 1
    err = capsys.readouterr().err
    assert "delivery failed: 1 traces" in err and "1 traces (" in err and "of 2 traces read" in err, err
    assert "not stored: no_episode_root" in err, err
    named = [r.getMessage() for r in caplog.records if ids["broken"] in r.getMessage()]
    assert len(named) == 1 and problem in named[0], caplog.text
    assert _stored_ids(project) == [ids["good"]]  # what the real Trackio storage holds
