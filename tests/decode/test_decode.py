"""record_token_batch with a real tokenizer: token-id batches become episodes, decoded lazily."""

from __future__ import annotations

import pytest
import torch
from decode_samples import (
    SYSTEM,
    completion,
    padded,
    prompt,
    retry_episode,
    single_turn,
    tool_episode,
)
from otr_helpers import configure_memory, root, traces, trackio_rows, tree
from tokenizer_fixture import DecodeLog, build_tokenizer, counting_tokenizer, text_ids

import otel_rollouts as otr
from otel_rollouts import conventions as c
from otel_rollouts.exporters._trackio_rows import episode_messages


@pytest.fixture(scope="module")
def tok():
    return build_tokenizer()


def episodes(exporter) -> dict[int, dict]:
    """Exported episodes by sample index: root attributes, span tree, Trackio-style messages."""
    out = {}
    for spans in traces(exporter).values():
        r = root(spans)
        out[r.attributes[c.RL_SAMPLE_INDEX]] = {
            "root": dict(r.attributes), "tree": tree(spans), "spans": spans,
            "messages": episode_messages(spans),
        }
    return out


def record(tok, exporter, *args, step=0, **kwargs):
    summary = otr.record_token_batch(*args, tokenizer=tok, step=step, **kwargs)
    otr.end_step(step)
    assert otr.flush()
    return summary, episodes(exporter)


EXPECTED_TOOL_MESSAGES = [
    {"role": "system", "content": SYSTEM},
    {"role": "user", "content": "What is 17 * 23? Use the calculator tool."},
    {"role": "assistant", "content": "Let me compute.", "tool_calls": [
        {"id": "call_0_0", "type": "function",
         "function": {"name": "calculator", "arguments": '{"expression": "17 * 23"}'}}]},
    {"role": "tool", "tool_call_id": "call_0_0", "name": "calculator", "content": "391"},
    {"role": "assistant", "content": "The answer is 391."},
]


def test_right_padded_batch_read_back_from_trackio(tok, otr_shutdown):
    from otel_rollouts.exporters import TrackioExporter

    project = "otr-test-decode-trackio"
    otr.configure(exporters=[TrackioExporter(project, run="decode")], sampler=otr.TailSampler(10, "first"))
    samples = [tool_episode(tok), single_turn(tok, "Say hi in Japanese.", "こんにちは 🙂", version=2),
               retry_episode(tok)]
    batch = padded(samples, tok.pad_token_id)
    summary = otr.record_token_batch(
        batch["input_ids"], tokenizer=tok, step=5, loss_mask=batch["loss_mask"],
        attention_mask=batch["attention_mask"], versions=batch["versions"],
        rewards=torch.tensor([1.0, 0.5, 0.0]), advantages=torch.tensor([0.5, 0.0, -0.5]),
        group_ids=["g0", "g1", "g2"], model="policy",
    )
    assert summary.recorded == 3 and summary.refused == []
    otr.end_step(5)
    assert otr.flush()
    rows = {r["metadata"]["rl.sample.index"]: r for r in trackio_rows(project)}
    assert sorted(rows) == [0, 1, 2] and {r["step"] for r in rows.values()} == {5}

    tool = rows[0]
    assert tool["messages"] == EXPECTED_TOOL_MESSAGES
    md = tool["metadata"]
    assert md["rl.reward.score"] == 1.0 and md["rl.advantage"] == 0.5 and md["rl.group.id"] == "g0"
    assert (md["rl.policy.version"], md["rl.policy.version_min"], md["rl.policy.version_max"]) == (4, 3, 4)
    assert md["rl.finish_reason"] == "stop" and md["status"] == "ok"
    names = [s["name"] for s in tool["spans"]]
    assert names == ["episode", "prompt", "turn", "chat policy", "execute_tool calculator", "turn",
                     "chat policy", "reward"]
    by_id = {s["id"]: s for s in tool["spans"]}
    call = next(s for s in tool["spans"] if s["name"] == "execute_tool calculator")
    assert call["kind"] == "tool" and call["input"] == {"expression": "17 * 23"} and call["output"] == "391"
    assert by_id[call["parent_id"]]["name"] == "turn"
    segments = samples[0].segments()  # prompt, call, tool result, answer
    chats = [s for s in tool["spans"] if s["kind"] == "generation"]
    assert [ch["usage"] for ch in chats] == [
        {"input_tokens": len(segments[0]), "output_tokens": len(segments[1])},
        {"input_tokens": sum(map(len, segments[:3])), "output_tokens": len(segments[3])},
    ]

    unicode = rows[1]
    assert unicode["messages"] == [{"role": "system", "content": SYSTEM},
                                   {"role": "user", "content": "Say hi in Japanese."},
                                   {"role": "assistant", "content": "こんにちは 🙂"}]
    assert unicode["metadata"]["rl.policy.version"] == 2
    assert "rl.policy.version_min" not in unicode["metadata"]  # one version: no range

    retry = rows[2]
    assert [m["role"] for m in retry["messages"]] == ["system", "user", "assistant", "user", "assistant"]
    assert retry["messages"][3]["content"] == "Please retry: your previous answer was wrong."
    assert [m["content"] for m in retry["messages"] if m["role"] == "assistant"] == [
        "The answer is 5.", "The answer is 4."]


def test_left_and_right_padding_and_ragged_inputs_give_the_same_episodes(tok, memory):
    samples = [tool_episode(tok), single_turn(tok, "Hello?", "Hello there."), retry_episode(tok)]
    results = []
    right = padded(samples, tok.pad_token_id)
    left = padded(samples, tok.pad_token_id, left=True)
    for step, kwargs in enumerate([
        dict(input_ids=right["input_ids"], attention_mask=right["attention_mask"], loss_mask=right["loss_mask"],
             versions=right["versions"]),
        dict(input_ids=left["input_ids"], attention_mask=left["attention_mask"], loss_mask=left["loss_mask"],
             versions=left["versions"]),
        dict(input_ids=[s.ids for s in samples], loss_mask=[s.mask for s in samples],
             versions=[s.versions for s in samples]),
        dict(input_ids=[torch.tensor(s.ids) for s in samples], loss_mask=[torch.tensor(s.mask) for s in samples],
             versions=[torch.tensor(s.versions) for s in samples]),
        # padded ids with unpadded per-sample masks
        dict(input_ids=left["input_ids"], attention_mask=left["attention_mask"],
             loss_mask=[s.mask for s in samples], versions=[s.versions for s in samples]),
    ]):
        ids = kwargs.pop("input_ids")
        memory.clear()
        summary = otr.record_token_batch(ids, tokenizer=tok, step=step, **kwargs)
        otr.end_step(step)
        assert otr.flush()
        assert summary.recorded == 3 and summary.refused == [], summary
        got = episodes(memory)
        results.append({i: (e["messages"], [n for _, n in e["tree"]],
                            e["root"].get(c.RL_POLICY_VERSION), e["root"].get(c.RL_FINISH_REASON))
                        for i, e in got.items()})
    assert results[0][0][0] == EXPECTED_TOOL_MESSAGES
    for other in results[1:]:
        assert other == results[0]


def test_multi_turn_tool_episode_structure(tok, memory):
    s = tool_episode(tok)
    summary, got = record(tok, memory, [s.ids], loss_mask=[s.mask], versions=[s.versions], model="pol")
    assert summary.recorded == 1
    ep = got[0]
    assert ep["tree"] == [(0, "episode"), (1, "prompt"), (1, "turn"), (2, "chat pol"),
                          (2, "execute_tool calculator"), (1, "turn"), (2, "chat pol")]
    assert ep["messages"] == EXPECTED_TOOL_MESSAGES
    tool = next(sp for sp in ep["spans"] if sp.name == "execute_tool calculator")
    assert tool.attributes[c.GEN_AI_OPERATION_NAME] == c.OP_EXECUTE_TOOL
    assert tool.attributes[c.GEN_AI_TOOL_CALL_RESULT] == "391"
    turns = [sp for sp in ep["spans"] if sp.name == "turn"]
    assert [t.attributes[c.RL_TURN_INDEX] for t in turns] == [0, 1]
    chats = [sp for sp in ep["spans"] if sp.name == "chat pol"]
    assert [ch.attributes[c.GEN_AI_RESPONSE_FINISH_REASONS] for ch in chats] == [["stop"], ["stop"]]
    assert c.RL_TOOL_PARSE_ERROR not in ep["root"]
    assert ep["root"][c.RL_POLICY_VERSION_MIN] == 3 and ep["root"][c.RL_POLICY_VERSION_MAX] == 4


def test_later_prompt_runs_without_tool_call_are_not_tool_results(tok, memory):
    s = prompt(tok, "Compute something.")
    s.add(completion(tok, "I will not call a tool."), True)
    s.add(text_ids(tok, "Observation: the environment says hello."), False)  # raw text, no role marker
    s.add(completion(tok, "Done."), True)
    r = retry_episode(tok)
    _, got = record(tok, memory, [s.ids, r.ids], loss_mask=[s.mask, r.mask])
    env = got[0]
    feedback = [sp for sp in env["spans"] if sp.name == "feedback"]
    assert len(feedback) == 1 and feedback[0].attributes[c.RL_FEEDBACK_ROLE] == "environment"
    assert not any(sp.name.startswith("execute_tool") for sp in env["spans"])
    assert {"role": "user", "name": "environment",
            "content": "Observation: the environment says hello."} in env["messages"]
    retry_feedback = [sp for sp in got[1]["spans"] if sp.name == "feedback"]
    assert retry_feedback[0].attributes[c.RL_FEEDBACK_ROLE] == "user"  # from the template's markers


def test_unparseable_tool_call_stays_as_text_with_a_flag(tok, memory):
    bad = '<tool_call>\n{"name": "calculator", "arguments": {"expression": 17 *}}\n</tool_call>'
    s = prompt(tok, "What is 17 * 23?").add(completion(tok, "Let me compute." + bad), True)
    s.add(text_ids(tok, "\n<|im_start|>user\nYour tool call was invalid.<|im_end|>\n<|im_start|>assistant\n"), False)
    s.add(completion(tok, "The answer is 391."), True)
    summary, got = record(tok, memory, [s.ids], loss_mask=[s.mask])
    assert summary.recorded == 1 and summary.refused == []
    ep = got[0]
    assert not any(sp.name.startswith("execute_tool") for sp in ep["spans"])
    assistant = [m for m in ep["messages"] if m["role"] == "assistant"]
    assert assistant[0]["content"] == "Let me compute." + bad and "tool_calls" not in assistant[0]
    errors = ep["root"][c.RL_TOOL_PARSE_ERROR]
    assert len(errors) == 1 and errors[0].startswith("turn 0: invalid JSON in <tool_call>")
    chat = next(sp for sp in ep["spans"] if sp.name == "chat")
    assert chat.attributes[c.RL_TOOL_PARSE_ERROR][0].startswith("invalid JSON")
    feedback = next(sp for sp in ep["spans"] if sp.name == "feedback")
    assert feedback.attributes[c.RL_FEEDBACK_ROLE] == "user"  # no parsed call: not a tool result


def test_openai_style_json_tool_call(tok, memory):
    call = '{"name": "calculator", "arguments": {"expression": "2 + 2"}}'
    s = prompt(tok, "What is 2 + 2?").add(completion(tok, call), True)
    s.add(text_ids(tok, "\n<|im_start|>user\n4<|im_end|>\n<|im_start|>assistant\n"), False)
    s.add(completion(tok, "The answer is 4."), True)
    _, got = record(tok, memory, [s.ids], loss_mask=[s.mask])
    ep = got[0]
    assert [n for _, n in ep["tree"]] == ["episode", "prompt", "turn", "chat", "execute_tool calculator",
                                          "turn", "chat"]
    assert ep["messages"][2] == {"role": "assistant", "content": "", "tool_calls": [
        {"id": "call_0_0", "type": "function",
         "function": {"name": "calculator", "arguments": '{"expression": "2 + 2"}'}}]}
    assert ep["messages"][3] == {"role": "tool", "tool_call_id": "call_0_0", "name": "calculator",
                                 "content": "4"}


def test_empty_completion_and_no_generated_tokens(tok, memory):
    empty = prompt(tok, "Say nothing.").add(completion(tok, ""), True)  # only the EOS was generated
    nothing = prompt(tok, "A prompt the policy never answered.")  # no mask-1 token at all
    zero = prompt(tok, "Also unanswered.").add([], True)
    summary, got = record(tok, memory, [empty.ids, nothing.ids, zero.ids],
                          loss_mask=[empty.mask, nothing.mask, zero.mask], rewards=[0.0, -1.0, -1.0])
    assert summary.recorded == 3 and summary.refused == []
    assert got[0]["messages"][-1] == {"role": "assistant", "content": ""}
    assert got[0]["root"][c.RL_FINISH_REASON] == "stop"
    for i, text in ((1, "A prompt the policy never answered."), (2, "Also unanswered.")):
        assert [n for _, n in got[i]["tree"]] == ["episode", "prompt", "reward"]
        assert got[i]["messages"] == [{"role": "system", "content": SYSTEM}, {"role": "user", "content": text}]
        assert c.RL_FINISH_REASON not in got[i]["root"] and got[i]["root"][c.RL_REWARD] == -1.0


def test_mismatched_lengths_refuse_that_sample_only(tok, memory):
    good = single_turn(tok, "Hello?", "Hello there.")
    bad = single_turn(tok, "Hi?", "Hi.")
    summary, got = record(tok, memory, [good.ids, bad.ids, good.ids],
                          loss_mask=[good.mask, bad.mask[:-2], good.mask], rewards=[1.0, 0.0, 0.5])
    assert summary.refused == [
        (1, f"sample 1: loss_mask has {len(bad.ids) - 2} tokens but input_ids has {len(bad.ids)}")]
    assert summary.recorded == 3
    assert got[0]["messages"][-1] == {"role": "assistant", "content": "Hello there."}
    assert got[2]["messages"] == got[0]["messages"]
    refused = got[1]
    assert refused["root"][c.RL_STATUS] == "error" and refused["root"][c.RL_REWARD] == 0.0
    assert refused["root"][c.RL_INVALID_FIELDS] == [summary.refused[0][1]]
    assert [n for _, n in refused["tree"]] == ["episode", "reward"]
    assert otr.stats()["totals"]["invalid_values"] >= 1


def test_mismatched_2d_shapes_are_refused_with_a_clear_reason(tok, memory):
    batch = padded([single_turn(tok, "a", "b"), single_turn(tok, "c", "d")], tok.pad_token_id)
    summary, got = record(tok, memory, batch["input_ids"], attention_mask=batch["attention_mask"],
                          loss_mask=batch["loss_mask"][:, :-1])
    width = batch["input_ids"].shape[1]
    assert [i for i, _ in summary.refused] == [0, 1]
    assert summary.refused[0][1] == f"sample 0: loss_mask has shape (2, {width - 1}) but input_ids (2, {width})"
    assert all(e["root"][c.RL_STATUS] == "error" for e in got.values())


def test_finish_reasons_inferred_or_given(tok, memory):
    stopped = single_turn(tok, "q1", "An answer.")
    cut = single_turn(tok, "q2", "An answer that ran out of room and", eos=False)
    short = single_turn(tok, "q3", "No EOS but short", eos=False)
    short.ids, short.mask, short.versions = short.ids[:-1], short.mask[:-1], short.versions[:-1]
    batch = padded([stopped, cut, short], tok.pad_token_id)  # `cut` is the longest: it fills the width
    assert len(cut.ids) == batch["input_ids"].shape[1]
    _, got = record(tok, memory, batch["input_ids"], attention_mask=batch["attention_mask"],
                    loss_mask=batch["loss_mask"])
    assert got[0]["root"][c.RL_FINISH_REASON] == "stop" and got[0]["root"][c.RL_STATUS] == "ok"
    assert got[1]["root"][c.RL_FINISH_REASON] == "length" and got[1]["root"][c.RL_STATUS] == "truncated"
    assert c.RL_FINISH_REASON not in got[2]["root"]
    memory.clear()
    _, got = record(tok, memory, batch["input_ids"], step=1, attention_mask=batch["attention_mask"],
                    loss_mask=batch["loss_mask"], finish_reasons=["abort", None, "stop"],
                    statuses=[None, "filtered", None], max_length=len(short.ids))
    assert got[0]["root"][c.RL_FINISH_REASON] == "abort"
    assert got[1]["root"][c.RL_STATUS] == "filtered"
    assert got[2]["root"][c.RL_FINISH_REASON] == "stop"


def test_versions_ignore_placeholders_and_per_sample_versions(tok, memory):
    s = single_turn(tok, "q", "answer", version=7)
    assert -1 in s.versions
    _, got = record(tok, memory, [s.ids, s.ids], loss_mask=[s.mask, s.mask], versions=[s.versions, s.versions])
    assert got[0]["root"][c.RL_POLICY_VERSION] == 7 and c.RL_POLICY_VERSION_MIN not in got[0]["root"]
    memory.clear()
    _, got = record(tok, memory, [s.ids, s.ids], step=1, loss_mask=[s.mask, s.mask], versions=torch.tensor([5, 6]))
    assert [got[i]["root"][c.RL_POLICY_VERSION] for i in (0, 1)] == [5, 6]


def test_dropped_episodes_are_never_decoded():
    log = DecodeLog()
    tok = counting_tokenizer(log)

    exporter = configure_memory(2, "top_bottom")
    try:
        samples = [single_turn(tok, f"Question {i}?", f"The answer is {i}.") for i in range(12)]
        samples[3] = tool_episode(tok)
        batch = padded(samples, tok.pad_token_id)
        rewards = torch.tensor([float(i) for i in range(12)])
        rewards[3] = 100.0  # the tool episode is the top one
        summary = otr.record_token_batch(batch["input_ids"], tokenizer=tok, step=0, loss_mask=batch["loss_mask"],
                                         attention_mask=batch["attention_mask"], rewards=rewards)
        assert summary.recorded == 12
        assert log.calls == 0  # nothing decoded on the training thread
        otr.end_step(0)
        assert otr.flush()
        kept = episodes(exporter)
        assert sorted(kept) == [0, 3]
        expected = [seg for i in (0, 3) for seg in samples[i].segments()]
        assert sorted(log.sequences) == sorted(expected)  # each kept segment once, nothing else
        assert log.calls == len(expected)
        assert kept[3]["messages"] == EXPECTED_TOOL_MESSAGES
    finally:
        otr.shutdown()


def test_content_capture_off_records_structure_without_decoding():
    log = DecodeLog()
    counting = counting_tokenizer(log)

    exporter = configure_memory(10, "first", capture_content=False)
    try:
        s = retry_episode(counting)
        summary, got = record(counting, exporter, [s.ids], loss_mask=[s.mask])
        assert summary.recorded == 1
        assert [n for _, n in got[0]["tree"]] == ["episode", "prompt", "turn", "chat", "feedback", "turn", "chat"]
        assert log.calls == 0
        for sp in got[0]["spans"]:
            assert c.GEN_AI_INPUT_MESSAGES not in sp.attributes and c.GEN_AI_OUTPUT_MESSAGES not in sp.attributes
    finally:
        otr.shutdown()


def test_skip_special_tokens(tok, memory):
    s = prompt(tok, "Echo the pad token.").add(completion(tok, "before<|endoftext|>after"), True)
    _, got = record(tok, memory, [s.ids, s.ids], loss_mask=[s.mask, s.mask])
    assert got[0]["messages"][-1]["content"] == "before<|endoftext|>after"
    memory.clear()
    _, got = record(tok, memory, [s.ids], step=1, loss_mask=[s.mask], skip_special_tokens=True)
    assert got[0]["messages"][-1]["content"] == "beforeafter"


def test_each_tensor_leaves_the_device_once_per_batch(tok, memory):
    calls: list[str] = []

    class Tracked(torch.Tensor):
        """A real tensor that logs the tensor methods called on it (instrumentation)."""

        @classmethod
        def __torch_function__(cls, func, types, args=(), kwargs=None):
            calls.append(getattr(func, "__name__", str(func)))
            return super().__torch_function__(func, types, args, kwargs or {})

    class Remote:
        """Like AReaL's RTensor: no tensor API, only ``to_local()``."""

        def __init__(self, tensor):
            self.tensor, self.localized = tensor, 0
            self.shape = tensor.shape

        def to_local(self):
            self.localized += 1
            return self.tensor

    samples = [single_turn(tok, f"q{i}", f"a{i}") for i in range(8)]
    batch = padded(samples, tok.pad_token_id)
    ids = batch["input_ids"].as_subclass(Tracked)
    remote = Remote(batch["loss_mask"])
    summary, got = record(tok, memory, ids, attention_mask=batch["attention_mask"], loss_mask=remote,
                          versions=batch["versions"])
    assert summary.recorded == 8 and len(got) == 8
    assert remote.localized == 1
    per_sample = [name for name in calls if name in ("__getitem__", "item", "tolist", "cpu")]
    assert per_sample == [], per_sample  # no per-sample indexing or copy of the device tensor
    assert got[5]["messages"][-1] == {"role": "assistant", "content": "a5"}


def test_bad_columns_are_noted_not_raised(tok, memory):
    samples = [single_turn(tok, f"q{i}", f"a{i}") for i in range(3)]
    summary, got = record(tok, memory, [s.ids for s in samples], loss_mask=[s.mask for s in samples],
                          rewards=[1.0, 2.0], group_ids=["a", "b", "c"], metadata={"task": "math"})
    assert summary.recorded == 3
    assert summary.problems == ["rewards: 2 values for 3 samples (alignment partial)"]
    assert [got[i]["root"].get(c.RL_REWARD) for i in range(3)] == [1.0, 2.0, None]
    assert got[2]["root"][c.RL_GROUP_ID] == "c" and got[2]["root"]["rl.metadata.task"] == "math"


def test_token_level_rewards_advantages_components_and_ids(tok, memory):
    samples = [single_turn(tok, "q0", "a0"), single_turn(tok, "q1", "a1")]
    batch = padded(samples, tok.pad_token_id)
    token_rewards = torch.zeros(batch["input_ids"].shape)
    token_rewards[0, len(samples[0].ids) - 1] = 1.0  # verl: the score sits on the last token
    token_rewards[1, len(samples[1].ids) - 1] = 0.25
    advantages = batch["loss_mask"].float() * torch.tensor([[0.5], [-0.5]])  # constant over generated tokens
    _, got = record(tok, memory, batch["input_ids"], attention_mask=batch["attention_mask"],
                    loss_mask=batch["loss_mask"], rewards=token_rewards, advantages=advantages,
                    reward_components={"format": [1.0, 0.0], "math": torch.tensor([0.0, 0.25])},
                    episode_ids=["ep-a", "ep-b"], sample_indices=[7, 9], framework="verl", dataset_name="gsm8k",
                    dataset_indices=[3, 4], attributes=[None, {c.RL_ALIGNMENT_KIND: "partial"}])
    a, b = got[7]["root"], got[9]["root"]
    assert (a[c.RL_REWARD], a[c.RL_ADVANTAGE], a["rl.reward.component.format"], a["rl.reward.component.math"]) == (1.0, 0.5, 1.0, 0.0)
    assert (b[c.RL_REWARD], b[c.RL_ADVANTAGE], b["rl.reward.component.format"], b["rl.reward.component.math"]) == (0.25, -0.5, 0.0, 0.25)
    assert (a[c.RL_EPISODE_ID], a[c.RL_SYSTEM_NAME], a[c.RL_DATASET_NAME], a[c.RL_DATASET_INDEX]) == (
        "ep-a", "verl", "gsm8k", 3)
    assert c.RL_ALIGNMENT_KIND not in a and b[c.RL_ALIGNMENT_KIND] == "partial"


def test_the_tokenizer_cache_is_weakly_keyed_and_bounded():
    """What is learned of a tokenizer is cached per object: a tokenizer that can be weakly
    referenced takes its entry with it; the others are kept by id, at most ``max_by_id``."""
    import gc

    from otel_rollouts.decode.batch import TokenizerCache

    class Plain:
        eos_token_id = 7

    class Slotted:  # no __weakref__: cached by id
        __slots__ = ()
        eos_token_id = 7

    cache = TokenizerCache(max_by_id=2)
    tokenizer = Plain()
    info = cache.get(tokenizer)
    assert cache.get(tokenizer) is info and 7 in info.eos_ids and len(cache) == 1
    del tokenizer, info
    gc.collect()
    assert len(cache) == 0
    kept = [Slotted() for _ in range(3)]
    first = cache.get(kept[0])
    assert cache.get(kept[0]) is first
    for t in kept[1:]:
        cache.get(t)
    assert len(cache) == 2  # the oldest by-id entry made room


def test_a_0d_tensor_column_is_given_to_every_sample_and_the_batch_recorded(tok, memory):
    """A 0-d tensor (or one number, one text) where a per-sample column goes: every sample gets
    it and the summary says so. It once raised inside the library and lost the whole batch."""
    samples = [single_turn(tok, "Say hi.", "hi", version=1), single_turn(tok, "Say yo.", "yo", version=1)]
    batch = padded(samples, tok.pad_token_id)
    summary, got = record(tok, memory, batch["input_ids"], attention_mask=batch["attention_mask"],
                          loss_mask=batch["loss_mask"], rewards=torch.tensor(1.0),
                          advantages=torch.tensor(0.5), group_ids="g0")
    assert summary.recorded == 2
    assert any(p.startswith("rewards: one value for 2 samples") for p in summary.problems)
    assert sorted(got) == [0, 1]
    for ep in got.values():
        assert ep["root"][c.RL_REWARD] == 1.0 and ep["root"][c.RL_ADVANTAGE] == 0.5
        assert ep["root"][c.RL_GROUP_ID] == "g0"
