"""AReaL adapter: trajectory dicts of CPU torch tensors shaped as AReaL's workflows write them."""

from __future__ import annotations

import json

import pytest
import torch
from adapter_fixtures import configure_memory, counting_tensor_class, episodes, messages_of
from otr_helpers import trackio_rows
from tokenizer_fixture import build_tokenizer, chat_ids, text_ids

import otel_rollouts as otr
from otel_rollouts import conventions as c
from otel_rollouts.adapters import areal

TOK = build_tokenizer()
CountingTensor = counting_tensor_class()
SYSTEM = {"role": "system", "content": "You are a helpful assistant."}
CALL = '<tool_call>\n{"name": "calculator", "arguments": {"expression": "17 * 23"}}\n</tool_call><|im_end|>'


def sample(kind: str, version: int):
    """(input_ids, loss_mask, versions) of one sample, as AReaL's multi-turn workflows build it."""
    prompt = chat_ids(TOK, [SYSTEM, {"role": "user", "content": "What is 17 * 23?"}], generation_prompt=True)
    parts = [(prompt, 0)]
    if kind == "tool":
        parts += [(text_ids(TOK, CALL), 1),
                  (text_ids(TOK, "\n<|im_start|>user\n<tool_response>\n391\n</tool_response><|im_end|>\n"
                                 "<|im_start|>assistant\n"), 0),
                  (text_ids(TOK, "The answer is 391.<|im_end|>"), 1)]
    else:
        parts += [(text_ids(TOK, "The answer is 4.<|im_end|>"), 1)]
    ids, mask, vers = [], [], []
    for k, (tokens, m) in enumerate(parts):
        ids += tokens
        mask += [m] * len(tokens)
        vers += [(version - 1 if k == 1 and kind == "tool" else version) if m else -1] * len(tokens)
    return ids, mask, vers


def group(kinds=("tool", "plain"), version=6, rewards=None, tensor=torch.tensor):
    """One accepted group: [G, L] tensors right-padded with concat_padded_tensors' conventions."""
    rows = [sample(k, version) for k in kinds]
    width = max(len(r[0]) for r in rows) + 3
    pad = TOK.pad_token_id

    def padded(i, value):
        return [r[i] + [value] * (width - len(r[i])) for r in rows]

    return {
        "input_ids": tensor(padded(0, pad), dtype=torch.int32),
        "attention_mask": tensor([[1] * len(r[0]) + [0] * (width - len(r[0])) for r in rows], dtype=torch.bool),
        "loss_mask": tensor(padded(1, 0), dtype=torch.int32),
        "logprobs": tensor([[0.0] * width for _ in rows], dtype=torch.float32),
        "versions": tensor(padded(2, -1), dtype=torch.int32),
        "rewards": tensor(rewards if rewards is not None else [1.0, 0.0][: len(rows)] + [0.5] * (len(rows) - 2),
                          dtype=torch.float32),
    }


def test_trajectories_round_trip_through_trackio(otr_shutdown):
    project = "otr-test-areal"
    exporter = configure_memory(trackio_project=project)
    n = areal.record_trajectories([group(), None, group(version=7)], step=12, tokenizer=TOK)
    areal.record_trajectories([group(("plain",))], step=12, tokenizer=TOK, split="eval-rollout")
    otr.end_step(12)
    assert n == 5 and otr.flush()
    eps = episodes(exporter)
    assert sorted(eps) == ["eval-12-0-0", "train-12-0-0", "train-12-0-1", "train-12-1-rejected",
                           "train-12-2-0", "train-12-2-1"]
    tool = eps["train-12-0-0"]["root"]
    assert tool[c.RL_GROUP_ID] == "0" and tool[c.RL_SYSTEM_NAME] == "areal"
    assert tool[c.RL_POLICY_VERSION] == 6 and tool[c.RL_POLICY_VERSION_MIN] == 5  # never -1
    assert eps["train-12-2-1"]["root"][c.RL_POLICY_VERSION] == 7
    assert eps["train-12-2-1"]["root"][c.RL_SAMPLE_INDEX] == 3  # rows counted across groups
    rejected = eps["train-12-1-rejected"]["root"]
    assert rejected[c.RL_STATUS] == c.STATUS_FILTERED and rejected[c.RL_GROUP_ID] == "1"
    assert otr.stats()["steps"]["12/train"]["adapters.filtered"] == 1

    rows = {r["metadata"]["rl.episode.id"]: r for r in trackio_rows(project)}
    row = rows["train-12-0-0"]
    assert row["step"] == 12
    md = row["metadata"]
    assert md["rl.split"] == "train" and md["rl.group.id"] == "0" and md["rl.policy.version"] == 6
    assert md["rl.reward.score"] == 1.0 and isinstance(md["rl.reward.score"], float)
    msgs = row["messages"]
    assert msgs[0] == SYSTEM and msgs[1] == {"role": "user", "content": "What is 17 * 23?"}
    assert msgs[2]["role"] == "assistant"
    call = msgs[2]["tool_calls"][0]
    assert call["function"]["name"] == "calculator"
    assert json.loads(call["function"]["arguments"]) == {"expression": "17 * 23"}
    assert msgs[3]["role"] == "tool" and msgs[3]["content"].strip() == "391"
    assert msgs[4] == {"role": "assistant", "content": "The answer is 391."}
    assert rows["eval-12-0-0"]["key"] == "eval/rollouts"
    assert rows["train-12-1-rejected"]["metadata"]["status"] == "filtered"


def test_each_tensor_leaves_the_device_once_per_group_not_per_sample(memory):
    g = group(("tool", "plain") * 4)  # 8 samples, 6 tensors
    tensors = {k: v.as_subclass(CountingTensor) for k, v in g.items()}
    CountingTensor.calls = {}
    assert areal.record_trajectories([tensors], step=1, tokenizer=TOK) == 8
    calls = CountingTensor.calls
    assert calls.get("item", 0) == 0, calls
    # at most one call of each kind per tensor: a per-sample copy of any tensor would be >= 8
    assert calls and max(calls.values()) <= len(tensors), calls
    assert otr.flush()
    assert len(episodes(memory)) == 8


class RTensorLike:
    """AReaL's single-controller RTensor surface: shape/dtype/ndim and to_local(), no detach()."""

    def __init__(self, local: torch.Tensor) -> None:
        self._local = local
        self.shape, self.dtype, self.ndim = local.shape, local.dtype, local.ndim
        self.localized = 0

    def to_local(self) -> torch.Tensor:
        self.localized += 1
        return self._local


def test_remote_tensors_are_localized_once(memory):
    g = {k: RTensorLike(v) for k, v in group().items()}
    assert areal.record_trajectories([g], step=2, tokenizer=TOK) == 2
    assert all(v.localized == 1 for v in g.values())
    assert otr.flush()
    assert episodes(memory)["train-2-0-1"]["root"][c.RL_REWARD] == 0.0


def test_ragged_rewards_mark_the_uncovered_sample_partial(memory):
    g = group(("tool", "plain", "plain"))
    g["rewards"] = torch.tensor([1.0, 0.0], dtype=torch.float32)
    assert areal.record_trajectories([g], step=3, tokenizer=TOK) == 3
    assert otr.flush()
    eps = episodes(memory)
    assert len(eps) == 3
    last = eps["train-3-0-2"]["root"]
    # on rl.alignment.kind itself now (was only rl.metadata.alignment: record_token_batch then took
    # no per-sample attributes)
    assert last[c.RL_ALIGNMENT_KIND] == "partial" and c.RL_REWARD not in last
    assert any("rewards" in m for m in last[c.RL_ALIGNMENT_MISSING])
    assert c.RL_ALIGNMENT_KIND not in eps["train-3-0-1"]["root"]
    assert otr.stats()["steps"]["3/train"]["adapters.alignment_partial"] == 1


def test_structured_messages_are_replayed_and_snapshotted(memory):
    g = group(("plain", "plain"))
    conversations = [
        [SYSTEM, {"role": "user", "content": "What is 2 + 2?"},
         {"role": "assistant", "content": "", "tool_calls": [
             {"id": "c1", "type": "function", "function": {"name": "calculator", "arguments": '{"e": "2+2"}'}}]},
         {"role": "tool", "tool_call_id": "c1", "content": "4"},
         {"role": "assistant", "content": "The answer is 4."}],
        [SYSTEM, {"role": "user", "content": "What is 2 + 2?"}, {"role": "assistant", "content": "5"}],
    ]
    g["messages"] = conversations
    areal.record_trajectories([g], step=4, tokenizer=TOK)
    conversations[0][1]["content"] = "MUTATED"
    conversations[1].append({"role": "user", "content": "MUTATED"})
    assert otr.flush()
    msgs = messages_of(memory)
    assert "MUTATED" not in str(msgs)
    assert [m["role"] for m in msgs["train-4-0-0"]] == ["system", "user", "assistant", "tool", "assistant"]
    assert msgs["train-4-0-0"][3] == {"role": "tool", "tool_call_id": "c1", "name": "calculator", "content": "4"}
    root = episodes(memory)["train-4-0-0"]["root"]
    assert root[c.RL_REWARD] == 1.0 and root[c.RL_POLICY_VERSION] == 6


def test_a_sample_without_generated_tokens_is_recorded_not_dropped(memory):
    g = group(("plain", "plain"))
    g["loss_mask"][1] = 0  # nothing generated (e.g. the engine aborted the request)
    assert areal.record_trajectories([g], step=5, tokenizer=TOK) == 2
    assert otr.flush()
    eps = episodes(memory)
    assert sorted(eps) == ["train-5-0-0", "train-5-0-1"]
    assert c.RL_POLICY_VERSION not in eps["train-5-0-1"]["root"]
    assert eps["train-5-0-1"]["root"][c.RL_REWARD] == 0.0


@pytest.mark.parametrize("split,expected", [("rollout", "train"), ("eval-rollout", "eval"), ("eval", "eval")])
def test_areal_split_names(memory, split, expected):
    areal.record_trajectories([group(("plain",))], step=6, tokenizer=TOK, split=split)
    assert otr.flush()
    (ep,) = episodes(memory).values()
    assert ep["root"][c.RL_SPLIT] == expected


def test_a_sample_ending_in_non_generated_tokens_is_recorded(memory):
    """AReaL's own logger dropped samples whose last token is not a loss token (mask[-1] == 0),
    e.g. MultiTurnWorkflow's retry prompt after a wrong answer."""
    g = group(("plain", "plain"))
    retry = text_ids(TOK, "\n<|im_start|>user\nPlease retry: your previous answer was wrong.<|im_end|>\n")
    width = g["input_ids"].shape[1] + len(retry)
    real = int(g["attention_mask"][1].sum())
    for key, fill in (("input_ids", TOK.pad_token_id), ("attention_mask", False), ("loss_mask", 0),
                      ("logprobs", 0.0), ("versions", -1)):
        pad = torch.full((2, len(retry)), fill, dtype=g[key].dtype)
        g[key] = torch.cat([g[key], pad], dim=1)
    g["input_ids"][1, real:real + len(retry)] = torch.tensor(retry, dtype=torch.int32)
    g["attention_mask"][1, real:real + len(retry)] = True
    assert g["input_ids"].shape[1] == width
    assert areal.record_trajectories([g], step=8, tokenizer=TOK) == 2
    assert otr.flush()
    eps = episodes(memory)
    assert sorted(eps) == ["train-8-0-0", "train-8-0-1"]
    msgs = messages_of(memory)["train-8-0-1"]
    assert msgs[2] == {"role": "assistant", "content": "The answer is 4."}
    assert msgs[-1]["content"] == "Please retry: your previous answer was wrong."
    assert eps["train-8-0-1"]["root"][c.RL_REWARD] == 0.0
