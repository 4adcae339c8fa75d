"""TRL adapter against TRL's real ``GRPOTrainer`` (CPU, tiny random Qwen2, nothing downloaded).

Regression tests for what the adapter got wrong with TRL 1.16 (issue #13): no finish reason and no
token usage although TRL clips completions, staleness 1 for on-policy data, template markup in
text prompts, tool calls in Hermes text left as text. The ground truth always comes from TRL
itself: the ``completion_ids`` it hands to reward functions, its own ``completions/clipped_ratio``
metric, its ``_buffered_inputs`` slices.
"""

from __future__ import annotations

import collections
import logging
from typing import Any

import pytest
from adapter_fixtures import configure_memory, episodes, messages_of
from frameworks import require
from tokenizer_fixture import build_tokenizer, chat_ids, text_ids

import otel_rollouts as otr
from otel_rollouts import conventions as c
from otel_rollouts.adapters.trl import RolloutTraceCallback

PROMPTS = ["What is 2 + 2?", "What is 17 * 23?", "The weather in Paris is sunny.", "Think step by step."]


def tiny_model(tokenizer):
    import torch
    from transformers import Qwen2Config, Qwen2ForCausalLM

    torch.manual_seed(0)
    config = Qwen2Config(vocab_size=len(tokenizer), hidden_size=32, intermediate_size=64,
                         num_hidden_layers=1, num_attention_heads=2, num_key_value_heads=1,
                         max_position_embeddings=256, pad_token_id=tokenizer.pad_token_id,
                         eos_token_id=tokenizer.eos_token_id, bos_token_id=None, tie_word_embeddings=True)
    model = Qwen2ForCausalLM(config)
    model.config.name_or_path = "tiny-qwen2"
    return model


class _TorchLogProb:
    """The per-token log-probabilities (and entropy) TRL's fused LM head asks its
    ``ChunkedLogProbFunction`` for, in plain torch: the CPU stand-in for TRL 1.15.0's kernel,
    which is Triton-only (without Triton, ``trl.trainer.utils._ChunkedLogProbFunction`` is None
    and every training step raises inside TRL). TRL 1.16.0 computes the same on CPU itself
    (``_torch_transform``: scale, tanh soft-cap, temperature); with it this is never used."""

    @staticmethod
    def apply(hidden, weight, bias, targets, temperature, chunk_size, softcap=None, logit_scale=1.0,
              outputs=("log_probs",)):
        import torch

        z = hidden.float() @ weight.float().t()
        if bias is not None:
            z = z + bias.float()
        z = z * logit_scale
        if softcap is not None:
            z = softcap * torch.tanh(z / softcap)
        logp = torch.log_softmax(z / temperature, dim=-1)
        per_token = logp.gather(-1, targets.long().unsqueeze(-1)).squeeze(-1)
        entropy = -(logp.exp() * logp).sum(-1) if "entropy" in outputs else None
        return per_token, entropy, None, None, None


def cpu_kernel_stand_in():
    """Install ``_TorchLogProb`` where TRL has no kernel (1.15.0 without Triton); a no-op on
    TRL 1.16.0. Returns what to restore."""
    import trl.trainer.utils as trl_utils

    missing = getattr(trl_utils, "_ChunkedLogProbFunction", _TorchLogProb) is None
    if missing:
        trl_utils._ChunkedLogProbFunction = _TorchLogProb
    return trl_utils, missing


def train(tokenizer, reward_funcs, args, dataset, **kwargs):
    """A real tiny GRPOTrainer with the callback, trained; (trainer, callback)."""
    from trl import GRPOTrainer

    trl_utils, stand_in = cpu_kernel_stand_in()
    try:
        return _train(GRPOTrainer, tokenizer, reward_funcs, args, dataset, **kwargs)
    finally:
        if stand_in:
            trl_utils._ChunkedLogProbFunction = None


def _train(GRPOTrainer, tokenizer, reward_funcs, args, dataset, **kwargs):
    trainer = GRPOTrainer(model=tiny_model(tokenizer), reward_funcs=reward_funcs, args=args,
                          train_dataset=dataset, processing_class=tokenizer, **kwargs)
    callback = RolloutTraceCallback(trainer)
    trainer.add_callback(callback)
    trainer.train()
    otr.flush()
    return trainer, callback


def grpo_args(tmp_path, **overrides):
    from trl import GRPOConfig

    kwargs = dict(output_dir=str(tmp_path / "out"), use_cpu=True, bf16=False, fp16=False,
                  per_device_train_batch_size=4, num_generations=2, max_completion_length=3,
                  max_steps=2, logging_steps=1, learning_rate=1e-2, report_to=[], save_strategy="no",
                  seed=0, dataloader_num_workers=0, disable_tqdm=True, beta=0.0)
    kwargs.update(overrides)
    return GRPOConfig(**kwargs)


def no_markup(text, tokenizer):
    markers = set(tokenizer.all_special_tokens) | {"<|im_start|>", "<|im_end|>", "<|endoftext|>"}
    return not any(m in text for m in markers)


@pytest.mark.matrix

def tool_calling_tokenizer() -> tuple[Any, list[int], list[int]]:
    """The test tokenizer with Qwen2.5's chat template and TRL's response schema (TRL parses a
    completion's tool calls with it), and the ids of a calculator call (17 * 23) and of a plain
    answer, each ending in EOS: the completions a tool-calling rollout returns."""
    from trl.chat_template_utils import add_response_schema, qwen2_5_chat_template

    tokenizer = build_tokenizer()
    tokenizer.chat_template = qwen2_5_chat_template  # TRL knows how to parse its responses
    add_response_schema(tokenizer)
    eos = tokenizer.eos_token_id
    call = '<tool_call>\n{"name": "calculator", "arguments": {"expression": "17 * 23"}}\n</tool_call>'
    return tokenizer, text_ids(tokenizer, call) + [eos], text_ids(tokenizer, "The answer is 4.") + [eos]

def test_real_grpo_finish_reason_usage_and_on_policy_staleness(tmp_path, otr_shutdown):
    """Every completion gets TRL's finish reason (length = clipped at ``max_completion_length``
    without EOS) and token usage; on-policy samples have staleness 0; only reward functions are
    reward terms."""
    require("trl")
    from datasets import Dataset

    mem = configure_memory()
    tokenizer = build_tokenizer()
    eos = tokenizer.eos_token_id
    truth = {}  # (prompt text, completion text) -> completion ids TRL scored

    def length_reward(prompts, completions, completion_ids, log_extra, **kwargs):
        for p, comp, ids in zip(prompts, completions, completion_ids, strict=True):
            truth[p[-1]["content"], comp[0]["content"]] = list(ids)
        log_extra("n_chars", [len(comp[0]["content"]) for comp in completions])
        return [len(ids) / 3.0 for ids in completion_ids]

    def eos_reward(completion_ids, **kwargs):
        return [float(ids[-1] == eos) for ids in completion_ids]

    dataset = Dataset.from_dict({"prompt": [[{"role": "user", "content": p}] for p in PROMPTS]})
    # EOS made likely enough that both clipped and stopped completions occur in one run
    args = grpo_args(tmp_path, generation_kwargs={"sequence_bias": [[[eos], 6.0]]})
    trainer, callback = train(tokenizer, [length_reward, eos_reward], args, dataset)

    eps = episodes(mem)
    msgs = messages_of(mem)
    assert callback.recorded == len(eps) == 8
    # the run as TRL's trainer describes it, on the resource of every span
    from importlib.metadata import version

    (resource,) = {s.resource for s in mem.get_finished_spans()}
    assert {k: resource.attributes.get(k) for k in (c.RL_SYSTEM_NAME, c.RL_SYSTEM_VERSION, c.RL_ALGORITHM,
                                                     c.RL_MODEL_NAME)} == {
        c.RL_SYSTEM_NAME: "trl", c.RL_SYSTEM_VERSION: version("trl"), c.RL_ALGORITHM: "grpo",
        c.RL_MODEL_NAME: "tiny-qwen2"}
    reasons = collections.Counter()
    by_step = collections.defaultdict(list)
    for eid, ep in eps.items():
        root = ep["root"]
        by_step[root[c.RL_STEP]].append(root)
        conv = msgs[eid]
        assert conv[0] == {"role": "user", "content": conv[0]["content"]} and conv[0]["content"] in PROMPTS
        assert [m["role"] for m in conv] == ["user", "assistant"]
        ids = truth[conv[0]["content"], conv[1]["content"]]
        # TRL's own rule (is_truncated): last id neither EOS nor pad
        expected = c.FINISH_STOP if ids[-1] in (eos, tokenizer.pad_token_id) else c.FINISH_LENGTH
        assert root[c.RL_FINISH_REASON] == expected
        assert root[c.RL_STATUS] == (c.STATUS_TRUNCATED if expected == c.FINISH_LENGTH else c.STATUS_OK)
        reasons[expected] += 1
        (gen,) = ep["by_kind"][c.KIND_GENERATION]
        assert gen.attributes[c.GEN_AI_USAGE_OUTPUT_TOKENS] == len(ids)
        assert gen.attributes[c.GEN_AI_USAGE_INPUT_TOKENS] == len(
            chat_ids(tokenizer, [{"role": "user", "content": conv[0]["content"]}], generation_prompt=True))
        assert list(gen.attributes[c.GEN_AI_RESPONSE_FINISH_REASONS]) == [expected]
        assert gen.attributes[c.GEN_AI_REQUEST_MODEL] == "tiny-qwen2"
        assert no_markup(conv[1]["content"], tokenizer)
        # on-policy: generated by the weights it trains (GRPO default schedule)
        assert root[c.RL_POLICY_VERSION] == root[c.RL_STEP] - 1 and root[c.RL_STALENESS] == 0
        # reward terms are exactly the reward functions; the logged extra column is metadata
        assert {k for k in root if k.startswith(c.RL_REWARD_COMPONENT_PREFIX)} == {
            c.RL_REWARD_COMPONENT_PREFIX + "length_reward", c.RL_REWARD_COMPONENT_PREFIX + "eos_reward"}
        assert root[c.RL_METADATA_PREFIX + "n_chars"] == len(conv[1]["content"])
        assert root[c.RL_TURN_COUNT] == 1
    assert sorted(by_step) == [1, 2] and all(len(v) == 4 for v in by_step.values())
    assert reasons[c.FINISH_LENGTH] and reasons[c.FINISH_STOP], reasons  # both kinds occurred
    # the recorded finish reasons agree with TRL's own metric, step by step
    clipped = {row["step"]: row["completions/clipped_ratio"] for row in trainer.state.log_history
               if "completions/clipped_ratio" in row}
    for step, roots in by_step.items():
        ratio = sum(r[c.RL_FINISH_REASON] == c.FINISH_LENGTH for r in roots) / len(roots)
        assert ratio == pytest.approx(clipped[step])


@pytest.mark.matrix
def test_real_grpo_generation_spanning_two_updates_is_off_policy(tmp_path, otr_shutdown):
    """``steps_per_generation`` = 2 with no gradient accumulation: one generation batch (made by
    the initial weights) is trained over two optimizer steps; the slice trained second is one
    update stale, the first slice is on-policy."""
    require("trl")
    from datasets import Dataset

    mem = configure_memory()
    tokenizer = build_tokenizer()

    def length_reward(completion_ids, **kwargs):
        return [float(len(ids)) for ids in completion_ids]

    dataset = Dataset.from_dict({"prompt": [[{"role": "user", "content": p}] for p in PROMPTS]})
    args = grpo_args(tmp_path, steps_per_generation=2, max_completion_length=4)
    trainer, callback = train(tokenizer, [length_reward], args, dataset)

    eps = episodes(mem)
    assert len(eps) == 8 and trainer.state.global_step == 2
    assert {ep["root"][c.RL_POLICY_VERSION] for ep in eps.values()} == {0}
    stale = collections.Counter(ep["root"][c.RL_STALENESS] for ep in eps.values())
    assert stale == {0: 4, 1: 4}
    # which samples are one update stale: exactly those TRL put in its second slice
    second = trainer._buffered_inputs[1]
    expected = collections.Counter(
        zip(tokenizer.batch_decode(second["prompt_ids"], skip_special_tokens=True),
            tokenizer.batch_decode(second["completion_ids"], skip_special_tokens=True), strict=True))
    msgs = messages_of(mem)
    got = collections.Counter()
    for eid, ep in eps.items():
        if ep["root"][c.RL_STALENESS] == 1:
            conv = msgs[eid]
            got["user\n" + conv[0]["content"] + "\nassistant\n", conv[1]["content"]] += 1
    assert got == expected


@pytest.mark.matrix
def test_real_grpo_text_prompts_and_hermes_tool_calls(tmp_path, otr_shutdown):
    """A dataset of prompts already rendered with the chat template, generated through TRL's
    ``rollout_func``: the prompt is recorded as its messages (no markup), a Hermes
    ``<tool_call>`` in the completion text becomes an ``execute_tool`` span, EOS never shows, and
    the token counts / finish reasons are those of the ids the rollout returned."""
    require("trl")
    from datasets import Dataset

    mem = configure_memory()
    tokenizer = build_tokenizer()
    eos = tokenizer.eos_token_id
    call = '<tool_call>\n{"name": "calculator", "arguments": {"expression": "17 * 23"}}\n</tool_call>'
    call_ids = text_ids(tokenizer, call) + [eos]
    clipped_ids = text_ids(tokenizer, "The answer is 391. The answer")[:6]
    system = {"role": "system", "content": "You are a helpful assistant."}
    rendered = [tokenizer.apply_chat_template([system, {"role": "user", "content": p}], tokenize=False,
                                              add_generation_prompt=True) for p in PROMPTS[:2]]

    def rollout(prompts, trainer):
        prompt_ids = [text_ids(tokenizer, p) for p in prompts]
        completion_ids = [call_ids if i % 2 == 0 else clipped_ids for i in range(len(prompts))]
        return {"prompt_ids": prompt_ids, "completion_ids": completion_ids, "logprobs": None}

    def used_tool(completions, **kwargs):
        return [float("<tool_call>" in comp) for comp in completions]

    dataset = Dataset.from_dict({"prompt": rendered * 2})
    args = grpo_args(tmp_path, max_steps=1, max_completion_length=64)
    trainer, callback = train(tokenizer, [used_tool], args, dataset, rollout_func=rollout)

    eps = episodes(mem)
    msgs = messages_of(mem)
    assert len(eps) == 4
    kinds = collections.Counter()
    for eid, ep in eps.items():
        root, conv = ep["root"], msgs[eid]
        assert conv[0] == system and conv[1]["role"] == "user" and conv[1]["content"] in PROMPTS[:2]
        for m in conv:
            assert no_markup(str(m.get("content") or ""), tokenizer), m
        (gen,) = ep["by_kind"][c.KIND_GENERATION]
        prompt_len = len(text_ids(tokenizer, rendered[PROMPTS.index(conv[1]["content"])]))
        assert gen.attributes[c.GEN_AI_USAGE_INPUT_TOKENS] == prompt_len
        if root[c.RL_REWARD_COMPONENT_PREFIX + "used_tool"] == 1.0:
            kinds["tool"] += 1
            (tool,) = ep["by_kind"][c.KIND_TOOL]
            assert tool.name == "execute_tool calculator"
            assert conv[2]["tool_calls"][0]["function"]["name"] == "calculator"
            assert "<tool_call>" not in conv[2]["content"]
            assert root[c.RL_FINISH_REASON] == c.FINISH_STOP and root[c.RL_STATUS] == c.STATUS_OK
            assert gen.attributes[c.GEN_AI_USAGE_OUTPUT_TOKENS] == len(call_ids)
        else:
            kinds["clipped"] += 1
            assert not ep["by_kind"][c.KIND_TOOL]
            assert conv[2]["content"] == tokenizer.decode(clipped_ids)
            assert root[c.RL_FINISH_REASON] == c.FINISH_LENGTH and root[c.RL_STATUS] == c.STATUS_TRUNCATED
            assert gen.attributes[c.GEN_AI_USAGE_OUTPUT_TOKENS] == len(clipped_ids)
    assert kinds == {"tool": 2, "clipped": 2}


def calculator(expression: str) -> str:
    """Evaluate an arithmetic expression.

    Args:
        expression: The arithmetic expression to evaluate.
    """
    a, op, b = expression.split()
    return str(int(a) * int(b) if op == "*" else int(a) + int(b))


@pytest.mark.matrix
def test_real_grpo_tool_loop_turns_usage_and_results(tmp_path, otr_shutdown):
    """TRL's own tool loop (``tools=[calculator]``, response parsing from TRL's Qwen template on
    the test tokenizer): the first assistant message comes from ``rollout_func``, TRL runs the
    tool and the model generates after the result. Each assistant message is a turn with its own
    token usage (runs of TRL's ``tool_mask``), the call an ``execute_tool`` span with TRL's result,
    one tool call per call in the conversation, no special tokens in any text."""
    require("trl")
    from datasets import Dataset

    mem = configure_memory()
    tokenizer, call_ids, plain_ids = tool_calling_tokenizer()
    eos = tokenizer.eos_token_id
    prompt_len = {}
    full = {}  # prompt -> completion ids TRL scored, per kind

    def rollout(prompts, trainer):
        prompt_ids = [chat_ids(tokenizer, p, generation_prompt=True) for p in prompts]
        for p, ids in zip(prompts, prompt_ids, strict=True):
            prompt_len[p[-1]["content"]] = len(ids)
        completion_ids = [call_ids if i % 2 == 0 else plain_ids for i in range(len(prompts))]
        return {"prompt_ids": prompt_ids, "completion_ids": completion_ids, "logprobs": None}

    def tool_used(prompts, completions, completion_ids, **kwargs):
        out = []
        for p, comp, ids in zip(prompts, completions, completion_ids, strict=True):
            used = any(m["role"] == "tool" for m in comp)
            full[p[-1]["content"], used] = list(ids)
            out.append(float(used))
        return out

    dataset = Dataset.from_dict({"prompt": [[{"role": "user", "content": p}] for p in PROMPTS[:2]] * 2})
    args = grpo_args(tmp_path, max_steps=1, max_completion_length=48)
    trainer, callback = train(tokenizer, [tool_used], args, dataset, rollout_func=rollout, tools=[calculator])

    eps = episodes(mem)
    msgs = messages_of(mem)
    assert len(eps) == 4
    lengths = []
    for eid, ep in eps.items():
        root, conv = ep["root"], msgs[eid]
        for m in conv:
            assert no_markup(str(m.get("content") or ""), tokenizer), m
        user = conv[0]["content"]
        gens = sorted(ep["by_kind"][c.KIND_GENERATION], key=lambda s: s.start_time)
        usage = [(g.attributes[c.GEN_AI_USAGE_INPUT_TOKENS], g.attributes[c.GEN_AI_USAGE_OUTPUT_TOKENS])
                 for g in gens]
        lengths.append(sum(out for _, out in usage))
        assert usage[0] == (prompt_len[user], len(call_ids if root[c.RL_REWARD] else plain_ids))
        if root[c.RL_REWARD] == 1.0:
            ids = full[user, True]
            assert root[c.RL_TURN_COUNT] == 2 and len(gens) == 2
            (tool,) = ep["by_kind"][c.KIND_TOOL]
            assert tool.name == "execute_tool calculator"
            assert tool.attributes[c.GEN_AI_TOOL_CALL_RESULT] == "391"
            assert [m["role"] for m in conv] == ["user", "assistant", "tool", "assistant"]
            (tc,) = conv[1]["tool_calls"]  # the call once, with the id its result answers
            assert tc["function"]["name"] == "calculator" and conv[2]["tool_call_id"] == tc["id"]
            # the second generation saw the prompt, the call and the tool result, and wrote the rest
            assert usage[1][0] + usage[1][1] == prompt_len[user] + len(ids)
        else:
            ids = full[user, False]
            assert root[c.RL_TURN_COUNT] == 1 and conv[1]["content"] == "The answer is 4."
        expected = c.FINISH_STOP if ids[-1] in (eos, tokenizer.pad_token_id) else c.FINISH_LENGTH
        assert root[c.RL_FINISH_REASON] == expected
        assert list(gens[-1].attributes[c.GEN_AI_RESPONSE_FINISH_REASONS]) == [expected]
    # TRL's completion_lengths (model tokens only) are what the turns add up to
    (row,) = [r for r in trainer.state.log_history if "completions/max_length" in r]
    assert (min(lengths), max(lengths)) == (row["completions/min_length"], row["completions/max_length"])
    assert row["tools/call_frequency"] == 0.5


def test_unknown_structures_warn_once(caplog, memory):
    """A completion neither text nor messages, and a ``_generate`` of another shape: recorded as
    far as understood, with one warning per field."""
    from otel_rollouts.adapters import kit

    class State:
        global_step = 1
        is_world_process_zero = True

    class Args:
        num_generations = 1

    class Trainer:
        reward_func_names = ["r"]
        reward_weights = [1.0]

        def __init__(self):
            self._logs = {"prompt": [], "completion": [], "rewards": {"r": []}, "advantages": [], "extra": {}}

        def _generate(self, prompts):
            return {"not": "a tuple"}

        def _generate_and_score_completions(self, inputs):
            self._generate(inputs)
            for _ in inputs:
                self._logs["prompt"].append("what is 2 + 2 ?")
                self._logs["completion"].append(42)  # neither text nor messages
                self._logs["rewards"]["r"].append(1.0)
                self._logs["advantages"].append(float(len(self._logs["advantages"])))
            return {}

        def _prepare_inputs(self, batch):
            return self._generate_and_score_completions(batch)

    trainer = Trainer()
    callback = RolloutTraceCallback(trainer, model="m")
    assert callback.hooked
    with caplog.at_level(logging.WARNING, logger="otel_rollouts"):
        for step in (1, 2):
            trainer._prepare_inputs([0])
            callback.on_step_end(Args(), type("S", (State,), {"global_step": step})(), None)
    otr.flush()
    eps = episodes(memory)
    assert len(eps) == 2
    assert all(messages_of(memory)[e][-1]["content"] == "42" for e in eps)
    warnings = [r.getMessage() for r in caplog.records if "otel_rollouts.adapters.trl" in r.getMessage()]
    assert sum("completion:" in w for w in warnings) == 1 and sum("_generate:" in w for w in warnings) == 1
    assert otr.stats()["totals"][kit.COUNT_UNKNOWN] >= 4


def test_a_newer_trl_is_warned_once(memory, caplog, monkeypatch):
    """The callback checks the installed TRL against the releases these tests run on
    (``TESTED``): a newer one is warned once (and counted), never refused."""
    import otel_rollouts.adapters.trl as trl_adapter

    monkeypatch.setattr(trl_adapter, "TESTED", ("1.0.0",))
    with caplog.at_level(logging.WARNING, logger="otel_rollouts"):
        RolloutTraceCallback()
        RolloutTraceCallback()
    warned = [r.getMessage() for r in caplog.records if "newer than the releases" in r.getMessage()]
    assert len(warned) == 1 and "trl" in warned[0] and "1.0.0" in warned[0]
    assert otr.stats()["totals"]["adapters.newer_release"] == 2
