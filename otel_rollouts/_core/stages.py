"""Where an episode's time went: seconds per stage (generation, tool, environment, reward,
waiting), from its spans or from what the framework measured.

Rules, per stage (``conventions.STAGES``):

* a number the framework measured, the root attribute ``rl.stage.<stage>.seconds``, wins;
* otherwise, for an episode recorded while it ran (``record.timed``), the *union* of its ended
  spans' intervals of that kind (generation, tool, reward), clipped to the root's: two
  concurrent generations, or a tool call nested in another, are not counted twice. There is
  no environment span kind: environment time is only what a framework measured;
* waiting is the root's duration minus everything above (the union of all the span-derived
  intervals, plus the measured stages' seconds), never negative: time the episode spent in
  none of its stages (queueing, the user's own code between calls);
* a stage with no span and no measure is absent, never 0 (waiting excepted, for a timed episode
  whose root ended). An episode recorded after the fact (an adapter, a batch row) has root
  times that say when it was recorded, not how long it ran: only its attributes count.

Runs for every decided episode when metrics are on (under the pipeline's lock). The common case
reads the sums ``SpanRecord.end`` kept as the stage spans ended (``EpisodeRecord.timing``: a few
integer operations per span, on timestamps that exist already), about 2.5 µs; spans that
overlapped, ended past the root or were given an end without ending take one pass over the
spans and a sort of each stage's few intervals (12-25 µs for ten spans).
"""

from __future__ import annotations

import math
from typing import Any

from otel_rollouts import conventions as c

__all__ = ["stage_totals"]

# the span kinds that are a stage of their own, by index
_STAGE_OF = (c.STAGE_GENERATION, c.STAGE_TOOL, c.STAGE_REWARD)
_INDEX = {c.KIND_GENERATION: 0, c.KIND_TOOL: 1, c.KIND_REWARD: 2}
_MEASURED = tuple((stage, c.stage_seconds(stage)) for stage in c.STAGES)
_MEASURED_NAMES = frozenset(name for _, name in _MEASURED)


def _seconds(value: Any) -> float | None:
    """A measured number of seconds (finite, not negative), or None."""
    if isinstance(value, (int, float)) and not isinstance(value, bool):
        value = float(value)
        if math.isfinite(value) and value >= 0:
            return value
    return None


def _union_ns(intervals: list[tuple[int, int]], low: int, high: int) -> int:
    """Total length in ns of the union of ``(start, end)`` intervals cut to ``[low, high]``
    (a span outside its root's time counts only inside it). Sorts ``intervals`` in place."""
    if len(intervals) > 1:
        intervals.sort()
    total = 0
    cur_start = cur_end = -1
    for start, end in intervals:
        if start < low:
            start = low
        if end > high:
            end = high
        if end <= start:
            continue
        if cur_end < 0:
            cur_start, cur_end = start, end
        elif start > cur_end:
            total += cur_end - cur_start
            cur_start, cur_end = start, end
        elif end > cur_end:
            cur_end = end
    return total + cur_end - cur_start if cur_end >= 0 else total


def stage_totals(record: Any) -> dict[str, float]:
    """``{stage: seconds}`` for an ``EpisodeRecord`` (see ``conventions.STAGES`` and the rules
    above). Cached in ``record.stages`` once the root has ended (or the episode is untimed):
    the metrics and the kept root's attributes read the same numbers."""
    cached = record.stages
    if cached is not None:
        return cached
    root = record.root
    if root is None:
        return {}
    out: dict[str, float] = {}
    attrs = root.attributes
    if not _MEASURED_NAMES.isdisjoint(attrs):  # a framework measured some (rare): read them
        for stage, name in _MEASURED:
            value = _seconds(attrs.get(name))
            if value is not None:
                out[stage] = value
    root_end = root.end_ns
    if not record.timed:
        record.stages = out
        return out
    if root_end is None:  # still running: not final, not cached
        return out
    root_start = root.start_ns
    timing = record.timing
    if timing is not None and not timing[7] and timing[6] <= root_end:
        # the common case: stage spans one after another inside the root, added up as they
        # ended (SpanRecord.end): no pass over the spans at all
        measured = sum(out.values())
        spent = 0
        for i, stage in enumerate(_STAGE_OF):
            if timing[3 + i] >= 0 and stage not in out:
                out[stage] = timing[i] / 1e9
                spent += timing[i]
        if c.STAGE_WAITING not in out:
            waiting = (max(root_end - root_start, 0) - spent) / 1e9 - measured
            out[c.STAGE_WAITING] = waiting if waiting > 0 else 0.0
        record.stages = out
        return out
    # spans that overlapped (concurrent tool calls, a span nested in one of its kind), ended
    # past the root, or were given their end without ending (no running sums): one pass collects the ended spans of each stage kind (a tuple appended per span: the
    # cheapest a Python loop gets); the unions are of a few intervals each, sorted in C
    gen: list[tuple[int, int]] = []
    tool: list[tuple[int, int]] = []
    reward: list[tuple[int, int]] = []
    lists = {c.KIND_GENERATION: gen, c.KIND_TOOL: tool, c.KIND_REWARD: reward}
    find = lists.get
    for span in record.spans:
        intervals = find(span.kind)
        if intervals is not None:
            end = span.end_ns
            if end is not None:  # still open: only ended spans count
                intervals.append((span.start_ns, end))
    measured = sum(out.values())  # seconds the framework measured (no intervals)
    covered: list[tuple[int, int]] = []
    for stage, intervals in ((c.STAGE_GENERATION, gen), (c.STAGE_TOOL, tool), (c.STAGE_REWARD, reward)):
        if not intervals or stage in out:
            continue
        out[stage] = _union_ns(intervals, root_start, root_end) / 1e9
        covered += intervals
    if c.STAGE_WAITING not in out:
        union = _union_ns(covered, root_start, root_end) if covered else 0
        waiting = (max(root_end - root_start, 0) - union) / 1e9 - measured
        out[c.STAGE_WAITING] = waiting if waiting > 0 else 0.0
    record.stages = out
    return out
