"""Kept episodes rendered and delivered in a renderer process: ``configure(render="process")``.

In the default ``render="thread"`` mode the render thread (``delivery.dispatch``) runs the
``Materializer`` (redaction, span building, views, encoding) and the exporters inside the
training process, where it shares the GIL with training. Here a child process owns all of it:
the ``Materializer``, the exporters and their ``SpoolingSender`` stacks (spool, retries,
splitting) run there, in an ordinary ``Delivery``; the training process only turns each kept
episode into a compact picklable wire form and writes it to a pipe.

- **Start**: a fresh interpreter (``subprocess`` with ``sys.executable``: fork immediately
  followed by exec, no Python code of the training process runs in it, so its threads and locks
  do not matter). Not ``multiprocessing``'s spawn: that re-imports the user's ``__main__``
  script in the child, and a training script without an ``if __name__ == "__main__"`` guard
  would start training again there. The child is in its own session (a Ctrl-C or a SIGTERM to
  the terminal's process group does not reach it) and ignores SIGINT: the training process's
  exit hooks drive its flush and shutdown. It exits by itself when the training process is gone
  (its input pipe closes).
- **Exporters in the child**: each exporter is pickled at configure time, or, for the built-in
  ones that hold locks, sockets or gRPC channels (``TrackioExporter``, ``OtlpJsonFileExporter``,
  the SDK's OTLP exporters and ``OTLPJsonSpanExporter``), rebuilt in the child from its
  constructor arguments (``exporter_recipe``). The ``Materializer`` (its resource, redactor and
  limits) is pickled likewise. When any of them cannot go, the whole ``Delivery`` falls back to
  the render thread, with one warning and ``render.process_fallback`` counted.
- **Channel**: the training thread pickles the wire form (a few microseconds) and queues the
  bytes for a writer thread, bounded in items and in bytes (``max_queue_bytes``: bytes written
  and not yet taken by the child count until it says it took them); when full, the episode is
  dropped under ``queue_full`` as in thread mode. A record that cannot be pickled has its
  offending values replaced by a flagged placeholder (``<unpicklable TYPE>``, counted
  ``render.process.unpicklable_values``); if it still cannot, it is dropped under
  ``unpicklable`` (never silently).
- **Ledger**: the training process keeps the only ``Ledger`` that ``otr.stats()`` reads. The
  child's ledger (``_ChildLedger``) decides as in thread mode but writes no counters: it reports
  each decision by trace id (rendered, stored per exporter, dropped per exporter with its
  reason, adopted from a spool) and the child's other counters (``errors.*``, ``spooled.*``,
  ``export.*``) as deltas; a reader thread in the training process applies them to its ledger
  and stats.
- **Death**: when the child dies (killed, crashed) every episode sent to it and not decided is
  dropped under ``renderer_died`` (per exporter still pending), ``render.process.restarts``
  counts the restart, and the next item starts a new child (with the same spool directory: a
  batch the dead child spooled is adopted and sent by the new one, counted ``ledger.adopted``).
- **Flush / shutdown**: ``flush(timeout)`` sends a marker; the child flushes its senders and
  exporters and answers; the training process waits for the answer (bounded by ``timeout``).
  ``shutdown(timeout)``: flush, then a stop message; the child shuts its ``Delivery`` down
  (within the time left), reports what stays in a persistent spool, and exits; it is joined,
  else terminated, then killed, within ``timeout``; the ledger is closed in the training
  process as in thread mode.
- **Pending snapshots, late spans, other processes' spans** go through the same channel: the
  child has the exporters that show them.
"""

from __future__ import annotations

import logging
import os
import pickle
import secrets
import shutil
import signal
import subprocess
import sys
import tempfile
import threading
import time
from collections import deque
from collections.abc import Callable, Iterable, Mapping, Sequence
from dataclasses import dataclass
from multiprocessing.connection import Connection
from pathlib import Path
from typing import Any, cast

from opentelemetry.sdk.trace import ReadableSpan
from opentelemetry.sdk.trace.export import SpanExporter
from opentelemetry.trace import Link, SpanContext, TraceFlags

from otel_rollouts import conventions as c
from otel_rollouts._core.codec import PendingSpan, decode, encode
from otel_rollouts._core.content import Deferred, jsonable, type_name
from otel_rollouts._core.health import GroupRow
from otel_rollouts._core.settings import RENDER_AUTO, RENDER_PROCESS, RENDER_THREAD
from otel_rollouts._core.spans import EpisodeRecord, SpanRecord
from otel_rollouts._core.stages import stage_totals
from otel_rollouts._core.stats import Stats
from otel_rollouts.delivery.dispatch import Delivery
from otel_rollouts.delivery.layers import DeliveryCounts, Warner, exporter_name, warn
from otel_rollouts.delivery.ledger import Ledger
from otel_rollouts.delivery.materialize import Materializer
from otel_rollouts.exporters.extras import GroupsSink, MetricsSink, PendingViewer

__all__ = ["ProcessDelivery", "RENDER_AUTO", "RENDER_PROCESS", "RENDER_THREAD", "exporter_recipe", "make_delivery", "wire_record"]

logger = logging.getLogger("otel_rollouts")

RENDERER_DIED = "renderer_died"
UNPICKLABLE = "unpicklable"
_REPORT_S = 0.02  # how often the child sends what it decided (and at every flush answer)
# the longest idle wait of the renderer's render and sender threads. Their bounded waits guard
# against a wakeup lost to a KeyboardInterrupt landing inside a notify; the renderer ignores
# SIGINT, so the bound only costs wakeups there (an idle renderer: ~0.15 ms of CPU each)
_CHILD_WAKE_S = 30.0
_PROTOCOL = pickle.HIGHEST_PROTOCOL


# --- exporters in the child ---------------------------------------------------------------------
@dataclass(frozen=True)
class Recipe:
    """How the child gets an exporter: ``pickled`` (the exporter's own pickle) or ``builder``
    (a module-level function) called with ``kwargs``."""

    pickled: bytes | None = None
    builder: Callable[..., SpanExporter] | None = None
    kwargs: dict[str, Any] | None = None

    def build(self) -> SpanExporter:
        if self.pickled is not None:
            return cast(SpanExporter, pickle.loads(self.pickled))
        assert self.builder is not None
        return self.builder(**(self.kwargs or {}))


def _build_trackio(**kwargs: Any) -> SpanExporter:
    from otel_rollouts.exporters import TrackioExporter

    return TrackioExporter(**kwargs)


def _build_otlp_json_file(**kwargs: Any) -> SpanExporter:
    from otel_rollouts.exporters.otlp_json import OtlpJsonFileExporter

    return OtlpJsonFileExporter(**kwargs)


def is_otlp(recipe: Recipe) -> bool:
    """Whether ``recipe`` rebuilds one of the SDK's OTLP exporters (what the span gateway's
    process exports with)."""
    return recipe.builder is _build_otlp


def _build_otlp(module: str, name: str, **kwargs: Any) -> SpanExporter:
    """An OTLP exporter class built in the child; aimed at a Phoenix, it posts annotations as
    the training process's would (``OTEL_ROLLOUTS_PHOENIX_ANNOTATIONS`` is inherited)."""
    import importlib

    from otel_rollouts.delivery.phoenix import PhoenixAnnotations

    exporter = cast(SpanExporter, getattr(importlib.import_module(module), name)(**kwargs))
    PhoenixAnnotations.attach(exporter)
    return exporter


_OTLP_HTTP = ("opentelemetry.exporter.otlp.proto.http.trace_exporter", "otel_rollouts.exporters.otlp_http_json",
              "opentelemetry.exporter.otlp.proto.http._log_exporter")
_OTLP_GRPC = ("opentelemetry.exporter.otlp.proto.grpc.trace_exporter", "opentelemetry.exporter.otlp.proto.grpc._log_exporter")
_OTLP_CLASSES = ("OTLPSpanExporter", "OTLPJsonSpanExporter", "OTLPLogExporter")
_OWN_HEADERS = frozenset({"content-type", "user-agent"})


def exporter_recipe(exporter: Any) -> Recipe | None:
    """How to make ``exporter`` in the renderer process (or, for the OTLP span and log
    exporters, in the span gateway's), None when it cannot be made there.

    The exporter's own pickle when it has one; else, for the built-in exporters (which hold
    locks, files, sessions or channels), their constructor arguments read back from the
    instance. A ``TrackioExporter``'s config is redacted already, and span content is redacted
    by the child's ``Materializer``: the rebuilt one is given ``redact=False``."""
    try:
        return Recipe(pickled=pickle.dumps(exporter, _PROTOCOL))
    except Exception:  # noqa: BLE001 - not picklable: try the built-in recipes
        pass
    cls = type(exporter)
    module = cls.__module__ or ""
    try:
        if module == "otel_rollouts.exporters.trackio" and cls.__name__ == "TrackioExporter":
            kwargs: dict[str, Any] = {
                "project": exporter.project, "run": exporter.run_name, "space_id": exporter.space_id,
                "trace_key": exporter.trace_key, "trace_ui_url": exporter.trace_ui_url,
                "config": exporter.config, "table": exporter.table, "redact": False}
            pickle.dumps(kwargs, _PROTOCOL)
            return Recipe(builder=_build_trackio, kwargs=kwargs)
        if module == "otel_rollouts.exporters.otlp_json" and cls.__name__ == "OtlpJsonFileExporter":
            return Recipe(builder=_build_otlp_json_file, kwargs={
                "path": str(exporter.path), "max_bytes": exporter.max_bytes, "backups": exporter.backups})
        if module in _OTLP_HTTP and cls.__name__ in _OTLP_CLASSES:
            client = exporter._client
            client = getattr(client, "client", client)  # OTLPJsonSpanExporter wraps the SDK's client
            headers = {k: v for k, v in dict(getattr(client, "_headers", {}) or {}).items()
                       if k.lower() not in _OWN_HEADERS}
            kwargs = {"endpoint": client._endpoint, "headers": headers or None, "timeout": client._timeout,
                      "compression": client._compression,
                      "max_request_size": getattr(exporter, "_max_request_size", None)}
            pickle.dumps(kwargs, _PROTOCOL)
            return Recipe(builder=_build_otlp, kwargs={"module": module, "name": cls.__name__, **kwargs})
        if module in _OTLP_GRPC and cls.__name__ in _OTLP_CLASSES:
            if exporter._credentials is not None:
                return None  # channel credentials do not pickle
            kwargs = {"endpoint": exporter._endpoint, "insecure": exporter._insecure,
                      "headers": exporter._headers, "timeout": exporter._timeout,
                      "compression": exporter._compression, "channel_options": exporter._channel_options,
                      "retryable_error_codes": exporter._retryable_error_codes}
            pickle.dumps(kwargs, _PROTOCOL)
            return Recipe(builder=_build_otlp, kwargs={"module": module, "name": cls.__name__, **kwargs})
    except Exception:  # noqa: BLE001 - an SDK version with other internals: no recipe
        return None
    return None


# --- the wire form of a record -------------------------------------------------------------------
class WireSpan:
    """A recorded span as the renderer process sees it: the fields the ``Materializer`` reads
    of a ``SpanRecord``, every value plain (deferred values computed, spans expanded)."""

    __slots__ = ("name", "span_id", "parent_id", "kind", "start_ns", "end_ns", "attributes", "events",
                 "links", "status_code", "status_message", "episode", "held")

    def __init__(self, episode: WireEpisode | None, fields: tuple[Any, ...]) -> None:
        (self.name, self.span_id, self.parent_id, self.kind, self.start_ns, self.end_ns, self.attributes,
         self.events, links, self.status_code, self.status_message) = fields
        self.links = [Link(SpanContext(t, s, False, TraceFlags(f)), a) for t, s, f, a in links] if links else None
        self.episode = episode
        self.held = True


class WireEpisode:
    """A kept episode as the renderer process sees it (what the ``Materializer`` reads of an
    ``EpisodeRecord``); built from ``wire_record``'s tuple."""

    __slots__ = ("trace_id", "step", "split", "reason", "notes", "stages", "_duration", "timed", "spans",
                 "foreign", "root", "reward_span", "timing", "mismatch", "capture_content")

    def __init__(self, wire: tuple[Any, ...]) -> None:
        (self.trace_id, self.step, self.split, self.reason, self.notes, self.stages, self._duration, self.timed,
         root, reward, spans, foreign) = wire
        self.foreign = spans_back(foreign)
        self.spans = [WireSpan(self, s) for s in spans]
        self.root = self.spans[root] if root is not None else None
        self.reward_span = self.spans[reward] if reward is not None else None
        self.timing = None
        self.mismatch = None
        self.capture_content = True

    def duration(self) -> float | None:
        return cast("float | None", self._duration)

    def attribute(self, key: str) -> Any:
        return self.root.attributes.get(key) if self.root is not None else None

    def release(self, *, keep_root: bool = False) -> None:
        self.spans = []
        self.foreign = []


def _resolved(attributes: dict[str, Any]) -> dict[str, Any]:
    """Deferred values computed here (they may hold a tokenizer or other user objects)."""
    for value in attributes.values():
        if isinstance(value, Deferred):
            return {k: jsonable(v) if isinstance(v, Deferred) else v for k, v in attributes.items()}
    return attributes


def _expanded(spans: Iterable[Any]) -> Iterable[Any]:
    for s in spans:
        expand = getattr(s, "expand", None)
        if expand is None:
            yield s
        else:
            yield from expand()


def _span_wire(s: Any) -> tuple[Any, ...]:
    links = None
    if s.links:
        links = [(link.context.trace_id, link.context.span_id, int(link.context.trace_flags),
                  dict(link.attributes) if link.attributes else None) for link in s.links]
    events = [(name, _resolved(dict(attrs)), ts) for name, attrs, ts in s.events] if s.events else None
    return (s.name, s.span_id, s.parent_id, s.kind, s.start_ns, s.end_ns, _resolved(s.attributes), events,
            links, s.status_code, s.status_message)


class EncodedSpans:
    """Finished spans of other processes (a Ray task's or actor's SDK ``ReadableSpan``s, which
    do not pickle: their attributes hold a lock) on their way to the renderer process, as one
    OTLP protobuf encoding; ``spans_back`` turns them into SDK spans again there (same ids,
    attributes, resource and scope)."""

    __slots__ = ("data",)

    def __init__(self, data: bytes) -> None:
        self.data = data


def picklable_spans(spans: Iterable[Any]) -> list[Any]:
    """``spans`` (other processes' spans: gateway ``PendingSpan``s, SDK ``ReadableSpan``s) in a
    form that pickles: the SDK spans encoded once, together (``EncodedSpans``)."""
    out: list[Any] = []
    readable: list[ReadableSpan] = []
    for span in spans:
        (readable if isinstance(span, ReadableSpan) else out).append(span)
    if readable:
        out.append(EncodedSpans(encode(readable)))
    return out


def spans_back(spans: Iterable[Any]) -> list[Any]:
    """What ``picklable_spans`` made, as spans again (in the renderer process)."""
    out: list[Any] = []
    for span in spans:
        if isinstance(span, EncodedSpans):
            out.extend(decode(span.data))
        else:
            out.append(span)
    return out


def wire_record(record: EpisodeRecord) -> tuple[Any, ...]:
    """The picklable form of a kept episode (or a pending snapshot): its spans' fields with
    deferred values computed and expandable spans expanded (here: they may need a tokenizer),
    what the root's sampling notes need (reason, notes, stages, duration), and other
    processes' spans as they are."""
    spans = list(_expanded(record.spans))
    root = reward = None
    for i, s in enumerate(spans):
        if s is record.root:
            root = i
        elif s is record.reward_span:
            reward = i
    try:
        stages = record.stages if record.stages is not None else stage_totals(record)
    except Exception:  # noqa: BLE001 - a view of the spans: the episode goes out without it
        stages = {}
    return (record.trace_id, record.step, record.split, record.reason, record.notes, stages,
            record.duration() if record.root is not None else None, record.timed, root, reward,
            [_span_wire(s) for s in spans], picklable_spans(record.foreign))


def _placeholder(value: Any) -> Any:
    """A value that pickles: ``value`` itself, its JSON-safe copy, or a flagged placeholder."""
    try:
        pickle.dumps(value, _PROTOCOL)
        return value
    except Exception:  # noqa: BLE001
        pass
    try:
        copy = jsonable(value)
        pickle.dumps(copy, _PROTOCOL)
        return copy
    except Exception:  # noqa: BLE001
        return f"<unpicklable {type_name(value)}>"


def _scrubbed(wire: tuple[Any, ...]) -> tuple[tuple[Any, ...], int]:
    """``wire`` with every value that does not pickle replaced (``_placeholder``), and how many
    were; other processes' spans that do not pickle are left out (counted with them)."""
    replaced = 0

    def clean(attrs: dict[str, Any] | None) -> dict[str, Any] | None:
        nonlocal replaced
        if not attrs:
            return attrs
        out = {}
        for k, v in attrs.items():
            new = _placeholder(v)
            replaced += new is not v
            out[str(k)] = new
        return out

    spans = []
    for s in wire[10]:
        fields = list(s)
        fields[6] = clean(fields[6])
        if fields[7]:
            fields[7] = [(str(n), clean(a), ts) for n, a, ts in fields[7]]
        if fields[8]:
            fields[8] = [(t, i, f, clean(a)) for t, i, f, a in fields[8]]
        for j in (0, 3, 10):
            if fields[j] is not None and not isinstance(fields[j], str):
                fields[j] = str(fields[j])
                replaced += 1
        spans.append(tuple(fields))
    foreign = []
    for f in wire[11]:
        try:
            pickle.dumps(f, _PROTOCOL)
            foreign.append(f)
        except Exception:  # noqa: BLE001
            replaced += 1
    notes = clean(wire[4])
    return (*wire[:4], notes, clean(wire[5]), *wire[6:10], spans, foreign), replaced


# --- the child's side --------------------------------------------------------------------------
class _Outbox:
    """What the child tells the training process, sent in batches (at most ``_REPORT_S`` after
    the first event of a batch, and at every flush answer) over one pipe; thread-safe. The first
    event of a batch sets ``waiting``: the report thread sleeps on it, so an idle renderer does
    not wake."""

    def __init__(self, conn: Connection) -> None:
        self.conn = conn
        self._events: list[tuple[Any, ...]] = []
        self._lock = threading.Lock()
        self._send_lock = threading.Lock()
        self.waiting = threading.Event()

    def put(self, event: tuple[Any, ...]) -> None:
        with self._lock:
            if not self._events:
                self.waiting.set()
            self._events.append(event)

    def send(self) -> None:
        with self._send_lock:
            with self._lock:
                events, self._events = self._events, []
            if events:
                try:
                    self.conn.send_bytes(pickle.dumps(events, _PROTOCOL))
                except (OSError, ValueError):  # the training process is gone
                    pass


class _ForwardingStats(Stats):
    """The child's counters: every one is sent to the training process, none kept."""

    def __init__(self, outbox: _Outbox) -> None:
        super().__init__()
        self.outbox = outbox

    def add(self, name: str, n: int = 1) -> None:
        self.outbox.put(("add", name, n))

    def step(self, key: tuple[int, str], name: str, n: int = 1) -> None:
        self.outbox.put(("step", key, name, n))


class _ChildLedger(Ledger):
    """The child's ledger: it decides as the training process's would, writes no counters, and
    reports every decision by trace id (``_Outbox``), which the training process applies."""

    def __init__(self, outbox: _Outbox, exporters: Sequence[str]) -> None:
        super().__init__(Stats(), exporters)  # its own counters are thrown away
        self.outbox = outbox

    def rendered(self, trace_id: int, spans: Sequence[ReadableSpan]) -> None:
        super().rendered(trace_id, spans)
        self.outbox.put(("rendered", trace_id))

    def stored(self, exporter: str, spans: Sequence[ReadableSpan]) -> None:
        i = self._index.get(exporter)
        if i is None:
            return
        delivered: list[int] = []
        with self._lock:
            for span in spans:
                ctx = span.context
                entry = self._entries.get(ctx.trace_id) if ctx is not None else None
                if entry is None or ctx is None:
                    continue
                out = entry.outstanding[i]
                if out is None or out == -1 or entry.bits is None:
                    continue
                bit = entry.bits.get(ctx.span_id)
                if bit is None or not out & bit:
                    continue
                out &= ~bit
                entry.outstanding[i] = out
                if out == 0:
                    entry.outstanding[i] = None
                    delivered.append(ctx.trace_id)
                    self._forget_if_done(ctx.trace_id, entry)
        if delivered:
            self.outbox.put(("stored", exporter, delivered))

    def dropped_traces(self, exporter: str | None, trace_ids: Iterable[int], reason: str) -> int:
        ids = list(trace_ids)
        taken = self._decide(exporter, ids)
        if taken:
            self.outbox.put(("dropped", exporter, reason, ids))
        return len(taken)

    def dropped_count(self, exporter: str, reason: str, n: int) -> int:
        if n > 0:
            self.outbox.put(("dropped_count", exporter, reason, n))
        return max(n, 0)

    def dropped_unentered(self, key: tuple[int, str], reason: str) -> None:
        self.outbox.put(("dropped_unentered", key, reason))

    def adopt(self, exporter: str, spans: Sequence[ReadableSpan]) -> int:
        before = set(self._entries)
        n = super().adopt(exporter, spans)
        roots = []
        for span in spans:
            attrs, ctx = span.attributes, span.context
            if attrs and ctx is not None and ctx.trace_id not in before and ctx.trace_id in self._entries \
                    and attrs.get(c.RL_SPAN_KIND) == c.KIND_EPISODE:
                roots.append((ctx.trace_id, attrs.get(c.RL_STEP), attrs.get(c.RL_SPLIT)))
                # one bit per trace, as the training process's ledger holds it
        if roots:
            self.outbox.put(("adopted", exporter, roots))
        return n

    def _forget_if_done(self, trace_id: int, entry: Any) -> None:
        if all(o is None for o in entry.outstanding):
            del self._entries[trace_id]
            self.outbox.put(("done", trace_id))

    def close(self, left_in_spool: Any) -> dict[str, int]:
        self.outbox.put(("closed", {name: sorted(ids) for name, ids in dict(left_in_spool).items()}))
        return {}


def _child(rfd: int, wfd: int) -> None:
    """The renderer process: read the training process's messages, render and deliver."""
    signal.signal(signal.SIGINT, signal.SIG_IGN)
    inbox, out = Connection(rfd, writable=False), Connection(wfd, readable=False)
    outbox = _Outbox(out)
    config = pickle.loads(inbox.recv_bytes())
    stats = _ForwardingStats(outbox)
    exporters: list[SpanExporter] = []
    for recipe in config["recipes"]:
        exporters.append(recipe.build())
    build, arguments = pickle.loads(config["materializer"])
    delivery = Delivery(exporters, build(**arguments), stats, config["max_queue"],
                        ledger=lambda _stats, names: _ChildLedger(outbox, names), **config["options"])
    # a spool directory the training process made private dies with the run, as in thread mode
    delivery._own_spool_root = bool(config["own_spool"])
    delivery.wake_s = _CHILD_WAKE_S
    for sender in delivery.senders:
        sender.idle_wait_s = _CHILD_WAKE_S
    if config.get("gateway"):
        delivery.use_gateway(*config["gateway"])
    if config.get("run_attributes"):
        delivery.describe_run(config["run_attributes"])
    stop = threading.Event()

    def report() -> None:
        # asleep until an event waits to be sent (an idle renderer costs no CPU), then a batch
        # window of _REPORT_S so that a burst of decisions goes in one message
        while True:
            outbox.waiting.wait()
            if stop.wait(_REPORT_S):
                return
            outbox.waiting.clear()
            outbox.send()

    threading.Thread(target=report, name="otel-rollouts-renderer-report", daemon=True).start()
    outbox.put(("ready", os.getpid()))
    outbox.send()
    exit_timeout = float(config["exit_timeout"])
    try:
        while True:
            try:
                data = inbox.recv_bytes()
            except (EOFError, OSError):  # the training process is gone: deliver what we have
                delivery.shutdown(exit_timeout)
                break
            kind, payload = pickle.loads(data)
            outbox.put(("taken", len(data)))
            if kind == "episode":
                delivery.episode(cast(EpisodeRecord, WireEpisode(payload)))
            elif kind == "late":
                trace_id, fields = payload
                delivery._put(("late", (trace_id, WireSpan(None, fields)), 0), "spans", 0)
            elif kind == "pending":
                wires, ended = payload
                delivery.pending([cast(EpisodeRecord, WireEpisode(w)) for w in wires], ended)
            elif kind == "spans":
                delivery.spans(spans_back(payload))
            elif kind == "metrics":
                index, step, values = payload
                sink = exporters[index]
                try:
                    if isinstance(sink, MetricsSink):
                        sink.log_metrics(step, values)
                except BaseException:  # noqa: BLE001 - an exporter bug never stops the renderer
                    stats.add(f"errors.log_metrics.{type(sink).__name__}")
            elif kind == "groups":
                index, step, split, rows = payload
                sink = exporters[index]
                try:
                    if isinstance(sink, GroupsSink):
                        sink.log_groups(step, split, [GroupRow._make(row) for row in rows])
                except BaseException:  # noqa: BLE001 - an exporter bug never stops the renderer
                    stats.add(f"errors.log_groups.{type(sink).__name__}")
            elif kind == "flush":
                marker, timeout, through = payload
                ok = delivery.flush(timeout, through_outage=through)
                outbox.put(("flushed", marker, ok))
                outbox.send()
            elif kind == "gateway":
                address, timeout = payload
                delivery.use_gateway(address, timeout)
            elif kind == "describe":
                delivery.describe_run(payload)
            elif kind == "stop":
                delivery.shutdown(float(payload))
                break
    finally:
        stop.set()
        outbox.waiting.set()
        outbox.put(("bye",))
        outbox.send()


def main() -> None:
    """Entry point of the renderer process: ``python -c ... main()`` with the two pipe fds."""
    _child(int(sys.argv[1]), int(sys.argv[2]))


# --- the training process's side --------------------------------------------------------------
class _Ref:
    """A span as the training process's ledger sees an episode of the renderer process: one
    per trace (span id 1), so that one confirmation decides it."""

    __slots__ = ("context", "attributes")

    def __init__(self, trace_id: int, attributes: dict[str, Any] | None = None) -> None:
        self.context = SpanContext(trace_id, 1, False)
        self.attributes = attributes


class _RemoteMetrics:
    """A metric sink (and groups sink) standing for exporter ``index`` of the renderer process:
    it sends only what that exporter takes (``metrics``: it is a ``MetricsSink``; ``groups``: a
    ``GroupsSink``)."""

    def __init__(self, delivery: ProcessDelivery, index: int, *, metrics: bool = True,
                 groups: bool = False) -> None:
        self.delivery = delivery
        self.index = index
        self.metrics = metrics
        self.groups = groups

    def log_metrics(self, step: int, values: dict[str, float]) -> None:
        if self.metrics:
            self.delivery._log_metrics(self.index, step, values)

    def log_groups(self, step: int, split: str, rows: Sequence[GroupRow]) -> None:
        if self.groups:
            self.delivery._log_groups(self.index, step, split, rows)


class _Renderer:
    """One renderer process: its pipes, the trace ids sent to it and not yet decided, and the
    thread that reads what it reports."""

    def __init__(self, process: subprocess.Popen[bytes], inbox: Connection, out: Connection) -> None:
        self.process = process
        self.out = out  # training process -> child
        self.inbox = inbox  # child -> training process
        self.inflight: dict[int, None] = {}
        self.unacked = 0  # bytes written to it that it has not said it took
        self.flushes: set[int] = set()  # flush markers sent to it, not answered
        self.lock = threading.Lock()
        self.dead = threading.Event()
        self.closed: dict[str, list[int]] | None = None
        self.bye = threading.Event()


class ProcessDelivery(Delivery):
    """``Delivery``'s interface, with rendering and exporting in a renderer process."""

    def __init__(self, exporters: Sequence[SpanExporter], recipes: list[Recipe], materializer: bytes,
                 stats: Stats, max_queue: int = 1024, *, spool_dir: str | os.PathLike[str] | None = None,
                 spool_max_bytes: int = 256 * 1024 * 1024, max_request_bytes: int | None = None,
                 max_pending_bytes: int = 64 * 1024 * 1024, max_queue_bytes: int = 64 * 1024 * 1024,
                 exit_timeout: float = 10.0) -> None:
        # (Delivery's interface; none of its threads or senders: they live in the child)
        self.senders = []
        self.exporters = list(exporters)
        self.stats = stats
        self.max_queue = max_queue
        self.max_queue_bytes = max_queue_bytes
        self.closed = False
        self.warner = Warner()
        seen: dict[str, int] = {}
        self.names: list[str] = []
        for exporter in self.exporters:
            base = exporter_name(exporter)
            seen[base] = seen.get(base, 0) + 1
            self.names.append(base if seen[base] == 1 else f"{base}#{seen[base]}")
        self.ledger = Ledger(stats, self.names)
        self.counts = [DeliveryCounts(stats, name, self.warner, self.ledger) for name in self.names]
        self._own_spool_root = spool_dir is None
        root = Path(spool_dir) if spool_dir is not None else (
            Path(tempfile.gettempdir()) / f"otel-rollouts-spool-{os.getpid()}-{secrets.token_hex(8)}")
        self.spool_root = root
        self._root = root
        self._config = {
            "recipes": recipes,
            "max_queue": max_queue,
            "exit_timeout": exit_timeout,
            "own_spool": self._own_spool_root,
            "options": {"spool_dir": str(self.spool_root), "spool_max_bytes": spool_max_bytes,
                        "max_request_bytes": max_request_bytes, "max_pending_bytes": max_pending_bytes,
                        "max_queue_bytes": max_queue_bytes},
        }
        self._materializer = materializer
        self._shows_pending = any(isinstance(e, PendingViewer) for e in self.exporters)
        self._items: deque[tuple[str, bytes, int, int | None]] = deque()
        self._wake = threading.Condition()
        self._bytes = 0  # queued here, or written and not yet taken by the child
        self._bytes_lock = threading.Lock()
        self._flushes: dict[int, list[Any]] = {}
        self._written: dict[int, threading.Event] = {}
        self._flush_ids = 0
        self._renderer: _Renderer | None = None
        self._generation = 0
        self._stopping = False
        self.pid = os.getpid()
        self.startup_s: float | None = None  # seconds from start to the child's first word
        self._started_at = 0.0
        self._writer = threading.Thread(target=self._write, name="otel-rollouts-render-writer", daemon=True)
        self._writer.start()
        self._enqueue("start", b"", 0, None, count=False)

    # --- the training side -----------------------------------------------------------------------
    def episode(self, record: EpisodeRecord) -> None:
        """A kept episode: it enters the ledger and goes to the renderer process as its wire form."""
        if not self.admit(record):
            return
        data = self._dumps(record, "episode")
        record.release(keep_root=True)
        if data is None:
            self.ledger.dropped_traces(None, (record.trace_id,), UNPICKLABLE)
            return
        if not self._enqueue("episode", data, len(data), record.trace_id):
            self.ledger.dropped_traces(None, (record.trace_id,), "queue_full")

    def _dumps(self, record: EpisodeRecord, what: str) -> bytes | None:
        """The pickled wire form of ``record``; values that do not pickle replaced and counted;
        None (counted) when it cannot be pickled even so."""
        try:
            wire = wire_record(record)
        except Exception:  # noqa: BLE001 - a deferred value that fails: as a render error
            self.stats.add("errors.materialize")
            return None
        try:
            return pickle.dumps((what, wire), _PROTOCOL)
        except Exception:  # noqa: BLE001 - a user object in a value: replaced, flagged, counted
            pass
        try:
            clean, replaced = _scrubbed(wire)
            self.stats.add("render.process.unpicklable_values", replaced)
            return pickle.dumps((what, clean), _PROTOCOL)
        except Exception:  # noqa: BLE001 - a kept episode: counted lost.unpicklable.<exporter> by the ledger
            if what != "episode":
                self.stats.add(f"dropped.{UNPICKLABLE}.{what}")
            return None

    def late_span(self, record: EpisodeRecord, span: SpanRecord) -> None:
        try:
            data = pickle.dumps(("late", (record.trace_id, _span_wire(span))), _PROTOCOL)
        except Exception:  # noqa: BLE001
            self.stats.add(f"dropped.{UNPICKLABLE}.spans")
            return
        self._enqueue("spans", data, len(data), None)

    @property
    def shows_pending(self) -> bool:
        return self._shows_pending

    def metric_sinks(self) -> list[MetricsSink | GroupsSink]:
        """Step summaries and step groups for the exporters that take them (``log_metrics``,
        ``log_groups``: Trackio) go to their copies in the renderer process, after the spans
        sent before them: the exporter objects given to ``configure()`` stay unused in this
        process (a second Trackio run)."""
        return [_RemoteMetrics(self, i, metrics=isinstance(e, MetricsSink), groups=isinstance(e, GroupsSink))
                for i, e in enumerate(self.exporters) if isinstance(e, (MetricsSink, GroupsSink))]

    def _log_metrics(self, index: int, step: int, values: dict[str, float]) -> None:
        try:
            data = pickle.dumps(("metrics", (index, step, dict(values))), _PROTOCOL)
        except Exception:  # noqa: BLE001
            self.stats.add("dropped.step_metrics")
            return
        self._enqueue("metrics", data, len(data), None)  # (a full channel counts dropped.queue_full.metrics)

    def _log_groups(self, index: int, step: int, split: str, rows: Sequence[GroupRow]) -> None:
        """A closed step's groups for exporter ``index`` of the renderer process: the rows as
        plain tuples (``GroupRow._make`` there), after the step's summary."""
        try:
            data = pickle.dumps(("groups", (index, step, split, [tuple(r) for r in rows])), _PROTOCOL)
        except Exception:  # noqa: BLE001
            self.stats.add("dropped.step_groups")
            return
        self._enqueue("groups", data, len(data), None)  # (a full channel counts dropped.queue_full.groups)

    def pending(self, snapshots: Sequence[EpisodeRecord], ended: Sequence[int]) -> bool:
        """Pending snapshots go to the renderer process, which shows them (see ``Delivery.pending``)."""
        if not snapshots and not ended:
            return True
        try:
            data = pickle.dumps(("pending", ([_scrubbed(wire_record(s))[0] for s in snapshots], list(ended))),
                                _PROTOCOL)
        except Exception:  # noqa: BLE001
            self.stats.add("errors.render_pending")
            return False
        return self._enqueue("pending", data, len(data), None)

    def describe_run(self, attributes: Mapping[str, str]) -> None:
        """The run's description goes to the renderer process (and to a restarted one, with
        its configuration)."""
        described = self._config.get("run_attributes")
        self._config["run_attributes"] = {**(described if isinstance(described, dict) else {}), **attributes}
        self._enqueue("describe", pickle.dumps(("describe", dict(attributes)), _PROTOCOL), 0, None, count=False)

    def use_gateway(self, address: str, timeout: float) -> None:
        """The renderer process pulls each kept episode's server spans from the node's gateway
        itself: they never pass through the training process."""
        self._config["gateway"] = (address, timeout)
        self._enqueue("gateway", pickle.dumps(("gateway", (address, timeout)), _PROTOCOL), 0, None, count=False)

    def spans(self, spans: Sequence[ReadableSpan | PendingSpan]) -> None:
        try:
            data = pickle.dumps(("spans", picklable_spans(spans)), _PROTOCOL)
        except Exception:  # noqa: BLE001
            self.stats.add(f"dropped.{UNPICKLABLE}_spans", len(spans))
            return
        self._enqueue("spans", data, len(data), None)

    def _enqueue(self, what: str, data: bytes, size: int, trace_id: int | None, *, count: bool = True) -> bool:
        """Queue ``data`` for the writer thread; False (counted) when the channel is full.
        ``size`` is ``len(data)``: what the child acknowledges taking (``taken``) when it read it.
        ``count=False``: a control message (start, flush, stop), never refused."""
        size = len(data)
        if self.closed and count:
            if what != "episode":  # a kept episode is counted by the ledger (lost.<reason>.<exporter>)
                self.stats.add(f"dropped.after_shutdown.{what}")
            return False
        with self._bytes_lock:
            # control messages (start, flush, stop) always go
            fits = not count or ((self._bytes + size <= self.max_queue_bytes or self._bytes == 0)
                                 and len(self._items) < self.max_queue)
            if fits:
                self._bytes += size
                self._items.append((what, data, size, trace_id))
        if fits:
            with self._wake:
                self._wake.notify()
            return True
        label = "episodes" if what == "episode" else what
        key = f"lost.queue_full.{self.ledger.exporters[0]}" if what == "episode" and self.ledger.exporters \
            else f"dropped.queue_full.{label}"
        if what != "episode":  # a kept episode is counted by the ledger (lost.queue_full.<exporter>)
            self.stats.add(key)
        self.warner.warn(f"queue_full.{label}",
                         "renderer queue full (%d items, %d of %d bytes); dropping %s. Total dropped before: %s "
                         "(%s in otr.stats())",
                         len(self._items), self._bytes, self.max_queue_bytes, label, self.stats.total(key), key)
        return False

    # --- the writer thread: the pipe to the child, started and restarted here ------------------
    def _write(self) -> None:
        while True:
            with self._wake:
                while not self._items:
                    self._wake.wait()
                what, data, size, trace_id = self._items.popleft()
            if what == "exit":
                return
            if what == "written":  # not sent: nothing will say it was taken
                with self._bytes_lock:
                    self._bytes -= size
                self._written.pop(int(data), threading.Event()).set()
                continue
            try:
                self._send(what, data, size, trace_id)
            except BaseException:  # noqa: BLE001 - the writer never dies
                self.stats.add("errors.render_writer")

    def _send(self, what: str, data: bytes, size: int, trace_id: int | None) -> None:
        for _attempt in range(3):
            renderer = self._renderer
            if renderer is None or renderer.dead.is_set():
                if self._stopping:
                    break
                renderer = self._start()
                if renderer is None:
                    break
            if what == "start":
                return
            with renderer.lock:
                if renderer.dead.is_set():
                    continue
                if trace_id is not None:
                    renderer.inflight[trace_id] = None
                renderer.unacked += size
                if what == "flush":
                    renderer.flushes.add(pickle.loads(data)[1][0])
            try:
                renderer.out.send_bytes(data)
                return
            except (OSError, ValueError):
                renderer.process.poll()
                # the reader sees the end of the pipe and drops what was in flight (this one too)
                renderer.dead.wait(5.0)
                if trace_id is not None:
                    return
        # no renderer could take it
        with self._bytes_lock:
            self._bytes -= size
        if trace_id is not None:
            self.ledger.dropped_traces(None, (trace_id,), RENDERER_DIED)
        elif what == "flush":
            self._answer(pickle.loads(data)[1][0], False)

    def _start(self) -> _Renderer | None:
        """Start a renderer process (a fresh interpreter) and its reader thread."""
        try:
            to_child_r, to_child_w = os.pipe()
            from_child_r, from_child_w = os.pipe()
            code = ("import sys; sys.path[:0] = " + repr([p for p in sys.path if p]) +
                    "; from otel_rollouts.delivery.process import main; main()")
            self._started_at = time.monotonic()
            process = subprocess.Popen(
                [sys.executable, "-c", code, str(to_child_r), str(from_child_w)],
                pass_fds=(to_child_r, from_child_w), start_new_session=True, stdin=subprocess.DEVNULL)
            os.close(to_child_r)
            os.close(from_child_w)
            renderer = _Renderer(process, Connection(from_child_r, writable=False),
                                 Connection(to_child_w, readable=False))
            renderer.out.send_bytes(pickle.dumps({**self._config, "materializer": self._materializer}, _PROTOCOL))
        except Exception as exc:  # noqa: BLE001 - counted; the items wait or are dropped
            self.stats.add("errors.render_process_start")
            warn("otel_rollouts: the renderer process could not start: %s", exc)
            return None
        if self._generation:
            self.stats.add("render.process.restarts")
        self._generation += 1
        self._renderer = renderer
        threading.Thread(target=self._read, args=(renderer,), name="otel-rollouts-render-reader",
                         daemon=True).start()
        return renderer

    # --- the reader thread: what the child decided, applied here --------------------------------
    def _read(self, renderer: _Renderer) -> None:
        while True:
            try:
                events = pickle.loads(renderer.inbox.recv_bytes())
            except (EOFError, OSError, pickle.UnpicklingError):
                break
            try:
                self._apply(renderer, events)
            except BaseException:  # noqa: BLE001 - the reader never dies
                self.stats.add("errors.render_reader")
        renderer.inbox.close()
        try:
            renderer.process.wait(timeout=5.0)
        except subprocess.TimeoutExpired:
            pass
        with renderer.lock:
            renderer.dead.set()
            lost = list(renderer.inflight)
            renderer.inflight.clear()
            unacked, renderer.unacked = renderer.unacked, 0
        with self._bytes_lock:  # what it never took no longer waits anywhere
            self._bytes -= unacked
        if not renderer.bye.is_set() and not self._stopping:
            self.stats.add("render.process.died")
            if lost:
                self.ledger.dropped_traces(None, lost, RENDERER_DIED)
        # (at shutdown, what it had not decided is closed by _close_ledger: undelivered_at_exit)
        for marker in list(renderer.flushes):  # (those not sent yet go to the next renderer)
            self._answer(marker, False)
        try:
            renderer.out.close()
        except OSError:
            pass

    def _apply(self, renderer: _Renderer, events: list[tuple[Any, ...]]) -> None:
        ledger, stats = self.ledger, self.stats
        for event in events:
            kind = event[0]
            if kind == "rendered":
                ledger.rendered(event[1], cast(list[ReadableSpan], [_Ref(event[1])]))
            elif kind == "stored":
                ledger.stored(event[1], cast(list[ReadableSpan], [_Ref(t) for t in event[2]]))
            elif kind == "done":
                renderer.inflight.pop(event[1], None)
            elif kind == "taken":
                with self._bytes_lock:
                    self._bytes -= event[1]
                with renderer.lock:
                    renderer.unacked -= event[1]
            elif kind == "add":
                stats.add(event[1], event[2])
            elif kind == "step":
                stats.step(event[1], event[2], event[3])
            elif kind == "dropped":
                ledger.dropped_traces(event[1], event[3], event[2])
            elif kind == "dropped_count":
                ledger.dropped_count(event[1], event[2], event[3])
            elif kind == "dropped_unentered":
                ledger.dropped_unentered(event[1], event[2])
            elif kind == "adopted":
                refs = [_Ref(t, {c.RL_SPAN_KIND: c.KIND_EPISODE, c.RL_STEP: step, c.RL_SPLIT: split})
                        for t, step, split in event[2]]
                ledger.adopt(event[1], cast(Sequence[ReadableSpan], refs))
            elif kind == "flushed":
                renderer.flushes.discard(event[1])
                self._answer(event[1], bool(event[2]))
            elif kind == "closed":
                renderer.closed = event[1]
            elif kind == "ready":
                if self.startup_s is None:
                    self.startup_s = time.monotonic() - self._started_at
            elif kind == "bye":
                renderer.bye.set()

    def _answer(self, marker: int, ok: bool) -> None:
        slot = self._flushes.pop(marker, None)
        if slot is not None:
            slot.append(ok)
            slot[0].set()

    def written(self, timeout: float) -> bool:
        """Wait until everything queued before this call was written to the renderer process
        (not yet rendered: ``flush`` waits for that). For tests and benchmarks."""
        self._flush_ids += 1
        event = self._written[self._flush_ids] = threading.Event()
        self._enqueue("written", str(self._flush_ids).encode(), 0, None, count=False)
        return event.wait(timeout)

    # --- flush / shutdown ------------------------------------------------------------------------
    def flush(self, timeout: float, *, through_outage: bool = False) -> bool:
        """Wait until the renderer process delivered what was sent before (or the deadline)."""
        if os.getpid() != self.pid or not self._writer.is_alive():
            return False
        deadline = time.monotonic() + timeout
        self._flush_ids += 1
        marker = self._flush_ids
        event = threading.Event()
        slot: list[Any] = [event]
        self._flushes[marker] = slot
        # the child's own flush gets most of the time, so that its answer arrives in time
        data = pickle.dumps(("flush", (marker, max(timeout * 0.9 - 0.05, 0.0), through_outage)), _PROTOCOL)
        self._enqueue("flush", data, 0, None, count=False)
        if not event.wait(max(deadline - time.monotonic(), 0.0)):
            self._flushes.pop(marker, None)
            return False
        return len(slot) > 1 and bool(slot[1])

    def shutdown(self, timeout: float) -> bool:
        """Flush, stop the renderer process (joined, else terminated, within ``timeout``), and
        close the ledger here as ``Delivery.shutdown`` does."""
        deadline = time.monotonic() + timeout
        if os.getpid() != self.pid or not self._writer.is_alive():
            return False
        flushed = self.flush(max(timeout * 0.5, 0.0), through_outage=True)
        self.closed = True
        self._stopping = True
        renderer = self._renderer
        if renderer is not None and not renderer.dead.is_set():
            left = max(deadline - time.monotonic(), 0.0)
            self._enqueue("stop", pickle.dumps(("stop", max(left * 0.8 - 0.1, 0.0)), _PROTOCOL), 0, None, count=False)
            renderer.dead.wait(max(deadline - time.monotonic() - 0.05, 0.0))
        self._enqueue("exit", b"", 0, None, count=False)
        stopped = self._end_process(renderer, deadline)
        self._writer.join(max(deadline - time.monotonic(), 0.0))
        self._close_ledger(renderer)
        return flushed and stopped

    def _end_process(self, renderer: _Renderer | None, deadline: float) -> bool:
        if renderer is None:
            return True
        process = renderer.process
        try:
            process.wait(max(deadline - time.monotonic(), 0.0))
            return True
        except subprocess.TimeoutExpired:
            pass
        process.terminate()
        try:
            process.wait(0.2)
        except subprocess.TimeoutExpired:
            process.kill()
            try:
                process.wait(0.2)
            except subprocess.TimeoutExpired:
                pass
        return False

    def _close_ledger(self, renderer: _Renderer | None) -> None:
        own = self._own_spool_root
        reported = (renderer.closed if renderer is not None else None) or {}
        left = {name: set() if own else set(reported.get(name, ())) for name in self.names}
        lost = self.ledger.close(left)
        for name in self.names:
            if lost.get(name):
                logger.warning("otel_rollouts: %s: %d kept episode(s) could not be delivered before exit and are "
                               "lost%s", name, lost[name],
                               " (pass configure(spool_dir=...) to keep them for the next run)" if own else "")
            if left.get(name):
                logger.warning("otel_rollouts: %s: %d kept episode(s) not delivered yet; they stay in %s and are "
                               "sent by the next process configured with this spool_dir", name, len(left[name]),
                               self.spool_root)
        if own and self._root.is_dir():
            shutil.rmtree(self._root, ignore_errors=True)

    def forget_after_fork(self) -> None:
        """In a process forked from the training process (a data-loader worker, say): close its
        copies of the renderer's pipes, so the renderer sees the training process's exit when it
        happens (not when the last fork exits) and no fork writes into its stream. The fork's own
        run, rebuilt lazily by the runtime, starts its own renderer."""
        renderer, self._renderer = self._renderer, None
        self.closed = True
        if renderer is not None:
            for conn in (renderer.out, renderer.inbox):
                try:
                    conn.close()
                except OSError:
                    pass

    def delivery_counts(self) -> list[DeliveryCounts]:
        """Each exporter's counters in this process (the child's sent back)."""
        return list(self.counts)

    @property
    def renderer_pid(self) -> int | None:
        """The renderer process's id (None before it started)."""
        renderer = self._renderer
        return renderer.process.pid if renderer is not None else None


def materializer_recipe(m: Materializer) -> tuple[Callable[..., Materializer], dict[str, Any]]:
    """How the renderer process makes the same ``Materializer``: its constructor arguments
    (the resource and scope as plain values: the SDK's hold locks and do not pickle)."""
    scope = m.scope
    return _build_materializer, {
        "resource": (dict(m.resource.attributes), m.resource.schema_url),
        "scope": (scope.name, scope.version, scope.schema_url, dict(scope.attributes or {}) or None),
        "max_attribute_chars": m.max_attribute_chars, "redact": m.redact,
        "max_episode_chars": m.max_episode_chars, "agent_name": getattr(m.views, "agent_name", None),
        "capture_content": m.capture_content}


def _build_materializer(resource: tuple[dict[str, Any], str | None], scope: tuple[Any, ...],
                        **kwargs: Any) -> Materializer:
    from opentelemetry.sdk.resources import Resource
    from opentelemetry.sdk.util.instrumentation import InstrumentationScope

    return Materializer(Resource(resource[0], resource[1]), InstrumentationScope(*scope), **kwargs)


def can_start_renderer() -> bool:
    """Whether a renderer process can be started here: an interpreter to run (not a frozen
    application, whose executable is not Python; not an embedded one without an executable)."""
    executable = sys.executable
    return bool(executable) and not getattr(sys, "frozen", False) and os.access(executable, os.X_OK)


def make_delivery(render: str, exporters: Sequence[SpanExporter], materializer: Materializer, stats: Stats,
                  max_queue: int = 1024, *, exit_timeout: float = 10.0, **options: Any) -> Delivery | ProcessDelivery:
    """The run's delivery: ``Delivery`` (the render thread) for ``render="thread"``; for
    ``"process"``, a ``ProcessDelivery`` when the materializer and every exporter can be made in
    the renderer process, else ``Delivery`` with one warning (``render.process_fallback``). For
    ``"auto"`` (which the caller passes only for exporters the library made itself), the same
    without the warning: the renderer process when it can be, else the thread, as asked."""
    if render == RENDER_AUTO and not can_start_renderer():
        render = RENDER_THREAD
    if render == RENDER_PROCESS or (render == RENDER_AUTO and exporters):
        recipes = [exporter_recipe(e) for e in exporters]
        missing = [exporter_name(e) for e, r in zip(exporters, recipes, strict=True) if r is None]
        reason = f"exporters that cannot be made in another process: {', '.join(missing)}" if missing else ""
        pickled: bytes | None = None
        if not missing:
            try:
                pickled = pickle.dumps(materializer_recipe(materializer), _PROTOCOL)
            except Exception as exc:  # noqa: BLE001 - a redact callable that does not pickle
                reason = f"the content settings (a redact callable?) do not pickle: {type_name(exc)}"
        if pickled is not None:
            return ProcessDelivery(exporters, [r for r in recipes if r is not None], pickled, stats, max_queue,
                                   exit_timeout=exit_timeout, **options)
        if render == RENDER_AUTO:  # not asked for: the thread, as the default always was
            return Delivery(exporters, materializer, stats, max_queue, **options)
        stats.add("render.process_fallback")
        warn("otel_rollouts: render=\"process\": %s; rendering on a thread of this process instead", reason)
    return Delivery(exporters, materializer, stats, max_queue, **options)
