"""Train–inference mismatch (issue 33) through the verl and SkyRL adapters, on the frameworks' own
objects and code paths (verl 0.9.1 on CPU, skyrl 0.3.0 + skyrl-gym).

verl: the batch is built by ``RayPPOTrainer.fit``'s steps on verl's code (``test_real_verl.verl_step``)
with an LLM server stand-in that returns ``TokenOutput.log_probs``: verl's own tool-agent loop and
``_postprocess`` turn them into ``rollout_log_probs``; the actor's ``old_log_probs`` (a GPU
forward pass in verl) are joined as ``RayPPOTrainer`` joins them: ``batch.union`` of a
``DataProto`` holding them. SkyRL: ``SkyRLGymGenerator.generate`` with ``sampling_params.logprobs``
set (the engine stand-in returns ``response_logprobs``); the trainer's ``action_log_probs`` are
laid out by SkyRL's own ``convert_prompts_responses_to_batch_tensors`` (right-aligned
``[rows, max_response]``), as ``fwd_logprobs_values_reward`` returns them.
"""

from __future__ import annotations

import asyncio
import logging
from typing import Any

import pytest
from adapter_fixtures import episodes
from frameworks import require
from otr_helpers import configure_memory

import otel_rollouts as otr
from otel_rollouts import conventions as c

SHIFT = -1.5  # the trainer's logprob minus the engine's on the diverging tokens
SHIFTED_TOKENS = 3  # tokens shifted per diverging sample


def engine_logprobs(n: int) -> list[float]:
    return [-0.05 - 0.1 * (k % 5) for k in range(n)]


def configure(cap: int, policy: Any = "mismatch"):

    exporter = configure_memory(cap, policy)
    return exporter


def mismatch_keys(attributes: Any) -> set[str]:
    return {k for k in attributes if k.startswith(c.RL_MISMATCH_PREFIX)}


def generation_spans(episode: dict[str, Any]) -> list[Any]:
    return [s for s in episode["spans"] if s.attributes.get(c.RL_SPAN_KIND) == c.KIND_GENERATION]


def assert_diverged(episode: dict[str, Any], counted: int) -> None:
    """The root and a generation span of a diverging sample carry the statistics: |Δ| max = the
    shift, the worst tokens listed largest first, the kept reason ``mismatch``."""
    root = episode["root"]
    assert root[c.RL_KEEP_REASON] == c.REASON_MISMATCH
    assert root[c.RL_MISMATCH_TOKENS] == counted
    assert root[c.RL_MISMATCH_ABS_MAX] == pytest.approx(abs(SHIFT), abs=1e-5)
    assert root[c.RL_MISMATCH_ABS_MEAN] == pytest.approx(abs(SHIFT) * SHIFTED_TOKENS / counted, abs=1e-5)
    assert root[c.RL_MISMATCH_KL] > 0 and root[c.RL_MISMATCH_RATIO_MIN] == pytest.approx(2.718281828 ** SHIFT, rel=1e-4)
    spans = [s for s in generation_spans(episode) if c.RL_MISMATCH_ABS_MAX in s.attributes]
    assert spans, "no generation span carries rl.mismatch.*"
    worst = max(spans, key=lambda s: s.attributes[c.RL_MISMATCH_ABS_MAX])
    assert worst.attributes[c.RL_MISMATCH_ABS_MAX] == pytest.approx(abs(SHIFT), abs=1e-5)
    rollout = list(worst.attributes[c.RL_MISMATCH_WORST_ROLLOUT])
    trainer = list(worst.attributes[c.RL_MISMATCH_WORST_TRAINER])
    assert trainer[0] - rollout[0] == pytest.approx(SHIFT, abs=1e-5)
    assert len(worst.attributes[c.RL_MISMATCH_WORST_POSITION]) == len(rollout)
    assert len(worst.attributes[c.RL_MISMATCH_WORST_TOKEN]) == len(rollout)


# --- verl ----------------------------------------------------------------------------------------
@pytest.fixture
def verl_real(monkeypatch):
    require("verl")
    import test_real_verl

    class LogprobServer(test_real_verl.ScriptedServer):
        """The LLM server stand-in, returning the sampled tokens' logprobs as verl's vLLM server
        does with ``calculate_log_probs``."""

        async def generate(self, request_id, **kwargs):
            output = await super().generate(request_id, **kwargs)
            output.log_probs = engine_logprobs(len(output.token_ids))
            return output

    def step(tmp_path, *, logprobs: bool = True):
        if logprobs:
            monkeypatch.setattr(test_real_verl, "ScriptedServer", LogprobServer)
        return test_real_verl.verl_step(tmp_path)

    logging.getLogger("verl").setLevel(logging.ERROR)
    return step


def with_old_log_probs(batch: Any, diverge: tuple[int, ...] = ()) -> Any:
    """``batch.union(old_log_prob)`` as ``RayPPOTrainer.fit`` does after ``_compute_old_log_prob``:
    the actor's logprobs equal the engine's, except ``SHIFTED_TOKENS`` generated tokens of the
    ``diverge`` samples."""
    import torch
    from verl.protocol import DataProto

    base = batch.batch["rollout_log_probs"] if "rollout_log_probs" in batch.batch.keys() else \
        torch.full(batch.batch["responses"].shape, -0.3)
    old = base.clone()
    mask = batch.batch["response_mask"]
    for j in diverge:
        positions = mask[j].nonzero().flatten()[:SHIFTED_TOKENS]
        old[j, positions] += SHIFT
    return batch.union(DataProto.from_single_dict({"old_log_probs": old}))


def episode_id(batch: Any, truth: list[dict[str, Any]], j: int, step: int = 3) -> str:
    return f"train-{step}-{batch.non_tensor_batch['uid'][j]}-{truth[j]['rollout_n']}"


def test_verl_mismatch_policy_keeps_exactly_the_diverging_samples(tmp_path, verl_real, otr_shutdown):
    from otel_rollouts.adapters import verl as verl_adapter

    tok, batch, truth = verl_real(tmp_path)
    assert "rollout_log_probs" in batch.batch.keys()  # made by verl's agent loop from log_probs
    diverge = (1, 6)
    batch = with_old_log_probs(batch, diverge)
    exporter = configure(cap=len(diverge))
    assert verl_adapter.record_batch(batch, step=3, tokenizer=tok) == len(batch)
    assert otr.flush()
    eps = episodes(exporter)
    assert sorted(eps) == sorted(episode_id(batch, truth, j) for j in diverge)
    for j in diverge:
        assert_diverged(eps[episode_id(batch, truth, j)], int(batch.batch["response_mask"][j].sum()))


def test_verl_mismatch_composes_with_other_parts_and_agreeing_samples_have_zero_stats(tmp_path, verl_real,
                                                                                        otr_shutdown):
    from otel_rollouts.adapters import verl as verl_adapter

    tok, batch, truth = verl_real(tmp_path)
    batch = with_old_log_probs(batch, (3,))
    exporter = configure(cap=len(batch), policy=otr.Compose(otr.Mismatch(n=1), otr.Uniform()))
    verl_adapter.record_batch(batch, step=3, tokenizer=tok)
    assert otr.flush()
    eps = episodes(exporter)
    assert len(eps) == len(batch)
    diverged = episode_id(batch, truth, 3)
    assert eps[diverged]["root"][c.RL_KEEP_REASON] == c.REASON_MISMATCH
    for key, ep in eps.items():
        root = ep["root"]
        assert root[c.RL_MISMATCH_TOKENS] > 0  # both logprob sets known on every sample
        if key != diverged:
            assert root[c.RL_MISMATCH_ABS_MAX] == 0 and root[c.RL_KEEP_REASON] != c.REASON_MISMATCH


def test_verl_without_engine_logprobs_records_no_mismatch_and_no_error(tmp_path, verl_real, memory):
    from otel_rollouts.adapters import verl as verl_adapter

    tok, batch, _ = verl_real(tmp_path, logprobs=False)
    assert "rollout_log_probs" not in batch.batch.keys()  # calculate_log_probs off
    batch = with_old_log_probs(batch, (0,))  # the actor's are there, the engine's are not
    assert verl_adapter.record_batch(batch, step=3, tokenizer=tok) == len(batch)
    assert otr.flush()
    eps = episodes(memory)
    assert len(eps) == len(batch)
    for ep in eps.values():
        assert c.RL_REWARD in ep["root"]
        for span in ep["spans"]:
            assert not mismatch_keys(span.attributes), span.name
    assert otr.stats()["totals"].get("errors.library", 0) == 0


def test_verl_bypass_mode_old_log_probs_are_not_the_trainers(tmp_path, verl_real, memory):
    """verl's bypass mode (``apply_bypass_mode``) makes ``old_log_probs`` the engine's tensor
    itself: no trainer measurement, so no statistics (not a Δ of 0 by construction)."""
    from omegaconf import OmegaConf
    from verl.trainer.ppo.rollout_corr_helper import apply_bypass_mode

    from otel_rollouts.adapters import verl as verl_adapter

    tok, batch, _ = verl_real(tmp_path)
    apply_bypass_mode(batch, rollout_corr_config=OmegaConf.create({"bypass_mode": True}),
                      policy_loss_config=OmegaConf.create({}))
    assert batch.batch["old_log_probs"].data_ptr() == batch.batch["rollout_log_probs"].data_ptr()
    verl_adapter.record_batch(batch, step=3, tokenizer=tok)
    assert otr.flush()
    eps = episodes(memory)
    assert len(eps) == len(batch)
    assert not any(mismatch_keys(s.attributes) for ep in eps.values() for s in ep["spans"])


def _spy_record_token_batch(monkeypatch, verl_adapter) -> dict[str, Any]:
    """The keywords the verl adapter passes to ``record_token_batch`` (the call still runs)."""
    seen: dict[str, Any] = {}
    real = verl_adapter.record_token_batch

    def spy(*args, **kwargs):
        seen.update(kwargs)
        return real(*args, **kwargs)

    monkeypatch.setattr(verl_adapter, "record_token_batch", spy)
    return seen


def test_verl_logprobs_are_passed_without_copies(tmp_path, verl_real, memory, monkeypatch):
    """The response-only ``[B, R]`` tensors reach ``record_token_batch`` as verl holds them."""
    from otel_rollouts.adapters import verl as verl_adapter

    tok, batch, _ = verl_real(tmp_path)
    batch = with_old_log_probs(batch)
    seen = _spy_record_token_batch(monkeypatch, verl_adapter)
    verl_adapter.record_batch(batch, step=3, tokenizer=tok)
    assert seen["logprobs"] is batch.batch["rollout_log_probs"]
    assert seen["trainer_logprobs"] is batch.batch["old_log_probs"]
    assert seen["logprobs"].shape == batch.batch["responses"].shape  # the last R columns of input_ids


def test_verl_loop_session_passes_the_engine_logprobs(memory, monkeypatch):
    """``verl_loop.observe_session`` (the v1 trainer's worker): ``AgentLoopOutput.response_logprobs``
    become ``rollout_log_probs``; the actor's are not computed yet: no statistics."""
    require("verl")
    from types import SimpleNamespace

    from tokenizer_fixture import build_tokenizer, chat_ids, text_ids
    from verl.experimental.agent_loop.agent_loop import AgentLoopMetrics, AgentLoopOutput

    from otel_rollouts.adapters import verl as verl_adapter
    from otel_rollouts.adapters import verl_loop

    tok = build_tokenizer()
    prompt = chat_ids(tok, [{"role": "user", "content": "What is 2 + 2?"}], generation_prompt=True)
    response = text_ids(tok, "The answer is 4.<|im_end|>")
    output = AgentLoopOutput(prompt_ids=prompt, response_ids=response, response_mask=[1] * len(response),
                             response_logprobs=engine_logprobs(len(response)), num_turns=2,
                             metrics=AgentLoopMetrics(), reward_score=1.0)
    seen = _spy_record_token_batch(monkeypatch, verl_adapter)
    sample = {"global_steps": 3, "session_id": 0, "uid": "u0", "index": 10}
    assert verl_loop.observe_session(SimpleNamespace(tokenizer=tok), output, False, sample) == 1
    assert seen["logprobs"].tolist() == [pytest.approx(engine_logprobs(len(response)))]
    assert "trainer_logprobs" not in seen
    assert otr.flush()
    (ep,) = episodes(memory).values()
    assert ep["root"][c.RL_REWARD] == 1.0 and not mismatch_keys(ep["root"])


# --- SkyRL ---------------------------------------------------------------------------------------
SCRIPT = {"q0_0": ["I think 2 + 2 = 5. #### 5", "#### 4"], "q0_1": ["The answer is #### 4"],
          "q0_2": ["It is #### 4"], "q0_3": ["Hmm, 2 + 2 = 3. #### 3", "Sorry: #### 4"]}


def skyrl_generate(*, logprobs: bool = True, step_wise: bool = False):
    """SkyRL's own path: ``prepare_generator_input`` → ``SkyRLGymGenerator.generate`` over skyrl-gym's
    ``gsm8k_multi_turn``, with ``sampling_params.logprobs`` set (the engine returns them)."""
    import test_real_skyrl as real

    gym_generator = require("skyrl.train.generators.skyrl_gym_generator")
    generator_utils = require("skyrl.train.generators.utils")
    skyrl_config = require("skyrl.train.config")

    class LogprobEngine(real.ScriptedEngine):
        async def generate(self, engine_input: dict[str, Any], model: str | None = None) -> dict[str, Any]:
            out = await super().generate(engine_input, model)
            if logprobs:
                out["response_logprobs"] = [engine_logprobs(len(out["response_ids"][0]))]
            return out

    cfg = skyrl_config.GeneratorConfig(max_turns=3, max_input_length=4096, n_samples_per_prompt=len(SCRIPT),
                                       step_wise_trajectories=step_wise)
    cfg.sampling_params.logprobs = 0 if logprobs else None  # vLLM: the sampled token's logprob
    generator = gym_generator.SkyRLGymGenerator(cfg, skyrl_config.SkyRLGymConfig(max_env_workers=0),
                                                LogprobEngine(SCRIPT), real.TOKENIZER)
    prompts = [{"prompt": real.QUESTION, "env_class": "gsm8k_multi_turn", "uid": "q0",
                "env_extras": {"reward_spec": {"ground_truth": "4"}}}]
    gi, _ = generator_utils.prepare_generator_input(prompts, len(SCRIPT), None, "gsm8k_multi_turn", "train", 1)
    go = asyncio.run(generator.generate(gi, disable_tqdm=True))
    return real.TOKENIZER, gi, go


def action_log_probs(tok, go: dict[str, Any], diverge: tuple[int, ...] = ()):
    """The trainer's logprobs as SkyRL lays out ``training_input["action_log_probs"]``: SkyRL's
    ``convert_prompts_responses_to_batch_tensors`` (right-aligned ``[rows, max_response]``), equal to
    the engine's except ``SHIFTED_TOKENS`` trained tokens of the ``diverge`` rows. Returns it and
    the right-aligned loss mask. (SkyRL's module imports ``jaxtyping``; where that is not
    installed the same layout is built here, as its docstring states it: leading zeros.)"""
    import torch

    try:
        from skyrl.train.dataset import preprocess
    except ImportError:
        width = max(len(r) for r in go["response_ids"])

        def right(rows, dtype):
            return torch.tensor([[0] * (width - len(r)) + list(r) for r in rows], dtype=dtype)

        logprobs, loss_masks = right(go["rollout_logprobs"], torch.float32), right(go["loss_masks"], torch.int64)
    else:
        import inspect

        convert = preprocess.convert_prompts_responses_to_batch_tensors
        # 0.3.0 takes the tokenizer, 0.4.0 its pad_token_id (as their trainers call it)
        first = tok if "tokenizer" in inspect.signature(convert).parameters else tok.pad_token_id
        tensors = convert(first, go["prompt_token_ids"], go["response_ids"], go["rewards"], go["loss_masks"],
                          logprobs=go["rollout_logprobs"])
        loss_masks, logprobs = tensors[4], tensors[5]
    trainer = logprobs.clone()
    for j in diverge:
        positions = loss_masks[j].nonzero().flatten()[:SHIFTED_TOKENS]
        trainer[j, positions] += SHIFT
    return trainer, loss_masks


def test_skyrl_mismatch_policy_keeps_exactly_the_diverging_trajectories(otr_shutdown):
    from otel_rollouts.adapters import skyrl

    tok, gi, go = skyrl_generate()
    assert go["rollout_logprobs"] is not None and len(go["rollout_logprobs"][0]) == len(go["response_ids"][0])
    diverge = (0, 3)  # the two-turn trajectories
    trainer, loss_masks = action_log_probs(tok, go, diverge)
    exporter = configure(cap=len(diverge))
    assert skyrl.record_generator_output(gi, go, step=1, tokenizer=tok, trainer_logprobs=trainer) == len(SCRIPT)
    assert otr.flush()
    eps = episodes(exporter)
    assert sorted(eps) == ["q0_0", "q0_3"]
    for j in diverge:
        ep = eps[f"q0_{j}"]
        assert_diverged(ep, int(loss_masks[j].sum()))
        assert len(generation_spans(ep)) == 2
        # each generation carries its own tokens' statistics (test_mismatch_multiturn.py)
        assert all(mismatch_keys(g.attributes) for g in generation_spans(ep))


def test_skyrl_trainer_logprobs_as_per_row_lists_and_composed_policy(otr_shutdown):
    from otel_rollouts.adapters import skyrl

    tok, gi, go = skyrl_generate()
    trainer = [list(row) for row in go["rollout_logprobs"]]
    masks = go["loss_masks"]
    shifted = [k for k, m in enumerate(masks[2]) if m][:SHIFTED_TOKENS]
    for k in shifted:
        trainer[2][k] += SHIFT
    exporter = configure(cap=len(SCRIPT), policy="mismatch+first")
    skyrl.record_generator_output(gi, go, step=1, tokenizer=tok, trainer_logprobs=trainer)
    assert otr.flush()
    eps = episodes(exporter)
    assert len(eps) == len(SCRIPT)
    assert_diverged(eps["q0_2"], sum(masks[2]))
    for key in ("q0_0", "q0_1", "q0_3"):
        assert eps[key]["root"][c.RL_MISMATCH_ABS_MAX] == 0


def test_skyrl_without_engine_logprobs_records_no_mismatch_and_no_error(memory):
    from otel_rollouts.adapters import skyrl

    tok, gi, go = skyrl_generate(logprobs=False)
    assert go["rollout_logprobs"] is None
    trainer = [[-0.3] * len(ids) for ids in go["response_ids"]]  # the trainer's alone
    assert skyrl.record_generator_output(gi, go, step=1, tokenizer=tok, trainer_logprobs=trainer) == len(SCRIPT)
    assert otr.flush()
    eps = episodes(memory)
    assert sorted(eps) == sorted(SCRIPT)
    for ep in eps.values():
        assert c.RL_REWARD in ep["root"]
        assert not any(mismatch_keys(s.attributes) for s in ep["spans"])
    assert otr.stats()["totals"].get("errors.library", 0) == 0


def test_skyrl_engine_logprobs_alone_give_no_statistics(memory):
    """``RecordingGenerator`` / a call right after generation: only the engine's are known."""
    from otel_rollouts.adapters import skyrl

    tok, gi, go = skyrl_generate()
    assert skyrl.record_generator_output(gi, go, step=1, tokenizer=tok) == len(SCRIPT)
    assert otr.flush()
    eps = episodes(memory)
    assert len(eps) == len(SCRIPT)
    assert not any(mismatch_keys(s.attributes) for ep in eps.values() for s in ep["spans"])


def test_skyrl_step_wise_rows_are_joined_per_trajectory(otr_shutdown):
    """Step-wise mode: one row per turn; the trajectory's rows' logprobs are compared together."""
    from otel_rollouts.adapters import skyrl

    tok, gi, go = skyrl_generate(step_wise=True)
    assert go["is_last_step"] is not None and len(go["response_ids"]) > len(SCRIPT)
    rows = [k for k, t in enumerate(go["trajectory_ids"]) if t.to_string() == "q0_3"]
    assert len(rows) == 2
    trainer, loss_masks = action_log_probs(tok, go, (rows[-1],))
    exporter = configure(cap=1)
    skyrl.record_generator_output(gi, go, step=1, tokenizer=tok, trainer_logprobs=trainer)
    assert otr.flush()
    eps = episodes(exporter)
    assert sorted(eps) == ["q0_3"]
    assert_diverged(eps["q0_3"], int(sum(loss_masks[k].sum() for k in rows)))


def test_skyrl_mismatched_lengths_are_warned_not_guessed(memory, caplog):
    from otel_rollouts.adapters import skyrl

    tok, gi, go = skyrl_generate()
    short = [row[:-1] for row in go["rollout_logprobs"]]  # a trainer row shorter than its response
    with caplog.at_level(logging.WARNING, logger="otel_rollouts"):
        assert skyrl.record_generator_output(gi, go, step=1, tokenizer=tok, trainer_logprobs=short) == len(SCRIPT)
    assert otr.flush()
    eps = episodes(memory)
    assert len(eps) == len(SCRIPT)
    assert not any(mismatch_keys(s.attributes) for ep in eps.values() for s in ep["spans"])
    assert "trainer_logprobs" in caplog.text
