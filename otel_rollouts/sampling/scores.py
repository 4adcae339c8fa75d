"""The policies that rank episodes by a numeric attribute: ``TopBottom`` (the best and the
worst by reward, or any score), ``Slowest`` (the stragglers) and ``Mismatch`` (the largest
train–inference mismatch)."""

from __future__ import annotations

import math
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
    _let_go,
    _pick,
    _RankedBucket,
    label,
    score_of,
)

__all__ = ["Mismatch", "Slowest", "TopBottom"]


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
        self.unscored: list[Candidate] = []
        # the thresholds a screen compares with (``sampling.screen``): once both sides are
        # ``full``, a score is held only if it is ``> above`` (the lowest of the best; earlier
        # ties win) or ``<= below`` (the highest of the worst; later ties win); NaN for a side of
        # no room, which no score passes
        self.full = False
        self.above = math.nan
        self.below = math.nan
        self._thresholds()

    def _thresholds(self) -> None:
        """Read the sides' thresholds again (after a side's heap changed)."""
        best, worst = self.best, self.worst
        best_full = best.capacity <= 0 or len(best.heap) >= best.capacity
        worst_full = worst.capacity <= 0 or len(worst.heap) >= worst.capacity
        self.full = best_full and worst_full
        if self.full:
            # best holds (score, ...) entries, worst (-score, ...): each heap's top is its worst
            self.above = best.heap[0][0] if best.capacity > 0 else math.nan
            self.below = -worst.heap[0][0] if worst.capacity > 0 else math.nan

    def _let_go(self, record: Candidate, out: list[Candidate]) -> None:
        _let_go(self.refs, record, out)

    def offer(self, record: Candidate) -> Decision:
        score = score_of(record, self.score)
        if score is None:
            if len(self.refs) < self.cap + self.margin and len(self.unscored) < self.cap + self.margin:
                self.unscored.append(record)
                return [], []
            return [record], []
        if not self.best.takes(-score) and not self.worst.takes(score):
            return [record], []  # the common case once the step is under way
        released: list[Candidate] = []
        self.refs[id(record)] = 2  # held by both sides until one lets it go
        for r in self.best.offer_ranked(record, -score)[0]:
            self._let_go(r, released)
        for r in self.worst.offer_ranked(record, score)[0]:
            self._let_go(r, released)
        self._thresholds()
        if self.unscored and len(self.refs) >= self.cap + self.margin:
            # enough distinct scored candidates: the unscored ones can never be chosen
            released.extend(self.unscored)
            self.unscored = []
        return released, []

    def candidates(self, batch: RowBatch) -> Sequence[int] | np.ndarray | None:
        """The best and the worst of the batch. Not when a row (held or offered) has no score:
        whether an unscored one is held depends on how many scored ones are held at each step."""
        import numpy as np

        if self.unscored or bool(np.isnan(batch.scores(self.score)).any()):
            return None
        best, worst = self.best.candidates(batch), self.worst.candidates(batch)
        if best is None or worst is None:  # never: a score bucket ranks a whole batch in one pass
            return None
        return np.union1d(best, worst)

    def decide(self, limit: int | None = None, exclude: set[int] | None = None) -> list[Candidate]:
        limit = self.cap if limit is None else limit
        k_top, k_bottom = self.policy.split(limit)
        taken = set(exclude or ())
        out: list[Candidate] = []
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

    def held(self) -> list[Candidate]:
        seen: dict[int, Candidate] = {}
        for r in self.best.held() + self.worst.held() + self.unscored:
            seen[id(r)] = r
        return list(seen.values())


class _ScoreBucket(_RankedBucket):
    __slots__ = ("score", "sign")
    reason = c.REASON_TOP  # TopBottom labels both sides itself

    def __init__(self, capacity: int, score: str, sign: float, *, later_wins: bool = False) -> None:
        super().__init__(capacity, later_wins=later_wins)
        self.score, self.sign = score, sign

    def rank(self, record: Candidate) -> float | None:
        value = score_of(record, self.score)
        return None if value is None else self.sign * value

    def batch_keys(self, batch: RowBatch) -> np.ndarray:
        return self.sign * batch.scores(self.score)


class _SlowestBucket(_ScoreBucket):
    __slots__ = ()
    reason = c.REASON_SLOWEST


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
