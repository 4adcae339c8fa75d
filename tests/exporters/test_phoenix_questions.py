"""The questions researchers ask of a step, answered in a real Phoenix by the filters the README
gives: the stragglers (latency, ``trace.keep_reason``, stage seconds), degenerate groups, why an
episode was kept, a watched prompt across steps. Phoenix's span list runs the same filter
condition over GraphQL as its filter box does."""

from __future__ import annotations

import time
import uuid

from opentelemetry.exporter.otlp.proto.http.trace_exporter import (
    OTLPSpanExporter as HttpSpanExporter,
)
from receivers import PhoenixReceiver
from test_phoenix_integration import _roots

import otel_rollouts as otr
from otel_rollouts import conventions as c

WATCHED = 7
SLOW = ("g2", 1)  # the episode whose tool is slow (a workload: it sleeps)


def _record(phoenix: PhoenixReceiver, project: str) -> dict[tuple[int, str, int], str]:
    otr.configure(service_name="otr-phoenix-questions",
                  exporters=[HttpSpanExporter(endpoint=phoenix.http_endpoint, timeout=10)],
                  sampler=otr.TailSampler(16, "errors+slowest+top_bottom+degenerate_groups", watch=[WATCHED]),
                  resource_attributes={"openinference.project.name": project}, run_id="run-q")
    traces = {}
    try:
        for step in (0, 1):
            for g in range(4):
                for i in range(4):
                    index = WATCHED if (g, i) == (3, 3) else 10 * g + i
                    with otr.episode(step=step, group_id=f"g{g}", sample_index=i, dataset_index=index) as ep:
                        ep.prompt(f"question {index}")
                        with ep.turn() as turn:
                            turn.record_generation(f"answer {step}-{g}-{i}", model="m")
                            with turn.tool_call("search", arguments={"q": index}) as call:
                                if step == 0 and (f"g{g}", i) == SLOW:
                                    time.sleep(0.25)
                                call.result("hit")
                        ep.reward(1.0 if g == 1 else i / 4)  # g1: every member the same reward
                    traces[(step, f"g{g}", i)] = ep.trace_id
            otr.end_step(step)
        assert otr.flush(60)
    finally:
        otr.shutdown(60)
    return traces


def test_phoenix_filters_answer_the_questions(phoenix: PhoenixReceiver) -> None:
    project = f"otr-questions-{uuid.uuid4().hex[:8]}"
    traces = _record(phoenix, project)
    kept = _roots(phoenix, project, "parent_id is None")
    deadline = time.monotonic() + 60
    while len(kept) < 20 and time.monotonic() < deadline:  # spans stored as they arrive
        time.sleep(0.5)
        kept = _roots(phoenix, project, "parent_id is None")
    by_trace = {r["trace_id"]: r["metadata"] for r in kept}
    assert all("trace.keep_reason" in m for m in by_trace.values())

    # 1. the stragglers of step 0: longest first, the slow tool's episode on top
    step0 = _roots(phoenix, project, "metadata['step'] == 0 and parent_id is None",
                   sort={"col": "latencyMs", "dir": "desc"})
    slow = traces[(0, *SLOW)]
    assert step0[0]["trace_id"] == slow
    assert step0[0]["metadata"]["stage.tool.seconds"] >= 0.25
    assert step0[0]["metadata"]["duration.seconds"] >= step0[0]["metadata"]["stage.tool.seconds"]
    slowest = _roots(phoenix, project, "metadata['trace.keep_reason'] == 'slowest' and parent_id is None")
    assert slow in {r["trace_id"] for r in slowest}
    tool_heavy = _roots(phoenix, project, "metadata['stage.tool.seconds'] > 0.2 and parent_id is None")
    assert {r["trace_id"] for r in tool_heavy} == {slow}

    # 2. degenerate groups: g1's members, all the same reward
    # (the documented filter: all-equal whatever else holds, lost members included)
    equal = _roots(phoenix, project, "metadata['group.all_equal'] == True and parent_id is None")
    assert equal and {r["metadata"]["group.id"] for r in equal} == {"g1"}
    assert all(r["metadata"]["group.reward_spread"] == 0 for r in equal)

    # 3. why kept: every reason is a filter
    reasons = {m["trace.keep_reason"] for m in by_trace.values()}
    assert {"slowest", "top", "bottom", "watch"} <= reasons
    for reason in reasons:
        found = _roots(phoenix, project, f"metadata['trace.keep_reason'] == '{reason}' and parent_id is None")
        assert found and {r["metadata"]["trace.keep_reason"] for r in found} == {reason}

    # 4. the watched prompt, at each step it appeared
    watched = _roots(phoenix, project, f"metadata['watch.key'] == '{WATCHED}' and parent_id is None",
                     sort={"col": "startTime", "dir": "asc"})
    assert [r["trace_id"] for r in watched] == [traces[(0, "g3", 3)], traces[(1, "g3", 3)]]
    assert all(r["metadata"]["dataset.index"] == WATCHED for r in watched)
    assert c.RL_WATCH_KEY.removeprefix("rl.") == "watch.key"
