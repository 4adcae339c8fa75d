"""The lean recording path keeps the contract: what the fast paths of the episode API and of
``@traced`` record is what the general paths record, ``with`` spans are the current span for other
instrumentation, hostile values are flagged and never raised, a late reward still decides its
episode, and the work per span stays small (counted structurally, never timed)."""

from __future__ import annotations

import json
import sys
from collections.abc import Iterator
from typing import Any

import pytest
from opentelemetry import trace
from opentelemetry.sdk.trace import TracerProvider
from opentelemetry.sdk.trace.export import SimpleSpanProcessor
from opentelemetry.sdk.trace.export.in_memory_span_exporter import InMemorySpanExporter
from otr_helpers import root, traces

import otel_rollouts as otr
from otel_rollouts import conventions as c

# attributes that differ between two recordings of the same episode by construction
_PER_RECORDING = {c.RL_EPISODE_ID, c.GEN_AI_CONVERSATION_ID, c.RL_DURATION_SECONDS}


@pytest.fixture
def other_sdk() -> Iterator[tuple[trace.Tracer, InMemorySpanExporter]]:
    """Another instrumentation's tracer (an httpx or OpenAI client's): a real SDK provider of its
    own, which reads the parent of each span it starts from the current OpenTelemetry context."""
    exporter = InMemorySpanExporter()
    provider = TracerProvider()
    provider.add_span_processor(SimpleSpanProcessor(exporter))
    yield provider.get_tracer("other-instrumentation"), exporter
    provider.shutdown()


def _by_name(spans: list[Any]) -> dict[str, Any]:
    return {s.name: s for s in spans}


def test_with_blocks_are_the_current_span_for_other_instrumentation(memory, other_sdk) -> None:
    tracer, other = other_sdk
    with otr.episode(step=0, group_id="g", sample_index=0) as ep:
        tracer.start_span("in episode").end()
        with ep.turn() as turn:
            tracer.start_span("in turn").end()
            with turn.tool_call("search", arguments={"q": "x"}) as call:
                tracer.start_span("in tool call").end()
                call.result("found")
            with turn.generation(model="policy") as gen:
                tracer.start_span("in generation").end()
                gen.output("done")
            tracer.start_span("in turn again").end()  # the block before, current again
        ep.reward(1.0)
    assert trace.get_current_span() is trace.INVALID_SPAN  # all blocks left: nothing current
    otr.flush()
    (spans,) = traces(memory).values()
    ours = _by_name(spans)
    theirs = _by_name(list(other.get_finished_spans()))
    trace_id = int(ep.trace_id or "0", 16)
    expected_parent = {"in episode": "episode", "in turn": "turn", "in tool call": "execute_tool search",
                       "in generation": "chat policy", "in turn again": "turn"}
    for child, parent in expected_parent.items():
        span = theirs[child]
        assert span.context.trace_id == trace_id, child
        assert span.parent is not None and span.parent.span_id == ours[parent].context.span_id, child


def test_a_traced_function_body_runs_with_its_span_current(memory, other_sdk) -> None:
    tracer, other = other_sdk

    @otr.traced(kind="generation", model="policy")
    def generate(messages: list[dict[str, str]]) -> str:
        tracer.start_span("http request").end()
        return "answer"

    with otr.episode(step=0) as ep:
        with ep.turn():
            generate([{"role": "user", "content": "q"}])
        ep.reward(0.0)
    otr.flush()
    (spans,) = traces(memory).values()
    (request,) = other.get_finished_spans()
    assert request.parent is not None
    assert request.parent.span_id == _by_name(spans)["chat policy"].context.span_id
    assert request.context.trace_id == int(ep.trace_id or "0", 16)


def _context_sets(fn: Any) -> int:
    """How many times ``fn()`` sets OpenTelemetry's current context (its ContextVar's ``set``),
    seen through the interpreter's profile hook: nothing is patched."""
    calls = 0

    def profile(frame: Any, event: str, arg: Any) -> None:
        nonlocal calls
        if event == "c_call" and getattr(arg, "__name__", "") == "set" and \
                type(getattr(arg, "__self__", None)).__name__ == "ContextVar":
            calls += 1

    sys.setprofile(profile)
    try:
        fn()
    finally:
        sys.setprofile(None)
    return calls


def test_leaf_spans_leave_the_context_alone_and_blocks_set_it_once(memory) -> None:
    with otr.episode(step=0) as ep:
        assert _context_sets(lambda: ep.prompt("hello")) == 0
        with ep.turn() as turn:
            assert _context_sets(lambda: turn.record_generation("hi", model="m", output_tokens=3)) == 0

            def block() -> None:
                with turn.tool_call("t") as call:
                    call.result(1)

            assert _context_sets(block) == 1  # entered once; left with the token's reset
        assert _context_sets(lambda: ep.reward(1.0)) == 0
    otr.flush()
    (spans,) = traces(memory).values()
    assert {s.name for s in spans} == {"episode", "prompt", "turn", "chat m", "execute_tool t", "reward"}


class _Hostile:
    """A value whose every conversion raises, SystemExit included."""

    def __str__(self) -> str:
        raise SystemExit("str")

    def __repr__(self) -> str:
        raise SystemExit("repr")

    def __float__(self) -> float:
        raise SystemExit("float")

    def __index__(self) -> int:
        raise SystemExit("index")

    def __int__(self) -> int:
        raise SystemExit("int")


def test_hostile_values_on_the_fast_paths_are_flagged_not_raised(memory) -> None:
    bad = _Hostile()
    with otr.episode(step=0, group_id=bad, sample_index=bad, split=bad) as ep:
        ep.prompt("q")
        with ep.turn() as turn:
            turn.record_generation("a", model="m", output_tokens=bad, input_tokens=bad)
            with turn.tool_call(bad, arguments={"x": bad}) as call:
                call.result(bad)
        ep.reward(bad, components={"part": bad}, advantage=bad)
    otr.flush()
    (spans,) = traces(memory).values()
    by_name = _by_name(spans)
    r = root(spans)
    invalid = " ".join(r.attributes[c.RL_INVALID_FIELDS])
    assert "sample_index" in invalid
    chat = by_name["chat m"]
    flagged = " ".join(chat.attributes[c.RL_INVALID_FIELDS])
    assert "output_tokens" in flagged and "input_tokens" in flagged
    assert c.GEN_AI_USAGE_OUTPUT_TOKENS not in chat.attributes
    reward = by_name["reward"]
    flagged = " ".join(reward.attributes[c.RL_INVALID_FIELDS])
    assert "reward" in flagged and "advantage" in flagged
    assert c.RL_REWARD not in reward.attributes
    tool = next(s for s in spans if s.name.startswith("execute_tool"))
    assert "raised" in tool.attributes[c.GEN_AI_TOOL_NAME]  # a placeholder text, not an exception


def test_a_late_reward_after_the_root_ended_decides_the_episode(configured) -> None:
    exporter = configured(2, "top_bottom", sampler_options={"step_lag": None})
    with otr.episode(step=0, group_id="g", sample_index=0) as low:
        low.reward(0.1)
    with otr.episode(step=0, group_id="g", sample_index=1) as middle:
        middle.reward(0.5)
    with otr.episode(step=0, group_id="g", sample_index=2) as high:
        high.prompt("q")
    high.reward(0.9)  # after its root ended: it still joins, and decides, the episode
    otr.end_step(0)
    otr.flush()
    kept = traces(exporter)
    assert set(kept) == {int(low.trace_id or "0", 16), int(high.trace_id or "0", 16)}
    spans = kept[int(high.trace_id or "0", 16)]
    assert root(spans).attributes[c.RL_REWARD] == 0.9
    assert _by_name(spans)["reward"].attributes[c.RL_REWARD] == 0.9


def _same_each_time(key: str, value: Any) -> Any:
    """``value`` less what differs per recording of the same episode: its ids and times."""
    if key == c.OI_METADATA:  # OpenInference's metadata: the root's rl.* attributes, as JSON
        return {k: v for k, v in json.loads(value).items()
                if not k.endswith("seconds") and k not in ("episode.id",)}
    return tuple(value) if isinstance(value, (list, tuple)) else value


def _attributes(spans: list[Any]) -> dict[str, dict[str, Any]]:
    """Each span's exported attributes by span name, less what differs per recording."""
    out: dict[str, dict[str, Any]] = {}
    for s in sorted(spans, key=lambda s: s.start_time):  # a name seen again: "name#2"
        name = s.name if s.name not in out else f"{s.name}#2"
        out[name] = {k: _same_each_time(k, v) for k, v in s.attributes.items()
                     if k not in _PER_RECORDING and not k.endswith(".seconds")}
    return out


def test_the_fast_paths_render_what_the_general_paths_render(memory) -> None:
    """One episode recorded twice: with the one-call forms (the fast paths: record_generation with
    a text answer, reward's own keys) and with the general forms (a generation block and
    ``output``, a mapping answer through ``@traced``); the kept episodes render alike."""
    messages = [{"role": "system", "content": "be brief"}, {"role": "user", "content": "2+2?"}]

    @otr.traced(kind="generation", model="policy")
    def answer_text(messages: list[dict[str, str]]) -> Any:
        return "4"

    @otr.traced(kind="generation", model="policy")
    def answer_message(messages: list[dict[str, str]]) -> Any:
        return {"role": "assistant", "content": "4"}

    def record(general: bool) -> str | None:
        with otr.episode(step=1, group_id="g7", sample_index=3, policy_version=2,
                         dataset_name="gsm8k", metadata={"temperature": 0.5}) as ep:
            ep.prompt(messages, system_instructions="be brief")
            with ep.turn() as turn:
                if general:
                    with turn.generation(model="policy", provider="vllm") as gen:
                        gen.output("calling", input_tokens=12, output_tokens=3, finish_reason="tool_calls")
                else:
                    turn.record_generation("calling", model="policy", provider="vllm", input_tokens=12,
                                           output_tokens=3, finish_reason="tool_calls")
                with turn.tool_call("calculator", arguments={"expr": "2+2"}, call_id="c1") as call:
                    call.result(4)
            with ep.turn():
                (answer_message if general else answer_text)(messages)
            ep.reward(1.0, components={"math": 1.0}, advantage=0.25)
            ep.finish(reason="stop")
        return ep.trace_id

    fast, general = record(False), record(True)
    otr.flush()
    by_trace = traces(memory)
    rendered_fast = _attributes(by_trace[int(fast or "0", 16)])
    rendered_general = _attributes(by_trace[int(general or "0", 16)])
    assert rendered_fast == rendered_general
    # and each attribute recorded through the public API is there with its value
    r = rendered_fast["episode"]
    assert (r[c.RL_STEP], r[c.RL_GROUP_ID], r[c.RL_SAMPLE_INDEX], r[c.RL_POLICY_VERSION]) == (1, "g7", 3, 2)
    assert (r[c.RL_REWARD], r[c.RL_REWARD_COMPONENT_PREFIX + "math"], r[c.RL_ADVANTAGE]) == (1.0, 1.0, 0.25)
    assert r[c.RL_DATASET_NAME] == "gsm8k" and r[c.RL_METADATA_PREFIX + "temperature"] == 0.5
    assert r[c.RL_STATUS] == c.STATUS_OK and r[c.RL_FINISH_REASON] == "stop"
    chat = rendered_fast["chat policy"]
    assert chat[c.GEN_AI_REQUEST_MODEL] == "policy" and chat[c.GEN_AI_PROVIDER_NAME] == "vllm"
    assert chat[c.GEN_AI_USAGE_INPUT_TOKENS] == 12 and chat[c.GEN_AI_USAGE_OUTPUT_TOKENS] == 3
    tool = rendered_fast["execute_tool calculator"]
    assert tool[c.GEN_AI_TOOL_CALL_ID] == "c1" and tool[c.GEN_AI_TOOL_CALL_RESULT] == 4
    assert rendered_fast["reward"][c.RL_REWARD] == 1.0
    assert '"4"' in rendered_fast["chat policy#2"][c.GEN_AI_OUTPUT_MESSAGES]


def _python_calls(fn: Any) -> int:
    """Python function calls made by ``fn()`` (the interpreter's profile hook; nothing timed)."""
    calls = 0

    def profile(frame: Any, event: str, arg: Any) -> None:
        nonlocal calls
        if event == "call":
            calls += 1

    sys.setprofile(profile)
    try:
        fn()
    finally:
        sys.setprofile(None)
    return calls


def test_the_work_per_recorded_span_stays_small(configured) -> None:
    """A dropped episode of 11 spans (the benchmarks' tree: prompt, 3 turns with a generation,
    2 tool calls, a reward) takes a bounded number of Python calls, offer and drop included.
    The bound is structural (calls, not time): the lean path takes about 12 per span (offer,
    drop and the loop's own calls included) where the recorder before it took about 23."""
    configured(0, "top_bottom", sampler_options={"step_lag": None})
    prompt = [{"role": "system", "content": "s"}, {"role": "user", "content": "u"}]

    def one(i: int) -> None:
        with otr.episode(step=0, group_id=f"g{i // 8}", sample_index=i % 8) as ep:
            ep.prompt(prompt)
            for k in range(3):
                with ep.turn() as turn:
                    turn.record_generation("text", model="policy", output_tokens=250)
                    if k < 2:
                        with turn.tool_call("search", arguments={"q": "x", "top_k": 5}) as call:
                            call.result("result")
            ep.reward(0.5)

    for i in range(32):
        one(i)  # warm: first-time paths (a step's bucket, its groups) out of the count
    n = 64
    calls = _python_calls(lambda: [one(32 + i) for i in range(n)])
    assert calls / n / 11 <= 14, f"{calls / n / 11:.1f} Python calls per recorded span"
    assert trace.get_current_span() is trace.INVALID_SPAN  # every block left
