"""End to end at a real receiver (Arize Phoenix): an instrumented rollout calls a real
OpenAI-compatible server process (FastAPI + OpenTelemetry's FastAPI instrumentation, exporting
OTLP itself), and a worker process; the receiver shows one trace per episode in which the
server's span is a child of the episode's generation span and the worker's spans sit under the
span that dispatched them."""

from __future__ import annotations

import concurrent.futures
import multiprocessing
import os
import subprocess
import sys
import tempfile
import time
import urllib.request
import uuid
from collections.abc import Iterator
from pathlib import Path

import httpx
import pytest
from openai_server import ENGINE_SPAN, SERVER_SPAN
from opentelemetry import trace
from opentelemetry.exporter.otlp.proto.http.trace_exporter import OTLPSpanExporter
from receivers import PhoenixReceiver, free_ports

import otel_rollouts as otr
from otel_rollouts import conventions as c

pytestmark = pytest.mark.slow

SERVER = Path(__file__).resolve().parents[1] / "openai_server.py"


@pytest.fixture(scope="module")
def project() -> str:
    return f"e2e-{uuid.uuid4().hex[:8]}"


@pytest.fixture(scope="module")
def server(phoenix: PhoenixReceiver, project: str) -> Iterator[str]:
    """The OpenAI-compatible server as its own process on a free loopback port."""
    (port,) = free_ports(1)
    env = {k: v for k, v in os.environ.items() if not k.startswith("OTEL_")}
    log = open(Path(tempfile.gettempdir()) / f"openai-server-{port}.log", "wb")  # noqa: SIM115
    proc = subprocess.Popen(
        [sys.executable, str(SERVER), "--port", str(port), "--endpoint", phoenix.http_endpoint,
         "--project", project],
        env=env, stdout=log, stderr=subprocess.STDOUT, stdin=subprocess.DEVNULL,
    )
    base = f"http://127.0.0.1:{port}"
    deadline = time.monotonic() + 60
    while True:
        assert proc.poll() is None, f"server exited with {proc.returncode}: see {log.name}"
        try:
            with urllib.request.urlopen(f"{base}/health", timeout=2) as response:
                if response.status == 200:
                    break
        except OSError:
            pass
        assert time.monotonic() < deadline, f"server not up after 60 s: see {log.name}"
        time.sleep(0.1)
    yield base
    proc.terminate()
    try:
        proc.wait(30)
    except subprocess.TimeoutExpired:
        proc.kill()
        proc.wait(10)
    log.close()


@pytest.fixture
def rollout(phoenix: PhoenixReceiver, project: str) -> Iterator[None]:
    """otel_rollouts with the stock OTLP/HTTP exporter to the same receiver and project."""
    otr.configure(
        service_name="rollout",
        exporters=[OTLPSpanExporter(endpoint=phoenix.http_endpoint)],
        sampler=otr.TailSampler(1, "first"),  # the first episode to complete is kept
        resource_attributes={c.OPENINFERENCE_PROJECT_NAME: project},
        handle_signals=False,
    )
    yield
    otr.shutdown()


def _chat(client: httpx.Client, base: str, text: str) -> dict:
    response = client.post(f"{base}/v1/chat/completions",
                           json={"model": "policy", "messages": [{"role": "user", "content": text}]})
    response.raise_for_status()
    return response.json()


def _hex_span_id() -> str:
    return f"{trace.get_current_span().get_span_context().span_id:016x}"


def _by_name(spans: list[dict]) -> dict[str, dict]:
    return {s["name"]: s for s in spans}


def test_the_server_span_is_a_child_of_the_generation_span(phoenix, server, rollout, project):
    episodes = []
    with httpx.Client(event_hooks=otr.httpx_event_hooks()) as client:
        for text in ("two plus two", "three plus three"):  # the second is dropped
            with otr.episode(step=0) as ep:
                with ep.turn() as turn, turn.generation("policy") as gen:
                    completion = _chat(client, server, text)
                    gen_id = _hex_span_id()
                    usage = completion["usage"]
                    gen.output(completion["choices"][0]["message"]["content"],
                               input_tokens=usage["prompt_tokens"],
                               output_tokens=usage["completion_tokens"])
                ep.reward(1.0)
            episodes.append((ep.trace_id, gen_id))
    otr.end_step(0)
    assert otr.flush(60)
    (kept_trace, kept_gen), (dropped_trace, _) = episodes

    # episode, turn, chat policy, reward (ours) + the server span and its llm_request child
    spans = phoenix.wait_for_spans(project, 6, trace_ids=[kept_trace])
    assert {s["context"]["trace_id"] for s in spans} == {kept_trace}  # one trace
    by_name = _by_name(spans)
    assert set(by_name) == {"episode", "turn", "chat policy", "reward", SERVER_SPAN, ENGINE_SPAN}
    assert by_name["chat policy"]["context"]["span_id"] == kept_gen
    assert by_name[SERVER_SPAN]["parent_id"] == kept_gen
    assert by_name[ENGINE_SPAN]["parent_id"] == by_name[SERVER_SPAN]["context"]["span_id"]
    assert by_name["episode"]["parent_id"] is None

    # The dropped episode: the server exported its own spans (it is not subject to our tail
    # sampler), so they reach the receiver as a fragment whose parent never arrives.
    fragment = phoenix.wait_for_spans(project, 2, trace_ids=[dropped_trace])
    assert {s["name"] for s in fragment} == {SERVER_SPAN, ENGINE_SPAN}


# --- a worker process that itself calls the server ------------------------------------------------
@otr.traced(kind="tool")
def judge(base: str, text: str) -> str:
    """Runs in a worker process: a tool span whose HTTP call reaches the server."""
    with httpx.Client(event_hooks=otr.httpx_event_hooks()) as client:
        return _chat(client, base, text)["choices"][0]["message"]["content"]


def test_worker_process_spans_arrive_in_the_episode_trace(phoenix, server, rollout, project):
    ctx = multiprocessing.get_context("spawn")  # nothing inherited: a fresh interpreter
    with concurrent.futures.ProcessPoolExecutor(1, mp_context=ctx) as pool:
        with otr.episode(step=1) as ep:
            with ep.turn():
                turn_id = _hex_span_id()
                verdict = otr.submit(pool, judge, server, "is 4 right?").result(timeout=120)
            ep.reward(1.0)
    assert verdict == "echo: is 4 right?"
    otr.end_step(1)
    assert otr.flush(60)

    # episode, turn, reward + execute_tool judge (worker) + the server's two spans
    spans = phoenix.wait_for_spans(project, 6, trace_ids=[ep.trace_id])
    assert {s["context"]["trace_id"] for s in spans} == {ep.trace_id}
    by_name = _by_name(spans)
    tool = by_name["execute_tool judge"]
    assert tool["parent_id"] == turn_id
    assert by_name[SERVER_SPAN]["parent_id"] == tool["context"]["span_id"]
    assert by_name[ENGINE_SPAN]["parent_id"] == by_name[SERVER_SPAN]["context"]["span_id"]
