"""What the user study of a multi-turn tool-using GRPO run asked of the Trackio view, checked in
Chromium on Trackio 0.43's own dashboard over its real storage, the way a researcher hunting
step 40's worst episode reads it:

1. a tool call that failed inside an episode that ended ``ok`` shows in the trace list (a ``⚠``
   mark after the status, which still starts with ``rl.status`` and stays green) and in the
   execution tree (``⚠`` after the span's name), never as the episode's failure;
2. ``ok`` and ``truncated`` rows are told apart in the list (``✂`` on a truncated one);
3. each trace's request time is its episode's start, so the list orders a step's episodes as
   they ran (one write used to stamp them all with one time);
4. the episode span's *Metadata* holds each value once, without the OpenInference views;
5. the step table has a short ``question`` and ``answer`` per episode (Trackio prints cells as
   plain text: the ``link`` column cannot be clickable);
6. a token count no generation recorded is ``—`` in the table and no point in the plots; when
   some recorded one, the sum of those.

The step is recorded in a child process (``TRACKIO_DIR`` is read when Trackio is imported):
``record_study`` below, shared with ``test_trackio_exporter`` for the storage-level checks.
"""

from __future__ import annotations

import json
import os
import sqlite3
import threading
from pathlib import Path
from typing import Any

import pytest
from browser_support import media_tables, save_screenshot
from otr_scenario import run_python, trackio_traces
from test_trackio_browser import _expand, _expect, _io, _select_span, _wait

PROJECT = "study"
STEP = 40
MODEL = "grpo-policy"
LONG_QUESTION = ("A train leaves Lyon at 09:12 and travels 427 km at an average of 183 km/h; a second train "
                 "leaves Paris at 09:40. When does the first one arrive, in local time?")
SHORT_QUESTION = "What is 17 * 23?"
FINAL = "The answer is 391."
FAILED = "\u26a0"  # the exporter's marks (MARK_FAILED, MARK_TRUNCATED), spelled as a person sees them
CUT = "\u2702"
GREEN_PILL = "rgba(220, 252, 231, 1)"  # Trackio 0.43's .status-pill background (#dcfce7)
RED_PILL = "rgba(254, 226, 226, 1)"  # .status-pill.status-error (#fee2e2)


def _call(call_id: str, expression: str) -> list[dict[str, Any]]:
    return [{"id": call_id, "type": "function",
             "function": {"name": "calculator", "arguments": json.dumps({"expression": expression})}}]


def record_study() -> dict[str, dict[str, Any]]:
    """Step 39: ``warmup`` (ok, no usage anywhere). Step 40, started in this order:

    * ``recovered`` (ok, reward 0.6): the calculator fails, the retry works, the final answer;
      only the first generation recorded its usage;
    * ``clean`` (ok, 0.9, one turn, usage recorded); started while ``recovered`` runs, and ends
      first;
    * ``cut`` (truncated, 0.0: the worst): out of turns, every call failed, no usage recorded;
    * ``crashed`` (error, 0.1): the environment raised.

    Returns each: trace id, step, reward, status, question, answer, input/output tokens (None:
    none recorded)."""
    import otel_rollouts as otr

    out: dict[str, dict[str, Any]] = {}

    def keep(name, ep, step, reward, status, question, answer, tokens):
        out[name] = {"trace_id": ep.trace_id, "step": step, "reward": reward, "status": status,
                     "question": question, "answer": answer, "input_tokens": tokens[0],
                     "output_tokens": tokens[1]}

    with otr.episode(step=STEP - 1, group_id="g39", sample_index=0) as ep:
        ep.prompt([{"role": "user", "content": SHORT_QUESTION}])
        with ep.turn() as turn:
            turn.record_generation(FINAL, model=MODEL)
        ep.reward(1.0, advantage=0.0)
    keep("warmup", ep, STEP - 1, 1.0, "ok", SHORT_QUESTION, FINAL, (None, None))
    otr.end_step(STEP - 1)

    started, clean_done = threading.Event(), threading.Event()

    def recovered() -> None:
        with otr.episode(step=STEP, group_id="g40", sample_index=0) as ep:
            started.set()
            ep.prompt([{"role": "system", "content": "Use the calculator."},
                       {"role": "user", "content": LONG_QUESTION}])
            assert clean_done.wait(60)  # "clean" starts after this one and ends before it
            with ep.turn() as turn:
                turn.record_generation("I'll compute 427/183.", model=MODEL, input_tokens=50, output_tokens=9,
                                       tool_calls=_call("c1", "427:183"))
                with turn.tool_call("calculator", arguments={"expression": "427:183"}, call_id="c1") as call:
                    call.error(ValueError("malformed expression: '427:183'"))
            with ep.turn() as turn:
                turn.record_generation("Retrying with 427/183.", model=MODEL, tool_calls=_call("c2", "427/183"))
                with turn.tool_call("calculator", arguments={"expression": "427/183"}, call_id="c2") as call:
                    call.result(2.3333)
            with ep.turn() as turn:
                turn.record_generation("It arrives at 11:32.", model=MODEL, finish_reason="stop")
            ep.reward(0.6, advantage=0.35)
            ep.finish(reason="stop", status="ok")
        keep("recovered", ep, STEP, 0.6, "ok", LONG_QUESTION, "It arrives at 11:32.", (50, 9))

    thread = threading.Thread(target=recovered)
    thread.start()
    assert started.wait(60)
    with otr.episode(step=STEP, group_id="g40", sample_index=1) as ep:
        ep.prompt([{"role": "user", "content": SHORT_QUESTION}])
        with ep.turn() as turn:
            turn.record_generation(FINAL, model=MODEL, input_tokens=12, output_tokens=6)
        ep.reward(0.9, advantage=0.65)
    keep("clean", ep, STEP, 0.9, "ok", SHORT_QUESTION, FINAL, (12, 6))
    clean_done.set()
    thread.join(60)

    with otr.episode(step=STEP, group_id="g40", sample_index=2) as ep:
        ep.prompt([{"role": "user", "content": "Split 144 marbles between 0 friends evenly."}])
        for i in range(2):
            with ep.turn() as turn:
                turn.record_generation("I'll compute 144/0.", model=MODEL, tool_calls=_call(f"d{i}", "144/0"))
                with turn.tool_call("calculator", arguments={"expression": "144/0"}, call_id=f"d{i}") as call:
                    call.error(ZeroDivisionError("division by zero"))
        ep.reward(0.0, advantage=-0.6)
        ep.finish(reason="max_turns", status="truncated")
    keep("cut", ep, STEP, 0.0, "truncated", "Split 144 marbles between 0 friends evenly.",
         "I'll compute 144/0.", (None, None))

    try:
        with otr.episode(step=STEP, group_id="g40", sample_index=3) as ep:
            ep.prompt([{"role": "user", "content": SHORT_QUESTION}])
            with ep.turn() as turn:
                turn.record_generation("Let me think.", model=MODEL, input_tokens=12, output_tokens=4)
            ep.reward(0.1, advantage=-0.4)
            raise RuntimeError("environment crashed")
    except RuntimeError:
        pass
    keep("crashed", ep, STEP, 0.1, "error", SHORT_QUESTION, "Let me think.", (12, 4))
    otr.end_step(STEP)
    return out


_FILL = """
import json
import otel_rollouts as otr
from otel_rollouts.exporters import TrackioExporter
from test_trackio_view_study import record_study
otr.configure(exporters=[TrackioExporter({project!r}, run="grpo", trace_ui_url="http://localhost:16686")],
              sampler=otr.TailSampler(10, "first"))
recorded = record_study()
assert otr.shutdown(60)
print(json.dumps(recorded))
"""


@pytest.fixture(scope="module")
def study(trackio_dashboard) -> tuple[str, dict[str, dict], Path]:
    """The session's dashboard over ``record_study()``'s project, filled in the session's
    TRACKIO_DIR: (base URL, the recorded episodes, each with ``trackio_id`` (``<log id>:<index>``,
    what the TRACE ID chip's title holds) and ``stored`` (its row, read back from Trackio's
    SQLite file), the TRACKIO_DIR)."""
    trackio_dir = Path(os.environ["TRACKIO_DIR"])
    out = run_python(_FILL.format(project=PROJECT), trackio_dir)
    recorded = json.loads(out.strip().splitlines()[-1])
    stored = {t["metadata"]["trace_id"]: t for t in trackio_traces(trackio_dir, PROJECT)}
    for episode in recorded.values():
        row = stored[episode["trace_id"]]
        _, log_id, *_, index = row["id"].split(":")
        episode["trackio_id"] = f"{log_id}:{index}"
        episode["stored"] = row
    return trackio_dashboard(trackio_dir), recorded, trackio_dir


# --- reading the Traces page -------------------------------------------------------------------
def _step_rows(driver, base: str, step: int, count: int, sort: str | None = None):
    """The Traces page narrowed to ``step`` with the Step select (and sorted by ``sort``), once
    it lists ``count`` rows of that step."""
    from selenium.webdriver.common.by import By
    from selenium.webdriver.support.ui import Select

    driver.get(f"{base}/traces?project={PROJECT}")
    _wait(driver, lambda d: d.find_elements(By.CSS_SELECTOR, "tr.trace-row"), "the trace list")
    selects = driver.find_elements(By.CSS_SELECTOR, ".filter-wrap select")
    Select(selects[0]).select_by_value(str(step))
    if sort is not None:
        Select(selects[1]).select_by_value(sort)

    def listed(d):
        rows = d.find_elements(By.CSS_SELECTOR, "tr.trace-row")
        cells = [r.find_elements(By.CSS_SELECTOR, "td") for r in rows]
        return len(rows) == count and all(c[3].text.strip() == str(step) for c in cells) and rows

    return _wait(driver, listed, f"{count} rows of step {step}")


def _by_episode(rows, recorded: dict[str, dict]) -> dict[str, Any]:
    """Each listed row by the episode name it is (the TRACE ID chip's title is Trackio's id)."""
    from selenium.webdriver.common.by import By

    names = {e["trackio_id"]: name for name, e in recorded.items()}
    return {names[r.find_element(By.CSS_SELECTOR, ".trace-id-chip").get_attribute("title")]: r for r in rows}


def _pill(row):
    from selenium.webdriver.common.by import By

    return row.find_elements(By.CSS_SELECTOR, "td")[4].find_element(By.CSS_SELECTOR, ".status-pill")


def _tree(expanded) -> list[tuple[str, bool]]:
    """(name, has Trackio's red dot) of each span row of an expanded trace's Execution tree."""
    from selenium.webdriver.common.by import By

    return [(r.find_element(By.CSS_SELECTOR, ".span-name").text,
             bool(r.find_elements(By.CSS_SELECTOR, ".span-error-dot")))
            for r in expanded.find_elements(By.CSS_SELECTOR, ".execution-tree .span-row")]


# --- 1 and 2: the list and the tree -----------------------------------------------------------
def test_a_recovered_tool_failure_shows_in_the_list_and_the_tree_without_failing_the_episode(
        browser, study, tmp_path: Path) -> None:
    base, recorded, _ = study
    rows = _by_episode(_step_rows(browser, base, STEP, 4), recorded)

    # the list: STATUS starts with rl.status, stays green, and carries the failure
    pill = _pill(rows["recovered"])
    label = pill.text.lower()
    _expect(browser, label.split()[0] == "ok", f"the recovered episode's STATUS reads {label!r}, not its rl.status ok")
    _expect(browser, f"{FAILED} 1 failed" in label, f"no failure mark in its STATUS {label!r}")
    colour = pill.value_of_css_property("background-color")
    _expect(browser, colour == GREEN_PILL, f"an ok episode's pill is {colour}, not green")
    clean = _pill(rows["clean"]).text.lower()
    _expect(browser, clean == "ok", f"the clean episode's STATUS reads {clean!r}")
    crashed = _pill(rows["crashed"])
    _expect(browser, crashed.text.lower() == "error" and crashed.value_of_css_property("background-color")
            == RED_PILL, f"the crashed episode reads {crashed.text!r}")

    # the tree: the failed call is marked after its name; no red dot in an episode that did not fail
    expanded = _expand(browser, rows["recovered"])
    spans = len(recorded["recovered"]["stored"]["spans"])
    _wait(browser, lambda d: len(_tree(expanded)) == spans, "the recovered episode's tree")
    tree = _tree(expanded)
    marked = [name for name, _ in tree if name.endswith(f" {FAILED}")]
    _expect(browser, marked == [f"execute_tool calculator {FAILED}"], f"marked spans {marked} in {tree}")
    _expect(browser, not any(dot for _, dot in tree), f"a red dot in an ok episode: {tree}")
    summary = expanded.find_element("css selector", ".trace-summary .status-pill").text.lower()
    _expect(browser, summary.split()[0] == "ok", f"the expanded summary says {summary!r}")
    save_screenshot(browser, tmp_path / "trackio-study-recovered.png")

    # the failed span's panel: its status names the episode's, its output the error
    panel = _select_span(browser, expanded, f"execute_tool calculator {FAILED}")
    badges = panel.find_element("css selector", ".operation-badges").text.lower()
    _expect(browser, "error (episode ok)" in badges, f"badges {badges!r}")
    output = _io(panel)["output"]
    _expect(browser, output == "error: ValueError: malformed expression: '427:183'", f"output {output!r}")

    # the error episode: Trackio's own red dot, on the span that failed
    expanded = _expand(browser, _by_episode(_step_rows(browser, base, STEP, 4), recorded)["crashed"])
    _wait(browser, lambda d: _tree(expanded), "the crashed episode's tree")
    dotted = [name for name, dot in _tree(expanded) if dot]
    _expect(browser, dotted == ["episode"], f"red dots in the error episode: {dotted}")


def test_ok_and_truncated_episodes_are_told_apart_in_the_list(browser, study, tmp_path: Path) -> None:
    base, recorded, _ = study
    rows = _by_episode(_step_rows(browser, base, STEP, 4), recorded)
    shown = {name: _pill(row).text.lower() for name, row in rows.items()}
    # Trackio 0.43 colours only "error": the words and the marks tell ok from truncated
    _expect(browser, shown["cut"].split()[0] == "truncated" and CUT in shown["cut"],
            f"the truncated episode reads {shown['cut']!r}")
    _expect(browser, f"{FAILED} 2 failed" in shown["cut"], f"its two failed calls: {shown['cut']!r}")
    _expect(browser, CUT not in shown["clean"] + shown["recovered"], f"ok episodes read {shown}")
    _expect(browser, len(set(shown.values())) == 4, f"two episodes look alike: {shown}")
    save_screenshot(browser, tmp_path / "trackio-study-step40.png")


# --- 3: request time ----------------------------------------------------------------------------
def test_request_time_is_each_episodes_start(browser, study) -> None:
    from selenium.webdriver.common.by import By

    base, recorded, _ = study
    step = {n: e for n, e in recorded.items() if e["step"] == STEP}
    started = {n: e["stored"]["spans"][0]["start_time"] for n, e in step.items()}
    assert all(e["stored"]["spans"][0]["name"] == "episode" for e in step.values())
    latest_first = sorted(step, key=lambda n: started[n], reverse=True)
    # "clean" started after "recovered" and ended before it: start order is not end order
    assert latest_first.index("clean") < latest_first.index("recovered")

    names = {e["trackio_id"]: n for n, e in step.items()}

    def order(d) -> list[str]:
        return [names.get(r.find_element(By.CSS_SELECTOR, ".trace-id-chip").get_attribute("title"), "?")
                for r in d.find_elements(By.CSS_SELECTOR, "tr.trace-row")]

    for sort, expected in (("request_time_desc", latest_first), ("request_time_asc", latest_first[::-1])):
        _step_rows(browser, base, STEP, 4, sort)
        # the list reloads after a select changes: polled until it shows the expected order
        _wait(browser, lambda d, expected=expected: order(d) == expected,
              f"step {STEP} sorted by {sort} as the episodes started: {expected} (started {started})")

    # the trace's own timestamp, as the expanded row shows it, is the episode's start
    rows = _by_episode(_step_rows(browser, base, STEP, 4), recorded)
    for name in ("clean", "recovered"):
        meta = _expand(browser, rows[name]).find_element(By.CSS_SELECTOR, ".detail-meta").text
        _expect(browser, f"Timestamp: {started[name]}" in meta, f"{name}: {meta!r}, started {started[name]}")


# --- 4: the episode span's metadata -------------------------------------------------------------
def test_the_episode_spans_metadata_shows_each_value_once(browser, study, tmp_path: Path) -> None:
    from selenium.webdriver.common.by import By

    base, recorded, _ = study
    episode = recorded["recovered"]
    expanded = _expand(browser, _by_episode(_step_rows(browser, base, STEP, 4), recorded)["recovered"])
    panel = _wait(browser, lambda d: [p for p in expanded.find_elements(By.CSS_SELECTOR, ".operation-panel")
                                      if p.find_element(By.CSS_SELECTOR, "h3").text == "episode"],
                  "the episode span, selected when the row opens")[0]
    details = panel.find_element(By.CSS_SELECTOR, ".span-metadata")
    details.find_element(By.CSS_SELECTOR, "summary").click()
    text = _wait(browser, lambda d: details.find_element(By.CSS_SELECTOR, "pre").text, "the Metadata box")
    shown = json.loads(text)
    save_screenshot(browser, tmp_path / "trackio-study-episode-metadata.png")

    episode_id = episode["stored"]["metadata"]["rl.episode.id"]
    _expect(browser, text.count(episode_id) == 1, f"the episode id {text.count(episode_id)} times:\n{text}")
    _expect(browser, text.count('"g40"') == 1, f"the group {text.count(chr(34) + 'g40' + chr(34))} times:\n{text}")
    views = [k for k in shown if k.startswith(("openinference.", "llm.")) or k.endswith("mime_type")
             or k in ("session.id", "metadata", "tag.tags", "gen_ai.conversation.id", "gen_ai.operation.name")]
    _expect(browser, not views, f"OpenInference/view keys in the episode's metadata: {views}")
    for key in ("rl.step", "rl.reward.score", "rl.advantage", "rl.status", "rl.group.id", "rl.episode.id"):
        _expect(browser, key in shown, f"{key} missing from the episode's metadata {sorted(shown)}")
    repeated = [value for value in shown.values()
                if not isinstance(value, (bool, int, float)) and list(shown.values()).count(value) > 1]
    _expect(browser, not repeated, f"values shown twice: {repeated}")


# --- 5 and 6: the step table, and the token plots ----------------------------------------------
def _tables(driver, base: str) -> dict[int, list[dict[str, str]]]:
    """Media & Tables: step -> the rows of its ``rollouts/table`` as shown (column -> text)."""
    return dict(media_tables(driver, f"{base}/media?project={PROJECT}", "rollouts/table", count=2))


def test_step_table_previews_the_question_and_the_answer(browser, study, tmp_path: Path) -> None:
    from selenium.webdriver.common.by import By

    base, recorded, _ = study
    rows = _tables(browser, base)[STEP]
    worst_first = sorted((e for e in recorded.values() if e["step"] == STEP), key=lambda e: e["reward"])
    _expect(browser, [r["trace id"] for r in rows] == [e["trace_id"] for e in worst_first], f"rows {rows}")
    columns = list(rows[0])
    _expect(browser, columns[:7] == ["reward", "reward parts", "advantage", "status", "failed tools", "question",
                                     "answer"], f"columns {columns}")
    for row, episode in zip(rows, worst_first, strict=True):
        for column in ("question", "answer"):
            full, shown = episode[column], row[column]
            if len(full) <= 80:
                _expect(browser, shown == full, f"{column} {shown!r}, recorded {full!r}")
            else:  # cut on a word's end, with an ellipsis, ~80 characters
                _expect(browser, len(shown) <= 80 and shown.endswith("\u2026") and full.startswith(shown[:-1]),
                        f"{column} preview {shown!r} of {full!r}")
    _expect(browser, any(r["question"].endswith("\u2026") for r in rows), "no long question was cut")
    # Trackio 0.43 prints a cell as text (Media.svelte): the link is there, not clickable
    links = browser.find_elements(By.CSS_SELECTOR, ".table-section td a")
    _expect(browser, not links and all(r["link"].endswith(r["trace id"]) for r in rows), f"links {links}")
    save_screenshot(browser, tmp_path / "trackio-study-table.png")


def test_tokens_nobody_recorded_are_absent_not_zero(browser, study) -> None:
    base, recorded, trackio_dir = study
    tables = _tables(browser, base)
    for step, rows in tables.items():
        by_trace = {r["trace id"]: r for r in rows}
        for name, episode in recorded.items():
            if episode["step"] != step:
                continue
            row = by_trace[episode["trace_id"]]
            for column, key in (("input tokens", "input_tokens"), ("output tokens", "output_tokens")):
                expected = "\u2014" if episode[key] is None else str(episode[key])
                _expect(browser, row[column] == expected,
                        f"{name}: {column} shows {row[column]!r}, recorded {episode[key]!r}")
    # the plots: the step's scalars Trackio stores (and plots) have no token point where no
    # generation recorded usage, and the sum of the recorded ones where some did
    scalars = _scalars(trackio_dir)
    assert "rollouts/tokens_input" not in scalars[STEP - 1], scalars[STEP - 1]
    assert "rollouts/tokens_output" not in scalars[STEP - 1], scalars[STEP - 1]
    kept = [e for e in recorded.values() if e["step"] == STEP]
    assert scalars[STEP]["rollouts/tokens_input"] == sum(e["input_tokens"] or 0 for e in kept)
    assert scalars[STEP]["rollouts/tokens_output"] == sum(e["output_tokens"] or 0 for e in kept)


def _scalars(trackio_dir: Path) -> dict[int, dict[str, Any]]:
    """step -> the scalar metrics logged at it (what Trackio's Metrics page plots)."""
    with sqlite3.connect(trackio_dir / f"{PROJECT}.db") as db:
        rows = db.execute("SELECT step, metrics FROM metrics ORDER BY id").fetchall()
    out: dict[int, dict[str, Any]] = {}
    for step, metrics in rows:
        values = json.loads(metrics.decode() if isinstance(metrics, bytes) else metrics)
        out.setdefault(step, {}).update({k: v for k, v in values.items() if isinstance(v, (int, float))})
    return out
