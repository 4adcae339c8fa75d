"""AReaL adapter against AReaL 1.0.4's own code paths (CPU; nothing downloaded).

The trajectories are built by AReaL itself: its ``RLVRWorkflow`` and ``MultiTurnWorkflow``
(``areal.workflow.rlvr`` / ``multi_turn``), grouped by ``GroupedRolloutWorkflow`` with
``concat_padded_tensors``, run and filtered by its ``WorkflowExecutor`` (staleness manager,
``should_accept_fn``; rejected groups come back as ``None`` from ``wait``), moved through
``RTensor.remotize`` as in single-controller mode, and its string-only trajectories built by
``concat_string_interactions``. Reward functions run in AReaL's ``AsyncRewardWrapper`` process
pool.

The one stand-in: the inference engine. AReaL's workflows accept any ``InferenceEngine`` whose
``agenerate`` returns a ``ModelResponse``; here it answers from a script (no GPU or SGLang server
on CPU CI), stamping each generated token with its current weight version as
``RemoteInfEngine`` does. The tokenizer is the test's real byte-level BPE with a ChatML template.

Regression tests for what the adapter lacked with AReaL 1.0.4 (issue #13): no ``rl.staleness``
(the trainer's version was never compared with the tokens' versions), no ``rl.turn.count``,
partial alignment only under ``rl.metadata``, unknown trajectory keys and AReaL's string-only
trajectories dropped silently.
"""

from __future__ import annotations

import asyncio
import logging
import uuid

import pytest
from adapter_fixtures import episodes, messages_of
from frameworks import require
from tokenizer_fixture import build_tokenizer

import otel_rollouts as otr
from otel_rollouts import conventions as c
from otel_rollouts.adapters import areal

TOK = build_tokenizer()
SYSTEM = {"role": "system", "content": "You are a helpful assistant."}
MARKUP = ("<|im_start|>", "<|im_end|>", "<|endoftext|>")
# question -> the scripted completions (in call order) and the reference answer
SCRIPT = {
    "What is 2 + 2?": (["The answer is 4.<|im_end|>", "The answer is 5.<|im_end|>"], "4"),
    "What is 17 * 23?": (["The answer is 391.<|im_end|>", "The answer is 4.<|im_end|>"], "391"),
    "Think step by step.": (["The quick brown fox.<|im_end|>", "The lazy dog.<|im_end|>"], "7"),
}
RETRY = ("Your answer is either wrong or not parsable to the reward function. You may misunderstand "
         "the original question. Please carefully read the original question, check the previous "
         "errors, and try to answer it again.")


@pytest.fixture(autouse=True)
def keep_logging():
    """AReaL's ``areal.utils.logging.getLogger`` (called when its modules are imported and when a
    ``WorkflowExecutor`` starts) replaces ``logging.Logger.root`` and ``Logger.manager`` with new
    ones: every logger looked up afterwards (``otel_rollouts`` included) is cut off the real root,
    where pytest's ``caplog`` listens. Put them back after each test, so the rest of the session
    is unaffected."""
    saved = logging.Logger.root, logging.Logger.manager
    yield saved
    logging.Logger.root, logging.Logger.manager = saved


def reward_fn(prompt, completions, prompt_ids, completion_ids, answer, **kwargs):
    """A verifier in AReaL's reward-function signature (run in AReaL's process pool)."""
    return 1.0 if f"is {answer}." in completions else 0.0


def modules():
    """AReaL's modules the tests use (skip locally, fail under CI when AReaL is missing)."""
    require("areal")
    import areal.api as api
    import areal.api.cli_args as cli_args
    import areal.experimental.openai.types as openai_types
    import areal.infra.remote_inf_engine as remote
    import areal.infra.rpc.rtensor as rtensor
    import areal.infra.workflow_executor as executor
    import areal.utils.data as data
    import areal.workflow.multi_turn as multi_turn
    import areal.workflow.rlvr as rlvr

    return api, cli_args, rlvr, multi_turn, remote, executor, rtensor, data, openai_types


def scripted_engine(replies=None, version=0):
    """The smallest ``InferenceEngine`` AReaL's workflows accept: completions from a script.

    ``replies``: per question, the completions in call order (default ``SCRIPT``); a callable
    ``replies(question, call_number) -> (text, version or None)`` for versions that change during
    an episode. Every generated token carries the engine's version, as in ``RemoteInfEngine``.
    """
    api = modules()[0]

    class ScriptedEngine(api.InferenceEngine):
        def __init__(self):
            self._version = version
            self.calls: dict[str, int] = {}

        def initialized(self):
            return True

        def set_version(self, v):
            self._version = v

        def get_version(self):
            return self._version

        async def agenerate(self, req):
            prompt = TOK.decode(req.input_ids)
            question = next(q for q in SCRIPT if q in prompt)
            k = self.calls.get(question, 0)
            self.calls[question] = k + 1
            if callable(replies):
                text, v = replies(question, k)
                if v is not None:
                    self._version = v
            else:
                text = (replies or SCRIPT)[question][0][k]
            out = TOK.encode(text, add_special_tokens=False)
            return api.ModelResponse(input_tokens=list(req.input_ids), output_tokens=out,
                                     output_logprobs=[-0.5] * len(out),
                                     output_versions=[self._version] * len(out),
                                     stop_reason="stop" if out and out[-1] == TOK.eos_token_id else "length",
                                     tokenizer=TOK)

    return ScriptedEngine()


def sample(question: str) -> dict:
    return {"messages": [SYSTEM, {"role": "user", "content": question}], "answer": SCRIPT[question][1]}


def rollout(engine, questions, *, group_size=2, accept=None):
    """AReaL's own rollout path: ``WorkflowExecutor.submit`` + ``wait`` over ``RLVRWorkflow`` groups."""
    api, cli_args, rlvr, _, remote, executor_mod, *_ = modules()
    gconfig = cli_args.GenerationHyperparameters(n_samples=1, max_new_tokens=32)
    workflow = remote.GroupedRolloutWorkflow(rlvr.RLVRWorkflow(reward_fn, gconfig, TOK), group_size,
                                             logging.getLogger("test"))
    config = cli_args.InferenceEngineConfig(consumer_batch_size=len(questions), max_head_offpolicyness=4,
                                            max_concurrent_rollouts=len(questions))
    ex = executor_mod.WorkflowExecutor(config, engine)
    ex.initialize(train_data_parallel_size=1)
    try:
        for q in questions:
            ex.submit(sample(q), workflow, should_accept_fn=accept)
        return ex.wait(len(questions), timeout=120)
    finally:
        ex.destroy()


def clean(text: str) -> bool:
    return not any(m in text for m in MARKUP)


def by_prompt(msgs: dict) -> dict:
    """Episode ids by (question, assistant text of the last turn)."""
    out = {}
    for eid, conv in msgs.items():
        users = [m["content"] for m in conv if m["role"] == "user"]
        answers = [m["content"] for m in conv if m["role"] == "assistant"]
        if users and answers:
            out[(users[0], answers[-1])] = eid
    return out


def test_rlvr_groups_from_the_workflow_executor(memory):
    """Text as a person reads it, the verifier's reward as the only reward term, on-policy
    staleness 0, groups from AReaL's grouping, a rejected group as a filtered episode."""
    engine = scripted_engine(version=3)
    accept = lambda traj: float(traj["rewards"].sum()) > 0  # noqa: E731 - AReaL's dynamic filtering
    batch = rollout(engine, list(SCRIPT), accept=accept)
    assert sum(t is None for t in batch) == 1  # "Think step by step." earns no reward: rejected
    truth = {}  # (question, completion) -> AReaL's own reward for it
    for traj in batch:
        if traj is None:
            continue
        for row in range(traj["input_ids"].shape[0]):
            n = int(traj["attention_mask"][row].sum())
            text = TOK.decode(traj["input_ids"][row, :n].tolist())
            question = next(q for q in SCRIPT if q in text)
            answer = text.rsplit("<|im_start|>assistant\n", 1)[1].removesuffix("<|im_end|>")
            truth[(question, answer)] = float(traj["rewards"][row])
    assert len(truth) == 4

    assert areal.record_trajectories(batch, step=3, tokenizer=TOK) == 5
    assert otr.flush()
    eps = episodes(memory)
    msgs = messages_of(memory)
    assert len(eps) == 5
    rejected = [e for e in eps.values() if e["root"].get(c.RL_STATUS) == c.STATUS_FILTERED]
    assert len(rejected) == 1
    index = by_prompt(msgs)
    assert set(index) == set(truth)
    groups = {}
    for (question, answer), eid in index.items():
        root, conv = eps[eid]["root"], msgs[eid]
        # the rendered prompt split back into AReaL's data messages; no markup or EOS in any role
        assert conv == [SYSTEM, {"role": "user", "content": question}, {"role": "assistant", "content": answer}]
        assert all(clean(m["content"]) for m in conv)
        # rewards: AReaL's reward tensor, nothing else under rl.reward.component.*
        assert root[c.RL_REWARD] == truth[(question, answer)]
        assert [k for k in root if k.startswith(c.RL_REWARD_COMPONENT_PREFIX)] == []
        assert {k for k in root if k.startswith(c.RL_METADATA_PREFIX)} == {
            c.RL_METADATA_PREFIX + "trajectory_index", c.RL_METADATA_PREFIX + "sample_index_in_group"}
        # version 3 generated, the actor at global_step 3 has received 3 updates: on-policy
        assert root[c.RL_POLICY_VERSION] == 3 and root[c.RL_STALENESS] == 0
        assert c.RL_POLICY_VERSION_MIN not in root
        assert root[c.RL_TURN_COUNT] == 1
        assert root[c.RL_FINISH_REASON] == c.FINISH_STOP and root[c.RL_STATUS] == c.STATUS_OK
        groups.setdefault(question, set()).add(root[c.RL_GROUP_ID])
    # the two samples of a question share their group; questions have distinct groups
    assert all(len(g) == 1 for g in groups.values()) and len(set().union(*groups.values())) == 2
    assert otr.stats()["steps"]["3/train"]["adapters.filtered"] == 1


def test_multi_turn_retry_prompt_keeps_its_user_role_and_versions_across_an_update(memory):
    """``MultiTurnWorkflow``: the retry prompt AReaL inserts after a wrong answer is a user message
    (not a tool result), clean even when AReaL appended the EOS the model did not emit; the
    discounted reward is the reward; a weight update during the episode gives min/max versions;
    groups concatenated by ``concat_padded_tensors`` (versions padded with 0, not -1)."""
    _, cli_args, _, multi_turn, _, _, _, data, _ = modules()

    def replies(question, k):
        if question == "What is 2 + 2?":  # wrong, no EOS (length) -> retry at version 5 -> right
            return [("5", 4), ("The answer is 4.<|im_end|>", 5)][k]
        return ("The answer is 391.<|im_end|>", 5)

    engine = scripted_engine(replies, version=4)
    gconfig = cli_args.GenerationHyperparameters(n_samples=1, max_new_tokens=32)
    workflow = multi_turn.MultiTurnWorkflow(reward_fn, gconfig, TOK, max_turns=3, turn_discount=0.5)
    first = asyncio.run(workflow.arun_episode(engine, sample("What is 2 + 2?")))
    second = asyncio.run(workflow.arun_episode(engine, sample("What is 17 * 23?")))
    group = data.concat_padded_tensors([first, second])
    assert group["rewards"].tolist() == [0.5, 1.0]  # AReaL discounted the retried answer

    areal.record_trajectories([group], step=6, tokenizer=TOK)
    assert otr.flush()
    eps, msgs = episodes(memory), messages_of(memory)
    retried, direct = eps["train-6-0-0"]["root"], eps["train-6-0-1"]["root"]
    assert msgs["train-6-0-0"] == [
        SYSTEM, {"role": "user", "content": "What is 2 + 2?"}, {"role": "assistant", "content": "5"},
        {"role": "user", "content": RETRY}, {"role": "assistant", "content": "The answer is 4."}]
    assert all(clean(m["content"]) for conv in msgs.values() for m in conv)
    feedback = [s for s in eps["train-6-0-0"]["spans"] if c.RL_FEEDBACK_ROLE in s.attributes]
    assert [s.attributes[c.RL_FEEDBACK_ROLE] for s in feedback] == ["user"]
    assert not eps["train-6-0-0"]["by_kind"][c.KIND_TOOL]
    assert retried[c.RL_REWARD] == 0.5 and direct[c.RL_REWARD] == 1.0
    assert retried[c.RL_TURN_COUNT] == 2 and direct[c.RL_TURN_COUNT] == 1
    # tokens from versions 4 and 5; the actor at step 6 has 6 updates
    assert retried[c.RL_POLICY_VERSION_MIN] == 4 and retried[c.RL_POLICY_VERSION_MAX] == 5
    assert retried[c.RL_POLICY_VERSION] == 5 and retried[c.RL_STALENESS] == 1
    # the shorter row is padded with version 0 by concat_padded_tensors: never read as a version
    assert direct[c.RL_POLICY_VERSION] == 5 and c.RL_POLICY_VERSION_MIN not in direct


def test_off_policy_staleness_and_eval(memory):
    """Samples generated two updates ago: staleness 2 by default (trained version = global_step),
    an explicit ``trained_version`` wins; evaluation samples get a version but no staleness."""
    batch = rollout(scripted_engine(version=1), ["What is 2 + 2?"])
    areal.record_trajectories(batch, step=3, tokenizer=TOK)
    areal.record_trajectories(batch, step=4, tokenizer=TOK, trained_version=2)
    areal.record_trajectories(batch, step=3, tokenizer=TOK, split="eval-rollout")
    assert otr.flush()
    eps = episodes(memory)
    assert [eps[f"train-3-0-{j}"]["root"][c.RL_STALENESS] for j in range(2)] == [2, 2]
    assert [eps[f"train-4-0-{j}"]["root"][c.RL_STALENESS] for j in range(2)] == [1, 1]
    evaluation = eps["eval-3-0-0"]["root"]
    assert evaluation[c.RL_POLICY_VERSION] == 1 and c.RL_STALENESS not in evaluation


def test_rtensor_trajectories_are_localized_once(memory):
    """Single-controller mode: the trajectories are ``RTensor``s (meta tensors plus a shard);
    the adapter localizes each once and records what the local tensors hold."""
    rtensor = modules()[6]

    class InProcessBackend:  # AReaL's storage functions, without the HTTP hop
        def store(self, tensor):
            shard_id = uuid.uuid4().hex
            rtensor.store(shard_id, tensor)
            return shard_id

        def fetch(self, shards):
            self.fetched = getattr(self, "fetched", 0) + len(shards)
            return [rtensor.fetch(s.shard_id) for s in shards]

        async def delete(self, node_addr, shard_ids):
            for shard_id in shard_ids:
                rtensor.remove(shard_id)

    backend = InProcessBackend()
    rtensor.set_backend(backend)
    try:
        batch = rollout(scripted_engine(version=2), ["What is 2 + 2?", "What is 17 * 23?"])
        remote = rtensor.RTensor.remotize(batch, node_addr="in-process")
        assert all(isinstance(v, rtensor.RTensor) and v.data.is_meta for t in remote for v in t.values())
        areal.record_trajectories(remote, step=2, tokenizer=TOK)
        assert backend.fetched == sum(len(t) for t in remote)  # each tensor fetched exactly once
    finally:
        rtensor.set_backend(None)
        rtensor.clear_fetch_buffer()
    assert otr.flush()
    eps, msgs = episodes(memory), messages_of(memory)
    assert len(eps) == 4
    for eid, conv in msgs.items():
        root = eps[eid]["root"]
        assert conv[:2] == [SYSTEM, {"role": "user", "content": conv[1]["content"]}]
        assert conv[2]["content"] in {t.removesuffix("<|im_end|>") for q in SCRIPT for t in SCRIPT[q][0]}
        assert root[c.RL_REWARD] == reward_fn("", conv[2]["content"], [], [], SCRIPT[conv[1]["content"]][1])
        assert root[c.RL_POLICY_VERSION] == 2 and root[c.RL_STALENESS] == 0


def test_string_only_interactions(memory):
    """External-API trajectories (``concat_string_interactions``): request messages, response
    text with a Hermes tool call, reward — recorded instead of dropped."""
    *_, openai_types = modules()
    interaction = openai_types.InteractionWithTokenLogpReward(
        messages=[SYSTEM, {"role": "user", "content": "What is 17 * 23?"}],
        output_message_list=[{"role": "assistant", "content":
                              '<tool_call>\n{"name": "calculator", "arguments": {"expression": "17 * 23"}}\n'
                              "</tool_call><|im_end|>"}],
        reward=1.0,
    )
    trajectory = openai_types.concat_string_interactions({"c1": interaction})
    assert areal.record_trajectories([trajectory], step=1, tokenizer=TOK) == 1
    assert otr.flush()
    (ep,) = episodes(memory).values()
    (conv,) = messages_of(memory).values()
    assert conv[:2] == [SYSTEM, {"role": "user", "content": "What is 17 * 23?"}]
    assert conv[2]["tool_calls"][0]["function"]["name"] == "calculator"
    assert all(clean(m.get("content") or "") for m in conv)
    assert ep["root"][c.RL_REWARD] == 1.0 and ep["root"][c.RL_TURN_COUNT] == 1
    assert ep["by_kind"][c.KIND_TOOL][0].attributes[c.GEN_AI_TOOL_NAME] == "calculator"


def test_unknown_trajectory_keys_and_shapes_warn_once(caplog, memory, keep_logging):
    """A key no stock workflow writes, and a trajectory of unknown shape: a warning per field,
    counted every time, never a guess."""
    batch = rollout(scripted_engine(version=0), ["What is 2 + 2?"])
    logging.Logger.root, logging.Logger.manager = keep_logging  # see keep_logging
    batch[0]["my_custom_score"] = batch[0]["rewards"] * 2
    with caplog.at_level(logging.WARNING, logger="otel_rollouts"):
        areal.record_trajectories(batch, step=0, tokenizer=TOK)
        areal.record_trajectories(batch, step=0, tokenizer=TOK)
        areal.record_trajectories([{"something": "else"}], step=0, tokenizer=TOK)
    warned = [r.getMessage() for r in caplog.records if "my_custom_score" in r.getMessage()]
    assert len(warned) == 1
    assert any("trajectory:" in r.getMessage() for r in caplog.records)
    assert otr.stats()["totals"]["adapters.unknown_structure"] >= 4
    assert otr.flush()
    eps = episodes(memory)
    root = eps["train-0-0-0"]["root"]
    assert not any("my_custom_score" in k for k in root)
    assert [k for k in root if k.startswith(c.RL_REWARD_COMPONENT_PREFIX)] == []
    assert eps["train-0-0-unknown"]["root"][c.RL_STATUS] == c.STATUS_ERROR


@pytest.mark.parametrize("split,expected", [("rollout", "train"), ("eval-rollout", "eval")])
def test_areal_split_names_real(memory, split, expected):
    batch = rollout(scripted_engine(version=0), ["What is 2 + 2?"], group_size=1)
    areal.record_trajectories(batch, step=0, tokenizer=TOK, split=split)
    assert otr.flush()
    (ep,) = episodes(memory).values()
    assert ep["root"][c.RL_SPLIT] == expected
