"""otel_rollouts → stock OTLP exporters → a real Arize Phoenix on loopback, read back over REST.

Phoenix stands in for Jaeger (which cannot run here): it takes OTLP over gRPC and HTTP/protobuf
and renders ``openinference.span.kind`` as its ``span_kind`` column. Everything is counted at
the receiver; ``force_flush()``/``shutdown()`` returning True proves nothing (a 503 from a busy
Phoenix is only logged by the exporter).
"""

from __future__ import annotations

import os
import subprocess
import sys
import uuid
from collections import Counter
from datetime import datetime
from pathlib import Path

import pytest
from opentelemetry.exporter.otlp.proto.grpc.trace_exporter import (
    OTLPSpanExporter as GrpcSpanExporter,
)
from opentelemetry.exporter.otlp.proto.http.trace_exporter import (
    OTLPSpanExporter as HttpSpanExporter,
)
from opentelemetry.sdk.trace import ReadableSpan
from opentelemetry.sdk.trace.export.in_memory_span_exporter import InMemorySpanExporter
from otr_scenario import (
    MODEL,
    SPAN_KINDS,
    SPANS_PER_EPISODE,
    TOOL_ERROR,
    TOOL_FAILS,
    TOOL_OK,
    kept_by_top_bottom,
    record_step,
)
from receivers import PhoenixReceiver

import otel_rollouts as otr
from otel_rollouts.exporters import OtlpJsonFileExporter

pytestmark = pytest.mark.receiver

STEPS = {0: [0.3, 0.8, 0.55, 0.1], 1: [0.6, 0.2, 0.9, 0.45]}  # 8 episodes, 4 kept, 36 spans


def _otlp(phoenix: PhoenixReceiver, protocol: str):
    if protocol == "http":
        return HttpSpanExporter(endpoint=phoenix.http_endpoint, timeout=10)
    return GrpcSpanExporter(endpoint=phoenix.grpc_endpoint, insecure=True, timeout=10)


def _run(exporters, project: str):
    """Record STEPS through otel_rollouts; (all recorded episodes, what the witness got)."""
    witness = InMemorySpanExporter()
    otr.configure(
        service_name="otr-phoenix-test",
        exporters=[*exporters, witness],
        sampler=otr.TailSampler(2, "top_bottom"),
        resource_attributes={"openinference.project.name": project},
    )
    try:
        recorded = [r for step, rewards in STEPS.items() for r in record_step(step, rewards)]
    finally:
        otr.shutdown(60)
    return recorded, list(witness.get_finished_spans())


def _iso_us(value: str) -> int:
    moment = datetime.fromisoformat(value)
    return int(moment.timestamp()) * 1_000_000 + moment.microsecond


def _assert_same_spans(received: list[dict], expected: list[ReadableSpan]) -> None:
    """Phoenix's spans are exactly the SDK spans: ids, parents, names, kinds, values, status."""
    by_id = {s["context"]["span_id"]: s for s in received}
    assert len(by_id) == len(received) == len(expected)
    for span in expected:
        got = by_id[f"{span.context.span_id:016x}"]
        assert got["context"]["trace_id"] == f"{span.context.trace_id:032x}"
        assert got["name"] == span.name
        parent = f"{span.parent.span_id:016x}" if span.parent is not None else None
        assert got["parent_id"] == parent
        assert got["span_kind"] == span.attributes["openinference.span.kind"]
        assert got["span_kind"] == SPAN_KINDS[span.name]
        # Phoenix keeps microseconds (rounded): within 1 µs of the nanosecond times
        assert abs(_iso_us(got["start_time"]) - span.start_time / 1000) <= 1
        assert abs(_iso_us(got["end_time"]) - span.end_time / 1000) <= 1
        assert got["status_code"] == span.status.status_code.name
        for key, value in span.attributes.items():
            if key.startswith("rl.") and isinstance(value, (int, float)):
                assert got["attributes"][key] == value, key
                assert type(got["attributes"][key]) is type(value), key  # numbers stay numbers


def _assert_episode_shapes(received: list[dict], kept) -> None:
    by_trace: dict[str, list[dict]] = {}
    for span in received:
        by_trace.setdefault(span["context"]["trace_id"], []).append(span)
    assert set(by_trace) == {r.trace_id for r in kept}
    for r in kept:
        spans = by_trace[r.trace_id]
        names = Counter(s["name"] for s in spans)
        assert names == Counter({"episode": 1, "prompt": 1, "turn": 2, f"chat {MODEL}": 2,
                                 f"execute_tool {TOOL_OK}": 1, f"execute_tool {TOOL_FAILS}": 1,
                                 "reward": 1})
        by_id = {s["context"]["span_id"]: s for s in spans}
        (root,) = [s for s in spans if s["parent_id"] is None]
        assert root["name"] == "episode" and root["span_kind"] == "AGENT"
        for s in spans:
            if s is root:
                continue
            parent = by_id[s["parent_id"]]  # every parent is in the same trace
            expected_parent = "turn" if s["name"].startswith(("chat", "execute_tool")) else "episode"
            assert parent["name"] == expected_parent, s["name"]
        assert sorted(s["attributes"]["rl.turn.index"] for s in spans if s["name"] == "turn") == [0, 1]
        attrs = root["attributes"]
        assert attrs["rl.reward"] == pytest.approx(r.reward)
        assert attrs["rl.step"] == r.step and attrs["rl.sample.index"] == r.sample_index
        assert attrs["rl.status"] == "ok"
        reward = next(s for s in spans if s["name"] == "reward")
        assert reward["span_kind"] == "EVALUATOR"
        assert reward["attributes"]["rl.reward.math"] == pytest.approx(r.reward)
        assert reward["attributes"]["rl.advantage"] == pytest.approx(r.reward - 0.5)
        chat = next(s for s in spans if s["name"] == f"chat {MODEL}")
        assert chat["span_kind"] == "LLM"
        assert chat["attributes"]["gen_ai.usage.input_tokens"] in (21, 30)
        failed = next(s for s in spans if s["name"] == f"execute_tool {TOOL_FAILS}")
        assert failed["span_kind"] == "TOOL"
        assert failed["status_code"] == "ERROR" and TOOL_ERROR in failed["status_message"]
        assert [e["name"] for e in failed["events"]] == ["exception"]
        ok = next(s for s in spans if s["name"] == f"execute_tool {TOOL_OK}")
        assert ok["status_code"] != "ERROR"


@pytest.mark.parametrize("protocol", ["grpc", "http"])
def test_kept_episodes_reach_phoenix_whole_and_dropped_ones_never(
    phoenix: PhoenixReceiver, protocol: str
) -> None:
    project = f"otr-{protocol}-{uuid.uuid4().hex[:8]}"
    recorded, witness = _run([_otlp(phoenix, protocol)], project)
    kept = [k for step in STEPS for k in kept_by_top_bottom([r for r in recorded if r.step == step])[0]]
    dropped = [r for r in recorded if r not in kept]
    assert len(kept) == 4 and len(dropped) == 4

    received = phoenix.wait_for_spans(project, 4 * SPANS_PER_EPISODE,
                                      trace_ids=[r.trace_id for r in kept])
    _assert_episode_shapes(received, kept)
    _assert_same_spans(received, witness)
    # Nothing of a dropped episode: neither by trace id nor anywhere in the project. The
    # exporter sent everything before shutdown returned, and the kept spans are all ingested.
    assert phoenix.spans(project, trace_id=[r.trace_id for r in dropped]) == []
    assert len(phoenix.spans(project)) == 4 * SPANS_PER_EPISODE


@pytest.mark.parametrize("protocol", ["http", "grpc"])
def test_file_replayed_to_phoenix_gives_the_same_spans(
    phoenix: PhoenixReceiver, protocol: str, tmp_path: Path
) -> None:
    """A run with no collector writes OTLP/JSON; ``otel-rollouts replay --to otlp`` later."""
    project = f"otr-replay-{protocol}-{uuid.uuid4().hex[:8]}"
    path = tmp_path / "offline.jsonl"
    recorded, witness = _run([OtlpJsonFileExporter(path)], project)
    assert phoenix.spans(project) == []  # nothing was sent while recording

    env = {k: v for k, v in os.environ.items() if not k.startswith("OTEL_")}
    if protocol == "http":
        env.update(OTEL_EXPORTER_OTLP_TRACES_ENDPOINT=phoenix.http_endpoint,
                   OTEL_EXPORTER_OTLP_TRACES_PROTOCOL="http/protobuf")
    else:
        env.update(OTEL_EXPORTER_OTLP_ENDPOINT=f"http://{phoenix.grpc_endpoint}",
                   OTEL_EXPORTER_OTLP_PROTOCOL="grpc", OTEL_EXPORTER_OTLP_INSECURE="true")
    done = subprocess.run(
        [sys.executable, "-m", "otel_rollouts.cli", "replay", str(path), "--to", "otlp"],
        capture_output=True, text=True, timeout=120, env=env,
    )
    assert done.returncode == 0, done.stderr
    assert "replayed 4 traces (36 spans)" in done.stderr

    kept = [k for step in STEPS for k in kept_by_top_bottom([r for r in recorded if r.step == step])[0]]
    received = phoenix.wait_for_spans(project, len(witness), trace_ids=[r.trace_id for r in kept])
    _assert_episode_shapes(received, kept)
    _assert_same_spans(received, witness)
    assert len(phoenix.spans(project)) == len(witness) == 4 * SPANS_PER_EPISODE
