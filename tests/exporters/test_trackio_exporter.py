"""Kept episodes land in Trackio's own SQLite storage as traces with messages, metadata, spans,
and a table per step; read back the way Trackio's dashboard reads them."""

from __future__ import annotations

import json
import os
import sqlite3
import uuid
from typing import Any

from otr_helpers import trackio_rows

import otel_rollouts as otr
from otel_rollouts import conventions as c
from otel_rollouts.exporters import TrackioExporter

# --- a step whose episodes' rl.status and span statuses disagree the way real ones do ---------
# (also recorded by test_trackio_browser.py, in a child process: keep it importable)
SYSTEM = "Use the calculator."
QUESTION = "How many seconds are in a week?"
BAD_EXPRESSION = "7x24x60x60"
TOOL_ERROR = f"malformed expression: '{BAD_EXPRESSION}'"
TOOL_RESULT = 604800.0  # a float: reads 604800.0 everywhere
FINAL_ANSWER = "The answer is 604800."
CRASH = "environment crashed"
DIVISION = "Split 144 marbles between 0 friends evenly."
SINGLE_QUESTION = "Say hi in French."
SINGLE_ANSWER = "Bonjour !"
MODEL = "pol"
TRACE_UI = "http://localhost:16686"


def _call(call_id: str, expression: str) -> list[dict[str, Any]]:
    return [{"id": call_id, "type": "function",
             "function": {"name": "calculator", "arguments": json.dumps({"expression": expression})}}]


def record_outcomes() -> dict[str, dict[str, Any]]:
    """Step 0: ``retried`` (ok: the calculator fails, the retry works, then the final answer),
    ``crashed`` (error: the environment raised), ``truncated`` (out of turns, every tool call
    failed), ``single`` (ok, one turn); step 1: ``next`` (ok). Each: trace id, step, reward,
    advantage, status, question, answer."""
    out: dict[str, dict[str, Any]] = {}

    def keep(name, ep, step, reward, advantage, status, question, answer):
        out[name] = {"trace_id": ep.trace_id, "step": step, "reward": reward, "advantage": advantage,
                     "status": status, "question": question, "answer": answer}

    with otr.episode(step=0, group_id="g0", sample_index=0) as ep:
        ep.prompt([{"role": "system", "content": SYSTEM}, {"role": "user", "content": QUESTION}])
        with ep.turn() as turn:
            turn.record_generation(f"I'll compute {BAD_EXPRESSION}.", model=MODEL, input_tokens=20,
                                   output_tokens=8, tool_calls=_call("c1", BAD_EXPRESSION))
            with turn.tool_call("calculator", arguments={"expression": BAD_EXPRESSION}, call_id="c1") as call:
                call.error(ValueError(TOOL_ERROR))
        with ep.turn() as turn:
            turn.record_generation("Retrying with 7*24*60*60.", model=MODEL, input_tokens=40,
                                   output_tokens=9, tool_calls=_call("c2", "7*24*60*60"))
            with turn.tool_call("calculator", arguments={"expression": "7*24*60*60"}, call_id="c2") as call:
                call.result(TOOL_RESULT)
        with ep.turn() as turn:
            turn.record_generation(FINAL_ANSWER, model=MODEL, input_tokens=60, output_tokens=6,
                                   finish_reason="stop")
        ep.reward(1.0, advantage=0.75)
        ep.finish(reason="stop", status="ok")
    keep("retried", ep, 0, 1.0, 0.75, "ok", QUESTION, FINAL_ANSWER)

    try:
        with otr.episode(step=0, group_id="g0", sample_index=1) as ep:
            ep.prompt([{"role": "system", "content": SYSTEM}, {"role": "user", "content": QUESTION}])
            with ep.turn() as turn:
                turn.record_generation("Let me think.", model=MODEL, input_tokens=20, output_tokens=4)
            ep.reward(0.0, advantage=-0.75)
            raise RuntimeError(CRASH)
    except RuntimeError:
        pass
    keep("crashed", ep, 0, 0.0, -0.75, "error", QUESTION, "Let me think.")

    with otr.episode(step=0, group_id="g1", sample_index=0) as ep:
        ep.prompt([{"role": "system", "content": SYSTEM}, {"role": "user", "content": DIVISION}])
        for i in range(2):
            with ep.turn() as turn:
                turn.record_generation("I'll compute 144/0.", model=MODEL, input_tokens=20 + 10 * i,
                                       output_tokens=5, tool_calls=_call(f"d{i}", "144/0"))
                with turn.tool_call("calculator", arguments={"expression": "144/0"}, call_id=f"d{i}") as call:
                    call.error(ZeroDivisionError("division by zero"))
        ep.reward(0.1, advantage=-0.25)
        ep.finish(reason="max_turns", status="truncated")
    keep("truncated", ep, 0, 0.1, -0.25, "truncated", DIVISION, "I'll compute 144/0.")

    for name, step, group, reward, advantage in (("single", 0, "g2", 0.5, 0.25), ("next", 1, "g3", 0.7, 0.0)):
        with otr.episode(step=step, group_id=group, sample_index=0) as ep:
            ep.prompt([{"role": "user", "content": SINGLE_QUESTION}])
            with ep.turn() as turn:
                turn.record_generation(SINGLE_ANSWER, model=MODEL, input_tokens=7, output_tokens=3)
            ep.reward(reward, advantage=advantage)
        keep(name, ep, step, reward, advantage, "ok", SINGLE_QUESTION, SINGLE_ANSWER)
        otr.end_step(step)
    return out


def trackio_list_status(trace: dict[str, Any]) -> str | None:
    """The STATUS Trackio 0.43's trace list shows (``traceSummary`` in its traceUtils.js): error
    when any span says error/failed or has an ``error``, else ``metadata.status``."""
    spans = trace["spans"]
    if any(str(s.get("status") or "").lower() in ("error", "failed") or s.get("error") for s in spans):
        return "error"
    status = trace["metadata"].get("status")
    if isinstance(status, str) and status:
        return status
    return "success" if spans and all(s.get("status") == "success" for s in spans) else None


def trackio_tables(project: str, key: str = "rollouts/table") -> list[tuple[int, list[dict[str, Any]]]]:
    """(step, rows) of every table logged under ``key``, in logging order."""
    db = sqlite3.connect(os.path.join(os.environ["TRACKIO_DIR"], f"{project}.db"))
    try:
        rows = db.execute("SELECT step, metrics FROM metrics ORDER BY id").fetchall()
    finally:
        db.close()
    out = []
    for step, metrics in rows:
        value = json.loads(metrics.decode() if isinstance(metrics, bytes) else metrics).get(key)
        if value is not None:
            assert value["_type"] == "trackio.table"
            out.append((step, value["_value"]))
    return out


def _configure(project: str, **kwargs) -> TrackioExporter:
    exporter = TrackioExporter(project, run="r", **kwargs)
    otr.configure(exporters=[exporter], sampler=otr.TailSampler(10, "first"))
    return exporter


# --- tests ---------------------------------------------------------------------------------------
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
        assert isinstance(md["rl.reward.score"], float) and md["rl.reward.score"] in (0.0, 1.0)
        assert isinstance(md["rl.step"], int) and md["rl.step"] == row["step"]
        assert md["rl.policy.version"] == row["step"] and md["rl.group.id"] == f"g{row['step']}"
        assert isinstance(md["rl.reward.component.math"], float) and isinstance(md["rl.advantage"], float)
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
        (tool,) = [s for s in spans if s["kind"] == "tool"]
        assert tool["input"] == {"i": i}
        if i == 0:  # a failed tool in an ok episode: on its span (a mark after its name, not
            # Trackio's red dot) and in the list's status, never the episode's failure
            assert tool["name"] == "execute_tool calc \u26a0"
            assert tool["status"] == "error (episode ok)" and "error" not in tool
            assert tool["output"] == "error: division by zero"
            assert md["span_errors"] == ["execute_tool calc: division by zero"]
            assert trackio_list_status(row) == md["status"] == "ok \u26a0 1 failed"
        else:  # the same text as the conversation's tool message
            assert tool["name"] == "execute_tool calc"
            assert tool["status"] == "success" and tool["output"] == str(i * 10)
            assert "span_errors" not in md
            assert trackio_list_status(row) == md["status"] == "ok"
        assert md["rl.status"] == "ok"
        assert by_name["reward"][0]["output"]["rl.reward.score"] == i / 4


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
    ((step, rows),) = trackio_tables(project, "eval/rollouts/table")
    assert step == 3 and [r["reward"] for r in rows] == [1.0]
    assert trackio_tables(project) == []  # no train table


def test_list_status_is_the_episodes_rl_status(otr_shutdown):
    """Trackio's list marks a trace "error" when any span errs: only an error episode may."""
    project = f"otr-test-status-{uuid.uuid4().hex[:6]}"
    _configure(project)
    recorded = record_outcomes()
    assert otr.flush()
    rows = {r["metadata"]["trace_id"]: r for r in trackio_rows(project)}
    assert set(rows) == {e["trace_id"] for e in recorded.values()}
    labels = {"retried": "ok \u26a0 1 failed", "crashed": "error", "truncated": "truncated \u2702 \u26a0 2 failed",
              "single": "ok", "next": "ok"}
    for name, episode in recorded.items():
        row = rows[episode["trace_id"]]
        assert row["metadata"]["rl.status"] == episode["status"], name
        # the list's status is rl.status, then the marks Trackio has no colour for
        assert trackio_list_status(row) == labels[name], name
        assert trackio_list_status(row).split()[0] == episode["status"], name

    def spans(name):
        return {(s["name"], i): s for i, s in enumerate(rows[recorded[name]["trace_id"]]["spans"])}

    failed = [s for s in spans("retried").values() if s["kind"] == "tool"]
    assert [s["status"] for s in failed] == ["error (episode ok)", "success"]
    assert [s["name"] for s in failed] == ["execute_tool calculator \u26a0", "execute_tool calculator"]
    assert failed[0]["output"] == f"error: ValueError: {TOOL_ERROR}" and "error" not in failed[0]
    assert failed[0]["metadata"][c.ERROR_TYPE] == "ValueError"
    truncated = [s for s in spans("truncated").values() if s["kind"] == "tool"]
    assert [s["status"] for s in truncated] == ["error (episode truncated)"] * 2
    # the episode span says what the list says, not "success"
    assert next(s for s in spans("truncated").values() if s["name"] == "episode")["status"] == labels["truncated"]
    assert next(s for s in spans("retried").values() if s["name"] == "episode")["status"] == labels["retried"]
    assert next(s for s in spans("single").values() if s["name"] == "episode")["status"] == "success"
    assert rows[recorded["truncated"]["trace_id"]]["metadata"]["span_errors"] == [
        "execute_tool calculator: ZeroDivisionError: division by zero"] * 2
    # the crashed episode's root carries the failure, the way Trackio shows a failed trace
    root = next(s for s in spans("crashed").values() if s["name"] == "episode")
    assert root["status"] == "error" and root["error"] == f"RuntimeError: {CRASH}"


def test_search_by_the_opentelemetry_trace_id_finds_the_episode(otr_shutdown):
    """Trackio's TRACE ID is its own random log id: the OpenTelemetry trace id (the metadata's
    ``trace_id``) is what its search finds an episode by, in storage and in the CLI, whose id
    then opens it with ``trackio get trace``."""
    import subprocess
    import sys

    from trackio.sqlite_storage import SQLiteStorage

    project = f"otr-test-ids-{uuid.uuid4().hex[:6]}"
    exporter = _configure(project)
    recorded = record_outcomes()
    assert otr.flush()
    ids = set()
    for name, episode in recorded.items():
        trace_id = episode["trace_id"]
        (found,) = SQLiteStorage.get_traces(project, run=exporter.run, search=trace_id)
        assert found["metadata"]["trace_id"] == trace_id, name
        _, log_id, key, index = found["id"].split(":")
        assert (key, len(log_id)) == ("rollouts", 32) and index.isdigit(), found["id"]
        ids.add(found["id"])
    assert len(ids) == len(recorded)

    def cli(*args: str) -> Any:
        out = subprocess.run([sys.executable, "-m", "trackio.cli", *args, "--project", project, "--json"],
                             check=True, capture_output=True, text=True, timeout=120).stdout
        return json.loads(out)

    trace_id = recorded["truncated"]["trace_id"]
    (listed,) = cli("list", "traces", "--search", trace_id)["traces"]
    assert listed["metadata"]["trace_id"] == trace_id
    shown = cli("get", "trace", "--trace-id", listed["id"])
    assert (shown["id"], shown["metadata"]["trace_id"]) == (listed["id"], trace_id)


def test_chat_input_and_tool_results_read_the_same_everywhere(otr_shutdown):
    project = f"otr-test-views-{uuid.uuid4().hex[:6]}"
    _configure(project)
    recorded = record_outcomes()
    assert otr.flush()
    (row,) = [r for r in trackio_rows(project) if r["metadata"]["trace_id"] == recorded["retried"]["trace_id"]]
    chats = [s for s in row["spans"] if s["kind"] == "generation"]
    assert len(chats) == 3 and all(s["input"] for s in chats)
    # each generation's input is the conversation up to it, as OpenAI-style messages
    assert chats[0]["input"] == [{"role": "system", "content": SYSTEM}, {"role": "user", "content": QUESTION}]
    last = chats[-1]["input"]
    assert last[:2] == chats[0]["input"] and last[2]["content"] == f"I'll compute {BAD_EXPRESSION}."
    assert last[-1] == {"role": "tool", "tool_call_id": "c2", "content": "604800.0", "name": "calculator"}
    assert chats[-1]["output"] == [{"role": "assistant", "content": FINAL_ANSWER}]
    # the tool's result: the same text on its span and in the conversation
    tool = [s for s in row["spans"] if s["kind"] == "tool"][1]
    message = [m for m in row["messages"] if m["role"] == "tool"][1]
    assert tool["output"] == message["content"] == "604800.0"
    # the episode span (selected when a row is expanded) holds the question and the final answer
    root = row["spans"][0]
    assert root["name"] == "episode" and (root["input"], root["output"]) == (QUESTION, FINAL_ANSWER)
    # what the list's REQUEST column takes: the first user message
    assert next(m for m in row["messages"] if m["role"] == "user")["content"] == QUESTION


def test_one_table_per_step_lists_its_kept_episodes_worst_first(otr_shutdown):
    project = f"otr-test-table-{uuid.uuid4().hex[:6]}"
    _configure(project, trace_ui_url=TRACE_UI)
    recorded = record_outcomes()
    # step 0's table is logged once step 1's episode arrives; step 1's at the flush
    assert otr.flush()
    tables = trackio_tables(project)
    assert [step for step, _ in tables] == [0, 1]
    for step, rows in tables:
        kept = sorted((e for e in recorded.values() if e["step"] == step), key=lambda e: e["reward"])
        assert [r["trace id"] for r in rows] == [e["trace_id"] for e in kept]
        assert [r["reward"] for r in rows] == [e["reward"] for e in kept]
        assert [r["advantage"] for r in rows] == [e["advantage"] for e in kept]
        assert [r["status"] for r in rows] == [e["status"] for e in kept]
        assert [r["link"] for r in rows] == [f"{TRACE_UI}/trace/{e['trace_id']}" for e in kept]
        assert list(rows[0]) == ["reward", "reward parts", "advantage", "status", "failed tools", "question",
                                 "answer", "turns", "input tokens", "output tokens", "kept because",
                                 "group health", "seconds", "most time in", "gen s", "tool s", "env s",
                                 "reward s", "wait s", "trace id", "group", "sample", "episode", "link"]
        assert [(r["question"], r["answer"]) for r in rows] == [(e["question"], e["answer"]) for e in kept]
    by_trace = {r["trace id"]: r for r in tables[0][1]}
    retried = by_trace[recorded["retried"]["trace_id"]]
    assert (retried["turns"], retried["input tokens"], retried["output tokens"]) == (3, 120, 23)
    assert retried["group"] == "g0" and retried["sample"] == 0 and retried["episode"]
    traces = {r["metadata"]["trace_id"]: r for r in trackio_rows(project)}
    assert retried["episode"] == traces[retried["trace id"]]["metadata"]["rl.episode.id"]


def test_no_table_when_turned_off(otr_shutdown):
    project = f"otr-test-notable-{uuid.uuid4().hex[:6]}"
    _configure(project, table=False)
    record_outcomes()
    assert otr.flush()
    assert len(trackio_rows(project)) == 5 and trackio_tables(project) == []


def test_a_tool_call_without_an_id_in_the_message_is_shown_once(configured):

    from otel_rollouts.exporters._trackio_rows import episode_messages

    memory = configured(10, "first", handle_signals=False)
    with otr.episode(step=0) as ep:
        ep.prompt("What is 17 * 23?")
        with ep.turn() as turn:
            call = {"type": "function", "function": {"name": "calc", "arguments": '{"e": "17 * 23"}'}}
            turn.record_generation({"role": "assistant", "content": "", "tool_calls": [call]})  # no id (TRL)
            with turn.tool_call("calc", arguments={"e": "17 * 23"}) as tool:
                tool.result("391")
        ep.reward(1.0)
    otr.flush()
    messages = episode_messages(memory.get_finished_spans())
    (assistant,) = [m for m in messages if m["role"] == "assistant"]
    (tool_message,) = [m for m in messages if m["role"] == "tool"]
    assert [tc["function"]["name"] for tc in assistant["tool_calls"]] == ["calc"]  # was shown twice
    assert assistant["tool_calls"][0]["id"] == tool_message["tool_call_id"] and tool_message["content"] == "391"


# --- what the user study asked of the Trackio view (storage level; the browser checks are in
# test_trackio_view_study.py) --------------------------------------------------------------------
def _stored_timestamps(project: str) -> dict[str, str]:
    """OpenTelemetry trace id -> the row's ``timestamp`` (the Traces list's request time)."""
    db = sqlite3.connect(os.path.join(os.environ["TRACKIO_DIR"], f"{project}.db"))
    try:
        rows = db.execute("SELECT metadata, timestamp FROM traces").fetchall()
    finally:
        db.close()
    return {json.loads(m.decode() if isinstance(m, bytes) else m)["trace_id"]: t for m, t in rows}


def test_each_trace_is_stamped_with_its_episodes_start(otr_shutdown):
    """Trackio stamps every row of a write with one time: the rows get their episode's start, in
    Trackio's own format (ISO 8601, UTC, microseconds), so the list orders a step as it ran."""
    import re

    project = f"otr-test-times-{uuid.uuid4().hex[:6]}"
    _configure(project)
    recorded = record_outcomes()
    assert otr.flush()
    stamped = _stored_timestamps(project)
    rows = {r["metadata"]["trace_id"]: r for r in trackio_rows(project)}
    for name, episode in recorded.items():
        root = rows[episode["trace_id"]]["spans"][0]
        assert root["name"] == "episode", name
        assert stamped[episode["trace_id"]] == root["start_time"], name
        assert re.fullmatch(r"\d{4}-\d\d-\d\dT\d\d:\d\d:\d\d\.\d{6}\+00:00", root["start_time"]), name
    step0 = [stamped[e["trace_id"]] for e in recorded.values() if e["step"] == 0]
    assert len(set(step0)) == len(step0) == 4
    # recorded one after the other: started in that order
    assert [stamped[e["trace_id"]] for e in recorded.values()] == sorted(stamped.values())


def test_span_metadata_shows_each_value_once_without_the_views(otr_shutdown):
    project = f"otr-test-meta-{uuid.uuid4().hex[:6]}"
    _configure(project)
    recorded = record_outcomes()
    assert otr.flush()
    (row,) = [r for r in trackio_rows(project) if r["metadata"]["trace_id"] == recorded["retried"]["trace_id"]]
    views = (c.OPENINFERENCE_PREFIX, "llm.", c.INPUT_MIME_TYPE, c.OUTPUT_MIME_TYPE, c.OI_SESSION_ID,
             c.OI_METADATA, c.OI_TAG_TAGS, c.OI_TOOL_NAME, c.GEN_AI_CONVERSATION_ID, c.GEN_AI_OPERATION_NAME)
    for span in row["spans"]:
        metadata = span.get("metadata", {})
        assert not [k for k in metadata if k.startswith(views)], (span["name"], metadata)
        # what the panel shows already is not repeated in the Metadata box
        assert c.GEN_AI_REQUEST_MODEL not in metadata and c.GEN_AI_USAGE_INPUT_TOKENS not in metadata
        assert not (isinstance(span.get("output"), dict) and set(span["output"]) & set(metadata)), span
    root = row["spans"][0]["metadata"]
    assert root[c.RL_EPISODE_ID] == row["metadata"][c.RL_EPISODE_ID] and root[c.RL_GROUP_ID] == "g0"
    texts = [json.dumps(v) for v in root.values() if isinstance(v, str)]
    assert len(texts) == len(set(texts)), root  # no value twice
    chat = next(s for s in row["spans"] if s["kind"] == "generation")
    assert chat["model"] == MODEL and chat["usage"] == {"input_tokens": 20, "output_tokens": 8}
    assert c.RL_SPAN_KIND not in chat.get("metadata", {})  # the panel's kind says "generation"
    tool = next(s for s in row["spans"] if s["kind"] == "tool")
    assert tool["metadata"] == {c.GEN_AI_TOOL_NAME: "calculator", c.GEN_AI_TOOL_CALL_ID: "c1",
                                c.ERROR_TYPE: "ValueError"}


def test_token_counts_nobody_recorded_read_absent_and_partial_ones_sum(otr_shutdown):
    """``—`` when no generation recorded usage (never 0), the sum of those that did otherwise;
    the step's token scalars are left out when none was recorded (no point on the plot)."""
    from otel_rollouts.exporters._trackio_rows import TABLE_ABSENT

    project = f"otr-test-tokens-{uuid.uuid4().hex[:6]}"
    _configure(project)
    ids = {}
    for name, usages in (("none", [{}, {}]), ("partial", [{"input_tokens": 11}, {"output_tokens": 4}, {}])):
        with otr.episode(step=0, sample_index=len(ids)) as ep:
            ep.prompt(QUESTION)
            for usage in usages:
                with ep.turn() as turn:
                    turn.record_generation("…", model=MODEL, **usage)
            ep.reward(0.5)
        ids[name] = ep.trace_id
    otr.end_step(0)
    with otr.episode(step=1) as ep:
        ep.prompt(QUESTION)
        with ep.turn() as turn:
            turn.record_generation("…", model=MODEL, input_tokens=3, output_tokens=0)
        ep.reward(0.5)
    ids["counted"] = ep.trace_id
    otr.end_step(1)
    assert otr.flush()
    rows = {r["trace id"]: r for _, table in trackio_tables(project) for r in table}
    shown = {name: (rows[t]["input tokens"], rows[t]["output tokens"]) for name, t in ids.items()}
    assert shown == {"none": (TABLE_ABSENT, TABLE_ABSENT), "partial": (11, 4), "counted": (3, 0)}

    db = sqlite3.connect(os.path.join(os.environ["TRACKIO_DIR"], f"{project}.db"))
    try:
        scalars = [(s, json.loads(m)) for s, m in db.execute("SELECT step, metrics FROM metrics ORDER BY id")]
    finally:
        db.close()
    by_step: dict[int, dict[str, Any]] = {}
    for step, values in scalars:
        by_step.setdefault(step, {}).update(values)
    assert (by_step[0]["rollouts/tokens_input"], by_step[0]["rollouts/tokens_output"]) == (11, 4)
    assert (by_step[1]["rollouts/tokens_input"], by_step[1]["rollouts/tokens_output"]) == (3, 0)


def test_log_metrics_leaves_out_values_nobody_recorded(monkeypatch):
    """A None or NaN handed to ``log_metrics`` is no point on its plot, never a 0."""
    exporter = TrackioExporter(f"otr-test-scalars-{uuid.uuid4().hex[:6]}", run="r")
    logged = []

    class _Run:
        def log(self, values, step):
            logged.append((step, values))

    monkeypatch.setattr(exporter, "_trackio_run", lambda: _Run())
    monkeypatch.setattr(exporter, "_cannot_write", lambda: None)
    exporter.log_metrics(3, {"rollouts/tokens_input": None, "rollouts/reward_mean": float("nan"),
                             "rollouts/episodes_seen": 2, "rollouts/flag": True})
    exporter.log_metrics(4, {"rollouts/tokens_input": None})
    scalars = [(step, values) for step, values in logged if "rollouts/summary" not in values]
    # (with the episodes hung now, 0: a closed step's point on the running_now line)
    assert scalars == [(3, {"rollouts/episodes_seen": 2, "running_now": 0})]


def test_table_previews_are_one_short_line():
    from otel_rollouts.exporters._trackio_rows import PREVIEW_CHARS, TABLE_ABSENT, preview

    assert preview("  What is\n 6*7? ") == "What is 6*7?"
    long = "word " * 40
    cut = preview(long)
    assert len(cut) <= PREVIEW_CHARS and cut.endswith("\u2026") and long.startswith(cut[:-1])
    assert preview(None) == preview("") == preview(" \n") == TABLE_ABSENT
    assert len(preview("x" * 10_000)) == PREVIEW_CHARS
