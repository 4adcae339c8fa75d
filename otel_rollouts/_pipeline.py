"""The rollout pipeline: holds undecided episodes, runs the tail sampler, hands kept ones on.

Data path: episode API / @traced (records) → this pipeline (sampler) → delivery → exporters.
It also sits in the SDK TracerProvider as a ``SpanProcessor``, so spans made by other
OpenTelemetry instrumentation inside an episode are held with that episode and kept or dropped
with it; spans outside any episode pass straight through.
"""

from __future__ import annotations

import threading
import time
from collections import OrderedDict

from opentelemetry.sdk.trace import ReadableSpan, SpanProcessor

from otel_rollouts._delivery import Delivery
from otel_rollouts._recording import DROPPED, KEPT, OFFERED, OPEN, EpisodeRecord, SpanRecord
from otel_rollouts._stats import Stats
from otel_rollouts.sampling import Bucket, TailSampler

_MAX_DECIDED = 65_536  # trace ids remembered after a decision, to route late spans


class _Step:
    __slots__ = ("bucket", "last_seen", "kept")

    def __init__(self, bucket: Bucket) -> None:
        self.bucket = bucket
        self.last_seen = time.monotonic()
        self.kept = 0


class Pipeline(SpanProcessor):
    """Thread-safe holder of the episodes in flight and the per-step sampler buckets."""

    def __init__(self, sampler: TailSampler, delivery: Delivery, stats: Stats) -> None:
        self.sampler = sampler
        self.delivery = delivery
        self.stats = stats
        self._lock = threading.RLock()
        self._live: dict[int, EpisodeRecord] = {}  # trace id → undecided episode
        self._decided: OrderedDict[int, bool] = OrderedDict()  # trace id → kept?
        self._steps: dict[tuple[int, str], _Step] = {}
        self._closed: OrderedDict[tuple[int, str], int] = OrderedDict()  # key → kept count
        self._max_step: dict[str, int] = {}
        self._seq = 0

    # --- episodes ------------------------------------------------------------------------------
    def started(self, record: EpisodeRecord) -> None:
        with self._lock:
            self._seq += 1
            record.seq = self._seq
            self._live[record.trace_id] = record
            self.stats.step((record.step, record.split), "started")
            lag = self.sampler.step_lag
            previous = self._max_step.get(record.split)
            if previous is None or record.step > previous:
                self._max_step[record.split] = record.step
                if lag is not None:
                    for key in [k for k in self._steps if k[1] == record.split]:
                        if key[0] <= record.step - lag:
                            self._close(key)
            self._expire()

    def part_ended(self, record: EpisodeRecord) -> None:
        """The root or the reward span ended: offer the episode once it is complete."""
        if record.state == OPEN and record.complete:
            with self._lock:
                if record.state == OPEN:
                    self._offer(record)

    def late_span(self, record: EpisodeRecord, span: SpanRecord) -> None:
        if record.state == KEPT:
            self.delivery.late_span(record, span)
        else:
            self.stats.add("dropped.late_spans")

    def _offer(self, record: EpisodeRecord) -> None:
        key = (record.step, record.split)
        record.state = OFFERED
        self.stats.step(key, "seen")
        if key in self._closed:
            self.stats.step(key, "late")
            if self._closed[key] < self.sampler.max_traces_per_step:
                self._closed[key] += 1
                self._keep(record)
            else:
                self._drop(record, "late")
            return
        step = self._steps.get(key)
        if step is None:
            step = self._steps[key] = _Step(self.sampler.bucket(key))
        step.last_seen = time.monotonic()
        released, keep_now = step.bucket.offer(record)
        for r in released:
            self._drop(r, "sampled_out")
        for r in keep_now:
            step.kept += 1
            self._keep(r)

    def _keep(self, record: EpisodeRecord) -> None:
        record.state = KEPT
        self._live.pop(record.trace_id, None)
        self._remember(record.trace_id, True)
        self.stats.step((record.step, record.split), "kept")
        if record.dropped_spans:
            self.stats.add("dropped.span_limit", record.dropped_spans)
        self.delivery.episode(record)

    def _drop(self, record: EpisodeRecord, reason: str) -> None:
        record.state = DROPPED
        self._live.pop(record.trace_id, None)
        self._remember(record.trace_id, False)
        self.stats.step((record.step, record.split), f"dropped.{reason}")
        # free what it held at once
        record.spans = []
        record.foreign = []

    def _remember(self, trace_id: int, kept: bool) -> None:
        self._decided[trace_id] = kept
        if len(self._decided) > _MAX_DECIDED:
            self._decided.popitem(last=False)

    # --- closing steps -----------------------------------------------------------------------
    def end_step(self, step: int, split: str | None = None) -> None:
        with self._lock:
            self._offer_waiting(lambda r: r.step == step and (split is None or r.split == split))
            keys = [k for k in self._steps if k[0] == step and (split is None or k[1] == split)]
            for key in keys:
                self._close(key)
            splits = [split] if split is not None else {k[1] for k in keys} | set(self._max_step)
            for s in splits:
                self._closed.setdefault((step, s), 0)
            self._trim_closed()

    def close_all(self) -> None:
        with self._lock:
            self._offer_waiting(lambda r: True)
            for key in list(self._steps):
                self._close(key)
            self._trim_closed()

    def _offer_waiting(self, match) -> None:
        """Episodes whose root ended but whose reward never came are offered as they are."""
        waiting = [
            r
            for r in self._live.values()
            if r.state == OPEN and r.root is not None and r.root.end_ns is not None and match(r)
        ]
        for record in sorted(waiting, key=lambda r: r.seq):
            if record.state == OPEN:
                self._offer(record)

    def _close(self, key: tuple[int, str]) -> None:
        step = self._steps.pop(key, None)
        if step is None:
            return
        chosen = step.bucket.decide()
        chosen_ids = {id(r) for r in chosen}
        for record in step.bucket.held():
            if id(record) not in chosen_ids:
                self._drop(record, "sampled_out")
        for record in chosen:
            self._keep(record)
        self._closed[key] = step.kept + len(chosen)

    def _trim_closed(self) -> None:
        while len(self._closed) > 4096:
            self._closed.popitem(last=False)

    def _expire(self) -> None:
        timeout = self.sampler.step_timeout_s
        if timeout is None or not self._steps:
            return
        now = time.monotonic()
        for key in [k for k, s in self._steps.items() if now - s.last_seen > timeout]:
            self._close(key)

    def tick(self) -> None:
        """Called periodically from the export side: closes steps that timed out."""
        if self.sampler.step_timeout_s is not None:
            with self._lock:
                self._expire()

    def open_episodes(self) -> list[EpisodeRecord]:
        with self._lock:
            return [r for r in self._live.values() if r.state == OPEN]

    # --- SpanProcessor: spans of other OpenTelemetry instrumentation ---------------------------
    def on_start(self, span, parent_context=None) -> None:
        return None

    def on_end(self, span: ReadableSpan) -> None:
        trace_id = span.context.trace_id
        with self._lock:
            record = self._live.get(trace_id)
            if record is not None and record.state in (OPEN, OFFERED):
                if len(record.spans) + len(record.foreign) < record.max_spans:
                    record.foreign.append(span)
                else:
                    record.dropped_spans += 1
                return
            kept = self._decided.get(trace_id)
        if kept is None:
            self.delivery.spans([span])  # not part of any episode: passes through
        elif kept:
            self.delivery.spans([span])  # late span of a kept episode
        else:
            self.stats.add("dropped.late_spans")

    def shutdown(self) -> None:
        return None

    def force_flush(self, timeout_millis: int = 30000) -> bool:
        return True
