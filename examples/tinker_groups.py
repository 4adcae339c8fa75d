"""tinker-cookbook: the cookbook's own ``ArithmeticEnv`` groups rolled out by its
``do_group_rollout``, recorded with ``record_trajectory_groups`` (the one call the README adds
to ``rl/train.py``). 2 steps x a group of 2 answers; rewards are the cookbook's (format and
correctness). The sampler is a scripted ``TokenCompleter`` (no Tinker service here); the
tokenizer is built in-process and rendered with the cookbook's ``qwen3`` renderer.

    python examples/tinker_groups.py        # then: trackio show --project otr-example-tinker

Output: ``$TRACKIO_DIR`` (Trackio's default when unset), project ``OTEL_ROLLOUTS_TRACKIO_PROJECT``.
"""

from __future__ import annotations

import asyncio
import os
from functools import partial
from typing import Any

import _tiny
from tinker_cookbook import renderers
from tinker_cookbook.completers import TokenCompleter, TokensWithLogprobs
from tinker_cookbook.recipes.math_rl.arithmetic_env import ArithmeticEnv
from tinker_cookbook.rl.problem_env import ProblemGroupBuilder
from tinker_cookbook.rl.rollouts import do_group_rollout
from tinker_cookbook.rl.train import WrappedTrajectoryGroup

import otel_rollouts as otr  # noqa: E402
from otel_rollouts.adapters.tinker import record_trajectory_groups  # noqa: E402

PROJECT = os.environ.get("OTEL_ROLLOUTS_TRACKIO_PROJECT", "otr-example-tinker")


class FixedTokens(TokenCompleter):  # type: ignore[misc]
    """The sampling client's stand-in: returns the token ids of ``texts`` in turn."""

    def __init__(self, tok: Any, texts: list[str]) -> None:
        self.tok, self.texts = tok, list(texts)

    async def __call__(self, model_input: Any, stop: Any, *, max_tokens: int | None = None) -> TokensWithLogprobs:
        ids = _tiny.text_ids(self.tok, self.texts.pop(0))
        return TokensWithLogprobs(ids, [-0.25] * len(ids), "stop")


def main() -> None:
    otr.configure(service_name="example-tinker", trackio_project=PROJECT)
    tok = _tiny.tokenizer()
    renderer = renderers.get_renderer("qwen3", tok)
    for step in (0, 1):
        builder = ProblemGroupBuilder(env_thunk=partial(ArithmeticEnv, 2, 2, renderer=renderer),
                                      num_envs=2, dataset_name="arithmetic")
        policy = FixedTokens(tok, ["The answer is 4<|im_end|>", "The answer is 5<|im_end|>"])
        group = asyncio.run(do_group_rollout(builder, policy))
        wrapped = WrappedTrajectoryGroup(trajectory_group=group, env_group_builder=builder,
                                         sampling_client_step=step)
        record_trajectory_groups([wrapped], step=step, tokenizer=tok)  # the one call in rl/train.py
        otr.end_step(step)
    otr.shutdown()
    print(f"kept episodes in Trackio project {PROJECT!r}: trackio show --project {PROJECT}")


if __name__ == "__main__":
    main()
