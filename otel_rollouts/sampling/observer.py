"""What the sampling pipeline tells about its decisions: the ``StepObserver`` protocol.

The pipeline has one observer (``Pipeline.observer``; the run's rollout metrics,
``correlate.metrics.RolloutMetrics``, when metrics go anywhere) and calls its methods on the
thread that ends episodes, under the pipeline's lock: they must be quick and must not call back
into the pipeline. What an observer raises is counted (``errors.metrics`` in ``otr.stats()``)
and never reaches the pipeline or training.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import TYPE_CHECKING, Protocol, runtime_checkable

if TYPE_CHECKING:
    from otel_rollouts._core.health import StepHealth
    from otel_rollouts._core.spans import EpisodeRecord
    from otel_rollouts.sampling.batch import RowBatch

__all__ = ["StepObserver"]


@runtime_checkable
class StepObserver(Protocol):
    """Told of each decision of the tail sampler and of each closed (step, split)."""

    def decided(self, record: EpisodeRecord, reason: str | None) -> None:
        """``record`` was kept (``reason`` None) or dropped (``reason``: why, as counted in
        ``dropped.<reason>``)."""
        ...

    def dropped_rows(self, batch: RowBatch, indices: Sequence[int], reason: str) -> None:
        """Rows ``indices`` of ``batch`` (``otr.record_batch``) were dropped before their
        episodes were recorded (``reason``: as counted in ``dropped.<reason>``)."""
        ...

    def step_closed(self, key: tuple[int, str], health: StepHealth) -> None:
        """The (step, split) ``key`` was decided; ``health``: how its groups fared."""
        ...
