"""The training process of the gateway flood test (``tests/correlate/test_gateway_flood.py``),
run as a process of its own so that the threads it counts are the library's and the loop's
only (a test worker's process holds whatever earlier tests started: Ray's, a browser driver's).

    python tests/gateway_flood_trainer.py SINK_ENDPOINT FLOOD_SECONDS IDLE_CONNECTIONS MAX_HELD

Prints one JSON line: the per-episode times of both arms, the thread counts, the gateway's RSS,
the flooder's report and the run's totals.
"""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import threading
import time
from pathlib import Path

import psutil
from opentelemetry.exporter.otlp.proto.http.trace_exporter import OTLPSpanExporter
from opentelemetry.sdk.trace import ReadableSpan
from opentelemetry.trace import SpanContext, TraceFlags

import otel_rollouts as otr

FLOODER = Path(__file__).resolve().parent / "gateway_flooder.py"


def _episode_times(n: int, step: int) -> list[float]:
    """Seconds the training thread spends on each of ``n`` episodes (a prompt, one turn with a
    generation, a reward), closing the step every 64."""
    times = []
    for i in range(n):
        started = time.perf_counter()
        with otr.episode(step=step, group_id=f"g{i // 8}", sample_index=i % 8) as ep:
            ep.prompt([{"role": "user", "content": "question"}])
            with ep.turn() as turn, turn.generation("policy") as gen:
                gen.output("answer")
            ep.reward(float(i % 7))
        times.append(time.perf_counter() - started)
        if i % 64 == 63:
            otr.end_step(step)
            step += 1
    return times


def _stranger(n: int) -> ReadableSpan:
    context = SpanContext(n + 1, 1, is_remote=False, trace_flags=TraceFlags(TraceFlags.SAMPLED))
    return ReadableSpan(name="served", context=context, start_time=1, end_time=2)


def main() -> None:
    endpoint, flood_s, idle_connections, max_held = (sys.argv[1], float(sys.argv[2]), int(sys.argv[3]),
                                                     int(sys.argv[4]))
    new_threads: set[str] = set()
    threads_seen: list[tuple[int, int]] = []
    otr.configure(service_name="trainer", exporters=[OTLPSpanExporter(endpoint=endpoint)],
                  sampler=otr.TailSampler(2, "top_bottom"), handle_signals=False,
                  gateway=otr.GatewayOptions(http_port=0, grpc_port=None, max_held_bytes=max_held))
    try:
        gateway = otr.gateway()
        assert gateway is not None and gateway.http_port
        process = psutil.Process(getattr(gateway, "pid", None) or os.getpid())  # the gateway's process
        _episode_times(2000, 0)  # warm: every code path taken once
        rss_before = process.memory_info().rss
        # the library starts some threads when first needed (a renderer's channel at its first
        # pull, the annotation poster at its first batch): counted once the first cycle of
        # blocks took every path, flood included
        threads_before: tuple[int, int] | None = None
        names_before: set[str] = set()
        # the flooder runs until stopped; flood_s of flooding is counted here
        flooder = subprocess.Popen([sys.executable, str(FLOODER), str(gateway.http_port), str(10 * flood_s),
                                    str(idle_connections)], stdout=subprocess.PIPE, text=True)
        idle: list[float] = []
        flooded: list[float] = []
        rss_peak = 0
        step = 1000
        to_gateway = OTLPSpanExporter(endpoint=f"{gateway.http_endpoint}/v1/traces")
        served = 0
        pace = threading.Event()  # never set: waits between blocks, as a training loop between steps
        flooding_s = 0.0
        try:
            # idle and flooded blocks alternate (ABBA: the flooder stopped, running, running,
            # stopped), so that whatever else the machine runs meanwhile weighs on both alike
            while flooding_s < flood_s and flooder.poll() is None:
                for flood in (False, True, True, False):
                    os.kill(flooder.pid, signal.SIGCONT if flood else signal.SIGSTOP)
                    began = time.monotonic()
                    pace.wait(0.1)  # the flood resumes, or what it left in flight is done
                    # a real server's request is still served meanwhile
                    served += flood and to_gateway.export([_stranger(step)]).name == "SUCCESS"
                    (flooded if flood else idle).extend(_episode_times(256, step))
                    step += 10
                    if flood:
                        pace.wait(0.2)
                        flooding_s += time.monotonic() - began
                    rss_peak = max(rss_peak, process.memory_info().rss)
                    if threads_before is not None:
                        threads_seen.append((threading.active_count(), psutil.Process().num_threads()))
                        new_threads.update(t.name for t in threading.enumerate() if t.name not in names_before)
                if threads_before is None:
                    threads_before = (threading.active_count(), psutil.Process().num_threads())
                    names_before = {t.name for t in threading.enumerate()}
            os.kill(flooder.pid, signal.SIGCONT)
            flooder.terminate()  # it prints what it did and exits
            out, _ = flooder.communicate(timeout=30)
        finally:
            if flooder.poll() is None:
                os.kill(flooder.pid, signal.SIGCONT)
                flooder.kill()
        report = json.loads(out)
        totals = otr.stats()["totals"]
    finally:
        otr.shutdown()
    print(json.dumps({"idle": idle, "flooded": flooded, "served": served, "threads_before": threads_before,
                      "threads_during": threads_seen, "rss_before": rss_before, "rss_peak": rss_peak,
                      "report": report, "totals": totals,
                      "new_threads": sorted(new_threads)}), flush=True)



if __name__ == "__main__":
    main()
