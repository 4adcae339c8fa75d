"""Kept episodes land in Trackio's own SQLite storage as traces with messages, metadata, spans."""

from __future__ import annotations

from otr_helpers import trackio_rows

import otel_rollouts as otr
from otel_rollouts.exporters import TrackioExporter


def test_trackio_traces_read_back_from_sqlite(otr_shutdown):
    project = "otr-test-trackio"
    otr.configure(exporters=[TrackioExporter(project, run="r1")],
                  sampler=otr.TailSampler(2, "top_bottom"))
    for step in range(2):
        for i in range(5):
            with otr.episode(step=step, group_id=f"g{step}", sample_index=i, policy_version=step) as ep:
                ep.prompt([{"role": "system", "content": "be brief"}, {"role": "user", "content": f"q{i}"}])
                with ep.turn() as turn:
                    turn.record_generation(f"call {i}", model="pol", input_tokens=9, output_tokens=2,
                                           tool_calls=[{"id": f"c{i}", "type": "function",
                                                        "function": {"name": "calc", "arguments": "{}"}}])
                    with turn.tool_call("calc", arguments={"i": i}, call_id=f"c{i}") as call:
                        if i == 0:
                            call.error("division by zero")
                        else:
                            call.result(i * 10)
                    turn.feedback("try again")
                with ep.turn() as turn:
                    turn.record_generation(f"final {i}", model="pol")
                ep.reward(i / 4, components={"math": float(i % 2)}, advantage=i - 2.0)
                ep.finish(reason="stop")
        otr.end_step(step)
    assert otr.flush()
    rows = trackio_rows(project)
    assert [r["step"] for r in rows] == [0, 0, 1, 1]
    assert all(r["key"] == "rollouts" for r in rows)
    for row in rows:
        md = row["metadata"]
        assert isinstance(md["rl.reward"], float) and md["rl.reward"] in (0.0, 1.0)
        assert isinstance(md["rl.step"], int) and md["rl.step"] == row["step"]
        assert md["rl.policy.version"] == row["step"] and md["rl.group.id"] == f"g{row['step']}"
        assert isinstance(md["rl.reward.math"], float) and isinstance(md["rl.advantage"], float)
        assert len(md["trace_id"]) == 32
        i = md["rl.sample.index"]
        msgs = row["messages"]
        assert [m["role"] for m in msgs] == ["system", "user", "assistant", "tool", "user", "assistant"]
        assert msgs[1]["content"] == f"q{i}"
        assert msgs[2]["tool_calls"][0]["id"] == f"c{i}"
        assert msgs[3]["tool_call_id"] == f"c{i}"
        assert msgs[3]["content"] == ("error: division by zero" if i == 0 else str(i * 10))
        assert msgs[4] == {"role": "user", "name": "environment", "content": "try again"}
        spans = row["spans"]
        ids = {s["id"] for s in spans}
        by_name = {}
        for s in spans:
            by_name.setdefault(s["name"], []).append(s)
            assert s.get("parent_id") is None or s["parent_id"] in ids
            assert s["start_time"].endswith("+00:00") and s["end_time"] >= s["start_time"]
        root = by_name["episode"][0]
        assert "parent_id" not in root
        assert [s["parent_id"] for s in by_name["turn"]] == [root["id"], root["id"]]
        gen = by_name["chat pol"][0]
        assert gen["kind"] == "generation" and gen["model"] == "pol"
        assert gen["usage"] == {"input_tokens": 9, "output_tokens": 2}
        assert gen["parent_id"] == by_name["turn"][0]["id"]
        tool = by_name["execute_tool calc"][0]
        assert tool["kind"] == "tool" and tool["input"] == {"i": i}
        if i == 0:
            assert tool["status"] == "error" and tool["error"] == "division by zero"
        else:
            assert tool["status"] == "success" and tool["output"] == i * 10
        assert by_name["reward"][0]["output"]["rl.reward"] == i / 4


def test_eval_split_gets_its_own_key(otr_shutdown):
    project = "otr-test-trackio-eval"
    otr.configure(exporters=[TrackioExporter(project)], sampler=otr.TailSampler(5, "first"))
    with otr.episode(step=3, split="eval") as ep:
        ep.prompt("q")
        ep.reward(1)
    otr.flush()
    (row,) = trackio_rows(project)
    assert row["key"] == "eval/rollouts" and row["step"] == 3
    assert row["metadata"]["rl.split"] == "eval"
