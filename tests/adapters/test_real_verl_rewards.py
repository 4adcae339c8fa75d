"""verl's rewards as the adapter passes them on, and the batch trainer's failed generation.

* A NaN reward (``AgentLoopOutput.reward_score``, what verl's reward loop streamed) reaches the core
  as NaN, unchanged: refusing it is the core's rule, not the adapter's to hide.
* ``RayPPOTrainer`` (``use_v1=False``) with the plug-in: when one sample's reward function raises,
  verl's ``AgentLoopWorker.generate_sequences`` (``asyncio.gather`` without
  ``return_exceptions``) raises and returns no sample of the batch; the plug-in counts the batch's
  samples (``COUNT_GENERATION_FAILED``) and verl's exception reaches the trainer unchanged.

On verl's own objects: ``AgentLoopOutput``/``AgentLoopMetrics``; the batch path is
``test_real_verl_reward_loop``'s (``RLHFDataset`` + ``collate_fn``, verl's ``AgentLoopManager``
over real ``AgentLoopWorker``s running ``ToolAgentLoop``, verl's ``RewardLoopWorker`` with a
``custom_reward_function`` file). Stand-ins as there: the LLM server (``ScriptedServer``), Ray actor
handles (``Remote``) and the workers' ``__init__`` (it loads a hub model config).
"""

from __future__ import annotations

import math
import uuid
from types import SimpleNamespace

import numpy as np
import pytest
from adapter_fixtures import episodes
from frameworks import require
from test_real_verl_reward_loop import (
    PLUGIN,
    N,
    actor_loop,  # noqa: F401 - the reward-loop actor's event loop fixture
    build_manager,
    config,
    dataset_batch,
)

import otel_rollouts as otr

FAILING_REWARD = '''
def compute_score(data_source, solution_str, ground_truth, extra_info=None, **kwargs):
    if "391" in solution_str:
        raise ValueError("grader crashed")
    return {"score": 1.0, "acc": 1.0, "format": 1.0}
'''


def test_a_nan_reward_reaches_the_core_unchanged(memory, monkeypatch):
    """``observe_session`` (the v1 trainer's worker) hands the core verl's NaN as it is."""
    require("verl")
    from tokenizer_fixture import build_tokenizer, chat_ids, text_ids
    from verl.experimental.agent_loop.agent_loop import AgentLoopMetrics, AgentLoopOutput

    from otel_rollouts.adapters import verl as verl_adapter
    from otel_rollouts.adapters import verl_loop

    tok = build_tokenizer()
    prompt = chat_ids(tok, [{"role": "user", "content": "What is 2 + 2?"}], generation_prompt=True)
    response = text_ids(tok, "The answer is 4.<|im_end|>")
    output = AgentLoopOutput(prompt_ids=prompt, response_ids=response, response_mask=[1] * len(response),
                             num_turns=2, metrics=AgentLoopMetrics(), reward_score=float("nan"))
    seen = {}
    real = verl_adapter.record_token_batch

    def spy(*args, **kwargs):  # the real call runs; what it was given is kept
        seen.update(kwargs)
        return real(*args, **kwargs)

    monkeypatch.setattr(verl_adapter, "record_token_batch", spy)
    sample = {"global_steps": 3, "session_id": 0, "uid": "u0", "index": 10}
    assert verl_loop.observe_session(SimpleNamespace(tokenizer=tok), output, False, sample) == 1
    (reward,) = seen["rewards"].tolist()
    assert math.isnan(reward)
    assert otr.flush()
    assert len(episodes(memory)) == 1  # recorded, not lost


@pytest.mark.matrix
def test_batch_trainer_failed_generation_is_counted(tmp_path, actor_loop, memory):  # noqa: F811
    require("verl")
    from test_real_verl import tokenizer
    from verl.trainer.ppo.ray_trainer import RayPPOTrainer

    tok = tokenizer()
    cfg = config(tmp_path, tok, manager=PLUGIN)
    with open(cfg.reward.custom_reward_function.path, "w") as f:
        f.write(FAILING_REWARD)
    manager = build_manager(cfg, tok, lambda turn: 2, actor_loop)
    batch = dataset_batch(tmp_path, tok, cfg)
    batch.non_tensor_batch["uid"] = np.array([str(uuid.uuid4()) for _ in range(len(batch.batch))], dtype=object)
    gen_batch = RayPPOTrainer._get_gen_batch(SimpleNamespace(), batch)
    gen_batch.meta_info["global_steps"] = 4
    gen_batch = gen_batch.repeat(repeat_times=N, interleave=True)
    with pytest.raises(Exception, match="grader crashed"):  # verl's own error, as verl raises it
        manager.generate_sequences(gen_batch)
    from otel_rollouts.adapters.verl_loop import COUNT_GENERATION_FAILED

    stats = otr.stats()
    assert stats["totals"][COUNT_GENERATION_FAILED] == len(gen_batch) == 2 * N
    assert stats["steps"]["4/train"][COUNT_GENERATION_FAILED] == 2 * N
    assert otr.flush() and episodes(memory) == {}
