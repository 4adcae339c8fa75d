"""The pipeline's front to telemetry it did not record itself, joined to the episodes it holds.

Spans of other OpenTelemetry instrumentation inside an episode (the ``SpanProcessor`` calls),
finished spans of worker tasks (``adopt``) and worker tasks' log records (``join_logs``) are held
with their episode while it is undecided, sent on if it is kept and dropped (counted) if it is
dropped; what arrives outside any episode passes straight through. A client span that starts
outside any episode (an eval request, a health check, a weight sync) is announced to the node's
span gateway, if the run has one, so that the server spans of that request pass through there
(``GatewaySink.outside``). This part owns what only it needs: the open foreign spans and the
bytes held, all episodes together. The pipeline owns the episodes and the lock; this part holds a reference to it and
changes state only under the pipeline's lock, exactly as the pipeline itself does.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from contextlib import AbstractContextManager
from typing import Any, Protocol

from opentelemetry import trace
from opentelemetry.sdk.trace import ReadableSpan
from opentelemetry.trace import SpanKind

from otel_rollouts._core.spans import KEPT, OFFERED, OPEN, EpisodeRecord, SpanRecord
from otel_rollouts._core.stats import Stats
from otel_rollouts.delivery.dispatch import Delivery

_MAX_FOREIGN_OPEN = 65_536  # open foreign spans tracked inside episodes (a leak guard)
# what other processes sent for undecided episodes (worker tasks' log records), held with them
# until they are decided: all episodes together
_MAX_HELD_BYTES = 64 * 1024 * 1024
_OUTBOUND = (SpanKind.CLIENT, SpanKind.PRODUCER)


class GatewaySink(Protocol):
    """The node's span gateway, as the pipeline tells it about traces (``correlate.gateway``):
    each call only queues a trace id (the training thread never waits)."""

    def opened(self, trace_id: int) -> None: ...
    def decided(self, trace_id: int, kept: bool) -> None: ...
    def outside(self, trace_id: int) -> None: ...


class ForeignHost(Protocol):
    """What this part needs of the pipeline: its lock, its undecided episodes, its outlets."""

    @property
    def stats(self) -> Stats: ...
    @property
    def delivery(self) -> Delivery: ...
    @property
    def gateway(self) -> GatewaySink | None: ...
    @property
    def lock(self) -> AbstractContextManager[Any]:
        """The lock every change of the episodes' state is made under."""
        ...
    @property
    def live(self) -> dict[int, EpisodeRecord]:
        """Trace id → episode not yet decided (read without the lock: single lookups)."""
        ...


class Foreign:
    """Joins foreign spans and log records to the pipeline's held episodes."""

    def __init__(self, host: ForeignHost) -> None:
        self._host = host
        self._open: dict[int, EpisodeRecord] = {}  # open foreign span id → its episode
        self._held_bytes = 0

    # --- SpanProcessor: spans of other OpenTelemetry instrumentation ---------------------------
    def on_start(self, span: Any, parent_context: Any = None) -> None:
        """Note which episode a foreign span belongs to (its parent is an episode span, or a
        foreign span already noted)."""
        parent = trace.get_current_span(parent_context)
        record: EpisodeRecord | None
        if isinstance(parent, SpanRecord):
            record = parent.episode
        else:
            ctx = parent.get_span_context()
            record = self._open.get(ctx.span_id) if ctx.is_valid else None
            if record is None:
                gateway = self._host.gateway
                if gateway is not None and getattr(span, "kind", None) in _OUTBOUND:
                    gateway.outside(span.context.trace_id)  # its server's spans pass through
                return
        if len(self._open) < _MAX_FOREIGN_OPEN:
            self._open[span.context.span_id] = record
        else:
            self._host.stats.add("dropped.foreign_untracked")

    def on_end(self, span: ReadableSpan) -> None:
        """A foreign span ended: held with its undecided episode, exported with a kept one,
        dropped with a dropped one; one of no episode passes straight through."""
        host = self._host
        record = self._open.pop(span.context.span_id, None)
        if record is None:
            if span.context.trace_id in host.live:
                # a foreign span of an episode we could not track: never export a fragment
                host.stats.add("dropped.late_spans")
                return
            host.delivery.spans([span])  # not part of any episode: passes through
            return
        with host.lock:
            if record.state in (OPEN, OFFERED):
                if len(record.spans) + len(record.foreign) < record.max_spans:
                    record.foreign.append(span)
                else:
                    record.dropped_spans += 1
                return
        if record.state == KEPT:
            host.delivery.spans([span])  # ended after its episode was kept
        else:  # DROPPED: nothing of a dropped episode is exported
            host.stats.add("dropped.late_spans")

    def adopt(self, spans: list[ReadableSpan], record: EpisodeRecord | None = None) -> None:
        """Finished spans made in another process (a worker task) for an episode held here:
        held with it while undecided, exported if it was kept, dropped (counted) otherwise."""
        host = self._host
        late: list[ReadableSpan] = []
        with host.lock:
            for span in spans:
                trace_id = span.context.trace_id
                owner = record if record is not None and record.trace_id == trace_id else None
                owner = owner or host.live.get(trace_id)
                if owner is not None and owner.state in (OPEN, OFFERED):
                    if len(owner.spans) + len(owner.foreign) < owner.max_spans:
                        owner.foreign.append(span)
                    else:
                        owner.dropped_spans += 1
                elif owner is not None and owner.state == KEPT:
                    late.append(span)
                else:  # dropped, or decided so long ago that it is not known any more
                    host.stats.add("dropped.late_spans")
        if late:
            host.delivery.spans(late)

    # --- telemetry of other processes: worker tasks' logs ------------------------------------
    def release(self, record: EpisodeRecord) -> None:
        """``record`` was decided: the bytes held for it are given back. Under the pipeline's lock."""
        self._held_bytes -= record.held_bytes
        record.held_bytes = 0

    def _owner(self, trace_id: int, record: EpisodeRecord | None) -> tuple[EpisodeRecord | None, bool | None]:
        """The undecided episode of ``trace_id``, else whether it was kept (None: unknown)."""
        if record is not None and record.trace_id == trace_id and record.state in (OPEN, OFFERED):
            return record, None
        owner = self._host.live.get(trace_id)
        if owner is not None and owner.state in (OPEN, OFFERED):
            return owner, None
        if record is not None and record.trace_id == trace_id and record.state >= KEPT:
            return None, record.state == KEPT
        return None, None

    def _hold(self, record: EpisodeRecord, size: int) -> bool:
        """Count ``size`` more bytes held for ``record``; False (nothing counted) past the cap."""
        if self._held_bytes + size > _MAX_HELD_BYTES:
            return False
        self._held_bytes += size
        record.held_bytes += size
        return True

    def join_logs(self, trace_id: int, logs: Sequence[Any], outlet: Callable[[Sequence[Any]], None],
                  size: int, record: EpisodeRecord | None = None) -> bool:
        """Log records of episode ``trace_id`` (any objects ``outlet`` takes, e.g. SDK log
        records): held with it while undecided and handed to ``outlet`` if it is kept; handed
        over at once if it was kept already; dropped (counted ``dropped.episode_logs``) if it
        was or will be dropped. ``size``: their bytes (all held records are bounded together).
        False: the trace is no episode known here, nothing was done (the caller sends them on)."""
        if not logs:
            return True
        host = self._host
        with host.lock:
            owner, kept = self._owner(trace_id, record)
            if owner is not None:
                if not self._hold(owner, size):
                    host.stats.add("dropped.held_bytes_full.logs", len(logs))
                    return True
                if owner.logs is None:
                    owner.logs = []
                owner.logs.append((outlet, logs, size))
                return True
            if kept is None:
                return False
            if not kept:
                host.stats.add("dropped.episode_logs", len(logs))
                return True
        self.send_logs(outlet, logs)
        return True

    def send_logs(self, outlet: Callable[[Sequence[Any]], None], logs: Sequence[Any]) -> None:
        """Hand log records of a kept episode to their outlet (a failing outlet is counted)."""
        try:
            outlet(logs)
        except Exception:  # noqa: BLE001 - a log outlet never breaks the pipeline
            self._host.stats.add("errors.episode_logs", len(logs))
