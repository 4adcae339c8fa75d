"""What the span gateway costs the training process: CPU per step while a server exports to it.

The gateway is a process of its own: the trainer's CPU in the ``gateway`` way is what telling it
about episodes and pulling the kept ones' server spans costs; the gateway process's own CPU is
printed beside it.

    python benchmarks/bench_gateway.py [--steps 6] [--episodes 256]

Each step the trainer records ``--episodes`` episodes (prompt, turn, a generation, reward; the
sampler keeps 16). A separate process plays the inference server: for each episode it sends the
six spans a FastAPI-instrumented vLLM request makes (route span, four ASGI send/receive spans,
``llm_request`` with vLLM's ``gen_ai.latency.*`` timings), under the episode's generation span,
over OTLP/HTTP in batches of 512 (the SDK's default batch). Two ways, alternated step by step:

* ``gateway``: the server exports to the trainer's span gateway (servers' spans follow their
  episodes: kept ones are exported, dropped ones are not);
* ``collector``: the server exports to another process (a collector; the trainer does nothing).

Printed: the trainer's CPU time per step in each way (``time.process_time``: every thread of
the process; robust to other processes on the machine), their ratio, and the gateway process's
CPU per received span. It checks that it measured real work: every span the
server sent was received, and the kept episodes went out with their server spans.
"""

from __future__ import annotations

import argparse
import contextlib
import json
import statistics
import subprocess
import sys
import time
from collections.abc import Iterator
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from pathlib import Path

import psutil
from opentelemetry import context as otel_context
from opentelemetry import trace
from opentelemetry.sdk.trace.export.in_memory_span_exporter import InMemorySpanExporter

import otel_rollouts as otr
from otel_rollouts import conventions as c

CAP = 16
SPANS_PER_REQUEST = 6

# the "server": reads one JSON line per step ({url, episodes: [[trace_id, span_id], ...]}),
# posts the spans of every request, answers one line when all were accepted
_SERVER = r'''
import json, sys, time
from opentelemetry.exporter.otlp.proto.http.trace_exporter import OTLPSpanExporter
from opentelemetry.sdk.resources import Resource
from opentelemetry.sdk.trace import ReadableSpan
from opentelemetry.sdk.util.instrumentation import InstrumentationScope
from opentelemetry.trace import SpanContext, SpanKind, TraceFlags

resource = Resource({"service.name": "vllm-server"})
scope = InstrumentationScope("opentelemetry.instrumentation.fastapi", "0.66b2")
flags = TraceFlags(TraceFlags.SAMPLED)
timings = {LATENCY}
exporters = {}
next_id = 1
for line in sys.stdin:
    order = json.loads(line)
    exporter = exporters.get(order["url"]) or exporters.setdefault(order["url"], OTLPSpanExporter(endpoint=order["url"]))
    batch, sent = [], 0
    now = time.time_ns()
    for trace_id, parent in order["episodes"]:
        ids = list(range(next_id, next_id + 6)); next_id += 6
        route = SpanContext(trace_id, ids[0], False, flags)
        spans = [ReadableSpan("POST /v1/chat/completions", route, SpanContext(trace_id, parent, True, flags),
                              resource=resource, attributes={"http.method": "POST", "http.route": "/v1/chat/completions",
                              "http.status_code": 200, "net.peer.ip": "127.0.0.1"}, kind=SpanKind.SERVER,
                              start_time=now, end_time=now + 2_000_000, instrumentation_scope=scope)]
        for i, name in enumerate(["http receive", "http receive", "http send", "http send"]):
            spans.append(ReadableSpan(f"POST /v1/chat/completions {name}", SpanContext(trace_id, ids[1 + i], False, flags),
                                      route, resource=resource, attributes={"asgi.event.type": name.replace(" ", ".")},
                                      start_time=now, end_time=now + 1000, instrumentation_scope=scope))
        spans.append(ReadableSpan("llm_request", SpanContext(trace_id, ids[5], False, flags), route, resource=resource,
                                  attributes={**timings, "gen_ai.request.model": "policy", "gen_ai.usage.prompt_tokens": 212,
                                              "gen_ai.usage.completion_tokens": 512, "gen_ai.request.id": f"chatcmpl-{ids[5]}"},
                                  start_time=now, end_time=now + 1_500_000, instrumentation_scope=scope))
        batch.extend(spans)
        if len(batch) >= 512:
            assert exporter.export(batch).name == "SUCCESS"; sent += len(batch); batch = []
    if batch:
        assert exporter.export(batch).name == "SUCCESS"; sent += len(batch)
    print(sent, flush=True)
'''


def _collector() -> tuple[ThreadingHTTPServer, str]:
    class Handler(BaseHTTPRequestHandler):
        protocol_version = "HTTP/1.1"

        def log_message(self, *args: object) -> None:
            pass

        def do_POST(self) -> None:  # noqa: N802
            self.rfile.read(int(self.headers.get("Content-Length") or 0))
            self.send_response(200)
            self.send_header("Content-Type", "application/x-protobuf")
            self.send_header("Content-Length", "0")
            self.end_headers()

    server = ThreadingHTTPServer(("127.0.0.1", 0), Handler)
    server.daemon_threads = True
    return server, f"http://127.0.0.1:{server.server_address[1]}/v1/traces"


@contextlib.contextmanager
def otel_context_of(ep: otr.Episode) -> Iterator[None]:
    """The episode's context current for the block (an episode started without ``with``)."""
    token = otel_context.attach(trace.set_span_in_context(ep.root))
    try:
        yield
    finally:
        otel_context.detach(token)


def per_span_costs(repeat: int = 20, episodes: int = 86) -> None:
    """CPU per received span in the gateway's store, by the episode's state, next to decoding
    every span into an SDK span (what a gateway that parsed everything on arrival would pay).
    One OTLP request of ``6 × episodes`` spans, parsed from its bytes each time."""
    from opentelemetry.exporter.otlp.proto.common.trace_encoder import encode_spans
    from opentelemetry.proto.collector.trace.v1.trace_service_pb2 import ExportTraceServiceRequest
    from opentelemetry.sdk.resources import Resource
    from opentelemetry.sdk.trace import ReadableSpan
    from opentelemetry.trace import SpanContext, TraceFlags

    from otel_rollouts._core.codec import spans_from_request
    from otel_rollouts.correlate.gateway_store import Store

    store = Store(max_held_bytes=1 << 30, hold_s=30.0)
    flags, resource = TraceFlags(TraceFlags.SAMPLED), Resource({"service.name": "vllm-server"})
    spans, trace_ids = [], []
    for i in range(episodes):
        tid, root = 0xABC0000 + i, 1
        trace_ids.append(tid)
        route = SpanContext(tid, 10_000 + i, False, flags)
        spans.append(ReadableSpan("POST /v1/chat/completions", route, SpanContext(tid, root, True, flags),
                                  resource=resource, attributes={"http.route": "/v1/chat/completions"},
                                  start_time=1, end_time=2))
        spans.extend(ReadableSpan(f"part {k}", SpanContext(tid, 20_000 + 8 * i + k, False, flags), route,
                                  resource=resource, attributes={c.GEN_AI_LATENCY_E2E: 2.2, "k": k},
                                  start_time=1, end_time=2) for k in range(5))
    data = encode_spans(spans).SerializeToString()
    dropped = 0

    def cost(receive) -> float:
        nonlocal dropped
        started = time.thread_time()
        for _ in range(repeat):
            request = ExportTraceServiceRequest()
            request.ParseFromString(data)
            outcome = receive(request)
            dropped += getattr(outcome, "owners", {}).get("trainer", {}).get("dropped.gateway_spans", 0)
        return (time.thread_time() - started) * 1e6 / (repeat * len(spans))

    decode_all = cost(spans_from_request)
    store.opened("trainer", trace_ids)
    held = cost(store.add_spans)  # every episode still running
    assert store.held_bytes > len(data) * repeat // 2, store.stats()
    store.decided("trainer", [(t, i == 0) for i, t in enumerate(trace_ids)])  # one kept, the rest dropped
    after = cost(store.add_spans)
    assert dropped == repeat * 6 * (episodes - 1), dropped
    print(f"gateway CPU per received span ({len(spans)} spans a request, {repeat} requests):")
    print(f"  decode every span to an SDK span (the naive gateway) {decode_all:6.1f} µs")
    print(f"  gateway, episodes running (held as bytes)          {held:6.1f} µs  ({held / decode_all:.2f}x)")
    print(f"  gateway, episodes decided (dropped: never decoded) {after:6.1f} µs  ({after / decode_all:.2f}x)")


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--steps", type=int, default=6, help="steps per way (alternated)")
    parser.add_argument("--episodes", type=int, default=256, help="episodes per step")
    parser.add_argument("--arrival", choices=["after", "during"], default="after",
                        help="server spans arrive after each episode ended (the sampler may have "
                             "dropped it already) or while every episode of the step is running")
    parser.add_argument("--costs-only", action="store_true", help="only the per-span costs")
    args = parser.parse_args()
    per_span_costs()
    if args.costs_only:
        return 0

    latency = {c.GEN_AI_LATENCY_TIME_IN_QUEUE: 0.4, c.GEN_AI_LATENCY_TIME_TO_FIRST_TOKEN: 0.6,
               c.GEN_AI_LATENCY_TIME_IN_MODEL_PREFILL: 0.2, c.GEN_AI_LATENCY_TIME_IN_MODEL_DECODE: 1.6,
               c.GEN_AI_LATENCY_E2E: 2.2}
    server = subprocess.Popen([sys.executable, "-c", _SERVER.replace("{LATENCY}", repr(latency))],
                              stdin=subprocess.PIPE, stdout=subprocess.PIPE, text=True)
    # the collector runs in another process, so that its CPU is not the trainer's
    collector = subprocess.Popen(
        [sys.executable, "-c", f"import sys; sys.path.insert(0, {str(Path(__file__).parent)!r}); "
         "import bench_gateway as b; s, url = b._collector(); print(url, flush=True); s.serve_forever()"],
        stdout=subprocess.PIPE, text=True)
    assert collector.stdout is not None and server.stdin is not None and server.stdout is not None
    collector_url = collector.stdout.readline().strip()

    spans = InMemorySpanExporter()
    otr.configure(exporters=[spans], sampler=otr.TailSampler(CAP, "top_bottom"), handle_signals=False,
                  gateway=otr.GatewayOptions(http_port=0, grpc_port=None))
    gateway = otr.gateway()
    assert gateway is not None and gateway.http_endpoint and gateway.pid
    gateway_process = psutil.Process(gateway.pid)
    gateway_url = f"{gateway.http_endpoint}/v1/traces"
    cpu: dict[str, list[float]] = {"gateway": [], "collector": []}
    gateway_cpu: list[float] = []
    received_before = 0
    try:
        step = 0
        for _ in range(args.steps):
            for way in ("gateway", "collector"):
                started = time.process_time()
                gateway_started = sum(gateway_process.cpu_times()[:2])
                requests, open_episodes = [], []
                for i in range(args.episodes):
                    ep = otr.episode(step=step, group_id=f"g{i // 8}", sample_index=i).start()
                    ep.prompt([{"role": "user", "content": f"problem {step}-{i}"}])
                    with otel_context_of(ep), ep.turn() as turn, turn.generation("policy") as gen:
                        requests.append((int(ep.trace_id, 16), trace.get_current_span().get_span_context().span_id))
                        gen.output(f"answer {i} " + "y" * 200)
                    if args.arrival == "after":
                        ep.reward(i / args.episodes)
                        ep.end()
                    else:
                        open_episodes.append((i, ep))
                url = gateway_url if way == "gateway" else collector_url
                server.stdin.write(json.dumps({"url": url, "episodes": requests}) + "\n")
                server.stdin.flush()
                sent = int(server.stdout.readline())
                assert sent == SPANS_PER_REQUEST * args.episodes, sent
                waited = 0.0
                if way == "gateway":  # every span was received and placed before the step closes
                    wait_started = time.process_time()  # (the benchmark's own polling: not counted)
                    deadline = time.monotonic() + 60
                    while otr.stats()["totals"].get("gateway.spans", 0) < received_before + sent:
                        assert time.monotonic() < deadline, otr.stats()["totals"]
                        time.sleep(0.005)
                    received_before += sent
                    waited = time.process_time() - wait_started
                for i, ep in open_episodes:  # the server's spans came while these were running
                    ep.reward(i / args.episodes)
                    ep.end()
                otr.end_step(step)
                cpu[way].append(time.process_time() - started - waited)
                if way == "gateway":
                    gateway_cpu.append(sum(gateway_process.cpu_times()[:2]) - gateway_started)
                step += 1
        assert otr.flush(60)
    finally:
        otr.shutdown()
        server.stdin.close()
        server.wait(30)
        collector.kill()
    # real work: kept gateway episodes went out with their server spans, and nothing else did
    finished = spans.get_finished_spans()
    engine = [s for s in finished if s.name == "llm_request"]
    roots = [s for s in finished if (s.attributes or {}).get(c.RL_SPAN_KIND) == c.KIND_EPISODE]
    assert len(roots) == 2 * args.steps * CAP, len(roots)
    assert len(engine) == args.steps * CAP, (len(engine), args.steps * CAP)
    totals = otr.stats()["totals"]
    print(f"server spans arriving {args.arrival} their episodes; "
          f"trainer CPU per step ({args.episodes} episodes, {SPANS_PER_REQUEST * args.episodes} server spans; "
          f"median of {args.steps}, alternated):")
    med = {way: statistics.median(v) for way, v in cpu.items()}
    for way, value in med.items():
        print(f"  {way:<10} {value * 1000:8.1f} ms")
    extra = med["gateway"] - med["collector"]
    print(f"  ratio gateway / collector: {med['gateway'] / med['collector']:.2f}x; "
          f"{extra * 1e6 / (SPANS_PER_REQUEST * args.episodes):.1f} µs of trainer CPU per received span")
    print(f"  the gateway process: {statistics.median(gateway_cpu) * 1000:.1f} ms of CPU per step, "
          f"{statistics.median(gateway_cpu) * 1e6 / (SPANS_PER_REQUEST * args.episodes):.1f} µs per received span")
    print(f"  exported with kept episodes: {len(engine)} llm_request spans; dropped on arrival (episode "
          f"dropped already): {totals.get('dropped.gateway_spans', 0)} spans; the rest held, then "
          f"dropped with their episodes")
    return 0


if __name__ == "__main__":
    sys.exit(main())
