"""@otr.traced on every kind of callable: spans live as long as the call, errors propagate."""

from __future__ import annotations

import asyncio

import pytest
from opentelemetry.trace.status import StatusCode
from otr_helpers import root, traces, tree

import otel_rollouts as otr
from otel_rollouts import conventions as c


class Env:
    model_name = "policy-7b"

    @otr.traced(kind="turn")
    def step(self, action: str) -> dict:
        return {"obs": f"saw {action}", "done": False}

    @otr.traced(kind="generation")
    def generate(self, messages: list) -> str:
        return "the answer"

    @classmethod
    @otr.traced
    def make(cls, n: int) -> int:
        return n + 1

    @otr.traced
    @classmethod
    def make2(cls, n: int) -> int:
        return n + 2

    @staticmethod
    @otr.traced(name="helper")
    def helper(x: int) -> int:
        return x * 2

    @otr.traced(name="helper2")
    @staticmethod
    def helper2(x: int) -> int:
        return x * 3


@otr.traced(kind="tool")
def calculator(expression: str) -> float:
    return float(eval(expression, {"__builtins__": {}}))  # noqa: S307


@otr.traced(kind="episode")
def rollout(step: int, group_id: str, env: Env) -> float:
    env.step("look")
    env.generate([{"role": "user", "content": "hi"}])
    calculator("6*7")
    assert Env.make(1) == 2 and Env.make2(1) == 3
    assert Env.helper(2) == 4 and Env.helper2(2) == 6
    otr.current_episode().reward(1.0)
    return 1.0


def test_decorated_rollout_builds_an_episode_tree(memory):
    assert rollout(5, "g1", Env()) == 1.0
    otr.flush()
    (spans,) = traces(memory).values()
    assert tree(spans) == [
        (0, "episode"),
        (1, "turn"),
        (1, "chat policy-7b"),
        (1, "execute_tool calculator"),
        (1, "Env.make"),
        (1, "Env.make2"),
        (1, "helper"),
        (1, "helper2"),
        (1, "reward"),
    ]
    r = root(spans)
    assert r.attributes[c.RL_STEP] == 5 and r.attributes[c.RL_GROUP_ID] == "g1"
    by = {s.name: s for s in spans}
    assert by["turn"].attributes[c.RL_TURN_INDEX] == 0
    assert '"saw look"' in by["turn"].attributes[c.OUTPUT_VALUE]
    assert "self" not in by["turn"].attributes[c.INPUT_VALUE]
    assert by["turn"].attributes[c.INPUT_VALUE] == '{"action":"look"}'
    gen = by["chat policy-7b"]
    assert gen.attributes[c.GEN_AI_REQUEST_MODEL] == "policy-7b"
    assert '"hi"' in gen.attributes[c.GEN_AI_INPUT_MESSAGES]
    assert '"the answer"' in gen.attributes[c.GEN_AI_OUTPUT_MESSAGES]
    tool = by["execute_tool calculator"]
    assert tool.attributes[c.GEN_AI_TOOL_CALL_ARGUMENTS] == '{"expression":"6*7"}'
    assert tool.attributes[c.GEN_AI_TOOL_CALL_RESULT] == 42.0
    assert by["Env.make"].attributes[c.INPUT_VALUE] == '{"n":1}'


def test_generation_model_from_argument(memory):
    @otr.traced(kind="generation")
    def generate(prompt: str, model: str = "m-arg") -> str:
        return prompt[::-1]

    with otr.episode(step=0):
        generate("abc")
    otr.flush()
    names = [s.name for s in memory.get_finished_spans()]
    assert "chat m-arg" in names


def test_exceptions_are_recorded_and_reraised_untouched(memory):
    class Boom(Exception):
        pass

    err = Boom("tool exploded")

    @otr.traced(kind="tool")
    def bad_tool():
        raise err

    with otr.episode(step=0) as ep:
        with pytest.raises(Boom) as info:
            bad_tool()
        assert info.value is err
        ep.reward(0)
    otr.flush()
    (spans,) = traces(memory).values()
    tool = [s for s in spans if s.name == "execute_tool bad_tool"][0]
    assert tool.status.status_code is StatusCode.ERROR
    assert "tool exploded" in tool.status.description
    assert tool.events[0].attributes[c.EXCEPTION_TYPE].endswith("Boom")


def test_episode_kind_exception_marks_episode_error(memory):
    @otr.traced(kind="episode")
    def crashing(step):
        raise ValueError("bad env")

    with pytest.raises(ValueError, match="bad env"):
        crashing(step=2)
    otr.end_step(2)
    otr.flush()
    (spans,) = traces(memory).values()
    r = root(spans)
    assert r.attributes[c.RL_STATUS] == "error" and r.status.status_code is StatusCode.ERROR


def test_generator_span_lives_until_exhausted_and_context_is_restored(memory):
    @otr.traced
    def tokens(n):
        yield from range(n)
        return "done"

    @otr.traced
    def inner():
        return 1

    with otr.episode(step=0) as ep:
        gen = tokens(3)
        first = next(gen)
        inner()  # between two yields the generator's span must NOT be the current one
        rest = list(gen)
        ep.reward(0)
    assert [first, *rest] == [0, 1, 2]
    otr.flush()
    (spans,) = traces(memory).values()
    by = {s.name: s for s in spans}
    tok = by["test_generator_span_lives_until_exhausted_and_context_is_restored.<locals>.tokens"]
    inn = by["test_generator_span_lives_until_exhausted_and_context_is_restored.<locals>.inner"]
    assert inn.parent.span_id == root(spans).context.span_id
    assert tok.end_time >= inn.end_time  # lived across the other call
    assert tok.attributes[c.OUTPUT_VALUE] == "done"


def test_generator_closed_early_ends_its_span_without_error(memory):
    @otr.traced
    def forever():
        i = 0
        while True:
            yield i
            i += 1

    with otr.episode(step=0) as ep:
        g = forever()
        assert next(g) == 0 and next(g) == 1
        g.close()
        ep.reward(0)
    otr.flush()
    (spans,) = traces(memory).values()
    span = [s for s in spans if s.name.endswith("forever")][0]
    assert span.end_time is not None and span.status.status_code is not StatusCode.ERROR


def test_generator_exception_propagates(memory):
    @otr.traced
    def broken():
        yield 1
        raise KeyError("k")

    with otr.episode(step=0) as ep:
        with pytest.raises(KeyError):
            list(broken())
        ep.reward(0)
    otr.flush()
    span = [s for s in memory.get_finished_spans() if s.name.endswith("broken")][0]
    assert span.status.status_code is StatusCode.ERROR


async def test_async_function_and_async_generator(memory):
    @otr.traced(kind="generation", model="async-m")
    async def agenerate(prompt):
        await asyncio.sleep(0)
        return "out"

    @otr.traced
    async def astream(n):
        for i in range(n):
            await asyncio.sleep(0)
            yield i

    @otr.traced(kind="episode")
    async def arollout(step):
        await agenerate("p")
        items = [i async for i in astream(3)]
        otr.current_episode().reward(len(items))
        return items

    assert await arollout(step=1) == [0, 1, 2]
    otr.end_step(1)
    otr.flush()
    (spans,) = traces(memory).values()
    assert [n for _, n in tree(spans)] == [
        "episode",
        "chat async-m",
        "test_async_function_and_async_generator.<locals>.astream",
        "reward",
    ]


async def test_async_generator_closed_early(memory):
    @otr.traced
    async def astream():
        i = 0
        while True:
            yield i
            i += 1

    async with otr.episode(step=0) as ep:
        agen = astream()
        assert await agen.__anext__() == 0
        await agen.aclose()
        ep.reward(0)
    otr.flush()
    span = [s for s in memory.get_finished_spans() if s.name.endswith("astream")][0]
    assert span.end_time is not None


def test_outside_an_episode_spans_are_plain_sdk_spans(memory):
    @otr.traced(name="standalone")
    def f(x):
        return x + 1

    assert f(1) == 2
    otr.flush()
    (span,) = memory.get_finished_spans()
    assert span.name == "standalone" and span.parent is None
    assert span.attributes[c.INPUT_VALUE] == '{"x":1}'


def test_traced_large_arguments_keep_head_and_tail(memory):
    @otr.traced
    def big(text):
        return len(text)

    with otr.episode(step=0) as ep:
        big("HEAD" + "x" * 100_000 + "TAIL")
        ep.reward(0)
    otr.flush()
    span = [s for s in memory.get_finished_spans() if s.name.endswith("big")][0]
    value = span.attributes[c.INPUT_VALUE]
    assert value.startswith('{"text":"HEAD') and value.endswith('TAIL"}')
    assert len(value) < 20_000


def test_non_json_arguments_do_not_break_the_call(memory):
    class Opaque:
        __slots__ = ()

        def __repr__(self):
            raise RuntimeError("repr is broken too")

    @otr.traced
    def takes(obj, fn=len):
        return 7

    with otr.episode(step=0) as ep:
        assert takes(Opaque()) == 7
        ep.reward(0)
    otr.flush()
    span = [s for s in memory.get_finished_spans() if s.name.endswith("takes")][0]
    assert "Opaque" in span.attributes[c.INPUT_VALUE]


def test_disabled_sdk_is_a_cheap_noop(otr_shutdown, monkeypatch):
    monkeypatch.setenv(c.ENV_SDK_DISABLED, "true")
    otr.configure()
    calls = []

    @otr.traced(kind="episode")
    def r(step):
        calls.append(step)
        with otr.episode(step=step) as ep:
            ep.prompt("x")
            with ep.turn() as t:
                with t.tool_call("x") as call:
                    call.result(1)
            ep.reward(1)
        return step

    assert r(3) == 3 and calls == [3]
    assert otr.current_episode() is None
    assert otr.stats() == {"totals": {}, "steps": {}}
    otr.end_step(3)
    assert otr.flush()


def test_unknown_kind_is_refused_at_decoration():
    with pytest.raises(ValueError, match="kind must be one of"):
        otr.traced(kind="banana")


def _sig_plain(self, messages, k=3, *, temperature=0.7, stop=None): ...
def _sig_required_kw(prompt, *, model, n=1): ...
def _sig_var(a, *rest, b=2, **extra): ...
def _sig_positional_only(a, b=1, /, c=2): ...
def _sig_none(): ...


@pytest.mark.parametrize("fn", [_sig_plain, _sig_required_kw, _sig_var, _sig_positional_only, _sig_none])
def test_a_traced_call_names_its_arguments_as_inspect_binds_them(fn) -> None:
    """The traced wrapper binds a call's arguments without inspect where the signature is plain:
    for every call shape (too many, missing, unknown, doubled) the result is inspect's, or its
    fallback where inspect refuses the call."""
    import inspect

    from otel_rollouts.record.traced import _bound_args, _Params

    params = _Params(inspect.signature(fn))
    calls = [
        ((), {}), ((1,), {}), ((1, 2), {}), ((1, 2, 3), {}), ((1, 2, 3, 4, 5), {}),
        ((1,), {"messages": 2}), ((1,), {"k": 9, "temperature": 0.1}), ((), {"self": 0, "messages": 1}),
        ((1, 2), {"k": 4}), ((1,), {"unknown": 1}), (("p",), {"model": "m"}), ((), {"prompt": "p", "n": 2}),
        ((1,), {"b": 5, "z": 6}), ((1, 2), {"c": 3}), ((1,), {"a": 1}), ((), {"a": 1, "b": 2, "c": 3}),
    ]
    for args, kwargs in calls:
        assert params.bind(args, kwargs) == _bound_args(params.sig, args, kwargs), (fn.__name__, args, kwargs)
        assert list(params.bind(args, kwargs)) == list(_bound_args(params.sig, args, kwargs))
    assert params.plain is not None if fn in (_sig_plain, _sig_required_kw, _sig_none) else params.plain is None
