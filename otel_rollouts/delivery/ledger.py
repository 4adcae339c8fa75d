"""The delivery ledger: every kept episode is pending until each exporter confirmed it stored it,
or was dropped under a named reason; never both, never neither.

Accounting holds by construction, not by each exporter's goodwill: the delivery layers never
add to a ``delivered`` or ``dropped`` counter themselves, they report what happened to *spans*
(stored, dropped for a reason) and the ledger decides what that means for the episodes those
spans belong to. An episode leaves ``pending`` for an exporter exactly once:

- **delivered** when every span it was rendered with was confirmed stored by that exporter (a
  call of ``export`` that returned ``SUCCESS``, less what the exporter reported it did not
  store: OTLP ``partial_success``, Trackio's checked write);
- **lost** under a reason the first time any of its spans is given up (queue full, render
  error, oversize, refused by the collector, spool full, exit deadline...). Spans of it that are
  stored later change nothing.

The counters, per step and in the totals, per exporter: ``ledger.entered.<exporter>`` (every kept
episode: the sampler's ``kept``) = ``delivered.<exporter>`` + ``lost.<reason>.<exporter>`` (each
reason) + ``undelivered_at_exit.<exporter>`` (left in a persistent spool) + pending. They are
apart from the sampler's ``dropped.<reason>`` (episodes the sampler did not keep), so that per
step ``seen = kept + dropped.*`` and ``kept = delivered + lost.* (+ left, + pending)`` each add up.

Reports about an episode that is not pending (a retried request the receiver had stored after
all, a hung ``export`` that returns after shutdown counted it lost) are ignored: no episode is
counted twice. Episodes a previous run left in a ``spool_dir`` enter when this process first
reads their batch (``adopt``: ``ledger.adopted.<exporter>``, in the step their root names).
A ledger made for one layer used on its own (``auto_enter``) has nobody to enter episodes: it
counts the roots it sees instead, as the layers did before the ledger (in the totals only, and
also as ``adopted.delivered.<exporter>`` / ``adopted.lost.<exporter>``: episodes never entered).

Memory: one small entry per *pending* episode (its step, a map of its span ids to bits, and one
int per exporter: the bits still outstanding); a decided episode leaves nothing behind.
"""

from __future__ import annotations

import threading
from collections.abc import Callable, Iterable, Mapping, Sequence
from typing import Any

from opentelemetry.sdk.trace import ReadableSpan

from otel_rollouts import conventions as c
from otel_rollouts._core.stats import Stats

__all__ = ["Ledger"]

StepKey = tuple[int, str]
# reasons the ledger itself gives (the delivery layers give theirs)
UNDELIVERED_AT_EXIT = "undelivered_at_exit"
# not a loss: a persistent spool_dir hands it to the next process (``undelivered_at_exit.<exporter>``)
LEFT_IN_SPOOL = "undelivered_at_exit"


class _Entry:
    __slots__ = ("key", "bits", "outstanding")

    def __init__(self, key: StepKey, exporters: int) -> None:
        self.key = key
        self.bits: dict[int, int] | None = None  # span id -> its bit, once rendered
        # per exporter: the bits of spans not yet confirmed; -1 = not rendered yet (all of them)
        self.outstanding: list[int | None] = [-1] * exporters


def _roots(spans: Iterable[ReadableSpan]) -> list[int]:
    """Trace ids of the episode roots among ``spans``."""
    out = []
    for span in spans:
        attrs = span.attributes
        if attrs and attrs.get(c.RL_SPAN_KIND) == c.KIND_EPISODE and span.context is not None:
            out.append(span.context.trace_id)
    return out


class Ledger:
    """Kept episodes by trace id, per exporter: pending, delivered, dropped (with a reason).

    Thread-safe; the counters it writes are the ``otr.stats()`` keys ``ledger.entered.<exporter>``,
    ``delivered.<exporter>``, ``lost.<reason>.<exporter>`` and ``undelivered_at_exit.<exporter>``
    (totals and per step), so no other code writes them. An episode lost by every exporter is
    counted once per exporter: no total over exporters is kept (it would count pairs)."""

    def __init__(self, stats: Stats, exporters: Sequence[str], *, auto_enter: bool = False) -> None:
        self.stats = stats
        self.exporters = list(exporters)
        self._index = {name: i for i, name in enumerate(self.exporters)}
        self._entries: dict[int, _Entry] = {}
        self._lock = threading.Lock()
        self._listeners: dict[str, Callable[[str, int], None]] = {}
        self.auto_enter = auto_enter

    def add_drop_listener(self, exporter: str, listener: Callable[[str, int], None]) -> None:
        """``listener(reason, episodes)`` is told of every drop for ``exporter`` (outside the
        lock: the layers warn from it)."""
        self._listeners[exporter] = listener

    # --- entering ----------------------------------------------------------------------------
    def enter(self, trace_id: int, key: StepKey) -> bool:
        """A kept episode, decided: pending for every exporter. False (and nothing entered) when
        an episode with this trace id is already pending: the caller drops the newcomer."""
        # no lock: on the training thread, and one dict operation is atomic (a lock here made the
        # training thread wait for the render thread holding it)
        entry = _Entry(key, len(self.exporters))
        if self._entries.setdefault(trace_id, entry) is not entry:
            return False
        for name in self.exporters:
            self.stats.step(key, f"ledger.entered.{name}")
        return True

    def dropped_unentered(self, key: StepKey, reason: str) -> None:
        """A kept episode that could not enter (its trace id is pending already, or delivery
        was closed): lost for every exporter, counted in its step."""
        for name in self.exporters:
            self.stats.step(key, f"ledger.entered.{name}")
        self._count_dropped([(i, key) for i in range(len(self.exporters))], reason)

    def adopt(self, exporter: str, spans: Sequence[ReadableSpan]) -> int:
        """Episodes of a batch a previous run left in the spool: each root whose trace is not
        pending enters, pending for ``exporter`` only, in the step its root names; it must
        confirm the spans of that trace in this batch. Returns the episodes entered."""
        i = self._index.get(exporter)
        if i is None:
            return 0
        by_trace: dict[int, list[int]] = {}
        for span in spans:
            if span.context is not None:
                by_trace.setdefault(span.context.trace_id, []).append(span.context.span_id)
        keys: list[StepKey] = []
        with self._lock:
            for span in spans:
                attrs = span.attributes
                ctx = span.context
                if not attrs or attrs.get(c.RL_SPAN_KIND) != c.KIND_EPISODE or ctx is None:
                    continue
                if ctx.trace_id in self._entries:
                    continue
                step = attrs.get(c.RL_STEP)
                key = (step if isinstance(step, int) else -1, str(attrs.get(c.RL_SPLIT, "")))
                entry = _Entry(key, len(self.exporters))
                entry.bits = {sid: 1 << n for n, sid in enumerate(dict.fromkeys(by_trace[ctx.trace_id]))}
                entry.outstanding = [None] * len(self.exporters)
                entry.outstanding[i] = (1 << len(entry.bits)) - 1
                self._entries[ctx.trace_id] = entry
                keys.append(key)
        for key in keys:
            self.stats.step(key, f"ledger.adopted.{exporter}")
        return len(keys)

    def rendered(self, trace_id: int, spans: Sequence[ReadableSpan]) -> None:
        """The spans the episode was rendered with: each exporter must confirm every one."""
        with self._lock:
            entry = self._entries.get(trace_id)
            if entry is None:
                return
            bits: dict[int, int] = {}
            for span in spans:
                ctx = span.context
                if ctx is not None and ctx.trace_id == trace_id and ctx.span_id not in bits:
                    bits[ctx.span_id] = 1 << len(bits)
            entry.bits = bits
            full = (1 << len(bits)) - 1
            entry.outstanding = [full if o == -1 else o for o in entry.outstanding]

    # --- outcomes ----------------------------------------------------------------------------
    def stored(self, exporter: str, spans: Sequence[ReadableSpan]) -> None:
        """``exporter`` confirmed it stored ``spans``: episodes all of whose spans are now
        confirmed are delivered."""
        i = self._index.get(exporter)
        if i is None:
            return
        delivered: list[StepKey] = []
        adopted = 0
        with self._lock:
            entries = self._entries
            for span in spans:
                ctx = span.context
                if ctx is None:
                    continue
                entry = entries.get(ctx.trace_id)
                if entry is None:
                    if self.auto_enter:
                        attrs = span.attributes
                        if attrs and attrs.get(c.RL_SPAN_KIND) == c.KIND_EPISODE:
                            adopted += 1  # nobody enters episodes here: count the roots
                    continue
                out = entry.outstanding[i]
                if out is None or out == -1 or entry.bits is None:
                    continue  # decided for this exporter already, or not rendered (cannot be)
                bit = entry.bits.get(ctx.span_id)
                if bit is None or not out & bit:
                    continue  # a late span of the episode, or a span confirmed before
                out &= ~bit
                entry.outstanding[i] = out
                if out == 0:
                    entry.outstanding[i] = None
                    delivered.append(entry.key)
                    self._forget_if_done(ctx.trace_id, entry)
            # counted under the lock: a report never sees an episode both pending and delivered
            for key in delivered:  # (a step's count adds to the total too)
                self.stats.step(key, f"delivered.{exporter}")
        if adopted:
            self.stats.add(f"delivered.{exporter}", adopted)
            self.stats.add(f"adopted.delivered.{exporter}", adopted)

    def dropped(self, exporter: str, spans: Sequence[ReadableSpan], reason: str) -> int:
        """``exporter`` gave ``spans`` up for ``reason``: every pending episode one of them belongs
        to is dropped. Returns the episodes dropped (adopted roots included)."""
        traces: dict[int, None] = {}
        for span in spans:
            if span.context is not None:
                traces[span.context.trace_id] = None
        with self._lock:
            adopted = [t for t in _roots(spans) if t not in self._entries] if self.auto_enter else []
        return self.dropped_traces(exporter, traces, reason) + self.dropped_count(
            exporter, reason, len(adopted))

    def dropped_traces(self, exporter: str | None, trace_ids: Iterable[int], reason: str) -> int:
        """Episodes ``trace_ids`` dropped for ``reason`` by ``exporter`` (None: by every one)."""
        return self._count_dropped(self._decide(exporter, trace_ids, reason), reason, counted=True)

    def _decide(self, exporter: str | None, trace_ids: Iterable[int],
                reason: str | None = None) -> list[tuple[int, StepKey]]:
        """Take ``trace_ids`` out of pending for ``exporter`` (None: every one); returns
        (exporter index, step) of each episode taken (those pending only). With ``reason``, each
        is counted dropped in its step under the same lock (a report never sees it neither
        pending nor dropped)."""
        targets = range(len(self.exporters)) if exporter is None else [self._index.get(exporter)]
        dropped: list[tuple[int, StepKey]] = []
        with self._lock:
            for trace_id in trace_ids:
                entry = self._entries.get(trace_id)
                if entry is None:
                    continue
                for i in targets:
                    if i is None or entry.outstanding[i] is None:
                        continue
                    entry.outstanding[i] = None
                    dropped.append((i, entry.key))
                    if reason is not None:
                        self.stats.step(entry.key, f"lost.{reason}.{self.exporters[i]}")
                self._forget_if_done(trace_id, entry)
        return dropped

    def _count_dropped(self, dropped: list[tuple[int, StepKey]], reason: str, *, counted: bool = False) -> int:
        """Count ``dropped`` in their steps (unless ``counted`` already) and in the totals."""
        per_exporter: dict[int, int] = {}
        for i, key in dropped:
            if not counted:
                self.stats.step(key, f"lost.{reason}.{self.exporters[i]}")
            per_exporter[i] = per_exporter.get(i, 0) + 1
        for i, n in per_exporter.items():
            self._count_drop(self.exporters[i], reason, n, stepped=True)
        return len(dropped)

    def dropped_count(self, exporter: str, reason: str, n: int) -> int:
        """``n`` episodes this process never entered (a previous run's spool) dropped."""
        if n > 0:
            self._count_drop(exporter, reason, n)
            self.stats.add(f"adopted.lost.{exporter}", n)
            return n
        return 0

    def _count_drop(self, exporter: str, reason: str, n: int, stepped: bool = False) -> None:
        """Totals of a drop (``stepped``: the per-exporter total came with the step's count)."""
        if not stepped:
            self.stats.add(f"lost.{reason}.{exporter}", n)
        listener = self._listeners.get(exporter)
        if listener is not None:
            try:
                listener(reason, n)
            except Exception:  # noqa: BLE001 - a warning's failure never breaks the count
                pass

    def _forget_if_done(self, trace_id: int, entry: _Entry) -> None:
        """(under the lock) An episode decided for every exporter leaves the ledger."""
        if all(o is None for o in entry.outstanding):
            del self._entries[trace_id]

    # --- the end -----------------------------------------------------------------------------
    def close(self, left_in_spool: Mapping[str, set[int]]) -> dict[str, int]:
        """Decide whatever is still pending: an episode whose batch waits in a persistent spool
        (``left_in_spool[exporter]``: their trace ids) is counted ``undelivered_at_exit.<exporter>``
        (the next process configured with that spool_dir delivers it); the rest is lost,
        ``lost.undelivered_at_exit.<exporter>``. Returns the episodes lost per exporter."""
        lost: dict[str, int] = {}
        for name in self.exporters:
            spooled = left_in_spool.get(name, set())
            with self._lock:
                pending = [t for t, e in list(self._entries.items())
                           if e.outstanding[self._index[name]] is not None]
            keep = [t for t in pending if t in spooled]
            gone = [t for t in pending if t not in spooled]
            for _, key in self._decide(name, keep):
                self.stats.step(key, f"{LEFT_IN_SPOOL}.{name}")
            if gone:
                lost[name] = self.dropped_traces(name, gone, UNDELIVERED_AT_EXIT)
        return lost

    # --- reading -----------------------------------------------------------------------------
    def report(self, counters: Callable[[str], dict[str, Any]] | None = None) -> dict[str, Any]:
        """Per exporter: episodes pending now, and how many of them per ``"step/split"`` (the
        rest of the books is in the ``delivered``/``lost`` counters: ``counters(exporter)``
        reads them under the same lock, so an episode is never counted both pending and
        delivered, or neither)."""
        with self._lock:
            by_step: list[dict[str, int]] = [{} for _ in self.exporters]
            for entry in list(self._entries.values()):  # one C-level copy: safe beside enter
                label = f"{entry.key[0]}/{entry.key[1]}"
                for i, out in enumerate(entry.outstanding):
                    if out is not None:
                        by_step[i][label] = by_step[i].get(label, 0) + 1
            return {name: {**(counters(name) if counters is not None else {}),
                           "pending": sum(by_step[i].values()), "pending_steps": by_step[i]}
                    for i, name in enumerate(self.exporters)}
