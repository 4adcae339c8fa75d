"""The health of a step's GRPO groups, tracked as the step's episodes are offered.

A group whose members all got the same reward has zero advantage: it teaches nothing. A group
that lost members (fewer than the framework sampled, or members filtered, failed or truncated)
biases the advantage of the rest. Both are invisible in a step's mean reward. The pipeline keeps
a few numbers per group of the open step (never the members), tells the metrics the step's counts
when it closes, and puts each kept member's group health on its root.
"""

from __future__ import annotations

import math
from typing import Any

from otel_rollouts import conventions as c
from otel_rollouts._core.health import StepHealth
from otel_rollouts.sampling.batch import RowBatch

_MAX_GROUPS = 65_536  # groups assessed per (step, split): ~100 bytes each; the rest counted untracked
_LOST = frozenset((c.STATUS_FILTERED, c.STATUS_ERROR, c.STATUS_TRUNCATED))


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


def _size(value: Any) -> int:
    return value if isinstance(value, int) and not isinstance(value, bool) and value > 0 else 0


def _reward(value: Any) -> float | None:
    if isinstance(value, bool) or not isinstance(value, (int, float)):
        return None
    value = float(value)
    return None if math.isnan(value) else value


class StepGroups:
    """The groups of one (step, split): per group, members seen, reward range, members lost
    and the expected size (the largest an episode gave, else ``group_size``)."""

    __slots__ = ("groups", "untracked", "group_size")

    def __init__(self, group_size: int | None = None) -> None:
        self.groups: dict[Any, _Group] = {}
        self.untracked = 0
        self.group_size = group_size or 0

    def _group(self, gid: Any) -> _Group | None:
        g = self.groups.get(gid)
        if g is None:
            if len(self.groups) >= _MAX_GROUPS:
                self.untracked += 1
                return None
            g = self.groups[gid] = _Group()
            g.expected = self.group_size
        return g

    def add(self, record: Any) -> None:
        """One offered episode (a record or a batch row): a few lookups, nothing held."""
        gid = record.attribute(c.RL_GROUP_ID)
        if gid is None or isinstance(gid, (list, dict)):
            return
        g = self._group(gid)
        if g is None:
            return
        g.n += 1
        reward = _reward(record.attribute(c.RL_REWARD))
        if reward is not None:
            g.lo = min(g.lo, reward)
            g.hi = max(g.hi, reward)
        if record.attribute(c.RL_STATUS) in _LOST:
            g.lost += 1
        expected = _size(record.attribute(c.RL_GROUP_EXPECTED_SIZE))
        if expected > g.expected:
            g.expected = expected

    def add_batch(self, batch: RowBatch) -> None:
        """Every row of a batch, from its columns, a run of rows of one group at a time (a
        group's samples are usually adjacent): numpy reduces each run, Python touches each run
        once, never a row (but for finding where runs start)."""
        gids = batch.column(c.RL_GROUP_ID)
        n = batch.n
        if gids is None or n == 0:
            return
        import numpy as np

        try:  # where runs start, compared in C (ids numpy cannot hold flat: one by one)
            if isinstance(gids[0], tuple):
                raise TypeError("tuple ids")
            ids = np.empty(n, dtype=object)
            ids[:] = gids
            changes: Any = np.flatnonzero(ids[1:] != ids[:-1]) + 1
        except Exception:  # noqa: BLE001
            changes = [i for i in range(1, n) if gids[i] != gids[i - 1]]
        starts = [0, *(int(i) for i in changes)]
        ends = [*starts[1:], n]
        counts = [b - a for a, b in zip(starts, ends, strict=True)]
        rewards = batch.scores(c.RL_REWARD)
        lows = np.fmin.reduceat(rewards, starts).tolist()
        highs = np.fmax.reduceat(rewards, starts).tolist()
        statuses = batch.column(c.RL_STATUS)
        lost: list[int] = [0] * len(starts)
        if statuses is not None:
            values = np.empty(n, dtype=object)
            values[:] = statuses
            mask = np.zeros(n, dtype=bool)
            for status in _LOST:
                mask |= values == status
            if mask.any():
                lost = np.add.reduceat(mask.astype(np.int64), starts).tolist()
        sizes = batch.column(c.RL_GROUP_EXPECTED_SIZE)
        groups = self.groups
        get = groups.get
        for run, start in enumerate(starts):
            gid = gids[start]
            g = get(gid) if type(gid) in (str, int) else None
            if g is None:
                if gid is None or isinstance(gid, (list, dict)):
                    continue
                g = self._group(gid)
                if g is None:
                    continue
            g.n += counts[run]
            lo = lows[run]
            if lo == lo:  # not NaN: a row of the run has a reward
                if lo < g.lo:
                    g.lo = lo
                hi = highs[run]
                if hi > g.hi:
                    g.hi = hi
            g.lost += lost[run]
            if sizes is not None:
                g.expected = max(g.expected, *(_size(v) for v in sizes[start:ends[run]]))

    def attributes(self, gid: Any) -> dict[str, Any] | None:
        """The root attributes of a kept member of group ``gid`` (None: not a tracked group)."""
        if gid is None or isinstance(gid, (list, dict)):
            return None
        g = self.groups.get(gid)
        if g is None:
            return None
        out: dict[str, Any] = {
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

    def summary(self) -> StepHealth:
        """The step's counts (a group both all-equal and lost counts in both, once as degenerate)."""
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
