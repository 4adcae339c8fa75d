"""What the node's span gateway holds: other processes' spans and log records, as bytes, per trace,
until the episode of that trace is decided.

The gateway process (``correlate.gateway_node``) receives OTLP from inference servers; this part
decides what happens to each span and record, and holds what must wait. Nothing here touches a
socket: it takes parsed OTLP requests and returns what to export, so that it can be tested, and
reasoned about, on its own.

A trace is in one of these states, learned from the recording processes over the local channel:

* **open**: an episode of a recording process, undecided. Its spans and records are held.
* **kept**: decided kept. Held spans wait for the renderer to *pull* them (so they join the
  episode's own tree and lend their timings to its generation spans); what arrives after the
  pull, or what nobody pulls within ``hold_s``, is exported by the gateway (late spans). Its log
  records are exported at once.
* **dropped**: decided dropped. Everything of it is dropped and counted: no orphan fragment.
* **outside**: a request made outside any episode (a recording process saw the client span
  start outside an episode). Its spans and records pass through at once.
* **unknown**: none of the above (yet). A span with no parent passes through at once (it cannot
  be part of an episode); the rest is held up to ``hold_s`` in case its episode is announced,
  then let go by the ``unknown`` rule: dropped, or exported.

Everything held is bytes (each span's and record's own protobuf encoding, plus the encoding of its
resource and scope, shared), counted at what it costs in memory, bounded all together by
``max_held_bytes``. What does not fit is dropped and counted. States are remembered for the last
``max_traces`` traces (about 200 bytes each).
"""

from __future__ import annotations

import time
from collections import OrderedDict
from collections.abc import Iterable
from dataclasses import dataclass, field

from opentelemetry.proto.collector.logs.v1.logs_service_pb2 import ExportLogsServiceRequest
from opentelemetry.proto.collector.trace.v1.trace_service_pb2 import ExportTraceServiceRequest
from opentelemetry.proto.logs.v1.logs_pb2 import LogRecord as PbLogRecord
from opentelemetry.proto.logs.v1.logs_pb2 import ResourceLogs, ScopeLogs
from opentelemetry.proto.trace.v1.trace_pb2 import ResourceSpans, ScopeSpans
from opentelemetry.proto.trace.v1.trace_pb2 import Span as PbSpan

__all__ = ["DROPPED", "FULL_LOGS", "FULL_SPANS", "KEPT", "OPEN", "OUTSIDE", "Outcome", "Store"]

OPEN, KEPT, PULLED, DROPPED, OUTSIDE = "open", "kept", "pulled", "dropped", "outside"
FULL_SPANS, FULL_LOGS = "dropped.held_bytes_full.spans", "dropped.held_bytes_full.logs"
SPAN, LOG = "span", "log"
# what an item costs beyond its own bytes: the bytes object's header, its tuple and list slot
ITEM_OVERHEAD = 160
TRACE_OVERHEAD = 400  # a trace's entry while it holds something: its object, dict slot, list
ORIGIN_OVERHEAD = 200
_EVICT_BATCH = 1024  # traces forgotten together, so that forgetting costs O(1) a trace


@dataclass
class Outcome:
    """What the caller does after one call: requests to export, and counts to add (by name)."""

    spans: list[bytes] = field(default_factory=list)  # encoded ExportTraceServiceRequests
    logs: list[bytes] = field(default_factory=list)  # encoded ExportLogsServiceRequests
    counts: dict[str, int] = field(default_factory=dict)
    owners: dict[str, dict[str, int]] = field(default_factory=dict)  # counts per owning client

    def count(self, name: str, n: int = 1, owner: str | None = None) -> None:
        if n <= 0:
            return
        if owner is None:
            self.counts[name] = self.counts.get(name, 0) + n
        else:
            mine = self.owners.setdefault(owner, {})
            mine[name] = mine.get(name, 0) + n

    def merge(self, other: Outcome) -> None:
        self.spans.extend(other.spans)
        self.logs.extend(other.logs)
        for name, n in other.counts.items():
            self.count(name, n)
        for owner, counts in other.owners.items():
            for name, n in counts.items():
                self.count(name, n, owner)


class _Trace:
    __slots__ = ("trace_id", "state", "owner", "items", "bytes", "deadline")

    def __init__(self, trace_id: int, state: str | None, owner: str | None, deadline: float) -> None:
        self.trace_id = trace_id
        self.state = state  # None: unknown
        self.owner = owner  # the client that announced it
        self.items: list[tuple[str, int, bytes]] = []  # (kind, origin key, encoding)
        self.bytes = 0
        self.deadline = deadline


class Store:
    """The gateway's held spans and records, and what it knows of each trace (see the module)."""

    def __init__(self, *, max_held_bytes: int, hold_s: float, unknown: str = "drop",
                 max_traces: int = 65_536, max_spans_per_trace: int = 4_096) -> None:
        self.max_held_bytes = max_held_bytes
        self.hold_s = hold_s
        self.unknown = unknown
        self.max_traces = max_traces
        self.max_spans_per_trace = max_spans_per_trace
        self.held_bytes = 0
        self._traces: OrderedDict[int, _Trace] = OrderedDict()
        self._holding: dict[int, _Trace] = {}  # the traces holding something
        self._gone: set[str] = set()  # clients that left: their open episodes will never be decided
        # (kind, resource+scope header) -> [key, refcount]; key -> (kind, header)
        self._origin_keys: dict[tuple[str, bytes], list[int]] = {}
        self._origins: dict[int, tuple[str, bytes]] = {}
        self._next_origin = 0

    # --- what the recording processes say --------------------------------------------------
    def opened(self, owner: str, trace_ids: Iterable[int], now: float | None = None) -> None:
        """Episodes of ``owner`` began: what arrives for them is held until they are decided."""
        now = time.monotonic() if now is None else now
        for trace_id in trace_ids:
            entry = self._entry(trace_id, now)
            if entry.state is None:
                entry.state, entry.owner = OPEN, owner

    def outside(self, trace_ids: Iterable[int], now: float | None = None) -> Outcome:
        """Requests made outside any episode: what was held of them passes through, and so will
        what arrives later."""
        now = time.monotonic() if now is None else now
        out = Outcome()
        for trace_id in trace_ids:
            entry = self._entry(trace_id, now)
            if entry.state is None:
                entry.state = OUTSIDE
                self._release(entry, out, export=True, spans="gateway.passed_through",
                              logs="gateway.logs_passed_through")
        return out

    def decided(self, owner: str, decisions: Iterable[tuple[int, bool]], now: float | None = None) -> Outcome:
        """Episodes were decided. Dropped: what was held is dropped, counted. Kept: log records
        go out now, spans wait to be pulled (or ``hold_s``)."""
        now = time.monotonic() if now is None else now
        out = Outcome()
        for trace_id, kept in decisions:
            entry = self._entry(trace_id, now)
            if entry.state in (KEPT, PULLED, DROPPED):
                continue  # decided already (a pull implies kept)
            entry.owner = entry.owner or owner
            if kept:
                entry.state, entry.deadline = KEPT, now + self.hold_s
                self._release(entry, out, export=True, logs="gateway.logs_kept")
            else:
                entry.state = DROPPED
                self._release(entry, out, export=False, spans="dropped.gateway_spans", logs="dropped.episode_logs")
        return out

    def pull(self, owner: str, trace_ids: Iterable[int], now: float | None = None) -> tuple[bytes, Outcome]:
        """The held spans of kept episodes about to be rendered, as one encoded
        ``ExportTraceServiceRequest`` (what arrives later is exported by the gateway)."""
        now = time.monotonic() if now is None else now
        out = Outcome()
        request = ExportTraceServiceRequest()
        groups: dict[int, ScopeSpans] = {}
        for trace_id in trace_ids:
            entry = self._entry(trace_id, now)
            if entry.state == DROPPED:
                continue
            if entry.state != PULLED:
                entry.owner = entry.owner or owner
            if entry.state in (None, OPEN, OUTSIDE):
                entry.state = KEPT
                self._release(entry, out, export=True, logs="gateway.logs_kept")
            entry.state = PULLED
            spans = [item for item in entry.items if item[0] == SPAN]
            if not spans:
                continue
            for _, key, data in spans:
                scope = groups.get(key)
                if scope is None:
                    scope = groups[key] = _add_group(request, self._origins[key][1])
                scope.spans.append(PbSpan.FromString(data))
            out.count("gateway.spans_pulled", len(spans), entry.owner)
            self._forget_items(entry, SPAN)
        return (request.SerializeToString() if groups else b""), out

    def owner_gone(self, owner: str, now: float | None = None) -> Outcome:
        """A recording process went away: its undecided episodes will never be decided; what is
        held for them is dropped, counted ``dropped.gateway_owner_gone``."""
        now = time.monotonic() if now is None else now
        out = Outcome()
        self._gone.add(owner)
        for entry in list(self._holding.values()):
            if entry.owner == owner and entry.state == OPEN:
                entry.state = DROPPED
                self._release(entry, out, export=False, spans="dropped.gateway_owner_gone.spans",
                              logs="dropped.gateway_owner_gone.logs")
        return out

    # --- what the servers send ----------------------------------------------------------------
    def add_spans(self, request: ExportTraceServiceRequest, now: float | None = None) -> Outcome:
        """Place every span of one OTLP request (ids checked by the caller's decoder)."""
        now = time.monotonic() if now is None else now
        out = Outcome()
        passing = ExportTraceServiceRequest()
        passing_groups: dict[int, ScopeSpans] = {}
        for resource_spans in request.resource_spans:
            for scope_spans in resource_spans.scope_spans:
                header = _span_header(resource_spans, scope_spans)
                key: int | None = None
                for pb in scope_spans.spans:
                    if len(pb.trace_id) != 16 or len(pb.span_id) != 8:
                        out.count("errors.gateway_bad_ids")
                        continue
                    trace_id = int.from_bytes(pb.trace_id, "big")
                    out.count("gateway.spans")
                    entry = self._traces.get(trace_id)
                    state = self._state(entry)
                    owner = entry.owner if entry is not None else None
                    if state == DROPPED:
                        out.count("dropped.gateway_spans", 1, owner)
                    elif state == OUTSIDE or (state is None and not pb.parent_span_id) or state == PULLED:
                        group = passing_groups.get(id(scope_spans))
                        if group is None:
                            group = passing_groups[id(scope_spans)] = _add_group(passing, header)
                        group.spans.append(pb)
                        if state == PULLED:
                            out.count("gateway.late_spans", 1, owner)
                        else:
                            out.count("gateway.passed_through")
                    else:
                        if entry is None:
                            entry = self._entry(trace_id, now)
                        if sum(1 for item in entry.items if item[0] == SPAN) >= self.max_spans_per_trace:
                            out.count("dropped.gateway_span_limit", 1, owner)
                            continue
                        if key is None:
                            key = self._origin(SPAN, header)
                        if not self._hold(entry, SPAN, key, pb.SerializeToString()):
                            out.count(FULL_SPANS, 1, owner)
                            self._forget_if_unknown(entry)
        if passing_groups:
            out.spans.append(passing.SerializeToString())
        self._drop_unused_origins()
        return out

    def add_logs(self, request: ExportLogsServiceRequest, now: float | None = None) -> Outcome:
        """Place every log record of one OTLP request: a record outside any trace passes through."""
        now = time.monotonic() if now is None else now
        out = Outcome()
        passing = ExportLogsServiceRequest()
        passing_groups: dict[int, ScopeLogs] = {}
        for resource_logs in request.resource_logs:
            for scope_logs in resource_logs.scope_logs:
                header = _log_header(resource_logs, scope_logs)
                key: int | None = None
                for pb in scope_logs.log_records:
                    out.count("gateway.logs")
                    trace_id = int.from_bytes(pb.trace_id, "big") if len(pb.trace_id) == 16 else 0
                    entry = self._traces.get(trace_id) if trace_id else None
                    state = self._state(entry)
                    owner = entry.owner if entry is not None else None
                    if state == DROPPED:
                        out.count("dropped.episode_logs", 1, owner)
                    elif not trace_id or state in (OUTSIDE, KEPT, PULLED):
                        group = passing_groups.get(id(scope_logs))
                        if group is None:
                            group = passing_groups[id(scope_logs)] = _add_log_group(passing, header)
                        group.log_records.append(pb)
                        out.count("gateway.logs_kept" if state in (KEPT, PULLED) else "gateway.logs_passed_through",
                                  1, owner if state in (KEPT, PULLED) else None)
                    else:
                        if entry is None:
                            entry = self._entry(trace_id, now)
                        if key is None:
                            key = self._origin(LOG, header)
                        if not self._hold(entry, LOG, key, pb.SerializeToString()):
                            out.count(FULL_LOGS, 1, owner)
                            self._forget_if_unknown(entry)
        if passing_groups:
            out.logs.append(passing.SerializeToString())
        self._drop_unused_origins()
        return out

    # --- time ----------------------------------------------------------------------------------
    def expire(self, now: float | None = None, *, final: bool = False) -> Outcome:
        """Let go what waited ``hold_s`` (everything held, ``final``): unknown traces by the
        ``unknown`` rule, kept ones nobody pulled as late spans."""
        now = time.monotonic() if now is None else now
        out = Outcome()
        for entry in list(self._holding.values()):
            if not entry.items or (not final and now < entry.deadline):
                continue
            if entry.state is None:
                name = "gateway.unknown_exported" if self.unknown == "export" else "dropped.gateway_unknown"
                self._release(entry, out, export=self.unknown == "export", spans=f"{name}.spans", logs=f"{name}.logs")
                self._forget_if_unknown(entry)
            elif entry.state in (KEPT, PULLED):
                self._release(entry, out, export=True, spans="gateway.late_spans", logs="gateway.logs_kept")
            elif entry.state == OPEN and final:
                self._release(entry, out, export=False, spans="dropped.gateway_undecided.spans",
                              logs="dropped.gateway_undecided.logs")
        self._drop_unused_origins()
        return out

    # --- inside ----------------------------------------------------------------------------------
    def _entry(self, trace_id: int, now: float) -> _Trace:
        entry = self._traces.get(trace_id)
        if entry is None:
            entry = self._traces[trace_id] = _Trace(trace_id, None, None, now + self.hold_s)
            if len(self._traces) > self.max_traces + _EVICT_BATCH:
                self._forget_oldest()
        else:
            self._traces.move_to_end(trace_id)
        return entry

    def _forget_if_unknown(self, entry: _Trace) -> None:
        """A trace nobody announced and that holds nothing is not remembered: a flood of
        strangers' traces costs no memory once let go."""
        if entry.state is None and not entry.items:
            self._traces.pop(entry.trace_id, None)

    def _state(self, entry: _Trace | None) -> str | None:
        if entry is None:
            return None
        if entry.state == OPEN and entry.owner in self._gone:
            entry.state = DROPPED  # its process went away before deciding it
        return entry.state

    def _forget_oldest(self) -> None:
        """Forget the oldest traces down to ``max_traces``: decisions first; a trace still holding
        something is never forgotten (those are bounded by the held bytes), an episode still open
        only past twice the limit."""
        traces = self._traces
        keep: list[tuple[int, _Trace]] = []
        for trace_id in list(traces):
            if len(traces) + len(keep) <= self.max_traces:
                break
            entry = traces.pop(trace_id)
            if entry.items or (entry.state == OPEN and len(traces) + len(keep) < 2 * self.max_traces):
                keep.append((trace_id, entry))
        for trace_id, entry in keep:
            traces[trace_id] = entry

    def _hold(self, entry: _Trace, kind: str, key: int, data: bytes) -> bool:
        size = len(data) + ITEM_OVERHEAD + (0 if entry.items else TRACE_OVERHEAD)
        if self.held_bytes + size > self.max_held_bytes:
            return False
        entry.items.append((kind, key, data))
        self._holding[entry.trace_id] = entry
        entry.bytes += size
        self.held_bytes += size
        self._origins_ref(key, 1)
        return True

    def _release(self, entry: _Trace, out: Outcome, *, export: bool, spans: str | None = None,
                 logs: str | None = None) -> None:
        """Let go the held spans (counted under ``spans``) and records (under ``logs``), each
        kind only when its name is given: exported, or dropped."""
        for kind, name in ((SPAN, spans), (LOG, logs)):
            if name is None:
                continue
            items = [item for item in entry.items if item[0] == kind]
            if not items:
                continue
            if export:
                if kind == SPAN:
                    out.spans.append(self._request(items))
                else:
                    out.logs.append(self._log_request(items))
            out.count(name, len(items), entry.owner)
            self._forget_items(entry, kind)

    def _forget_items(self, entry: _Trace, kind: str) -> None:
        keep: list[tuple[str, int, bytes]] = []
        gone: list[tuple[str, int, bytes]] = []
        for item in entry.items:
            (gone if item[0] == kind else keep).append(item)
        freed = sum(len(item[2]) + ITEM_OVERHEAD for item in gone)
        if gone and not keep:
            freed += TRACE_OVERHEAD  # what its list of items cost
            self._holding.pop(entry.trace_id, None)
        entry.items = keep
        entry.bytes -= freed
        self.held_bytes -= freed
        self._unref_items(gone)

    def _unref_items(self, items: list[tuple[str, int, bytes]]) -> None:
        for _, key, _ in items:
            self._origins_ref(key, -1)

    def _origin(self, kind: str, header: bytes) -> int:
        found = self._origin_keys.get((kind, header))
        if found is None:
            key = self._next_origin
            self._next_origin += 1
            found = self._origin_keys[(kind, header)] = [key, 0]
            self._origins[key] = (kind, header)
            self.held_bytes += len(header) + ORIGIN_OVERHEAD
        return found[0]

    def _origins_ref(self, key: int, n: int) -> None:
        kind, header = self._origins[key]
        self._origin_keys[(kind, header)][1] += n

    def _drop_unused_origins(self) -> None:
        for (kind, header), (key, refs) in list(self._origin_keys.items()):
            if refs <= 0:
                del self._origin_keys[(kind, header)]
                del self._origins[key]
                self.held_bytes -= len(header) + ORIGIN_OVERHEAD

    def _request(self, items: list[tuple[str, int, bytes]]) -> bytes:
        request = ExportTraceServiceRequest()
        groups: dict[int, ScopeSpans] = {}
        for _, key, data in items:
            scope = groups.get(key)
            if scope is None:
                scope = groups[key] = _add_group(request, self._origins[key][1])
            scope.spans.append(PbSpan.FromString(data))
        return request.SerializeToString()

    def _log_request(self, items: list[tuple[str, int, bytes]]) -> bytes:
        request = ExportLogsServiceRequest()
        groups: dict[int, ScopeLogs] = {}
        for _, key, data in items:
            scope = groups.get(key)
            if scope is None:
                scope = groups[key] = _add_log_group(request, self._origins[key][1])
            scope.log_records.append(PbLogRecord.FromString(data))
        return request.SerializeToString()

    def stats(self) -> dict[str, int]:
        return {"held_bytes": self.held_bytes, "traces": len(self._traces), "origins": len(self._origins)}


# --- a span's resource and scope, as one header ------------------------------------------------
def _span_header(resource_spans: ResourceSpans, scope_spans: ScopeSpans) -> bytes:
    header = ResourceSpans(resource=resource_spans.resource, schema_url=resource_spans.schema_url)
    header.scope_spans.add(scope=scope_spans.scope, schema_url=scope_spans.schema_url)
    return header.SerializeToString()


def _log_header(resource_logs: ResourceLogs, scope_logs: ScopeLogs) -> bytes:
    header = ResourceLogs(resource=resource_logs.resource, schema_url=resource_logs.schema_url)
    header.scope_logs.add(scope=scope_logs.scope, schema_url=scope_logs.schema_url)
    return header.SerializeToString()


def _add_group(request: ExportTraceServiceRequest, header: bytes) -> ScopeSpans:
    resource_spans = request.resource_spans.add()
    resource_spans.ParseFromString(header)
    return resource_spans.scope_spans[0]


def _add_log_group(request: ExportLogsServiceRequest, header: bytes) -> ScopeLogs:
    resource_logs = request.resource_logs.add()
    resource_logs.ParseFromString(header)
    return resource_logs.scope_logs[0]
