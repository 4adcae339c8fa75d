"""Trackio failures are contained: counted, logged once, training continues, other exporters
still receive. Each fault is real: a read-only or full filesystem under TRACKIO_DIR (a tmpfs
mounted for the test when running as root; file permissions otherwise), a database whose
process lock another process holds, a Space on a Hub that cannot be reached.

Trackio reads TRACKIO_DIR at import, so each scenario runs in a child Python process.
"""

from __future__ import annotations

import fcntl
import json
import os
import subprocess
import sys
import textwrap
from pathlib import Path

import pytest
from disk_faults import fill, mount_tmpfs, umount
from otlp_sink import free_port

REPO = Path(__file__).resolve().parents[2]

CHILD = textwrap.dedent(
    """
    import json, logging, os, sys, time
    logging.basicConfig(level=logging.WARNING, format="%(name)s|%(message)s")
    import otel_rollouts as otr
    from otel_rollouts.exporters import TrackioExporter
    from opentelemetry.sdk.trace.export.in_memory_span_exporter import InMemorySpanExporter

    memory = InMemorySpanExporter()
    trackio = TrackioExporter("proj", run="r", space_id=os.environ.get("OTR_SPACE") or None)
    otr.configure(exporters=[trackio, memory], sampler=otr.TailSampler(4, "first"), spool_dir=sys.argv[1])
    user_errors = []
    for step in range(3):
        for i in range(6):
            try:
                with otr.episode(step=step, sample_index=i) as ep:
                    ep.prompt("question")
                    ep.reward(float(i))
            except BaseException as exc:  # anything the library let through
                user_errors.append(repr(exc))
        otr.end_step(step)
    flushed = otr.flush(timeout=float(os.environ.get("OTR_FLUSH", "5")))
    roots = [s for s in memory.get_finished_spans() if s.name == "episode"]
    stats = otr.stats()
    print(json.dumps({"user_errors": user_errors, "flushed": flushed, "memory_roots": len(roots),
                      "kept": stats["totals"].get("kept", 0), "totals": stats["totals"],
                      "delivery": stats["delivery"]}), flush=True)
    otr.shutdown(timeout=3)
    """
)


def _run(tmp_path: Path, trackio_dir: Path, timeout: float = 120, **env: str) -> tuple[dict, str]:
    script = tmp_path / "child.py"
    script.write_text(CHILD)
    full_env = dict(os.environ)
    full_env["PYTHONPATH"] = os.pathsep.join(filter(None, [str(REPO), full_env.get("PYTHONPATH")]))
    full_env["TRACKIO_DIR"] = str(trackio_dir)
    full_env.update(env)
    done = subprocess.run(
        [sys.executable, str(script), str(tmp_path / "spool")],
        capture_output=True, text=True, env=full_env, timeout=timeout,
    )
    assert done.returncode == 0, done.stderr
    # Trackio prints its own lines (at shutdown, after ours): the result is the JSON line
    return json.loads([line for line in done.stdout.splitlines() if line.startswith("{")][-1]), done.stderr


def _assert_contained(result: dict, stderr: str, dropped_as: str | None = None) -> None:
    """Training saw nothing, the other exporter got everything, and Trackio's failure is counted:
    as failed exports (retried: a lock, a full disk, an unreachable Space) or, with
    ``dropped_as``, as every episode dropped under that reason. Never as delivered."""
    assert result["user_errors"] == []  # training never saw an exception
    assert result["kept"] == 12
    assert result["memory_roots"] == 12  # the other exporter received every kept episode
    assert result["delivery"]["InMemorySpanExporter"]["delivered"] == 12
    assert result["delivery"]["TrackioExporter"]["delivered"] == 0  # nothing was stored
    totals = result["totals"]
    if dropped_as is not None:
        assert totals.get(f"lost.{dropped_as}.TrackioExporter") == 12, totals  # counted, by name
    else:
        failures = sum(v for k, v in totals.items() if k.endswith(".TrackioExporter")
                       and k.startswith(("errors.", "export.failures.")))
        assert failures >= 1, (totals, result["delivery"])  # counted
    ours = [line for line in stderr.splitlines() if line.startswith("otel_rollouts|") and "Trackio" in line]
    assert ours, stderr
    assert len(ours) == len(set(ours)), ours  # each problem logged once, not per episode




def test_read_only_trackio_directory(tmp_path):
    trackio_dir = tmp_path / "ro"
    mounted = mount_tmpfs(trackio_dir, "ro,size=1m")
    if not mounted:
        trackio_dir.mkdir(exist_ok=True)
        trackio_dir.chmod(0o555)
        if os.access(trackio_dir, os.W_OK):
            pytest.skip("cannot make a read-only directory here (root without mount)")
    try:
        result, stderr = _run(tmp_path, trackio_dir)
    finally:
        if mounted:
            umount(trackio_dir)
        else:
            trackio_dir.chmod(0o755)
    # not transient: every episode dropped under a named reason (retrying cannot help)
    _assert_contained(result, stderr, dropped_as="trackio_read_only")


def test_full_trackio_directory(tmp_path):
    trackio_dir = tmp_path / "full"
    if not mount_tmpfs(trackio_dir, "size=256k"):
        pytest.skip("needs root to mount a small tmpfs")
    try:
        fill(trackio_dir)  # the filesystem full to the last byte
        result, stderr = _run(tmp_path, trackio_dir)
    finally:
        umount(trackio_dir)
    _assert_contained(result, stderr)


@pytest.mark.slow
def test_locked_trackio_database(tmp_path):
    trackio_dir = tmp_path / "locked"
    trackio_dir.mkdir()
    # another process (here: this one) holds Trackio's per-project lock for the whole run;
    # Trackio gives up on it after 10 s
    with open(trackio_dir / "proj.lock", "w") as lock:
        fcntl.flock(lock.fileno(), fcntl.LOCK_EX)
        result, stderr = _run(tmp_path, trackio_dir, OTR_FLUSH="25")
    _assert_contained(result, stderr)
    assert result["flushed"] is False  # and flush() says that not everything got through


HOLD_SQLITE_LOCK = textwrap.dedent(
    """
    import sqlite3, sys
    db = sqlite3.connect(sys.argv[1], isolation_level=None)
    db.execute("PRAGMA journal_mode = WAL")  # as Trackio made it
    db.execute("CREATE TABLE IF NOT EXISTS held (x)")
    db.execute("BEGIN EXCLUSIVE")
    print("locked", flush=True)
    sys.stdin.readline()  # held until the test says so
    db.execute("ROLLBACK")
    """
)


def test_sqlite_database_locked_by_another_process(tmp_path):
    trackio_dir = tmp_path / "sqlite-locked"
    trackio_dir.mkdir()
    # another process holds an exclusive SQLite lock on the project's database for the whole run
    holder = subprocess.Popen([sys.executable, "-c", HOLD_SQLITE_LOCK, str(trackio_dir / "proj.db")],
                              stdin=subprocess.PIPE, stdout=subprocess.PIPE, text=True)
    try:
        assert holder.stdout is not None and holder.stdout.readline().strip() == "locked"
        result, stderr = _run(tmp_path, trackio_dir, OTR_FLUSH="5")
    finally:
        assert holder.stdin is not None
        holder.stdin.write("\n")
        holder.stdin.close()
        holder.wait(timeout=30)
    _assert_contained(result, stderr)
    assert result["flushed"] is False  # retried, not stored: flush() says so


def test_trackio_dir_that_is_a_file(tmp_path):
    trackio_dir = tmp_path / "a-file"
    trackio_dir.write_text("not a directory")
    result, stderr = _run(tmp_path, trackio_dir)
    _assert_contained(result, stderr, dropped_as="trackio_dir_unusable")


def test_unreachable_trackio_space_fails_fast(tmp_path):
    closed = free_port()  # nothing listens: the Hub cannot be reached
    result, stderr = _run(
        tmp_path,
        tmp_path / "space",
        timeout=90,
        OTR_SPACE="nobody-otr/nowhere-otr",
        HF_ENDPOINT=f"http://127.0.0.1:{closed}",
        HF_HUB_DISABLE_TELEMETRY="1",
    )
    _assert_contained(result, stderr)
    # what Trackio could not take waits in the spool, to be sent when the Space is reachable
    assert result["delivery"]["TrackioExporter"]["pending"] == 12
