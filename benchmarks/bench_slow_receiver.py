"""Training-thread cost per episode when the OTLP receiver is healthy, slow, hanging or down.

    python benchmarks/bench_slow_receiver.py [--episodes 2048]
    python benchmarks/bench_slow_receiver.py --quick     # smoke: 128 episodes, 1 round, 3 states

The receiver is a real process on loopback (``tests/otlp_sink.py``: a stdlib OTLP/HTTP server
that can sleep before answering). For each receiver state the same loop records episodes
(prompt, turn, generation, tool call, reward; 64 per step, the sampler keeps 8) and times the
training thread only, in CPU time (``time.thread_time``: what the training thread itself spent,
robust to other processes) and wall time. Side by side, the same episodes built as plain OpenTelemetry SDK spans with
the stock ``BatchSpanProcessor`` (no tail sampling: every span is exported). Printed: µs per
episode, the ratio to the healthy receiver, and how many kept episodes reached the receiver (or
are safe in the spool) against how many were lost, from the final counts after shutdown (checked:
every kept episode is delivered, left in the spool or dropped, once; exit status non-zero
otherwise). Not a timed test: numbers vary with the machine; the ratios are the point.
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
EXPORTER = "OTLPSpanExporter"  # the exporter's name in otr.stats()
STATES: dict[str, dict[str, float] | None] = {  # receiver state -> (sink settings, or None: nothing listens)
    "healthy": {"delay": 0},
    "slow (0.5 s/request)": {"delay": 0.5},
    "hanging (30 s/request)": {"delay": 30},
    "down (refused)": None,
}


def otr_loop(endpoint: str, episodes: int, spool: Path) -> tuple[tuple[float, float], dict[str, int]]:
    otr.configure(
        exporters=[OTLPSpanExporter(endpoint=endpoint, timeout=2)],
        sampler=otr.TailSampler(CAP, "top_bottom"),
        spool_dir=spool,
        handle_signals=False,
    )
    samples, cpu = [], []
    for step in range(episodes // PER_STEP):
        started, started_cpu = time.perf_counter(), time.thread_time()
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
        cpu.append((time.thread_time() - started_cpu) / PER_STEP)
    otr.flush(timeout=2)
    otr.shutdown(timeout=3)
    return (statistics.median(samples), statistics.median(cpu)), books(otr.stats()["totals"], EXPORTER)


def books(totals: dict[str, int], exporter: str) -> dict[str, int]:
    """What became of the kept episodes, read from the final counters after shutdown.

    Not from ``stats()["delivery"]`` while deliveries are still under way: that report reads the
    ledger's pending episodes and then the exporter's delivered counter, two reads, so an
    episode whose request completes in between is counted in both (this benchmark once printed
    "safe 130 of 128"). After shutdown every kept episode is decided exactly once: delivered,
    left in the spool for the next process (``undelivered_at_exit.<exporter>``, not a loss), or
    dropped under a named reason."""
    suffix = f".{exporter}"
    dropped = sum(v for k, v in totals.items() if k.startswith("lost.") and k.endswith(suffix))
    return {
        "kept": totals.get("kept", 0),
        "delivered": totals.get(f"delivered{suffix}", 0),
        "in_spool": totals.get(f"undelivered_at_exit{suffix}", 0),
        "dropped": dropped,
    }


def check_books(state: str, report: dict[str, int]) -> list[str]:
    """Every kept episode counted once: delivered + in the spool + dropped == kept, and so the
    safe ones (delivered or in the spool) never more than the kept ones."""
    problems = []
    safe = report["delivered"] + report["in_spool"]
    if safe > report["kept"]:
        problems.append(f"{state}: safe {safe} of {report['kept']} kept")
    if safe + report["dropped"] != report["kept"]:
        problems.append(f"{state}: delivered {report['delivered']} + in the spool {report['in_spool']} + "
                        f"dropped {report['dropped']} != kept {report['kept']}")
    return problems


def sdk_loop(endpoint: str, episodes: int) -> tuple[tuple[float, float], int]:
    from opentelemetry.sdk.resources import Resource
    from opentelemetry.sdk.trace import TracerProvider
    from opentelemetry.sdk.trace.export import BatchSpanProcessor

    provider = TracerProvider(resource=Resource.create({"service.name": "bench"}))
    provider.add_span_processor(BatchSpanProcessor(OTLPSpanExporter(endpoint=endpoint, timeout=2)))
    tracer = provider.get_tracer("bench")
    samples, cpu = [], []
    for step in range(episodes // PER_STEP):
        started, started_cpu = time.perf_counter(), time.thread_time()
        for i in range(PER_STEP):
            with tracer.start_as_current_span("episode", attributes={"rl.step": step, "rl.sample.index": i}):
                with tracer.start_as_current_span("prompt", attributes={"gen_ai.input.messages": f"problem {step}-{i}"}):
                    pass
                with tracer.start_as_current_span("turn"):
                    with tracer.start_as_current_span("chat policy", attributes={"gen_ai.output.messages": "y" * 200}):
                        pass
                    with tracer.start_as_current_span("execute_tool calc", attributes={"gen_ai.tool.call.result": str(i)}):
                        pass
                with tracer.start_as_current_span("reward", attributes={"rl.reward.score": i / PER_STEP}):
                    pass
        samples.append((time.perf_counter() - started) / PER_STEP)
        cpu.append((time.thread_time() - started_cpu) / PER_STEP)
    provider.force_flush(2000)
    provider.shutdown()
    return (statistics.median(samples), statistics.median(cpu)), episodes


def run_once(name: str, settings: dict | None, lib: str, episodes: int, tmp: Path, tag: str) -> tuple:
    sink = OtlpSink(tmp / f"{name}-{lib}-{tag}".replace(" ", "_").replace("/", "_").replace("(", "").replace(")", ""))
    if settings is not None:
        sink.start(**settings)
        endpoint = sink.endpoint
    else:
        endpoint = f"http://127.0.0.1:{free_port()}/v1/traces"
    try:
        if lib == "otel_rollouts":
            cost, report = otr_loop(endpoint, episodes, tmp / f"spool-{name}-{tag}".replace(" ", "_").replace("/", "_"))
            # distinct episodes: delivery is at least once (a request retried after a timeout
            # the receiver had stored arrives twice)
            arrived = len({s["trace_id"] for s in sink.roots()}) if settings is not None else 0
            safe = report["delivered"] + report["in_spool"]
            return cost, report["kept"], arrived, safe, report["dropped"], check_books(name, report)
        cost, sent = sdk_loop(endpoint, episodes)
        arrived = len({s["trace_id"] for s in sink.spans() if s["name"] == "episode"}) if settings is not None else 0
        return cost, sent, arrived, arrived, None, []
    finally:
        sink.kill()


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--episodes", type=int, default=2048)
    parser.add_argument("--rounds", type=int, default=3, help="each round runs every state once, rotated")
    parser.add_argument("--quick", action="store_true",
                        help="smoke run: 128 episodes, 1 round, no warm-up, no hanging receiver (the checks, not the figures)")
    args = parser.parse_args()
    names = list(STATES)
    if args.quick:
        args.episodes, args.rounds = 2 * PER_STEP, 1
        names = [n for n in names if not n.startswith("hanging")]
    runs: dict[tuple[str, str], list[tuple]] = {}
    with tempfile.TemporaryDirectory() as tmp_dir:
        tmp = Path(tmp_dir)
        if not args.quick:  # (a smoke run checks the counts, not the figures)
            with OtlpSink(tmp / "warmup") as warm:  # imports and first-call costs, not measured
                otr_loop(warm.endpoint, 4 * PER_STEP, tmp / "spool-warmup")
                sdk_loop(warm.endpoint, 4 * PER_STEP)
        for r in range(args.rounds):  # states alternated: a drifting machine affects them alike
            order = names[r % len(names):] + names[: r % len(names)]
            for name in order:
                for lib in ("otel_rollouts", "sdk"):
                    runs.setdefault((name, lib), []).append(
                        run_once(name, STATES[name], lib, args.episodes, tmp, str(r)))

    def med(name: str, lib: str, k: int) -> float:
        return statistics.median(run[0][k] for run in runs[(name, lib)])

    print(f"{args.episodes} episodes, {PER_STEP}/step, otel_rollouts keeps {CAP}/step; {args.rounds} rounds,"
          " states alternated; training thread: CPU (time.thread_time) and wall, medians")
    header = (f"{'receiver':24} {'library':14} {'CPU µs/ep':>9} {'vs healthy':>10} {'wall µs/ep':>10} "
              f"{'vs healthy':>10} {'to export':>9} {'arrived':>8} {'safe*':>6} {'dropped':>8}")
    print(header)
    print("-" * len(header))
    for name in names:
        for lib in ("otel_rollouts", "sdk"):
            cpu, wall = med(name, lib, 1), med(name, lib, 0)
            last = runs[(name, lib)][-1]
            _, exported, arrived, safe, dropped, _ = last
            print(
                f"{name:24} {lib:14} {cpu * 1e6:9.1f} {cpu / med(names[0], lib, 1):10.2f} {wall * 1e6:10.1f} "
                f"{wall / med(names[0], lib, 0):10.2f} {exported:9d} {arrived:8d} {safe:6d} "
                f"{'uncounted' if dropped is None else dropped:>8}"
            )
    print("* safe: delivered, or left in the on-disk spool for the next process (last round; the final "
          "counts after shutdown); arrived: distinct episodes the receiver stored")
    spread = [run[0][1] for run in runs[("down (refused)", "otel_rollouts")]]
    healthy = [run[0][1] for run in runs[(names[0], "otel_rollouts")]]
    print("otel_rollouts training-thread CPU, down / healthy per round: "
          + ", ".join(f"{d / h:.2f}" for d, h in zip(spread, healthy, strict=True)))
    print(f"otel_rollouts / raw SDK training-thread CPU, healthy receiver: "
          f"{med(names[0], 'otel_rollouts', 1) / med(names[0], 'sdk', 1):.2f}")
    problems = [p for name in names for run in runs[(name, "otel_rollouts")] for p in run[5]]
    for p in problems:
        print(f"CHECK FAILED: {p}")
    if problems:
        return 1
    print(f"checked: in every run, delivered + in the spool + dropped == kept (safe <= kept), "
          f"{len(names)} receiver states x {args.rounds} rounds")
    return 0


if __name__ == "__main__":
    sys.exit(main())
