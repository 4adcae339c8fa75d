"""Delivery layers: each one a ``SpanExporter`` wrapping the next, with one job.

The library puts this stack in front of every exporter it is given (``Delivery``); a user can
put any of them in front of any OpenTelemetry exporter of their own::

    SpoolingSender(           a thread, memory bounded in bytes, backoff, disk retry (spool)
      SplittingExporter(      requests cut under the collector's message-size limit
        CountingExporter(     delivered / failed / not stored, per exporter
          exporter)))

What a layer needs from the one below beyond ``export`` is the ``PartialExporter`` protocol:
which parts of a split batch failed, so that a retry never sends a stored part twice.
"""

from __future__ import annotations

import logging
import threading
import time
from collections.abc import Sequence
from typing import Any, Protocol, runtime_checkable

from opentelemetry.sdk.trace import ReadableSpan
from opentelemetry.sdk.trace.export import SpanExporter, SpanExportResult

from otel_rollouts._core.codec import count_episodes
from otel_rollouts._core.content import exception_text, type_name
from otel_rollouts._core.guard import first_time
from otel_rollouts._core.stats import Stats

__all__ = [
    "CountingExporter",
    "DeliveryCounts",
    "PartialExporter",
    "SplittingExporter",
    "Warner",
    "exporter_name",
    "request_limit",
    "warn",
]

logger = logging.getLogger("otel_rollouts")
WARN_INTERVAL_S = 10.0


def exporter_name(exporter: Any) -> str:
    return type(exporter).__name__


def request_limit(exporter: Any, configured: int | None) -> int | None:
    """The request-size limit to split under for ``exporter``: ``configured`` for a stock OTLP
    exporter (lowered to the exporter's own limit when it has a smaller one), None (no
    splitting) for any other exporter.

    The one place that reads the OTLP exporter's private ``_max_request_size``: the SDK has no
    public accessor for it."""
    module = type(exporter).__module__ or ""
    if not configured or not module.startswith("opentelemetry.exporter.otlp"):
        return None
    own = getattr(exporter, "_max_request_size", None)
    if isinstance(own, int) and 0 < own < configured:
        return own
    return configured


@runtime_checkable
class PartialExporter(Protocol):
    """An exporter that says which parts of a batch failed (the rest were stored)."""

    def export_parts(self, spans: Sequence[ReadableSpan]) -> list[list[ReadableSpan]]:
        """Export ``spans``; return the parts that failed (empty: all stored)."""
        ...


class Warner:
    """At most one warning per kind per interval (the counts are in otr.stats())."""

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
        warn(message, *args)


def warn(message: str, *args: Any) -> None:
    try:
        logger.warning(message, *args)
    except Exception:  # noqa: BLE001 - a broken log handler never breaks delivery
        pass


class DeliveryCounts:
    """The typed counters of one exporter's delivery, behind ``otr.stats()``.

    Every count of the delivery layers goes through a method here, so the keys (``delivered.
    <exporter>``, ``dropped.<reason>.<exporter>``...) are written in one place."""

    def __init__(self, stats: Stats, name: str, warner: Warner | None = None) -> None:
        self.stats = stats
        self.name = name
        self.warner = warner or Warner()

    # the keys, per exporter
    def key(self, what: str) -> str:
        return f"{what}.{self.name}"

    def delivered(self, episodes: int) -> None:
        self.stats.add(self.key("delivered"), episodes)

    def spooled(self, episodes: int) -> None:
        self.stats.add(self.key("spooled"), episodes)

    def failure(self, episodes: int) -> None:
        """A request that failed, and the episodes in it. They are retried, so a receiver that
        stored the request before the client gave up sees them twice: delivery is at least
        once, and the duplicates are bounded by ``export.failed_episodes``."""
        self.stats.add(self.key("export.failures"))
        self.stats.add(self.key("export.failed_episodes"), episodes)

    def error(self, where: str) -> None:
        """An exception contained in ``where`` (export, sender, spool)."""
        self.stats.add(f"errors.{where}.{self.name}")

    def split_requests(self, extra: int) -> None:
        self.stats.add(self.key("export.split_requests"), extra)

    def oversize_span(self) -> None:
        self.stats.add(self.key("dropped.oversize_spans"))

    def quarantined(self) -> None:
        self.stats.add(self.key("spool.quarantined"))

    def dropped(self, reason: str, episodes: int) -> None:
        """Episodes lost for ``reason``: counted per exporter and in all, warned at most once
        per interval."""
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

    def dropped_episodes(self) -> int:
        """Episodes this exporter lost, every reason together (spans are not episodes)."""
        totals = self.stats.snapshot()["totals"]
        suffix = "." + self.name
        return sum(
            v for k, v in totals.items()
            if k.startswith("dropped.") and k.endswith(suffix) and k != self.key("dropped.oversize_spans")
        )

    def total(self, what: str) -> int:
        return self.stats.total(self.key(what))

    def log_once(self, what: str, message: str) -> None:
        if not first_time(f"exporter.{self.name}.{what}"):
            return
        warn("otel_rollouts: exporter %s: %s (logged once; counted in otr.stats())", self.name, message)


class CountingExporter(SpanExporter):
    """Counts what ``exporter`` stored, failed and took without storing; contains its errors.

    An exception from the exporter (even ``SystemExit``) is a failed export, never a dead
    thread. An exporter may implement ``take_not_stored() -> {reason: episodes}``: episodes it
    took but did not store (Trackio skips a trace it cannot write) are counted lost, not
    delivered."""

    def __init__(self, exporter: SpanExporter, counts: DeliveryCounts | None = None) -> None:
        self.exporter = exporter
        self.counts = counts if counts is not None else DeliveryCounts(Stats(), exporter_name(exporter))

    def export(self, spans: Sequence[ReadableSpan]) -> SpanExportResult:
        try:
            result = self.exporter.export(spans)
        except BaseException as exc:  # noqa: BLE001 - an exporter bug never kills the sender
            self.counts.error("export")
            self.counts.log_once(f"export.{type_name(exc)}", f"export raised {exception_text(exc)}")
            result = SpanExportResult.FAILURE
        if result is SpanExportResult.FAILURE:
            self.counts.failure(count_episodes(spans))
            self.counts.log_once("export.FAILURE", "export returned FAILURE (will retry from the spool)")
            return SpanExportResult.FAILURE
        lost = self._not_stored()
        self.counts.delivered(max(count_episodes(spans) - sum(lost.values()), 0))
        for reason, episodes in lost.items():
            self.counts.dropped(reason, episodes)
        return SpanExportResult.SUCCESS

    def _not_stored(self) -> dict[str, int]:
        take = getattr(self.exporter, "take_not_stored", None)
        if not callable(take):
            return {}
        try:
            lost = take()
            return {str(k): int(v) for k, v in dict(lost or {}).items() if int(v) > 0}
        except BaseException as exc:  # noqa: BLE001 - an exporter bug never kills the sender
            self.counts.log_once("take_not_stored", f"take_not_stored raised {exception_text(exc)}")
            return {}

    def force_flush(self, timeout_millis: int = 30000) -> bool:
        return bool(self.exporter.force_flush(timeout_millis))

    def shutdown(self) -> None:
        self.exporter.shutdown()


class SplittingExporter(SpanExporter):
    """Cuts a batch into requests under ``max_request_bytes`` (encoded OTLP size): a collector
    refuses a larger message whole (gRPC's default limit is 4 MiB). A single span over the limit
    is dropped, counted. ``max_request_bytes=None`` passes batches through."""

    def __init__(self, exporter: SpanExporter, max_request_bytes: int | None,
                 counts: DeliveryCounts | None = None) -> None:
        self.exporter = exporter
        self.max_request_bytes = max_request_bytes
        self.counts = counts

    def export_parts(self, spans: Sequence[ReadableSpan]) -> list[list[ReadableSpan]]:
        parts = self.split(list(spans)) if self.max_request_bytes else [list(spans)]
        failed: list[list[ReadableSpan]] = []
        for part in parts:
            if part and self.exporter.export(part) is SpanExportResult.FAILURE:
                failed.append(part)
        return failed

    def export(self, spans: Sequence[ReadableSpan]) -> SpanExportResult:
        return SpanExportResult.FAILURE if self.export_parts(spans) else SpanExportResult.SUCCESS

    def split(self, spans: list[ReadableSpan]) -> list[list[ReadableSpan]]:
        from opentelemetry.exporter.otlp.proto.common.trace_encoder import encode_spans

        limit = self.max_request_bytes or 0
        out: list[list[ReadableSpan]] = []
        stack = [spans]
        while stack:
            part = stack.pop()
            if encode_spans(part).ByteSize() <= limit:
                out.append(part)
            elif len(part) == 1:
                if self.counts is not None:
                    self.counts.oversize_span()
                    self.counts.dropped("oversize", count_episodes(part))
            else:
                half = len(part) // 2
                stack.append(part[half:])
                stack.append(part[:half])
        if len(out) > 1 and self.counts is not None:
            self.counts.split_requests(len(out) - 1)
        return out

    def force_flush(self, timeout_millis: int = 30000) -> bool:
        return bool(self.exporter.force_flush(timeout_millis))

    def shutdown(self) -> None:
        self.exporter.shutdown()
