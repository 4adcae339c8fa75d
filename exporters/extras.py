"""What an exporter may offer beyond ``SpanExporter``: the optional extras the library calls.

Each extra is a ``typing.Protocol`` (``runtime_checkable``): the library finds it with
``isinstance(exporter, MetricsSink)`` and calls the method, nothing else. An exporter declares
what it offers by subclassing the protocol next to ``SpanExporter``
(``class TrackioExporter(SpanExporter, MetricsSink, NotStoredReporter, PendingViewer)``), or
simply by having the method (the protocols are structural; a declaration lets a type checker
hold the signature to it).

Every call is contained: what an extra raises is counted (``errors.<method>.<exporter>`` in
``otr.stats()``) and logged once, never raised into training, never retried.
"""

from __future__ import annotations

from collections.abc import Iterable, Mapping, Sequence
from typing import Protocol, runtime_checkable

from opentelemetry.sdk.trace import ReadableSpan

# a row of ``GroupsSink.log_groups``, defined in ``_core`` (the sampler makes it; exporters read it)
from otel_rollouts._core.health import GroupRow

__all__ = ["GroupsSink", "MetricsSink", "NotStoredReporter", "PendingViewer"]


@runtime_checkable
class MetricsSink(Protocol):
    """An exporter that takes each closed step's summary (Trackio logs them as scalars).

    Called on a background thread of the library (never the training thread), in step order,
    once per closed (step, split)."""

    def log_metrics(self, step: int, values: dict[str, float]) -> None:
        """Log ``values`` (metric name -> number: ``rollouts/reward/mean``, ...) at ``step``."""
        ...


@runtime_checkable
class GroupsSink(Protocol):
    """An exporter that takes each closed step's GRPO groups as a table (Trackio: a groups table
    beside the step's scalars): every group the step saw, kept or not.

    Called on the same background thread as ``MetricsSink.log_metrics`` (never the training
    thread), in step order, once per closed (step, split) that saw groups (``rl.group.id``), right
    after that step's ``log_metrics`` when the exporter is also a ``MetricsSink``. With
    ``configure(process=True)`` the call is made on the exporter's copy in the renderer process
    (the rows travel pickled, as step summaries do)."""

    def log_groups(self, step: int, split: str, rows: Sequence[GroupRow]) -> None:
        """Show ``rows`` (``otel_rollouts._core.health.GroupRow``: group id as text, members
        seen, expected size (0: unknown), reward spread (None: no rewards), all-equal, members
        truncated, members lost, members kept) for (``step``, ``split``). At most 256 rows, the
        degenerate groups (all-equal or lost members) first, then by group id; groups past that
        are counted in the step's scalar ``groups_unlisted``, not listed."""
        ...


@runtime_checkable
class NotStoredReporter(Protocol):
    """An exporter that can say which episodes of its last ``export`` it took but did not store
    (a ``SUCCESS`` is confirmed, not trusted: those episodes are counted dropped, not delivered).
    """

    def take_not_stored(self) -> Mapping[str, Iterable[int] | int]:
        """What the last ``export`` did not store, and forget it: reason -> trace ids (or a
        count, taken as that many of the batch's episodes, in order). Empty: all stored."""
        ...


@runtime_checkable
class PendingViewer(Protocol):
    """An exporter that shows episodes still running past the hang threshold (snapshots that
    are not kept episodes: never counted as delivered, never retried)."""

    def show_pending(self, snapshots: Sequence[ReadableSpan], ended: Sequence[int]) -> None:
        """Show ``snapshots`` (rendered spans of running episodes, redacted as kept ones) and
        stop showing the episodes whose trace ids are in ``ended`` (they finished since)."""
        ...
