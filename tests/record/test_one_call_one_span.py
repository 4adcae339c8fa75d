"""One tool call is one span, one generation is one span, however the user writes it.

A ``@traced(kind="tool")`` function called directly inside ``with turn.tool_call(...)`` of the
same tool records into that span (the README's Quickstart writes it that way); the same for a
``@traced(kind="generation")`` inside ``with turn.generation(...)``. A traced generation's token
usage comes from the response it returns (the openai package's own ``ChatCompletion``), or from
``otr.current_generation()``; a count nobody gave stays absent, never 0.
"""

from __future__ import annotations

import json
import uuid

import pytest
from openai.types.chat import ChatCompletion
from opentelemetry.sdk.metrics.export import InMemoryMetricReader
from opentelemetry.sdk.trace.export.in_memory_span_exporter import InMemorySpanExporter
from opentelemetry.trace import SpanKind
from opentelemetry.trace.status import StatusCode
from otr_helpers import configure_memory

import otel_rollouts as otr
from otel_rollouts import conventions as c


@otr.traced(kind="tool")
def calculator(expression: str) -> float:
    return float(eval(expression, {"__builtins__": {}}))  # noqa: S307


@otr.traced(kind="tool")
def search(query: str) -> str:
    return f"results for {query}"


@otr.traced(kind="generation")
def generate(messages, model="qwen-0.5b"):
    return "I'll use the calculator."


def _completion(content: str | None, *, tool_call: bool = False, usage: bool = True) -> ChatCompletion:
    """The openai package's own response object, as its client returns it."""
    message: dict = {"role": "assistant", "content": content}
    if tool_call:
        message["tool_calls"] = [{"id": "call_9", "type": "function",
                                  "function": {"name": "calculator", "arguments": '{"expression": "6*7"}'}}]
    body = {
        "id": "chatcmpl-1", "object": "chat.completion", "created": 1, "model": "served-model",
        "choices": [{"index": 0, "message": message,
                     "finish_reason": "tool_calls" if tool_call else "stop"}],
    }
    if usage:
        body["usage"] = {"prompt_tokens": 812, "completion_tokens": 64, "total_tokens": 876}
    return ChatCompletion.model_validate(body)


@pytest.fixture
def run():
    reader = InMemoryMetricReader()
    memory = configure_memory(1000, "first", service_name="one-call", metric_readers=[reader],
                              handle_signals=False)
    yield memory, reader
    otr.shutdown()


def _spans(memory: InMemorySpanExporter) -> list:
    assert otr.flush(30)
    return list(memory.get_finished_spans())


def _named(spans, prefix: str) -> list:
    return [s for s in spans if s.name.startswith(prefix)]


def _tool_errors(reader: InMemoryMetricReader) -> float:
    data = reader.get_metrics_data()
    return sum(p.value for rm in data.resource_metrics for sm in rm.scope_metrics for m in sm.metrics
               if m.name == c.METRIC_TOOL_ERRORS for p in m.data.data_points)


def test_quickstart_pattern_makes_one_tool_span_and_one_tool_call_in_the_chat(run):
    memory, _ = run
    with otr.episode(step=0, group_id="p0", sample_index=0) as ep:
        ep.prompt([{"role": "user", "content": "2+2?"}])
        with ep.turn() as turn:
            generate([{"role": "user", "content": "2+2?"}])
            with turn.tool_call("calculator", arguments={"expression": "2+2"}, call_id="c1") as call:
                call.result(calculator("2+2"))
        ep.reward(1.0)
    otr.end_step(0)
    spans = _spans(memory)
    (tool,) = _named(spans, "execute_tool")
    assert tool.attributes[c.GEN_AI_TOOL_CALL_ID] == "c1"
    assert json.loads(tool.attributes[c.GEN_AI_TOOL_CALL_ARGUMENTS]) == {"expression": "2+2"}
    assert tool.attributes[c.GEN_AI_TOOL_CALL_RESULT] == 4.0
    (chat,) = _named(spans, "chat")
    (output,) = json.loads(chat.attributes[c.GEN_AI_OUTPUT_MESSAGES])
    calls = [p for p in output["parts"] if p["type"] == c.PART_TOOL_CALL]
    assert [(p["id"], p["name"]) for p in calls] == [("c1", "calculator")]
    # the model stopped to call a tool: the spec's finish reasons say so (on the span: the field
    # inside the output messages is deprecated)
    assert tuple(chat.attributes[c.GEN_AI_RESPONSE_FINISH_REASONS]) == (c.FINISH_TOOL_CALL,)
    assert "finish_reason" not in output
    assert chat.kind is SpanKind.CLIENT and tool.kind is SpanKind.INTERNAL
    flat_calls = [k for k in chat.attributes if k.endswith(c.OI_TOOL_CALL_ID)]
    assert len(flat_calls) == 1


def test_traced_tool_gives_the_arguments_the_block_did_not(run):
    memory, _ = run
    with otr.episode(step=0) as ep:
        with ep.turn() as turn:
            with turn.tool_call("calculator", call_id="c7"):
                calculator("6*7")
        ep.reward(1.0)
    otr.end_step(0)
    (tool,) = _named(_spans(memory), "execute_tool")
    assert json.loads(tool.attributes[c.GEN_AI_TOOL_CALL_ARGUMENTS]) == {"expression": "6*7"}
    assert tool.attributes[c.GEN_AI_TOOL_CALL_RESULT] == 42.0
    assert tool.attributes[c.GEN_AI_TOOL_CALL_ID] == "c7"


def test_a_failing_traced_tool_is_one_failed_call_counted_once(run):
    memory, reader = run
    with otr.episode(step=0) as ep:
        with ep.turn() as turn:
            with turn.tool_call("calculator", arguments={"expression": "1/0"}) as call:
                try:
                    calculator("1/0")
                except ZeroDivisionError as exc:
                    call.error(exc)  # the user reports what the function already recorded
        with ep.turn() as turn:  # the exception left the block: the same, one failure
            with pytest.raises(ZeroDivisionError), turn.tool_call("calculator"):
                calculator("2/0")
        ep.reward(0.0)
    otr.end_step(0)
    tools = _named(_spans(memory), "execute_tool")
    assert len(tools) == 2
    for tool in tools:
        assert tool.status.status_code is StatusCode.ERROR
        assert [e.name for e in tool.events] == [c.EVENT_EXCEPTION]
    assert _tool_errors(reader) == 2


def test_other_calls_inside_a_tool_call_stay_spans_of_their_own(run):
    memory, _ = run
    with otr.episode(step=0) as ep:
        with ep.turn() as turn:
            with turn.tool_call("calculator", arguments={"expression": "1+1"}) as call:
                search("sum")              # another tool: a sub-call of its own
                first = calculator("1+1")  # the call itself: merged
                second = calculator("2+2")  # a second call of the tool: its own span
                call.result(first + second)
            calculator("3+4")  # outside the block: its own tool call
        ep.reward(1.0)
    otr.end_step(0)
    spans = _spans(memory)
    tools = _named(spans, "execute_tool")
    by_id = {s.context.span_id: s for s in spans}
    outer = [t for t in tools if t.attributes.get(c.GEN_AI_TOOL_CALL_RESULT) == 6.0]
    assert len(outer) == 1
    nested = [t for t in tools if t.parent is not None and t.parent.span_id == outer[0].context.span_id]
    assert sorted(t.name for t in nested) == ["execute_tool calculator", "execute_tool search"]
    assert [t.attributes[c.GEN_AI_TOOL_CALL_RESULT] for t in nested if "calculator" in t.name] == [4.0]
    assert len(tools) == 4
    assert all(by_id.get(t.parent.span_id) is not None for t in tools)


def test_traced_generation_inside_a_generation_block_is_one_span_with_the_response(run):
    memory, _ = run

    @otr.traced(kind="generation")
    def call_policy(messages):
        return _completion(None, tool_call=True)

    with otr.episode(step=0) as ep:
        ep.prompt("6*7?")
        with ep.turn() as turn:
            with turn.generation("policy", provider="vllm"):
                call_policy([{"role": "user", "content": "6*7?"}])
        ep.reward(1.0)
    otr.end_step(0)
    spans = _spans(memory)
    (chat,) = _named(spans, "chat")
    assert chat.name == "chat policy"  # the block's model wins over the response's
    assert chat.attributes[c.GEN_AI_USAGE_INPUT_TOKENS] == 812
    assert chat.attributes[c.GEN_AI_USAGE_OUTPUT_TOKENS] == 64
    assert chat.attributes[c.OI_LLM_TOKEN_COUNT_TOTAL] == 876
    assert list(chat.attributes[c.GEN_AI_RESPONSE_FINISH_REASONS]) == [c.FINISH_TOOL_CALL]
    (output,) = json.loads(chat.attributes[c.GEN_AI_OUTPUT_MESSAGES])
    calls = [p for p in output["parts"] if p["type"] == c.PART_TOOL_CALL]
    assert [(p["id"], p["name"]) for p in calls] == [("call_9", "calculator")]


def test_traced_generation_returning_a_completion_records_text_model_and_usage(run):
    memory, _ = run

    @otr.traced(kind="generation")
    def call_policy(messages):
        return _completion("42")

    with otr.episode(step=0) as ep:
        with ep.turn():
            call_policy([{"role": "user", "content": "6*7?"}])
        ep.reward(1.0)
    otr.end_step(0)
    (chat,) = _named(_spans(memory), "chat")
    assert chat.name == "chat served-model"
    assert chat.attributes[c.GEN_AI_USAGE_INPUT_TOKENS] == 812
    assert chat.attributes[c.OUTPUT_VALUE] == "42"
    assert list(chat.attributes[c.GEN_AI_RESPONSE_FINISH_REASONS]) == [c.FINISH_STOP]


def test_usage_through_current_generation_and_absent_usage_stays_absent(run):
    memory, _ = run

    @otr.traced(kind="generation")
    def counted(messages):
        otr.current_generation().usage(input_tokens=30, output_tokens=7)
        return "counted"

    @otr.traced(kind="generation")
    def uncounted(messages):
        return _completion("no usage", usage=False)

    with otr.episode(step=0) as ep:
        with ep.turn():
            counted("q")
            uncounted("q")
        ep.reward(1.0)
    otr.current_generation().usage(input_tokens=1)  # outside any generation: nothing, no error
    otr.end_step(0)
    spans = _spans(memory)
    counted_span = next(s for s in _named(spans, "chat") if s.attributes.get(c.OUTPUT_VALUE) == "counted")
    assert counted_span.attributes[c.GEN_AI_USAGE_INPUT_TOKENS] == 30
    assert counted_span.attributes[c.OI_LLM_TOKEN_COUNT_COMPLETION] == 7
    plain = next(s for s in _named(spans, "chat") if s.attributes.get(c.OUTPUT_VALUE) == "no usage")
    for key in (c.GEN_AI_USAGE_INPUT_TOKENS, c.GEN_AI_USAGE_OUTPUT_TOKENS, c.OI_LLM_TOKEN_COUNT_PROMPT,
                c.OI_LLM_TOKEN_COUNT_COMPLETION, c.OI_LLM_TOKEN_COUNT_TOTAL):
        assert key not in plain.attributes


def test_a_step_without_usage_logs_no_token_scalars_and_one_with_usage_logs_the_sum():
    from trackio.sqlite_storage import SQLiteStorage

    from otel_rollouts.exporters import TrackioExporter

    project = f"tokens-{uuid.uuid4().hex[:8]}"
    exporter = TrackioExporter(project)
    otr.configure(exporters=[exporter], sampler=otr.TailSampler(10, "first"), handle_signals=False)
    try:
        with otr.episode(step=0) as ep:
            with ep.turn():
                generate("q")  # returns text: no usage
            ep.reward(1.0)
        otr.end_step(0)
        with otr.episode(step=1) as ep:
            with ep.turn() as turn:
                turn.record_generation("a", output_tokens=5)
                turn.record_generation("b")  # unknown usage: not 0, just not counted
            ep.reward(1.0)
        otr.end_step(1)
        assert otr.flush(60)
    finally:
        otr.shutdown()
    by_step: dict[int, dict] = {}
    for row in SQLiteStorage.get_logs(project, exporter.run):
        by_step.setdefault(row["step"], {}).update(row)
    assert "rollouts/tokens_output" not in by_step[0] and "rollouts/tokens_input" not in by_step[0]
    assert by_step[1]["rollouts/tokens_output"] == 5
    assert "rollouts/tokens_input" not in by_step[1]


class _Hostile:
    """A response object whose every read raises, down to SystemExit."""

    def __getattr__(self, name):
        raise SystemExit(f"read {name}")

    def __repr__(self):
        raise SystemExit("repr")

    __str__ = __repr__


def test_a_hostile_response_object_never_reaches_the_traced_function(run):
    memory, _ = run

    @otr.traced(kind="generation")
    def hostile(messages):
        return _Hostile()

    with otr.episode(step=0) as ep:
        with ep.turn() as turn:
            with turn.generation("policy"):
                result = hostile("q")
            with turn.tool_call("calculator"):
                value = calculator("1+2")
        ep.reward(1.0)
    otr.end_step(0)
    assert isinstance(result, _Hostile) and value == 3.0
    spans = _spans(memory)
    assert len(_named(spans, "chat")) == 1 and len(_named(spans, "execute_tool")) == 1


def test_bad_token_counts_are_refused_and_named(run):
    memory, _ = run
    with otr.episode(step=0) as ep:
        with ep.turn() as turn:
            turn.record_generation("x", input_tokens=-3, output_tokens="many")
        ep.reward(1.0)
    otr.end_step(0)
    (chat,) = _named(_spans(memory), "chat")
    assert c.GEN_AI_USAGE_INPUT_TOKENS not in chat.attributes
    assert c.GEN_AI_USAGE_OUTPUT_TOKENS not in chat.attributes
    invalid = list(chat.attributes[c.RL_INVALID_FIELDS])
    assert any(m.startswith("input_tokens: negative") for m in invalid)
    assert any(m.startswith("output_tokens") for m in invalid)
