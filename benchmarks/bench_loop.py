"""The figure users feel: what tracing adds to the step time of a realistic RL loop.

Two modes.

``--mode episodes`` (the default; the step-overhead figure): the user's loop, 512 episodes per
step, each ~7.5 ms of numpy CPU standing in for inference inside 3 ``@otr.traced`` generations
that take the growing conversation, 3 ``@otr.traced`` tool calls, a prompt and a reward; the
default sampler (cap 32). Inside one process, traced and untraced episodes alternate in ABBA
blocks of ``--block`` (1 to 4) episodes, so that both arms see the same mix of this machine's
CPU speed modes (whole-step pairs measure the switches between them: A/A sd ~5.9%; single
episodes: ~0.45% per step). Per step: (traced episodes' training-thread CPU + ``end_step``) /
(untraced episodes' CPU) - 1, and the same with all the other CPU the step cost the process
(its other threads, the flush) and its child processes (the renderer of ``render="process"``,
read at nanosecond resolution from schedstat); the median (quartiles) over ``--steps`` x
``--rounds`` steps. Arms, each a step of its own, in rotated order: ``aa`` (untraced against
untraced: the A/A row, the same units), ``floor`` (``FloorLib``: no library, the least a recorder
of the same 9 spans with this API can do, in the same units: what no implementation goes
below), ``otr`` (this checkout) and, with ``--prev REV``, the
previous release (its package exported from git at REV, absolute imports rewritten, imported as
``otel_rollouts_prev`` in the same process); ``--kinds process`` runs ``aa`` and
``render="process"`` in a process of their own. The threads of a library not measured in a step
(the other release's) are left out of its CPU. Checks: every traced step exported min(32, n)
episodes of 9 spans and the ledger counted them delivered; no export on the training thread; the
untraced episodes did at least half their calibrated work.

    python benchmarks/bench_loop.py --prev 6ee8273 --markdown   # 8 steps per arm (~5 CPU minutes)
    python benchmarks/bench_loop.py --quick --kinds thread       # smoke
    python benchmarks/bench_loop.py --profile 1024               # where a traced episode's time goes
    python benchmarks/bench_loop.py --segments 128 --steps 4     # the same, timed in the loop itself,
                                                                 # against the floor

``--mode steps`` (below): untraced and traced whole steps alternated, every variant and peer in
a process of its own (the peers' table).

One script, one run. Each variant runs in its own fresh Python process (a peer's configure()
installs global state, and every child refuses network connections: the guard of
``bench_overhead.py``); the run is repeated in ``--rounds`` rounds, every variant once per round
in a freshly shuffled order (``--seed``).

The loop: per step ``--episodes`` episodes (default 512). Each episode is a prompt (~2 KB), 3
turns each with a generation (~1 KB completion, token counts) and 2 tool calls in all (~0.5 KB
arguments and results), then a reward: ``bench_overhead.py``'s content and its 11-span tree.
Each generation does a fixed piece of real numpy work standing in for inference (float32
matrix products; one BLAS thread), calibrated once in the parent so that an episode's three
generations cost ``--work-ms`` (default 8 ms) of CPU, or fixed with ``--work-iters`` (the
printed rerun command fixes it: CPU time of the same work varies ~25% on shared cores); every
child does the same work.

In one process, steps without tracing and steps with tracing alternate (off, on, off, on...,
after one unmeasured warm-up pair); the overhead of a pair is (on - off) / off of the step's
time. Reported: the median over all pairs of all rounds, with the min-max next to it, of
  training thread  time.thread_time() of the thread running the loop, from the step's first
                   episode to the end of the user's step: ``otr.end_step(step)`` for
                   otel_rollouts, the loop's last span for the others (a user of the raw SDK,
                   Logfire, OpenInference or Langfuse does not flush each step);
  process          time.process_time() of the whole process, every thread, until the step's
                   export work is done: after the user's step end, the exporters are flushed
                   (``otr.flush()``, ``provider.force_flush()``, ``logfire.force_flush()``,
                   ``langfuse.flush()``) *from a helper thread*, so that whatever a flush does
                   runs off the training thread (the SDK's BatchSpanProcessor.force_flush
                   exports on its caller's thread) and the step's export work is counted in its
                   own step, not in the next (tracing-off) one;
  + child processes  process CPU plus the CPU of this process's child processes over the same
                   span (psutil; where the library renders in a child process, its CPU is
                   there, not in process CPU); a column of its own only when one used CPU;
  wall             time.perf_counter() over the same span as process (noisy on shared cores).
``gc.collect()`` runs before each measured step (outside the clocks), so one step's garbage is
not collected in the other.

Variants (every one checks what it measured; see ``check``):
  aa_control        no tracing in either step: the noise floor of the method (A/A)
  otr_cap32         otel_rollouts' per-episode API (otr.episode, ep.prompt, ep.turn,
                    turn.generation as a ``with`` block around the inference, turn.tool_call,
                    ep.reward), the default sampler (``TailSampler(32)``: cap 32 per step,
                    the default policy), into an in-memory exporter; 32 kept per step
  otr_traced_cap32  the same, the generation a function decorated with
                    ``@otr.traced(kind="generation", model="policy")`` doing the inference
  otr_batch_cap32   the batched path: the step's episodes run untraced, then
                    ``otr.record_batch`` offers them all (rewards, group ids) and records the
                    content only of the ones the sampler may keep
  otr_keep_all      the per-episode API keeping every episode (cap = episodes per step)
  raw_sdk_all       raw OpenTelemetry SDK spans (JSON content attributes), BatchSpanProcessor
                    (queue raised so nothing is dropped) into an in-memory exporter: all
                    exported
  raw_sdk_head16    the same with head sampling, ParentBased(TraceIdRatioBased(1/16))
  logfire           Pydantic Logfire configured as in bench_overhead.py (sending off, console
                    off, SimpleSpanProcessor into an in-memory exporter): all exported
  openinference     OpenInference OITracer decorators, SimpleSpanProcessor: all exported
  langfuse          the Langfuse SDK offline as in bench_overhead.py (its own
                    BatchSpanProcessor, the OTLP exporter replaced by an in-memory one)
A peer whose package is not installed is skipped, with a printed line saying so.

    python benchmarks/bench_loop.py --mode steps                  # 512 episodes, 3 rounds x 3 pairs
    python benchmarks/bench_loop.py --mode steps --markdown       # also the README's table
    python benchmarks/bench_loop.py --mode steps --variants otr_cap32,raw_sdk_all --rounds 5
    python benchmarks/bench_loop.py --mode steps --json out.json  # every child's figures (after each round)
    python benchmarks/bench_loop.py --from-json out.json --markdown   # re-render only (either mode)
    python benchmarks/bench_loop.py --mode steps --quick          # smoke: 32 episodes of 2 ms, 1 round, 2 pairs

Exit status non-zero when a check fails (or a present variant fails to run).
"""

from __future__ import annotations

import argparse
import gc
import importlib.util
import json
import os
import platform
import random
import statistics
import subprocess
import sys
import threading
import time
from collections.abc import Callable, Sequence
from typing import Any

# One BLAS thread: the stand-in inference runs on the training thread (set before numpy loads)
for _var in ("OPENBLAS_NUM_THREADS", "OMP_NUM_THREADS", "MKL_NUM_THREADS"):
    os.environ.setdefault(_var, "1")

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))

import bench_overhead as overhead  # noqa: E402 - the content, the network guard, the checkout
from bench_dropped import floor_span_class  # noqa: E402 - the floor's span

VARIANTS = ["aa_control", "otr_cap32", "otr_traced_cap32", "otr_batch_cap32", "otr_keep_all",
            "otr_cap32_process", "otr_keep_all_process", "raw_sdk_all", "raw_sdk_head16", "logfire", "openinference", "langfuse"]

LABELS = {
    "aa_control": "no tracing in either step (A/A: the method's noise floor)",
    "otr_cap32": "otel_rollouts, per-episode API, cap 32 (default sampler)",
    "otr_traced_cap32": "otel_rollouts, `@otr.traced(kind=\"generation\")`, cap 32",
    "otr_batch_cap32": "otel_rollouts, `otr.record_batch` after the step, cap 32",
    "otr_keep_all": "otel_rollouts, per-episode API, every episode kept",
    "otr_cap32_process": "otel_rollouts, cap 32, `render=\"process\"` (OTLP/JSON file)",
    "otr_keep_all_process": "otel_rollouts, every episode kept, `render=\"process\"` (OTLP/JSON file)",
    "raw_sdk_all": "raw OTel SDK, BatchSpanProcessor, everything exported",
    "raw_sdk_head16": "raw OTel SDK, head-sampled 1/16 (ParentBased(TraceIdRatioBased))",
    "logfire": "Pydantic Logfire{version} (sending off, everything exported)",
    "openinference": "OpenInference{version} OITracer decorators (everything exported)",
    "langfuse": "Langfuse{version} (offline, everything exported)",
}

# variant -> (module that must import, distribution for the version line)
PACKAGES = {
    "logfire": ("logfire", "logfire"),
    "openinference": ("openinference.instrumentation", "openinference-instrumentation"),
    "langfuse": ("langfuse", "langfuse"),
}

# peers whose configuration (as bench_overhead.py sets them up) exports synchronously, on the
# thread that ends the span: exports on the training thread are theirs by design, not counted
# against them by the check
SYNC_EXPORT = {"logfire", "openinference"}

CAP = 32
SPANS_PER_EPISODE = 11
PROMPT_TOKENS = 512
OUTPUT_TOKENS = 250
WARMUP_EPISODES = 64
CHILD_CPU_NOTED = 0.005  # seconds of child-process CPU in a step worth a column
OFF_WORK_FLOOR = 0.5  # an off step must take at least this share of its calibrated work (CPU time of
# the same work varies ~25% between processes on shared cores; the check catches work not done)
MATRIX = 128

sample = overhead.sample


# --- the stand-in inference ------------------------------------------------------------------
class Work:
    """A fixed numpy workload: ``iters`` float32 products of a 128 x 128 matrix per call."""

    def __init__(self, iters: int) -> None:
        import numpy as np

        rng = np.random.default_rng(0)
        self.np = np
        self.a = (rng.standard_normal((MATRIX, MATRIX)) / MATRIX ** 0.5).astype(np.float32)
        self.x0 = rng.standard_normal((MATRIX, MATRIX)).astype(np.float32)
        self.iters = iters

    def __call__(self) -> float:
        x = self.x0
        tanh, a = self.np.tanh, self.a
        for _ in range(self.iters):
            x = tanh(a @ x)
        return float(x[0, 0])


def per_call(w: Work, timings: int = 15) -> float:
    """Thread CPU seconds of one call of ``w``: the least of ``timings`` timings of 5 calls (on a
    shared machine CPU time only grows under contention)."""
    times = []
    for _ in range(timings):
        t0 = time.thread_time()
        for _ in range(5):
            w()
        times.append((time.thread_time() - t0) / 5)
    return min(times)


def calibrate(work_ms: float) -> tuple[int, float]:
    """Iterations per generation so that 3 generations take ``work_ms`` of thread CPU, and the
    measured CPU ms per episode at that setting."""
    probe = Work(60)
    probe()  # first calls: imports, allocations
    per_iter = per_call(probe) / probe.iters
    iters = max(1, round(work_ms / 1e3 / 3 / per_iter))
    return iters, 3 * per_call(Work(iters)) * 1e3


# --- an exporter that says which thread exported ----------------------------------------------
def noting_exporter(training: int) -> Any:
    """An in-memory exporter counting the export calls made on the training thread; it takes
    the step scalars as Trackio's exporter (the default one) does, so that the library computes
    them as in its default configuration."""
    from opentelemetry.sdk.trace.export.in_memory_span_exporter import InMemorySpanExporter

    class LoopExporter(InMemorySpanExporter):
        on_training = 0
        calls = 0
        steps_logged = 0

        def log_metrics(self, step: int, values: dict[str, float]) -> None:
            if values:
                self.steps_logged += 1

        def export(self, spans: Sequence[Any]) -> Any:
            self.calls += 1
            if threading.get_ident() == training:
                self.on_training += 1
            return super().export(spans)

    return LoopExporter()


def count_jsonl(path: str, offset: int) -> tuple[int, int, int]:
    """(root spans, spans, the file's new end) of the OTLP JSON lines written to ``path`` after
    ``offset``."""
    roots = spans = 0
    with open(path, "rb") as f:
        f.seek(offset)
        data = f.read()
    for line in data.splitlines():
        for rs in json.loads(line).get("resourceSpans", []):
            for ss in rs.get("scopeSpans", []):
                for span in ss.get("spans", []):
                    spans += 1
                    roots += not span.get("parentSpanId")
    return roots, spans, offset + len(data)


def drain(exporter: Any) -> tuple[int, int]:
    """The step's (root spans, spans), then cleared as if shipped."""
    spans = exporter.get_finished_spans()
    exporter.clear()
    return sum(1 for s in spans if s.parent is None), len(spans)


# --- the loops -------------------------------------------------------------------------------
class Loop:
    """One variant: ``on(step, n)`` runs a traced step up to the user's step end (training
    thread), ``settle(step)`` waits for its export work (called on a helper thread),
    ``counts(step)`` says what the step exported: (episodes, spans, delivered per the library)."""

    exporter: Any = None

    def __init__(self, work: Work) -> None:
        self.work = work

    def off(self, step: int, n: int) -> None:
        """The same loop without tracing."""
        work = self.work
        acc = 0.0
        for i in range(n):
            prompt, completions, args, result, reward = sample(i)
            for k in range(3):
                acc += work() + len(completions[k])
                if k < 2:
                    acc += len(args) + len(result)
            acc += reward

    def on(self, step: int, n: int) -> None:
        self.off(step, n)

    def settle(self, step: int) -> None:
        return None

    def counts(self, step: int) -> tuple[int, int, int | None]:
        if self.exporter is None:
            return 0, 0, None
        roots, spans = drain(self.exporter)
        return roots, spans, None

    def close(self) -> None:
        return None


class OtrLoop(Loop):
    """otel_rollouts: per-episode API, ``@traced`` generation, or ``record_batch``."""

    def __init__(self, work: Work, training: int, cap: int, style: str) -> None:
        super().__init__(work)
        import otel_rollouts as otr

        self.otr = otr
        self.style = style
        self.exporter = noting_exporter(training)
        otr.configure(exporters=[self.exporter], sampler=otr.TailSampler(cap), run_id="bench-loop",
                      handle_signals=False)
        current: list[str] = []
        self.current = current

        @otr.traced(kind="generation", model="policy")
        def generate(messages: list[dict[str, str]], k: int) -> str:
            work()
            return current[k]

        self.generate = generate

    def on(self, step: int, n: int) -> None:
        if self.style == "batch":
            self.batch(step, n)
            return
        otr, work, traced = self.otr, self.work, self.style == "traced"
        for i in range(n):
            prompt, completions, args, result, reward = sample(i)
            with otr.episode(step=step, group_id=f"g{i // 8}", sample_index=i % 8) as ep:
                ep.prompt(prompt)
                if traced:
                    self.current[:] = completions
                for k in range(3):
                    with ep.turn() as turn:
                        if traced:
                            self.generate(prompt, k)
                        else:
                            with turn.generation(model="policy") as gen:
                                work()
                                gen.output(completions[k], input_tokens=PROMPT_TOKENS,
                                           output_tokens=OUTPUT_TOKENS)
                        if k < 2:
                            with turn.tool_call("search", arguments=args) as call:
                                call.result(result)
                ep.reward(reward)
        otr.end_step(step)

    def batch(self, step: int, n: int) -> None:
        """The step runs untraced; its episodes are offered at once after the work."""
        self.off(step, n)
        rewards = [sample(i)[4] for i in range(n)]

        def record(i: int, ep: Any) -> None:
            prompt, completions, args, result, _ = sample(i)
            ep.prompt(prompt)
            for k in range(3):
                with ep.turn() as turn:
                    turn.record_generation(completions[k], model="policy", input_tokens=PROMPT_TOKENS,
                                           output_tokens=OUTPUT_TOKENS)
                    if k < 2:
                        with turn.tool_call("search", arguments=args) as call:
                            call.result(result)

        self.otr.record_batch(n, step=step, rewards=rewards, group_ids=[f"g{i // 8}" for i in range(n)],
                              sample_indices=[i % 8 for i in range(n)], record=record)
        self.otr.end_step(step)

    def settle(self, step: int) -> None:
        self.otr.flush()

    def counts(self, step: int) -> tuple[int, int, int | None]:
        roots, spans = drain(self.exporter)
        entry = self.otr.stats().get("steps", {}).get(f"{step}/train", {})
        delivered = entry.get(f"delivered.{type(self.exporter).__name__}")
        return roots, spans, delivered

    def close(self) -> None:
        self.otr.shutdown()


class OtrProcessLoop(OtrLoop):
    """otel_rollouts rendering in its renderer process (``render="process"``), exporting to an
    OTLP/JSON file there: the file is what the step exported."""

    def __init__(self, work: Work, training: int, cap: int) -> None:
        Loop.__init__(self, work)
        import tempfile

        import otel_rollouts as otr
        from otel_rollouts.exporters.otlp_json import OtlpJsonFileExporter

        self.otr = otr
        self.style = "episode"
        self.current = []
        self.dir = tempfile.mkdtemp(prefix="bench-loop-")
        self.path = os.path.join(self.dir, "spans.jsonl")
        self.offset = 0
        self.exporter = OtlpJsonFileExporter(self.path)
        otr.configure(exporters=[self.exporter], sampler=otr.TailSampler(cap), run_id="bench-loop",
                      handle_signals=False, render="process")

    def counts(self, step: int) -> tuple[int, int, int | None]:
        roots, spans, self.offset = count_jsonl(self.path, self.offset)  # the lines written since the last step
        entry = self.otr.stats().get("steps", {}).get(f"{step}/train", {})
        delivered = entry.get(f"delivered.{type(self.exporter).__name__}")
        return roots, spans, delivered

    def close(self) -> None:
        import shutil

        self.otr.shutdown()
        shutil.rmtree(self.dir, ignore_errors=True)


class RawSdkLoop(Loop):
    """Plain OpenTelemetry SDK spans, BatchSpanProcessor, optional head sampling."""

    def __init__(self, work: Work, training: int, ratio: float | None) -> None:
        super().__init__(work)
        from opentelemetry.sdk.trace import TracerProvider
        from opentelemetry.sdk.trace.export import BatchSpanProcessor
        from opentelemetry.sdk.trace.sampling import ParentBased, TraceIdRatioBased

        self.exporter = noting_exporter(training)
        sampler = None if ratio is None else ParentBased(TraceIdRatioBased(ratio))
        self.provider = TracerProvider(sampler=sampler) if sampler is not None else TracerProvider()
        # the default queue (2,048 spans) drops most of a 512-episode step: raised, so that
        # "everything exported" holds
        self.provider.add_span_processor(BatchSpanProcessor(self.exporter, max_queue_size=1 << 20))
        self.tracer = self.provider.get_tracer("bench-loop")

    def on(self, step: int, n: int) -> None:
        tracer, work, dumps = self.tracer, self.work, json.dumps
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
                                "rl.span.kind": "generation", "gen_ai.request.model": "policy"}) as gen:
                            work()
                            gen.set_attributes({
                                "gen_ai.output.messages": dumps([{"role": "assistant", "content": completions[k]}]),
                                "gen_ai.usage.input_tokens": PROMPT_TOKENS,
                                "gen_ai.usage.output_tokens": OUTPUT_TOKENS})
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

    def settle(self, step: int) -> None:
        self.provider.force_flush()

    def close(self) -> None:
        self.provider.shutdown()


class LogfireLoop(Loop):
    def __init__(self, work: Work, training: int) -> None:
        super().__init__(work)
        import logfire
        from opentelemetry.sdk.trace.export import SimpleSpanProcessor

        self.logfire = logfire
        self.exporter = noting_exporter(training)
        logfire.configure(send_to_logfire=False, console=False, metrics=False,
                          additional_span_processors=[SimpleSpanProcessor(self.exporter)])

    def on(self, step: int, n: int) -> None:
        span, work = self.logfire.span, self.work
        for i in range(n):
            prompt, completions, args, result, reward = sample(i)
            with span("episode", step=step, episode_id=f"{step}-{i}", group_id=f"g{i // 8}") as root:
                with span("prompt", messages=prompt):
                    pass
                for k in range(3):
                    with span("turn", turn_index=k):
                        with span("chat policy", input_tokens=PROMPT_TOKENS) as gen:
                            work()
                            gen.set_attributes({"output": completions[k], "output_tokens": OUTPUT_TOKENS})
                        if k < 2:
                            with span("execute_tool search", arguments=args, result=result):
                                pass
                with span("reward", reward=reward):
                    pass
                root.set_attribute("reward", reward)

    def settle(self, step: int) -> None:
        self.logfire.force_flush()

    def close(self) -> None:
        self.logfire.shutdown()


class OpenInferenceLoop(Loop):
    def __init__(self, work: Work, training: int) -> None:
        super().__init__(work)
        from openinference.instrumentation import TracerProvider
        from opentelemetry.sdk.trace.export import SimpleSpanProcessor

        self.exporter = noting_exporter(training)
        self.provider = TracerProvider()
        self.provider.add_span_processor(SimpleSpanProcessor(self.exporter))
        tracer = self.provider.get_tracer("bench-loop")

        @tracer.chain(name="prompt")
        def prompt_span(messages: Any) -> None:
            return None

        @tracer.llm(name="chat policy")  # type: ignore[arg-type]  # its ParamSpec typing
        def generate(completion: str) -> str:
            work()
            return completion

        @tracer.tool(name="search")
        def tool(arguments: Any, result: str) -> str:
            return result

        @tracer.chain(name="turn")
        def turn(k: int, completion: str, args: Any, result: str) -> None:
            generate(completion)  # type: ignore[arg-type]
            if k < 2:
                tool(args, result)

        @tracer.chain(name="reward")
        def reward_span(value: float) -> float:
            return value

        @tracer.agent(name="episode")
        def episode(step: int, i: int) -> float:
            prompt, completions, args, result, reward = sample(i)
            prompt_span(prompt)
            for k in range(3):
                turn(k, completions[k], args, result)
            return reward_span(reward)

        self.episode = episode

    def on(self, step: int, n: int) -> None:
        for i in range(n):
            self.episode(step, i)

    def settle(self, step: int) -> None:
        self.provider.force_flush()

    def close(self) -> None:
        self.provider.shutdown()


class LangfuseLoop(Loop):
    def __init__(self, work: Work, training: int) -> None:
        super().__init__(work)
        # as bench_overhead.py: the BatchSpanProcessor's queue raised (nothing dropped), no
        # LANGFUSE_* settings from the environment, dummy keys, a closed loopback port
        os.environ["OTEL_BSP_MAX_QUEUE_SIZE"] = str(1 << 20)
        for key in [k for k in os.environ if k.startswith("LANGFUSE_")]:
            del os.environ[key]
        from langfuse import Langfuse

        self.exporter = noting_exporter(training)
        self.lf = Langfuse(public_key="pk-lf-bench", secret_key="sk-lf-bench", base_url="http://127.0.0.1:9",
                           span_exporter=self.exporter, tracing_enabled=True)

    def on(self, step: int, n: int) -> None:
        observe, work = self.lf.start_as_current_observation, self.work
        for i in range(n):
            prompt, completions, args, result, reward = sample(i)
            with observe(name="episode", as_type="agent",
                         metadata={"step": step, "episode_id": f"{step}-{i}", "group_id": f"g{i // 8}",
                                   "sample_index": i % 8}) as root:
                with observe(name="prompt", as_type="span", input=prompt):
                    pass
                for k in range(3):
                    with observe(name="turn", as_type="span", metadata={"turn_index": k}):
                        with observe(name="chat policy", as_type="generation", model="policy") as gen:
                            work()
                            gen.update(output=completions[k],
                                       usage_details={"input": PROMPT_TOKENS, "output": OUTPUT_TOKENS})
                        if k < 2:
                            with observe(name="execute_tool search", as_type="tool", input=args,
                                         output=result):
                                pass
                with observe(name="reward", as_type="span", output=reward):
                    pass
                root.update(output=reward)

    def settle(self, step: int) -> None:
        self.lf.flush()

    def close(self) -> None:
        self.lf.shutdown()


def make(variant: str, work: Work, training: int, episodes: int) -> Loop:
    makers: dict[str, Callable[[], Loop]] = {
        "aa_control": lambda: Loop(work),
        "otr_cap32": lambda: OtrLoop(work, training, CAP, "episode"),
        "otr_traced_cap32": lambda: OtrLoop(work, training, CAP, "traced"),
        "otr_batch_cap32": lambda: OtrLoop(work, training, CAP, "batch"),
        "otr_keep_all": lambda: OtrLoop(work, training, max(episodes, WARMUP_EPISODES), "episode"),
        "otr_cap32_process": lambda: OtrProcessLoop(work, training, CAP),
        "otr_keep_all_process": lambda: OtrProcessLoop(work, training, max(episodes, WARMUP_EPISODES)),
        "raw_sdk_all": lambda: RawSdkLoop(work, training, None),
        "raw_sdk_head16": lambda: RawSdkLoop(work, training, 1 / 16),
        "logfire": lambda: LogfireLoop(work, training),
        "openinference": lambda: OpenInferenceLoop(work, training),
        "langfuse": lambda: LangfuseLoop(work, training),
    }
    if variant not in makers:
        raise SystemExit(f"unknown variant {variant} (known: {', '.join(VARIANTS)})")
    return makers[variant]()


# --- the child -------------------------------------------------------------------------------
def children_cpu() -> float:
    """CPU seconds of this process's child processes (a renderer process, where the library
    runs one): the live ones (psutil, when installed) and the finished ones (``os.times``)."""
    t = os.times()
    total = t.children_user + t.children_system
    try:
        import psutil
    except ImportError:
        return total
    try:
        for proc in psutil.Process().children(recursive=True):
            try:
                times = proc.cpu_times()
                total += times.user + times.system
            except psutil.Error:
                pass
    except psutil.Error:
        pass
    return total


def on_helper_thread(fn: Callable[[], Any]) -> None:
    """Run ``fn`` on a thread of its own and wait: a flush's work never lands on the caller."""
    failure: list[BaseException] = []

    def run() -> None:
        try:
            fn()
        except BaseException as exc:  # noqa: BLE001 - reported by the caller
            failure.append(exc)

    helper = threading.Thread(target=run, name="bench-loop-settle")
    helper.start()
    helper.join()
    if failure:
        raise failure[0]


def child(variant: str, episodes: int, pairs: int, iters: int, seed: int) -> dict[str, Any]:
    """Alternate untraced and traced steps in this process; figures per pair."""
    overhead._guard_network()
    random.seed(seed)
    training = threading.get_ident()
    work = Work(iters)
    try:
        loop = make(variant, work, training, episodes)
    except ImportError as exc:
        return {"variant": variant, "skipped": f"not installed: {exc.name or exc}"}

    def clocks() -> tuple[float, float, float]:
        return time.thread_time(), time.process_time(), time.perf_counter()

    def measured(step: int, n: int, traced: bool) -> dict[str, float]:
        gc.collect()
        c0 = children_cpu()
        t0, p0, w0 = clocks()
        if traced:
            loop.on(step, n)
            t1 = time.thread_time()
            on_helper_thread(lambda: loop.settle(step))
        else:
            loop.off(step, n)
            t1 = time.thread_time()
        _, p1, w1 = clocks()
        children = children_cpu() - c0
        return {"thread": t1 - t0, "process": p1 - p0, "wall": w1 - w0,
                "all_processes": p1 - p0 + children, "children": children}

    warm = min(episodes, WARMUP_EPISODES)  # imports, caches, first calls: not measured
    measured(0, warm, False)
    measured(0, warm, True)
    loop.counts(0)
    out: dict[str, Any] = {"variant": variant, "pairs": []}
    for p in range(1, pairs + 1):
        off = measured(p, episodes, False)
        on = measured(p, episodes, True)
        roots, spans, delivered = loop.counts(p)
        out["pairs"].append({"off": off, "on": on, "episodes": roots, "spans": spans,
                             "delivered": delivered})
    exporter = loop.exporter
    out["exports"] = getattr(exporter, "calls", 0)  # (in a renderer process: not here)
    out["exports_on_training_thread"] = getattr(exporter, "on_training", 0)
    loop.close()
    out["net_attempts"] = overhead.NET_ATTEMPTS[:5]
    return out


def run_child(variant: str, args: argparse.Namespace, iters: int) -> dict[str, Any]:
    proc = subprocess.run(
        [sys.executable, os.path.abspath(__file__), "--child", variant, "--episodes", str(args.episodes),
         "--pairs", str(args.pairs), "--work-iters", str(iters), "--seed", str(args.seed)],
        capture_output=True, text=True,
        env={**os.environ, "OTEL_SDK_DISABLED": "false", "OPENBLAS_NUM_THREADS": "1",
             "OMP_NUM_THREADS": "1", "MKL_NUM_THREADS": "1"},
    )
    lines = [ln for ln in proc.stdout.splitlines() if ln.startswith("{")]
    if proc.returncode != 0 or not lines:
        tail = (proc.stderr.strip().splitlines() or ["failed"])[-1]
        return {"variant": variant, "error": f"exit {proc.returncode}: {tail}"}
    result: dict[str, Any] = json.loads(lines[-1])
    return result


# --- the checks ------------------------------------------------------------------------------
def expected(variant: str, n: int) -> int | None:
    """Episodes each traced step must export (None: checked otherwise)."""
    if variant == "aa_control":
        return 0
    if variant.startswith("otr_"):
        return n if variant.startswith("otr_keep_all") else min(CAP, n)
    if variant == "raw_sdk_head16":
        return None
    return n


def check(variant: str, result: dict[str, Any], n: int, work_ms: float) -> list[str]:
    """What this child measured was real work: the episodes and spans it exported per step are
    the ones expected, the library delivered them, no export ran on the training thread (where
    the variant exports on threads), and an untraced step took at least its calibrated work."""
    problems: list[str] = []
    pairs = result.get("pairs", [])
    if not pairs:
        return [f"{variant}: no step measured"]
    want = expected(variant, n)
    for k, pair in enumerate(pairs, 1):
        eps, spans = pair["episodes"], pair["spans"]
        if want is not None and eps != want:
            problems.append(f"{variant}: step {k} exported {eps} episodes, expected {want}")
        if spans != SPANS_PER_EPISODE * eps:
            problems.append(f"{variant}: step {k} exported {spans} spans for {eps} episodes, "
                            f"expected {SPANS_PER_EPISODE} each")
        if variant.startswith("otr_") and pair.get("delivered") != want:
            problems.append(f"{variant}: step {k}: the library counts {pair.get('delivered')} delivered, "
                            f"expected {want}")
        floor = OFF_WORK_FLOOR * n * work_ms / 1e3
        if pair["off"]["thread"] < floor:
            problems.append(f"{variant}: step {k}'s untraced step took {pair['off']['thread'] * 1e3:.0f} ms "
                            f"of thread CPU, under {OFF_WORK_FLOOR:.0%} of its calibrated work "
                            f"({n * work_ms:.0f} ms)")
    if variant == "raw_sdk_head16":
        kept = [p["episodes"] for p in pairs]
        if sum(kept) == 0:
            problems.append(f"{variant}: head sampling 1/16 exported no episode in {len(kept)} steps")
        elif n * len(kept) >= 512 and not n / 64 <= statistics.mean(kept) <= n / 4:
            problems.append(f"{variant}: head sampling 1/16 exported {statistics.mean(kept):.1f} "
                            f"episodes per step of {n}, far from {n / 16:.0f}")
    if variant not in SYNC_EXPORT and result.get("exports_on_training_thread"):
        problems.append(f"{variant}: {result['exports_on_training_thread']} exports ran on the "
                        "training thread")
    if result.get("net_attempts"):
        problems.append(f"{variant}: attempted network connections {result['net_attempts']}")
    return problems


# --- the parent ------------------------------------------------------------------------------
def available(variant: str) -> str | None:
    """None when the variant can run here, else why not."""
    need = PACKAGES.get(variant)
    if need is None:
        return None
    try:
        found = importlib.util.find_spec(need[0]) is not None
    except (ImportError, ValueError):
        found = False
    return None if found else f"package {need[1]} not installed"


def conditions(args: argparse.Namespace, variants: list[str], iters: int, work_ms: float) -> dict[str, Any]:
    from importlib import metadata

    versions: dict[str, str] = {}
    for dist in ["otel-rollouts", "opentelemetry-sdk", "numpy"] + [PACKAGES[v][1] for v in variants if v in PACKAGES]:
        try:
            versions[dist] = metadata.version(dist)
        except metadata.PackageNotFoundError:
            versions[dist] = "not installed"
    affinity = len(os.sched_getaffinity(0)) if hasattr(os, "sched_getaffinity") else os.cpu_count()
    return {
        "episodes": args.episodes, "pairs": args.pairs, "rounds": args.rounds, "seed": args.seed,
        "work_ms_target": args.work_ms, "work_iters": iters, "work_ms": round(work_ms, 3),
        "python": platform.python_version(), "implementation": platform.python_implementation(),
        "platform": platform.platform(), "cpu_count": os.cpu_count(), "cpus_usable": affinity,
        "loadavg_start": [round(x, 2) for x in os.getloadavg()] if hasattr(os, "getloadavg") else None,
        "versions": versions, "commit": overhead.checkout(), "command": command_line(args, iters),
    }


def command_line(args: argparse.Namespace, iters: int) -> str:
    """The command that reruns this measurement with the same work per episode."""
    parts = ["python benchmarks/bench_loop.py --mode steps"]
    if args.quick:
        parts.append("--quick")
    else:
        parts += [f"--episodes {args.episodes}", f"--rounds {args.rounds}", f"--pairs {args.pairs}",
                  f"--work-iters {iters}", f"--seed {args.seed}"]
    if args.variants != ",".join(VARIANTS):
        parts.append(f"--variants {args.variants}")
    return " ".join(parts)


def print_conditions(cond: dict[str, Any]) -> None:
    print(f"bench_loop: {cond['episodes']} episodes/step, {cond['pairs']} untraced/traced step pairs per "
          f"process (+ one warm-up pair), {cond['rounds']} rounds alternated (seed {cond['seed']}); "
          f"inference stand-in {cond['work_ms']:.2f} ms of numpy CPU per episode "
          f"({cond['work_iters']} x 3 products of {MATRIX}x{MATRIX} float32)")
    print(f"  python {cond['python']} ({cond['implementation']}) on {cond['platform']}; cpu count "
          f"{cond['cpu_count']} ({cond['cpus_usable']} usable); load average at start {cond['loadavg_start']}"
          f"{'; at end ' + str(cond['loadavg_end']) if cond.get('loadavg_end') else ''}")
    vers = ", ".join(f"{k} {v}" for k, v in cond["versions"].items())
    end = cond.get("commit_end")
    moved = f" at the start, {end} at the end" if end and end != cond.get("commit") else ""
    print(f"  versions: {vers}; checkout {cond.get('commit') or '?'}{moved}")
    print(f"  rerun with the same work: {cond['command']} (or --work-ms to calibrate anew)")
    sys.stdout.flush()


# --- the user's loop, episode by episode (the default mode, ``--mode episodes``) -------------
# The CPU of these machines runs in two speed modes ~40% apart, switching every 1 to 100
# episodes: untraced and traced steps measured one after the other measure those switches (A/A
# sd ~5.9% per step pair). Alternating single episodes (or blocks of at most 4), untraced and
# traced, in ABBA order inside one process puts both arms in the same mix of modes (A/A sd ~0.45%
# per step of 512 + 512 episodes). Every arm of one process is a step of its own: the A/A arm
# (untraced against untraced), this checkout, and the previous release (``--prev REV``: its
# package exported from git and imported as ``otel_rollouts_prev``), in rotated order.
USER_SPANS = 9  # episode, prompt, 3 generations, 3 tool calls, reward
USER_WORK_MS = 7.5
LIBS = ("otel_rollouts_prev", "otel_rollouts")
EPISODE_ARMS = {"thread": ["aa", "floor", "otr", "prev"], "process": ["aa", "otr_process"]}
ARM_LABELS = {
    "aa": "A/A: untraced against untraced (the method's noise floor)",
    "floor": "floor: no library, the least a recorder with this API can do (`FloorLib`)",
    "otr": "otel_rollouts (this checkout), cap 32, render thread",
    "prev": "previous release{rev}, cap 32, render thread",
    "otr_process": "otel_rollouts (this checkout), cap 32, render=\"process\"",
}


def _lib_of(thread: threading.Thread) -> str | None:
    """Which library started ``thread`` (by the module of its target or class), or None."""
    target = getattr(thread, "_target", None)
    mod = (getattr(target, "__module__", None) if target is not None else None) or type(thread).__module__ or ""
    for name in LIBS:
        if mod == name or mod.startswith(name + "."):
            return name
    return None


def _task_cpu(path: str) -> float:
    try:
        with open(path) as f:
            return int(f.read().split()[0]) / 1e9  # on-CPU nanoseconds
    except (OSError, ValueError, IndexError):
        return 0.0


def lib_threads_cpu(libs: set[str]) -> float:
    """CPU seconds of the live threads of this process that the libraries ``libs`` started (an
    idle library's threads are not the active arm's cost)."""
    if not libs:
        return 0.0
    return sum(_task_cpu(f"/proc/self/task/{t.native_id}/schedstat") for t in threading.enumerate()
               if t.native_id is not None and _lib_of(t) in libs)


def children_cpu_ns() -> float:
    """CPU seconds of this process's live child processes, every thread, at nanosecond
    resolution (schedstat; psutil's tick-based times are 10 ms coarse, a quarter of a percent of
    a step), plus the finished ones (``os.times``)."""
    t = os.times()
    total = t.children_user + t.children_system
    try:
        import psutil

        kids = psutil.Process().children(recursive=True)
    except Exception:  # noqa: BLE001 - no psutil: the finished ones only
        return total
    for proc in kids:
        tasks = f"/proc/{proc.pid}/task"
        try:
            names = os.listdir(tasks)
        except OSError:
            continue
        total += sum(_task_cpu(f"{tasks}/{tid}/schedstat") for tid in names)
    return total


def export_prev(rev: str) -> str:
    """The package at git revision ``rev`` of this checkout, importable as ``otel_rollouts_prev``
    from the returned folder (its absolute imports rewritten; ``exporters/`` placed as the
    installed layout has it)."""
    import io
    import re
    import tarfile
    import tempfile

    root = subprocess.run(["git", "-C", os.path.dirname(os.path.abspath(__file__)), "rev-parse", "--show-toplevel"],
                          capture_output=True, text=True, check=True).stdout.strip()
    data = subprocess.run(["git", "-C", root, "archive", rev, "otel_rollouts", "exporters"],
                          capture_output=True, check=True).stdout
    folder = tempfile.mkdtemp(prefix="bench-loop-prev-")
    with tarfile.open(fileobj=io.BytesIO(data)) as tar:
        tar.extractall(folder, filter="data")
    pkg = os.path.join(folder, "otel_rollouts_prev")
    os.rename(os.path.join(folder, "otel_rollouts"), pkg)
    os.rename(os.path.join(folder, "exporters"), os.path.join(pkg, "exporters"))
    word = re.compile(r"\botel_rollouts\b")
    for base, _, files in os.walk(pkg):
        for name in files:
            if name.endswith(".py"):
                path = os.path.join(base, name)
                with open(path, encoding="utf-8") as f:
                    text = f.read()
                with open(path, "w", encoding="utf-8") as f:
                    f.write(word.sub("otel_rollouts_prev", text))
    return folder


class FloorLib:
    """The no-library floor of the loop's calls, the least a recorder with this API can do, with
    the library's call shapes (``episode``, ``traced``; ``end_step``, ``flush``, ``shutdown`` do
    nothing): per span one slotted object with a random 64-bit id and ``time_ns`` stamps; the
    episode and each traced call a ``with`` block attached to and detached from the
    OpenTelemetry context (nested instrumentation would join it); a traced call holds its
    arguments and result by reference (no copy); the episode's spans let go at its end.
    ``built``: the spans of each finished episode (a check that it recorded the tree)."""

    def __init__(self) -> None:
        from opentelemetry import context as otel_context
        from opentelemetry import trace

        getrandbits = random.getrandbits
        current, in_context = otel_context.get_current, trace.set_span_in_context
        span_key = next(iter(in_context(trace.INVALID_SPAN, otel_context.Context())))  # its key, public API
        built = self.built = []
        S = floor_span_class()

        class Ep(S):  # type: ignore[misc, valid-type]
            """The episode: a span holding its spans, let go at its end."""

            __slots__ = ("spans",)

            def __exit__(self, *exc: object) -> None:
                S.__exit__(self)
                built.append(len(self.spans))
                self.spans = None

            def prompt(self, messages: Any) -> None:
                self.spans.append(S("prompt", self.trace_id, self.span_id, messages).close())

            def reward(self, value: float) -> None:
                self.spans.append(S("reward", self.trace_id, self.span_id, value).close())

        def episode(step: int, group_id: str, sample_index: int) -> Ep:
            root = Ep("episode", getrandbits(128), None, (step, group_id, sample_index))
            root.spans = [root]
            return root

        def traced(kind: str, **_: Any) -> Callable[[Callable[..., Any]], Callable[..., Any]]:
            def decorate(fn: Callable[..., Any]) -> Callable[..., Any]:
                def wrapper(*args: Any) -> Any:
                    parent = current().get(span_key)
                    with S(kind, parent.trace_id, parent.span_id, args) as span:  # type: ignore[union-attr]
                        span.value = result = fn(*args)
                    parent.spans.append(span)  # type: ignore[union-attr]
                    return result
                return wrapper
            return decorate

        self.episode, self.traced = episode, traced

    def end_step(self, step: int) -> None:
        return None

    def flush(self) -> None:
        return None

    def shutdown(self) -> None:
        return None


class UserLoop:
    """The user's episode: a prompt, 3 generations (``@traced``, taking the growing
    conversation, doing the inference stand-in), 3 tool calls (``@traced``), a reward. ``lib``
    None: the same episode untraced (plain functions, the same appends)."""

    def __init__(self, lib: Any, work: Work) -> None:
        self.lib = lib

        def generate(messages: list[dict[str, str]], k: int) -> str:
            work()
            return self.completions[k]

        def search(arguments: dict[str, Any]) -> str:
            return self.result

        if lib is not None:
            generate = lib.traced(kind="generation", model="policy")(generate)
            search = lib.traced(kind="tool", name="search")(search)
        self.generate, self.search = generate, search
        self.completions: list[str] = []
        self.result = ""

    def episode(self, step: int, i: int) -> None:
        prompt, completions, args, result, reward = sample(i)
        self.completions, self.result = completions, result
        generate, search = self.generate, self.search
        lib = self.lib
        if lib is None:
            messages = list(prompt)
            for k in range(3):
                messages.append({"role": "assistant", "content": generate(messages, k)})
                messages.append({"role": "tool", "content": search(args)})
            return
        with lib.episode(step=step, group_id=f"g{i // 8}", sample_index=i % 8) as ep:
            ep.prompt(prompt)
            messages = list(prompt)
            for k in range(3):
                messages.append({"role": "assistant", "content": generate(messages, k)})
                messages.append({"role": "tool", "content": search(args)})
            ep.reward(reward)


class EpisodeArm:
    """One arm of the episode mode: its traced loop (None for A/A), how it ends and settles a
    step, what the step exported."""

    def __init__(self, name: str, lib: Any, work: Work, training: int, process: bool) -> None:
        self.name, self.lib = name, lib
        self.loop = UserLoop(lib, work)
        self.path = ""
        self.offset = 0
        self.exporter: Any = None
        if lib is None or isinstance(lib, FloorLib):
            return
        if process:
            import tempfile

            from otel_rollouts.exporters.otlp_json import OtlpJsonFileExporter

            self.path = os.path.join(tempfile.mkdtemp(prefix="bench-loop-"), "spans.jsonl")
            self.exporter = OtlpJsonFileExporter(self.path)
            lib.configure(exporters=[self.exporter], sampler=lib.TailSampler(CAP), run_id=f"bench-loop-{name}",
                          handle_signals=False, render="process")
        else:
            self.exporter = noting_exporter(training)
            lib.configure(exporters=[self.exporter], sampler=lib.TailSampler(CAP), run_id=f"bench-loop-{name}",
                          handle_signals=False)

    def counts(self, step: int) -> tuple[int, int, int | None]:
        if self.lib is None or isinstance(self.lib, FloorLib):
            return 0, 0, None
        if self.path:
            roots, spans, self.offset = count_jsonl(self.path, self.offset)
        else:
            roots, spans = drain(self.exporter)
        entry = self.lib.stats().get("steps", {}).get(f"{step}/train", {})
        return roots, spans, entry.get(f"delivered.{type(self.exporter).__name__}")


def episode_child(kind: str, episodes: int, steps: int, block: int, iters: int, seed: int,
                  prev: str | None) -> dict[str, Any]:
    """Alternate the arms step by step; inside a step, untraced and traced episodes in ABBA
    blocks of ``block``. Figures per step."""
    overhead._guard_network()
    random.seed(seed)
    training = threading.get_ident()
    work = Work(iters)
    import otel_rollouts

    arms: list[EpisodeArm] = [EpisodeArm("aa", None, work, training, False)]
    if kind == "process":
        arms.append(EpisodeArm("otr_process", otel_rollouts, work, training, True))
    else:
        floor = FloorLib()
        arms.append(EpisodeArm("floor", floor, work, training, False))
        arms.append(EpisodeArm("otr", otel_rollouts, work, training, False))
        if prev:
            sys.path.insert(0, prev)
            import otel_rollouts_prev  # type: ignore[import-not-found]

            arms.append(EpisodeArm("prev", otel_rollouts_prev, work, training, False))
    off = UserLoop(None, work)
    clock = time.thread_time

    def measured(arm: EpisodeArm, step: int, n: int) -> dict[str, Any]:
        own = (LIBS[1] if arm.lib is otel_rollouts
               else None if arm.lib is None or isinstance(arm.lib, FloorLib) else LIBS[0])
        idle = {lib for lib in LIBS if lib != own}
        on_episode, off_episode = arm.loop.episode, off.episode
        gc.collect()
        l0, c0 = lib_threads_cpu(idle), children_cpu_ns()
        t0, p0 = clock(), time.process_time()
        on_s = off_s = 0.0
        i_on = i_off = 0
        for _ in range(n // (2 * block)):
            for traced in (False, True, True, False):
                s = clock()
                if traced:
                    for _ in range(block):
                        on_episode(step, i_on)
                        i_on += 1
                    on_s += clock() - s
                else:
                    for _ in range(block):
                        off_episode(step, i_off)
                        i_off += 1
                    off_s += clock() - s
        if arm.lib is not None:
            s = clock()
            arm.lib.end_step(step)
            on_s += clock() - s
            on_helper_thread(arm.lib.flush)
        t1, p1 = clock(), time.process_time()
        children = children_cpu_ns() - c0 if own is not None else 0.0
        other = max((p1 - p0) - (t1 - t0) - (lib_threads_cpu(idle) - l0), 0.0)
        roots, spans, delivered = arm.counts(step)
        return {"arm": arm.name, "step": step, "n": n, "on": on_s, "off": off_s, "other": other,
                "children": children, "episodes": roots, "spans": spans, "delivered": delivered}

    warm = min(2 * block * max(1, 32 // block), episodes)
    for arm in arms:  # imports, caches, first calls, the renderer's start: not measured
        measured(arm, 0, warm)
    out: dict[str, Any] = {"kind": kind, "steps": []}
    for s in range(1, steps + 1):
        k = (s - 1) % len(arms)
        for arm in arms[k:] + arms[:k]:
            out["steps"].append(measured(arm, s, episodes))
    out["exports_on_training_thread"] = sum(getattr(a.exporter, "on_training", 0) for a in arms)
    for arm in arms:
        if arm.lib is not None:
            arm.lib.shutdown()
    # step scalars computed and taken (thread mode's exporter takes them, as Trackio's does)
    out["step_summaries"] = {a.name: a.exporter.steps_logged for a in arms
                             if a.lib is not None and hasattr(a.exporter, "steps_logged")}
    out["net_attempts"] = overhead.NET_ATTEMPTS[:5]
    if kind == "thread":
        out["floor_built"] = sorted(set(floor.built))
    return out


def run_episode_child(kind: str, args: argparse.Namespace, iters: int, prev: str | None) -> dict[str, Any]:
    cmd = [sys.executable, os.path.abspath(__file__), "--episode-child", kind, "--episodes", str(args.episodes),
           "--steps", str(args.steps), "--block", str(args.block), "--work-iters", str(iters),
           "--seed", str(args.seed)]
    if prev:
        cmd += ["--prev-dir", prev]
    proc = subprocess.run(cmd, capture_output=True, text=True,
                          env={**os.environ, "OTEL_SDK_DISABLED": "false", "OPENBLAS_NUM_THREADS": "1",
                               "OMP_NUM_THREADS": "1", "MKL_NUM_THREADS": "1"})
    lines = [ln for ln in proc.stdout.splitlines() if ln.startswith("{")]
    if proc.returncode != 0 or not lines:
        tail = "\n".join(proc.stderr.strip().splitlines()[-5:]) or "failed"
        return {"kind": kind, "error": f"exit {proc.returncode}: {tail}"}
    result: dict[str, Any] = json.loads(lines[-1])
    return result


def episode_checks(results: list[dict[str, Any]], work_ms: float) -> list[str]:
    problems = []
    for res in results:
        if "error" in res:
            problems.append(f"{res['kind']}: {res['error']}")
            continue
        if res.get("exports_on_training_thread"):
            problems.append(f"{res['kind']}: {res['exports_on_training_thread']} exports ran on the training thread")
        for name, logged in res.get("step_summaries", {}).items():
            if logged < len([st for st in res["steps"] if st["arm"] == name]):
                problems.append(f"{res['kind']}: {name} logged {logged} step summaries, fewer than its steps")
        if res.get("kind") == "thread" and res.get("floor_built") != [USER_SPANS]:
            problems.append(f"thread: the floor's episodes built {res.get('floor_built')} spans, not {USER_SPANS}")
        if res.get("net_attempts"):
            problems.append(f"{res['kind']}: attempted network connections {res['net_attempts']}")
        for st in res["steps"]:
            n, arm = st["n"], st["arm"]
            if st["off"] < OFF_WORK_FLOOR * n * work_ms / 1e3:
                problems.append(f"{arm} step {st['step']}: the untraced episodes took {st['off'] * 1e3:.0f} ms of "
                                f"thread CPU, under {OFF_WORK_FLOOR:.0%} of the calibrated {n * work_ms:.0f} ms")
            if arm in ("aa", "floor"):
                continue
            want = min(CAP, n)
            if st["episodes"] != want or st["spans"] != want * USER_SPANS or st["delivered"] != want:
                problems.append(f"{arm} step {st['step']}: exported {st['episodes']} episodes, {st['spans']} spans, "
                                f"ledger delivered {st['delivered']}; expected {want}, {want * USER_SPANS}, {want}")
    return problems


def _quant(values: list[float]) -> str:
    if len(values) >= 4:
        q = statistics.quantiles(values, n=4)
        return f"{statistics.median(values):+.2f}% ({q[0]:+.2f} to {q[2]:+.2f})"
    return f"{statistics.median(values):+.2f}% ({min(values):+.2f} to {max(values):+.2f})"


def episode_report(data: dict[str, Any], markdown: bool) -> int:
    cond = data["conditions"]
    results = data["results"]
    problems = episode_checks(results, cond["work_ms"])
    n_steps = cond["steps"] * cond["rounds"]
    print(f"\nstep overhead of tracing, per step: (traced episodes' CPU) / (untraced episodes' CPU) - 1; untraced "
          f"and traced episodes alternated in ABBA blocks of {cond['block']} in one process; median (q1 to q3) "
          f"over {n_steps} steps of {cond['episodes']} + {cond['episodes']} episodes")
    print(f"{'arm':<12} {'training thread CPU':>28} {'all CPU (+ children)':>28} {'µs/episode':>11} "
          f"{'exported/step':>14}")
    rows = []
    for kind in [k for k in ("thread", "process") if any(r.get("kind") == k for r in results)]:
        for arm in EPISODE_ARMS[kind]:
            steps = [st for r in results if r.get("kind") == kind and "steps" in r for st in r["steps"]
                     if st["arm"] == arm]
            if not steps:
                continue
            thread = [100 * (st["on"] / st["off"] - 1) for st in steps]
            total = [100 * ((st["on"] + st["other"] + st["children"]) / st["off"] - 1) for st in steps]
            us = [1e6 * (st["on"] + st["other"] + st["children"] - st["off"]) / st["n"] for st in steps]
            exported = statistics.median([st["episodes"] for st in steps])
            name = arm if kind == "thread" or arm != "aa" else "aa (process)"
            print(f"{name:<12} {_quant(thread):>28} {_quant(total):>28} {statistics.median(us):>11.0f} "
                  f"{exported:>14g}")
            rev = f" ({cond['prev']})" if cond.get("prev") else ""
            label = ARM_LABELS[arm].format(rev=rev) + (" (the render=\"process\" run's own)" if name == "aa (process)" else "")
            rows.append(f"| {label} | {_quant(thread)} | {_quant(total)} | {statistics.median(us):.0f} | {exported:g} |")
    if not problems:
        print(f"checked: every traced step exported min({CAP}, episodes) episodes x {USER_SPANS} spans, counted "
              f"delivered by the ledger; no export on the training thread; untraced episodes >= "
              f"{OFF_WORK_FLOOR:.0%} of the calibrated work")
    for p in problems:
        print(f"CHECK FAILED: {p}")
    if markdown:
        print()
        print(f"{cond['episodes']} + {cond['episodes']} episodes per step (traced and untraced alternated in ABBA "
              f"blocks of {cond['block']}), {cond['work_ms']:.1f} ms of numpy CPU per episode; {n_steps} steps per "
              f"arm; python {cond['python']}, {cond['cpu_count']} CPUs, load average {cond.get('loadavg_start')} → "
              f"{cond.get('loadavg_end')}; checkout {cond.get('commit') or '?'}. Reproduce: `{cond['command']} "
              "--markdown`.\n")
        print("| arm | step overhead, training thread CPU | all CPU, child processes included | µs of tracing per "
              "episode | episodes exported per step |")
        print("|---|---|---|---|---|")
        print("\n".join(rows))
    return 1 if problems else 0


def episode_profile(episodes: int, top: int = 30) -> int:
    """Where the traced episode's time goes: ``episodes`` traced episodes of the user's loop
    (one matrix product of work per generation), the default configuration, cap 32, under
    cProfile; the functions by own time, per episode, and the Python calls per episode. cProfile
    slows every call alike, so read the shares, not the times."""
    import cProfile
    import pstats

    import otel_rollouts as otr

    overhead._guard_network()
    exporter = noting_exporter(threading.get_ident())
    otr.configure(exporters=[exporter], sampler=otr.TailSampler(CAP), run_id="bench-loop-profile",
                  handle_signals=False)
    loop = UserLoop(otr, Work(1))
    for i in range(min(episodes, 256)):  # warm
        loop.episode(0, i)
    otr.end_step(0)
    prof = cProfile.Profile()
    step, done = 1, 0
    while done < episodes:
        n = min(512, episodes - done)
        prof.enable()
        for i in range(n):
            loop.episode(step, i)
        otr.end_step(step)
        prof.disable()
        otr.flush()
        done += n
        step += 1
    roots, _ = drain(exporter)
    otr.shutdown()
    stats = pstats.Stats(prof)
    calls = getattr(stats, "total_calls", 0)
    print(f"bench_loop --profile: {episodes} traced episodes of the user's loop (cap 32, {roots} kept), "
          f"{calls / episodes:.0f} Python calls per episode (the work's numpy calls included: "
          f"{3 * 2} per episode); own time per episode, top {top}:")
    rows = sorted(stats.stats.items(), key=lambda kv: kv[1][2], reverse=True)[:top]  # type: ignore[attr-defined]
    for (path, line, name), (_cc, nc, tt, ct, _) in rows:
        where = f"{os.path.relpath(path) if os.path.isabs(path) else path}:{line}({name})"
        print(f"  {1e6 * tt / episodes:8.1f} µs own {1e6 * ct / episodes:8.1f} µs cum {nc / episodes:7.1f} calls  {where}")
    return 0


SEGMENTS = ("enter", "prompt", "generations", "tool calls", "reward", "exit", "end_step")


SEGMENT_ARMS = ("none", "floor", "otr")


def episode_segments(episodes: int, steps: int, work_ms: float) -> int:
    """Where the traced episode's extra CPU goes in the user's loop itself (real work between the
    calls, so the tracing code runs as it does there: after the work, its caches cold): the
    episode's segments timed in untraced, floor (``floor_api``: the least any recorder with
    this API costs) and traced episodes alternated one by one in the order none floor otr otr
    floor none, the default configuration, cap 32; per segment the training-thread CPU per
    episode in each arm and the floor's and otel_rollouts' extra over the untraced episode.
    Checks: the untraced generations did at least half the calibrated work, every step kept
    min(32, n) episodes, the floor's episodes built their 9 spans."""
    import otel_rollouts as otr

    overhead._guard_network()
    iters, _ = calibrate(work_ms)
    work = Work(iters)
    exporter = noting_exporter(threading.get_ident())
    otr.configure(exporters=[exporter], sampler=otr.TailSampler(CAP), run_id="bench-loop-segments",
                  handle_signals=False)
    clock = time.thread_time_ns
    held: list[Any] = [None, None]

    def generate(messages: list[dict[str, str]], k: int) -> str:
        work()
        return str(held[0][k])

    def search(arguments: dict[str, Any]) -> str:
        return str(held[1])

    floor = FloorLib()
    calls = {
        "none": (generate, search, None),
        "floor": (floor.traced(kind="generation")(generate), floor.traced(kind="tool")(search), floor.episode),
        "otr": (otr.traced(kind="generation", model="policy")(generate),
                otr.traced(kind="tool", name="search")(search), otr.episode),
    }
    spent: dict[tuple[str, str], int] = dict.fromkeys(((a, s) for a in SEGMENT_ARMS for s in SEGMENTS), 0)

    def run(arm: str, step: int, i: int) -> None:
        prompt, completions, args, result, reward = sample(i)
        held[0], held[1] = completions, result
        gen, tool, begin = calls[arm]
        ep = None
        t = clock()
        if begin is not None:
            ep = begin(step=step, group_id=f"g{i // 8}", sample_index=i % 8)
            ep.__enter__()
            t1 = clock()
            spent[arm, "enter"] += t1 - t
            ep.prompt(prompt)
            t = clock()
            spent[arm, "prompt"] += t - t1
        messages = list(prompt)
        for k in range(3):
            t1 = clock()
            out = gen(messages, k)
            t2 = clock()
            messages.append({"role": "assistant", "content": out})
            t3 = clock()
            answer = tool(args)
            t4 = clock()
            messages.append({"role": "tool", "content": answer})
            spent[arm, "generations"] += t2 - t1
            spent[arm, "tool calls"] += t4 - t3
        if ep is not None:
            t1 = clock()
            ep.reward(reward)
            t2 = clock()
            ep.__exit__(None, None, None)
            t3 = clock()
            spent[arm, "reward"] += t2 - t1
            spent[arm, "exit"] += t3 - t2

    kept = []
    order = SEGMENT_ARMS + SEGMENT_ARMS[::-1]
    for step in range(steps + 1):  # step 0 warms up
        for i in range(0, episodes, 2):
            for j, arm in enumerate(order):
                run(arm, step, i + j // 3)
        t = clock()
        otr.end_step(step)
        spent["otr", "end_step"] += clock() - t
        otr.flush()
        kept.append(drain(exporter)[0])
        if step == 0:
            spent = dict.fromkeys(spent, 0)
    otr.shutdown()
    n = episodes * steps
    print(f"bench_loop --segments: {episodes} untraced, floor and traced episodes per step alternated one by one "
          f"(none floor otr otr floor none), {steps} steps, {3 * per_call(work) * 1e3:.2f} ms of numpy CPU per "
          f"episode; training-thread CPU per episode, load average {[round(x, 2) for x in os.getloadavg()]}")
    print(f"  {'segment':12s} {'untraced µs':>12s} {'floor +µs':>10s} {'otr +µs':>9s} {'otr/floor':>10s}")
    total = dict.fromkeys(SEGMENT_ARMS, 0.0)
    for seg in SEGMENTS:
        per = {a: spent[a, seg] / n / 1e3 for a in SEGMENT_ARMS}
        for a in SEGMENT_ARMS:
            total[a] += per[a]
        f, o = per["floor"] - per["none"], per["otr"] - per["none"]
        print(f"  {seg:12s} {per['none']:12.1f} {f:10.1f} {o:9.1f} {o / f if f > 0.05 else float('nan'):10.2f}")
    f, o = total["floor"] - total["none"], total["otr"] - total["none"]
    print(f"  {'all':12s} {total['none']:12.1f} {f:10.1f} {o:9.1f} {o / f:10.2f}")
    print(f"  step overhead: floor {100 * f / total['none']:+.2f}%, otel_rollouts {100 * o / total['none']:+.2f}% "
          "of the untraced episode's measured CPU")
    problems = []
    if spent["none", "generations"] / n < 0.5 * 3 * per_call(work) * 1e9:
        problems.append("the untraced generations did less than half the calibrated work")
    if kept[1:] != [min(CAP, episodes)] * steps:
        problems.append(f"kept per step {kept[1:]}, expected {min(CAP, episodes)}")
    if set(floor.built) != {USER_SPANS}:
        problems.append(f"the floor's episodes built {sorted(set(floor.built))} spans, not {USER_SPANS}")
    print("checked: the untraced generations did their calibrated work; every step kept min(32, n) episodes; "
          "the floor built 9 spans an episode" if not problems else "FAILED: " + "; ".join(problems))
    return 1 if problems else 0


def episode_main(args: argparse.Namespace) -> int:
    if args.quick:
        args.episodes, args.steps, args.rounds, args.work_ms = 32, 2, 1, 2.0
    if args.episodes % (2 * args.block) or not 1 <= args.block <= 4:
        raise SystemExit("--block must be 1 to 4 and --episodes a multiple of 2 x --block")
    if args.work_iters > 0:
        iters, work_ms = args.work_iters, 3 * per_call(Work(args.work_iters)) * 1e3
    else:
        iters, work_ms = calibrate(args.work_ms)
    prev = export_prev(args.prev) if args.prev else None
    kinds = [k for k in args.kinds.split(",") if k]
    parts = ["python benchmarks/bench_loop.py"] + (["--quick"] if args.quick else [
        f"--episodes {args.episodes}", f"--steps {args.steps}", f"--rounds {args.rounds}", f"--block {args.block}",
        f"--work-iters {iters}", f"--seed {args.seed}"]) + [f"--kinds {args.kinds}"] + (
        [f"--prev {args.prev}"] if args.prev else [])
    cond = {"episodes": args.episodes, "steps": args.steps, "rounds": args.rounds, "block": args.block,
            "work_iters": iters, "work_ms": round(work_ms, 3), "prev": args.prev, "python": platform.python_version(),
            "cpu_count": os.cpu_count(), "loadavg_start": [round(x, 2) for x in os.getloadavg()],
            "commit": overhead.checkout(), "command": " ".join(parts)}
    print(f"bench_loop (episodes mode): {args.episodes} traced + {args.episodes} untraced episodes per step, ABBA "
          f"blocks of {args.block}, {args.steps} steps per arm x {args.rounds} process rounds; {work_ms:.2f} ms of "
          f"numpy CPU per episode ({iters} x 3 products); load average {cond['loadavg_start']}; checkout "
          f"{cond['commit']}; previous release: {args.prev or 'not compared (--prev REV)'}")
    print(f"  rerun: {cond['command']}")
    sys.stdout.flush()
    results = []
    started = time.monotonic()
    try:
        for r in range(args.rounds):
            for kind in kinds:
                results.append(run_episode_child(kind, args, iters, prev))
                print(f"  round {r + 1}/{args.rounds} {kind} ({time.monotonic() - started:.0f} s)", file=sys.stderr,
                      flush=True)
    finally:
        if prev:
            import shutil

            shutil.rmtree(prev, ignore_errors=True)
    cond["loadavg_end"] = [round(x, 2) for x in os.getloadavg()]
    data = {"conditions": cond, "results": results}
    if args.json:
        with open(args.json, "w") as f:
            json.dump(data, f, indent=1)
    return episode_report(data, args.markdown)


def main() -> int:
    parser = argparse.ArgumentParser(description=(__doc__ or "").split("\n")[0])
    parser.add_argument("--episodes", type=int, default=512, help="episodes per step")
    parser.add_argument("--pairs", type=int, default=3, help="untraced/traced step pairs per process")
    parser.add_argument("--rounds", type=int, default=None,
                        help="rounds; every variant (steps mode: default 3) or kind (episodes mode: 2) once in each")
    parser.add_argument("--work-ms", type=float, default=None,
                        help=f"CPU ms of numpy work per episode (default {USER_WORK_MS} in episodes mode, 8 in steps mode)")
    parser.add_argument("--variants", default=",".join(VARIANTS))
    parser.add_argument("--seed", type=int, default=34, help="seed of the shuffles and of each child")
    parser.add_argument("--quick", action="store_true",
                        help="tiny run for the smoke test: 32 episodes of 2 ms, 1 round, 2 pairs")
    parser.add_argument("--markdown", action="store_true", help="also print the README's table")
    parser.add_argument("--json", help="write every child's figures (and the conditions) here")
    parser.add_argument("--from-json", help="only render a --json file of an earlier run")
    parser.add_argument("--child", help=argparse.SUPPRESS)
    parser.add_argument("--work-iters", type=int, default=0,
                        help="matrix products per generation, fixed (default: calibrated to --work-ms)")
    parser.add_argument("--mode", choices=["episodes", "steps"], default="episodes",
                        help="episodes: the user's loop, traced and untraced episodes alternated in one "
                             "process (the step-overhead figure); steps: untraced and traced steps alternated, "
                             "every variant and peer in a process of its own")
    parser.add_argument("--steps", type=int, default=4, help="episodes mode: measured steps per arm and process")
    parser.add_argument("--block", type=int, default=2, help="episodes mode: episodes per ABBA block (1 to 4)")
    parser.add_argument("--kinds", default="thread,process",
                        help="episodes mode: thread (A/A, this checkout, --prev) and/or process (A/A, render=process)")
    parser.add_argument("--prev", help="episodes mode: git revision of the previous release, measured in the "
                                       "same process as otel_rollouts_prev")
    parser.add_argument("--profile", type=int, default=0, metavar="EPISODES",
                        help="episodes mode: profile this many traced episodes of the user's loop instead")
    parser.add_argument("--segments", type=int, default=0, metavar="EPISODES",
                        help="episodes mode: time the traced episode's segments in the loop itself instead "
                             "(this many traced + untraced episodes per step, --steps steps)")
    parser.add_argument("--episode-child", help=argparse.SUPPRESS)
    parser.add_argument("--prev-dir", help=argparse.SUPPRESS)
    args = parser.parse_args()
    if args.episode_child:
        print(json.dumps(episode_child(args.episode_child, args.episodes, args.steps, args.block, args.work_iters,
                                       args.seed, args.prev_dir)))
        return 0
    if args.child:
        print(json.dumps(child(args.child, args.episodes, args.pairs, args.work_iters, args.seed)))
        return 0
    if args.from_json:
        with open(args.from_json) as f:
            loaded = json.load(f)
        if "results" in loaded:  # an episodes-mode run
            return episode_report(loaded, args.markdown)
    if args.profile:
        return episode_profile(args.profile)
    if args.segments:  # one BLAS thread, as every mode (set at import, before numpy loads)
        return episode_segments(args.segments, args.steps, USER_WORK_MS if args.work_ms is None else args.work_ms)
    if args.mode == "episodes" and not args.from_json:
        args.work_ms = USER_WORK_MS if args.work_ms is None else args.work_ms
        args.rounds = 2 if args.rounds is None else args.rounds
        return episode_main(args)
    args.work_ms = 8.0 if args.work_ms is None else args.work_ms
    args.rounds = 3 if args.rounds is None else args.rounds
    if args.from_json:
        with open(args.from_json) as f:
            data = json.load(f)
        return render(data, markdown=args.markdown)
    if args.quick:  # a smoke run: the checks, not the figures
        args.episodes, args.rounds, args.pairs, args.work_ms = 32, 1, 2, 2.0

    variants = [v for v in args.variants.split(",") if v]
    for v in variants:
        if v not in VARIANTS:
            raise SystemExit(f"unknown variant {v} (known: {', '.join(VARIANTS)})")
    skipped = {v: why for v in variants if (why := available(v))}
    variants = [v for v in variants if v not in skipped]
    if args.work_iters > 0:
        iters, work_ms = args.work_iters, 3 * per_call(Work(args.work_iters)) * 1e3
    else:
        iters, work_ms = calibrate(args.work_ms)
    cond = conditions(args, variants, iters, work_ms)
    cond["skipped"] = skipped
    print_conditions(cond)
    for v, why in skipped.items():
        print(f"skipped {v}: {why}")
    rng = random.Random(args.seed)
    rounds: list[dict[str, Any]] = []
    started = time.monotonic()
    for r in range(args.rounds):
        order = variants[:]
        rng.shuffle(order)
        results = {v: run_child(v, args, iters) for v in order}
        rounds.append({"order": order, "results": results})
        print(f"  round {r + 1}/{args.rounds} ({time.monotonic() - started:.0f} s): {' '.join(order)}",
              file=sys.stderr, flush=True)
        if args.json:  # after every round: an interrupted run keeps its finished rounds
            with open(args.json, "w") as f:
                json.dump({"conditions": cond, "variants": variants, "rounds": rounds}, f, indent=1)
    cond["loadavg_end"] = [round(x, 2) for x in os.getloadavg()] if hasattr(os, "getloadavg") else None
    cond["wall_s"] = round(time.monotonic() - started, 1)
    cond["commit_end"] = overhead.checkout()
    data = {"conditions": cond, "variants": variants, "rounds": rounds}
    if args.json:
        with open(args.json, "w") as f:
            json.dump(data, f, indent=1)
    return render(data, markdown=args.markdown, header=False)


# --- the report ------------------------------------------------------------------------------
def summarise(data: dict[str, Any]) -> dict[str, dict[str, Any]]:
    """Per variant: every pair's overheads (all rounds), medians, and the checks' findings."""
    cond = data["conditions"]
    out: dict[str, dict[str, Any]] = {}
    for v in data["variants"]:
        figs: dict[str, Any] = {"problems": [], "overhead": {}}
        per: dict[str, list[float]] = {"thread": [], "process": [], "all_processes": [], "wall": []}
        off_ms: list[float] = []
        episodes: list[int] = []
        spans: list[int] = []
        on_training = 0
        for rnd in data["rounds"]:
            res = rnd["results"].get(v, {})
            if "error" in res or "skipped" in res:
                figs["problems"].append(f"{v}: {res.get('error') or res.get('skipped')}")
                continue
            figs["problems"] += check(v, res, cond["episodes"], cond["work_ms"])
            on_training += res.get("exports_on_training_thread", 0)
            for pair in res.get("pairs", []):
                children = max(pair["off"].get("children", 0.0), pair["on"].get("children", 0.0))
                figs["children"] = max(figs.get("children", 0.0), children)
                for metric, values in per.items():
                    if metric not in pair["off"]:
                        continue
                    off = pair["off"][metric]
                    if off > 0:
                        values.append(100 * (pair["on"][metric] - off) / off)
                off_ms.append(1e3 * pair["off"]["thread"])
                episodes.append(pair["episodes"])
                spans.append(pair["spans"])
        for metric, values in per.items():
            if values:
                figs["overhead"][metric] = (statistics.median(values), min(values), max(values), len(values))
        if off_ms:
            figs["off_ms"] = statistics.median(off_ms)
            figs["episodes"] = statistics.median(episodes)
            figs["spans"] = statistics.median(spans)
        figs["exports_on_training_thread"] = on_training
        out[v] = figs
    return out


def _pct(figs: dict[str, Any], metric: str) -> str:
    value = figs["overhead"].get(metric)
    if value is None:
        return "—"
    med, lo, hi, _ = value
    return f"{med:+.1f}% ({lo:+.1f} to {hi:+.1f})"


def _kept(figs: dict[str, Any]) -> str:
    if "episodes" not in figs:
        return "—"
    eps, spans = figs["episodes"], figs["spans"]
    return f"{eps:g} ({spans:g} spans)"


def render(data: dict[str, Any], markdown: bool = False, header: bool = True) -> int:
    """Print the table and the checks; the exit status: 1 if a check failed."""
    cond = data["conditions"]
    if header:
        print_conditions(cond)
        for v, why in cond.get("skipped", {}).items():
            print(f"skipped {v}: {why}")
    summary = summarise(data)
    n_pairs = cond["pairs"] * len(data["rounds"])
    print(f"\nstep-time overhead of tracing, (on - off) / off per step pair; median (min to max) of "
          f"{n_pairs} pairs ({len(data['rounds'])} rounds x {cond['pairs']})")
    head = (f"{'variant':<18} {'training thread CPU':>26} {'process CPU':>26} {'+ child processes':>26} "
            f"{'wall':>26} {'off ms/step':>11} {'exported/step':>20}")
    print(head)
    for v in data["variants"]:
        figs = summary[v]
        if not figs["overhead"]:
            print(f"{v:<18} {'—':>26}   {'; '.join(figs['problems'])}")
            continue
        print(f"{v:<18} {_pct(figs, 'thread'):>26} {_pct(figs, 'process'):>26} "
              f"{_pct(figs, 'all_processes'):>26} {_pct(figs, 'wall'):>26} "
              f"{figs['off_ms']:>11.0f} {_kept(figs):>20}")
    if not any(summary[v].get("children", 0.0) > CHILD_CPU_NOTED for v in data["variants"]):
        print("(no child process used CPU: the process CPU is all the CPU tracing used)")
    problems = [p for v in data["variants"] for p in summary[v]["problems"]]
    print()
    for v in data["variants"]:
        figs = summary[v]
        if figs["overhead"] and not figs["problems"]:
            what = f"{figs['episodes']:g} episodes x {SPANS_PER_EPISODE} spans exported per step"
            if v in SYNC_EXPORT:
                thread = f"exports on the training thread: {figs['exports_on_training_thread']} (synchronous by configuration)"
            else:
                thread = "no export on the training thread"
            print(f"checked: {v}: {what}; {thread}; untraced steps >= {OFF_WORK_FLOOR:.0%} of the "
                  f"calibrated work")
    for p in problems:
        print(f"CHECK FAILED: {p}")
    if markdown:
        print("\n" + markdown_table(data, summary))
    return 1 if problems else 0


def markdown_table(data: dict[str, Any], summary: dict[str, dict[str, Any]]) -> str:
    cond = data["conditions"]
    vers = cond.get("versions", {})
    # child processes (a renderer process, where the library runs one) get a column when one
    # used CPU: the training process's CPU is then not all the CPU tracing used
    children = any(summary[v].get("children", 0.0) > CHILD_CPU_NOTED for v in data["variants"])
    rows = [
        "| variant | step-time overhead, training thread CPU | training process CPU "
        + ("| + its child processes " if children else "")
        + "| ms per step, tracing off | episodes (spans) exported per step |",
        "|---|---|---|---|---|" + ("---|" if children else ""),
    ]
    for v in data["variants"]:
        figs = summary[v]
        dist = PACKAGES.get(v, ("", ""))[1]
        label = LABELS[v].format(version=f" {vers[dist]}" if dist in vers else "")
        if not figs["overhead"]:
            dashes = "— | — | — | " + ("— | " if children else "")
            rows.append(f"| {label} | {dashes}{'; '.join(figs['problems']) or 'not run'} |")
            continue
        extra = f"| {_pct(figs, 'all_processes')} " if children else ""
        rows.append(f"| {label} | {_pct(figs, 'thread')} | {_pct(figs, 'process')} {extra}"
                    f"| {figs['off_ms']:.0f} | {_kept(figs)} |")
    caption = (f"{cond['episodes']} episodes per step, each {cond['work_ms']:.1f} ms of numpy CPU standing "
               f"in for inference; untraced and traced steps alternated in one process, "
               f"{cond['pairs']} pairs x {len(data['rounds'])} rounds; median (min to max) over the pairs; "
               f"python {cond['python']}, {cond['cpu_count']} CPUs, load average {cond.get('loadavg_start')} "
               f"→ {cond.get('loadavg_end')}; checkout {cond.get('commit') or '?'}"
               f"{' → ' + cond['commit_end'] if cond.get('commit_end', cond.get('commit')) != cond.get('commit') else ''}. "
               f"Reproduce: `{cond['command']} --markdown`.")
    return "\n".join([caption, "", *rows, ""])


if __name__ == "__main__":
    sys.exit(main())
