"""verl: one training step's batch, a real ``verl.DataProto`` with verl's GRPO advantages,
recorded with ``otel_rollouts.adapters.verl.record_batch`` (the call the README's two-line way
adds to ``RayPPOTrainer.fit``, after ``compute_advantage``). 2 prompts x 2 samples; the texts are
scripted (no inference engine here), the tokenizer is built in-process.

    python examples/verl_batch.py             # then: trackio show --project otr-example-verl

Output: ``$TRACKIO_DIR`` (Trackio's default when unset), project ``OTEL_ROLLOUTS_TRACKIO_PROJECT``.
"""

from __future__ import annotations

import os

import _tiny
import numpy as np
import torch
from verl import DataProto
from verl.trainer.ppo.core_algos import compute_grpo_outcome_advantage

import otel_rollouts as otr
from otel_rollouts.adapters import verl

PROJECT = os.environ.get("OTEL_ROLLOUTS_TRACKIO_PROJECT", "otr-example-verl")
SAMPLES = [("What is 2 + 2?", "The answer is 4.", 1.0), ("What is 2 + 2?", "The answer is 17.", 0.0),
           ("What is 17 * 23?", "The answer is 391.", 1.0), ("What is 17 * 23?", "Think step by step", 0.0)]


def batch(tok: object, step: int) -> DataProto:
    """The batch as ``RayPPOTrainer.fit`` holds it after generation and reward (left-padded
    prompts, right-padded responses, the score on the last response token)."""
    prompts = [_tiny.chat_ids(tok, [{"role": "user", "content": q}]) for q, _, _ in SAMPLES]
    answers = [_tiny.text_ids(tok, a + ("<|im_end|>" if r else "")) for _, a, r in SAMPLES]
    pw, rw, pad = max(map(len, prompts)), max(map(len, answers)), tok.pad_token_id  # type: ignore[attr-defined]
    p = torch.tensor([[pad] * (pw - len(x)) + x for x in prompts])
    r = torch.tensor([x + [pad] * (rw - len(x)) for x in answers])
    mask = torch.tensor([[1] * len(x) + [0] * (rw - len(x)) for x in answers])
    attention = torch.cat([torch.tensor([[0] * (pw - len(x)) + [1] * len(x) for x in prompts]), mask], 1)
    scores = torch.zeros(r.shape)
    for i, (x, (_, _, reward)) in enumerate(zip(answers, SAMPLES, strict=True)):
        scores[i, len(x) - 1] = reward
    uid = np.array([f"q{i // 2}" for i in range(len(SAMPLES))], dtype=object)
    advantages, _ = compute_grpo_outcome_advantage(scores, mask, uid)  # verl's own GRPO
    return DataProto.from_dict(
        tensors={"prompts": p, "responses": r, "input_ids": torch.cat([p, r], 1), "attention_mask": attention,
                 "response_mask": mask, "token_level_scores": scores, "token_level_rewards": scores,
                 "advantages": advantages},
        non_tensors={"uid": uid, "index": np.array([i // 2 for i in range(len(SAMPLES))], dtype=object),
                     "data_source": np.array(["arithmetic"] * len(SAMPLES), dtype=object)},
        meta_info={"global_steps": step})


def main() -> None:
    otr.configure(service_name="example-verl", trackio_project=PROJECT)
    tok = _tiny.tokenizer()
    for step in (1, 2):
        verl.record_batch(batch(tok, step), step=step, tokenizer=tok)
        otr.end_step(step)
    otr.shutdown()
    print(f"kept episodes in Trackio project {PROJECT!r}: trackio show --project {PROJECT}")


if __name__ == "__main__":
    main()
