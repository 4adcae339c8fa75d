"""Train–inference mismatch (issue 33) from AReaL, TRL and the Tinker cookbook, on their own objects.

* AReaL: trajectories made by its ``RLVRWorkflow`` / ``GroupedRolloutWorkflow`` through its
  ``WorkflowExecutor`` (``test_real_areal``'s scripted inference engine: every generated token has
  logprob −0.5), with ``prox_logp`` stored per trajectory as ``PPOTrainer`` does
  (``traj["prox_logp"] = logp`` for each result of ``actor.compute_logp``). The trainer's forward
  pass is the stand-in here (AReaL's FSDP engine needs GPUs): ``compute_logp``'s layout (column t
  scores token t + 1) is produced through AReaL's own ``batched_call`` concat/split.
* TRL: a real tiny ``GRPOTrainer`` with a ``rollout_func`` (the engine: it returns the tokens and
  their logprobs as vLLM would); TRL itself computes ``old_per_token_logps`` (the trainer's) because
  ``steps_per_generation`` = 2 makes the batch off-policy.
* Tinker: groups from the cookbook's ``do_group_rollout`` (``test_real_tinker``'s fixed-token
  completer returns ``TokensWithLogprobs``); the trainer's logprobs never reach the adapter.
"""

from __future__ import annotations

import math

import pytest
from adapter_fixtures import configure_memory, episodes, messages_of
from frameworks import require
from test_real_areal import SCRIPT, keep_logging, modules, rollout, scripted_engine
from tokenizer_fixture import build_tokenizer, chat_ids, text_ids

import otel_rollouts as otr
from otel_rollouts import conventions as c
from otel_rollouts.adapters import areal

__all__ = ["keep_logging"]  # the fixture, imported for its autouse

TOK = build_tokenizer()
STATS = (c.RL_MISMATCH_TOKENS, c.RL_MISMATCH_ABS_MEAN, c.RL_MISMATCH_ABS_MAX, c.RL_MISMATCH_KL,
         c.RL_MISMATCH_RATIO_MIN, c.RL_MISMATCH_RATIO_MAX, c.RL_MISMATCH_OUTSIDE)
DELTA = -2.0  # trainer − engine on every generated token of a diverging sample
KL = 0.5 * DELTA ** 2  # the core's KL estimate (k2, ½·mean Δ², _core/logprobs.py) of such a sample


def mismatch_keys(attributes) -> set[str]:
    return {k for k in attributes if k.startswith(c.RL_MISMATCH_PREFIX)}


def assert_diverged(ep, tokens: int, rollout_logprob=None) -> None:
    """Root and (last) generation of a sample whose every counted token has Δ = DELTA."""
    root = ep["root"]
    assert root[c.RL_KEEP_REASON] == c.REASON_MISMATCH
    assert root[c.RL_MISMATCH_TOKENS] == tokens
    assert root[c.RL_MISMATCH_KL] == pytest.approx(KL, rel=1e-3)
    assert root[c.RL_MISMATCH_ABS_MEAN] == pytest.approx(-DELTA, rel=1e-3)
    assert root[c.RL_MISMATCH_RATIO_MAX] == pytest.approx(math.exp(DELTA), rel=1e-3)
    assert root[c.RL_MISMATCH_OUTSIDE] == tokens  # r = e^-2 is below the default band
    gen = ep["by_kind"][c.KIND_GENERATION][-1].attributes
    assert gen[c.RL_MISMATCH_KL] == pytest.approx(KL, rel=1e-3)
    worst = list(gen[c.RL_MISMATCH_WORST_POSITION])
    assert 0 < len(worst) <= tokens
    assert len(gen[c.RL_MISMATCH_WORST_TOKEN]) == len(worst)
    assert all(isinstance(t, str) and t for t in gen[c.RL_MISMATCH_WORST_TOKEN])
    rollout_lp = list(gen[c.RL_MISMATCH_WORST_ROLLOUT])
    trainer_lp = list(gen[c.RL_MISMATCH_WORST_TRAINER])
    for p, r, t in zip(worst, rollout_lp, trainer_lp, strict=True):
        assert t - r == pytest.approx(DELTA, abs=1e-4)
        if rollout_logprob is not None:  # the value is the engine's for that position: aligned
            assert r == pytest.approx(rollout_logprob(p), abs=1e-5)


# --- AReaL -------------------------------------------------------------------------------------
def engine_logprob(k: int) -> float:
    """The scripted engine's logprob of the k-th generated token."""
    return -0.1 * (k + 1)


def areal_batch(diverging: str, *, drop_engine: bool = False):
    """Groups of two samples per question from AReaL's executor; ``prox_logp`` set on each
    trajectory as ``PPOTrainer`` sets it; the ``diverging`` question's rows get Δ = DELTA."""
    import torch

    data = modules()[7]
    engine = scripted_engine(version=3)
    scripted = engine.agenerate

    async def agenerate(req):  # a logprob that differs per position, as a real engine's
        resp = await scripted(req)
        resp.output_logprobs = [engine_logprob(k) for k in range(len(resp.output_tokens))]
        return resp

    engine.agenerate = agenerate
    batch = [t for t in rollout(engine, ["What is 2 + 2?", "What is 17 * 23?"]) if t is not None]
    assert len(batch) == 2

    def compute_logp(d):  # the trainer's forward, in compute_logp's next-token layout
        rows = []
        for row in range(d["input_ids"].shape[0]):
            text = TOK.decode(d["input_ids"][row].tolist())
            shift = DELTA if diverging in text else 0.0
            rows.append(torch.roll(d["logprobs"][row], -1, dims=-1) + shift)
        return torch.stack(rows)

    for traj, logp in zip(batch, data.batched_call(compute_logp, batch), strict=True):
        traj["prox_logp"] = logp
        if drop_engine:
            del traj["logprobs"]
    return batch


def question_of(root_messages) -> str:
    return next(q for q in SCRIPT if q in str(root_messages))


def test_areal_prox_logp_against_engine_logprobs_keeps_the_diverging_samples(otr_shutdown):
    require("areal")
    mem = configure_memory(cap=2, policy="mismatch")
    batch = areal_batch("What is 17 * 23?")
    generated = {}
    for traj in batch:
        for row in range(traj["input_ids"].shape[0]):
            text = TOK.decode(traj["input_ids"][row].tolist())
            generated[question_of(text)] = int(traj["loss_mask"][row].sum())
    assert areal.record_trajectories(batch, step=3, tokenizer=TOK) == 4
    otr.end_step(3)
    assert otr.flush()
    eps, msgs = episodes(mem), messages_of(mem)
    assert len(eps) == 2  # exactly the two diverging samples (one group)
    for eid, ep in eps.items():
        question = question_of(msgs[eid][1]["content"])
        assert question == "What is 17 * 23?"
        assert_diverged(ep, generated[question], rollout_logprob=engine_logprob)


def test_areal_equal_logprobs_give_zero_mismatch_and_no_logprobs_give_none(memory):
    require("areal")
    batch = areal_batch("no question diverges")
    assert areal.record_trajectories(batch, step=4, tokenizer=TOK) == 4
    without = areal_batch("What is 17 * 23?", drop_engine=True)  # a workflow writing no logprobs
    assert areal.record_trajectories(without, step=5, tokenizer=TOK) == 4
    assert otr.flush()
    eps = episodes(memory)
    assert len(eps) == 8
    for ep in eps.values():
        root = ep["root"]
        if root[c.RL_STEP] == 4:  # the trainer agrees with the engine: measured, and 0
            assert root[c.RL_MISMATCH_TOKENS] > 0
            assert root[c.RL_MISMATCH_KL] == pytest.approx(0.0, abs=1e-9)
            assert root[c.RL_MISMATCH_ABS_MAX] == pytest.approx(0.0, abs=1e-6)
        else:  # no engine logprobs: nothing to compare, recorded all the same
            assert mismatch_keys(root) == set()
            assert all(mismatch_keys(s.attributes) == set() for s in ep["spans"])
            assert root[c.RL_STATUS] == c.STATUS_OK and c.RL_REWARD in root


def test_areal_workflow_wrapper_has_engine_logprobs_only(memory):
    """The trajectory a workflow returns has no ``prox_logp`` yet: no statistic, no warning."""
    require("areal")
    batch = areal_batch("What is 17 * 23?")
    for traj in batch:
        del traj["prox_logp"]
    assert areal.record_trajectories(batch, step=6, tokenizer=TOK) == 4
    assert otr.flush()
    eps = episodes(memory)
    assert len(eps) == 4
    assert all(mismatch_keys(s.attributes) == set() for ep in eps.values() for s in ep["spans"])


# --- TRL ---------------------------------------------------------------------------------------
PROMPTS = ["What is 2 + 2?", "What is 17 * 23?", "The weather in Paris is sunny.", "Think step by step."]
ANSWER = "The answer is 4.<|im_end|>"


def engine_rollout(diverging: str | None, engine: bool = True):
    """A ``rollout_func`` standing in for vLLM: fixed completions, and their logprobs under the
    model being trained (what a perfect engine would report) — shifted by −DELTA for the
    ``diverging`` prompt (the engine is more confident than the trainer there)."""

    def rollout_func(prompts, trainer):
        import torch

        out = {"prompt_ids": [], "completion_ids": [], "logprobs": []}
        temperature = float(getattr(trainer, "temperature", 1.0) or 1.0)
        for p in prompts:
            pids = chat_ids(TOK, p, generation_prompt=True)
            cids = text_ids(TOK, ANSWER)
            with torch.no_grad():
                logits = trainer.model(torch.tensor([pids + cids])).logits[0].float()
            logp = torch.log_softmax(logits[len(pids) - 1:-1] / temperature, dim=-1)
            lp = logp.gather(-1, torch.tensor(cids).unsqueeze(-1)).squeeze(-1)
            if p[-1]["content"] == diverging:
                lp = lp - DELTA
            out["prompt_ids"].append(pids)
            out["completion_ids"].append(cids)
            out["logprobs"].append(lp.tolist() if engine else [None] * len(cids))
        return out

    return rollout_func


def trl_train(tmp_path, rollout_func, **overrides):
    require("trl")
    from datasets import Dataset
    from test_real_trl import grpo_args, train

    def length_reward(completion_ids, **kwargs):
        return [float(len(ids)) for ids in completion_ids]

    dataset = Dataset.from_dict({"prompt": [[{"role": "user", "content": p}] for p in PROMPTS]})
    args = grpo_args(tmp_path, steps_per_generation=2, max_completion_length=8, **overrides)
    kwargs = {"rollout_func": rollout_func} if rollout_func is not None else {}
    return train(TOK, [length_reward], args, dataset, **kwargs)


def test_trl_sampling_against_old_logps_keeps_the_diverging_group(tmp_path, otr_shutdown, monkeypatch):
    monkeypatch.setenv("TRL_EXPERIMENTAL_SILENCE", "1")
    mem = configure_memory(cap=2, policy="mismatch")
    trl_train(tmp_path, engine_rollout("Think step by step."))
    eps, msgs = episodes(mem), messages_of(mem)
    assert len(eps) == 2
    tokens = len(text_ids(TOK, ANSWER))
    for eid, ep in eps.items():
        assert msgs[eid][0] == {"role": "user", "content": "Think step by step."}
        assert_diverged(ep, tokens)


def test_trl_agreeing_engine_gives_near_zero_mismatch(tmp_path, otr_shutdown, monkeypatch):
    monkeypatch.setenv("TRL_EXPERIMENTAL_SILENCE", "1")
    mem = configure_memory()
    trl_train(tmp_path, engine_rollout(None))
    eps = episodes(mem)
    assert len(eps) == 8
    for ep in eps.values():
        root = ep["root"]
        assert root[c.RL_MISMATCH_TOKENS] == len(text_ids(TOK, ANSWER))
        assert root[c.RL_MISMATCH_ABS_MAX] < 1e-3  # TRL's forward and ours: the same weights


def test_trl_without_engine_logprobs_records_no_mismatch(tmp_path, otr_shutdown, monkeypatch):
    """Plain ``transformers`` generation gives TRL no sampling logprobs (only its own
    ``old_per_token_logps``): recorded, without any ``rl.mismatch.*``."""
    mem = configure_memory()
    trainer, callback = trl_train(tmp_path, None)
    eps = episodes(mem)
    assert len(eps) == 8 and callback.recorded == 8
    for ep in eps.values():
        assert all(mismatch_keys(s.attributes) == set() for s in ep["spans"])
        assert ep["root"][c.RL_STATUS] in (c.STATUS_OK, c.STATUS_TRUNCATED)


# --- Tinker ------------------------------------------------------------------------------------
def tinker_group(logprobs: bool):
    """An arithmetic ``ProblemEnv`` group from the cookbook, the sampler's logprobs given or not."""
    completers = require("tinker_cookbook.completers")
    renderers = require("tinker_cookbook.renderers")
    from test_real_tinker import arithmetic_group

    renderer = renderers.get_renderer("qwen3", TOK)
    builder, group = arithmetic_group(TOK, renderer, ["The answer is 4.<|im_end|>", "5<|im_end|>"])
    if not logprobs:
        for trajectory in group.trajectories_G:
            for tr in trajectory.transitions:
                tr.ac = completers.TokensWithLogprobs(tr.ac.tokens, None, tr.ac.stop_reason)
    return renderer, group


@pytest.mark.parametrize("logprobs", [True, False])
def test_tinker_engine_logprobs_alone_give_no_statistic(memory, monkeypatch, logprobs):
    from otel_rollouts.adapters.tinker import record_trajectory_groups
    from otel_rollouts.record.episode import Turn

    passed = []
    original = Turn.record_generation

    def spy(self, *args, **kwargs):
        passed.append({k: kwargs.get(k) for k in ("logprobs", "trainer_logprobs", "tokens")})
        return original(self, *args, **kwargs)

    monkeypatch.setattr(Turn, "record_generation", spy)
    renderer, group = tinker_group(logprobs)
    ids = record_trajectory_groups([group], step=1, tokenizer=TOK, renderer=renderer)
    assert otr.flush()
    eps = episodes(memory)
    assert len(ids) == len(eps) == 2
    for ep in eps.values():
        assert all(mismatch_keys(s.attributes) == set() for s in ep["spans"])
        assert len(ep["by_kind"][c.KIND_GENERATION]) == 1 and c.RL_REWARD in ep["root"]
    assert len(passed) == 2
    for (trajectory, call) in zip(group.trajectories_G, passed, strict=True):
        ac = trajectory.transitions[0].ac
        assert call["trainer_logprobs"] is None
        if logprobs:
            assert call["logprobs"] == ac.maybe_logprobs and call["tokens"] == ac.tokens
        else:
            assert call["logprobs"] is None
