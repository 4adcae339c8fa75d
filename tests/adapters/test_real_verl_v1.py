"""verl's default trainer (``trainer.use_v1=True``): the TransferQueue path, with one config entry.

``main_ppo.TaskRunnerV1`` builds the agent-loop manager named by
``actor_rollout_ref.rollout.agent.agent_loop_manager_class`` with ``create(...)``; under that
trainer the manager only dispatches, and each ``AgentLoopWorkerTQ`` (a Ray actor) puts every
finished session into TransferQueue. Run here on verl's own code (0.9.0 and 0.9.1) and a real
TransferQueue 0.1.11 (controller and storage units as Ray actors, ZMQ on 127.0.0.1): a local Ray
cluster on the loopback address; ``tq.init(config.transfer_queue)`` as ``TaskRunnerV1.run``;
verl's ``RewardLoopWorker`` actor (``NaiveRewardManager`` over a ``custom_reward_function`` file);
the manager class loaded by verl's ``load_class_from_fqn`` and built by its ``create`` (real
``AgentLoopWorkerTQ`` actors running ``ToolAgentLoop`` with a ``function_tool_path`` tool);
``RLHFDataset`` + ``collate_fn`` + ``tu.get_tensordict`` and the ``kv_batch_put`` of
``_submit_batch_to_rollout`` / ``_validate``; verl's sync ``ReplayBuffer`` (built by
``PPOTrainer._build_replay_buffer``) waits for the groups; the samples are read back with
``tq.kv_batch_get``. Stand-ins: the LLM server (``ScriptedServer``, pickled into each worker as
verl's ``LLMServerClient`` is). Each worker's otel_rollouts is set up with an in-memory exporter
through Ray's ``__ray_call__`` and its spans are fetched back the same way.
"""

from __future__ import annotations

import os
import uuid
from collections import defaultdict
from types import SimpleNamespace

import numpy as np
import pytest
from frameworks import require

from otel_rollouts import conventions as c

N = 3
WORKERS = 2
PLUGIN = "otel_rollouts.adapters.verl_loop.AgentLoopManager"
TOOLS = '''
from verl.tools.function_tool import function_tool


@function_tool
def calculator(expression: str) -> str:
    """Evaluate an arithmetic expression.

    Args:
        expression: the expression to evaluate
    """
    return str(eval(expression, {"__builtins__": {}}))
'''


@pytest.fixture(scope="module")
def cluster(ray_cluster):
    """The session's local Ray cluster (tests/conftest.py: loopback only, the test modules
    importable in its workers for ``ScriptedServer``); TransferQueue binds its ZMQ sockets to
    Ray's node address. A second ``ray.init`` in this process would fail: one cluster serves
    every Ray test."""
    require("verl")
    require("transfer_queue")  # the v1 trainer imports it: .ci/run installs transferqueue
    import ray

    assert ray.util.get_node_ip_address() == "127.0.0.1"
    return ray


def v1_config(tmp_path, tok):
    from test_real_verl_reward_loop import config

    cfg = config(tmp_path, tok, manager=PLUGIN, workers=WORKERS)
    cfg.actor_rollout_ref.rollout.n = N
    cfg.data.train_batch_size = 2
    cfg.data.max_response_length = 128
    tools = tmp_path / "tools.py"
    tools.write_text(TOOLS)
    cfg.actor_rollout_ref.rollout.multi_turn.function_tool_path = str(tools)
    cfg.transfer_queue.backend.SimpleStorage.num_data_storage_units = 1
    assert cfg.trainer.use_v1 is True  # verl's default
    cfg.transfer_queue.enable = True  # TaskRunnerV1.run
    return cfg


def model_dir(cfg, tok):
    """The policy's directory as verl's workers read it: tokenizer + a (tiny) model config."""
    from transformers import Qwen2Config

    Qwen2Config(vocab_size=len(tok), hidden_size=16, intermediate_size=16, num_hidden_layers=1,
                num_attention_heads=2, num_key_value_heads=1,
                architectures=["Qwen2ForCausalLM"]).save_pretrained(cfg.actor_rollout_ref.model.path)


def start(cfg, tok, version):
    """``TaskRunnerV1.run`` / ``init_agent_loop_manager``: TransferQueue, then the manager class the
    config names, built by its ``create`` with verl's reward-loop worker actors."""
    import ray
    import transfer_queue as tq
    from test_real_verl import ScriptedServer
    from verl.experimental.reward_loop.reward_loop import RewardLoopWorker
    from verl.utils.import_utils import load_class_from_fqn

    tq.init(cfg.transfer_queue)
    reward = ray.remote(RewardLoopWorker).remote(cfg, None)  # as RewardLoopManager starts them
    fqn = cfg.actor_rollout_ref.rollout.agent.get("agent_loop_manager_class")
    if fqn:
        manager_cls = load_class_from_fqn(fqn, "AgentLoopManager")
    else:
        from verl.trainer.ppo.v1 import AgentLoopManagerTQ as manager_cls
    return manager_cls.create(config=cfg, llm_client=ScriptedServer(tok, version), teacher_client=None,
                              reward_loop_worker_handles=[reward])


def submit(tmp_path, tok, cfg, manager, *, step, validate=False):
    """``_next_train_batch`` + ``_submit_batch_to_rollout`` (sync), or a ``_validate`` batch; then
    the replay buffer's ``sample`` (it waits for every group); returns the samples from TQ."""
    import pandas as pd
    import transfer_queue as tq
    from test_real_verl import QUESTIONS
    from verl.trainer.ppo.v1.trainer_base import PPOTrainer
    from verl.utils import tensordict_utils as tu
    from verl.utils.dataset.rl_dataset import RLHFDataset, collate_fn

    rows = [{"data_source": "openai/gsm8k", "prompt": [{"role": "user", "content": q}],
             "reward_model": {"style": "rule", "ground_truth": a}, "agent_name": "tool_agent",
             "extra_info": {"index": 10 + i, "split": "test" if validate else "train"}}
            for i, (q, a) in enumerate(QUESTIONS)]
    path = str(tmp_path / f"data-{step}-{validate}.parquet")
    pd.DataFrame(rows).to_parquet(path)
    dataset = RLHFDataset([path], tok, cfg.data)
    batch_dict = collate_fn([dataset[i] for i in range(len(dataset))])
    batch_dict["uid"] = np.array([str(uuid.uuid4()) for _ in range(len(batch_dict["raw_prompt"]))], dtype=object)
    batch = tu.get_tensordict(batch_dict)
    tu.assign_non_tensor_data(batch, "global_steps", step)
    partition = "val" if validate else "train"
    if validate:
        tu.assign_non_tensor_data(batch, "validate", True)
    tags = [{"is_prompt": True, "status": "pending", "global_steps": step} for _ in range(len(batch))]
    tq.kv_batch_put(keys=list(batch["uid"]), partition_id=partition, tags=tags)
    manager.generate_sequences(batch)
    trainer = SimpleNamespace(config=cfg, trainer_mode="sync", _add_prompts_to_generate=None,
                              _resolve_filter_groups_metric=lambda: None)
    buffer = PPOTrainer._build_replay_buffer(trainer)
    meta, _ = buffer.sample(global_steps=step, partition_id=partition, batch_size=len(batch))
    data = tq.kv_batch_get(keys=meta.keys, partition_id=partition,
                           select_fields=["uid", "rm_scores", "response_mask", "extra_fields", "num_turns"])
    return list(meta.keys), data


def configure_memory(worker):
    """Runs inside an agent-loop worker actor: otel_rollouts with an in-memory exporter and a
    sampler that exports a step's episodes only when the step closes."""
    from opentelemetry.sdk.trace.export.in_memory_span_exporter import InMemorySpanExporter

    import otel_rollouts as otr

    worker._test_exporter = InMemorySpanExporter()
    otr.configure(exporters=[worker._test_exporter], sampler=otr.TailSampler(1000, "uniform"))
    return os.getpid()


def exported(worker):
    """Runs inside an agent-loop worker actor: the (step, split) of each episode exported so far."""
    return sorted({(s.attributes[c.RL_STEP], s.attributes[c.RL_SPLIT])
                   for s in worker._test_exporter.get_finished_spans() if s.parent is None})


def collect(worker):
    """Runs inside an agent-loop worker actor: flush, and the finished spans as plain data."""
    import otel_rollouts as otr

    assert otr.flush()
    return [{"trace": s.context.trace_id, "parent": s.parent is not None, "start": s.start_time,
             "name": s.name, "attributes": dict(s.attributes)}
            for s in worker._test_exporter.get_finished_spans()]


def episodes(spans):
    traces = defaultdict(list)
    for s in spans:
        traces[s["trace"]].append(s)
    out = {}
    for group in traces.values():
        (root,) = [s for s in group if not s["parent"]]
        kinds = defaultdict(list)
        for s in group:
            kinds[s["attributes"].get(c.RL_SPAN_KIND)].append(s)
        out[root["attributes"][c.RL_EPISODE_ID]] = {"root": root["attributes"], "spans": group, "by_kind": kinds}
    return out


@pytest.mark.matrix
def test_default_trainer_records_each_session_with_the_config_entry(tmp_path, cluster):
    import ray
    import transfer_queue as tq
    from test_real_verl import tokenizer

    tok = tokenizer()
    cfg = v1_config(tmp_path, tok)
    model_dir(cfg, tok)
    manager = start(cfg, tok, lambda turn: 2)
    try:
        from verl.trainer.ppo.v1 import AgentLoopManagerTQ
        from verl.utils.import_utils import load_class_from_fqn

        # the config entry's class hands TaskRunnerV1 the TQ manager (also nameable directly)
        recording = load_class_from_fqn("otel_rollouts.adapters.verl_loop.AgentLoopManagerTQ", "AgentLoopManager")
        assert type(manager) is recording and issubclass(recording, AgentLoopManagerTQ)
        workers = manager.agent_loop_workers
        assert len(set(ray.get([w.__ray_call__.remote(configure_memory) for w in workers]))) == WORKERS
        keys, data = submit(tmp_path, tok, cfg, manager, step=3)
        assert ray.get([w.__ray_call__.remote(exported) for w in workers]) == [[], []]  # train-3 open
        val_keys, val_data = submit(tmp_path, tok, cfg, manager, step=3, validate=True)
        # each worker closed train-3 when the validation batch reached it; eval-3 is still open
        assert ray.get([w.__ray_call__.remote(exported) for w in workers]) == [[(3, "train")]] * WORKERS
        eps = episodes([s for w in workers for s in ray.get(w.__ray_call__.remote(collect))])
    finally:
        tq.close()
    val_n = cfg.actor_rollout_ref.rollout.val_kwargs.n
    assert len(keys) == 2 * N and len(val_keys) == 2 * val_n and len(eps) == 2 * N + 2 * val_n
    for split, keys_, data_ in (("train", keys, data), ("eval", val_keys, val_data)):
        for j, key in enumerate(keys_):
            uid, session, _ = key.rsplit("_", 2)  # verl's TQ key: {uid}_{session_id}_{output}
            root = eps[f"{split}-3-{uid}-{session}"]["root"]
            assert root[c.RL_GROUP_ID] == uid and root[c.RL_SAMPLE_INDEX] == int(session)
            assert root[c.RL_REWARD] == float(data_["rm_scores"][j].sum())
            extra = data_["extra_fields"][j]
            assert root["rl.reward.component.acc"] == float(extra["reward_extra_info"]["acc"])
            assert root[c.RL_STEP] == 3 and root[c.RL_SPLIT] == split
            assert root[c.RL_POLICY_VERSION] == extra["max_global_steps"] == 2
            assert root[c.RL_TURN_COUNT] == int(data_["num_turns"][j])
            assert (root.get(c.RL_STALENESS), c.RL_ADVANTAGE in root) == ((0 if split == "train" else None), False)
            spans = eps[root[c.RL_EPISODE_ID]]["spans"]
            outputs = sum(s["attributes"].get(c.GEN_AI_USAGE_OUTPUT_TOKENS, 0) for s in spans)
            assert outputs == int(data_["response_mask"][j].sum())  # the same sample
    rewards = sorted(e["root"][c.RL_REWARD] for e in eps.values())
    assert rewards == [1.0] * len(eps)  # both answers right (the tool one via the calculator)
    tool_ep = next(e for e in eps.values() if e["root"][c.RL_DATASET_INDEX] == 10)
    (tool_span,) = tool_ep["by_kind"][c.KIND_TOOL]
    assert tool_span["attributes"][c.GEN_AI_TOOL_CALL_RESULT] == "391"


@pytest.mark.matrix
def test_the_legacy_trainer_keeps_the_batch_manager(tmp_path, cluster):
    """``RayPPOTrainer.init_workers`` (``trainer.use_v1=False``) builds the same class with
    ``create``: verl's batch ``AgentLoopManager`` and its workers, as before."""
    import ray
    from test_real_verl import ScriptedServer, tokenizer
    from verl.experimental.agent_loop import AgentLoopManager
    from verl.utils.import_utils import load_class_from_fqn

    tok = tokenizer()
    cfg = v1_config(tmp_path, tok)
    model_dir(cfg, tok)
    cfg.trainer.use_v1 = False
    cfg.transfer_queue.enable = False
    manager_cls = load_class_from_fqn(cfg.actor_rollout_ref.rollout.agent.agent_loop_manager_class, "AgentLoopManager")
    manager = manager_cls.create(config=cfg, llm_client=ScriptedServer(tok, lambda turn: 2), teacher_client=None,
                                 reward_loop_worker_handles=None)
    try:
        assert type(manager) is manager_cls and issubclass(manager_cls, AgentLoopManager)
        assert len(manager.agent_loop_workers) == WORKERS
    finally:
        for worker in manager.agent_loop_workers:
            ray.kill(worker)
