"""Capture off drops the dataset fields that hold answers: torchforge's ``target`` and
Open-Instruct's ``ground_truth`` were kept as ``rl.metadata.*`` labels (issue 28)."""

from __future__ import annotations

import json
from types import SimpleNamespace

from opentelemetry.sdk.trace.export.in_memory_span_exporter import InMemorySpanExporter
from otr_helpers import configure_memory

import otel_rollouts as otr
from otel_rollouts import conventions as c
from otel_rollouts.adapters import open_instruct, torchforge

ANSWER = "secret-answer-1729"


def _configure(capture: bool) -> InMemorySpanExporter:
    memory = configure_memory(100, "first", capture_content=capture, handle_signals=False)
    return memory


def _rendered(memory: InMemorySpanExporter, step: int) -> str:
    otr.end_step(step)
    assert otr.flush(10.0)
    spans = memory.get_finished_spans()
    assert spans
    return "\n".join(json.dumps(dict(s.attributes or {}), default=str) for s in spans)


def _forge_samples() -> list[dict]:
    return [{"episode_id": f"e{i}", "prompt": "what is the answer?", "response": "no idea",
             "target": ANSWER, "reward": float(i)} for i in range(2)]


def _open_instruct_batch():
    batch = SimpleNamespace(queries=[[1, 2], [1, 2]], ground_truths=[ANSWER, ANSWER],
                            datasets=["gsm8k", "gsm8k"], raw_queries=["q?", "q?"],
                            decoded_responses=["a", "b"], indices=[0, 0], scores=[1.0, 0.0])
    result = SimpleNamespace(responses=[[3], [4]], finish_reasons=["stop", "stop"],
                             masks=[[1], [1]], request_info=None)
    return batch, result


def test_torchforge_target_is_dropped_with_capture_off(otr_shutdown):
    memory = _configure(capture=False)
    torchforge.record_episodes(_forge_samples(), step=0)
    assert ANSWER not in _rendered(memory, 0)


def test_open_instruct_ground_truth_is_dropped_with_capture_off(otr_shutdown):
    memory = _configure(capture=False)
    batch, result = _open_instruct_batch()
    assert open_instruct.record_batch(batch, result, step=0) == 2
    assert ANSWER not in _rendered(memory, 0)


def test_the_answers_are_kept_with_capture_on(otr_shutdown):
    memory = _configure(capture=True)
    torchforge.record_episodes(_forge_samples(), step=0)
    batch, result = _open_instruct_batch()
    open_instruct.record_batch(batch, result, step=0)
    rendered = _rendered(memory, 0)
    assert f'"{c.RL_METADATA_PREFIX}target": "{ANSWER}"' in rendered
    assert f'"{c.RL_METADATA_PREFIX}ground_truth": "{ANSWER}"' in rendered
