"""AReaL: ``areal.traced(workflow)`` around AReaL's own ``RLVRWorkflow``, the one change the
README makes to ``trainer.train(workflow=...)``. Each trajectory the workflow returns (prompt,
answer, reward from a verifier run in AReaL's reward pool) becomes one episode; the step is the
engine's weight version, and a step closes when the version moves on. The inference engine is a
scripted stand-in (no SGLang/GPU here); the tokenizer is built in-process.

    python examples/areal_workflow.py         # then: trackio show --project otr-example-areal

Output: ``$TRACKIO_DIR`` (Trackio's default when unset), project ``OTEL_ROLLOUTS_TRACKIO_PROJECT``.
"""

from __future__ import annotations

import asyncio
import os
from typing import Any

import _tiny
from areal.api import InferenceEngine, ModelResponse
from areal.api.cli_args import GenerationHyperparameters, InferenceEngineConfig
from areal.workflow.rlvr import RLVRWorkflow

import otel_rollouts as otr
from otel_rollouts.adapters import areal

PROJECT = os.environ.get("OTEL_ROLLOUTS_TRACKIO_PROJECT", "otr-example-areal")
ANSWERS = {"What is 2 + 2?": "The answer is 4.", "What is 17 * 23?": "The answer is 391."}


def reward_fn(prompt: str, completions: str, prompt_ids: Any, completion_ids: Any, answer: str,
              **kwargs: Any) -> float:
    """A verifier in AReaL's reward-function signature."""
    return 1.0 if f"is {answer}." in completions else 0.0


class ScriptedEngine(InferenceEngine):  # type: ignore[misc]
    """The inference engine's stand-in: a fixed answer per question, every generated token
    stamped with the current weight version, as AReaL's ``RemoteInfEngine`` does."""

    def __init__(self, tok: Any) -> None:
        self.tok, self.version = tok, 0
        self.config = InferenceEngineConfig(max_head_offpolicyness=0)  # on-policy: staleness is known

    def initialized(self) -> bool:
        return True

    def get_version(self) -> int:
        return self.version

    async def agenerate(self, req: Any) -> ModelResponse:
        question = next(q for q in ANSWERS if q in self.tok.decode(req.input_ids))
        out = _tiny.text_ids(self.tok, ANSWERS[question] + "<|im_end|>")
        return ModelResponse(input_tokens=list(req.input_ids), output_tokens=out, output_logprobs=[-0.5] * len(out),
                             output_versions=[self.version] * len(out), stop_reason="stop", tokenizer=self.tok)


async def train(tok: Any) -> None:
    engine = ScriptedEngine(tok)
    gconfig = GenerationHyperparameters(n_samples=1, max_new_tokens=16)
    workflow = areal.traced(RLVRWorkflow(reward_fn, gconfig, tok))  # the line the README adds
    for step in (1, 2):
        engine.version = step  # PPOTrainer: set_version(global_step + 1) after each update
        for question, answer in (("What is 2 + 2?", "4"), ("What is 17 * 23?", "391")):
            data = {"messages": [{"role": "user", "content": question}], "answer": answer}
            await workflow.arun_episode(engine, data)


def main() -> None:
    otr.configure(service_name="example-areal", trackio_project=PROJECT)
    asyncio.run(train(_tiny.tokenizer()))
    otr.shutdown()  # closes the last step
    print(f"kept episodes in Trackio project {PROJECT!r}: trackio show --project {PROJECT}")


if __name__ == "__main__":
    main()
