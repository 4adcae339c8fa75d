"""W3C trace context and baggage out of an episode, into real HTTP requests, and back."""

from __future__ import annotations

import asyncio
import http.server
import threading
from collections.abc import Iterator

import httpx
import pytest
import requests
from opentelemetry import baggage, propagate, trace
from opentelemetry import context as otel_context
from opentelemetry.sdk.trace import TracerProvider
from opentelemetry.sdk.trace.export import SimpleSpanProcessor
from opentelemetry.sdk.trace.export.in_memory_span_exporter import InMemorySpanExporter
from opentelemetry.trace.propagation.tracecontext import TraceContextTextMapPropagator
from otr_helpers import configure_memory

import otel_rollouts as otr
from otel_rollouts import conventions as c


@pytest.fixture
def exported() -> Iterator[InMemorySpanExporter]:
    exporter = configure_memory(8, "first", handle_signals=False)
    yield exporter
    otr.shutdown()


class _Recorder(http.server.BaseHTTPRequestHandler):
    seen: list[dict[str, str]] = []

    def do_POST(self) -> None:  # noqa: N802 - http.server's naming
        length = int(self.headers.get("content-length") or 0)
        self.rfile.read(length)
        type(self).seen.append({k.lower(): v for k, v in self.headers.items()})
        body = b'{"ok": true}'
        self.send_response(200)
        self.send_header("content-type", "application/json")
        self.send_header("content-length", str(len(body)))
        self.end_headers()
        self.wfile.write(body)

    do_GET = do_POST  # noqa: N815

    def log_message(self, *args) -> None:
        return None


@pytest.fixture
def server() -> Iterator[tuple[str, list[dict[str, str]]]]:
    """A real HTTP server on loopback that records the headers of each request."""
    handler = type("Recorder", (_Recorder,), {"seen": []})
    httpd = http.server.ThreadingHTTPServer(("127.0.0.1", 0), handler)
    thread = threading.Thread(target=httpd.serve_forever, daemon=True)
    thread.start()
    yield f"http://127.0.0.1:{httpd.server_address[1]}", handler.seen
    httpd.shutdown()
    httpd.server_close()


def _ids(headers: dict[str, str]) -> tuple[int, int]:
    """(trace id, parent span id) parsed by OpenTelemetry's own TraceContext propagator."""
    ctx = TraceContextTextMapPropagator().extract(headers)
    span_ctx = trace.get_current_span(ctx).get_span_context()
    assert span_ctx.is_valid, headers
    return span_ctx.trace_id, span_ctx.span_id


def _current_ids() -> tuple[int, int]:
    span_ctx = trace.get_current_span().get_span_context()
    return span_ctx.trace_id, span_ctx.span_id


def test_inject_headers_carries_the_current_generation_and_episode_baggage(exported):
    with otr.episode(step=3, episode_id="ep-7") as ep:
        with ep.turn() as turn, turn.generation("policy") as gen:
            headers = otr.inject_headers({"authorization": "Bearer x"})
            expected = _current_ids()
            gen.output("4")
        ep.reward(1.0)
    assert headers["authorization"] == "Bearer x"
    assert _ids(headers) == expected
    assert expected[0] == int(ep.trace_id, 16)
    assert headers["traceparent"].endswith("-01")  # sampled: the server records its spans
    remote = otr.extract_context(headers)
    assert baggage.get_baggage(c.RL_STEP, remote) == "3"
    assert baggage.get_baggage(c.RL_EPISODE_ID, remote) == "ep-7"
    # the generation span that was current is exported with exactly those ids
    otr.flush()
    gen_span = next(s for s in exported.get_finished_spans() if s.name == "chat policy")
    assert (gen_span.context.trace_id, gen_span.context.span_id) == expected


def test_the_stock_global_propagator_sees_the_episode_span(exported):
    with otr.episode(step=0) as ep:
        carrier: dict[str, str] = {}
        propagate.inject(carrier)  # OpenTelemetry's global propagator, nothing of ours
        expected = _current_ids()
        ep.reward(0.0)
    assert _ids(carrier) == expected


def test_outside_an_episode_nothing_is_injected_and_user_baggage_still_is(exported):
    assert "traceparent" not in otr.inject_headers()
    token = otel_context.attach(baggage.set_baggage("tenant", "a"))
    try:
        headers = otr.inject_headers()
    finally:
        otel_context.detach(token)
    assert "traceparent" not in headers
    assert "tenant=a" in headers["baggage"]


def test_extract_context_is_case_insensitive_and_parents_a_server_span(exported):
    server_spans = InMemorySpanExporter()
    server_provider = TracerProvider()  # stands for the server's own SDK
    server_provider.add_span_processor(SimpleSpanProcessor(server_spans))
    with otr.episode(step=1) as ep:
        with ep.turn() as turn, turn.generation("policy"):
            headers = {k.title(): v for k, v in otr.openai_extra_headers().items()}
            expected = _current_ids()
        ep.reward(1.0)
    assert "Traceparent" in headers
    parent = otr.extract_context(headers)
    server_provider.get_tracer("server").start_span("POST /v1/chat/completions", context=parent).end()
    (span,) = server_spans.get_finished_spans()
    assert span.context.trace_id == expected[0]
    assert span.parent.span_id == expected[1]
    assert span.parent.is_remote


def test_openai_extra_headers_keeps_given_headers(exported):
    with otr.episode(step=0) as ep:
        headers = otr.openai_extra_headers({"x-request-id": "r1"})
        expected = _current_ids()
        ep.reward(0.0)
    assert headers["x-request-id"] == "r1"
    assert _ids(headers) == expected


def test_httpx_event_hook_sends_the_context_of_each_request(exported, server):
    url, seen = server
    with httpx.Client(event_hooks=otr.httpx_event_hooks()) as client:
        with otr.episode(step=2, episode_id="e2") as ep:
            with ep.turn() as turn, turn.generation("policy"):
                client.post(url, json={"messages": []}).raise_for_status()
                expected = _current_ids()
            ep.reward(1.0)
        client.get(url).raise_for_status()  # after the episode: no context any more
    assert _ids(seen[0]) == expected
    assert "rl.episode.id=e2" in seen[0]["baggage"]
    assert "traceparent" not in seen[1]


def test_httpx_async_event_hook(exported, server):
    url, seen = server

    async def main() -> tuple[int, int]:
        async with httpx.AsyncClient(event_hooks=otr.httpx_event_hooks(asynchronous=True)) as client:
            async with otr.episode(step=4) as ep:
                async with ep.turn() as turn:
                    with turn.generation("policy"):
                        (await client.post(url, json={})).raise_for_status()
                        ids = _current_ids()
                ep.reward(1.0)
        return ids

    expected = asyncio.run(main())
    assert _ids(seen[0]) == expected


def test_requests_session_adapter(exported, server):
    url, seen = server
    session = otr.instrument_requests_session(requests.Session())
    with otr.episode(step=5) as ep:
        with ep.turn() as turn, turn.tool_call("search") as call:
            session.post(url, json={"q": "x"}).raise_for_status()
            expected = _current_ids()
            call.result("found")
        ep.reward(1.0)
    session.get(url).raise_for_status()
    assert _ids(seen[0]) == expected
    assert "rl.step=5" in seen[0]["baggage"]
    assert "traceparent" not in seen[1]
