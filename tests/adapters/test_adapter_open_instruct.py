"""Open-Instruct adapter: batches shaped like open_instruct's Batch / GenerationResult / RequestInfo.

The structures are those of ``test_open_instruct_source`` (Open-Instruct's source at
``e6c3044a``, 2026-08-20, field by field); ``make`` below builds small hand-made batches for the
alignment, sampling and version checks, ``test_open_instruct_source`` the path's real output.
"""

from __future__ import annotations

import numpy as np
import pytest
from adapter_fixtures import configure_memory, count_prompts, episodes, ids, messages_of, tokenizer
from otr_helpers import trackio_rows
from test_open_instruct_source import (
    QUESTION,
    TOK,
    Batch,
    Call,
    Engine,
    GenerationResult,
    RequestInfo,
    ToolCallStats,
    dataset_row,
    hermes_call,
    prepare,
)

import otel_rollouts as otr
from otel_rollouts import conventions as c
from otel_rollouts.adapters import open_instruct

G = 2  # samples per prompt


def make(n_groups: int = 2, *, tools: bool = True):
    """``n_groups`` x G samples, blocked; sample 1 of group 0 called python once."""
    queries, raw, decoded, responses, masks, finish = [], [], [], [], [], []
    scores, datasets, indices, steps, truths = [], [], [], [], []
    stats, outputs, calls = [], [], []
    for g in range(n_groups):
        q = f"what is {g + 2} + 3 ?"
        for r in range(G):
            i = g * G + r
            queries.append(ids(f"<|im_start|> user {q} <|im_end|>"))
            raw.append(f"system: be brief\nuser: {q}")
            if tools and i == 1:
                model1, tool, model2 = ids("<tool_call> python print ( 5 ) </tool_call>"), ids(
                    "<tool_response> 5 </tool_response>"), ids("the answer is 5 <eos>")
                responses.append(model1 + tool + model2)
                masks.append([1] * len(model1) + [0] * len(tool) + [1] * len(model2))
                stats.append([ToolCallStats("python", True, 0.25)])
                outputs.append("5")
                calls.append(1)
            else:
                resp = ids(f"the answer is {g + 5 - r} <eos>")
                responses.append(resp)
                masks.append([1] * len(resp))
                stats.append([])
                outputs.append("")
                calls.append(0)
            decoded.append(tokenizer().decode(responses[-1], skip_special_tokens=False))
            finish.append("length" if i == 3 else "stop")
            scores.append(float(r == 0))
            datasets.append(["gsm8k"])  # the default transform wraps it
            indices.append(100 + g)
            steps.append(6)
            truths.append([str(g + 5)])
    n = len(responses)
    info = RequestInfo(num_calls=calls, timeouts=[0] * n, tool_errors=[""] * n, tool_outputs=outputs,
                       tool_runtimes=[0.25 if k else 0.0 for k in calls], tool_calleds=[bool(k) for k in calls],
                       tool_call_stats=stats,
                       rollout_states=[{"rewards": [0.0, 1.0] if k else [], "step_count": k} for k in calls])
    batch = Batch(queries=queries, ground_truths=truths, datasets=datasets, raw_queries=raw,
                  decoded_responses=decoded, indices=indices, scores=scores, model_steps=steps)
    result = GenerationResult(responses=responses, finish_reasons=finish, masks=masks, request_info=info,
                              index=None, prompt_id=None)
    advantages = np.array([0.7, -0.7] * n_groups, dtype=np.float64)
    return batch, result, advantages


def source_batch(n_groups: int = 2, *, tools: bool = True, model_step: int = 6):
    """What ``make_batch_from_groups`` hands the loop: ``n_groups`` prompts x G samples; sample 1
    of group 0 called the calculator once (Hermes), sample 3 ran out of tokens."""
    engine, groups = Engine(), []
    for g in range(n_groups):
        question = [QUESTION[0], {"role": "user", "content": f"What is {g + 2} + 3?"}]
        row = dataset_row(question, str(g + 5), "gsm8k")
        outputs = []
        for r in range(G):
            i = g * G + r
            if tools and i == 1:
                turns = [(hermes_call("calculator", expression="2 + 3"), [Call("calculator", "5", runtime=0.25,
                                                                              reward=1.0)]),
                         ("The answer is 5.", [])]
            else:
                turns = [(f"The answer is {g + 5 - r}.", [])]
            outputs.append(engine.sample(turns, finish="length" if i == 3 else "stop"))
        scores = [float(r == 0) for r in range(G)]
        groups.append((row, Engine.result(outputs, 100 + g, row, scores, model_step)))
    return prepare(groups)


def test_batch_round_trips_through_trackio_with_tools_and_numbers(otr_shutdown):
    project = "otr-test-open-instruct"
    exporter = configure_memory(trackio_project=project)
    batch, result, adv = source_batch()
    n = open_instruct.record_batch(batch, result, step=7, advantages=adv, num_samples_per_prompt=G,
                                   tokenizer=TOK)
    eval_batch, eval_result, _ = source_batch(1, tools=False)
    open_instruct.record_batch(eval_batch, eval_result, step=7, split="eval", tokenizer=TOK)
    otr.end_step(7)
    assert n == 4 and otr.flush()
    eps = episodes(exporter)
    assert sorted(eps) == ["eval-7-0", "eval-7-1", "train-7-0", "train-7-1", "train-7-2", "train-7-3"]
    root = eps["train-7-1"]["root"]
    assert root[c.RL_SYSTEM_NAME] == "open-instruct" and root[c.RL_GROUP_ID] == "100"
    assert root[c.RL_POLICY_VERSION] == 6 and root[c.RL_STALENESS] == 1
    assert root[c.RL_DATASET_NAME] == "gsm8k" and root[c.RL_DATASET_INDEX] == 100
    assert root[c.RL_REWARD] == 0.0 and root[c.RL_ADVANTAGE] == pytest.approx(-0.5)
    assert root["rl.reward.component.env_step_0"] == 1.0
    assert eps["train-7-3"]["root"][c.RL_STATUS] == c.STATUS_TRUNCATED
    assert eps["train-7-2"]["root"][c.RL_GROUP_ID] == "101"
    assert c.RL_ALIGNMENT_KIND not in root

    rows = {r["metadata"]["rl.episode.id"]: r for r in trackio_rows(project)}
    assert len(rows) == 6 and {r["key"] for r in rows.values()} == {"rollouts", "eval/rollouts"}
    row = rows["train-7-1"]
    assert row["step"] == 7
    md = row["metadata"]
    assert md["rl.split"] == "train" and md["rl.step"] == 7 and md["rl.group.id"] == "100"
    assert md["rl.policy.version"] == 6 and isinstance(md["rl.reward.score"], float)
    assert isinstance(md["rl.advantage"], float) and isinstance(md["rl.reward.component.env_step_0"], float)
    msgs = row["messages"]
    assert msgs[0] == {"role": "system", "content": "You are a helpful assistant."}
    assert msgs[1] == {"role": "user", "content": "What is 2 + 3?"}
    assert msgs[2]["role"] == "assistant" and msgs[2]["content"] == ""  # the call is the message
    assert msgs[2]["tool_calls"][0]["function"]["name"] == "calculator"
    assert msgs[3] == {"role": "tool", "tool_call_id": "call_0_0", "name": "calculator", "content": "5"}
    assert msgs[4] == {"role": "assistant", "content": "The answer is 5."}  # no <|im_end|>
    tool = next(s for s in row["spans"] if s["kind"] == "tool")
    assert tool["metadata"][c.RL_TOOL_RUNTIME] == 0.25
    assert rows["eval-7-0"]["metadata"]["rl.split"] == "eval"


def test_ragged_lists_record_every_sample_as_partial_instead_of_indexerror(memory):
    batch, result, adv = make()
    batch.scores = batch.scores[:3]
    batch.datasets = batch.datasets[:2]
    assert open_instruct.record_batch(batch, result, step=1, advantages=adv[:3],
                                      num_samples_per_prompt=G) == 4
    assert otr.flush()
    eps = episodes(memory)
    assert len(eps) == 4
    assert c.RL_ALIGNMENT_KIND not in eps["train-1-0"]["root"]
    assert c.RL_ALIGNMENT_KIND not in eps["train-1-1"]["root"]
    third, fourth = eps["train-1-2"]["root"], eps["train-1-3"]["root"]
    assert third[c.RL_ALIGNMENT_KIND] == "partial" and fourth[c.RL_ALIGNMENT_KIND] == "partial"
    assert any("datasets" in m for m in third[c.RL_ALIGNMENT_MISSING])
    assert third[c.RL_REWARD] == 1.0 and c.RL_REWARD not in fourth
    assert otr.stats()["steps"]["1/train"]["adapters.alignment_partial"] == 2


def test_truncation_filter_never_pairs_request_info_with_another_sample(memory):
    batch, result, adv = make()
    # mask_truncated_completions dropped sample 0 from responses and batch, not from request_info
    for name in ("queries", "raw_queries", "decoded_responses", "scores", "datasets", "indices",
                 "model_steps", "ground_truths"):
        setattr(batch, name, getattr(batch, name)[1:])
    for name in ("responses", "masks", "finish_reasons"):
        setattr(result, name, getattr(result, name)[1:])
    open_instruct.record_batch(batch, result, step=2, advantages=adv[1:], num_samples_per_prompt=G,
                               tokenizer=tokenizer())
    assert otr.flush()
    eps = episodes(memory)
    assert len(eps) == 3
    for ep in eps.values():
        assert not ep["by_kind"][c.KIND_TOOL]  # request_info[i] belongs to sample i+1 now
        assert ep["root"][c.RL_ALIGNMENT_KIND] == "partial"
    assert eps["train-2-0"]["root"][c.RL_GROUP_ID] == "100"  # groups from dataset indices


def test_groups_by_blocked_layout_only_when_complete(memory):
    batch, result, adv = make()
    batch.indices = None
    open_instruct.record_batch(batch, result, step=3, advantages=adv, num_samples_per_prompt=G)
    batch2, result2, _ = make()
    batch2.indices = None
    result2.responses = result2.responses[:3]  # a group lost a sample: i // G would be a guess
    open_instruct.record_batch(batch2, result2, step=4, num_samples_per_prompt=G)
    assert otr.flush()
    eps = episodes(memory)
    assert [eps[f"train-3-{i}"]["root"][c.RL_GROUP_ID] for i in range(4)] == ["0", "0", "1", "1"]
    assert all(c.RL_GROUP_ID not in eps[f"train-4-{i}"]["root"] for i in range(3))


def test_rewards_as_strings_and_numpy_scalars_become_floats_and_no_scores_still_records(memory):
    batch, result, _ = make()
    batch.scores = ["0.5", np.float32(1.5), "oops", 2]
    open_instruct.record_batch(batch, result, step=5, advantages=[np.float64(0.1)] * 4)
    batch2, result2, _ = make()
    batch2.scores = None
    open_instruct.record_batch(batch2, result2, step=6)
    assert otr.flush()
    eps = episodes(memory)
    assert eps["train-5-0"]["root"][c.RL_REWARD] == 0.5
    assert eps["train-5-1"]["root"][c.RL_REWARD] == 1.5
    bad = eps["train-5-2"]["root"]
    assert c.RL_REWARD not in bad and any("scores[2]" in m for m in bad[c.RL_INVALID_FIELDS])
    assert type(eps["train-5-3"]["root"][c.RL_REWARD]) is float
    assert len([e for e in eps if e.startswith("train-6-")]) == 4  # the review's `return` skipped these


def test_content_is_snapshotted_before_the_batch_is_reused(memory):
    batch, result, _ = make(tools=False)
    open_instruct.record_batch(batch, result, step=8)
    batch.decoded_responses[0] = "MUTATED"
    batch.raw_queries[0] = "user: MUTATED"
    result.finish_reasons[0] = "MUTATED"
    assert otr.flush()
    msgs = messages_of(memory)["train-8-0"]
    assert "MUTATED" not in str(msgs) and msgs[-1]["content"] == "the answer is 5 <eos>"


class CountingTokenizer:
    """The real tokenizer, counting decode calls (to see decoding happens only for kept episodes).

    The counter is on the class: decoding uses a private copy of the tokenizer.
    """

    decoded = 0

    def decode(self, token_ids, **kw):
        type(self).decoded += 1
        return tokenizer().decode(token_ids, **kw)


def test_cap_holds_per_step_and_dropped_episodes_are_never_decoded(otr_shutdown):
    exporter = configure_memory(cap=2, policy="first")
    tok = CountingTokenizer()
    CountingTokenizer.decoded = 0
    batch, result, adv = make(4, tools=False)
    batch.raw_queries = batch.decoded_responses = None  # text must come from token ids
    open_instruct.record_batch(batch, result, step=9, advantages=adv, num_samples_per_prompt=G, tokenizer=tok)
    assert CountingTokenizer.decoded == 0  # nothing decoded on the training thread
    otr.end_step(9)
    assert otr.flush()
    eps = episodes(exporter)
    assert len(eps) == 2
    assert CountingTokenizer.decoded == 4  # prompt + response of the 2 kept episodes only
    msgs = messages_of(exporter)[sorted(eps)[0]]
    assert msgs[0]["content"].startswith("<|im_start|> user what is")


def test_a_batch_takes_the_columnar_path_content_only_for_the_samples_the_sampler_may_keep(
        otr_shutdown, monkeypatch):
    prompts = count_prompts(monkeypatch)
    exporter = configure_memory(cap=4, policy="top_bottom")
    batch, result, adv = make(50, tools=False)
    batch.scores = [float((i * 37) % 100) for i in range(100)]
    n = open_instruct.record_batch(batch, result, step=3, advantages=adv, num_samples_per_prompt=G,
                                   tokenizer=tokenizer())
    otr.end_step(3)
    assert n == 100 and otr.flush()
    kept = sorted(e["root"][c.RL_REWARD] for e in episodes(exporter).values())
    assert kept == [0.0, 1.0, 98.0, 99.0]  # the sampler read every sample's score
    assert len(prompts) == 4  # only the candidates had their prompt (and turns) recorded
    assert otr.stats()["steps"]["3/train"]["dropped.sampled_out"] == 96


def test_placeholder_model_steps_are_not_policy_versions(memory):
    batch, result, _ = make(1, tools=False)
    batch.model_steps = [-1, 3]
    open_instruct.record_batch(batch, result, step=4)
    assert otr.flush()
    eps = episodes(memory)
    assert c.RL_POLICY_VERSION not in eps["train-4-0"]["root"]
    assert eps["train-4-1"]["root"][c.RL_POLICY_VERSION] == 3


# --- issue #13: one policy-version definition, reward terms only, unknown structures reported ---
def test_policy_version_and_staleness_by_the_one_definition(memory):
    """``model_steps[i]`` counts the learner updates of the generating weights and ``step`` (the
    consuming ``training_step``) those of the trained ones: on-policy is 0, k steps behind is k;
    an explicit ``trained_version`` wins; evaluation samples get no staleness (they are never
    trained on; the old adapter gave them ``step − model_step``)."""
    batch, result, adv = make(1, tools=False)
    batch.model_steps = [7, 5]
    open_instruct.record_batch(batch, result, step=7, advantages=adv, num_samples_per_prompt=G)
    open_instruct.record_batch(batch, result, step=8, num_samples_per_prompt=G, trained_version=7)
    open_instruct.record_batch(batch, result, step=9, split="eval")
    assert otr.flush()
    eps = episodes(memory)
    on, off = eps["train-7-0"]["root"], eps["train-7-1"]["root"]
    assert on[c.RL_POLICY_VERSION] == 7 and on[c.RL_STALENESS] == 0
    assert off[c.RL_POLICY_VERSION] == 5 and off[c.RL_STALENESS] == 2
    assert [eps[f"train-8-{i}"]["root"][c.RL_STALENESS] for i in range(2)] == [0, 2]
    ev = eps["eval-9-1"]["root"]
    assert ev[c.RL_POLICY_VERSION] == 5 and c.RL_STALENESS not in ev


def test_only_reward_terms_are_rl_reward(memory):
    """Scores and the environment's per-step rewards are rewards; tool-call counters, runtimes,
    ground truths and advantages are not."""
    batch, result, adv = make()
    open_instruct.record_batch(batch, result, step=1, advantages=adv, num_samples_per_prompt=G,
                               tokenizer=tokenizer())
    assert otr.flush()
    root = episodes(memory)["train-1-1"]["root"]
    assert {k for k in root if k.startswith(c.RL_REWARD_COMPONENT_PREFIX)} == {
        c.RL_REWARD_COMPONENT_PREFIX + "env_step_0", c.RL_REWARD_COMPONENT_PREFIX + "env_step_1"}
    assert root[c.RL_REWARD] == 0.0 and root[c.RL_ADVANTAGE] == pytest.approx(-0.7)
    for name in ("num_calls", "tool_runtimes", "ground_truth"):
        assert c.RL_METADATA_PREFIX + name in root


def test_unknown_structures_warn_once_and_are_recorded_as_far_as_understood(caplog, memory):
    import logging


    # each run (configure()) warns once per kind: the `memory` fixture's run is fresh
    batch, result, _ = make()
    batch.model_steps = ["latest", 6, 6, 6]
    batch.raw_queries[2] = "what is 3 + 3 ?"  # not "role: content" lines
    result.request_info.tool_call_stats[1] = [("python", True, 0.25)]  # not a ToolCallStats
    result.masks[3] = result.masks[3][:-1]  # one mask value short
    result.request_info.rollout_states[1] = {"rewards": "1.0", "step_count": 1}
    with caplog.at_level(logging.WARNING, logger="otel_rollouts"):
        for step in (2, 3):
            open_instruct.record_batch(batch, result, step=step, num_samples_per_prompt=G,
                                       tokenizer=tokenizer())
        # raw_queries are read only without a tokenizer (the prompt ids are split otherwise)
        open_instruct.record_batch(batch, result, step=4, num_samples_per_prompt=G)
    assert otr.flush()
    warnings = [r.getMessage() for r in caplog.records if "adapters.open-instruct" in r.getMessage()]
    for name in ("model_steps:", "tool_call_stats:", "masks:", "raw_queries:", "rollout_states.rewards:"):
        assert sum(name in w for w in warnings) == 1, (name, warnings)
    assert otr.stats()["totals"]["adapters.unknown_structure"] >= 10
    eps = episodes(memory)
    assert len(eps) == 12
    first = eps["train-2-0"]["root"]
    assert c.RL_POLICY_VERSION not in first and c.RL_STALENESS not in first
    assert eps["train-2-2"]["root"][c.RL_POLICY_VERSION] == 6
    tool_sample = eps["train-2-1"]
    assert not [k for k in tool_sample["root"] if k.startswith(c.RL_REWARD_COMPONENT_PREFIX)]
    assert len(tool_sample["by_kind"][c.KIND_TOOL]) == 1


def test_tool_runtime_is_the_tool_stage_only_for_samples_that_called_tools(memory):
    """``tool_runtimes[i]`` (the engine's sum over the calls it awaited in turn) is the sample's
    tool time; a sample without calls has none measured (absent, not 0), and no sample has a
    duration (Open-Instruct times no whole rollout)."""
    batch, result, adv = source_batch()
    open_instruct.record_batch(batch, result, step=7, advantages=adv, num_samples_per_prompt=G, tokenizer=TOK)
    assert otr.flush()
    roots = {ep["root"][c.RL_EPISODE_ID]: ep["root"] for ep in episodes(memory).values()}
    tool = c.stage_seconds(c.STAGE_TOOL)
    assert {eid: r[tool] for eid, r in roots.items() if tool in r} == {"train-7-1": 0.25}
    assert all(c.RL_DURATION_SECONDS not in r for r in roots.values())
    assert {r[c.RL_DATASET_INDEX] for r in roots.values()} == {100, 101}
