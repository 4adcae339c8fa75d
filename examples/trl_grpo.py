"""TRL's ``GRPOTrainer`` with ``RolloutTraceCallback``: 2 training steps of a tiny Qwen2 built
here (random weights, a tokenizer trained in-process: nothing is downloaded, CPU is enough);
every completion TRL generates becomes one episode with its reward terms, advantage, finish
reason and token usage; the kept ones go to a local Trackio project.

    python examples/trl_grpo.py               # then: trackio show --project otr-example-trl

Output: ``$TRACKIO_DIR`` (Trackio's default when unset), project ``OTEL_ROLLOUTS_TRACKIO_PROJECT``;
TRL's own output directory is a temporary one.
"""

from __future__ import annotations

import os
import tempfile

import _tiny
import torch
from datasets import Dataset
from transformers import Qwen2Config, Qwen2ForCausalLM
from trl import GRPOConfig, GRPOTrainer

import otel_rollouts as otr
from otel_rollouts.adapters.trl import RolloutTraceCallback

PROJECT = os.environ.get("OTEL_ROLLOUTS_TRACKIO_PROJECT", "otr-example-trl")


def length_reward(completion_ids: list[list[int]], **kwargs: object) -> list[float]:
    """A reward function in TRL's signature: longer completions score higher."""
    return [len(ids) / 4.0 for ids in completion_ids]


def main() -> None:
    otr.configure(service_name="example-trl", trackio_project=PROJECT)
    tokenizer = _tiny.tokenizer()
    torch.manual_seed(0)
    model = Qwen2ForCausalLM(Qwen2Config(
        vocab_size=len(tokenizer), hidden_size=32, intermediate_size=64, num_hidden_layers=1,
        num_attention_heads=2, num_key_value_heads=1, max_position_embeddings=128,
        pad_token_id=tokenizer.pad_token_id, eos_token_id=tokenizer.eos_token_id, tie_word_embeddings=True))
    prompts = ["What is 2 + 2?", "What is 17 * 23?"]
    dataset = Dataset.from_dict({"prompt": [[{"role": "user", "content": p}] for p in prompts]})
    with tempfile.TemporaryDirectory() as out:
        args = GRPOConfig(output_dir=out, use_cpu=True, per_device_train_batch_size=4, num_generations=2,
                          max_completion_length=4, max_steps=2, learning_rate=1e-2, report_to=[],
                          save_strategy="no", logging_steps=1, disable_tqdm=True, beta=0.0, seed=0)
        trainer = GRPOTrainer(model=model, reward_funcs=[length_reward], args=args,
                              train_dataset=dataset, processing_class=tokenizer)
        trainer.add_callback(RolloutTraceCallback(trainer))  # the one line the adapter needs
        trainer.train()
    otr.shutdown()
    print(f"kept episodes in Trackio project {PROJECT!r}: trackio show --project {PROJECT}")


if __name__ == "__main__":
    main()
