"""verifiers adapter against verifiers' own code path (verifiers 0.4.0, ``verifiers.v1``).

A real ``SingleAgentEnv`` (``tests/verifiers_env.py``: a ``Taskset`` whose tasks carry
``@vf.reward`` / ``@vf.metric`` functions, and an in-process ``Harness`` with an ``add`` tool
loop) runs each task through verifiers' ``Env.run_episode``: its interception server, its
``EvalClient``, its stage timing, scoring and error boundaries, against a scripted
OpenAI-compatible server on 127.0.0.1 (the only stand-in: no model or GPU here). The adapter
gets the ``Episode`` / ``Trace`` objects verifiers returns, and the real OpenTelemetry SDK
exports what it records.
"""

from __future__ import annotations

import ast
import asyncio
import os
import types
from collections.abc import Awaitable, Callable
from pathlib import Path
from typing import Any

import pytest
from adapter_fixtures import configure_memory, episodes, messages_of
from docs_blocks import page_blocks
from frameworks import require

import otel_rollouts as otr
from otel_rollouts import conventions as c
from otel_rollouts.adapters import verifiers as otr_verifiers

vf = require("verifiers.v1")
verifiers_env = require("verifiers_env")

KEY_VAR = "OTR_VERIFIERS_STUB_KEY"


def run_env(select: Callable[[list[Any]], list[Any]], wrap: Callable[[Any], Any] | None = None,
            gather: Callable[[Any, list[Any], Any], Awaitable[list[Any]]] | None = None,
            **agent: Any) -> list[Any]:
    """verifiers' ``Env.run_episode`` over the selected tasks, against the loopback server
    (``wrap``: applied to the env verifiers built; ``gather(env, tasks, ctx)``: runs the episodes
    instead of ``asyncio.gather``; ``agent``: more ``AgentConfig`` settings, e.g. ``max_turns``)."""
    os.environ.setdefault(KEY_VAR, "not-a-secret")
    config = vf.SingleAgentEnvConfig(
        taskset=vf.TasksetConfig(id="verifiers_env"),
        agent=vf.AgentConfig(harness=vf.HarnessConfig(id="verifiers_env"), runtime=vf.SubprocessConfig(),
                             **agent))
    env = vf.SingleAgentEnv(config)
    if wrap is not None:
        env = wrap(env)

    async def main(base_url: str) -> list[Any]:
        ctx = vf.ModelContext(model="policy", client=vf.EvalClientConfig(base_url=base_url, api_key_var=KEY_VAR))
        async with env.serving():
            tasks = select(list(env.taskset))
            if gather is not None:
                return list(await gather(env, tasks, ctx))
            return list(await asyncio.gather(*(env.run_episode(t, ctx) for t in tasks)))

    with verifiers_env.ScriptedModelServer() as server:
        return asyncio.run(main(server.base_url))


@pytest.fixture(scope="module")
def run() -> list[Any]:
    """One episode per scripted task (plain, tool, long, fail), verifiers' own objects."""
    return run_env(lambda tasks: tasks)


def by_name(episodes_: list[Any]) -> dict[str, Any]:
    return {ep.task.data.name: ep.traces[0] for ep in episodes_}


def test_each_trace_is_an_episode_with_rewards_metrics_and_timing(run: list[Any]) -> None:
    exporter = configure_memory()
    try:
        assert otr_verifiers.record_traces(run, step=3) == 4
        otr.flush()
        got = episodes(exporter)
    finally:
        otr.shutdown()
    traces = by_name(run)
    assert set(got) == {t.id for t in traces.values()}
    plain = got[traces["plain"].id]["root"]
    assert plain[c.RL_STEP] == 3 and plain[c.RL_STATUS] == c.STATUS_OK
    assert plain[c.RL_FINISH_REASON] == c.FINISH_STOP
    # the task's @reward functions, weighted as verifiers weights them; the sum is Trace.reward
    assert plain[c.RL_REWARD_COMPONENT_PREFIX + "correct"] == 1.0
    assert plain[c.RL_REWARD_COMPONENT_PREFIX + "short"] == 0.5
    assert plain[c.RL_REWARD] == pytest.approx(traces["plain"].reward) == pytest.approx(1.5)
    assert plain[c.RL_METADATA_PREFIX + "metric.reply_chars"] == traces["plain"].metrics["reply_chars"]
    assert plain[c.RL_METADATA_PREFIX + "stop_condition"] == "agent_completed"
    assert plain[c.RL_DATASET_NAME] == "verifiers_env"
    assert plain[c.RL_DATASET_INDEX] == traces["plain"].task.data.idx == 0
    assert plain[c.RL_GROUP_ID] == traces["plain"].task.key
    timing = traces["plain"].timing
    assert plain[c.stage_seconds(c.STAGE_GENERATION)] == pytest.approx(timing.agent.model.duration)
    assert plain[c.stage_seconds(c.STAGE_REWARD)] == pytest.approx(timing.scoring.duration)
    assert plain[c.RL_DURATION_SECONDS] == pytest.approx(timing.scoring.end - timing.start)


def test_prompt_turns_tool_calls_and_usage(run: list[Any]) -> None:
    exporter = configure_memory()
    try:
        otr_verifiers.record_traces(run, step=1)
        otr.flush()
        got, conversations = episodes(exporter), messages_of(exporter)
    finally:
        otr.shutdown()
    tool = by_name(run)["tool"]
    ep = got[tool.id]
    generations = ep["by_kind"][c.KIND_GENERATION]
    assert len(generations) == 2 == tool.num_turns
    assert [g.attributes[c.GEN_AI_USAGE_INPUT_TOKENS] for g in generations] == \
        [call.usage.prompt_tokens for call in tool.calls]
    [tool_span] = ep["by_kind"][c.KIND_TOOL]
    assert tool_span.attributes[c.GEN_AI_TOOL_NAME] == "add"
    assert tool_span.attributes[c.GEN_AI_TOOL_CALL_RESULT] == "7"
    text = [str(m.get("content")) for m in conversations[tool.id]]
    assert text[0] == verifiers_env.PROMPTS["tool"] and text[-1] == "The sum is 7."


def test_truncation_and_errors(run: list[Any]) -> None:
    exporter = configure_memory()
    try:
        otr_verifiers.record_traces(run, step=1)
        otr.flush()
        got = episodes(exporter)
        conversations = messages_of(exporter)
    finally:
        otr.shutdown()
    traces = by_name(run)
    assert traces["long"].is_truncated  # verifiers' own verdict
    long_root = got[traces["long"].id]["root"]
    assert long_root[c.RL_STATUS] == c.STATUS_TRUNCATED and long_root[c.RL_FINISH_REASON] == c.FINISH_LENGTH
    failed = traces["fail"]
    assert not failed.ok and failed.errors  # the server's 500, through verifiers' error boundary
    fail_root = got[failed.id]["root"]
    assert fail_root[c.RL_STATUS] == c.STATUS_ERROR
    assert fail_root[c.RL_METADATA_PREFIX + "error"].startswith(failed.errors[-1].type + ": ")
    assert fail_root[c.RL_METADATA_PREFIX + "stop_condition"] == failed.stop_condition
    assert c.RL_REWARD not in fail_root  # scoring did not run: no reward made up
    # the model call failed before verifiers stored a message: the task's prompt shows which failed
    assert not failed.nodes
    assert [m["content"] for m in conversations[failed.id]] == [verifiers_env.PROMPTS["fail"]]


def test_verifiers_turn_limit_is_truncation() -> None:
    """verifiers' own ``max_turns`` limit stops the tool task after its first model call."""
    [episode] = run_env(lambda tasks: [tasks[1]], max_turns=1)
    [trace] = episode.traces
    assert trace.stop_condition == "max_turns" and trace.is_truncated  # verifiers' verdict
    exporter = configure_memory()
    try:
        otr_verifiers.record_traces(episode, step=2)
        otr.flush()
        root = episodes(exporter)[trace.id]["root"]
    finally:
        otr.shutdown()
    assert root[c.RL_STATUS] == c.STATUS_TRUNCATED
    assert root[c.RL_METADATA_PREFIX + "stop_condition"] == "max_turns"


def test_traced_env_records_each_episode_with_its_group() -> None:
    """The plug-in point: ``traced`` wraps the env instance's ``run_episode``; two rollouts
    of one task form one group (verifiers' task key); a consumer's ``GroupInfo`` wins."""
    exporter = configure_memory()
    steps = iter([7, 8])
    try:
        done = run_env(lambda tasks: [tasks[0], tasks[0]],
                       wrap=lambda env: otr_verifiers.traced(env, step=lambda: next(steps)))
        otr.flush()
        got = episodes(exporter)
    finally:
        otr.shutdown()
    ids = [ep.traces[0].id for ep in done]
    assert set(got) == set(ids) and len(set(ids)) == 2
    assert {got[i]["root"][c.RL_GROUP_ID] for i in ids} == {done[0].traces[0].task.key}
    assert sorted(got[i]["root"][c.RL_STEP] for i in ids) == [7, 8]

    exporter = configure_memory()
    try:
        done[0].group = vf.GroupInfo(id="group-a")
        otr_verifiers.record_traces(done[0], step=9)
        otr.flush()
        root = episodes(exporter)[ids[0]]["root"]
    finally:
        otr.shutdown()
    assert root[c.RL_GROUP_ID] == "group-a"


def test_bad_reward_is_flagged_not_raised(run: list[Any]) -> None:
    """A reward that is not a number is recorded as ``rl.invalid`` naming the field."""
    trace = by_name(run)["plain"].model_copy(deep=True)
    trace.rewards["correct"] = vf.Reward.model_construct(score="n/a", weight=1.0)
    exporter = configure_memory()
    try:
        assert otr_verifiers.record_traces([trace], step=1) == 1
        otr.flush()
        root = episodes(exporter)[trace.id]["root"]
    finally:
        otr.shutdown()
    assert "rewards.correct.score" in str(root[c.RL_INVALID_FIELDS])
    assert c.RL_REWARD not in root


def test_prime_rl_rollout_files_all_and_effective_cohorts(run: list[Any], tmp_path: Any) -> None:
    """prime-rl's rollout files, written as its ``FileMonitor.log_episodes`` writes them (one
    ``orjson`` line of ``Episode.to_record()`` per episode, under
    ``rollouts/step_N/<kind>/<all|effective>/traces.jsonl``) from verifiers' real episodes.
    prime-rl itself is not installed here (GPU stack); its ``effective`` predicate is applied
    as its ``EvalEpisodes.effective`` does (no error, trainable agent)."""
    orjson = pytest.importorskip("orjson")

    def write(cohort: str, episodes_: list[Any]) -> None:
        path = tmp_path / "rollouts" / "step_5" / "eval" / cohort / "traces.jsonl"
        path.parent.mkdir(parents=True, exist_ok=True)
        with path.open("ab") as f:
            for episode in episodes_:
                f.write(orjson.dumps(episode.to_record(), default=str,
                                     option=orjson.OPT_APPEND_NEWLINE | orjson.OPT_SERIALIZE_NUMPY))

    effective = [ep for ep in run if all(not t.has_error and t.agent.trainable for t in ep.traces)]
    write("all", run)
    write("effective", effective)
    exporter = configure_memory()
    try:
        assert otr_verifiers.record_prime_rl_rollouts(tmp_path, step=5, kind="eval") == 4
        otr.flush()
        got = episodes(exporter)
    finally:
        otr.shutdown()
    traces = by_name(run)
    assert set(got) == {t.id for t in traces.values()}  # each trace once, not once per cohort
    flag = c.RL_METADATA_PREFIX + "prime_rl.effective"
    assert {name: got[t.id]["root"][flag] for name, t in traces.items()} == \
        {"plain": True, "tool": True, "long": True, "fail": False}
    tool = got[traces["tool"].id]
    assert tool["root"][c.RL_SPLIT] == "eval" and tool["root"][c.RL_STEP] == 5
    assert tool["root"][c.RL_REWARD] == pytest.approx(traces["tool"].reward)
    [tool_span] = tool["by_kind"][c.KIND_TOOL]
    assert tool_span.attributes[c.GEN_AI_TOOL_CALL_RESULT] == "7"
    assert got[traces["fail"].id]["root"][c.RL_STATUS] == c.STATUS_ERROR


def test_the_documented_lines_run_as_written(run: list[Any], tmp_path: Path,
                                             monkeypatch: pytest.MonkeyPatch) -> None:
    """docs/adapters/verifiers.md's three blocks, run as written: the one line on the env
    verifiers built, the after-the-fact call inside the event loop (its top-level ``await``), and
    prime-rl's files read from a run directory written as prime-rl writes it."""
    plug, after, prime = [b for b in page_blocks("adapters/verifiers.md", "python") if b.marker == "run-by"]
    trainer = types.SimpleNamespace(step=4)

    def wrap(env: Any) -> Any:
        scope = {"env": env, "trainer": trainer}
        exec(compile(plug.code, str(plug), "exec"), scope)
        return scope["env"]

    async def documented(env: Any, tasks: list[Any], ctx: Any) -> list[Any]:
        scope = {"asyncio": asyncio, "env": env, "tasks": tasks, "ctx": ctx, "step": 5,
                 "otr_verifiers": otr_verifiers}
        code = compile(after.code, str(after), "exec", flags=ast.PyCF_ALLOW_TOP_LEVEL_AWAIT)
        pending = eval(code, scope)  # a coroutine: the block awaits
        if pending is not None:
            await pending
        return scope["episodes"]

    exporter = configure_memory()
    try:
        plugged = run_env(lambda tasks: tasks[:1], wrap=wrap)
        later = run_env(lambda tasks: tasks[1:2], gather=documented)
        otr.flush()
        got = episodes(exporter)
    finally:
        otr.shutdown()
    first, second = plugged[0].traces[0], later[0].traces[0]
    assert got[first.id]["root"][c.RL_STEP] == 4 and got[first.id]["root"][c.RL_SPLIT] == "train"
    assert got[second.id]["root"][c.RL_STEP] == 5 and got[second.id]["root"][c.RL_SPLIT] == "eval"
    assert set(got) == {first.id, second.id}

    orjson = pytest.importorskip("orjson")
    cohort = tmp_path / "outputs" / "run" / "rollouts" / "step_12" / "train" / "all" / "traces.jsonl"
    cohort.parent.mkdir(parents=True)
    cohort.write_bytes(b"".join(orjson.dumps(ep.to_record(), default=str) + b"\n" for ep in run))
    monkeypatch.chdir(tmp_path)
    exporter = configure_memory()
    try:
        exec(compile(prime.code, str(prime), "exec"), {"otr_verifiers": otr_verifiers})
        otr.flush()
        got = episodes(exporter)
    finally:
        otr.shutdown()
    assert set(got) == {ep.traces[0].id for ep in run}
    assert {root["root"][c.RL_STEP] for root in got.values()} == {12}
