"""``otr.describe_run``: the run as the RL conventions' resource attributes (``rl.system.name``,
``rl.system.version``, ``rl.algorithm``, ``rl.model.name``, ``rl.environment.name``) on what is
exported from then on, in the render thread, with the real SDK's in-memory exporter (the
renderer process and a restarted one: ``test_render_process.py``'s restart test)."""

from __future__ import annotations

from collections.abc import Iterator
from pathlib import Path

import pytest
from opentelemetry.sdk.trace.export.in_memory_span_exporter import InMemorySpanExporter

import otel_rollouts as otr
from otel_rollouts import conventions as c
from otel_rollouts.exporters.otlp_json import read_requests

DESCRIBED = {c.RL_SYSTEM_NAME: "verl", c.RL_SYSTEM_VERSION: "0.9.1", c.RL_ALGORITHM: "grpo",
             c.RL_MODEL_NAME: "Qwen/Qwen3-0.6B", c.RL_ENVIRONMENT_NAME: "gsm8k"}


@pytest.fixture(autouse=True)
def _shutdown() -> Iterator[None]:
    yield
    otr.shutdown(timeout=10)


def _episode(step: int) -> None:
    with otr.episode(step=step, group_id="g", sample_index=0) as ep:
        ep.reward(1.0)
    otr.end_step(step)


def _file_resources(path: Path) -> list[dict[str, str]]:
    out = []
    for request in read_requests(path):
        for rs in request.resource_spans:
            out.append({a.key: a.value.string_value for a in rs.resource.attributes
                        if a.value.WhichOneof("value") == "string_value"})
    return out


class Hostile:
    def __str__(self) -> str:
        raise SystemExit("a model name that cannot be printed")

    __repr__ = __str__


def test_the_description_is_on_the_resource_of_what_is_exported_next() -> None:
    assert otr.describe_run(system="verl") == {}  # nothing configured: nothing to describe
    memory = InMemorySpanExporter()
    otr.configure(exporters=[memory], sampler=otr.TailSampler(10, "first"), handle_signals=False,
                  resource_attributes={"team": "rl"})
    _episode(0)
    assert otr.flush()
    (before,) = {s.resource for s in memory.get_finished_spans()}
    assert c.RL_ALGORITHM not in before.attributes
    memory.clear()
    described = otr.describe_run(system="verl", system_version="0.9.1", algorithm="GRPO",
                                 model_name="Qwen/Qwen3-0.6B", environment_name="gsm8k")
    assert described == DESCRIBED  # the algorithm in lower case
    assert otr.describe_run(model_name=None) == DESCRIBED  # None leaves a value as it is
    _episode(1)
    assert otr.flush()
    (after,) = {s.resource for s in memory.get_finished_spans()}
    assert {k: after.attributes[k] for k in DESCRIBED} == DESCRIBED
    assert after.attributes["team"] == "rl" and after.attributes[c.RL_RUN_ID]  # the rest stays
    # a value whose __str__ raises SystemExit: a placeholder, nothing raised into the caller
    described = otr.describe_run(model_name=Hostile())
    assert described[c.RL_MODEL_NAME].startswith("<Hostile")
