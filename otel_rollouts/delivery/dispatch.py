"""Delivery: kept episodes leave the training thread and reach every exporter, or are counted.

Every kept episode enters the ``Ledger`` here, when it is handed over, and leaves it exactly
once per exporter: delivered (confirmed stored) or dropped under a named reason.

Three stages, none of which the training thread waits on:

1. the training thread only ``put_nowait``s a kept episode record into a queue bounded in items
   and in bytes (``max_queue_bytes``, plus at most two records queued while the render thread
   kept up, which are not sized); a full queue drops the item, counts it and warns once per
   interval;
2. one render thread turns records into SDK spans (``Materializer``) and hands each batch to one
   stack of delivery layers per exporter (``delivery.layers``; never blocking: the sender's memory
   buffer is bounded too);
3. each exporter's ``SpoolingSender`` has its own thread, so a slow or dead exporter holds up only itself. A
   batch the exporter fails (``FAILURE`` or an exception) goes to a bounded on-disk ``Spool``
   and is retried with exponential backoff until the exporter accepts it; while an outage
   lasts, new batches go straight to the spool. Nothing kept is lost while the spool has room;
   when it is full the oldest batches go first, counted.

``force_flush()`` of an exporter is never trusted as proof of delivery (the stock batch
processor returns True after dropping spans): an episode counts as delivered only when ``export``
calls that carried every one of its spans returned ``SUCCESS`` and nothing said otherwise (OTLP
``partial_success``, the exporter's ``take_not_stored``).

OTLP requests are split so that none is larger than the collector's message-size limit
(``max_request_bytes``): a batch is halved by span until every part fits.
"""

from __future__ import annotations

import logging
import os
import queue
import secrets
import shutil
import sys
import tempfile
import threading
import time
from collections.abc import Callable, Mapping, Sequence
from functools import partial
from pathlib import Path
from typing import Any

from opentelemetry.sdk.trace import ReadableSpan
from opentelemetry.sdk.trace.export import SpanExporter

from otel_rollouts._core.codec import PendingSpan
from otel_rollouts._core.content import exception_text, type_name
from otel_rollouts._core.guard import first_time
from otel_rollouts._core.settings import DEFAULT_MAX_REQUEST_BYTES
from otel_rollouts._core.spans import EpisodeRecord, SpanRecord
from otel_rollouts._core.stats import Stats
from otel_rollouts.delivery.gateway_channel import Channel
from otel_rollouts.delivery.layers import (
    CountingExporter,
    DeliveryCounts,
    SplittingExporter,
    Warner,
    exporter_name,
    request_limit,
    warn,
)
from otel_rollouts.delivery.ledger import Ledger
from otel_rollouts.delivery.materialize import Materializer
from otel_rollouts.delivery.sender import SpoolingSender
from otel_rollouts.exporters.extras import GroupsSink, MetricsSink, PendingViewer

__all__ = ["Delivery"]

logger = logging.getLogger("otel_rollouts")

_STOP = object()
_WAKE_S = 0.25  # the render thread looks at its queue at least this often (see Delivery._run)


_BASE_BYTES = 256  # a span's own objects (ids, times, dicts), about
_MAX_NODES = 100_000  # nodes of one value walked to size it
_SCALARS = (int, float, bool, type(None))
_SIZE_FROM = 2  # queued items from which a kept record is sized (see Delivery.episode)


_SHARED_TEXT = 256  # a string at least this long is counted once per record, however often held


def _value_bytes(value: Any, seen: set[int] | None = None) -> int:
    """Memory held by one attribute value: strings at their real size (``sys.getsizeof``: a
    text with one non-Latin-1 character takes 2 or 4 bytes a character), containers walked (at
    most ``_MAX_NODES`` nodes: a recorded value is a bounded snapshot already). ``seen``: the
    ids of the containers and long strings counted already for the same record; an object held
    twice (a conversation's message copies, shared by every generation that took them as input,
    and the texts in them) holds its memory once, and is counted once."""
    size = sys.getsizeof
    if seen is None:
        seen = set()
    total = 0
    stack = [value]
    nodes = 0
    while stack and nodes < _MAX_NODES:
        v = stack.pop()
        nodes += 1
        t = type(v)
        if t is str or t is bytes:
            if len(v) >= _SHARED_TEXT:
                if id(v) in seen:
                    continue
                seen.add(id(v))
            total += size(v)
        elif t is dict:
            if id(v) in seen:
                continue
            seen.add(id(v))
            total += 64 + 16 * len(v)
            stack.extend(v.keys())
            stack.extend(v.values())
        elif t is list or t is tuple:
            if id(v) in seen:
                continue
            seen.add(id(v))
            total += 56 + 8 * len(v)
            stack.extend(v)
        else:
            total += 32
    return total


def record_bytes(record: EpisodeRecord) -> int:
    """About how much memory a kept episode's record holds until it is rendered (each object
    counted once, however many of its spans hold it)."""
    size = sys.getsizeof
    seen: set[int] = set()
    total = 0
    for span in record.spans:
        total += _BASE_BYTES
        for key, value in span.attributes.items():
            t = type(value)
            total += size(key) + (size(value) if t is str and len(value) < _SHARED_TEXT else
                                  32 if t in _SCALARS else _value_bytes(value, seen))
        for event in span.events or ():
            total += _BASE_BYTES + _value_bytes(event[1], seen)
    return total + _BASE_BYTES * len(record.foreign)


class _Marker:
    """Put in the queue by flush(): set when the render thread reaches it."""

    def __init__(self) -> None:
        self.event = threading.Event()


class Delivery:
    """A bounded queue, the render thread that drains it, and one stack of delivery layers per
    exporter (``SpoolingSender`` over ``SplittingExporter`` over ``CountingExporter``)."""

    def __init__(
        self,
        exporters: Sequence[SpanExporter],
        materializer: Materializer,
        stats: Stats,
        max_queue: int = 1024,
        *,
        spool_dir: str | os.PathLike[str] | None = None,
        spool_max_bytes: int = 256 * 1024 * 1024,
        max_request_bytes: int | None = DEFAULT_MAX_REQUEST_BYTES,
        max_pending_bytes: int = 64 * 1024 * 1024,
        max_queue_bytes: int = 64 * 1024 * 1024,
        ledger: Callable[[Stats, list[str]], Ledger] | None = None,
    ) -> None:
        """``ledger``: makes the ledger from the stats and the exporters' names (default
        ``Ledger``); the renderer process (``delivery.process``) passes one that reports every
        decision to the training process, whose ledger is the one ``otr.stats()`` reads."""
        self.exporters = list(exporters)
        self.max_queue_bytes = max_queue_bytes
        self._queued_bytes = 0  # memory of the records waiting for the render thread
        self._bytes_lock = threading.Lock()
        self.materializer = materializer
        self.stats = stats
        self.warner = Warner()
        self._queue: queue.Queue = queue.Queue(maxsize=max_queue)
        self.closed = False  # set by shutdown: later items are counted, not queued
        # set by shutdown once its render time is over: queued items are let go unrendered (the
        # ledger counts the kept episodes among them at exit); the exit's time goes to the spool
        self._abandon = threading.Event()
        # the render thread's longest wait on an empty queue (a process that ignores SIGINT, the
        # renderer process, waits longer: see _run)
        self.wake_s = _WAKE_S
        self._own_spool_root = spool_dir is None
        self.spool_root = Path(spool_dir) if spool_dir is not None else None
        self.senders: list[SpoolingSender] = []
        seen: dict[str, int] = {}
        names = []
        for exporter in self.exporters:
            base = exporter_name(exporter)
            seen[base] = seen.get(base, 0) + 1
            names.append(base if seen[base] == 1 else f"{base}#{seen[base]}")
        self.ledger = ledger(stats, names) if ledger is not None else Ledger(stats, names)
        for i, (exporter, name) in enumerate(zip(self.exporters, names, strict=True)):
            base = exporter_name(exporter)
            counts = DeliveryCounts(stats, name, self.warner, self.ledger)
            limit = request_limit(exporter, max_request_bytes)
            stack = SplittingExporter(CountingExporter(exporter, counts), limit, counts)
            sender = SpoolingSender(
                stack,
                counts,
                max_pending=max_queue,
                spool_dir=self._spool_dir_for(i, base),
                spool_max_bytes=spool_max_bytes,
                max_pending_bytes=max_pending_bytes,
            )
            sender.user_exporter = exporter
            self.senders.append(sender)
        # the node's span gateway, once the run has one: the render thread pulls each kept
        # episode's server spans from it (``use_gateway``)
        self._gateway: Channel | None = None
        self._pull: Callable[[int], list[PendingSpan]] | None = None
        self._thread = threading.Thread(target=self._run, name="otel-rollouts-export", daemon=True)
        self._thread.start()

    def describe_run(self, attributes: Mapping[str, str]) -> None:
        """The run's description (``otr.describe_run``): on the resource of what is rendered
        from now on."""
        self.materializer.describe_run(attributes)

    def use_gateway(self, address: str, timeout: float) -> None:
        """Pull each kept episode's server spans from the gateway at ``address`` (waiting up to
        ``timeout`` for each) before rendering it."""
        channel = Channel(address, self.stats, role="renderer").start()
        self._gateway = channel
        self._pull = channel.puller(timeout)

    def _spool_dir_for(self, index: int, name: str) -> Path | None:
        if self.spool_root is None:
            # created lazily, private to this process, removed at shutdown when empty
            # (a name no other local user can guess and create first: the spool holds content)
            self.spool_root = Path(tempfile.gettempdir()) / f"otel-rollouts-spool-{os.getpid()}-{secrets.token_hex(8)}"
        return self.spool_root / f"{index}-{name}"

    # --- called from the training side -------------------------------------------------------
    def episode(self, record: EpisodeRecord) -> None:
        """A kept episode: it enters the ledger (pending for every exporter) and the queue."""
        if not self.admit(record):
            return
        # sized only while the render thread is behind (two items or more waiting): then at most
        # two unsized records are ever queued, and a render thread that keeps up costs nothing
        size = record_bytes(record) if len(self._queue.queue) >= _SIZE_FROM else 0
        if not self._put(("episode", record, size), "episodes", size):
            self.ledger.dropped_traces(None, (record.trace_id,), "queue_full")
            record.release(keep_root=True)  # freed now, not by the cyclic GC

    def admit(self, record: EpisodeRecord) -> bool:
        """Enter a kept episode in the ledger; False (dropped, counted, released) when delivery
        is closed or its trace id is pending already."""
        key = (record.step, record.split)
        if self.closed:  # kept as the run was being shut down or reconfigured
            self.ledger.dropped_unentered(key, "after_shutdown")
            record.release(keep_root=True)
            return False
        if not self.ledger.enter(record.trace_id, key):
            # another episode with this trace id is still being delivered (ids made from a seed
            # that repeats): exporting both would merge two episodes into one trace
            self.ledger.dropped_unentered(key, "duplicate_trace_id")
            record.release(keep_root=True)
            return False
        return True

    def late_span(self, record: EpisodeRecord, span: SpanRecord) -> None:
        self._put(("late", (record.trace_id, span), 0), "spans", 0)

    def metric_sinks(self) -> list[MetricsSink | GroupsSink]:
        """Where step summaries and step groups go (the exporters that are a ``MetricsSink`` or
        a ``GroupsSink``): the exporters themselves here; the renderer process's copies,
        through the channel, in ``render="process"`` mode."""
        return [e for e in self.exporters if isinstance(e, (MetricsSink, GroupsSink))]

    @property
    def shows_pending(self) -> bool:
        """Whether any exporter shows pending snapshots (has ``show_pending``)."""
        return any(isinstance(e, PendingViewer) for e in self.exporters)

    def pending(self, snapshots: Sequence[EpisodeRecord], ended: Sequence[int]) -> bool:
        """Pending snapshots of episodes still running past the hang threshold (copies made by
        ``sampling.hung``, never the live records), and the trace ids of shown episodes that
        ended since. Best effort: queued (bounded in items and bytes, never blocking) for the
        render thread, which renders them with the same ``Materializer`` as kept episodes
        (redaction, limits) and hands them to every exporter that has ``show_pending(spans,
        ended)``; the others never see them. A snapshot is not a kept episode: it never enters
        the ledger, and an exporter's failure to show it is counted, not retried.

        OTLP exporters get none: a snapshot under the episode's real trace id would put the
        same span ids into Jaeger or Phoenix twice (once running, once finished), and a
        snapshot of an episode the sampler later drops would leave a fragment of a dropped
        episode there, which OTLP cannot take back. Returns False (counted
        ``dropped.queue_full.pending``) when the queue had no room."""
        if not snapshots and not ended:
            return True
        size = sum(record_bytes(s) for s in snapshots)
        return self._put(("pending", (list(snapshots), list(ended)), size), "pending", size)

    def spans(self, spans: Sequence[ReadableSpan | PendingSpan]) -> None:
        self._put(("spans", spans, 0), "spans", 0)

    def _put(self, item: object, what: str, size: int) -> bool:
        """Queue ``item`` (``size`` bytes of memory); False (counted) when it cannot be. A kept
        episode refused is counted by the caller's ledger, per exporter (``lost.queue_full.
        <exporter>``), never here: ``dropped.*`` is the sampler's for episodes."""
        if self.closed:  # a span of an episode begun before shutdown or reconfiguration
            if what != "episodes":
                self.stats.add(f"dropped.after_shutdown.{what}")
            return False
        with self._bytes_lock:
            fits = self._queued_bytes + size <= self.max_queue_bytes or self._queued_bytes == 0
            if fits:
                self._queued_bytes += size
        if fits:
            try:
                self._queue.put_nowait(item)
                return True
            except queue.Full:
                with self._bytes_lock:
                    self._queued_bytes -= size
        key = f"lost.queue_full.{self.ledger.exporters[0]}" if what == "episodes" and self.ledger.exporters \
            else f"dropped.queue_full.{what}"
        if what != "episodes":
            self.stats.add(key)
        self.warner.warn(
            f"queue_full.{what}",
            "export queue full (%d items, %d of %d bytes); dropping %s. Total dropped before: %s (%s in otr.stats())",
            self._queue.maxsize,
            self._queued_bytes,
            self.max_queue_bytes,
            what,
            self.stats.total(key),
            key,
        )
        return False

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
        for sender in self.senders:
            ok = sender.wait_idle(deadline, through_outage=through_outage) and ok
        for sender in self.senders:
            if time.monotonic() >= deadline:
                return False
            ok = self._flush_exporter(sender, deadline) and ok
        return ok

    def _flush_exporter(self, sender: SpoolingSender, deadline: float) -> bool:
        result: list[object] = []
        remaining_ms = int(max(deadline - time.monotonic(), 0.0) * 1000)
        worker = threading.Thread(
            target=lambda: result.append(
                self._call(sender, "force_flush", lambda: sender.user_exporter.force_flush(remaining_ms))
            ),
            daemon=True,
        )
        worker.start()
        worker.join(max(deadline - time.monotonic(), 0.0))
        return bool(result) and result[0] is not False

    def shutdown(self, timeout: float) -> bool:
        """Flush, then stop; never waits past ``timeout`` (a dead network, a large backlog and
        a slow disk included).

        The time goes, in order, to delivery (at most 80%: the exporters are retried, the last
        chance), to the render thread finishing what is queued (half of what is left; then it
        stops rendering), and to writing what still waits in memory to a persistent spool
        (until the deadline: what fits is written, oldest first). Nothing is written to the
        private spool, which is removed at exit. Whatever is not delivered or written by the
        deadline is counted by the ledger, ``undelivered_at_exit``, with one log line per
        exporter. The exporters' own ``shutdown`` gets what is left, on a thread of its own."""
        deadline = time.monotonic() + timeout
        if not self._thread.is_alive():
            return False  # a forked copy: the threads (and the work) are the parent's
        flushed = self.flush(max(timeout * 0.8, 0.0), through_outage=True)
        self.closed = True
        try:
            self._queue.put_nowait(_STOP)
        except queue.Full:
            pass  # the render thread stops at the deadline anyway (_abandon)
        self._thread.join(max((deadline - time.monotonic()) / 2, 0.0))
        self._abandon.set()  # what is not rendered now stays pending: counted at exit
        if self._gateway is not None:
            self._gateway.close(min(max(deadline - time.monotonic(), 0.0) / 4, 1.0))
        keep = not self._own_spool_root
        unwritten = {sender.name: sender.stop(deadline, keep=keep) for sender in self.senders}
        for name, batches in unwritten.items():
            if batches:
                self.stats.add(f"spool.unwritten_at_exit.{name}", batches)
        # exporters' shutdown may hang on a dead network: run it where we can stop waiting
        closer = threading.Thread(target=self._shutdown_exporters, daemon=True)
        closer.start()
        closer.join(max(deadline - time.monotonic(), 0.0))
        self._report_leftovers(unwritten)
        return (flushed and not any(unwritten.values()) and not self._thread.is_alive()
                and not closer.is_alive())

    def _report_leftovers(self, unwritten: dict[str, int] | None = None) -> None:
        """Decide every episode still pending (the ledger's end): left in a persistent spool for
        the next process, or lost under ``undelivered_at_exit`` (a private spool dies with the
        process; an ``export`` still hung at the deadline never confirmed anything; a batch the
        deadline left unwritten, ``unwritten[exporter]`` of them, never reached the spool)."""
        unwritten = unwritten or {}
        own = self._own_spool_root
        left: dict[str, set[int]] = {}
        directories: dict[str, Path | None] = {}
        for sender in self.senders:
            directories[sender.name] = sender.leftover()
            left[sender.name] = set() if own else sender.spooled_traces()
        lost = self.ledger.close(left)
        for sender in self.senders:
            if lost.get(sender.name):
                logger.warning(
                    "otel_rollouts: %s: %d kept episode(s) could not be delivered before exit and are "
                    "lost%s",
                    sender.name,
                    lost[sender.name],
                    " (pass configure(spool_dir=...) to keep them for the next run)" if own else
                    f" ({unwritten[sender.name]} batch(es) still in memory when the exit deadline came; "
                    "a longer exit_timeout or shutdown(timeout) writes more of them to the spool)"
                    if unwritten.get(sender.name) else "",
                )
            kept = len(left.get(sender.name, ()))
            if kept:
                logger.warning(
                    "otel_rollouts: %s: %d kept episode(s) not delivered yet; they stay in %s and are "
                    "sent by the next process configured with this spool_dir",
                    sender.name,
                    kept,
                    directories[sender.name],
                )
        root = self.spool_root
        if own and root is not None and root.is_dir():
            shutil.rmtree(root, ignore_errors=True)

    def _shutdown_exporters(self) -> None:
        for sender in self.senders:
            self._call(sender, "shutdown", partial(_shut_down, sender.user_exporter))

    def report(self) -> dict[str, dict[str, object]]:
        """Per exporter: episodes delivered, spooled to disk, pending (the ledger's: in all and
        per ``"step/split"``), dropped; read together under the ledger's lock."""
        by_name = {counts.name: counts for counts in self.delivery_counts()}

        def counters(name: str) -> dict[str, object]:
            counts = by_name[name]
            return {
                "delivered": counts.total("delivered"),
                "spooled": counts.total("spooled"),
                "dropped": counts.dropped_episodes(),  # episodes only: dropped spans are not added
                "failures": counts.total("export.failures"),
            }

        return self.ledger.report(counters)

    def forget_after_fork(self) -> None:
        """In a forked child: let go of what belongs to the parent (nothing here: the render
        thread did not survive the fork, and the queue is the parent's copy)."""

    def delivery_counts(self) -> list[DeliveryCounts]:
        """Each exporter's counters, in the exporters' order."""
        return [sender.counts for sender in self.senders]

    # --- the render thread ---------------------------------------------------------------------
    def _run(self) -> None:
        while True:
            try:
                # never an unbounded wait: a KeyboardInterrupt that lands in the training thread's
                # put_nowait while it notifies this thread (inside Condition.notify) loses the
                # wakeup, and a thread blocked in get() then never saw what was queued after it
                # (a SIGINT exit waited out its whole deadline on a render thread asleep)
                item = self._queue.get(timeout=self.wake_s)
            except queue.Empty:
                if self._abandon.is_set():
                    return  # shut down (its stop item may not have found room in a full queue)
                continue
            if item is _STOP:
                return
            if isinstance(item, _Marker):
                item.event.set()
                continue
            if self._abandon.is_set():
                self._let_go(item)
                continue
            try:
                self._render(item)
            except BaseException:  # noqa: BLE001 - last resort (a logging handler that raises): go on
                self.stats.add("errors.render_thread")

    def _let_go(self, item: Any) -> None:
        """After the exit's render time: an item is freed unrendered (a kept episode among them
        stays pending in the ledger, which counts it ``undelivered_at_exit``)."""
        kind, payload, size = item
        if size:
            with self._bytes_lock:
                self._queued_bytes -= size
        if kind == "episode":
            payload.release(keep_root=True)

    def _render(self, item: Any) -> None:
        """Materialise one queued item and offer it to every sender; failures are counted."""
        kind, payload, size = item
        if size:
            with self._bytes_lock:
                self._queued_bytes -= size
        if kind == "pending":
            self._show_pending(*payload)
            return
        try:
            if kind == "episode":
                pull = self._pull
                if pull is not None:
                    payload.foreign.extend(pull(payload.trace_id))
                spans = self.materializer.episode(payload)
                payload.release(keep_root=True)
                self.ledger.rendered(payload.trace_id, spans)
                self.stats.add("exported.episodes")
            elif kind == "late":
                trace_id, span = payload
                spans = [self.materializer.span(trace_id, span)]
            else:
                spans = [self.materializer.foreign(s) for s in payload]
        except BaseException as exc:  # noqa: BLE001 - rendering must never kill the thread
            self.stats.add("errors.materialize")
            if kind == "episode":  # counted lost.render_error.<exporter> by the ledger
                self.ledger.dropped_traces(None, (payload.trace_id,), "render_error")
                payload.release(keep_root=True)
            else:
                self.stats.add("dropped.render_error_spans", len(payload) if kind == "spans" else 1)
            self._log_once("materialize", exc)
            return
        for sender in self.senders:
            try:
                sender.offer(spans)
            except BaseException as exc:  # noqa: BLE001
                self.stats.add(f"errors.offer.{sender.name}")
                self._log_once(f"{sender.name}.offer", exc)
                sender.counts.dropped("offer_error", spans)

    def _show_pending(self, snapshots: list[EpisodeRecord], ended: list[int]) -> None:
        """Render pending snapshots and hand them, with the ended trace ids, to every exporter
        that shows them (on this thread: they are few, bounded per step and refresh interval).
        A snapshot that fails to render is left out, an exporter that raises is skipped: both
        counted (``errors.render_pending``, ``errors.show_pending.<exporter>``)."""
        spans: list[ReadableSpan] = []
        rendered = 0
        for snapshot in snapshots:
            try:
                spans.extend(self.materializer.pending(snapshot))
                rendered += 1
            except BaseException as exc:  # noqa: BLE001 - rendering must never kill the thread
                self.stats.add("errors.render_pending")
                self._log_once("render_pending", exc)
        if not rendered and not ended:
            return
        for sender in self.senders:
            viewer = sender.user_exporter
            if not isinstance(viewer, PendingViewer):
                continue
            try:
                viewer.show_pending(spans, ended)
            except BaseException as exc:  # noqa: BLE001 - an exporter bug never reaches training
                self.stats.add(f"errors.show_pending.{sender.name}")
                self._log_once(f"{sender.name}.show_pending", exc)
        if rendered:
            self.stats.add("exported.pending_snapshots", rendered)

    def _call(self, sender: SpoolingSender, method: str, call: Callable[[], object]) -> object:
        """``call()`` (the exporter's ``method``), contained: what it raises is counted and
        logged once, and the answer is False."""
        try:
            return call()
        except BaseException as exc:  # noqa: BLE001 - an exporter bug never reaches training
            self.stats.add(f"errors.{method}.{sender.name}")
            self._log_once(f"{sender.name}.{method}", exc)
            return False

    def _log_once(self, where: str, error: object) -> None:
        kind = type_name(error) if isinstance(error, BaseException) else str(error)
        if not first_time(f"delivery.{where}.{kind}"):
            return
        message = exception_text(error) if isinstance(error, BaseException) else str(error)
        warn("otel_rollouts: %s failed: %s (logged once; counted in otr.stats())", where, message)


def _shut_down(exporter: SpanExporter) -> None:
    """``exporter.shutdown()``, looked up when called (inside ``Delivery._call``'s guard)."""
    exporter.shutdown()
