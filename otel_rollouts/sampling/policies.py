"""Tail sampling of whole episodes, per (training step, split).

A policy decides which episodes of a step are worth exporting once their rewards are known.
It sees *episode records* (never rendered spans), holds a number of them bounded by the cap,
and releases a candidate the moment it can no longer be chosen, so memory depends on the cap,
not on how many episodes a step saw.

The protocol is small so that policies compose. ``Policy`` and ``Bucket`` are the extension
points (``typing.Protocol``, checkable with ``isinstance``): a custom policy is any object with
``bucket`` and ``needs``, a plain class will do (no base class needed; ``BasePolicy`` gives the
built-ins' defaults to those who want them):

* ``Policy.bucket(cap, key, stream=False, margin=0)`` makes a ``Bucket`` for one (step, split)
  that may be asked for up to ``cap`` episodes, ``margin`` of its candidates possibly being
  taken already by an earlier part of a composition (so it holds up to ``cap + margin``).
* ``Bucket.offer(record)`` returns ``(released, keep_now)``: records it will never choose (the
  caller drops them at once) and records kept for good right now (streaming policies only).
* ``Bucket.decide(limit, exclude)`` returns at most ``limit`` held records, none whose ``id()``
  is in ``exclude``, each once. Everything held and not returned is dropped.
* ``Bucket.held()`` lists what it holds (each record once).

A bucket may also offer ``candidates(batch)`` (see ``otel_rollouts.sampling.batch``): the rows
of a ``RowBatch`` it could still hold once the whole batch was offered, found with numpy, so
that a batch of thousands of samples costs Python objects for a few dozen. A bucket without it
(a custom one) is offered every row of a batch, as light ``BatchRow`` objects.

A record only needs ``attribute(name)`` and an integer ``trace_id``; the distributed budget
(``otel_rollouts.sampling.distributed``) feeds light summaries of every rank's candidates into a fresh
bucket of the same policy, so every rank computes the same global choice.
"""

from __future__ import annotations

import hashlib
import heapq
import math
from collections.abc import Callable, Iterable
from typing import Any, Protocol, runtime_checkable

from otel_rollouts import conventions as c
from otel_rollouts.sampling.batch import RowBatch, best_rows, masked

Decision = tuple[list[Any], list[Any]]  # (released, keep_now)
_MASK64 = (1 << 64) - 1


def score_of(record: Any, attribute: str) -> float | None:
    """The numeric score of an episode record, or None when it has none (or NaN)."""
    value = record.attribute(attribute)
    if isinstance(value, bool) or not isinstance(value, (int, float)):
        return None
    value = float(value)
    return None if math.isnan(value) else value


def _stable_hash(seed: int, value: Any) -> int:
    """A 64-bit hash that is the same in every process (str hashing is salted per process)."""
    if isinstance(value, int):
        value = value.to_bytes(16, "big", signed=False) if value >= 0 else str(value).encode()
    else:
        value = str(value).encode()
    digest = hashlib.blake2b(value, digest_size=8, key=str(seed).encode()[:64])
    return int.from_bytes(digest.digest(), "big")


def _or_nan(value: int | None) -> float:
    return math.nan if value is None else float(value)


def _let_go(refs: dict[int, int], record: Any, out: list[Any]) -> None:
    """One holder lets ``record`` go; once no holder is left it goes to ``out`` (released)."""
    i = id(record)
    n = refs.get(i, 0) - 1
    if n > 0:
        refs[i] = n
    else:
        refs.pop(i, None)
        out.append(record)


def label(records: Iterable[Any], reason: str) -> None:
    """Say why ``records`` are kept (``rl.sampling.reason``), unless a more specific part of the
    policy said it already: a record carries its reason until the pipeline keeps it. Records
    of other kinds (without a ``reason`` slot) are left as they are."""
    for r in records:
        try:
            if getattr(r, "reason", None) is None:
                r.reason = reason
        except AttributeError:
            pass


def reason_of(policy: Any) -> str:
    """The reason a policy gives for what it keeps: its ``label``, else its ``name``, else
    ``policy`` (a custom policy without either)."""
    for attr in ("label", "name"):
        value = getattr(policy, attr, None)
        if isinstance(value, str) and value:
            return value
    return c.REASON_POLICY


@runtime_checkable
class Bucket(Protocol):
    """The candidates of one (step, split) under one policy: what ``Policy.bucket`` returns.

    The sampling pipeline calls, on the thread that ends episodes (under its lock, so a bucket
    needs no lock of its own): ``offer`` once per finished episode of the step, then, when the
    step closes, ``decide`` once and ``held`` (to drop what was not chosen). The distributed
    budget does the same on a fresh bucket fed light summaries of every rank's candidates, so
    ``decide`` must depend only on what was offered (in order), never on the clock or on chance.
    A record is only known by ``record.attribute(name)`` and ``record.trace_id``; a bucket holds
    at most about ``cap + margin`` of them (memory must not grow with the episodes of a step).
    """

    def offer(self, record: Any) -> Decision:
        """Take one finished episode: return ``(released, keep_now)``, the records this bucket
        will never choose (dropped at once) and those kept for good right now (exported at
        once; streaming buckets only, others return ``[]``)."""
        ...

    def decide(self, limit: int | None = None, exclude: set[int] | None = None) -> list[Any]:
        """When the step closes: at most ``limit`` (default: the cap) held records, none whose
        ``id()`` is in ``exclude`` (taken by an earlier part of a composition), each once."""
        ...

    def held(self) -> list[Any]:
        """Every record held now, each once (what is not decided is dropped)."""
        ...


@runtime_checkable
class Policy(Protocol):
    """A rule for choosing at most ``cap`` episodes of a step: the sampling extension point.

    A custom policy is any object with these two methods (``isinstance(obj, Policy)`` checks
    it); it may also carry ``budget`` (int or None), its own share of the cap when it is a part
    of a ``Compose``. ``bucket`` is called once per (step, split), when the step's first episode
    finishes (and once per step by the distributed budget); ``needs`` when the distributed budget
    summarises candidates (the attributes it must carry across ranks).
    """

    def bucket(self, cap: int, key: tuple[int, str], *, stream: bool = False,
               margin: int = 0) -> Bucket:
        """A fresh ``Bucket`` for the (step, split) ``key``, choosing at most ``cap`` episodes and
        holding up to ``cap + margin``. ``stream=True`` (one process, the policy alone) allows
        it to keep episodes at once from ``offer``."""
        ...

    def needs(self) -> set[str]:
        """Episode attributes this policy reads (carried across ranks by the distributed budget)."""
        ...


def budget_of(policy: Policy) -> int | None:
    """A policy's own share of the cap in a ``Compose`` (``budget``; None: what is left)."""
    budget = getattr(policy, "budget", None)
    return budget if isinstance(budget, int) and not isinstance(budget, bool) else None


class BasePolicy(Policy):
    """The built-in policies' base: a name, no attributes read, no budget of its own."""

    name = "policy"
    label = c.REASON_POLICY  # rl.sampling.reason of what it keeps
    streaming = False  # True when decisions need no comparison and can be exported at once
    budget: int | None = None  # its own share of the cap inside a ``Compose`` (None: what is left)

    def bucket(self, cap: int, key: tuple[int, str], *, stream: bool = False,
               margin: int = 0) -> Bucket:  # pragma: no cover - interface
        raise NotImplementedError

    def needs(self) -> set[str]:
        """Episode attributes this policy reads (carried across ranks by the distributed budget)."""
        return set()

    def __repr__(self) -> str:
        return f"{type(self).__name__}()"


def _check_budget(n: int | None, what: str) -> int | None:
    if n is not None and (isinstance(n, bool) or not isinstance(n, int) or n < 0):
        raise ValueError(f"{what}: expected a non-negative int or None, got {n!r}")
    return n


def _pick(candidates: Iterable[Any], limit: int, exclude: set[int], out: list[Any]) -> None:
    """Append to ``out`` up to ``limit`` candidates not excluded and not already in ``out``."""
    if limit <= 0:
        return
    taken = 0
    for r in candidates:
        i = id(r)
        if i in exclude:
            continue
        exclude.add(i)
        out.append(r)
        taken += 1
        if taken >= limit:
            return


class _RankedBucket(Bucket):
    """Holds the ``capacity`` best records by a key (smaller is better); releases the rest."""

    __slots__ = ("capacity", "heap", "seq", "later_wins")
    reason = c.REASON_POLICY  # what the records it decides are kept for

    def __init__(self, capacity: int, *, later_wins: bool = False) -> None:
        self.capacity = capacity
        self.heap: list[tuple[Any, int, Any]] = []  # max-heap via negated keys: worst on top
        self.seq = 0
        self.later_wins = later_wins  # ties: the later arrival is better (default: the earlier)

    def rank(self, record: Any) -> Any:  # pragma: no cover - interface
        """The record's key (smaller is better), or None when it is not eligible at all."""
        raise NotImplementedError

    def offer(self, record: Any) -> Decision:
        return self.offer_ranked(record, self.rank(record))

    def takes(self, key: Any) -> bool:
        """Whether a record of this key would be held now (ties: the earlier arrival wins)."""
        heap = self.heap
        if key is None or self.capacity <= 0:
            return False
        return len(heap) < self.capacity or -key > heap[0][0] or (self.later_wins and -key == heap[0][0])

    def offer_ranked(self, record: Any, key: Any) -> Decision:
        if not self.takes(key):
            return [record], []
        self.seq += 1
        # the worst on top; ties: the earlier arrival is better, or the later one (later_wins)
        entry = (-key, self.seq if self.later_wins else -self.seq, record)
        if len(self.heap) < self.capacity:
            heapq.heappush(self.heap, entry)
            return [], []
        return [heapq.heapreplace(self.heap, entry)[2]], []

    def batch_keys(self, batch: RowBatch) -> Any:
        """``rank`` for every row of ``batch`` as a numpy array (float NaN: not eligible), or
        None when it cannot be computed in one pass."""
        return None

    def candidates(self, batch: RowBatch) -> Any:
        """The rows of ``batch`` this bucket could hold once it was offered all of them (None:
        every row)."""
        keys = self.batch_keys(batch)
        if keys is None:
            return None
        return best_rows(masked(keys, batch), self.capacity, later_wins=self.later_wins)

    def ordered(self) -> list[Any]:
        return [e[2] for e in sorted(self.heap, key=lambda e: e[:2], reverse=True)]

    def decide(self, limit: int | None = None, exclude: set[int] | None = None) -> list[Any]:
        out: list[Any] = []
        _pick(self.ordered(), self.capacity if limit is None else limit, set(exclude or ()), out)
        if self.reason:
            label(out, self.reason)
        return out

    def held(self) -> list[Any]:
        return [e[2] for e in self.heap]


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

    def offer(self, record: Any) -> Decision:
        if self.kept < self.cap:
            self.kept += 1
            label((record,), c.REASON_FIRST)
            return [], [record]
        return [record], []

    def candidates(self, batch: RowBatch) -> Any:
        return batch.unskipped(self.cap - self.kept)

    def decide(self, limit: int | None = None, exclude: set[int] | None = None) -> list[Any]:
        return []

    def held(self) -> list[Any]:
        return []


class _FirstBucket(Bucket):
    def __init__(self, capacity: int) -> None:
        self.capacity = capacity
        self.records: list[Any] = []

    def offer(self, record: Any) -> Decision:
        if len(self.records) < self.capacity:
            self.records.append(record)
            return [], []
        return [record], []

    def candidates(self, batch: RowBatch) -> Any:
        return batch.unskipped(self.capacity - len(self.records))

    def decide(self, limit: int | None = None, exclude: set[int] | None = None) -> list[Any]:
        out: list[Any] = []
        _pick(self.records, self.capacity if limit is None else limit, set(exclude or ()), out)
        label(out, c.REASON_FIRST)
        return out

    def held(self) -> list[Any]:
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

    def rank(self, record: Any) -> Any:
        return _stable_hash(self.seed, record.trace_id)

    def batch_keys(self, batch: RowBatch) -> Any:
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

    def rank(self, record: Any) -> Any:
        return Errors._CLASS.get(record.attribute(c.RL_STATUS))

    def decide(self, limit: int | None = None, exclude: set[int] | None = None) -> list[Any]:
        out = super().decide(limit, exclude)  # errors first, then truncated: each says which
        for r in out:
            if r.attribute(c.RL_STATUS) == c.STATUS_TRUNCATED:
                label((r,), c.REASON_TRUNCATED)
        label(out, c.REASON_ERROR)
        return out

    def batch_keys(self, batch: RowBatch) -> Any:
        import numpy as np

        statuses = batch.column(c.RL_STATUS)
        if statuses is None:
            return np.full(batch.n, np.nan)
        get = Errors._CLASS.get
        return np.fromiter((_or_nan(get(s) if isinstance(s, str) else None) for s in statuses),
                           dtype=np.float64, count=batch.n)


# --- top / bottom --------------------------------------------------------------------------------
class TopBottom(BasePolicy):
    """The ``top`` best and ``bottom`` worst episodes by a numeric attribute (default reward).

    Any numeric root attribute may be named (``score="rl.advantage"``). With no explicit split
    of the cap, half goes to each side (the extra one to the top). Episodes without a score only
    fill what the ranked ones leave free. Ties among the best go to the earlier arrival, among
    the worst to the later one, so equal scores still fill the cap with distinct episodes; an
    episode that is both among the best and the worst (few episodes) is kept once.
    """

    name = "top_bottom"
    label = c.REASON_TOP

    def __init__(self, score: str = c.RL_REWARD, top: int | None = None,
                 bottom: int | None = None):
        self.score = score
        self.top = _check_budget(top, "TopBottom(top)")
        self.bottom = _check_budget(bottom, "TopBottom(bottom)")
        self.budget = (top or 0) + (bottom or 0) if (top is not None and bottom is not None) else None

    def split(self, limit: int) -> tuple[int, int]:
        """(top, bottom) for a budget of ``limit`` episodes, never over it."""
        if self.top is None and self.bottom is None:
            return limit - limit // 2, limit // 2
        if self.top is None:
            bottom = min(self.bottom or 0, limit)
            return limit - bottom, bottom
        top = min(self.top, limit)
        bottom = limit - top if self.bottom is None else min(self.bottom, limit - top)
        return top, bottom

    def bucket(self, cap: int, key: tuple[int, str], *, stream: bool = False,
               margin: int = 0) -> Bucket:
        top, bottom = self.split(cap)
        return _TopBottomBucket(self, cap, top + margin if top else 0,
                                bottom + margin if bottom else 0, margin)

    def needs(self) -> set[str]:
        return {self.score}

    def __repr__(self) -> str:
        return f"TopBottom(score={self.score!r}, top={self.top}, bottom={self.bottom})"


class _TopBottomBucket(Bucket):
    def __init__(self, policy: TopBottom, cap: int, top: int, bottom: int, margin: int) -> None:
        self.policy, self.cap, self.margin, self.score = policy, cap, margin, policy.score
        # one total order, (score, arrival), read from both ends: the best are the highest scores
        # (ties: the earlier arrival), the worst the lowest (ties: the later), so the two sides
        # never hold the same episode once there are more than top + bottom of them
        self.best = _ScoreBucket(top, policy.score, -1.0)
        self.worst = _ScoreBucket(bottom, policy.score, 1.0, later_wins=True)
        self.refs: dict[int, int] = {}  # id(record) -> how many sides hold it
        self.unscored: list[Any] = []

    def _let_go(self, record: Any, out: list[Any]) -> None:
        _let_go(self.refs, record, out)

    def offer(self, record: Any) -> Decision:
        score = score_of(record, self.score)
        if score is None:
            if len(self.refs) < self.cap + self.margin and len(self.unscored) < self.cap + self.margin:
                self.unscored.append(record)
                return [], []
            return [record], []
        if not self.best.takes(-score) and not self.worst.takes(score):
            return [record], []  # the common case once the step is under way
        released: list[Any] = []
        self.refs[id(record)] = 2  # held by both sides until one lets it go
        for r in self.best.offer_ranked(record, -score)[0]:
            self._let_go(r, released)
        for r in self.worst.offer_ranked(record, score)[0]:
            self._let_go(r, released)
        if self.unscored and len(self.refs) >= self.cap + self.margin:
            # enough distinct scored candidates: the unscored ones can never be chosen
            released.extend(self.unscored)
            self.unscored = []
        return released, []

    def candidates(self, batch: RowBatch) -> Any:
        """The best and the worst of the batch. Not when a row (held or offered) has no score:
        whether an unscored one is held depends on how many scored ones are held at each step."""
        import numpy as np

        if self.unscored or bool(np.isnan(batch.scores(self.score)).any()):
            return None
        return np.union1d(self.best.candidates(batch), self.worst.candidates(batch))

    def decide(self, limit: int | None = None, exclude: set[int] | None = None) -> list[Any]:
        limit = self.cap if limit is None else limit
        k_top, k_bottom = self.policy.split(limit)
        taken = set(exclude or ())
        out: list[Any] = []
        best, worst = self.best.ordered(), self.worst.ordered()
        _pick(best, k_top, taken, out)
        label(out, c.REASON_TOP)
        n = len(out)
        _pick(worst, k_bottom, taken, out)
        label(out[n:], c.REASON_BOTTOM)
        # the other side (or unscored ones) fill what one side could not
        n = len(out)
        _pick(best, limit - len(out), taken, out)
        label(out[n:], c.REASON_TOP)
        n = len(out)
        _pick(worst, limit - len(out), taken, out)
        label(out[n:], c.REASON_BOTTOM)
        n = len(out)
        _pick(self.unscored, limit - len(out), taken, out)
        label(out[n:], c.REASON_FIRST)  # no score: first come
        return out

    def held(self) -> list[Any]:
        seen: dict[int, Any] = {}
        for r in self.best.held() + self.worst.held() + self.unscored:
            seen[id(r)] = r
        return list(seen.values())


class _ScoreBucket(_RankedBucket):
    __slots__ = ("score", "sign")
    reason = c.REASON_TOP  # TopBottom labels both sides itself

    def __init__(self, capacity: int, score: str, sign: float, *, later_wins: bool = False) -> None:
        super().__init__(capacity, later_wins=later_wins)
        self.score, self.sign = score, sign

    def rank(self, record: Any) -> Any:
        value = score_of(record, self.score)
        return None if value is None else self.sign * value

    def batch_keys(self, batch: RowBatch) -> Any:
        return self.sign * batch.scores(self.score)


class _SlowestBucket(_ScoreBucket):
    __slots__ = ()
    reason = c.REASON_SLOWEST


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


LOST_STATUSES = frozenset((c.STATUS_FILTERED, c.STATUS_ERROR, c.STATUS_TRUNCATED))


class DegenerateGroups(Groups):
    """Up to ``groups`` whole *degenerate* groups (default 2): groups of two or more members
    that all got the same score (zero GRPO advantage: they teach nothing) or that lost members
    (a member filtered, failed or truncated, or fewer members than ``rl.group.expected_size``:
    the advantage of the rest is biased). First come first. A part for a composition, e.g.
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


# --- slowest -------------------------------------------------------------------------------------
class Slowest(BasePolicy):
    """The ``n`` (default: its share of the cap) slowest episodes of the step: the stragglers
    that held it back. Ranked by ``rl.duration.seconds`` (the root's duration for an episode
    recorded while it ran; what the framework measured for an adapter's); an episode whose time
    nobody measured is never chosen. Ties: the earlier to finish."""

    name = "slowest"
    label = c.REASON_SLOWEST

    def __init__(self, n: int | None = None) -> None:
        self.budget = _check_budget(n, "Slowest(n)")

    def bucket(self, cap: int, key: tuple[int, str], *, stream: bool = False,
               margin: int = 0) -> Bucket:
        return _SlowestBucket(cap + margin, c.RL_DURATION_SECONDS, -1.0)

    def needs(self) -> set[str]:
        return {c.RL_DURATION_SECONDS}

    def __repr__(self) -> str:
        return f"Slowest({self.budget})" if self.budget is not None else "Slowest()"


class _MismatchBucket(_ScoreBucket):
    __slots__ = ()
    reason = c.REASON_MISMATCH


class Mismatch(BasePolicy):
    """The ``n`` (default: its share of the cap) episodes of the step whose train–inference
    mismatch is largest: where the inference engine and the trainer disagree most on the
    probabilities of the tokens that were sampled. ``by``: the statistic ranked (a key of
    ``conventions.MISMATCH_STATS``: ``"kl"`` (default), ``"abs_mean"``, ``"abs_max"``,
    ``"ratio_max"``, ``"tokens_outside"``, or ``"ratio_min"``, ranked smallest first). An episode
    without both logprobs has no statistic and is never chosen. Ties: the earlier to finish."""

    name = "mismatch"
    label = c.REASON_MISMATCH

    def __init__(self, n: int | None = None, *, by: str = "kl") -> None:
        if by not in c.MISMATCH_STATS:
            raise ValueError(f"Mismatch(by): expected one of {sorted(c.MISMATCH_STATS)}, got {by!r}")
        self.budget = _check_budget(n, "Mismatch(n)")
        self.by = by
        self.score = c.MISMATCH_STATS[by]

    def bucket(self, cap: int, key: tuple[int, str], *, stream: bool = False,
               margin: int = 0) -> Bucket:
        return _MismatchBucket(cap + margin, self.score, 1.0 if self.by == "ratio_min" else -1.0)

    def needs(self) -> set[str]:
        return {self.score}

    def __repr__(self) -> str:
        n = "" if self.budget is None else f"{self.budget}, "
        return f"Mismatch({n}by={self.by!r})"


class _Group:
    __slots__ = ("gid", "members", "lo", "hi", "first", "lost", "expected")

    def __init__(self, gid: Any, first: int) -> None:
        self.gid, self.first = gid, first
        self.members: list[Any] = []
        self.lo = math.inf
        self.hi = -math.inf
        self.lost = 0  # members filtered, failed or truncated
        self.expected = 0  # the largest expected size a member gave (0: unknown)

    def degenerate(self) -> bool:
        """All its (two or more) members scored the same, or it lost members."""
        n = len(self.members)
        return (n >= 2 and self.hi == self.lo) or self.lost > 0 or n < self.expected


class _GroupsBucket(Bucket):
    def __init__(self, policy: Groups, cap: int, max_held: int) -> None:
        self.policy, self.cap, self.max_held = policy, cap, max_held
        self.groups: dict[Any, _Group] = {}
        self.dropped: set[Any] = set()
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

    def offer(self, record: Any) -> Decision:
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
        released: list[Any] = []
        if len(g.members) > self.cap:
            self._evict(g, released)
        while self.count > self.max_held:
            # the group being filled may still grow (its spread too): evict among the others
            others = [h for h in self.groups.values() if h is not g] or [g]
            self._evict(min(others, key=self.priority), released)
        return released, []

    def offer_batch(self, batch: RowBatch, make_row: Callable[[int], Any]) -> tuple[list[Any], list[Any]]:
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
        released: list[Any] = []
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
        held: list[Any] = []
        for gid, g in touched.items():
            if self.groups.get(gid) is g:
                g.members = [make_row(m) if type(m) is int else m for m in g.members]
                held.extend(m for m in g.members if getattr(m, "batch", None) is batch)
        return [r for r in released if type(r) is not int], held

    def _evict(self, g: _Group, released: list[Any]) -> None:
        del self.groups[g.gid]
        self.dropped.add(g.gid)
        self.count -= len(g.members)
        released.extend(g.members)

    def decide(self, limit: int | None = None, exclude: set[int] | None = None) -> list[Any]:
        limit = self.cap if limit is None else limit
        taken = set(exclude or ())
        out: list[Any] = []
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

    def held(self) -> list[Any]:
        return [r for g in self.groups.values() for r in g.members]


# --- compositions --------------------------------------------------------------------------------
class Compose(BasePolicy):
    """Parts with sub-budgets, decided in order: ``Compose(Errors(2), TopBottom(top=4,
    bottom=4), Uniform())`` keeps 2 failures, then the 4 best and 4 worst of the rest, then fills
    the cap uniformly. A part with a budget takes at most that many; a part without one
    (``Uniform()``) takes all it can of what the later parts' budgets leave. Never over the cap
    (budgets past it are cut), never the same episode twice: each part skips episodes an earlier
    part took, and holds that many extra candidates so that it can still fill its share.

    ``equal_shares=True`` (what names joined by ``+`` build, e.g. ``"errors+top_bottom"``)
    splits the cap into equal shares instead: part ``i`` of ``n`` gets ``(cap + i) // n``, i.e.
    ``cap // n`` each, the remainder one each to the last parts (the last part, typically the
    main policy, gets the most). A part takes at most its own share plus what the earlier parts
    left of theirs (and at most its budget, when it has one), so the first part takes at most its
    share and a share a part could not fill passes on to the next parts: ``"errors+top_bottom"``
    at cap 8 keeps at most 4 errors and fills the rest (8 with no errors) by top/bottom. The
    shares are of the cap the composition is asked for (a smaller ``limit`` at decide time
    shrinks them).
    """

    name = "compose"

    def __init__(self, *parts: Policy | str, equal_shares: bool = False) -> None:
        if not parts:
            raise ValueError("Compose: expected at least one policy")
        self.parts = [make_policy(p) for p in parts]
        self.equal_shares = bool(equal_shares)

    def needs(self) -> set[str]:
        out: set[str] = set()
        for p in self.parts:
            out |= p.needs()
        return out

    def shares(self, cap: int) -> list[int]:
        """Each part's equal share of ``cap`` (summing to ``cap``, the remainder to the last)."""
        n = len(self.parts)
        return [(cap + i) // n for i in range(n)]

    def reserved(self, cap: int) -> list[int]:
        """For each part, how much of ``cap`` is kept back for the parts after it: their budgets
        (by default) or their equal shares (``equal_shares``)."""
        keep = self.shares(cap) if self.equal_shares else [budget_of(p) or 0 for p in self.parts]
        out, later = [], 0
        for k in reversed(keep):
            out.append(later)
            later += k
        return out[::-1]

    def limits(self, cap: int) -> list[int]:
        """The most each part may take (its budget, or what the later parts' budgets or shares
        leave when no earlier part took anything), cut to the cap."""
        out = []
        for p, later in zip(self.parts, self.reserved(cap), strict=True):
            most, budget = max(cap - later, 0), budget_of(p)
            out.append(min(most, budget) if budget is not None else most)
        return out

    def bucket(self, cap: int, key: tuple[int, str], *, stream: bool = False,
               margin: int = 0) -> Bucket:
        subs = []
        earlier = 0  # the most the earlier parts may take together
        before = cap  # ... which is also at most what the previous part's room left (the cap)
        for part, most, later in zip(self.parts, self.limits(cap), self.reserved(cap), strict=True):
            # each part holds its most plus as many as the earlier parts may have taken of its
            # candidates, so that it can still fill its room after them
            subs.append(part.bucket(most, key, margin=min(earlier, before) + margin))
            earlier += most
            before = max(cap - later, 0)
        return _ComposeBucket(self, cap, subs)

    def __repr__(self) -> str:
        shares = ", equal_shares=True" if self.equal_shares else ""
        return f"Compose({', '.join(map(repr, self.parts))}{shares})"


class _ComposeBucket(Bucket):
    def __init__(self, policy: Compose, cap: int, subs: list[Bucket]) -> None:
        self.policy, self.cap, self.subs = policy, cap, subs
        self.refs: dict[int, int] = {}  # id(record) -> how many parts hold it

    def offer(self, record: Any) -> Decision:
        released: list[Any] = []
        self.refs[id(record)] = len(self.subs)  # held by every part until each lets it go
        for sub in self.subs:
            for r in sub.offer(record)[0]:
                _let_go(self.refs, r, released)
        return released, []

    def candidates(self, batch: RowBatch) -> Any:
        """Every part's candidates: each part ends as it would have after every row, since the
        rows it could hold are all offered to it (None when a part cannot tell)."""
        import numpy as np

        out = None
        for sub in self.subs:
            find = getattr(sub, "candidates", None)
            found = find(batch) if callable(find) else None
            if found is None:
                return None
            out = np.asarray(found, dtype=np.int64) if out is None else np.union1d(out, found)
        return out

    def decide(self, limit: int | None = None, exclude: set[int] | None = None) -> list[Any]:
        cap = self.cap if limit is None else min(limit, self.cap)
        taken = set(exclude or ())
        out: list[Any] = []
        parts = self.policy.parts
        for part, sub, later in zip(parts, self.subs, self.policy.reserved(cap), strict=True):
            room, budget = cap - len(out) - later, budget_of(part)
            if budget is not None:
                room = min(room, budget)
            if room <= 0:
                continue
            chosen = sub.decide(room, taken)
            label(chosen, reason_of(part))  # a custom part's own label, if it set none
            for r in chosen:
                taken.add(id(r))
                out.append(r)
        return out[:cap]

    def held(self) -> list[Any]:
        seen: dict[int, Any] = {}
        for sub in self.subs:
            for r in sub.held():
                seen[id(r)] = r
        return list(seen.values())


# --- names ---------------------------------------------------------------------------------------
POLICIES: dict[str, Any] = {
    First.name: First,
    Uniform.name: Uniform,
    TopBottom.name: TopBottom,
    Errors.name: lambda: Compose(Errors(), Uniform()),
    Groups.name: Groups,
    Slowest.name: Slowest,
    Mismatch.name: Mismatch,
    DegenerateGroups.name: DegenerateGroups,
}
DEFAULT_POLICY = "default"
ERROR_SHARE = 4  # the default policy keeps errors within a quarter of the cap (at least one)


def default_policy(cap: int) -> Compose:
    """What ``TailSampler()`` keeps: errors (failed first, then truncated) within a quarter of
    the cap (at least one, while the cap allows), then the best and worst by reward. A step's
    crash is never lost for want of a rule, and failures never crowd out the ranked episodes."""
    return Compose(Errors(min(max(cap // ERROR_SHARE, 1), cap)), TopBottom())


def make_policy(policy: str | Policy, seed: int = 0) -> Policy:
    """A policy from an object, a name (``"first"``, ``"uniform"``, ``"top_bottom"``,
    ``"errors"``, ``"groups"``) or names joined by ``+`` (``"errors+top_bottom+uniform"``:
    a ``Compose(..., equal_shares=True)`` of those parts: each gets ``cap // n`` of the cap, the
    remainder to the last parts, and what a part leaves of its share passes on to the next).
    Parts for compositions: ``"slowest"`` (the stragglers), ``"mismatch"`` (the largest
    train–inference mismatch) and ``"degenerate_groups"``."""
    if isinstance(policy, Policy):
        return policy
    if not isinstance(policy, str):
        raise TypeError(f"policy: expected a name or a Policy, got {type(policy).__name__}")
    if "+" in policy:
        # inside a composition "errors" is only the errors (at most their share of the cap):
        # what they leave goes to the next part
        parts = [p.strip() for p in policy.split("+")]
        return Compose(*(Errors() if p == Errors.name else make_policy(p, seed) for p in parts),
                       equal_shares=True)
    if policy == Uniform.name:
        return Uniform(seed=seed)
    if policy == Errors.name:
        return Compose(Errors(), Uniform(seed=seed))
    if policy == Groups.name:
        return Groups(seed=seed)
    try:
        made: Policy = POLICIES[policy]()
        return made
    except KeyError:
        raise ValueError(
            f"unknown sampling policy {policy!r}; expected one of {sorted(POLICIES)} or a Policy"
        ) from None


# --- companions: episodes kept together ---------------------------------------------------------
def companions_of(record: Any) -> Any:
    """The ``rl.companions.id`` of an episode record or batch row (None: it has none)."""
    value = record.attribute(c.RL_COMPANIONS_ID)
    return value if isinstance(value, (str, int)) and not isinstance(value, bool) else None


def _has_companions(records: list[Any]) -> bool:
    for r in records:
        if r.attribute(c.RL_COMPANIONS_ID) is not None:
            return True
    return False


class _CompanionsBucket(Bucket):
    """A policy's bucket that keeps the episodes sharing an ``rl.companions.id`` (a game's
    players, a preference pair) together: when the policy keeps one, the others of its (step,
    split) are kept too.

    A companion the policy lets go is *parked* (held, not dropped) so that it can still follow
    a companion kept later; a companion of an episode kept already is kept on arrival. Both
    come out of budgets of ``room`` episodes per (step, split) (the cap): at most ``room``
    parked (when full, the parked ones whose companions the policy no longer holds go first),
    and at most ``room`` companions kept beyond the policy's choice (a step keeps at most twice
    the cap when its kept episodes have companions); past them, a companion is dropped as the
    policy decided. Episodes without the attribute pass straight through."""

    def __init__(self, inner: Bucket, room: int) -> None:
        self.inner = inner
        self.room = room
        self.parked: dict[Any, list[Any]] = {}
        self.n_parked = 0
        self.kept: set[Any] = set()  # companion ids one of whose episodes was kept for good
        self.extra = 0  # companions kept beyond the policy's choice

    def _take(self) -> bool:
        if self.extra >= self.room:
            return False
        self.extra += 1
        return True

    def offer(self, record: Any) -> Decision:
        if self.kept:
            cid = companions_of(record)
            if cid is not None and cid in self.kept and self._take():
                label((record,), c.REASON_COMPANION)
                return [], [record]
        released, keep_now = self.inner.offer(record)
        if keep_now or (released and _has_companions(released)):
            return self.settle(released, keep_now)
        return released, keep_now

    def settle(self, released: list[Any], keep_now: list[Any]) -> Decision:
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
        out: list[Any] = []
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

    def _room_to_park(self, cid: Any, out: list[Any]) -> bool:
        """Whether one more can be parked; when full, the parked companions that no episode the
        policy still holds can bring back are let go first (into ``out``)."""
        if self.n_parked < self.room:
            return True
        alive = {companions_of(r) for r in self.inner.held()}
        for other in [k for k in self.parked if k != cid and k not in alive]:
            gone = self.parked.pop(other)
            self.n_parked -= len(gone)
            out.extend(gone)
        return self.n_parked < self.room

    def candidates(self, batch: RowBatch) -> Any:
        find = getattr(self.inner, "candidates", None)
        chosen = find(batch) if callable(find) else None
        if chosen is None:
            return None
        col = batch.column(c.RL_COMPANIONS_ID)
        if col is None:
            return chosen
        extra = [i for i, v in enumerate(col) if v is not None]
        if not extra:
            return chosen
        return sorted({int(i) for i in chosen} | set(extra))

    def decide(self, limit: int | None = None, exclude: set[int] | None = None) -> list[Any]:
        return self.inner.decide(limit, exclude)

    def with_companions(self, chosen: list[Any]) -> list[Any]:
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

    def held(self) -> list[Any]:
        held = self.inner.held()
        if self.parked:
            held = held + [r for group in self.parked.values() for r in group]
        return held


class _CompanionsWholeBucket(_CompanionsBucket):
    """The same, around a bucket offered a batch whole (``Groups``)."""

    def offer_batch(self, batch: RowBatch, make_row: Callable[[int], Any]) -> tuple[list[Any], list[Any]]:
        col = batch.column(c.RL_COMPANIONS_ID)
        if col is None or all(v is None for v in col):
            released, held = self.inner.offer_batch(batch, make_row)  # type: ignore[attr-defined]
            out, keep = self.settle(released, [])
            return out, held + keep
        released = []
        for i in range(batch.n):  # one row at a time, so that a row can be parked
            rel, keep = self.offer(make_row(i))
            released.extend(r for r in rel if getattr(r, "batch", None) is not batch)
            for r in keep:  # not a streaming policy: kept at the step's close with its companions
                self.parked.setdefault(companions_of(r), []).append(r)
                self.n_parked += 1
        held = [r for r in self.held() if getattr(r, "batch", None) is batch]
        return released, held


def with_companions(bucket: Bucket, cap: int) -> Bucket:
    """``bucket`` wrapped so that companions (``rl.companions.id``) are kept together."""
    if callable(getattr(bucket, "offer_batch", None)):
        return _CompanionsWholeBucket(bucket, cap)
    return _CompanionsBucket(bucket, cap)


class TailSampler:
    """Keeps at most ``max_traces_per_step`` whole episodes per (rl.step, rl.split).

    ``policy`` is a name (``"first"``, ``"uniform"``, ``"top_bottom"``, ``"errors"``,
    ``"groups"``, or several joined by ``+``, e.g. ``"errors+slowest+top_bottom"`` or
    ``"errors+top_bottom+degenerate_groups"``) or a ``Policy`` object such as
    ``Compose(Errors(2), TopBottom(top=4, bottom=4), Uniform())``. The default keeps errors
    (failed, then truncated) within a quarter of the cap, then the best and worst by reward
    (``default_policy``). Every kept root says why in ``rl.sampling.reason``.

    ``watch``: prompts followed across the run, by dataset index (``rl.dataset.index``, an int
    or a string) or prompt hash (``otr.prompt_hash(prompt)``, matched against what
    ``ep.prompt()`` recorded): every episode of a watched prompt is kept when it finishes, with
    the reason ``watch``, outside the cap, at most ``watch_per_step`` per (step, split) (then
    the policy decides as for any other). At most ``MAX_WATCH`` keys.

    ``group_size``: how many episodes the framework samples per group (GRPO's group size), when
    every group has the same; a group with fewer members that step lost some (group health).
    An episode's own ``rl.group.expected_size`` wins.

    When a step closes (the decision is taken then):

    * ``otr.end_step(step)`` closes every split of that step (or one, with ``split=``);
    * once an episode of step ``step + step_lag`` of the same split has *started*, older steps
      close (``step_lag=None`` turns that off; asynchronous RL overlaps policy versions);
    * ``step_timeout_s`` seconds after the last episode of that step finished, checked every
      second by a background ticker (``None``: no timeout);
    * at ``otr.flush()`` / ``otr.shutdown()``.

    Late rule: an episode that finishes after its step closed is counted ``late``. It is kept
    only while its step kept fewer than the cap (first come), otherwise dropped and counted
    ``dropped.late``. With a distributed budget a rank cannot know what the other ranks kept,
    so late episodes are always dropped.

    ``distributed`` (default ``"auto"``): when ``torch.distributed`` is initialised with more
    than one rank (or a process group is passed), ``end_step`` agrees one global budget per step
    across ranks (see ``otel_rollouts.sampling.distributed``); every rank must call ``end_step`` for the
    same steps. ``False`` keeps the cap per process.
    """

    def __init__(
        self,
        max_traces_per_step: int = 32,
        policy: str | Policy = DEFAULT_POLICY,
        *,
        step_lag: int | None = 2,
        step_timeout_s: float | None = None,
        seed: int = 0,
        distributed: Any = "auto",
        watch: Any = None,
        watch_per_step: int = 16,
        group_size: int | None = None,
    ) -> None:
        if (
            isinstance(max_traces_per_step, bool)
            or not isinstance(max_traces_per_step, int)
            or max_traces_per_step < 0
        ):
            raise ValueError(
                f"max_traces_per_step must be a non-negative int, got {max_traces_per_step!r}"
            )
        if step_lag is not None and (not isinstance(step_lag, int) or step_lag < 1):
            raise ValueError(f"step_lag must be an int >= 1 or None, got {step_lag!r}")
        if step_timeout_s is not None and not step_timeout_s > 0:
            raise ValueError(f"step_timeout_s must be > 0 or None, got {step_timeout_s!r}")
        self.max_traces_per_step = max_traces_per_step
        self.policy = (default_policy(max_traces_per_step) if isinstance(policy, str) and policy == DEFAULT_POLICY
                       else make_policy(policy, seed))
        self.watch = _watch_keys(watch)
        if isinstance(watch_per_step, bool) or not isinstance(watch_per_step, int) or watch_per_step < 0:
            raise ValueError(f"watch_per_step must be a non-negative int, got {watch_per_step!r}")
        self.watch_per_step = watch_per_step
        if group_size is not None and (isinstance(group_size, bool) or not isinstance(group_size, int)
                                       or group_size < 1):
            raise ValueError(f"group_size must be a positive int or None, got {group_size!r}")
        self.group_size = group_size
        self.step_lag = step_lag
        self.step_timeout_s = step_timeout_s
        self.seed = seed
        self.distributed = distributed

    def bucket(self, key: tuple[int, str], *, stream: bool = True) -> Bucket:
        return with_companions(self.policy.bucket(self.max_traces_per_step, key, stream=stream),
                               self.max_traces_per_step)

    def __repr__(self) -> str:
        return (
            f"TailSampler(max_traces_per_step={self.max_traces_per_step}, policy={self.policy!r},"
            f" step_lag={self.step_lag}, step_timeout_s={self.step_timeout_s}"
            + (f", watch={sorted(map(str, self.watch))}" if self.watch else "") + ")"
        )

    def watched(self, record: Any) -> str | None:
        """The watch key ``record`` matches (its dataset index or prompt hash), or None."""
        watch = self.watch
        index = record.attribute(c.RL_DATASET_INDEX)
        if type(index) in (int, str) and index in watch:
            return str(index)
        digest = record.attribute(c.RL_PROMPT_HASH)
        if type(digest) is str and digest in watch:
            return str(digest)
        return None


MAX_WATCH = 4096  # watched prompts at most (a set of their keys: a few hundred KB)


def _watch_keys(watch: Any) -> frozenset[Any]:
    """The watch list as a set of ints and strings; a clear error for anything else."""
    if watch is None:
        return frozenset()
    if isinstance(watch, (str, int)):
        watch = [watch]
    keys: set[Any] = set()
    for i, key in enumerate(watch):
        if isinstance(key, bool) or not isinstance(key, (int, str)):
            raise ValueError(f"watch[{i}]: expected a dataset index (int or str) or a prompt hash (str), "
                             f"got {type(key).__name__}")
        keys.add(key)
        if len(keys) > MAX_WATCH:
            raise ValueError(f"watch: at most {MAX_WATCH} prompts")
    return frozenset(keys)
