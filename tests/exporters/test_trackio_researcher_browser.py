"""The seven questions a researcher asks of a GRPO run, each read off one Trackio page in headless
Chromium, on a six-step run with every case planted (``researcher_run``: a failed tool in the
worst episode, a tool straggler and an engine-queue straggler, a crash, a truncated member,
drift in one token, all-equal and lost groups, a watched prompt, a hang):

* Q1 the worst episode of the step: what it said, which tool failed, its reward and why;
* Q2 why the step was slow: which episode, which stage and span, the engine's timings;
* Q3 which groups of the step were degenerate, and how;
* Q4 where the rollout policy drifts from the trained one: which step, which token;
* Q5 how a watched prompt's answer and reward evolved;
* Q6 whether a rollout is hung right now (read while it hangs);
* Q7 why each episode was kept, and how many were dropped, by status.

A child process records the run (``TRACKIO_DIR`` is read when Trackio is imported); its last
step hangs until the test has looked at it, then it ends and flushes.
"""

from __future__ import annotations

import json
import os
import sqlite3
import subprocess
import sys
from collections.abc import Iterator
from pathlib import Path

import pytest
import researcher_run as run
from browser_support import media_tables, save_screenshot, scroll_to_table, wait_for
from otr_helpers import running_rows, wait_ready
from otr_helpers import wait_for as wait_until
from suite_paths import TEST_PATHS

PROJECT = "otr-researcher"
RED_PILL = "rgba(254, 226, 226, 1)"  # Trackio 0.43's .status-pill.status-error (#fee2e2)


def _tables(browser, base: str, tmp: Path, key: str, count: int | None = None) -> dict[int, list[dict[str, str]]]:
    """The tables logged under ``key`` as the Media & Tables page shows them, by step."""
    return dict(media_tables(browser, f"{base}/media?project={PROJECT}", key,
                             tmp / f"failure-{key.replace('/', '-')}.png", count))


@pytest.fixture(scope="module")
def looked(tmp_path_factory, trackio_dashboard, chromium_session) -> Iterator[dict]:
    """The run recorded (its project in the session's TRACKIO_DIR, served by the session's
    dashboard), and what the browser saw while its last step hung."""
    from browser_support import reset_browser

    tmp = tmp_path_factory.mktemp("researcher")
    trackio_dir = Path(os.environ["TRACKIO_DIR"])
    db = trackio_dir / f"{PROJECT}.db"
    env = {k: v for k, v in os.environ.items() if not k.startswith(("OTEL_", "TRACKIO_"))}
    env.update(TRACKIO_DIR=str(trackio_dir), PYTHONPATH=TEST_PATHS)
    base = trackio_dashboard(trackio_dir)
    reset_browser(chromium_session)
    child = subprocess.Popen([sys.executable, run.__file__, PROJECT], env=env, stdin=subprocess.PIPE,
                             stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True)
    try:
        wait_ready(child.stdout, "HANGING")
        wait_until(lambda: running_rows(db), 120, "the hung episode stored while it hangs")
        seen = _look_while_hung(chromium_session, base, tmp)
        assert child.poll() is None, "the hang ended before the page was read"
        child.stdin.write("go\n")
        child.stdin.flush()
        wait_ready(child.stdout, "DONE")
        assert child.wait(timeout=120) == 0
        yield {"base": base, "tmp": tmp, "hung": seen, "db": db}
    finally:
        if child.poll() is None:
            child.kill()
            child.wait(timeout=30)


def _look_while_hung(browser, base: str, tmp: Path) -> dict:
    """Q6 while it hangs: the metrics page's ``running_now`` (in its first section, above the
    rollouts' plots), the running table, the trace list."""
    from selenium.webdriver.common.by import By

    browser.get(f"{base}/?project={PROJECT}")
    wait_for(browser, lambda d: "running_now" in d.find_element(By.TAG_NAME, "body").text.split("rollouts (")[0],
             "the running_now plot on the metrics page", tmp / "failure-metrics.png")
    save_screenshot(browser, tmp / "q6-metrics.png")
    running = media_tables(browser, f"{base}/media?project={PROJECT}", "rollouts/running/table",
                           tmp / "failure-running-table.png")
    scroll_to_table(browser, "rollouts/running/table")
    save_screenshot(browser, tmp / "q6-running-table.png")
    def one_running_row(d):
        # a snapshot refreshed (every HANG_AFTER_S) is written, then its older one deleted: a list
        # loaded between the two shows both until reloaded, as a person would reload it
        d.get(f"{base}/traces?project={PROJECT}")
        wait_for(d, lambda d: d.find_elements(By.CSS_SELECTOR, ".search-wrap input"), "the trace list")
        d.find_element(By.CSS_SELECTOR, ".search-wrap input").send_keys("rollouts/running")
        rows = wait_for(d, lambda d: d.find_elements(By.CSS_SELECTOR, "tr.trace-row"), "running rows")
        return len(rows) == 1 and rows

    (row,) = wait_for(browser, one_running_row, "the hung episode in the trace list, once",
                      tmp / "failure-running-row.png")
    pill = row.find_element(By.CSS_SELECTOR, ".status-pill")
    cells = [td.text for td in row.find_elements(By.CSS_SELECTOR, "td")]
    row.click()
    tree = wait_for(browser, lambda d: [s.text for s in d.find_elements(By.CSS_SELECTOR, ".span-row")],
                    "the hung episode's tree", tmp / "failure-running-tree.png")
    save_screenshot(browser, tmp / "q6-trace-list.png")
    return {"running": running, "pill": pill.text, "pill_colour": pill.value_of_css_property("background-color"),
            "cells": cells, "tree": tree}


def test_q1_the_worst_episode_of_the_step(browser, looked) -> None:
    """The step table, worst first: what it said, the tool that failed and what it said, the
    reward and its parts, why it was kept."""
    table = _tables(browser, looked["base"], looked["tmp"], "rollouts/table")[run.STEP]
    scored = [r for r in table if r["reward"] not in ("", "\u2014")]
    worst = scored[0]
    assert float(worst["reward"]) == 0.0 and worst["status"] == "ok", worst
    assert worst["failed tools"] == f"search: ConnectionError: {run.TOOL_ERROR}", worst
    assert worst["reward parts"] == "correct 0 \u00b7 format 0", worst
    assert worst["question"] == run.QUESTIONS[run.WORST[1]] and worst["answer"], worst
    assert worst["kept because"] not in ("", "\u2014")
    assert [float(r["reward"]) for r in scored] == sorted(float(r["reward"]) for r in scored)
    scroll_to_table(browser, "rollouts/table", _index(looked, "rollouts/table", run.STEP))
    save_screenshot(browser, looked["tmp"] / "q1-step-table.png")


def test_q2_why_the_step_was_slow(browser, looked) -> None:
    """The slowest table: the tool straggler on top with the span it waited in; the engine
    straggler next with the engine's queue time and time to first token."""
    rows = _tables(browser, looked["base"], looked["tmp"], "rollouts/slowest")[run.STEP]
    top, second = rows[0], rows[1]
    assert float(top["seconds"]) >= run.SLOW_TOOL_S, top
    assert top["most time in"].startswith("tool ") and top["most time in"].endswith(
        f": execute_tool fetch_page {float(top['tool s']):g} s"), top
    assert second["most time in"].startswith("generation ") and ": chat policy " in second["most time in"], second
    assert (float(second["engine queue s"]), float(second["ttft s"])) == (run.ENGINE_QUEUE_S, run.ENGINE_TTFT_S)
    assert all(r["engine queue s"] == "\u2014" for r in rows if r is not second)
    scroll_to_table(browser, "rollouts/slowest", _index(looked, "rollouts/slowest", run.STEP))
    save_screenshot(browser, looked["tmp"] / "q2-slowest.png")


def test_q3_which_groups_were_degenerate(browser, looked) -> None:
    """The groups table: every group the step saw, degenerate first, all-equal and lost apart,
    truncation its own count; the one both all-equal and lost says both."""
    rows = _tables(browser, looked["base"], looked["tmp"], "rollouts/groups")[run.STEP]
    by_group = {r["group"]: r for r in rows}
    assert len(rows) == run.PROMPTS, rows  # every group seen, kept or not
    easy, short, cut = (by_group[f"s{run.STEP}-p{p}"] for p in (0, 4, run.TRUNCATED[1]))
    assert (easy["all equal"], easy["lost"], easy["health"]) == ("yes", "0", f"all equal \u00d7{run.SAMPLES}"), easy
    assert (short["all equal"], short["lost"], short["members"]) == ("yes", "1", f"{run.SAMPLES - 1}/{run.SAMPLES}")
    assert short["health"] == f"all equal \u00d7{run.SAMPLES - 1}, lost 1/{run.SAMPLES}", short
    assert (cut["all equal"], cut["lost"], cut["truncated"]) == ("no", "0", "1"), cut
    assert cut["health"] == f"ok {run.SAMPLES}, truncated 1/{run.SAMPLES}", cut
    crashed = by_group[f"s{run.STEP}-p{run.CRASHED[1]}"]
    assert (crashed["lost"], crashed["all equal"]) == ("1", "no"), crashed
    degenerate = [r["all equal"] == "yes" or r["lost"] != "0" for r in rows]
    assert degenerate == sorted(degenerate, reverse=True)  # degenerate groups first
    assert all(int(r["kept"]) >= 0 for r in rows)
    scroll_to_table(browser, "rollouts/groups", _index(looked, "rollouts/groups", run.STEP))
    save_screenshot(browser, looked["tmp"] / "q3-groups.png")


def test_q4_the_step_and_the_token_that_drift(browser, looked) -> None:
    """The mismatch table of the drifting step: the token on top, with its question and group."""
    rows = _tables(browser, looked["base"], looked["tmp"], "rollouts/mismatch")[run.DRIFT_STEP]
    top = rows[0]
    assert float(top["\u03b4 (trainer\u2212rollout)"]) == run.DRIFT_DELTA, top
    assert (top["token"], top["position"]) == ("\u2423is", str(run.DRIFT_POSITION)), top
    assert top["question"] == run.QUESTIONS[run.DRIFT[1]] and top["group"] == f"s{run.DRIFT_STEP}-p{run.DRIFT[1]}"
    assert all(abs(float(r["\u03b4 (trainer\u2212rollout)"])) < 0.01 for r in rows[1:])
    scroll_to_table(browser, "rollouts/mismatch", _index(looked, "rollouts/mismatch", run.DRIFT_STEP))
    save_screenshot(browser, looked["tmp"] / "q4-mismatch.png")


def test_q5_a_watched_prompts_answers_across_the_run(browser, looked) -> None:
    tables = _tables(browser, looked["base"], looked["tmp"], f"rollouts/watch/{run.WATCHED}")
    history = tables[max(tables)]
    firsts = [r for r in history if r["answer"] == run.answer_of(int(r["step"]), run.WATCHED, 0)
              and r["question"] == run.QUESTIONS[run.WATCHED]]
    assert [int(r["step"]) for r in firsts] == list(range(run.STEPS)), history
    assert [float(r["reward"]) for r in firsts] == [run.reward_of(s, run.WATCHED, 0) for s in range(run.STEPS)]
    scroll_to_table(browser, f"rollouts/watch/{run.WATCHED}")
    save_screenshot(browser, looked["tmp"] / "q5-watch.png")


def test_q6_a_hung_rollout_while_it_hangs(looked) -> None:
    """Seen while it hung: ``running_now`` on the metrics page, the running table naming the span,
    the trace list's red pill, the stuck span's ``hung`` in the tree; one running table at the
    step however often it was refreshed."""
    seen = looked["hung"]
    ((step, rows),) = seen["running"]
    assert step == run.HANG[0] and len(rows) == 1 and rows[0]["stuck in"].startswith("execute_tool fetch_page ")
    assert seen["pill_colour"] == RED_PILL and seen["pill"].lower() == "error", seen
    assert str(run.HANG[0]) in seen["cells"]
    assert any("execute_tool fetch_page" in name for name in seen["tree"]), seen["tree"]


def test_q7_why_kept_and_what_was_dropped(browser, looked) -> None:
    """The summary table: seen, kept and dropped, by status, why kept, one table a step."""
    rows = _tables(browser, looked["base"], looked["tmp"], "rollouts/summary")[run.STEP]
    by_what = {r["episodes"]: r for r in rows}
    seen = run.PROMPTS * run.SAMPLES - 1
    total = by_what["all"]
    assert int(total["seen"]) == seen and int(total["kept"]) + int(total["dropped"]) == seen, rows
    assert int(by_what["status error"]["seen"]) == 1 and int(by_what["status truncated"]["seen"]) == 1
    assert sum(int(r["kept"]) for w, r in by_what.items() if w.startswith("kept because ")) == int(total["kept"])
    assert {"kept because error", "kept because slowest", "kept because watch"} <= set(by_what)
    scroll_to_table(browser, "rollouts/summary", _index(looked, "rollouts/summary", run.STEP))
    save_screenshot(browser, looked["tmp"] / "q7-summary.png")


def _index(looked: dict, key: str, step: int) -> int:
    """The position of ``key``'s table of ``step`` among its tables on the page (newest first)."""
    return sorted(_logged_steps(looked["db"], key), reverse=True).index(step)


def _logged_steps(db: Path, key: str) -> list[int]:
    with sqlite3.connect(db, timeout=5) as conn:
        rows = conn.execute("SELECT step, metrics FROM metrics").fetchall()
    return [step for step, metrics in rows if key in json.loads(metrics)]
