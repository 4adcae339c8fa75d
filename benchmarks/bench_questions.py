"""What answering the researchers' questions costs a training step: reasons, group health,
timings, watchlist and the hang watcher, against the same loop without them.

    python benchmarks/bench_questions.py --baseline /path/to/a/checkout/of/the/previous/release
    python benchmarks/bench_questions.py --baseline REF      # a git ref: checked out to a temp dir

Each variant runs in a fresh Python process (``configure()`` is process-wide) on the same
workload, variants alternated in a freshly shuffled order every round. The workload: per step
``--episodes`` episodes (prompt, 3 turns each with a generation, 2 tool calls, reward: 11 spans,
groups of 8), the tail sampler keeping 32, and an exporter that takes step summaries
(``log_metrics``, as Trackio does), so the rollout metrics run as they do by default.

* ``previous``: the baseline checkout (``--baseline``), its default sampler;
* ``now``: this checkout, its default sampler (errors within a quarter of the cap, top/bottom),
  reasons, group health, timings, the hang watcher on (the defaults);
* ``now_all``: this checkout with every part asked for: ``errors+slowest+top_bottom+
  degenerate_groups``, a watchlist of 3 prompts, ``group_size=8``.

Printed: training-thread CPU per episode (``time.thread_time`` of the loop's thread, which
includes ``end_step``), the median over rounds of each variant's ratio to ``previous`` within
the round, and the min-max of that ratio. Each child checks that it did real work: every
episode seen, the cap kept (plus the watched ones), per step.
"""

from __future__ import annotations

import argparse
import json
import random
import statistics
import subprocess
import sys
import tempfile
from pathlib import Path

HERE = Path(__file__).resolve().parent
ROOT = HERE.parent
CAP = 32
GROUP = 8

_CHILD = r'''
import json, sys, time
from opentelemetry.sdk.trace.export import SpanExporter, SpanExportResult
import otel_rollouts as otr

variant, episodes, steps = sys.argv[1], int(sys.argv[2]), int(sys.argv[3])


class Sink(SpanExporter):
    """Takes kept episodes and step summaries (what Trackio is given), keeps a count."""

    def __init__(self):
        self.roots = 0
        self.summaries = 0

    def export(self, spans):
        self.roots += sum(1 for s in spans if s.parent is None)
        return SpanExportResult.SUCCESS

    def log_metrics(self, step, values):
        self.summaries += 1

    def shutdown(self):
        pass


sink = Sink()
kwargs = {}
extra = {}
if variant == "now_all":
    kwargs = dict(policy="errors+slowest+top_bottom+degenerate_groups", watch=[3, 17, 40], group_size=8)
if variant == "now_nohang":
    extra = dict(hang=False)
if variant in ("now_nometrics", "previous_nometrics"):
    Sink.log_metrics = None
otr.configure(exporters=[sink], sampler=otr.TailSampler(32, step_lag=None, **kwargs), run_id="bench",
              handle_signals=False, **extra)
PROMPT = "Solve step by step. " * 100
ANSWER = "Let me think about it. " * 40
per_step = []
for step in range(steps + 1):  # the first step warms up
    start = time.thread_time()
    for i in range(episodes):
        with otr.episode(step=step, group_id=f"g{i // 8}", dataset_index=i // 8) as ep:
            ep.prompt(PROMPT)
            for t in range(3):
                with ep.turn() as turn:
                    turn.record_generation(ANSWER, model="policy", input_tokens=500, output_tokens=60)
                    if t < 2:
                        with turn.tool_call("search", arguments={"q": i}) as call:
                            call.result({"hits": t})
            if i % 97 == 5:
                ep.finish(status="error")
            ep.reward(((i * 7919) % 101) / 100 if (i // 8) % 9 else 1.0)
    otr.end_step(step)
    per_step.append((time.thread_time() - start) / episodes)
otr.flush()
stats = otr.stats()
seen = [stats["steps"][f"{s}/train"]["seen"] for s in range(steps + 1)]
kept = sink.roots
otr.shutdown()
print(json.dumps({"per_episode": per_step[1:], "seen": seen, "kept": kept, "summaries": sink.summaries}))
'''


def _mirror(root: Path) -> Path:
    """A directory whose ``otel_rollouts`` package is ``root``'s, with ``exporters`` inside it
    as the installed package has it: each checkout importable by path, none installed."""
    shim = Path(tempfile.mkdtemp(prefix="otr-shim-")) / "otel_rollouts"
    shim.mkdir()
    for entry in (root / "otel_rollouts").iterdir():
        (shim / entry.name).symlink_to(entry)
    (shim / "exporters").symlink_to(root / "exporters")
    return shim.parent


def _child(variant: str, path: Path, episodes: int, steps: int) -> dict:
    env_path = str(path)
    proc = subprocess.run([sys.executable, "-c", _CHILD, variant, str(episodes), str(steps)],
                          capture_output=True, text=True, timeout=900,
                          env={"PYTHONPATH": env_path, "PATH": "/usr/bin:/bin", "HOME": str(Path.home())},
                          cwd=tempfile.gettempdir())
    if proc.returncode != 0:
        raise SystemExit(f"{variant} failed:\n{proc.stderr[-3000:]}")
    out = json.loads(proc.stdout.strip().splitlines()[-1])
    # it measured real work: every episode offered, the cap (and the watched ones) kept
    assert out["seen"] == [episodes] * (steps + 1), out["seen"]
    least = CAP * (steps + 1)
    assert out["kept"] >= least, (variant, out["kept"], least)
    assert out["summaries"] >= steps + 1 or "nometrics" in variant, out["summaries"]
    return out


def _baseline(ref: str) -> Path:
    path = Path(ref)
    if path.is_dir():
        return path.resolve()
    target = Path(tempfile.mkdtemp(prefix="otr-baseline-"))
    subprocess.run(["git", "-C", str(ROOT), "worktree", "add", "--detach", str(target), ref],
                   check=True, capture_output=True)
    return target


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--baseline", required=True, help="a checkout (directory) or a git ref of the previous release")
    parser.add_argument("--episodes", type=int, default=1024)
    parser.add_argument("--steps", type=int, default=2)
    parser.add_argument("--rounds", type=int, default=5)
    parser.add_argument("--seed", type=int, default=32)
    parser.add_argument("--extra", default="", help="more variants: now_nohang, now_nometrics, previous_nometrics")
    args = parser.parse_args()
    base = _baseline(args.baseline)
    paths = {"previous": _mirror(base), "now": _mirror(ROOT), "now_all": _mirror(ROOT)}
    for extra in args.extra.split(",") if args.extra else ():
        paths[extra] = paths["previous"] if extra.startswith("previous") else paths["now"]
    rng = random.Random(args.seed)
    rounds: list[dict[str, float]] = []
    for r in range(args.rounds):
        order = list(paths)
        rng.shuffle(order)
        got = {v: statistics.median(_child(v, paths[v], args.episodes, args.steps)["per_episode"]) for v in order}
        rounds.append(got)
        print(f"round {r + 1}: " + ", ".join(f"{v} {got[v] * 1e6:.1f} µs" for v in paths), flush=True)
    print(f"\ntraining-thread CPU per episode, {args.episodes} episodes per step, cap {CAP}, "
          f"median of {args.rounds} rounds (ratio to previous within each round: median, min-max)")
    for v in paths:
        per = statistics.median(r[v] for r in rounds) * 1e6
        ratios = [r[v] / r["previous"] for r in rounds]
        print(f"  {v:9s} {per:7.1f} µs   {statistics.median(ratios):.3f}x ({min(ratios):.3f}-{max(ratios):.3f})")


if __name__ == "__main__":
    main()
