"""Reading what otel_rollouts exported back, for tests: span trees and Trackio traces."""

from __future__ import annotations

import json
import os
import shutil
import sqlite3
import subprocess
import time
from collections import defaultdict
from collections.abc import Callable, Mapping, Sequence
from pathlib import Path
from typing import TYPE_CHECKING, Any

if TYPE_CHECKING:
    from opentelemetry.sdk.trace.export import SpanExporter
    from opentelemetry.sdk.trace.export.in_memory_span_exporter import InMemorySpanExporter


def configure_memory(
    cap: int = 1000,
    policy: Any = "first",
    *,
    also: Sequence[SpanExporter] = (),
    sampler_options: Mapping[str, Any] | None = None,
    **settings: Any,
) -> InMemorySpanExporter:
    """Configure the SDK with a new real InMemorySpanExporter and return that exporter.

    The call most tests make, written once: ``otr.configure(exporters=[InMemorySpanExporter(),
    *also], sampler=otr.TailSampler(cap, policy, **sampler_options), **settings)``. ``policy`` is
    a policy name or a ``Policy`` object; ``also`` are further exporters, after the in-memory one;
    ``settings`` are any other ``configure()`` arguments (``handle_signals=False``, ``run_id=``,
    limits...). The caller shuts the SDK down: use the ``configured`` fixture (conftest), which
    does it after the test, or call ``otr.shutdown()`` yourself."""
    from opentelemetry.sdk.trace.export.in_memory_span_exporter import InMemorySpanExporter

    import otel_rollouts as otr

    exporter = InMemorySpanExporter()
    otr.configure(
        exporters=[exporter, *also],
        sampler=otr.TailSampler(cap, policy, **(sampler_options or {})),
        **settings,
    )
    return exporter


def traces(exporter) -> dict[int, list]:
    """Finished spans of an InMemorySpanExporter grouped by trace id."""
    out: dict[int, list] = defaultdict(list)
    for span in exporter.get_finished_spans():
        out[span.context.trace_id].append(span)
    return dict(out)


def tree(spans) -> list[tuple[int, str]]:
    """(depth, name) in depth-first start order; fails if a span's parent is missing."""
    by_id = {s.context.span_id: s for s in spans}
    children = defaultdict(list)
    roots = []
    for s in spans:
        if s.parent is None:
            roots.append(s)
        else:
            assert s.parent.span_id in by_id, f"span {s.name} has a parent outside its trace"
            children[s.parent.span_id].append(s)
    out = []

    def walk(span, depth):
        out.append((depth, span.name))
        for child in sorted(children[span.context.span_id], key=lambda c: c.start_time):
            walk(child, depth + 1)

    for r in roots:
        walk(r, 0)
    return out


def root(spans):
    roots = [s for s in spans if s.parent is None]
    assert len(roots) == 1, [s.name for s in roots]
    return roots[0]


def trackio_rows(project: str) -> list[dict[str, Any]]:
    """The rows of Trackio's `traces` table for a project, JSON columns decoded."""
    path = os.path.join(os.environ["TRACKIO_DIR"], f"{project}.db")
    db = sqlite3.connect(path)
    try:
        rows = db.execute(
            "SELECT id, step, key, messages, metadata, spans FROM traces ORDER BY step, trace_index"
        ).fetchall()
    finally:
        db.close()

    def load(value):
        if isinstance(value, bytes):
            value = value.decode()
        return json.loads(value)

    return [
        {"id": r[0], "step": r[1], "key": r[2], "messages": load(r[3]), "metadata": load(r[4]),
         "spans": load(r[5])}
        for r in rows
    ]


def running_rows(db: Path) -> list[dict]:
    """Trackio's stored rows of running episodes in the project database ``db`` (what the Traces
    page lists under ``rollouts/running``), their metadata decoded."""
    if not db.exists():
        return []
    try:
        with sqlite3.connect(db, timeout=5) as conn:
            rows = conn.execute("SELECT metadata FROM traces WHERE key = 'rollouts/running'").fetchall()
    except sqlite3.OperationalError:  # the table is made on the first write
        return []
    return [json.loads(m) for (m,) in rows]


def wait_ready(stream, word: str = "READY") -> str:
    """Read a child's stdout up to its line with ``word`` and return that line. Other lines may
    come first, or be written into the same line: Trackio prints from its own thread ("* Trackio
    project initialized") while the child prints READY. Fails if the child exits first."""
    seen = []
    while line := stream.readline():
        if word in line:
            return line
        seen.append(line)
    raise AssertionError(f"the child ended without {word}; it printed {seen!r}")


def shrink_windows(monkeypatch, steps: int, splits: int) -> None:
    """Every per-step window the library keeps (closed steps, per-step counters, metrics waiting
    for their step, hang snapshots shown per step: 4,096 steps each) made ``steps`` long, and the
    splits remembered for the lag rule (1,024) ``splits``: the same code with smaller numbers, so a
    memory test reaches the steady state (every window full) in a few hundred steps, not 5,000."""
    from otel_rollouts._core import stats
    from otel_rollouts.correlate import metrics
    from otel_rollouts.sampling import hung
    from otel_rollouts.sampling import steps as step_book

    for module, name in ((step_book, "_MAX_CLOSED"), (stats, "_MAX_STEPS_KEPT"),
                         (metrics, "_MAX_PENDING_STEPS"), (hung, "_MAX_SHOWN_STEPS")):
        assert getattr(module, name) >= steps, (module.__name__, name)  # a window, made smaller
        monkeypatch.setattr(module, name, steps)
    assert step_book._MAX_SPLITS >= splits
    monkeypatch.setattr(step_book, "_MAX_SPLITS", splits)



def wait_for(predicate: Callable[[], Any], timeout: float = 60.0, what: str = "condition") -> Any:
    """Poll ``predicate`` until it holds (returns its value); fail naming ``what`` at the deadline."""
    deadline = time.monotonic() + timeout
    while True:
        value = predicate()
        if value:
            return value
        if time.monotonic() > deadline:
            raise AssertionError(f"not within {timeout:g} s: {what}")
        time.sleep(0.02)


def self_signed_certificate(tmp_path: Path) -> tuple[str, str]:
    """A certificate and key for 127.0.0.1, made with the openssl CLI (skips without it)."""
    import pytest

    if shutil.which("openssl") is None:
        pytest.skip("openssl CLI not available to make a test certificate")
    cert, key = tmp_path / "cert.pem", tmp_path / "key.pem"
    subprocess.run(
        ["openssl", "req", "-x509", "-newkey", "rsa:2048", "-nodes", "-keyout", str(key), "-out", str(cert),
         "-days", "1", "-subj", "/CN=127.0.0.1", "-addext", "subjectAltName=IP:127.0.0.1"],
        check=True, capture_output=True,
    )
    return str(cert), str(key)


def reference_rewards(policy: Any, episodes: list[dict], step: int, cap: int) -> list[float]:
    """The rewards one process holding every episode of ``step`` keeps under ``policy`` and
    ``cap``: what a distributed budget over several members must keep ({"id", "group", "index",
    "reward"} per episode, recorded in id order)."""
    import otel_rollouts as otr

    exporter = configure_memory(cap, policy, sampler_options={"distributed": False}, handle_signals=False)
    try:
        for e in sorted(episodes, key=lambda e: e["id"]):
            with otr.episode(step=step, group_id=e["group"], sample_index=e["index"], episode_id=e["id"]) as ep:
                ep.reward(e["reward"])
        otr.end_step(step)
        assert otr.flush(10)
        return sorted(s.attributes[otr.conventions.RL_REWARD] for s in exporter.get_finished_spans()
                      if s.name == "episode")
    finally:
        otr.shutdown(timeout=10)
