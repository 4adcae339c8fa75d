"""One span gateway per node, shared by the node's rollout actors (the asynchronous-RL layout).

Three Ray rollout actors on one node (the session's local Ray cluster), one instrumented
inference server process shared by all three (``tests/instrumented_server.py``: FastAPI, the
stock instrumentation, exporting to the gateway's fixed ports). Every actor asks for the same
ports: one gateway process serves them all. Kept episodes carry the server's spans under their
generation spans, dropped ones leave nothing downstream, and a request made outside any episode
arrives whole (client span, server spans, log record).
"""

from __future__ import annotations

import socket
from pathlib import Path

import ray
import ray_workloads as w
from instrumented_server import ENGINE_SPAN, SERVER_SPAN, serve
from otlp_sink import OtlpSink
from otr_helpers import wait_for

from otel_rollouts import conventions as c

ACTORS = 3
EPISODES = 6  # per actor
CAP = 2  # per actor and step (each actor decides alone: distributed=False)
GatewayActor = ray.remote(w.GatewayRollouts)


def _free_port() -> int:
    with socket.socket() as probe:
        probe.bind(("127.0.0.1", 0))
        return probe.getsockname()[1]


def test_three_rollout_actors_share_one_gateway_and_one_server(ray_cluster, tmp_path: Path) -> None:
    http_port, grpc_port = _free_port(), _free_port()
    with OtlpSink(tmp_path / "sink") as sink:
        actors = [GatewayActor.remote(sink.endpoint, sink.logs_endpoint, http_port, grpc_port, CAP)
                  for _ in range(ACTORS)]
        pids = set(ray.get([a.gateway_pid.remote() for a in actors]))
        assert len(pids) == 1 and None not in pids, pids  # one gateway for the node's three actors
        env = {"OTEL_EXPORTER_OTLP_ENDPOINT": f"http://127.0.0.1:{http_port}",
               "OTEL_EXPORTER_OTLP_PROTOCOL": "http/protobuf", "OTEL_BSP_SCHEDULE_DELAY": "50",
               "OTEL_BLRP_SCHEDULE_DELAY": "50", "OTEL_SERVICE_NAME": "toy-vllm"}
        with serve(env) as server:
            rewards = [[float(10 * a + i) for i in range(EPISODES)] for a in range(ACTORS)]
            ids = ray.get([actor.run_step.remote(0, server.url, r) for actor, r in zip(actors, rewards, strict=True)])
            outside = ray.get(actors[0].outside.remote(server.url))
        # the server has flushed its spans and logs (SIGTERM at the end of `serve`)
        totals = ray.get([a.finish.remote(0) for a in actors])
        # a server span that reached the gateway after its episode was rendered goes out on its
        # own, from the gateway, which exports it as it leaves (its clients gone): wait for it
        kept_ids = {actor_ids[i] for actor_ids in ids for i in (0, EPISODES - 1)}
        wait_for(lambda: kept_ids <= {s["trace_id"] for s in sink.spans() if s["name"] == ENGINE_SPAN},
                 30, "every kept episode's engine span")
        spans, logs = sink.spans(), sink.logs()
    roots = {s["trace_id"] for s in spans if s["attributes"].get(c.RL_SPAN_KIND) == c.KIND_EPISODE}
    every = {t for actor_ids in ids for t in actor_ids}
    # top 1 and bottom 1 of each actor's step
    assert roots == {actor_ids[i] for actor_ids in ids for i in (0, EPISODES - 1)}
    by_id = {s["span_id"]: s for s in spans}
    for trace_id in roots:
        engine = [s for s in spans if s["trace_id"] == trace_id and s["name"] == ENGINE_SPAN]
        assert len(engine) == 1
        parent = by_id[engine[0]["parent_id"]]
        while parent["attributes"].get(c.RL_SPAN_KIND) is None:  # the route, the client span
            parent = by_id[parent["parent_id"]]
        assert parent["attributes"][c.RL_SPAN_KIND] == c.KIND_GENERATION
        assert parent["attributes"][c.RL_SERVER_QUEUE_SECONDS] > 0  # the engine's timings lent
        assert [r for r in logs if r["trace_id"] == trace_id]
    dropped = every - roots
    assert len(dropped) == ACTORS * (EPISODES - CAP)
    assert not [s for s in spans if s["trace_id"] in dropped]  # no orphan fragment downstream
    assert not [r for r in logs if r["trace_id"] in dropped]
    # the request outside any episode, whole: the actor's spans, the server's spans, its log
    trace = {s["name"] for s in spans if s["trace_id"] == outside}
    assert {"eval", "POST", SERVER_SPAN, ENGINE_SPAN} <= trace, trace
    assert [r for r in logs if r["trace_id"] == outside]
    assert sum(t.get("dropped.gateway_spans", 0) for t in totals) >= len(dropped)
    assert sum(t.get("dropped.gateway_unknown.spans", 0) for t in totals) == 0
