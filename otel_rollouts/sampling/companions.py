"""Episodes kept together: the bucket wrapper that keeps the episodes sharing an
``rl.companions.id`` (a game's players, a preference pair) with the one the policy keeps."""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

from otel_rollouts import conventions as c
from otel_rollouts.sampling.batch import BatchRow, RowBatch
from otel_rollouts.sampling.policy import (
    BatchBucket,
    Bucket,
    Candidate,
    Decision,
    WholeBatchBucket,
    label,
)

__all__ = ["CompanionsBucket", "companions_of", "with_companions"]

_PARK_FACTOR = 4  # companions parked per (step, split): this many times the cap...
_MIN_PARK = 64  # ...and at least this many


# --- companions: episodes kept together ---------------------------------------------------------
def companions_of(record: Candidate) -> Any:
    """The ``rl.companions.id`` of an episode record or batch row (None: it has none)."""
    value = record.attribute(c.RL_COMPANIONS_ID)
    return value if isinstance(value, (str, int)) and not isinstance(value, bool) else None


def _has_companions(records: list[Candidate]) -> bool:
    for r in records:
        if r.attribute(c.RL_COMPANIONS_ID) is not None:
            return True
    return False


class CompanionsBucket(Bucket):
    """A policy's bucket that keeps the episodes sharing an ``rl.companions.id`` (a game's
    players, a preference pair) together: when the policy keeps one, the others of its (step,
    split) are kept too.

    A companion the policy lets go is *parked* (held, not dropped) so that it can still follow
    a companion kept later; a companion of an episode kept already is kept on arrival. At most
    ``park_room`` are parked per (step, split) (four times the cap, at least 64: a companion
    arriving after its partner was let go can only follow it while it is still parked; when
    full, the parked ones whose companions the policy no longer holds go first), and at most
    ``room`` (the cap) companions are kept beyond the policy's choice (a step keeps at most twice
    the cap when its kept episodes have companions); past them, a companion is dropped as the
    policy decided. Episodes without the attribute pass straight through."""

    def __init__(self, inner: Bucket, room: int) -> None:
        self.inner = inner
        self.room = room
        self.park_room = max(_PARK_FACTOR * room, _MIN_PARK)
        self.parked: dict[Any, list[Candidate]] = {}
        self.n_parked = 0
        self.kept: set[object] = set()  # companion ids one of whose episodes was kept for good
        self.extra = 0  # companions kept beyond the policy's choice

    def _take(self) -> bool:
        if self.extra >= self.room:
            return False
        self.extra += 1
        return True

    def offer(self, record: Candidate) -> Decision:
        if self.kept:
            cid = companions_of(record)
            if cid is not None and cid in self.kept and self._take():
                label((record,), c.REASON_COMPANION)
                return [], [record]
        released, keep_now = self.inner.offer(record)
        if keep_now or (released and _has_companions(released)):
            return self.settle(released, keep_now)
        return released, keep_now

    def settle(self, released: list[Candidate], keep_now: list[Candidate]) -> Decision:
        """Park the companions the policy let go; keep the parked companions of kept ones."""
        keep = list(keep_now)
        for r in keep_now:
            cid = companions_of(r)
            if cid is None:
                continue
            self.kept.add(cid)
            for p in self.parked.pop(cid, ()):
                self.n_parked -= 1
                if self._take():
                    label((p,), c.REASON_COMPANION)
                    keep.append(p)
                else:
                    released = [*released, p]
        out: list[Candidate] = []
        for r in released:
            cid = companions_of(r)
            if cid is None:
                out.append(r)
            elif cid in self.kept and self._take():
                label((r,), c.REASON_COMPANION)
                keep.append(r)
            elif cid not in self.kept and self._room_to_park(cid, out):
                self.parked.setdefault(cid, []).append(r)
                self.n_parked += 1
            else:
                out.append(r)
        return out, keep

    def _room_to_park(self, cid: object, out: list[Candidate]) -> bool:
        """Whether one more can be parked; when full, the parked companions that no episode the
        policy still holds can bring back are let go first (into ``out``)."""
        if self.n_parked < self.park_room:
            return True
        alive = {companions_of(r) for r in self.inner.held()}
        for other in [k for k in self.parked if k != cid and k not in alive]:
            gone = self.parked.pop(other)
            self.n_parked -= len(gone)
            out.extend(gone)
        return self.n_parked < self.park_room

    def candidates(self, batch: RowBatch) -> Any:
        chosen = self.inner.candidates(batch) if isinstance(self.inner, BatchBucket) else None
        if chosen is None:
            return None
        col = batch.column(c.RL_COMPANIONS_ID)
        if col is None:
            return chosen
        extra = [i for i, v in enumerate(col) if v is not None]
        if not extra:
            return chosen
        return sorted({int(i) for i in chosen} | set(extra))

    def decide(self, limit: int | None = None, exclude: set[int] | None = None) -> list[Candidate]:
        return self.inner.decide(limit, exclude)

    def with_companions(self, chosen: list[Candidate]) -> list[Candidate]:
        """``chosen`` and, within the extra budget, the held companions of chosen episodes."""
        cids = {cid for cid in map(companions_of, chosen) if cid is not None} | self.kept
        if not cids:
            return chosen
        taken = {id(r) for r in chosen}
        out = list(chosen)
        for r in self.held():
            if id(r) not in taken and companions_of(r) in cids and self._take():
                label((r,), c.REASON_COMPANION)
                out.append(r)
                taken.add(id(r))
        return out

    def held(self) -> list[Candidate]:
        held = self.inner.held()
        if self.parked:
            held = held + [r for group in self.parked.values() for r in group]
        return held


class _CompanionsWholeBucket(CompanionsBucket):
    """The same, around a bucket offered a batch whole (``Groups``)."""

    def offer_batch(self, batch: RowBatch, make_row: Callable[[int], Any]) -> tuple[list[Candidate], list[Candidate]]:
        col = batch.column(c.RL_COMPANIONS_ID)
        if col is None or all(v is None for v in col):
            inner = self.inner
            assert isinstance(inner, WholeBatchBucket)  # made so by with_companions
            released, held = inner.offer_batch(batch, make_row)
            out, keep = self.settle(released, [])
            return out, held + keep
        released = []
        for i in range(batch.n):  # one row at a time, so that a row can be parked
            rel, keep = self.offer(make_row(i))
            released.extend(r for r in rel if not (isinstance(r, BatchRow) and r.batch is batch))
            for r in keep:  # not a streaming policy: kept at the step's close with its companions
                self.parked.setdefault(companions_of(r), []).append(r)
                self.n_parked += 1
        held = [r for r in self.held() if isinstance(r, BatchRow) and r.batch is batch]
        return released, held


def with_companions(bucket: Bucket, cap: int) -> Bucket:
    """``bucket`` wrapped so that companions (``rl.companions.id``) are kept together."""
    if isinstance(bucket, WholeBatchBucket):
        return _CompanionsWholeBucket(bucket, cap)
    return CompanionsBucket(bucket, cap)
