"""Episodes offered to the sampler as columns: a dropped sample never becomes a Python object.

A framework that holds a step's samples as columns (rewards, group ids, statuses, token
tensors) offers them here in one call. The sampler sees *rows*: a ``BatchRow`` is made only for
a candidate, a row the bucket could still hold once the batch is through; the rest of the
batch is counted dropped in one update. A built-in bucket finds its candidates with numpy
(``candidates(batch)``: the rows of this batch among its own best, whatever it holds already),
so that offering only those rows, in order, leaves it exactly as offering every row would; a
bucket that cannot tell (a custom one, ``Groups``, unscored rows under ``TopBottom``) is offered
every row, still as a light ``BatchRow`` and never as an episode record.

A row the bucket still holds when the batch is through is *promoted*: the caller records its
episode (the spans, the content) outside the sampler's lock and attaches it; a row decided
before its record arrives (another thread closed the step) gets the decision when it does.
"""

from __future__ import annotations

import math
from collections.abc import Callable, Iterator, Sequence
from typing import TYPE_CHECKING, Any

from otel_rollouts import conventions as c

if TYPE_CHECKING:
    import numpy as np

    from otel_rollouts._core.spans import EpisodeRecord, SpanRecord

UNDECIDED, KEEP, DROP = 0, 1, 2


class RowBatch:
    """One batch of a (step, split): ``n`` rows, each row's episode trace id, and the values a
    policy reads (``rl.reward.score``, ``rl.status``, ``rl.group.id``...) as columns.

    ``columns`` maps an attribute name to its per-row values, or to a function computing them
    (called at most once, when a policy reads that attribute: a dropped sample never pays for a
    value no policy reads). A value is what the episode's root attribute would hold (already
    converted: a float reward, a status string), None where the row has none."""

    __slots__ = ("step", "split", "n", "_columns", "_made", "_trace_ids", "_trace_id_of", "_arrays", "skipped")

    def __init__(
        self,
        step: int,
        split: str,
        n: int,
        columns: dict[str, Sequence[object] | Callable[[], Sequence[object]]],
        trace_id_of: Callable[[int], int],
    ) -> None:
        self.step, self.split, self.n = step, split, n
        self._columns = columns
        self._made: dict[str, Sequence[object]] = {}
        self._trace_ids: dict[int, int] = {}
        self._trace_id_of = trace_id_of
        self._arrays: dict[str, np.ndarray] = {}
        # rows the sampler took apart (watched prompts, kept outside the cap): a bucket's
        # candidates are found among the other rows, as if these were never offered to it
        self.skipped: np.ndarray | None = None

    def skip(self, indices: Sequence[int]) -> None:
        """Leave rows ``indices`` out of every bucket's candidates."""
        import numpy as np

        mask = np.zeros(self.n, dtype=bool)
        mask[np.asarray(list(indices), dtype=np.int64)] = True
        self.skipped = mask

    def unskipped(self, count: int) -> list[int]:
        """The first ``count`` rows not skipped (what a first-come bucket could take)."""
        if count <= 0:
            return []
        skipped = self.skipped
        if skipped is None:
            return list(range(min(self.n, count)))
        out: list[int] = []
        for i in range(self.n):
            if not skipped[i]:
                out.append(i)
                if len(out) >= count:
                    break
        return out

    @property
    def key(self) -> tuple[int, str]:
        return (self.step, self.split)

    def has(self, name: str) -> bool:
        """Whether the batch can answer ``attribute(name)`` (a column it was given)."""
        return name in self._columns or name in _ALWAYS or name in _ABSENT_IS_NONE

    def column(self, name: str) -> Sequence[object] | None:
        made = self._made.get(name)
        if made is not None:
            return made
        source = self._columns.get(name)
        if source is None:
            return None
        if callable(source):
            made = list(source())
        elif _float_array(source):
            # a float array (NaN: none), e.g. a statistic computed for the whole batch at once
            made = [None if v != v else v for v in source.tolist()]  # type: ignore[attr-defined]
        else:
            made = source
        if len(made) != self.n:  # a short column is padded, never a wrong alignment
            made = (list(made) + [None] * self.n)[: self.n]
        self._made[name] = made
        return made

    def value(self, name: str, i: int) -> Any:
        if name == c.RL_STEP:
            return self.step
        if name == c.RL_SPLIT:
            return self.split
        col = self.column(name)
        return None if col is None else col[i]

    def scores(self, name: str) -> np.ndarray:
        """The column as float64, NaN where a row has no number (what ``score_of`` reads as
        no score)."""
        import numpy as np

        out = self._arrays.get(name)
        source = self._columns.get(name)
        if out is None and _float_array(source):
            out = self._arrays[name] = np.asarray(source, dtype=np.float64)  # already NaN for none
        if out is None:
            col = self.column(name)
            if col is None:
                out = np.full(self.n, np.nan)
            elif all(type(v) is float or v is None for v in col):  # the common case, one pass in C
                out = np.array([math.nan if v is None else v for v in col], dtype=np.float64)
            else:
                out = np.fromiter((_number(v) for v in col), dtype=np.float64, count=self.n)
            self._arrays[name] = out
        return out

    def trace_id(self, i: int) -> int:
        tid = self._trace_ids.get(i)
        if tid is None:
            tid = self._trace_ids[i] = self._trace_id_of(i)
        return tid


_ALWAYS = (c.RL_STEP, c.RL_SPLIT)
# columns a batch may lack, each row then having none: no status is ``ok``, no duration and no
# expected group size are "not measured" (a policy reading them finds nothing, never a 0)
_ABSENT_IS_NONE = (c.RL_STATUS, c.RL_DURATION_SECONDS, c.RL_GROUP_EXPECTED_SIZE,
                   *c.MISMATCH_STATS.values())


def _float_array(value: object) -> bool:
    """Whether a column is a float numpy array (NaN standing for none)."""
    dtype = getattr(value, "dtype", None)
    return dtype is not None and getattr(dtype, "kind", None) == "f"


def _number(value: object) -> float:
    if isinstance(value, bool) or not isinstance(value, (int, float)):
        return math.nan
    return float(value)


class BatchRow:
    """One candidate row of a batch, standing in for its episode record inside a bucket.

    It answers what a bucket and the distributed budget ask of a record (``attribute``,
    ``trace_id``, ``seq``, ``root``); once promoted, ``record`` is the episode recorded for it."""

    __slots__ = ("batch", "index", "trace_id", "seq", "record", "decision", "built", "reason", "notes")

    spans: tuple[()] = ()  # what metrics read of a record: a row has no span of its own

    def __init__(self, batch: RowBatch, index: int, seq: int) -> None:
        self.batch = batch
        self.index = index
        self.trace_id = batch.trace_id(index)
        self.seq = seq
        self.record: EpisodeRecord | None = None
        self.decision = UNDECIDED  # decided before its record arrived
        self.built = False  # the caller tried to record it (record None: that failed)
        self.reason: str | None = None  # why the sampler keeps it (rl.trace.keep_reason)
        self.notes: dict[str, object] | None = None  # root attributes the sampler adds (EpisodeRecord.notes)

    def attribute(self, name: str) -> Any:
        record = self.record
        if record is not None:
            return record.attribute(name)
        return self.batch.value(name, self.index)

    @property
    def root(self) -> SpanRecord | None:
        return None if self.record is None else self.record.root

    @property
    def step(self) -> int:
        return self.batch.step

    @property
    def split(self) -> str:
        return self.batch.split


def rows(batch: RowBatch, indices: Sequence[int], seq: Iterator[int]) -> list[BatchRow]:
    """Rows for ``indices`` of ``batch``, numbered in arrival order from ``seq``."""
    return [BatchRow(batch, i, next(seq)) for i in indices]


# --- vectorised candidates for the built-in buckets ------------------------------------------------
def masked(keys: np.ndarray, batch: RowBatch) -> np.ndarray:
    """``keys`` with the batch's skipped rows made the least eligible: NaN (not eligible) for a
    float key, the largest value (ranked last) otherwise."""
    skipped = batch.skipped
    if skipped is None:
        return keys
    import numpy as np

    keys = keys.copy()
    keys[skipped] = np.nan if keys.dtype.kind == "f" else np.iinfo(keys.dtype).max
    return keys


def best_rows(keys: np.ndarray, k: int, *, later_wins: bool = False) -> np.ndarray:
    """Indices (ascending) of the ``k`` rows a ranked bucket would hold after offering them all
    in order: the smallest keys (a float NaN: not eligible); ties go to the earlier row, or to
    the later one with ``later_wins``. Every row a bucket could hold at the end is among these,
    whatever it held before: its final content is the best of all it was offered, and a row
    with ``k`` rows of the batch ahead of it has ``k`` rows ahead of it in all."""
    import numpy as np

    if keys.dtype.kind == "f":
        eligible = np.flatnonzero(~np.isnan(keys))
    else:
        eligible = np.arange(keys.size)
    if k <= 0 or eligible.size == 0:
        return eligible[:0]
    if eligible.size <= k:
        return eligible
    if later_wins:  # the later of equal keys first: rank the reversed rows, stably
        eligible = eligible[::-1]
    ranked = eligible[np.argsort(keys[eligible], kind="stable")[:k]]
    return np.sort(ranked)
