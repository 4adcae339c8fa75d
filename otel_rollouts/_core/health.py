"""The health of a step's GRPO groups, summarised when the step closes (told to the metrics)."""

from __future__ import annotations

from dataclasses import dataclass


@dataclass
class StepHealth:
    """What a closed (step, split) said about its groups. Counts are of groups unless named
    ``members``; a group is *degenerate* when all its members (two or more) got the same reward
    (zero advantage: it teaches nothing) or it lost members (missing from its expected size,
    filtered, failed or truncated: the advantage of the rest is biased)."""

    groups: int = 0  # groups seen (episodes with an rl.group.id)
    all_equal: int = 0  # groups of two or more members, every reward equal
    lost: int = 0  # groups that lost members
    lost_members: int = 0  # members lost, all groups together
    degenerate: int = 0  # groups all_equal or lost (a group both counts once)
    untracked: int = 0  # groups past the per-step bound: not assessed
