"""verl adapter: DataProto-shaped batches (TensorDict of CPU torch tensors, numpy object columns)."""

from __future__ import annotations

import json
from dataclasses import dataclass, field
from typing import Any

import numpy as np
import pytest
import torch
from adapter_fixtures import configure_memory, counting_tensor_class, episodes, messages_of
from otr_helpers import trackio_rows
from tokenizer_fixture import build_tokenizer, chat_ids, text_ids

import otel_rollouts as otr
from otel_rollouts import conventions as c
from otel_rollouts.adapters import verl

TOK = build_tokenizer()
CountingTensor = counting_tensor_class()
PAD = TOK.pad_token_id
SYSTEM = {"role": "system", "content": "You are a helpful assistant."}
CALL = '<tool_call>\n{"name": "calculator", "arguments": {"expression": "17 * 23"}}\n</tool_call><|im_end|>'
TOOL_OBS = "\n<|im_start|>user\n<tool_response>\n391\n</tool_response><|im_end|>\n<|im_start|>assistant\n"


class TensorDictLike:
    """The part of tensordict.TensorDict that verl's DataProto.batch is read through (keys(),
    [key], batch_size). tensordict is not installed here; its interface is what matters."""

    def __init__(self, tensors: dict[str, torch.Tensor]) -> None:
        self._tensors = tensors
        self.batch_size = torch.Size([next(iter(tensors.values())).shape[0]])

    def keys(self):
        return self._tensors.keys()

    def __getitem__(self, key: str) -> torch.Tensor:
        return self._tensors[key]

    def __setitem__(self, key: str, value: torch.Tensor) -> None:
        self._tensors[key] = value


@dataclass
class DataProto:
    batch: Any = None
    non_tensor_batch: dict[str, np.ndarray] = field(default_factory=dict)
    meta_info: dict[str, Any] = field(default_factory=dict)


def response(kind: str) -> tuple[list[int], list[int]]:
    """(response ids, response_mask): 0 on tool tokens inserted by verl's agent loop."""
    if kind == "tool":
        parts = [(text_ids(TOK, CALL), 1), (text_ids(TOK, TOOL_OBS), 0),
                 (text_ids(TOK, "The answer is 391.<|im_end|>"), 1)]
    elif kind == "long":
        parts = [(text_ids(TOK, " ".join(["Think step by step and answer briefly."] * 8)), 1)]  # no EOS
    else:
        parts = [(text_ids(TOK, f"The answer is {kind}.<|im_end|>"), 1)]
    ids, mask = [], []
    for tokens, m in parts:
        ids += tokens
        mask += [m] * len(tokens)
    return ids, mask


def make(kinds=("tool", "4", "391", "long"), *, n=2, validate=False, step=5, scores=None):
    """A batch after batch.repeat(n, interleave=True), generation and reward: blocked groups."""
    size = len(kinds)
    questions = ["What is 17 * 23?", "What is 2 + 2?"]
    prompt_rows = [chat_ids(TOK, [SYSTEM, {"role": "user", "content": questions[(i // n) % 2]}],
                            generation_prompt=True) for i in range(size)]
    resp_rows = [response(k) for k in kinds]
    pw = max(len(p) for p in prompt_rows)
    rw = max(len(r[0]) for r in resp_rows)  # the "long" sample hit the response length: truncated
    prompts = torch.tensor([[PAD] * (pw - len(p)) + p for p in prompt_rows])
    responses = torch.tensor([r[0] + [PAD] * (rw - len(r[0])) for r in resp_rows])
    response_mask = torch.tensor([r[1] + [0] * (rw - len(r[1])) for r in resp_rows])
    attention = torch.cat([
        torch.tensor([[0] * (pw - len(p)) + [1] * len(p) for p in prompt_rows]),
        torch.tensor([[1] * len(r[0]) + [0] * (rw - len(r[0])) for r in resp_rows]),
    ], dim=1)
    scores = scores if scores is not None else [float(i % 2 == 0) for i in range(size)]
    token_scores = torch.zeros((size, rw), dtype=torch.float32)
    for i, (ids, _) in enumerate(resp_rows):
        token_scores[i, len(ids) - 1] = scores[i]
    adv = torch.tensor([[0.5 if s else -0.5] * rw for s in scores], dtype=torch.float32) * response_mask
    uids = [f"uid-{i // n}" for i in range(size)]
    non_tensor = {
        "uid": np.array(uids, dtype=object),
        "index": np.array([10 + i // n for i in range(size)], dtype=object),
        "data_source": np.array(["openai/gsm8k"] * size, dtype=object),
        "extra_info": np.array([{"index": 10 + i // n, "split": "train"} for i in range(size)], dtype=object),
        "reward_model": np.array([{"ground_truth": "391", "style": "rule"}] * size, dtype=object),
        "acc": np.array([bool(s) for s in scores], dtype=object),
        "param_version": np.array([step - 1] * size, dtype=object),
    }
    tensors = TensorDictLike({
        "prompts": prompts, "responses": responses, "input_ids": torch.cat([prompts, responses], dim=1),
        "attention_mask": attention, "position_ids": torch.clamp(attention.cumsum(-1) - 1, min=0),
        "response_mask": response_mask, "token_level_scores": token_scores,
        "token_level_rewards": token_scores.clone(), "advantages": adv,
    })
    return DataProto(batch=tensors, non_tensor_batch=non_tensor,
                     meta_info={"global_steps": step, "validate": validate, "temperature": 1.0})


def test_batch_round_trips_through_trackio(otr_shutdown):
    project = "otr-test-verl"
    exporter = configure_memory(trackio_project=project)
    assert verl.record_batch(make(), step=5, tokenizer=TOK) == 4
    verl.record_batch(make(("4", "391"), validate=True), step=5, tokenizer=TOK)
    otr.end_step(5)
    assert otr.flush()
    eps = episodes(exporter)
    assert sorted(eps) == ["eval-5-uid-0-0", "eval-5-uid-0-1", "train-5-uid-0-0", "train-5-uid-0-1",
                           "train-5-uid-1-0", "train-5-uid-1-1"]
    root = eps["train-5-uid-0-0"]["root"]
    assert root[c.RL_GROUP_ID] == "uid-0" and root[c.RL_SYSTEM_NAME] == "verl"
    assert root[c.RL_POLICY_VERSION] == 4 and root[c.RL_DATASET_INDEX] == 10
    assert root[c.RL_REWARD] == 1.0 and root["rl.reward.component.acc"] == 1.0
    assert root[c.RL_ADVANTAGE] == pytest.approx(0.5)
    assert root["rl.metadata.rollout_n"] == 0 and root["rl.metadata.sample_index"] == 10
    assert eps["train-5-uid-1-1"]["root"][c.RL_STATUS] == c.STATUS_TRUNCATED
    assert eps["train-5-uid-1-1"]["root"]["rl.metadata.rollout_n"] == 1

    rows = {r["metadata"]["rl.episode.id"]: r for r in trackio_rows(project)}
    row = rows["train-5-uid-0-0"]
    assert row["step"] == 5 and row["key"] == "rollouts"
    md = row["metadata"]
    assert md["rl.split"] == "train" and md["rl.group.id"] == "uid-0" and md["rl.policy.version"] == 4
    assert isinstance(md["rl.reward.score"], float) and isinstance(md["rl.reward.component.acc"], float)
    assert md["rl.metadata.validate"] is False and md["rl.dataset.name"] == "openai/gsm8k"
    msgs = row["messages"]
    assert msgs[0] == SYSTEM and msgs[1] == {"role": "user", "content": "What is 17 * 23?"}
    call = msgs[2]["tool_calls"][0]
    assert call["function"]["name"] == "calculator"
    assert json.loads(call["function"]["arguments"]) == {"expression": "17 * 23"}
    assert msgs[3]["role"] == "tool" and msgs[3]["content"].strip() == "391"
    assert msgs[4] == {"role": "assistant", "content": "The answer is 391."}
    val = rows["eval-5-uid-0-1"]
    assert val["key"] == "eval/rollouts" and val["metadata"]["rl.metadata.validate"] is True


def test_tensors_leave_the_device_once_per_batch_not_per_sample(memory):
    data = make(("4", "391") * 4, n=2)  # 8 samples
    data.batch = TensorDictLike({k: data.batch[k].as_subclass(CountingTensor) for k in data.batch.keys()})
    CountingTensor.calls = {}
    assert verl.record_batch(data, step=1, tokenizer=TOK) == 8
    calls = CountingTensor.calls
    assert calls.get("item", 0) == 0, calls
    # at most one call of each kind per tensor: a per-sample copy would be >= 8 of one kind
    assert calls and max(calls.values()) < 8, calls
    assert otr.flush()
    assert len(episodes(memory)) == 8


def test_ragged_non_tensor_columns_mark_uncovered_samples_partial(memory):
    data = make()
    data.non_tensor_batch["acc"] = data.non_tensor_batch["acc"][:3]
    assert verl.record_batch(data, step=2, tokenizer=TOK) == 4
    assert otr.flush()
    eps = episodes(memory)
    assert len(eps) == 4
    last = eps["train-2-uid-1-1"]["root"]
    assert last["rl.metadata.alignment"] == "partial" and "rl.reward.component.acc" not in last
    assert "rl.metadata.alignment" not in eps["train-2-uid-1-0"]["root"]
    assert eps["train-2-uid-1-0"]["root"]["rl.reward.component.acc"] == 1.0
    assert otr.stats()["steps"]["2/train"]["adapters.alignment_partial"] == 1


def test_groups_without_uid_use_rollout_n_only_when_it_divides_the_batch(memory):
    data = make()
    del data.non_tensor_batch["uid"]
    verl.record_batch(data, step=3, tokenizer=TOK, rollout_n=2)
    data3 = make(("4", "391", "4"))
    del data3.non_tensor_batch["uid"]
    verl.record_batch(data3, step=4, tokenizer=TOK, rollout_n=2)
    assert otr.flush()
    eps = episodes(memory)
    assert [eps[f"train-3-{g}-{r}"]["root"][c.RL_GROUP_ID] for g in (0, 1) for r in (0, 1)] == ["0", "0", "1", "1"]
    assert all(c.RL_GROUP_ID not in eps[f"train-4-{i}"]["root"] for i in range(3))


def test_in_place_reuse_of_the_batch_after_logging_does_not_change_the_trace(memory):
    data = make(("4", "391"))
    verl.record_batch(data, step=6, tokenizer=TOK)
    data.batch["input_ids"].fill_(PAD)  # the trainer reuses its buffers
    data.batch["token_level_scores"].zero_()
    assert otr.flush()
    msgs = messages_of(memory)["train-6-uid-0-0"]
    assert msgs[-1] == {"role": "assistant", "content": "The answer is 4."}
    assert episodes(memory)["train-6-uid-0-0"]["root"][c.RL_REWARD] == 1.0


def test_reward_extra_info_as_strings_becomes_numbers(memory):
    data = make(("4", "391"))
    data.non_tensor_batch["format"] = np.array(["1.0", "0.5"], dtype=object)
    verl.record_batch(data, step=7, tokenizer=TOK, reward_extra_keys=["acc", "format"], policy_version=6)
    assert otr.flush()
    root = episodes(memory)["train-7-uid-0-1"]["root"]
    assert root["rl.reward.component.format"] == 0.5 and type(root["rl.reward.component.acc"]) is float
    assert root[c.RL_POLICY_VERSION] == 6


def test_placeholder_policy_versions_are_ignored(memory):
    data = make(("4", "391"))
    data.non_tensor_batch["param_version"] = np.array([-1, 4], dtype=object)
    verl.record_batch(data, step=8, tokenizer=TOK)
    assert otr.flush()
    eps = episodes(memory)
    assert c.RL_POLICY_VERSION not in eps["train-8-uid-0-0"]["root"]
    assert eps["train-8-uid-0-1"]["root"][c.RL_POLICY_VERSION] == 4


# --- stage times (issue 32) -------------------------------------------------------------------------
def test_fully_async_per_sample_times_are_stage_seconds_and_per_step_timing_is_not_copied(memory):
    from frameworks import require

    detach_utils = require("verl.experimental.fully_async_policy.detach_utils")
    AgentLoopMetrics = require("verl.experimental.agent_loop.agent_loop").AgentLoopMetrics
    batch = make()
    # the agent loop's per-sample metrics, as verl's fully async rollouter collects them
    batch.meta_info["metrics"] = [AgentLoopMetrics(generate_sequences=g, tool_calls=t).model_dump()
                                  for g, t in [(2.5, 0.75), (1.25, 0.0), (0.5, 0.0), (4.0, 0.0)]]
    detach_utils.addition_process(batch)  # verl's own: processing_times / tool_calls_times columns
    batch.meta_info["timing"] = {"agent_loop/generate_sequences/max": 4.0}  # per step: not an episode's
    assert verl.record_batch(batch, step=5, tokenizer=TOK) == 4
    assert otr.flush()
    roots = {ep["root"][c.RL_EPISODE_ID]: ep["root"] for ep in episodes(memory).values()}
    generation, tool = c.stage_seconds(c.STAGE_GENERATION), c.stage_seconds(c.STAGE_TOOL)
    ordered = [roots[f"train-5-uid-{i // 2}-{i % 2}"] for i in range(4)]
    assert [r[generation] for r in ordered] == [2.5, 1.25, 0.5, 4.0]
    assert ordered[0][tool] == 0.75
    assert all(tool not in r for r in ordered[1:])  # verl's 0.0 default: not timed, left out
    for r in ordered:
        assert c.RL_DURATION_SECONDS not in r  # verl measures no sample's wall time
        assert not any(k.startswith(c.RL_METADATA_PREFIX + n) for k in r for n in ("processing", "tool_calls"))


def test_a_batch_without_per_sample_times_has_no_stage_or_duration(memory):
    batch = make()
    batch.meta_info["timing"] = {"agent_loop/generate_sequences/max": 4.0, "agent_loop/tool_calls/max": 1.0}
    verl.record_batch(batch, step=5, tokenizer=TOK)
    assert otr.flush()
    for ep in episodes(memory).values():
        assert not any(k.startswith(c.RL_STAGE_PREFIX) for k in ep["root"])
        assert c.RL_DURATION_SECONDS not in ep["root"]  # absent, never 0
