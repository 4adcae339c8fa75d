"""A streaming reject before the bucket: the built-in policies' thresholds, read by the offer.

Once a step is under way, almost every episode offered to the default policy (errors within a
quarter of the cap, then top/bottom by reward) is let go at once: it is no error, and its reward
is neither above the lowest of the best held nor at or below the highest of the worst held.
Asking the bucket (the companions wrapper, the composition, each part) costs a dozen calls for
that answer; a ``Screen`` gives it with two comparisons against thresholds the top/bottom bucket
keeps up to date. The pipeline drops an episode the screen rejects without offering it: exactly
what the bucket would have done (it releases the episode at once and changes nothing).

Only buckets whose every rejection is known that way get a screen (``screen_of``): the
built-in ``Errors`` and ``TopBottom`` parts, alone or composed, inside the companions wrapper.
Anything else (a custom policy or bucket, a subclass, ``Uniform``, ``Groups``, ...) gets None
and keeps the full offer. An episode the screen cannot judge (an error or truncated status
while errors may still be held, no numeric score, a companions id, the top/bottom sides not yet
full) takes the full offer too.
"""

from __future__ import annotations

from otel_rollouts import conventions as c
from otel_rollouts.sampling.companions import CompanionsBucket
from otel_rollouts.sampling.compose import _ComposeBucket
from otel_rollouts.sampling.policy import Bucket
from otel_rollouts.sampling.scores import _TopBottomBucket
from otel_rollouts.sampling.simple import _ErrorsBucket

__all__ = ["Screen", "screen_of"]

_ERRORISH = frozenset((c.STATUS_ERROR, c.STATUS_TRUNCATED))


class Screen:
    """What decides a rejection: ``statuses`` an episode with which must be offered (an errors
    part may hold it), ``ranked`` the top/bottom bucket whose thresholds (``full``, ``above``,
    ``below``) a scored episode is compared with, and ``score`` the attribute it ranks by.
    With no ranked part (errors alone), every episode of another status is rejected."""

    __slots__ = ("statuses", "ranked", "score")

    def __init__(self, statuses: frozenset[str], ranked: _TopBottomBucket | None) -> None:
        self.statuses = statuses
        self.ranked = ranked
        self.score = ranked.score if ranked is not None else c.RL_REWARD

    def rejects(self, score: float, status: object) -> bool:
        """Whether the bucket would let an episode of ``score`` (a float, NaN: none) and
        ``status`` go at once (the pipeline inlines this; kept here as its definition)."""
        if status in self.statuses:
            return False
        ranked = self.ranked
        if ranked is None:
            return True
        return ranked.full and score == score and not score > ranked.above and not score <= ranked.below


def screen_of(bucket: Bucket) -> Screen | None:
    """The screen of ``bucket`` when every rejection it makes can be told by comparisons (see
    the module's docstring), else None. Exact types only: a subclass may offer otherwise."""
    inner = bucket.inner if type(bucket) is CompanionsBucket else bucket
    parts = inner.subs if type(inner) is _ComposeBucket else [inner]
    statuses: set[str] = set()
    ranked: _TopBottomBucket | None = None
    for part in parts:
        if type(part) is _ErrorsBucket:
            if part.capacity > 0:
                statuses |= _ERRORISH
        elif type(part) is _TopBottomBucket and ranked is None:
            ranked = part
        else:
            return None
    return Screen(frozenset(statuses), ranked)
