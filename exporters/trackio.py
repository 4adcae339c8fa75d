"""Kept episodes as Trackio traces: one ``trackio.Trace`` per episode, logged at its step, and
per step the tables a researcher reads first (the episodes worst first, the slowest, the worst
tokens, watched prompts, what runs now, the step's summary and its groups).

Trackio's dashboard shows each trace's conversation (OpenAI-style messages, tool calls and tool
results) and its execution tree (the spans). The embedded default writes to a local SQLite file
under ``TRACKIO_DIR``: nothing to start.

Three parts, one job each: ``_trackio_rows`` builds what Trackio shows from the spans (the trace
and the tables' rows; what Trackio's pages derive from them and how each field is written so that
it reads true is said there), ``_trackio_store`` holds every access to Trackio beyond its public
API (its SQLite file, its process lock, its ``Run``'s private fields), and this exporter decides
when to log what and what counts as delivered.
"""

from __future__ import annotations

import logging
import math
import threading
from collections import OrderedDict, defaultdict, deque
from collections.abc import Mapping, Sequence
from datetime import datetime, timezone
from typing import TYPE_CHECKING, Any, NamedTuple

from opentelemetry.sdk.trace import ReadableSpan
from opentelemetry.sdk.trace.export import SpanExporter, SpanExportResult

if TYPE_CHECKING:
    from trackio.run import Run

from otel_rollouts import conventions as c
from otel_rollouts._core.health import GroupRow
from otel_rollouts._core.redaction import Redactor
from otel_rollouts._core.values import fits_int64
from otel_rollouts.exporters._trackio_rows import (
    GROUPS_SUFFIX,
    META_STATUS,
    MISMATCH_SUFFIX,
    RUNNING_COLUMNS,
    RUNNING_MAX,
    RUNNING_NONE,
    RUNNING_NOW,
    RUNNING_SUFFIX,
    SLOWEST_SUFFIX,
    SUMMARY_SUFFIX,
    TABLE_ABSENT,
    TABLE_SUFFIX,
    WATCH_MAX_KEYS,
    WATCH_MAX_ROWS,
    WATCH_SUFFIX,
    TokenRow,
    episode_messages,
    episode_metadata,
    episode_spans,
    groups_rows,
    iso_utc,
    mismatch_rows,
    running_label,
    running_row,
    running_spans,
    slowest_rows,
    step_rows,
    summary_prefix,
    summary_rows,
    table_row,
    watch_key,
    watch_row,
    why_unstorable,
    worst_first,
    worst_tokens,
)
from otel_rollouts.exporters._trackio_store import (
    NOT_STORED_NO_ROOT,
    NOT_STORED_UNSTORABLE,
    NOT_STORED_WRITE_FAILED,
    TrackioStore,
    WriteProblem,
)
from otel_rollouts.exporters._tree import broken_root, by_trace, hex_id, root_of, trace_link
from otel_rollouts.exporters.extras import GroupsSink, MetricsSink, NotStoredReporter, PendingViewer

__all__ = ["TrackioExporter"]

logger = logging.getLogger("otel_rollouts")

_BROKEN_LOGGED = 20  # broken traces named one by one in the log, the rest counted


class _Episode(NamedTuple):
    """One episode of an export, ready for Trackio."""

    trace_id: int
    step: int
    key: str
    trace: object  # trackio.Trace
    row: dict[str, object]
    started: str | None  # the episode's start, as Trackio stamps rows (its request time)
    watch: tuple[str, dict[str, object]] | None = None  # (its watch table's key, its history row)
    mismatch: tuple[TokenRow, ...] = ()  # its worst tokens (train–inference mismatch)


class _Running(NamedTuple):
    """An episode shown running (``show_pending``): where its snapshot is, and its table row."""

    step: int
    key: str  # the running traces' key (``rollouts/running``)
    row: dict[str, object]
    row_ids: tuple[str, ...]  # the Trackio rows of its snapshot (local storage only)


class TrackioExporter(SpanExporter, MetricsSink, GroupsSink, NotStoredReporter, PendingViewer):
    """Writes each kept episode as a ``trackio.Trace`` at ``step=rl.step``, and per step a table.

    ``project``/``run``/``space_id`` are Trackio's (a ``space_id`` syncs to a Hugging Face
    Space). Train episodes go under ``trace_key``; other splits under ``"{split}/{trace_key}"``.
    ``trace_ui_url`` (or env ``OTEL_ROLLOUTS_TRACE_UI_URL``), e.g. a Jaeger base URL, adds a
    ``trace_url`` link to each trace's metadata; a value with ``{trace_id}`` is a URL template
    (Phoenix: ``http://localhost:6006/redirects/traces/{trace_id}``).

    The step table (``"{trace_key}/table"``, ``"{split}/{trace_key}/table"``; ``table=False``
    turns it off) has one row per kept episode: reward, advantage, status, question and answer
    (one short line each), turns, input and output tokens (``—`` when no generation recorded
    any), trace id, group, sample, episode id (and ``link`` with a trace UI), lowest reward
    first. A step's episodes reach the exporter one export at a time, so its rows are collected
    and the table is logged once the step is over: when an episode of a later step arrives, or at
    ``force_flush``/``shutdown`` (``otr.flush()``, ``otr.shutdown()``). An episode that arrives
    after its step's table was logged goes into another table at that step.

    With train–inference mismatch measured (``rl.mismatch.*``), the step table gains ``mismatch
    kl``, ``max |Δ|`` and ``tokens outside band``, and a ``"{trace_key}/mismatch"`` table lists
    the step's worst tokens (``mismatch_rows``), largest |Δ| first, with their question and group.

    Per step also: ``slowest`` (the timed episodes slowest first, the stage and span their time
    went to, the engine's queue and first-token times), ``watch/<key>`` (a watched prompt's
    history), ``summary`` and ``groups`` when the step closes (``log_metrics``, ``log_groups``:
    seen/kept/dropped by status and reason; every group seen), and while episodes hang the
    ``running`` traces, ``running/table`` (replaced in place) and the scalar ``running_now``.
    """

    def __init__(
        self,
        project: str,
        run: str | None = None,
        space_id: str | None = None,
        trace_key: str = "rollouts",
        *,
        trace_ui_url: str | None = None,
        config: dict[str, object] | None = None,
        table: bool = True,
        redact: Redactor | bool = True,
    ) -> None:
        import os

        self.project = project
        self.run_name = run
        self.space_id = space_id
        self.store = TrackioStore(project, space_id)  # every access to Trackio beyond its public API
        self.trace_key = trace_key
        self.trace_ui_url = (trace_ui_url or os.environ.get(c.ENV_TRACE_UI_URL) or "").rstrip("/") or None
        # the run's config is stored by Trackio as given: it is redacted like span content
        # (``redact``: a Redactor, True for the default patterns, False for none)
        redactor = Redactor() if redact is True else redact or None
        self.config = redactor.mapping(config) if redactor is not None and config is not None else config
        self.table = table
        self._run: Any = None  # trackio's Run, made on the first export
        self._lock = threading.Lock()
        # (step, table key) -> trace id -> row: an episode exported again before its step's table is
        # logged (a retried export) is one row
        self._rows: dict[tuple[int, str], dict[str, dict[str, object]]] = defaultdict(dict)
        # (step, table key) -> trace id -> its worst tokens: the step's mismatch table, logged with it
        self._tokens: dict[tuple[int, str], dict[str, tuple[TokenRow, ...]]] = defaultdict(dict)
        self.exported = 0
        self.skipped_fragments = 0
        self.tables_logged = 0
        self.table_failures = 0
        self.metrics_skipped = 0  # steps whose scalars could not be written (log_metrics)
        self.request_time_failures = 0  # writes whose rows kept Trackio's time (_stamp_request_times)
        self._not_stored: dict[str, list[int]] = {}  # reason -> trace ids (take_not_stored)
        self._not_stored_lock = threading.Lock()
        self._warned_unstorable = False
        self._warned_problems: set[str] = set()
        self.broken_traces = 0  # traces refused for a broken tree (``broken_root``)
        # watched prompts: table key -> its history rows (bounded), and (step, key) tables due
        self._watch: OrderedDict[str, deque[dict[str, Any]]] = OrderedDict()
        self._watch_due: set[tuple[int, str]] = set()
        # episodes shown running (show_pending), earliest shown first
        self._running: OrderedDict[int, _Running] = OrderedDict()
        self._running_tables: dict[str, int] = {}  # running table key -> the step it was last logged at
        self.pending_failures = 0  # show_pending calls (or replacements) that failed or were skipped
        self._import_lock = threading.Lock()
        self._imported = False
        try:
            # here, on the thread that makes the exporter (configure), before any thread of ours
            # exists: the sender and metrics threads then find Trackio imported (0.5 s, once)
            self._import_trackio()
        except Exception:  # noqa: BLE001 - the first export imports it again and reports why
            pass

    def _import_trackio(self) -> None:
        """Import Trackio and the modules of it used here, once, one thread at a time. This
        exporter's sender thread and the metrics thread (``log_metrics``) both reach for it
        first: two threads importing Trackio's circular modules at once gave one of them a
        half-initialised module (``cannot import name 'SQLiteStorage' from partially initialized
        module``), a failed export."""
        if self._imported:
            return
        with self._import_lock:
            if not self._imported:
                import trackio  # noqa: F401
                import trackio.sqlite_storage  # noqa: F401
                import trackio.utils  # noqa: F401

                self._imported = True

    def _trackio_run(self) -> Any:
        if self._run is None:
            import trackio

            kwargs: dict[str, Any] = {  # trackio.init's keywords, of several types
                "project": self.project,
                "name": self.run_name,
                "space_id": self.space_id,
                "config": self.config,
                "embed": False,
                "auto_log_cpu": False,
                "auto_log_gpu": False,
            }
            if self.run_name is not None:
                kwargs["resume"] = "allow"
            self._run = trackio.init(**kwargs)
        return self._run

    @property
    def run(self) -> str | None:
        """The Trackio run name (known after the first export)."""
        return getattr(self._run, "name", self.run_name)

    def trace_url(self, trace_id: int) -> str | None:
        """The link to this trace in a trace UI, or None when no UI is configured
        (``_tree.trace_link``)."""
        return trace_link(self.trace_ui_url, trace_id)

    def table_key(self, split: str) -> str:
        """The key a split's step tables are logged under (``rollouts/table``, ``eval/rollouts/table``)."""
        key = self.trace_key if split == "train" else f"{split}/{self.trace_key}"
        return f"{key}/{TABLE_SUFFIX}"

    def export(self, spans: Sequence[ReadableSpan]) -> SpanExportResult:
        """Write each episode (trace) of ``spans`` to Trackio, and confirm what got stored.

        Trackio's ``run.log`` only queues: its writer thread writes a batch every half second and
        merely *warns* when the write fails (a locked database, a full disk, ``TRACKIO_DIR`` a
        file), dropping the batch. So, with Trackio's local SQLite storage, the export waits for
        the write and reads back which of its episodes were stored:

        * ``SUCCESS``: every episode was stored, except those ``take_not_stored()`` returns by
          reason (a value Trackio cannot store, a directory that can never be written...);
        * ``FAILURE``: nothing was stored and retrying later makes sense (a lock another process
          holds, a full disk): nothing is half-written, so a retry sends no episode twice.

        A Space (or a Trackio in its JSONL mode) cannot be read back from here: its failures are
        those Trackio reports when the run is finished (``force_flush``).
        """
        self._import_trackio()
        import trackio

        episodes: list[_Episode] = []
        unstorable: list[int] = []  # reported only when the export succeeds (a retry finds them again)
        broken: list[int] = []  # the same, for traces whose tree has no episode root
        for trace_id, group in by_trace(spans).items():
            root = root_of(group)
            if root is None:
                problem = broken_root(group)
                if problem is None:  # late spans of an episode exported before: nothing to store
                    self.skipped_fragments += len(group)
                else:
                    broken.append(trace_id)
                    self._log_broken(trace_id, problem)
                continue
            attrs = root.attributes or {}
            step = attrs.get(c.RL_STEP)
            step = step if isinstance(step, int) and not isinstance(step, bool) else 0
            split = str(attrs.get(c.RL_SPLIT) or "train")
            key = self.trace_key if split == "train" else f"{split}/{self.trace_key}"
            url = self.trace_url(trace_id)
            try:
                messages, metadata = episode_messages(group), episode_metadata(root, url, group)
                tree = episode_spans(group)
                problem = why_unstorable(messages, metadata, tree)
                if problem is None and not fits_int64(step):
                    problem = f"step {step} is beyond 64-bit integer range"
                trace = None if problem is not None else trackio.Trace(messages=messages, metadata=metadata,
                                                                       spans=tree)
                row = table_row(group, url)
                tokens = tuple(mismatch_rows(group, url))
                watched = watch_key(attrs.get(c.RL_WATCH_KEY))
                watch = None if watched is None else (
                    f"{key}/{WATCH_SUFFIX}/{watched}", watch_row(step, attrs, trace_id))
            except Exception as exc:  # noqa: BLE001 - one episode's odd value never loses the others
                problem, trace, watch, tokens = f"{type(exc).__name__}: {str(exc)[:120]}", None, None, ()
            if problem is not None or trace is None:
                # Trackio would skip the whole step's traces with a warning of its own: leave this
                # one out, and say so (counted lost, never delivered)
                unstorable.append(trace_id)
                if not self._warned_unstorable:
                    self._warned_unstorable = True
                    logger.warning("otel_rollouts: TrackioExporter: trace %s cannot be stored by Trackio (%s); "
                                   "counted lost in otr.stats()", hex_id(trace_id, 32), problem)
                continue
            episodes.append(_Episode(trace_id, step, key, trace, row, iso_utc(root.start_time), watch, tokens))
        result = self._write(episodes)
        if result is SpanExportResult.SUCCESS and unstorable:
            self._not_stored_add(NOT_STORED_UNSTORABLE, unstorable)
        if result is SpanExportResult.SUCCESS and broken:
            self._not_stored_add(NOT_STORED_NO_ROOT, broken)
        return result

    def _log_broken(self, trace_id: int, problem: str) -> None:
        """Name a trace refused for its broken tree (the first ``_BROKEN_LOGGED`` one by one: a
        replayed file of thousands of them says so without a line each)."""
        self.broken_traces += 1
        if self.broken_traces <= _BROKEN_LOGGED:
            logger.warning("otel_rollouts: TrackioExporter: trace %s not stored: %s, so it has no episode "
                           "root (counted %s)", hex_id(trace_id, 32), problem, NOT_STORED_NO_ROOT)
        elif self.broken_traces == _BROKEN_LOGGED + 1:
            logger.warning("otel_rollouts: TrackioExporter: more traces without an episode root; the "
                           "rest are counted (%s), not named", NOT_STORED_NO_ROOT)

    def _write(self, episodes: list[_Episode]) -> SpanExportResult:
        """Log ``episodes`` to Trackio and confirm them (see ``export``)."""
        if not episodes:
            return SpanExportResult.SUCCESS
        with self._lock:
            problem = self._cannot_write()
            if problem is not None:
                return self._not_written(problem, episodes)
            run = self._trackio_run()
            confirm = self.store.local(run)
            since = datetime.now(timezone.utc).isoformat()
            by_step: dict[tuple[int, str], list[object]] = defaultdict(list)
            for episode in episodes:
                by_step[(episode.step, episode.key)].append(episode.trace)
            # one log per (step, key): Trackio's trace ids are "<run id>:<log id>:<key>:<index>"
            for (step, key), traces in sorted(by_step.items()):
                run.log({key: traces}, step=step)
            stored = episodes
            if confirm:
                outcome = self._confirm(run, episodes, since)
                if isinstance(outcome, SpanExportResult):
                    return outcome
                stored = outcome
                self._stamp_request_times(run, stored, since)
            self.exported += len(stored)
            if self.table:
                for episode in stored:
                    table = (episode.step, f"{episode.key}/{TABLE_SUFFIX}")
                    self._rows[table][hex_id(episode.trace_id, 32)] = episode.row
                    if episode.mismatch:
                        self._tokens[table][hex_id(episode.trace_id, 32)] = episode.mismatch
                    if episode.watch is not None:
                        self._watch_add(episode.step, *episode.watch)
            self._replace_running(run, [e.trace_id for e in stored])
            if stored:
                # the steps before the latest one here are over: their tables can be logged
                self._log_tables(before=max(e.step for e in stored))
        return SpanExportResult.SUCCESS

    def _cannot_write(self) -> WriteProblem | None:
        """Why a write cannot succeed now (``TrackioStore.cannot_write``), None when it can."""
        return self.store.cannot_write(self._run)

    def _write_now(self, run: Any) -> None:
        """Make Trackio write what ``run`` queued, now; a Trackio without the internals for it had
        the run finished instead, resumed by name on the next export."""
        if not self.store.write_now(run):
            self._run = None
            self.run_name = run.name

    def _confirm(self, run: Run, episodes: list[_Episode], since: str) -> SpanExportResult | list[_Episode]:
        """Wait for Trackio's write of ``episodes`` and read back which were stored.

        Returns the stored episodes (the others are added to ``take_not_stored`` under the reason
        the diagnosis names), or ``FAILURE`` when none was stored and the cause is transient.
        """
        self._write_now(run)
        found = self.store.stored(run, since)
        if isinstance(found, WriteProblem):  # what was written cannot be read
            return self._not_written(found, episodes)
        stored = [e for e in episodes if hex_id(e.trace_id, 32) in found]
        if len(stored) == len(episodes):
            return stored
        missing = [e for e in episodes if hex_id(e.trace_id, 32) not in found]
        problem = self.store.diagnose() or WriteProblem(
            NOT_STORED_WRITE_FAILED, False,
            f"Trackio did not store it ({', '.join(self.store.persist_failures(run)) or 'no warning'})")
        if not stored:
            return self._not_written(problem, episodes)
        # part of the write went through: a retry would send the stored ones twice
        self._not_written(problem._replace(transient=False), missing)
        return stored

    def _stamp_request_times(self, run: Run, stored: list[_Episode], since: str) -> None:
        """Give each stored episode's row its episode's start as its request time.

        Trackio stamps every row of a write with the time of the write (``bulk_log``; neither
        ``trackio.log`` nor ``Trace`` takes a time), so a step's episodes would share one and the
        Traces list would order them at random. A view: failing never fails the export."""
        times = {hex_id(e.trace_id, 32): e.started for e in stored if e.started is not None}
        if not times:
            return
        try:
            self.store.stamp_request_times(run, since, times)
        except Exception as exc:  # noqa: BLE001 - a view: never fail (and so resend) a stored export
            self.request_time_failures += 1
            if self.request_time_failures == 1:
                logger.warning("otel_rollouts: TrackioExporter could not set the episodes' request times "
                               "(%s: %s); they keep the time of their write", type(exc).__name__, exc)

    def _not_written(self, problem: WriteProblem, episodes: list[_Episode]) -> SpanExportResult:
        """``episodes`` were not stored for ``problem``: ``FAILURE`` when it is transient (the
        export is retried), else counted under its reason in ``take_not_stored`` (``SUCCESS``)."""
        first = problem.reason not in self._warned_problems
        self._warned_problems.add(problem.reason)
        if problem.transient:
            if first:
                logger.warning("otel_rollouts: TrackioExporter: Trackio cannot write now (%s); the export "
                               "fails and is retried", problem.detail)
            return SpanExportResult.FAILURE
        if first:
            logger.warning("otel_rollouts: TrackioExporter: %d episode(s) not stored by Trackio (%s: %s); "
                           "counted lost in otr.stats()", len(episodes), problem.reason, problem.detail)
        self._not_stored_add(problem.reason, [e.trace_id for e in episodes])
        return SpanExportResult.SUCCESS

    def _not_stored_add(self, reason: str, trace_ids: list[int]) -> None:
        with self._not_stored_lock:
            self._not_stored.setdefault(reason, []).extend(trace_ids)

    def take_not_stored(self) -> dict[str, list[int]]:
        """The episodes of the last exports that were not stored: reason -> their OpenTelemetry
        trace ids (then forgotten). Called by the delivery layer right after an export returned
        ``SUCCESS``: those episodes are dropped under ``reason``, the batch's others delivered."""
        with self._not_stored_lock:
            out, self._not_stored = self._not_stored, {}
        return out

    def _log_tables(self, before: int | None = None) -> None:
        """Log the collected step tables (those of steps before ``before``; all when None): for
        each, its ``slowest`` table when an episode of it was timed, and the watched prompts'
        history tables due at those steps.

        A table is a view of traces already logged: failing to log one never fails an export
        (which would be retried); it is logged once and its rows are dropped.
        """
        for step, key in sorted(self._rows):
            if before is not None and step >= before:
                continue
            rows = sorted(self._rows.pop((step, key)).values(), key=worst_first)
            self._log_table(key, step, step_rows(rows))
            slowest = slowest_rows(rows)
            if slowest:
                self._log_table(f"{key[: -len(TABLE_SUFFIX)]}{SLOWEST_SUFFIX}", step, slowest)
            tokens = self._tokens.pop((step, key), None)
            if tokens:
                self._log_table(f"{key[: -len(TABLE_SUFFIX)]}{MISMATCH_SUFFIX}", step,
                                worst_tokens([token for rows_of in tokens.values() for token in rows_of]))
        for step, key in sorted(self._watch_due):
            if before is not None and step >= before:
                continue
            self._watch_due.discard((step, key))
            history = self._watch.get(key)
            watched = sorted((row for row in history or () if row["step"] <= step), key=lambda row: row["step"])
            if watched:
                self._log_table(key, step, watched)

    def _log_table(self, key: str, step: int, rows: Sequence[Mapping[str, object]]) -> bool:
        """Log one ``trackio.Table`` of ``rows`` (dicts, the first one's keys as the columns) at
        ``step``; a failure is counted (``table_failures``) and said once, never raised."""
        import trackio

        columns = list(rows[0])
        try:
            table = trackio.Table(columns=columns, data=[[row.get(col) for col in columns] for row in rows])
            self._trackio_run().log({key: table}, step=step)
        except Exception as exc:  # noqa: BLE001 - a view: never fail the export for it
            self.table_failures += 1
            if self.table_failures == 1:
                logger.warning("otel_rollouts: TrackioExporter could not log the step %d table %s: %r",
                               step, key, exc)
            return False
        self.tables_logged += 1
        return True

    def _watch_add(self, step: int, key: str, row: dict[str, object]) -> None:
        """Add a stored episode of a watched prompt to its history (``key``: its table's key), to
        be logged with its step's tables. Bounded: ``WATCH_MAX_ROWS`` rows per key (the oldest
        dropped first) and ``WATCH_MAX_KEYS`` keys (the one updated longest ago forgotten)."""
        history = self._watch.get(key)
        if history is None:
            history = self._watch[key] = deque(maxlen=WATCH_MAX_ROWS)
            while len(self._watch) > WATCH_MAX_KEYS:
                forgotten, _ = self._watch.popitem(last=False)
                self._watch_due = {due for due in self._watch_due if due[1] != forgotten}
        self._watch.move_to_end(key)
        if any(old["trace id"] == row["trace id"] for old in history):
            return  # the same episode exported again (a retried export)
        history.append(row)
        self._watch_due.add((step, key))

    def show_pending(self, snapshots: Sequence[ReadableSpan], ended: Sequence[int]) -> None:
        """Show which episodes are still running, and stop showing those that ended.

        ``snapshots``: the spans of snapshots of episodes still running (their roots carry
        ``rl.pending.snapshot``, the span they are stuck in and for how long; open spans end "now");
        ``ended``: OpenTelemetry trace ids of episodes shown running before that have ended
        (kept, dropped or given up). Called by the delivery thread, never the training thread.

        Each snapshot becomes a ``trackio.Trace`` under ``rollouts/running`` (``<split>/...``
        for other splits) at its step, its status ``running <span> <seconds>s``, its open spans
        ``running`` in the tree; a newer snapshot of the same episode replaces the older one.
        With Trackio's local storage an episode that ended (or whose finished episode was
        exported) has its snapshot's row deleted: only what runs reads as running. Then a
        ``rollouts/running/table`` is logged at the step: what runs now (episode, open for, stuck
        in, trace id), or one ``nothing running`` row. Best effort: a view, never counted as an
        episode delivered or lost; a failure is counted (``pending_failures``) and said once.
        """
        try:
            self._import_trackio()
            with self._lock:
                self._show_pending(snapshots, ended)
        except Exception as exc:  # noqa: BLE001 - a view of episodes still running: never raise
            self.pending_failures += 1
            if self.pending_failures == 1:
                logger.warning("otel_rollouts: TrackioExporter could not show the running episodes: %s: %s",
                               type(exc).__name__, exc)

    def _show_pending(self, snapshots: Sequence[ReadableSpan], ended: Sequence[int]) -> None:
        import trackio

        problem = self._cannot_write()
        if problem is not None:
            self.pending_failures += 1
            return
        shown: dict[int, tuple[int, str, Any, dict[str, object]]] = {}
        for trace_id, group in by_trace(snapshots).items():
            root = root_of(group)
            if root is None:
                continue
            attrs = root.attributes or {}
            step = attrs.get(c.RL_STEP)
            step = step if isinstance(step, int) and not isinstance(step, bool) and fits_int64(step) else 0
            split = str(attrs.get(c.RL_SPLIT) or "train")
            key = f"{self.trace_key if split == 'train' else f'{split}/{self.trace_key}'}/{RUNNING_SUFFIX}"
            metadata = episode_metadata(root, self.trace_url(trace_id), group)
            metadata[META_STATUS] = running_label(attrs)
            tree = episode_spans(group)
            running_spans(group, tree)
            messages = episode_messages(group)
            if why_unstorable(messages, metadata, tree) is not None:
                continue
            shown[trace_id] = (step, key, trackio.Trace(messages=messages, metadata=metadata, spans=tree),
                               running_row(attrs, trace_id))
        run = self._trackio_run()
        local = self.store.local(run)
        since = datetime.now(timezone.utc).isoformat()
        by_key: dict[tuple[int, str], list[object]] = defaultdict(list)
        for step, key, trace, _ in shown.values():
            by_key[(step, key)].append(trace)
        for (step, key), traces in sorted(by_key.items()):
            run.log({key: traces}, step=step)
        new_rows: dict[str, list[str]] = {}
        if local and shown:
            self._write_now(run)
            new_rows = self.store.snapshot_rows(run, since, {key for _, key, _, _ in shown.values()})
        stale: list[str] = []
        touched: dict[str, int] = {}
        for trace_id, (step, key, _, row) in shown.items():
            old = self._running.pop(trace_id, None)
            if old is not None:
                stale.extend(old.row_ids)
            self._running[trace_id] = _Running(step, key, row, tuple(new_rows.get(hex_id(trace_id, 32), ())))
            touched[key] = max(touched.get(key, step), step)
        while len(self._running) > RUNNING_MAX:
            self._running.popitem(last=False)
        stale.extend(self._end_running(ended, touched))
        if local and stale:
            self.store.delete_rows(run, stale)
        self._log_running_tables(touched)
        if local and touched:
            self._write_now(run)  # a view of now: on the dashboard at once, not at the next write

    def _end_running(self, trace_ids: Sequence[int], touched: dict[str, int]) -> list[str]:
        """Forget the episodes of ``trace_ids`` shown running; their snapshots' row ids (to
        delete). ``touched`` gains each running key whose table changed, at its latest step."""
        stale: list[str] = []
        for trace_id in trace_ids:
            old = self._running.pop(trace_id, None)
            if old is not None:
                stale.extend(old.row_ids)
                touched[old.key] = max(touched.get(old.key, old.step), old.step)
        return stale

    def _replace_running(self, run: Run, trace_ids: Sequence[int]) -> None:
        """Episodes just stored that were shown running: their finished episode replaces the
        snapshot (deleted; a fresh running table is logged). Never fails the export."""
        if not self._running or not any(t in self._running for t in trace_ids):
            return
        try:
            touched: dict[str, int] = {}
            stale = self._end_running(trace_ids, touched)
            if stale and self.store.local(run):
                self.store.delete_rows(run, stale)
            self._log_running_tables(touched)
            if self.store.local(run):
                self._write_now(run)
        except Exception as exc:  # noqa: BLE001 - a view: the export stored its episodes
            self.pending_failures += 1
            if self.pending_failures == 1:
                logger.warning("otel_rollouts: TrackioExporter could not replace a running episode: %s: %s",
                               type(exc).__name__, exc)

    def _log_running_tables(self, touched: Mapping[str, int]) -> None:
        """For each running key in ``touched`` (key -> step), what runs now: the scalar
        ``running_now`` (``<split>_running_now``: how many episodes are hung now, on the metrics page) and the table of them,
        which replaces the one logged before (local storage): a page shows one table of now, not
        one per refresh."""
        run = self._trackio_run()
        for key, step in sorted(touched.items()):
            running = [r for r in self._running.values() if r.key == key]
            rows = [r.row for r in sorted(running, key=lambda r: r.step)]
            if not rows:
                rows = [dict(zip(RUNNING_COLUMNS, (TABLE_ABSENT, TABLE_ABSENT, RUNNING_NONE, TABLE_ABSENT),
                                 strict=True))]
            else:
                step = max(r.step for r in running)
            run.log({self._running_now(key): len(running)}, step=step)
            if not self.table:
                continue
            table_key = f"{key}/{TABLE_SUFFIX}"
            before = self._running_tables.get(table_key)
            if before is not None and self.store.local(run):
                try:  # (written already: every running table is written at once, see _show_pending)
                    self.store.forget_logged(run, table_key, before)
                except Exception as exc:  # noqa: BLE001 - a view: an extra table is no loss
                    self.pending_failures += 1
                    if self.pending_failures == 1:
                        logger.warning("otel_rollouts: TrackioExporter could not replace the running table: %s: %s",
                                       type(exc).__name__, exc)
            if self._log_table(table_key, step, rows):
                self._running_tables[table_key] = step

    def _running_now(self, key: str) -> str:
        """The scalar of how many episodes of a running key hang now: ``running_now`` for train,
        ``<split>_running_now`` (no "/" in its name: the first section of the metrics page)."""
        return RUNNING_NOW if key.startswith(f"{self.trace_key}/") else f"{key.split('/', 1)[0]}_{RUNNING_NOW}"

    def log_metrics(self, step: int, values: dict[str, float]) -> None:
        """Log a training step's rollout numbers as Trackio scalars at ``step`` (the same step
        as its traces), and a closed step's summary as a table too (``<prefix>summary``: seen,
        kept, dropped, by status, why kept, its groups): a one-point series draws as an empty
        chart, and the counts of one step read best side by side. Handed down by the pipeline's
        metrics when the step closes."""
        self._import_trackio()
        # a value nobody recorded is no point on its plot, never a 0 (None, NaN: left out)
        values = {key: value for key, value in values.items()
                  if isinstance(value, (int, float)) and not isinstance(value, bool) and math.isfinite(value)}
        if not values or not fits_int64(int(step)):
            return  # a step Trackio's storage cannot hold would lose the whole batch of its write
        with self._lock:
            problem = self._cannot_write()
            if problem is not None:  # scalars are a view of the step: skipped, said once
                self.metrics_skipped += 1
                if self.metrics_skipped == 1:
                    logger.warning("otel_rollouts: TrackioExporter: step %d scalars not logged (%s)",
                                   step, problem.detail)
                return
            prefix = summary_prefix(values)
            scalars = dict(values)
            if prefix is not None and self.trace_key and prefix.endswith(f"{self.trace_key}/"):
                # what runs past the hang threshold, at every closed step too: a line, not one point
                key = f"{prefix}{RUNNING_SUFFIX}"
                scalars[self._running_now(key)] = sum(1 for r in self._running.values() if r.key == key)
            self._trackio_run().log(scalars, step=int(step))
            if prefix is not None and self.table:  # a closed step's summary: also as one table
                self._log_table(f"{prefix}{SUMMARY_SUFFIX}", int(step), summary_rows(values, prefix))

    def log_groups(self, step: int, split: str, rows: Sequence[GroupRow]) -> None:
        """Log a closed step's groups, every one it saw (kept or not), as the table
        ``rollouts/groups`` (``<split>/rollouts/groups``) at ``step``: members, reward spread,
        all-equal, lost and truncated apart, kept, degenerate first. A view: a failure is counted
        (``table_failures``), never raised."""
        if not self.table or not rows or not fits_int64(int(step)):
            return
        self._import_trackio()
        key = self.trace_key if split == "train" else f"{split}/{self.trace_key}"
        with self._lock:
            if self._cannot_write() is not None:  # a view of the step: skipped like its scalars
                self.metrics_skipped += 1
                return
            self._log_table(f"{key}/{GROUPS_SUFFIX}", int(step), groups_rows(rows))

    def force_flush(self, timeout_millis: int = 30000) -> bool:
        """Make everything logged so far durable (Trackio writes on ``finish``), step tables
        still collecting included.

        The run is finished and transparently resumed by name on the next export.
        """
        self._finish()
        return True

    def shutdown(self) -> None:
        self._finish()

    def _finish(self) -> None:
        with self._lock:
            if self._rows or self._watch_due:
                self._log_tables()
            if self._run is not None:
                run, self._run = self._run, None
                self.run_name = run.name
                confirmed = self.store.local(run)
                run.finish()
                # Trackio writes on its own thread and only *warns* when a write fails (read-only
                # or full directory, locked database). Episodes written to local storage were
                # confirmed by their export (what is left here are step tables and scalars, views
                # of them); elsewhere (a Space) turn the warning into an error the delivery layer
                # counts and logs once, instead of a silent loss
                failed = self.store.persist_failures(run)
                if failed and not confirmed:
                    raise OSError(f"trackio could not persist run {run.name!r} ({', '.join(failed)})")
                if failed and "finish" not in self._warned_problems:
                    self._warned_problems.add("finish")
                    logger.warning("otel_rollouts: TrackioExporter: Trackio could not write everything of run "
                                   "%r (%s); stored episodes are not affected", run.name, ", ".join(failed))
