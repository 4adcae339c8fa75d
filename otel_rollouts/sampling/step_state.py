"""The state the pipeline keeps for one open (step, split): its sampler bucket and counts.

Its own module so that the pipeline and the parts it delegates to (the batch path) share the one
type without importing each other.
"""

from __future__ import annotations

import time

from otel_rollouts.sampling.health import StepGroups
from otel_rollouts.sampling.policy import Bucket


class StepState:
    """An open step: the bucket holding its undecided episodes, when it last saw one, how many
    it kept before its close, its groups' health and its watched episodes kept."""

    __slots__ = ("bucket", "last_seen", "kept", "groups", "watched")

    def __init__(self, bucket: Bucket, group_size: int | None = None) -> None:
        self.bucket = bucket
        self.last_seen = time.monotonic()
        self.kept = 0
        self.groups = StepGroups(group_size)  # the health of the step's groups
        self.watched = 0  # episodes of watched prompts kept (outside the cap)
