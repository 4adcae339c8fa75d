"""TRL adapter: ``RolloutTraceCallback`` on a real ``GRPOTrainer`` run (CPU, nothing downloaded).

The model is a randomly initialised two-layer Qwen2 saved to a temp dir; the tokenizer is a
byte-level BPE trained here with ``tokenizers`` and wrapped in ``PreTrainedTokenizerFast`` with a
ChatML chat template. Two optimizer steps, two reward functions; the traces are read back from
an InMemorySpanExporter and from Trackio's SQLite file.
"""

from __future__ import annotations

import collections
import os
import statistics

import pytest
from adapter_fixtures import configure_memory, episodes, messages_of
from otr_helpers import trackio_rows
from test_real_trl import cpu_kernel_stand_in

import otel_rollouts as otr
from otel_rollouts import conventions as c
from otel_rollouts.adapters.trl import RolloutTraceCallback

CHAT_TEMPLATE = (
    "{%- for message in messages -%}"
    "{{ '<|im_start|>' + message.role + '\\n' + message.content + '<|im_end|>\\n' }}"
    "{%- endfor -%}"
    "{%- if add_generation_prompt -%}{{ '<|im_start|>assistant\\n' }}{%- endif -%}"
)
CORPUS = ["what is 2 + 2 ? the answer is 4 .", "what is 3 + 4 ? the answer is 7 .",
          "you are a helpful assistant . think step by step .", "hello world 0123456789"]
PROMPTS = ["what is 2 + 2 ?", "what is 3 + 4 ?", "hello world", "think step by step"]


def build_tokenizer():
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers
    from transformers import PreTrainedTokenizerFast

    core = Tokenizer(models.BPE())
    core.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    core.decoder = decoders.ByteLevel()
    core.train_from_iterator(CORPUS, trainers.BpeTrainer(
        vocab_size=300, special_tokens=["<|endoftext|>", "<|im_start|>", "<|im_end|>"],
        initial_alphabet=pre_tokenizers.ByteLevel.alphabet(), show_progress=False))
    tok = PreTrainedTokenizerFast(tokenizer_object=core, eos_token="<|im_end|>",
                                  pad_token="<|endoftext|>")
    tok.add_special_tokens({"additional_special_tokens": ["<|im_start|>"]})
    tok.chat_template = CHAT_TEMPLATE
    return tok


def tiny_model_dir(tmp_path, tokenizer):
    import torch
    from transformers import Qwen2Config, Qwen2ForCausalLM

    torch.manual_seed(0)
    config = Qwen2Config(vocab_size=len(tokenizer), hidden_size=32, intermediate_size=64,
                         num_hidden_layers=2, num_attention_heads=2, num_key_value_heads=1,
                         max_position_embeddings=256, pad_token_id=tokenizer.pad_token_id,
                         eos_token_id=tokenizer.eos_token_id, tie_word_embeddings=True)
    path = tmp_path / "tiny-qwen2"
    Qwen2ForCausalLM(config).save_pretrained(path)
    tokenizer.save_pretrained(path)
    return str(path)


def require_trl():
    """TRL, or a skip outside CI (in CI a missing TRL is a failure)."""
    try:
        import trl
    except ImportError:
        if os.environ.get("CI"):
            raise
        pytest.skip("trl is not installed (pip install trl)")
    return trl


def test_grpo_trainer_two_steps_traced(tmp_path, otr_shutdown):
    require_trl()
    from datasets import Dataset
    from trl import GRPOConfig, GRPOTrainer

    project = "adapter-trl"
    mem = configure_memory(trackio_project=project)
    tokenizer = build_tokenizer()
    model_dir = tiny_model_dir(tmp_path, tokenizer)
    seen = collections.defaultdict(dict)  # (prompt, completion) -> {reward fn: value returned}

    def length_reward(prompts, completions, **kwargs):
        out = [len(comp[0]["content"]) / 10.0 for comp in completions]
        for p, comp, r in zip(prompts, completions, out, strict=True):
            seen[p[-1]["content"], comp[0]["content"]]["length_reward"] = r
        return out

    def format_reward(prompts, completions, task, **kwargs):
        # None: "this function does not apply" (TRL logs NaN for it); the trace omits it
        out = [None if t == "chat" else float("4" in comp[0]["content"])
               for comp, t in zip(completions, task, strict=True)]
        for p, comp, r in zip(prompts, completions, out, strict=True):
            seen[p[-1]["content"], comp[0]["content"]]["format_reward"] = r
        return out

    dataset = Dataset.from_dict({
        "prompt": [[{"role": "user", "content": p}] for p in PROMPTS],
        "task": ["math", "math", "chat", "chat"],
    })
    args = GRPOConfig(
        output_dir=str(tmp_path / "out"), use_cpu=True, bf16=False, fp16=False,
        per_device_train_batch_size=4, num_generations=2, max_completion_length=8,
        max_steps=2, logging_steps=1, learning_rate=1e-3, report_to="none", save_strategy="no",
        seed=0, reward_weights=[1.0, 2.0], dataloader_num_workers=0, disable_tqdm=True,
        eval_strategy="steps", eval_steps=2, per_device_eval_batch_size=2,
    )
    eval_dataset = Dataset.from_dict({"prompt": [[{"role": "user", "content": "what is 3 + 4 ?"}]],
                                      "task": ["math"]})
    trainer = GRPOTrainer(model=model_dir, reward_funcs=[length_reward, format_reward], args=args,
                          train_dataset=dataset, eval_dataset=eval_dataset,
                          processing_class=tokenizer)
    callback = RolloutTraceCallback(trainer)
    trainer.add_callback(callback)
    trl_utils, stand_in = cpu_kernel_stand_in()  # TRL 1.15.0 on CPU: see test_real_trl
    try:
        trainer.train()
    finally:
        if stand_in:
            trl_utils._ChunkedLogProbFunction = None
    otr.flush()

    eps = episodes(mem)
    assert callback.recorded == len(eps) == 10  # 2 steps x generation batch of 4, 2 eval samples
    evals = [ep["root"] for ep in eps.values() if ep["root"][c.RL_SPLIT] == "eval"]
    assert len(evals) == 2 and {a[c.RL_STEP] for a in evals} == {2}
    assert len({a[c.RL_GROUP_ID] for a in evals}) == 1
    assert all(c.RL_REWARD_COMPONENT_PREFIX + "format_reward" in a for a in evals)
    by_step = collections.defaultdict(list)
    for ep in eps.values():
        if ep["root"][c.RL_SPLIT] == "train":
            by_step[ep["root"][c.RL_STEP]].append(ep)
    assert sorted(by_step) == [1, 2] and all(len(v) == 4 for v in by_step.values())

    msgs = messages_of(mem)
    for step, step_eps in by_step.items():
        groups = collections.defaultdict(list)
        for ep in step_eps:
            a = ep["root"]
            assert a[c.RL_POLICY_VERSION] == step - 1 and a[c.RL_SPLIT] == "train"
            assert a[c.RL_STALENESS] == 0  # on-policy (was 1: step end minus step begin)
            assert a[c.RL_SYSTEM_NAME] == "trl"
            conv = msgs[a[c.RL_EPISODE_ID]]
            assert conv[0]["role"] == "user" and conv[0]["content"] in PROMPTS  # prompt included
            assert conv[-1]["role"] == "assistant"
            rewards = seen[conv[0]["content"], conv[-1]["content"]]  # this prompt, this completion
            # rewards per reward function as numbers, exactly what the functions returned
            assert a[c.RL_REWARD_COMPONENT_PREFIX + "length_reward"] == pytest.approx(rewards["length_reward"])
            if rewards["format_reward"] is None:
                assert c.RL_REWARD_COMPONENT_PREFIX + "format_reward" not in a
                expected = rewards["length_reward"]
            else:
                assert isinstance(a[c.RL_REWARD_COMPONENT_PREFIX + "format_reward"], float)
                expected = rewards["length_reward"] + 2.0 * rewards["format_reward"]
            assert a[c.RL_REWARD] == pytest.approx(expected)  # weighted as TRL optimises
            groups[a[c.RL_GROUP_ID]].append((conv[0]["content"], a[c.RL_REWARD], a[c.RL_ADVANTAGE]))
        assert len(groups) == 2
        for members in groups.values():  # one prompt per GRPO group; advantages as TRL computes
            assert len(members) == 2 and members[0][0] == members[1][0]
            values = [m[1] for m in members]
            mean, std = statistics.fmean(values), statistics.stdev(values)
            for _, reward, advantage in members:
                assert advantage == pytest.approx((reward - mean) / (std + 1e-4), abs=1e-4)

    rows = [r for r in trackio_rows(project) if r["metadata"][c.RL_SPLIT] == "train"]
    assert sorted(r["step"] for r in rows) == [1, 1, 1, 1, 2, 2, 2, 2]
    row = rows[0]
    assert row["messages"][0]["role"] == "user" and row["messages"][0]["content"] in PROMPTS
    md = row["metadata"]
    assert isinstance(md[c.RL_REWARD_COMPONENT_PREFIX + "length_reward"], float)
    assert isinstance(md[c.RL_ADVANTAGE], float) and md[c.RL_POLICY_VERSION] == 0
    assert md[c.RL_GROUP_ID].startswith("train:1:") and md[c.RL_SPLIT] == "train"


# --- the callback on TRL's buffer layout, for what a random model never generates ---------------
class _State:
    def __init__(self, step):
        self.global_step = step
        self.is_world_process_zero = True


class _Args:
    num_generations = 2
    num_generations_eval = None


class _Trainer:
    """The attributes of ``GRPOTrainer`` the callback reads (``_logs`` as TRL 1.x builds it)."""

    def __init__(self):
        self.reward_func_names = ["accuracy", "format"]
        self.reward_weights = [1.0, 1.0]
        self._logs = {"prompt": collections.deque(maxlen=4), "completion": collections.deque(maxlen=4),
                      "rewards": collections.defaultdict(lambda: collections.deque(maxlen=4)),
                      "advantages": collections.deque(maxlen=4),
                      "extra": collections.defaultdict(lambda: collections.deque(maxlen=4))}

    def generate(self, completions, accuracy, fmt, advantages):
        n = len(completions)
        self._logs["prompt"].extend([[{"role": "user", "content": "what is 2 + 2 ?"}]] * n)
        self._logs["completion"].extend(completions)
        self._logs["rewards"]["accuracy"].extend(accuracy)
        self._logs["rewards"]["format"].extend(fmt)
        self._logs["advantages"].extend([float(a) for a in advantages])


def _step(callback, trainer, step):
    state = _State(step - 1)
    callback.on_step_begin(_Args(), state, None)
    state.global_step = step
    callback.on_step_end(_Args(), state, None)


def test_tool_calling_completions_ragged_buffers_and_reused_batches(memory):
    trainer = _Trainer()
    callback = RolloutTraceCallback(trainer, model="tiny")
    call = {"type": "function", "function": {"name": "calc", "arguments": {"expr": "2 + 2"}}}
    tool_completion = [
        {"role": "assistant", "content": "let me compute", "tool_calls": [call]},
        {"role": "tool", "name": "calc", "content": "4"},  # TRL's tool message: no call id
        {"role": "assistant", "content": "the answer is 4"},
    ]
    plain = [{"role": "assistant", "content": "5"}]
    trainer.generate([tool_completion, plain], [1.0, 0.0], [1.0, 0.0], [0.7, -0.7])
    _step(callback, trainer, 1)
    tool_completion[2]["content"] = "MUTATED"  # the trainer's buffers change after the step
    _step(callback, trainer, 2)  # num_iterations > 1: the same batch again, not recorded twice
    # a buffer shorter than the others (ragged): no IndexError, the sample is marked partial
    trainer.generate([plain, plain], [1.0, 1.0], [1.0, 1.0], [0.0, 0.0])
    trainer._logs["rewards"]["format"].pop()
    _step(callback, trainer, 3)
    otr.flush()

    eps = episodes(memory)
    assert sorted(eps) == ["train:1:0:0", "train:1:0:1", "train:3:1:0", "train:3:1:1"]
    tool_ep = eps["train:1:0:0"]
    (tool,) = tool_ep["by_kind"]["tool"]
    assert tool.name == "execute_tool calc" and tool.attributes[c.GEN_AI_TOOL_CALL_RESULT] == "4"
    assert len(tool_ep["by_kind"]["turn"]) == 2
    conv = messages_of(memory)["train:1:0:0"]
    assert [m["role"] for m in conv] == ["user", "assistant", "tool", "assistant"]
    assert conv[0]["content"] == "what is 2 + 2 ?" and conv[3]["content"] == "the answer is 4"
    assert conv[1]["tool_calls"][0]["function"]["name"] == "calc"
    assert tool_ep["root"][c.RL_REWARD] == 2.0 and tool_ep["root"][c.RL_ADVANTAGE] == 0.7
    assert tool_ep["root"][c.RL_GROUP_ID] == eps["train:1:0:1"]["root"][c.RL_GROUP_ID]
    for eid in ("train:3:1:0", "train:3:1:1"):  # the short buffer is not paired with anything
        ragged = eps[eid]["root"]
        assert ragged[c.RL_ALIGNMENT_KIND] == "partial" and c.RL_REWARD_COMPONENT_PREFIX + "format" not in ragged
        assert ragged[c.RL_REWARD_COMPONENT_PREFIX + "accuracy"] == 1.0 and ragged[c.RL_REWARD] == 1.0
        assert list(ragged[c.RL_ALIGNMENT_MISSING]) == ["rewards.format[3!=4]"]
