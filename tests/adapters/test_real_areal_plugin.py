"""AReaL plug-in (``areal.traced``): AReaL 1.0.4's own rollout loop with one line added.

The loop is AReaL's: ``RemoteInfEngine.prepare_batch`` (its ``_resolve_workflow``, which wraps
the workflow in ``GroupedRolloutWorkflow`` for ``group_size``), its ``WorkflowExecutor`` with the
staleness manager and ``should_accept_fn``, ``submit(..., is_eval=True)`` + ``wait`` for
evaluation, and ``set_version(global_step + 1)`` after each step as ``PPOTrainer.train`` does.
The workflows are AReaL's ``RLVRWorkflow`` and ``MultiTurnWorkflow``, reward functions run in its
process pool. The one stand-in: ``RemoteInfEngine.agenerate`` answers from a script (no GPU or
SGLang server on CPU CI), stamping tokens with the engine's real version (its ``get_version``).

The only line added to the loop is the wrapper (``workflow=areal.traced(workflow)``), or its
by-path form (``workflow="otel_rollouts.adapters.areal.TracedWorkflow"``).
"""

from __future__ import annotations

import logging

import pytest
from adapter_fixtures import configure_memory, episodes, messages_of
from test_real_areal import (
    RETRY,
    SCRIPT,
    SYSTEM,
    TOK,
    clean,
    keep_logging,
    modules,
    reward_fn,
    sample,
)

import otel_rollouts as otr
from otel_rollouts import conventions as c
from otel_rollouts.adapters import areal

__all__ = ["keep_logging"]  # the fixture, imported for its autouse


def scripted_remote_engine(*, batch_size, offpolicy=0, replies=None):
    """AReaL's ``RemoteInfEngine`` with its real executor, version and workflow resolution;
    only ``agenerate`` (the HTTP call to an inference server) is scripted."""
    api, cli_args, _, _, remote, executor_mod, *_ = modules()

    class ScriptedRemoteEngine(remote.RemoteInfEngine):
        calls: dict[str, int]

        async def agenerate(self, req):
            prompt = TOK.decode(req.input_ids)
            question = next(q for q in SCRIPT if q in prompt)
            k = self.calls.get(question, 0)
            self.calls[question] = k + 1
            script = replies or {q: v[0] for q, v in SCRIPT.items()}
            text = script[question][k % len(script[question])]
            out = TOK.encode(text, add_special_tokens=False)
            version = self.get_version()
            return api.ModelResponse(input_tokens=list(req.input_ids), output_tokens=out,
                                     output_logprobs=[-0.5] * len(out), output_versions=[version] * len(out),
                                     stop_reason="stop" if out and out[-1] == TOK.eos_token_id else "length",
                                     tokenizer=TOK)

    config = cli_args.InferenceEngineConfig(consumer_batch_size=batch_size, max_head_offpolicyness=offpolicy,
                                            max_concurrent_rollouts=8)
    engine = ScriptedRemoteEngine(config, backend=None)
    engine.calls = {}
    engine.logger = logging.getLogger("test-engine")
    executor = executor_mod.WorkflowExecutor(config, engine)
    executor.initialize(train_data_parallel_size=1)
    engine.workflow_executor = executor
    return engine


def dataloader(questions, batch_size):
    from torchdata.stateful_dataloader import StatefulDataLoader

    return StatefulDataLoader([sample(q) for q in questions], batch_size=batch_size, shuffle=False,
                              collate_fn=lambda items: items)


def rlvr():
    _, cli_args, rlvr_mod, *_ = modules()
    return rlvr_mod.RLVRWorkflow(reward_fn, cli_args.GenerationHyperparameters(n_samples=1, max_new_tokens=32), TOK)


def answer_of(conv):
    return next(m["content"] for m in conv if m["role"] == "assistant")


def test_trainer_loop_with_the_wrapper_records_every_sample_on_policy(otr_shutdown):
    """``PPOTrainer.train``'s rollout loop (``prepare_batch`` with ``group_size``, then
    ``set_version(global_step + 1)``) over three steps with only the wrapper added: every sample
    of every step is an episode at that step, with AReaL's reward, its group, the tokens' version
    and staleness 0; each step is closed once the engine moved past it."""
    memory = configure_memory(policy="uniform")  # keeps nothing before its step closes
    questions = ["What is 2 + 2?", "What is 17 * 23?"]
    engine = scripted_remote_engine(batch_size=2)
    loader = dataloader(questions, batch_size=2)
    workflow = areal.traced(rlvr())  # the one line
    truth = {}  # (step, question, answer) -> AReaL's reward
    closed_before_flush = []
    try:
        for global_step in range(3):
            batch = engine.prepare_batch(loader, workflow=workflow, group_size=2)
            for traj in batch:
                for row in range(traj["input_ids"].shape[0]):
                    n = int(traj["attention_mask"][row].sum())
                    text = TOK.decode(traj["input_ids"][row, :n].tolist())
                    question = next(q for q in SCRIPT if q in text)
                    answer = text.rsplit("<|im_start|>assistant\n", 1)[1].removesuffix("<|im_end|>")
                    truth[(global_step, question, answer)] = float(traj["rewards"][row])
            engine.set_version(global_step + 1)  # PPOTrainer.train after the update
        # steps 0 and 1 were closed by the wrapper when later samples carried a newer version
        closed_before_flush = sorted(k for k, v in otr.stats()["steps"].items() if v.get("kept", 0) == 4)
    finally:
        engine.destroy()
    assert "0/train" in closed_before_flush and "1/train" in closed_before_flush
    assert "2/train" not in closed_before_flush  # the last step waits for flush/shutdown
    assert otr.flush()
    eps, msgs = episodes(memory), messages_of(memory)
    assert len(eps) == len(truth) == 3 * 2 * 2
    groups: dict[tuple[int, str], set] = {}
    for eid, ep in eps.items():
        root, conv = ep["root"], msgs[eid]
        step, question, answer = root[c.RL_STEP], conv[1]["content"], answer_of(conv)
        assert conv == [SYSTEM, {"role": "user", "content": question}, {"role": "assistant", "content": answer}]
        assert all(clean(m["content"]) for m in conv)
        assert root[c.RL_REWARD] == truth[(step, question, answer)]
        assert [k for k in root if k.startswith(c.RL_REWARD_COMPONENT_PREFIX)] == []
        assert root[c.RL_SPLIT] == "train"
        assert root[c.RL_POLICY_VERSION] == step and root[c.RL_STALENESS] == 0
        assert root[c.RL_TURN_COUNT] == 1 and root[c.RL_STATUS] == c.STATUS_OK
        groups.setdefault((step, question), set()).add(root[c.RL_GROUP_ID])
    # the two samples AReaL's GroupedRolloutWorkflow ran for one prompt share their group
    assert all(len(g) == 1 for g in groups.values())
    assert len({next(iter(g)) for g in groups.values()}) == len(groups)


def test_config_path_form_is_resolved_by_areal(memory):
    """The by-path form (what single-controller mode sends to rollout workers): AReaL's own
    ``_resolve_workflow`` imports ``otel_rollouts.adapters.areal.TracedWorkflow`` and builds it
    with ``workflow_kwargs``, which name the wrapped workflow by path too; a wrapper instance maps
    back to that path in AReaL's ``RolloutController``."""
    api, cli_args, *_ = modules()
    from areal.infra.controller.rollout_controller import RolloutController
    from areal.utils.dynamic_import import import_from_string

    engine = scripted_remote_engine(batch_size=1)
    kwargs = {"workflow": "areal.workflow.rlvr.RLVRWorkflow",
              "workflow_kwargs": {"reward_fn": reward_fn, "tokenizer": TOK,
                                  "gconfig": cli_args.GenerationHyperparameters(n_samples=1, max_new_tokens=32)}}
    try:
        batch = engine.prepare_batch(dataloader(["What is 17 * 23?"], 1),
                                     workflow="otel_rollouts.adapters.areal.TracedWorkflow",
                                     workflow_kwargs=kwargs, group_size=2)
    finally:
        engine.destroy()
    assert len(batch) == 1
    path = RolloutController._resolve_workflow_str(None, areal.traced(rlvr()))
    assert path == "otel_rollouts.adapters.areal.TracedWorkflow"
    assert isinstance(import_from_string(path)(rlvr()), api.RolloutWorkflow)
    assert otr.flush()
    eps = episodes(memory)
    assert len(eps) == 2
    assert {ep["root"][c.RL_REWARD] for ep in eps.values()} == {1.0, 0.0}
    assert all(ep["root"][c.RL_STALENESS] == 0 for ep in eps.values())


def test_eval_submit_rejected_failed_and_multi_turn(memory, caplog):
    """Evaluation (``submit(..., is_eval=True)``, whose results ``PPOTrainer`` never hands back):
    split eval, no staleness, at the evaluated weights' version. A trajectory the workflow
    returns as None is a filtered episode; a workflow that raises gives an error episode while
    AReaL goes on; ``MultiTurnWorkflow``'s retry prompt stays a user message."""
    _, cli_args, _, multi_turn, *_ = modules()
    gconfig = cli_args.GenerationHyperparameters(n_samples=1, max_new_tokens=32)
    replies = {"What is 2 + 2?": ["5", "The answer is 4.<|im_end|>"],
               "What is 17 * 23?": ["The answer is 391.<|im_end|>"],
               "Think step by step.": ["The lazy dog.<|im_end|>"]}
    engine = scripted_remote_engine(batch_size=1, replies=replies)
    engine.set_version(4)

    class NoneOrRaise(modules()[0].RolloutWorkflow):
        async def arun_episode(self, engine, data):
            if "Think" in data["messages"][1]["content"]:
                return None
            raise RuntimeError("sandbox unreachable")

    try:
        multi = multi_turn.MultiTurnWorkflow(reward_fn, gconfig, TOK, max_turns=3, turn_discount=0.5)
        engine.submit(sample("What is 2 + 2?"), areal.traced(multi), is_eval=True)
        engine.submit(sample("Think step by step."), areal.traced(NoneOrRaise(), tokenizer=TOK))
        engine.submit(sample("What is 17 * 23?"), areal.traced(NoneOrRaise(), tokenizer=TOK))
        results = engine.wait(3, timeout=60)
    finally:
        engine.destroy()
    assert sum(r is None for r in results) == 2
    assert otr.flush()
    eps, msgs = episodes(memory), messages_of(memory)
    by_status = {}
    for eid, ep in eps.items():
        by_status.setdefault(ep["root"][c.RL_STATUS], []).append(eid)
    (evaluation,) = [e for e in eps if eps[e]["root"][c.RL_SPLIT] == "eval"]
    root = eps[evaluation]["root"]
    assert root[c.RL_STEP] == 4 and root[c.RL_POLICY_VERSION] == 4 and c.RL_STALENESS not in root
    assert root[c.RL_REWARD] == 0.5 and root[c.RL_TURN_COUNT] == 2
    assert msgs[evaluation][3] == {"role": "user", "content": RETRY}
    assert len(by_status[c.STATUS_FILTERED]) == 1 and len(by_status[c.STATUS_ERROR]) == 1
    error = eps[by_status[c.STATUS_ERROR][0]]["root"]
    assert "sandbox unreachable" in str(error.get(c.RL_FINISH_REASON, "")) + str(error)


def test_async_run_gets_no_staleness_and_a_broken_tokenizer_never_reaches_areal(memory):
    """``max_head_offpolicyness`` > 0: a trajectory finished at version v may be trained at any
    step in v..v+k, so no staleness is claimed (version and step are). A recording failure (a
    tokenizer that raises) is reported, never raised into AReaL's loop."""

    class Broken:
        def __getattr__(self, name):
            raise RuntimeError("broken tokenizer")

    engine = scripted_remote_engine(batch_size=1, offpolicy=2)
    engine.set_version(1)
    try:
        batch = engine.prepare_batch(dataloader(["What is 2 + 2?"], 1), workflow=areal.traced(rlvr()),
                                     group_size=1)
        other = scripted_remote_engine(batch_size=1)
        try:
            again = other.prepare_batch(dataloader(["What is 2 + 2?"], 1),
                                        workflow=areal.traced(rlvr(), tokenizer=Broken()), group_size=1)
        finally:
            other.destroy()
    finally:
        engine.destroy()
    assert len(batch) == 1 and len(again) == 1  # AReaL got its trajectories either way
    assert otr.flush()
    roots = [ep["root"] for ep in episodes(memory).values()]
    async_root = next(r for r in roots if r[c.RL_STEP] == 1)
    assert async_root[c.RL_POLICY_VERSION] == 1 and c.RL_STALENESS not in async_root


@pytest.mark.parametrize("form", ["instance", "class"])
def test_wrapper_is_an_areal_workflow(form):
    """What AReaL's ``_resolve_workflow`` needs: a ``RolloutWorkflow`` (else it is taken for an
    agent workflow needing a proxy); a class is built from ``workflow_kwargs``."""
    api, cli_args, rlvr_mod, *_ = modules()
    if form == "instance":
        wrapped = areal.traced(rlvr())
    else:
        wrapped = areal.traced(rlvr_mod.RLVRWorkflow, {"reward_fn": reward_fn, "tokenizer": TOK,
                                                       "gconfig": cli_args.GenerationHyperparameters()})
    assert isinstance(wrapped, api.RolloutWorkflow)
    assert isinstance(wrapped.workflow, rlvr_mod.RLVRWorkflow) and wrapped.tokenizer is TOK


def test_a_newer_areal_is_warned_once(memory, caplog, monkeypatch, keep_logging):
    """Both entry points check the installed AReaL against ``TESTED`` (1.0.4, the only release
    on the registry): a newer one is warned once, and still recorded."""
    modules()
    logging.Logger.root, logging.Logger.manager = keep_logging  # see test_real_areal.keep_logging
    monkeypatch.setattr(areal, "TESTED", ("1.0.3",))
    with caplog.at_level(logging.WARNING, logger="otel_rollouts"):
        areal.traced(rlvr())
        areal.record_trajectories([None], step=0, tokenizer=TOK)
    warned = [r.getMessage() for r in caplog.records if "newer than the releases" in r.getMessage()]
    assert len(warned) == 1 and "areal 1.0.4" in warned[0]
    assert otr.stats()["totals"]["adapters.newer_release"] == 2


def nan_reward(prompt, completions, prompt_ids, completion_ids, answer, **kwargs):
    return float("nan")


def test_strict_mode_never_turns_a_recording_problem_into_a_rejected_rollout(otr_shutdown):
    """``strict=True`` raises refused values to the caller; inside AReaL's executor that would
    reject the rollout (changing the training data), so the wrapper reports it instead."""
    from opentelemetry.sdk.trace.export.in_memory_span_exporter import InMemorySpanExporter

    _, cli_args, rlvr_mod, *_ = modules()
    otr.configure(exporters=[InMemorySpanExporter()], strict=True)
    workflow = rlvr_mod.RLVRWorkflow(nan_reward, cli_args.GenerationHyperparameters(max_new_tokens=32), TOK)
    engine = scripted_remote_engine(batch_size=1)
    try:
        engine.submit(sample("What is 2 + 2?"), areal.traced(workflow))
        (result,) = engine.wait(1, timeout=60)
    finally:
        engine.destroy()
    assert result is not None and result["rewards"].isnan().all()  # accepted, as without the wrapper
    assert otr.stats()["totals"].get("errors.library", 0) + otr.stats()["totals"].get("invalid_values", 0) >= 1


# --- durations (issue 32) ------------------------------------------------------------------------
def test_the_wrapper_times_each_samples_arun_episode_and_the_explicit_call_has_none(memory):
    """The wrapper's clock around ``arun_episode`` is the sample's wall time (AReaL's
    ``GroupedRolloutWorkflow`` runs the group's samples as concurrent calls): a rollout held up
    in its reward function shows it; ``record_trajectories`` (no time in AReaL's data) records
    none rather than 0."""
    import asyncio

    class SlowReward:
        """RLVRWorkflow's own episode, with a reward function that takes a while (a slow
        sandbox), as the issue's stragglers do."""

        def __init__(self, delay):
            self.inner, self.delay = rlvr(), delay
            self.tokenizer = TOK

        async def arun_episode(self, engine, data):
            trajectory = await self.inner.arun_episode(engine, data)
            await asyncio.sleep(self.delay)
            return trajectory

    engine = scripted_remote_engine(batch_size=2)
    try:
        engine.prepare_batch(dataloader(["What is 2 + 2?"], 1), workflow=areal.traced(SlowReward(0.3)),
                             group_size=2)
        engine.set_version(1)
        fast = engine.prepare_batch(dataloader(["What is 17 * 23?"], 1), workflow=areal.traced(SlowReward(0.0)),
                                    group_size=2)
    finally:
        engine.destroy()
    areal.record_trajectories(fast, step=7, tokenizer=TOK)
    assert otr.flush()
    roots = [ep["root"] for ep in episodes(memory).values()]
    by_step = {s: [r for r in roots if r[c.RL_STEP] == s] for s in (0, 1, 7)}
    assert all(len(v) == 2 for v in by_step.values())
    slow_s = [r[c.RL_DURATION_SECONDS] for r in by_step[0]]
    fast_s = [r[c.RL_DURATION_SECONDS] for r in by_step[1]]
    # the 0.3 s the slow workflow sleeps is in its duration; the fast one's is its own (no bound
    # on it: a loaded machine may take longer than 0.3 s for anything)
    assert all(0.3 <= s < 300 for s in slow_s) and all(0 < s < 300 for s in fast_s)
    assert all(c.RL_DURATION_SECONDS not in r for r in by_step[7])  # not measured: absent, never 0
