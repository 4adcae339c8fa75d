"""verl's default layout: reward-loop workers stream the reward from inside the agent loop.

``RayPPOTrainer.init_workers`` passes the reward-loop workers to the agent loop whenever no reward
model runs colocated (``enable_agent_reward_loop = not use_rm or ...``), i.e. by default. Then
``AgentLoopWorker._postprocess`` returns none of its input columns: at the documented call site
the trained batch has ``uid``, ``data_source``, ``reward_model``, ``extra_info`` (kept by
``_get_gen_batch``) and what the agent loop made (``rm_scores``, reward terms, ``__num_turns__``,
versions), but no ``index``. The samples are in generation order (``repeat(n, interleave=True)``),
and verl's ``rollout_n`` is ``get_trajectory_info`` over each agent-loop worker's chunk of the
dataset index ``RLHFDataset`` took from ``extra_info["index"]``.

Built with verl's own code (0.9.0 and 0.9.1): ``RLHFDataset`` + ``collate_fn`` over a parquet file,
``_get_gen_batch``, verl's ``AgentLoopManager.generate_sequences`` (priority, chunking, concat,
metrics) over real ``AgentLoopWorker``s running the ``ToolAgentLoop`` and ``_compute_score``,
verl's ``RewardLoopWorker.compute_score`` with the reward-loop ``NaiveRewardManager`` loaded by
``load_reward_manager`` from a ``custom_reward_function`` file, ``union``, ``_balance_batch``,
``extract_reward``, ``compute_advantage`` (GRPO). Stand-ins: the LLM server (``ScriptedServer``),
Ray actor handles (``Remote``: calls in-process, arguments pickled as Ray does), and the workers'
``__init__`` (it loads a hub model config).
"""

from __future__ import annotations

import asyncio
import logging
import os
import pickle
import threading
import uuid
from types import SimpleNamespace

import numpy as np
import pytest
from adapter_fixtures import episodes
from frameworks import require
from test_real_verl import QUESTIONS, ScriptedServer, calculator, tokenizer

import otel_rollouts as otr
from otel_rollouts import conventions as c
from otel_rollouts.adapters import verl as verl_adapter

N = 4
WORKERS = 2
PLUGIN = "otel_rollouts.adapters.verl_loop.AgentLoopManager"
REWARD_FN = '''
def compute_score(data_source, solution_str, ground_truth, extra_info=None, **kwargs):
    acc = float(ground_truth in solution_str)
    return {"score": acc, "acc": acc, "format": 1.0}
'''


class Remote:
    """A Ray actor handle stand-in: ``handle.method.remote(*args)`` runs the method on a pickled
    copy of the arguments (as Ray serializes them) and is awaited like an ObjectRef; an actor
    given a ``loop`` runs its coroutines there (an async Ray actor has its own event loop)."""

    def __init__(self, actor, loop=None):
        self.actor, self.loop = actor, loop

    def __getattr__(self, name):
        method = getattr(self.actor, name)

        def remote(*args, **kwargs):
            args, kwargs = pickle.loads(pickle.dumps((args, kwargs)))
            result = method(*args, **kwargs)
            if self.loop is None:
                return result
            return asyncio.wrap_future(asyncio.run_coroutine_threadsafe(result, self.loop))

        return SimpleNamespace(remote=remote)


@pytest.fixture
def actor_loop():
    """An event loop on its own thread: the reward-loop worker actor's."""
    loop = asyncio.new_event_loop()
    thread = threading.Thread(target=loop.run_forever, daemon=True)
    thread.start()
    yield loop
    loop.call_soon_threadsafe(loop.stop)
    thread.join(timeout=30)
    loop.close()


def config(tmp_path, tok, *, manager=None, workers=WORKERS, val_n=1):
    import verl
    from omegaconf import OmegaConf

    cfg = OmegaConf.load(os.path.join(os.path.dirname(verl.__file__), "trainer/config/_generated_ppo_trainer.yaml"))
    cfg.data.max_prompt_length = cfg.actor_rollout_ref.rollout.prompt_length = 256
    cfg.actor_rollout_ref.rollout.response_length = 128
    cfg.actor_rollout_ref.rollout.n = N
    cfg.actor_rollout_ref.rollout.val_kwargs.n = val_n
    cfg.actor_rollout_ref.rollout.name = "vllm"
    cfg.actor_rollout_ref.rollout.agent.num_workers = workers
    model_dir = tmp_path / "model"
    tok.save_pretrained(str(model_dir))  # the policy's tokenizer, where verl's workers load it
    cfg.actor_rollout_ref.model.path = str(model_dir)
    reward_file = tmp_path / "reward_fn.py"
    reward_file.write_text(REWARD_FN)
    cfg.reward.custom_reward_function.path = str(reward_file)
    if manager is not None:  # the one config entry of the plug-in
        cfg.actor_rollout_ref.rollout.agent.agent_loop_manager_class = manager
    return cfg


def build_manager(cfg, tok, version, loop):
    """What ``RayPPOTrainer.init_workers`` builds: the reward-loop workers, and the agent-loop
    manager class named by the config (verl's own lookup) with those workers' handles."""
    from verl.experimental.agent_loop import tool_agent_loop  # noqa: F401 - registers tool_agent
    from verl.experimental.agent_loop.agent_loop import AgentLoopWorker
    from verl.experimental.reward_loop.reward_loop import RewardLoopWorker
    from verl.tools.function_tool import FunctionTool, _build_schema_from_fn
    from verl.trainer.ppo.reward import load_reward_manager
    from verl.utils.config import omega_conf_to_dataclass
    from verl.utils.dataset.rl_dataset import RLHFDataset
    from verl.utils.import_utils import load_class_from_fqn

    async def in_actor():  # RewardLoopWorker._init_reward_fn, inside the actor (its event loop)
        return load_reward_manager(cfg, tok)

    reward_worker = object.__new__(RewardLoopWorker)  # __init__ loads the tokenizer from a hub path
    reward_worker.__dict__.update(config=cfg, reward_router_address=None, loop=loop,
                                  reward_manager=asyncio.run_coroutine_threadsafe(in_actor(), loop).result())
    handles = [Remote(reward_worker, loop)]
    fqn = cfg.actor_rollout_ref.rollout.agent.get("agent_loop_manager_class")
    if fqn:
        manager_cls = load_class_from_fqn(fqn, "AgentLoopManager")  # as RayPPOTrainer.init_workers
    else:
        from verl.experimental.agent_loop import AgentLoopManager as manager_cls
    manager = manager_cls(config=cfg, llm_client=None, reward_loop_worker_handles=handles)

    def worker():
        tool = FunctionTool(name="calculator", fn=calculator,
                            tool_schema=_build_schema_from_fn(calculator, "calculator"))
        w = object.__new__(AgentLoopWorker)
        w.__dict__.update(
            config=cfg, llm_client=ScriptedServer(tok, version), teacher_client=None,
            reward_loop_worker_handles=manager.reward_loop_worker_handles,
            rollout_config=omega_conf_to_dataclass(cfg.actor_rollout_ref.rollout), dataset_cls=RLHFDataset,
            tokenizer=tok, processor=None, hf_model_type=None, mm_processor_kwargs={},
            distillation_enabled=False, tools=[tool])
        return Remote(w)

    manager.agent_loop_workers = [worker() for _ in range(cfg.actor_rollout_ref.rollout.agent.num_workers)]
    return manager


def dataset_batch(tmp_path, tok, cfg, validate=False, questions=QUESTIONS):
    import pandas as pd
    from verl.protocol import DataProto
    from verl.utils.dataset.rl_dataset import RLHFDataset, collate_fn

    rows = [{"data_source": "openai/gsm8k", "prompt": [{"role": "user", "content": q}],
             "reward_model": {"style": "rule", "ground_truth": a}, "agent_name": "tool_agent",
             "extra_info": {"index": 10 + i, "split": "test" if validate else "train"}}
            for i, (q, a) in enumerate(questions)]
    path = str(tmp_path / ("val.parquet" if validate else "train.parquet"))
    pd.DataFrame(rows).to_parquet(path)
    dataset = RLHFDataset([path], tok, cfg.data)
    return DataProto.from_single_dict(collate_fn([dataset[i] for i in range(len(dataset))]))


def fit_step(tmp_path, tok, cfg, manager, *, step=3, mark=True):
    """One step of ``RayPPOTrainer.fit`` (verl's lines, in its order); returns (batch, truth)."""
    from verl.experimental.agent_loop.agent_loop import get_trajectory_info
    from verl.trainer.ppo.core_algos import AdvantageEstimator
    from verl.trainer.ppo.ray_trainer import RayPPOTrainer, compute_advantage
    from verl.trainer.ppo.reward import extract_reward

    batch = dataset_batch(tmp_path, tok, cfg)
    batch.non_tensor_batch["uid"] = np.array([str(uuid.uuid4()) for _ in range(len(batch.batch))], dtype=object)
    gen_batch = RayPPOTrainer._get_gen_batch(SimpleNamespace(), batch)
    gen_batch.meta_info["global_steps"] = step
    gen_batch_output = gen_batch.repeat(repeat_times=N, interleave=True)
    # verl's rollout traces: get_trajectory_info over each worker's chunk, in generation order
    truth = [t for chunk in gen_batch_output.chunk(len(manager.agent_loop_workers))
             for t in asyncio.run(get_trajectory_info(step, chunk.non_tensor_batch["index"].tolist(), False))]
    output = manager.generate_sequences(gen_batch_output)
    output.meta_info.pop("timing", None)
    batch = batch.repeat(repeat_times=N, interleave=True)
    batch = batch.union(output)
    batch.non_tensor_batch["probe_position"] = np.arange(len(batch))  # test only: where each sample was
    if mark:
        verl_adapter.mark_rollouts(batch, agent_loop_workers=cfg.actor_rollout_ref.rollout.agent.num_workers)
    trainer = SimpleNamespace(_get_dp_size=lambda wg, role: 2, actor_rollout_wg=None, config=cfg)
    RayPPOTrainer._balance_batch(trainer, batch, metrics={})
    positions = batch.non_tensor_batch.pop("probe_position").tolist()
    reward_tensor, reward_extra_infos_dict = extract_reward(batch)
    batch.batch["token_level_scores"] = reward_tensor
    batch.non_tensor_batch.update({k: np.array(v) for k, v in reward_extra_infos_dict.items()})
    batch.batch["token_level_rewards"] = batch.batch["token_level_scores"]
    batch = compute_advantage(batch, adv_estimator=AdvantageEstimator.GRPO, num_repeat=N, config=cfg.algorithm)
    return batch, [truth[p] for p in positions]


def validate(tmp_path, tok, cfg, manager, *, step=3):
    """``RayPPOTrainer._validate`` up to the generated batch (padding to the worker count)."""
    from verl.protocol import pad_dataproto_to_divisor, unpad_dataproto
    from verl.trainer.ppo.ray_trainer import RayPPOTrainer

    test_batch = dataset_batch(tmp_path, tok, cfg, validate=True,
                               questions=QUESTIONS + [("What is 3 + 4?", "7")])
    test_batch.non_tensor_batch["uid"] = np.array([str(uuid.uuid4()) for _ in range(len(test_batch.batch))],
                                                  dtype=object)
    test_batch = test_batch.repeat(repeat_times=cfg.actor_rollout_ref.rollout.val_kwargs.n, interleave=True)
    test_gen_batch = RayPPOTrainer._get_gen_batch(SimpleNamespace(), test_batch)
    test_gen_batch.meta_info = {"eos_token_id": tok.eos_token_id, "pad_token_id": tok.pad_token_id,
                                "recompute_log_prob": False, "do_sample": False, "validate": True,
                                "global_steps": step}
    padded, pad_size = pad_dataproto_to_divisor(test_gen_batch, cfg.actor_rollout_ref.rollout.agent.num_workers)
    assert pad_size > 0, "no padding: the test would prove nothing"
    return unpad_dataproto(manager.generate_sequences(padded), pad_size=pad_size), test_batch


def record(memory, tok, batch, step=3, **kwargs):
    assert verl_adapter.record_batch(batch, step=step, tokenizer=tok, **kwargs) == len(batch)
    assert otr.flush()
    return episodes(memory)


def check_rollouts(eps, batch, truth, step=3):
    uids = batch.non_tensor_batch["uid"].tolist()
    assert len(eps) == len(batch)
    for j, t in enumerate(truth):
        root = eps[f"train-{step}-{uids[j]}-{t['rollout_n']}"]["root"]
        assert root["rl.metadata.rollout_n"] == t["rollout_n"] and root[c.RL_SAMPLE_INDEX] == t["rollout_n"]
        assert root["rl.metadata.sample_index"] == t["sample_index"] == root[c.RL_DATASET_INDEX]
        assert root[c.RL_GROUP_ID] == uids[j]
        n_out = sum(s.attributes.get(c.GEN_AI_USAGE_OUTPUT_TOKENS, 0) for s in eps[root[c.RL_EPISODE_ID]]["spans"])
        assert n_out == int(batch.batch["response_mask"][j].sum())  # the same sample


@pytest.mark.matrix
def test_reward_loop_layout_has_no_index_column(tmp_path, actor_loop):
    require("verl")
    tok = tokenizer()
    cfg = config(tmp_path, tok)
    batch, truth = fit_step(tmp_path, tok, cfg, build_manager(cfg, tok, lambda turn: 2, actor_loop), mark=False)
    columns = set(batch.non_tensor_batch)
    assert "index" not in columns and {"uid", "extra_info", "data_source", "reward_model"} <= columns
    assert {"score", "acc", "format", "__num_turns__", "max_global_steps"} <= columns
    assert batch.meta_info["reward_extra_keys"] == ["score", "acc", "format"]
    uids = batch.non_tensor_batch["uid"].tolist()
    assert [uids[:j].count(u) for j, u in enumerate(uids)] != [t["rollout_n"] for t in truth], \
        "balancing kept the order: the test would prove nothing"


@pytest.mark.matrix
def test_rollout_n_in_the_reward_loop_layout(tmp_path, actor_loop, memory, caplog):
    require("verl")
    tok = tokenizer()
    cfg = config(tmp_path, tok)
    batch, truth = fit_step(tmp_path, tok, cfg, build_manager(cfg, tok, lambda turn: 2, actor_loop))
    with caplog.at_level(logging.WARNING, logger="otel_rollouts"):
        eps = record(memory, tok, batch)
    assert "rollout_n" not in caplog.text
    check_rollouts(eps, batch, truth)
    for e in eps.values():
        root = e["root"]
        assert {k for k in root if k.startswith(c.RL_REWARD_COMPONENT_PREFIX)} == {"rl.reward.component.score", "rl.reward.component.acc",
                                                                          "rl.reward.component.format"}
        assert c.RL_ADVANTAGE in root and root[c.RL_POLICY_VERSION] == 2 and root[c.RL_STALENESS] == 0
        assert root[c.RL_REWARD] == 1.0  # both answers right (the tool one via the calculator)


@pytest.mark.matrix
def test_plugin_records_each_generated_batch_with_one_config_entry(tmp_path, actor_loop, memory):
    require("verl")
    tok = tokenizer()
    cfg = config(tmp_path, tok, manager=PLUGIN)
    cfg.algorithm.adv_estimator = "grpo"
    manager = build_manager(cfg, tok, lambda turn: 2, actor_loop)
    assert type(manager).__module__ == "otel_rollouts.adapters.verl_loop"
    batch, truth = fit_step(tmp_path, tok, cfg, manager, mark=False)  # verl's loop, no adapter line
    assert otr.flush()
    eps = episodes(memory)
    check_rollouts(eps, batch, truth)
    # the run as verl's configuration describes it, on the resource of every span
    from importlib.metadata import version

    (resource,) = {s.resource for s in memory.get_finished_spans()}
    assert {k: resource.attributes.get(k) for k in (c.RL_SYSTEM_NAME, c.RL_SYSTEM_VERSION, c.RL_ALGORITHM,
                                                     c.RL_MODEL_NAME)} == {
        c.RL_SYSTEM_NAME: "verl", c.RL_SYSTEM_VERSION: version("verl"), c.RL_ALGORITHM: "grpo",
        c.RL_MODEL_NAME: cfg.actor_rollout_ref.model.path}
    scores = batch.batch["token_level_scores"].sum(-1).tolist()
    uids = batch.non_tensor_batch["uid"].tolist()
    for j, t in enumerate(truth):
        root = eps[f"train-3-{uids[j]}-{t['rollout_n']}"]["root"]
        assert root[c.RL_REWARD] == scores[j]
        assert root["rl.reward.component.acc"] == batch.non_tensor_batch["acc"][j]
        assert root[c.RL_STEP] == 3 and root[c.RL_SPLIT] == "train"
        assert root[c.RL_POLICY_VERSION] == 2 and root[c.RL_STALENESS] == 0
        assert root[c.RL_TURN_COUNT] == batch.non_tensor_batch["__num_turns__"][j]
        assert c.RL_ADVANTAGE not in root  # computed after the manager returns: the source lines
    tool_ep = next(e for e in eps.values() if e["root"][c.RL_DATASET_INDEX] == 10)
    (tool_span,) = tool_ep["by_kind"][c.KIND_TOOL]
    assert tool_span.attributes[c.GEN_AI_TOOL_CALL_RESULT] == "391"


@pytest.mark.matrix
def test_plugin_validation_skips_padding_and_closes_steps(tmp_path, actor_loop, memory):
    require("verl")
    tok = tokenizer()
    cfg = config(tmp_path, tok, manager=PLUGIN, workers=2, val_n=1)
    manager = build_manager(cfg, tok, lambda turn: 3, actor_loop)
    output, test_batch = validate(tmp_path, tok, cfg, manager, step=3)
    assert otr.flush()
    eps = episodes(memory)
    assert len(eps) == len(test_batch) == 3  # the padding copy is not an episode
    uids = test_batch.non_tensor_batch["uid"].tolist()
    assert set(eps) == {f"eval-3-{u}-0" for u in uids}
    for e in eps.values():
        root = e["root"]
        assert root[c.RL_SPLIT] == "eval" and root[c.RL_POLICY_VERSION] == 3 and c.RL_STALENESS not in root
    fit_step(tmp_path, tok, cfg, manager, step=4, mark=False)  # the next step closes eval-3
    assert otr.stats()["steps"]["3/eval"]["kept"] == 3


@pytest.fixture(autouse=True)
def _quiet_verl():
    logging.getLogger("verl").setLevel(logging.ERROR)
    yield


@pytest.mark.matrix
def test_plugin_keeps_each_samples_agent_loop_times_as_stage_seconds(tmp_path, actor_loop, memory):
    """verl's manager reduces the samples' AgentLoopMetrics to per-step min/mean/max; the plug-in
    records each sample's own seconds (LLM calls, tool calls, reward) on its episode."""
    from verl.trainer.ppo.ray_trainer import RayPPOTrainer

    require("verl")
    tok = tokenizer()
    cfg = config(tmp_path, tok, manager=PLUGIN)
    manager = build_manager(cfg, tok, lambda turn: 2, actor_loop)
    batch = dataset_batch(tmp_path, tok, cfg)
    batch.non_tensor_batch["uid"] = np.array([str(uuid.uuid4()) for _ in range(len(batch.batch))], dtype=object)
    gen_batch = RayPPOTrainer._get_gen_batch(SimpleNamespace(), batch)
    gen_batch.meta_info["global_steps"] = 3
    output = manager.generate_sequences(gen_batch.repeat(repeat_times=N, interleave=True))
    timing = output.meta_info["timing"]  # verl's own per-step figures from the same metrics
    assert "processing_times" not in output.non_tensor_batch  # verl's output is left as it was
    assert otr.flush()
    roots = [e["root"] for e in episodes(memory).values()]
    assert len(roots) == len(output)
    for stage, name in [(c.STAGE_GENERATION, "generate_sequences"), (c.STAGE_TOOL, "tool_calls"),
                        (c.STAGE_REWARD, "compute_score")]:
        values = [r[c.stage_seconds(stage)] for r in roots if c.stage_seconds(stage) in r]
        assert values and max(values) == pytest.approx(timing[f"agent_loop/{name}/max"])
    tool = c.stage_seconds(c.STAGE_TOOL)
    # only the calculator question's samples (dataset index 10) ran a tool
    assert {r[c.RL_DATASET_INDEX] for r in roots if tool in r} == {10}
    assert all(c.RL_DURATION_SECONDS not in r for r in roots)  # no wall time per sample in verl
    assert not manager._otr_sample_metrics  # taken by the recording, nothing held
