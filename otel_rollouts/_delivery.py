"""Delivery: one background thread renders kept episodes and hands them to the exporters.

The training thread only enqueues (never blocks: a full queue drops and counts). Each exporter
call is guarded: an exporter that raises or fails is counted and logged once per exporter and
error type, and the other exporters still receive.
"""

from __future__ import annotations

import logging
import queue
import threading
import time
from collections.abc import Sequence
from typing import Any

from opentelemetry.sdk.trace import ReadableSpan
from opentelemetry.sdk.trace.export import SpanExporter, SpanExportResult

from otel_rollouts._materialize import Materializer
from otel_rollouts._recording import EpisodeRecord, SpanRecord
from otel_rollouts._stats import Stats

logger = logging.getLogger("otel_rollouts")

_STOP = object()


class _Marker:
    __slots__ = ("event",)

    def __init__(self) -> None:
        self.event = threading.Event()


def exporter_name(exporter: Any) -> str:
    return type(exporter).__name__


class Delivery:
    """A bounded queue and the thread that drains it into the exporters."""

    def __init__(
        self,
        exporters: Sequence[SpanExporter],
        materializer: Materializer,
        stats: Stats,
        max_queue: int = 1024,
    ) -> None:
        self.exporters = list(exporters)
        self.materializer = materializer
        self.stats = stats
        self._queue: queue.Queue = queue.Queue(maxsize=max_queue)
        self._logged: set[tuple[str, str]] = set()
        self._last_full_warning = 0.0
        self._thread = threading.Thread(target=self._run, name="otel-rollouts-export", daemon=True)
        self._thread.start()

    # --- called from the training side -------------------------------------------------------
    def episode(self, record: EpisodeRecord) -> None:
        self._put(("episode", record), "episodes")

    def late_span(self, record: EpisodeRecord, span: SpanRecord) -> None:
        self._put(("late", (record.trace_id, span)), "spans")

    def spans(self, spans: list[ReadableSpan]) -> None:
        self._put(("spans", spans), "spans")

    def _put(self, item: Any, what: str) -> None:
        try:
            self._queue.put_nowait(item)
        except queue.Full:
            self.stats.add(f"dropped.queue_full.{what}")
            now = time.monotonic()
            if now - self._last_full_warning > 10.0:
                self._last_full_warning = now
                logger.warning(
                    "otel_rollouts: export queue full (%d items); dropping %s. Total dropped: %s",
                    self._queue.maxsize,
                    what,
                    self.stats.total(f"dropped.queue_full.{what}"),
                )

    def flush(self, timeout: float) -> bool:
        """Wait until everything queued before this call went to the exporters."""
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
        for exporter in self.exporters:
            remaining_ms = int(max(deadline - time.monotonic(), 0.0) * 1000)
            ok = self._call(exporter, "force_flush", remaining_ms) is not False and ok
        return ok

    def shutdown(self, timeout: float) -> bool:
        deadline = time.monotonic() + timeout
        flushed = self.flush(timeout)
        try:
            self._queue.put(_STOP, timeout=max(deadline - time.monotonic(), 0.001))
        except queue.Full:
            pass
        self._thread.join(max(deadline - time.monotonic(), 0.0))
        # exporters' shutdown may hang on a dead network: run it where we can stop waiting
        closer = threading.Thread(target=self._shutdown_exporters, daemon=True)
        closer.start()
        closer.join(max(deadline - time.monotonic(), 0.0))
        return flushed and not self._thread.is_alive() and not closer.is_alive()

    def _shutdown_exporters(self) -> None:
        for exporter in self.exporters:
            self._call(exporter, "shutdown")

    # --- the export thread ---------------------------------------------------------------------
    def _run(self) -> None:
        while True:
            item = self._queue.get()
            if item is _STOP:
                return
            if isinstance(item, _Marker):
                item.event.set()
                continue
            try:
                kind, payload = item
                if kind == "episode":
                    spans = self.materializer.episode(payload)
                    self.stats.add("exported.episodes")
                elif kind == "late":
                    trace_id, span = payload
                    spans = [self.materializer.span(trace_id, span)]
                else:
                    spans = payload
            except Exception as exc:  # noqa: BLE001 - rendering must never kill the thread
                self._log_once("materialize", exc)
                self.stats.add("errors.materialize")
                continue
            for exporter in self.exporters:
                result = self._call(exporter, "export", spans)
                if result is SpanExportResult.FAILURE:
                    self.stats.add(f"errors.export.{exporter_name(exporter)}")
                    self._log_once(exporter_name(exporter), "export returned FAILURE")

    def _call(self, exporter: Any, method: str, *args: Any) -> Any:
        try:
            return getattr(exporter, method)(*args)
        except Exception as exc:  # noqa: BLE001 - an exporter bug never reaches training
            self.stats.add(f"errors.{method}.{exporter_name(exporter)}")
            self._log_once(f"{exporter_name(exporter)}.{method}", exc)
            return False

    def _log_once(self, where: str, error: Any) -> None:
        key = (where, type(error).__name__ if isinstance(error, BaseException) else str(error))
        if key in self._logged:
            return
        self._logged.add(key)
        logger.warning("otel_rollouts: %s failed: %s (logged once; counted in otr.stats())", where, error)
