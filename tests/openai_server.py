"""A small OpenAI-compatible HTTP server for the end-to-end tests, run as its own process.

    python tests/openai_server.py --port 8123 --endpoint http://127.0.0.1:6006/v1/traces \
        --project my-project

``POST /v1/chat/completions`` answers with a fixed-shape chat completion (the last user message
echoed back, token counts by whitespace). The app is instrumented with OpenTelemetry's own
FastAPI instrumentation (it extracts the W3C ``traceparent`` of each request) plus one child
span per request, ``llm_request``, the way vLLM names its own; the server exports its spans
itself over OTLP/HTTP to ``--endpoint``, independently of the client's tail sampler, as a real
inference server does. ``GET /health`` answers 200 once the app is up.
"""

from __future__ import annotations

import argparse
import time
import uuid
from typing import Any

from fastapi import FastAPI
from opentelemetry import trace
from opentelemetry.exporter.otlp.proto.http.trace_exporter import OTLPSpanExporter
from opentelemetry.instrumentation.fastapi import FastAPIInstrumentor
from opentelemetry.sdk.resources import Resource
from opentelemetry.sdk.trace import TracerProvider
from opentelemetry.sdk.trace.export import BatchSpanProcessor

from otel_rollouts import conventions as c

SERVICE_NAME = "openai-compatible-server"
SERVER_SPAN = "POST /v1/chat/completions"  # the FastAPI instrumentation's name for the route
ENGINE_SPAN = "llm_request"


def build_app(provider: TracerProvider) -> FastAPI:
    app = FastAPI()
    tracer = provider.get_tracer("openai_server")

    @app.get("/health")
    async def health() -> dict[str, str]:
        return {"status": "ok"}

    @app.post("/v1/chat/completions")
    async def chat_completions(body: dict[str, Any]) -> dict[str, Any]:
        model = str(body.get("model") or "policy")
        messages = body.get("messages") or []
        prompt = " ".join(str(m.get("content", "")) for m in messages if isinstance(m, dict))
        with tracer.start_as_current_span(ENGINE_SPAN) as span:
            content = f"echo: {messages[-1].get('content', '') if messages else ''}"
            prompt_tokens, completion_tokens = len(prompt.split()), len(content.split())
            span.set_attribute(c.GEN_AI_REQUEST_MODEL, model)
            span.set_attribute(c.GEN_AI_USAGE_INPUT_TOKENS, prompt_tokens)
            span.set_attribute(c.GEN_AI_USAGE_OUTPUT_TOKENS, completion_tokens)
        return chat_completion(f"chatcmpl-{uuid.uuid4().hex[:12]}", model, content, prompt_tokens,
                               completion_tokens)

    FastAPIInstrumentor.instrument_app(app, tracer_provider=provider,
                                       exclude_spans=["receive", "send"])
    return app


def chat_completion(completion_id: str, model: str, content: str, prompt_tokens: int,
                    completion_tokens: int) -> dict[str, Any]:
    """A minimal OpenAI chat completion body, as an OpenAI-compatible server answers."""
    return {
        "id": completion_id,
        "object": "chat.completion",
        "created": int(time.time()),
        "model": model,
        "choices": [{"index": 0, "finish_reason": "stop",
                     "message": {"role": "assistant", "content": content}}],
        "usage": {"prompt_tokens": prompt_tokens, "completion_tokens": completion_tokens,
                  "total_tokens": prompt_tokens + completion_tokens},
    }


def main() -> None:
    import uvicorn

    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--host", default="127.0.0.1")
    parser.add_argument("--port", type=int, required=True)
    parser.add_argument("--endpoint", required=True, help="OTLP/HTTP traces endpoint")
    parser.add_argument("--project", default=None, help="Phoenix project (openinference.project.name)")
    args = parser.parse_args()

    attributes = {c.SERVICE_NAME: SERVICE_NAME}
    if args.project:
        attributes[c.OPENINFERENCE_PROJECT_NAME] = args.project
    provider = TracerProvider(resource=Resource.create(attributes))
    provider.add_span_processor(
        BatchSpanProcessor(OTLPSpanExporter(endpoint=args.endpoint), schedule_delay_millis=100)
    )
    trace.set_tracer_provider(provider)
    try:
        uvicorn.run(build_app(provider), host=args.host, port=args.port, log_level="warning")
    finally:
        provider.shutdown()


if __name__ == "__main__":
    main()

