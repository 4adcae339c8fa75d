"""A small, fixed RL step recorded through otel_rollouts, shared by the receiver/replay/browser tests.

Each episode: ``episode`` → ``prompt``, ``turn`` 0 (``chat tiny-policy`` + ``execute_tool
calculator`` that succeeds), ``turn`` 1 (``chat tiny-policy`` + ``execute_tool search`` that
fails), ``reward`` with components and the advantage. Rewards differ per episode, so a
``top_bottom`` sampler with cap 2 keeps exactly the best and the worst: the others are dropped
and must never reach an exporter.
"""

from __future__ import annotations

import json
import os
import sqlite3
import subprocess
import sys
from collections.abc import Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from suite_paths import TEST_PATHS

import otel_rollouts as otr

MODEL = "tiny-policy"
TOOL_OK = "calculator"
TOOL_FAILS = "search"
TOOL_ERROR = "search backend unavailable"
# names of one episode's spans, each with the OpenInference kind Phoenix should show
SPAN_KINDS = {
    "episode": "AGENT",
    "prompt": "CHAIN",
    "turn": "CHAIN",
    f"chat {MODEL}": "LLM",
    f"execute_tool {TOOL_OK}": "TOOL",
    f"execute_tool {TOOL_FAILS}": "TOOL",
    "reward": "EVALUATOR",
}
SPANS_PER_EPISODE = 9  # episode, prompt, 2 turns, 2 chats, 2 tool calls, reward


@dataclass
class Recorded:
    """One episode as the test recorded it."""

    trace_id: str
    step: int
    sample_index: int
    reward: float


def record_episode(step: int, sample_index: int, reward: float) -> Recorded:
    with otr.episode(step=step, group_id=f"g{step}", sample_index=sample_index,
                     policy_version=7) as ep:
        ep.prompt([{"role": "system", "content": "Use the tools."},
                   {"role": "user", "content": f"What is 6*7? (sample {sample_index})"}])
        with ep.turn() as turn:
            turn.record_generation("Let me compute.", model=MODEL, input_tokens=21, output_tokens=5,
                                   tool_calls=[{"id": "c1", "type": "function",
                                                "function": {"name": TOOL_OK,
                                                             "arguments": '{"expression": "6*7"}'}}])
            with turn.tool_call(TOOL_OK, arguments={"expression": "6*7"}, call_id="c1") as call:
                call.result(42)
        with ep.turn() as turn:
            turn.record_generation("Let me check online.", model=MODEL, input_tokens=30,
                                   output_tokens=4)
            with turn.tool_call(TOOL_FAILS, arguments={"q": "6*7"}, call_id="c2") as call:
                call.error(ConnectionError(TOOL_ERROR))  # status + an exception event
        ep.reward(reward, components={"math": reward, "format": 0.25}, advantage=reward - 0.5)
        ep.finish(reason="stop")
    assert ep.trace_id is not None
    return Recorded(ep.trace_id, step, sample_index, reward)


def record_step(step: int, rewards: Sequence[float]) -> list[Recorded]:
    """One step of episodes with these rewards, then close the step (the sampler decides)."""
    recorded = [record_episode(step, i, r) for i, r in enumerate(rewards)]
    otr.end_step(step)
    return recorded


def kept_by_top_bottom(recorded: Sequence[Recorded]) -> tuple[list[Recorded], list[Recorded]]:
    """With ``TailSampler(2, "top_bottom")``: (kept = best and worst, dropped = the rest)."""
    best = max(recorded, key=lambda r: r.reward)
    worst = min(recorded, key=lambda r: r.reward)
    kept = [best, worst]
    return kept, [r for r in recorded if r not in kept]


# --- Trackio in a subprocess (TRACKIO_DIR is read when trackio is imported) ---------------------
def run_python(code: str, trackio_dir: Path, timeout: float = 120, **env: str) -> str:
    """Run ``code`` in a fresh interpreter with ``TRACKIO_DIR`` set; its stdout (fails loudly)."""
    full_env = {k: v for k, v in os.environ.items() if not k.startswith(("OTEL_", "TRACKIO_"))}
    full_env.update(TRACKIO_DIR=str(trackio_dir), PYTHONPATH=TEST_PATHS, **env)
    done = subprocess.run([sys.executable, "-c", code], env=full_env, capture_output=True,
                          text=True, timeout=timeout)
    assert done.returncode == 0, f"exit {done.returncode}\n{done.stdout}\n{done.stderr}"
    return done.stdout


def trackio_traces(trackio_dir: Path, project: str) -> list[dict[str, Any]]:
    """Every stored trace of ``project``, read from Trackio's SQLite file (blobs decoded)."""
    with sqlite3.connect(trackio_dir / f"{project}.db") as db:
        db.row_factory = sqlite3.Row
        rows = db.execute("SELECT * FROM traces ORDER BY step, trace_index").fetchall()
    out = []
    for row in rows:
        item = dict(row)
        for key in ("messages", "metadata", "spans"):
            raw = item[key]
            item[key] = json.loads(raw.decode() if isinstance(raw, bytes) else raw)
        out.append(item)
    return out
