"""verl's default trainer (TransferQueue): a session that fails is recorded, in its group, and one
training run is one run across its agent-loop workers.

Run on verl's own code as ``test_real_verl_v1.py`` runs it (its fixtures): TransferQueue, verl's
``RewardLoopWorker`` actor scoring with a ``custom_reward_function`` file, the manager class the
config names built by verl's ``create`` (real ``AgentLoopWorkerTQ`` Ray actors, started by verl's
``_init_agent_loop_workers``), verl's sync ``ReplayBuffer``. Stand-in: the LLM server
(``ScriptedServer``; here one that raises for one session, as an engine error does).

* The reward function raises for one session of one prompt: verl's ``_agent_loop_postprocess``
  scores it (``_compute_score``) before it puts the session into TransferQueue, so the exception
  ends the session there; verl logs it and marks the prompt ``failure``.
* The LLM server raises for one session of the other prompt: its agent loop raises before any
  output exists.

Each is an error episode (the exception on its root) in its group; the groups say 3 members, 1
lost, 3 expected.
"""

from __future__ import annotations

import os

import pytest
from test_real_verl import ScriptedServer
from test_real_verl_v1 import (
    WORKERS,
    N,
    cluster,  # noqa: F401 - the module's Ray cluster fixture
    configure_memory,
    episodes,
    model_dir,
    submit,
    v1_config,
)

from otel_rollouts import conventions as c

FAILING = "reward backend down"
REWARD_FN = f'''
def compute_score(data_source, solution_str, ground_truth, extra_info=None, **kwargs):
    if solution_str.count("Think step by step.") == 3:  # one session of the "2 + 2" prompt
        raise ValueError("{FAILING}")
    acc = float(ground_truth in solution_str)
    return {{"score": acc, "acc": acc, "format": 1.0}}
'''


class FailingServer(ScriptedServer):
    """``ScriptedServer`` whose second session of the tool prompt gets an engine error."""

    async def generate(self, request_id, *, prompt_ids, sampling_params, **kwargs):
        text = self.tok.decode(prompt_ids)
        if "17 * 23" in text and "<|im_start|>tool" not in text and "<tool_response>" not in text:
            self.tool_first_turns = getattr(self, "tool_first_turns", 0) + 1
            if self.tool_first_turns == 2:
                raise RuntimeError("engine died mid-request")
        return await super().generate(request_id, prompt_ids=prompt_ids, sampling_params=sampling_params, **kwargs)


def collect_with_status(worker):
    """Runs inside an agent-loop worker actor: flush, and every finished span as plain data with
    its status and exception events."""
    import otel_rollouts as otr

    assert otr.flush()
    return [{"trace": s.context.trace_id, "parent": s.parent is not None, "start": s.start_time,
             "name": s.name, "attributes": dict(s.attributes), "status": s.status.status_code.name,
             "description": s.status.description,
             "exceptions": [dict(e.attributes) for e in s.events if e.name == "exception"]}
            for s in worker._test_exporter.get_finished_spans()]


def run_id_of_worker(worker):
    """Runs inside an agent-loop worker actor: the run id its environment gives and the one its
    otel_rollouts (configured from that environment) records under."""
    from otel_rollouts.adapters.kit import current_instance

    return os.environ.get(c.ENV_RUN_ID), current_instance().run_id


def start_with(cfg, tok, server):
    """``test_real_verl_v1.start`` (``TaskRunnerV1.run`` / ``init_agent_loop_manager``) with another
    LLM-server stand-in."""
    import ray
    import transfer_queue as tq
    from verl.experimental.reward_loop.reward_loop import RewardLoopWorker
    from verl.utils.import_utils import load_class_from_fqn

    tq.init(cfg.transfer_queue)
    reward = ray.remote(RewardLoopWorker).remote(cfg, None)
    manager_cls = load_class_from_fqn(cfg.actor_rollout_ref.rollout.agent.agent_loop_manager_class, "AgentLoopManager")
    return manager_cls.create(config=cfg, llm_client=server(tok, lambda turn: 2), teacher_client=None,
                              reward_loop_worker_handles=[reward])


@pytest.mark.matrix
def test_failed_reward_and_failed_agent_loop_are_error_episodes_of_their_groups(tmp_path, cluster,  # noqa: F811
                                                                                  monkeypatch):
    import ray
    import transfer_queue as tq
    from test_real_verl import tokenizer

    monkeypatch.setenv(c.ENV_RUN_ID, "unset")
    monkeypatch.delenv(c.ENV_RUN_ID)  # the run id is the manager's to fix
    tok = tokenizer()
    cfg = v1_config(tmp_path, tok)
    model_dir(cfg, tok)
    with open(cfg.reward.custom_reward_function.path, "w") as f:
        f.write(REWARD_FN)
    manager = start_with(cfg, tok, FailingServer)
    try:
        workers = manager.agent_loop_workers
        ray.get([w.__ray_call__.remote(configure_memory) for w in workers])
        keys, _ = submit(tmp_path, tok, cfg, manager, step=3)
        spans = [s for w in workers for s in ray.get(w.__ray_call__.remote(collect_with_status))]
        run_ids = ray.get([w.__ray_call__.remote(run_id_of_worker) for w in workers])
    finally:
        tq.close()
    # verl: 2 prompts x N sessions, one session of each failed (its prompt marked "failure", the
    # survivors still trained: the sync buffer samples failed groups)
    assert len(keys) == 2 * N - 2
    eps = episodes(spans)
    assert len(eps) == 2 * N  # every session verl ran, the failed ones included
    failed = {e["root"][c.RL_DATASET_INDEX]: e for e in eps.values() if e["root"][c.RL_STATUS] == c.STATUS_ERROR}
    assert sorted(failed) == [10, 11]  # one per prompt: 17 * 23 (index 10) and 2 + 2 (index 11)

    reward_failed, loop_failed = failed[11], failed[10]
    (root_span,) = [s for s in reward_failed["spans"] if not s["parent"]]
    assert root_span["status"] == "ERROR" and FAILING in root_span["description"]
    assert any(FAILING in e.get("exception.message", "") for e in root_span["exceptions"])
    assert reward_failed["root"][c.RL_METADATA_PREFIX + "failed_in"] == "postprocess"
    assert c.RL_REWARD not in reward_failed["root"]
    # the response it generated is recorded (its 3 repetitions), and the prompt
    generated = sum(s["attributes"].get(c.GEN_AI_USAGE_OUTPUT_TOKENS, 0) for s in reward_failed["spans"])
    assert generated > 0
    (root_span,) = [s for s in loop_failed["spans"] if not s["parent"]]
    assert root_span["status"] == "ERROR" and "engine died mid-request" in root_span["description"]
    assert loop_failed["root"][c.RL_METADATA_PREFIX + "failed_in"] == "agent_loop"
    assert [s["name"] for s in loop_failed["spans"] if s["parent"]] == [c.SPAN_PROMPT]

    # the failed member is its group's: the episode id, group and sample index its session has
    for e in failed.values():
        root = e["root"]
        assert root[c.RL_EPISODE_ID] == f"train-3-{root[c.RL_GROUP_ID]}-{root[c.RL_SAMPLE_INDEX]}"
    by_group = {}
    for e in eps.values():
        by_group.setdefault(e["root"][c.RL_GROUP_ID], []).append(e["root"])
    assert len(by_group) == 2
    for members in by_group.values():
        assert sorted(r[c.RL_SAMPLE_INDEX] for r in members) == list(range(N))
        for root in members:
            assert (root[c.RL_GROUP_SIZE], root[c.RL_GROUP_LOST], root[c.RL_GROUP_EXPECTED_SIZE]) == (N, 1, N)
        assert sum(r[c.RL_STATUS] == c.STATUS_ERROR for r in members) == 1
    # one training run: every worker records under the run id the manager fixed
    assert len(run_ids) == WORKERS and len({env for env, _ in run_ids}) == 1
    assert all(env == recorded and env for env, recorded in run_ids)
    assert {e["root"][c.RL_RUN_ID] for e in eps.values()} == {run_ids[0][0]}
