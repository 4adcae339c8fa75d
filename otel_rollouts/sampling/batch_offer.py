"""The batch path of the pipeline: a step's finished episodes offered to the sampler as rows.

A batch (``sampling.batch.RowBatch``) is offered in one lock round-trip; only the rows the
sampler holds or keeps become objects, and only their episodes are recorded (``attach`` then
joins each recorded episode to its row). Rows dropped before they were recorded are counted
here. The pipeline owns the state (its lock, its step book, the arrival numbers) and the
decisions (keep, drop); this part holds a reference to it and takes the pipeline's lock for every
state change, exactly as the pipeline itself does.
"""

from __future__ import annotations

import itertools
import time
from collections import deque
from collections.abc import Sequence
from contextlib import AbstractContextManager
from typing import TYPE_CHECKING, Any, Protocol

from otel_rollouts import conventions as c
from otel_rollouts._core.spans import OFFERED, EpisodeRecord
from otel_rollouts._core.stats import Stats
from otel_rollouts.sampling.batch import DROP, KEEP, BatchRow, RowBatch, rows
from otel_rollouts.sampling.observer import StepObserver
from otel_rollouts.sampling.policy import BatchBucket, WholeBatchBucket
from otel_rollouts.sampling.steps import StepBook, StepState
from otel_rollouts.sampling.tail import TailSampler

if TYPE_CHECKING:
    from otel_rollouts.sampling.distributed import Member


class BatchHost(Protocol):
    """What the batch path needs of the pipeline: its shared state and its decisions, each a
    declared member (the pipeline's own state is never reached into)."""

    @property
    def sampler(self) -> TailSampler: ...
    @property
    def stats(self) -> Stats: ...
    @property
    def observer(self) -> StepObserver | None: ...
    @property
    def lock(self) -> AbstractContextManager[Any]:
        """The lock every change of the sampler's state is made under."""
        ...
    @property
    def steps(self) -> StepBook: ...
    @property
    def arrivals(self) -> itertools.count[int]:
        """Arrival numbers (``next()`` is atomic): a row's ``seq``, its place among episodes."""
        ...

    def step_started(self, step: int, split: str, n: int) -> None:
        """``n`` episodes of (step, split) started: counted; the lag and timeout rules apply."""
        ...
    def new_step(self, key: tuple[int, str]) -> StepState:
        """Open (step, split) ``key`` (it was neither open nor closed)."""
        ...
    def coordinator(self) -> Member | None:
        """The cross-rank coordinator when a distributed budget applies now, else None."""
        ...
    def keep(self, record: EpisodeRecord | BatchRow) -> None:
        """Keep ``record`` (a row not yet recorded is marked and kept when it is)."""
        ...
    def drop(self, record: EpisodeRecord | BatchRow, reason: str | None) -> None:
        """Drop ``record``, counted under ``reason`` (None: counted already)."""
        ...


class BatchOffer:
    """Offers batches of rows to the pipeline's sampler and counts rows dropped unrecorded."""

    def __init__(self, host: BatchHost) -> None:
        self._host = host

    def takes_batches(self) -> bool:
        """Whether a batch can be offered as rows: the policy's buckets are offered rows and
        read nothing a batch's columns lack (decided per batch by ``offer_batch``)."""
        return callable(self._host.sampler.policy.bucket)

    def offer_batch(self, batch: RowBatch) -> list[BatchRow] | None:
        """Offer every row of ``batch`` (finished episodes of one step) in one call; return the
        rows to record (held by the sampler, or kept already), or None when this policy must
        see whole episode records (it reads an attribute the batch has no column for): the
        caller then records every row as an episode.

        One lock round-trip, one stats update per outcome; a row never offered (no candidate)
        is never an object. Record each returned row's episode, then ``attach`` them."""
        host = self._host
        policy = host.sampler.policy
        if not all(batch.has(name) for name in policy.needs()):
            return None
        key = batch.key
        with host.lock:
            host.step_started(batch.step, batch.split, batch.n)
            if batch.n == 0:
                return []
            host.stats.step(key, "seen", batch.n)
            step = host.steps.open.get(key)
            if step is None:
                if host.steps.is_closed(key):
                    return self._late_batch(batch, key)
                step = host.new_step(key)
            step.last_seen = time.monotonic()
            step.groups.add_batch(batch)
            bucket = step.bucket
            if isinstance(bucket, WholeBatchBucket):  # the bucket takes the batch whole (Groups: a run at a time)
                return self._offer_whole(batch, bucket.offer_batch, step)
            watched = self._watched_rows(batch, step)
            if watched:  # the bucket chooses among the other rows, as one by one it would
                batch.skip(list(watched))
            chosen = bucket.candidates(batch) if isinstance(bucket, BatchBucket) else None
            indices = range(batch.n) if chosen is None else [int(i) for i in chosen]
            if watched:
                indices = [i for i in indices if i not in watched]
            offered = rows(batch, indices, host.arrivals)
            step.watching.extend(watched.values())  # kept when the step closes, with the rest
            kept_now: list[BatchRow] = []
            dropped = batch.n - len(offered) - len(watched)  # never offered: dropped without an object
            for row in offered:
                released, keep_now = bucket.offer(row)
                for r in released:
                    if isinstance(r, BatchRow) and r.batch is batch:
                        dropped += 1
                    else:
                        host.drop(r, "sampled_out")
                for r in keep_now:
                    step.kept += 1
                    step.groups.count_kept(r.attribute(c.RL_GROUP_ID))  # its group's row says it was kept
                    kept_now.append(r)
            held = [r for r in bucket.held() if isinstance(r, BatchRow) and r.batch is batch]
            survivors = held + kept_now + list(watched.values())
            if dropped:
                alive = {r.index for r in survivors}
                self.dropped_rows(batch, [i for i in range(batch.n) if i not in alive], "sampled_out")
            for r in kept_now:
                host.keep(r)
            return sorted(survivors, key=lambda r: r.seq)

    def _offer_whole(self, batch: RowBatch, offer: Any, step: StepState) -> list[BatchRow]:
        """A bucket that is offered the batch at once: rows numbered in order as if offered one
        by one; only the rows it still holds become objects (and watched rows it let go)."""
        host = self._host
        base = next(host.arrivals)
        if batch.n > 1:
            deque(itertools.islice(host.arrivals, batch.n - 1), maxlen=0)  # reserve the batch's numbers
        released, held = offer(batch, lambda i: BatchRow(batch, i, base + i))
        for r in released:
            host.drop(r, "sampled_out")
        alive = {r.index for r in held}
        watched = [r for i, r in self._watched_rows(batch, step, base).items() if i not in alive]
        step.watching.extend(watched)  # kept when the step closes, with the rest
        held += watched
        if len(held) < batch.n:
            alive = {r.index for r in held}
            self.dropped_rows(batch, [i for i in range(batch.n) if i not in alive], "sampled_out")
        return sorted(held, key=lambda r: r.seq)

    def _watched_rows(self, batch: RowBatch, step: StepState, base: int | None = None) -> dict[int, BatchRow]:
        """The rows of watched prompts (by dataset index), kept outside the cap while the step's
        watch budget lasts: index -> row, marked with the reason (the caller holds them in
        ``StepState.watching`` until the step closes)."""
        sampler = self._host.sampler
        watch = sampler.watch
        if not watch or step.watched >= sampler.watch_per_step:
            return {}
        column = batch.column(c.RL_DATASET_INDEX)
        if column is None:
            return {}
        out: dict[int, BatchRow] = {}
        for i, index in enumerate(column):
            if type(index) not in (int, str) or index not in watch:  # only ints and strings are keys
                continue
            row = BatchRow(batch, i, base + i if base is not None else next(self._host.arrivals))
            row.reason = c.REASON_WATCH
            row.notes = {c.RL_WATCH_KEY: str(index)}
            out[i] = row
            step.watched += 1
            if step.watched >= sampler.watch_per_step:
                break
        return out

    def _late_batch(self, batch: RowBatch, key: tuple[int, str]) -> list[BatchRow]:
        """The late rule for a batch: its first rows kept while the step kept fewer than the
        cap (none under a distributed budget), the rest dropped, counted at once."""
        host = self._host
        host.stats.step(key, "late", batch.n)
        room = 0 if host.coordinator() is not None else host.steps.late_room(key)
        taken = rows(batch, range(min(room, batch.n)), host.arrivals)
        if taken:
            host.steps.kept_late(key, len(taken))
        for row in taken:
            row.reason = c.REASON_LATE
            host.keep(row)
        if batch.n > len(taken):
            self.dropped_rows(batch, range(len(taken), batch.n), reason="late")
        return taken

    def dropped_rows(self, batch: RowBatch, indices: Sequence[int], reason: str) -> None:
        """Rows dropped before their episodes were recorded: one count, one call to the metrics."""
        self._host.stats.step(batch.key, "dropped." + reason, len(indices))
        self._dropped_rows_observed(batch, indices, reason)

    def _dropped_rows_observed(self, batch: RowBatch, indices: Sequence[int], reason: str) -> None:
        """Tell the observer (the metrics) that rows of ``batch`` were dropped unrecorded."""
        observer = self._host.observer
        if observer is not None:
            try:
                observer.dropped_rows(batch, indices, reason)
            except Exception:  # noqa: BLE001 - metrics never break the pipeline
                self._host.stats.add("errors.metrics")

    def attach(self, recorded: list[tuple[BatchRow, EpisodeRecord | None]]) -> None:
        """The episodes recorded for rows ``offer_batch`` returned (None: recording failed).
        A row still held now stands for its record; one decided meanwhile gets its decision."""
        host = self._host
        with host.lock:
            for row, record in recorded:
                row.built = True
                if record is None:
                    if row.decision == KEEP:
                        self.record_failed(row)
                    continue
                record.seq = row.seq
                record.state = OFFERED
                record.reason = row.reason
                record.notes = row.notes
                row.record = record
                if row.decision == KEEP:
                    host.keep(record)
                elif row.decision == DROP:
                    host.drop(record, None)

    def record_failed(self, row: BatchRow) -> None:
        """A row chosen to keep whose episode could not be recorded (its callback raised, or
        was interrupted): dropped under ``batch_record_failed``, per step and in totals (its
        ``seen`` is counted per step: so must its end be)."""
        self._host.stats.step(row.batch.key, "dropped.batch_record_failed")
        self._dropped_rows_observed(row.batch, [row.index], "batch_record_failed")
