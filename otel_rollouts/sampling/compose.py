"""``Compose`` (parts with sub-budgets, decided in order) and the policies by name:
``make_policy("errors+top_bottom")``, ``default_policy(cap)`` (what ``TailSampler()`` keeps)."""

from __future__ import annotations

from collections.abc import Callable, Sequence
from typing import TYPE_CHECKING

if TYPE_CHECKING:
    import numpy as np

from otel_rollouts.sampling.batch import RowBatch
from otel_rollouts.sampling.groups import DegenerateGroups, Groups
from otel_rollouts.sampling.policy import (
    BasePolicy,
    BatchBucket,
    Bucket,
    Candidate,
    Decision,
    Policy,
    _let_go,
    budget_of,
    label,
    reason_of,
)
from otel_rollouts.sampling.scores import Mismatch, Slowest, TopBottom
from otel_rollouts.sampling.simple import Errors, First, Uniform

__all__ = ["DEFAULT_POLICY", "ERROR_SHARE", "POLICIES", "Compose", "default_policy", "make_policy"]


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

    def offer(self, record: Candidate) -> Decision:
        released: list[Candidate] = []
        self.refs[id(record)] = len(self.subs)  # held by every part until each lets it go
        for sub in self.subs:
            for r in sub.offer(record)[0]:
                _let_go(self.refs, r, released)
        return released, []

    def candidates(self, batch: RowBatch) -> Sequence[int] | np.ndarray | None:
        """Every part's candidates: each part ends as it would have after every row, since the
        rows it could hold are all offered to it (None when a part cannot tell)."""
        import numpy as np

        out = None
        for sub in self.subs:
            found = sub.candidates(batch) if isinstance(sub, BatchBucket) else None
            if found is None:
                return None
            out = np.asarray(found, dtype=np.int64) if out is None else np.union1d(out, found)
        return out

    def decide(self, limit: int | None = None, exclude: set[int] | None = None) -> list[Candidate]:
        cap = self.cap if limit is None else min(limit, self.cap)
        taken = set(exclude or ())
        out: list[Candidate] = []
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

    def held(self) -> list[Candidate]:
        seen: dict[int, Candidate] = {}
        for sub in self.subs:
            for r in sub.held():
                seen[id(r)] = r
        return list(seen.values())


# --- names ---------------------------------------------------------------------------------------
POLICIES: dict[str, Callable[[], Policy]] = {
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
