"""torchforge: ``record_episodes`` on the GRPO app's episodes, the one call the README adds to
``continuous_rollouts`` in ``apps/grpo/main.py`` after a group's advantages are set. torchforge's
package on the registry holds no code, so ``Episode`` and ``Completion`` are declared below
field by field as in ``forge.rl.types`` at meta-pytorch/torchforge ``cf02b132``. 2 steps x a
group of 2; the tokenizer is built in-process (the app uses vLLM's).

    python examples/torchforge_episodes.py    # then: trackio show --project otr-example-torchforge

Output: ``$TRACKIO_DIR`` (Trackio's default when unset), project ``OTEL_ROLLOUTS_TRACKIO_PROJECT``.
"""

from __future__ import annotations

import os
from dataclasses import dataclass
from typing import Any

import _tiny
import torch

import otel_rollouts as otr
from otel_rollouts.adapters.torchforge import record_episodes

PROJECT = os.environ.get("OTEL_ROLLOUTS_TRACKIO_PROJECT", "otr-example-torchforge")


@dataclass
class Completion:  # forge/data_models/completion.py
    prompt: Any
    text: str
    prompt_ids: torch.Tensor
    token_ids: torch.Tensor
    stop_reason: str | None = None
    generator_version: int | None = None


@dataclass
class Episode:  # forge/rl/types.py
    episode_id: str
    pad_id: int
    request_len: int
    response_len: int
    target: Any | None = None
    request: str | None = None
    response: str | None = None
    completion: Completion | None = None
    reward: float | None = None
    reward_breakdown: dict[str, float] | None = None
    advantage: float | None = None

    @property
    def policy_version(self) -> int | None:
        return None if self.completion is None else self.completion.generator_version


def group(tok: Any, step: int) -> list[Episode]:
    """One group of the app's ``continuous_rollouts``: two answers to one chat-templated request."""
    prompt_ids = _tiny.chat_ids(tok, [{"role": "user", "content": "What is 2 + 2?"}])
    request = tok.decode(prompt_ids)
    episodes = []
    for i, (text, correct) in enumerate([("The answer is 4.", 1.0), ("The answer is 17.", 0.0)]):
        ids = _tiny.text_ids(tok, text + "<|im_end|>")
        completion = Completion(prompt=None, text=text, prompt_ids=torch.tensor(prompt_ids),
                                token_ids=torch.tensor(ids), stop_reason="stop", generator_version=step)
        breakdown = {"MathReward": correct, "ThinkingReward": 0.5}
        episodes.append(Episode(episode_id=f"s{step}-{i}", pad_id=tok.pad_token_id, request_len=64,
                                response_len=16, target="4", request=request, response=text,
                                completion=completion, reward=sum(breakdown.values()) / 2,
                                reward_breakdown=breakdown))
    mean = sum(e.reward or 0.0 for e in episodes) / len(episodes)
    for e in episodes:
        e.advantage = (e.reward or 0.0) - mean
    return episodes


def main() -> None:
    otr.configure(service_name="example-torchforge", trackio_project=PROJECT)
    tok = _tiny.tokenizer()
    for step in (1, 2):
        episodes = group(tok, step)
        record_episodes(episodes, step=episodes[0].policy_version or 0, tokenizer=tok)
        otr.end_step(step)
    otr.shutdown()
    print(f"kept episodes in Trackio project {PROJECT!r}: trackio show --project {PROJECT}")


if __name__ == "__main__":
    main()
