"""The policies that keep or drop whole groups (``rl.group.id``: the samples of one GRPO
prompt): ``Groups`` and ``DegenerateGroups``."""

from __future__ import annotations

import math
from collections.abc import Callable
from typing import Any

from otel_rollouts import conventions as c
from otel_rollouts.sampling.batch import BatchRow, RowBatch
from otel_rollouts.sampling.policy import (
    BasePolicy,
    Bucket,
    Candidate,
    Decision,
    _check_budget,
    _pick,
    _stable_hash,
    label,
    score_of,
)

__all__ = ["LOST_STATUSES", "DegenerateGroups", "Groups"]


# --- groups --------------------------------------------------------------------------------------
class Groups(BasePolicy):
    """Whole groups (``rl.group.id``, e.g. the samples of one GRPO prompt) kept or dropped together.

    ``rule`` orders groups: ``"spread"`` (default: largest max−min of ``score`` first — a group
    whose samples all scored the same carries no GRPO advantage), ``"uniform"`` (a seeded hash
    of the group id) or ``"first"`` (first group to start first). Whole groups are added while
    they fit in the budget; an episode without a group id is a group of one.

    Memory rule: members arrive one by one, so a bucket holds at most ``max_held`` episode
    records (default ``2 × (cap + margin)``) plus a small summary per group it holds. When a new
    member would go over, the held group that ranks last right now is dropped whole. The choice
    is exact while a step's episodes fit in ``max_held``; past it, a group is let go on its
    standing at that moment: a group whose members are still arriving may rank higher later,
    and a small low-ranked group that would have filled the cap's last places is gone (raise
    ``max_held`` when that matters). A group larger than the cap can never be kept and is dropped
    whole. The ids of groups dropped this step are kept (a few bytes each) until the step closes,
    so their later members are dropped too.
    """

    name = "groups"
    label = c.REASON_GROUP
    RULES = ("spread", "uniform", "first")

    def __init__(self, n: int | None = None, *, rule: str = "spread", score: str = c.RL_REWARD,
                 max_held: int | None = None, seed: int = 0) -> None:
        if rule not in self.RULES:
            raise ValueError(f"Groups(rule): expected one of {self.RULES}, got {rule!r}")
        self.budget = _check_budget(n, "Groups(n)")
        self.rule, self.score, self.seed = rule, score, seed
        self.max_held = _check_budget(max_held, "Groups(max_held)")

    def bucket(self, cap: int, key: tuple[int, str], *, stream: bool = False,
               margin: int = 0) -> Bucket:
        held = self.max_held if self.max_held is not None else 2 * (cap + margin)
        return _GroupsBucket(self, cap, max(held, cap + margin))

    def needs(self) -> set[str]:
        return {c.RL_GROUP_ID, self.score}

    max_groups = 1 << 62  # whole groups kept at most (DegenerateGroups bounds it)

    def __repr__(self) -> str:
        return f"Groups({self.budget}, rule={self.rule!r}, score={self.score!r})"


# the statuses of a member a group lost: it never counts towards the advantage of the rest. A
# truncated member is not lost (it was sampled from the policy and scored, only cut short): the
# group health counts it apart (rl.group.truncated), and it never makes a group degenerate.
LOST_STATUSES = frozenset((c.STATUS_FILTERED, c.STATUS_ERROR))


class DegenerateGroups(Groups):
    """Up to ``groups`` whole *degenerate* groups (default 2): groups of two or more members
    that all got the same score (zero GRPO advantage: they teach nothing) or that lost members
    (a member filtered or failed, or fewer members than ``rl.group.expected_size``: the
    advantage of the rest is biased). A truncated member is not lost (it was scored, only cut
    short): a group whose truncated members scored apart is healthy, as its ``rl.group.*``
    health says. First come first. A part for a composition, e.g.
    ``"errors+top_bottom+degenerate_groups"``; each kept member says ``degenerate_group``."""

    name = "degenerate_groups"
    label = c.REASON_DEGENERATE_GROUP

    def __init__(self, groups: int = 2, n: int | None = None, *, score: str = c.RL_REWARD,
                 max_held: int | None = None) -> None:
        super().__init__(n, rule="first", score=score, max_held=max_held)
        self.rule = "degenerate"
        self.max_groups = _check_budget(groups, "DegenerateGroups(groups)") or 0

    def needs(self) -> set[str]:
        return {c.RL_GROUP_ID, self.score, c.RL_STATUS, c.RL_GROUP_EXPECTED_SIZE}

    def __repr__(self) -> str:
        return f"DegenerateGroups({self.max_groups}, n={self.budget}, score={self.score!r})"


class _Group:
    __slots__ = ("gid", "members", "lo", "hi", "first", "lost", "expected")

    def __init__(self, gid: object, first: int) -> None:
        self.gid, self.first = gid, first
        self.members: list[Any] = []  # records, or a batch's row indices until made
        self.lo = math.inf
        self.hi = -math.inf
        self.lost = 0  # members filtered or failed (LOST_STATUSES; truncated ones are not lost)
        self.expected = 0  # the largest expected size a member gave (0: unknown)

    def degenerate(self) -> bool:
        """All its (two or more) members scored the same, or it lost members."""
        n = len(self.members)
        return (n >= 2 and self.hi == self.lo) or self.lost > 0 or n < self.expected


class _GroupsBucket(Bucket):
    def __init__(self, policy: Groups, cap: int, max_held: int) -> None:
        self.policy, self.cap, self.max_held = policy, cap, max_held
        self.groups: dict[Any, _Group] = {}
        self.dropped: set[object] = set()
        self.count = 0
        self.seq = 0

    def priority(self, g: _Group) -> tuple[float, ...]:
        """Larger is better."""
        rule = self.policy.rule
        if rule == "spread":
            spread = g.hi - g.lo if g.hi >= g.lo else -1.0
            return (spread, -g.first)
        if rule == "uniform":
            return (-_stable_hash(self.policy.seed, g.gid), -g.first)
        if rule == "degenerate":  # the degenerate ones, then those too small to tell, first come
            return (2.0 if g.degenerate() else 1.0 if len(g.members) < 2 else 0.0, -g.first)
        return (-g.first,)

    def offer(self, record: Candidate) -> Decision:
        gid = record.attribute(c.RL_GROUP_ID)
        if gid is None:
            gid = ("episode", record.trace_id)
        if gid in self.dropped:
            return [record], []
        self.seq += 1
        g = self.groups.get(gid)
        if g is None:
            g = self.groups[gid] = _Group(gid, self.seq)
        g.members.append(record)
        self.count += 1
        score = score_of(record, self.policy.score)
        if score is not None:
            g.lo, g.hi = min(g.lo, score), max(g.hi, score)
        if self.policy.rule == "degenerate":
            if record.attribute(c.RL_STATUS) in LOST_STATUSES:
                g.lost += 1
            expected = record.attribute(c.RL_GROUP_EXPECTED_SIZE)
            if isinstance(expected, int) and not isinstance(expected, bool):
                g.expected = max(g.expected, expected)
        released: list[Candidate] = []
        if len(g.members) > self.cap:
            self._evict(g, released)
        while self.count > self.max_held:
            # the group being filled may still grow (its spread too): evict among the others
            others = [h for h in self.groups.values() if h is not g] or [g]
            self._evict(min(others, key=self.priority), released)
        return released, []

    def offer_batch(self, batch: RowBatch, make_row: Callable[[int], Any]) -> tuple[list[Candidate], list[Candidate]]:
        """Offer every row of ``batch`` in order, a run of rows of one group at a time: the
        same state as offering them one by one (what a run does to the count, the cap and the
        other groups follows from its length), with an object made only for a row still held at
        the end (``make_row(i)``). Returns the earlier records let go, and this batch's held rows.
        """
        import numpy as np

        n = batch.n
        col = batch.column(c.RL_GROUP_ID)
        gids = [
            ("episode", batch.trace_id(i)) if col is None or col[i] is None else col[i]
            for i in range(n)
        ]
        starts = [0] + [i for i in range(1, n) if gids[i] != gids[i - 1]] if n else []
        scores = batch.scores(self.policy.score)
        degenerate = self.policy.rule == "degenerate"
        statuses = (batch.column(c.RL_STATUS) or [None] * n) if degenerate else ()
        expected = (batch.column(c.RL_GROUP_EXPECTED_SIZE) or [None] * n) if degenerate else ()
        lows = np.fmin.reduceat(scores, starts).tolist() if n else []
        highs = np.fmax.reduceat(scores, starts).tolist() if n else []
        released: list[Any] = []  # records, and row indices never made
        touched: dict[Any, _Group] = {}
        for run, start in enumerate(starts):
            stop = starts[run + 1] if run + 1 < len(starts) else n
            gid = gids[start]
            if gid in self.dropped:
                continue
            g = self.groups.get(gid)
            if g is None:
                g = self.groups[gid] = _Group(gid, self.seq + 1)
            room = self.cap - len(g.members)
            take = min(stop - start, room)
            g.members.extend(range(start, start + take))
            touched[gid] = g
            self.seq += take
            self.count += take
            if take == stop - start and lows[run] == lows[run]:  # not NaN: a row has a score
                g.lo, g.hi = min(g.lo, lows[run]), max(g.hi, highs[run])
            if degenerate:
                g.lost += sum(1 for i in range(start, start + take) if statuses[i] in LOST_STATUSES)
                sizes = [v for v in expected[start:start + take] if isinstance(v, int) and not isinstance(v, bool)]
                g.expected = max([g.expected, *sizes])
            if self.count > self.max_held:  # the others, in the order one by one would evict them
                for h in sorted((h for h in self.groups.values() if h is not g), key=self.priority):
                    if self.count <= self.max_held:
                        break
                    self._evict(h, released)
            if take < stop - start:  # the next row goes over the cap: the group goes whole
                g.members.append(start + take)
                self.seq += 1
                self.count += 1
                self._evict(g, released)
        held: list[Candidate] = []
        for gid, g in touched.items():
            if self.groups.get(gid) is g:
                g.members = [make_row(m) if type(m) is int else m for m in g.members]
                held.extend(m for m in g.members if isinstance(m, BatchRow) and m.batch is batch)
        return [r for r in released if type(r) is not int], held

    def _evict(self, g: _Group, released: list[Candidate]) -> None:
        del self.groups[g.gid]
        self.dropped.add(g.gid)
        self.count -= len(g.members)
        released.extend(g.members)

    def decide(self, limit: int | None = None, exclude: set[int] | None = None) -> list[Candidate]:
        limit = self.cap if limit is None else limit
        taken = set(exclude or ())
        out: list[Candidate] = []
        policy = self.policy
        only_degenerate = policy.rule == "degenerate"
        groups = 0
        for g in sorted(self.groups.values(), key=self.priority, reverse=True):
            if only_degenerate and (not g.degenerate() or groups >= policy.max_groups):
                break  # ordered: the degenerate ones come first
            fresh = [r for r in g.members if id(r) not in taken]
            if fresh and len(fresh) <= limit - len(out):
                _pick(fresh, len(fresh), taken, out)
                groups += 1
        label(out, policy.label)
        return out

    def held(self) -> list[Candidate]:
        return [r for g in self.groups.values() for r in g.members]
