"""The health of a step's GRPO groups, tracked as the step's episodes are offered.

A group whose members all got the same reward has zero advantage: it teaches nothing. A group
that lost members (fewer than the framework sampled, or members filtered or failed) biases the
advantage of the rest. Both are invisible in a step's mean reward, and the two are told apart: a
group can be both. A truncated member is not lost (it was sampled from the policy and scored, only
cut short): truncation is its own count. The pipeline keeps a few numbers per group of the open
step (never the members), tells the metrics the step's counts and a bounded table of its groups
(``GroupRow``: every group seen, kept or not) when it closes, and puts each kept member's group
health on its root.
"""

from __future__ import annotations

import heapq
import math
from array import array
from collections.abc import Callable, Sequence
from typing import TYPE_CHECKING, Any

from otel_rollouts import conventions as c
from otel_rollouts._core.health import GroupRow, StepHealth
from otel_rollouts.sampling.batch import RowBatch
from otel_rollouts.sampling.groups import LOST_STATUSES

if TYPE_CHECKING:
    import numpy as np

    from otel_rollouts.sampling.policy import Candidate

_MAX_GROUPS = 65_536  # groups assessed per (step, split): ~100 bytes each; the rest counted untracked
MAX_ROWS = 256  # groups handed to the exporters per (step, split) as rows (GroupRow); the rest counted
_GROUP_TEXT = 256  # a group id as a row's text, at most this many characters
_FOLD_ROWS = 4096  # offered episodes held as columns before they are added up per group
_NAN = math.nan
# an offered episode's fate for its group, one byte in the columns
_OK, _LOST, _TRUNCATED = 0, 1, 2


# how a member with a status counts for its group: lost, truncated (scored, not lost), else ok
_FATES: dict[object, int] = {**dict.fromkeys(LOST_STATUSES, _LOST), c.STATUS_TRUNCATED: _TRUNCATED}


def degenerate_reason(all_equal: bool, lost: int) -> str | None:
    """``rl.group.degenerate`` of a group: ``all_equal``, ``lost_members``, both joined
    (``all_equal,lost_members``: a filter on either word finds it), or None (healthy)."""
    if lost:
        return c.DEGENERATE_ALL_EQUAL_LOST if all_equal else c.DEGENERATE_LOST
    return c.DEGENERATE_ALL_EQUAL if all_equal else None


class _Group:
    __slots__ = ("n", "lo", "hi", "lost", "truncated", "expected")

    def __init__(self) -> None:
        self.n = 0
        self.lo = math.inf
        self.hi = -math.inf
        self.lost = 0  # members filtered or failed (not those missing: see missing())
        self.truncated = 0  # members cut short (scored: not lost)
        self.expected = 0

    def missing(self) -> int:
        return max(self.expected - self.n, 0)

    def all_equal(self) -> bool:
        return self.n >= 2 and self.hi == self.lo

    def degenerate(self) -> str | None:
        return degenerate_reason(self.all_equal(), self.lost + self.missing())

    def row(self, gid: object, kept: int) -> GroupRow:
        return GroupRow(_text(gid), self.n, self.expected, self.hi - self.lo if self.hi >= self.lo else None,
                        self.all_equal(), self.truncated, self.lost + self.missing(), kept)


def _text(gid: object) -> str:
    """A group id as a row's text (as its attribute reads; bounded)."""
    text = gid if isinstance(gid, str) else str(gid)
    return text if len(text) <= _GROUP_TEXT else text[:_GROUP_TEXT - 1] + "\u2026"


def _order(gid: object) -> tuple[int, float, str]:
    """A group id's place among the rows: numbers by value, then text."""
    if isinstance(gid, (int, float)) and not isinstance(gid, bool) and gid == gid:
        return (0, gid, "")
    return (1, 0.0, _text(gid))


def _table(gids: Sequence[object], degenerate: Sequence[bool],
           row: Callable[[int], GroupRow]) -> tuple[tuple[GroupRow, ...], int]:
    """At most ``MAX_ROWS`` rows of the groups ``gids`` (degenerate first, then by group id;
    arrival order among equal ids), and how many groups were left out. Only the rows shown
    are made (``row(i)``)."""
    n = len(gids)
    if n <= MAX_ROWS:
        order = sorted(range(n), key=lambda i: (not degenerate[i], _order(gids[i])))
    else:
        order = heapq.nsmallest(MAX_ROWS, range(n), key=lambda i: (not degenerate[i], _order(gids[i])))
    return tuple(row(i) for i in order), n - len(order)


def _size(value: object) -> int:
    return value if isinstance(value, int) and not isinstance(value, bool) and value > 0 else 0


def _reward(value: object) -> float | None:
    if isinstance(value, bool) or not isinstance(value, (int, float)):
        return None
    value = float(value)
    return None if math.isnan(value) else value


class StepGroups:
    """The groups of one (step, split): per group, members seen, reward range, members lost,
    members truncated, the expected size (the largest an episode gave, else ``group_size``) and
    how many of its members the sampler kept (``keep``).

    An offered episode is one row appended to columns (``note``: its group id, reward, whether
    it was lost or truncated, its expected size when it gave one), added up per group only when
    the step's health is asked for (kept members and the step's close) or every ``_FOLD_ROWS``
    rows (so the columns stay small): the per-episode work is a few appends under the lock the
    offer holds."""

    __slots__ = ("groups", "untracked", "group_size", "runs", "kept", "_index", "_ids", "_rewards",
                 "_fates", "_sizes")

    def __init__(self, group_size: int | None = None) -> None:
        self.groups: dict[object, _Group] = {}
        self.untracked = 0
        self.group_size = group_size or 0
        # batches' runs of one group each, as arrays: (group ids, members, lowest and highest
        # reward, members lost, members truncated, expected size), merged into ``groups`` only
        # when needed
        self.runs: list[tuple[list[object], Any, Any, Any, Any, Any, Any]] = []
        # members the sampler kept, per group id (``keep``: at most the step's kept episodes)
        self.kept: dict[object, int] = {}
        self._index: dict[object, int] | None = None
        # offered episodes not yet added up, one row each (always newer than every run):
        # group id, reward (NaN: none), fate (_OK, _LOST, _TRUNCATED); expected sizes as
        # (row, size), rare
        self._ids: list[object] = []
        self._rewards = array("d")
        self._fates = bytearray()
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
        self._fates.append(_FATES.get(status, _OK))
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
        for row, (gid, reward, fate) in enumerate(zip(ids, self._rewards, self._fates, strict=True)):
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
            if fate:
                if fate == _LOST:
                    g.lost += 1
                else:
                    g.truncated += 1
            if sizes:
                expected = _size(sizes.get(row))
                if expected > g.expected:
                    g.expected = expected
        self._ids = []
        self._rewards = array("d")
        self._fates = bytearray()
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
        truncated = np.zeros(starts.size, dtype=np.int64)
        statuses = batch.column(c.RL_STATUS)
        if statuses is not None:
            values = np.empty(n, dtype=object)
            values[:] = statuses
            mask = np.zeros(n, dtype=bool)
            for status in LOST_STATUSES:
                mask |= values == status
            if mask.any():
                lost = np.add.reduceat(mask.astype(np.int64), starts)
            mask = values == c.STATUS_TRUNCATED
            if mask.any():
                truncated = np.add.reduceat(mask.astype(np.int64), starts)
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
            truncated = truncated[idx]
        room = _MAX_GROUPS - self._held()
        if len(run_ids) > room:  # past the bound: counted, not assessed
            self.untracked += len(run_ids) - max(room, 0)
            cut = max(room, 0)
            run_ids, counts, lows, highs = run_ids[:cut], counts[:cut], lows[:cut], highs[:cut]
            lost, truncated, expected = lost[:cut], truncated[:cut], expected[:cut]
        if run_ids:
            self.runs.append((run_ids, counts, lows, highs, lost, truncated, expected))
            self._index = None

    def _held(self) -> int:
        return len(self.groups) + sum(len(r[0]) for r in self.runs)

    def pending(self) -> bool:
        """Whether anything was offered (rows or runs) that is not yet added up per group."""
        return bool(self._ids or self.runs)

    def _merge(self) -> None:
        """The batches' runs into per-group entries (a group seen in several runs or batches,
        or also episode by episode)."""
        for run_ids, counts, lows, highs, lost, truncated, expected in self.runs:
            for gid, m, lo, hi, gone, cut, size in zip(run_ids, counts.tolist(), lows.tolist(), highs.tolist(),
                                                       lost.tolist(), truncated.tolist(), expected.tolist(),
                                                       strict=True):
                g = self.groups.get(gid)
                if g is None:
                    g = self.groups[gid] = _Group()
                    g.expected = self.group_size
                g.n += m
                if lo == lo:  # not NaN: a row of the run has a reward
                    g.lo = min(g.lo, lo)
                    g.hi = max(g.hi, hi)
                g.lost += gone
                g.truncated += cut
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
                _, counts, lows, highs, lost, truncated, expected = self.runs[0]
                run = _Group()
                run.n, run.lost, run.truncated = int(counts[at]), int(lost[at]), int(truncated[at])
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

    def keep(self, gid: object) -> dict[str, object] | None:
        """A member of group ``gid`` was kept (the pipeline, as it hands kept episodes on at the
        step's close): counted for the group's row (``GroupRow.kept``); returns the member's
        root attributes (``attributes``: None when ``gid`` is not a tracked group)."""
        health = self.attributes(gid)
        if health is not None:
            self.kept[gid] = self.kept.get(gid, 0) + 1
        return health

    def count_kept(self, gid: object) -> None:
        """A member of group ``gid`` was kept as it was offered (a streaming policy), before its
        group's health is known: counted for the group's row only (nothing is added up)."""
        if gid is not None and not isinstance(gid, (list, dict)):
            self.kept[gid] = self.kept.get(gid, 0) + 1

    def summary(self) -> StepHealth:
        """The step's counts (a group both all-equal and lost counts in both, once as
        degenerate) and its groups as rows (``GroupRow``, at most ``MAX_ROWS``: degenerate
        first, then by group id), each with how many of its members were kept (``keep``)."""
        if self._ids:
            self._fold()
        kept = self.kept
        if self.runs and self._one_batch():
            import numpy as np

            run_ids, counts, lows, highs, lost, truncated, expected = self.runs[0]
            sizes = np.maximum(expected, self.group_size)
            gone = lost + np.maximum(sizes - counts, 0)
            equal = (counts >= 2) & (lows == highs)  # NaN (no reward) is never equal
            bad = equal | (gone > 0)

            def row(i: int) -> GroupRow:
                lo = float(lows[i])
                gid = run_ids[i]
                return GroupRow(_text(gid), int(counts[i]), int(sizes[i]),
                                float(highs[i]) - lo if lo == lo else None, bool(equal[i]),
                                int(truncated[i]), int(gone[i]), kept.get(gid, 0))

            rows, left_out = _table(run_ids, bad.tolist(), row)
            return StepHealth(groups=int(counts.size), all_equal=int(equal.sum()), lost=int((gone > 0).sum()),
                              lost_members=int(gone.sum()), degenerate=int(bad.sum()),
                              untracked=self.untracked, truncated=int((truncated > 0).sum()),
                              truncated_members=int(truncated.sum()), rows=rows, rows_left_out=left_out)
        if self.runs:
            self._merge()
        health = StepHealth(groups=len(self.groups), untracked=self.untracked)
        gids = list(self.groups)
        groups = list(self.groups.values())
        bad = []
        for g in groups:
            lost = g.lost + g.missing()
            equal = g.all_equal()
            if equal:
                health.all_equal += 1
            if lost:
                health.lost += 1
                health.lost_members += lost
            if g.truncated:
                health.truncated += 1
                health.truncated_members += g.truncated
            bad.append(equal or lost > 0)
        health.degenerate = bad.count(True)
        health.rows, health.rows_left_out = _table(
            gids, bad, lambda i: groups[i].row(gids[i], kept.get(gids[i], 0)))
        return health


def _attributes(g: _Group) -> dict[str, object]:
    """The root attributes of a kept member of group ``g``."""
    out: dict[str, object] = {
        c.RL_GROUP_SIZE: g.n,
        c.RL_GROUP_ALL_EQUAL: g.all_equal(),
        c.RL_GROUP_LOST: g.lost + g.missing(),
        c.RL_GROUP_TRUNCATED: g.truncated,
    }
    if g.expected:
        out[c.RL_GROUP_EXPECTED_SIZE] = g.expected
    if g.hi >= g.lo:
        out[c.RL_GROUP_REWARD_SPREAD] = g.hi - g.lo
    why = g.degenerate()
    if why is not None:
        out[c.RL_GROUP_DEGENERATE] = why
    return out
