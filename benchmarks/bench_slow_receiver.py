"""Training-thread cost per episode when the OTLP receiver is healthy, slow, hanging or down.

    python benchmarks/bench_slow_receiver.py [--episodes 2048]

The receiver is a real process on loopback (``tests/otlp_sink.py``: a stdlib OTLP/HTTP server
that can sleep before answering). For each receiver state the same loop records episodes
(prompt, turn, generation, tool call, reward; 64 per step, the sampler keeps 8) and times the
training thread only. Side by side, the same episodes built as plain OpenTelemetry SDK spans with
the stock ``BatchSpanProcessor`` (no tail sampling: every span is exported). Printed: µs per
episode, the ratio to the healthy receiver, and how many kept episodes reached the receiver (or
are safe in the spool) against how many were lost. Not a timed test: numbers vary with the
machine; the ratios are the point.
"""

from __future__ import annotations

import argparse
import statistics
import sys
import tempfile
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent.parent / "tests"))

from opentelemetry.exporter.otlp.proto.http.trace_exporter import OTLPSpanExporter  # noqa: E402
from otlp_sink import OtlpSink, free_port  # noqa: E402

import otel_rollouts as otr  # noqa: E402

PER_STEP, CAP = 64, 8
STATES = {  # receiver state -> (sink settings, or None: nothing listens)
    "healthy": {"delay": 0},
    "slow (0.5 s/request)": {"delay": 0.5},
    "hanging (30 s/request)": {"delay": 30},
    "down (refused)": None,
}


def otr_loop(endpoint: str, episodes: int, spool: Path) -> tuple[float, dict]:
    otr.configure(
        exporters=[OTLPSpanExporter(endpoint=endpoint, timeout=2)],
        sampler=otr.TailSampler(CAP, "top_bottom"),
        spool_dir=spool,
        handle_signals=False,
    )
    samples = []
    for step in range(episodes // PER_STEP):
        started = time.perf_counter()
        for i in range(PER_STEP):
            with otr.episode(step=step, group_id=f"g{i // 8}", sample_index=i) as ep:
                ep.prompt([{"role": "user", "content": f"problem {step}-{i}"}])
                with ep.turn() as turn:
                    turn.record_generation(f"answer {i} " + "y" * 200, model="policy", output_tokens=40)
                    with turn.tool_call("calc", arguments={"i": i}) as call:
                        call.result(i * 2)
                ep.reward(i / PER_STEP)
        otr.end_step(step)
        samples.append((time.perf_counter() - started) / PER_STEP)
    otr.flush(timeout=2)
    report = otr.stats()["delivery"]["OTLPSpanExporter"]
    kept = otr.stats()["totals"]["kept"]
    otr.shutdown(timeout=3)
    return statistics.median(samples), {"kept": kept, **report}


def sdk_loop(endpoint: str, episodes: int) -> tuple[float, int]:
    from opentelemetry.sdk.resources import Resource
    from opentelemetry.sdk.trace import TracerProvider
    from opentelemetry.sdk.trace.export import BatchSpanProcessor

    provider = TracerProvider(resource=Resource.create({"service.name": "bench"}))
    provider.add_span_processor(BatchSpanProcessor(OTLPSpanExporter(endpoint=endpoint, timeout=2)))
    tracer = provider.get_tracer("bench")
    samples = []
    for step in range(episodes // PER_STEP):
        started = time.perf_counter()
        for i in range(PER_STEP):
            with tracer.start_as_current_span("episode", attributes={"rl.step": step, "rl.sample.index": i}):
                with tracer.start_as_current_span("prompt", attributes={"gen_ai.input.messages": f"problem {step}-{i}"}):
                    pass
                with tracer.start_as_current_span("turn"):
                    with tracer.start_as_current_span("chat policy", attributes={"gen_ai.output.messages": "y" * 200}):
                        pass
                    with tracer.start_as_current_span("execute_tool calc", attributes={"gen_ai.tool.call.result": str(i)}):
                        pass
                with tracer.start_as_current_span("reward", attributes={"rl.reward": i / PER_STEP}):
                    pass
        samples.append((time.perf_counter() - started) / PER_STEP)
    provider.force_flush(2000)
    provider.shutdown()
    return statistics.median(samples), episodes


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--episodes", type=int, default=2048)
    args = parser.parse_args()
    rows = []
    with tempfile.TemporaryDirectory() as tmp:
        with OtlpSink(Path(tmp) / "warmup") as warm:  # imports and first-call costs, not measured
            otr_loop(warm.endpoint, 4 * PER_STEP, Path(tmp) / "spool-warmup")
            sdk_loop(warm.endpoint, 4 * PER_STEP)
        for name, settings in STATES.items():
            results = {}
            for lib in ("otel_rollouts", "sdk"):
                sink = OtlpSink(Path(tmp) / f"{name}-{lib}".replace(" ", "_").replace("/", "_"))
                if settings is not None:
                    sink.start(**settings)
                    endpoint = sink.endpoint
                else:
                    endpoint = f"http://127.0.0.1:{free_port()}/v1/traces"
                try:
                    if lib == "otel_rollouts":
                        cost, report = otr_loop(endpoint, args.episodes, Path(tmp) / f"spool-{len(rows)}")
                        arrived = len(sink.roots()) if settings is not None else 0
                        safe = report["delivered"] + report["pending"]
                        results[lib] = (cost, report["kept"], arrived, safe, report["dropped"])
                    else:
                        cost, sent = sdk_loop(endpoint, args.episodes)
                        arrived = sum(s["name"] == "episode" for s in sink.spans()) if settings is not None else 0
                        results[lib] = (cost, sent, arrived, arrived, None)
                finally:
                    sink.kill()
            rows.append((name, results))
    healthy = {lib: rows[0][1][lib][0] for lib in ("otel_rollouts", "sdk")}
    print(f"{args.episodes} episodes, {PER_STEP}/step, otel_rollouts keeps {CAP}/step; training-thread cost")
    header = f"{'receiver':24} {'library':14} {'µs/episode':>10} {'vs healthy':>10} {'to export':>9} {'arrived':>8} {'safe*':>6} {'dropped':>8}"
    print(header)
    print("-" * len(header))
    for name, results in rows:
        for lib, (cost, exported, arrived, safe, dropped) in results.items():
            print(
                f"{name:24} {lib:14} {cost * 1e6:10.1f} {cost / healthy[lib]:10.2f} {exported:9d} {arrived:8d} "
                f"{safe:6d} {'uncounted' if dropped is None else dropped:>8}"
            )
    print("* safe: delivered, or in the on-disk spool to be delivered when the receiver answers")
    print(f"otel_rollouts / raw SDK cost, healthy receiver: {healthy['otel_rollouts'] / healthy['sdk']:.2f}")


if __name__ == "__main__":
    main()
