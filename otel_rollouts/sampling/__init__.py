"""Stage 2 of the data path, and its public extension points: the tail sampler.

Episodes are held per (step, split) until the step closes; a policy decides which whole episodes
are kept (across ranks too). This package is the canonical home of the sampling API::

    from otel_rollouts.sampling import Compose, Errors, TailSampler, TopBottom

    sampler = TailSampler(32, Compose(Errors(2), TopBottom(top=4, bottom=4)))

(the root re-exports the same objects, ``otr.TailSampler``, ``otr.Errors``, ... for short
scripts). Writing a policy of your own: a ``Policy`` makes one ``Bucket`` per (step, split); the
bucket is offered each finished episode as a ``Candidate`` and answers with a ``Decision``;
``BasePolicy`` gives a subclass the built-ins' defaults. A bucket may also be a ``BatchBucket``
(it prefilters the rows of ``otr.record_batch``) or a ``WholeBatchBucket`` (it takes a batch at
once). A ``StepObserver`` is told of every decision and every closed step (the run's rollout
metrics are one). Every name here is typed and ``isinstance``-checkable where it is a protocol.

The built-in policies, by family: ``First``, ``Uniform``, ``Errors`` (``simple``);
``TopBottom``, ``Slowest``, ``Mismatch`` (``scores``); ``Groups``, ``DegenerateGroups``
(``groups``); ``Compose`` and ``make_policy`` (``compose``).
"""

from otel_rollouts.sampling.compose import Compose, default_policy, make_policy
from otel_rollouts.sampling.groups import DegenerateGroups, Groups
from otel_rollouts.sampling.observer import StepObserver
from otel_rollouts.sampling.policy import (
    BasePolicy,
    BatchBucket,
    Bucket,
    Candidate,
    Decision,
    Policy,
    WholeBatchBucket,
    label,
)
from otel_rollouts.sampling.scores import Mismatch, Slowest, TopBottom
from otel_rollouts.sampling.simple import Errors, First, Uniform
from otel_rollouts.sampling.tail import TailSampler

__all__ = [
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
    "StepObserver",
    "TailSampler",
    "TopBottom",
    "Uniform",
    "WholeBatchBucket",
    "default_policy",
    "label",
    "make_policy",
]
