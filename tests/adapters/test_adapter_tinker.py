"""Tinker cookbook adapter: trajectory groups shaped like the cookbook's own dataclasses.

The cookbook is not imported (it pulls the Tinker API client); the structures below copy its
field names and layout (``tinker_cookbook/rl/types.py`` with ``RolloutTrace`` from PR #748/#749,
``completers.TokensWithLogprobs``, ``tinker.ModelInput``), so the adapter is exercised on the
exact shapes it reads.
"""

from __future__ import annotations

import copy
from dataclasses import dataclass, field
from typing import Any

from adapter_fixtures import configure_memory, episodes, ids, messages_of, tokenizer
from otr_helpers import trackio_rows, tree

import otel_rollouts as otr
from otel_rollouts import conventions as c
from otel_rollouts.adapters.tinker import record_trajectory_groups


# --- the cookbook's structures (field names as in tinker_cookbook.rl.types) ---------------------
@dataclass
class ModelInput:
    tokens: list[int]

    @classmethod
    def from_ints(cls, tokens):
        return cls(list(tokens))

    def to_ints(self):
        return list(self.tokens)

    @property
    def length(self):
        return len(self.tokens)


@dataclass
class TokensWithLogprobs:
    tokens: list[int]
    maybe_logprobs: list[float] | None
    stop_reason: str = "stop"


@dataclass
class RolloutTrace:
    prompt: dict[str, object] | None = None
    policy_response: dict[str, object] | None = None
    reward_data: dict[str, object] | None = None
    env_state: dict[str, object] | None = None
    extra: dict[str, object] | None = None


@dataclass
class Transition:
    ob: ModelInput
    ac: TokensWithLogprobs
    reward: float
    episode_done: bool
    metrics: dict[str, float] = field(default_factory=dict)
    logs: dict[str, Any] = field(default_factory=dict)
    trace: RolloutTrace | None = None


@dataclass(frozen=True)
class Trajectory:
    transitions: list[Transition]
    final_ob: ModelInput


@dataclass
class RolloutError:
    error_type: str
    error_message: str


@dataclass
class TrajectoryGroup:
    trajectories_G: list[Trajectory]
    final_rewards_G: list[float]
    metrics_G: list[dict[str, float]]
    rollout_errors: list[RolloutError] = field(default_factory=list)


class EnvGroupBuilder:
    def __init__(self, tags):
        self._tags = tags

    def logging_tags(self):
        return self._tags


@dataclass
class WrappedTrajectoryGroup:
    trajectory_group: TrajectoryGroup
    env_group_builder: EnvGroupBuilder
    sampling_client_step: int
    metrics: dict[str, Any] = field(default_factory=dict)


def conv(messages):
    """``ConversationFormatter(messages).to_data()``."""
    return {"type": "conversation", "messages": messages}


def tokens(text, stop_reason="stop"):
    return TokensWithLogprobs(ids(text), [-0.1] * len(ids(text)), stop_reason)


PROMPT = [{"role": "system", "content": "let me think"}, {"role": "user", "content": "what is 2 + 2 ?"}]


def problem_trajectory(answer, correct):
    """``ProblemEnv``: one step; reward_data written with f-strings as in PR #749."""
    reward = (1.0 if correct else 0.0) + 0.1
    trace = RolloutTrace(
        prompt=conv(copy.deepcopy(PROMPT)),
        policy_response={"role": "assistant", "content": f"the answer is {answer}"},
        reward_data={"reference_answer": "4", "format_valid": True, "correct": correct,
                     "format_coef": 0.1, "reward": f"{reward:.3f}"},
    )
    tr = Transition(ModelInput.from_ints(ids("user : what is 2 + 2 ?")), tokens(f"the answer is {answer}"),
                    reward, True, {"format": 1.0, "correct": float(correct)}, trace=trace)
    return Trajectory([tr], ModelInput.from_ints([]))


def by_index(eps):
    return {eid.rsplit(":", 1)[1]: ep for eid, ep in eps.items()}


# --- tests --------------------------------------------------------------------------------------
def test_problem_env_groups_read_back_from_trackio(otr_shutdown):
    project = "adapter-tinker-problem"
    mem = configure_memory(trackio_project=project)
    group = TrajectoryGroup([problem_trajectory(4, True), problem_trajectory(5, False)],
                            [0.0, 0.0], [{"len": 1.0}, {"len": 1.0}])
    wrapped = WrappedTrajectoryGroup(group, EnvGroupBuilder(["gsm8k"]), sampling_client_step=4)
    recorded = record_trajectory_groups([wrapped], step=5, advantages=[[0.5, -0.5]])
    otr.flush()

    assert recorded == ["train:5:0:0", "train:5:0:1"]
    eps = by_index(episodes(mem))
    a = eps["0"]["root"]
    assert a[c.RL_STEP] == 5 and a[c.RL_SPLIT] == "train" and a[c.RL_GROUP_ID] == "train:5:0"
    assert a[c.RL_POLICY_VERSION] == 4 and a[c.RL_STALENESS] == 1 and a[c.RL_SAMPLE_INDEX] == 0
    assert a[c.RL_SYSTEM_NAME] == "tinker-cookbook" and a[c.RL_STATUS] == "ok"
    # the reward terms are ProblemEnv's metrics (format, correct); reward_data mixes them with
    # the total, a coefficient and the reference answer: none of those is an rl.reward.component.* term
    assert a[c.RL_REWARD] == 1.1
    assert a[c.RL_REWARD_COMPONENT_PREFIX + "correct"] == 1.0 and a[c.RL_REWARD_COMPONENT_PREFIX + "format"] == 1.0
    for key in ("reward", "format_coef", "format_valid", "reference_answer"):
        assert c.RL_REWARD_COMPONENT_PREFIX + key not in a
    assert a[c.RL_ADVANTAGE] == 0.5 and eps["1"]["root"][c.RL_ADVANTAGE] == -0.5
    assert eps["1"]["root"][c.RL_REWARD_COMPONENT_PREFIX + "correct"] == 0.0
    assert tree(eps["0"]["spans"]) == [(0, "episode"), (1, "prompt"), (1, "turn"), (2, "chat"),
                                       (1, "reward")]
    chat = eps["0"]["by_kind"]["generation"][0].attributes
    assert chat[c.GEN_AI_USAGE_INPUT_TOKENS] == 8 and chat[c.GEN_AI_USAGE_OUTPUT_TOKENS] == 4
    assert list(chat[c.GEN_AI_RESPONSE_FINISH_REASONS]) == ["stop"]

    rows = trackio_rows(project)
    assert len(rows) == 2 and {r["step"] for r in rows} == {5}
    row = next(r for r in rows if r["metadata"][c.RL_EPISODE_ID] == "train:5:0:0")
    assert [m["role"] for m in row["messages"]] == ["system", "user", "assistant"]
    assert row["messages"][1]["content"] == "what is 2 + 2 ?"
    assert row["messages"][2]["content"] == "the answer is 4"
    md = row["metadata"]
    assert md[c.RL_REWARD] == 1.1 and isinstance(md[c.RL_REWARD_COMPONENT_PREFIX + "correct"], float)
    assert md[c.RL_POLICY_VERSION] == 4 and md[c.RL_GROUP_ID] == "train:5:0" and md[c.RL_SPLIT] == "train"
    assert md[c.RL_METADATA_PREFIX + "reward_data"][0]["reward"] == "1.100"  # raw text kept
    assert md[c.RL_METADATA_PREFIX + "tags"] == ["gsm8k"]


def message_env_trajectory():
    """``EnvFromMessageEnv`` with a tool-using ``MessageEnv`` that keeps its history in place."""
    history = copy.deepcopy(PROMPT)
    call = {"id": "c1", "type": "function",
            "function": {"name": "calc", "arguments": '{"expr": "2 + 2"}'}}
    steps = []
    # step 0: the env snapshots the history before step() mutates it (the fix of PR #749)
    prompt0 = copy.deepcopy(history)
    assistant0 = {"role": "assistant", "content": "let me compute", "tool_calls": [call]}
    history += [assistant0, {"role": "tool", "tool_call_id": "c1", "content": "4"}]
    steps.append(Transition(ModelInput.from_ints(ids("user : what is 2 + 2 ?")), tokens("let me compute"),
                            0.0, False, {}, trace=RolloutTrace(
                                prompt=conv(prompt0), policy_response=assistant0,
                                extra={"next_messages": conv(copy.deepcopy(history))})))
    prompt1 = copy.deepcopy(history)
    assistant1 = {"role": "assistant", "content": "the answer is 4"}
    history += [assistant1, {"role": "user", "content": "ok"}]
    steps.append(Transition(ModelInput.from_ints(ids("user : what is 2 + 2 ?")), tokens("the answer is 4"),
                            1.0, True, {}, trace=RolloutTrace(
                                prompt=conv(prompt1), policy_response=assistant1,
                                env_state={"turn": 1, "game_over": True})))
    return Trajectory(steps, ModelInput.from_ints([])), history, steps


def test_message_env_turns_tool_calls_and_no_history_duplication(otr_shutdown):
    project = "adapter-tinker-message"
    mem = configure_memory(trackio_project=project)
    traj, history, steps = message_env_trajectory()
    record_trajectory_groups([TrajectoryGroup([traj], [0.0], [{}])], step=2, split="eval/math")
    # the environment keeps mutating its messages after the adapter ran: nothing changes
    history.append({"role": "user", "content": "MUTATED"})
    steps[0].trace.prompt["messages"][1]["content"] = "MUTATED"
    steps[1].trace.policy_response["content"] = "MUTATED"
    otr.flush()

    (ep,) = episodes(mem).values()
    assert tree(ep["spans"]) == [
        (0, "episode"), (1, "prompt"), (1, "turn"), (2, "chat"), (2, "execute_tool calc"),
        (1, "turn"), (2, "chat"), (1, "reward"),
    ]
    (tool,) = ep["by_kind"]["tool"]
    assert tool.attributes[c.GEN_AI_TOOL_CALL_ID] == "c1"
    assert tool.attributes[c.GEN_AI_TOOL_CALL_RESULT] == "4"
    assert ep["root"][c.RL_SPLIT] == "eval/math" and ep["root"][c.RL_REWARD] == 1.0

    (row,) = trackio_rows(project)
    msgs = row["messages"]
    # the growing per-step prompts are stored once: system, user, assistant+call, tool, assistant
    assert [m["role"] for m in msgs] == ["system", "user", "assistant", "tool", "assistant"]
    assert msgs[1]["content"] == "what is 2 + 2 ?" and msgs[4]["content"] == "the answer is 4"
    assert msgs[2]["tool_calls"][0]["function"]["name"] == "calc" and msgs[3]["tool_call_id"] == "c1"
    assert "MUTATED" not in str(msgs)
    assert row["metadata"][c.RL_METADATA_PREFIX + "steps"][1]["env_state"] == {"turn": 1, "game_over": True}


def test_env_that_logged_its_live_history_still_gets_the_initial_prompt(memory):
    """Regression (PR #749 review): a trace prompt aliasing the env's live list, mutated later."""
    live = copy.deepcopy(PROMPT)
    a0 = {"role": "assistant", "content": "let me think"}
    a1 = {"role": "assistant", "content": "the answer is 4"}
    t0 = Transition(ModelInput.from_ints([1]), tokens("let me think"), 0.0, False,
                    trace=RolloutTrace(prompt=conv(live), policy_response=a0))
    t1 = Transition(ModelInput.from_ints([1]), tokens("the answer is 4"), 1.0, True,
                    trace=RolloutTrace(prompt=conv(live), policy_response=a1))
    live += [a0, {"role": "user", "content": "try again"}, a1]  # mutated before logging
    record_trajectory_groups([TrajectoryGroup([Trajectory([t0, t1], ModelInput([]))], [0.0], [{}])],
                             step=0)
    otr.flush()
    (msgs,) = messages_of(memory).values()
    assert [(m["role"], m["content"]) for m in msgs] == [
        ("system", "let me think"), ("user", "what is 2 + 2 ?"),
        ("assistant", "let me think"), ("user", "try again"), ("assistant", "the answer is 4"),
    ]


def test_early_returns_still_give_episodes(memory):
    """Parse error (trace kept), ``length`` early return (no trace) and a failed rollout."""
    parse_error = Transition(
        ModelInput.from_ints(ids("what is 2 + 2 ?")), tokens("<tool_call> ( ( ("), -1.0, True,
        {"parse_error": 1.0},
        trace=RolloutTrace(prompt=conv(copy.deepcopy(PROMPT)),
                           policy_response={"role": "assistant", "content": "( ( (",
                                            "unparsed_tool_calls": [{"raw_text": "( ( (",
                                                                     "error": "bad json"}]}))
    length = Transition(ModelInput.from_ints(ids("user : what is 2 + 2 ?")),
                        tokens("let me think let me think", stop_reason="length"), 0.0, True,
                        {"max_tokens_reached": 1.0})  # no trace: the cookbook's [found] bug
    group = TrajectoryGroup(
        [Trajectory([parse_error], ModelInput([])), Trajectory([length], ModelInput([]))],
        [0.0, 0.0], [{}, {}],
        rollout_errors=[RolloutError("BadRequestError", "context overflow: 40000 > 32768")],
    )
    recorded = record_trajectory_groups([group, None], step=1, tokenizer=tokenizer())
    otr.flush()

    assert recorded == ["train:1:0:0", "train:1:0:1", "train:1:0:error0"]
    eps = by_index(episodes(memory))
    msgs = messages_of(memory)
    pe = eps["0"]["root"]
    assert pe[c.RL_STATUS] == "error" and pe[c.RL_FINISH_REASON] == "parse_error"
    assert list(pe[c.RL_TOOL_PARSE_ERROR]) == ["bad json"] and pe[c.RL_REWARD] == -1.0
    tr = eps["1"]["root"]
    assert tr[c.RL_STATUS] == "truncated" and tr[c.RL_FINISH_REASON] == "length"
    # no trace: prompt and action decoded from their tokens with the tokenizer (lazily)
    assert msgs["train:1:0:1"][0]["content"] == "user : what is 2 + 2 ?"
    assert msgs["train:1:0:1"][1]["content"] == "let me think let me think"
    err = eps["error0"]["root"]
    assert err[c.RL_STATUS] == "error" and err[c.RL_FINISH_REASON] == "BadRequestError"
    assert "context overflow" in err[c.RL_METADATA_PREFIX + "error_message"]
    assert msgs["train:1:0:error0"][1]["content"] == "what is 2 + 2 ?"  # the group's prompt
    assert otr.stats()["steps"]["1/train"]["adapters.filtered"] == 1  # the skipped group


def test_preference_env_responses_backfilled_per_trajectory(memory):
    """``PairwisePreferenceGroupBuilder`` sets the trace after the rollout, on transitions[0],
    sharing one ``convo_prefix`` list across the group."""
    prefix = copy.deepcopy(PROMPT)
    trajs = []
    for text in ("hello world", "hello again"):
        tr = Transition(ModelInput.from_ints([1, 2]), tokens(text), 0.0, True)
        trajs.append(Trajectory([tr], ModelInput([])))
    group = TrajectoryGroup(trajs, [1.0, -1.0], [{}, {}])
    for traj in group.trajectories_G:  # compute_group_rewards back-fills each trajectory's trace
        response = [{"role": "assistant", "content": tokenizer().decode(traj.transitions[0].ac.tokens)}]
        traj.transitions[0].trace = RolloutTrace(prompt=conv(prefix), policy_response=conv(response),
                                                 env_state={"valid_format": True})
    record_trajectory_groups([group], step=3)
    prefix[1]["content"] = "MUTATED"
    otr.flush()
    msgs = messages_of(memory)
    assert msgs["train:3:0:0"][-1]["content"] == "hello world"
    assert msgs["train:3:0:1"][-1]["content"] == "hello again"
    assert msgs["train:3:0:1"][1]["content"] == "what is 2 + 2 ?"
    eps = by_index(episodes(memory))
    assert eps["0"]["root"][c.RL_REWARD_COMPONENT_PREFIX + "final"] == 1.0 and eps["1"]["root"][c.RL_REWARD] == -1.0


def test_ragged_group_lists_and_placeholder_version(memory):
    """``final_rewards_G`` / advantages shorter than the trajectories: no IndexError, partial."""
    group = TrajectoryGroup([problem_trajectory(4, True) for _ in range(3)], [0.5, 0.5], [{}, {}, {}])
    wrapped = WrappedTrajectoryGroup(group, EnvGroupBuilder([]), sampling_client_step=-1)
    record_trajectory_groups([wrapped], step=0, advantages=[[0.1, 0.2]])
    otr.flush()
    eps = by_index(episodes(memory))
    assert len(eps) == 3
    assert c.RL_ALIGNMENT_KIND not in eps["0"]["root"] and eps["0"]["root"][c.RL_REWARD] == 1.6
    last = eps["2"]["root"]
    assert last[c.RL_ALIGNMENT_KIND] == "partial" and last[c.RL_REWARD] == 1.1  # no group reward
    missing = " ".join(last[c.RL_ALIGNMENT_MISSING])
    assert "final_rewards" in missing and "advantages" in missing and c.RL_ADVANTAGE not in last
    assert eps["1"]["root"][c.RL_ADVANTAGE] == 0.2
    assert all(c.RL_POLICY_VERSION not in ep["root"] for ep in eps.values())  # -1 placeholder
    assert otr.stats()["steps"]["0/train"]["adapters.alignment_partial"] == 1


def test_cap_holds_per_step_not_per_group_or_call(otr_shutdown):
    mem = configure_memory(cap=3, policy="first")
    for start in (0, 3):  # one step's groups arriving in two calls (async rollouts)
        groups = [TrajectoryGroup([problem_trajectory(4, True), problem_trajectory(5, False)],
                                  [0.0, 0.0], [{}, {}]) for _ in range(3)]
        record_trajectory_groups(groups, step=7, group_start=start)
    otr.end_step(7)
    otr.flush()
    eps = episodes(mem)
    assert len(eps) == 3
    assert otr.stats()["steps"]["7/train"]["seen"] == 12


def test_rollout_summary_records(memory):
    """The per-trajectory records of ``{iteration}/train_rollout_summaries.jsonl``."""
    records = [
        {"schema_version": 1, "split": "train", "iteration": 9, "group_idx": g, "traj_idx": t,
         "tags": ["math"], "sampling_client_step": 8, "total_reward": "0.750", "final_reward": 0.0,
         "trajectory_metrics": {}, "final_ob_len": 0,
         "steps": [{"step_idx": 0, "ob_len": 6, "ac_len": 4, "reward": 0.75, "episode_done": True,
                    "stop_reason": "stop", "metrics": {}, "logs": {},
                    "trace": {"prompt": conv(PROMPT),
                              "policy_response": {"role": "assistant", "content": f"answer {g}{t}"},
                              "reward_data": {"reward": "0.750"}}}]}
        for g in range(2) for t in range(2)
    ]
    recorded = record_trajectory_groups(records, step=9)
    otr.flush()
    assert recorded == ["train:9:0:0", "train:9:0:1", "train:9:1:0", "train:9:1:1"]
    eps = episodes(memory)
    a = eps["train:9:1:0"]["root"]
    assert a[c.RL_REWARD] == 0.75 and a[c.RL_POLICY_VERSION] == 8 and a[c.RL_GROUP_ID] == "train:9:1"
    chat = eps["train:9:1:0"]["by_kind"]["generation"][0].attributes
    assert chat[c.GEN_AI_USAGE_OUTPUT_TOKENS] == 4
    assert messages_of(memory)["train:9:1:0"][-1]["content"] == "answer 10"
