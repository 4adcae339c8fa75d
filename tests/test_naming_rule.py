"""OpenTelemetry's naming rule: a name is an attribute or a namespace, never both
(semantic-conventions ``docs/general/naming.md``: "Names SHOULD NOT coincide with namespaces").

Checked over every name ``conventions`` declares, and over every name an episode with every
feature on emits: span, event and resource attributes, metric names and their attributes, of a
kept episode with reward components, an advantage, a policy version, stage times, train-inference
mismatch, companions and the run's description (``otr.describe_run``), and of a hang snapshot. Attributes share one registry (spans, events,
logs and metrics' attributes); metric names are another.
"""

from __future__ import annotations

import re
import threading
import time
from collections.abc import Iterable
from typing import Any

import numpy as np
from opentelemetry.sdk.metrics.export import InMemoryMetricReader
from opentelemetry.sdk.trace.export.in_memory_span_exporter import InMemorySpanExporter

import otel_rollouts as otr
from otel_rollouts import conventions as c

DOTTED = re.compile(r"^[a-z][a-z0-9_]*(\.[a-z0-9_]+)+$")
# conventions' constants that name no attribute: metric and event names (their own registries),
# span names and kinds, enumerated values, environment variables, message fields
NOT_ATTRIBUTES = ("METRIC_", "EVENT_", "ENV_", "SPAN_", "KIND_", "OP_", "STATUS_", "REASON_", "STAGE_",
                  "FINISH_", "PART_", "DEGENERATE_", "EVALUATION_", "LINK_", "COMPANIONS_", "MIME_",
                  "LOG_", "SCOPE_", "OI_EVALUATION", "OI_MESSAGE", "OI_TOOL_CALL_", "OI_ANNOTATOR_",
                  "LEGACY_")


def clashes(names: Iterable[str]) -> list[tuple[str, str]]:
    """Pairs (name, longer name) where the first is also the namespace of the second."""
    ordered = sorted(set(names))
    found = []
    for i, name in enumerate(ordered):
        prefix = name + "."
        for other in ordered[i + 1:]:
            if other.startswith(prefix):
                found.append((name, other))
            elif other > prefix and not other.startswith(name):
                break
    return found


def declared() -> tuple[set[str], set[str]]:
    """(attribute names, metric names) ``conventions`` declares, its dynamic families included
    (a reward component, each stage's seconds, the serving engine's timings)."""
    attributes: set[str] = set()
    metrics: set[str] = set()
    for name, value in vars(c).items():
        if not (name.isupper() and isinstance(value, str) and DOTTED.match(value)):
            continue
        if name.startswith("METRIC_"):
            metrics.add(value)
        elif not name.startswith(NOT_ATTRIBUTES):
            attributes.add(value)
    # OpenInference's flattened message lists: namespaces (llm.input_messages.<i>.message.role)
    attributes -= {c.OI_LLM_INPUT_MESSAGES, c.OI_LLM_OUTPUT_MESSAGES}
    attributes |= {c.stage_seconds(stage) for stage in c.STAGES}
    attributes |= {c.RL_REWARD_COMPONENT_PREFIX + "correct", c.RL_METADATA_PREFIX + "note"}
    attributes |= set(c.SERVER_TIMINGS.values()) | set(c.MISMATCH_STATS.values())
    return attributes, metrics


def test_the_rule_finds_a_clash() -> None:
    # the check itself: 0.1.0's reward was both (rl.reward and rl.reward.<component>)
    assert clashes(["rl.reward", "rl.reward.correct", "rl.rewards"]) == [("rl.reward", "rl.reward.correct")]
    assert clashes(["rl.stage.name", "rl.stage.generation.seconds"]) == []


def test_no_declared_name_is_both_an_attribute_and_a_namespace() -> None:
    attributes, metrics = declared()
    assert c.RL_REWARD in attributes and c.RL_KEEP_REASON in attributes and len(attributes) > 100
    assert clashes(attributes) == []
    assert clashes(metrics) == []
    # no 0.1.0 name is declared again with another meaning
    assert not set(c.LEGACY_NAMES) & attributes


class ShowingExporter(InMemorySpanExporter):
    """The in-memory exporter with the ``show_pending`` of an exporter that shows running
    episodes (as Trackio's does): what a hang snapshot carries."""

    def __init__(self) -> None:
        super().__init__()
        self.lock = threading.Lock()
        self.snapshots: list[Any] = []

    def show_pending(self, spans: Any, ended: Any) -> None:
        with self.lock:
            self.snapshots.extend(spans)


def _names(spans: Iterable[Any]) -> tuple[set[str], set[str]]:
    attributes: set[str] = set()
    resource: set[str] = set()
    for span in spans:
        attributes |= set(span.attributes or {})
        for event in span.events:
            attributes |= set(event.attributes or {})
        for link in span.links:
            attributes |= set(link.attributes or {})
        resource |= set(span.resource.attributes)
    return attributes, resource


def test_no_emitted_name_is_both_with_every_feature_on(otr_shutdown) -> None:
    exporter = ShowingExporter()
    reader = InMemoryMetricReader()
    otr.configure(exporters=[exporter], sampler=otr.TailSampler(10, "first"), metric_readers=[reader],
                  hang=otr.HangOptions(after_s=0.2, refresh_s=3600), handle_signals=False, run_id="naming")
    otr.describe_run(system="verl", system_version="0.9.1", algorithm="grpo", model_name="policy",
                     environment_name="gsm8k")
    engine = np.log(np.linspace(0.2, 0.9, 8, dtype=np.float32))
    for i in range(2):  # a pair of companions, each with every per-episode feature
        with otr.episode(step=0, group_id="g", sample_index=i, policy_version=3) as ep:
            ep.set_attribute(c.RL_COMPANIONS_ID, "pair-0")
            ep.set_attribute(c.RL_COMPANIONS_KIND, c.COMPANIONS_PREFERENCE)
            ep.prompt([{"role": "user", "content": "2 + 2?"}])
            with ep.turn() as turn:
                turn.record_generation("4", model="policy", input_tokens=5, output_tokens=8, logprobs=engine,
                                       trainer_logprobs=engine + np.float32(0.1 * (i + 1)))
                with turn.tool_call("calc", {"expression": "2 + 2"}) as call:
                    call.result(4)
            ep.reward(float(i), components={"correct": float(i), "format": 1.0}, advantage=i - 0.5)
    release, started = threading.Event(), threading.Event()

    def hanging() -> None:
        with otr.episode(step=0, group_id="h", sample_index=0) as ep, ep.turn() as turn, \
                turn.tool_call("slow") as call:
            started.set()
            release.wait(30)
            call.result("done")
            ep.reward(0.0)

    worker = threading.Thread(target=hanging, daemon=True)
    worker.start()
    assert started.wait(10)
    deadline = time.monotonic() + 30
    while True:  # the hang watcher's ticker shows the snapshot
        with exporter.lock:
            snapshots = list(exporter.snapshots)
        if any((s.attributes or {}).get(c.RL_PENDING_SNAPSHOT) for s in snapshots):
            break
        assert time.monotonic() < deadline, "no hang snapshot"
        time.sleep(0.02)
    release.set()
    worker.join(10)
    otr.end_step(0)
    assert otr.flush()
    spans = exporter.get_finished_spans()
    attributes, resource = _names([*spans, *snapshots])
    # every feature left its names (else the check below would prove nothing)
    assert {c.RL_REWARD, c.RL_REWARD_COMPONENT_PREFIX + "correct", c.RL_ADVANTAGE, c.RL_POLICY_VERSION,
            c.RL_KEEP_REASON, c.RL_TRACE_KEPT, c.stage_seconds(c.STAGE_GENERATION), c.RL_MISMATCH_KL,
            c.RL_MISMATCH_WORST_POSITION, c.RL_COMPANIONS_ID, c.RL_PENDING_SNAPSHOT,
            c.RL_PENDING_SPAN_NAME} <= attributes
    metric_names: set[str] = set()
    for resource_metrics in reader.get_metrics_data().resource_metrics:
        resource |= set(resource_metrics.resource.attributes)
        for scope in resource_metrics.scope_metrics:
            for metric in scope.metrics:
                metric_names.add(metric.name)
                for point in metric.data.data_points:
                    attributes |= set(point.attributes or {})
    assert {c.METRIC_REWARD, c.METRIC_STAGE_DURATION} <= metric_names and c.RL_STAGE_NAME in attributes
    assert {c.RL_SYSTEM_NAME, c.RL_SYSTEM_VERSION, c.RL_ALGORITHM, c.RL_MODEL_NAME, c.RL_ENVIRONMENT_NAME,
            c.RL_RUN_ID} <= resource
    assert clashes(attributes | resource | declared()[0]) == []
    assert clashes(metric_names | declared()[1]) == []
