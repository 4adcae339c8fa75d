"""Where the sampling policies lived before ``otel_rollouts.sampling`` was split by family: a
thin re-export kept so that ``from otel_rollouts.sampling.policies import X`` still works.

New code imports from ``otel_rollouts.sampling`` (the public names) or from the module of each
family: ``policy`` (the protocols, ``BasePolicy``, shared helpers), ``simple`` (``First``,
``Uniform``, ``Errors``), ``scores`` (``TopBottom``, ``Slowest``, ``Mismatch``), ``groups``
(``Groups``, ``DegenerateGroups``), ``compose`` (``Compose``, policies by name), ``companions``
and ``tail`` (``TailSampler``).
"""

from __future__ import annotations

from otel_rollouts.sampling.companions import companions_of, with_companions
from otel_rollouts.sampling.compose import (
    DEFAULT_POLICY,
    ERROR_SHARE,
    POLICIES,
    Compose,
    default_policy,
    make_policy,
)
from otel_rollouts.sampling.groups import LOST_STATUSES, DegenerateGroups, Groups
from otel_rollouts.sampling.policy import (
    BasePolicy,
    BatchBucket,
    Bucket,
    Candidate,
    Decision,
    Policy,
    WholeBatchBucket,
    _stable_hash,
    budget_of,
    label,
    reason_of,
    score_of,
)
from otel_rollouts.sampling.scores import Mismatch, Slowest, TopBottom
from otel_rollouts.sampling.simple import Errors, First, Uniform
from otel_rollouts.sampling.tail import MAX_WATCH, TailSampler

__all__ = [
    "DEFAULT_POLICY",
    "ERROR_SHARE",
    "LOST_STATUSES",
    "MAX_WATCH",
    "POLICIES",
    "BasePolicy",
    "BatchBucket",
    "Bucket",
    "Candidate",
    "Compose",
    "Decision",
    "DegenerateGroups",
    "Errors",
    "First",
    "Groups",
    "Mismatch",
    "Policy",
    "Slowest",
    "TailSampler",
    "TopBottom",
    "Uniform",
    "WholeBatchBucket",
    "_stable_hash",
    "budget_of",
    "companions_of",
    "default_policy",
    "label",
    "make_policy",
    "reason_of",
    "score_of",
    "with_companions",
]
