"""verl adapter against verl's own code paths (verl 0.9.1, CPU only).

One training step is built the way ``RayPPOTrainer.fit`` builds it: ``RLHFDataset`` over a parquet
file written here + ``collate_fn``; ``DataProto.from_single_dict``; ``uid`` per prompt;
``_get_gen_batch``; ``repeat(n, interleave=True)``; verl's ``AgentLoopWorker.generate_sequences``
running the real ``ToolAgentLoop`` (Hermes tool parser, a real verl ``FunctionTool``, verl's
Continuous Token builder, ``_agent_loop_postprocess`` / ``_postprocess``); ``batch.union``;
``RayPPOTrainer._balance_batch`` (dp size 2); verl's ``NaiveRewardManager`` with a small
``compute_score``, ``extract_reward`` and ``compute_advantage`` (GRPO).

Stand-ins, because they need a GPU / vLLM / a Ray cluster: the LLM server is ``ScriptedServer``
(returns verl ``TokenOutput`` objects with the ``extra_fields`` verl's vLLM server and
``LLMServerClient.generate`` add: ``global_steps``, ``min/max_global_steps``,
``num_cached_tokens``); the ``AgentLoopWorker`` is built without its ``__init__`` (which loads a
model config from a hub path); the reward columns are put where verl's reward loop puts them
(``rm_scores``, the ``reward_extra_info`` columns, ``meta_info["reward_extra_keys"]``).
"""

from __future__ import annotations

import asyncio
import logging
import os
import uuid
from types import SimpleNamespace

import numpy as np
import pytest
from adapter_fixtures import episodes
from frameworks import require
from tokenizer_fixture import build_tokenizer

import otel_rollouts as otr
from otel_rollouts import conventions as c
from otel_rollouts.adapters import verl as verl_adapter

N = 4
QUESTIONS = [("What is 17 * 23?", "391"), ("What is 2 + 2?", "4")]
# plain ChatML with Hermes tool calls: a tool message is rendered as <|im_start|>tool\n...
CHATML_TOOL_ROLE = (
    "{%- if tools -%}{{ '<|im_start|>system\\nYou may call these tools:\\n' }}"
    "{%- for t in tools -%}{{ t | tojson }}{{ '\\n' }}{%- endfor -%}{{ '<|im_end|>\\n' }}{%- endif -%}"
    "{%- for m in messages -%}"
    "{{ '<|im_start|>' + m.role + '\\n' }}"
    "{%- if m.content is string -%}{{ m.content }}{%- else -%}"
    "{%- for p in m.content -%}{%- if p.type == 'text' -%}{{ p.text }}{%- endif -%}{%- endfor -%}{%- endif -%}"
    "{%- if m.tool_calls is defined and m.tool_calls -%}{%- for call in m.tool_calls -%}"
    "{{ '<tool_call>\\n{\"name\": \"' + call.function.name + '\", \"arguments\": ' }}"
    "{{- call.function.arguments if call.function.arguments is string else call.function.arguments | tojson -}}"
    "{{ '}\\n</tool_call>' }}{%- endfor -%}{%- endif -%}"
    "{{ '<|im_end|>\\n' }}"
    "{%- endfor -%}"
    "{%- if add_generation_prompt -%}{{ '<|im_start|>assistant\\n' }}{%- endif -%}"
)
MARKUP = ("<|im_start|>", "<|im_end|>", "<|endoftext|>")


def tokenizer():
    tok = build_tokenizer()
    tok.chat_template = CHATML_TOOL_ROLE
    return tok


def calculator(expression: str) -> str:
    """Evaluate an arithmetic expression.

    Args:
        expression: the expression to evaluate
    """
    return str(eval(expression, {"__builtins__": {}}))  # noqa: S307 - test tool on fixed input


class ScriptedServer:
    """Stands in for verl's vLLM replica + ``LLMServerClient``: answers by the prompt, tags each
    output with the weights version (``version(call_of_this_request)``) as verl's server does."""

    def __init__(self, tok, version):
        self.tok, self.version, self.calls, self.arrivals = tok, version, {}, {}

    async def generate(self, request_id, *, prompt_ids, sampling_params, **kwargs):
        from verl.workers.rollout.replica import TokenOutput

        turn = self.calls[request_id] = self.calls.get(request_id, 0) + 1
        text = self.tok.decode(prompt_ids)
        # the k-th request of a prompt: distinct lengths within a group, so balancing reorders
        # (verl 0.9.1's det-<priority> request ids do not exist in 0.9.0)
        rank = self.arrivals[text] = self.arrivals.get(text, -1) + 1
        if "<tool_response>" in text or "<|im_start|>tool" in text:
            out = "The answer is 391.<|im_end|>"
        elif "17 * 23" in text:
            out = '<tool_call>\n{"name": "calculator", "arguments": {"expression": "17 * 23"}}\n</tool_call><|im_end|>'
        else:
            out = "The answer is 4." + " Think step by step." * ((rank * 3) % N) + "<|im_end|>"
        version = self.version(turn)
        output = TokenOutput(token_ids=self.tok.encode(out, add_special_tokens=False), stop_reason="completed",
                             extra_fields={"global_steps": version, "num_cached_tokens": 0})
        output.extra_fields.setdefault("min_global_steps", version)  # LLMServerClient.generate
        output.extra_fields.setdefault("max_global_steps", version)
        return output


def verl_step(tmp_path, *, step=3, version=None, validate=False, balance=True, mark=True, reward_keys=True):
    """One step of RayPPOTrainer.fit on verl's own code; returns (batch, truth) where truth[j] is
    verl's get_trajectory_info entry of sample j of the final (balanced) batch."""
    require("verl")
    import pandas as pd
    import verl
    from omegaconf import OmegaConf
    from verl.experimental.agent_loop import tool_agent_loop  # noqa: F401 - registers tool_agent
    from verl.experimental.agent_loop.agent_loop import AgentLoopWorker, get_trajectory_info
    from verl.protocol import DataProto
    from verl.tools.function_tool import FunctionTool, _build_schema_from_fn
    from verl.trainer.ppo.core_algos import AdvantageEstimator
    from verl.trainer.ppo.ray_trainer import RayPPOTrainer, compute_advantage
    from verl.trainer.ppo.reward import extract_reward
    from verl.utils.config import omega_conf_to_dataclass
    from verl.utils.dataset.rl_dataset import RLHFDataset, collate_fn
    from verl.workers.reward_manager.naive import NaiveRewardManager

    tok = tokenizer()
    rows = [{"data_source": "openai/gsm8k", "prompt": [{"role": "user", "content": q}],
             "reward_model": {"style": "rule", "ground_truth": a}, "agent_name": "tool_agent",
             "extra_info": {"index": 10 + i, "split": "test" if validate else "train"}}
            for i, (q, a) in enumerate(QUESTIONS)]
    path = str(tmp_path / "train.parquet")
    pd.DataFrame(rows).to_parquet(path)
    cfg = OmegaConf.load(os.path.join(os.path.dirname(verl.__file__), "trainer/config/_generated_ppo_trainer.yaml"))
    cfg.data.max_prompt_length = cfg.actor_rollout_ref.rollout.prompt_length = 256
    cfg.actor_rollout_ref.rollout.response_length = 128
    cfg.actor_rollout_ref.rollout.n = N
    cfg.actor_rollout_ref.rollout.name = "vllm"

    dataset = RLHFDataset([path], tok, cfg.data)
    batch = DataProto.from_single_dict(collate_fn([dataset[i] for i in range(len(dataset))]))
    batch.non_tensor_batch["uid"] = np.array([str(uuid.uuid4()) for _ in range(len(batch.batch))], dtype=object)
    gen_batch = RayPPOTrainer._get_gen_batch(SimpleNamespace(), batch)
    gen_batch.meta_info["global_steps"] = step
    if validate:
        gen_batch.meta_info["validate"] = True
    gen_batch_output = gen_batch.repeat(repeat_times=N, interleave=True)
    # AgentLoopManager.generate_sequences adds this column (it flows into the trained batch)
    gen_batch_output.non_tensor_batch["priority"] = np.arange(len(gen_batch_output), dtype=np.int64)
    # what verl's rollout traces are keyed by (one agent-loop worker: the whole batch)
    info = asyncio.run(get_trajectory_info(step, gen_batch_output.non_tensor_batch["index"].tolist(), validate))

    def tool():
        return FunctionTool(name="calculator", fn=calculator, tool_schema=_build_schema_from_fn(calculator, "calculator"))

    worker = object.__new__(AgentLoopWorker)
    worker.__dict__.update(
        config=cfg, llm_client=ScriptedServer(tok, version or (lambda turn: step - 1)), teacher_client=None,
        reward_loop_worker_handles=None, rollout_config=omega_conf_to_dataclass(cfg.actor_rollout_ref.rollout),
        dataset_cls=RLHFDataset, tokenizer=tok, processor=None, hf_model_type=None, mm_processor_kwargs={},
        distillation_enabled=False, tools=[tool()])
    output = asyncio.run(worker.generate_sequences(gen_batch_output))

    batch = batch.repeat(repeat_times=N, interleave=True)
    batch = batch.union(output)
    if validate:
        batch.meta_info["validate"] = True  # as RayPPOTrainer._validate does
    batch.non_tensor_batch["probe_position"] = np.arange(len(batch))  # test only: where each sample was
    if mark:
        verl_adapter.mark_rollouts(batch)
    if balance:
        trainer = SimpleNamespace(_get_dp_size=lambda wg, role: 2, actor_rollout_wg=None, config=cfg)
        RayPPOTrainer._balance_batch(trainer, batch, metrics={})
    positions = batch.non_tensor_batch.pop("probe_position").tolist()

    def compute_score(data_source, solution_str, ground_truth, extra_info=None):
        acc = float(ground_truth in solution_str)
        return {"score": acc, "acc": acc, "format": 1.0}

    result = NaiveRewardManager(tok, 0, compute_score)(batch, return_dict=True)
    batch.batch["rm_scores"] = result["reward_tensor"]  # where verl's reward loop puts them
    for key, values in result["reward_extra_info"].items():
        batch.non_tensor_batch[key] = np.array(values)
    if reward_keys:
        batch.meta_info["reward_extra_keys"] = list(result["reward_extra_info"])
    reward_tensor, reward_extra_infos_dict = extract_reward(batch)
    batch.batch["token_level_scores"] = reward_tensor
    batch.non_tensor_batch.update({k: np.array(v) for k, v in reward_extra_infos_dict.items()})
    batch.batch["token_level_rewards"] = batch.batch["token_level_scores"]
    if not validate:
        batch = compute_advantage(batch, adv_estimator=AdvantageEstimator.GRPO, num_repeat=N, config=cfg.algorithm)
    return tok, batch, [info[p] for p in positions]


def record(memory, tok, batch, step=3, **kwargs):
    assert verl_adapter.record_batch(batch, step=step, tokenizer=tok, **kwargs) == len(batch)
    assert otr.flush()
    return episodes(memory)


@pytest.mark.matrix
def test_only_reward_terms_are_rewards(tmp_path, memory):
    tok, batch, _ = verl_step(tmp_path)
    assert {"global_steps", "min_global_steps", "max_global_steps", "num_cached_tokens",
            "priority"} <= set(batch.non_tensor_batch)
    eps = record(memory, tok, batch)
    assert len(eps) == 2 * N
    for e in eps.values():
        root = e["root"]
        rewards = {k for k in root if k.startswith(c.RL_REWARD_COMPONENT_PREFIX)}
        assert rewards == {"rl.reward.component.score", "rl.reward.component.acc", "rl.reward.component.format"}, rewards
        assert root["rl.metadata.num_cached_tokens"] == 0
        assert root["rl.metadata.agent_name"] == "tool_agent"
    tool_runs = [e["root"] for e in eps.values() if e["root"][c.RL_DATASET_INDEX] == 10]
    assert {r[c.RL_TURN_COUNT] for r in tool_runs} == {4}  # verl: user + assistant + tool + assistant
    assert {r[c.RL_REWARD] for r in tool_runs} == {1.0}


@pytest.mark.matrix
def test_reward_terms_without_verl_list_skip_bookkeeping_and_warn(tmp_path, memory, caplog, monkeypatch):
    tok, batch, _ = verl_step(tmp_path, reward_keys=False)  # an older reward-manager path
    with caplog.at_level(logging.WARNING, logger="otel_rollouts"):
        eps = record(memory, tok, batch)
    for e in eps.values():
        assert {k for k in e["root"] if k.startswith(c.RL_REWARD_COMPONENT_PREFIX)} == {
            "rl.reward.component.score", "rl.reward.component.acc", "rl.reward.component.format"}
    assert "reward_extra_keys" in caplog.text
    eps2 = record(memory, tok, batch, step=4, reward_extra_keys=["acc"])
    assert {k for k in next(iter(v for k, v in eps2.items() if k.startswith("train-4")))["root"]
            if k.startswith(c.RL_REWARD_COMPONENT_PREFIX)} == {"rl.reward.component.acc"}


@pytest.mark.matrix
def test_tool_result_rendered_with_the_tool_role_is_clean(tmp_path, memory):
    tok, batch, _ = verl_step(tmp_path)
    text = tok.decode(batch.batch["responses"][[i for i in range(len(batch))
                                                if batch.non_tensor_batch["index"][i] == 10][0]])
    assert "<|im_start|>tool\n391<|im_end|>" in text  # what verl's tool-agent loop produced
    eps = record(memory, tok, batch)
    for e in eps.values():
        for span in e["spans"]:
            for key, value in span.attributes.items():
                assert not any(m in str(value) for m in MARKUP), (span.name, key, value)
    tool_ep = next(e for e in eps.values() if e["root"][c.RL_DATASET_INDEX] == 10)
    (tool_span,) = tool_ep["by_kind"][c.KIND_TOOL]
    assert tool_span.attributes[c.GEN_AI_TOOL_NAME] == "calculator"
    assert tool_span.attributes[c.GEN_AI_TOOL_CALL_RESULT] == "391"
    assert tool_span.attributes[c.RL_FEEDBACK_ROLE] == "tool"
    assert '"expression": "17 * 23"' in tool_span.attributes[c.GEN_AI_TOOL_CALL_ARGUMENTS]
    (prompt,) = tool_ep["by_kind"][c.KIND_PROMPT]
    import json

    messages = json.loads(prompt.attributes[c.GEN_AI_INPUT_MESSAGES])
    assert [m["role"] for m in messages] == ["system", "user"]
    assert messages[1]["parts"][0]["content"] == "What is 17 * 23?"
    chats = [s for s in tool_ep["spans"] if s.attributes.get(c.RL_SPAN_KIND) == c.KIND_GENERATION]
    last = json.loads(chats[-1].attributes[c.GEN_AI_OUTPUT_MESSAGES])[0]
    assert last["parts"] == [{"type": "text", "content": "The answer is 391."}]


@pytest.mark.matrix
def test_policy_version_from_verl_columns_on_policy(tmp_path, memory):
    tok, batch, _ = verl_step(tmp_path, step=3)  # sync trainer: step 3 generates with weights 2
    eps = record(memory, tok, batch)
    for e in eps.values():
        assert e["root"][c.RL_POLICY_VERSION] == 2
        assert e["root"][c.RL_STALENESS] == 0
        assert c.RL_POLICY_VERSION_MIN not in e["root"]


@pytest.mark.matrix
def test_policy_version_off_policy_and_partial_rollouts(tmp_path, memory):
    # one-step-off / async: generation started on weights 1, a resumed turn ran on weights 2
    tok, batch, _ = verl_step(tmp_path, step=4, version=lambda turn: 1 if turn == 1 else 2)
    eps = record(memory, tok, batch, step=4)
    for e in eps.values():
        root = e["root"]
        if root[c.RL_DATASET_INDEX] == 10:  # two generations: min 1, max 2
            assert root[c.RL_POLICY_VERSION] == 2 and root[c.RL_STALENESS] == 1
            assert root[c.RL_POLICY_VERSION_MIN] == 1 and root[c.RL_POLICY_VERSION_MAX] == 2
        else:
            assert root[c.RL_POLICY_VERSION] == 1 and root[c.RL_STALENESS] == 2
    eps = record(memory, tok, batch, step=5, trained_version=7)  # fully async: current_param_version
    assert {e["root"][c.RL_STALENESS] for k, e in eps.items() if k.startswith("train-5")} == {5, 6}


@pytest.mark.matrix
def test_validation_batch_has_a_version_but_no_staleness(tmp_path, memory):
    tok, batch, truth = verl_step(tmp_path, step=3, version=lambda turn: 3, validate=True, balance=False,
                                  mark=False)
    eps = record(memory, tok, batch)
    assert all(k.startswith("eval-3-") for k in eps)
    for e in eps.values():
        assert e["root"][c.RL_POLICY_VERSION] == 3 and c.RL_STALENESS not in e["root"]
    got = sorted((e["root"]["rl.metadata.sample_index"], e["root"]["rl.metadata.rollout_n"]) for e in eps.values())
    assert got == sorted((t["sample_index"], t["rollout_n"]) for t in truth)  # unbalanced: order kept


@pytest.mark.matrix
def test_rollout_n_matches_verl_trajectory_info_after_balancing(tmp_path, memory):
    tok, batch, truth = verl_step(tmp_path)
    uids = batch.non_tensor_batch["uid"].tolist()
    order = [uids[:j].count(u) for j, u in enumerate(uids)]
    assert order != [t["rollout_n"] for t in truth], "balancing kept the order: the test would prove nothing"
    eps = record(memory, tok, batch)
    assert len(eps) == len(batch)
    for j, t in enumerate(truth):
        root = eps[f"train-3-{uids[j]}-{t['rollout_n']}"]["root"]
        assert root["rl.metadata.rollout_n"] == t["rollout_n"] and root[c.RL_SAMPLE_INDEX] == t["rollout_n"]
        assert root["rl.metadata.sample_index"] == t["sample_index"] == root[c.RL_DATASET_INDEX]
        assert root[c.RL_GROUP_ID] == uids[j] and root["rl.metadata.validate"] is False
        # the same sample: its response length is the one verl generated for that rollout
        n_out = sum(s.attributes.get(c.GEN_AI_USAGE_OUTPUT_TOKENS, 0) for s in eps[root[c.RL_EPISODE_ID]]["spans"])
        assert n_out == int(batch.batch["response_mask"][j].sum())


@pytest.mark.matrix
def test_balanced_batch_without_mark_records_no_wrong_rollout_n(tmp_path, memory, caplog, monkeypatch):
    tok, batch, _ = verl_step(tmp_path, mark=False)
    with caplog.at_level(logging.WARNING, logger="otel_rollouts"):
        eps = record(memory, tok, batch)
    assert len(eps) == len(batch)  # ids stay unique
    assert all("rl.metadata.rollout_n" not in e["root"] for e in eps.values())
    assert "mark_rollouts" in caplog.text
    assert otr.stats()["totals"]["adapters.unknown_structure"] >= 1


@pytest.mark.matrix
def test_mark_rollouts_numbers_each_agent_loop_worker_chunk_like_verl():
    require("verl")
    from verl.experimental.agent_loop.agent_loop import get_trajectory_info

    index = [7, 7, 7, 8, 8, 8]  # n=3 over 2 prompts, 4 workers: chunks of 2, 2, 1, 1
    batch = {"non_tensor_batch": {"index": np.array(index, dtype=object)}}
    assert verl_adapter.mark_rollouts(batch, agent_loop_workers=4) == 6
    chunks = [index[0:2], index[2:4], index[4:5], index[5:6]]
    truth = [t["rollout_n"] for ch in chunks for t in asyncio.run(get_trajectory_info(1, ch, False))]
    assert batch["non_tensor_batch"][verl_adapter.ROLLOUT_N_COLUMN].tolist() == truth == [0, 1, 0, 0, 0, 0]


def test_adapter_errors_never_reach_the_trainer(memory):
    assert not verl_adapter.mark_rollouts(object())
    assert not verl_adapter.record_batch(object(), step=1, tokenizer=None)
    broken = {"batch": {"responses": np.zeros((2, 3)), "input_ids": "not a tensor"}, "non_tensor_batch": {}}
    verl_adapter.record_batch(broken, step=1, tokenizer=None)  # reported, not raised


@pytest.fixture(autouse=True)
def _quiet_verl(caplog):
    logging.getLogger("verl").setLevel(logging.ERROR)
    yield
