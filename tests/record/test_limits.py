"""Limits: text budgets per attribute and per episode (head and tail kept, flagged), the span-count
limit per episode (counted), OpenTelemetry's attribute-count limit raised, and OTLP requests
split under a real receiver's message-size limit."""

from __future__ import annotations

import pytest
from opentelemetry.exporter.otlp.proto.http.trace_exporter import OTLPSpanExporter
from otlp_sink import OtlpSink

import otel_rollouts as otr
from otel_rollouts import conventions as c
from otel_rollouts._core import runtime as _runtime


def _spans(memory):
    otr.flush(timeout=10)
    return memory.get_finished_spans()


def test_long_content_keeps_head_and_tail_and_is_flagged(configured):
    memory = configured(5, "first", max_attribute_chars=1000)
    text = "HEAD-MARK " + "x" * 50_000 + " TAIL-MARK"
    with otr.episode(step=0) as ep:
        ep.prompt(text)
        ep.reward(1.0)
    otr.end_step(0)
    prompt = next(s for s in _spans(memory) if s.name == c.SPAN_PROMPT)
    value = prompt.attributes[c.GEN_AI_INPUT_MESSAGES]
    assert len(value) <= 1000
    assert "HEAD-MARK" in value[:200] and value.rstrip('"}]').endswith("TAIL-MARK")
    assert "chars cut" in value
    assert c.GEN_AI_INPUT_MESSAGES in prompt.attributes[c.RL_TRUNCATED_FIELDS]


def test_episode_text_budget_is_shared_by_all_its_spans(configured):
    memory = configured(5, "first", max_attribute_chars=10_000, max_episode_chars=6_000)
    with otr.episode(step=0) as ep:
        for i in range(20):
            with ep.turn() as turn:
                turn.record_generation(f"turn-{i} " + "y" * 2_000 + f" end-{i}")
        ep.reward(1.0)
    otr.end_step(0)
    spans = _spans(memory)
    generations = sorted(
        (s for s in spans if s.attributes.get(c.RL_SPAN_KIND) == c.KIND_GENERATION), key=lambda s: s.start_time
    )
    assert len(generations) == 20
    texts = [g.attributes[c.GEN_AI_OUTPUT_MESSAGES] for g in generations]
    total = sum(len(v) for s in spans for v in s.attributes.values() if isinstance(v, str))
    # the budget, plus a minimal head+tail for each text after it ran out
    assert total <= 6_000 + 20 * 300
    assert c.RL_TRUNCATED_FIELDS not in generations[0].attributes  # early turns whole
    assert c.GEN_AI_OUTPUT_MESSAGES in generations[-1].attributes[c.RL_TRUNCATED_FIELDS]  # late ones cut
    assert "turn-19" in texts[-1] and "end-19" in texts[-1]  # but still head and tail
    # without the episode budget the same episode is about 4x larger
    assert sum(len(t) for t in texts) < 20 * 2_000 / 3


def test_span_count_limit_per_episode_is_enforced_and_counted(configured):
    memory = configured(5, "first", max_spans_per_episode=10)
    with otr.episode(step=0) as ep:
        with ep.turn() as turn:
            for i in range(50):
                turn.tool_call("calc", arguments={"i": i}).result(i)
        ep.reward(1.0)
    otr.end_step(0)
    spans = _spans(memory)
    assert len(spans) == 10
    assert any(s.name == c.SPAN_EPISODE for s in spans)
    # 1 root + 1 turn + 50 calls + 1 reward = 53 recorded, 10 kept: 43 dropped and counted
    assert otr.stats()["totals"]["dropped.span_limit"] == 43


def test_attribute_count_is_not_cut_at_opentelemetrys_default_128(configured):
    memory = configured(5, "first")
    tracer = _runtime.installed().tracer
    with otr.episode(step=0, metadata={f"k{i}": i for i in range(300)}) as ep:
        # a span of other OpenTelemetry instrumentation (an SDK span) with many attributes
        with tracer.start_as_current_span("client call", attributes={f"a{i}": i for i in range(300)}):
            pass
        ep.reward(1.0)
    otr.end_step(0)
    spans = _spans(memory)
    root = next(s for s in spans if s.name == c.SPAN_EPISODE)
    assert sum(k.startswith(c.RL_METADATA_PREFIX) for k in root.attributes) == 300
    foreign = next(s for s in spans if s.name == "client call")
    assert len(foreign.attributes) == 300 and foreign.dropped_attributes == 0


def _big_episode(n_spans: int = 40, size: int = 2_000) -> None:
    with otr.episode(step=0) as ep:
        with ep.turn() as turn:
            for i in range(n_spans):
                turn.tool_call("fetch", arguments={"i": i}).result(f"{i}:" + "z" * size)
        ep.reward(1.0)
    otr.end_step(0)


@pytest.fixture
def limited_sink(tmp_path):
    with OtlpSink(tmp_path / "sink") as sink:
        sink.control(max_body=20_000)  # the collector refuses requests above 20 kB (413)
        yield sink


def test_otlp_requests_are_split_under_the_receivers_size_limit(limited_sink, tmp_path, otr_shutdown):
    otr.configure(
        exporters=[OTLPSpanExporter(endpoint=limited_sink.endpoint, timeout=2)],
        sampler=otr.TailSampler(5, "first"),
        max_request_bytes=15_000,
        spool_dir=tmp_path / "spool",
    )
    _big_episode()
    assert otr.flush(timeout=20)
    state = limited_sink.state()
    assert state["refused"] == 0
    assert len(state["sizes"]) >= 5 and max(state["sizes"]) <= 15_000
    assert len(limited_sink.spans()) == 43  # root, turn, 40 calls, reward: all of them
    assert otr.stats()["delivery"]["OTLPSpanExporter"]["delivered"] == 1


def test_without_splitting_a_refused_request_is_split_when_the_collector_refuses_it(
        limited_sink, tmp_path, otr_shutdown):
    """The limit is real: without ``max_request_bytes`` the first request is refused (413). A
    refusal is never retried as it is (that once stopped all later delivery): it is halved
    until every part fits, so the episode still arrives whole, once, counted delivered."""
    otr.configure(
        exporters=[OTLPSpanExporter(endpoint=limited_sink.endpoint, timeout=1)],
        sampler=otr.TailSampler(5, "first"),
        max_request_bytes=None,
        spool_dir=tmp_path / "spool",
    )
    _big_episode()
    assert otr.flush(timeout=30)
    state = limited_sink.state()
    assert state["refused"] >= 1
    spans = limited_sink.spans()
    assert len(spans) == 43 and len({s["span_id"] for s in spans}) == 43
    delivery = otr.stats()["delivery"]["OTLPSpanExporter"]
    assert delivery["delivered"] == 1 and delivery["dropped"] == 0 and delivery["pending"] == 0


def test_a_single_span_over_the_limit_is_dropped_and_counted(limited_sink, tmp_path, otr_shutdown):
    otr.configure(
        exporters=[OTLPSpanExporter(endpoint=limited_sink.endpoint, timeout=2)],
        sampler=otr.TailSampler(5, "first"),
        max_attribute_chars=100_000,
        max_request_bytes=15_000,
        spool_dir=tmp_path / "spool",
    )
    with otr.episode(step=0) as ep:
        with ep.turn() as turn:
            turn.tool_call("dump").result("w" * 30_000)
            turn.tool_call("small").result("ok")
        ep.reward(1.0)
    otr.end_step(0)
    otr.flush(timeout=10)
    names = sorted(s["name"] for s in limited_sink.spans())
    assert "execute_tool dump" not in names and "execute_tool small" in names and "episode" in names
    assert otr.stats()["totals"]["dropped.oversize_spans.OTLPSpanExporter"] == 1
