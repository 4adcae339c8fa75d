"""What building a dataset from kept episodes costs: rows per CPU second and peak memory, from an
OTLP/JSON file and from a Trackio project, as the input grows.

A run of ``--episodes`` kept episodes (prompt ~1 KB, 2 turns, a tool call, reward; ``--per-step``
a step) is exported once to an OTLP/JSON file and to a Trackio project; then, alternated over
``--rounds`` rounds, ``build_dataset`` reads each source for the ``messages`` format (Parquet
only: the Hugging Face copy is a memory-mapped conversion of it) at 1x and 4x the input (a
second run 4x as long: 4x the steps, as many episodes a step, its file and its project). It
prints CPU µs per episode (process_time) and the peak traced memory (tracemalloc, a separate
pass). Checks (exit 1 if one fails): every episode became a row; the two sources wrote the same
rows; the 4x input's peak memory is within 1.5x of the 1x input's (bounded, not growing with it).

    python benchmarks/bench_dataset.py                 # 800 episodes, 3 rounds
    python benchmarks/bench_dataset.py --quick         # 120 episodes, 1 round (CI smoke)
"""

from __future__ import annotations

import argparse
import os
import shutil
import statistics
import sys
import tempfile
import time
import tracemalloc
from pathlib import Path


def _record(path: Path, project: str, episodes: int, per_step: int) -> None:
    import otel_rollouts as otr
    from otel_rollouts.exporters import OtlpJsonFileExporter, TrackioExporter

    otr.configure(exporters=[OtlpJsonFileExporter(str(path)), TrackioExporter(project, run="bench", table=False)],
                  sampler=otr.TailSampler(per_step, "first"), run_id="bench")
    try:
        for i in range(episodes):
            step = i // per_step
            with otr.episode(step=step, group_id=f"g{i // 4}", sample_index=i % 4) as ep:
                ep.prompt([{"role": "system", "content": "You are a careful solver. " * 20},
                           {"role": "user", "content": f"Problem {i}: " + "x + 1 = 2; " * 40}])
                with ep.turn() as turn:
                    turn.record_generation("Let me use the solver. " * 10, output_tokens=60)
                    with turn.tool_call("solve", arguments={"eq": "x + 1 = 2"}) as call:
                        call.result("x = 1")
                with ep.turn() as turn:
                    turn.record_generation(f"The answer is {i % 3}.", output_tokens=6)
                ep.reward(float(i % 3 == 1))
            if i % per_step == per_step - 1:
                otr.end_step(step)
                otr.flush()
        otr.flush()
    finally:
        otr.shutdown()


ROWS_PER_GROUP = [512]  # --quick: smaller, so that even its small input fills a row group


def _build(sources: list[Path], project: str | None, out: Path) -> tuple[float, int]:
    import otel_rollouts as otr

    shutil.rmtree(out, ignore_errors=True)
    start = time.process_time()
    result = otr.build_dataset(sources, out, trackio_project=project, hf=False, progress=False,
                               rows_per_group=ROWS_PER_GROUP[0])
    return time.process_time() - start, result.rows


def _peak(sources: list[Path], project: str | None, out: Path) -> int:
    tracemalloc.start()
    try:
        _build(sources, project, out)
        return tracemalloc.get_traced_memory()[1]
    finally:
        tracemalloc.stop()


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--episodes", type=int, default=800)
    parser.add_argument("--per-step", type=int, default=40)
    parser.add_argument("--rounds", type=int, default=3)
    parser.add_argument("--quick", action="store_true")
    args = parser.parse_args(argv)
    if args.quick:
        args.episodes, args.per_step, args.rounds = 120, 20, 1
        ROWS_PER_GROUP[0] = 32
    work = Path(tempfile.mkdtemp(prefix="bench-dataset-"))
    os.environ["TRACKIO_DIR"] = str(work / "trackio")
    import pyarrow.parquet as pq

    n = args.episodes
    print(f"bench_dataset: {n} kept episodes ({args.per_step} a step), {args.rounds} rounds; "
          f"load average {os.getloadavg()[0]:.2f}; cpu count {os.cpu_count()}")
    file = work / "kept.jsonl"
    _record(file, "bench1", n, args.per_step)
    # 4x: a run 4x as long (4x the steps, the same episodes a step): its file (with its rotated
    # backups) and its project
    file4 = work / "kept4.jsonl"
    _record(file4, "bench4", 4 * n, args.per_step)
    cases = {"file 1x": ([file], None, n), "file 4x": ([file4], None, 4 * n),
             "trackio 1x": ([], "bench1", n), "trackio 4x": ([], "bench4", 4 * n)}
    cpu: dict[str, list[float]] = {name: [] for name in cases}
    failures = []
    for _ in range(args.rounds):
        for name, (sources, project, expected) in cases.items():
            seconds, rows = _build(sources, project, work / "out")
            cpu[name].append(seconds / expected * 1e6)
            if rows != expected:
                failures.append(f"{name}: {rows} rows for {expected} episodes")
    peaks = {name: _peak(sources, project, work / "out") for name, (sources, project, _) in cases.items()}
    a = sorted(pq.read_table(_out(work, [file], None)).to_pylist(), key=lambda r: r["trace_id"])
    b = sorted(pq.read_table(_out(work, [], "bench1")).to_pylist(), key=lambda r: r["trace_id"])
    if a != b or len(a) != n:
        failures.append(f"the file and Trackio gave different rows ({len(a)} and {len(b)})")
    print(f"{'source':12} {'CPU µs/episode':>16} {'min–max':>14} {'peak MiB':>9}")
    for name in cases:
        values = cpu[name]
        print(f"{name:12} {statistics.median(values):16.0f} {min(values):7.0f}–{max(values):<6.0f} "
              f"{peaks[name] / 2**20:9.1f}")
    for kind in ("file", "trackio"):
        ratio = peaks[f"{kind} 4x"] / peaks[f"{kind} 1x"]
        print(f"{kind}: peak memory 4x input / 1x input = {ratio:.2f}")
        if ratio > 1.5:
            failures.append(f"{kind}: peak memory grew {ratio:.2f}x with a 4x input")
    shutil.rmtree(work, ignore_errors=True)
    for failure in failures:
        print(f"CHECK FAILED: {failure}")
    if not failures:
        print(f"checked: every episode a row, the same rows from both sources, memory bounded ({n} and {4 * n} episodes)")
    return 1 if failures else 0


def _out(work: Path, sources: list[Path], project: str | None) -> Path:
    import otel_rollouts as otr

    out = work / ("a" if sources else "b")
    return otr.build_dataset(sources, out, trackio_project=project, hf=False, progress=False).parquet


if __name__ == "__main__":
    sys.exit(main())
