"""A GRPO-style loop traced with ``@otr.traced`` and ``otr.episode``: 3 steps x 2 prompts x 4
samples, each sample one episode (prompt, a turn with a generation and a tool call, its reward);
the tail sampler keeps 6 per step and exports them to a local Trackio project.

    python examples/traced_loop.py            # then: trackio show --project otr-example-loop

Trackio writes under ``$TRACKIO_DIR`` (default ``~/.cache/huggingface/trackio``); the project
name comes from ``OTEL_ROLLOUTS_TRACKIO_PROJECT``.
"""

from __future__ import annotations

import os

import otel_rollouts as otr

PROJECT = os.environ.get("OTEL_ROLLOUTS_TRACKIO_PROJECT", "otr-example-loop")
PROMPTS = ["2 + 2", "17 * 23"]


@otr.traced(kind="generation")
def generate(messages: list[dict[str, str]], model: str = "tiny-policy") -> str:
    """The policy's reply (a real loop calls its inference server here)."""
    return "I'll use the calculator."


@otr.traced(kind="tool")
def calculator(expression: str) -> int:
    """A tool the policy calls; its arguments and result land on the ``execute_tool`` span."""
    a, op, b = expression.split()
    return int(a) + int(b) if op == "+" else int(a) * int(b)


def main() -> None:
    otr.configure(service_name="example-loop", trackio_project=PROJECT,
                  sampler=otr.TailSampler(max_traces_per_step=6, policy="top_bottom"))
    for step in range(3):
        for group, expression in enumerate(PROMPTS):
            for sample in range(4):
                question = [{"role": "user", "content": f"What is {expression}?"}]
                with otr.episode(step=step, group_id=f"p{group}", sample_index=sample) as ep:
                    ep.prompt(question)
                    with ep.turn() as turn:
                        generate(question)
                        with turn.tool_call("calculator", arguments={"expression": expression},
                                            call_id="c1") as call:
                            call.result(calculator(expression))
                    score = float((sample + step) % 2 == 0)
                    ep.reward(score, components={"correct": score, "format": 0.5})
                    ep.finish(reason="stop")
        otr.end_step(step)  # the sampler decides for this step and exports off-thread
    otr.shutdown()
    print(f"kept episodes in Trackio project {PROJECT!r}: trackio show --project {PROJECT}")


if __name__ == "__main__":
    main()
