"""Open-Instruct: ``open_instruct.record_batch`` on one GRPO batch, the one line the README adds
to ``DataPreparationActor._data_preparation_loop`` after the advantages. Open-Instruct is not on
the package registry (git only, with vLLM and DeepSpeed), so its ``Batch``, ``GenerationResult``
and ``RequestInfo`` are declared below field by field as in its source at commit ``e6c3044a``;
2 steps x 2 prompts x 2 samples, centered advantages as its loop computes them.

    python examples/open_instruct.py          # then: trackio show --project otr-example-open-instruct

Output: ``$TRACKIO_DIR`` (Trackio's default when unset), project ``OTEL_ROLLOUTS_TRACKIO_PROJECT``.
"""

from __future__ import annotations

import os
from dataclasses import dataclass, field
from typing import Any

import _tiny
import numpy as np

import otel_rollouts as otr
from otel_rollouts.adapters import open_instruct

PROJECT = os.environ.get("OTEL_ROLLOUTS_TRACKIO_PROJECT", "otr-example-open-instruct")


@dataclass
class RequestInfo:  # open_instruct/data_types.py
    num_calls: list[int]
    timeouts: list[int]
    tool_errors: list[str]
    tool_outputs: list[str]
    tool_runtimes: list[float]
    tool_calleds: list[bool]
    tool_call_stats: list[list[Any]] = field(default_factory=list)
    rollout_states: list[dict[str, Any]] = field(default_factory=list)


@dataclass
class GenerationResult:  # open_instruct/data_types.py
    responses: list[list[int]]
    finish_reasons: list[str]
    masks: list[list[int]]
    request_info: RequestInfo
    index: int | None = None
    prompt_id: str | None = None


@dataclass
class Batch:  # open_instruct/data_types.py
    queries: list[list[int]]
    ground_truths: list[list[str]]
    datasets: list[list[str]]
    raw_queries: list[str] | None
    decoded_responses: list[str] | None
    indices: list[int] | None
    scores: list[float] | None
    model_steps: list[int] = field(default_factory=list)


def make(tok: Any, step: int) -> tuple[Batch, GenerationResult, np.ndarray]:
    questions = [("What is 2 + 2?", "4", ["The answer is 4.", "The answer is 17."]),
                 ("What is 17 * 23?", "391", ["The answer is 391.", "Think step by step"])]
    rows = [(q, truth, text) for q, truth, texts in questions for text in texts]
    responses = [_tiny.text_ids(tok, text + "<|im_end|>") for _, _, text in rows]
    scores = [float(text.endswith(f"is {truth}.")) for _, truth, text in rows]
    n = len(rows)
    info = RequestInfo(num_calls=[0] * n, timeouts=[0] * n, tool_errors=[""] * n, tool_outputs=[""] * n,
                       tool_runtimes=[0.0] * n, tool_calleds=[False] * n)
    batch = Batch(queries=[_tiny.chat_ids(tok, [{"role": "user", "content": q}]) for q, _, _ in rows],
                  ground_truths=[[truth] for _, truth, _ in rows], datasets=[["gsm8k"]] * n,
                  raw_queries=[f"user: {q}" for q, _, _ in rows], decoded_responses=None,
                  indices=[i // 2 for i in range(n)], scores=scores, model_steps=[step - 1] * n)
    result = GenerationResult(responses=responses, finish_reasons=["stop"] * n, masks=[[1] * len(r) for r in responses],
                              request_info=info)
    grouped = np.array(scores).reshape(-1, 2)
    return batch, result, (grouped - grouped.mean(axis=1, keepdims=True)).reshape(-1)


def main() -> None:
    otr.configure(service_name="example-open-instruct", trackio_project=PROJECT)
    tok = _tiny.tokenizer()
    for step in (1, 2):
        batch, result, advantages = make(tok, step)
        open_instruct.record_batch(batch, result, step=step, advantages=advantages,
                                   num_samples_per_prompt=2, tokenizer=tok)
        otr.end_step(step)
    otr.shutdown()
    print(f"kept episodes in Trackio project {PROJECT!r}: trackio show --project {PROJECT}")


if __name__ == "__main__":
    main()
