"""A toy inference server instrumented the way a real one is, run as its own process.

    OTEL_EXPORTER_OTLP_ENDPOINT=http://127.0.0.1:4318 OTEL_EXPORTER_OTLP_PROTOCOL=http/protobuf \
        python tests/instrumented_server.py        # prints "PORT <n>" once it accepts connections

Everything comes from the standard OpenTelemetry environment variables, as for any service in a
cluster: a TracerProvider with a BatchSpanProcessor and an OTLP span exporter, a LoggerProvider
with a BatchLogRecordProcessor and an OTLP log exporter (the stdlib ``LoggingHandler`` on the
``toy_vllm`` logger), the protocol from ``OTEL_EXPORTER_OTLP_PROTOCOL`` (``grpc`` or
``http/protobuf``, the default), the endpoint from ``OTEL_EXPORTER_OTLP_ENDPOINT`` (read by the
exporters themselves), the service name from ``OTEL_SERVICE_NAME`` (default ``toy-vllm``). The app
is instrumented with the stock FastAPI instrumentation, and ``otr.copy_baggage_to_spans()`` /
``copy_baggage_to_logs`` copy the rl.* baggage of each request onto its spans and log records.

* ``POST /v1/chat/completions`` answers a minimal OpenAI chat completion. Inside the request it
  makes a child span ``llm_request`` carrying vLLM's ``gen_ai.latency.*`` timings, derived from
  the request's ``max_tokens`` by :func:`timings` (so tests can check them), and the usage
  counts; it logs one INFO record ``served <id>`` on the ``toy_vllm`` logger under that span.
* ``GET /health`` makes a SERVER span that ignores any incoming context: always a root span.
* SIGTERM: the server stops, the providers are shut down (everything pending is exported), exit 0.

Tests use :func:`serve`, which starts the process and waits for its ``PORT`` line.
"""

from __future__ import annotations

import os
import selectors
import signal
import socket
import subprocess
import sys
import tempfile
import time
import uuid
from collections.abc import Iterator, Mapping
from contextlib import contextmanager
from dataclasses import dataclass
from pathlib import Path
from typing import Any

if __name__ == "__main__":  # run as a script: this checkout's otel_rollouts, not an installed one
    sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from otel_rollouts import conventions as c  # noqa: E402

SERVICE_NAME = "toy-vllm"
LOGGER_NAME = "toy_vllm"
SERVER_SPAN = "POST /v1/chat/completions"  # the FastAPI instrumentation's name for the route
HEALTH_SPAN = "GET /health"
ENGINE_SPAN = "llm_request"  # vLLM's name for its per-request span
START_TIMEOUT_S = 30.0
STOP_TIMEOUT_S = 10.0


def timings(max_tokens: int) -> dict[str, float]:
    """The ``gen_ai.latency.*`` values (seconds) the server reports for a request asking for
    ``max_tokens`` tokens: deterministic, so a test can predict what a gateway copies."""
    queue, prefill, decode = max_tokens / 1000, max_tokens / 2000, max_tokens / 250
    return {
        c.GEN_AI_LATENCY_TIME_IN_QUEUE: queue,
        c.GEN_AI_LATENCY_TIME_TO_FIRST_TOKEN: queue + prefill,
        c.GEN_AI_LATENCY_TIME_IN_MODEL_PREFILL: prefill,
        c.GEN_AI_LATENCY_TIME_IN_MODEL_DECODE: decode,
        c.GEN_AI_LATENCY_TIME_IN_MODEL_INFERENCE: prefill + decode,
        c.GEN_AI_LATENCY_E2E: queue + prefill + decode,
    }


# --- the server (runs in the child process) -------------------------------------------------------
def _providers() -> tuple[Any, Any]:
    """Tracer and logger providers from the standard environment variables."""
    from opentelemetry.sdk._logs import LoggerProvider
    from opentelemetry.sdk._logs.export import BatchLogRecordProcessor
    from opentelemetry.sdk.resources import Resource
    from opentelemetry.sdk.trace import TracerProvider
    from opentelemetry.sdk.trace.export import BatchSpanProcessor

    import otel_rollouts as otr
    from otel_rollouts.correlate.baggage import copy_baggage_to_logs

    protocol = os.environ.get(c.ENV_OTLP_PROTOCOL, "http/protobuf").strip().lower()
    if protocol == "grpc":
        from opentelemetry.exporter.otlp.proto.grpc._log_exporter import OTLPLogExporter
        from opentelemetry.exporter.otlp.proto.grpc.trace_exporter import OTLPSpanExporter
    else:
        from opentelemetry.exporter.otlp.proto.http._log_exporter import (  # type: ignore[assignment]
            OTLPLogExporter,
        )
        from opentelemetry.exporter.otlp.proto.http.trace_exporter import (  # type: ignore[assignment]
            OTLPSpanExporter,
        )
    resource = Resource.create({c.SERVICE_NAME: os.environ.get(c.ENV_SERVICE_NAME) or SERVICE_NAME})
    tracer_provider = TracerProvider(resource=resource)
    otr.copy_baggage_to_spans(tracer_provider)  # before the exporting processor: attributes set at start
    tracer_provider.add_span_processor(BatchSpanProcessor(OTLPSpanExporter()))
    logger_provider = LoggerProvider(resource=resource)
    copy_baggage_to_logs(logger_provider)  # stamps the record before the batch processor takes it
    logger_provider.add_log_record_processor(BatchLogRecordProcessor(OTLPLogExporter()))
    return tracer_provider, logger_provider


def build_app(tracer_provider: Any) -> Any:
    """The FastAPI app, instrumented with ``tracer_provider``."""
    import logging

    from fastapi import FastAPI
    from openai_server import chat_completion
    from opentelemetry import context as otel_context
    from opentelemetry import trace
    from opentelemetry.instrumentation.fastapi import FastAPIInstrumentor

    app = FastAPI()
    tracer = tracer_provider.get_tracer("toy_vllm")
    log = logging.getLogger(LOGGER_NAME)

    @app.get("/health")
    async def health() -> dict[str, str]:
        # a root span whatever the request carried: a server's own, not a client's, work
        with tracer.start_as_current_span(HEALTH_SPAN, context=otel_context.Context(),
                                          kind=trace.SpanKind.SERVER):
            return {"status": "ok"}

    @app.post("/v1/chat/completions")
    async def chat_completions(body: dict[str, Any]) -> dict[str, Any]:
        model = str(body.get("model") or "policy")
        messages = [m for m in (body.get("messages") or []) if isinstance(m, dict)]
        max_tokens = int(body.get("max_tokens") or 16)
        prompt = " ".join(str(m.get("content", "")) for m in messages)
        content = f"echo: {messages[-1].get('content', '') if messages else ''}"
        prompt_tokens, completion_tokens = len(prompt.split()), len(content.split())
        completion_id = f"chatcmpl-{uuid.uuid4().hex[:12]}"
        with tracer.start_as_current_span(ENGINE_SPAN, kind=trace.SpanKind.INTERNAL) as span:
            span.set_attribute(c.GEN_AI_REQUEST_MODEL, model)
            span.set_attribute(c.GEN_AI_USAGE_INPUT_TOKENS, prompt_tokens)
            span.set_attribute(c.GEN_AI_USAGE_OUTPUT_TOKENS, completion_tokens)
            for key, value in timings(max_tokens).items():
                span.set_attribute(key, value)
            log.info("served %s", completion_id)
        return chat_completion(completion_id, model, content, prompt_tokens, completion_tokens)

    FastAPIInstrumentor.instrument_app(app, tracer_provider=tracer_provider,
                                       excluded_urls="health", exclude_spans=["receive", "send"])
    return app


def main() -> None:
    """Serve on a free loopback port until SIGTERM/SIGINT, then flush the providers and exit 0."""
    import logging

    import uvicorn
    from opentelemetry.sdk._logs import LoggingHandler

    tracer_provider, logger_provider = _providers()
    log = logging.getLogger(LOGGER_NAME)
    log.setLevel(logging.INFO)
    log.propagate = False
    log.addHandler(LoggingHandler(level=logging.INFO, logger_provider=logger_provider))

    sock = socket.socket(socket.AF_INET, socket.SOCK_STREAM)
    sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
    sock.bind(("127.0.0.1", 0))
    port = sock.getsockname()[1]

    class Server(uvicorn.Server):
        async def startup(self, sockets: list[socket.socket] | None = None) -> None:
            await super().startup(sockets=sockets)
            if not self.should_exit:  # started: the socket is listening and served
                print(f"PORT {port}", flush=True)

    # uvicorn takes SIGTERM/SIGINT while it serves and raises them again once stopped: a no-op
    # handler underneath makes that re-raise harmless, so the providers below get flushed
    signal.signal(signal.SIGTERM, lambda *_: None)
    signal.signal(signal.SIGINT, lambda *_: None)
    config = uvicorn.Config(build_app(tracer_provider), log_level="warning", lifespan="off")
    try:
        Server(config).run(sockets=[sock])
    finally:
        tracer_provider.shutdown()
        logger_provider.shutdown()
    sys.exit(0)


# --- the handle the tests use --------------------------------------------------------------------
@dataclass
class Server:
    """A running server process: ``url`` is ``http://127.0.0.1:<port>``."""

    url: str
    port: int
    process: subprocess.Popen[bytes]


@contextmanager
def serve(env: Mapping[str, str]) -> Iterator[Server]:
    """Start the server with ``os.environ`` + ``env``; yield once it accepts connections.

    On exit: SIGTERM (the server flushes its spans and logs), wait, SIGKILL after 10 s.
    Raises RuntimeError (with the server's stderr) when it exits or stays silent at start.
    """
    with tempfile.TemporaryFile() as stderr:
        process = subprocess.Popen(
            [sys.executable, str(Path(__file__).resolve())],
            env={**os.environ, **env}, stdin=subprocess.DEVNULL, stdout=subprocess.PIPE, stderr=stderr,
        )
        try:
            port = _wait_for_port(process, stderr)
            yield Server(url=f"http://127.0.0.1:{port}", port=port, process=process)
        finally:
            if process.poll() is None:
                process.send_signal(signal.SIGTERM)
                try:
                    process.wait(STOP_TIMEOUT_S)
                except subprocess.TimeoutExpired:
                    process.kill()
                    process.wait()
            if process.stdout is not None:
                process.stdout.close()


def _wait_for_port(process: subprocess.Popen[bytes], stderr: Any) -> int:
    """Read the child's ``PORT <n>`` line, with a deadline."""
    assert process.stdout is not None
    deadline = time.monotonic() + START_TIMEOUT_S
    buffer = b""
    with selectors.DefaultSelector() as selector:
        selector.register(process.stdout, selectors.EVENT_READ)
        while b"\n" not in buffer:
            left = deadline - time.monotonic()
            if left <= 0 or (not selector.select(timeout=left) and process.poll() is not None):
                break
            chunk = os.read(process.stdout.fileno(), 4096)
            if not chunk:  # the child closed stdout: it exited
                break
            buffer += chunk
    line = buffer.split(b"\n", 1)[0].decode(errors="replace").strip()
    if line.startswith("PORT "):
        return int(line.split()[1])
    process.kill()
    process.wait()
    stderr.seek(0)
    raise RuntimeError(f"instrumented server did not start ({line!r}): "
                       f"{stderr.read().decode(errors='replace')[-4000:]}")


if __name__ == "__main__":
    main()
