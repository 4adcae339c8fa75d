"""``@otr.traced(kind="episode")`` ends an episode by the rule of ``with otr.episode()``: cut short
(Ctrl-C, ``sys.exit``, an abandoned generator) is ``truncated``, not ``ok`` or ``error`` (issue 28)."""

from __future__ import annotations

import asyncio

import pytest
from opentelemetry.trace.status import StatusCode
from otr_helpers import root, traces

import otel_rollouts as otr
from otel_rollouts import conventions as c


def _the_root(memory, step):
    otr.end_step(step)
    assert otr.flush(10.0)
    (spans,) = traces(memory).values()
    return root(spans)


def _with_block(memory, exc_type):
    with pytest.raises(exc_type), otr.episode(step=9):
        raise exc_type()
    return _the_root(memory, 9)


@pytest.mark.parametrize("exc_type", [KeyboardInterrupt, SystemExit])
def test_an_interrupted_function_episode_is_truncated_as_with_episode(memory, exc_type):
    @otr.traced(kind="episode")
    def run(step):
        raise exc_type()

    with pytest.raises(exc_type):
        run(step=3)
    r = _the_root(memory, 3)
    assert r.attributes[c.RL_STATUS] == c.STATUS_TRUNCATED
    assert r.attributes[c.RL_FINISH_REASON] == exc_type.__name__
    assert r.status.status_code is not StatusCode.ERROR


@pytest.mark.parametrize("exc_type", [KeyboardInterrupt, SystemExit])
def test_the_with_block_gives_the_same_status(memory, exc_type):
    r = _with_block(memory, exc_type)
    assert r.attributes[c.RL_STATUS] == c.STATUS_TRUNCATED
    assert r.status.status_code is not StatusCode.ERROR


@pytest.mark.parametrize("exc_type", [KeyboardInterrupt, SystemExit])
def test_an_interrupted_coroutine_episode_is_truncated(memory, exc_type):
    @otr.traced(kind="episode")
    async def run(step):
        raise exc_type()

    with pytest.raises(exc_type):
        asyncio.run(run(step=4))
    r = _the_root(memory, 4)
    assert r.attributes[c.RL_STATUS] == c.STATUS_TRUNCATED


def test_an_abandoned_generator_episode_is_truncated(memory):
    @otr.traced(kind="episode")
    def rollout(step):
        yield from range(10)

    gen = rollout(step=5)
    assert next(gen) == 0
    gen.close()  # the consumer gave up before the end
    r = _the_root(memory, 5)
    assert r.attributes[c.RL_STATUS] == c.STATUS_TRUNCATED
    assert r.attributes[c.RL_FINISH_REASON] == "GeneratorExit"


def test_an_abandoned_async_generator_episode_is_truncated(memory):
    @otr.traced(kind="episode")
    async def rollout(step):
        for i in range(10):
            yield i

    async def consume():
        agen = rollout(step=6)
        assert await agen.__anext__() == 0
        await agen.aclose()

    asyncio.run(consume())
    r = _the_root(memory, 6)
    assert r.attributes[c.RL_STATUS] == c.STATUS_TRUNCATED


def test_an_exhausted_generator_episode_is_ok_and_a_failing_one_error(memory):
    @otr.traced(kind="episode")
    def rollout(step, fail):
        yield 1
        if fail:
            raise ValueError("env broke")

    assert list(rollout(step=7, fail=False)) == [1]
    with pytest.raises(ValueError):
        list(rollout(step=7, fail=True))
    otr.end_step(7)
    assert otr.flush(10.0)
    statuses = sorted(root(spans).attributes[c.RL_STATUS] for spans in traces(memory).values())
    assert statuses == [c.STATUS_ERROR, c.STATUS_OK]


def test_a_span_kind_generator_abandoned_still_ends_ok(memory):
    @otr.traced
    def tokens():
        yield from range(3)

    with otr.episode(step=8) as ep:
        gen = tokens()
        next(gen)
        gen.close()
        ep.reward(1.0)
    otr.end_step(8)
    assert otr.flush(10.0)
    (spans,) = traces(memory).values()
    child = next(s for s in spans if s.parent is not None)
    assert child.status.status_code is not StatusCode.ERROR


class _NoText:
    """A name whose ``__str__`` and ``__bool__`` end the process if anything calls them unguarded."""

    def __str__(self) -> str:
        raise SystemExit(3)

    def __bool__(self) -> bool:
        raise SystemExit(4)


def test_a_hostile_name_or_model_given_to_traced_never_reaches_the_user(memory):
    # the names are made text once, when the function is decorated: guarded there, placeholders
    # in the span names, every call recorded
    @otr.traced(kind="tool", name=_NoText())
    def search(query: str) -> str:
        return "found"

    @otr.traced(kind="generation", model=_NoText())
    def generate(messages: list) -> str:
        return "hi"

    with otr.episode(step=5) as ep:
        assert search("q") == "found"
        assert generate([{"role": "user", "content": "q"}]) == "hi"
        ep.reward(1.0)
    otr.end_step(5)
    assert otr.flush(10.0)
    (spans,) = traces(memory).values()
    names = sorted(s.name for s in spans)
    assert names == ["chat <_NoText: str raised SystemExit>", "episode",
                     "execute_tool <_NoText: str raised SystemExit>", "reward"]
