"""Context stays correct under concurrency: each episode's trace holds exactly its own spans."""

from __future__ import annotations

import asyncio
import random
from concurrent.futures import ThreadPoolExecutor

from otr_helpers import root, traces, tree

import otel_rollouts as otr
from otel_rollouts import conventions as c


async def _async_episode(i: int) -> str:
    async with otr.episode(step=0, sample_index=i, group_id=f"g{i % 7}") as ep:
        ep.prompt(f"prompt {i}")
        for t in range(2):
            async with ep.turn() as turn:
                await asyncio.sleep(random.random() / 1000)
                turn.record_generation(f"answer {i}.{t}", model="m")
                with turn.tool_call("tool", arguments={"i": i}, call_id=f"{i}-{t}") as call:
                    await asyncio.sleep(random.random() / 1000)
                    call.result(i)
        ep.reward(i / 200)
    return ep.trace_id


def _check(exporter, expected: int) -> None:
    by_trace = traces(exporter)
    assert len(by_trace) == expected
    for spans in by_trace.values():
        r = root(spans)
        i = r.attributes[c.RL_SAMPLE_INDEX]
        assert [n for _, n in tree(spans)] == [
            "episode", "prompt", "turn", "chat m", "execute_tool tool", "turn", "chat m",
            "execute_tool tool", "reward",
        ]
        for s in spans:
            if s.name == "execute_tool tool":
                assert s.attributes[c.GEN_AI_TOOL_CALL_ID].startswith(f"{i}-")
                assert s.attributes[c.GEN_AI_TOOL_CALL_RESULT] == i
            if s.name == "chat m":
                assert f"answer {i}." in s.attributes[c.GEN_AI_OUTPUT_MESSAGES]
            if s.name == "prompt":
                assert f'"prompt {i}"' in s.attributes[c.GEN_AI_INPUT_MESSAGES]


async def test_200_concurrent_asyncio_episodes(memory):
    ids = await asyncio.gather(*(_async_episode(i) for i in range(200)))
    assert len(set(ids)) == 200
    otr.flush()
    _check(memory, 200)


def _thread_episode(i: int) -> str:
    with otr.episode(step=0, sample_index=i) as ep:
        ep.prompt(f"prompt {i}")
        for t in range(2):
            with ep.turn() as turn:
                turn.record_generation(f"answer {i}.{t}", model="m")
                with turn.tool_call("tool", arguments={"i": i}, call_id=f"{i}-{t}") as call:
                    call.result(i)
        ep.reward(i / 200)
    return ep.trace_id


def test_episodes_from_a_thread_pool(memory):
    with ThreadPoolExecutor(max_workers=8) as pool:
        ids = list(pool.map(_thread_episode, range(120)))
    assert len(set(ids)) == 120
    otr.flush()
    _check(memory, 120)
