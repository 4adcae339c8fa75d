"""SkyRL adapter: inputs shaped like skyrl/train/generators/base.py's GeneratorInput/Output."""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any, Literal, TypedDict

import numpy as np
import pytest
from adapter_fixtures import configure_memory, count_prompts, episodes, ids, messages_of, tokenizer
from otr_helpers import trackio_rows

import otel_rollouts as otr
from otel_rollouts import conventions as c
from otel_rollouts.adapters import skyrl


# --- the framework's structures, field for field ------------------------------------------------
@dataclass
class TrajectoryID:
    instance_id: str
    repetition_id: int

    def to_string(self) -> str:
        return f"{self.instance_id}_{self.repetition_id}"


@dataclass
class BatchMetadata:
    global_step: int
    training_phase: Literal["train", "eval"]


class GeneratorInput(TypedDict, total=False):
    prompts: list[list[dict[str, str]]]
    env_classes: list[str]
    env_extras: list[dict[str, Any]] | None
    sampling_params: dict[str, Any] | None
    trajectory_ids: list[TrajectoryID] | None
    batch_metadata: BatchMetadata | None


class GeneratorOutput(TypedDict, total=False):
    prompt_token_ids: list[list[int]]
    response_ids: list[list[int]]
    rewards: list[float] | list[list[float]]
    loss_masks: list[list[int]]
    stop_reasons: list[str] | None
    rollout_metrics: dict[str, Any] | None
    rollout_logprobs: list[list[float]] | None
    trajectory_ids: list[TrajectoryID] | None
    is_last_step: list[bool] | None
    env_metrics: list[dict[str, Any]] | None


N = 2  # n_samples_per_prompt


def make(uids=("q0", "q1"), *, global_step=3, phase="train", with_ids=True):
    """prepare_generator_input-style blocked expansion of len(uids) prompts x N samples."""
    prompts, classes, extras, tids = [], [], [], []
    responses, masks, rewards, stops, metrics, prompt_ids = [], [], [], [], [], []
    for p, uid in enumerate(uids):
        for r in range(N):
            prompts.append([{"role": "system", "content": "be brief"},
                            {"role": "user", "content": f"what is {p + 2} + 3 ?"}])
            classes.append("gsm8k")
            extras.append({"answer": str(p + 5)})
            tids.append(TrajectoryID(uid, r))
            prompt_ids.append(ids(f"<|im_start|> user what is {p + 2} + 3 ? <|im_end|>"))
            if r == 0:  # two turns with an environment observation between them
                a, obs, b = ids("let me compute"), ids("<tool_response> 5 </tool_response>"), ids(f"{p + 5} <eos>")
                responses.append(a + obs + b)
                masks.append([1] * len(a) + [0] * len(obs) + [1] * len(b))
                rewards.append([0.0] * (len(a) + len(obs) + len(b) - 1) + [1.0])  # token-level
            else:
                resp = ids("the answer is 4 <eos>")
                responses.append(resp)
                masks.append([1] * len(resp))
                rewards.append(0.0)
            stops.append("stop")
            metrics.append({"format": 1.0, "turns": 2 if r == 0 else 1})
    gi = GeneratorInput(prompts=prompts, env_classes=classes, env_extras=extras, sampling_params=None,
                        trajectory_ids=tids if with_ids else None,
                        batch_metadata=BatchMetadata(global_step=global_step, training_phase=phase))
    go = GeneratorOutput(prompt_token_ids=prompt_ids, response_ids=responses, rewards=rewards,
                         loss_masks=masks, stop_reasons=stops, rollout_metrics={"x": 1},
                         rollout_logprobs=None, trajectory_ids=tids if with_ids else None,
                         is_last_step=None, env_metrics=metrics)
    return gi, go


def test_generation_round_trips_through_trackio(otr_shutdown):
    project = "otr-test-skyrl"
    exporter = configure_memory(trackio_project=project)
    gi, go = make()
    assert skyrl.record_generator_output(gi, go, step=3, tokenizer=tokenizer()) == 4
    egi, ego = make(("e0",), phase="eval")
    skyrl.record_generator_output(egi, ego, step=3, tokenizer=tokenizer())
    otr.end_step(3)
    assert otr.flush()
    eps = episodes(exporter)
    assert sorted(eps) == ["e0_0", "e0_1", "q0_0", "q0_1", "q1_0", "q1_1"]
    root = eps["q1_0"]["root"]
    assert root[c.RL_GROUP_ID] == "q1" and root[c.RL_SYSTEM_NAME] == "skyrl"
    # env_metrics are not rewards (the old adapter wrote rl.reward.component.format / rl.reward.component.turns)
    assert root[c.RL_REWARD] == 1.0 and "rl.reward.component.format" not in root and "rl.reward.component.turns" not in root
    assert root["rl.metadata.env_metrics.format"] == 1.0 and root[c.RL_TURN_COUNT] == 2
    assert root["rl.reward.component.turn_0"] == 0.0 and root["rl.reward.component.turn_1"] == 1.0  # token-level, per turn
    # global_step 3 = the step being worked on: 2 updates done (the old adapter said version 3)
    assert root[c.RL_POLICY_VERSION] == 2 and root[c.RL_STALENESS] == 0
    assert eps["e0_0"]["root"][c.RL_SPLIT] == "eval"

    rows = {r["metadata"]["rl.episode.id"]: r for r in trackio_rows(project)}
    row = rows["q1_0"]
    assert row["step"] == 3 and row["key"] == "rollouts"
    md = row["metadata"]
    assert md["rl.split"] == "train" and md["rl.group.id"] == "q1" and md["rl.policy.version"] == 2
    assert isinstance(md["rl.reward.score"], float) and "rl.reward.component.turns" not in md
    assert row["messages"] == [
        {"role": "system", "content": "be brief"},
        {"role": "user", "content": "what is 3 + 3 ?"},
        {"role": "assistant", "content": "let me compute"},
        # the tokenizer's special tokens (here the tool tags and <eos>) are not text a person reads
        {"role": "user", "name": "environment", "content": " 5 "},
        {"role": "assistant", "content": "6 "},
    ]
    assert rows["e0_1"]["key"] == "eval/rollouts"


def test_fully_async_groups_of_different_scheduling_steps_share_one_cap_per_training_step(otr_shutdown):
    exporter = configure_memory(cap=2, policy="first")
    # three groups scheduled at steps 4, 5, 6 are consumed by training step 7, one call per group
    for k, scheduled in enumerate((4, 5, 6)):
        gi, go = make((f"g{k}",), global_step=scheduled)
        skyrl.record_generator_output(gi, go, step=7, tokenizer=tokenizer())
    otr.end_step(7)
    assert otr.flush()
    eps = episodes(exporter)
    assert len(eps) == 2  # not 3 groups x 2
    counters = otr.stats()["steps"]["7/train"]
    assert counters["kept"] == 2 and counters["seen"] == 6
    for ep in eps.values():
        root = ep["root"]
        assert root[c.RL_STEP] == 7
        # scheduled at global_step g: g - 1 updates done; trained at step 7 (6 updates done)
        assert root[c.RL_STALENESS] == 7 - root["rl.metadata.scheduled_step"]
        assert root[c.RL_POLICY_VERSION] == root["rl.metadata.scheduled_step"] - 1
        assert root[c.RL_STALENESS] == 6 - root[c.RL_POLICY_VERSION]


def test_rows_map_to_prompts_by_trajectory_id_not_position(memory):
    gi, go = make()
    order = [3, 0, 2, 1]  # the generator returned rows in another order than the inputs
    for key in ("response_ids", "rewards", "loss_masks", "stop_reasons", "env_metrics", "prompt_token_ids"):
        go[key] = [go[key][i] for i in order]
    go["trajectory_ids"] = [gi["trajectory_ids"][i] for i in order]
    skyrl.record_generator_output(gi, go, step=1, tokenizer=tokenizer())
    assert otr.flush()
    msgs = messages_of(memory)
    assert msgs["q1_1"][1]["content"] == "what is 3 + 3 ?"
    assert msgs["q0_0"][1]["content"] == "what is 2 + 3 ?"
    assert episodes(memory)["q1_1"]["root"][c.RL_GROUP_ID] == "q1"


def test_without_ids_blocked_groups_only_when_complete(memory):
    gi, go = make(with_ids=False)
    skyrl.record_generator_output(gi, go, step=2, n_samples_per_prompt=N)
    gi2, go2 = make(with_ids=False)
    go2["stop_reasons"] = go2["stop_reasons"][:3]  # ragged: the layout is not known complete
    skyrl.record_generator_output(gi2, go2, step=3, n_samples_per_prompt=N)
    assert otr.flush()
    eps = episodes(memory)
    assert [eps[f"train-2-{i}"]["root"][c.RL_GROUP_ID] for i in range(4)] == ["0", "0", "1", "1"]
    assert all(c.RL_GROUP_ID not in eps[f"train-3-{i}"]["root"] for i in range(4))
    last = eps["train-3-3"]["root"]
    assert last[c.RL_ALIGNMENT_KIND] == "partial" and c.RL_FINISH_REASON not in last
    assert c.RL_ALIGNMENT_KIND not in eps["train-3-0"]["root"]
    assert otr.stats()["steps"]["3/train"]["adapters.alignment_partial"] == 1


def test_step_wise_rows_of_one_trajectory_become_one_episode(memory):
    gi, _ = make(("s0",))
    t0, t1 = TrajectoryID("s0", 0), TrajectoryID("s0", 1)
    turn = ids("let me compute")
    go = GeneratorOutput(prompt_token_ids=[[1], [1, 2], [1]], response_ids=[turn, ids("5 <eos>"), ids("4 <eos>")],
                         rewards=[0.0, "1.0", np.float32(0.0)], loss_masks=[[1] * 3, [1, 1], [1, 1]],
                         stop_reasons=["stop", "stop", "length"], trajectory_ids=[t0, t0, t1],
                         is_last_step=[False, True, True], env_metrics=[{}, {}, {}])
    assert skyrl.record_generator_output(gi, go, step=4, tokenizer=tokenizer()) == 2
    assert otr.flush()
    eps = episodes(memory)
    first = eps["s0_0"]
    assert len(first["by_kind"][c.KIND_TURN]) == 2
    assert first["root"][c.RL_REWARD] == 1.0 and first["root"]["rl.reward.component.turn_1"] == 1.0
    assert eps["s0_1"]["root"][c.RL_STATUS] == c.STATUS_TRUNCATED
    assert [m["content"] for m in messages_of(memory)["s0_0"][2:]] == ["let me compute", "5 "]  # EOS removed


def test_duplicate_trajectories_are_recorded_once(memory):
    gi, go = make(("d0",))
    for key in ("response_ids", "rewards", "loss_masks", "stop_reasons", "env_metrics", "trajectory_ids"):
        go[key] = go[key] + go[key][:1]
    assert skyrl.record_generator_output(gi, go, step=5) == 2
    assert otr.flush()
    assert sorted(episodes(memory)) == ["d0_0", "d0_1"]
    assert otr.stats()["steps"]["5/train"]["adapters.duplicates"] == 1


def test_prompts_are_snapshotted_and_string_rewards_are_numbers(memory):
    gi, go = make(("m0",))
    go["rewards"] = ["0.25", np.float64(0.5)]
    skyrl.record_generator_output(gi, go, step=6, tokenizer=tokenizer())
    gi["prompts"][0][1]["content"] = "MUTATED"
    gi["prompts"][0].append({"role": "user", "content": "MUTATED"})
    assert otr.flush()
    eps = episodes(memory)
    assert eps["m0_0"]["root"][c.RL_REWARD] == pytest.approx(0.25)
    assert type(eps["m0_1"]["root"][c.RL_REWARD]) is float
    assert "MUTATED" not in str(messages_of(memory)["m0_0"])


def test_structures_not_understood_are_warned_once_and_counted(memory, caplog):
    import logging

    @dataclass
    class OddId:  # neither to_string nor instance_id
        name: str

    gi, go = make(("w0",))
    go["env_metrics"] = [{"rlm_metadata_w0": {"depth": 2}, "steps": 1}, ["not", "a", "dict"]]
    gi["trajectory_ids"] = go["trajectory_ids"] = [OddId("a"), OddId("b")]
    with caplog.at_level(logging.WARNING, logger="otel_rollouts"):
        skyrl.record_generator_output(gi, go, step=8, tokenizer=tokenizer())
        skyrl.record_generator_output(gi, go, step=9, tokenizer=tokenizer())
    assert otr.flush()
    warned = [r.getMessage() for r in caplog.records if "adapters.skyrl" in r.getMessage()]
    assert sum("env_metrics.rlm_metadata_w0" in m for m in warned) == 1  # once, not per call
    assert any("env_metrics: expected a dict" in m for m in warned)
    assert any("trajectory_ids" in m for m in warned)
    assert otr.stats()["totals"]["adapters.unknown_structure"] >= 4
    roots = [ep["root"] for ep in episodes(memory).values()]
    rewards = {k for r in roots for k in r if k.startswith(c.RL_REWARD_COMPONENT_PREFIX)}
    assert rewards <= {"rl.reward.component.turn_0", "rl.reward.component.turn_1"}  # no env metric taken for a reward
    assert any(r.get(c.RL_TURN_COUNT) == 1 for r in roots)


def test_unparseable_tool_call_is_a_parse_error_not_a_lost_turn(memory):
    from tokenizer_fixture import build_tokenizer

    tok = build_tokenizer()
    text = 'Use the calculator tool <tool_call>\n{"name": "calculator", "arguments": {"expression": '
    resp = tok.encode(text, add_special_tokens=False)
    gi, _ = make(("t0",))
    go = GeneratorOutput(response_ids=[resp], rewards=[0.0], loss_masks=[[1] * len(resp)], stop_reasons=["length"],
                         trajectory_ids=[TrajectoryID("t0", 0)], env_metrics=[{}])
    skyrl.record_generator_output(gi, go, step=10, tokenizer=tok)
    assert otr.flush()
    ep = episodes(memory)["t0_0"]
    (turn,) = ep["by_kind"][c.KIND_TURN]
    assert "unclosed <tool_call>" in str(turn.attributes[c.RL_TOOL_PARSE_ERROR])
    assert ep["root"][c.RL_STATUS] == c.STATUS_TRUNCATED and ep["root"][c.RL_TURN_COUNT] == 1


@dataclass
class GeneratedOutputGroup:  # skyrl/train/fully_async_trainer.py (its module needs jaxtyping to import)
    generator_output: GeneratorOutput
    uid: str
    global_step_when_scheduled: int
    group_completion_time_s: float | None = None
    prompts: list[Any] | None = None


def test_fully_async_output_groups_carry_their_own_scheduling_step(memory):
    for k, scheduled in enumerate((3, 5)):
        gi, go = make((f"a{k}",), global_step=scheduled)
        go["trajectory_ids"] = None  # as SkyRLGymGenerator returns it outside step-wise mode
        group = GeneratedOutputGroup(go, f"a{k}", scheduled, 1.5, gi["prompts"])
        assert skyrl.record_output_group(group, step=5, tokenizer=tokenizer()) == 2
    assert otr.flush()
    eps = episodes(memory)
    assert sorted(eps) == ["a0_0", "a0_1", "a1_0", "a1_1"]
    old, fresh = eps["a0_1"]["root"], eps["a1_0"]["root"]
    assert old[c.RL_GROUP_ID] == "a0" and old[c.RL_POLICY_VERSION] == 2 and old[c.RL_STALENESS] == 2
    assert fresh[c.RL_POLICY_VERSION] == 4 and fresh[c.RL_STALENESS] == 0  # on-policy: 0
    assert messages_of(memory)["a1_1"][1]["content"] == "what is 2 + 3 ?"


def test_trajectories_take_the_columnar_path_turns_only_for_the_samples_the_sampler_may_keep(
        otr_shutdown, monkeypatch):
    prompts = count_prompts(monkeypatch)
    mem = configure_memory(cap=1, policy="first")
    gi, go = make(tuple(f"q{p}" for p in range(10)))
    n = skyrl.record_generator_output(gi, go, step=3, tokenizer=tokenizer())
    otr.end_step(3)
    assert otr.flush() and n == 10 * N
    assert len(episodes(mem)) == 1 and len(prompts) == 1  # one candidate: one prompt recorded
    assert otr.stats()["steps"]["3/train"]["dropped.sampled_out"] == 10 * N - 1


def test_time_splits_that_do_not_fit_the_rows_are_warned_not_guessed(memory, caplog):
    import logging

    gi, go = make(("t0",))  # 2 rows
    go["trajectory_time_splits"] = {"llm": [1.5, -1.0], "env": [0.25, 0.5, 0.75]}  # env: ragged
    with caplog.at_level(logging.WARNING, logger="otel_rollouts"):
        assert skyrl.record_generator_output(gi, go, step=1, tokenizer=tokenizer()) == 2
    assert otr.flush()
    eps = episodes(memory)
    generation, environment = c.stage_seconds(c.STAGE_GENERATION), c.stage_seconds(c.STAGE_ENVIRONMENT)
    assert eps["t0_0"]["root"][generation] == 1.5
    assert generation not in eps["t0_1"]["root"]  # a negative duration is not a time
    assert not any(environment in ep["root"] for ep in eps.values())  # 3 values for 2 rows
    warned = " ".join(r.getMessage() for r in caplog.records)
    assert "trajectory_time_splits.env: 3 values for 2 rows" in warned
    assert "trajectory_time_splits.llm: not a duration" in warned
