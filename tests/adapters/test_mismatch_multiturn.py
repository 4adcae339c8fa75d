"""Train–inference mismatch per generation where an adapter concatenates a multi-turn response.

SkyRL concatenates a trajectory's turns into one ``response_ids`` row (observations between them,
``loss_masks`` 0); TRL's tool loop concatenates the completion's assistant turns with the tool
results between them (``tool_mask`` 0). The statistics of each generation span must be its own
tokens', its worst tokens' positions indices within that generation (as the docs say, and as the
verl / AReaL path records them), and the generations must add up to the root.

* SkyRL: ``SkyRLGymGenerator.generate`` over skyrl-gym's ``gsm8k_multi_turn`` and a tool
  environment registered with ``skyrl_gym.register`` (``test_real_skyrl``), from SkyRL's own
  ``prepare_generator_input``; the trainer's ``action_log_probs`` laid out by SkyRL's
  ``convert_prompts_responses_to_batch_tensors`` (``test_mismatch_verl_skyrl.action_log_probs``).
  Stand-in: the inference engine (no GPU / vLLM here), answering with fixed texts and logprobs.
* TRL: a real tiny ``GRPOTrainer`` running its own tool loop (``tools=[calculator]``): the first
  assistant message from a ``rollout_func``, TRL runs the tool and generates after its result.
  Stand-in: the engine's logprobs of that post-tool generation (TRL reports them only from vLLM,
  which cannot run here): ``_generate_single_turn`` runs as TRL wrote it and the sampled tokens'
  logprobs under the model are added, as vLLM returns them. TRL computes the trainer's
  ``old_per_token_logps`` itself (``steps_per_generation`` = 2).
"""

from __future__ import annotations

import asyncio
from collections import Counter
from typing import Any

import pytest
from adapter_fixtures import configure_memory, episodes
from frameworks import require
from tokenizer_fixture import chat_ids

import otel_rollouts as otr
from otel_rollouts import conventions as c

STATS = (c.RL_MISMATCH_TOKENS, c.RL_MISMATCH_ABS_MEAN, c.RL_MISMATCH_ABS_MAX, c.RL_MISMATCH_KL,
         c.RL_MISMATCH_OUTSIDE)


def generations(ep: dict[str, Any]) -> list[Any]:
    """The episode's generation spans, in the order they were recorded."""
    return sorted(ep["by_kind"][c.KIND_GENERATION], key=lambda s: s.start_time)


def runs_of_ones(mask: list[int]) -> list[tuple[int, int]]:
    """[start, end) of each run of 1s: the generations a loss / tool mask marks."""
    out, start = [], None
    for k, m in enumerate([*mask, 0]):
        if m and start is None:
            start = k
        elif not m and start is not None:
            out.append((start, k))
            start = None
    return out


def assert_per_generation(ep: dict[str, Any], lengths: list[int]) -> None:
    """Each generation's statistics count its own tokens, its worst positions lie inside it,
    and the generations add up to the root (tokens, Σ|Δ|, Σ Δ², tokens outside the band)."""
    root = ep["root"]
    gens = generations(ep)
    assert len(gens) == len(lengths)
    tokens = abs_sum = sq_sum = outside = 0.0
    for gen, length in zip(gens, lengths, strict=True):
        attrs = gen.attributes
        assert attrs.get(c.RL_MISMATCH_TOKENS) == length, (gen.name, attrs.get(c.RL_MISMATCH_TOKENS), length)
        positions = list(attrs.get(c.RL_MISMATCH_WORST_POSITION, ()))
        assert all(0 <= p < length for p in positions), (positions, length)
        tokens += attrs[c.RL_MISMATCH_TOKENS]
        abs_sum += attrs[c.RL_MISMATCH_ABS_MEAN] * attrs[c.RL_MISMATCH_TOKENS]
        sq_sum += 2 * attrs[c.RL_MISMATCH_KL] * attrs[c.RL_MISMATCH_TOKENS]
        outside += attrs[c.RL_MISMATCH_OUTSIDE]
    assert root[c.RL_MISMATCH_TOKENS] == tokens
    assert root[c.RL_MISMATCH_ABS_MEAN] * root[c.RL_MISMATCH_TOKENS] == pytest.approx(abs_sum, rel=1e-4)
    assert 2 * root[c.RL_MISMATCH_KL] * root[c.RL_MISMATCH_TOKENS] == pytest.approx(sq_sum, rel=1e-4)
    assert root[c.RL_MISMATCH_OUTSIDE] == outside
    assert root[c.RL_MISMATCH_ABS_MAX] == pytest.approx(max(g.attributes[c.RL_MISMATCH_ABS_MAX] for g in gens))


# --- SkyRL ---------------------------------------------------------------------------------------
CALL = '<tool_call>\n{"name": "calculator", "arguments": {"expression": "2 + 2"}}\n</tool_call>'
GSM8K = {"q0_0": ["I think 2 + 2 = 5. #### 5", "#### 4"], "q0_1": ["The answer is #### 4"],
         "q0_2": ["Hmm, 2 + 2 = 3. #### 3", "No, wait: 2 + 2 = 5. #### 5", "Sorry: #### 4"]}
TOOLS = {"q0_0": [f"Let me compute. {CALL}", "The answer is 4."], "q0_1": ["It is 4."],
         "q0_2": [CALL, f"Once more. {CALL}", "So it is 4."]}


def skyrl_generate(script: dict[str, list[str]], env_class: str, *, step_wise: bool = False):
    """SkyRL's own path (``prepare_generator_input`` → ``SkyRLGymGenerator.generate``) with
    ``sampling_params.logprobs`` set: the engine stand-in returns each answer's logprobs,
    different per token so that each token's Δ below is its own."""
    import test_real_skyrl as real

    gym_generator = require("skyrl.train.generators.skyrl_gym_generator")
    generator_utils = require("skyrl.train.generators.utils")
    skyrl_config = require("skyrl.train.config")

    class LogprobEngine(real.ScriptedEngine):
        async def generate(self, engine_input: dict[str, Any], model: str | None = None) -> dict[str, Any]:
            out = await super().generate(engine_input, model)
            out["response_logprobs"] = [[-0.05 - 0.01 * (k % 7) for k in range(len(out["response_ids"][0]))]]
            return out

    cfg = skyrl_config.GeneratorConfig(max_turns=3, max_input_length=4096, n_samples_per_prompt=len(script),
                                       step_wise_trajectories=step_wise)
    cfg.sampling_params.logprobs = 0
    generator = gym_generator.SkyRLGymGenerator(cfg, skyrl_config.SkyRLGymConfig(max_env_workers=0),
                                                LogprobEngine(script), real.TOKENIZER)
    prompts = [{"prompt": real.QUESTION, "env_class": env_class, "uid": "q0",
                "env_extras": {"reward_spec": {"ground_truth": "4"}}}]
    gi, _ = generator_utils.prepare_generator_input(prompts, len(script), None, env_class, "train", 1)
    go = asyncio.run(generator.generate(gi, disable_tqdm=True))
    return real.TOKENIZER, gi, go


def skyrl_trainer_logprobs(tok, go: dict[str, Any]):
    """SkyRL's ``action_log_probs`` layout (right-aligned ``[rows, max_response]``), equal to the
    engine's except one token per generation: its last token is shifted by −(1 + k) in the
    trajectory's k-th generation, so every generation has its own worst token, at its end."""
    from test_mismatch_verl_skyrl import action_log_probs

    trainer, _ = action_log_probs(tok, go)
    width = trainer.shape[1]
    rows_of: dict[str, list[int]] = {}
    for j, tid in enumerate(go["trajectory_ids"] or [None] * len(go["response_ids"])):
        rows_of.setdefault(tid.to_string() if tid is not None else str(j), []).append(j)  # a row each
    for rows in rows_of.values():
        k = 0
        for j in rows:
            pad = width - len(go["response_ids"][j])
            for _, end in runs_of_ones(go["loss_masks"][j]):
                trainer[j, pad + end - 1] -= 1.0 + k
                k += 1
    return trainer


@pytest.mark.parametrize(("script", "env_class", "step_wise"), [
    (GSM8K, "gsm8k_multi_turn", False), (TOOLS, "otr_calculator", False), (GSM8K, "gsm8k_multi_turn", True)],
    ids=["gsm8k", "tool-calls", "step-wise"])
def test_skyrl_each_generation_gets_its_own_statistics_and_worst_tokens(memory, script, env_class, step_wise):
    from otel_rollouts.adapters import skyrl

    tok, gi, go = skyrl_generate(script, env_class, step_wise=step_wise)
    trainer = skyrl_trainer_logprobs(tok, go)
    assert skyrl.record_generator_output(gi, go, step=1, tokenizer=tok, trainer_logprobs=trainer) == len(script)
    assert otr.flush()
    eps = episodes(memory)
    assert sorted(eps) == sorted(script)
    row_ids = go["trajectory_ids"] or gi["trajectory_ids"]  # step-wise: a row per turn
    for eid, answers in script.items():
        rows = [j for j, t in enumerate(row_ids) if t.to_string() == eid]
        runs = [(j, start, end) for j in rows for start, end in runs_of_ones(go["loss_masks"][j])]
        lengths = [end - start for _, start, end in runs]
        last_ids = [go["response_ids"][j][end - 1] for j, _, end in runs]
        assert len(lengths) == len(answers)  # one generation per scripted answer
        ep = eps[eid]
        assert_per_generation(ep, lengths)
        for k, (gen, length, last_id) in enumerate(zip(generations(ep), lengths, last_ids, strict=True)):
            attrs = gen.attributes
            assert attrs[c.GEN_AI_USAGE_OUTPUT_TOKENS] == length
            assert attrs[c.RL_MISMATCH_ABS_MAX] == pytest.approx(1.0 + k, abs=1e-5)
            # its own last token, the only one that differs: the position inside the generation
            assert list(attrs[c.RL_MISMATCH_WORST_POSITION]) == [length - 1]
            worst = list(attrs[c.RL_MISMATCH_WORST_TRAINER])[0] - list(attrs[c.RL_MISMATCH_WORST_ROLLOUT])[0]
            assert worst == pytest.approx(-(1.0 + k), abs=1e-5)
            assert list(attrs[c.RL_MISMATCH_WORST_TOKEN]) == [tok.decode([last_id])]
        assert ep["root"][c.RL_MISMATCH_ABS_MAX] == pytest.approx(len(lengths), abs=1e-5)


def test_skyrl_single_generation_statistics_unchanged(memory):
    """One generation: its span and the root carry the same statistics, as before."""
    from otel_rollouts.adapters import skyrl

    script = {"q0_0": ["The answer is #### 4"], "q0_1": ["It is #### 4"]}
    tok, gi, go = skyrl_generate(script, "gsm8k_multi_turn")
    trainer = skyrl_trainer_logprobs(tok, go)
    skyrl.record_generator_output(gi, go, step=1, tokenizer=tok, trainer_logprobs=trainer)
    assert otr.flush()
    for ep in episodes(memory).values():
        (gen,) = generations(ep)
        for key in STATS:
            assert gen.attributes[key] == pytest.approx(ep["root"][key])


# --- TRL ---------------------------------------------------------------------------------------
def calculator(expression: str) -> str:
    """Evaluate an arithmetic expression.

    Args:
        expression: The arithmetic expression to evaluate.
    """
    a, op, b = expression.split()
    return str(int(a) * int(b) if op == "*" else int(a) + int(b))


def test_trl_tool_loop_each_generation_gets_its_own_statistics(tmp_path, otr_shutdown, monkeypatch):
    """TRL's own tool loop: a completion is [first assistant turn, tool result, second assistant
    turn]; TRL's ``sampling_per_token_logps`` and ``old_per_token_logps`` span all of it (0 for
    the tool tokens, which ``tool_mask`` leaves out). Each turn's generation gets its own
    statistics: its token count, worst positions inside it; the turns add up to the root."""
    require("trl")
    import torch
    from datasets import Dataset
    from test_real_trl import PROMPTS, grpo_args, tool_calling_tokenizer, train

    monkeypatch.setenv("TRL_EXPERIMENTAL_SILENCE", "1")
    mem = configure_memory()
    tokenizer, call_ids, plain_ids = tool_calling_tokenizer()

    def model_logprobs(model, context: list[int], ids: list[int], temperature: float) -> list[float]:
        """The sampled tokens' logprobs under the model (what vLLM reports), shifted by −0.5 so
        that the trainer's differ on every model token."""
        with torch.no_grad():
            logits = model(torch.tensor([context + ids])).logits[0].float()
        logp = torch.log_softmax(logits[len(context) - 1:-1] / temperature, dim=-1)
        return (logp.gather(-1, torch.tensor(ids).unsqueeze(-1)).squeeze(-1) - 0.5).tolist()

    def rollout(prompts, trainer):
        prompt_ids = [chat_ids(tokenizer, p, generation_prompt=True) for p in prompts]
        completion_ids = [call_ids if i % 2 == 0 else plain_ids for i in range(len(prompts))]
        temperature = float(trainer.temperature or 1.0)
        logprobs = [model_logprobs(trainer.model, p, q, temperature) for p, q in zip(prompt_ids, completion_ids,
                                                                                    strict=True)]
        return {"prompt_ids": prompt_ids, "completion_ids": completion_ids, "logprobs": logprobs}

    from trl import GRPOTrainer

    real_single_turn = GRPOTrainer._generate_single_turn

    def with_engine_logprobs(self, prompt_ids, *args, **kwargs):
        ids, logprobs = real_single_turn(self, prompt_ids, *args, **kwargs)
        if logprobs is None:  # TRL's transformers path: the engine's logprobs, as vLLM's would be
            temperature = float(self.temperature or 1.0)
            logprobs = [model_logprobs(self.model, list(p), list(q), temperature) if len(q) else []
                        for p, q in zip(prompt_ids, ids, strict=True)]
        return ids, logprobs

    monkeypatch.setattr(GRPOTrainer, "_generate_single_turn", with_engine_logprobs)
    real_generate = GRPOTrainer._generate
    tool_masks: list[list[int]] = []  # TRL's own tool_mask of each completion it generated

    def spy_generate(self, prompts):
        result = real_generate(self, prompts)
        tool_masks.extend(list(m) for m in result[2])
        return result

    monkeypatch.setattr(GRPOTrainer, "_generate", spy_generate)

    def tool_used(prompts, completions, completion_ids, **kwargs):
        return [float(any(m["role"] == "tool" for m in comp)) for comp in completions]

    dataset = Dataset.from_dict({"prompt": [[{"role": "user", "content": p}] for p in PROMPTS[:2]] * 2})
    args = grpo_args(tmp_path, max_steps=1, max_completion_length=48, steps_per_generation=2)
    trainer, callback = train(tokenizer, [tool_used], args, dataset, rollout_func=rollout, tools=[calculator])
    size = args.per_device_train_batch_size * args.steps_per_generation  # TRL's generation batch
    assert callback.recorded == size
    eps = episodes(mem)
    assert len(eps) == size
    # each completion's generations, as TRL's tool_mask marks them (runs of model tokens), are
    # the generations that carry statistics, with as many tokens
    assert len(tool_masks) == size
    expected = Counter(tuple(end - start for start, end in runs_of_ones(m)) for m in tool_masks)
    got = Counter(tuple(g.attributes.get(c.RL_MISMATCH_TOKENS) for g in generations(ep)) for ep in eps.values())
    assert got == expected
    tool_eps = 0
    for ep in eps.values():
        gens = generations(ep)
        lengths = [g.attributes[c.GEN_AI_USAGE_OUTPUT_TOKENS] for g in gens]  # runs of TRL's tool_mask
        if ep["root"][c.RL_REWARD] == 1.0:
            tool_eps += 1
            assert len(gens) == 2 and lengths[0] == len(call_ids)
        else:
            assert len(gens) == 1 and lengths == [len(plain_ids)]
        assert_per_generation(ep, lengths)
        for gen in gens:  # the engine is 0.5 more confident on every model token
            assert gen.attributes[c.RL_MISMATCH_ABS_MEAN] == pytest.approx(0.5, abs=1e-3)
            assert list(gen.attributes[c.RL_MISMATCH_WORST_POSITION])
        assert ep["root"][c.RL_MISMATCH_KL] == pytest.approx(0.5 * 0.5 ** 2, rel=1e-2)
    assert tool_eps == size // 2  # every other rollout_func completion calls the tool
