"""Delivery: kept episodes leave the training thread and reach every exporter, or are counted.

Three stages, none of which the training thread waits on:

1. the training thread only ``put_nowait``s a kept episode record into a bounded queue (sized
   from the sampler's cap); a full queue drops the item, counts it and warns once per interval;
2. one render thread turns records into SDK spans (``Materializer``) and hands each batch to one
   ``Outlet`` per exporter (never blocking: an outlet's memory buffer is bounded too);
3. each outlet has its own sender thread, so a slow or dead exporter holds up only itself. A
   batch the exporter fails (``FAILURE`` or an exception) goes to a bounded on-disk ``Spool``
   and is retried with exponential backoff until the exporter accepts it; while an outage
   lasts, new batches go straight to the spool. Nothing kept is lost while the spool has room;
   when it is full the oldest batches go first, counted.

``force_flush()`` of an exporter is never trusted as proof of delivery (the stock batch
processor returns True after dropping spans): an episode counts as delivered only when an
``export`` call that carried its root span returned ``SUCCESS``.

OTLP requests are split so that none is larger than the collector's message-size limit
(``max_request_bytes``): a batch is halved by span until every part fits.
"""

from __future__ import annotations

import logging
import os
import queue
import secrets
import shutil
import tempfile
import threading
import time
from collections import deque
from collections.abc import Sequence
from pathlib import Path
from typing import Any

from opentelemetry.sdk.trace import ReadableSpan
from opentelemetry.sdk.trace.export import SpanExporter, SpanExportResult

from otel_rollouts import conventions as c
from otel_rollouts._core.content import exception_text, type_name
from otel_rollouts._core.settings import DEFAULT_MAX_REQUEST_BYTES
from otel_rollouts._core.spans import EpisodeRecord, SpanRecord
from otel_rollouts._core.stats import Stats
from otel_rollouts.delivery.materialize import Materializer
from otel_rollouts.delivery.spool import Spool, encode

logger = logging.getLogger("otel_rollouts")

_STOP = object()
WARN_INTERVAL_S = 10.0
_BACKOFF_MIN_S = 0.25
_BACKOFF_MAX_S = 15.0
_POISON_AFTER = 3
_DRAIN_BATCHES = 64  # spooled batches sent together once the exporter takes them again
_DRAIN_BYTES = 2 * 1024 * 1024  # consecutive failures of one batch before checking whether only it fails


class _Marker:
    __slots__ = ("event",)

    def __init__(self) -> None:
        self.event = threading.Event()


def _warn(message: str, *args: Any) -> None:
    """Log a warning from a delivery thread; a logging handler that raises cannot stop the thread."""
    try:
        logger.warning(message, *args)
    except BaseException:  # noqa: BLE001, S110 - nothing left to tell it to
        pass


def exporter_name(exporter: Any) -> str:
    return type(exporter).__name__


def count_episodes(spans: Sequence[ReadableSpan]) -> int:
    """Episode roots in a batch: a batch is delivered episode by episode, by its roots."""
    n = 0
    for span in spans:
        attrs = span.attributes
        if attrs and attrs.get(c.RL_SPAN_KIND) == c.KIND_EPISODE:
            n += 1
    return n


def _is_otlp(exporter: Any) -> bool:
    return type(exporter).__module__.startswith("opentelemetry.exporter.otlp")


class _Warner:
    """A warning per kind at most once per interval, with the running total."""

    def __init__(self, interval: float = WARN_INTERVAL_S) -> None:
        self.interval = interval
        self._last: dict[str, float] = {}
        self._lock = threading.Lock()

    def warn(self, kind: str, message: str, *args: Any) -> None:
        now = time.monotonic()
        with self._lock:
            last = self._last.get(kind)
            if last is not None and now - last < self.interval:
                return
            self._last[kind] = now
        _warn("otel_rollouts: " + message, *args)


def approx_bytes(spans: Sequence[ReadableSpan]) -> int:
    """About how many bytes a batch holds: its texts plus a fixed cost per value (the bound on
    memory waiting for an exporter is kept in these units)."""
    total = 0
    for span in spans:
        total += 200 + len(span.name)
        for key, value in (span.attributes or {}).items():
            total += len(key) + 16
            if isinstance(value, str):
                total += len(value)
            elif isinstance(value, (tuple, list)):
                total += sum(len(v) if isinstance(v, str) else 8 for v in value)
        for event in span.events or ():
            total += 64 + len(event.name)
            for key, value in (event.attributes or {}).items():
                total += len(key) + 16 + (len(value) if isinstance(value, str) else 8)
    return total


class Outlet:
    """One exporter's buffer, spool and sender thread."""

    def __init__(
        self,
        exporter: SpanExporter,
        name: str,
        stats: Stats,
        warner: _Warner,
        *,
        max_pending: int,
        spool_dir: Path | None,
        spool_max_bytes: int,
        max_request_bytes: int | None,
        max_pending_bytes: int = 64 * 1024 * 1024,
    ) -> None:
        self.exporter = exporter
        self.max_pending_bytes = max_pending_bytes
        self._pending_bytes = 0
        self._sizes: dict[int, int] = {}  # id(batch in _pending) -> its approximate bytes
        self.name = name
        self.stats = stats
        self.warner = warner
        self.max_pending = max_pending
        self._spool_dir = spool_dir
        self._spool_max_bytes = spool_max_bytes
        self._spool: Spool | None = None
        self.max_request_bytes = max_request_bytes if _is_otlp(exporter) else None
        limit = getattr(exporter, "_max_request_size", None)
        if self.max_request_bytes and isinstance(limit, int) and 0 < limit < self.max_request_bytes:
            self.max_request_bytes = limit
        self._pending: deque[list[ReadableSpan]] = deque()
        self._cond = threading.Condition()
        self._busy = False
        self._stopping = threading.Event()
        self._wake = threading.Event()  # cut a backoff short (flush, stop)
        self._attempts = 0  # export attempts finished
        self._inflight = 0  # episodes in the export call under way
        self._last_ok = True
        self._head_strikes: dict[Any, int] = {}  # spool head -> times a later batch went through instead
        self._logged: set[str] = set()
        if spool_dir is not None and spool_dir.is_dir() and any(spool_dir.glob("*.otlp")):
            self._open_spool()  # batches a previous process left behind go first
        self._thread = threading.Thread(target=self._run, name=f"otel-rollouts-send-{name}", daemon=True)
        self._thread.start()

    # --- render side ---------------------------------------------------------------------
    def offer(self, spans: list[ReadableSpan]) -> None:
        size = approx_bytes(spans)
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
                    spill.append(self._take_head())
                if size <= self.max_pending_bytes:
                    self._pending.append(spans)
                    self._sizes[id(spans)] = size
                    self._pending_bytes += size
                    spans = None
                self._cond.notify()
        for batch in spill:
            self._to_spool(batch)
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
                self._dropped("spool_full", self._spool.dropped_at_open)
        return self._spool

    def _quarantined(self, name: str, episodes: int, reason: str) -> None:
        """A spool file that is not a batch was moved aside: count what it claimed to hold."""
        self.stats.add(f"spool.quarantined.{self.name}")
        self._log_once("spool.quarantine", f"spool file {name} moved to quarantine/: {reason}")
        if episodes:
            self._dropped("spool_damaged", episodes)

    def _to_spool(self, spans: list[ReadableSpan]) -> None:
        episodes = count_episodes(spans)
        spool = self._open_spool()
        if spool is None:
            self._dropped("spool_unavailable", episodes)
            return
        try:
            dropped = spool.push(encode(spans), episodes)
        except BaseException as exc:  # noqa: BLE001 - a full disk must not stop delivery
            self.stats.add(f"errors.spool.{self.name}")
            self._log_once("spool.write", f"spool write failed: {exception_text(exc)}")
            self._dropped("spool_error", episodes)
            return
        self.stats.add(f"spooled.{self.name}", episodes)
        if dropped:
            self._dropped("spool_full", dropped)

    def _dropped(self, reason: str, episodes: int) -> None:
        self.stats.add(f"dropped.{reason}.{self.name}", episodes)
        self.stats.add(f"dropped.{reason}", episodes)
        self.warner.warn(
            f"{reason}.{self.name}",
            "%s: dropped %d episode(s) (%s); total so far %d (counted in otr.stats())",
            self.name,
            episodes,
            reason,
            self.stats.total(f"dropped.{reason}.{self.name}"),
        )

    # --- status ----------------------------------------------------------------------------
    def pending_episodes(self) -> int:
        with self._cond:
            in_memory = sum(count_episodes(b) for b in self._pending) + self._inflight
        return in_memory + (self._spool.episodes if self._spool is not None else 0)

    def idle(self) -> bool:
        with self._cond:
            return not self._pending and not self._busy and (self._spool is None or len(self._spool) == 0)

    def _idle_locked(self) -> bool:
        return not self._pending and not self._busy and (self._spool is None or len(self._spool) == 0)

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
                if through_outage and self._attempts > start and not self._wake.is_set():
                    start = self._attempts
                    self._wake.set()  # at shutdown, retry promptly instead of backing off
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
                    self._cond.wait(0.5)
                self._busy = True
            ok = False
            batch = None  # taken from memory, and neither delivered nor spooled yet
            try:
                spool = self._spool
                if spool is not None and len(spool) > 0:
                    ok = self._send_spooled(spool, failures)
                else:
                    with self._cond:
                        batch = self._take_head() if self._pending else None
                        self._inflight = count_episodes(batch) if batch is not None else 0
                    ok = True
                    if batch is not None:
                        failed = self._send(batch)
                        batch = None
                        ok = not failed
                        if failed:
                            # keep it, and everything behind it, on disk until the exporter is back
                            for part in failed:
                                self._to_spool(part)
                            self._spill_pending()
            except BaseException as exc:  # noqa: BLE001 - the sender thread never dies
                ok = False
                self.stats.add(f"errors.sender.{self.name}")
                if batch is not None:
                    self._dropped("sender_error", count_episodes(batch))
                self._log_once(f"sender.{type_name(exc)}", f"delivery error: {exception_text(exc)}")
            finally:
                with self._cond:
                    self._busy = False
                    self._inflight = 0
                    self._attempts += 1
                    self._last_ok = ok
                    self._cond.notify_all()
            if ok:
                backoff, failures = 0.0, 0
            else:
                failures += 1
                backoff = min(_BACKOFF_MAX_S, _BACKOFF_MIN_S * (2 ** min(failures - 1, 10)))

    def _spill_pending(self) -> None:
        """Move the memory buffer to disk, oldest first; each batch is on disk before it leaves
        memory, so ``pending_episodes`` never undercounts."""
        while True:
            with self._cond:
                if not self._pending:
                    return
                item = self._pending[0]
            self._to_spool(item)
            with self._cond:
                if self._pending and self._pending[0] is item:
                    self._take_head()

    def _send_spooled(self, spool: Spool, failures: int) -> bool:
        if failures == 0 and len(spool) > 1:
            # the exporter is taking batches: drain several spooled ones per request
            many = spool.peek_many(_DRAIN_BATCHES, _DRAIN_BYTES)
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
            second = spool.peek(1)
            if second is not None and not self._send(second[1]):
                spool.remove(second[0])
                strikes = self._head_strikes.get(path, 0) + 1
                if strikes >= _POISON_AFTER:
                    self._head_strikes.pop(path, None)
                    spool.remove(path)
                    self._dropped("rejected", count_episodes(spans))
                else:
                    self._head_strikes = {path: strikes}
                return True
        return False

    def _send(self, spans: list[ReadableSpan]) -> list[list[ReadableSpan]]:
        """Export ``spans`` (split under the request-size limit); return the parts that failed."""
        parts = self._split(spans) if self.max_request_bytes else [spans]
        failed: list[list[ReadableSpan]] = []
        for part in parts:
            if not part:
                continue
            try:
                result = self.exporter.export(part)
            except BaseException as exc:  # noqa: BLE001 - an exporter bug (even SystemExit) never kills the sender
                self.stats.add(f"errors.export.{self.name}")
                self._log_once(f"export.{type_name(exc)}", f"export raised {exception_text(exc)}")
                result = SpanExportResult.FAILURE
            if result is SpanExportResult.FAILURE:
                self.stats.add(f"export.failures.{self.name}")
                self._log_once("export.FAILURE", "export returned FAILURE (will retry from the spool)")
                failed.append(part)
            else:
                lost = self._not_stored()
                stored = count_episodes(part) - sum(lost.values())
                self.stats.add(f"delivered.{self.name}", max(stored, 0))
                for reason, episodes in lost.items():
                    self._dropped(reason, episodes)
        return failed

    def _not_stored(self) -> dict[str, int]:
        """Episodes the exporter took but says it did not store, by reason.

        An exporter may implement ``take_not_stored() -> {reason: episodes}`` (the Trackio
        exporter does: a trace Trackio would skip is never counted delivered).
        """
        take = getattr(self.exporter, "take_not_stored", None)
        if not callable(take):
            return {}
        try:
            lost = take()
            return {str(k): int(v) for k, v in dict(lost or {}).items() if int(v) > 0}
        except BaseException as exc:  # noqa: BLE001 - an exporter bug never kills the sender
            self._log_once("take_not_stored", f"take_not_stored raised {exception_text(exc)}")
            return {}

    def _split(self, spans: list[ReadableSpan]) -> list[list[ReadableSpan]]:
        from opentelemetry.exporter.otlp.proto.common.trace_encoder import encode_spans

        limit = self.max_request_bytes or 0
        out: list[list[ReadableSpan]] = []
        stack = [spans]
        while stack:
            part = stack.pop()
            if encode_spans(part).ByteSize() <= limit:
                out.append(part)
            elif len(part) == 1:
                self.stats.add(f"dropped.oversize_spans.{self.name}")
                self._dropped("oversize", count_episodes(part))
            else:
                half = len(part) // 2
                stack.append(part[half:])
                stack.append(part[:half])
        if len(out) > 1:
            self.stats.add(f"export.split_requests.{self.name}", len(out) - 1)
        return out

    # --- shutdown --------------------------------------------------------------------------
    def stop(self) -> None:
        """Stop the sender; batches still in memory are kept on disk (when there is a spool)."""
        self._stopping.set()
        self._wake.set()
        with self._cond:
            rest, self._pending = list(self._pending), deque()
            self._sizes.clear()
            self._pending_bytes = 0
            self._cond.notify_all()
        if rest and self._spool_max_bytes > 0:
            for batch in rest:
                self._to_spool(batch)
        elif rest:
            self._dropped("shutdown", sum(count_episodes(b) for b in rest))

    def leftover(self) -> tuple[int, Path | None]:
        """(episodes left undelivered on disk, spool directory) after stop()."""
        spool = self._spool
        if spool is None:
            return 0, None
        spool.close()  # the lock goes; the files stay for the next process
        return spool.episodes, spool.directory

    def _log_once(self, what: str, message: str) -> None:
        if what in self._logged:
            return
        self._logged.add(what)
        _warn("otel_rollouts: exporter %s: %s (logged once; counted in otr.stats())", self.name, message)


class Delivery:
    """A bounded queue, the render thread that drains it, and one outlet per exporter."""

    def __init__(
        self,
        exporters: Sequence[SpanExporter],
        materializer: Materializer,
        stats: Stats,
        max_queue: int = 1024,
        *,
        spool_dir: str | Path | None = None,
        spool_max_bytes: int = 256 * 1024 * 1024,
        max_request_bytes: int | None = DEFAULT_MAX_REQUEST_BYTES,
        max_pending_bytes: int = 64 * 1024 * 1024,
    ) -> None:
        self.exporters = list(exporters)
        self.materializer = materializer
        self.stats = stats
        self.warner = _Warner()
        self._queue: queue.Queue = queue.Queue(maxsize=max_queue)
        self.closed = False  # set by shutdown: later items are counted, not queued
        self._logged: set[tuple[str, str]] = set()
        self._own_spool_root = spool_dir is None
        self.spool_root = Path(spool_dir) if spool_dir is not None else None
        self.outlets: list[Outlet] = []
        seen: dict[str, int] = {}
        for i, exporter in enumerate(self.exporters):
            base = exporter_name(exporter)
            seen[base] = seen.get(base, 0) + 1
            name = base if seen[base] == 1 else f"{base}#{seen[base]}"
            self.outlets.append(
                Outlet(
                    exporter,
                    name,
                    stats,
                    self.warner,
                    max_pending=max_queue,
                    spool_dir=self._spool_dir_for(i, base),
                    spool_max_bytes=spool_max_bytes,
                    max_request_bytes=max_request_bytes,
                    max_pending_bytes=max_pending_bytes,
                )
            )
        self._thread = threading.Thread(target=self._run, name="otel-rollouts-export", daemon=True)
        self._thread.start()

    def _spool_dir_for(self, index: int, name: str) -> Path | None:
        if self.spool_root is None:
            # created lazily, private to this process, removed at shutdown when empty
            # (a name no other local user can guess and create first: the spool holds content)
            self.spool_root = Path(tempfile.gettempdir()) / f"otel-rollouts-spool-{os.getpid()}-{secrets.token_hex(8)}"
        return self.spool_root / f"{index}-{name}"

    # --- called from the training side -------------------------------------------------------
    def episode(self, record: EpisodeRecord) -> None:
        self._put(("episode", record), "episodes")

    def late_span(self, record: EpisodeRecord, span: SpanRecord) -> None:
        self._put(("late", (record.trace_id, span)), "spans")

    def spans(self, spans: list[ReadableSpan]) -> None:
        self._put(("spans", spans), "spans")

    def _put(self, item: Any, what: str) -> None:
        if self.closed:  # a span of an episode begun before shutdown or reconfiguration
            self.stats.add(f"dropped.after_shutdown.{what}")
            return
        try:
            self._queue.put_nowait(item)
        except queue.Full:
            self.stats.add(f"dropped.queue_full.{what}")
            self.warner.warn(
                f"queue_full.{what}",
                "export queue full (%d items); dropping %s. Total dropped: %s (otr.stats())",
                self._queue.maxsize,
                what,
                self.stats.total(f"dropped.queue_full.{what}"),
            )

    # --- flush / shutdown ----------------------------------------------------------------------
    def flush(self, timeout: float, *, through_outage: bool = False) -> bool:
        """Wait until everything queued before this call was delivered (or the deadline).

        Returns False early when an exporter is failing (its batches wait in the spool and are
        retried in the background), unless ``through_outage`` (shutdown: the last chance).
        """
        deadline = time.monotonic() + timeout
        if not self._thread.is_alive():
            return False
        marker = _Marker()
        try:
            self._queue.put(marker, timeout=max(deadline - time.monotonic(), 0.001))
        except queue.Full:
            return False
        if not marker.event.wait(max(deadline - time.monotonic(), 0.0)):
            return False
        ok = True
        for outlet in self.outlets:
            ok = outlet.wait_idle(deadline, through_outage=through_outage) and ok
        for outlet in self.outlets:
            if time.monotonic() >= deadline:
                return False
            ok = self._flush_exporter(outlet, deadline) and ok
        return ok

    def _flush_exporter(self, outlet: Outlet, deadline: float) -> bool:
        result: list[Any] = []
        remaining_ms = int(max(deadline - time.monotonic(), 0.0) * 1000)
        worker = threading.Thread(
            target=lambda: result.append(self._call(outlet, "force_flush", remaining_ms)), daemon=True
        )
        worker.start()
        worker.join(max(deadline - time.monotonic(), 0.0))
        return bool(result) and result[0] is not False

    def shutdown(self, timeout: float) -> bool:
        """Flush, then stop; never waits past ``timeout`` (a dead network included)."""
        deadline = time.monotonic() + timeout
        if not self._thread.is_alive():
            return False  # a forked copy: the threads (and the work) are the parent's
        flushed = self.flush(max(timeout * 0.8, 0.0), through_outage=True)
        self.closed = True
        try:
            self._queue.put(_STOP, timeout=max(deadline - time.monotonic(), 0.001))
        except queue.Full:
            pass
        self._thread.join(max(deadline - time.monotonic(), 0.0))
        for outlet in self.outlets:
            outlet.stop()
        # exporters' shutdown may hang on a dead network: run it where we can stop waiting
        closer = threading.Thread(target=self._shutdown_exporters, daemon=True)
        closer.start()
        closer.join(max(deadline - time.monotonic(), 0.0))
        self._report_leftovers()
        return flushed and not self._thread.is_alive() and not closer.is_alive()

    def _report_leftovers(self) -> None:
        own = self._own_spool_root
        for outlet in self.outlets:
            episodes, directory = outlet.leftover()
            if not episodes:
                continue
            if own:
                # a private temporary spool dies with the process: say so, and count the loss
                self.stats.add(f"dropped.undelivered_at_exit.{outlet.name}", episodes)
                logger.warning(
                    "otel_rollouts: %s: %d kept episode(s) could not be delivered before exit and are "
                    "lost (pass configure(spool_dir=...) to keep them for the next run)",
                    outlet.name,
                    episodes,
                )
            else:
                self.stats.add(f"undelivered_at_exit.{outlet.name}", episodes)
                logger.warning(
                    "otel_rollouts: %s: %d kept episode(s) not delivered yet; they stay in %s and are "
                    "sent by the next process configured with this spool_dir",
                    outlet.name,
                    episodes,
                    directory,
                )
        root = self.spool_root
        if own and root is not None and root.is_dir():
            shutil.rmtree(root, ignore_errors=True)

    def _shutdown_exporters(self) -> None:
        for outlet in self.outlets:
            self._call(outlet, "shutdown")

    def report(self) -> dict[str, dict[str, int]]:
        """Per exporter: episodes delivered, spooled to disk, pending, dropped."""
        out = {}
        for outlet in self.outlets:
            n = outlet.name
            dropped = sum(
                v for k, v in self.stats.snapshot()["totals"].items() if k.startswith("dropped.") and k.endswith("." + n)
            )
            out[n] = {
                "delivered": self.stats.total(f"delivered.{n}"),
                "spooled": self.stats.total(f"spooled.{n}"),
                "pending": outlet.pending_episodes(),
                "dropped": dropped,
                "failures": self.stats.total(f"export.failures.{n}"),
            }
        return out

    # --- the render thread ---------------------------------------------------------------------
    def _run(self) -> None:
        while True:
            item = self._queue.get()
            if item is _STOP:
                return
            if isinstance(item, _Marker):
                item.event.set()
                continue
            try:
                self._render(item)
            except BaseException:  # noqa: BLE001 - last resort (a logging handler that raises): go on
                self.stats.add("errors.render_thread")

    def _render(self, item: Any) -> None:
        """Materialise one queued item and offer it to every outlet; failures are counted."""
        kind, payload = item
        try:
            if kind == "episode":
                spans = self.materializer.episode(payload)
                self.stats.add("exported.episodes")
            elif kind == "late":
                trace_id, span = payload
                spans = [self.materializer.span(trace_id, span)]
            else:
                spans = [self.materializer.foreign(s) for s in payload]
        except BaseException as exc:  # noqa: BLE001 - rendering must never kill the thread
            self.stats.add("errors.materialize")
            if kind == "episode":
                self.stats.add("dropped.render_error")
            else:
                self.stats.add("dropped.render_error_spans", len(payload) if kind == "spans" else 1)
            self._log_once("materialize", exc)
            return
        for outlet in self.outlets:
            try:
                outlet.offer(spans)
            except BaseException as exc:  # noqa: BLE001
                self.stats.add(f"errors.offer.{outlet.name}")
                self._log_once(f"{outlet.name}.offer", exc)

    def _call(self, outlet: Outlet, method: str, *args: Any) -> Any:
        try:
            return getattr(outlet.exporter, method)(*args)
        except BaseException as exc:  # noqa: BLE001 - an exporter bug never reaches training
            self.stats.add(f"errors.{method}.{outlet.name}")
            self._log_once(f"{outlet.name}.{method}", exc)
            return False

    def _log_once(self, where: str, error: Any) -> None:
        key = (where, type_name(error) if isinstance(error, BaseException) else str(error))
        if key in self._logged:
            return
        self._logged.add(key)
        message = exception_text(error) if isinstance(error, BaseException) else str(error)
        _warn("otel_rollouts: %s failed: %s (logged once; counted in otr.stats())", where, message)
