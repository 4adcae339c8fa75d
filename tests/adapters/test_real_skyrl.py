"""SkyRL adapter against SkyRL's own code path (skyrl 0.3.0 + skyrl-gym 0.4.0).

The data is made by ``SkyRLGymGenerator.generate`` (agent loop, chat-template token-in-token-out
bookkeeping, loss masks, per-token rewards, env metrics) stepping real skyrl-gym environments
(``gsm8k_multi_turn``; a tool environment registered through ``skyrl_gym.register``), from a
``GeneratorInput`` built by SkyRL's ``prepare_generator_input``. The only stand-in is the
inference engine (no GPU / vLLM here): ``ScriptedEngine`` answers ``generate`` with fixed texts
and their token ids, which is all the generator asks of an ``InferenceEngineInterface``.
"""

from __future__ import annotations

import asyncio
from typing import Any

import pytest
from adapter_fixtures import episodes, messages_of
from frameworks import require
from tokenizer_fixture import build_tokenizer

import otel_rollouts as otr
from otel_rollouts import conventions as c
from otel_rollouts.adapters import skyrl

gym_generator = require("skyrl.train.generators.skyrl_gym_generator")
generator_utils = require("skyrl.train.generators.utils")
skyrl_config = require("skyrl.train.config")
skyrl_gym = require("skyrl_gym")
base_text_env = require("skyrl_gym.envs.base_text_env")

TOKENIZER = build_tokenizer()
QUESTION = [{"role": "system", "content": "Think step by step."}, {"role": "user", "content": "What is 2 + 2?"}]


class ScriptedEngine:
    """The inference engine client: fixed answers per trajectory (``session_id`` = ``uid_rep``)."""

    def __init__(self, script: dict[str, list[str]], truncated: tuple[str, ...] = ()) -> None:
        self.script = script
        self.truncated = truncated  # sessions whose last answer hits max_tokens
        self.calls: dict[str, int] = {}

    async def generate(self, engine_input: dict[str, Any], model: str | None = None) -> dict[str, Any]:
        session = engine_input["session_ids"][0]
        k = self.calls.get(session, 0)
        self.calls[session] = k + 1
        cut = session in self.truncated and k == len(self.script[session]) - 1
        text = self.script[session][k] + ("" if cut else TOKENIZER.eos_token)  # vLLM keeps the EOS
        ids = TOKENIZER.encode(text, add_special_tokens=False)
        stop = "length" if cut else "stop"
        return {"responses": [text], "response_ids": [ids], "stop_reasons": [stop], "response_logprobs": None}

    async def finish_session(self, session_id: str) -> None:
        return None


class CalculatorEnv(base_text_env.BaseTextEnv):
    """A tool environment: answers each Hermes ``<tool_call>`` with a ``tool`` message."""

    def __init__(self, env_config: Any = None, extras: dict[str, Any] | None = None) -> None:
        super().__init__()
        self.max_turns = int((extras or {}).get("max_turns", 3))

    def step(self, action: str):
        self.turns += 1
        done = "<tool_call>" not in action or self.turns >= self.max_turns
        observations = [] if done else [{"role": "tool", "content": "4"}]
        return base_text_env.BaseTextEnvStepOutput(observations=observations, reward=1.0 if done else 0.0,
                                                   done=done, metadata={})

    def get_metrics(self) -> dict[str, Any]:
        return {"steps": self.turns, "tool": "calculator"}


if "otr_calculator" not in skyrl_gym.registry:
    skyrl_gym.register(id="otr_calculator", entry_point=CalculatorEnv)


def generate(script: dict[str, list[str]], *, env_class: str = "gsm8k_multi_turn", n: int = 2,
             phase: str = "train", global_step: int = 1, step_wise: bool = False, uid: str = "q0",
             truncated: tuple[str, ...] = (), overlong_filtering: bool = False, wrap=None,
             extra_info: dict[str, Any] | None = None):
    """SkyRL's own path: prepare_generator_input -> SkyRLGymGenerator.generate (``wrap``: what
    a ``get_generator`` override returns around SkyRL's generator)."""
    cfg = skyrl_config.GeneratorConfig(max_turns=3, max_input_length=4096, n_samples_per_prompt=n,
                                       step_wise_trajectories=step_wise,
                                       apply_overlong_filtering=overlong_filtering)
    cfg.sampling_params.logprobs = None
    generator = gym_generator.SkyRLGymGenerator(cfg, skyrl_config.SkyRLGymConfig(max_env_workers=0),
                                                ScriptedEngine(script, truncated), TOKENIZER)
    if wrap is not None:
        generator = wrap(generator)
    prompts = [{"prompt": QUESTION, "env_class": env_class, "uid": uid,
                "env_extras": {"reward_spec": {"ground_truth": "4"}, "extra_info": extra_info or {}}}]
    generator_input, _ = generator_utils.prepare_generator_input(prompts, n, None, env_class, phase, global_step)
    generator_output = asyncio.run(generator.generate(generator_input, disable_tqdm=True))
    return generator_input, generator_output


GSM8K = {"q0_0": ["I think 2 + 2 = 5. #### 5", "#### 4"], "q0_1": ["The answer is #### 4"]}


@pytest.mark.matrix
def test_gsm8k_env_metrics_are_not_rewards_and_steps_is_the_turn_count(memory):
    gi, go = generate(GSM8K)
    assert go["env_metrics"] == [{"steps": 2}, {"steps": 1}]  # what skyrl-gym really reports
    assert skyrl.record_generator_output(gi, go, step=1, tokenizer=TOKENIZER, model="tiny-policy") == 2
    assert otr.flush()
    eps = episodes(memory)
    root = eps["q0_0"]["root"]
    # the run as SkyRL's batch describes it, on the resource: the environment every sample ran in
    (resource,) = {s.resource for s in memory.get_finished_spans()}
    assert {k: resource.attributes.get(k) for k in (c.RL_SYSTEM_NAME, c.RL_MODEL_NAME, c.RL_ENVIRONMENT_NAME)} == {
        c.RL_SYSTEM_NAME: "skyrl", c.RL_MODEL_NAME: "tiny-policy", c.RL_ENVIRONMENT_NAME: "gsm8k_multi_turn"}
    # regression: the old adapter recorded env_metrics as reward components (rl.reward.component.steps)
    assert not any(k.startswith(c.RL_REWARD_COMPONENT_PREFIX + "steps") for k in root)
    assert root[c.RL_TURN_COUNT] == 2 and eps["q0_1"]["root"][c.RL_TURN_COUNT] == 1
    # per-token rewards: format score 0.2 / max_turns on turn 0, 1.0 (correct) on turn 1
    assert root[c.RL_REWARD] == pytest.approx(0.2 / 3 + 1.0)
    assert root[c.RL_REWARD_COMPONENT_PREFIX + "turn_0"] == pytest.approx(0.2 / 3)
    assert root[c.RL_REWARD_COMPONENT_PREFIX + "turn_1"] == 1.0
    assert {k for k in root if k.startswith(c.RL_REWARD_COMPONENT_PREFIX)} == {"rl.reward.component.turn_0", "rl.reward.component.turn_1"}
    assert root[c.RL_GROUP_ID] == "q0" and root[c.RL_DATASET_NAME] == "gsm8k_multi_turn"
    assert len(eps["q0_0"]["by_kind"][c.KIND_TURN]) == 2


def _texts(ep: dict[str, Any]) -> str:
    return repr([dict(s.attributes) for s in ep["spans"]])


@pytest.mark.matrix
def test_gsm8k_text_has_no_template_markup_and_observations_keep_their_role(memory):
    gi, go = generate(GSM8K)
    response = TOKENIZER.decode(go["response_ids"][0])
    assert "<|im_start|>user\n" in response and response.endswith("<|im_end|>")  # the real layout
    skyrl.record_generator_output(gi, go, step=1, tokenizer=TOKENIZER)
    assert otr.flush()
    observation = ("Please provide your step-by-step reasoning, and also include a tentative numeric "
                   "answer at the end in the exact format: '#### ANSWER'.")
    msgs = messages_of(memory)
    assert msgs["q0_0"] == [
        {"role": "system", "content": "Think step by step."},
        {"role": "user", "content": "What is 2 + 2?"},
        {"role": "assistant", "content": "I think 2 + 2 = 5. #### 5"},
        {"role": "user", "content": observation},
        {"role": "assistant", "content": "#### 4"},
    ]
    assert msgs["q0_1"][2:] == [{"role": "assistant", "content": "The answer is #### 4"}]
    eps = episodes(memory)
    for ep in eps.values():  # no markup or EOS left in any span, whatever the role
        assert "<|im_start|>" not in _texts(ep) and "<|im_end|>" not in _texts(ep)
    (feedback,) = [s for s in eps["q0_0"]["spans"] if s.name == c.SPAN_FEEDBACK]
    assert feedback.attributes[c.RL_FEEDBACK_ROLE] == "user"  # regression: was "environment"


@pytest.mark.matrix
def test_on_policy_is_staleness_zero_off_policy_and_eval(memory):
    # synchronous trainer: prepare_generator_input(..., "train", global_step) then training at
    # the same global_step; global_step 1 is the first step (the initial weights, 0 updates)
    gi, go = generate(GSM8K, global_step=1)
    skyrl.record_generator_output(gi, go, step=1, tokenizer=TOKENIZER)
    # fully async: scheduled at global_step 2 (1 update done), trained at step 4
    gi2, go2 = generate({"q1_0": ["#### 4"], "q1_1": ["#### 4"]}, global_step=2, uid="q1")
    skyrl.record_generator_output(gi2, go2, step=4, tokenizer=TOKENIZER)
    # eval after step 5: SkyRL's eval() runs with global_step = 5 finished steps
    gi3, go3 = generate({"e0_0": ["#### 4"]}, n=1, phase="eval", global_step=5, uid="e0")
    skyrl.record_generator_output(gi3, go3, step=5, tokenizer=TOKENIZER)
    assert otr.flush()
    roots = [ep["root"] for ep in episodes(memory).values()]
    on = [r for r in roots if r[c.RL_STEP] == 1]
    off = [r for r in roots if r[c.RL_STEP] == 4]
    ev = [r for r in roots if r[c.RL_SPLIT] == "eval"]
    assert len(on) == 2 and len(off) == 2 and len(ev) == 1
    assert all(r[c.RL_POLICY_VERSION] == 0 and r[c.RL_STALENESS] == 0 for r in on)  # old: version 1
    assert all(r[c.RL_POLICY_VERSION] == 1 and r[c.RL_STALENESS] == 2 for r in off)
    assert ev[0][c.RL_POLICY_VERSION] == 5 and c.RL_STALENESS not in ev[0]


@pytest.mark.matrix
def test_step_wise_trajectories_are_one_episode_with_clean_turns(memory):
    gi, go = generate(GSM8K, step_wise=True)
    assert go["is_last_step"] == [False, True, True]
    assert skyrl.record_generator_output(gi, go, step=1, tokenizer=TOKENIZER) == 2
    assert otr.flush()
    eps = episodes(memory)
    root = eps["q0_0"]["root"]
    assert root[c.RL_TURN_COUNT] == 2 and root[c.RL_REWARD] == pytest.approx(0.2 / 3 + 1.0)
    assert "rl.reward.component.steps" not in root
    assert [m["role"] for m in messages_of(memory)["q0_0"]] == ["system", "user", "assistant", "user", "assistant"]
    assert "<|im_" not in _texts(eps["q0_0"])


@pytest.mark.matrix
def test_hermes_tool_calls_become_execute_tool_spans_with_their_results(memory):
    call = '<tool_call>\n{"name": "calculator", "arguments": {"expression": "2 + 2"}}\n</tool_call>'
    gi, go = generate({"q0_0": [f"Let me compute. {call}", "The answer is 4"]}, env_class="otr_calculator", n=1)
    skyrl.record_generator_output(gi, go, step=1, tokenizer=TOKENIZER)
    assert otr.flush()
    ep = episodes(memory)["q0_0"]
    (tool,) = ep["by_kind"][c.KIND_TOOL]
    assert tool.attributes[c.GEN_AI_TOOL_NAME] == "calculator"
    assert tool.attributes[c.GEN_AI_TOOL_CALL_RESULT] == "4"
    assert ep["root"]["rl.metadata.env_metrics.tool"] == "calculator" and ep["root"][c.RL_TURN_COUNT] == 2
    assistant = messages_of(memory)["q0_0"][2]
    assert assistant["content"] == "Let me compute." and assistant["tool_calls"][0]["function"]["name"] == "calculator"
    assert "<|im_" not in _texts(ep) and "<tool_call>" not in _texts(ep)


@pytest.mark.matrix
def test_truncated_trajectory_and_overlong_filtering(memory):
    # max_turns=3: the third answer is cut at max_tokens (the last turn's stop reason counts)
    script = {"q0_0": ["I think 2 + 2 = 5. #### 5", "#### 5", "Let me think again about"], "q0_1": ["#### 4"]}
    gi, go = generate(script, truncated=("q0_0",), overlong_filtering=True)
    assert go["stop_reasons"][0] == "length" and not any(go["loss_masks"][0])  # SkyRL zeroed the mask
    skyrl.record_generator_output(gi, go, step=1, tokenizer=TOKENIZER)
    assert otr.flush()
    eps = episodes(memory)
    root = eps["q0_0"]["root"]
    assert root[c.RL_STATUS] == c.STATUS_TRUNCATED and root["rl.metadata.loss_masked"] is True
    # the model's text is not passed off as an environment message: one generation
    assert [m["role"] for m in messages_of(memory)["q0_0"]] == ["system", "user", "assistant"]
    assert "rl.metadata.loss_masked" not in eps["q0_1"]["root"]


@pytest.mark.matrix
def test_assistant_text_of_dropped_episodes_is_never_decoded(otr_shutdown):
    from adapter_fixtures import configure_memory
    from tokenizer_fixture import DecodeLog, counting_tokenizer

    exporter = configure_memory(cap=1, policy="first")
    log = DecodeLog()
    counting = counting_tokenizer(log)  # same vocabulary as TOKENIZER, logs every decode
    gi, go = generate({"q0_0": ["The answer is #### 4"], "q0_1": ["Easy: the answer is #### 4"]})
    skyrl.record_generator_output(gi, go, step=1, tokenizer=counting)
    otr.end_step(1)
    assert otr.flush()
    assert sorted(episodes(exporter)) == ["q0_0"]
    kept, dropped = (tuple(go["response_ids"][i][:-1]) for i in (0, 1))  # without the EOS run
    decoded = {s for s in log.sequences if len(s) > 4}
    assert any(s[: len(kept)] == kept for s in decoded)
    assert not any(s[: len(dropped)] == dropped for s in decoded)


# --- the plug-in: SkyRL's generator hook ------------------------------------------------------
@pytest.mark.matrix
def test_recording_generator_records_what_skyrls_generator_returns(memory):
    # only the documented line is added: get_generator returns the wrapper around SkyRL's own
    gi, go = generate(GSM8K, global_step=3, wrap=lambda g: skyrl.RecordingGenerator(g, tokenizer=TOKENIZER))
    assert go["env_metrics"] == [{"steps": 2}, {"steps": 1}]  # SkyRL's output, returned unchanged
    assert otr.flush()
    eps = episodes(memory)
    assert sorted(eps) == ["q0_0", "q0_1"]
    root = eps["q0_0"]["root"]
    assert root[c.RL_STEP] == 3 and root[c.RL_POLICY_VERSION] == 2 and root[c.RL_STALENESS] == 0
    assert root[c.RL_REWARD] == pytest.approx(0.2 / 3 + 1.0) and root[c.RL_TURN_COUNT] == 2
    assert messages_of(memory)["q0_0"][2] == {"role": "assistant", "content": "I think 2 + 2 = 5. #### 5"}


@pytest.mark.matrix
def test_recording_generator_in_the_fully_async_trainer_has_no_staleness(memory):
    import inspect

    wrapped = skyrl.RecordingGenerator(None, tokenizer=TOKENIZER, fully_async=True)
    # SkyRL's FullyAsyncRayPPOTrainer passes disable_tqdm only when the signature names it
    assert "disable_tqdm" in inspect.signature(wrapped.generate).parameters
    generate(GSM8K, global_step=2, wrap=lambda g: skyrl.RecordingGenerator(g, tokenizer=TOKENIZER, fully_async=True))
    assert otr.flush()
    roots = [ep["root"] for ep in episodes(memory).values()]
    assert len(roots) == 2 and all(r[c.RL_POLICY_VERSION] == 1 for r in roots)
    assert all(c.RL_STALENESS not in r for r in roots)  # unknown at generation, not a wrong 0


# --- releases ------------------------------------------------------------------------------
SKYRL_VERSION = tuple(int(p) for p in __import__("importlib.metadata").metadata.version("skyrl").split(".")[:2])
needs_040 = pytest.mark.skipif(SKYRL_VERSION < (0, 4), reason="trajectory_time_splits is SkyRL >= 0.4.0's")


@pytest.mark.matrix
@needs_040
def test_trajectory_time_splits_are_the_episodes_stage_times(memory):
    gi, go = generate(GSM8K)
    splits = go["trajectory_time_splits"]
    assert set(splits) == {"llm", "env"} and len(splits["llm"]) == 2  # SkyRL 0.4.0's own measurement
    assert skyrl.record_generator_output(gi, go, step=1, tokenizer=TOKENIZER) == 2
    assert otr.flush()
    eps = episodes(memory)
    for i, tid in enumerate(["q0_0", "q0_1"]):
        root = eps[tid]["root"]
        assert root[c.stage_seconds(c.STAGE_GENERATION)] == splits["llm"][i]
        assert root[c.stage_seconds(c.STAGE_ENVIRONMENT)] == splits["env"][i]
        assert {k for k in root if k.startswith(c.RL_STAGE_PREFIX)} == {
            c.stage_seconds(c.STAGE_GENERATION), c.stage_seconds(c.STAGE_ENVIRONMENT)}


@pytest.mark.matrix
@needs_040
def test_step_wise_time_splits_before_and_after_the_trainers_concatenation(memory):
    gi, go = generate(GSM8K, step_wise=True)
    assert go["is_last_step"] == [False, True, True]
    env = go["trajectory_time_splits"]["env"]
    assert len(env) == 3 and env[0] == env[1]  # per row: q0_0's two rows repeat its times
    gi2, go2 = generate({"q1_0": ["x", "#### 4"], "q1_1": ["#### 4"]}, step_wise=True, uid="q1")
    # what the trainers do with several generations (fully async: one per group)
    merged = generator_utils.concatenate_generator_outputs([go, go2], step_wise=True)
    merged_input = {**gi, "prompts": gi["prompts"] + gi2["prompts"],
                    "trajectory_ids": gi["trajectory_ids"] + gi2["trajectory_ids"],
                    "env_extras": gi["env_extras"] + gi2["env_extras"],
                    "env_classes": gi["env_classes"] + gi2["env_classes"]}
    assert skyrl.record_generator_output(merged_input, merged, step=1, tokenizer=TOKENIZER) == 4
    assert otr.flush()
    eps = episodes(memory)
    stage = c.stage_seconds(c.STAGE_ENVIRONMENT)
    expected = dict(zip(["q0_0", "q0_0", "q0_1", "q1_0", "q1_0", "q1_1"], merged["trajectory_time_splits"]["env"],
                        strict=True))
    assert {tid: ep["root"][stage] for tid, ep in eps.items()} == expected
    assert eps["q0_0"]["root"][c.RL_TURN_COUNT] == 2


@pytest.mark.matrix
@pytest.mark.skipif(SKYRL_VERSION >= (0, 4), reason="SkyRL 0.3.0 measures no time splits")
def test_no_stage_time_where_skyrl_does_not_measure_it(memory):
    gi, go = generate(GSM8K)
    assert "trajectory_time_splits" not in go
    skyrl.record_generator_output(gi, go, step=1, tokenizer=TOKENIZER)
    assert otr.flush()
    for ep in episodes(memory).values():
        assert not any(k.startswith(c.RL_STAGE_PREFIX) for k in ep["root"])  # absent, never 0


def test_a_newer_release_and_an_unknown_output_field_are_warned_once(memory, caplog, monkeypatch):
    gi, go = generate(GSM8K)
    go["trajectory_energy"] = [1.0, 2.0]  # a field a newer SkyRL might add
    go["trajectory_time_splits"] = {"llm": [0.5, 0.25], "queue": [0.1, 0.1]}
    monkeypatch.setattr(skyrl, "TESTED", ("0.1.0",))  # the installed release is newer
    with caplog.at_level("WARNING", logger="otel_rollouts"):
        assert skyrl.record_generator_output(gi, go, step=1, tokenizer=TOKENIZER) == 2
        assert skyrl.record_generator_output(gi, go, step=2, tokenizer=TOKENIZER) == 2
    assert otr.flush()
    warnings = [r.getMessage() for r in caplog.records]
    assert sum("newer than the releases" in w for w in warnings) == 1
    assert sum("GeneratorOutput.trajectory_energy" in w for w in warnings) == 1
    assert sum("trajectory_time_splits.queue" in w for w in warnings) == 1
    roots = {tid: ep["root"] for tid, ep in episodes(memory).items()}
    assert sorted(roots) == ["q0_0", "q0_1"]  # recorded all the same, as far as understood
    assert roots["q0_0"][c.stage_seconds(c.STAGE_GENERATION)] == 0.5
    assert not any(k.startswith(c.RL_STAGE_PREFIX + "queue") for k in roots["q0_0"])


# --- durations and dataset indices (issue 32) -----------------------------------------------------
@pytest.mark.matrix
def test_the_agent_loops_e2e_time_is_the_episodes_duration(memory):
    gi, go = generate(GSM8K)
    times = go["trajectory_generation_times"]  # SkyRL's own e2e_time around each agent loop
    assert len(times) == 2 and all(isinstance(t, float) and t > 0 for t in times)
    skyrl.record_generator_output(gi, go, step=1, tokenizer=TOKENIZER)
    assert otr.flush()
    eps = episodes(memory)
    assert [eps[tid]["root"][c.RL_DURATION_SECONDS] for tid in ("q0_0", "q0_1")] == times


@pytest.mark.matrix
def test_step_wise_rows_take_their_trajectorys_duration(memory):
    gi, go = generate(GSM8K, step_wise=True)
    times = go["trajectory_generation_times"]
    assert len(times) == 3 and times[0] == times[1]  # q0_0's two rows repeat its e2e_time
    skyrl.record_generator_output(gi, go, step=1, tokenizer=TOKENIZER)
    assert otr.flush()
    eps = episodes(memory)
    assert eps["q0_0"]["root"][c.RL_DURATION_SECONDS] == times[1]
    assert eps["q0_1"]["root"][c.RL_DURATION_SECONDS] == times[2]


@pytest.mark.matrix
def test_no_duration_where_the_agent_loop_did_not_time_it(memory):
    gi, go = generate(GSM8K)
    go["trajectory_generation_times"] = None  # what SkyRL returns when an agent loop leaves e2e_time None
    skyrl.record_generator_output(gi, go, step=1, tokenizer=TOKENIZER)
    assert otr.flush()
    roots = [ep["root"] for ep in episodes(memory).values()]
    assert len(roots) == 2 and all(c.RL_DURATION_SECONDS not in r for r in roots)  # absent, never 0


@pytest.mark.matrix
def test_the_dataset_index_is_skyrls_uid_or_the_extra_info_index(memory):
    # PromptDataset.__getitem__ makes the uid str(row): the row's dataset index
    gi, go = generate({"17_0": ["#### 4"], "17_1": ["#### 4"]}, uid="17")
    skyrl.record_generator_output(gi, go, step=1, tokenizer=TOKENIZER)
    # a preprocessed dataset's extra_info.index (verl's column layout) wins over the uid
    gi, go = generate({"q1_0": ["#### 4"], "q1_1": ["#### 4"]}, uid="q1", extra_info={"index": 42})
    skyrl.record_generator_output(gi, go, step=1, tokenizer=TOKENIZER)
    gi, go = generate({"q2_0": ["#### 4"], "q2_1": ["#### 4"]}, uid="q2")  # neither: none claimed
    skyrl.record_generator_output(gi, go, step=1, tokenizer=TOKENIZER)
    assert otr.flush()
    index = {tid: ep["root"].get(c.RL_DATASET_INDEX) for tid, ep in episodes(memory).items()}
    assert index == {"17_0": 17, "17_1": 17, "q1_0": 42, "q1_1": 42, "q2_0": None, "q2_1": None}
