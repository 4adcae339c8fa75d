"""OTLP: the same episodes sent to Jaeger (or any OTLP collector: Phoenix, an OpenTelemetry
Collector) as well as to Trackio. 2 steps x 4 episodes with a tool call each; every kept episode is
one trace named ``episode`` with its ``rl.*`` tags.

    docker compose -f docker/docker-compose.yml up -d   # Jaeger v2: OTLP/HTTP on 4318, UI on 16686
    python examples/otlp_jaeger.py
    # then open http://localhost:16686, service "otr-example-otlp", Find Traces

The endpoint is ``OTEL_EXPORTER_OTLP_ENDPOINT`` (default ``http://127.0.0.1:4318``, Jaeger's
OTLP/HTTP port) with ``OTEL_EXPORTER_OTLP_PROTOCOL`` (default ``http/protobuf``); the Trackio copy
goes to ``$TRACKIO_DIR``, project ``OTEL_ROLLOUTS_TRACKIO_PROJECT``.
"""

from __future__ import annotations

import os

import otel_rollouts as otr

ENDPOINT = os.environ.setdefault("OTEL_EXPORTER_OTLP_ENDPOINT", "http://127.0.0.1:4318")
os.environ.setdefault("OTEL_EXPORTER_OTLP_PROTOCOL", "http/protobuf")
SERVICE = os.environ.get("OTEL_SERVICE_NAME", "otr-example-otlp")
PROJECT = os.environ.get("OTEL_ROLLOUTS_TRACKIO_PROJECT", "otr-example-otlp")


@otr.traced(kind="tool")
def calculator(expression: str) -> int:
    """A tool; its call is an ``execute_tool calculator`` span in the episode's trace."""
    a, b = expression.split("+")
    return int(a) + int(b)


def main() -> None:
    # default exporters: Trackio, plus OTLP because OTEL_EXPORTER_OTLP_ENDPOINT is set
    otr.configure(service_name=SERVICE, trackio_project=PROJECT)
    for step in range(2):
        for sample in range(4):
            expression = f"{sample} + 2"
            with otr.episode(step=step, group_id="g0", sample_index=sample) as ep:
                ep.prompt([{"role": "user", "content": f"What is {expression}?"}])
                with ep.turn() as turn:
                    turn.record_generation(f"Let me compute {expression}.", model="tiny-policy",
                                           input_tokens=12, output_tokens=6)
                    with turn.tool_call("calculator", arguments={"expression": expression}) as call:
                        call.result(calculator(expression.replace(" ", "")))
                ep.reward(float(sample % 2 == 0))
        otr.end_step(step)
    otr.shutdown()  # waits for the OTLP exporter to send what is queued
    print(f"sent to {ENDPOINT} (service {SERVICE!r}): Jaeger UI http://localhost:16686; "
          f"Trackio copy: trackio show --project {PROJECT}")


if __name__ == "__main__":
    main()
