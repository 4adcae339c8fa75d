"""otel_rollouts → stock OTLP exporters → a real Arize Phoenix on loopback, read back over REST.

Phoenix stands in for Jaeger (which cannot run here): it takes OTLP over gRPC and HTTP/protobuf
and renders ``openinference.span.kind`` as its ``span_kind`` column. Everything is counted at
the receiver; ``force_flush()``/``shutdown()`` returning True proves nothing (a 503 from a busy
Phoenix is only logged by the exporter).
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
import time
import urllib.request
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
from otel_rollouts import conventions as c
from otel_rollouts.delivery.defaults import otlp_exporter_from_env
from otel_rollouts.delivery.phoenix import PhoenixAnnotations
from otel_rollouts.exporters import OtlpJsonFileExporter

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
        assert attrs["rl.reward.score"] == pytest.approx(r.reward)
        assert attrs["rl.step"] == r.step and attrs["rl.sample.index"] == r.sample_index
        assert attrs["rl.status"] == "ok"
        reward = next(s for s in spans if s["name"] == "reward")
        assert reward["span_kind"] == "EVALUATOR"
        assert reward["attributes"]["rl.reward.component.math"] == pytest.approx(r.reward)
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


# --- what a researcher sorts and filters by: sessions, annotations -------------------------------
# (step, group, sample index): group ids repeat every step, as a GRPO trainer's prompt ids do
GROUPS = [(step, group, i) for step in (38, 39, 40) for group in ("p0", "p1") for i in range(3)]
TRUNCATED = (40, "p1", 2)
# the annotations of each root: its evaluations (reward, correct, advantage, status) and the
# columns step, stage (slowest) and kept (why)
PER_ROOT = 7


def _reward(step: int, group: str, i: int) -> float:
    """Distinct rewards within a step; step 40's worst is the truncated one, (40, "p1", 2)."""
    return round(0.9 - 0.1 * i - 0.3 * (group == "p1") + 0.01 * (step - 38), 2)


def _record_groups(exporter, project: str, run_id: str) -> tuple[dict[tuple[int, str, int], str], dict]:
    """GROUPS through otel_rollouts: (trace id by (step, group, sample index), otr.stats())."""
    otr.configure(service_name="otr-phoenix-groups", exporters=[exporter], sampler=otr.TailSampler(10, "first"),
                  run_id=run_id, resource_attributes={"openinference.project.name": project})
    traces = {}
    try:
        for key in GROUPS:
            step, group, i = key
            reward = _reward(*key)
            with otr.episode(step=step, group_id=group, sample_index=i) as ep:
                ep.prompt([{"role": "user", "content": f"step {step} group {group} sample {i}"}])
                with ep.turn() as turn:
                    turn.record_generation(f"answer {step}-{group}-{i}", model=MODEL)
                ep.reward(reward, components={"correct": float(reward >= 0.5)}, advantage=reward - 0.5)
                ep.finish(reason="length" if key == TRUNCATED else "stop",
                          status="truncated" if key == TRUNCATED else None)
            traces[key] = ep.trace_id
            if key[1:] == ("p1", 2):  # the step's last episode
                otr.end_step(step)
        assert otr.flush(60)
    finally:
        stats = otr.stats()
        otr.shutdown(60)
    return traces, stats


def _graphql(phoenix: PhoenixReceiver, query: str, **variables) -> dict:
    request = urllib.request.Request(f"{phoenix.base_url}/graphql", method="POST",
                                     data=json.dumps({"query": query, "variables": variables}).encode(),
                                     headers={"Content-Type": "application/json"})
    with urllib.request.urlopen(request, timeout=30) as response:
        body = json.load(response)
    assert not body.get("errors"), body["errors"]
    return body["data"]


_ROOTS = """query($id: ID!, $filter: String, $sort: SpanSort) { node(id: $id) { ... on Project {
  spans(first: 100, filterCondition: $filter, sort: $sort) { edges { node {
    context { traceId } metadata spanAnnotations { name score label annotatorKind } } } } } } }"""


def _roots(phoenix: PhoenixReceiver, project: str, filter: str, sort: dict | None = None) -> list[dict]:
    """Episode roots as Phoenix's span list gives them: (trace id, metadata, annotations)."""
    data = _graphql(phoenix, _ROOTS, id=phoenix.project_id(project), filter=filter, sort=sort)
    return [{"trace_id": e["node"]["context"]["traceId"], "metadata": json.loads(e["node"]["metadata"]),
             "annotations": {a["name"]: a for a in e["node"]["spanAnnotations"]}}
            for e in data["node"]["spans"]["edges"]]


def wait_for_annotations(phoenix: PhoenixReceiver, project: str, count: int, per_root: int,
                         timeout: float = 90.0) -> list[dict]:
    """Poll until ``count`` roots each have ``per_root`` annotations (Phoenix inserts an
    annotation that came before its span on its next retry, 10 s later)."""
    deadline = time.monotonic() + timeout
    while True:
        # (Phoenix makes the project as it inserts its first span: not there yet, nothing yet)
        known = project in phoenix.projects()
        roots = _roots(phoenix, project, "parent_id is None") if known else []
        if len(roots) >= count and all(len(r["annotations"]) >= per_root for r in roots):
            return roots
        assert time.monotonic() < deadline, (
            f"{sum(len(r['annotations']) for r in roots)} annotations on {len(roots)} roots after {timeout:.0f} s")
        time.sleep(0.5)


def test_phoenix_sessions_hold_one_group_of_one_step(phoenix: PhoenixReceiver) -> None:
    """session.id is the run, split, step and group: with group ids that repeat every step, each
    Phoenix session still holds exactly one group (before: one session per group id, 3 steps)."""
    project = f"otr-sessions-{uuid.uuid4().hex[:8]}"
    traces, _ = _record_groups(HttpSpanExporter(endpoint=phoenix.http_endpoint, timeout=10), project, "run-s")
    phoenix.wait_for_spans(project, 5 * len(GROUPS), trace_ids=traces.values())
    data = _graphql(phoenix, """query($id: ID!) { node(id: $id) { ... on Project {
        sessions(first: 100) { edges { node { sessionId numTraces
          traces(first: 100) { edges { node { traceId rootSpan { metadata } } } } } } } } } }""",
                    id=phoenix.project_id(project))
    sessions = {e["node"]["sessionId"]: e["node"] for e in data["node"]["sessions"]["edges"]}
    assert set(sessions) == {f"run-s/train/{step}/{group}" for step, group, _ in GROUPS}
    for session_id, session in sessions.items():
        _, _, step, group = session_id.split("/")
        members = [json.loads(t["node"]["rootSpan"]["metadata"]) for t in session["traces"]["edges"]]
        assert session["numTraces"] == 3
        assert {(m["step"], m["group.id"]) for m in members} == {(int(step), group)}
        assert {t["node"]["traceId"] for t in session["traces"]["edges"]} == {
            traces[(int(step), group, i)] for i in range(3)}


def test_phoenix_sorts_and_filters_episodes_by_their_annotations(phoenix: PhoenixReceiver, monkeypatch) -> None:
    """The default OTLP exporter (configured by the environment) posts each episode's reward,
    components, advantage and status as annotations: Phoenix's span list sorts by the reward
    (worst first) and filters by reward, component and status."""
    project = f"otr-annotations-{uuid.uuid4().hex[:8]}"
    monkeypatch.setenv("OTEL_EXPORTER_OTLP_TRACES_ENDPOINT", phoenix.http_endpoint)
    monkeypatch.setenv("OTEL_EXPORTER_OTLP_TRACES_PROTOCOL", "http/protobuf")
    exporter = otlp_exporter_from_env()
    layer = exporter.export.layer  # the Phoenix layer the environment wired
    traces, stats = _record_groups(exporter, project, "run-a")
    totals = stats["totals"]
    assert totals["annotations.posted.OTLPSpanExporter"] == PER_ROOT * len(GROUPS)
    assert not [k for k in totals if k.startswith(("annotations.failures", "annotations.lost"))]
    assert layer.version and layer.last_post_s is not None
    print(f"Phoenix {layer.version}: last annotation post took {1000 * layer.last_post_s:.1f} ms")

    roots = wait_for_annotations(phoenix, project, len(GROUPS), PER_ROOT)
    by_trace = {r["trace_id"]: r for r in roots}
    for key, trace_id in traces.items():
        annotations = by_trace[trace_id]["annotations"]
        assert annotations["reward"]["score"] == pytest.approx(_reward(*key))
        assert annotations["advantage"]["score"] == pytest.approx(_reward(*key) - 0.5)
        assert annotations["correct"]["score"] == float(_reward(*key) >= 0.5)
        assert annotations["status"]["label"] == ("truncated" if key == TRUNCATED else "ok")
        assert annotations["status"]["score"] is None
        assert annotations["step"]["score"] == key[0] and annotations["kept"]["label"] == "first"
        assert annotations["stage"]["label"] in c.STAGES and annotations["stage"]["score"] is None
        assert {a["annotatorKind"] for a in annotations.values()} == {"CODE"}
        assert by_trace[trace_id]["metadata"]["reward.component.correct"] == float(_reward(*key) >= 0.5)

    # step 40, sorted by the reward annotation, worst first
    step40 = _roots(phoenix, project, "metadata['step'] == 40 and parent_id is None",
                    sort={"evalResultKey": {"name": "reward", "attr": "score"}, "dir": "asc"})
    expected = sorted((k for k in GROUPS if k[0] == 40), key=lambda k: _reward(*k))
    assert [r["trace_id"] for r in step40] == [traces[k] for k in expected]
    assert expected[0] == TRUNCATED
    # filters a person types in the span list: a step by its column, the status
    assert {r["trace_id"] for r in _roots(phoenix, project, "evals['step'].score == 40")} == {
        traces[k] for k in GROUPS if k[0] == 40}
    assert {r["trace_id"] for r in _roots(phoenix, project, "evals['status'].label == 'truncated'")} == {
        traces[TRUNCATED]}
    low = _roots(phoenix, project, "evals['reward'].score < 0.55 and parent_id is None")
    assert {r["trace_id"] for r in low} == {traces[k] for k in GROUPS if _reward(*k) < 0.55} and len(low) == 6
    wrong = _roots(phoenix, project, "metadata['reward.component.correct'] == 0 and parent_id is None")
    assert {r["trace_id"] for r in wrong} == {traces[k] for k in GROUPS if _reward(*k) < 0.5} and len(wrong) == 3


def test_phoenix_annotations_over_grpc_need_phoenixs_url(phoenix: PhoenixReceiver) -> None:
    """Phoenix's OTLP/gRPC port is not its REST port: with the URL given, annotations arrive."""
    project = f"otr-grpc-annotations-{uuid.uuid4().hex[:8]}"
    exporter = GrpcSpanExporter(endpoint=phoenix.grpc_endpoint, insecure=True, timeout=10)
    assert PhoenixAnnotations.attach(exporter) is None  # auto: nothing to derive a URL from
    layer = PhoenixAnnotations.attach(exporter, phoenix.base_url)
    assert layer is not None
    traces, stats = _record_groups(exporter, project, "run-g")
    assert stats["totals"]["annotations.posted.OTLPSpanExporter"] == PER_ROOT * len(GROUPS)
    roots = wait_for_annotations(phoenix, project, len(GROUPS), PER_ROOT)
    assert {r["trace_id"] for r in roots} == set(traces.values())
