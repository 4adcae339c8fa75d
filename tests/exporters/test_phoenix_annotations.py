"""The Phoenix annotation layer and the views it posts, without a Phoenix: what each episode root
carries (session, evaluations, metadata), what is posted, and every failure path against a real
loopback server (``otlp_sink.py`` in its Phoenix mode): Phoenix down, 4xx/5xx, slow, not a
Phoenix. Delivery (the ledger, the spans) never depends on the annotations.

The real Phoenix checks (annotations sortable and filterable, one group per session) are in
``test_phoenix_integration.py`` and ``test_phoenix_browser.py``.
"""

from __future__ import annotations

import json
import logging
import socket
import time
from pathlib import Path
from typing import Any

import pytest
from opentelemetry.exporter.otlp.proto.grpc.trace_exporter import (
    OTLPSpanExporter as GrpcSpanExporter,
)
from opentelemetry.exporter.otlp.proto.http.trace_exporter import OTLPSpanExporter
from opentelemetry.sdk.trace.export.in_memory_span_exporter import InMemorySpanExporter
from otlp_sink import OtlpSink
from otr_helpers import root

import otel_rollouts as otr
from otel_rollouts import conventions as c
from otel_rollouts._core.messages import read_evaluations
from otel_rollouts._core.settings import check_environment
from otel_rollouts.delivery import phoenix
from otel_rollouts.delivery.defaults import otlp_exporter_from_env
from otel_rollouts.delivery.phoenix import PhoenixAnnotations, annotations_of, columns_of

RUN = "run-7"
NAME = "OTLPSpanExporter"
# annotations of each episode recorded here: its evaluations (reward, correct, format, advantage,
# status) and the columns step, stage (slowest) and kept (why)
PER_EPISODE = 8
# (step, group, sample index, reward, status): groups p0/p1 repeat every step
EPISODES = [(step, group, i, round(0.1 * (i + 3 * (group == "p1")) + 0.05 * (step - 38), 2),
             "truncated" if (step, group, i) == (40, "p1", 2) else "ok")
            for step in (38, 39, 40) for group in ("p0", "p1") for i in range(3)]


def _record(exporter, episodes=EPISODES, *, flush_each_step: bool = False, run_id: str = RUN) -> None:
    otr.configure(service_name="phoenix-layer", exporters=[exporter], sampler=otr.TailSampler(100, "first"),
                  run_id=run_id)
    last = None
    for step, group, i, reward, status in episodes:
        if flush_each_step and last is not None and step != last:
            assert otr.flush(30)
        last = step
        with otr.episode(step=step, group_id=group, sample_index=i) as ep:
            ep.prompt([{"role": "user", "content": f"step {step} {group} q{i}"}])
            ep.reward(reward, components={"correct": float(reward > 0.3), "format": 1.0}, advantage=reward - 0.3)
            ep.finish(reason="length" if status == "truncated" else "stop", status=status)


def _totals() -> dict[str, int]:
    return otr.stats()["totals"]


@pytest.fixture
def sink(tmp_path: Path):
    with OtlpSink(tmp_path / "sink") as s:
        yield s


def _dead_url() -> str:
    with socket.socket() as s:  # a port nothing listens on (bound, then closed)
        s.bind(("127.0.0.1", 0))
        return f"http://127.0.0.1:{s.getsockname()[1]}"


# --- the views: what each episode root carries -----------------------------------------------
def test_root_has_a_session_per_run_step_and_group_evaluations_and_components_in_metadata(otr_shutdown):
    memory = InMemorySpanExporter()
    _record(memory, [(40, "p0", 0, 0.25, "truncated")])
    otr.shutdown()
    spans = memory.get_finished_spans()
    attrs = root(spans).attributes
    # one session per run, split, step and group (was the bare group id "p0")
    assert attrs[c.OI_SESSION_ID] == f"{RUN}/train/40/p0"
    # OpenInference evaluations on the span they describe (the episode)
    evaluations = read_evaluations(attrs)
    assert [(e["name"], e.get("score"), e.get("label")) for e in evaluations] == [
        ("reward", 0.25, None), ("correct", 0.0, None), ("format", 1.0, None),
        ("advantage", pytest.approx(-0.05), None), ("status", None, "truncated")]
    assert {e["annotator_kind"] for e in evaluations} == {c.OI_ANNOTATOR_CODE}
    assert attrs[c.oi_evaluation_key(0, c.OI_EVALUATION_NAME)] == "reward"
    assert attrs[c.oi_evaluation_key(0, c.OI_EVALUATION_SCORE)] == 0.25
    # the components are filterable metadata too
    metadata = json.loads(attrs[c.OI_METADATA])
    assert metadata["reward.component.correct"] == 0.0 and metadata["reward.component.format"] == 1.0
    assert metadata["status"] == "truncated" and metadata["step"] == 40
    # each evaluation event of the root (the span evaluated) says which score it is and its value
    events = [dict(e.attributes) for e in root(spans).events if e.name == c.EVENT_GEN_AI_EVALUATION_RESULT]
    assert [e[c.GEN_AI_EVALUATION_EXPLANATION] for e in events] == [
        "reward = 0.25", "correct = 0.0", "format = 1.0", f"advantage = {0.25 - 0.3}", "status = truncated"]
    assert all(set(e) == {c.GEN_AI_EVALUATION_NAME, c.GEN_AI_EVALUATION_SCORE_VALUE,
                          c.GEN_AI_EVALUATION_EXPLANATION} for e in events[:4])  # the spec's attributes only
    assert events[4][c.GEN_AI_EVALUATION_SCORE_LABEL] == "truncated"


def test_sessions_of_repeating_group_ids_are_told_apart_across_steps_and_runs(otr_shutdown):
    sessions = []
    for run_id in ("run-a", "run-b"):
        memory = InMemorySpanExporter()
        _record(memory, [e for e in EPISODES if e[2] == 0], run_id=run_id)
        otr.shutdown()
        sessions += [s.attributes[c.OI_SESSION_ID] for s in memory.get_finished_spans() if s.parent is None]
    # 2 runs x 3 steps x 2 groups: each its own session; before, all were "p0" or "p1"
    assert len(sessions) == len(set(sessions)) == 12
    assert "run-b/train/39/p1" in sessions


def test_a_component_named_like_another_evaluation_keeps_its_own_name(configured):
    memory = configured(10, "first")
    with otr.episode(step=0, group_id="g") as ep:
        ep.reward(1.0, components={"status": 0.5, "note": 0.25}, advantage=0.0)
        ep.finish(status="ok")
    otr.shutdown()
    names = [e["name"] for e in read_evaluations(root(memory.get_finished_spans()).attributes)]
    assert names == ["reward", "reward.component.status", "reward.component.note", "advantage", "status"]


def test_annotations_are_the_roots_evaluations_reward_first_then_the_columns(otr_shutdown):
    memory = InMemorySpanExporter()
    _record(memory, EPISODES[:2])
    otr.shutdown()
    spans = memory.get_finished_spans()
    annotations = annotations_of(spans)
    roots = {f"{s.context.span_id:016x}": s for s in spans if s.parent is None}
    assert {a["span_id"] for a in annotations} == set(roots)  # episode roots only
    for span_id, span in roots.items():
        posted = [a for a in annotations if a["span_id"] == span_id]
        assert {a["annotator_kind"] for a in posted} == {"CODE"}
        # the reward first (the first annotation column Phoenix lists), then the columns a
        # researcher sorts and filters by, then the other evaluations
        assert [a["name"] for a in posted] == [c.EVALUATION_REWARD, c.ANNOTATION_STEP, c.ANNOTATION_STAGE,
                                               c.ANNOTATION_KEPT, "correct", "format", "advantage", "status"]
        evaluations = {e["name"]: e for e in read_evaluations(span.attributes)}
        for a in posted:
            if a["name"] in evaluations:  # the span's own evaluations, as they are
                assert a["result"] == {k: evaluations[a["name"]][k] for k in ("score", "label")
                                       if k in evaluations[a["name"]]}
        by_name = {a["name"]: a["result"] for a in posted}
        assert by_name[c.ANNOTATION_STEP] == {"score": span.attributes[c.RL_STEP]}
        assert by_name[c.ANNOTATION_KEPT] == {"label": c.REASON_FIRST}
        stage = by_name[c.ANNOTATION_STAGE]
        seconds = {s: span.attributes[c.stage_seconds(s)] for s in c.STAGES if c.stage_seconds(s) in span.attributes}
        assert stage["label"] == max(seconds, key=seconds.__getitem__)  # the slowest stage, by name
        assert stage["explanation"].startswith(f"{stage['label']} ") and " s of " in stage["explanation"]
        # none of them is an evaluation: not on the span as one, nor an evaluation event
        assert not {c.ANNOTATION_STEP, c.ANNOTATION_STAGE, c.ANNOTATION_KEPT} & set(evaluations)
        assert {e.attributes[c.GEN_AI_EVALUATION_NAME] for e in span.events} == set(evaluations)
    assert len(annotations) == 2 * PER_EPISODE


def test_the_columns_name_the_slowest_stage_the_kl_and_yield_to_a_component_of_their_name():
    from otel_rollouts.delivery.phoenix import columns_of

    attrs = {c.RL_STEP: 40, c.stage_seconds(c.STAGE_GENERATION): 1.5, c.stage_seconds(c.STAGE_TOOL): 8.0,
             c.stage_seconds(c.STAGE_WAITING): 0.25, c.RL_DURATION_SECONDS: 9.75, c.RL_MISMATCH_KL: 0.125,
             c.RL_KEEP_REASON: c.REASON_SLOWEST}
    assert columns_of(attrs) == [
        (c.ANNOTATION_STEP, {"score": 40}),
        (c.ANNOTATION_STAGE, {"label": c.STAGE_TOOL, "explanation": "tool 8 s of 9.75 s"}),
        (c.ANNOTATION_KL, {"score": 0.125}),
        (c.ANNOTATION_KEPT, {"label": c.REASON_SLOWEST}),
    ]
    # unknown is absent, never 0: no step, no stage, a NaN KL
    assert columns_of({c.RL_MISMATCH_KL: float("nan"), c.RL_STEP: True}) == []
    # the seconds its generations waited in the engine's queue, when the engine said
    assert columns_of({}, 0.45) == [(c.ANNOTATION_QUEUE, {"score": 0.45})]
    # a group member: its group's degenerate reason as the label (none for a healthy one), the
    # health as Trackio's tables write it
    short = {c.RL_GROUP_SIZE: 3, c.RL_GROUP_EXPECTED_SIZE: 4, c.RL_GROUP_ALL_EQUAL: True, c.RL_GROUP_LOST: 1,
             c.RL_GROUP_TRUNCATED: 0, c.RL_GROUP_DEGENERATE: c.DEGENERATE_ALL_EQUAL_LOST}
    assert columns_of(short) == [(c.ANNOTATION_GROUP, {"label": c.DEGENERATE_ALL_EQUAL_LOST,
                                                       "explanation": "all equal \u00d73, lost 1/4"})]
    healthy = {c.RL_GROUP_SIZE: 4, c.RL_GROUP_ALL_EQUAL: False, c.RL_GROUP_LOST: 0, c.RL_GROUP_TRUNCATED: 1}
    assert columns_of(healthy) == [(c.ANNOTATION_GROUP, {"label": c.DEGENERATE_NONE,
                                                         "explanation": "ok 4, truncated 1/4"})]


def test_a_reward_component_named_like_a_column_keeps_its_name(configured):
    memory = configured(10, "first")
    with otr.episode(step=3, group_id="g") as ep:
        ep.reward(1.0, components={"step": 0.5})
    otr.shutdown()
    posted = [(a["name"], a["result"]) for a in annotations_of(memory.get_finished_spans())]
    assert ("step", {"score": 0.5}) in posted and ("step", {"score": 3}) not in posted  # the user's own
    assert len([name for name, _ in posted if name == "step"]) == 1  # Phoenix keeps one per name


# --- the layer against a loopback Phoenix ------------------------------------------------------
def test_posts_each_batchs_evaluations_to_a_phoenix(sink: OtlpSink, otr_shutdown):
    sink.control(phoenix_version="20.26.1")
    exporter = OTLPSpanExporter(endpoint=sink.endpoint, timeout=5)
    layer = PhoenixAnnotations.attach(exporter, "auto")
    assert layer is not None and layer.base == f"http://127.0.0.1:{sink.port}"
    _record(exporter, flush_each_step=True)
    assert otr.shutdown(30)
    assert layer.phoenix is True and layer.version == "20.26.1"
    posted = sink.annotations()
    roots = {r["span_id"]: r for r in sink.roots()}
    assert len(roots) == len(EPISODES) and {a["span_id"] for a in posted} == set(roots)
    for a in posted:
        attrs = roots[a["span_id"]]["attributes"]
        assert a in [{"span_id": a["span_id"], "name": e["name"], "annotator_kind": "CODE",
                      "result": {k: e[k] for k in ("score", "label") if k in e}} for e in read_evaluations(attrs)] + [
            {"span_id": a["span_id"], "name": name, "annotator_kind": "CODE", "result": result}
            for name, result in columns_of(attrs)]
    by_name = {(a["span_id"], a["name"]): a["result"] for a in posted}
    truncated = next(r for r in roots.values() if r["attributes"][c.RL_STATUS] == "truncated")
    assert by_name[(truncated["span_id"], "status")] == {"label": "truncated"}
    totals = _totals()
    assert totals[f"annotations.posted.{NAME}"] == len(posted) == PER_EPISODE * len(EPISODES)
    assert totals[f"delivered.{NAME}"] == len(EPISODES)
    state = sink.state()
    # at most one post per kept episode (the episodes queued together go in one post)
    assert 1 <= state["annotation_requests"] <= len(EPISODES)
    assert layer.last_post_s is not None and layer.last_post_s < phoenix.POST_TIMEOUT_S


def test_a_receiver_that_is_not_a_phoenix_gets_no_annotations(sink: OtlpSink, otr_shutdown, caplog):
    exporter = OTLPSpanExporter(endpoint=sink.endpoint, timeout=5)
    layer = PhoenixAnnotations.attach(exporter, "auto")
    assert layer is not None
    with caplog.at_level(logging.WARNING, logger="otel_rollouts"):
        _record(exporter, flush_each_step=True)
        assert otr.shutdown(30)
    assert layer.phoenix is False and layer._tries == 1  # asked once, at the first batch
    assert sink.annotations() == [] and sink.state()["annotation_requests"] == 0
    assert not [k for k in _totals() if k.startswith("annotations.")]
    assert "annotation" not in caplog.text
    assert len(sink.roots()) == len(EPISODES)


def _failing_run(exporter, layer, caplog) -> dict[str, int]:
    with caplog.at_level(logging.WARNING, logger="otel_rollouts"):
        _record(exporter, flush_each_step=True)
        assert otr.shutdown(30)  # delivery is not held up, nor failed, by annotations
    warnings = [r for r in caplog.records if "annotations" in r.getMessage()]
    assert len(warnings) == 1, [r.getMessage() for r in warnings]  # reported once
    totals = _totals()
    assert totals[f"delivered.{NAME}"] == len(EPISODES)  # the ledger: every episode delivered
    assert not [k for k in totals if k.startswith(("dropped.", "lost."))]
    assert totals.get(f"annotations.posted.{NAME}", 0) == 0
    # the first batch's request failed; the next two batches came during the pause: not posted
    assert totals[f"annotations.failures.{NAME}"] == 1
    assert totals[f"annotations.lost.{NAME}"] == PER_EPISODE * len(EPISODES)
    return totals


def test_phoenix_down_loses_annotations_never_episodes(sink: OtlpSink, otr_shutdown, caplog):
    exporter = OTLPSpanExporter(endpoint=sink.endpoint, timeout=5)
    layer = PhoenixAnnotations.attach(exporter, _dead_url())
    assert layer is not None and layer.phoenix is True  # a URL given: not asked
    _failing_run(exporter, layer, caplog)
    assert len(sink.roots()) == len(EPISODES)


@pytest.mark.parametrize("status", [401, 422, 500, 503])
def test_phoenix_refusing_annotations_loses_annotations_never_episodes(sink: OtlpSink, otr_shutdown, caplog,
                                                                       status: int):
    sink.control(phoenix_version="20.26.1", annotations_status=status)
    exporter = OTLPSpanExporter(endpoint=sink.endpoint, timeout=5)
    layer = PhoenixAnnotations.attach(exporter)
    assert layer is not None
    _failing_run(exporter, layer, caplog)
    assert f"HTTP {status}" in caplog.text
    assert sink.state()["annotation_requests"] == 1  # paused after the failure: not hammered
    assert sink.annotations() == [] and len(sink.roots()) == len(EPISODES)


def test_a_slow_phoenix_never_holds_delivery_up(sink: OtlpSink, otr_shutdown, caplog):
    sink.control(phoenix_version="20.26.1", annotations_delay=5.0)
    exporter = OTLPSpanExporter(endpoint=sink.endpoint, timeout=5)
    layer = PhoenixAnnotations.attach(exporter)
    assert layer is not None
    layer.post_timeout = 0.3
    started = time.monotonic()
    _failing_run(exporter, layer, caplog)
    assert time.monotonic() - started < 4.0  # not the 5 s Phoenix takes, let alone 3 batches of it
    assert layer.last_post_s is not None and layer.last_post_s < 1.5
    assert "timed out" in caplog.text


def test_posting_resumes_after_the_pause(sink: OtlpSink, otr_shutdown):
    sink.control(phoenix_version="20.26.1", annotations_status=503)
    exporter = OTLPSpanExporter(endpoint=sink.endpoint, timeout=5)
    layer = PhoenixAnnotations.attach(exporter)
    assert layer is not None
    layer._pause = 0.0  # no pause: the next batch tries again
    otr.configure(exporters=[exporter], sampler=otr.TailSampler(100, "first"), run_id=RUN)
    for step, status in ((0, 503), (1, 200)):
        sink.control(annotations_status=status)
        with otr.episode(step=step, group_id="g") as ep:
            ep.reward(1.0)
        assert otr.flush(30)
    totals = _totals()
    assert totals[f"annotations.failures.{NAME}"] == 1 and totals[f"annotations.posted.{NAME}"] == 5
    assert [a["name"] for a in sink.annotations()] == ["reward", "step", "stage", "kept", "status"]  # step 1's


def test_an_error_inside_the_layer_is_counted_and_the_export_still_succeeds(sink: OtlpSink, otr_shutdown,
                                                                            monkeypatch, caplog):
    sink.control(phoenix_version="20.26.1")
    exporter = OTLPSpanExporter(endpoint=sink.endpoint, timeout=5)
    layer = PhoenixAnnotations.attach(exporter)
    assert layer is not None

    def broken(*args: Any) -> None:
        raise RuntimeError("boom")

    monkeypatch.setattr(layer, "_post", broken)
    with caplog.at_level(logging.WARNING, logger="otel_rollouts"):
        _record(exporter, EPISODES[:3])
        assert otr.shutdown(30)
    totals = _totals()
    assert totals[f"delivered.{NAME}"] == 3 and totals[f"annotations.errors.{NAME}"] >= 1
    assert [r.getMessage() for r in caplog.records if "boom" in r.getMessage()] == [
        f"otel_rollouts: exporter {NAME}: annotations: RuntimeError: boom (logged once; counted in otr.stats())"]


# --- attaching and the option ------------------------------------------------------------------
def test_what_gets_annotations_attached():
    http = OTLPSpanExporter(endpoint="http://127.0.0.1:6006/v1/traces")
    assert PhoenixAnnotations.attach(http, "off") is None
    layer = PhoenixAnnotations.attach(http, "auto")
    assert layer is not None and layer.base == "http://127.0.0.1:6006" and layer.phoenix is None
    assert PhoenixAnnotations.attach(http, "auto") is layer  # once
    # an endpoint that is not .../v1/traces: no Phoenix base to derive
    assert PhoenixAnnotations.attach(OTLPSpanExporter(endpoint="http://127.0.0.1:4318/custom"), "auto") is None
    # gRPC: Phoenix's REST port is not the gRPC one, so only a URL given
    grpc = GrpcSpanExporter(endpoint="127.0.0.1:4317", insecure=True)
    assert PhoenixAnnotations.attach(grpc, "auto") is None and PhoenixAnnotations.attach(grpc, "on") is None
    given = PhoenixAnnotations.attach(grpc, "http://127.0.0.1:6006/")
    assert given is not None and given.base == "http://127.0.0.1:6006" and given.phoenix is True
    assert PhoenixAnnotations.attach(InMemorySpanExporter(), "on") is None


def test_the_exporters_credentials_go_with_the_annotations_to_its_own_host_only():
    http = OTLPSpanExporter(endpoint="http://127.0.0.1:6006/v1/traces", headers={"authorization": "Bearer k"})
    layer = PhoenixAnnotations.attach(http)
    assert layer is not None and layer.headers == {"authorization": "Bearer k"}
    other = GrpcSpanExporter(endpoint="collector.example:4317", headers={"authorization": "Bearer k"})
    elsewhere = PhoenixAnnotations.attach(other, "http://127.0.0.1:6006")
    assert elsewhere is not None and elsewhere.headers == {}


def test_the_default_otlp_exporter_is_wired_by_the_environment(monkeypatch):
    monkeypatch.setenv(c.ENV_OTLP_TRACES_ENDPOINT, "http://127.0.0.1:6006/v1/traces")
    monkeypatch.setenv(c.ENV_OTLP_TRACES_PROTOCOL, "http/protobuf")
    exporter = otlp_exporter_from_env()
    assert isinstance(exporter.export, phoenix._Export)
    assert exporter.export.layer.base == "http://127.0.0.1:6006"
    monkeypatch.setenv(c.ENV_PHOENIX_ANNOTATIONS, "off")
    assert not isinstance(otlp_exporter_from_env().export, phoenix._Export)
    monkeypatch.setenv(c.ENV_OTLP_TRACES_PROTOCOL, "grpc")
    monkeypatch.setenv(c.ENV_PHOENIX_ANNOTATIONS, "http://127.0.0.1:6006")
    grpc = otlp_exporter_from_env()
    assert isinstance(grpc.export, phoenix._Export) and grpc.export.layer.base == "http://127.0.0.1:6006"


@pytest.mark.parametrize(("text", "mode"), [
    ("auto", "auto"), (" ON ", "on"), ("true", "on"), ("off", "off"), ("0", "off"),
    ("http://127.0.0.1:6006/", "http://127.0.0.1:6006"), ("https://phoenix.example/root", "https://phoenix.example/root"),
])
def test_option_values(text: str, mode: str):
    assert phoenix.parse_mode(text) == mode


@pytest.mark.parametrize("text", ["maybe", "ftp://host", "http://", "http://host:99999", "127.0.0.1:6006"])
def test_a_bad_option_value_is_warned_about_and_auto_is_used(text: str, caplog):
    environ = {c.ENV_PHOENIX_ANNOTATIONS: text}
    with caplog.at_level(logging.WARNING, logger="otel_rollouts"):
        check_environment(environ)
    assert c.ENV_PHOENIX_ANNOTATIONS in caplog.text and c.ENV_PHOENIX_ANNOTATIONS not in environ
    assert phoenix.mode_from_env({c.ENV_PHOENIX_ANNOTATIONS: text}) == "auto"
