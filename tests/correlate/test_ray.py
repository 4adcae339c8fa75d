"""Episode context across Ray calls, on a real local Ray cluster kept on loopback.

Remote functions and actor methods declared with ``@otr.ray_remote`` record their
``@otr.traced`` spans under the caller's span, and the spans come back to the episode with the
call: kept or dropped with it, never exported from the actor.
"""

from __future__ import annotations

import ipaddress
import json
import os
import threading

import psutil
import pytest
import ray
import ray_workloads as w
from opentelemetry import trace
from opentelemetry.sdk.trace.export.in_memory_span_exporter import InMemorySpanExporter
from otr_helpers import configure_memory
from suite_paths import TEST_PATHS

import otel_rollouts as otr
from otel_rollouts import conventions as c


@pytest.fixture
def cluster(ray_cluster):
    return ray_cluster


@pytest.fixture
def exported(cluster):
    exporter = configure_memory(100, "first", handle_signals=False)
    yield exporter
    otr.shutdown(timeout=10)


def _current_span_id() -> int:
    return trace.get_current_span().get_span_context().span_id


def _spans(exporter: InMemorySpanExporter, trace_id: str) -> list:
    return [s for s in exporter.get_finished_spans() if f"{s.context.trace_id:032x}" == trace_id]


def _children(spans: list, parent_id: int, name: str) -> list:
    return [s for s in spans if s.name == name and s.parent is not None and s.parent.span_id == parent_id]


# --- the cluster itself --------------------------------------------------------------------------
def _ray_processes() -> set[int]:
    """This session's Ray processes (gcs_server, raylet, Ray's Python helpers, ``ray::`` workers),
    not the other servers tests start (Phoenix: see test_receiver_fixture)."""
    package = os.path.dirname(ray.__file__)
    found = set()
    for proc in psutil.Process().children(recursive=True):
        try:
            if proc.name().startswith("ray::") or any(package in arg for arg in proc.cmdline()):
                found.add(proc.pid)
        except psutil.Error:  # ended meanwhile
            continue
    return found


def test_the_cluster_listens_on_loopback_only(cluster):
    ray_pids = _ray_processes()
    assert {"gcs_server", "raylet"} <= {psutil.Process(pid).name() for pid in ray_pids}
    listening = [
        conn for conn in psutil.net_connections(kind="inet")
        if conn.status == psutil.CONN_LISTEN and conn.pid in ray_pids
    ]
    assert listening, "no listener found for Ray's processes"
    for conn in listening:
        address = ipaddress.ip_address(conn.laddr.ip)
        address = getattr(address, "ipv4_mapped", None) or address  # ::ffff:127.0.0.1
        assert address.is_loopback, conn


# --- context into remote functions and actor methods ----------------------------------------------
def _in_a_turn(exporter: InMemorySpanExporter, call) -> tuple[object, list, int]:
    """``call()`` inside the turn of a finished, kept episode: its value, the episode's exported
    spans and the turn's span id."""
    with otr.episode(step=0) as ep:
        with ep.turn():
            turn_id = _current_span_id()
            value = call()
        ep.reward(1.0)
    otr.end_step(0)
    assert otr.flush(10)
    return value, _spans(exporter, ep.trace_id), turn_id


def test_a_remote_function_joins_the_episode_under_the_calling_span(exported):
    result, spans, turn_id = _in_a_turn(exported, lambda: ray.get(w.score.remote("hello")))
    assert result == {"length": 5}  # the caller gets the plain value
    (tool,) = _children(spans, turn_id, "execute_tool score")
    assert len(_children(spans, tool.context.span_id, "measure")) == 1
    assert tool.attributes[c.GEN_AI_TOOL_NAME] == "score"
    assert json.loads(tool.attributes[c.GEN_AI_TOOL_CALL_RESULT]) == {"length": 5}
    root = next(s for s in spans if s.name == "episode")
    assert tool.resource.attributes == root.resource.attributes  # stamped as part of this run
    assert otr.stats()["totals"].get("dropped.ray_spans", 0) == 0


@pytest.mark.parametrize("actor", ["SyncEnv", "ThreadedEnv", "AsyncEnv"])
def test_an_actor_method_joins_the_episode_under_the_calling_span(exported, actor):
    env = getattr(w, actor).remote()
    observation, spans, turn_id = _in_a_turn(exported, lambda: ray.get(env.step.remote("look")))
    assert "look:4" in observation
    (tool,) = _children(spans, turn_id, "execute_tool step")
    assert _children(spans, tool.context.span_id, "measure")
    ray.kill(env.ray_handle)


def test_a_handle_from_get_actor_wrapped_with_ray_actor_joins_the_episode(exported):
    name = f"env-{os.getpid()}-{threading.get_ident()}"
    env = w.SyncEnv.options(name=name).remote()
    plain = ray.get_actor(name)  # Ray's own handle: its calls would carry no context
    traced = otr.ray_actor(plain, w.SyncEnv)
    observation, spans, turn_id = _in_a_turn(exported, lambda: ray.get(traced.step.remote("peek")))
    assert "peek:4" in observation
    assert len(_children(spans, turn_id, "execute_tool step")) == 1
    ray.kill(env.ray_handle)


def test_multiple_returns_and_options_keep_the_callers_refs(exported):
    with otr.episode(step=0) as ep:
        head_ref, tail_ref = w.split_words.options(num_cpus=1).remote("hello world")
        assert ray.get([head_ref, tail_ref]) == ["hello", "world"]
        trace_id = ep.trace_id
    otr.end_step(0)
    assert otr.flush(10)
    assert [s.name for s in _spans(exported, trace_id) if s.name.startswith("execute_tool")] == [
        "execute_tool split_words"
    ]


def test_a_failing_call_raises_for_the_caller_and_brings_its_error_span(exported):
    with otr.episode(step=0) as ep:
        with pytest.raises(ValueError, match="refused no"):
            ray.get(w.refuse.remote("no"))
        trace_id = ep.trace_id
    otr.end_step(0)
    assert otr.flush(10)
    (tool,) = [s for s in _spans(exported, trace_id) if s.name == "execute_tool refuse"]
    assert tool.status.status_code.name == "ERROR"


def test_outside_an_episode_a_call_is_plain_ray(exported):
    assert ray.get(w.score.remote("abc")) == {"length": 3}
    assert otr.flush(10)
    assert exported.get_finished_spans() == ()


# --- kept or dropped with the episode --------------------------------------------------------------
def test_actor_spans_are_kept_or_dropped_with_their_episode(cluster, configured):
    exporter = configured(1, "top_bottom", handle_signals=False)
    env = w.SyncEnv.remote()
    trace_ids = {}
    for reward in (0.1, 0.9):
        with otr.episode(step=0) as ep:
            ray.get(env.step.remote(f"r{reward}"))
            ep.reward(reward)
            trace_ids[reward] = ep.trace_id
    otr.end_step(0)  # spans of finished calls are in their episodes before the decision
    assert otr.flush(10)
    exported_traces = {f"{s.context.trace_id:032x}" for s in exporter.get_finished_spans()}
    kept = [r for r, t in trace_ids.items() if t in exported_traces]
    assert len(kept) == 1
    spans = _spans(exporter, trace_ids[kept[0]])
    assert [s.name for s in spans if s.name == "execute_tool step"] == ["execute_tool step"]
    assert otr.stats()["totals"].get("dropped.late_spans", 0) == 0
    ray.kill(env.ray_handle)


# --- concurrency and failures ---------------------------------------------------------------------
def test_concurrent_calls_into_one_threaded_actor_lose_no_span(exported):
    env = w.ThreadedEnv.remote()
    results: dict[int, tuple[str, str]] = {}

    def one_episode(i: int) -> None:
        with otr.episode(step=0, sample_index=i) as ep:
            with ep.turn():
                observation = ray.get(env.step.remote(f"a{i}", wait_for_others=i < 4))
                for j in range(4):
                    ray.get(env.step.remote(f"b{i}{j}"))
            ep.reward(float(i))
            results[i] = (ep.trace_id, observation)

    threads = [threading.Thread(target=one_episode, args=(i,)) for i in range(8)]
    for t in threads:
        t.start()
    for t in threads:
        t.join(120)
    otr.end_step(0)
    assert otr.flush(10)
    assert ray.get(env.most_at_once.remote()) >= 4  # the calls did overlap in the actor
    for trace_id, _ in results.values():
        spans = _spans(exported, trace_id)
        assert sum(s.name == "execute_tool step" for s in spans) == 5
        assert sum(s.name == "measure" for s in spans) == 10
    assert len(results) == 8
    ray.kill(env.ray_handle)


def test_an_actor_killed_mid_call_fails_the_call_not_the_episode(exported):
    stuck = w.Stuck.remote()
    with otr.episode(step=0) as ep:
        ref = stuck.hang.remote("x")
        assert ray.get(stuck.wait_started.remote(), timeout=60)
        ray.kill(stuck.ray_handle)
        with pytest.raises(ray.exceptions.RayActorError):
            ray.get(ref, timeout=60)
        ep.reward(0.0)
        trace_id = ep.trace_id
    otr.end_step(0)
    assert otr.flush(10)
    names = [s.name for s in _spans(exported, trace_id)]
    assert "episode" in names and "execute_tool hang" not in names
    assert otr.stats()["totals"]["dropped.ray_spans"] == 1  # the lost spans are counted


def test_shutdown_stops_the_span_collector_before_ray_is_shut_down(cluster):
    """``otr.shutdown()`` then ``ray.shutdown()`` (the examples' order): the thread that adopts
    finished calls' spans is gone when ``otr.shutdown()`` returns, even with a call still under
    way (it would otherwise ask Ray again after its shutdown, and Ray's core worker ends the
    process then: the Ray example exited 1 once in a fresh-clone run). The call's spans that
    never came are counted."""
    configure_memory(100, "first", handle_signals=False)
    stuck = w.Stuck.remote()
    try:
        with otr.episode(step=0) as ep:
            stuck.hang.remote("x")  # never finishes: pending when the run shuts down
            assert ray.get(stuck.wait_started.remote(), timeout=60)
            ep.reward(0.0)
        collector = [t for t in threading.enumerate() if t.name == "otel-rollouts-ray-spans"]
        assert collector, "the collector thread runs while a call is pending"
    finally:
        otr.shutdown(timeout=10)
        ray.kill(stuck.ray_handle)
    assert not [t for t in threading.enumerate() if t.name == "otel-rollouts-ray-spans" and t.is_alive()]
    assert otr.stats()["totals"]["dropped.ray_spans"] == 1


# --- what an unconfigured worker says --------------------------------------------------------------
def test_an_unconfigured_worker_says_its_spans_travel_with_the_call(exported):
    # a worker process of its own (a runtime_env of its own): what it logs is from this test only
    fresh = {"env_vars": {"PYTHONPATH": TEST_PATHS,
                          "OTR_TEST_WORKER": f"{os.getpid()}-{threading.get_ident()}"}}
    env = w.Unconfigured.options(runtime_env=fresh).remote()
    assert ray.get(env.step.remote("out")) == "out:3"  # outside an episode first: not recorded
    observation, spans, turn_id = _in_a_turn(exported, lambda: ray.get(env.step.remote("in")))
    assert observation == "in:2"
    assert len(_children(spans, turn_id, "execute_tool step")) == 1  # recorded, and back with the call
    logged = ray.get(env.logged.remote())
    assert not [line for line in logged if "nothing is recorded" in line], logged
    (said,) = [line for line in logged if line.startswith("WARNING") and "not configured" in line]
    assert "travel back with the call" in said
    ray.kill(env.ray_handle)


# --- log records made in Ray calls ---------------------------------------------------------------
def test_log_records_of_ray_calls_travel_back_and_join_their_episode(cluster):
    """Records logged in a remote function, a failing one and a threaded actor's method, inside an
    episode, come back with the call (the worker exports none of them) and join the episode:
    exported with the kept one, with the run's resource, dropped with the dropped one."""
    from opentelemetry.sdk._logs.export import InMemoryLogRecordExporter

    configure_memory(1, "first", handle_signals=False, service_name="rl-job")
    logs = InMemoryLogRecordExporter()
    integration = otr.instrument_logging(exporter=logs)
    env = w.LoggingEnv.remote()
    try:
        with otr.episode(step=0) as kept:
            assert ray.get(env.step.remote("a"), timeout=120) == "obs:a"
            assert ray.get(w.log_and_score.remote("bb"), timeout=120) == 2
            with pytest.raises(ray.exceptions.RayTaskError):
                ray.get(w.log_and_refuse.remote("c"), timeout=120)
            kept.reward(1.0)
        with otr.episode(step=0) as dropped:
            ray.get(env.step.remote("dropped"), timeout=120)
            dropped.reward(0.0)
        otr.end_step(0)
        assert otr.flush(30)
        assert integration.flush()
        records = [r for r in logs.get_finished_logs() if str(r.log_record.body).startswith("ray call")]
        assert sorted(str(r.log_record.body) for r in records) == [
            "ray call env step a", "ray call refused c", "ray call scored bb"]
        resource = otr.tracer_provider().resource.attributes
        for r in records:
            assert f"{r.log_record.trace_id:032x}" == kept.trace_id  # none of the dropped episode's
            assert r.resource.attributes[c.RL_RUN_ID] == resource[c.RL_RUN_ID]
            assert r.resource.attributes[c.SERVICE_NAME] == "rl-job"
        assert otr.stats()["totals"].get("dropped.worker_logs", 0) == 0
        assert ray.get(env.exported.remote(), timeout=120) == []  # nothing exported from the actor
    finally:
        otr.uninstrument_logging()
        otr.shutdown(timeout=10)
        ray.kill(env.ray_handle)
