"""What recording an episode costs: otel_rollouts next to raw OpenTelemetry and its peers.

One script, one run, variants alternated. Each variant runs in its own fresh Python process (a
peer's configure() installs global state), and the run is repeated in ``--rounds`` rounds; in
each round every variant runs once, in a freshly shuffled order (``--seed``). On a shared,
noisy machine a variant measured after another drifts (Logfire ranged 2.93-4.01x raw SDK
across sequential runs), so every figure is the median over rounds of a ratio taken *within*
one round, with the min-max of that ratio over the rounds next to it.

Workload: episodes of prompt + 3 turns (a generation each) + 2 tool calls + reward, 11 spans,
with content of realistic size (a ~2 KB prompt, ~1 KB completions, ~0.5 KB tool arguments and
results). ``--episodes`` per step (default 2,048), ``--steps`` measured steps per process
(default 2) after a warm-up step of 512 episodes.

What is measured, per variant, per step, divided by the episodes of the step:
  training thread  time.thread_time() of the thread running the loop. It includes every call
                   the loop makes: otr.end_step()/otr.flush() for otel_rollouts,
                   force_flush()/flush() for Logfire and Langfuse; not the time that thread
                   spends blocked waiting for an export thread.
  all threads      time.process_time(): every thread of the process, so the rendering and
                   exporting that otel_rollouts (and Langfuse's BatchSpanProcessor) do on their
                   export threads counts. Each step ends with a flush, so the step's export work
                   falls inside the step.
Both are taken minus the ``none`` baseline of the same round; ratios are to the raw SDK tree
of the same round (for the ``*_traced`` family: to ``raw_sdk_traced``). Per process the median
of its steps is used. In the last round each process then goes on with ``--mem-steps`` more
steps of ``--mem-episodes`` episodes (default 2 x 512) under tracemalloc (slower; after its
timed steps, so they are not affected) and reports the peak traced memory of the first and the
last of them: "flat" means the last is not above the first.

Conditions to keep in mind when reading the ratios: the raw SDK baseline exports into an
``InMemorySpanExporter`` that holds every span of the step (cleared at the end of each step, as
if shipped): 11 x 2,048 live span objects by the end of a default step. Python's cyclic GC walks
them again at every older-generation collection, so the baseline's cost grows with the episodes
per step: ``raw_sdk_nogc`` is the same process with ``gc.disable()``, and the difference is the
GC share of the raw baseline (printed; the "GC off" ratios divide by it instead). Any variant
name with the suffix ``_nogc`` runs that way. Every child process refuses network connections (a
guard on socket.connect): nothing here reaches the network, and any attempt is counted and
printed.

Variants (bench tree: the same 11-span tree in each):
  none            the workload without tracing (the baseline subtracted from all others)
  floor           no library: per span one __slots__ object with random 64-bit ids
                  (random.getrandbits) and time.time_ns() stamps, appended to its episode's
                  list; the spans used as ``with`` blocks (episode, turns, tool calls) attach
                  and detach themselves in the OpenTelemetry context; content is referenced,
                  never copied; the episode is dropped at its end. The least a recorder with
                  this API can do: the dropped-episode target is measured against it.
  floor_contract  the floor plus what the episode API promises every episode, kept or not,
                  written as plainly as it can be: a containment guard (try/except) around
                  each call, a dict of attributes per span (labels, step, group, model, token
                  counts), content snapshotted when it is recorded (the prompt's messages and
                  the tool's arguments copied: the caller may change them afterwards), and one
                  lock round-trip and one count to offer the finished episode to a sampler
                  that drops it. What a dropped episode cannot cost less than under this API.
  raw_sdk         the tree as plain OpenTelemetry SDK spans (start_as_current_span),
                  SimpleSpanProcessor into an InMemorySpanExporter; content serialised to JSON
                  (SDK attributes must be primitives); every episode exported
  raw_sdk_nogc    raw_sdk with the cyclic GC disabled in its process
  otr_dropped     otel_rollouts, cap 0: every episode recorded, then dropped by the sampler
  otr_kept_plain  otel_rollouts, no cap: every episode kept, rendered and exported, secret
                  redaction off
  otr_kept        the same with the default secret redaction (on the export thread)
  otr_cap32       otel_rollouts, cap 32 per step (top_bottom): the real setting
  logfire         Pydantic Logfire, send_to_logfire=False, console=False, logfire.span() for
                  each span, SimpleSpanProcessor into the same in-memory exporter (no tail
                  sampling: everything exported)
  openinference   OpenInference's OITracer decorators (@tracer.agent/.chain/.llm/.tool) into the
                  same in-memory exporter (everything exported)
  langfuse        the Langfuse Python SDK (v3+, OpenTelemetry-based), fully offline:
                  Langfuse(public_key/secret_key dummies, base_url http://127.0.0.1:9,
                  span_exporter=InMemorySpanExporter()): its own LangfuseSpanProcessor (a
                  BatchSpanProcessor, queue raised so nothing is dropped) and its transforming
                  exporter run as they do in production, only the OTLP/HTTP exporter at the end
                  is replaced by the in-memory one; start_as_current_observation() for each span
                  (agent, span, generation, tool), langfuse.flush() at the end of each step
Traced tree (the same tree, but each generation is a decorated function ``generate(messages)``
returning the completion; its span carries the prompt as input messages and the completion as
output messages):
  raw_sdk_traced      a hand-written SDK decorator (start_as_current_span, JSON attributes)
  otr_traced_dropped  ``@otr.traced(kind="generation", model="policy")``, cap 0
  otr_traced_kept     ``@otr.traced(kind="generation", model="policy")``, everything kept,
                      default redaction

    python benchmarks/bench_overhead.py                      # default: 5 rounds, 2 x 2048
    python benchmarks/bench_overhead.py --rounds 3 --variants none,raw_sdk,otr_dropped
    python benchmarks/bench_overhead.py --markdown           # also the README's table
    python benchmarks/bench_overhead.py --json out.json      # keep every child's figures
    python benchmarks/bench_overhead.py --from-json out.json --markdown   # re-render only
"""

from __future__ import annotations

import argparse
import functools
import gc
import json
import os
import platform
import random
import socket
import statistics
import subprocess
import sys
import time
import tracemalloc
from collections.abc import Callable
from typing import Any

VARIANTS = [
    "none", "floor", "floor_contract", "raw_sdk", "raw_sdk_nogc", "otr_dropped", "otr_kept_plain", "otr_kept",
    "otr_cap32", "raw_sdk_traced", "otr_traced_dropped", "otr_traced_kept", "logfire",
    "openinference", "langfuse",
]

LABELS = {
    "none": "no tracing (baseline)",
    "floor": "floor: slotted objects + ids + context, no library",
    "floor_contract": "floor + the API's contract (guard, attributes, snapshots, one offer)",
    "raw_sdk": "raw OTel SDK spans, every episode exported",
    "raw_sdk_nogc": "raw OTel SDK spans, cyclic GC off",
    "otr_dropped": "otel_rollouts, dropped episode",
    "otr_kept_plain": "otel_rollouts, kept episode, redaction off",
    "otr_kept": "otel_rollouts, kept episode, default redaction",
    "otr_cap32": "otel_rollouts, cap 32 of {episodes} per step (the real setting)",
    "raw_sdk_traced": "traced tree: raw OTel SDK decorator",
    "otr_traced_dropped": "traced tree: `@otr.traced(kind=\"generation\")`, dropped",
    "otr_traced_kept": "traced tree: `@otr.traced(kind=\"generation\")`, kept, default redaction",
    "logfire": "Pydantic Logfire{version} `logfire.span` (sending off, everything exported)",
    "openinference": "OpenInference{version} `OITracer` decorators (everything exported)",
    "langfuse": "Langfuse{version} `start_as_current_observation` (offline, everything exported)",
}

DISTRIBUTIONS = {
    "logfire": "logfire", "openinference": "openinference-instrumentation", "langfuse": "langfuse",
    "raw_sdk": "opentelemetry-sdk", "otr_kept": "otel-rollouts",
}

WARMUP_EPISODES = 512

RunStep = Callable[[int, int], int]  # (step, episodes) -> spans exported in the step
Close = Callable[[], Any]


# --- the workload ------------------------------------------------------------------------------
_WORDS = ("the policy considered several options before it chose to call the search tool with a "
          "query about the integral and then verified the answer against the reference ").split()


def _text(n_chars: int, salt: int) -> str:
    out: list[str] = []
    i = salt
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

Sample = tuple[list[dict[str, str]], list[str], dict[str, Any], str, float]


def sample(i: int) -> Sample:
    """What the rollout produced for episode i (content comes from the model: not built here)."""
    j = i % POOL
    return (PROMPTS[j], [COMPLETIONS[(j + k) % POOL] for k in range(3)], TOOL_ARGS[j],
            TOOL_RESULTS[j], (i * 7919 % 1000) / 1000)


# --- variants ----------------------------------------------------------------------------------
def make_none() -> tuple[RunStep, Close]:
    def run_step(step: int, n: int) -> int:
        acc = 0
        for i in range(n):
            prompt, completions, args, result, reward = sample(i)
            acc += len(prompt) + len(completions[0]) + len(args) + len(result) + int(reward)
        return 0

    return run_step, lambda: None


def make_floor() -> tuple[RunStep, Close]:
    from opentelemetry import context as otel_context
    from opentelemetry import trace

    getrandbits = random.getrandbits
    time_ns = time.time_ns
    attach, detach, in_context = otel_context.attach, otel_context.detach, trace.set_span_in_context

    class FloorSpan:
        """One span: ids, stamps, a reference to its content; a ``with`` block attaches it."""

        __slots__ = ("name", "trace_id", "span_id", "parent_id", "start", "end", "value",
                     "result", "token")

        def __init__(self, spans: list[FloorSpan], name: str, trace_id: int, parent_id: int | None,
                     value: Any = None) -> None:
            self.name = name
            self.trace_id = trace_id
            self.span_id = getrandbits(64)
            self.parent_id = parent_id
            self.value = value
            self.result: Any = None
            self.token: Any = None
            self.start = time_ns()
            self.end = 0
            spans.append(self)

        def close(self) -> FloorSpan:
            self.end = time_ns()
            return self

        def __enter__(self) -> FloorSpan:
            self.token = attach(in_context(self))  # type: ignore[arg-type]
            return self

        def __exit__(self, *exc: object) -> None:
            detach(self.token)
            self.end = time_ns()

    def run_step(step: int, n: int) -> int:
        for i in range(n):
            prompt, completions, args, result, reward = sample(i)
            spans: list[FloorSpan] = []
            trace_id = getrandbits(128)
            with FloorSpan(spans, "episode", trace_id, None, (step, i // 8, i % 8)) as root:
                rid = root.span_id
                FloorSpan(spans, "prompt", trace_id, rid, prompt).close()
                for k in range(3):
                    with FloorSpan(spans, "turn", trace_id, rid, k) as turn:
                        FloorSpan(spans, "chat policy", trace_id, turn.span_id, completions[k]).close()
                        if k < 2:
                            with FloorSpan(spans, "execute_tool search", trace_id, turn.span_id,
                                           args) as call:
                                call.result = result
                FloorSpan(spans, "reward", trace_id, rid, reward).close()
            del spans  # dropped: nothing kept
        return 0

    return run_step, lambda: None


def _memory_exporter() -> Any:
    from opentelemetry.sdk.trace.export.in_memory_span_exporter import InMemorySpanExporter

    return InMemorySpanExporter()


def _drain(exporter: Any) -> int:
    """As if shipped: the exporter does not accumulate across steps. Returns the step's spans."""
    count = len(exporter.get_finished_spans())
    exporter.clear()
    return count


def _memory_provider() -> tuple[Any, Any]:
    from opentelemetry.sdk.trace import TracerProvider
    from opentelemetry.sdk.trace.export import SimpleSpanProcessor

    exporter = _memory_exporter()
    provider = TracerProvider()
    provider.add_span_processor(SimpleSpanProcessor(exporter))
    return provider, exporter


def make_floor_contract() -> tuple[RunStep, Close]:
    import threading

    from opentelemetry import context as otel_context
    from opentelemetry import trace

    getrandbits = random.getrandbits
    time_ns = time.time_ns
    attach, detach, in_context = otel_context.attach, otel_context.detach, trace.set_span_in_context
    lock = threading.Lock()
    dropped = [0]

    def guarded(fn: Callable[..., Any]) -> Callable[..., Any]:
        @functools.wraps(fn)
        def call(*args: Any, **kwargs: Any) -> Any:
            try:
                return fn(*args, **kwargs)
            except Exception:  # noqa: BLE001 - the contract: nothing reaches the caller
                return None
        return call

    class Span:
        __slots__ = ("name", "trace_id", "span_id", "parent_id", "start", "end", "attributes", "token")

        def __init__(self, spans: list[Span], name: str, trace_id: int, parent_id: int | None,
                     attributes: dict[str, Any]) -> None:
            self.name = name
            self.trace_id = trace_id
            self.span_id = getrandbits(64)
            self.parent_id = parent_id
            self.attributes = attributes
            self.token: Any = None
            self.start = time_ns()
            self.end = 0
            spans.append(self)

        def __enter__(self) -> Span:
            self.token = attach(in_context(self))  # type: ignore[arg-type]
            return self

        def __exit__(self, *exc: object) -> None:
            detach(self.token)
            self.end = time_ns()

    @guarded
    def episode(spans: list[Span], step: int, group: str, index: int) -> Span:
        return Span(spans, "episode", getrandbits(128), None, {
            "rl.span.kind": "episode", "rl.step": step, "rl.split": "train", "rl.group.id": group,
            "rl.sample.index": index})

    @guarded
    def prompt(root: Span, spans: list[Span], messages: list[dict[str, str]]) -> None:
        span = Span(spans, "prompt", root.trace_id, root.span_id, {
            "rl.span.kind": "prompt", "gen_ai.input.messages": [dict(m) for m in messages]})
        span.end = time_ns()

    @guarded
    def turn(root: Span, spans: list[Span], k: int) -> Span:
        return Span(spans, "turn", root.trace_id, root.span_id, {"rl.span.kind": "turn", "rl.turn.index": k})

    @guarded
    def generation(parent: Span, spans: list[Span], content: str, model: str, output_tokens: int) -> None:
        span = Span(spans, f"chat {model}", parent.trace_id, parent.span_id, {
            "rl.span.kind": "generation", "gen_ai.operation.name": "chat", "gen_ai.request.model": model,
            "gen_ai.output.messages": [{"role": "assistant", "content": content}],
            "gen_ai.usage.output_tokens": int(output_tokens)})
        span.end = time_ns()

    @guarded
    def tool_call(parent: Span, spans: list[Span], name: str, arguments: dict[str, Any]) -> Span:
        return Span(spans, f"execute_tool {name}", parent.trace_id, parent.span_id, {
            "rl.span.kind": "tool", "gen_ai.tool.name": name, "gen_ai.tool.call.arguments": dict(arguments)})

    @guarded
    def result(call: Span, value: Any) -> None:
        call.attributes["gen_ai.tool.call.result"] = value

    @guarded
    def reward(root: Span, spans: list[Span], value: float) -> None:
        root.attributes["rl.reward.score"] = float(value)
        span = Span(spans, "reward", root.trace_id, root.span_id, {"rl.span.kind": "reward", "rl.reward.score": float(value)})
        span.end = time_ns()

    @guarded
    def offer(spans: list[Span]) -> None:
        with lock:  # the sampler decides: dropped
            dropped[0] += 1

    def run_step(step: int, n: int) -> int:
        for i in range(n):
            prompt_messages, completions, args, tool_result, value = sample(i)
            spans: list[Span] = []
            with episode(spans, step, f"g{i // 8}", i % 8) as root:
                prompt(root, spans, prompt_messages)
                for k in range(3):
                    with turn(root, spans, k) as t:
                        generation(t, spans, completions[k], "policy", 250)
                        if k < 2:
                            with tool_call(t, spans, "search", args) as call:
                                result(call, tool_result)
                reward(root, spans, value)
            offer(spans)
        return 0

    return run_step, lambda: None


def make_raw_sdk(traced: bool = False) -> tuple[RunStep, Close]:
    provider, exporter = _memory_provider()
    tracer = provider.get_tracer("bench")
    dumps = json.dumps

    def sdk_generation(model: str) -> Callable[[Callable[..., str]], Callable[..., str]]:
        """What a user writes without a library: a decorator opening an SDK span."""
        def decorate(fn: Callable[..., str]) -> Callable[..., str]:
            @functools.wraps(fn)
            def wrapper(messages: list[dict[str, str]], *args: Any, **kwargs: Any) -> str:
                with tracer.start_as_current_span(f"chat {model}", attributes={
                        "rl.span.kind": "generation", "gen_ai.request.model": model,
                        "gen_ai.input.messages": dumps(messages)}) as span:
                    out = fn(messages, *args, **kwargs)
                    span.set_attribute("gen_ai.output.messages",
                                       dumps([{"role": "assistant", "content": out}]))
                    return out
            return wrapper
        return decorate

    current: list[str] = []

    @sdk_generation("policy")
    def generate(messages: list[dict[str, str]], k: int) -> str:
        return current[k]

    def run_step(step: int, n: int) -> int:
        for i in range(n):
            prompt, completions, args, result, reward = sample(i)
            with tracer.start_as_current_span("episode", attributes={
                "rl.span.kind": "episode", "rl.step": step, "rl.split": "train",
                "rl.episode.id": f"{step}-{i}", "rl.group.id": f"g{i // 8}", "rl.sample.index": i % 8,
            }) as root:
                with tracer.start_as_current_span("prompt", attributes={
                        "rl.span.kind": "prompt", "gen_ai.input.messages": dumps(prompt)}):
                    pass
                if traced:
                    current[:] = completions
                for k in range(3):
                    with tracer.start_as_current_span("turn", attributes={
                            "rl.span.kind": "turn", "rl.turn.index": k}):
                        if traced:
                            generate(prompt, k)
                        else:
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
        return _drain(exporter)

    return run_step, provider.shutdown


def make_otr(cap: int, redact: bool = True, traced: bool = False) -> tuple[RunStep, Close]:
    import otel_rollouts as otr

    exporter = _memory_exporter()
    otr.configure(exporters=[exporter], sampler=otr.TailSampler(cap, "top_bottom", step_lag=None),
                  run_id="bench", max_queue=max(256, 2 * cap), redact=redact)
    current: list[str] = []

    @otr.traced(kind="generation", model="policy")
    def generate(messages: list[dict[str, str]], k: int) -> str:
        return current[k]

    def run_step(step: int, n: int) -> int:
        for i in range(n):
            prompt, completions, args, result, reward = sample(i)
            if traced:
                current[:] = completions
            with otr.episode(step=step, group_id=f"g{i // 8}", sample_index=i % 8) as ep:
                ep.prompt(prompt)
                for k in range(3):
                    with ep.turn() as turn:
                        if traced:
                            generate(prompt, k)
                        else:
                            turn.record_generation(completions[k], model="policy", output_tokens=250)
                        if k < 2:
                            with turn.tool_call("search", arguments=args) as call:
                                call.result(result)
                ep.reward(reward)
        otr.end_step(step)
        otr.flush()
        return _drain(exporter)

    return run_step, otr.shutdown


def make_logfire() -> tuple[RunStep, Close]:
    import logfire
    from opentelemetry.sdk.trace.export import SimpleSpanProcessor

    exporter = _memory_exporter()
    logfire.configure(send_to_logfire=False, console=False, metrics=False,
                      additional_span_processors=[SimpleSpanProcessor(exporter)])

    def run_step(step: int, n: int) -> int:
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
        return _drain(exporter)

    return run_step, logfire.shutdown


def make_openinference() -> tuple[RunStep, Close]:
    from openinference.instrumentation import TracerProvider
    from opentelemetry.sdk.trace.export import SimpleSpanProcessor

    exporter = _memory_exporter()
    provider = TracerProvider()
    provider.add_span_processor(SimpleSpanProcessor(exporter))
    tracer = provider.get_tracer("bench")

    @tracer.chain(name="prompt")
    def prompt_span(messages: Any) -> None:
        return None

    @tracer.llm(name="chat policy")  # type: ignore[arg-type]  # its ParamSpec typing
    def generate(completion: str) -> str:
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

    def run_step(step: int, n: int) -> int:
        for i in range(n):
            episode(step, i)
        return _drain(exporter)

    return run_step, provider.shutdown


def make_langfuse() -> tuple[RunStep, Close]:
    # A BatchSpanProcessor drops spans past its queue (2,048 by default): raise it so that every
    # span of a step is processed, as with the other variants.
    os.environ["OTEL_BSP_MAX_QUEUE_SIZE"] = str(1 << 20)
    for key in [k for k in os.environ if k.startswith("LANGFUSE_")]:
        del os.environ[key]
    from langfuse import Langfuse

    exporter = _memory_exporter()
    # Dummy keys (the SDK disables itself without them) and a closed loopback port: nothing is
    # sent anywhere. The span exporter replaces the OTLP/HTTP one; the processor, the
    # transforming exporter (media, masking) and the BatchSpanProcessor thread are Langfuse's own.
    lf = Langfuse(public_key="pk-lf-bench", secret_key="sk-lf-bench", base_url="http://127.0.0.1:9",
                  span_exporter=exporter, tracing_enabled=True)
    observe = lf.start_as_current_observation

    def run_step(step: int, n: int) -> int:
        for i in range(n):
            prompt, completions, args, result, reward = sample(i)
            with observe(name="episode", as_type="agent",
                         metadata={"step": step, "episode_id": f"{step}-{i}", "group_id": f"g{i // 8}",
                                   "sample_index": i % 8}) as root:
                with observe(name="prompt", as_type="span", input=prompt):
                    pass
                for k in range(3):
                    with observe(name="turn", as_type="span", metadata={"turn_index": k}):
                        with observe(name="chat policy", as_type="generation", model="policy",
                                     output=completions[k], usage_details={"output": 250}):
                            pass
                        if k < 2:
                            with observe(name="execute_tool search", as_type="tool", input=args,
                                         output=result):
                                pass
                with observe(name="reward", as_type="span", output=reward):
                    pass
                root.update(output=reward)
        lf.flush()
        return _drain(exporter)

    return run_step, lf.shutdown


def make(variant: str) -> tuple[RunStep, Close]:
    makers: dict[str, Callable[[], tuple[RunStep, Close]]] = {
        "none": make_none,
        "floor": make_floor,
        "floor_contract": make_floor_contract,
        "raw_sdk": make_raw_sdk,
        "raw_sdk_traced": lambda: make_raw_sdk(traced=True),
        "otr_dropped": lambda: make_otr(0),
        "otr_kept": lambda: make_otr(1 << 20),
        "otr_kept_plain": lambda: make_otr(1 << 20, redact=False),
        "otr_cap32": lambda: make_otr(32),
        "otr_traced_dropped": lambda: make_otr(0, traced=True),
        "otr_traced_kept": lambda: make_otr(1 << 20, traced=True),
        "logfire": make_logfire,
        "openinference": make_openinference,
        "langfuse": make_langfuse,
    }
    maker = makers.get(base_of(variant))
    if maker is None:
        raise SystemExit(f"unknown variant {variant} (known: {', '.join(VARIANTS)})")
    return maker()


def base_of(variant: str) -> str:
    return variant.removesuffix("_nogc")


def reference_of(variant: str) -> str:
    """The raw SDK variant a variant's ratios are taken to: its tree's raw SDK spans."""
    return "raw_sdk_traced" if "traced" in variant else "raw_sdk"


# --- the child ---------------------------------------------------------------------------------
NET_ATTEMPTS: list[str] = []


def _guard_network() -> None:
    """Refuse (and count) every connection that is not a local socket file."""
    original = socket.socket.connect

    def connect(self: socket.socket, address: Any) -> None:
        if self.family == getattr(socket, "AF_UNIX", None):
            return original(self, address)
        NET_ATTEMPTS.append(repr(address))
        raise ConnectionRefusedError(f"bench_overhead: no network ({address!r})")

    def connect_ex(self: socket.socket, address: Any) -> int:
        try:
            connect(self, address)
        except ConnectionRefusedError:
            return 111
        return 0

    socket.socket.connect = connect  # type: ignore[method-assign, assignment]
    socket.socket.connect_ex = connect_ex  # type: ignore[method-assign, assignment]


def child(variant: str, steps: int, episodes: int, mem_steps: int, mem_episodes: int) -> dict[str, Any]:
    """Run one variant in this process: CPU time per episode, then (mem_steps) peak memory."""
    _guard_network()
    if variant.endswith("_nogc"):
        gc.disable()
    try:
        run_step, close = make(variant)
    except ImportError as exc:
        return {"variant": variant, "error": f"not installed: {exc.name or exc}"}
    run_step(0, min(episodes, WARMUP_EPISODES))  # warm-up (imports, caches)
    out: dict[str, Any] = {"variant": variant}
    thread_us, process_us, spans = [], [], []
    for step in range(1, steps + 1):
        p0, t0 = time.process_time(), time.thread_time()
        exported = run_step(step, episodes)
        t1, p1 = time.thread_time(), time.process_time()
        thread_us.append(1e6 * (t1 - t0) / episodes)
        process_us.append(1e6 * (p1 - p0) / episodes)
        spans.append(exported / episodes)
    if steps:
        out.update(thread_us=statistics.median(thread_us), process_us=statistics.median(process_us),
                   spans_per_episode=statistics.median(spans))
    if mem_steps:  # after the timed steps: tracemalloc slows everything down
        tracemalloc.start()
        peaks = []
        for step in range(steps + 1, steps + 1 + mem_steps):
            tracemalloc.reset_peak()
            run_step(step, mem_episodes)
            peaks.append(tracemalloc.get_traced_memory()[1])
        tracemalloc.stop()
        out["peaks"] = peaks
    close()
    out["net_attempts"] = NET_ATTEMPTS[:5]
    return out


def run_child(variant: str, args: argparse.Namespace, mem_steps: int = 0) -> dict[str, Any]:
    proc = subprocess.run(
        [sys.executable, os.path.abspath(__file__), "--child", variant, "--steps", str(args.steps),
         "--episodes", str(args.episodes), "--mem-steps", str(mem_steps),
         "--mem-episodes", str(args.mem_episodes)],
        capture_output=True, text=True, env={**os.environ, "OTEL_SDK_DISABLED": "false"},
    )
    lines = [ln for ln in proc.stdout.splitlines() if ln.startswith("{")]
    if proc.returncode != 0 or not lines:
        tail = (proc.stderr.strip().splitlines() or ["failed"])[-1]
        return {"variant": variant, "error": f"exit {proc.returncode}: {tail}"}
    result: dict[str, Any] = json.loads(lines[-1])
    return result


# --- the parent --------------------------------------------------------------------------------
def conditions(args: argparse.Namespace, variants: list[str]) -> dict[str, Any]:
    from importlib import metadata

    versions = {}
    wanted = {base_of(v) for v in variants} | {"raw_sdk", "otr_kept"}
    for variant, dist in DISTRIBUTIONS.items():
        if variant in wanted:
            try:
                versions[dist] = metadata.version(dist)
            except metadata.PackageNotFoundError:
                versions[dist] = "not installed"
    commit = checkout()
    affinity = len(os.sched_getaffinity(0)) if hasattr(os, "sched_getaffinity") else os.cpu_count()
    return {
        "episodes": args.episodes, "steps": args.steps, "rounds": args.rounds,
        "warmup_episodes": min(args.episodes, WARMUP_EPISODES), "mem_steps": args.mem_steps,
        "mem_episodes": args.mem_episodes,
        "seed": args.seed, "python": platform.python_version(),
        "implementation": platform.python_implementation(), "platform": platform.platform(),
        "cpu_count": os.cpu_count(), "cpus_usable": affinity,
        "loadavg_start": [round(x, 2) for x in os.getloadavg()] if hasattr(os, "getloadavg") else None,
        "versions": versions, "commit": commit,
    }


def checkout() -> str:
    """The commit measured, and whether the library's files differ from it (others may be
    editing the working tree while this runs: checked at the start and at the end)."""
    root = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
    try:
        head = subprocess.run(["git", "-C", root, "rev-parse", "--short", "HEAD"],
                              capture_output=True, text=True, timeout=10).stdout.strip()
        changed = subprocess.run(["git", "-C", root, "status", "--porcelain", "--", "otel_rollouts",
                                  "exporters"], capture_output=True, text=True, timeout=10).stdout
    except (OSError, subprocess.SubprocessError):
        return "?"
    return f"{head}{' + uncommitted library changes' if changed.strip() else ''}"


def print_conditions(cond: dict[str, Any], out: Any = sys.stdout) -> None:
    print(f"bench_overhead: {cond['episodes']} episodes/step x {cond['steps']} measured steps per "
          f"process (+ a {cond['warmup_episodes']}-episode warm-up), {cond['rounds']} rounds "
          f"alternated (seed {cond['seed']}), memory pass {cond['mem_steps']} steps x "
          f"{cond.get('mem_episodes', cond['episodes'])} episodes", file=out)
    print(f"  python {cond['python']} ({cond['implementation']}) on {cond['platform']}; "
          f"cpu count {cond['cpu_count']} ({cond['cpus_usable']} usable); load average at start "
          f"{cond['loadavg_start']}{'; at end ' + str(cond['loadavg_end']) if cond.get('loadavg_end') else ''}",
          file=out)
    if cond.get("versions") or cond.get("commit"):
        vers = ", ".join(f"{k} {v}" for k, v in cond.get("versions", {}).items())
        end = cond.get("commit_end")
        moved = f" at the start, {end} at the end" if end and end != cond.get("commit") else ""
        print(f"  versions: {vers}; checkout {cond.get('commit') or '?'}{moved}", file=out)
    out.flush()


def main() -> None:
    parser = argparse.ArgumentParser(description=(__doc__ or "").split("\n")[0])
    parser.add_argument("--steps", type=int, default=2, help="measured steps per process")
    parser.add_argument("--episodes", type=int, default=2048, help="episodes per step")
    parser.add_argument("--rounds", type=int, default=5, help="rounds; every variant once in each")
    parser.add_argument("--mem-steps", type=int, default=2,
                        help="steps of the memory pass (tracemalloc), run in the last round's processes after "
                             "their timed steps; 0: none")
    parser.add_argument("--mem-episodes", type=int, default=512, help="episodes per memory step")
    parser.add_argument("--variants", default=",".join(VARIANTS))
    parser.add_argument("--seed", type=int, default=15, help="seed of the per-round shuffles")
    parser.add_argument("--markdown", action="store_true", help="also print the README's table")
    parser.add_argument("--json", help="write every child's figures (and the conditions) here")
    parser.add_argument("--from-json", help="only render a --json file of an earlier run")
    parser.add_argument("--child", help=argparse.SUPPRESS)
    args = parser.parse_args()
    if args.child:
        print(json.dumps(child(args.child, args.steps, args.episodes, args.mem_steps, args.mem_episodes)))
        return
    if args.from_json:
        with open(args.from_json) as f:
            data = json.load(f)
        render(data, markdown=args.markdown)
        return

    variants = [v for v in args.variants.split(",") if v]
    for v in variants:
        if base_of(v) not in VARIANTS:
            raise SystemExit(f"unknown variant {v} (known: {', '.join(VARIANTS)})")
    if "none" not in variants:
        variants.insert(0, "none")  # every figure is taken minus it
    cond = conditions(args, variants)
    print_conditions(cond)
    rng = random.Random(args.seed)
    rounds: list[dict[str, Any]] = []
    started = time.monotonic()
    memory: dict[str, Any] = {}
    for r in range(args.rounds):
        order = variants[:]
        rng.shuffle(order)
        results: dict[str, Any] = {}
        last = r == args.rounds - 1
        for variant in order:
            # the memory pass rides on the last round, after that process's timed steps
            mem = args.mem_steps if last and variant != "none" and not variant.endswith("_nogc") else 0
            results[variant] = run_child(variant, args, mem_steps=mem)
            if mem:
                memory[variant] = {"peaks": results[variant].pop("peaks", None)}
        rounds.append({"order": order, "results": results})
        print(f"  round {r + 1}/{args.rounds} ({time.monotonic() - started:.0f} s): "
              f"{' '.join(order)}", file=sys.stderr, flush=True)
    cond["loadavg_end"] = [round(x, 2) for x in os.getloadavg()] if hasattr(os, "getloadavg") else None
    cond["wall_s"] = round(time.monotonic() - started, 1)
    cond["commit_end"] = checkout()
    data = {"conditions": cond, "variants": variants, "rounds": rounds, "memory": memory}
    if args.json:
        with open(args.json, "w") as f:
            json.dump(data, f, indent=1)
    render(data, markdown=args.markdown, header=False)


# --- the report --------------------------------------------------------------------------------
Figures = dict[str, Any]


def summarise(data: dict[str, Any]) -> dict[str, Figures]:
    """Per variant: medians over rounds of the overheads and ratios, with their min and max."""
    variants: list[str] = data["variants"]
    per: dict[str, dict[str, list[float]]] = {v: {} for v in variants}

    def add(v: str, key: str, value: float) -> None:
        per[v].setdefault(key, []).append(value)

    for rnd in data["rounds"]:
        res = rnd["results"]
        base = res.get("none", {})
        if "error" in base or "thread_us" not in base:
            continue
        for v in variants:
            r = res.get(v, {})
            if "thread_us" not in r:
                continue
            for metric in ("thread_us", "process_us"):
                over = r[metric] - base[metric]
                add(v, metric, over)
                ref = res.get(reference_of(v), {})
                if metric in ref and ref[metric] - base[metric] > 0:
                    add(v, metric + ":x_raw", over / (ref[metric] - base[metric]))
                nogc = res.get(reference_of(v) + "_nogc", {})
                if metric in nogc and nogc[metric] - base[metric] > 0:
                    add(v, metric + ":x_nogc", over / (nogc[metric] - base[metric]))
                floor = res.get("floor", {})
                if metric in floor and floor[metric] - base[metric] > 0:
                    add(v, metric + ":x_floor", over / (floor[metric] - base[metric]))
            add(v, "spans", r["spans_per_episode"])
            add(v, "absolute", r["process_us"])
    out: dict[str, Figures] = {}
    for v in variants:
        figs: Figures = {}
        for key, values in per[v].items():
            figs[key] = (statistics.median(values), min(values), max(values), len(values))
        errors = [rnd["results"].get(v, {}).get("error") for rnd in data["rounds"]]
        errors = [e for e in errors if e]
        if errors:
            figs["error"] = errors[0]
        mem = data.get("memory", {}).get(v, {})
        if mem.get("peaks"):
            figs["peaks"] = mem["peaks"]
        net = sorted({a for rnd in data["rounds"] for a in rnd["results"].get(v, {}).get("net_attempts", [])})
        if net:
            figs["net_attempts"] = net
        out[v] = figs
    return out


def _ratio(figs: Figures, key: str) -> str:
    if key not in figs:
        return "—"
    med, lo, hi, _ = figs[key]
    if med == lo == hi == 1.0:  # the reference itself
        return "1.00"
    return f"{med:.2f} ({lo:.2f}–{hi:.2f})"


def _us(figs: Figures, key: str) -> str:
    if key not in figs:
        return "—"
    return f"{figs[key][0]:.0f}"


def _mem(figs: Figures) -> str:
    peaks = figs.get("peaks")
    if not peaks:
        return "—"
    return f"{peaks[0] / 2**20:.1f} → {peaks[-1] / 2**20:.1f}"


def _spans(figs: Figures) -> str:
    if "spans" not in figs:
        return "—"
    value = figs["spans"][0]
    return f"{value:.0f}" if value == int(value) else f"{value:.2f}"


def targets(summary: dict[str, Figures]) -> list[str]:
    """The issue's targets, as ratios within each round: met only if met in every round."""
    lines = []

    def fig(v: str, key: str) -> tuple[float, float, float, int] | None:
        return summary.get(v, {}).get(key)

    def verdict(value: tuple[float, float, float, int] | None, limit: float) -> str:
        if value is None:
            return "not measured"
        med, lo, hi, _ = value
        state = "met" if hi <= limit else ("missed" if lo > limit else "met in some rounds")
        return f"{med:.2f}× ({lo:.2f}–{hi:.2f}) — {state}"

    for v in ("otr_dropped", "otr_traced_dropped"):
        if v in summary:
            lines.append(f"dropped episode ≤ 2× the floor ({v}), all threads: "
                         f"{verdict(fig(v, 'process_us:x_floor'), 2.0)}; training thread: "
                         f"{verdict(fig(v, 'thread_us:x_floor'), 2.0)}")
    for v in ("otr_kept", "otr_traced_kept"):
        if v in summary:
            lines.append(f"kept episode with redaction ≤ 1.0× raw SDK ({v} / {reference_of(v)}), "
                         f"all threads: {verdict(fig(v, 'process_us:x_raw'), 1.0)}")
    return lines


def gc_share(summary: dict[str, Figures]) -> str | None:
    raw, nogc = summary.get("raw_sdk", {}), summary.get("raw_sdk_nogc", {})
    if "process_us" not in raw or "process_us:x_raw" not in nogc:
        return None
    share = [1 - x for x in (nogc["process_us:x_raw"][0], nogc["process_us:x_raw"][2],
                             nogc["process_us:x_raw"][1])]
    return (f"GC share of the raw SDK baseline: {100 * share[0]:.0f}% of its all-thread CPU "
            f"({100 * share[1]:.0f}–{100 * share[2]:.0f}% over rounds; raw_sdk "
            f"{raw['process_us'][0]:.0f} µs/episode, with gc.disable() {nogc['process_us'][0]:.0f})")


def render(data: dict[str, Any], markdown: bool = False, header: bool = True) -> None:
    cond = data["conditions"]
    if header:
        print_conditions(cond)
    summary = summarise(data)
    variants: list[str] = data["variants"]
    n_rounds = len(data["rounds"])
    traced_note = " (raw_sdk_traced for the *_traced tree)" if any("traced" in v for v in variants) else ""
    print(f"\nper episode, minus no tracing, median of {n_rounds} rounds; ratios: median (min–max over "
          f"rounds) to the raw SDK tree of the same round{traced_note}")
    head = (f"{'variant':<20} {'train µs':>9} {'train × raw':>19} {'all µs':>8} {'all × raw':>19}"
            f" {'all × raw GC-off':>19} {'spans/ep':>9} {'peak MiB first→last':>20}")
    print(head)
    for v in variants:
        figs = summary[v]
        if "error" in figs and "thread_us" not in figs:
            print(f"{v:<20} {'—':>9}   {figs['error']}")
            continue
        if v == "none":
            absolute = figs.get("absolute", (float("nan"),))[0]
            print(f"{v:<20} (baseline: {absolute:.0f} µs/episode all threads)")
            continue
        print(f"{v:<20} {_us(figs, 'thread_us'):>9} {_ratio(figs, 'thread_us:x_raw'):>19}"
              f" {_us(figs, 'process_us'):>8} {_ratio(figs, 'process_us:x_raw'):>19}"
              f" {_ratio(figs, 'process_us:x_nogc'):>19} {_spans(figs):>9} {_mem(figs):>20}")
    notes = []
    share = gc_share(summary)
    if share:
        notes.append(share)
    for v in variants:
        if summary[v].get("error"):
            notes.append(f"{v}: {summary[v]['error']}")
        if summary[v].get("net_attempts"):
            notes.append(f"{v}: network connections attempted (refused): {summary[v]['net_attempts']}")
    if not any(summary[v].get("net_attempts") for v in variants):
        notes.append("no variant attempted a network connection")
    print()
    for line in notes + targets(summary):
        print(line)
    if markdown:
        print("\n" + markdown_table(data, summary))


def markdown_table(data: dict[str, Any], summary: dict[str, Figures]) -> str:
    cond = data["conditions"]
    vers = cond.get("versions", {})
    rows = [
        "| variant | training thread µs/episode | × raw SDK | all threads µs/episode | × raw SDK "
        "| × raw SDK with GC off | spans exported / episode | peak MiB (first step → last) |",
        "|---|---|---|---|---|---|---|---|",
    ]
    for v in data["variants"]:
        figs = summary[v]
        if v == "none":
            continue
        label = LABELS.get(v) or LABELS.get(base_of(v), v) + " (cyclic GC off)"
        dist = DISTRIBUTIONS.get(v)
        version = f" {vers[dist]}" if dist and dist in vers else ""
        label = label.format(version=version, episodes=f"{cond['episodes']:,}")
        if "thread_us" not in figs:
            rows.append(f"| {label} | — | — | — | — | — | — | {figs.get('error', 'not run')} |")
            continue
        rows.append(
            f"| {label} | {_us(figs, 'thread_us')} | {_ratio(figs, 'thread_us:x_raw')} "
            f"| {_us(figs, 'process_us')} | {_ratio(figs, 'process_us:x_raw')} "
            f"| {_ratio(figs, 'process_us:x_nogc')} | {_spans(figs)} | {_mem(figs)} |")
    caption = (f"{cond['episodes']:,} episodes/step × {cond['steps']} steps per process, "
               f"{len(data['rounds'])} rounds alternated, medians (min–max over rounds); "
               f"python {cond['python']}, {cond['cpu_count']} CPUs, load average "
               f"{cond.get('loadavg_start')} → {cond.get('loadavg_end')}; "
               f"checkout {cond.get('commit') or '?'}"
               f"{' → ' + cond['commit_end'] if cond.get('commit_end', cond.get('commit')) != cond.get('commit') else ''}.")
    lines = [caption, "", *rows, ""]
    share = gc_share(summary)
    if share:
        lines.append(f"- {share}.")
    lines += [f"- {t}." for t in targets(summary)]
    return "\n".join(lines)


if __name__ == "__main__":
    main()
