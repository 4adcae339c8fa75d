"""The health of a step's GRPO groups, tracked as the step's episodes are offered.

A group whose members all got the same reward has zero advantage: it teaches nothing. A group
that lost members (fewer than the framework sampled, or members filtered, failed or truncated)
biases the advantage of the rest. Both are invisible in a step's mean reward. The pipeline keeps
a few numbers per group of the open step (never the members), tells the metrics the step's counts
when it closes, and puts each kept member's group health on its root.
"""

from __future__ import annotations

import math
from array import array
from collections.abc import Sequence
from typing import TYPE_CHECKING, Any

from otel_rollouts import conventions as c
from otel_rollouts._core.health import StepHealth
from otel_rollouts.sampling.batch import RowBatch

if TYPE_CHECKING:
    import numpy as np

    from otel_rollouts.sampling.policy import Candidate

_MAX_GROUPS = 65_536  # groups assessed per (step, split): ~100 bytes each; the rest counted untracked
_LOST = frozenset((c.STATUS_FILTERED, c.STATUS_ERROR, c.STATUS_TRUNCATED))
_FOLD_ROWS = 4096  # offered episodes held as columns before they are added up per group
_NAN = math.nan


class _Group:
    __slots__ = ("n", "lo", "hi", "lost", "expected")

    def __init__(self) -> None:
        self.n = 0
        self.lo = math.inf
        self.hi = -math.inf
        self.lost = 0
        self.expected = 0

    def missing(self) -> int:
        return max(self.expected - self.n, 0)

    def all_equal(self) -> bool:
        return self.n >= 2 and self.hi == self.lo

    def degenerate(self) -> str | None:
        if self.lost or self.missing():
            return c.DEGENERATE_LOST
        if self.all_equal():
            return c.DEGENERATE_ALL_EQUAL
        return None


def _size(value: object) -> int:
    return value if isinstance(value, int) and not isinstance(value, bool) and value > 0 else 0


def _reward(value: object) -> float | None:
    if isinstance(value, bool) or not isinstance(value, (int, float)):
        return None
    value = float(value)
    return None if math.isnan(value) else value


class StepGroups:
    """The groups of one (step, split): per group, members seen, reward range, members lost
    and the expected size (the largest an episode gave, else ``group_size``).

    An offered episode is one row appended to columns (``note``: its group id, reward, whether
    it was lost, its expected size when it gave one), added up per group only when the step's
    health is asked for (kept members and the step's close) or every ``_FOLD_ROWS`` rows (so the
    columns stay small): the per-episode work is a few appends under the lock the offer holds."""

    __slots__ = ("groups", "untracked", "group_size", "runs", "_index", "_ids", "_rewards", "_lost",
                 "_sizes")

    def __init__(self, group_size: int | None = None) -> None:
        self.groups: dict[object, _Group] = {}
        self.untracked = 0
        self.group_size = group_size or 0
        # batches' runs of one group each, as arrays: (group ids, members, lowest and highest
        # reward, members lost, expected size), merged into ``groups`` only when needed
        self.runs: list[tuple[list[object], Any, Any, Any, Any, Any]] = []
        self._index: dict[object, int] | None = None
        # offered episodes not yet added up, one row each (always newer than every run):
        # group id, reward (NaN: none), lost (1) or not (0); expected sizes as (row, size), rare
        self._ids: list[object] = []
        self._rewards = array("d")
        self._lost = bytearray()
        self._sizes: list[tuple[int, object]] = []

    def add(self, record: Candidate) -> None:
        """One offered episode (a record or a batch row), read by its attributes."""
        gid = record.attribute(c.RL_GROUP_ID)
        if gid is None:
            return
        reward = _reward(record.attribute(c.RL_REWARD))
        self.note(gid, _NAN if reward is None else reward, record.attribute(c.RL_STATUS),
                  record.attribute(c.RL_GROUP_EXPECTED_SIZE))

    def note(self, gid: object, reward: float, status: object, expected: object = None) -> None:
        """One offered episode of group ``gid`` (not None), as the offer read it: ``reward`` a
        float (NaN: none), its ``status``, its ``rl.group.expected_size`` (None: not given).
        Appended to the columns (added up later, in order): nothing looked up per group."""
        ids = self._ids
        if expected is not None:
            self._sizes.append((len(ids), expected))
        ids.append(gid)
        self._rewards.append(reward)
        self._lost.append(status in _LOST)
        if len(ids) >= _FOLD_ROWS:
            self._fold()

    def _fold(self) -> None:
        """Add up the columns per group, in arrival order (after the batches' runs, which
        are older): the bound on groups applies as if each had been added on arrival."""
        if self.runs:
            self._merge()
        ids = self._ids
        if not ids:
            return
        sizes = dict(self._sizes)
        groups, size0 = self.groups, self.group_size
        for row, (gid, reward, lost) in enumerate(zip(ids, self._rewards, self._lost, strict=True)):
            if isinstance(gid, (list, dict)):
                continue
            g = groups.get(gid)
            if g is None:
                if len(groups) >= _MAX_GROUPS:
                    self.untracked += 1
                    continue
                g = groups[gid] = _Group()
                g.expected = size0
            g.n += 1
            if reward == reward:  # not NaN: it has a reward
                if reward < g.lo:
                    g.lo = reward
                if reward > g.hi:
                    g.hi = reward
            if lost:
                g.lost += 1
            if sizes:
                expected = _size(sizes.get(row))
                if expected > g.expected:
                    g.expected = expected
        self._ids = []
        self._rewards = array("d")
        self._lost = bytearray()
        self._sizes = []
        self._index = None

    def add_batch(self, batch: RowBatch) -> None:
        """Every row of a batch, from its columns, a run of rows of one group at a time (a
        group's samples are usually adjacent): numpy reduces each run, and the runs are kept as
        arrays (a few numbers per group). They become per-group entries only if asked for:
        a step recorded as one batch gets its counts from the arrays, vectorised, and the
        health of a kept member's group by one lookup."""
        gids = batch.column(c.RL_GROUP_ID)
        n = batch.n
        if gids is None or n == 0:
            return
        if self._ids:  # episodes offered before this batch are added up first (their order)
            self._fold()
        import numpy as np

        try:  # where runs start, compared in C (ids numpy cannot hold flat: one by one)
            if isinstance(gids[0], tuple):
                raise TypeError("tuple ids")
            ids = np.empty(n, dtype=object)
            ids[:] = gids
            changes: Sequence[int] | np.ndarray = np.flatnonzero(ids[1:] != ids[:-1]) + 1
        except Exception:  # noqa: BLE001
            changes = [i for i in range(1, n) if gids[i] != gids[i - 1]]
        starts = np.asarray([0, *(int(i) for i in changes)], dtype=np.int64)
        counts = np.diff(np.append(starts, n))
        rewards = batch.scores(c.RL_REWARD)
        lows = np.fmin.reduceat(rewards, starts)
        highs = np.fmax.reduceat(rewards, starts)
        lost = np.zeros(starts.size, dtype=np.int64)
        statuses = batch.column(c.RL_STATUS)
        if statuses is not None:
            values = np.empty(n, dtype=object)
            values[:] = statuses
            mask = np.zeros(n, dtype=bool)
            for status in _LOST:
                mask |= values == status
            if mask.any():
                lost = np.add.reduceat(mask.astype(np.int64), starts)
        expected = np.zeros(starts.size, dtype=np.int64)
        sizes = batch.column(c.RL_GROUP_EXPECTED_SIZE)
        if sizes is not None:
            expected = np.asarray([max(_size(v) for v in sizes[a:a + m])
                                   for a, m in zip(starts.tolist(), counts.tolist(), strict=True)], dtype=np.int64)
        run_ids = [gids[a] for a in starts.tolist()]
        keep = [gid is not None and not isinstance(gid, (list, dict)) for gid in run_ids]
        if not all(keep):
            idx = np.flatnonzero(np.asarray(keep, dtype=bool))
            run_ids = [run_ids[i] for i in idx.tolist()]
            counts, lows, highs, lost, expected = counts[idx], lows[idx], highs[idx], lost[idx], expected[idx]
        room = _MAX_GROUPS - self._held()
        if len(run_ids) > room:  # past the bound: counted, not assessed
            self.untracked += len(run_ids) - max(room, 0)
            cut = max(room, 0)
            run_ids, counts, lows, highs = run_ids[:cut], counts[:cut], lows[:cut], highs[:cut]
            lost, expected = lost[:cut], expected[:cut]
        if run_ids:
            self.runs.append((run_ids, counts, lows, highs, lost, expected))
            self._index = None

    def _held(self) -> int:
        return len(self.groups) + sum(len(r[0]) for r in self.runs)

    def pending(self) -> bool:
        """Whether anything was offered (rows or runs) that is not yet added up per group."""
        return bool(self._ids or self.runs)

    def _merge(self) -> None:
        """The batches' runs into per-group entries (a group seen in several runs or batches,
        or also episode by episode)."""
        for run_ids, counts, lows, highs, lost, expected in self.runs:
            for gid, m, lo, hi, gone, size in zip(run_ids, counts.tolist(), lows.tolist(), highs.tolist(),
                                                  lost.tolist(), expected.tolist(), strict=True):
                g = self.groups.get(gid)
                if g is None:
                    g = self.groups[gid] = _Group()
                    g.expected = self.group_size
                g.n += m
                if lo == lo:  # not NaN: a row of the run has a reward
                    g.lo = min(g.lo, lo)
                    g.hi = max(g.hi, hi)
                g.lost += gone
                g.expected = max(g.expected, size)
        self.runs = []
        self._index = None

    def _one_batch(self) -> bool:
        """Whether the step is one batch whose groups are each one run (no merging needed)."""
        if self.groups or len(self.runs) != 1:
            return False
        if self._index is None:
            run_ids = self.runs[0][0]
            self._index = {gid: i for i, gid in enumerate(run_ids)}
        return len(self._index) == len(self.runs[0][0])

    def attributes(self, gid: object) -> dict[str, object] | None:
        """The root attributes of a kept member of group ``gid`` (None: not a tracked group)."""
        if gid is None or isinstance(gid, (list, dict)):
            return None
        if self._ids:
            self._fold()
        if self.runs:
            if self._one_batch():
                at = self._index.get(gid) if self._index is not None else None
                if at is None:
                    return None
                _, counts, lows, highs, lost, expected = self.runs[0]
                run = _Group()
                run.n, run.lost = int(counts[at]), int(lost[at])
                run.expected = max(self.group_size, int(expected[at]))
                lo = float(lows[at])
                if lo == lo:
                    run.lo, run.hi = lo, float(highs[at])
                return _attributes(run)
            self._merge()
        g = self.groups.get(gid)
        if g is None:
            return None
        return _attributes(g)

    def summary(self) -> StepHealth:
        """The step's counts (a group both all-equal and lost counts in both, once as degenerate)."""
        if self._ids:
            self._fold()
        if self.runs and self._one_batch():
            import numpy as np

            _, counts, lows, highs, lost, expected = self.runs[0]
            missing = np.maximum(np.maximum(expected, self.group_size) - counts, 0)
            gone = lost + missing
            equal = (counts >= 2) & (lows == highs)  # NaN (no reward) is never equal
            return StepHealth(groups=int(counts.size), all_equal=int(equal.sum()), lost=int((gone > 0).sum()),
                              lost_members=int(gone.sum()), degenerate=int((equal | (gone > 0)).sum()),
                              untracked=self.untracked)
        if self.runs:
            self._merge()
        health = StepHealth(groups=len(self.groups), untracked=self.untracked)
        for g in self.groups.values():
            lost = g.lost + g.missing()
            equal = g.all_equal()
            if equal:
                health.all_equal += 1
            if lost:
                health.lost += 1
                health.lost_members += lost
            if equal or lost:
                health.degenerate += 1
        return health


def _attributes(g: _Group) -> dict[str, object]:
    """The root attributes of a kept member of group ``g``."""
    out: dict[str, object] = {
        c.RL_GROUP_SIZE: g.n,
        c.RL_GROUP_ALL_EQUAL: g.all_equal(),
        c.RL_GROUP_LOST: g.lost + g.missing(),
    }
    if g.expected:
        out[c.RL_GROUP_EXPECTED_SIZE] = g.expected
    if g.hi >= g.lo:
        out[c.RL_GROUP_REWARD_SPREAD] = g.hi - g.lo
    why = g.degenerate()
    if why is not None:
        out[c.RL_GROUP_DEGENERATE] = why
    return out
