"""``otel-rollouts demo``: a small but realistic GRPO-style rollout loop, traced.

Each step samples a group of completions per prompt from a toy "policy" that solves arithmetic
word problems with a calculator tool over several turns. Some tool calls fail (division by
zero, malformed expressions), some episodes run out of turns (truncated), rewards vary, and the
group-normalised advantage is recorded once the whole group is scored — after the episode block
has closed, as real trainers do.

What a researcher asks of such a run happens in it too: a slow ``search`` tool makes stragglers
(a heavy tail: most calls take milliseconds, a few a quarter of a second), one prompt is so easy
that its whole group scores the same (zero advantage) and one is impossible (every sample runs
out of turns), and with ``hang_s`` one tool call hangs that long at ``hang_step`` before it times
out, so the episode is visible as running while it hangs. Every final answer carries the
engine's and the trainer's logprobs of its tokens: they agree closely (more loosely for a
sample from the previous policy version), except that every few steps one sample of
``GLITCH_PROMPT`` has one token the trainer finds far less likely than the engine did (a
numerics glitch), which the ``mismatch`` part keeps and Trackio shows token by token.
"""

from __future__ import annotations

import asyncio
import random
import statistics
from dataclasses import dataclass
from typing import Any

import otel_rollouts as otr

MODEL = "toy-policy-0.5b"
SYSTEM = "You are a careful assistant. Use the calculator tool for arithmetic."
PROBLEMS = [
    ("A crate holds 12 boxes of 8 apples. How many apples?", "12*8"),
    ("Split 144 marbles between 0 friends evenly.", "144/0"),
    ("A train covers 315 km in 3.5 hours. Average speed?", "315/3.5"),
    ("Add the first five primes.", "2+3+5+7+11"),
    ("A shirt costs 40 after a 20% discount. Original price?", "40/0.8"),
    ("How many seconds are in a week?", "7*24*60*60"),
    ("What is 17 squared minus 13 squared?", "17**2-13**2"),
    ("Average of 82, 91 and 77?", "(82+91+77)/3"),
]


EASY = {5}  # every sample answers right in the same format: an all-equal group
SLOW_SEARCH = {2, 6}  # prompts whose first turn looks something up first (a slow tool, at times)
HANG_PROMPT = 2  # the prompt whose first sample's fetch hangs at the hang step
LEARNING_STEPS = 30  # steps over which the toy policy gets better
GLITCH_PROMPT, GLITCH_EVERY = 4, 3  # one sample of this prompt every 3 steps: a mismatch glitch


def answer_logprobs(text: str, step: int, prompt: int, sample: int, stale: bool) -> dict[str, Any]:
    """Per-token logprobs of an answer as the inference engine and the trainer computed them
    (a word a token): a seeded stand-in, so that the rest of the demo's randomness is unchanged."""
    rng = random.Random(step * 1_000_003 + prompt * 1_009 + sample)
    tokens = text.split(" ")
    engine = [round(rng.uniform(-2.5, -0.01), 4) for _ in tokens]
    spread = 0.15 if stale else 0.02  # a sample from the previous policy version drifts more
    trainer = [round(lp + rng.gauss(0.0, spread), 4) for lp in engine]
    if prompt == GLITCH_PROMPT and sample == 1 and step % GLITCH_EVERY == 0:
        number = max((k for k, word in enumerate(tokens) if any(ch.isdigit() for ch in word)), default=len(tokens) - 1)
        trainer[number] -= 4.0  # the trainer finds the number 55x less likely than the engine did
    return {"logprobs": engine, "trainer_logprobs": trainer, "tokens": tokens}


class ToolError(Exception):
    """A tool call that failed in the environment."""


def calculator(expression: str) -> float:
    allowed = set("0123456789+-*/(). ")
    if not expression or set(expression) - allowed:
        raise ToolError(f"malformed expression: {expression!r}")
    try:
        return float(eval(expression, {"__builtins__": {}}, {}))  # noqa: S307 - digits and operators only
    except ZeroDivisionError as exc:
        raise ToolError("division by zero") from exc
    except SyntaxError as exc:
        raise ToolError(f"malformed expression: {expression!r}") from exc


@dataclass
class Outcome:
    reward: float
    episode: otr.Episode


async def _search(turn: otr.Turn, query: str, rng: random.Random) -> None:
    """A lookup tool with a heavy tail: 1 call in 8 takes 0.1-0.3 s (a straggler's cause)."""
    with turn.tool_call("search", arguments={"query": query}) as call:
        await asyncio.sleep(rng.uniform(0.1, 0.3) if rng.random() < 0.125 else rng.uniform(0.001, 0.004))
        call.result({"hits": 3, "top": "a worked example"})


async def _fetch_that_hangs(turn: otr.Turn, hang_s: float) -> None:
    """A tool call that never answers: cancelled by its own timeout after ``hang_s``."""
    with turn.tool_call("fetch_page", arguments={"url": "http://reference.invalid/table"}) as call:
        try:
            await asyncio.wait_for(asyncio.Event().wait(), timeout=hang_s)
        except asyncio.TimeoutError:
            call.error(ToolError(f"fetch_page timed out after {hang_s:g} s"))
            raise ToolError("fetch_page timed out") from None


async def rollout(step: int, prompt_index: int, sample: int, rng: random.Random, max_turns: int,
                  hang_s: float = 0.0, hang_step: int = 1) -> Outcome:
    question, expression = PROBLEMS[prompt_index % len(PROBLEMS)]
    easy = prompt_index % len(PROBLEMS) in EASY
    group = f"s{step}-p{prompt_index}"
    version = max(step - rng.choice([0, 0, 1]), 0)
    async with otr.episode(
        step=step,
        split="train",
        group_id=group,
        sample_index=sample,
        policy_version=version,
        dataset_name="toy-arith",
        dataset_index=prompt_index,
        metadata={"temperature": 0.8},
    ) as ep:
        ep.prompt([{"role": "system", "content": SYSTEM}, {"role": "user", "content": question}])
        answer = None
        hung = False
        learned = min(step / LEARNING_STEPS, 1.0)  # the policy gets better as training goes on
        for _ in range(max_turns):
            async with ep.turn() as turn:
                garbled = not easy and rng.random() < 0.25 - 0.15 * learned
                expr = expression.replace("*", "x") if garbled else expression
                call_id = f"call_{step}_{prompt_index}_{sample}_{turn.index}"
                with turn.generation(model=MODEL) as gen:
                    await asyncio.sleep(rng.uniform(0.0005, 0.002))  # generation latency
                    gen.output(
                        f"I'll compute `{expr}` with the calculator.",
                        tool_calls=[{"id": call_id, "type": "function",
                                     "function": {"name": "calculator", "arguments": f'{{"expression": "{expr}"}}'}}],
                        input_tokens=40 + 25 * turn.index,
                        output_tokens=12 + rng.randrange(8),
                        finish_reason="tool_calls",
                    )
                if turn.index == 0 and prompt_index % len(PROBLEMS) in SLOW_SEARCH:
                    await _search(turn, question, rng)
                if hang_s > 0 and turn.index == 0 and step == hang_step and sample == 0 \
                        and prompt_index == HANG_PROMPT:
                    try:
                        await _fetch_that_hangs(turn, hang_s)
                    except ToolError:
                        hung = True
                        break
                with turn.tool_call("calculator", arguments={"expression": expr}, call_id=call_id) as call:
                    try:
                        value = calculator(expr)
                    except ToolError as exc:
                        call.error(exc)
                        continue
                    call.result(value)
                if easy or rng.random() < 0.7:
                    answer = value
                    # early on the policy hedges; later it answers plainly (a watched prompt's
                    # answers show the change)
                    text = f"The answer is {value:g}." if rng.random() < 0.3 + 0.7 * learned \
                        else f"Hmm, maybe {value:g}? I am not sure."
                    with turn.generation(model=MODEL) as gen:
                        await asyncio.sleep(rng.uniform(0.0003, 0.001))
                        gen.output(text, input_tokens=70, output_tokens=8, finish_reason="stop",
                                   **answer_logprobs(text, step, prompt_index, sample, version < step))
                    break
                turn.feedback("Please double-check and state the final answer.", role="user")
        if hung:
            ep.finish(reason="tool_timeout", status="truncated")
            reward = 0.0
            components = {"correct": 0.0, "format": 0.0}
        elif answer is None:
            ep.finish(reason="max_turns", status="truncated")
            reward = 0.0
            components = {"correct": 0.0, "format": 0.0}
        else:
            correct = 1.0 if easy or rng.random() < 0.6 + 0.35 * learned else 0.0
            fmt = 1.0 if easy else round(rng.uniform(0.5, 1.0), 2)
            reward = correct + 0.2 * fmt
            components = {"correct": correct, "format": fmt}
            ep.finish(reason="stop", status="ok")
        ep.reward(reward, components=components)
    return Outcome(reward, ep)


async def run_step(step: int, prompts: int, group_size: int, rng: random.Random, max_turns: int,
                   hang_s: float = 0.0, hang_step: int = 1) -> list[Outcome]:
    tasks = [
        rollout(step, p, s, random.Random(rng.random()), max_turns, hang_s, hang_step)
        for p in range(prompts)
        for s in range(group_size)
    ]
    outcomes = await asyncio.gather(*tasks)
    # the advantage is known only once the whole group is scored: recorded after the episodes closed
    for p in range(prompts):
        group = outcomes[p * group_size : (p + 1) * group_size]
        mean = statistics.fmean(o.reward for o in group)
        std = statistics.pstdev(o.reward for o in group) or 1.0
        for o in group:
            o.episode.reward(o.reward, advantage=(o.reward - mean) / (std + 1e-6))
    return outcomes


def run(steps: int = 4, prompts: int = 16, group_size: int = 4, seed: int = 0,
        max_turns: int = 3, progress: bool = True, hang_s: float = 0.0, hang_step: int = 1) -> dict:
    """Run the loop; returns otr.stats(). Call otr.configure() first. ``hang_s`` > 0: one tool
    call of step ``hang_step`` hangs that long (then times out)."""
    from tqdm import tqdm

    rng = random.Random(seed)
    bar = tqdm(total=steps * prompts * group_size, unit="episode", disable=not progress, desc="rollouts")
    for step in range(steps):
        asyncio.run(run_step(step, prompts, group_size, rng, max_turns, hang_s, hang_step))
        otr.end_step(step)
        bar.update(prompts * group_size)
    bar.close()
    otr.flush()
    return otr.stats()
