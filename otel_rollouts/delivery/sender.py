"""The sender layer: a thread per exporter, memory bounded in bytes, backoff, disk retry."""

from __future__ import annotations

import sys
import threading
import time
from collections import deque
from collections.abc import Sequence
from pathlib import Path
from typing import Any

from opentelemetry.sdk.trace import ReadableSpan
from opentelemetry.sdk.trace.export import SpanExporter, SpanExportResult

from otel_rollouts._core.codec import count_episodes, encode
from otel_rollouts._core.content import exception_text, type_name
from otel_rollouts._core.stats import Stats
from otel_rollouts.delivery.layers import DeliveryCounts, PartialExporter, exporter_name
from otel_rollouts.delivery.spool import Spool, SpoolClosed

__all__ = ["SpoolingSender", "approx_bytes"]

_BACKOFF_MIN_S = 0.25
_BACKOFF_MAX_S = 15.0
_POISON_AFTER = 3  # consecutive failures of one batch before checking whether only it fails
_HURRY_MAX_S = 1.0  # backoff cap while shutdown waits (tries, not a busy loop: ~1 a second)
_PROBE_LATER = 4  # later spooled batches tried to tell a refused head from a dead exporter
_DRAIN_BATCHES = 64  # batches sent together: spooled ones once the exporter is back, or waiting in memory
_DRAIN_BYTES = 2 * 1024 * 1024


def approx_bytes(spans: Sequence[ReadableSpan]) -> int:
    """About how much memory a batch holds, in bytes: texts at their real size (``sys.getsizeof``:
    a text holding one character beyond Latin-1 takes 2 or 4 bytes a character, which counting
    characters missed), plus a fixed cost per span, value and event (the bound on memory waiting
    for an exporter is kept in these units)."""
    total = 0
    size = sys.getsizeof
    for span in spans:
        total += 400 + size(span.name)
        for key, value in (span.attributes or {}).items():
            total += size(key) + 16
            if isinstance(value, str):
                total += size(value)
            elif isinstance(value, (tuple, list)):
                total += 56 + sum(size(v) if isinstance(v, str) else 24 for v in value)
            else:
                total += 24
        for event in span.events or ():
            total += 200 + size(event.name)
            for key, value in (event.attributes or {}).items():
                total += size(key) + 16 + (size(value) if isinstance(value, str) else 24)
        status = span.status
        if status is not None and status.description:
            total += size(status.description)
    return total


class SpoolingSender(SpanExporter):
    """The top layer: ``export`` hands a batch over and returns at once; a thread of its own
    sends it through the layers below. Memory is bounded in batches and bytes (the oldest go to
    disk); a batch the layers below fail waits in a bounded on-disk ``Spool`` and is retried
    with exponential backoff (during an outage new batches go straight behind it, so order is
    kept); a spooled batch that keeps failing while later ones go through is dropped as
    refused, counted. ``force_flush`` waits for delivery; ``shutdown`` keeps what is left on
    disk."""

    def __init__(
        self,
        exporter: SpanExporter,
        counts: DeliveryCounts | None = None,
        *,
        max_pending: int = 1024,
        spool_dir: str | Path | None = None,
        spool_max_bytes: int = 256 * 1024 * 1024,
        max_pending_bytes: int = 64 * 1024 * 1024,
    ) -> None:
        """``exporter``: the layers below, or any exporter. ``counts``: where counts go (default:
        counters of its own, ``counts.stats``). ``spool_dir``: where failed batches wait (None:
        they are dropped, counted). ``max_pending`` / ``max_pending_bytes``: the memory bound."""
        self.exporter = exporter  # the layers below (the user's exporter at the bottom)
        self.user_exporter: SpanExporter = exporter  # whose force_flush/shutdown the library calls
        if counts is None:  # the layer below's counts, if it keeps some (one set per exporter)
            below = getattr(exporter, "counts", None)
            counts = below if isinstance(below, DeliveryCounts) else DeliveryCounts(
                Stats(), exporter_name(exporter))
        spool_dir = Path(spool_dir) if spool_dir is not None else None
        self.counts = counts
        self.name = counts.name
        self.max_pending_bytes = max_pending_bytes
        self._pending_bytes = 0
        self._sizes: dict[int, int] = {}  # id(batch in _pending) -> its approximate bytes
        self.max_pending = max_pending
        self._spool_dir = spool_dir
        self._spool_max_bytes = spool_max_bytes
        self._spool: Spool | None = None
        self._pending: deque[list[ReadableSpan]] = deque()
        self._cond = threading.Condition()
        self._busy = False
        self._stopping = threading.Event()
        # the longest wait of an idle sender thread (every change notifies it; the bound is a
        # safety net), longer in the renderer process, which ignores SIGINT
        self.idle_wait_s = 0.5
        self._wake = threading.Event()  # cut a backoff short (flush, stop)
        self._attempts = 0  # export attempts finished
        self._inflight = 0  # episodes in the export call under way
        # the batch of that call when it came from memory (None: from the spool): stop() keeps it
        # on disk while the call hangs, and then the sender leaves its failure to stop()
        self._sending: list[ReadableSpan] | None = None
        self._spilling = 0  # episodes taken from memory and being written to the spool
        self._last_ok = True
        self._hurry = False  # shutdown: backoff capped at _HURRY_MAX_S (a few tries before the deadline)
        self._adopted: set[Path] = set()  # spool files of a previous run, entered in the ledger
        self._head_strikes: dict[Any, int] = {}  # spool head -> times a later batch went through instead
        if spool_dir is not None and spool_dir.is_dir() and any(spool_dir.glob("*.otlp")):
            self._open_spool()  # batches a previous process left behind go first
        self._thread = threading.Thread(target=self._run, name=f"otel-rollouts-send-{self.name}", daemon=True)
        self._thread.start()

    # --- render side ---------------------------------------------------------------------
    def offer(self, batch: list[ReadableSpan]) -> None:
        if self._stopping.is_set():
            return  # after stop(): still pending in the ledger, which decides it at exit
        spans: list[ReadableSpan] | None = batch
        size = approx_bytes(batch)
        spill: list[list[ReadableSpan]] = []
        with self._cond:
            outage = self._spool is not None and len(self._spool) > 0
            # during an outage batches go to disk, behind those already there; while the memory
            # buffer is being spilled (it is not empty), they queue behind it, so order is kept
            if not outage or self._pending:
                # the memory buffer is bounded in batches and in bytes: the oldest make room (to
                # the spool, which the sender drains first, so the order is kept)
                while self._pending and (
                    len(self._pending) >= self.max_pending or self._pending_bytes + size > self.max_pending_bytes
                ):
                    spill.append(self._take_for_spool())
                if size <= self.max_pending_bytes:
                    self._pending.append(batch)
                    self._sizes[id(batch)] = size
                    self._pending_bytes += size
                    spans = None
                self._cond.notify()
        for oldest in spill:
            self._spill(oldest)
        if spans is not None:
            # an outage is going on, or the batch alone is over the memory bound: keep it on disk
            self._to_spool(spans)
        with self._cond:
            self._cond.notify()

    def _take_head(self) -> list[ReadableSpan]:
        """Pop the oldest pending batch (caller holds ``_cond``)."""
        batch = self._pending.popleft()
        self._pending_bytes -= self._sizes.pop(id(batch), 0)
        return batch

    def _take_request(self) -> list[list[ReadableSpan]]:
        """The batches waiting in memory, oldest first, that go out in one request (caller
        holds ``_cond``): at least one, at most ``_DRAIN_BATCHES`` of about ``_DRAIN_BYTES``. A
        receiver that takes its time per request (Phoenix, a loaded collector) then costs one
        round trip for everything that waited, not one per kept episode: at an exit, with
        seconds left, 48 episodes sent one by one to a receiver answering in 0.2 s did not
        all arrive. The layer below still splits a request over the receiver's size limit; a
        request that fails whole is spooled batch by batch (one refused batch is then found
        and dropped alone, never its request's companions)."""
        size = self._sizes.get(id(self._pending[0]), 0)
        batches = [self._take_head()]
        while self._pending and len(batches) < _DRAIN_BATCHES:
            following = self._sizes.get(id(self._pending[0]), 0)
            if size + following > _DRAIN_BYTES:
                break
            batches.append(self._take_head())
            size += following
        return batches

    @property
    def pending_bytes(self) -> int:
        """Approximate bytes of the batches waiting in memory."""
        return self._pending_bytes

    def _open_spool(self) -> Spool | None:
        if self._spool is None and self._spool_dir is not None and self._spool_max_bytes > 0:
            try:
                self._spool = Spool(self._spool_dir, self._spool_max_bytes, self._quarantined)
            except OSError as exc:
                self._log_once("spool", f"cannot create spool at {self._spool_dir}: {exc}")
                self._spool_max_bytes = 0
                return None
            if self._spool.shared:
                self._log_once(
                    "spool.shared",
                    f"spool directory {self._spool_dir} is in use by another process; this process "
                    f"spools to {self._spool.directory} (adopted by the next process once this one ends)",
                )
            if self._spool.dropped_at_open:
                self.counts.dropped_traces("spool_full", (), unknown=self._spool.dropped_at_open)
        return self._spool

    def _quarantined(self, name: str, episodes: int, reason: str, traces: tuple[int, ...] | None) -> None:
        """A spool file that is not a batch was moved aside: count what it held (by trace id when
        this process wrote it, else what its name claims)."""
        self.counts.quarantined()
        self._log_once("spool.quarantine", f"spool file {name} moved to quarantine/: {reason}")
        self._dropped_batches("spool_damaged", [(episodes, traces)])

    def _dropped_batches(self, reason: str, batches: list[tuple[int, tuple[int, ...] | None]]) -> None:
        for episodes, traces in batches:
            if traces is None:
                self.counts.dropped_traces(reason, (), unknown=episodes)
            else:
                self.counts.dropped_traces(reason, traces)

    def _to_spool(self, spans: list[ReadableSpan]) -> None:
        episodes = count_episodes(spans)
        spool = self._open_spool()
        if spool is None:
            self.counts.dropped("spool_unavailable", spans)
            return
        traces = tuple({s.context.trace_id: None for s in spans if s.context is not None})
        try:
            dropped = spool.push(encode(spans), episodes, traces)
        except SpoolClosed:
            return  # after the exit's accounts were closed: those episodes are decided there
        except BaseException as exc:  # noqa: BLE001 - a full disk must not stop delivery
            self.counts.error("spool")
            self._log_once("spool.write", f"spool write failed: {exception_text(exc)}")
            self.counts.dropped("spool_error", spans)
            return
        self.counts.spooled(episodes)
        if dropped:
            self._dropped_batches("spool_full", dropped)

    # --- status ----------------------------------------------------------------------------
    def pending_episodes(self) -> int:
        with self._cond:
            in_memory = sum(count_episodes(b) for b in self._pending) + self._inflight + self._spilling
        return in_memory + (self._spool.episodes if self._spool is not None else 0)

    def idle(self) -> bool:
        with self._cond:
            return self._idle_locked()

    def _idle_locked(self) -> bool:
        return (not self._pending and not self._busy and not self._spilling
                and (self._spool is None or len(self._spool) == 0))

    def wait_idle(self, deadline: float, *, through_outage: bool = False) -> bool:
        """Wait until all is delivered. Unless ``through_outage``, stop waiting (returning
        False) as soon as one attempt made after this call has failed: what failed is safe in
        the spool and is retried in the background, and an outage may last longer than anyone
        calling flush() wants to wait."""
        with self._cond:
            start = self._attempts
            self._wake.set()  # a sender in a backoff wait tries again now
            self._cond.notify_all()
            while not self._idle_locked():
                if not through_outage and self._attempts > start and not self._last_ok:
                    return False
                remaining = deadline - time.monotonic()
                if remaining <= 0:
                    return False
                if through_outage:
                    self._hurry = True  # at shutdown, retry sooner, but still backing off
                self._cond.wait(min(remaining, 0.05))
            return True

    # --- sender thread ---------------------------------------------------------------------
    def _run(self) -> None:
        backoff = 0.0
        failures = 0
        while not self._stopping.is_set():
            if backoff:
                self._wake.wait(backoff)
                if self._stopping.is_set():
                    return
            self._wake.clear()
            with self._cond:
                while not self._pending and (self._spool is None or len(self._spool) == 0):
                    if self._stopping.is_set():
                        return
                    self._cond.wait(self.idle_wait_s)
                self._busy = True
            ok = False
            batch = None  # taken from memory, and neither delivered nor spooled yet
            try:
                spool = self._spool
                if spool is not None and len(spool) > 0:
                    ok = self._send_spooled(spool, failures)
                else:
                    with self._cond:
                        batches = self._take_request() if self._pending else []
                        batch = batches[0] if len(batches) == 1 else [s for b in batches for s in b]
                        self._inflight = count_episodes(batch) if batches else 0
                        self._sending = batch if batches else None
                    ok = True
                    if batches:
                        failed = self._send(batch)
                        with self._cond:
                            taken = self._sending is not batch  # stop() took it meanwhile
                            self._sending = None
                        ok = not failed
                        if failed and not taken:
                            # keep it, and everything behind it, on disk until the exporter is back
                            whole = len(failed) == 1 and len(failed[0]) == len(batch)
                            for part in (batches if whole else failed):
                                self._to_spool(part)
                            self._spill_pending()
                        batch = None
            except BaseException as exc:  # noqa: BLE001 - the sender thread never dies
                ok = False
                self.counts.error("sender")
                if batch is not None:
                    self.counts.dropped("sender_error", batch)
                self._log_once(f"sender.{type_name(exc)}", f"delivery error: {exception_text(exc)}")
            finally:
                # what was sent is let go before the sender says it is idle: a flush() that
                # returns leaves no delivered span held here until the next batch
                batch, batches = None, []
                with self._cond:
                    self._busy = False
                    self._inflight = 0
                    self._sending = None
                    self._attempts += 1
                    self._last_ok = ok
                    self._cond.notify_all()
            if ok:
                backoff, failures = 0.0, 0
            else:
                failures += 1
                backoff = min(_HURRY_MAX_S if self._hurry else _BACKOFF_MAX_S,
                              _BACKOFF_MIN_S * (2 ** min(failures - 1, 10)))

    def _spill_pending(self) -> None:
        """Move the memory buffer to disk, oldest first."""
        while True:
            with self._cond:
                if not self._pending:
                    return
                item = self._take_for_spool()
            self._spill(item)

    def _take_for_spool(self) -> list[ReadableSpan]:
        """Take the oldest batch out of memory for the spool (caller holds ``_cond``): taken, so
        that no other thread spools it too (the render thread making room, the sender spilling
        after a failure: both once wrote the same batch, which was then delivered twice), and
        counted in ``_spilling`` until it is on disk, so ``pending_episodes`` never undercounts."""
        batch = self._take_head()
        self._spilling += count_episodes(batch)
        return batch

    def _spill(self, batch: list[ReadableSpan]) -> None:
        try:
            self._to_spool(batch)
        finally:
            with self._cond:
                self._spilling -= count_episodes(batch)
                self._cond.notify_all()

    def _send_spooled(self, spool: Spool, failures: int) -> bool:
        if failures == 0 and len(spool) > 1:
            # the exporter is taking batches: drain several spooled ones per request
            many = spool.peek_many(_DRAIN_BATCHES, _DRAIN_BYTES)
            for path, batch, _ in many:
                self._adopt(spool, path, batch)
            spans = [span for _, batch, _ in many for span in batch]
            failed = self._send(spans)
            if not failed or sum(len(p) for p in failed) < len(spans):
                for path, _, _ in many:
                    spool.remove(path)
                for part in failed:
                    self._to_spool(part)
            return not failed
        head = spool.peek()
        if head is None:
            return True
        path, spans, _ = head
        self._adopt(spool, path, spans)
        failed = self._send(spans)
        if not failed:
            spool.remove(path)
            return True
        if sum(len(p) for p in failed) < len(spans):  # part of it went through: keep the rest
            spool.remove(path)
            for part in failed:
                self._to_spool(part)
            return False
        if failures + 1 >= _POISON_AFTER and len(spool) > 1:
            # this batch, or the exporter? try the next one: if it goes through, the exporter
            # works. The head is dropped (counted) only after it failed that way _POISON_AFTER
            # times: once may be a receiver that was still starting up when the head was sent
            # (several later ones: two refused batches in a row once stopped all delivery)
            for index in range(1, _PROBE_LATER + 1):
                later = spool.peek(index)
                if later is None:
                    return False
                self._adopt(spool, later[0], later[1])
                if not self._send(later[1]):
                    spool.remove(later[0])
                    break
            else:
                return False
            strikes = self._head_strikes.get(path, 0) + 1
            if strikes >= _POISON_AFTER:
                self._head_strikes.pop(path, None)
                spool.remove(path)
                self.counts.dropped("rejected", spans)
            else:
                self._head_strikes = {path: strikes}
            return True
        return False

    def _adopt(self, spool: Spool, path: Path, spans: list[ReadableSpan]) -> None:
        """A batch a previous run left behind enters the ledger the first time it is read."""
        if path in self._adopted or spool.is_own(path):
            return
        self._adopted.add(path)
        self.counts.adopt(spans)

    def _send(self, spans: list[ReadableSpan]) -> list[list[ReadableSpan]]:
        """Export ``spans`` through the layers below; return the parts that failed."""
        try:
            if isinstance(self.exporter, PartialExporter):
                return self.exporter.export_parts(spans)
            return [] if self.exporter.export(spans) is SpanExportResult.SUCCESS else [spans]
        except BaseException as exc:  # noqa: BLE001 - a layer's bug never kills the sender
            self.counts.error("export")
            self._log_once(f"export.{type_name(exc)}", f"export raised {exception_text(exc)}")
            return [spans]

    # --- shutdown --------------------------------------------------------------------------
    def stop(self, deadline: float | None = None, *, keep: bool = True) -> int:
        """Stop the sender. Batches still in memory, and the one of an export call still under
        way (a hung exporter), are kept on disk, oldest first, until ``deadline``: what is not
        written by then stays pending in the ledger, which counts it lost at exit
        (``undelivered_at_exit``) with one log line. ``keep=False`` (a private spool, removed at
        exit) writes nothing: those files would be deleted unread. Without a spool the batches
        in memory are dropped (``shutdown``). Returns the batches left unwritten at the deadline.

        A batch is written whole: the deadline can be passed by the time of one write (a
        batch is at most ``max_pending_bytes``; an episode, at most ``max_episode_chars``)."""
        self._stopping.set()
        self._wake.set()
        with self._cond:
            rest, self._pending = list(self._pending), deque()
            sending, self._sending = self._sending, None
            self._sizes.clear()
            self._pending_bytes = 0
            self._cond.notify_all()
        if self._spool_max_bytes <= 0:
            for batch in rest:
                self.counts.dropped("shutdown", batch)
            return 0
        if not keep:
            return 0
        batches = ([sending] if sending is not None else []) + rest
        for written, batch in enumerate(batches):
            if deadline is not None and time.monotonic() >= deadline:
                return len(batches) - written
            self._to_spool(batch)
        return 0

    def leftover(self) -> Path | None:
        """After stop(): the spool directory (None: none was made), its lock let go; the files
        stay for the next process."""
        spool = self._spool
        if spool is None:
            return None
        spool.close()
        return spool.directory

    def spooled_traces(self) -> set[int]:
        """Trace ids of the episodes this process left in the spool."""
        spool = self._spool
        return spool.trace_ids() if spool is not None else set()

    def _log_once(self, what: str, message: str) -> None:
        self.counts.log_once(what, message)

    # --- SpanExporter ----------------------------------------------------------------------
    def export(self, spans: Sequence[ReadableSpan]) -> SpanExportResult:
        """Hand ``spans`` over (never blocks on the exporter): memory, or the spool."""
        self.offer(list(spans))
        return SpanExportResult.SUCCESS

    def force_flush(self, timeout_millis: int = 30000) -> bool:
        """Wait until everything handed over was delivered; False at the first failure after
        this call (what failed waits in the spool) or at the timeout."""
        return self.wait_idle(time.monotonic() + max(timeout_millis, 0) / 1000)

    def shutdown(self) -> None:
        """Stop the thread; what is still in memory goes to the spool (or is counted lost)."""
        self.stop()
