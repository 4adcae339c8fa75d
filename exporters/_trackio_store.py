"""Every access this package makes to Trackio's storage beyond its public API, in one place:
its SQLite file (what a write really stored, request times, running snapshots deleted), its
process lock, and the private fields of its ``Run`` (the writer's lock, an inline flush, the
failures its writer only warned about). The exporter asks; this module knows how.

Why each is needed: ``trackio.log`` only queues, its writer thread drops a batch it cannot write
with a warning, and Trackio has no reader of what it stored, no way to choose a row's time and
no way to delete a row. Each access checks that the field or table exists, so a Trackio that
changed degrades to its public behaviour (said in the log), never to an exception.
"""

from __future__ import annotations

import errno
import json
import os
import sqlite3
import threading
from collections import defaultdict
from collections.abc import Callable, Mapping, Sequence
from pathlib import Path
from typing import Any, NamedTuple, TypeVar

from otel_rollouts.exporters._trackio_rows import META_TRACE_ID, is_snapshot

_T = TypeVar("_T")

# Trackio's warning keys for data it could not persist (trackio.run.Run._warn_once)
_PERSIST_FAILURES = ("write-", "persist-", "local-sender", "remote-sender", "flush-local-buffer", "finish-pending")


def _persist_failures(run: object) -> list[str]:
    """The keys of the writes a finished Trackio run reported as failed (sorted).

    The one place this package reads a private field of Trackio: ``Run._warned_failures``, the
    set of keys ``Run._warn_once`` adds before it warns. Trackio has no public way to learn that
    a write failed: its writer thread only calls ``warnings.warn`` (process-wide, filtered and
    de-duplicated by the warnings registry, and not safely capturable from another thread). The
    field exists in the lower bound CI installs (``trackio==0.43.0``, the latest release when this
    was written); should a later release drop it, this returns ``[]`` (failures go back to being
    Trackio's warnings only) and the trackio-failure tests say so.
    """
    return sorted(key for key in getattr(run, "_warned_failures", ()) if key.startswith(_PERSIST_FAILURES))


# Why an episode the exporter took was not stored (the reasons of ``take_not_stored``)
NOT_STORED_UNSTORABLE = "unstorable"  # a value Trackio cannot store (see ``why_unstorable``)
NOT_STORED_DIR_UNUSABLE = "trackio_dir_unusable"  # TRACKIO_DIR (or a parent) is a file: never writable
NOT_STORED_READ_ONLY = "trackio_read_only"  # TRACKIO_DIR or the database cannot be written
NOT_STORED_WRITE_FAILED = "trackio_write_failed"  # the write left it out, for no reason we could name
NOT_STORED_NO_ROOT = "no_episode_root"  # a broken tree: no span is its episode root (see ``broken_root``)
# (a locked database and a full disk are transient: the export fails and is retried instead)
# what makes trackio.init log to a remote server instead of the local database
_TRACKIO_REMOTE_ENV = ("TRACKIO_SPACE_ID", "TRACKIO_SERVER_URL")
_PROBE_TIMEOUT_S = 0.25  # how long the lock probe waits on SQLite's lock (a write takes milliseconds)
_PROCESS_LOCK_WAIT_S = 1.0  # and on Trackio's per-project process lock


class WriteProblem(NamedTuple):
    """Why a Trackio write cannot (or did not) happen: a ``reason`` for ``take_not_stored``, and
    whether retrying the export later makes sense (``transient``: a lock, a full disk)."""

    reason: str
    transient: bool
    detail: str



def _first_existing(path: Path) -> Path:
    """``path`` or its nearest ancestor that exists."""
    while not path.exists() and path.parent != path:
        path = path.parent
    return path


def _probe_process_lock(lock_path: Path) -> bool:
    """Whether Trackio's per-project process lock (an ``flock`` on ``<project>.lock``) can be
    taken within ``_PROCESS_LOCK_WAIT_S``: another process holding it for longer makes every
    Trackio write wait 10 s and then fail. Released at once."""
    try:
        import fcntl
    except ImportError:  # Windows: Trackio uses msvcrt there; not probed
        return True
    try:
        fd = os.open(lock_path, os.O_RDONLY | getattr(os, "O_NOFOLLOW", 0) | getattr(os, "O_CLOEXEC", 0))
    except OSError:
        return True  # no lock file yet (or unreadable): nothing to wait for, the write tells
    try:
        waiter = threading.Event()
        deadline = _PROCESS_LOCK_WAIT_S
        while True:
            try:
                fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
            except OSError:
                if deadline <= 0:
                    return False
                waiter.wait(0.05)  # polling another process's lock: nothing to wait on
                deadline -= 0.05
                continue
            fcntl.flock(fd, fcntl.LOCK_UN)
            return True
    finally:
        os.close(fd)


def classify(exc: BaseException) -> WriteProblem:
    """A failed write's ``WriteProblem`` from its exception."""
    detail = f"{type(exc).__name__}: {str(exc)[:160]}"
    text = str(exc).lower()
    code = getattr(exc, "errno", None)
    if code == errno.ENOSPC or "disk is full" in text or "no space" in text:
        return WriteProblem(NOT_STORED_WRITE_FAILED, True, f"disk full ({detail})")
    if "locked" in text or "busy" in text:
        return WriteProblem(NOT_STORED_WRITE_FAILED, True, f"database locked ({detail})")
    if code in (errno.ENOTDIR, errno.EEXIST):
        return WriteProblem(NOT_STORED_DIR_UNUSABLE, False, detail)
    if code in (errno.EACCES, errno.EPERM, errno.EROFS) or "readonly" in text or "read-only" in text:
        return WriteProblem(NOT_STORED_READ_ONLY, False, detail)
    return WriteProblem(NOT_STORED_WRITE_FAILED, False, detail)


def diagnose(db_path: Path, lock_path: Path | None = None) -> WriteProblem | None:
    """Why a write to Trackio's database at ``db_path`` cannot succeed now, or None when nothing
    is seen to stop it. Cheap enough to run before every write, and again after a write that
    stored less than it was given, to name why:

    * ``TRACKIO_DIR`` (or a parent) is a file: never writable, not transient;
    * another process holds Trackio's process lock or an exclusive SQLite lock: transient;
    * the filesystem has no space left: transient (space may be freed; the export is retried);
    * the directory or the database is read-only: not transient.
    """
    directory = db_path.parent
    existing = _first_existing(directory)
    if not existing.is_dir():
        return WriteProblem(NOT_STORED_DIR_UNUSABLE, False, f"TRACKIO_DIR {str(directory)!r} is not a directory "
                             f"({str(existing)!r} is a file)")
    if existing == directory and not os.access(directory, os.W_OK | os.X_OK):
        return WriteProblem(NOT_STORED_READ_ONLY, False, f"TRACKIO_DIR {str(directory)!r} is not writable")
    try:
        stat = os.statvfs(existing)
        if stat.f_bavail == 0 and os.geteuid() != 0 or stat.f_bfree == 0:
            return WriteProblem(NOT_STORED_WRITE_FAILED, True, f"no space left under {str(existing)!r}")
    except (OSError, AttributeError):
        pass
    if lock_path is not None and not _probe_process_lock(lock_path):
        return WriteProblem(NOT_STORED_WRITE_FAILED, True, f"another process holds {str(lock_path)!r}")
    if not db_path.exists():
        return None  # Trackio creates it
    try:
        conn = sqlite3.connect(str(db_path), timeout=_PROBE_TIMEOUT_S, isolation_level=None)
        try:
            conn.execute("BEGIN IMMEDIATE")  # the lock a write takes first; released at once
            conn.execute("ROLLBACK")
        finally:
            conn.close()
    except sqlite3.Error as exc:
        return classify(exc)
    return None


def stored_trace_ids(db_path: Path, run_name: str, since: str) -> set[str]:
    """The OpenTelemetry trace ids (32 hex digits, from each trace's metadata) of the traces
    Trackio stored for ``run_name`` at or after ``since`` (an ISO timestamp in UTC, the format
    Trackio stamps rows with): what a write really stored. Read-only; raises ``sqlite3.Error``
    when the database cannot be read."""
    if not db_path.exists():
        return set()
    conn = sqlite3.connect(f"{db_path.resolve().as_uri()}?mode=ro", uri=True, timeout=5.0)
    try:
        rows = conn.execute(
            "SELECT metadata FROM traces WHERE run_name = ? AND timestamp >= ?", (run_name, since)
        ).fetchall()
    except sqlite3.OperationalError as exc:
        if "no such table" in str(exc):
            return set()
        raise
    finally:
        conn.close()
    found: set[str] = set()
    for (metadata,) in rows:
        try:
            value = json.loads(metadata)
        except (TypeError, ValueError):
            continue
        trace_id = value.get(META_TRACE_ID) if isinstance(value, dict) else None
        if isinstance(trace_id, str) and not is_snapshot(value):  # a snapshot is no stored episode
            found.add(trace_id)
    return found


def stamp_request_times(db_path: Path, run_id: str | None, run_name: str, since: str,
                        times: Mapping[str, str]) -> int:
    """Set the ``timestamp`` (the Traces list's request time) of the run's rows written at or
    after ``since`` to ``times[their metadata's trace_id]``; returns how many were set. The run
    is found by Trackio's run id where it has one: Trackio indexes (run_id, timestamp), so only
    this write's rows are read, however large the project grew."""
    if not db_path.exists():
        return 0
    conn = sqlite3.connect(str(db_path), timeout=5.0)
    try:
        if run_id:
            query = "SELECT id, metadata FROM traces WHERE run_id = ? AND timestamp >= ?"
            rows = conn.execute(query, (run_id, since)).fetchall()
        else:
            query = "SELECT id, metadata FROM traces WHERE run_name = ? AND timestamp >= ?"
            rows = conn.execute(query, (run_name, since)).fetchall()
        updates = []
        for row_id, metadata in rows:
            try:
                value = json.loads(metadata)
            except (TypeError, ValueError):
                continue
            trace_id = value.get(META_TRACE_ID) if isinstance(value, dict) else None
            if isinstance(trace_id, str) and trace_id in times and not is_snapshot(value):
                updates.append((times[trace_id], row_id))
        with conn:
            conn.executemany("UPDATE traces SET timestamp = ? WHERE id = ?", updates)
        return len(updates)
    finally:
        conn.close()


def _read_rows(db_path: Path, run_id: object, run_name: str, since: str) -> list[tuple[str, str, Any]]:
    """(row id, key, decoded metadata) of the run's trace rows written at or after ``since``
    (by Trackio's run id where there is one: an indexed read of that write's rows only)."""
    if not db_path.exists():
        return []
    conn = sqlite3.connect(f"{db_path.resolve().as_uri()}?mode=ro", uri=True, timeout=5.0)
    try:
        if isinstance(run_id, str) and run_id:
            rows = conn.execute("SELECT id, key, metadata FROM traces WHERE run_id = ? AND timestamp >= ?",
                                (run_id, since)).fetchall()
        else:
            rows = conn.execute("SELECT id, key, metadata FROM traces WHERE run_name = ? AND timestamp >= ?",
                                (run_name, since)).fetchall()
    finally:
        conn.close()
    out = []
    for row_id, key, metadata in rows:
        try:
            out.append((row_id, key, json.loads(metadata)))
        except (TypeError, ValueError):
            continue
    return out


def delete_trace_rows(db_path: Path, row_ids: Sequence[str]) -> int:
    """Delete Trackio trace rows by their ids (a running episode's snapshot, once it ended);
    returns how many were deleted."""
    if not row_ids or not db_path.exists():
        return 0
    conn = sqlite3.connect(str(db_path), timeout=5.0)
    try:
        with conn:
            cursor = conn.executemany("DELETE FROM traces WHERE id = ?", [(row_id,) for row_id in row_ids])
        return cursor.rowcount
    finally:
        conn.close()


class TrackioStore:
    """One Trackio project's storage as the exporter needs it: whether a run writes to the local
    SQLite file (and can be read back), why a write cannot happen now, writing what a run queued
    now, what a write stored, rows' request times, running snapshots found and deleted."""

    def __init__(self, project: str, space_id: str | None = None) -> None:
        self.project = project
        self.space_id = space_id

    def db_path(self) -> Path:
        """The project's SQLite file, as Trackio names it (under ``TRACKIO_DIR``)."""
        from trackio.sqlite_storage import SQLiteStorage

        return Path(SQLiteStorage.get_project_db_path(self.project))

    def lock_path(self) -> Path | None:
        """Trackio's per-project process lock file (None when this Trackio has none we know)."""
        try:
            from trackio.utils import canonical_project_name

            return self.db_path().parent / f"{canonical_project_name(self.project)}.lock"
        except ImportError:
            return None

    def local(self, run: Any) -> bool:
        """Whether this run's writes can be read back here: Trackio's local SQLite storage."""
        return bool(getattr(run, "_is_local", self.space_id is None)) and getattr(
            run, "_storage_mode", "sqlite") == "sqlite"

    def cannot_write(self, run: Any | None) -> WriteProblem | None:
        """Why a write to the local database cannot succeed now (``diagnose``), checked before
        anything is handed to Trackio, whose writer (and ``trackio.init`` itself) waits 30 s on a
        locked database and then drops the batch; None when it can, or when Trackio logs to a
        Space or a server (nothing local to check). ``run``: the open run, None before the first."""
        if run is not None:
            local = self.local(run)
        else:
            local = self.space_id is None and not any(os.environ.get(name) for name in _TRACKIO_REMOTE_ENV)
        return diagnose(self.db_path(), self.lock_path()) if local else None

    def diagnose(self) -> WriteProblem | None:
        """Why a write cannot succeed now (``diagnose`` of this project's files)."""
        return diagnose(self.db_path(), self.lock_path())

    @staticmethod
    def write_now(run: Any) -> bool:
        """Make Trackio write what ``run.log`` queued, now, on this thread: what its writer thread
        does every half second (under the same lock, so never concurrently with it). False when
        this Trackio lacks those internals: the run was finished instead (its writer joined), and
        the caller resumes it by name."""
        client_lock = getattr(run, "_client_lock", None)
        flush = getattr(run, "_flush_queues_inline", None)
        if client_lock is not None and callable(flush):
            with client_lock:
                flush()
            return True
        run.finish()
        return False

    def stored(self, run: Any, since: str) -> set[str] | WriteProblem:
        """The trace ids of the episodes this run stored since ``since`` (``stored_trace_ids``),
        or why they cannot be read (the write met the same fault: a lock taken since)."""
        try:
            return stored_trace_ids(self.db_path(), run.name, since)
        except sqlite3.Error as exc:
            return classify(exc)

    def _under_run_lock(self, run: Any, job: Callable[[], _T]) -> _T:
        """``job()`` under the run's client lock: never while its writer thread writes."""
        client_lock = getattr(run, "_client_lock", None)
        if client_lock is None:
            return job()
        with client_lock:
            return job()

    def stamp_request_times(self, run: Any, since: str, times: Mapping[str, str]) -> int:
        """Give the run's rows written since ``since`` their episode's start as request time
        (``stamp_request_times``), under the run's client lock."""
        run_id = getattr(run, "id", None)
        run_id = run_id if isinstance(run_id, str) else None
        return self._under_run_lock(run, lambda: stamp_request_times(self.db_path(), run_id, run.name, since, times))

    def snapshot_rows(self, run: Any, since: str, keys: set[str]) -> dict[str, list[str]]:
        """OpenTelemetry trace id -> the row ids of the running episodes' snapshots written since
        ``since`` under ``keys``."""
        found: dict[str, list[str]] = defaultdict(list)
        for row_id, key, metadata in _read_rows(self.db_path(), getattr(run, "id", None), run.name, since):
            if key in keys and is_snapshot(metadata):
                trace_id = metadata.get(META_TRACE_ID)
                if isinstance(trace_id, str):
                    found[trace_id].append(row_id)
        return found

    def delete_rows(self, run: Any, row_ids: Sequence[str]) -> None:
        """Delete rows of snapshots no longer running (and their session files, best effort),
        under the run's client lock."""
        self._under_run_lock(run, lambda: delete_trace_rows(self.db_path(), row_ids))
        try:
            from trackio import agent_sessions
            from trackio.utils import project_trace_sessions_dir

            directory = project_trace_sessions_dir(self.project) / agent_sessions.safe_id(run.name or "run")
            for row_id in row_ids:
                (directory / agent_sessions.trace_session_filename(row_id)).unlink(missing_ok=True)
        except Exception:  # noqa: BLE001, S110 - Trackio's rendering artifact; its database is what it reads
            pass

    @staticmethod
    def persist_failures(run: object) -> list[str]:
        """The writes a finished run reported as failed (``_persist_failures``)."""
        return _persist_failures(run)

    def forget_logged(self, run: Any, key: str, step: int) -> int:
        """Take the values this run logged under ``key`` at ``step`` out of the metrics table (a
        row left with nothing else is deleted): a view of *now* (what runs) replaced in place
        instead of piling up one table per refresh. Returns how many rows changed."""
        return self._under_run_lock(run, lambda: forget_metric(self.db_path(), getattr(run, "id", None),
                                                                run.name, key, step))


def forget_metric(db_path: Path, run_id: object, run_name: str, key: str, step: int) -> int:
    """Remove ``key`` from the run's metrics rows at ``step`` (Trackio stores each ``log`` call
    as one row whose ``metrics`` column is a JSON object); a row left with only Trackio's own
    underscore keys is deleted. Returns how many rows changed."""
    if not db_path.exists():
        return 0
    conn = sqlite3.connect(str(db_path), timeout=5.0)
    try:
        column, value = ("run_id", run_id) if isinstance(run_id, str) and run_id else ("run_name", run_name)
        rows = conn.execute(f"SELECT id, metrics FROM metrics WHERE {column} = ? AND step = ? "  # noqa: S608 - a fixed column name
                            "AND instr(CAST(metrics AS TEXT), ?) > 0", (value, step, json.dumps(key))).fetchall()
        deletes, updates = [], []
        for row_id, raw in rows:
            try:
                metrics = json.loads(raw)
            except (TypeError, ValueError):
                continue
            if not isinstance(metrics, dict) or key not in metrics:
                continue
            del metrics[key]
            if all(name.startswith("_") for name in metrics):
                deletes.append((row_id,))
            else:
                updates.append((json.dumps(metrics), row_id))
        with conn:
            conn.executemany("DELETE FROM metrics WHERE id = ?", deletes)
            conn.executemany("UPDATE metrics SET metrics = ? WHERE id = ?", updates)
        return len(deletes) + len(updates)
    except sqlite3.OperationalError as exc:
        if "no such table" in str(exc):
            return 0
        raise
    finally:
        conn.close()
