"""Rollout metrics: every episode counted, kept or dropped, as OpenTelemetry metrics.

The pipeline tells ``RolloutMetrics`` about each sampler decision and each closed step (it
observes; it never reaches back). From that it records, on the run's resource:

* ``rl.episodes.seen`` / ``rl.episodes.kept`` / ``rl.episodes.dropped`` — counters with
  ``rl.split`` (and ``rl.drop.reason``) attributes;
* ``rl.reward`` and ``rl.episode.duration`` (s) — histograms by ``rl.split``; exemplars of
  kept episodes carry their trace id (the SDK's trace-based exemplar filter), so a bucket in
  Grafana links to a trace that exists;
* ``rl.tokens`` (``gen_ai.token.type`` = input | output) and ``rl.tool.errors`` — counters.

Metrics go to the readers given to ``configure(metric_readers=[...])``, or over OTLP when
``OTEL_METRICS_EXPORTER=otlp``. When an exporter has ``log_metrics(step, values)`` (the
``TrackioExporter``), each closed step's summary (episodes seen/kept/dropped, reward
mean/min/max, mean duration, tokens, tool errors) is handed to it on a background thread, so
Trackio plots them at the same step as the traces.

No instrument has a per-step or per-episode attribute: a series per step would grow the SDK's
memory (and a backend's cardinality) for as long as the run lasts. The step is the time axis;
per-step numbers are in ``otr.stats()["steps"]`` and in the Trackio scalars. A step's summary
is a few running aggregates (count, sum, min, max), never a list of its values.
"""

from __future__ import annotations

import logging
import os
import queue
import threading
import time
from collections.abc import Callable, Sequence
from typing import Any

from opentelemetry import trace
from opentelemetry.trace import NonRecordingSpan
from opentelemetry.trace.status import StatusCode

from otel_rollouts import conventions as c
from otel_rollouts._core.spans import EpisodeRecord

logger = logging.getLogger("otel_rollouts")

__all__ = ["RolloutMetrics", "meter_provider", "step_summary_names"]

_REWARD_BUCKETS = (-1.0, -0.5, 0.0, 0.1, 0.25, 0.5, 0.75, 0.9, 1.0, 2.0, 5.0)
_DURATION_BUCKETS = (0.05, 0.1, 0.25, 0.5, 1.0, 2.5, 5.0, 10.0, 30.0, 60.0, 120.0, 300.0, 600.0)
_MAX_PENDING_STEPS = 4096


def meter_provider(resource, metric_readers: Sequence[Any] | None):
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


class _Step:
    __slots__ = ("seen", "kept", "dropped", "rewards", "reward_sum", "reward_min", "reward_max",
                 "durations", "duration_sum", "tokens_in", "tokens_out", "tokens_in_known",
                 "tokens_out_known", "tool_errors")

    def __init__(self) -> None:
        self.seen = self.kept = self.dropped = 0
        self.rewards = self.durations = 0  # how many of each were seen
        self.reward_sum = self.duration_sum = 0.0
        self.reward_min = float("inf")
        self.reward_max = float("-inf")
        self.tokens_in = self.tokens_out = self.tool_errors = 0
        # whether any generation of the step reported its usage: absent is not 0
        self.tokens_in_known = self.tokens_out_known = False

    def add_reward(self, reward: float) -> None:
        self.rewards += 1
        self.reward_sum += reward
        self.reward_min = min(self.reward_min, reward)
        self.reward_max = max(self.reward_max, reward)

    def add_duration(self, duration: float) -> None:
        self.durations += 1
        self.duration_sum += duration

    def summary(self, prefix: str) -> dict[str, float]:
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
        return out


class _ScalarSender:
    """A bounded queue and one lazily started thread: step summaries to ``log_metrics``."""

    def __init__(self, sinks: Sequence[Any], stats) -> None:
        self.sinks = list(sinks)
        self.stats = stats
        self._queue: queue.Queue = queue.Queue(maxsize=1024)
        self._thread: threading.Thread | None = None
        self._lock = threading.Lock()
        self._idle = threading.Condition(self._lock)
        self._pending = 0

    def send(self, step: int, values: dict[str, float]) -> None:
        with self._lock:
            if self._thread is None or not self._thread.is_alive():
                self._thread = threading.Thread(target=self._run, name="otel-rollouts-metrics",
                                                daemon=True)
                self._thread.start()
            try:
                self._queue.put_nowait((step, values))
                self._pending += 1
            except queue.Full:
                if self.stats is not None:
                    self.stats.add("dropped.step_metrics")

    def _run(self) -> None:
        while True:
            item = self._queue.get()
            if item is None:  # stop(): the run is over
                return
            step, values = item
            for sink in self.sinks:
                try:
                    sink.log_metrics(step, values)
                except BaseException as exc:  # noqa: BLE001 - an exporter bug (even SystemExit) never stops this thread
                    if self.stats is not None:
                        self.stats.add(f"errors.log_metrics.{type(sink).__name__}")
                    logger.debug("otel_rollouts: log_metrics failed: %s", type(exc).__name__)
            with self._lock:
                self._pending -= 1
                self._idle.notify_all()

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
        self.tokens = meter.create_counter(c.METRIC_TOKENS, "{token}",
                                           "Tokens in (prompt) and out (generated)")
        self.tool_errors = meter.create_counter(c.METRIC_TOOL_ERRORS, "{call}",
                                                "Tool calls that failed")

    def _step(self, key: tuple[int, str]) -> _Step:
        """The summary of (step, split), made on first use; the oldest is forgotten past
        ``_MAX_PENDING_STEPS`` (under ``self._lock``)."""
        step = self._steps.get(key)
        if step is None:
            if len(self._steps) >= _MAX_PENDING_STEPS:
                self._steps.pop(next(iter(self._steps)))
            step = self._steps[key] = _Step()
        return step

    # --- called by the pipeline (under its lock) --------------------------------------------------
    def dropped_rows(self, batch: Any, indices: Sequence[int], reason: str) -> None:
        """Rows of a batch (``sampling.batch.RowBatch``) dropped before their episodes were
        recorded: counted and their rewards summarised at once (they have no duration, no
        spans). Rewards still reach the histogram one by one: it has no bulk call."""
        n = len(indices)
        if not n:
            return
        import numpy as np

        scores = batch.scores(c.RL_REWARD)[np.asarray(indices, dtype=np.int64)]
        rewards = scores[~np.isnan(scores)]
        split = self.label(batch.split) if self.label is not None else batch.split
        with self._lock:
            step = self._step((batch.step, split))
            step.seen += n
            step.dropped += n
            if rewards.size:
                step.rewards += int(rewards.size)
                step.reward_sum += float(rewards.sum())
                step.reward_min = min(step.reward_min, float(rewards.min()))
                step.reward_max = max(step.reward_max, float(rewards.max()))
        if not self._instruments:
            return
        by_split = {c.RL_SPLIT: split}
        self.seen.add(n, by_split)
        self.dropped.add(n, {**by_split, c.RL_DROP_REASON: reason})
        for value in rewards.tolist():
            self.reward.record(value, by_split)

    def decided(self, record: EpisodeRecord, reason: str | None) -> None:
        """``reason`` None: kept; else why it was dropped. Called before its spans are freed."""
        root = record.root
        reward = record.attribute(c.RL_REWARD)
        reward = float(reward) if isinstance(reward, (int, float)) and not isinstance(reward, bool) else None
        duration = None
        if root is not None and root.end_ns is not None:
            duration = max(root.end_ns - root.start_ns, 0) / 1e9
        tokens_in = tokens_out = errors = 0
        in_known = out_known = False
        for span in record.spans:
            attrs = span.attributes
            count = _count(attrs.get(c.GEN_AI_USAGE_INPUT_TOKENS))
            if count is not None:
                tokens_in += count
                in_known = True
            count = _count(attrs.get(c.GEN_AI_USAGE_OUTPUT_TOKENS))
            if count is not None:
                tokens_out += count
                out_known = True
            if span.kind == c.KIND_TOOL and span.status_code is StatusCode.ERROR:
                errors += 1
        split = self.label(record.split) if self.label is not None else record.split
        key = (record.step, split)
        with self._lock:
            step = self._step(key)
            step.seen += 1
            if reason is None:
                step.kept += 1
            else:
                step.dropped += 1
            if reward is not None:
                step.add_reward(reward)
            if duration is not None:
                step.add_duration(duration)
            step.tokens_in += tokens_in
            step.tokens_out += tokens_out
            step.tokens_in_known = step.tokens_in_known or in_known
            step.tokens_out_known = step.tokens_out_known or out_known
            step.tool_errors += errors
        if not self._instruments:
            return
        by_split = {c.RL_SPLIT: split}
        # exemplars point at a trace only when it will exist (kept)
        ctx = None
        if reason is None and root is not None:
            ctx = trace.set_span_in_context(NonRecordingSpan(root.get_span_context()))
        self.seen.add(1, by_split, context=ctx)
        if reason is None:
            self.kept.add(1, by_split, context=ctx)
        else:
            self.dropped.add(1, {**by_split, c.RL_DROP_REASON: reason})
        if reward is not None:
            self.reward.record(reward, by_split, context=ctx)
        if duration is not None:
            self.duration.record(duration, by_split, context=ctx)
        if tokens_in:
            self.tokens.add(tokens_in, {**by_split, c.GEN_AI_TOKEN_TYPE: "input"}, context=ctx)
        if tokens_out:
            self.tokens.add(tokens_out, {**by_split, c.GEN_AI_TOKEN_TYPE: "output"}, context=ctx)
        if errors:
            self.tool_errors.add(errors, by_split, context=ctx)

    def step_closed(self, key: tuple[int, str]) -> None:
        with self._lock:
            step = self._steps.pop(key, None)
        if step is not None and self._sender is not None:
            self._sender.send(key[0], step.summary(step_summary_names(key[1])))

    # --- configuration's controls ---------------------------------------------------------------
    def flush(self, timeout: float = 10.0) -> bool:
        ok = True
        if self._sender is not None:
            ok = self._sender.flush(timeout)
        if self.provider is not None:
            ok = bool(self.provider.force_flush(int(timeout * 1000))) and ok
        return ok

    def shutdown(self, timeout: float = 10.0) -> None:
        deadline = time.monotonic() + timeout
        self.flush(timeout)
        if self._sender is not None:
            self._sender.stop(max(deadline - time.monotonic(), 0.0))
        if self.provider is not None:
            self.provider.shutdown()


def _count(value: Any) -> int | None:
    """A recorded token count, or None where none was recorded (absent is not 0)."""
    return value if isinstance(value, int) and not isinstance(value, bool) and value >= 0 else None
