"""A multi-step GRPO run with every case a researcher hunts for planted in it, recorded through
the real ``otr`` API into Trackio (``python researcher_run.py <project>``, ``TRACKIO_DIR`` set).

Six steps of six prompts × four samples, a multi-turn loop with tools, kept by
``errors+slowest+top_bottom+degenerate_groups+mismatch`` with prompt ``WATCHED`` on the
watchlist. Planted:

* step ``STEP`` (the step under study):
  - the worst episode: ``WORST`` (reward 0, components ``correct 0`` and ``format 0``), whose
    ``search`` call failed with ``TOOL_ERROR``;
  - a tool straggler: ``SLOW_TOOL``'s ``fetch_page`` takes ``SLOW_TOOL_S`` (really);
  - an engine-queue straggler: ``SLOW_ENGINE``'s generation waits ``ENGINE_QUEUE_S`` in the
    inference engine's queue (the engine's own timing, ``rl.server.queue.seconds``);
  - a crash: ``CRASHED`` raises inside its episode (status ``error``);
  - a truncated member in prompt 5's group (its rewards differ: truncated, not lost);
* every step: prompt 0's four samples score the same (all equal); prompt 4's group lost a
  member (three of four arrive) and the three score the same (all equal *and* lost);
* step ``DRIFT_STEP``: the trainer and the engine disagree on one token of ``DRIFT`` by
  ``DRIFT_DELTA`` (every other token within 0.01);
* the watched prompt's answer changes across the steps;
* the last step: one ``fetch_page`` call hangs until a line arrives on stdin (the hang watcher
  shows it running past ``HANG_AFTER_S``); the child prints ``HANGING`` when it starts.

The child prints ``DONE`` once everything was flushed.
"""

from __future__ import annotations

import json
import sys
import time

import otel_rollouts as otr
from otel_rollouts import conventions as c
from otel_rollouts.exporters import TrackioExporter

STEPS = 6
STEP = 4
PROMPTS = 6
SAMPLES = 4
WATCHED = 2
QUESTIONS = [f"Question {p}: what is {7 + p} * {13 + p}?" for p in range(PROMPTS)]
WORST = (STEP, 1, 2)  # (step, prompt, sample)
SLOW_TOOL = (STEP, 1, 0)
SLOW_TOOL_S = 1.2
SLOW_ENGINE = (STEP, 1, 1)
ENGINE_QUEUE_S = 0.6
ENGINE_TTFT_S = 0.65
CRASHED = (STEP, 3, 3)
TRUNCATED = (STEP, 5, 1)
DRIFT_STEP = 3
DRIFT = (DRIFT_STEP, 1, 0)
DRIFT_POSITION = 2
DRIFT_DELTA = 3.0
HANG = (STEPS - 1, 3, 0)
HANG_AFTER_S = 1.0
TOOL_ERROR = "search backend unavailable"
TOKENS = ["The", " answer", " is", " 91", "."]


class Crash(RuntimeError):
    """What the crashed rollout raises."""


def reward_of(step: int, prompt: int, sample: int) -> float:
    """Prompt 0 and 4: the same for every sample (all equal); the others spread, rising with the
    step (the policy learns); the worst: 0, the truncated one: 0.1."""
    if (step, prompt, sample) == WORST:
        return 0.0
    if (step, prompt, sample) == TRUNCATED:
        return 0.1
    if prompt in (0, 4):
        return 1.0
    return round(0.2 + 0.1 * sample + 0.05 * step, 3)


def answer_of(step: int, prompt: int, sample: int) -> str:
    if prompt == WATCHED and sample == 0:
        return ["I am not sure.", "Maybe 200?", "It is 225.", "225", "225.", "The answer is 225."][step]
    return f"The answer is {(7 + prompt) * (13 + prompt) + (0 if sample % 2 == 0 else 1)}."


def episode(step: int, prompt: int, sample: int, release) -> None:
    key = (step, prompt, sample)
    with otr.episode(step=step, group_id=f"s{step}-p{prompt}", sample_index=sample, dataset_index=prompt,
                     policy_version=step) as ep:
        ep.prompt([{"role": "user", "content": QUESTIONS[prompt]}])
        with ep.turn() as turn:
            call = {"id": "c1", "type": "function",
                    "function": {"name": "search", "arguments": json.dumps({"q": QUESTIONS[prompt]})}}
            rollout = [-0.1, -0.2, -0.3, -0.4, -0.5]
            trainer = [v + 0.001 * (sample + 1) for v in rollout]
            if key == DRIFT:
                trainer[DRIFT_POSITION] = rollout[DRIFT_POSITION] + DRIFT_DELTA
            if key == SLOW_ENGINE:
                with turn.generation("policy") as gen:
                    time.sleep(ENGINE_QUEUE_S + 0.2)  # the request waited in the engine's queue
                    gen.output("Let me search.", tool_calls=[call], input_tokens=20, output_tokens=5,
                               tokens=TOKENS, logprobs=rollout, trainer_logprobs=trainer)
                    gen.set_attributes({c.RL_SERVER_QUEUE_SECONDS: ENGINE_QUEUE_S,
                                        c.RL_SERVER_TTFT_SECONDS: ENGINE_TTFT_S})
            else:
                turn.record_generation("Let me search.", model="policy", tool_calls=[call], input_tokens=20,
                                       output_tokens=5, tokens=TOKENS, logprobs=rollout, trainer_logprobs=trainer)
            with turn.tool_call("search", arguments={"q": QUESTIONS[prompt]}, call_id="c1") as tool:
                if key == WORST:
                    tool.error(ConnectionError(TOOL_ERROR))
                else:
                    tool.result(f"{(7 + prompt) * (13 + prompt)}")
            if key in (SLOW_TOOL, HANG):
                with turn.tool_call("fetch_page", arguments={"url": "https://example.org"}) as fetch:
                    if key == HANG:
                        print("HANGING", flush=True)
                        release()
                        fetch.error(TimeoutError("fetch_page timed out"))
                    else:
                        time.sleep(SLOW_TOOL_S)
                        fetch.result("<html>91</html>")
        with ep.turn() as turn:
            turn.record_generation(answer_of(step, prompt, sample), model="policy", input_tokens=40,
                                   output_tokens=6)
        if key == CRASHED:
            raise Crash("the environment crashed")
        ep.reward(reward_of(step, prompt, sample),
                  components={"correct": reward_of(step, prompt, sample), "format": 0.0 if key == WORST else 1.0})
        ep.finish(reason="length" if key == TRUNCATED else "stop",
                  status=c.STATUS_TRUNCATED if key == TRUNCATED else None)


def main(project: str) -> None:
    otr.configure(service_name="researcher-run", exporters=[TrackioExporter(project, run="grpo")],
                  sampler=otr.TailSampler(12, "errors+slowest+top_bottom+degenerate_groups+mismatch",
                                          watch=[WATCHED], group_size=SAMPLES),
                  hang=otr.HangOptions(after_s=HANG_AFTER_S, refresh_s=HANG_AFTER_S), run_id="researcher")
    try:
        for step in range(STEPS):
            for prompt in range(PROMPTS):
                for sample in range(SAMPLES if prompt != 4 else SAMPLES - 1):  # prompt 4 lost one
                    try:
                        episode(step, prompt, sample, lambda: sys.stdin.readline())
                    except Crash:
                        pass
            otr.end_step(step)
        assert otr.flush(120)
        print("DONE", flush=True)
    finally:
        otr.shutdown()


if __name__ == "__main__":
    main(sys.argv[1])
