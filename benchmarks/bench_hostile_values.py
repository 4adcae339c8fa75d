"""What recording a hostile value costs the training thread: it must cost no more than its size.

One script, one run, side by side on the same inputs:

  tree       a plain nested structure of N containers (each referred to once): the baseline
  shared     a "diamond" of N containers where each level refers twice to the same child
             (2**N paths): a copy that walks paths instead of objects never returns
  cycles     N dicts that each refer back to the whole list (and to themselves)
  huge       one list of N * 1,000 numbers (far past the attribute budget)

Each is recorded as a tool call's arguments with ``otr`` (the episode is dropped by the
sampler, as almost all are), and copied with ``copy.deepcopy`` (memoised, unbounded) for
comparison. Reported: training-thread CPU time per call, and each input's cost as a ratio to
the plain tree of the same number of containers.

    python benchmarks/bench_hostile_values.py            # N = 200 containers
    python benchmarks/bench_hostile_values.py --nodes 1000
"""

from __future__ import annotations

import argparse
import copy
import time

from opentelemetry.sdk.trace.export.in_memory_span_exporter import InMemorySpanExporter

import otel_rollouts as otr


def tree(n: int) -> dict:
    node: dict = {"leaf": "x"}
    for i in range(n):
        node = {"child": node, "level": i, "text": "some content"}
    return node


def shared(n: int) -> dict:
    node: dict = {"leaf": "x"}
    for i in range(n):
        node = {"left": node, "right": node, "level": i}
    return node


def cycles(n: int) -> list:
    items: list = []
    for i in range(n):
        item: dict = {"index": i, "all": items}
        item["self"] = item
        items.append(item)
    return items


def huge(n: int) -> list:
    return list(range(n * 1000))


def _cpu_per_call(fn, repeat: int) -> float:
    start = time.thread_time()
    for _ in range(repeat):
        fn()
    return (time.thread_time() - start) / repeat


def record(value) -> None:
    with otr.episode(step=0) as ep:
        with ep.turn() as turn:
            with turn.tool_call("tool", arguments=value) as call:
                call.result("ok")
        ep.reward(1.0)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--nodes", type=int, default=200, help="containers per input (default: 200)")
    parser.add_argument("--repeat", type=int, default=200, help="calls timed per input (default: 200)")
    args = parser.parse_args()
    otr.configure(exporters=[InMemorySpanExporter()], sampler=otr.TailSampler(0, "first"))
    inputs = {"tree": tree(args.nodes), "shared": shared(args.nodes), "cycles": cycles(args.nodes),
              "huge": huge(args.nodes)}
    rows = []
    for name, value in inputs.items():
        ours = _cpu_per_call(lambda v=value: record(v), args.repeat)
        deep = _cpu_per_call(lambda v=value: copy.deepcopy(v), max(args.repeat // 10, 1))
        rows.append((name, ours, deep))
    otr.shutdown()
    base = rows[0][1]
    print(f"recording one tool call whose arguments hold {args.nodes} containers "
          f"(training-thread CPU per call; ratio to the plain tree)")
    print(f"{'input':<8} {'otel_rollouts':>14} {'x tree':>8} {'copy.deepcopy':>14}")
    for name, ours, deep in rows:
        print(f"{name:<8} {ours * 1e6:>11.1f} us {ours / base:>8.2f} {deep * 1e6:>11.1f} us")


if __name__ == "__main__":
    main()
