"""The pipeline's step bookkeeping: which (step, split) are open, which closed, and when.

An open step holds its sampler bucket and counts (``StepState``); a closed one is remembered
with how many episodes it kept (the late rule lets later ones in up to the cap); each split's
newest step drives the lag rule, and each open step's last arrival the timeout rule. The
pipeline decides (offer, keep, drop) and holds the lock; this book answers what to close and
where an episode belongs, and forgets the oldest entries so that its memory stays bounded.
Its own module so that the pipeline and its batch path share it without importing each other.
"""

from __future__ import annotations

import time
from collections import OrderedDict

from otel_rollouts._core.spans import EpisodeRecord
from otel_rollouts.sampling.batch import BatchRow
from otel_rollouts.sampling.health import StepGroups
from otel_rollouts.sampling.policy import Bucket
from otel_rollouts.sampling.screen import Screen, screen_of
from otel_rollouts.sampling.tail import TailSampler

Key = tuple[int, str]  # (step, split)

SEEN = "seen"  # the per-step stats names the step state counts itself
SAMPLED_OUT = "dropped.sampled_out"

_MAX_CLOSED = 4096  # closed (step, split) keys remembered, with their kept count, for late ones
_MAX_SPLITS = 1024  # splits whose newest step is remembered (for the lag rule), least recent forgotten


class StepState:
    """An open step: the bucket holding its undecided episodes, when it last saw one, how many
    it kept before its close, its groups' health and its watched episodes.

    A watched episode is chosen (outside the cap) when it is offered but handed on only when
    the step closes, with the others: what its episode records after its block (the advantage,
    once the whole group is scored) and its group's health reach it as they reach the rest.
    ``watching`` holds them until then (at most ``watch_per_step``: bounded).

    ``seen`` and ``sampled_out`` count the episodes offered one by one and those the bucket let
    go at once (plain ints, under the pipeline's lock): they reach the run's ``Stats`` when the
    step closes (``take_counts``), and a read of the stats before that adds them in
    (``Pipeline.pending_counts``). ``screen``: the bucket's thresholds, when it is a built-in
    one whose rejections can be told by comparisons alone (``sampling.screen``)."""

    __slots__ = ("bucket", "last_seen", "kept", "groups", "watched", "watching", "seen", "sampled_out",
                 "screen")

    def __init__(self, bucket: Bucket, group_size: int | None = None) -> None:
        self.bucket = bucket
        self.last_seen = time.monotonic()
        self.kept = 0
        self.groups = StepGroups(group_size)  # the health of the step's groups
        self.watched = 0  # episodes of watched prompts chosen (outside the cap)
        self.watching: list[EpisodeRecord | BatchRow] = []  # those chosen, kept when the step closes
        self.seen = 0  # offered one by one, not yet in the stats
        self.sampled_out = 0  # of those, let go by the bucket at once, not yet in the stats
        self.screen: Screen | None = screen_of(bucket)

    def counts(self) -> list[tuple[str, int]]:
        """The counts not yet in the stats, as (stats name, n), zeros left out."""
        out = []
        if self.seen:
            out.append((SEEN, self.seen))
        if self.sampled_out:
            out.append((SAMPLED_OUT, self.sampled_out))
        return out

    def take_counts(self) -> list[tuple[str, int]]:
        """``counts()``, then zeroed: the caller adds them to the stats (under the same lock)."""
        out = self.counts()
        self.seen = self.sampled_out = 0
        return out


class StepBook:
    """Open steps, closed steps and each split's newest step, under the sampler's lag and
    timeout rules. Not thread-safe: the pipeline calls it under its lock (``is_closed`` and the read of
    ``newest`` when an episode starts excepted: single dictionary reads)."""

    __slots__ = ("_sampler", "open", "closed", "newest")

    def __init__(self, sampler: TailSampler) -> None:
        self._sampler = sampler
        self.open: dict[Key, StepState] = {}
        self.closed: OrderedDict[Key, int] = OrderedDict()  # key -> episodes kept
        self.newest: OrderedDict[str, int] = OrderedDict()  # split -> newest step seen

    def advance(self, step: int, split: str) -> int | None:
        """``step`` of ``split`` started. Returns the newest step of ``split`` the lag rule closes
        now, or None."""
        previous = self.newest.get(split)
        if previous is not None and step <= previous:
            return None
        self.newest[split] = step
        self.newest.move_to_end(split)
        if len(self.newest) > _MAX_SPLITS:
            self.newest.popitem(last=False)
        lag = self._sampler.step_lag
        return step - lag if lag is not None and previous is not None else None

    def is_closed(self, key: Key) -> bool:
        """Whether (step, split) was closed, or is behind its split's newest step by the lag."""
        if key in self.closed:
            return True
        lag = self._sampler.step_lag
        newest = self.newest.get(key[1])
        return lag is not None and newest is not None and key[0] <= newest - lag

    def start(self, key: Key, stream: bool) -> StepState:
        """Open ``key`` with a new bucket (``stream``: it may keep episodes before the close)."""
        state = self.open[key] = StepState(self._sampler.bucket(key, stream=stream), self._sampler.group_size)
        return state

    def of_step(self, step: int, split: str | None) -> list[Key]:
        """The open keys of ``step`` (of every split, or of ``split``)."""
        return [k for k in self.open if k[0] == step and (split is None or k[1] == split)]

    def up_to(self, split: str, newest_closed: int) -> list[Key]:
        """The open keys of ``split`` up to step ``newest_closed``."""
        return [k for k in self.open if k[1] == split and k[0] <= newest_closed]

    def expired(self) -> list[Key]:
        """The open keys whose last episode arrived longer ago than the step timeout."""
        timeout = self._sampler.step_timeout_s
        if timeout is None or not self.open:
            return []
        now = time.monotonic()
        return [k for k, s in self.open.items() if now - s.last_seen > timeout]

    def late_room(self, key: Key) -> int:
        """How many more late episodes the closed ``key`` may keep (the cap less those kept)."""
        return max(self._sampler.cap - self.closed.get(key, 0), 0)

    def kept_late(self, key: Key, n: int = 1) -> None:
        """``n`` late episodes of ``key`` were kept."""
        self.closed[key] = self.closed.get(key, 0) + n
        self.trim()

    def mark_closed(self, key: Key, kept: int | None = None) -> None:
        """``key`` closed, having kept ``kept`` episodes (None: keep a count already noted, or 0)."""
        if kept is None:
            self.closed.setdefault(key, 0)
        else:
            self.closed[key] = kept

    def trim(self) -> None:
        """Forget the oldest closed keys past the bound."""
        while len(self.closed) > _MAX_CLOSED:
            self.closed.popitem(last=False)
