"""The tail sampler through the real pipeline: step closing, late rule, whole traces only,
per-step counters, deterministic ids. Spans are read back with the SDK's InMemorySpanExporter."""

from __future__ import annotations

import http.server
import threading
import time
from collections import Counter

import pytest
from otr_helpers import configure_memory, root, traces, tree

import otel_rollouts as otr
from otel_rollouts import conventions as c
from otel_rollouts._core import runtime as _runtime
from otel_rollouts.record.episode import trace_id_int


def configure(cap=4, policy="top_bottom", **kw):
    sampler_kw = {k: kw.pop(k) for k in ("step_lag", "step_timeout_s") if k in kw}
    return configure_memory(cap, policy, sampler_options=sampler_kw, **kw)


def one(step, reward=None, split="train", status=None, group=None, reward_after=False):
    ep = otr.episode(step=step, split=split, group_id=group)
    with ep:
        ep.prompt("What is 2+2?")
        with ep.turn() as turn:
            turn.record_generation("4", model="policy")
            with turn.tool_call("calc", arguments={"x": 2}) as call:
                call.result(4)
        if status:
            ep.finish(status=status)
        if reward is not None and not reward_after:
            ep.reward(reward)
    if reward is not None and reward_after:
        ep.reward(reward)
    return ep


def kept_rewards(exporter, step=None):
    out = []
    for spans in traces(exporter).values():
        r = root(spans)
        if step is None or r.attributes[c.RL_STEP] == step:
            out.append(r.attributes.get(c.RL_REWARD))
    return sorted(out)


def wait_for(condition, timeout=10.0):
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        if condition():
            return True
        time.sleep(0.02)
    return condition()


# --- step closing ---------------------------------------------------------------------------------
def test_end_step_decides_top_bottom_and_counts_per_step_and_split(otr_shutdown):
    exporter = configure(cap=4, step_lag=None)
    for i in range(10):
        one(0, reward=float(i))
        one(0, reward=float(i) / 10, split="eval")
    otr.end_step(0)
    assert otr.flush()
    assert kept_rewards(exporter) == sorted([0.0, 1.0, 8.0, 9.0, 0.0, 0.1, 0.8, 0.9])
    steps = otr.stats()["steps"]
    assert steps["0/train"]["seen"] == 10 and steps["0/train"]["kept"] == 4
    assert steps["0/train"]["dropped.sampled_out"] == 6
    assert steps["0/eval"]["kept"] == 4 and steps["0/eval"]["dropped.sampled_out"] == 6


def test_nothing_is_exported_before_the_step_closes(otr_shutdown):
    exporter = configure(cap=4, step_lag=None)
    for i in range(6):
        one(0, reward=float(i))
    delivery = _runtime.current().delivery
    assert delivery.flush(5.0)  # the export thread drained everything it was given
    assert exporter.get_finished_spans() == ()
    otr.end_step(0)
    otr.flush()
    assert len(traces(exporter)) == 4


def test_lag_closes_older_steps_once_a_newer_step_starts(otr_shutdown):
    exporter = configure(cap=2, step_lag=1)
    for i in range(5):
        one(0, reward=float(i))
    assert _runtime.current().delivery.flush(5.0) and exporter.get_finished_spans() == ()
    one(1, reward=0.5)  # step 1 starts: step 0 (= 1 - lag) closes
    assert wait_for(lambda: len(traces(exporter)) == 2)
    assert kept_rewards(exporter, step=0) == [0.0, 4.0]
    # an episode of the step closed by the lag is late
    one(0, reward=9.0)
    assert otr.stats()["steps"]["0/train"]["late"] == 1


def test_lag_two_keeps_one_step_of_overlap(otr_shutdown):
    exporter = configure(cap=1, step_lag=2, policy="first")
    for step in range(3):
        one(step, reward=float(step))
        one(step - 1 if step else 0, reward=10.0 + step)  # a rollout of the previous version
    otr.flush()
    seen = Counter(root(s).attributes[c.RL_STEP] for s in traces(exporter).values())
    assert seen == Counter({0: 1, 1: 1, 2: 1})
    assert otr.stats()["steps"]["1/train"].get("late", 0) == 0  # overlap allowed by the lag


def test_timeout_closes_a_quiet_step_from_the_ticker(otr_shutdown):
    exporter = configure(cap=2, step_lag=None, step_timeout_s=0.3)
    for i in range(4):
        one(7, reward=float(i))
    # no end_step, no newer step: the configuration's ticker thread closes step 7
    assert wait_for(lambda: len(traces(exporter)) == 2, timeout=10.0)
    assert kept_rewards(exporter) == [0.0, 3.0]


def test_flush_and_shutdown_close_open_steps_and_truncate_open_episodes(otr_shutdown):
    exporter = configure(cap=8, step_lag=None)
    one(3, reward=1.0)
    otr.flush()
    assert len(traces(exporter)) == 1
    ep = otr.episode(step=4)
    ep.start()
    ep.prompt("never finished")
    assert otr.shutdown()
    (spans,) = [s for s in traces(exporter).values() if root(s).attributes[c.RL_STEP] == 4]
    assert root(spans).attributes[c.RL_STATUS] == c.STATUS_TRUNCATED


def test_episode_waiting_for_its_reward_is_offered_when_the_step_closes(otr_shutdown):
    exporter = configure(cap=4, step_lag=None)
    ep = otr.episode(step=0)
    with ep:
        ep.prompt("p")
    # no reward yet: the episode waits; end_step offers it as it is
    otr.end_step(0)
    otr.flush()
    (spans,) = traces(exporter).values()
    assert c.RL_REWARD not in root(spans).attributes


# --- the late rule ------------------------------------------------------------------------------
def test_late_episode_kept_while_the_step_kept_fewer_than_the_cap(otr_shutdown):
    exporter = configure(cap=3, step_lag=None)
    one(0, reward=1.0)
    otr.end_step(0)  # kept 1 of 3
    one(0, reward=2.0)
    one(0, reward=3.0)  # kept: the step is now at the cap
    one(0, reward=4.0)  # dropped, late
    otr.flush()
    assert kept_rewards(exporter) == [1.0, 2.0, 3.0]
    s = otr.stats()["steps"]["0/train"]
    assert s["late"] == 3 and s["dropped.late"] == 1 and s["kept"] == 3 and s["seen"] == 4


def test_late_rule_per_split(otr_shutdown):
    exporter = configure(cap=1, step_lag=None)
    one(0, reward=1.0)
    otr.end_step(0, split="train")
    one(0, reward=2.0, split="eval")  # eval of step 0 is still open
    one(0, reward=3.0)  # train is closed and full
    otr.flush()
    assert kept_rewards(exporter) == [1.0, 2.0]
    assert otr.stats()["steps"]["0/train"]["dropped.late"] == 1


# --- policies end to end ----------------------------------------------------------------------
def test_groups_export_whole_groups(otr_shutdown):
    exporter = configure(cap=8, policy="groups", step_lag=None)
    for g, rewards in enumerate([[1, 1, 1, 1], [0, 1, 0, 1], [0.4, 0.5, 0.5, 0.4], [0, 0, 1, 1]]):
        for r in rewards:
            one(0, reward=float(r), group=f"prompt-{g}")
    otr.end_step(0)
    otr.flush()
    groups = Counter(root(s).attributes[c.RL_GROUP_ID] for s in traces(exporter).values())
    assert groups == Counter({"prompt-1": 4, "prompt-3": 4})


def test_composed_policy_end_to_end(otr_shutdown):
    policy = otr.Compose(otr.Errors(1), otr.TopBottom(top=1, bottom=1), otr.Uniform())
    exporter = configure(cap=5, policy=policy, step_lag=None)
    for i in range(20):
        one(0, reward=float(i), status="error" if i == 10 else None)
    otr.end_step(0)
    otr.flush()
    kept = {root(s).attributes[c.RL_REWARD]: root(s) for s in traces(exporter).values()}
    assert len(kept) == 5 and {10.0, 0.0, 19.0} <= set(kept)
    assert kept[10.0].attributes[c.RL_STATUS] == c.STATUS_ERROR


# --- whole traces only --------------------------------------------------------------------------
def test_reward_after_the_block_joins_kept_and_never_leaks_from_dropped(otr_shutdown):
    exporter = configure(cap=2, step_lag=None)
    for i in range(6):
        one(0, reward=float(i), reward_after=True)
    otr.end_step(0)
    otr.flush()
    by_trace = traces(exporter)
    assert len(by_trace) == 2
    for spans in by_trace.values():
        assert [n for _, n in tree(spans)].count(c.SPAN_REWARD) == 1
    assert {s.context.trace_id for s in exporter.get_finished_spans()} == set(by_trace)


def test_reward_recorded_after_a_drop_exports_nothing(otr_shutdown):
    exporter = configure(cap=1, policy="first", step_lag=None)
    one(0, reward=1.0)
    late = one(0)  # no reward yet; the cap is full: first drops it when offered at end_step
    otr.end_step(0)
    late.reward(5.0)  # after the decision
    otr.flush()
    assert kept_rewards(exporter) == [1.0]
    assert not [s for s in exporter.get_finished_spans() if s.attributes.get(c.RL_REWARD) == 5.0]
    assert otr.stats()["steps"]["0/train"]["dropped.sampled_out"] == 1


def _foreign_episode(step, reward, tracer, end_after=None):
    """An episode with spans made by plain OpenTelemetry instrumentation inside it; optionally
    one of them ends only after the step was decided (returned, still open)."""
    ep = otr.episode(step=step)
    with ep:
        with ep.turn():
            with tracer.start_as_current_span("db.query") as outer:
                with tracer.start_as_current_span("db.fetch"):
                    pass
                outer.set_attribute("db.rows", 3)
            pending = tracer.start_span("stream.read") if end_after else None
        ep.reward(reward)
    return ep, pending


@pytest.mark.parametrize("global_provider", [False, True])
def test_foreign_spans_follow_their_episode(otr_shutdown, global_provider):
    exporter = configure(cap=1, step_lag=None, set_global_provider=global_provider)
    if global_provider:
        from opentelemetry import trace

        tracer = trace.get_tracer("other.instrumentation")
    else:
        tracer = _runtime.current().provider.get_tracer("other.instrumentation")
    kept, open_kept = _foreign_episode(0, 1.0, tracer, end_after=True)
    dropped, open_dropped = _foreign_episode(0, 0.5, tracer, end_after=True)
    _foreign_episode(0, 0.1, tracer)
    otr.end_step(0)
    open_kept.end()  # ends after the decision: goes out with its kept episode
    open_dropped.end()  # ends after the decision: nothing of a dropped episode goes out
    with tracer.start_as_current_span("outside.any.episode"):
        pass
    otr.flush()
    spans = exporter.get_finished_spans()
    by_trace = traces(exporter)
    kept_id = int(kept.trace_id, 16)
    assert int(dropped.trace_id, 16) not in by_trace
    assert sorted(n for _, n in tree(by_trace[kept_id])) == sorted(
        [c.SPAN_EPISODE, c.SPAN_TURN, "db.query", "db.fetch", "stream.read", c.SPAN_REWARD]
    )
    outside = [s for s in spans if s.name == "outside.any.episode"]
    assert len(outside) == 1 and outside[0].context.trace_id not in (kept_id,)
    assert len(by_trace) == 2  # the kept episode and the span outside any episode
    assert otr.stats()["totals"]["dropped.late_spans"] == 1


class _Quiet(http.server.BaseHTTPRequestHandler):
    def do_GET(self):  # noqa: N802 - the stdlib's name
        body = b"ok"
        self.send_response(200)
        self.send_header("Content-Length", str(len(body)))
        self.end_headers()
        self.wfile.write(body)

    def log_message(self, *args):
        pass


def test_real_httpx_client_spans_are_kept_or_dropped_with_their_episode(otr_shutdown):
    httpx = pytest.importorskip("httpx")
    instrumentation = pytest.importorskip("opentelemetry.instrumentation.httpx")
    server = http.server.ThreadingHTTPServer(("127.0.0.1", 0), _Quiet)
    thread = threading.Thread(target=server.serve_forever, daemon=True)
    thread.start()
    url = f"http://127.0.0.1:{server.server_address[1]}/tool"
    client = httpx.Client()
    try:
        exporter = configure(cap=1, step_lag=None)
        provider = _runtime.current().provider
        instrumentation.HTTPXClientInstrumentor.instrument_client(client, tracer_provider=provider)
        ids = {}
        for reward in (1.0, 0.0, 0.5):  # top_bottom, cap 1: the best one
            with otr.episode(step=0) as ep:
                with ep.turn() as turn, turn.tool_call("fetch"):
                    assert client.get(url).text == "ok"
                ep.reward(reward)
            ids[reward] = int(ep.trace_id, 16)
        client.get(url)  # outside any episode: an ordinary trace
        otr.end_step(0)
        otr.flush()
    finally:
        client.close()
        server.shutdown()
    by_trace = traces(exporter)
    assert ids[1.0] in by_trace and ids[0.0] not in by_trace and ids[0.5] not in by_trace
    kept = by_trace[ids[1.0]]
    http_spans = [s for s in kept if s.attributes.get("http.request.method") == "GET"
                  or s.attributes.get("http.method") == "GET"]
    assert len(http_spans) == 1
    tool = next(s for s in kept if s.attributes.get(c.RL_SPAN_KIND) == c.KIND_TOOL)
    assert http_spans[0].parent.span_id == tool.context.span_id
    assert len(by_trace) == 2  # the kept episode and the request outside any episode


# --- deterministic ids -----------------------------------------------------------------------------
def test_deterministic_ids_find_a_kept_trace_from_training_data(otr_shutdown):
    exporter = configure(cap=2, step_lag=None, deterministic_ids=True, run_id="run-42")
    for i in range(5):
        with otr.episode(step=3, episode_id=f"sample-{i}") as ep:
            ep.prompt("p")
            ep.reward(float(i))
    otr.end_step(3)
    otr.flush()
    by_trace = traces(exporter)
    for i in (0, 4):  # top 1 and bottom 1
        spans = by_trace[trace_id_int("run-42", 3, f"sample-{i}")]
        assert root(spans).attributes[c.RL_EPISODE_ID] == f"sample-{i}"
        # the public form is the id every viewer shows
        assert otr.trace_id_for("run-42", 3, f"sample-{i}") == f"{root(spans).context.trace_id:032x}"
    assert trace_id_int("run-42", 3, "sample-1") not in by_trace
    assert trace_id_int("run-43", 3, "sample-0") != trace_id_int("run-42", 3, "sample-0")
    assert trace_id_int("run-42", 4, "sample-0") != trace_id_int("run-42", 3, "sample-0")
