"""The span gateway with a real OpenTelemetry-instrumented server process.

The server (``tests/instrumented_server.py``: FastAPI + the stock FastAPI instrumentation, the
SDK's OTLP span and log exporters, configured only from the standard environment variables)
exports to the gateway over gRPC or OTLP/HTTP. otel_rollouts exports what it keeps to a real
OTLP/HTTP receiver process (``tests/otlp_sink.py``): the "collector". Kept episodes must hold the
server's spans under their generation span and its log records; a dropped episode must leave
nothing there at all.
"""

from __future__ import annotations

import gzip
import json
import os
import socket
import time
import urllib.error
import urllib.request
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import httpx
import pytest
from instrumented_server import ENGINE_SPAN, LOGGER_NAME, SERVER_SPAN, serve, timings
from opentelemetry.exporter.otlp.proto.grpc.trace_exporter import OTLPSpanExporter as GrpcExporter
from opentelemetry.exporter.otlp.proto.http._log_exporter import OTLPLogExporter
from opentelemetry.exporter.otlp.proto.http.trace_exporter import OTLPSpanExporter
from opentelemetry.sdk.trace import ReadableSpan
from opentelemetry.trace import SpanContext, TraceFlags
from otlp_sink import OtlpSink
from receivers import free_ports

import otel_rollouts as otr
from otel_rollouts import conventions as c

EPISODES = 6
KEPT = 2


def _totals() -> dict[str, Any]:
    return otr.stats()["totals"]


def _wait(condition: Any, what: str, timeout: float = 60.0) -> None:
    deadline = time.monotonic() + timeout
    while not condition():
        if time.monotonic() > deadline:
            raise AssertionError(f"timed out waiting for {what}; stats: {_totals()}")
        time.sleep(0.02)


@pytest.fixture
def sink(tmp_path: Path) -> Iterator[OtlpSink]:
    with OtlpSink(tmp_path / "sink") as running:
        yield running


def _configure(sink: OtlpSink, render: str | None = None, **options: Any) -> otr.SpanGateway:
    otr.configure(
        render=render,
        service_name="trainer",
        run_id="gateway-run",
        exporters=[OTLPSpanExporter(endpoint=sink.endpoint)],
        sampler=otr.TailSampler(KEPT, "top_bottom"),
        gateway=otr.GatewayOptions(http_port=0, grpc_port=0,
                                   log_exporter=OTLPLogExporter(endpoint=sink.logs_endpoint), **options),
        handle_signals=False,
    )
    gateway = otr.gateway()
    assert gateway is not None and gateway.http_port and gateway.grpc_port
    return gateway


def _server_env(gateway: otr.SpanGateway, protocol: str) -> dict[str, str]:
    endpoint = gateway.grpc_endpoint if protocol == "grpc" else gateway.http_endpoint
    assert endpoint is not None
    return {
        "OTEL_EXPORTER_OTLP_ENDPOINT": endpoint,
        "OTEL_EXPORTER_OTLP_PROTOCOL": protocol,
        "OTEL_EXPORTER_OTLP_INSECURE": "true",
        "OTEL_BSP_SCHEDULE_DELAY": "50",
        "OTEL_BLRP_SCHEDULE_DELAY": "50",
        "OTEL_SERVICE_NAME": "toy-vllm",
    }


@pytest.mark.parametrize(("protocol", "render"), [("grpc", "thread"), ("http/protobuf", "thread"),
                                                  ("http/protobuf", "process")])
def test_server_spans_and_logs_follow_their_episode(sink: OtlpSink, protocol: str, render: str) -> None:
    """``render="process"``: the renderer process pulls the kept episodes' server spans from the
    gateway itself; they never pass through the training process."""
    gateway = _configure(sink, render)
    try:
        with serve(_server_env(gateway, protocol)) as server:
            client = httpx.Client(base_url=server.url, event_hooks=otr.httpx_event_hooks())
            trace_ids: dict[int, str] = {}
            for i in range(EPISODES):
                with otr.episode(step=0, group_id="g", sample_index=i) as ep:
                    trace_ids[i] = ep.trace_id
                    ep.prompt([{"role": "user", "content": f"question {i}"}])
                    with ep.turn() as turn, turn.generation("policy") as gen:
                        body = {"model": "policy", "max_tokens": 100 * (i + 1),
                                "messages": [{"role": "user", "content": f"question {i}"}]}
                        reply = client.post("/v1/chat/completions", json=body).json()
                        gen.output(reply["choices"][0]["message"]["content"])
                    ep.reward(float(i))
            assert client.get("/health").status_code == 200  # outside any episode
            # every server span (route + engine + the ASGI send/receive spans) and log arrived
            _wait(lambda: _totals().get("gateway.spans", 0) >= 2 * EPISODES + 1
                  and _totals().get("gateway.logs", 0) >= EPISODES, "the server's telemetry")
        otr.end_step(0)
        assert otr.flush(30)
    finally:
        otr.shutdown()

    spans = sink.spans()
    roots = [s for s in spans if s["attributes"].get(c.RL_SPAN_KIND) == c.KIND_EPISODE]
    kept = {r["trace_id"] for r in roots}
    assert kept == {trace_ids[0], trace_ids[EPISODES - 1]}  # top 1 and bottom 1 by reward
    dropped = set(trace_ids.values()) - kept
    # orphans: nothing of a dropped episode reached the collector, spans or logs
    assert [s for s in spans if s["trace_id"] in dropped] == []
    logs = sink.logs()
    assert [r for r in logs if r["trace_id"] in dropped] == []
    by_id = {s["span_id"]: s for s in spans}
    for i in (0, EPISODES - 1):
        tid = trace_ids[i]
        trace = [s for s in spans if s["trace_id"] == tid]
        engine = [s for s in trace if s["name"] == ENGINE_SPAN]
        assert len(engine) == 1, [s["name"] for s in trace]
        # the engine span sits under the generation span that made the request
        node, chain = engine[0], []
        while node["parent_id"] is not None:
            node = by_id[node["parent_id"]]
            chain.append(node["attributes"].get(c.RL_SPAN_KIND))
        assert c.KIND_GENERATION in chain and chain[-1] == c.KIND_EPISODE
        assert engine[0]["service"] == "toy-vllm"  # the server's own resource
        assert engine[0]["attributes"][c.RL_EPISODE_ID]  # baggage copied by the server
        generation = [s for s in trace if s["attributes"].get(c.RL_SPAN_KIND) == c.KIND_GENERATION]
        expected = timings(100 * (i + 1))
        assert generation[0]["attributes"][c.RL_SERVER_QUEUE_SECONDS] == pytest.approx(
            expected[c.GEN_AI_LATENCY_TIME_IN_QUEUE])
        assert generation[0]["attributes"][c.RL_SERVER_DECODE_SECONDS] == pytest.approx(
            expected[c.GEN_AI_LATENCY_TIME_IN_MODEL_DECODE])
        served = [r for r in logs if r["trace_id"] == tid]
        assert len(served) == 1 and served[0]["body"].startswith("served"), served
        assert served[0]["scope"] == LOGGER_NAME and served[0]["resource"]["service.name"] == "toy-vllm"
    # the health check's span belongs to no episode: it passes through
    assert [s for s in spans if s["name"] == "GET /health"]
    totals = otr.stats()["totals"]
    assert totals.get("dropped.gateway_unknown.spans", 0) == 0
    assert totals["dropped.episode_logs"] == EPISODES - KEPT


def _span(trace_id: int, span_id: int, parent: int, name: str = "late") -> ReadableSpan:
    ctx = SpanContext(trace_id, span_id, is_remote=False, trace_flags=TraceFlags(TraceFlags.SAMPLED))
    parent_ctx = SpanContext(trace_id, parent, is_remote=True, trace_flags=TraceFlags(TraceFlags.SAMPLED))
    now = time.time_ns()
    return ReadableSpan(name=name, context=ctx, parent=parent_ctx, start_time=now, end_time=now + 1000)


def test_spans_arriving_after_the_decision_follow_it(sink: OtlpSink) -> None:
    gateway = _configure(sink, hold_s=0.2)
    try:
        ids = {}
        for i in range(4):
            with otr.episode(step=0, sample_index=i) as ep:
                ids[i] = (int(ep.trace_id, 16), ep.root.span_id)
                ep.reward(float(i))
        otr.end_step(0)  # keeps 0 and 3
        # the stock OTLP/HTTP exporter, aimed at the gateway, sends spans of decided episodes
        to_gateway = OTLPSpanExporter(endpoint=f"{gateway.http_endpoint}/v1/traces")
        spans = [_span(tid, 0x1000 + i, root, f"late-{i}") for i, (tid, root) in ids.items()]
        stranger = _span(0xABCDEF, 0x2000, 0x3000, "stranger")  # no episode of this process
        assert to_gateway.export([*spans, stranger]).name == "SUCCESS"
        _wait(lambda: _totals().get("dropped.gateway_unknown.spans", 0) == 1, "the stranger let go")
        assert otr.flush(30)
    finally:
        otr.shutdown()
    names = {s["name"] for s in sink.spans()}
    assert {"late-0", "late-3"} <= names
    assert not names & {"late-1", "late-2", "stranger"}
    totals = otr.stats()["totals"]
    assert totals["dropped.gateway_spans"] == 2


def test_unknown_traces_can_be_exported_instead(sink: OtlpSink) -> None:
    gateway = _configure(sink, hold_s=0.2, unknown="export")
    try:
        to_gateway = OTLPSpanExporter(endpoint=f"{gateway.http_endpoint}/v1/traces")
        assert to_gateway.export([_span(0xABCDEF, 0x2000, 0x3000, "stranger")]).name == "SUCCESS"
        _wait(lambda: _totals().get("gateway.unknown_exported.spans", 0) == 1, "the stranger exported")
        assert otr.flush(30)
    finally:
        otr.shutdown()
    assert "stranger" in {s["name"] for s in sink.spans()}


def _post(url: str, body: bytes, headers: dict[str, str]) -> tuple[int, bytes]:
    request = urllib.request.Request(url, data=body, headers=headers, method="POST")
    try:
        with urllib.request.urlopen(request, timeout=10) as response:
            return response.status, response.read()
    except urllib.error.HTTPError as exc:
        return exc.code, exc.read()


def test_http_json_gzip_and_bad_requests(sink: OtlpSink) -> None:
    gateway = _configure(sink, max_request_bytes=64 * 1024)
    url = f"{gateway.http_endpoint}/v1/traces"
    try:
        with otr.episode(step=0) as ep:
            tid, root = int(ep.trace_id, 16), ep.root.span_id
            ep.reward(1.0)
            # OTLP/JSON: hex ids, as the OTLP specification writes them; gzip, as exporters send
            request = {"resourceSpans": [{"resource": {"attributes": [
                {"key": "service.name", "value": {"stringValue": "json-server"}}]},
                "scopeSpans": [{"spans": [{
                    "traceId": f"{tid:032x}", "spanId": "00000000000000aa", "parentSpanId": f"{root:016x}",
                    "name": "json-span", "startTimeUnixNano": "1", "endTimeUnixNano": "2"}]}]}]}
            status, answer = _post(url, gzip.compress(json.dumps(request).encode()),
                                   {"Content-Type": "application/json", "Content-Encoding": "gzip"})
            assert status == 200 and json.loads(answer) == {}
        assert _post(url, b"\x00garbage", {"Content-Type": "application/x-protobuf"})[0] == 400
        assert _post(url, b"{not json", {"Content-Type": "application/json"})[0] == 400
        assert _post(url, b"x" * (65 * 1024), {"Content-Type": "application/x-protobuf"})[0] == 413
        bomb = gzip.compress(b"\x00" * (1024 * 1024))  # 1 KiB on the wire, 1 MiB inflated
        assert _post(url, bomb, {"Content-Type": "application/x-protobuf", "Content-Encoding": "gzip"})[0] == 413
        assert _post(f"{gateway.http_endpoint}/v1/metrics", b"", {})[0] == 404
        # a chunked body (no Content-Length) is read whole, not taken for an empty request
        chunked = json.dumps(request).replace("json-span", "chunked-span").encode()
        status, _ = _post(url, iter([chunked[:100], chunked[100:]]),  # type: ignore[arg-type]
                          {"Content-Type": "application/json", "Transfer-Encoding": "chunked"})
        assert status == 200
        otr.end_step(0)
        assert otr.flush(30)
    finally:
        otr.shutdown()
    assert [s["trace_id"] for s in sink.spans() if s["name"] == "chunked-span"] == [f"{tid:032x}"]
    span = [s for s in sink.spans() if s["name"] == "json-span"]
    assert span and span[0]["service"] == "json-server" and span[0]["trace_id"] == f"{tid:032x}"
    assert otr.stats()["totals"]["errors.gateway_decode"] == 4  # 2 malformed, 1 too large, 1 bomb


def test_a_busy_port_is_reported_not_raised(sink: OtlpSink, caplog: pytest.LogCaptureFixture) -> None:
    with socket.socket() as taken:
        taken.bind(("127.0.0.1", 0))
        taken.listen()
        port = taken.getsockname()[1]
        otr.configure(exporters=[OTLPSpanExporter(endpoint=sink.endpoint)], handle_signals=False,
                      gateway=otr.GatewayOptions(http_port=port, grpc_port=0))
        try:
            gateway = otr.gateway()
            assert gateway is not None and gateway.http_port is None and gateway.grpc_port
            assert "could not listen" in caplog.text
            assert _totals()["errors.gateway_bind"] == 1
            with otr.episode(step=0) as ep:  # recording is unaffected
                ep.reward(1.0)
            assert otr.flush(30)
        finally:
            otr.shutdown()
    assert sink.roots()


def test_what_is_held_for_undecided_episodes_is_bounded_in_bytes(sink: OtlpSink) -> None:
    """Server spans held with undecided episodes count against one byte budget: past it they
    are dropped and counted, never held without bound; a dropped episode's bytes are given back
    at its decision, a kept one's once its renderer took its spans."""
    gateway = _configure(sink, max_held_bytes=2400)
    to_gateway = OTLPSpanExporter(endpoint=f"{gateway.http_endpoint}/v1/traces")
    padding = {"pad": "x" * 200}  # ~260 bytes a span on the wire
    try:
        for step in (0, 1):
            with otr.episode(step=step) as ep:
                tid, root = int(ep.trace_id, 16), ep.root.span_id
                spans = [_span(tid, 0x100 + i, root, f"s{step}-{i}") for i in range(8)]
                spans = [ReadableSpan(name=s.name, context=s.context, parent=s.parent, attributes=padding,
                                      start_time=s.start_time, end_time=s.end_time) for s in spans]
                assert to_gateway.export(spans).name == "SUCCESS"
                ep.reward(1.0)
            otr.end_step(step)  # kept: its bytes are given back once its renderer has pulled them
            assert otr.flush(30)
        assert otr.flush(30)
    finally:
        otr.shutdown()
    totals = otr.stats()["totals"]
    names = [s["name"] for s in sink.spans() if s["name"].startswith("s")]
    held = {step: len([n for n in names if n.startswith(f"s{step}-")]) for step in (0, 1)}
    assert held[0] == held[1] and 2 <= held[0] < 8, (held, totals)  # the same share both steps: bytes given back
    assert totals["dropped.held_bytes_full.spans"] == 2 * (8 - held[0])


def test_in_phoenix_the_server_spans_sit_in_the_episodes_project(phoenix, browser, tmp_path: Path) -> None:
    """The server's spans keep their own resource (no Phoenix project): Phoenix files them with
    the trace they belong to, in the run's project, not in ``default`` (the episode's spans go
    out first in each request); a dropped episode leaves nothing in any project."""
    import uuid

    project = f"otr-gateway-{uuid.uuid4().hex[:8]}"
    otr.configure(exporters=[OTLPSpanExporter(endpoint=phoenix.http_endpoint)],
                  sampler=otr.TailSampler(1, "top_bottom"), handle_signals=False,
                  resource_attributes={c.OPENINFERENCE_PROJECT_NAME: project},
                  gateway=otr.GatewayOptions(http_port=0, grpc_port=None))
    gateway = otr.gateway()
    assert gateway is not None and gateway.http_endpoint
    env = {"OTEL_EXPORTER_OTLP_ENDPOINT": gateway.http_endpoint, "OTEL_EXPORTER_OTLP_PROTOCOL": "http/protobuf",
           "OTEL_BSP_SCHEDULE_DELAY": "50", "OTEL_BLRP_SCHEDULE_DELAY": "50"}
    trace_ids = []
    try:
        with serve(env) as server:
            client = httpx.Client(base_url=server.url, event_hooks=otr.httpx_event_hooks())
            for i in range(2):
                with otr.episode(step=0, sample_index=i) as ep:
                    trace_ids.append(ep.trace_id)
                    with ep.turn() as turn, turn.generation("policy") as gen:
                        body = {"model": "policy", "max_tokens": 50, "messages": [{"role": "user", "content": "hi"}]}
                        gen.output(client.post("/v1/chat/completions", json=body).json()["choices"][0]
                                   ["message"]["content"])
                    ep.reward(float(i))
            _wait(lambda: _totals().get("gateway.spans", 0) >= 4, "the server's spans")
        otr.end_step(0)  # one kept (the better), one dropped
        assert otr.flush(30)
    finally:
        otr.shutdown()
    kept, dropped = trace_ids[1], trace_ids[0]
    spans = phoenix.wait_for_spans(project, 1, trace_ids=[kept])
    deadline = time.monotonic() + 60
    while ENGINE_SPAN not in {s["name"] for s in spans} and time.monotonic() < deadline:
        time.sleep(0.2)
        spans = phoenix.spans(project, trace_id=[kept])
    assert ENGINE_SPAN in {s["name"] for s in spans}, sorted(s["name"] for s in spans)
    assert phoenix.spans("default", trace_id=[kept, dropped]) == []
    assert phoenix.spans(project, trace_id=[dropped]) == []
    generation = [s for s in spans if s["attributes"].get(c.RL_SPAN_KIND) == c.KIND_GENERATION]
    assert generation[0]["attributes"][c.RL_SERVER_QUEUE_SECONDS] == pytest.approx(
        timings(50)[c.GEN_AI_LATENCY_TIME_IN_QUEUE])
    # as a person sees it: the engine's span in the episode's trace tree, under the chat span
    from browser_support import save_screenshot, wait_for
    from selenium.webdriver.common.by import By
    from test_phoenix_browser import _tree_node

    shots = Path(os.environ.get("OTR_SCREENSHOTS", tmp_path))
    browser.get(f"{phoenix.base_url}/redirects/traces/{kept}")
    wait_for(browser, lambda d: d.find_elements(By.XPATH, _tree_node(ENGINE_SPAN))
             and d.find_elements(By.XPATH, _tree_node("chat policy")),
             "the engine span and the chat span in Phoenix's trace tree", shots / "phoenix-gateway.png")
    save_screenshot(browser, shots / "phoenix-gateway.png")


def test_async_episodes_with_the_stock_httpx_instrumentation_leave_no_orphans(sink: OtlpSink) -> None:
    """The issue's async run: episodes run concurrently in one event loop, their requests go
    through the stock ``HTTPXClientInstrumentor`` (no header helper of ours): the server gets
    the episode's baggage from the context, its spans follow their episode, and the dropped
    episodes leave nothing in the collector."""
    import asyncio

    from opentelemetry.instrumentation.httpx import HTTPXClientInstrumentor

    gateway = _configure(sink)
    instrumentor = HTTPXClientInstrumentor()
    instrumentor.instrument(tracer_provider=otr.tracer_provider())
    trace_ids: dict[int, str] = {}
    try:
        with serve(_server_env(gateway, "grpc")) as server:

            async def one(client: httpx.AsyncClient, i: int) -> None:
                with otr.episode(step=0, group_id=f"g{i // 3}", sample_index=i) as ep:
                    trace_ids[i] = ep.trace_id
                    with ep.turn() as turn, turn.generation("policy") as gen:
                        body = {"model": "policy", "max_tokens": 10, "messages": [{"role": "user", "content": "hi"}]}
                        reply = await client.post("/v1/chat/completions", json=body)
                        gen.output(reply.json()["choices"][0]["message"]["content"])
                    ep.reward(float(i))

            async def run() -> None:
                async with httpx.AsyncClient(base_url=server.url) as client:
                    await asyncio.gather(*(one(client, i) for i in range(EPISODES)))

            asyncio.run(run())
            _wait(lambda: _totals().get("gateway.spans", 0) >= 2 * EPISODES, "the server's spans")
        otr.end_step(0)
        assert otr.flush(30)
    finally:
        instrumentor.uninstrument()
        otr.shutdown()
    spans = sink.spans()
    kept = {s["trace_id"] for s in spans if s["attributes"].get(c.RL_SPAN_KIND) == c.KIND_EPISODE}
    assert kept == {trace_ids[0], trace_ids[EPISODES - 1]}
    assert [s for s in spans if s["trace_id"] not in kept] == []  # no orphan
    engine = [s for s in spans if s["name"] == ENGINE_SPAN]
    assert {s["trace_id"] for s in engine} == kept
    for span in engine:  # the stock instrumentation sent the episode's baggage
        episode = next(i for i, t in trace_ids.items() if t == span["trace_id"])
        assert span["attributes"][c.RL_GROUP_ID] == f"g{episode // 3}"
        assert span["attributes"][c.RL_RUN_ID] == "gateway-run"
    # the client span of the stock instrumentation sits between the generation and the server
    clients = [s for s in spans if s["name"] == "POST" and s["service"] == "trainer"]
    assert len(clients) == KEPT
    generations = [s for s in spans if s["attributes"].get(c.RL_SPAN_KIND) == c.KIND_GENERATION]
    assert [g["attributes"][c.RL_SERVER_QUEUE_SECONDS] for g in generations] == [
        pytest.approx(timings(10)[c.GEN_AI_LATENCY_TIME_IN_QUEUE])] * KEPT  # lent through the client span


def test_reconfiguring_with_a_gateway_leaks_no_thread_and_frees_the_ports(sink: OtlpSink) -> None:
    """A run replaced by another stops its gateway: its threads end and its ports are free for
    the next run (the default ports are fixed: the new one must be able to take them)."""
    import threading

    def gateway_threads() -> set[str]:
        return {t.name for t in threading.enumerate() if t.name.startswith("otel-rollouts-gateway")}

    assert gateway_threads() == set()
    first = _configure(sink)
    ports = (first.http_port, first.grpc_port)
    to_gateway = OTLPSpanExporter(endpoint=f"{first.http_endpoint}/v1/traces")
    assert to_gateway.export([_span(0xABC, 0x1, 0x2)]).name == "SUCCESS"  # its threads have worked
    over_grpc = GrpcExporter(endpoint=f"127.0.0.1:{first.grpc_port}", insecure=True)
    assert over_grpc.export([_span(0xABC, 0x3, 0x2)]).name == "SUCCESS"
    over_grpc.shutdown()
    with socket.socket() as probe:
        assert probe.connect_ex(("127.0.0.1", ports[0])) == 0
    try:
        for _ in range(3):
            otr.configure(exporters=[OTLPSpanExporter(endpoint=sink.endpoint)], handle_signals=False,
                          gateway=otr.GatewayOptions(http_port=ports[0], grpc_port=ports[1]))
            again = otr.gateway()
            assert again is not None and (again.http_port, again.grpc_port) == ports
    finally:
        otr.shutdown()
    deadline = time.monotonic() + 10
    while gateway_threads() and time.monotonic() < deadline:
        time.sleep(0.02)
    assert gateway_threads() == set()


def _raw(port: int, data: bytes, timeout: float = 10.0) -> bytes:
    """Send ``data`` on a new connection to the gateway and read until it closes or answers."""
    with socket.create_connection(("127.0.0.1", port), timeout=timeout) as conn:
        conn.sendall(data)
        answer = b""
        while b"\r\n\r\n" not in answer:
            chunk = conn.recv(4096)
            if not chunk:
                break
            answer += chunk
        return answer


def test_hostile_requests_get_an_answer_and_reach_nothing(sink: OtlpSink, capfd: pytest.CaptureFixture[str]) -> None:
    """What a misbehaving neighbour sends is answered with the right status by the gateway's
    own process, counted, and never printed into the training process: deeply nested JSON (a
    RecursionError in a JSON parser), a negative Content-Length, a parentless span carrying a
    dropped episode's trace id."""
    gateway = _configure(sink)
    url = f"{gateway.http_endpoint}/v1/traces"
    port = gateway.http_port
    assert port is not None
    try:
        ids = {}
        for i in range(4):
            with otr.episode(step=0, sample_index=i) as ep:
                ids[i] = int(ep.trace_id, 16)
                ep.reward(float(i))
        otr.end_step(0)  # keeps 0 and 3, drops 1 and 2
        nested = b'{"resourceSpans": ' + b"[" * 100_000 + b"]" * 100_000 + b"}"
        status, _ = _post(url, nested, {"Content-Type": "application/json"})
        assert status == 400
        assert _raw(port, b"POST /v1/traces HTTP/1.1\r\nHost: x\r\nContent-Length: -5\r\n\r\n").startswith(
            b"HTTP/1.1 400")
        # a span with no parent is no episode's, unless its trace is an episode's: then it
        # shares its fate (dropped here), never exported as a fragment
        to_gateway = OTLPSpanExporter(endpoint=url)
        parentless = ReadableSpan(name="parentless-of-dropped", context=SpanContext(
            ids[1], 0x77, is_remote=False, trace_flags=TraceFlags(TraceFlags.SAMPLED)), start_time=1, end_time=2)
        assert to_gateway.export([parentless]).name == "SUCCESS"
        _wait(lambda: _totals().get("dropped.gateway_spans", 0) == 1, "the parentless span dropped")
        assert otr.flush(30)
    finally:
        otr.shutdown()
    assert "parentless-of-dropped" not in {s["name"] for s in sink.spans()}
    assert otr.stats()["totals"]["errors.gateway_decode"] == 1  # the nested JSON (h11 refused the -5 itself)
    captured = capfd.readouterr()
    assert "RecursionError" not in captured.err + captured.out and "Traceback" not in captured.err


def test_a_connection_that_sends_its_head_slowly_is_closed(sink: OtlpSink) -> None:
    """A slow-loris client (one byte at a time, or nothing at all) holds a connection for at most
    ``header_timeout_s`` (5 s by default): the gateway closes it, counted; a whole request on
    another connection meanwhile is served."""
    gateway = _configure(sink)
    port = gateway.http_port
    assert port is not None
    try:
        silent = socket.create_connection(("127.0.0.1", port), timeout=10)
        dribbling = socket.create_connection(("127.0.0.1", port), timeout=10)
        started = time.monotonic()
        closed_at = None
        for byte in b"POST /v1/traces HTTP/1.1\r\nHost: x\r\nContent-Type: application/x-protobuf\r\n":
            try:
                dribbling.sendall(bytes([byte]))
            except OSError:
                closed_at = time.monotonic()
                break
            dribbling.settimeout(0.2)
            try:
                if dribbling.recv(1) == b"":
                    closed_at = time.monotonic()
                    break
            except TimeoutError:
                pass
        assert closed_at is not None and closed_at - started < 7.0, "the dribbling connection was not closed"
        silent.settimeout(5)
        assert silent.recv(1) == b""  # closed by the gateway, not by us
        to_gateway = OTLPSpanExporter(endpoint=f"{gateway.http_endpoint}/v1/traces")
        assert to_gateway.export([_span(0xABC, 0x1, 0x2)]).name == "SUCCESS"
        silent.close()
        dribbling.close()
        assert otr.flush(30)
    finally:
        otr.shutdown()
    assert otr.stats()["totals"]["errors.gateway_slow_head"] >= 2


def test_a_request_made_outside_any_episode_passes_through_whole(sink: OtlpSink) -> None:
    """An eval request, a health check, a weight sync: made outside any episode with the stock
    httpx instrumentation, the request has a client span, so the server's spans have a parent.
    They are no episode's and pass through at once (not held ``hold_s`` and dropped as
    "unknown"): the collector gets the client span, the server's spans and its log record, one
    trace, whole."""
    from opentelemetry.instrumentation.httpx import HTTPXClientInstrumentor

    gateway = _configure(sink)  # hold_s: the default 30 s
    instrumentor = HTTPXClientInstrumentor()
    instrumentor.instrument(tracer_provider=otr.tracer_provider())
    try:
        with serve(_server_env(gateway, "http/protobuf")) as server, httpx.Client(base_url=server.url) as client:
            body = {"model": "policy", "max_tokens": 10, "messages": [{"role": "user", "content": "eval"}]}
            assert client.post("/v1/chat/completions", json=body).status_code == 200
            deadline = time.monotonic() + 15  # well inside hold_s: nothing was held
            while not [s for s in sink.spans() if s["name"] == ENGINE_SPAN]:
                assert time.monotonic() < deadline, f"the server's spans were held; stats: {_totals()}"
                otr.flush(1)
                time.sleep(0.05)
        assert otr.flush(30)
    finally:
        instrumentor.uninstrument()
        otr.shutdown()
    spans = sink.spans()
    engine = [s for s in spans if s["name"] == ENGINE_SPAN]
    assert len(engine) == 1
    trace = {s["name"]: s for s in spans if s["trace_id"] == engine[0]["trace_id"]}
    assert {"POST", SERVER_SPAN, ENGINE_SPAN} <= set(trace)  # the client's span and the server's
    assert trace["POST"]["service"] == "trainer" and trace[SERVER_SPAN]["service"] == "toy-vllm"
    assert [r for r in sink.logs() if r["trace_id"] == engine[0]["trace_id"]]  # its log record too
    totals = otr.stats()["totals"]
    assert totals.get("dropped.gateway_unknown.spans", 0) == 0
    assert totals["gateway.passed_through"] >= 2


def test_two_gateways_starting_at_once_for_the_same_ports_leave_one_serving(tmp_path: Path) -> None:
    """Two processes of a node start a gateway for the same ports at the same moment (two Ray
    actors configuring together): one gateway serves both ports and the control socket, the
    other binds nothing. The race, made certain: the first is held between its HTTP and its gRPC
    bind while the second starts; without the node's lock the second took the gRPC port, the
    first then served HTTP alone, and each made the control socket (the later one replacing
    the other's): the node's clients split between two gateways."""
    import threading

    from otel_rollouts.correlate import gateway_node
    from otel_rollouts.delivery.gateway_channel import gateway_dir

    ports = free_ports(2)
    config = {"address": str(gateway_dir() / f"gw-test-race-{os.getpid()}-{ports[0]}-{ports[1]}"),
              "host": "127.0.0.1", "http_port": ports[0], "grpc_port": ports[1], "hold_s": 1.0,
              "max_held_bytes": 1 << 20, "unknown": "drop", "linger_s": 0.0, "span_recipes": [],
              "log_recipe": None, "limits": {}}
    first, second = gateway_node.Node(dict(config)), gateway_node.Node(dict(config))
    held, answers = threading.Event(), {}
    start_grpc = first.receivers.start_grpc

    def grpc_later(host: str, port: int) -> int:
        held.wait(30)
        return start_grpc(host, port)

    first.receivers.start_grpc = grpc_later  # type: ignore[method-assign]
    threads = [threading.Thread(target=lambda n=n, name=name: answers.__setitem__(name, n.start()))
               for n, name in ((first, "first"), (second, "second"))]
    try:
        threads[0].start()
        _wait(lambda: first.receivers.http_port is not None, "the first gateway's HTTP port", 30)
        threads[1].start()
        threads[1].join(2)  # with the lock it waits for the first one: not done yet
        held.set()
        for thread in threads:
            thread.join(30)
        serving = [name for name, node in (("first", first), ("second", second)) if node.listener is not None]
        assert serving == ["first"], answers
        assert answers["first"]["http_port"] == ports[0] and answers["first"]["grpc_port"] == ports[1]
        assert answers["second"]["http_port"] is None and answers["second"]["grpc_port"] is None
        assert len(answers["second"]["errors"]) == 2, answers["second"]  # both ports said busy
    finally:
        held.set()
        for node in (first, second):
            node.receivers.stop(1.0)
            if node.listener is not None:
                node.listener.close()
        for suffix in (".key", ".lock"):
            Path(config["address"] + suffix).unlink(missing_ok=True)
