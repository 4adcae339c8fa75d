"""Training-process CPU per kept episode: render thread vs renderer process vs raw OpenTelemetry.

``configure(render="process")`` moves rendering (redaction, span building, views, encoding) and
exporting into a renderer process; what stays in the training process is recording the episode,
turning it into its wire form, pickling it and writing it to a pipe, and applying what the
child reports to the ledger. This measures what that leaves in the training process.

Variants, each in its own fresh Python process (``configure()`` installs global state), run in
``--rounds`` rounds, every variant once per round in a shuffled order (``--seed``):

  none     the workload without tracing (subtracted from the others)
  raw_sdk  the same 11-span tree as plain OpenTelemetry SDK spans, ``BatchSpanProcessor`` into an
           ``InMemorySpanExporter`` (drained at the end of each step)
  thread   otel_rollouts, every episode kept, default redaction, ``render="thread"``
  process  the same with ``render="process"``
  default  ``otr.configure()`` as a user calls it: no exporters given (the environment's default,
           local Trackio in a temporary ``TRACKIO_DIR``), no ``render`` (``"auto"``: the renderer
           process for the exporters the library made); checked to run a renderer process

Workload: ``bench_overhead``'s tree (prompt, 3 turns each with a generation, 2 tool calls,
reward; ~2 KB prompt, ~1 KB completions, ~0.5 KB tool arguments and results). Both otel_rollouts
variants export to ``CountingExporter`` (the cheapest exporter, as the raw SDK's in-memory one:
what is compared is rendering; in the renderer process for ``process``), and every step ends
with ``otr.flush()``.

Measured per process, per step, per episode: ``time.process_time()`` of the training process
(every thread of it: the render thread in ``thread`` mode, the writer and reader threads in
``process`` mode; not the renderer process), minus ``none`` of the same round; the median of
its steps. Printed: per variant the median over rounds of its ratio to ``raw_sdk`` of the same
round, with min-max; the renderer process's own CPU per episode (from /proc); and its start-up
cost (seconds from ``configure()`` to the child's first message, and ``configure()``'s CPU in
the training process).

Sanity check (exit status 1 when it fails): every otel_rollouts variant must have stored every
span it kept (the exporter's count, written by it, in the renderer process for ``process``) and the ledger must say every episode was
delivered.

Run: ``python benchmarks/bench_render_process.py`` (defaults: 5 rounds, 512 episodes per step,
3 measured steps after a warm-up step).
"""

from __future__ import annotations

import argparse
import json
import os
import random
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

sys.path.insert(0, str(Path(__file__).resolve().parent))

from bench_overhead import sample  # noqa: E402

VARIANTS = ("none", "raw_sdk", "thread", "process", "default")
SPANS = 11


class CountingExporter:
    """The cheapest exporter that can live in the renderer process (it pickles): counts the
    spans it is given and writes the count to ``path`` at shutdown (read back by the training
    process for the sanity check). Both otel_rollouts variants use it, so that what is compared
    is rendering, not an exporter's encoding."""

    def __init__(self, path: str) -> None:
        self.path = path
        self.spans = 0

    def export(self, spans: Any) -> Any:
        from opentelemetry.sdk.trace.export import SpanExportResult

        self.spans += len(spans)
        return SpanExportResult.SUCCESS

    def force_flush(self, timeout_millis: int = 30000) -> bool:
        Path(self.path).write_text(str(self.spans))
        return True

    def shutdown(self) -> None:
        Path(self.path).write_text(str(self.spans))


def _child_cpu(pid: int | None) -> float:
    """User + system CPU seconds of process ``pid`` so far (0 when unknown)."""
    if pid is None:
        return 0.0
    try:
        fields = Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()
        return (int(fields[11]) + int(fields[12])) / os.sysconf("SC_CLK_TCK")
    except (OSError, IndexError, ValueError):
        return 0.0


def run_variant(variant: str, episodes: int, steps: int, warmup: int) -> dict[str, Any]:
    """Run one variant in this process; per-episode CPU per measured step, and checks."""
    out: dict[str, Any] = {"variant": variant}
    if variant == "none":
        def run_step(step: int, n: int) -> None:
            for i in range(n):
                sample(i)
        finish = None
    elif variant == "raw_sdk":
        import json as _json

        from opentelemetry.sdk.trace import TracerProvider
        from opentelemetry.sdk.trace.export import BatchSpanProcessor
        from opentelemetry.sdk.trace.export.in_memory_span_exporter import InMemorySpanExporter

        exporter = InMemorySpanExporter()
        provider = TracerProvider()
        processor = BatchSpanProcessor(exporter, max_queue_size=65536)
        provider.add_span_processor(processor)
        tracer = provider.get_tracer("bench")
        dumps = _json.dumps
        exported = [0]

        def run_step(step: int, n: int) -> None:
            for i in range(n):
                prompt, completions, args, result, reward = sample(i)
                with tracer.start_as_current_span("episode", attributes={
                    "rl.span.kind": "episode", "rl.step": step, "rl.split": "train",
                    "rl.episode.id": f"{step}-{i}", "rl.group.id": f"g{i // 8}", "rl.sample.index": i % 8,
                }) as root:
                    with tracer.start_as_current_span("prompt", attributes={
                            "rl.span.kind": "prompt", "gen_ai.input.messages": dumps(prompt)}):
                        pass
                    for k in range(3):
                        with tracer.start_as_current_span("turn", attributes={
                                "rl.span.kind": "turn", "rl.turn.index": k}):
                            with tracer.start_as_current_span("chat policy", attributes={
                                "rl.span.kind": "generation", "gen_ai.request.model": "policy",
                                "gen_ai.output.messages": dumps([{"role": "assistant", "content": completions[k]}]),
                                "gen_ai.usage.output_tokens": 250}):
                                pass
                            if k < 2:
                                with tracer.start_as_current_span("execute_tool search", attributes={
                                    "rl.span.kind": "tool", "gen_ai.tool.name": "search",
                                    "gen_ai.tool.call.arguments": dumps(args),
                                    "gen_ai.tool.call.result": result}):
                                    pass
                    with tracer.start_as_current_span("reward", attributes={
                            "rl.span.kind": "reward", "rl.reward.score": reward}):
                        pass
                    root.set_attribute("rl.reward.score", reward)
            processor.force_flush()
            exported[0] += len(exporter.get_finished_spans())
            exporter.clear()

        def finish() -> None:
            provider.shutdown()
            out["exported_spans"] = exported[0]
    else:
        from bench_render_process import (
            CountingExporter as Counting,  # by its module name: it pickles
        )

        import otel_rollouts as otr

        path = Path(tempfile.mkdtemp(prefix="otr-bench-render-")) / "spans.count"
        cpu0, wall0 = time.process_time(), time.monotonic()
        sampler = otr.TailSampler(1_000_000, "top_bottom", step_lag=None)
        if variant == "default":  # what the user gets: the environment's exporters, render "auto"
            os.environ["TRACKIO_DIR"] = str(path.parent / "trackio")
            rt = otr.configure(sampler=sampler, run_id="bench", max_queue=4 * episodes)
        else:
            rt = otr.configure(exporters=[Counting(str(path))], render=variant, sampler=sampler, run_id="bench",
                               max_queue=4 * episodes)
        out["configure_cpu_s"] = time.process_time() - cpu0
        delivery = rt.delivery

        def run_step(step: int, n: int) -> None:
            for i in range(n):
                prompt, completions, args, result, reward = sample(i)
                with otr.episode(step=step, group_id=f"g{i // 8}", sample_index=i % 8) as ep:
                    ep.prompt(prompt)
                    for k in range(3):
                        with ep.turn() as turn:
                            turn.record_generation(completions[k], model="policy", output_tokens=250)
                            if k < 2:
                                with turn.tool_call("search", arguments=args) as call:
                                    call.result(result)
                    ep.reward(reward)
            otr.end_step(step)
            if not otr.flush(120):
                out["flush_failed"] = out.get("flush_failed", 0) + 1

        def finish() -> None:
            startup = getattr(delivery, "startup_s", None)
            if startup is not None:
                out["startup_s"] = startup
            out["report"] = otr.stats()["delivery"]
            out["kept"] = otr.stats()["totals"].get("ledger.entered.CountingExporter", 0)
            out["delivery"] = type(delivery).__name__
            otr.shutdown(60)
            out["exported_spans"] = int(path.read_text()) if path.exists() else 0
            if variant == "default":  # Trackio's exporter confirms each episode stored (the ledger)
                out["exported_spans"] = SPANS * out["report"].get("TrackioExporter", {}).get("delivered", 0)
            out["wall_configure_to_ready_s"] = startup if startup is not None else time.monotonic() - wall0

    run_step(-1, warmup)
    per_step: list[float] = []
    child: list[float] = []
    for step in range(steps):
        pid = getattr(getattr(sys.modules.get("otel_rollouts"), "_rollouts", None), "_installed", lambda: None)()
        renderer = getattr(getattr(pid, "delivery", None), "renderer_pid", None) if pid is not None else None
        c0 = _child_cpu(renderer)
        t0 = time.process_time()
        run_step(step, episodes)
        per_step.append((time.process_time() - t0) / episodes)
        child.append((_child_cpu(renderer) - c0) / episodes)
    out["cpu_per_episode_s"] = statistics.median(per_step)
    out["child_cpu_per_episode_s"] = statistics.median(child)
    out["episodes"] = episodes * steps + warmup
    if finish is not None:
        finish()
    return out


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--rounds", type=int, default=5)
    parser.add_argument("--episodes", type=int, default=512)
    parser.add_argument("--steps", type=int, default=3)
    parser.add_argument("--warmup", type=int, default=128)
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--variant", choices=VARIANTS, help="(internal) run one variant and print JSON")
    args = parser.parse_args()
    if args.variant:
        print(json.dumps(run_variant(args.variant, args.episodes, args.steps, args.warmup)))
        return 0
    rng = random.Random(args.seed)
    rounds: list[dict[str, dict[str, Any]]] = []
    print(f"load average before: {os.getloadavg()}; {os.cpu_count()} CPUs", flush=True)
    for r in range(args.rounds):
        order = list(VARIANTS)
        rng.shuffle(order)
        results: dict[str, dict[str, Any]] = {}
        for variant in order:
            proc = subprocess.run([sys.executable, __file__, "--variant", variant, "--episodes", str(args.episodes),
                                   "--steps", str(args.steps), "--warmup", str(args.warmup)],
                                  capture_output=True, text=True, check=False)
            if proc.returncode != 0:
                print(proc.stderr, file=sys.stderr)
                return 1
            results[variant] = json.loads(proc.stdout.strip().splitlines()[-1])
        rounds.append(results)
        base = results["none"]["cpu_per_episode_s"]
        print(f"round {r + 1}: " + ", ".join(
            f"{v} {1e6 * (results[v]['cpu_per_episode_s'] - base):.0f} us" for v in VARIANTS if v != "none"),
            flush=True)
    print(f"load average after: {os.getloadavg()}")

    def net(res: dict[str, dict[str, Any]], v: str) -> float:
        return float(res[v]["cpu_per_episode_s"] - res["none"]["cpu_per_episode_s"])

    print("\ntraining-process CPU per kept episode (minus `none`), median over rounds [min-max]:")
    for v in ("raw_sdk", "thread", "process", "default"):
        us = [1e6 * net(res, v) for res in rounds]
        ratios = [net(res, v) / net(res, "raw_sdk") for res in rounds]
        print(f"  {v:8s} {statistics.median(us):7.1f} us   {statistics.median(ratios):.2f}x raw SDK "
              f"[{min(ratios):.2f}-{max(ratios):.2f}]")
    ratios = [net(res, "process") / net(res, "thread") for res in rounds]
    print(f"  process / thread: {statistics.median(ratios):.2f}x [{min(ratios):.2f}-{max(ratios):.2f}]")
    child = [1e6 * res["process"]["child_cpu_per_episode_s"] for res in rounds]
    print(f"  renderer process's own CPU per episode: {statistics.median(child):.0f} us "
          f"[{min(child):.0f}-{max(child):.0f}]")
    startup = [res["process"].get("startup_s", float("nan")) for res in rounds]
    conf = [1e3 * res["process"]["configure_cpu_s"] for res in rounds]
    conf_t = [1e3 * res["thread"]["configure_cpu_s"] for res in rounds]
    print(f"  renderer start-up (configure() to its first message): {statistics.median(startup):.2f} s "
          f"[{min(startup):.2f}-{max(startup):.2f}]; configure() CPU here {statistics.median(conf):.0f} ms "
          f"(thread mode {statistics.median(conf_t):.0f} ms)")
    ok = True
    for res in rounds:
        if res["default"]["delivery"] != "ProcessDelivery":
            print(f"SANITY CHECK FAILED: default: delivery {res['default']['delivery']}, not the renderer process")
            ok = False
        for v in ("thread", "process", "default"):
            r = res[v]
            delivered = r["report"]["CountingExporter" if v != "default" else "TrackioExporter"]["delivered"]
            if r["exported_spans"] == 0 or r["exported_spans"] != SPANS * r["episodes"] or delivered != r["episodes"] \
                    or r.get("flush_failed"):
                print(f"SANITY CHECK FAILED: {v}: {r['exported_spans']} spans stored, {delivered} of "
                      f"{r['episodes']} episodes delivered, flush failures {r.get('flush_failed', 0)}")
                ok = False
        if res["raw_sdk"]["exported_spans"] != SPANS * res["raw_sdk"]["episodes"]:
            print(f"SANITY CHECK FAILED: raw_sdk exported {res['raw_sdk']['exported_spans']} spans")
            ok = False
    print("sanity check: " + ("every kept span stored by the exporter (read back; default: Trackio's stores "
                              "confirmed by the ledger), every episode delivered, default in a renderer process"
                              if ok else "FAILED"))
    return 0 if ok else 1


if __name__ == "__main__":
    sys.exit(main())
