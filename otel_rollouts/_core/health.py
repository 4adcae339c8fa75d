"""The health of a step's GRPO groups, summarised when the step closes (told to the metrics, and
through them to the exporters that take a step's groups: ``exporters.extras.GroupsSink``).

Here, in ``_core``, so that an exporter can read a ``GroupRow`` without importing the sampler
(exporters stand below sampling on the data path)."""

from __future__ import annotations

from dataclasses import dataclass
from typing import NamedTuple

__all__ = ["GroupRow", "StepHealth"]


class GroupRow(NamedTuple):
    """One GRPO group of a closed (step, split), as a table row: what a researcher asks of a
    group ("is it teaching anything, did it lose members, did the sampler keep any of it").

    ``lost`` and ``truncated`` are apart: a truncated member was still sampled from the policy
    and scored (it only ran out of turns or tokens), a lost one never counts towards the
    advantage (filtered, failed, or missing from the expected size)."""

    group: str  # rl.group.id as text
    size: int  # members seen in the step
    expected_size: int  # members the framework sampled (0: unknown)
    reward_spread: float | None  # max - min reward of its members (None: no member had a reward)
    all_equal: bool  # two or more members, every reward equal: zero advantage
    truncated: int  # members cut short (scored: not lost)
    lost: int  # members filtered or failed, plus those missing from the expected size
    kept: int  # members the sampler kept (0: the group was seen, none of it kept)

    @property
    def degenerate(self) -> bool:
        """All-equal or short of members: the rows a researcher looks at first."""
        return self.all_equal or self.lost > 0


@dataclass
class StepHealth:
    """What a closed (step, split) said about its groups. Counts are of groups unless named
    ``members``; a group is *degenerate* when all its members (two or more) got the same reward
    (zero advantage: it teaches nothing) or it lost members (missing from its expected size,
    filtered or failed: the advantage of the rest is biased). A truncated member is not lost:
    it was sampled and scored, only cut short; truncation is counted apart.

    ``rows`` is every group seen, as a bounded table (at most ``sampling.health.MAX_ROWS``:
    degenerate groups first, then by group id; ``rows_left_out`` counts the groups past it)."""

    groups: int = 0  # groups seen (episodes with an rl.group.id)
    all_equal: int = 0  # groups of two or more members, every reward equal
    lost: int = 0  # groups that lost members
    lost_members: int = 0  # members lost, all groups together
    degenerate: int = 0  # groups all_equal or lost (a group both counts once)
    untracked: int = 0  # groups past the per-step bound: not assessed
    truncated: int = 0  # groups with a truncated member
    truncated_members: int = 0  # members truncated, all groups together
    rows: tuple[GroupRow, ...] = ()  # the groups seen, bounded (see above)
    rows_left_out: int = 0  # groups assessed but past the rows' bound

    @property
    def all_equal_and_lost(self) -> int:
        """Groups both all-equal and short of members (``degenerate`` counts each group once)."""
        return max(self.all_equal + self.lost - self.degenerate, 0)


def health_text(size: int, expected: int | None, all_equal: bool, lost: int, truncated: int,
                other: str | None = None) -> str:
    """A GRPO group's health as a person reads it, the same in every viewer: ``all equal ×8``
    (zero advantage), ``lost 2/8`` (members lost of those expected, or of those seen when the
    expected size is unknown), both joined by ``, `` when both hold, else ``ok 8`` (``ok 6/8``
    when fewer were seen than expected; ``other``, a degenerate reason this version has no words
    for, instead); then ``truncated 1/8`` when members were cut short (scored: not lost)."""
    of = expected or size
    parts = []
    if all_equal:
        parts.append(f"all equal \u00d7{size}")
    if lost:
        parts.append(f"lost {lost}/{of}")
    if not parts:
        parts.append(other.replace("_", " ") if other else
                     f"ok {size}" if expected is None or expected == size else f"ok {size}/{expected}")
    if truncated:
        parts.append(f"truncated {truncated}/{of}")
    return ", ".join(parts)
