"""Hung episodes, visible while they hang: pending snapshots of episodes open past a threshold.

An RL step waits for its slowest rollout. When one hangs (a tool that never returns, an
inference request stuck in a queue) nothing of it reaches any viewer until it ends, which may be
never. ``HungWatcher`` runs on the configuration's ticker thread (``Pipeline.tick``, once a
second): it looks at the episodes still open, and one open longer than the hang threshold is
sent to the exporters as a *pending snapshot*: its tree so far (ended spans as they are, open
spans ended at "now" and marked ``rl.pending.snapshot``), its root saying which span it is stuck in and
for how long. When the episode ends (kept or dropped) the next notice names its trace id in
``ended``, so an exporter replaces or removes the snapshot; one that never ends (still open at
shutdown, ended by ``episode_timeout_s``, or open after its step closed) is counted ``hung``.

What it costs and what it never does:

* nothing on the training thread: the scan, the copies and the queueing happen on the ticker
  thread, reading the live records without the pipeline's lock (a span's attributes may change
  while they are copied: copies are retried, and a failed one is counted, never raised);
* the tail sampler never hears of it: a snapshot is a separate copy, not a kept episode, it
  never enters the delivery ledger, and no record's state changes;
* bounded: at most ``max_per_step`` episodes of one (step, split) are ever shown, each re-sent
  at most every ``refresh_s`` while it hangs; the state kept here is bounded by those numbers.

The threshold (``HangOptions``): a fixed ``after_s``, or automatic: ``factor`` times the median
duration of the step's finished episodes, never below ``floor_s``; until ``min_finished``
episodes of the step finished, the median of the latest earlier step of the same split (steps
of one run are alike), and before any, ``initial_s``. Why relative: a 40 s rollout is normal in
a tool-using agent run and a hang in a single-turn math run; three times the median is past
every normal straggler of a step whose durations are not wildly spread, and the floor keeps
sub-second episodes from making every scheduling hiccup a "hang".

Durations come from the pipeline: as it offers a finished episode it appends (step, seconds)
to a bounded deque (an atomic append: no lock, one subtraction on the training thread), drained
here at each tick.
"""

from __future__ import annotations

import threading
import time
from array import array
from collections import OrderedDict, deque
from collections.abc import Callable, Iterable
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any, cast

from otel_rollouts import conventions as c
from otel_rollouts._core.spans import OPEN, EpisodeRecord, SpanRecord

if TYPE_CHECKING:
    from otel_rollouts._core.stats import Stats
    from otel_rollouts.delivery.dispatch import Delivery

__all__ = ["HangOptions", "HungWatcher"]

_MAX_SAMPLE = 255  # finished durations remembered per (step, split) for its median (a ring)
_MAX_STEPS = 8  # (step, split) keys whose durations are remembered (the open steps, in practice)
_MAX_SPLITS = 64  # splits whose latest median is remembered
_MAX_SHOWN = 1024  # episodes with a snapshot out, all steps together
_MAX_SHOWN_STEPS = 4096  # (step, split) keys whose number of shown episodes is remembered
_MAX_ENDED = 4096  # ended notices waiting for room in the export queue
_COPY_TRIES = 3  # a container that changed size while copied is copied again, this many times
_MAX_COPY_NODES = 100_000  # nodes of one span's attribute values copied for a snapshot


@dataclass(frozen=True)
class HangOptions:
    """When an open episode counts as hanging, and how much is sent about it.

    ``after_s``: a fixed threshold in seconds; None (the default) is automatic: ``factor`` ×
    the median duration of the step's finished episodes, at least ``floor_s``; before
    ``min_finished`` episodes of the step finished, the latest earlier step's median of the same
    split; before any, ``initial_s``. ``max_per_step``: episodes of one (step, split) shown at
    most; ``refresh_s``: a shown episode's snapshot is re-sent at most this often while it hangs.
    """

    after_s: float | None = None
    factor: float = 3.0
    floor_s: float = 30.0
    initial_s: float = 120.0
    min_finished: int = 3
    max_per_step: int = 4
    refresh_s: float = 15.0

    def __post_init__(self) -> None:
        for name in ("factor", "floor_s", "initial_s", "refresh_s"):
            value = getattr(self, name)
            if isinstance(value, bool) or not isinstance(value, (int, float)) or not value >= 0:
                raise ValueError(f"HangOptions.{name} must be a number >= 0, got {value!r}")
        after = self.after_s
        if after is not None and (isinstance(after, bool) or not isinstance(after, (int, float))
                                  or not after > 0):
            raise ValueError(f"HangOptions.after_s must be > 0 or None, got {after!r}")
        for name in ("min_finished", "max_per_step"):
            value = getattr(self, name)
            if isinstance(value, bool) or not isinstance(value, int) or value < 1:
                raise ValueError(f"HangOptions.{name} must be an int >= 1, got {value!r}")

    @classmethod
    def of(cls, value: object) -> HangOptions | None:
        """The options ``configure(hang=...)`` means: None or True, the defaults (automatic
        threshold); False, off (None returned); a number, a fixed threshold in seconds."""
        if value is None or value is True:
            return cls()
        if value is False:
            return None
        if isinstance(value, HangOptions):
            return value
        if isinstance(value, (int, float)):
            return cls(after_s=float(value))
        raise ValueError(f"hang must be a HangOptions, a number of seconds, True or False, got {value!r}")


class _Shown:
    """An episode with a snapshot out: what is needed to tell when it ends."""

    __slots__ = ("record", "root", "key", "sent_ns", "hung")

    def __init__(self, record: EpisodeRecord, root: SpanRecord, key: tuple[int, str]) -> None:
        self.record = record
        self.root = root
        self.key = key
        self.sent_ns = 0
        self.hung = False  # counted hung already


class _Durations:
    """A ring of the latest finished durations of one (step, split)."""

    __slots__ = ("values", "next")

    def __init__(self) -> None:
        self.values = array("d")  # one block, not a float object per value
        self.next = 0

    def add(self, seconds: float) -> None:
        if len(self.values) < _MAX_SAMPLE:
            self.values.append(seconds)
        else:
            self.values[self.next] = seconds
            self.next = (self.next + 1) % _MAX_SAMPLE

    def median(self) -> float:
        ordered = sorted(self.values)
        n = len(ordered)
        mid = n // 2
        return ordered[mid] if n % 2 else (ordered[mid - 1] + ordered[mid]) / 2


class _Sink:
    """A snapshot's sink: its copied spans never end, and if one did, nothing would happen."""

    stats = None

    def part_ended(self, record: EpisodeRecord) -> None:
        return None

    def late_span(self, record: EpisodeRecord, span: SpanRecord) -> None:
        return None


class HungWatcher:
    """Finds episodes open past the hang threshold and sends pending snapshots of them.

    Call ``tick(records)`` from the ticker thread with the pipeline's live records (a list made
    without its lock), and ``stop()`` once at shutdown, *before* open episodes are ended:
    those still open then are counted hung. ``is_closed(key)`` (optional) says whether a
    (step, split) was closed: a shown episode still open after its step closed is counted hung.
    ``on_hung(key, n)`` (optional) is told of every hung count (the OTel counter).
    """

    def __init__(
        self,
        options: HangOptions,
        delivery: Delivery,
        stats: Stats,
        *,
        is_closed: Callable[[tuple[int, str]], bool] | None = None,
        on_hung: Callable[[tuple[int, str], int], None] | None = None,
    ) -> None:
        self.options = options
        self.delivery = delivery
        self.stats = stats
        self.is_closed = is_closed
        self.on_hung = on_hung
        self._lock = threading.Lock()  # tick and stop, one at a time (never the pipeline's lock)
        self._sink = _Sink()
        self._stopped = False
        self._durations: OrderedDict[tuple[int, str], _Durations] = OrderedDict()
        self._medians: OrderedDict[str, tuple[int, float]] = OrderedDict()  # split -> (step, median)
        self._shown: dict[int, _Shown] = {}
        self._per_step: OrderedDict[tuple[int, str], int] = OrderedDict()
        self._ended: list[int] = []  # ended notices not yet queued
        # durations of finished episodes, appended by the pipeline as it offers them (a deque's
        # append is atomic: no lock on the training thread), drained at each tick
        self.finished: deque[tuple[tuple[int, str], float]] = deque(maxlen=_MAX_SAMPLE * 4)

    # --- the threshold -------------------------------------------------------------------------
    def threshold_s(self, key: tuple[int, str]) -> float:
        """Seconds after which an open episode of ``key`` counts as hanging."""
        options = self.options
        if options.after_s is not None:
            return float(options.after_s)
        median = None
        sample = self._durations.get(key)
        if sample is not None and len(sample.values) >= options.min_finished:
            median = sample.median()
            self._medians[key[1]] = (key[0], median)
            self._medians.move_to_end(key[1])
            if len(self._medians) > _MAX_SPLITS:
                self._medians.popitem(last=False)
        else:
            earlier = self._medians.get(key[1])
            if earlier is not None and earlier[0] < key[0]:
                median = earlier[1]
        if median is None:
            return float(options.initial_s)
        return max(options.factor * median, options.floor_s)

    def _drain(self) -> None:
        """The durations the pipeline noted since the last tick join their steps' samples."""
        finished = self.finished
        while finished:
            key, seconds = finished.popleft()
            self._finished(key, seconds)

    def _finished(self, key: tuple[int, str], seconds: float) -> None:
        sample = self._durations.get(key)
        if sample is None:
            sample = self._durations[key] = _Durations()
            if len(self._durations) > _MAX_STEPS:
                self._durations.popitem(last=False)
        sample.add(seconds)

    # --- the tick ------------------------------------------------------------------------------
    def tick(self, records: Iterable[EpisodeRecord], now_ns: int | None = None) -> None:
        """One look at the live ``records``: durations measured, ended snapshots noticed, hung
        ones counted, and snapshots of episodes past the threshold sent (bounded). Never
        raises: a failure is counted (``errors.hung_watcher``)."""
        try:
            with self._lock:
                if not self._stopped:
                    self._tick(records, time.time_ns() if now_ns is None else now_ns)
        except Exception:  # noqa: BLE001 - the watcher never breaks the ticker
            self.stats.add("errors.hung_watcher")

    def _tick(self, records: Iterable[EpisodeRecord], now: int) -> None:
        # the one pass over every live record: kept lean (it runs each second, under the GIL the
        # training thread wants): no allocation for an episode that is not overdue but its entry
        # in ``opened``, the threshold looked up again only when the (step, split) changes
        self._drain()
        overdue: list[tuple[int, EpisodeRecord, SpanRecord]] = []
        last_step: int | None = None
        last_split: str | None = None
        limit = 0
        for record in records:
            root = record.root
            # an episode recorded after the fact (adapters, batches) has no running time
            if root is None or root.end_ns is not None or record.state != OPEN or not record.timed:
                continue
            step, split = record.step, record.split
            if step != last_step or split != last_split:
                last_step, last_split = step, split
                limit = int(self.threshold_s((step, split)) * 1e9)
            age = now - root.start_ns
            if age >= limit:
                overdue.append((age, record, root))
        ended = self._ended_since(now)
        self._send(self._snapshots(overdue, now), ended)

    def _ended_since(self, now: int) -> list[int]:
        """Trace ids of shown episodes that ended since the last tick; hung ones counted."""
        ended: list[int] = []
        hung: dict[tuple[int, str], int] = {}
        for trace_id, shown in list(self._shown.items()):
            root = shown.root
            if shown.record.state == OPEN and root.end_ns is None:
                if not shown.hung and self.is_closed is not None and self.is_closed(shown.key):
                    shown.hung = True  # its step closed without it
                    hung[shown.key] = hung.get(shown.key, 0) + 1
                continue
            if not shown.hung and root.attributes.get(c.RL_TIMED_OUT) is True:
                shown.hung = True  # ended by configure(episode_timeout_s=...), not by itself
                hung[shown.key] = hung.get(shown.key, 0) + 1
            ended.append(trace_id)
            del self._shown[trace_id]
        self._count_hung(hung)
        return ended

    def _count_hung(self, hung: dict[tuple[int, str], int]) -> None:
        for key, n in hung.items():
            self.stats.add("episodes.hung", n)
            self.stats.step(key, "hung", n)
            if self.on_hung is not None:
                try:
                    self.on_hung(key, n)
                except Exception:  # noqa: BLE001 - metrics never break the watcher
                    self.stats.add("errors.metrics")

    def _snapshots(self, overdue: list[tuple[int, EpisodeRecord, SpanRecord]],
                   now: int) -> list[EpisodeRecord]:
        """Snapshots of the overdue episodes (longest open first) that may be shown now. With
        no exporter that shows them, none is copied, but the overdue ones are still followed
        (within the same bounds) so that the ones that never end are counted hung."""
        out: list[EpisodeRecord] = []
        refresh = int(self.options.refresh_s * 1e9)
        copy = self.delivery.shows_pending
        overdue.sort(key=lambda item: -item[0])
        for _, record, root in overdue:
            trace_id = record.trace_id
            shown = self._shown.get(trace_id)
            if shown is None:
                key = (record.step, record.split)
                count = self._per_step.get(key, 0)
                if count >= self.options.max_per_step or len(self._shown) >= _MAX_SHOWN:
                    continue
                shown = _Shown(record, root, key)
            elif now - shown.sent_ns < refresh:
                continue
            if copy:
                snapshot = self._copy(record, root, now)
                if snapshot is None:
                    continue
                out.append(snapshot)
            elif root.end_ns is not None:
                continue
            if trace_id not in self._shown:
                self._shown[trace_id] = shown
                self._per_step[shown.key] = self._per_step.get(shown.key, 0) + 1
                self._per_step.move_to_end(shown.key)
                if len(self._per_step) > _MAX_SHOWN_STEPS:
                    self._per_step.popitem(last=False)
            shown.sent_ns = now
        return out

    def _send(self, snapshots: list[EpisodeRecord], ended: list[int]) -> None:
        """Queue the snapshots and the ended notices; notices that find no room wait for the
        next tick (an exporter that never hears of the end would show it running forever)."""
        notices = self._ended + ended
        if not snapshots and not notices:
            return
        if not self.delivery.shows_pending:
            self._ended = []
            return
        if self.delivery.pending(snapshots, notices):
            self._ended = []
            self.stats.add("pending.snapshots", len(snapshots))
        else:
            self._ended = notices[-_MAX_ENDED:]

    # --- the copy ------------------------------------------------------------------------------
    def _copy(self, record: EpisodeRecord, root: SpanRecord, now: int) -> EpisodeRecord | None:
        """A snapshot of ``record`` at ``now``: a new record of copied spans (open ones ended at
        ``now`` and marked), or None when the episode ended meanwhile or a copy failed (counted
        ``errors.pending_copy``). Runs while the training thread goes on recording."""
        snapshot = EpisodeRecord(record.trace_id, record.step, record.split, self._sink,
                                 record.max_spans)
        snapshot.capture_content = record.capture_content
        snapshot.max_attributes = record.max_attributes
        snapshot.dropped_spans = record.dropped_spans
        snapshot.timed = False  # its root's end is "now", not the episode's: no duration
        try:
            spans = list(record.spans)  # appended to by the training thread: one C-level copy
            foreign = list(record.foreign)
            copies = [self._span_copy(snapshot, s) for s in spans]
        except _CopyFailed:
            self.stats.add("errors.pending_copy")
            return None
        by_id = {s.span_id: s for s in copies}
        root_copy = by_id.get(root.span_id)
        if root_copy is None or root_copy.end_ns is not None:
            return None  # ended while copied: the finished episode follows, not a snapshot
        open_spans = [s for s in copies if s.end_ns is None]
        parents = {s.parent_id for s in open_spans}
        # the span it is stuck in: an open span without an open child; of several (parallel
        # calls), the one open longest
        leaves = [s for s in open_spans if s.span_id not in parents] or [root_copy]
        stuck = min(leaves, key=lambda s: s.start_ns)
        for s in open_spans:
            s.end_ns = max(now, s.start_ns)
            s.attributes[c.RL_PENDING_SNAPSHOT] = True
            s.attributes[c.RL_PENDING_SPAN_SECONDS] = max(now - s.start_ns, 0) / 1e9
        attributes = root_copy.attributes
        attributes[c.RL_PENDING_SPAN_NAME] = stuck.name
        attributes[c.RL_PENDING_SPAN_SECONDS] = max(now - stuck.start_ns, 0) / 1e9
        attributes[c.RL_PENDING_SECONDS] = max(now - root_copy.start_ns, 0) / 1e9
        snapshot.spans = copies
        snapshot.foreign = foreign
        snapshot.root = root_copy
        reward = record.reward_span
        snapshot.reward_span = by_id.get(reward.span_id) if reward is not None else None
        return snapshot

    def _span_copy(self, snapshot: EpisodeRecord, span: SpanRecord) -> SpanRecord:
        copy = SpanRecord(snapshot, span.name, span.span_id, span.parent_id, span.kind,
                          attributes=_copied(span.attributes), start_ns=span.start_ns)
        copy.end_ns = span.end_ns
        copy.status_code = span.status_code
        copy.status_message = span.status_message
        events = span.events
        if events:
            copy.events = [(name, _copied(attrs), ts) for name, attrs, ts in list(events)]
        links = span.links
        if links:
            copy.links = list(links)
        copy.held = True
        return copy

    # --- shutdown ------------------------------------------------------------------------------
    def stop(self, timeout: float | None = None) -> None:
        """At shutdown, before open episodes are ended: every shown episode still open is
        counted hung, and every shown one is named ended (its exporter stops showing it
        running). Later ticks do nothing. Never raises; waits at most ``timeout`` for a tick
        under way (thousands of open episodes make a long one): past that the watcher is only
        marked stopped, counted ``errors.hung_watcher_busy``."""
        try:
            if not self._lock.acquire(timeout=-1 if timeout is None else max(timeout, 0.0)):
                self._stopped = True  # the tick under way is the last one
                self.stats.add("errors.hung_watcher_busy")
                return
            try:
                if self._stopped:
                    return
                self._stopped = True
                hung: dict[tuple[int, str], int] = {}
                for shown in self._shown.values():
                    if not shown.hung and shown.record.state == OPEN and shown.root.end_ns is None:
                        hung[shown.key] = hung.get(shown.key, 0) + 1
                self._count_hung(hung)
                notices = self._ended + list(self._shown)
                if notices and self.delivery.shows_pending:
                    self.delivery.pending([], notices)
                self._shown.clear()
                self._ended = []
            finally:
                self._lock.release()
        except Exception:  # noqa: BLE001 - shutdown goes on
            self.stats.add("errors.hung_watcher")


class _CopyFailed(Exception):
    """A container kept changing while it was copied."""


def _copied(value: object) -> Any:
    """A copy of an attribute dict (or event attributes) whose plain containers (dict, list,
    tuple) are copied too, so the render thread never iterates one the training thread is
    changing. Other objects are kept as they are (never called: a hostile ``__repr__`` is the
    renderer's to contain). A container that changes size while copied is copied again, up to
    ``_COPY_TRIES`` times; then ``_CopyFailed``."""
    for _ in range(_COPY_TRIES):
        try:
            return _Copy().walk(value, 0)
        except RuntimeError:  # "dictionary changed size during iteration"
            continue
    raise _CopyFailed


class _Copy:
    __slots__ = ("nodes",)

    def __init__(self) -> None:
        self.nodes = 0

    def walk(self, value: object, depth: int) -> object:
        kind = type(value)
        if kind is not dict and kind is not list and kind is not tuple:
            return value
        self.nodes += 1
        if depth > 64 or self.nodes > _MAX_COPY_NODES:
            return value  # past the budget: shared, as recorded (rendered later, guarded)
        if kind is dict:
            return {k: self.walk(v, depth + 1) for k, v in list(cast("dict[object, object]", value).items())}
        items = [self.walk(v, depth + 1) for v in list(cast("list[object] | tuple[object, ...]", value))]
        return items if kind is list else tuple(items)
