"""The policies that need no comparison between episodes' scores: ``First`` (the first to
finish), ``Uniform`` (a seeded uniform sample) and ``Errors`` (failed, then truncated)."""

from __future__ import annotations

from collections.abc import Sequence
from typing import TYPE_CHECKING

if TYPE_CHECKING:
    import numpy as np

from otel_rollouts import conventions as c
from otel_rollouts.sampling.batch import RowBatch
from otel_rollouts.sampling.policy import (
    BasePolicy,
    Bucket,
    Candidate,
    Decision,
    _check_budget,
    _or_nan,
    _pick,
    _RankedBucket,
    _stable_hash,
    label,
)

__all__ = ["Errors", "First", "Uniform"]


# --- first -------------------------------------------------------------------------------------
class First(BasePolicy):
    """The first ``n`` (default: the cap) episodes to finish.

    Alone and in a single process it streams: kept episodes are exported at once. Inside a
    composition or across ranks it holds the first ones until the step closes.
    """

    name = "first"
    label = c.REASON_FIRST
    streaming = True

    def __init__(self, n: int | None = None) -> None:
        self.budget = _check_budget(n, "First(n)")

    def bucket(self, cap: int, key: tuple[int, str], *, stream: bool = False,
               margin: int = 0) -> Bucket:
        if stream and margin == 0:
            return _FirstStreamBucket(cap)
        return _FirstBucket(cap + margin)

    def __repr__(self) -> str:
        return f"First({self.budget})" if self.budget is not None else "First()"


class _FirstStreamBucket(Bucket):
    def __init__(self, cap: int) -> None:
        self.cap = cap
        self.kept = 0

    def offer(self, record: Candidate) -> Decision:
        if self.kept < self.cap:
            self.kept += 1
            label((record,), c.REASON_FIRST)
            return [], [record]
        return [record], []

    def candidates(self, batch: RowBatch) -> Sequence[int] | np.ndarray | None:
        return batch.unskipped(self.cap - self.kept)

    def decide(self, limit: int | None = None, exclude: set[int] | None = None) -> list[Candidate]:
        return []

    def held(self) -> list[Candidate]:
        return []


class _FirstBucket(Bucket):
    def __init__(self, capacity: int) -> None:
        self.capacity = capacity
        self.records: list[Candidate] = []

    def offer(self, record: Candidate) -> Decision:
        if len(self.records) < self.capacity:
            self.records.append(record)
            return [], []
        return [record], []

    def candidates(self, batch: RowBatch) -> Sequence[int] | np.ndarray | None:
        return batch.unskipped(self.capacity - len(self.records))

    def decide(self, limit: int | None = None, exclude: set[int] | None = None) -> list[Candidate]:
        out: list[Candidate] = []
        _pick(self.records, self.capacity if limit is None else limit, set(exclude or ()), out)
        label(out, c.REASON_FIRST)
        return out

    def held(self) -> list[Candidate]:
        return list(self.records)


# --- uniform -------------------------------------------------------------------------------------
class Uniform(BasePolicy):
    """A seeded uniform sample: every episode of the step is equally likely to be kept.

    Each episode gets a pseudo-random priority from a keyed hash of ``(seed, trace id)`` and the
    ``n`` smallest are kept (bottom-k sampling, equivalent to a reservoir). Because the priority
    depends only on the episode, the choice is reproducible and merges exactly across ranks.
    """

    name = "uniform"
    label = c.REASON_UNIFORM

    def __init__(self, n: int | None = None, *, seed: int = 0) -> None:
        self.budget = _check_budget(n, "Uniform(n)")
        self.seed = seed

    def bucket(self, cap: int, key: tuple[int, str], *, stream: bool = False,
               margin: int = 0) -> Bucket:
        return _UniformBucket(cap + margin, self.seed)

    def __repr__(self) -> str:
        n = "" if self.budget is None else f"{self.budget}, "
        return f"Uniform({n}seed={self.seed})"


class _UniformBucket(_RankedBucket):
    __slots__ = ("seed",)
    reason = c.REASON_UNIFORM

    def __init__(self, capacity: int, seed: int) -> None:
        super().__init__(capacity)
        self.seed = seed

    def rank(self, record: Candidate) -> float | None:
        return _stable_hash(self.seed, record.trace_id)

    def batch_keys(self, batch: RowBatch) -> np.ndarray | None:
        import numpy as np

        seed = self.seed
        return np.fromiter((_stable_hash(seed, batch.trace_id(i)) for i in range(batch.n)),
                           dtype=np.uint64, count=batch.n)


# --- errors --------------------------------------------------------------------------------------
class Errors(BasePolicy):
    """Episodes whose ``rl.status`` is ``error`` (first) or ``truncated`` (next), first come.

    Alone it keeps only such episodes; the string ``"errors"`` means ``Compose(Errors(),
    Uniform())``: failures first, the rest of the cap filled uniformly.
    """

    name = "errors"
    label = c.REASON_ERROR
    _CLASS = {c.STATUS_ERROR: 0, c.STATUS_TRUNCATED: 1}

    def __init__(self, n: int | None = None) -> None:
        self.budget = _check_budget(n, "Errors(n)")

    def bucket(self, cap: int, key: tuple[int, str], *, stream: bool = False,
               margin: int = 0) -> Bucket:
        return _ErrorsBucket(cap + margin)

    def needs(self) -> set[str]:
        return {c.RL_STATUS}

    def __repr__(self) -> str:
        return f"Errors({self.budget})" if self.budget is not None else "Errors()"


class _ErrorsBucket(_RankedBucket):
    __slots__ = ()
    reason = ""  # labelled by status in decide

    def rank(self, record: Candidate) -> float | None:
        return Errors._CLASS.get(record.attribute(c.RL_STATUS))

    def decide(self, limit: int | None = None, exclude: set[int] | None = None) -> list[Candidate]:
        out = super().decide(limit, exclude)  # errors first, then truncated: each says which
        for r in out:
            if r.attribute(c.RL_STATUS) == c.STATUS_TRUNCATED:
                label((r,), c.REASON_TRUNCATED)
        label(out, c.REASON_ERROR)
        return out

    def batch_keys(self, batch: RowBatch) -> np.ndarray | None:
        import numpy as np

        statuses = batch.column(c.RL_STATUS)
        if statuses is None:
            return np.full(batch.n, np.nan)
        get = Errors._CLASS.get
        return np.fromiter((_or_nan(get(s) if isinstance(s, str) else None) for s in statuses),
                           dtype=np.float64, count=batch.n)
