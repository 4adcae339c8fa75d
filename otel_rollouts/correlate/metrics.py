"""Rollout metrics: every episode counted, kept or dropped, as OpenTelemetry metrics.

The pipeline tells ``RolloutMetrics`` about each sampler decision and each closed step (it
observes; it never reaches back). From that it records, on the run's resource:

* ``rl.episodes.seen`` / ``rl.episodes.kept`` / ``rl.episodes.dropped`` — counters with
  ``rl.split`` (and ``rl.drop.reason``) attributes;
* ``rl.episode.reward`` and ``rl.episode.duration`` (s) — histograms by ``rl.split``; exemplars of
  kept episodes carry their trace id (the SDK's trace-based exemplar filter), so a bucket in
  Grafana links to a trace that exists;
* ``rl.tokens.input``, ``rl.tokens.output`` and ``rl.tool.errors`` — counters.

Metrics go to the readers given to ``configure(metric_readers=[...])``, or over OTLP when
``OTEL_METRICS_EXPORTER=otlp``. When an exporter has ``log_metrics(step, values)`` (the
``TrackioExporter``), each closed step's summary (episodes seen/kept/dropped, reward
mean/min/max, mean duration, tokens, tool errors) is handed to it on a background thread, so
Trackio plots them at the same step as the traces.

No instrument has a per-step or per-episode attribute: a series per step would grow the SDK's
memory (and a backend's cardinality) for as long as the run lasts. The step is the time axis;
per-step numbers are in ``otr.stats()["steps"]`` and in the Trackio scalars. A step's summary
is a few running aggregates (count, sum, min, max) and, for the percentiles of time, a bounded
sample of its values.

Where time went and what was not kept (the questions a researcher opens a step for):

* episode duration and time per stage (``_core.stages``: generation, tool, environment,
  reward, waiting): the ``rl.stage.duration`` histogram (``rl.stage.name``, ``rl.split``), and per
  step the Trackio scalars ``episode_duration_s_p50/_p95/_max`` and
  ``stage/<stage>_s_p50/_p95/_max``. Only measured durations count (``record.duration()``): an
  episode recorded after the fact with no measure is counted in ``episodes_unmeasured``, never
  as 0 s. The percentiles come from a deterministic reservoir of at most ``_RESERVOIR`` (1024)
  values per series per step (exact below that; the max is always exact), and all open steps'
  reservoirs together hold at most ``_MAX_SAMPLES`` values (8 MiB): past that a series keeps
  sampling within what it holds. A step's numbers are computed when it closes, then freed.
* seen / kept / dropped by ``rl.status``: the counters carry ``rl.status``; per step the scalars
  ``episodes_seen/<status>``, ``episodes_kept/<status>``, ``episodes_dropped/<status>`` for each
  status the step saw (0 included: "3 errors seen, 0 kept" is said, not implied), and
  ``errors_unkept`` (error episodes seen but not kept) whenever the step saw an error.
* why kept: ``episodes_kept_by/<reason>`` (``rl.trace.keep_reason`` of each kept episode).
* group health (``_core.health.StepHealth``, told when the step closes): the scalars ``groups``,
  ``groups_all_equal``, ``groups_lost``, ``group_members_lost``, ``groups_degenerate``,
  ``groups_truncated`` and ``group_members_truncated`` (a truncated member is scored, not lost:
  counted apart), and the ``rl.groups`` counter by ``rl.group.degenerate`` (none | all_equal |
  lost_members | all_equal,lost_members), each group counted once: a group that lost members
  *and* is all-equal counts under both words joined, so that neither question misses it.
* the step's groups as a table (``StepHealth.rows``: every group seen, kept or not, at most
  ``sampling.health.MAX_ROWS``; ``groups_unlisted`` counts the rest) go to the exporters that
  take them (``exporters.extras.GroupsSink.log_groups``) on the same thread, right after the
  step's ``log_metrics``.
"""

from __future__ import annotations

import logging
import math
import os
import queue
import threading
import time
from array import array
from collections import Counter
from collections.abc import Callable, Sequence
from functools import partial
from itertools import groupby
from operator import itemgetter
from typing import TYPE_CHECKING, Any

from opentelemetry import trace
from opentelemetry.trace import NonRecordingSpan
from opentelemetry.trace.status import StatusCode

from otel_rollouts import conventions as c
from otel_rollouts._core.health import GroupRow
from otel_rollouts._core.spans import EpisodeRecord
from otel_rollouts._core.stages import stage_totals
from otel_rollouts.exporters.extras import GroupsSink, MetricsSink

if TYPE_CHECKING:
    import numpy as np
    from opentelemetry.sdk.metrics.export import MetricReader

    from otel_rollouts._core.health import StepHealth
    from otel_rollouts.sampling.batch import RowBatch

logger = logging.getLogger("otel_rollouts")

__all__ = ["RolloutMetrics", "meter_provider", "step_summary_names"]

_REWARD_BUCKETS = (-1.0, -0.5, 0.0, 0.1, 0.25, 0.5, 0.75, 0.9, 1.0, 2.0, 5.0)
_DURATION_BUCKETS = (0.05, 0.1, 0.25, 0.5, 1.0, 2.5, 5.0, 10.0, 30.0, 60.0, 120.0, 300.0, 600.0)
_MAX_PENDING_STEPS = 4096
# the percentiles of time: a reservoir of at most this many values per series per step (exact
# below it), and all open steps' reservoirs together at most _MAX_SAMPLES values (8 bytes each)
_RESERVOIR = 1024
_MAX_SAMPLES = 1 << 20
# an episode's times wait in a series' pending column, this many at most, and enter its
# reservoir together (``_Series.add_many``, vectorised): an append per value on the caller's
# path instead of a reservoir step; pending values count against _MAX_SAMPLES like stored ones
_PENDING = 512
# the stages of an episode's times, in the order of EpisodeRecord.timing's running sums
_ROW_STAGES = (c.STAGE_GENERATION, c.STAGE_TOOL, c.STAGE_REWARD, c.STAGE_WAITING)
# an inbox entry's (step, split) (see decided)
_ENTRY_KEY = itemgetter(0, 1)
_NO_USAGE = (0, 0, False, False, 0)
# root attributes that make the times of an episode other than its spans' (a measure given)
_GIVEN_TIMES = frozenset((c.RL_DURATION_SECONDS, *(c.stage_seconds(stage) for stage in c.STAGES)))
# a custom policy's labels are its author's: past this many reasons in a step, "policy"
_MAX_REASONS = 32
_WAKE_S = 0.25  # the step-summary thread looks at its queue at least this often (_ScalarSender._run)
_STATUSES = frozenset(c.STATUSES)
# the reservoir's generator: a 64-bit LCG (Knuth's MMIX constants), the same for every series,
# so that the same values in the same order give the same sample
_LCG_A, _LCG_C, _MASK = 6364136223846793005, 1442695040888963407, (1 << 64) - 1
_SEED = 0x2545F4914F6CDD1D


def meter_provider(resource, metric_readers: Sequence[MetricReader] | None):
    """A MeterProvider for ``metric_readers``, plus OTLP when ``OTEL_METRICS_EXPORTER`` says
    ``otlp``; None when there is no reader at all (then no instrument costs anything)."""
    readers = list(metric_readers or ())
    wanted = [v.strip().lower() for v in os.environ.get(c.ENV_METRICS_EXPORTER, "").split(",")]
    if "otlp" in wanted:
        from opentelemetry.sdk.metrics.export import PeriodicExportingMetricReader

        readers.append(PeriodicExportingMetricReader(_otlp_metric_exporter()))
    if not readers:
        return None
    from opentelemetry.sdk.metrics import MeterProvider

    return MeterProvider(metric_readers=readers, resource=resource, shutdown_on_exit=False)


def _otlp_metric_exporter():
    # grpc, http/protobuf or http/json, per OTEL_EXPORTER_OTLP_(METRICS_)PROTOCOL
    from otel_rollouts.delivery.defaults import otlp_metric_exporter

    return otlp_metric_exporter()


def step_summary_names(split: str) -> str:
    """The prefix of a step's Trackio scalars: ``rollouts/`` for train, ``{split}/rollouts/``."""
    return "rollouts/" if split == "train" else f"{split}/rollouts/"


class _Series:
    """A step's values of one time series (episode duration, one stage): how many, the exact
    max, and a deterministic reservoir sample (Algorithm R) for p50/p95, as float64."""

    __slots__ = ("count", "max", "values", "rng", "pending", "gen")

    def __init__(self) -> None:
        self.count = 0
        self.max = float("-inf")
        self.values = array("d")
        self.rng = _SEED
        self.pending = array("d")  # values counted by nothing yet (see _PENDING)
        self.gen: Any = None  # add_many's generator, made once from the LCG's state when needed

    def flush(self, room: int) -> int:
        """The pending values into the sample (``add_many``); returns the slots they took."""
        pending = self.pending
        if not pending:
            return 0
        import numpy as np

        self.pending = array("d")
        return self.add_many(np.frombuffer(pending, dtype=np.float64), room)

    def add(self, value: float, room: bool) -> bool:
        """Count ``value``; True when it took a new slot (``room``: the global bound allows)."""
        self.count += 1
        if value > self.max:
            self.max = value
        values = self.values
        if room and len(values) < _RESERVOIR:
            values.append(value)
            return True
        if values:
            self.rng = rng = (self.rng * _LCG_A + _LCG_C) & _MASK
            slot = (rng >> 11) % self.count
            if slot < len(values):
                values[slot] = value
        return False

    def add_many(self, new: np.ndarray, room: int) -> int:
        """``add`` for an array of values at once (a batch's column), vectorised; returns how
        many slots it took (at most ``room``)."""
        import numpy as np

        n = int(new.size)
        if not n:
            return 0
        self.max = max(self.max, float(new.max()))
        values = self.values
        take = max(min(_RESERVOIR - len(values), room, n), 0)
        if take:
            values.frombytes(np.ascontiguousarray(new[:take], dtype=np.float64).tobytes())
        rest = new[take:]
        if rest.size and values:
            # Algorithm R for the rest: value t (0-based, of all this series saw) replaces slot
            # j ~ U[0, t] when j falls inside the sample; a later value wins a slot drawn twice
            gen = self.gen
            if gen is None:  # made once per series (making one costs more than drawing 1,000)
                self.rng = seed = (self.rng * _LCG_A + _LCG_C) & _MASK
                gen = self.gen = np.random.Generator(np.random.PCG64(seed))
            seen = self.count + take + np.arange(1, rest.size + 1, dtype=np.int64)
            slots = gen.integers(0, seen)
            hit = slots < len(values)
            view = np.frombuffer(values, dtype=np.float64)
            view[slots[hit]] = rest[hit]
            del view  # the array may grow again only once no view of it is left
        self.count += n
        return take

    def add_list(self, new: list[float], room: int) -> int:
        """``add_many`` for a short list of values (an inbox's column): plain Python while they
        fit in the sample (a numpy call on a few hundred values costs more than the loop, and
        much more right after the user's own numpy work, its caches cold); else ``add_many``."""
        n = len(new)
        values = self.values
        if not n:
            return 0
        if n > min(_RESERVOIR - len(values), room):
            import numpy as np

            return self.add_many(np.array(new, dtype=np.float64), room)
        top = max(new)
        if top > self.max:
            self.max = top
        values.extend(new)
        self.count += n
        return n

    def summary(self, out: dict[str, float], name: str) -> None:
        """``name_p50``, ``name_p95`` (linear interpolation over the sample) and ``name_max``."""
        if not self.count:
            return
        if self.values:
            import numpy as np

            p50, p95 = np.percentile(np.frombuffer(self.values, dtype=np.float64), (50, 95))
            out[name + "_p50"] = float(p50)
            out[name + "_p95"] = float(p95)
        out[name + "_max"] = self.max


class _Step:
    __slots__ = ("seen", "kept", "dropped", "rewards", "reward_sum", "reward_min", "reward_max",
                 "durations", "duration_sum", "tokens_in", "tokens_out", "tokens_in_known",
                 "tokens_out_known", "tool_errors", "duration", "stages", "unmeasured",
                 "by_status", "kept_by", "stored", "mismatch")

    def __init__(self) -> None:
        self.seen = self.kept = self.dropped = 0
        self.rewards = self.durations = 0  # how many of each were seen
        self.reward_sum = self.duration_sum = 0.0
        self.reward_min = float("inf")
        self.reward_max = float("-inf")
        self.tokens_in = self.tokens_out = self.tool_errors = 0
        # whether any generation of the step reported its usage: absent is not 0
        self.tokens_in_known = self.tokens_out_known = False
        self.duration = _Series()  # measured episode durations
        self.stages: dict[str, _Series] = {}
        self.unmeasured = 0  # episodes with no measured duration
        self.by_status: dict[str, list[int]] = {}  # status -> [seen, kept]
        self.kept_by: dict[str, int] = {}  # rl.trace.keep_reason -> kept
        self.stored = 0  # reservoir slots held (of the global _MAX_SAMPLES)
        self.mismatch: dict[str, _Series] = {}  # train–inference mismatch statistic -> its values

    def settle(self) -> None:
        """Every value still waiting (series' pending columns) into its series: what a closed
        step does before its summary (its slots were given back when it closed)."""
        for series in (self.duration, *self.stages.values(), *self.mismatch.values()):
            series.flush(_RESERVOIR)

    def series(self, stat: str) -> _Series:
        series = self.mismatch.get(stat)
        if series is None:
            series = self.mismatch[stat] = _Series()
        return series

    def add_status(self, status: str, seen: int, kept: int) -> None:
        counts = self.by_status.get(status)
        if counts is None:
            self.by_status[status] = [seen, kept]
        else:
            counts[0] += seen
            counts[1] += kept

    def stage(self, stage: str) -> _Series:
        series = self.stages.get(stage)
        if series is None:
            series = self.stages[stage] = _Series()
        return series

    def add_kept_by(self, reason: str) -> None:
        """One episode kept for ``reason`` (past ``_MAX_REASONS`` reasons in a step: "policy")."""
        if reason not in self.kept_by and len(self.kept_by) >= _MAX_REASONS:
            reason = c.REASON_POLICY
        self.kept_by[reason] = self.kept_by.get(reason, 0) + 1

    def add_reward(self, reward: float) -> None:
        self.rewards += 1
        self.reward_sum += reward
        self.reward_min = min(self.reward_min, reward)
        self.reward_max = max(self.reward_max, reward)

    def add_duration(self, duration: float) -> None:
        self.durations += 1
        self.duration_sum += duration

    def summary(self, prefix: str, health: StepHealth | None = None) -> dict[str, float]:
        self.settle()
        out: dict[str, float] = {
            prefix + "episodes_seen": self.seen,
            prefix + "episodes_kept": self.kept,
            prefix + "episodes_dropped": self.dropped,
            prefix + "tool_errors": self.tool_errors,
        }
        if self.tokens_in_known:
            out[prefix + "tokens_input"] = self.tokens_in
        if self.tokens_out_known:
            out[prefix + "tokens_output"] = self.tokens_out
        if self.rewards:
            out[prefix + "reward_mean"] = self.reward_sum / self.rewards
            out[prefix + "reward_min"] = self.reward_min
            out[prefix + "reward_max"] = self.reward_max
        if self.durations:
            out[prefix + "episode_duration_s_mean"] = self.duration_sum / self.durations
        self.duration.summary(out, prefix + "episode_duration_s")
        for stage in c.STAGES:
            series = self.stages.get(stage)
            if series is not None:
                series.summary(out, f"{prefix}stage/{stage}_s")
        out[prefix + "episodes_unmeasured"] = self.unmeasured
        for stat in c.MISMATCH_STEP_STATS:
            series = self.mismatch.get(stat)
            if series is not None:
                series.summary(out, f"{prefix}mismatch/{stat}")
        for status, (seen, kept) in self.by_status.items():
            out[f"{prefix}episodes_seen/{status}"] = seen
            out[f"{prefix}episodes_kept/{status}"] = kept
            out[f"{prefix}episodes_dropped/{status}"] = seen - kept
        errors = self.by_status.get(c.STATUS_ERROR)
        if errors is not None:  # said whenever the step saw an error: 0 is "all kept"
            out[prefix + "errors_unkept"] = errors[0] - errors[1]
        for reason, kept in self.kept_by.items():
            out[f"{prefix}episodes_kept_by/{reason}"] = kept
        if health is not None and (health.groups or health.untracked):
            out[prefix + "groups"] = health.groups
            out[prefix + "groups_all_equal"] = health.all_equal
            out[prefix + "groups_lost"] = health.lost
            out[prefix + "group_members_lost"] = health.lost_members
            out[prefix + "groups_degenerate"] = health.degenerate
            out[prefix + "groups_truncated"] = health.truncated
            out[prefix + "group_members_truncated"] = health.truncated_members
            if health.untracked:
                out[prefix + "groups_untracked"] = health.untracked
            if health.rows_left_out:
                out[prefix + "groups_unlisted"] = health.rows_left_out
        return out


# a closed step's groups for ``log_groups``: its split and its rows (or what makes them, on the
# metrics thread)
_Groups = tuple[str, "Sequence[GroupRow] | Callable[[], Sequence[GroupRow]]"]


class _ScalarSender:
    """A bounded queue and one lazily started thread: step summaries to ``log_metrics``, then
    the step's groups to ``log_groups`` (the sinks that are a ``GroupsSink``)."""

    def __init__(self, sinks: Sequence[Any], stats) -> None:
        self.sinks = list(sinks)
        # what each sink takes, told once (a runtime protocol check is a few attribute reads)
        self.metric_sinks = {id(s) for s in self.sinks if isinstance(s, MetricsSink)}
        self.group_sinks = {id(s) for s in self.sinks if isinstance(s, GroupsSink)}
        self.stats = stats
        self._queue: queue.Queue = queue.Queue(maxsize=1024)
        self._thread: threading.Thread | None = None
        self._lock = threading.Lock()
        self._idle = threading.Condition(self._lock)
        self._pending = 0

    def send(self, step: int, values: dict[str, float] | Callable[[], dict[str, float]] | None,
             groups: _Groups | None = None) -> None:
        """Queue a step's ``values`` for ``log_metrics`` (None: none) and its ``groups`` for
        ``log_groups`` (None: none); past the queue's bound, counted dropped."""
        if groups is not None and not self.group_sinks:
            groups = None
        if values is None and groups is None:
            return
        with self._lock:
            if self._thread is None or not self._thread.is_alive():
                self._thread = threading.Thread(target=self._run, name="otel-rollouts-metrics",
                                                daemon=True)
                self._thread.start()
            try:
                self._queue.put_nowait((step, values, groups))
                self._pending += 1
            except queue.Full:
                if self.stats is not None:
                    self.stats.add("dropped.step_metrics")

    def _run(self) -> None:
        while True:
            try:
                # bounded: a KeyboardInterrupt landing in the training thread's put_nowait while
                # it notifies this thread loses the wakeup (see delivery.dispatch.Delivery._run)
                item = self._queue.get(timeout=_WAKE_S)
            except queue.Empty:
                continue
            if item is None:  # stop(): the run is over
                return
            step, values, groups = item
            if callable(values):  # a closed step's summary, computed here, off the pipeline's lock
                try:
                    values = values()
                except Exception:  # noqa: BLE001 - a summary's failure never stops this thread
                    if self.stats is not None:
                        self.stats.add("errors.step_summary")
                    values = {}
            split, rows = groups if groups is not None else ("", ())
            if callable(rows):  # the rows' group ids redacted here, off the pipeline's lock
                try:
                    rows = rows()
                except Exception:  # noqa: BLE001 - never stops this thread
                    if self.stats is not None:
                        self.stats.add("errors.step_groups")
                    rows = ()
            for sink in self.sinks:
                if values is not None and id(sink) in self.metric_sinks:
                    self._call(sink, "log_metrics", step, values)
                if rows and id(sink) in self.group_sinks:
                    self._call(sink, "log_groups", step, split, rows)
            with self._lock:
                self._pending -= 1
                self._idle.notify_all()

    def _call(self, sink: Any, method: str, *args: Any) -> None:
        """``sink.<method>(*args)``, contained: whatever it raises (an exporter bug, even
        ``SystemExit``) is counted as ``errors.<method>.<exporter>`` and never stops this thread."""
        try:
            getattr(sink, method)(*args)
        except BaseException as exc:  # noqa: BLE001 - an exporter bug (even SystemExit) never stops this thread
            if self.stats is not None:
                self.stats.add(f"errors.{method}.{type(sink).__name__}")
            logger.debug("otel_rollouts: %s failed: %s", method, type(exc).__name__)

    def flush(self, timeout: float) -> bool:
        with self._lock:
            return self._idle.wait_for(lambda: self._pending == 0, timeout)

    def stop(self, timeout: float) -> None:
        """End the thread once what is queued was sent (within ``timeout``): a run replaced by
        another leaves no thread behind."""
        with self._lock:
            thread = self._thread
        if thread is None or not thread.is_alive():
            return
        try:
            self._queue.put(None, timeout=max(timeout, 0.0))
        except queue.Full:
            return
        thread.join(max(timeout, 0.0))


class RolloutMetrics:
    """Told of every decision and closed step by the pipeline; records the instruments."""

    def __init__(self, provider=None, scalar_sinks: Sequence[Any] = (), stats=None,
                 label: Callable[[str], str] | None = None) -> None:
        self.provider = provider
        # the split is a user's name: it leaves (as an attribute, in Trackio's metric names)
        # redacted like a span name
        self.label = label
        self._lock = threading.Lock()
        self._steps: dict[tuple[int, str], _Step] = {}
        self._samples = 0  # reservoir values held by all open steps (bounded by _MAX_SAMPLES)
        # decided episodes as read (``decided``), fewer than _PENDING, not yet in their steps
        self._inbox: list[tuple[Any, ...]] = []
        self._sender = _ScalarSender(scalar_sinks, stats) if scalar_sinks else None
        self._instruments = provider is not None
        if provider is None:
            return
        meter = provider.get_meter(c.SCOPE_NAME)
        self.seen = meter.create_counter(c.METRIC_EPISODES_SEEN, "{episode}",
                                         "Episodes offered to the tail sampler")
        self.kept = meter.create_counter(c.METRIC_EPISODES_KEPT, "{episode}",
                                         "Episodes the tail sampler kept")
        self.dropped = meter.create_counter(c.METRIC_EPISODES_DROPPED, "{episode}",
                                            "Episodes the tail sampler dropped, by reason")
        self.reward = meter.create_histogram(c.METRIC_REWARD, "{reward}", "Episode reward",
                                             explicit_bucket_boundaries_advisory=_REWARD_BUCKETS)
        self.duration = meter.create_histogram(
            c.METRIC_EPISODE_DURATION, "s", "Episode wall time (root span)",
            explicit_bucket_boundaries_advisory=_DURATION_BUCKETS)
        self.input_tokens = meter.create_counter(c.METRIC_INPUT_TOKENS, "{token}", "Tokens in (prompts)")
        self.output_tokens = meter.create_counter(c.METRIC_OUTPUT_TOKENS, "{token}", "Tokens out (generated)")
        self.tool_errors = meter.create_counter(c.METRIC_TOOL_ERRORS, "{call}",
                                                "Tool calls that failed")
        self.hung_episodes = meter.create_counter(c.METRIC_HUNG, "{episode}",
                                                  "Episodes shown hanging that never ended by themselves")
        self.stage_duration = meter.create_histogram(
            c.METRIC_STAGE_DURATION, "s",
            "Episode time per stage (generation, tool, environment, reward, waiting)",
            explicit_bucket_boundaries_advisory=_DURATION_BUCKETS)
        self.groups = meter.create_counter(
            c.METRIC_GROUPS, "{group}",
            "GRPO groups of closed steps, by why they are degenerate (none: healthy)")

    def _step(self, key: tuple[int, str]) -> _Step:
        """The summary of (step, split), made on first use; the oldest is forgotten past
        ``_MAX_PENDING_STEPS`` (under ``self._lock``)."""
        step = self._steps.get(key)
        if step is None:
            if len(self._steps) >= _MAX_PENDING_STEPS:
                self._samples -= self._steps.pop(next(iter(self._steps))).stored
            step = self._steps[key] = _Step()
        return step

    def _time(self, step: _Step, duration: float | None, stages: dict[str, float]) -> None:
        """One episode's measured duration and stage seconds into its step (under the lock)."""
        if duration is None:
            step.unmeasured += 1
        else:
            self._push(step, step.duration, duration)
        for stage, seconds in stages.items():
            self._push(step, step.stage(stage), seconds)

    def _push(self, step: _Step, series: _Series, value: float) -> None:
        """``value`` into ``series``: to its pending column while the global bound has room
        (counted as a slot until it is flushed), else a reservoir step at once."""
        if self._samples >= _MAX_SAMPLES:
            series.add(value, False)
            return
        pending = series.pending
        pending.append(value)
        step.stored += 1
        self._samples += 1
        if len(pending) >= _PENDING:
            n = len(pending)
            taken = series.flush(max(_MAX_SAMPLES - self._samples + n, 0))
            step.stored += taken - n
            self._samples += taken - n

    def _time_column(self, step: _Step, series: _Series, values: np.ndarray) -> None:
        taken = series.add_many(values, max(_MAX_SAMPLES - self._samples, 0))
        step.stored += taken
        self._samples += taken

    def _time_list(self, step: _Step, series: _Series, values: list[float]) -> None:
        taken = series.add_list(values, max(_MAX_SAMPLES - self._samples, 0))
        step.stored += taken
        self._samples += taken

    # --- called by the pipeline (under its lock) --------------------------------------------------
    def dropped_rows(self, batch: RowBatch, indices: Sequence[int], reason: str) -> None:
        """Rows of a batch (``sampling.batch.RowBatch``) dropped before their episodes were
        recorded: counted (by status) and their rewards summarised at once, with numpy, never a
        Python object per row. They have no spans: a duration or stage time only where the batch
        has that column (``rl.duration.seconds``, ``rl.stage.<stage>.seconds``), else they are
        unmeasured. Values still reach the histograms one by one: they have no bulk call."""
        n = len(indices)
        if not n:
            return
        import numpy as np

        rows = np.asarray(indices, dtype=np.int64)
        scores = batch.scores(c.RL_REWARD)[rows]
        rewards = scores[~np.isnan(scores)]
        by_status = _status_counts(batch, rows)
        durations = _measured(batch, c.RL_DURATION_SECONDS, rows)
        stages = {stage: values for stage in c.STAGES
                  if (values := _measured(batch, c.stage_seconds(stage), rows)) is not None}
        mismatch = {stat: values for stat in c.MISMATCH_STEP_STATS
                    if (values := _finite(batch, c.MISMATCH_STATS[stat], rows)) is not None and values.size}
        split = self.label(batch.split) if self.label is not None else batch.split
        with self._lock:
            step = self._step((batch.step, split))
            step.seen += n
            step.dropped += n
            for status, count in by_status.items():
                step.add_status(status, count, 0)
            if rewards.size:
                step.rewards += int(rewards.size)
                step.reward_sum += float(rewards.sum())
                step.reward_min = min(step.reward_min, float(rewards.min()))
                step.reward_max = max(step.reward_max, float(rewards.max()))
            if durations is None:
                step.unmeasured += n
            else:
                step.unmeasured += n - int(durations.size)
                step.durations += int(durations.size)
                step.duration_sum += float(durations.sum())
                self._time_column(step, step.duration, durations)
            for stage, values in stages.items():
                self._time_column(step, step.stage(stage), values)
            for stat, values in mismatch.items():
                self._time_column(step, step.series(stat), values)
        if not self._instruments:
            return
        by_split = {c.RL_SPLIT: split}
        for status, count in by_status.items():
            by_status_attrs = {**by_split, c.RL_STATUS: status}
            self.seen.add(count, by_status_attrs)
            self.dropped.add(count, {**by_status_attrs, c.RL_DROP_REASON: reason})
        for value in rewards.tolist():
            self.reward.record(value, by_split)
        if durations is not None:
            for value in durations.tolist():
                self.duration.record(value, by_split)
        for stage, values in stages.items():
            by_stage = {**by_split, c.RL_STAGE_NAME: stage}
            for value in values.tolist():
                self.stage_duration.record(value, by_stage)

    def decided(self, record: EpisodeRecord, reason: str | None) -> None:
        """``reason`` None: kept; else why it was dropped. Called before its spans are freed.

        The common case (no instruments, times from the episode's own spans, added up as they
        ended, no mismatch) is read into the inbox as it is (one tuple, no lock, nothing
        computed) and added up ``_PENDING`` at a time (``_fold``); any other, here at once."""
        root = record.root
        if root is not None and not self._instruments:
            attrs = root.attributes
            end = root.end_ns
            timing = record.timing
            if not (end is None or timing is None or timing[7] or timing[6] > end or not record.timed
                    or record.mismatch is not None or not _GIVEN_TIMES.isdisjoint(attrs)):
                # (else no running sums: stage spans recorded another way, stage_totals' pass)
                inbox = self._inbox
                inbox.append((record.step, record.split, end - root.start_ns, timing[0], timing[1],
                              timing[2], timing[3], timing[4], timing[5], attrs.get(c.RL_REWARD),
                              attrs.get(c.RL_STATUS), _usage(record), reason is None,
                              record.reason if reason is None else None))
                if len(inbox) >= _PENDING:
                    with self._lock:
                        self._fold()
                return
        reward = _reward(record.attribute(c.RL_REWARD))
        # measured time only: an episode recorded after the fact has none (never 0 s)
        duration = record.duration()
        if duration is not None and not (math.isfinite(duration) and duration >= 0):
            duration = None
        stages = stage_totals(record)
        mismatch: dict[str, float] = {}
        if record.mismatch is not None and root is not None:
            attrs = root.attributes
            for stat in c.MISMATCH_STEP_STATS:
                value = attrs.get(c.MISMATCH_STATS[stat])
                if isinstance(value, (int, float)) and math.isfinite(value):
                    mismatch[stat] = float(value)
        status = record.attribute(c.RL_STATUS)
        if status not in _STATUSES:  # statuses are checked where they are set; None is ok
            status = c.STATUS_OK
        kept_by = record.reason if reason is None else None
        tokens_in, tokens_out, in_known, out_known, errors = _usage(record)
        split = self.label(record.split) if self.label is not None else record.split
        key = (record.step, split)
        with self._lock:
            step = self._step(key)
            step.seen += 1
            if reason is None:
                step.kept += 1
            else:
                step.dropped += 1
            step.add_status(status, 1, 1 if reason is None else 0)
            if kept_by is not None:
                step.add_kept_by(kept_by)
            if reward is not None:
                step.add_reward(reward)
            if duration is not None:
                step.add_duration(duration)
            self._time(step, duration, stages)
            for stat, value in mismatch.items():
                if step.series(stat).add(value, self._samples < _MAX_SAMPLES):
                    step.stored += 1
                    self._samples += 1
            step.tokens_in += tokens_in
            step.tokens_out += tokens_out
            step.tokens_in_known = step.tokens_in_known or in_known
            step.tokens_out_known = step.tokens_out_known or out_known
            step.tool_errors += errors
        if not self._instruments:
            return
        by_split = {c.RL_SPLIT: split}
        by_status = {c.RL_SPLIT: split, c.RL_STATUS: status}
        # exemplars point at a trace only when it will exist (kept)
        ctx = None
        if reason is None and root is not None:
            ctx = trace.set_span_in_context(NonRecordingSpan(root.get_span_context()))
        self.seen.add(1, by_status, context=ctx)
        if reason is None:
            self.kept.add(1, by_status, context=ctx)
        else:
            self.dropped.add(1, {**by_status, c.RL_DROP_REASON: reason})
        if reward is not None:
            self.reward.record(reward, by_split, context=ctx)
        if duration is not None:
            self.duration.record(duration, by_split, context=ctx)
        for stage, seconds in stages.items():
            self.stage_duration.record(seconds, {c.RL_SPLIT: split, c.RL_STAGE_NAME: stage},
                                       context=ctx)
        if tokens_in:
            self.input_tokens.add(tokens_in, by_split, context=ctx)
        if tokens_out:
            self.output_tokens.add(tokens_out, by_split, context=ctx)
        if errors:
            self.tool_errors.add(errors, by_split, context=ctx)

    def _fold(self) -> None:
        """The inbox's episodes into their steps (under ``self._lock``): counts, statuses, why
        kept, rewards, usage and times, a column at a time per step, in plain Python (a few
        hundred values: numpy's per-call cost is more than the loops', and it runs right after
        the user's numpy work, where its first calls cost milliseconds)."""
        inbox = self._inbox
        n = len(inbox)
        if not n:
            return
        entries = inbox[:n]
        del inbox[:n]  # (appends made meanwhile stay: list operations are atomic)
        for (step_no, split), group in groupby(entries, _ENTRY_KEY):
            rows = list(group)
            m = len(rows)
            columns = list(zip(*rows, strict=True))  # the entries as columns, in C
            step = self._step((step_no, self.label(split) if self.label is not None else split))
            step.seen += m
            kept = columns[12]
            n_kept = kept.count(True)
            step.kept += n_kept
            step.dropped += m - n_kept
            statuses = [status if status in _STATUSES else c.STATUS_OK for status in columns[10]]
            if not n_kept:
                for status, count in Counter(statuses).items():
                    step.add_status(status, count, 0)
            else:
                for (status, was_kept), count in Counter(zip(statuses, kept, strict=True)).items():
                    step.add_status(status, count, count if was_kept else 0)
                for kept_by in columns[13]:
                    if kept_by is not None:
                        step.add_kept_by(kept_by)
            rewards = columns[9]
            if set(map(type, rewards)) == {float}:  # the common case: add_reward, a column at once
                step.rewards += m
                step.reward_sum = sum(rewards, step.reward_sum)
                step.reward_min = min(step.reward_min, *rewards)  # (a NaN skipped, as one by one)
                step.reward_max = max(step.reward_max, *rewards)
            else:
                for value in rewards:
                    reward = _reward(value)
                    if reward is not None:
                        step.add_reward(reward)
            usage = columns[11]
            if usage.count(_NO_USAGE) != m:
                for tokens_in, tokens_out, in_known, out_known, errors in usage:
                    step.tokens_in += tokens_in
                    step.tokens_out += tokens_out
                    step.tokens_in_known = step.tokens_in_known or in_known
                    step.tokens_out_known = step.tokens_out_known or out_known
                    step.tool_errors += errors
            # the times: duration (the root's span, never negative), each stage that ended (its
            # running sum), and waiting (what no stage took)
            totals = [t if t > 0 else 0 for t in columns[2]]
            durations = [t / 1e9 for t in totals]
            step.durations += m
            step.duration_sum = sum(durations, step.duration_sum)
            self._time_list(step, step.duration, durations)
            spent = [0] * m
            for j, name in enumerate(_ROW_STAGES[:3]):
                sums, ends = columns[3 + j], columns[6 + j]
                if max(ends) >= 0:  # some episode's stage ended
                    self._time_list(step, step.stage(name),
                                    [t / 1e9 for t, end in zip(sums, ends, strict=True) if end >= 0])
                    spent = [a + (t if end >= 0 else 0) for a, t, end in zip(spent, sums, ends, strict=True)]
            self._time_list(step, step.stage(c.STAGE_WAITING),
                            [max((t - a) / 1e9, 0.0) for t, a in zip(totals, spent, strict=True)])

    def step_closed(self, key: tuple[int, str], health: StepHealth | None = None) -> None:
        """(step, split) closed: its summary goes to the scalar sinks, then its groups' rows
        (``health.rows``) to the sinks that take them (``log_groups``), its group ``health``
        (when the pipeline assessed it) to the ``rl.groups`` counter, and the step is freed.
        The split is labelled (redacted) as ``decided`` labels it: the step is found by it."""
        split = self.label(key[1]) if self.label is not None else key[1]
        with self._lock:
            self._fold()
            step = self._steps.pop((key[0], split), None)
            if step is not None:
                self._samples -= step.stored
        if self._sender is not None:
            groups: _Groups | None = None
            if health is not None and health.rows:
                label = self.label
                # a group id is the user's text: it leaves redacted like a name (on the metrics thread)
                groups = (split, health.rows if label is None else partial(_labelled, label, health.rows))
            # percentiles sort each series: done on the metrics thread, not the caller's
            values = partial(step.summary, step_summary_names(split), health) if step is not None else None
            self._sender.send(key[0], values, groups)
        if health is None or not health.groups or not self._instruments:
            return
        # each group once; a group both all-equal and short of members under both words joined
        both = health.all_equal_and_lost
        lost = max(health.lost - both, 0)
        all_equal = max(health.all_equal - both, 0)
        healthy = max(health.groups - health.degenerate, 0)
        for kind, count in ((c.DEGENERATE_LOST, lost), (c.DEGENERATE_ALL_EQUAL, all_equal),
                            (c.DEGENERATE_ALL_EQUAL_LOST, both), (c.DEGENERATE_NONE, healthy)):
            if count:
                self.groups.add(count, {c.RL_SPLIT: split, c.RL_GROUP_DEGENERATE: kind})

    def hung(self, key: tuple[int, str], n: int) -> None:
        """``n`` episodes of (step, split) hung: shown running past the hang threshold, they
        never ended by themselves (still open when their step closed, at shutdown, or ended by
        ``episode_timeout_s``). A Trackio scalar at that step, and the ``rl.episodes.hung`` counter."""
        split = self.label(key[1]) if self.label is not None else key[1]
        if self._sender is not None:
            self._sender.send(key[0], {step_summary_names(split) + "episodes_hung": n})
        if self._instruments:
            self.hung_episodes.add(n, {c.RL_SPLIT: split})

    # --- configuration's controls ---------------------------------------------------------------
    def flush(self, timeout: float = 10.0) -> bool:
        ok = True
        if self._sender is not None:
            ok = self._sender.flush(timeout)
        if self.provider is not None:
            ok = bool(self.provider.force_flush(int(timeout * 1000))) and ok
        return ok

    def shutdown(self, timeout: float = 10.0) -> None:
        """Send what is queued and stop, within ``timeout`` (the meter provider's shutdown
        exports a last time: bounded by what is left)."""
        deadline = time.monotonic() + timeout
        self.flush(timeout)
        if self._sender is not None:
            self._sender.stop(max(deadline - time.monotonic(), 0.0))
        if self.provider is not None:
            self.provider.shutdown(timeout_millis=max(deadline - time.monotonic(), 0.0) * 1000)


def _labelled(label: Callable[[str], str], rows: Sequence[GroupRow]) -> list[GroupRow]:
    """``rows`` with each group id as ``label`` (the run's redactor) says it."""
    return [row._replace(group=label(row.group)) for row in rows]


def _status_counts(batch: RowBatch, rows: np.ndarray) -> dict[str, int]:
    """How many of ``rows`` have each ``rl.status`` (None, or anything not a status: ok).
    Counted in C (``Counter`` over the column), less the rows not in ``rows`` when those are
    the few (the dropped rows of a batch are nearly all of it): no Python object per row."""
    import numpy as np

    column = batch.column(c.RL_STATUS)
    if column is None:
        return {c.STATUS_OK: int(rows.size)}
    n = len(column)
    if rows.size * 2 > n:
        counts = Counter(column)
        mask = np.ones(n, dtype=bool)
        mask[rows] = False
        counts.subtract(column[i] for i in np.flatnonzero(mask).tolist())
    else:
        counts = Counter(column[i] for i in rows.tolist())
    out: dict[str, int] = {}
    rest = int(rows.size)
    for status in c.STATUSES:
        count = counts.get(status, 0)
        if count and status != c.STATUS_OK:
            out[status] = count
            rest -= count
    if rest:
        out[c.STATUS_OK] = rest
    return out


def _measured(batch: RowBatch, name: str, rows: np.ndarray) -> np.ndarray | None:
    """The measured seconds of ``rows`` in the batch's column ``name`` (finite, not negative),
    or None when the batch has no such column."""
    if not batch.has(name):
        return None
    import numpy as np

    values = batch.scores(name)[rows]
    return values[np.isfinite(values) & (values >= 0)]


def _finite(batch: RowBatch, name: str, rows: np.ndarray) -> np.ndarray | None:
    """The finite values of ``rows`` in the batch's column ``name`` (None: no such column)."""
    if not batch.has(name):
        return None
    import numpy as np

    values = batch.scores(name)[rows]
    return values[np.isfinite(values)]


def _reward(value: object) -> float | None:
    """A recorded reward as a float (None: none, or not a number; a bool is not one)."""
    return float(value) if isinstance(value, (int, float)) and not isinstance(value, bool) else None


def _count(value: object) -> int | None:
    """A recorded token count, or None where none was recorded (absent is not 0)."""
    return value if isinstance(value, int) and not isinstance(value, bool) and value >= 0 else None


def _usage(record: EpisodeRecord) -> tuple[int, int, bool, bool, int]:
    """An episode's token usage (input, output, and whether any generation reported each: absent
    is not 0) and its failed tool calls: usage is a generation's, a failure counted a tool's."""
    tokens_in = tokens_out = errors = 0
    in_known = out_known = False
    for span in record.spans:
        kind = span.kind
        if kind == c.KIND_GENERATION:
            attrs = span.attributes
            count = _count(attrs.get(c.GEN_AI_USAGE_INPUT_TOKENS))
            if count is not None:
                tokens_in += count
                in_known = True
            count = _count(attrs.get(c.GEN_AI_USAGE_OUTPUT_TOKENS))
            if count is not None:
                tokens_out += count
                out_known = True
        elif kind == c.KIND_TOOL and span.status_code is StatusCode.ERROR:
            errors += 1
    if not (in_known or out_known or errors):
        return _NO_USAGE  # (one tuple for the common case: an inbox entry holds no new one)
    return tokens_in, tokens_out, in_known, out_known, errors
