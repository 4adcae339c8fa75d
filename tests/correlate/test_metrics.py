"""Rollout metrics: OpenTelemetry instruments read back with an InMemoryMetricReader, and
per-step scalars read back from a real Trackio project."""

from __future__ import annotations

import uuid
from collections.abc import Iterator

import pytest
from opentelemetry.sdk.metrics.export import InMemoryMetricReader
from opentelemetry.sdk.trace.export.in_memory_span_exporter import InMemorySpanExporter
from otr_helpers import configure_memory

import otel_rollouts as otr
from otel_rollouts import conventions as c
from otel_rollouts._core import runtime as _runtime

REWARDS = (1.0, 0.0, 0.5)  # with TailSampler(1, "first"): the first is kept, two are dropped


def _episode(step: int, reward: float, tool_fails: bool = False) -> otr.Episode:
    with otr.episode(step=step) as ep:
        with ep.turn() as turn:
            turn.record_generation("ok", model="policy", input_tokens=10, output_tokens=5)
            with turn.tool_call("calc") as call:
                if tool_fails:
                    call.error("division by zero")
                else:
                    call.result(1)
        ep.reward(reward)
    return ep


@pytest.fixture
def reader() -> Iterator[InMemoryMetricReader]:
    reader = InMemoryMetricReader()
    configure_memory(1, "first", metric_readers=[reader], handle_signals=False)
    yield reader
    otr.shutdown()


def _metrics(reader: InMemoryMetricReader) -> tuple[dict, object]:
    data = reader.get_metrics_data()
    (resource_metrics,) = data.resource_metrics
    out = {}
    for scope in resource_metrics.scope_metrics:
        for metric in scope.metrics:
            out[metric.name] = list(metric.data.data_points)
    return out, resource_metrics.resource


def test_episodes_seen_kept_dropped_reward_duration_tokens_tool_errors(reader):
    episodes = [_episode(0, r, tool_fails=(i == 2)) for i, r in enumerate(REWARDS)]
    otr.end_step(0)
    metrics, resource = _metrics(reader)

    def total(name: str, **attrs) -> float:
        return sum(p.value for p in metrics[name]
                   if all(p.attributes.get(k) == v for k, v in attrs.items()))

    step0 = {c.RL_SPLIT: "train"}
    assert total(c.METRIC_EPISODES_SEEN, **step0) == 3
    assert total(c.METRIC_EPISODES_KEPT, **step0) == 1
    dropped = metrics[c.METRIC_EPISODES_DROPPED]
    reasons = {p.attributes[c.RL_DROP_REASON]: p.value for p in dropped}
    stats = otr.stats()["steps"]["0/train"]
    assert reasons == {k.split(".", 1)[1]: v for k, v in stats.items() if k.startswith("dropped.")}
    assert sum(reasons.values()) == 2

    (reward,) = metrics[c.METRIC_REWARD]
    assert (reward.count, reward.sum, reward.min, reward.max) == (3, 1.5, 0.0, 1.0)
    (duration,) = metrics[c.METRIC_EPISODE_DURATION]
    assert duration.count == 3 and duration.sum > 0
    assert total(c.METRIC_INPUT_TOKENS) == 30
    assert total(c.METRIC_OUTPUT_TOKENS) == 15
    assert total(c.METRIC_TOOL_ERRORS) == 1

    # the same resource as the traces
    assert resource.attributes == _runtime.installed().provider.resource.attributes
    # exemplars link to the kept episode's trace only (dropped traces will never exist)
    kept_trace = int(episodes[0].trace_id, 16)
    exemplar_traces = {e.trace_id for e in reward.exemplars}
    assert exemplar_traces == {kept_trace}


def test_splits_are_separate_series_and_steps_are_not(reader):
    _episode(0, 1.0)
    with otr.episode(step=0, split="eval") as ep:
        ep.reward(0.25)
    _episode(1, 0.5)
    otr.flush()
    metrics, _ = _metrics(reader)
    seen = {tuple(sorted(p.attributes.items())): p.value for p in metrics[c.METRIC_EPISODES_SEEN]}
    # one series per split: a series per step would grow memory for as long as the run lasts
    # (and per status: a handful of values, never a step)
    assert seen == {((c.RL_SPLIT, "train"), (c.RL_STATUS, "ok")): 2, ((c.RL_SPLIT, "eval"), (c.RL_STATUS, "ok")): 1}


def test_no_reader_and_no_trackio_means_no_metrics_at_all():
    otr.configure(exporters=[InMemorySpanExporter()], handle_signals=False)
    try:
        assert _runtime.installed().pipeline.observer is None
    finally:
        otr.shutdown()


def test_per_step_numbers_land_in_trackio_at_the_same_step_as_the_traces():
    from trackio.sqlite_storage import SQLiteStorage

    from otel_rollouts.exporters import TrackioExporter

    project = f"metrics-{uuid.uuid4().hex[:8]}"
    exporter = TrackioExporter(project)
    otr.configure(exporters=[exporter], sampler=otr.TailSampler(1, "first"), handle_signals=False)
    try:
        for r in REWARDS:
            _episode(0, r, tool_fails=(r == 0.5))
        otr.end_step(0)
        _episode(1, 0.75)
        otr.end_step(1)
        assert otr.flush(60)
    finally:
        otr.shutdown()
    logs = SQLiteStorage.get_logs(project, exporter.run)
    by_step: dict[int, dict] = {}
    for row in logs:
        by_step.setdefault(row["step"], {}).update(
            {k: v for k, v in row.items() if k.startswith("rollouts/")})
    assert by_step[0]["rollouts/episodes_seen"] == 3
    assert by_step[0]["rollouts/episodes_kept"] == 1
    assert by_step[0]["rollouts/episodes_dropped"] == 2
    assert by_step[0]["rollouts/reward_mean"] == pytest.approx(0.5)
    assert by_step[0]["rollouts/reward_max"] == 1.0
    assert by_step[0]["rollouts/tokens_output"] == 15
    assert by_step[0]["rollouts/tool_errors"] == 1
    assert by_step[1]["rollouts/episodes_seen"] == 1
    assert by_step[1]["rollouts/reward_mean"] == 0.75
    # the kept traces sit at the same steps
    steps_with_traces = {t["step"] for t in SQLiteStorage.get_traces(project, run=exporter.run)}
    assert steps_with_traces == {0, 1}


def test_otlp_from_env_delivers_metrics_with_the_run_resource(monkeypatch):
    """OTEL_METRICS_EXPORTER=otlp: the stock OTLP/HTTP metric exporter posts to a real HTTP
    server on loopback, which decodes the protobuf request."""
    import http.server
    import threading

    from opentelemetry.proto.collector.metrics.v1.metrics_service_pb2 import (
        ExportMetricsServiceRequest,
    )

    received: list[ExportMetricsServiceRequest] = []

    class Receiver(http.server.BaseHTTPRequestHandler):
        def do_POST(self) -> None:  # noqa: N802
            request = ExportMetricsServiceRequest()
            request.ParseFromString(self.rfile.read(int(self.headers["content-length"])))
            received.append(request)
            self.send_response(200)
            self.send_header("content-length", "0")
            self.end_headers()

        def log_message(self, *args) -> None:
            return None

    httpd = http.server.ThreadingHTTPServer(("127.0.0.1", 0), Receiver)
    threading.Thread(target=httpd.serve_forever, daemon=True).start()
    monkeypatch.setenv("OTEL_METRICS_EXPORTER", "otlp")
    monkeypatch.setenv("OTEL_EXPORTER_OTLP_METRICS_PROTOCOL", "http/protobuf")
    monkeypatch.setenv("OTEL_EXPORTER_OTLP_METRICS_ENDPOINT",
                       f"http://127.0.0.1:{httpd.server_address[1]}/v1/metrics")
    try:
        configure_memory(1, "first", run_id="otlp-run", handle_signals=False)
        try:
            for r in REWARDS:
                _episode(0, r)
            otr.end_step(0)
            assert otr.flush(30)
        finally:
            otr.shutdown()
    finally:
        httpd.shutdown()
        httpd.server_close()
    assert received
    names, resource = set(), {}
    for request in received:
        for rm in request.resource_metrics:
            resource = {kv.key: kv.value for kv in rm.resource.attributes}
            for sm in rm.scope_metrics:
                names.update(m.name for m in sm.metrics)
    assert {c.METRIC_EPISODES_SEEN, c.METRIC_REWARD, c.METRIC_INPUT_TOKENS} <= names
    assert resource[c.RL_RUN_ID].string_value == "otlp-run"
