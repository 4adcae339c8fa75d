"""The episode's identity as W3C baggage: sent by the stock client instrumentations, copied onto
the spans (and logs) of a real instrumented server by ``otr.copy_baggage_to_spans()``.

Inside an episode the OpenTelemetry context itself carries rl.run.id, rl.step, rl.episode.id and
rl.group.id as baggage, so OpenTelemetry's own httpx / requests / aiohttp / grpc instrumentations
send them with ``traceparent``, with no header helper of ours. The server is a real process
(``tests/instrumented_server.py``: FastAPI instrumentation, OTLP export to a loopback sink).
"""

from __future__ import annotations

import asyncio
import threading
import time
from collections.abc import Callable, Iterator, Mapping
from concurrent import futures
from typing import Any

import aiohttp
import grpc  # type: ignore[import-untyped]
import httpx
import pytest
import requests
from instrumented_server import ENGINE_SPAN, LOGGER_NAME, SERVER_SPAN, serve
from opentelemetry import baggage, trace
from opentelemetry import context as otel_context
from opentelemetry.baggage.propagation import W3CBaggagePropagator
from opentelemetry.instrumentation.aiohttp_client import AioHttpClientInstrumentor
from opentelemetry.instrumentation.grpc import GrpcInstrumentorClient, server_interceptor
from opentelemetry.instrumentation.httpx import HTTPXClientInstrumentor
from opentelemetry.instrumentation.requests import RequestsInstrumentor
from opentelemetry.proto.collector.trace.v1 import trace_service_pb2, trace_service_pb2_grpc
from opentelemetry.sdk.trace import TracerProvider
from opentelemetry.sdk.trace.export import SimpleSpanProcessor
from opentelemetry.sdk.trace.export.in_memory_span_exporter import InMemorySpanExporter
from otlp_sink import OtlpSink
from otr_helpers import configure_memory

import otel_rollouts as otr
from otel_rollouts import conventions as c

RUN_ID = "run-bag"
RL_KEYS = set(c.BAGGAGE_KEYS)


# --- fixtures ------------------------------------------------------------------------------------
@pytest.fixture(scope="module")
def toy_server(tmp_path_factory: pytest.TempPathFactory) -> Iterator[tuple[str, OtlpSink]]:
    """The instrumented server (its own process), exporting spans and logs to a loopback sink."""
    sink = OtlpSink(tmp_path_factory.mktemp("baggage-sink")).start()
    env = {
        c.ENV_OTLP_ENDPOINT: f"http://127.0.0.1:{sink.port}",
        c.ENV_OTLP_PROTOCOL: "http/protobuf",
        "OTEL_BSP_SCHEDULE_DELAY": "50",
        "OTEL_BLRP_SCHEDULE_DELAY": "50",
    }
    try:
        with serve(env) as server:
            yield server.url, sink
    finally:
        sink.kill()


@pytest.fixture
def rollouts() -> Iterator[Any]:
    """A configured run. The instrumentations are given its provider explicitly: the same as
    ``set_global_provider=True`` for them, without taking OpenTelemetry's once-per-process global
    slot away from the tests that come after (tests share a process)."""
    configure_memory(64, "first", run_id=RUN_ID, handle_signals=False)
    try:
        from otel_rollouts._core import runtime

        rt = runtime.installed()
        assert rt is not None
        yield rt
    finally:
        otr.shutdown()


def _expected(ep: otr.Episode, group: str) -> dict[str, str]:
    return {c.RL_RUN_ID: RUN_ID, c.RL_STEP: str(ep.step), c.RL_EPISODE_ID: str(ep.episode_id),
            c.RL_GROUP_ID: group}


def _wait_for(sink: OtlpSink, predicate: Callable[[dict[str, Any]], bool], count: int,
              timeout: float = 20.0) -> list[dict[str, Any]]:
    """The sink's spans matching ``predicate``, once there are ``count`` of them (or the deadline)."""
    deadline = time.monotonic() + timeout
    while True:
        found = [s for s in sink.spans() if predicate(s)]
        if len(found) >= count or time.monotonic() > deadline:
            return found
        time.sleep(0.05)


def _body(max_tokens: int) -> dict[str, Any]:
    # max_tokens makes each request's llm_request span recognisable (its time_in_queue)
    return {"model": "policy", "max_tokens": max_tokens, "messages": [{"role": "user", "content": "2+2?"}]}


def _server_spans_of(sink: OtlpSink, max_tokens: int) -> list[dict[str, Any]]:
    """The server span and the llm_request span of the request made with ``max_tokens``."""
    queue = max_tokens / 1000
    engine = _wait_for(sink, lambda s: s["name"] == ENGINE_SPAN
                       and s["attributes"].get(c.GEN_AI_LATENCY_TIME_IN_QUEUE) == queue, 1)
    assert len(engine) == 1, f"no llm_request span for max_tokens={max_tokens}"
    trace_id = engine[0]["trace_id"]
    server = _wait_for(sink, lambda s: s["name"] == SERVER_SPAN and s["trace_id"] == trace_id, 1)
    assert len(server) == 1
    return [server[0], engine[0]]


def _rl(attributes: dict[str, Any]) -> dict[str, Any]:
    return {k: v for k, v in attributes.items() if k in RL_KEYS}


# --- the four stock client instrumentations --------------------------------------------------------
def _httpx(url: str, body: dict[str, Any]) -> None:
    with httpx.Client() as client:
        client.post(f"{url}/v1/chat/completions", json=body).raise_for_status()


def _requests(url: str, body: dict[str, Any]) -> None:
    requests.post(f"{url}/v1/chat/completions", json=body, timeout=30).raise_for_status()


def _aiohttp(url: str, body: dict[str, Any]) -> None:
    async def call() -> None:
        async with aiohttp.ClientSession() as session:
            async with session.post(f"{url}/v1/chat/completions", json=body) as response:
                response.raise_for_status()
                await response.read()

    asyncio.run(call())


CLIENTS: dict[str, tuple[Any, Callable[[str, dict[str, Any]], None]]] = {
    "httpx": (HTTPXClientInstrumentor, _httpx),
    "requests": (RequestsInstrumentor, _requests),
    "aiohttp": (AioHttpClientInstrumentor, _aiohttp),
}


@pytest.mark.parametrize("name", list(CLIENTS))
def test_stock_http_instrumentation_sends_the_episode_identity_to_a_real_server(
        name: str, toy_server: tuple[str, OtlpSink], rollouts: Any) -> None:
    url, sink = toy_server
    instrumentor_class, call = CLIENTS[name]
    instrumentor = instrumentor_class()
    instrumentor.instrument(tracer_provider=rollouts.provider)
    inside, outside = 100 + 2 * list(CLIENTS).index(name), 101 + 2 * list(CLIENTS).index(name)
    try:
        group = f"group-{name}"
        with otr.episode(step=4, group_id=group) as ep:
            with ep.turn() as turn, turn.generation("policy"):
                trace_id = trace.get_current_span().get_span_context().trace_id
                call(url, _body(inside))
            ep.reward(1.0)
        call(url, _body(outside))  # no episode: nothing rl.* leaves
    finally:
        instrumentor.uninstrument()

    expected = _expected(ep, group)
    for span in _server_spans_of(sink, inside):
        assert span["trace_id"] == f"{trace_id:032x}"  # the stock propagator's traceparent
        assert _rl(span["attributes"]) == expected, span  # its baggage, copied by the server
    for span in _server_spans_of(sink, outside):
        assert _rl(span["attributes"]) == {}, span
        assert span["trace_id"] != f"{trace_id:032x}"


def test_server_logs_carry_the_episode_identity(toy_server: tuple[str, OtlpSink], rollouts: Any) -> None:
    """The server's log record, written while serving the episode's request, carries its trace
    id and (``copy_baggage_to_logs``) its identity."""
    url, sink = toy_server
    instrumentor = HTTPXClientInstrumentor()
    instrumentor.instrument(tracer_provider=rollouts.provider)
    try:
        with otr.episode(step=6, group_id="g-logs") as ep:
            trace_id = trace.get_current_span().get_span_context().trace_id
            _httpx(url, _body(120))
    finally:
        instrumentor.uninstrument()
    deadline = time.monotonic() + 20
    while True:
        logs = [r for r in sink.logs() if r["trace_id"] == f"{trace_id:032x}"]
        if logs or time.monotonic() > deadline:
            break
        time.sleep(0.05)
    assert [r["scope"] for r in logs] == [LOGGER_NAME]
    assert _rl(logs[0]["attributes"]) == _expected(ep, "g-logs")


# --- grpc ----------------------------------------------------------------------------------------
class _TraceService(trace_service_pb2_grpc.TraceServiceServicer):
    """OTLP's TraceService as a ready-made gRPC service: records each call's metadata."""

    def __init__(self, provider: TracerProvider) -> None:
        self.metadata: list[dict[str, str]] = []
        self.tracer = provider.get_tracer("test")

    def Export(self, request: Any, context: Any) -> Any:  # noqa: N802 - gRPC's naming
        self.metadata.append({k: v for k, v in context.invocation_metadata() if isinstance(v, str)})
        self.tracer.start_span("handled").end()  # a child of the server span
        return trace_service_pb2.ExportTraceServiceResponse()


@pytest.fixture
def grpc_server() -> Iterator[tuple[str, _TraceService, InMemorySpanExporter]]:
    """A real gRPC server on loopback, instrumented server-side with its own provider that
    copies the rl.* baggage onto its spans."""
    provider = TracerProvider()
    assert otr.copy_baggage_to_spans(provider) is not None
    exporter = InMemorySpanExporter()
    provider.add_span_processor(SimpleSpanProcessor(exporter))
    service = _TraceService(provider)
    server = grpc.server(futures.ThreadPoolExecutor(max_workers=2),
                         interceptors=[server_interceptor(tracer_provider=provider)])
    trace_service_pb2_grpc.add_TraceServiceServicer_to_server(service, server)
    port = server.add_insecure_port("127.0.0.1:0")
    server.start()
    try:
        yield f"127.0.0.1:{port}", service, exporter
    finally:
        server.stop(grace=None)
        provider.shutdown()


def test_stock_grpc_instrumentation_sends_the_episode_identity(grpc_server: Any, rollouts: Any) -> None:
    address, service, exporter = grpc_server
    instrumentor = GrpcInstrumentorClient()
    instrumentor.instrument(tracer_provider=rollouts.provider)
    try:
        with grpc.insecure_channel(address) as channel:
            stub = trace_service_pb2_grpc.TraceServiceStub(channel)
            with otr.episode(step=2, group_id="g-grpc") as ep:
                trace_id = trace.get_current_span().get_span_context().trace_id
                stub.Export(trace_service_pb2.ExportTraceServiceRequest(), timeout=10)
            stub.Export(trace_service_pb2.ExportTraceServiceRequest(), timeout=10)
    finally:
        instrumentor.uninstrument()

    inside, outside = service.metadata
    sent = baggage.get_all(W3CBaggagePropagator().extract({"baggage": inside.get("baggage", "")}))
    assert {k: v for k, v in sent.items() if k in RL_KEYS} == _expected(ep, "g-grpc")
    assert not any(k in RL_KEYS for k in baggage.get_all(
        W3CBaggagePropagator().extract({"baggage": outside.get("baggage", "")})))
    spans = exporter.get_finished_spans()
    episode_spans = [s for s in spans if s.context.trace_id == trace_id]
    assert {s.name for s in episode_spans} == {"/opentelemetry.proto.collector.trace.v1.TraceService/Export",
                                                 "handled"}
    for span in episode_spans:
        assert _rl(dict(span.attributes or {})) == _expected(ep, "g-grpc")
    assert all(_rl(dict(s.attributes or {})) == {} for s in spans if s.context.trace_id != trace_id)


# --- the rules, with inject_headers ------------------------------------------------------------
def _sent(headers: Mapping[str, str]) -> dict[str, Any]:
    return dict(baggage.get_all(W3CBaggagePropagator().extract(headers)))


def test_user_baggage_stays_and_another_episodes_identity_is_replaced(rollouts: Any) -> None:
    # what came in from upstream: the user's own entry, and an upstream episode's identity
    upstream = otel_context.get_current()
    for key, value in (("tenant", "a"), (c.RL_EPISODE_ID, "upstream-ep"), (c.RL_GROUP_ID, "upstream-g"),
                       (c.RL_STEP, "99")):
        upstream = baggage.set_baggage(key, value, upstream)
    token = otel_context.attach(upstream)
    try:
        with otr.episode(step=1) as ep:  # no group: the upstream one must not be sent as ours
            assert _sent(otr.inject_headers({})) == {
                "tenant": "a", c.RL_RUN_ID: RUN_ID, c.RL_STEP: "1", c.RL_EPISODE_ID: ep.episode_id}
            # an entry the user sets inside the episode stays, under a key of its own
            inner = otel_context.attach(baggage.set_baggage("user.id", "u7"))
            try:
                with ep.turn():
                    assert _sent(otr.inject_headers({}))["user.id"] == "u7"
            finally:
                otel_context.detach(inner)
        assert _sent(otr.inject_headers({}))[c.RL_EPISODE_ID] == "upstream-ep"  # back as it was
    finally:
        otel_context.detach(token)


def test_inside_its_episode_the_episodes_identity_wins_over_the_users_baggage(
        rollouts: Any) -> None:
    """An rl.* identity key the user sets with OpenTelemetry's baggage API inside an episode is
    replaced by the episode's own in what leaves (and in the context its spans run under); the
    user's other entries stay, and the user's value is theirs again once the episode is over."""
    with otr.episode(step=2, group_id="g-own") as ep:
        mine = baggage.set_baggage(c.RL_STEP, "99", baggage.set_baggage(
            c.RL_EPISODE_ID, "mine", baggage.set_baggage("tenant", "t1")))
        token = otel_context.attach(mine)
        try:
            # no span of ours entered since: the headers are fixed as they are made
            assert _sent(otr.inject_headers({})) == {"tenant": "t1", **_expected(ep, "g-own")}
            assert _sent(otr.openai_extra_headers()) == {"tenant": "t1", **_expected(ep, "g-own")}
            with ep.turn() as turn, turn.generation("policy"):
                # the spans of the episode run under its identity: stock propagators send it too
                assert baggage.get_baggage(c.RL_EPISODE_ID) == ep.episode_id
                assert _sent(otr.inject_headers({})) == {"tenant": "t1", **_expected(ep, "g-own")}
            assert baggage.get_baggage(c.RL_EPISODE_ID) == "mine"  # the user's context, untouched
        finally:
            otel_context.detach(token)
    ctx = baggage.set_baggage(c.RL_EPISODE_ID, "mine")
    assert _sent(otr.inject_headers({}, context=ctx)) == {c.RL_EPISODE_ID: "mine"}  # no episode


def test_stock_instrumentation_sends_the_episodes_identity_over_the_users(
        toy_server: tuple[str, OtlpSink], rollouts: Any) -> None:
    url, sink = toy_server
    instrumentor = HTTPXClientInstrumentor()
    instrumentor.instrument(tracer_provider=rollouts.provider)
    try:
        with otr.episode(step=5, group_id="g-stock-own") as ep:
            token = otel_context.attach(baggage.set_baggage(c.RL_EPISODE_ID, "mine"))
            try:
                with ep.turn() as turn, turn.generation("policy"):
                    _httpx(url, _body(190))
            finally:
                otel_context.detach(token)
    finally:
        instrumentor.uninstrument()
    for span in _server_spans_of(sink, 190):
        assert _rl(span["attributes"]) == _expected(ep, "g-stock-own"), span


def test_a_span_entered_in_another_thread_carries_the_identity(rollouts: Any) -> None:
    """A turn entered in a plain thread (no context copied) still sends the episode's keys."""
    seen: list[dict[str, Any]] = []
    with otr.episode(step=3, group_id="g-thread") as ep:
        def work() -> None:
            with ep.turn() as turn, turn.generation("policy"):
                seen.append(_sent(otr.inject_headers({})))

        thread = threading.Thread(target=work)
        thread.start()
        thread.join(30)
    assert seen == [_expected(ep, "g-thread")]


def test_the_step_is_the_episodes_when_it_starts(rollouts: Any) -> None:
    """``otr.set_step`` between making the handle and entering it: the episode, and its
    baggage, take the step current when it starts."""
    ep = otr.episode()
    otr.set_step(7)
    with ep:
        assert ep.step == 7
        assert _sent(otr.inject_headers({}))[c.RL_STEP] == "7"
    assert not RL_KEYS & set(_sent(otr.inject_headers({})))


def test_copy_baggage_to_spans_keys_and_a_non_sdk_provider() -> None:
    provider = TracerProvider()
    exporter = InMemorySpanExporter()
    assert otr.copy_baggage_to_spans(provider, keys=[c.RL_STEP]) is not None
    provider.add_span_processor(SimpleSpanProcessor(exporter))
    ctx = baggage.set_baggage(c.RL_STEP, "5", baggage.set_baggage(c.RL_EPISODE_ID, "e", baggage.set_baggage("x", "y")))
    provider.get_tracer("t").start_span("s", context=ctx).end()
    assert dict(exporter.get_finished_spans()[0].attributes or {}) == {c.RL_STEP: "5"}
    # not an SDK provider: nothing added, nothing raised
    assert otr.copy_baggage_to_spans(trace.NoOpTracerProvider()) is None
    provider.shutdown()


def test_instrumented_server_health_is_a_root_span(toy_server: tuple[str, OtlpSink]) -> None:
    url, sink = toy_server
    headers = {"traceparent": "00-0af7651916cd43dd8448eb211c80319c-b7ad6b7169203331-01",
               "baggage": f"{c.RL_STEP}=1"}
    assert httpx.get(f"{url}/health", headers=headers).status_code == 200
    health = _wait_for(sink, lambda s: s["name"] == "GET /health", 1)
    assert health and health[0]["parent_id"] is None
    assert health[0]["trace_id"] != "0af7651916cd43dd8448eb211c80319c"
    assert _rl(health[0]["attributes"]) == {}
