"""torchforge adapter: GRPO ``Episode`` records and the sample dicts forge's sample logging keeps.

``forge`` is not imported (it needs monarch, torchtitan, vllm); ``Episode`` below follows
``src/forge/rl/types.py`` (``forge.rl``) of meta-pytorch/torchforge at
``cf02b132b078decc68b7f64f0dd51f70d603a073`` field by field, ``Completion`` its
``forge/data_models/completion.py``, with real CPU torch tensors for the token ids. The Episode of
a torchforge before the sample-logging change (in the app) is in ``test_torchforge_versions``.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

import torch
from adapter_fixtures import configure_memory, count_prompts, episodes, messages_of
from otr_helpers import trackio_rows

import otel_rollouts as otr
from otel_rollouts import conventions as c
from otel_rollouts.adapters.torchforge import record_episodes

SOURCE_COMMIT = "cf02b132b078decc68b7f64f0dd51f70d603a073"  # meta-pytorch/torchforge, forge.rl


@dataclass
class Completion:
    prompt: Any
    text: str
    prompt_ids: torch.Tensor
    token_ids: torch.Tensor
    logprobs: torch.Tensor | None = None
    stop_reason: str | None = None
    generator_version: int | None = None
    metadata: dict | None = None


@dataclass
class Episode:
    episode_id: str
    pad_id: int
    request_len: int
    response_len: int
    target: Any | None = None
    request: str | None = None
    response: str | None = None
    completion: Completion | None = None
    inference_logprobs: torch.Tensor | None = None
    ref_logprobs: torch.Tensor | None = None
    reward: float | None = None
    reward_breakdown: dict[str, float] | None = None
    advantage: float | None = None
    loss_mask: torch.Tensor | None = None

    @property
    def policy_version(self) -> int | None:
        return self.completion.generator_version

    def to_dict(self, exclude: list[str] | None = None) -> dict[str, Any]:
        """As ``forge.rl.types.Episode.to_dict``: the breakdown is flattened into the top level."""
        result = {
            "episode_id": self.episode_id, "policy_version": self.policy_version,
            "prompt": self.request, "response": self.response, "target": str(self.target),
            "reward": self.reward, "advantage": self.advantage,
            "request_len": self.request_len, "response_len": self.response_len,
            "pad_id": self.pad_id, "ref_logprobs": self.ref_logprobs, "completion": self.completion,
        }
        if self.reward_breakdown is not None and "reward_breakdown" not in exclude:
            result.update(self.reward_breakdown)
        for key in exclude or []:
            result.pop(key, None)
        return result


REQUEST = ("<|im_start|>system\nlet me think<|im_end|>\n<|im_start|>user\nwhat is 2 + 2 ?"
           "<|im_end|>\n<|im_start|>assistant\n")


def make_episode(i, text, math, thinking, version=3, stop="stop", response_tokens=5):
    completion = Completion(prompt=None, text=text, prompt_ids=torch.arange(12),
                            token_ids=torch.arange(response_tokens), stop_reason=stop,
                            generator_version=version, metadata={"num_cached_tokens": 8})
    ep = Episode(episode_id=f"uuid-{i}", pad_id=0, request_len=512, response_len=512, target=4,
                 request=REQUEST, response=text, completion=completion)
    ep.reward_breakdown = {"MathReward": math, "ThinkingReward": thinking}
    ep.reward = (math + thinking) / 2
    return ep


def test_episodes_read_back_from_trackio(otr_shutdown):
    project = "adapter-torchforge"
    mem = configure_memory(trackio_project=project)
    group = [make_episode(0, "the answer is 4", 1.0, 0.5),
             make_episode(1, "the answer is", 0.0, 0.0, stop="length", response_tokens=512)]
    group[0].advantage, group[1].advantage = torch.tensor(0.7), torch.tensor(-0.7)
    # staleness needs the trained version explicitly (the old adapter used `step` for it)
    assert record_episodes(group, step=5, trained_version=5) == ["uuid-0", "uuid-1"]
    otr.flush()

    eps = episodes(mem)
    a = eps["uuid-0"]["root"]
    assert a[c.RL_STEP] == 5 and a[c.RL_SPLIT] == "train" and a[c.RL_POLICY_VERSION] == 3
    assert a[c.RL_STALENESS] == 2 and a[c.RL_SYSTEM_NAME] == "torchforge"
    assert a[c.RL_GROUP_ID] == eps["uuid-1"]["root"][c.RL_GROUP_ID]  # same request: same group
    assert a[c.RL_REWARD] == 0.75 and a[c.RL_REWARD_COMPONENT_PREFIX + "MathReward"] == 1.0
    assert a[c.RL_REWARD_COMPONENT_PREFIX + "ThinkingReward"] == 0.5
    assert abs(a[c.RL_ADVANTAGE] - 0.7) < 1e-6 and a[c.RL_STATUS] == "ok"
    chat = eps["uuid-1"]["by_kind"]["generation"][0].attributes
    # real token counts from the completion, not the padded request_len/response_len
    assert chat[c.GEN_AI_USAGE_INPUT_TOKENS] == 12 and chat[c.GEN_AI_USAGE_OUTPUT_TOKENS] == 512
    truncated = eps["uuid-1"]["root"]
    assert truncated[c.RL_STATUS] == "truncated" and truncated[c.RL_FINISH_REASON] == "length"

    rows = {r["metadata"][c.RL_EPISODE_ID]: r for r in trackio_rows(project)}
    row = rows["uuid-0"]
    assert row["step"] == 5
    assert [m["role"] for m in row["messages"]] == ["user", "assistant"]
    assert row["messages"][0]["content"] == REQUEST and row["messages"][1]["content"] == "the answer is 4"
    md = row["metadata"]
    assert md[c.RL_REWARD_COMPONENT_PREFIX + "MathReward"] == 1.0 and md[c.RL_POLICY_VERSION] == 3
    assert md[c.RL_METADATA_PREFIX + "padded_request_len"] == 512
    assert md[c.RL_METADATA_PREFIX + "completion.num_cached_tokens"] == 8
    assert md[c.RL_METADATA_PREFIX + "target"] == "4"


def test_sample_dicts_from_top_bottom_heaps_recorded_once(memory):
    """``SampleAccumulator`` with fewer samples than top_k + bottom_k returns the same dict in both
    heaps, and global_reduce concatenates ranks: each episode must appear once."""
    a = make_episode(0, "the answer is 4", 1.0, 1.0).to_dict(exclude=["ref_logprobs", "completion"])
    b = make_episode(1, "no", 0.0, 0.0).to_dict(exclude=["ref_logprobs", "completion"])
    state = {"reduction_type": "sample", "samples": [b, a, b, a, a]}  # bottoms + tops, 2 ranks
    assert record_episodes(state, step=2) == ["uuid-1", "uuid-0"]
    otr.flush()
    eps = episodes(memory)
    assert sorted(eps) == ["uuid-0", "uuid-1"]
    assert eps["uuid-0"]["root"][c.RL_REWARD_COMPONENT_PREFIX + "MathReward"] == 1.0  # flattened column
    assert c.RL_REWARD_COMPONENT_PREFIX + "pad_id" not in eps["uuid-0"]["root"]
    assert otr.stats()["steps"]["2/train"]["adapters.duplicates"] == 3


def test_streamed_dict_string_rewards_placeholder_version_and_mutation(memory):
    """per_rank_no_reduce streams one dict; legacy values as text; -1 version; mutated later."""
    sample = make_episode(7, "the answer is 4", 1.0, 0.5, version=-1).to_dict(
        exclude=["ref_logprobs", "completion"])
    sample.update(reward="0.750", advantage="0.25", MathReward="1.0")
    record_episodes(sample, step=1)
    sample["response"] = "MUTATED"
    sample["MathReward"] = 0.0
    bad = make_episode(8, "x", 1.0, 0.5).to_dict(exclude=["ref_logprobs", "completion"])
    bad["reward"] = "n/a"
    record_episodes([bad], step=1)
    otr.flush()

    eps = episodes(memory)
    a = eps["uuid-7"]["root"]
    assert a[c.RL_REWARD] == 0.75 and a[c.RL_ADVANTAGE] == 0.25
    assert a[c.RL_REWARD_COMPONENT_PREFIX + "MathReward"] == 1.0
    assert c.RL_POLICY_VERSION not in a and c.RL_STALENESS not in a  # -1 placeholder ignored
    assert messages_of(memory)["uuid-7"][1]["content"] == "the answer is 4"
    flagged = eps["uuid-8"]["root"]
    assert c.RL_REWARD not in flagged and flagged[c.RL_REWARD_COMPONENT_PREFIX + "ThinkingReward"] == 0.5
    assert any("uuid-8" in m and "reward" in m for m in flagged[c.RL_INVALID_FIELDS])


def test_cap_per_step_across_calls(otr_shutdown):
    mem = configure_memory(cap=2, policy="first")
    for call in range(3):  # continuous_rollouts records group after group
        record_episodes([make_episode(f"{call}-{i}", "the answer is 4", 1.0, 0.5) for i in range(2)],
                        step=9)
    otr.end_step(9)
    otr.flush()
    assert len(episodes(mem)) == 2 and otr.stats()["steps"]["9/train"]["seen"] == 6


# --- issue #13: one policy-version definition, reward terms only, readable text, unknowns ---
def test_staleness_only_against_the_trained_version(memory):
    """``generator_version`` counts the optimizer steps of the generating weights; the consuming
    training step is not known where forge logs samples, so staleness needs ``trained_version``
    (the old adapter took ``step - version``, i.e. 0 when called with the policy version)."""
    on, off = make_episode(0, "the answer is 4", 1.0, 0.5, version=4), make_episode(1, "no", 0.0, 0.0, version=2)
    record_episodes([on, off], step=4, trained_version=4)
    record_episodes([make_episode(2, "the answer is 4", 1.0, 0.5, version=4)], step=9)
    otr.flush()
    eps = episodes(memory)
    assert eps["uuid-0"]["root"][c.RL_POLICY_VERSION] == 4 and eps["uuid-0"]["root"][c.RL_STALENESS] == 0
    assert eps["uuid-1"]["root"][c.RL_POLICY_VERSION] == 2 and eps["uuid-1"]["root"][c.RL_STALENESS] == 2
    unknown = eps["uuid-2"]["root"]
    assert unknown[c.RL_POLICY_VERSION] == 4 and c.RL_STALENESS not in unknown


def test_only_reward_function_columns_are_reward_terms(caplog, memory):
    """forge's main copies ``reward`` into a ``score`` column for the sample table; other numeric
    columns that are not terms of the reward are metadata (with a warning), not rewards."""
    import logging


    sample = make_episode(0, "the answer is 4", 1.0, 0.5).to_dict(exclude=["ref_logprobs", "completion"])
    sample["score"] = sample["reward"]
    extra = make_episode(1, "the answer is 4", 1.0, 0.5).to_dict(exclude=["ref_logprobs", "completion"])
    extra["num_turns"] = 3
    with caplog.at_level(logging.WARNING, logger="otel_rollouts"):
        record_episodes([sample, extra], step=1)
    otr.flush()
    eps = episodes(memory)
    for eid in ("uuid-0", "uuid-1"):
        root = eps[eid]["root"]
        assert {k for k in root if k.startswith(c.RL_REWARD_COMPONENT_PREFIX)} == {
            c.RL_REWARD_COMPONENT_PREFIX + "MathReward", c.RL_REWARD_COMPONENT_PREFIX + "ThinkingReward"}
        assert root[c.RL_REWARD] == 0.75
    assert eps["uuid-1"]["root"][c.RL_METADATA_PREFIX + "num_turns"] == 3.0
    assert sum("num_turns" in r.getMessage() for r in caplog.records) == 1


def test_chat_templated_request_is_split_and_text_is_clean_with_a_tokenizer(memory):
    from tokenizer_fixture import build_tokenizer

    tok = build_tokenizer()
    request = tok.apply_chat_template([{"role": "system", "content": "You are a helpful assistant."},
                                       {"role": "user", "content": "What is 17 * 23?"}],
                                      tokenize=False, add_generation_prompt=True)
    call = '<tool_call>\n{"name": "calculator", "arguments": {"expression": "17 * 23"}}\n</tool_call><|im_end|>'
    ep = make_episode(0, call, 1.0, 0.5)
    ep.request = request
    record_episodes([ep, make_episode(1, "The answer is 391.<|im_end|>", 1.0, 0.5)], step=1, tokenizer=tok)
    otr.flush()
    msgs = messages_of(memory)
    assert msgs["uuid-0"][:2] == [{"role": "system", "content": "You are a helpful assistant."},
                                  {"role": "user", "content": "What is 17 * 23?"}]
    assert msgs["uuid-0"][2]["tool_calls"][0]["function"]["name"] == "calculator"
    assert msgs["uuid-1"][-1] == {"role": "assistant", "content": "The answer is 391."}
    for conv in msgs.values():
        assert not any(t in (m.get("content") or "") for m in conv for t in ("<|im_start|>", "<|im_end|>"))
    assert episodes(memory)["uuid-0"]["by_kind"][c.KIND_TOOL][0].attributes[c.GEN_AI_TOOL_NAME] == "calculator"


def test_unknown_samples_and_versions_warn_once(caplog, memory):
    import logging


    odd = make_episode(0, "the answer is 4", 1.0, 0.5).to_dict(exclude=["ref_logprobs", "completion"])
    odd["policy_version"] = "latest"
    with caplog.at_level(logging.WARNING, logger="otel_rollouts"):
        record_episodes([odd, 42], step=1)
        record_episodes([42.5], step=1)
    otr.flush()
    messages = [r.getMessage() for r in caplog.records if "adapters.torchforge" in r.getMessage()]
    assert sum("episode:" in m for m in messages) == 1 and sum("policy_version:" in m for m in messages) == 1
    assert c.RL_POLICY_VERSION not in episodes(memory)["uuid-0"]["root"]
    assert len(episodes(memory)) == 3
    assert otr.stats()["totals"]["adapters.unknown_structure"] >= 3


def test_episodes_take_the_columnar_path_text_only_for_the_samples_the_sampler_may_keep(
        otr_shutdown, monkeypatch):
    prompts = count_prompts(monkeypatch)
    mem = configure_memory(cap=2, policy="top_bottom")
    batch = [make_episode(i, "the answer is 4", float((i * 7) % 40), 0.0) for i in range(40)]
    ids = record_episodes(batch, step=4)
    otr.end_step(4)
    assert otr.flush() and len(ids) == 40
    kept = sorted(e["root"][c.RL_REWARD] for e in episodes(mem).values())
    assert kept == [0.0, 19.5]  # (math + thinking) / 2 of the lowest and highest
    assert len(prompts) == 2  # the other 38 never had their request split or their turn recorded
