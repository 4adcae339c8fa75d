"""Delivery layers: each one a ``SpanExporter`` wrapping the next, with one job.

The library puts this stack in front of every exporter it is given (``Delivery``); a user can
put any of them in front of any OpenTelemetry exporter of their own::

    SpoolingSender(           a thread, memory bounded in bytes, backoff, disk retry (spool)
      SplittingExporter(      requests cut under the collector's message-size limit
        CountingExporter(     delivered / failed / not stored, per exporter
          exporter)))

What a layer needs from the one below beyond ``export`` is a protocol, found with ``isinstance``:
``PartialExporter`` (which parts of a split batch failed, so that a retry never sends a stored
part twice) and ``RequestSender`` (how one request went: refused requests are split). What the
library needs from a user's exporter beyond ``export`` are the protocols of
``otel_rollouts.exporters.extras`` (``NotStoredReporter`` here).
"""

from __future__ import annotations

import logging
import threading
import time
from collections.abc import Iterable, Sequence
from typing import Protocol, runtime_checkable

from opentelemetry.sdk.trace import ReadableSpan
from opentelemetry.sdk.trace.export import SpanExporter, SpanExportResult

from otel_rollouts import conventions as c
from otel_rollouts._core.codec import count_episodes
from otel_rollouts._core.content import exception_text, type_name
from otel_rollouts._core.guard import first_time
from otel_rollouts._core.stats import Stats
from otel_rollouts.delivery.ledger import Ledger
from otel_rollouts.delivery.otlp_probe import OtlpProbe
from otel_rollouts.exporters.extras import NotStoredReporter

__all__ = [
    "CountingExporter",
    "DeliveryCounts",
    "PartialExporter",
    "RequestSender",
    "SplittingExporter",
    "Warner",
    "exporter_name",
    "request_limit",
    "take_not_stored",
    "warn",
]

logger = logging.getLogger("otel_rollouts")
WARN_INTERVAL_S = 10.0


def exporter_name(exporter: object) -> str:
    return type(exporter).__name__


def request_limit(exporter: object, configured: int | None) -> int | None:
    """The request-size limit to split under for ``exporter``: ``configured`` for a stock OTLP
    exporter (lowered to the exporter's own limit when it has a smaller one), None (no
    splitting) for any other exporter.

    The one place that reads the OTLP exporter's private ``_max_request_size``: the SDK has no
    public accessor for it."""
    module = type(exporter).__module__ or ""
    # the SDK's OTLP exporters, and ours for OTLP/JSON (built on the SDK's HTTP ones)
    if not configured or not module.startswith(("opentelemetry.exporter.otlp", "otel_rollouts.exporters.otlp_http_json")):
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


@runtime_checkable
class RequestSender(Protocol):
    """A layer that tells how one request went (``CountingExporter.send``): ``"ok"``,
    ``"failed"`` (retry later) or ``"refused"`` (the collector refuses this request for good:
    ``SplittingExporter`` splits it)."""

    def send(self, spans: Sequence[ReadableSpan]) -> str:
        """Export ``spans`` once and say how it went."""
        ...


class Warner:
    """At most one warning per kind per interval (the counts are in otr.stats())."""

    def __init__(self, interval: float = WARN_INTERVAL_S) -> None:
        self.interval = interval
        self._last: dict[str, float] = {}
        self._lock = threading.Lock()

    def warn(self, kind: str, message: str, *args: object) -> None:
        now = time.monotonic()
        with self._lock:
            last = self._last.get(kind)
            if last is not None and now - last < self.interval:
                return
            self._last[kind] = now
        warn(message, *args)


def warn(message: str, *args: object) -> None:
    try:
        logger.warning(message, *args)
    except Exception:  # noqa: BLE001 - a broken log handler never breaks delivery
        pass


class DeliveryCounts:
    """The typed counters of one exporter's delivery, behind ``otr.stats()``.

    Every count of the delivery layers goes through a method here, so the keys (``delivered.
    <exporter>``, ``lost.<reason>.<exporter>``...) are written in one place. What happened to
    episodes is decided by the ``Ledger`` from what happened to their spans; without one (a layer
    used on its own, in front of a user's exporter), a private ledger counts episodes by their
    root spans."""

    def __init__(self, stats: Stats, name: str, warner: Warner | None = None,
                 ledger: Ledger | None = None) -> None:
        self.stats = stats
        self.name = name
        self.warner = warner or Warner()
        self.ledger = ledger if ledger is not None else Ledger(stats, [name], auto_enter=True)
        self.ledger.add_drop_listener(name, self._warn_drop)

    # the keys, per exporter
    def key(self, what: str) -> str:
        return f"{what}.{self.name}"

    def stored(self, spans: Sequence[ReadableSpan]) -> None:
        """The exporter confirmed it stored ``spans``."""
        self.ledger.stored(self.name, spans)

    def spooled(self, episodes: int) -> None:
        self.stats.add(self.key("spooled"), episodes)

    def failure(self, episodes: int) -> None:
        """A request that failed, and the episodes in it. They are retried, so a receiver that
        stored the request before the client gave up sees them twice: delivery is at least
        once, and the duplicates are bounded by ``export.failed_episodes``."""
        self.stats.add(self.key("export.failures"))
        self.stats.add(self.key("export.failed_episodes"), episodes)

    def refused(self, episodes: int) -> None:
        """A request the collector refused for good (it is split, or dropped)."""
        self.stats.add(self.key("export.refused"))
        self.stats.add(self.key("export.refused_episodes"), episodes)

    def error(self, where: str) -> None:
        """An exception contained in ``where`` (export, sender, spool)."""
        self.stats.add(f"errors.{where}.{self.name}")

    def split_requests(self, extra: int) -> None:
        self.stats.add(self.key("export.split_requests"), extra)

    def oversize_span(self) -> None:
        self.stats.add(self.key("dropped.oversize_spans"))

    def quarantined(self) -> None:
        self.stats.add(self.key("spool.quarantined"))

    def dropped(self, reason: str, spans: Sequence[ReadableSpan]) -> int:
        """``spans`` given up for ``reason``: the episodes they belong to are lost (the ledger
        counts each once, per exporter and in all, and a warning goes out at most once per
        interval). Returns the episodes dropped."""
        return self.ledger.dropped(self.name, spans, reason)

    def adopt(self, spans: Sequence[ReadableSpan]) -> None:
        """A batch a previous run left in the spool: its episodes enter the ledger."""
        if not self.ledger.auto_enter:
            self.ledger.adopt(self.name, spans)

    def dropped_traces(self, reason: str, trace_ids: Iterable[int], unknown: int = 0) -> int:
        """Episodes known by trace id given up for ``reason``; ``unknown``: episodes of a batch
        this process did not write (a previous run's spool), counted by number."""
        return self.ledger.dropped_traces(self.name, trace_ids, reason) + self.ledger.dropped_count(
            self.name, reason, unknown)

    def _warn_drop(self, reason: str, episodes: int) -> None:
        self.warner.warn(
            f"{reason}.{self.name}",
            "%s: dropped %d episode(s) (%s); total so far %d (counted in otr.stats())",
            self.name,
            episodes,
            reason,
            self.stats.total(f"lost.{reason}.{self.name}"),
        )

    def dropped_episodes(self) -> int:
        """Episodes this exporter lost, every reason together (spans are not episodes)."""
        totals = self.stats.snapshot()["totals"]
        suffix = "." + self.name
        return sum(v for k, v in totals.items() if k.startswith("lost.") and k.endswith(suffix))

    def total(self, what: str) -> int:
        return self.stats.total(self.key(what))

    def log_once(self, what: str, message: str) -> None:
        if not first_time(f"exporter.{self.name}.{what}"):
            return
        warn("otel_rollouts: exporter %s: %s (logged once; counted in otr.stats())", self.name, message)


OK, FAILED, REFUSED = "ok", "failed", "refused"  # what one request came to (CountingExporter.send)


def take_not_stored(exporter: object, spans: Sequence[ReadableSpan]) -> dict[str, set[int]]:
    """What ``exporter`` took in its last export of ``spans`` but did not store: reason -> trace
    ids, from its ``take_not_stored() -> {reason: [trace ids]}`` (Trackio checks its write; an
    exporter without the method stored everything it took). A count instead of ids (an older
    exporter) is taken as that many of the batch's episodes, in order. What the method raises
    is reported as a reason with no ids (``KeyboardInterrupt`` passes: Ctrl-C during a replay)."""
    if not isinstance(exporter, NotStoredReporter):
        return {}
    try:
        taken = exporter.take_not_stored()
    except KeyboardInterrupt:
        raise
    except BaseException as exc:  # noqa: BLE001 - a hostile exporter: reported, nothing trusted
        return {f"take_not_stored raised {exception_text(exc)}": set()}
    out: dict[str, set[int]] = {}
    roots: list[int] | None = None
    for reason, value in dict(taken or {}).items():  # a Mapping, or what a hostile one returned
        if isinstance(value, int):
            if roots is None:
                roots = [s.context.trace_id for s in spans if s.context is not None
                         and (s.attributes or {}).get(c.RL_SPAN_KIND) == c.KIND_EPISODE]
            ids, roots = roots[:value], roots[value:]
        else:
            ids = [t for t in value if isinstance(t, int)]
        if ids:
            out.setdefault(str(reason), set()).update(ids)
    return out


class CountingExporter(SpanExporter):
    """Reports to the ledger what ``exporter`` stored and did not; contains its errors.

    An exception from the exporter (even ``SystemExit``) is a failed export, never a dead
    thread. A ``SUCCESS`` is confirmed, not trusted: spans a collector rejected in its
    ``partial_success`` (a stock OTLP exporter, read through ``OtlpProbe``) and episodes the
    exporter says it took without storing (``take_not_stored() -> {reason: [trace ids]}``:
    Trackio checks its write) are dropped under that reason, not delivered."""

    def __init__(self, exporter: SpanExporter, counts: DeliveryCounts | None = None) -> None:
        self.exporter = exporter
        self.counts = counts if counts is not None else DeliveryCounts(Stats(), exporter_name(exporter))
        self.probe = OtlpProbe.attach(exporter)

    def send(self, spans: Sequence[ReadableSpan]) -> str:
        """Export ``spans`` once: ``OK`` (what was stored is reported, the rest dropped),
        ``FAILED`` (retry later) or ``REFUSED`` (the collector refuses this request for good:
        split it or drop it; retrying it as it is would fail again)."""
        probe = self.probe
        if probe is not None:
            probe.begin()
        try:
            result = self.exporter.export(spans)
        except BaseException as exc:  # noqa: BLE001 - an exporter bug never kills the sender
            self.counts.error("export")
            self.counts.log_once(f"export.{type_name(exc)}", f"export raised {exception_text(exc)}")
            result = SpanExportResult.FAILURE
        answer = probe.answer() if probe is not None else None
        if result is not SpanExportResult.SUCCESS:
            if answer is not None and answer.refused:
                self.counts.refused(count_episodes(spans))
                self.counts.log_once(f"export.refused.{answer.code}",
                                     f"the collector refused a request ({answer.code} {answer.message}); "
                                     "it is split and what is still refused is dropped")
                return REFUSED
            self.counts.failure(count_episodes(spans))
            self.counts.log_once("export.FAILURE", "export returned FAILURE (will retry from the spool)")
            return FAILED
        if answer is not None and answer.unreadable:
            # a 2xx whose body is no OTLP response (junk after a partial_success, a proxy's
            # page): nothing says what was stored, so nothing of this request counts as stored
            self.counts.log_once("export.unconfirmed",
                                 f"the collector accepted a request with {answer.message}; its "
                                 "episodes are counted dropped (unconfirmed), not delivered")
            self.counts.dropped("unconfirmed", spans)
            return OK
        if answer is not None and answer.rejected_spans > 0:
            # the collector says how many spans it rejected, not which: no episode of this
            # request is confirmed stored
            reason = "rejected" if answer.rejected_spans >= len(spans) else "partially_rejected"
            self.counts.log_once(f"export.{reason}",
                                 f"the collector rejected {answer.rejected_spans} of {len(spans)} spans "
                                 f"({answer.message}); their episodes are counted dropped ({reason})")
            self.counts.dropped(reason, spans)
            return OK
        lost = self._not_stored(spans)
        if lost:
            gone = set().union(*lost.values())
            self.counts.stored([s for s in spans if s.context is None or s.context.trace_id not in gone])
            for reason, traces in lost.items():
                self.counts.dropped(reason, [s for s in spans if s.context is not None
                                             and s.context.trace_id in traces])
        else:
            self.counts.stored(spans)
        return OK

    def export(self, spans: Sequence[ReadableSpan]) -> SpanExportResult:
        return SpanExportResult.SUCCESS if self.send(spans) == OK else SpanExportResult.FAILURE

    def _not_stored(self, spans: Sequence[ReadableSpan]) -> dict[str, set[int]]:
        lost = take_not_stored(self.exporter, spans)
        for reason, ids in list(lost.items()):
            if not ids:  # an answer that names no episode (it raised): said, nothing dropped
                self.counts.log_once("take_not_stored", reason)
                del lost[reason]
        return lost

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
        while parts:
            part = parts.pop()
            if not part:
                continue
            outcome = self._send(part)
            if outcome == FAILED:
                failed.append(part)
            elif outcome == REFUSED:
                # refused for good: halve it (whole episodes first) until what is refused is one
                # span, which is dropped with its episode; the rest goes on
                if len(part) > 1:
                    ordered = sorted(part, key=lambda s: s.context.trace_id if s.context else 0)
                    half = len(ordered) // 2
                    parts.append(ordered[half:])
                    parts.append(ordered[:half])
                    if self.counts is not None:
                        self.counts.split_requests(1)
                elif self.counts is not None:
                    self.counts.dropped("refused", part)
        failed.reverse()
        return failed

    def _send(self, part: list[ReadableSpan]) -> str:
        if isinstance(self.exporter, RequestSender):
            return str(self.exporter.send(part))
        return OK if self.exporter.export(part) is SpanExportResult.SUCCESS else FAILED

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
                    self.counts.dropped("oversize", part)
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
