"""What an idle run costs: CPU of the training process and of the renderer process (``render="process"``)
while no episode is recorded.

    python benchmarks/bench_idle.py [--seconds 10] [--render process|thread]

One kept episode starts the renderer and is checked delivered (the file holds its span, the
ledger counted it); then the run stays idle for ``--seconds`` and the CPU of every thread of both
processes is read from ``/proc/<pid>/task/*/schedstat`` (nanoseconds; the tick-based
``cpu_times`` is 10 ms coarse). Linux only. Exits 1 when the check fails.
"""

from __future__ import annotations

import argparse
import glob
import json
import os
import sys
import tempfile
import time


def cpu_s(pid: int) -> float:
    """CPU seconds of every live thread of ``pid`` (schedstat: on-CPU nanoseconds)."""
    total = 0
    for path in glob.glob(f"/proc/{pid}/task/*/schedstat"):
        try:
            with open(path) as f:
                total += int(f.read().split()[0])
        except (OSError, ValueError, IndexError):
            pass
    return total / 1e9


def main() -> int:
    parser = argparse.ArgumentParser(description=(__doc__ or "").split("\n")[0])
    parser.add_argument("--seconds", type=float, default=10.0)
    parser.add_argument("--render", default="process", choices=["process", "thread"])
    parser.add_argument("--settle", type=float, default=3.0, help="idle seconds before measuring")
    args = parser.parse_args()
    if not os.path.exists(f"/proc/{os.getpid()}/schedstat"):
        print("bench_idle: needs /proc/<pid>/task/*/schedstat (Linux)")
        return 1
    import psutil

    import otel_rollouts as otr
    from otel_rollouts.exporters.otlp_json import OtlpJsonFileExporter

    path = os.path.join(tempfile.mkdtemp(prefix="bench-idle-"), "spans.jsonl")
    otr.configure(exporters=[OtlpJsonFileExporter(path)], handle_signals=False, render=args.render,
                  run_id="bench-idle")
    with otr.episode(step=0) as ep:
        ep.reward(1.0)
    otr.end_step(0)
    otr.flush()
    time.sleep(args.settle)
    problems = []
    with open(path) as f:
        spans = sum(len(ss.get("spans", [])) for line in f for rs in json.loads(line)["resourceSpans"]
                    for ss in rs.get("scopeSpans", []))
    delivered = otr.stats().get("steps", {}).get("0/train", {}).get("delivered.OtlpJsonFileExporter")
    if spans < 2 or delivered != 1:
        problems.append(f"the episode was not delivered (spans in the file {spans}, ledger {delivered})")
    kids = psutil.Process().children()
    if args.render == "process" and len(kids) != 1:
        problems.append(f"expected one renderer process, found {len(kids)}")
    me = os.getpid()
    p0, k0 = cpu_s(me), sum(cpu_s(k.pid) for k in kids)
    time.sleep(args.seconds)
    p1, k1 = cpu_s(me), sum(cpu_s(k.pid) for k in kids)
    print(f"bench_idle: render={args.render}, idle {args.seconds:g} s after one delivered episode; "
          f"load average {os.getloadavg()[0]:.2f}")
    print(f"  training process {1e3 * (p1 - p0) / args.seconds:7.3f} ms CPU per second")
    if args.render == "process":
        print(f"  renderer process {1e3 * (k1 - k0) / args.seconds:7.3f} ms CPU per second")
    otr.shutdown()
    if not problems:
        print(f"checked: the episode was delivered ({spans} spans in the file, the ledger counted it)"
              + ("; one renderer process" if args.render == "process" else ""))
    for p in problems:
        print(f"CHECK FAILED: {p}")
    return 1 if problems else 0


if __name__ == "__main__":
    sys.exit(main())
