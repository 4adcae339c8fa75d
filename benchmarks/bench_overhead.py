"""What recording an episode costs: otel_rollouts next to raw OpenTelemetry and its peers.

One script, one run: each variant runs in its own fresh Python process (a peer's configure()
installs global state) on the same workload, and the table compares them.

Workload: episodes of prompt + 3 turns (a generation each) + 2 tool calls + reward, with
content of realistic size (a ~2 KB prompt, ~1 KB completions, ~0.5 KB tool arguments and
results), 4,096 episodes per step, cap 32 per step.

Variants:
  none          the workload without tracing (the baseline subtracted from all others)
  raw_sdk       the same span tree with plain OpenTelemetry SDK spans, SimpleSpanProcessor into
                an InMemorySpanExporter; content serialised to JSON (SDK attributes must be
                primitives), every episode exported
  otr_dropped   otel_rollouts, cap 0: every episode recorded, then dropped by the sampler
  otr_kept_plain  otel_rollouts, no cap: every episode kept, rendered and exported, with
                secret redaction off (the same work as the raw SDK tree)
  otr_kept      the same with the default secret redaction (a literal pre-scan, then the
                patterns on text that may hold a secret; on the export thread)
  otr_cap32     otel_rollouts, cap 32 (top_bottom): the real setting
  logfire       Pydantic Logfire, send_to_logfire=False, console=False, logfire.span() for each
                span into the same in-memory exporter (no per-step tail sampling: all exported)
  openinference OpenInference's OITracer decorators (@tracer.agent/.chain/.llm/.tool) into the
                same in-memory exporter (no tail sampling: all exported)

Cost is CPU time of the whole process (every thread: rendering and exporting on
otel_rollouts' export thread counts), per episode, minus the no-tracing baseline; ratios are to
the raw SDK's overhead. Peak memory is measured in a second pass with tracemalloc (slower), after
the first step and at the end: "flat" means the end is not above the first step's peak.

    python benchmarks/bench_overhead.py                # default: 3 steps x 4096 episodes
    python benchmarks/bench_overhead.py --steps 5 --episodes 4096
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import time
import tracemalloc

VARIANTS = [
    "none", "raw_sdk", "otr_dropped", "otr_kept_plain", "otr_kept", "otr_cap32", "logfire", "openinference",
]

# --- the workload ------------------------------------------------------------------------------
_WORDS = ("the policy considered several options before it chose to call the search tool with a "
          "query about the integral and then verified the answer against the reference ").split()


def _text(n_chars: int, salt: int) -> str:
    out, i = [], salt
    while sum(len(w) + 1 for w in out) < n_chars:
        out.append(_WORDS[i % len(_WORDS)])
        i += 7
    return " ".join(out)


POOL = 64
PROMPTS = [
    [{"role": "system", "content": _text(600, s)}, {"role": "user", "content": _text(1400, s + 1)}]
    for s in range(POOL)
]
COMPLETIONS = [_text(1000, s + 2) for s in range(POOL)]
TOOL_ARGS = [{"query": _text(300, s + 3), "top_k": 5} for s in range(POOL)]
TOOL_RESULTS = [_text(500, s + 4) for s in range(POOL)]


def sample(i: int):
    """What the rollout produced for episode i (content comes from the model: not built here)."""
    j = i % POOL
    return PROMPTS[j], [COMPLETIONS[(j + k) % POOL] for k in range(3)], TOOL_ARGS[j], TOOL_RESULTS[j], (i * 7919 % 1000) / 1000


# --- variants ----------------------------------------------------------------------------------
def make_none():
    def run_step(step: int, n: int) -> None:
        acc = 0
        for i in range(n):
            prompt, completions, args, result, reward = sample(i)
            acc += len(prompt) + len(completions[0]) + len(args) + len(result) + int(reward)

    return run_step, lambda: None


def _memory_provider():
    from opentelemetry.sdk.trace import TracerProvider
    from opentelemetry.sdk.trace.export import SimpleSpanProcessor
    from opentelemetry.sdk.trace.export.in_memory_span_exporter import InMemorySpanExporter

    exporter = InMemorySpanExporter()
    provider = TracerProvider()
    provider.add_span_processor(SimpleSpanProcessor(exporter))
    return provider, exporter


def make_raw_sdk():
    from opentelemetry import trace

    provider, exporter = _memory_provider()
    tracer = provider.get_tracer("bench")
    dumps = json.dumps

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
                    "rl.span.kind": "reward", "rl.reward": reward}):
                    pass
                root.set_attribute("rl.reward", reward)
        exporter.clear()  # as if shipped: the exporter does not accumulate across steps

    trace.get_tracer_provider()  # noqa: B018 - nothing global is installed
    return run_step, provider.shutdown


def make_otr(cap: int, redact: bool = True):
    from opentelemetry.sdk.trace.export.in_memory_span_exporter import InMemorySpanExporter

    import otel_rollouts as otr

    exporter = InMemorySpanExporter()
    otr.configure(exporters=[exporter], sampler=otr.TailSampler(cap, "top_bottom", step_lag=None),
                  run_id="bench", max_queue=max(256, 2 * cap), redact=redact)

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
        otr.flush()
        exporter.clear()

    return run_step, otr.shutdown


def make_logfire():
    import logfire
    from opentelemetry.sdk.trace.export import SimpleSpanProcessor
    from opentelemetry.sdk.trace.export.in_memory_span_exporter import InMemorySpanExporter

    exporter = InMemorySpanExporter()
    logfire.configure(send_to_logfire=False, console=False, metrics=False,
                      additional_span_processors=[SimpleSpanProcessor(exporter)])

    def run_step(step: int, n: int) -> None:
        for i in range(n):
            prompt, completions, args, result, reward = sample(i)
            with logfire.span("episode", step=step, episode_id=f"{step}-{i}", group_id=f"g{i // 8}") as root:
                with logfire.span("prompt", messages=prompt):
                    pass
                for k in range(3):
                    with logfire.span("turn", turn_index=k):
                        with logfire.span("chat policy", output=completions[k], output_tokens=250):
                            pass
                        if k < 2:
                            with logfire.span("execute_tool search", arguments=args, result=result):
                                pass
                with logfire.span("reward", reward=reward):
                    pass
                root.set_attribute("reward", reward)
        logfire.force_flush()
        exporter.clear()

    return run_step, logfire.shutdown


def make_openinference():
    from openinference.instrumentation import TracerProvider
    from opentelemetry.sdk.trace.export import SimpleSpanProcessor
    from opentelemetry.sdk.trace.export.in_memory_span_exporter import InMemorySpanExporter

    exporter = InMemorySpanExporter()
    provider = TracerProvider()
    provider.add_span_processor(SimpleSpanProcessor(exporter))
    tracer = provider.get_tracer("bench")

    @tracer.chain(name="prompt")
    def prompt_span(messages):
        return None

    @tracer.llm(name="chat policy")
    def generate(completion):
        return completion

    @tracer.tool(name="search")
    def tool(arguments, result):
        return result

    @tracer.chain(name="turn")
    def turn(k, completion, args, result):
        generate(completion)
        if k < 2:
            tool(args, result)

    @tracer.chain(name="reward")
    def reward_span(value):
        return value

    @tracer.agent(name="episode")
    def episode(step, i):
        prompt, completions, args, result, reward = sample(i)
        prompt_span(prompt)
        for k in range(3):
            turn(k, completions[k], args, result)
        return reward_span(reward)

    def run_step(step: int, n: int) -> None:
        for i in range(n):
            episode(step, i)
        exporter.clear()

    return run_step, provider.shutdown


def make(variant: str):
    if variant == "none":
        return make_none()
    if variant == "raw_sdk":
        return make_raw_sdk()
    if variant == "otr_dropped":
        return make_otr(0)
    if variant == "otr_kept":
        return make_otr(1 << 20)
    if variant == "otr_kept_plain":
        return make_otr(1 << 20, redact=False)
    if variant == "otr_cap32":
        return make_otr(32)
    if variant == "logfire":
        return make_logfire()
    if variant == "openinference":
        return make_openinference()
    raise SystemExit(f"unknown variant {variant}")


def child(variant: str, steps: int, episodes: int, mem_steps: int) -> dict:
    """Run one variant in this process: CPU time per episode, then peak memory per step."""
    try:
        run_step, close = make(variant)
    except ImportError as exc:
        return {"variant": variant, "error": f"not installed: {exc.name or exc}"}
    run_step(0, min(episodes, 512))  # warm-up (imports, caches)
    cpu = []
    for step in range(1, steps + 1):
        t0 = time.process_time()
        run_step(step, episodes)
        cpu.append((time.process_time() - t0) / episodes)
    tracemalloc.start()
    peaks = []
    for step in range(steps + 1, steps + 1 + mem_steps):
        tracemalloc.reset_peak()
        run_step(step, episodes)
        peaks.append(tracemalloc.get_traced_memory()[1])
    tracemalloc.stop()
    close()
    cpu.sort()
    return {"variant": variant, "us_per_episode": 1e6 * cpu[len(cpu) // 2], "peaks": peaks}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--steps", type=int, default=3)
    parser.add_argument("--episodes", type=int, default=4096)
    parser.add_argument("--mem-steps", type=int, default=3)
    parser.add_argument("--variants", default=",".join(VARIANTS))
    parser.add_argument("--child", help=argparse.SUPPRESS)
    args = parser.parse_args()
    if args.child:
        print(json.dumps(child(args.child, args.steps, args.episodes, args.mem_steps)))
        return
    results = {}
    for variant in args.variants.split(","):
        proc = subprocess.run(
            [sys.executable, __file__, "--child", variant, "--steps", str(args.steps),
             "--episodes", str(args.episodes), "--mem-steps", str(args.mem_steps)],
            capture_output=True, text=True, env={**os.environ, "OTEL_SDK_DISABLED": "false"},
        )
        lines = [ln for ln in proc.stdout.splitlines() if ln.startswith("{")]
        if proc.returncode != 0 or not lines:
            results[variant] = {"variant": variant, "error": (proc.stderr.strip().splitlines() or ["failed"])[-1]}
        else:
            results[variant] = json.loads(lines[-1])
        print(f"  ran {variant}", file=sys.stderr)
    report(results, args)


def report(results: dict, args) -> None:
    base = results.get("none", {}).get("us_per_episode", 0.0)
    raw = results.get("raw_sdk", {}).get("us_per_episode")
    raw_over = (raw - base) if raw is not None else None
    print(f"\n{args.episodes} episodes/step x {args.steps} steps; prompt + 3 turns + 2 tool calls +"
          " reward; cost = process CPU time per episode (all threads), overhead = minus no tracing")
    print(f"{'variant':<15} {'µs/episode':>11} {'overhead µs':>12} {'× raw SDK':>10}"
          f" {'peak MiB (first step → last)':>30}")
    for variant in args.variants.split(","):
        r = results.get(variant, {})
        if "error" in r:
            print(f"{variant:<15} {'—':>11} {'':>12} {'':>10}   {r['error']}")
            continue
        us = r["us_per_episode"]
        over = us - base
        ratio = f"{over / raw_over:.2f}" if raw_over and variant not in ("none",) else ""
        peaks = r.get("peaks") or [0]
        mem = f"{peaks[0] / 2**20:.1f} → {peaks[-1] / 2**20:.1f}"
        print(f"{variant:<15} {us:>11.1f} {over:>12.1f} {ratio:>10} {mem:>30}")
    if raw_over:
        dropped = results.get("otr_dropped", {}).get("us_per_episode")
        kept = results.get("otr_kept_plain", {}).get("us_per_episode")
        if dropped is not None and kept is not None:
            print(f"\ntargets: dropped ≤ 0.5× raw SDK: {(dropped - base) / raw_over:.2f}×;"
                  f" kept ≤ 1.3×: {(kept - base) / raw_over:.2f}×")


if __name__ == "__main__":
    main()
