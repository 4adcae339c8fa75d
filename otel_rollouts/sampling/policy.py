"""The sampling extension points and what the built-in policies share.

A policy decides which episodes of a step are worth exporting once their rewards are known.
It sees *candidates* (episode records, never rendered spans), holds a number of them bounded by
the cap, and releases a candidate the moment it can no longer be chosen, so memory depends on
the cap, not on how many episodes a step saw.

The protocol is small so that policies compose. ``Policy``, ``Bucket`` and ``Candidate`` are
the extension points (``typing.Protocol``, checkable with ``isinstance``): a custom policy is any
object with ``bucket`` and ``needs``, a plain class will do (no base class needed; ``BasePolicy``
gives the built-ins' defaults, a ``name``, a ``label`` and ``budget``, to those who want them):

* ``Policy.bucket(cap, key, stream=False, margin=0)`` makes a ``Bucket`` for one (step, split)
  that may be asked for up to ``cap`` episodes, ``margin`` of its candidates possibly being
  taken already by an earlier part of a composition (so it holds up to ``cap + margin``).
* ``Bucket.offer(candidate)`` returns a ``Decision`` ``(released, keep_now)``: candidates it will
  never choose (the caller drops them at once) and candidates kept for good right now
  (streaming policies only).
* ``Bucket.decide(limit, exclude)`` returns at most ``limit`` held candidates, none whose
  ``id()`` is in ``exclude``, each once. Everything held and not returned is dropped.
* ``Bucket.held()`` lists what it holds (each candidate once).

A bucket may also offer ``candidates(batch)`` (see ``otel_rollouts.sampling.batch``): the rows
of a ``RowBatch`` it could still hold once the whole batch was offered, found with numpy, so
that a batch of thousands of samples costs Python objects for a few dozen. A bucket without it
(a custom one) is offered every row of a batch, as light ``BatchRow`` objects.

A ``Candidate`` only needs ``attribute(name)`` and an integer ``trace_id``; the distributed
budget (``otel_rollouts.sampling.distributed``) feeds light summaries of every rank's candidates
into a fresh bucket of the same policy, so every rank computes the same global choice.
"""

from __future__ import annotations

import hashlib
import heapq
import math
from collections.abc import Callable, Iterable, Sequence
from typing import TYPE_CHECKING, Any, Protocol, runtime_checkable

from otel_rollouts import conventions as c
from otel_rollouts.sampling.batch import RowBatch, best_rows, masked

if TYPE_CHECKING:
    import numpy as np

__all__ = ["BasePolicy", "BatchBucket", "Bucket", "Candidate", "Decision", "Policy", "WholeBatchBucket",
           "budget_of", "label", "reason_of", "score_of"]

Decision = tuple[list[Any], list[Any]]
"""What ``Bucket.offer`` returns: ``(released, keep_now)``, lists of the candidates it was
offered (the caller's own records, as given: ``EpisodeRecord``, ``BatchRow`` or a summary; ``Any``
because the caller gets back exactly the type it offered)."""



@runtime_checkable
class Candidate(Protocol):
    """What a bucket is offered: one finished episode, known only by its root's attributes.

    The pipeline offers its episode records (``EpisodeRecord``), the rows of a batch recorded
    with ``otr.record_batch`` (``BatchRow``) and, under a distributed budget, light summaries of
    every rank's candidates: all three have these two members, and a policy must read nothing
    else. A candidate usually also has a writable ``reason`` slot (``rl.trace.keep_reason`` of a
    kept episode, set with ``label``); a policy must not count on it (``label`` skips records
    without one).
    """

    @property
    def trace_id(self) -> int:
        """The episode's 128-bit OpenTelemetry trace id (stable: ``Uniform`` hashes it)."""
        ...

    def attribute(self, name: str) -> Any:
        """The episode root's attribute ``name`` (``rl.reward.score``, ``rl.status``, ...), None when
        it has none."""
        ...


@runtime_checkable
class Bucket(Protocol):
    """The candidates of one (step, split) under one policy: what ``Policy.bucket`` returns.

    The sampling pipeline calls, on the thread that ends episodes (under its lock, so a bucket
    needs no lock of its own): ``offer`` once per finished episode of the step, then, when the
    step closes, ``decide`` once and ``held`` (to drop what was not chosen). The distributed
    budget does the same on a fresh bucket fed light summaries of every rank's candidates, so
    ``decide`` must depend only on what was offered (in order), never on the clock or on chance.
    A record is only known as a ``Candidate``: ``record.attribute(name)`` and ``record.trace_id``; a bucket holds
    at most about ``cap + margin`` of them (memory must not grow with the episodes of a step).
    """

    def offer(self, record: Candidate) -> Decision:
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


@runtime_checkable
class BatchBucket(Protocol):
    """A ``Bucket`` that can prefilter a batch (optional): ``otr.record_batch`` then makes
    Python objects only for the rows it could still hold (the built-ins, with numpy). A bucket
    without it is offered every row of a batch, as light ``BatchRow`` candidates."""

    def candidates(self, batch: RowBatch) -> Sequence[int] | np.ndarray | None:
        """The indices of the rows of ``batch`` this bucket could hold once it was offered all
        of them (None: it cannot tell, offer every row)."""
        ...


@runtime_checkable
class WholeBatchBucket(Protocol):
    """A ``Bucket`` offered a batch whole (optional; ``Groups``: a run of one group at a time)."""

    def offer_batch(self, batch: RowBatch, make_row: Callable[[int], Any]) -> Decision:
        """Offer every row of ``batch`` in order, as ``offer`` one by one would; ``make_row(i)``
        makes the candidate of row ``i`` still held. Returns the earlier candidates let go and
        this batch's held rows."""
        ...


def budget_of(policy: Policy) -> int | None:
    """A policy's own share of the cap in a ``Compose`` (``budget``; None: what is left)."""
    budget = getattr(policy, "budget", None)
    return budget if isinstance(budget, int) and not isinstance(budget, bool) else None


class BasePolicy(Policy):
    """The built-in policies' base, for a custom policy that wants their defaults: a ``name``,
    a ``label`` (the ``rl.trace.keep_reason`` of what it keeps), no attributes read and no
    ``budget`` of its own. Subclass it and implement ``bucket`` (and ``needs`` when the policy
    reads attributes); a plain class with ``bucket`` and ``needs`` is a ``Policy`` too."""

    name = "policy"
    label = c.REASON_POLICY  # rl.trace.keep_reason of what it keeps
    streaming = False  # True when decisions need no comparison and can be exported at once
    budget: int | None = None  # its own share of the cap inside a ``Compose`` (None: what is left)

    def bucket(self, cap: int, key: tuple[int, str], *, stream: bool = False,
               margin: int = 0) -> Bucket:  # pragma: no cover - interface
        """A fresh ``Bucket`` for the (step, split) ``key`` (see ``Policy.bucket``)."""
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


def _pick(candidates: Iterable[Candidate], limit: int, exclude: set[int], out: list[Candidate]) -> None:
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


def score_of(record: Candidate, attribute: str) -> float | None:
    """The numeric score of an episode record, or None when it has none (or NaN)."""
    value = record.attribute(attribute)
    if isinstance(value, bool) or not isinstance(value, (int, float)):
        return None
    value = float(value)
    return None if math.isnan(value) else value


def _stable_hash(seed: int, value: object) -> int:
    """A 64-bit hash that is the same in every process (str hashing is salted per process)."""
    if isinstance(value, int):
        value = value.to_bytes(16, "big", signed=False) if value >= 0 else str(value).encode()
    else:
        value = str(value).encode()
    digest = hashlib.blake2b(value, digest_size=8, key=str(seed).encode()[:64])
    return int.from_bytes(digest.digest(), "big")


def _or_nan(value: int | None) -> float:
    return math.nan if value is None else float(value)


def _let_go(refs: dict[int, int], record: Candidate, out: list[Candidate]) -> None:
    """One holder lets ``record`` go; once no holder is left it goes to ``out`` (released)."""
    i = id(record)
    n = refs.get(i, 0) - 1
    if n > 0:
        refs[i] = n
    else:
        refs.pop(i, None)
        out.append(record)


def label(records: Iterable[object], reason: str) -> None:
    """Say why ``records`` are kept (``rl.trace.keep_reason``), unless a more specific part of the
    policy said it already: a record carries its reason until the pipeline keeps it. Records
    of other kinds (without a ``reason`` slot) are left as they are."""
    for r in records:
        try:
            if getattr(r, "reason", None) is None:
                setattr(r, "reason", reason)  # noqa: B010 - any record kind with a reason slot
        except AttributeError:
            pass


def reason_of(policy: object) -> str:
    """The reason a policy gives for what it keeps: its ``label``, else its ``name``, else
    ``policy`` (a custom policy without either)."""
    for attr in ("label", "name"):
        value = getattr(policy, attr, None)
        if isinstance(value, str) and value:
            return value
    return c.REASON_POLICY


class _RankedBucket(Bucket):
    """Holds the ``capacity`` best records by a key (smaller is better); releases the rest."""

    __slots__ = ("capacity", "heap", "seq", "later_wins")
    reason = c.REASON_POLICY  # what the records it decides are kept for

    def __init__(self, capacity: int, *, later_wins: bool = False) -> None:
        self.capacity = capacity
        self.heap: list[tuple[float, int, Candidate]] = []  # max-heap via negated keys: worst on top
        self.seq = 0
        self.later_wins = later_wins  # ties: the later arrival is better (default: the earlier)

    def rank(self, record: Candidate) -> float | None:  # pragma: no cover - interface
        """The record's key (smaller is better), or None when it is not eligible at all."""
        raise NotImplementedError

    def offer(self, record: Candidate) -> Decision:
        return self.offer_ranked(record, self.rank(record))

    def takes(self, key: float | None) -> bool:
        """Whether a record of this key would be held now (ties: the earlier arrival wins)."""
        heap = self.heap
        if key is None or self.capacity <= 0:
            return False
        return len(heap) < self.capacity or -key > heap[0][0] or (self.later_wins and -key == heap[0][0])

    def offer_ranked(self, record: Candidate, key: float | None) -> Decision:
        if key is None or not self.takes(key):
            return [record], []
        self.seq += 1
        # the worst on top; ties: the earlier arrival is better, or the later one (later_wins)
        entry = (-key, self.seq if self.later_wins else -self.seq, record)
        if len(self.heap) < self.capacity:
            heapq.heappush(self.heap, entry)
            return [], []
        return [heapq.heapreplace(self.heap, entry)[2]], []

    def batch_keys(self, batch: RowBatch) -> np.ndarray | None:
        """``rank`` for every row of ``batch`` as a numpy array (float NaN: not eligible), or
        None when it cannot be computed in one pass."""
        return None

    def candidates(self, batch: RowBatch) -> np.ndarray | None:
        """The rows of ``batch`` this bucket could hold once it was offered all of them (None:
        every row)."""
        keys = self.batch_keys(batch)
        if keys is None:
            return None
        return best_rows(masked(keys, batch), self.capacity, later_wins=self.later_wins)

    def ordered(self) -> list[Candidate]:
        return [e[2] for e in sorted(self.heap, key=lambda e: e[:2], reverse=True)]

    def decide(self, limit: int | None = None, exclude: set[int] | None = None) -> list[Candidate]:
        out: list[Candidate] = []
        _pick(self.ordered(), self.capacity if limit is None else limit, set(exclude or ()), out)
        if self.reason:
            label(out, self.reason)
        return out

    def held(self) -> list[Candidate]:
        return [e[2] for e in self.heap]
