"""Tail sampling of whole episodes, per (training step, split).

A policy decides which episodes of a step are worth exporting once their rewards are known.
It sees *episode records* (never rendered spans), holds at most the cap of them, and releases a
candidate the moment it can no longer be chosen, so memory depends on the cap, not on how many
episodes a step saw.

The protocol is small so that policies compose: ``Policy.bucket(cap, key)`` makes a ``Bucket``
for one (step, split); ``Bucket.offer(record)`` returns ``(released, keep_now)``; and
``Bucket.decide()`` returns the records to keep when the step closes. Everything a bucket still
holds and does not return from ``decide`` is dropped.
"""

from __future__ import annotations

import heapq
import math
import random
from typing import Any

from otel_rollouts import conventions as c

Decision = tuple[list[Any], list[Any]]  # (released, keep_now)


def score_of(record: Any, attribute: str) -> float | None:
    """The numeric score of an episode record, or None when it has none (or NaN)."""
    value = record.attribute(attribute)
    if isinstance(value, bool) or not isinstance(value, (int, float)):
        return None
    value = float(value)
    return None if math.isnan(value) else value


class Bucket:
    """Candidates of one (step, split) under one policy."""

    def offer(self, record: Any) -> Decision:  # pragma: no cover - interface
        raise NotImplementedError

    def decide(self) -> list[Any]:  # pragma: no cover - interface
        raise NotImplementedError

    def held(self) -> list[Any]:  # pragma: no cover - interface
        raise NotImplementedError


class Policy:
    """A rule for choosing at most ``cap`` episodes of a step."""

    name = "policy"
    streaming = False  # True when decisions need no comparison and can be exported at once

    def bucket(self, cap: int, key: tuple[int, str]) -> Bucket:  # pragma: no cover
        raise NotImplementedError

    def __repr__(self) -> str:
        return f"{type(self).__name__}()"


# --- first -------------------------------------------------------------------------------------
class First(Policy):
    """The first ``cap`` episodes to finish; kept episodes are exported at once (streaming)."""

    name = "first"
    streaming = True

    def bucket(self, cap: int, key: tuple[int, str]) -> Bucket:
        return _FirstBucket(cap)


class _FirstBucket(Bucket):
    def __init__(self, cap: int) -> None:
        self.cap = cap
        self.kept = 0

    def offer(self, record: Any) -> Decision:
        if self.kept < self.cap:
            self.kept += 1
            return [], [record]
        return [record], []

    def decide(self) -> list[Any]:
        return []

    def held(self) -> list[Any]:
        return []


# --- uniform -------------------------------------------------------------------------------------
class Uniform(Policy):
    """A seeded reservoir sample: every episode of the step is equally likely to be kept."""

    name = "uniform"

    def __init__(self, seed: int = 0) -> None:
        self.seed = seed

    def bucket(self, cap: int, key: tuple[int, str]) -> Bucket:
        return _ReservoirBucket(cap, random.Random(f"{self.seed}:{key[0]}:{key[1]}"))

    def __repr__(self) -> str:
        return f"Uniform(seed={self.seed})"


class _ReservoirBucket(Bucket):
    def __init__(self, cap: int, rng: random.Random) -> None:
        self.cap = cap
        self.rng = rng
        self.seen = 0
        self.reservoir: list[Any] = []

    def offer(self, record: Any) -> Decision:
        self.seen += 1
        if len(self.reservoir) < self.cap:
            self.reservoir.append(record)
            return [], []
        j = self.rng.randrange(self.seen)
        if j < self.cap:
            old = self.reservoir[j]
            self.reservoir[j] = record
            return [old], []
        return [record], []

    def decide(self) -> list[Any]:
        return list(self.reservoir)

    def held(self) -> list[Any]:
        return list(self.reservoir)


# --- top / bottom --------------------------------------------------------------------------------
class TopBottom(Policy):
    """The ``top`` best and ``bottom`` worst episodes by a numeric attribute (default reward).

    With no explicit split of the cap, half goes to each side (the extra one to the top).
    Episodes without a score only fill what the ranked ones leave free. Ties are broken by
    arrival order, so the same episode is never chosen twice.
    """

    name = "top_bottom"

    def __init__(self, score: str = c.RL_REWARD, top: int | None = None, bottom: int | None = None):
        self.score = score
        self.top = top
        self.bottom = bottom

    def bucket(self, cap: int, key: tuple[int, str]) -> Bucket:
        top = self.top if self.top is not None else cap - cap // 2
        bottom = self.bottom if self.bottom is not None else cap // 2
        if top + bottom > cap:  # never over the cap
            top = min(top, cap)
            bottom = cap - top
        return _TopBottomBucket(cap, top, bottom, self.score)

    def __repr__(self) -> str:
        return f"TopBottom(score={self.score!r}, top={self.top}, bottom={self.bottom})"


class _TopBottomBucket(Bucket):
    def __init__(self, cap: int, top: int, bottom: int, score: str) -> None:
        self.cap, self.k_top, self.k_bottom, self.score = cap, top, bottom, score
        self.top: list[tuple[float, int, Any]] = []  # min-heap: smallest of the best on top
        self.bottom: list[tuple[float, int, Any]] = []  # max-heap via negated keys
        self.unscored: list[Any] = []
        self.seq = 0

    def _held(self, record: Any) -> bool:
        return any(e[2] is record for e in self.top) or any(e[2] is record for e in self.bottom)

    def offer(self, record: Any) -> Decision:
        score = score_of(record, self.score)
        if score is None:
            if len(self.unscored) < self.cap:
                self.unscored.append(record)
                return [], []
            return [record], []
        self.seq += 1
        out: list[Any] = []
        if self.k_top:
            entry = (score, self.seq, record)
            if len(self.top) < self.k_top:
                heapq.heappush(self.top, entry)
            elif entry[:2] > self.top[0][:2]:
                out.append(heapq.heapreplace(self.top, entry)[2])
            else:
                out.append(record)
        else:
            out.append(record)
        if self.k_bottom:
            entry = (-score, -self.seq, record)
            if len(self.bottom) < self.k_bottom:
                heapq.heappush(self.bottom, entry)
            elif entry[:2] > self.bottom[0][:2]:
                out.append(heapq.heapreplace(self.bottom, entry)[2])
            else:
                out.append(record)
        released = []
        for r in out:
            if not self._held(r) and not any(r is x for x in released):
                released.append(r)
        # a scored episode outranks an unscored one that only filled space
        return released, []

    def decide(self) -> list[Any]:
        kept: list[Any] = []
        ids: set[int] = set()
        for _, _, r in sorted(self.top, key=lambda e: e[:2], reverse=True):
            kept.append(r)
            ids.add(id(r))
        for _, _, r in sorted(self.bottom, key=lambda e: e[:2], reverse=True):
            if id(r) not in ids:
                kept.append(r)
                ids.add(id(r))
        for r in self.unscored:
            if len(kept) >= self.cap:
                break
            kept.append(r)
        return kept[: self.cap]

    def held(self) -> list[Any]:
        seen: dict[int, Any] = {}
        for _, _, r in self.top + self.bottom:
            seen[id(r)] = r
        for r in self.unscored:
            seen[id(r)] = r
        return list(seen.values())


POLICIES: dict[str, type[Policy]] = {
    First.name: First,
    Uniform.name: Uniform,
    TopBottom.name: TopBottom,
}


def make_policy(policy: str | Policy, seed: int = 0) -> Policy:
    """A policy object from a name (``"first"``, ``"uniform"``, ``"top_bottom"``) or object."""
    if isinstance(policy, Policy):
        return policy
    if policy == Uniform.name:
        return Uniform(seed)
    try:
        return POLICIES[policy]()
    except KeyError:
        raise ValueError(
            f"unknown sampling policy {policy!r}; expected one of {sorted(POLICIES)} or a Policy"
        ) from None


class TailSampler:
    """Keeps at most ``max_traces_per_step`` whole episodes per (rl.step, rl.split).

    The decision is taken when the step closes: ``otr.end_step(step)``; automatically once
    episodes of step ``step + step_lag`` have started (``step_lag=None`` turns that off); after
    ``step_timeout_s`` seconds without a new episode of that step; or at flush/shutdown.
    An episode that finishes after its step closed is *late*: it is kept only while its step
    kept fewer than the cap (first come), otherwise dropped and counted as late.
    """

    def __init__(
        self,
        max_traces_per_step: int = 32,
        policy: str | Policy = "top_bottom",
        *,
        step_lag: int | None = 2,
        step_timeout_s: float | None = None,
        seed: int = 0,
    ) -> None:
        if not isinstance(max_traces_per_step, int) or max_traces_per_step < 0:
            raise ValueError(
                f"max_traces_per_step must be a non-negative int, got {max_traces_per_step!r}"
            )
        if step_lag is not None and step_lag < 1:
            raise ValueError(f"step_lag must be >= 1 or None, got {step_lag!r}")
        self.max_traces_per_step = max_traces_per_step
        self.policy = make_policy(policy, seed)
        self.step_lag = step_lag
        self.step_timeout_s = step_timeout_s
        self.seed = seed

    def bucket(self, key: tuple[int, str]) -> Bucket:
        return self.policy.bucket(self.max_traces_per_step, key)

    def __repr__(self) -> str:
        return (
            f"TailSampler(max_traces_per_step={self.max_traces_per_step}, policy={self.policy!r},"
            f" step_lag={self.step_lag}, step_timeout_s={self.step_timeout_s})"
        )
